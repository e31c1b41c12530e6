//! The reference Python layout (`gradwire::reference`) for `gradwire.reference`: compress with
//! or without error feedback, decode a payload against the receiver's shapes, pack arrays into
//! the safetensors bytes the reference sends.

use gradwire::TensorSpec;
use gradwire::reference::{self, Entry, Mode, ReferenceError};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use safetensors::tensor::{Dtype, TensorView};

use crate::errors::{PayloadError, Side, reference_error};

/// One compressed tensor as `gradwire.reference` returns it: name, indices (int64), values
/// (float32, or int8 codes) and the int8 scale.
type EntryArrays<'py> = (
    String,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyAny>,
    Option<f32>,
);

/// What [`reference_compress`] returns: the entries, and the new residuals (with error
/// feedback).
type Compressed<'py> = (
    Vec<EntryArrays<'py>>,
    Option<Vec<Bound<'py, PyArray1<f32>>>>,
);

fn parse_mode(mode: &str) -> PyResult<Mode> {
    mode.parse::<Mode>()
        .map_err(|e| reference_error(e, Side::Input))
}

/// `k = max(1, min(n, floor(n * ratio)))` (`n` for `ratio >= 1`, `0` for `n = 0`): the
/// entries top-k keeps of a tensor of `numel` elements.
///
/// # Errors
/// `ValueError` for a NaN, infinite or negative ratio.
#[pyfunction]
pub(crate) fn topk_count(numel: u64, ratio: f64) -> PyResult<u64> {
    if !(ratio.is_finite() && ratio >= 0.0) {
        return Err(reference_error(
            ReferenceError::InvalidRatio(ratio),
            Side::Input,
        ));
    }
    Ok(gradwire::core::k_from_ratio(numel, ratio))
}

/// Compresses `tensors` (`(name, shape, flat float32 array)`, each array C-contiguous) in
/// `mode` (`topk` or `topk-int8`) at `ratio`. With `residuals` (one flat float32 array or
/// `None` per tensor, `None` meaning zeros), error feedback: the input of each tensor is
/// `gradient + residual`, and the new residuals are returned (the arrays given are not
/// written). All or nothing: every tensor is checked before anything is computed.
///
/// Returns the entries (in the order of `tensors`, indices ascending) and the new residuals.
///
/// # Errors
/// `ValueError` for an unknown mode, a bad ratio or name, an element count that differs from
/// the shape or from the residual's, NaN or Inf in a gradient (or in gradient + residual).
#[pyfunction]
#[pyo3(signature = (tensors, mode, ratio, residuals=None))]
pub(crate) fn reference_compress<'py>(
    py: Python<'py>,
    tensors: Vec<(String, Vec<usize>, PyReadonlyArray1<'py, f32>)>,
    mode: &str,
    ratio: f64,
    residuals: Option<Vec<Option<PyReadonlyArray1<'py, f32>>>>,
) -> PyResult<Compressed<'py>> {
    let mode = parse_mode(mode)?;
    if mode == Mode::None {
        return Err(PyValueError::new_err(
            "mode none sends the tensors as they are: nothing to compress",
        ));
    }
    let mut slices = Vec::with_capacity(tensors.len());
    for (_, _, array) in &tensors {
        slices.push(array.as_slice()?);
    }
    let inputs: Vec<reference::Input<'_>> = tensors
        .iter()
        .zip(&slices)
        .map(|((name, shape, _), data)| (name.as_str(), shape.as_slice(), *data))
        .collect();
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, shape, _)| TensorSpec::new(name.clone(), shape.clone()))
        .collect();
    let mut state: Option<Vec<Vec<f32>>> = match &residuals {
        None => None,
        Some(list) => {
            if list.len() != tensors.len() {
                return Err(PyValueError::new_err(format!(
                    "{} residuals for {} tensors",
                    list.len(),
                    tensors.len()
                )));
            }
            let mut out = Vec::with_capacity(list.len());
            for (r, data) in list.iter().zip(&slices) {
                out.push(match r {
                    Some(r) => crate::errors::copied(r.as_slice()?, "a residual")?,
                    None => {
                        let mut zeros = crate::errors::zeros_then(data.len(), "a residual")?;
                        zeros.resize(data.len(), 0.0);
                        zeros
                    }
                });
            }
            Some(out)
        }
    };
    let entries = py
        .detach(|| {
            let payload = match state.as_mut() {
                None => reference::compress(&inputs, mode, ratio)?,
                Some(r) => reference::compress_with_residuals(&inputs, r, mode, ratio)?,
            };
            reference::parse(&payload, mode, &specs)
        })
        .map_err(|e| reference_error(e, Side::Input))?;
    let mut out = Vec::with_capacity(entries.len());
    for ((name, _, _), entry) in tensors.iter().zip(entries) {
        out.push(entry_arrays(py, name.clone(), entry)?);
    }
    let residuals = state.map(|list| list.into_iter().map(|r| r.into_pyarray(py)).collect());
    Ok((out, residuals))
}

fn indices_array(py: Python<'_>, indices: Vec<u64>) -> PyResult<Bound<'_, PyArray1<i64>>> {
    let signed: Vec<i64> = indices
        .into_iter()
        .map(i64::try_from)
        .collect::<Result<_, _>>()
        .map_err(|_| PyValueError::new_err("an index does not fit an int64"))?;
    Ok(signed.into_pyarray(py))
}

fn entry_arrays(py: Python<'_>, name: String, entry: Entry) -> PyResult<EntryArrays<'_>> {
    match entry {
        Entry::TopK { indices, values } => Ok((
            name,
            indices_array(py, indices)?,
            values.into_pyarray(py).into_any(),
            None,
        )),
        Entry::TopKInt8 {
            indices,
            codes,
            scale,
        } => Ok((
            name,
            indices_array(py, indices)?,
            codes.into_pyarray(py).into_any(),
            Some(scale),
        )),
        Entry::Dense(_) => Err(PyValueError::new_err("mode none has no sparse entries")),
    }
}

/// Decodes a reference payload (safetensors bytes) in `mode` against the receiver's model
/// (`specs`: `(name, shape)` per tensor, in the order wanted). Returns one flat float32 array
/// per spec. Every key, dtype, shape, index (in range, once), value (finite), code and scale is
/// checked first; memory is bounded by `specs`, never by the payload's header.
///
/// # Errors
/// `gradwire.PayloadError` for a payload that fails a check; `ValueError` for an unknown mode
/// or a bad spec.
#[pyfunction]
pub(crate) fn reference_decode<'py>(
    py: Python<'py>,
    payload: &[u8],
    mode: &str,
    specs: Vec<(String, Vec<usize>)>,
) -> PyResult<Vec<Bound<'py, PyArray1<f32>>>> {
    let mode = parse_mode(mode)?;
    let specs: Vec<TensorSpec> = specs
        .into_iter()
        .map(|(name, shape)| TensorSpec::new(name, shape))
        .collect();
    let dense = py
        .detach(|| reference::decode(payload, mode, &specs))
        .map_err(|e| reference_error(e, Side::Payload))?;
    Ok(dense.into_iter().map(|d| d.into_pyarray(py)).collect())
}

/// Packs `(key, dtype, shape, raw little-endian bytes)` tensors into one safetensors file, the
/// bytes a reference payload travels as. `dtype` is `int64`, `float32` or `int8` (the only
/// dtypes of the layout).
///
/// # Errors
/// `gradwire.PayloadError` for another dtype, a byte length that does not match the shape, or a
/// key given twice.
#[pyfunction]
pub(crate) fn reference_pack<'py>(
    py: Python<'py>,
    tensors: Vec<(String, String, Vec<usize>, Bound<'py, PyBytes>)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut views = Vec::with_capacity(tensors.len());
    let mut seen = std::collections::BTreeSet::new();
    for (key, dtype, shape, data) in &tensors {
        if !seen.insert(key.as_str()) {
            return Err(PayloadError::new_err(format!("key {key:?} given twice")));
        }
        let dtype = match dtype.as_str() {
            "int64" => Dtype::I64,
            "float32" => Dtype::F32,
            "int8" => Dtype::I8,
            other => {
                return Err(PayloadError::new_err(format!(
                    "key {key:?} has dtype {other}: the reference layout has int64 indices, \
                     float32 or int8 values and float32 scales"
                )));
            }
        };
        let view = TensorView::new(dtype, shape.clone(), data.as_bytes())
            .map_err(|e| PayloadError::new_err(format!("key {key:?}: {e}")))?;
        views.push((key.as_str(), view));
    }
    let bytes = safetensors::tensor::serialize(views, None)
        .map_err(|e| PayloadError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &bytes))
}

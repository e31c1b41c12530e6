//! `gradwire.Compressor`: one rank's [`GradientCompressor`] with its manifest (the model's names
//! and shapes, fixed by the first call) and a rank-order aggregator.

use std::collections::HashMap;
use std::path::PathBuf;

use gradwire::feedback::ErrorFeedback;
use gradwire::{
    Aggregator, BucketConfig, CompressionMethod, GradientCompressor, Manifest, Tensor, TensorSpec,
    method,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{PayloadError, Side, library_error};

/// A tensor as the Python half passes it: name, shape, flat C-contiguous float32 data.
type NamedArray<'py> = (String, Vec<usize>, PyReadonlyArray1<'py, f32>);

/// A decoded tensor: name, shape, flat float32 data.
type DecodedArray<'py> = (String, Vec<usize>, Bound<'py, PyArray1<f32>>);

/// One rank's compressor (see `gradwire/__init__.py` for the Python-facing documentation).
#[pyclass(module = "gradwire._native", name = "Compressor")]
pub(crate) struct Compressor {
    method: CompressionMethod,
    seed: u64,
    inner: GradientCompressor,
    manifest: Option<Manifest>,
    aggregator: Aggregator,
    last_bundle_len: usize,
}

pub(crate) fn method_from_text(text: &str, error_feedback: bool) -> PyResult<CompressionMethod> {
    let core = method::parse(text).map_err(|e| library_error(e, Side::Input))?;
    let m = CompressionMethod::Core(core);
    let m = if error_feedback {
        m.with_error_feedback()
    } else {
        m
    };
    // Refuses error feedback around a method whose residual would grow without bound.
    m.core_method().map_err(|e| library_error(e, Side::Input))?;
    Ok(m)
}

impl Compressor {
    fn manifest_for(&mut self, specs: Vec<TensorSpec>) -> PyResult<&Manifest> {
        if self.manifest.is_none() {
            let mut specs = specs;
            specs.sort_by(|a, b| a.name.cmp(&b.name));
            let manifest = Manifest::new(specs, &self.method, self.seed, BucketConfig::none())
                .map_err(|e| library_error(e, Side::Input))?;
            self.manifest = Some(manifest);
        }
        Ok(self.manifest.as_ref().expect("set above"))
    }

    fn manifest(&self) -> PyResult<&Manifest> {
        self.manifest.as_ref().ok_or_else(|| {
            PyValueError::new_err(
                "no model yet: compress once, or give the model's shapes to Compressor(shapes=...)",
            )
        })
    }

    fn split<'py>(
        py: Python<'py>,
        manifest: &Manifest,
        flat: Vec<f32>,
    ) -> PyResult<Vec<DecodedArray<'py>>> {
        let mut out = Vec::with_capacity(manifest.tensors().len());
        for t in manifest.tensors() {
            let part = flat
                .get(t.offset..t.offset + t.numel)
                .ok_or_else(|| PyValueError::new_err("decoded length differs from the model"))?;
            let copy = crate::errors::copied(part, &format!("tensor {:?}", t.name))?;
            out.push((t.name.clone(), t.shape.clone(), copy.into_pyarray(py)));
        }
        Ok(out)
    }
}

#[pymethods]
impl Compressor {
    /// `method`: the canonical method text (`topk k=ratio:0.01 values=int8:256`, `sign
    /// scale=mean-abs:1024`, `quant bits=4 block=512 rounding=nearest-even`, ...);
    /// `shapes`: the model's `(name, shape)` list, else the first `compress` fixes it.
    #[new]
    #[pyo3(signature = (method, error_feedback = true, seed = 0, shapes = None))]
    fn new(
        method: &str,
        error_feedback: bool,
        seed: u64,
        shapes: Option<Vec<(String, Vec<usize>)>>,
    ) -> PyResult<Self> {
        let method = method_from_text(method, error_feedback)?;
        let inner = GradientCompressor::new(method.clone()).with_seed(seed);
        let mut c = Compressor {
            method,
            seed,
            inner,
            manifest: None,
            aggregator: Aggregator::serial(),
            last_bundle_len: 0,
        };
        if let Some(shapes) = shapes {
            c.manifest_for(
                shapes
                    .into_iter()
                    .map(|(n, s)| TensorSpec::new(n, s))
                    .collect(),
            )?;
        }
        Ok(c)
    }

    /// The method's canonical text (without the error-feedback flag).
    #[getter]
    fn method(&self) -> PyResult<String> {
        let core = self
            .method
            .core_method()
            .map_err(|e| library_error(e, Side::Input))?;
        Ok(method::format(&core))
    }

    /// Whether residuals are kept.
    #[getter]
    fn error_feedback(&self) -> bool {
        matches!(self.method, CompressionMethod::ErrorFeedback { .. })
    }

    /// Seed of random-k draws and stochastic rounding.
    #[getter]
    fn seed(&self) -> u64 {
        self.seed
    }

    /// The step the next bundle is made at.
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// The model's `(name, shape)` list in bundle order (sorted by name), or `None` before the
    /// first call that fixes it.
    #[getter]
    fn shapes(&self) -> Option<Vec<(String, Vec<usize>)>> {
        self.manifest.as_ref().map(|m| {
            m.tensors()
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect()
        })
    }

    /// Bytes of the model's gradient as float32 (4 per element); `OverflowError` for a model
    /// whose byte count does not fit a `usize` (a shape of `2**62` elements wrapped to 0).
    #[getter]
    fn dense_bytes(&self) -> PyResult<usize> {
        let elements = self.manifest()?.flat_len();
        elements.checked_mul(4).ok_or_else(|| {
            pyo3::exceptions::PyOverflowError::new_err(format!(
                "a model of {elements} float32 values is more bytes than a usize holds"
            ))
        })
    }

    /// Bytes of the last bundle this compressor made (0 before the first).
    #[getter]
    fn last_bundle_bytes(&self) -> usize {
        self.last_bundle_len
    }

    /// Every residual (name, shape, flat float32 copy), in name order; empty without error
    /// feedback or before the first step.
    fn residuals<'py>(&self, py: Python<'py>) -> PyResult<Vec<DecodedArray<'py>>> {
        let Some(fb) = self.inner.feedback() else {
            return Ok(Vec::new());
        };
        fb.residuals()
            .map(|(name, r)| {
                let shape = fb
                    .residual_shape(name)
                    .map_or_else(|| vec![r.len()], <[usize]>::to_vec);
                let copy = crate::errors::copied(r, &format!("residual {name:?}"))?;
                Ok((name.to_owned(), shape, copy.into_pyarray(py)))
            })
            .collect()
    }

    /// Compresses `tensors` into one bundle for `rank`.
    fn compress<'py>(
        &mut self,
        py: Python<'py>,
        tensors: Vec<NamedArray<'py>>,
        rank: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut grads = HashMap::with_capacity(tensors.len());
        let mut specs = Vec::with_capacity(tensors.len());
        for (name, shape, array) in &tensors {
            let data = crate::errors::copied(array.as_slice()?, &format!("tensor {name:?}"))?;
            let t = Tensor::new(shape.clone(), data).map_err(|e| library_error(e, Side::Input))?;
            if grads.insert(name.clone(), t).is_some() {
                return Err(PyValueError::new_err(format!(
                    "tensor {name:?} given twice"
                )));
            }
            specs.push(TensorSpec::new(name.clone(), shape.clone()));
        }
        self.manifest_for(specs)?;
        let manifest = self.manifest.as_ref().expect("set above");
        let inner = &mut self.inner;
        let mut out = Vec::new();
        py.detach(|| inner.compress_bundle(manifest, &grads, rank, &mut out))
            .map_err(|e| library_error(e, Side::Input))?;
        self.last_bundle_len = out.len();
        Ok(PyBytes::new(py, &out))
    }

    /// Decodes one bundle (this compressor's or a peer's with the same method, seed and model).
    #[pyo3(signature = (bundle, rank = None))]
    fn decompress<'py>(
        &self,
        py: Python<'py>,
        bundle: &[u8],
        rank: Option<usize>,
    ) -> PyResult<Vec<DecodedArray<'py>>> {
        let manifest = self.manifest()?;
        let mut flat = Vec::new();
        py.detach(|| manifest.decode_bundle(bundle, rank, None, &mut flat))
            .map_err(|e| library_error(e, Side::Payload))?;
        Self::split(py, manifest, flat)
    }

    /// The rank-order mean (or sum, or majority vote) of every rank's bundle of one step
    /// (`bundles[r]` is rank `r`'s), bit-identical on every rank that holds the same bundles.
    #[pyo3(signature = (bundles, reduction = "mean"))]
    fn aggregate<'py>(
        &mut self,
        py: Python<'py>,
        bundles: Vec<Vec<u8>>,
        reduction: &str,
    ) -> PyResult<Vec<DecodedArray<'py>>> {
        let reduction = crate::allreduce::parse_reduction(reduction)?;
        let manifest = self
            .manifest
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("no model yet: compress once, or give shapes="))?;
        let first = bundles
            .first()
            .ok_or_else(|| PyValueError::new_err("no bundles to aggregate"))?;
        let step = manifest
            .check_bundle(first, Some(0), None)
            .map_err(|e| library_error(e, Side::Payload))?
            .step;
        let aggregator = &mut self.aggregator;
        let mut flat = Vec::new();
        py.detach(|| aggregator.aggregate_into(manifest, &bundles, step, reduction, &mut flat))
            .map_err(|e| library_error(e, Side::Payload))?;
        Self::split(py, manifest, flat)
    }

    /// Writes the residual checkpoint (residuals, step, seed, method) to `path`.
    fn save(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let inner = &mut self.inner;
        py.detach(|| inner.save_feedback(&path))
            .map_err(|e| library_error(e, Side::Input))
    }

    /// Restores the residual checkpoint at `path`: it must be for this method and seed (a
    /// checkpoint of another seed is refused rather than adopted, since every rank of a job
    /// draws from the same seed).
    fn load(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        load_checked(py, &mut self.inner, self.seed, &path)
    }
}

/// Restores the residual checkpoint at `path` into `compressor`, refusing one made with
/// another seed than `seed` (`GradientCompressor::load_feedback` would adopt it, and the
/// manifest, made for `seed`, would then refuse every step).
pub(crate) fn load_checked(
    py: Python<'_>,
    compressor: &mut GradientCompressor,
    seed: u64,
    path: &std::path::Path,
) -> PyResult<()> {
    let feedback = py
        .detach(|| ErrorFeedback::load(path))
        .map_err(|e| library_error(e, Side::Payload))?;
    if feedback.seed() != seed {
        return Err(PayloadError::new_err(format!(
            "{}: the checkpoint was made with seed {}, this compressor uses seed {seed}",
            path.display(),
            feedback.seed(),
        )));
    }
    compressor
        .restore_feedback(feedback)
        .map_err(|e| library_error(e, Side::Payload))
}

//! [`Tensor`]: a dense row-major f32 tensor with a shape.
//!
//! A 0-d tensor (shape `[]`) holds one element; a shape with a zero dimension holds none.
//!
//! ```
//! use gradwire::tensor::Tensor;
//!
//! let t = Tensor::new(vec![2, 3], vec![0.0; 6])?;
//! assert_eq!(t.data().len(), 6);
//! assert!(Tensor::new(vec![2, 3], vec![0.0; 5]).is_err());
//! let s = Tensor::new(vec![], vec![1.5])?;
//! assert_eq!(s.shape(), &[] as &[usize]);
//! assert_eq!(s.data(), &[1.5]);
//! # Ok::<(), gradwire::Error>(())
//! ```

use safetensors::tensor::Dtype;

use crate::error::{Error, Result};

/// `n` zeros, written: the pages are the process's own from the start. A `vec![0.0; n]` of a
/// large `n` maps the shared zero page, so a buffer that is read before it is written (a
/// residual) faults twice per page, and the second fault flushes that page from the TLB of
/// every thread of the process: a first step of W ranks as threads spent most of its time in
/// those flushes.
///
/// # Errors
/// [`Error::OutOfMemory`] naming `what` when the memory cannot be had (state the size of a
/// model: a failed allocation would abort the process, a Python interpreter with it).
pub(crate) fn written_zeros(n: usize, what: &str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        tensor: what.to_owned(),
        elements: n,
    })?;
    // An opaque zero, so that the fill is not turned back into a zeroed allocation.
    v.resize(n, std::hint::black_box(0.0f32));
    Ok(v)
}

/// Resizes `out` to `n` elements (new ones zero), reserving first, so that a model larger than
/// memory is [`Error::OutOfMemory`] naming `what` instead of an abort (a bundle or a manifest
/// from elsewhere may declare any size its format allows).
///
/// # Errors
/// [`Error::OutOfMemory`] when the memory cannot be had; `out` is unchanged then.
pub(crate) fn resize_or_refuse(out: &mut Vec<f32>, n: usize, what: &str) -> Result<()> {
    out.try_reserve_exact(n.saturating_sub(out.len()))
        .map_err(|_| Error::OutOfMemory {
            tensor: what.to_owned(),
            elements: n,
        })?;
    out.resize(n, 0.0);
    Ok(())
}

/// A dense row-major f32 tensor: a shape and `product(shape)` elements.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// One tensor of a step held in the caller's memory, for
/// [`crate::CompressedAllReduce::all_reduce_in_place`]: `data` (row-major, the product of
/// `shape` f32 elements) holds the gradient before the step and the result after it.
#[derive(Debug)]
pub struct TensorMut<'a> {
    /// Parameter name: the key of its residual and of its entry in the messages.
    pub name: &'a str,
    /// Shape (`[]` for a 0-d tensor).
    pub shape: &'a [usize],
    /// The elements: read as the gradient, then overwritten with the reduced result.
    pub data: &'a mut [f32],
}

/// The number of elements of `shape` (1 for `[]`), or `None` on overflow.
pub(crate) fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The number of elements of `shape`, or an error naming `tensor` on overflow.
///
/// # Errors
/// [`Error::ShapeOverflow`] when the product overflows `usize`.
pub(crate) fn checked_numel(tensor: &str, shape: &[usize]) -> Result<usize> {
    numel(shape).ok_or_else(|| Error::ShapeOverflow {
        tensor: tensor.to_owned(),
        shape: shape.to_vec(),
    })
}

impl Tensor {
    /// A tensor of `shape` holding `data` (row-major).
    ///
    /// # Errors
    /// [`Error::Shape`] when `data.len()` differs from the product of `shape`;
    /// [`Error::ShapeOverflow`] when that product overflows.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let n = checked_numel("", &shape)?;
        if n != data.len() {
            return Err(Error::Shape {
                tensor: String::new(),
                shape,
                expected: n,
                got: data.len(),
            });
        }
        Ok(Tensor { shape, data })
    }

    /// A tensor of `shape` holding `data`, arguments in the order of the original module's
    /// `Tensor::from_vec`.
    ///
    /// # Errors
    /// As [`Tensor::new`].
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        Tensor::new(shape.to_vec(), data)
    }

    /// A 1-d tensor holding `data`.
    pub fn vector(data: Vec<f32>) -> Self {
        Tensor {
            shape: vec![data.len()],
            data,
        }
    }

    /// A tensor of `shape` filled with zeros.
    ///
    /// # Errors
    /// [`Error::ShapeOverflow`] when the product of `shape` overflows.
    pub fn zeros(shape: &[usize]) -> Result<Self> {
        let n = checked_numel("", shape)?;
        Ok(Tensor {
            shape: shape.to_vec(),
            data: vec![0.0; n],
        })
    }

    /// The shape (empty for a 0-d tensor).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The elements, row-major, to write in place (the engine's outputs).
    pub(crate) fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// The shape and the elements, the elements to write in place (a step's tensors moved
    /// into a non-blocking all-reduce).
    pub(crate) fn parts_mut(&mut self) -> (&[usize], &mut [f32]) {
        (&self.shape, &mut self.data)
    }

    /// Sets the shape to `shape` of `n` elements (`n` checked by the caller), reusing this
    /// tensor's buffers: the elements are unspecified afterwards (kept where the length did not
    /// change, zeros where it grew), for a caller that writes every one of them.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] naming `what` when the memory cannot be had; the tensor is
    /// unchanged then.
    pub(crate) fn reshape_for_overwrite(
        &mut self,
        shape: &[usize],
        n: usize,
        what: &str,
    ) -> Result<()> {
        resize_or_refuse(&mut self.data, n, what)?;
        if self.shape != shape {
            self.shape.clear();
            self.shape.extend_from_slice(shape);
        }
        Ok(())
    }

    /// Sets the shape and copies `data` in, reusing this tensor's buffers (no allocation when
    /// the capacities suffice).
    ///
    /// # Errors
    /// As [`Tensor::new`]; on error the tensor is unchanged.
    pub fn assign(&mut self, shape: &[usize], data: &[f32]) -> Result<()> {
        let n = checked_numel("", shape)?;
        if n != data.len() {
            return Err(Error::Shape {
                tensor: String::new(),
                shape: shape.to_vec(),
                expected: n,
                got: data.len(),
            });
        }
        self.shape.clear();
        self.shape.extend_from_slice(shape);
        self.data.clear();
        self.data.extend_from_slice(data);
        Ok(())
    }
}

/// The tensors of a safetensors file of float32 tensors (a model's gradients, as
/// `safetensors.torch.save_file` writes them), sorted by name. The bytes are treated as
/// untrusted: the header is parsed with every length and offset checked before the
/// `safetensors` crate reads it.
///
/// ```
/// use std::collections::HashMap;
/// use gradwire::tensor::{Tensor, read_safetensors, write_safetensors};
///
/// let grads = vec![("w".to_string(), Tensor::new(vec![2, 2], vec![1.0, -2.0, 0.5, 4.0])?)];
/// let bytes = write_safetensors(&grads)?;
/// // What `GradientCompressor::compress` takes:
/// let by_name: HashMap<String, Tensor> = read_safetensors(&bytes)?.into_iter().collect();
/// assert_eq!(by_name["w"].shape(), &[2, 2]);
/// # Ok::<(), gradwire::Error>(())
/// ```
///
/// # Errors
/// [`Error::Safetensors`] for bytes that are not a valid safetensors file;
/// [`Error::Dtype`] naming the first tensor (in file order) that is not float32.
pub fn read_safetensors(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let st = crate::safetensors_reader::deserialize(bytes)?;
    let mut tensors = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        if view.dtype() != Dtype::F32 {
            return Err(Error::Dtype {
                tensor: name.to_owned(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // Cannot fail: safetensors checked that the data holds the shape's elements.
        let tensor = Tensor::new(view.shape().to_vec(), data)?;
        tensors.push((name.to_owned(), tensor));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}

/// A safetensors file of `tensors` (float32, little-endian), which [`read_safetensors`] reads
/// back bit for bit.
///
/// # Errors
/// [`Error::DuplicateTensor`] for a name given twice; [`Error::Config`] for a tensor named
/// `__metadata__` (safetensors reserves it); [`Error::Safetensors`] when safetensors refuses
/// to serialize them.
pub fn write_safetensors(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::DuplicateTensor {
            tensor: w[0].to_owned(),
        });
    }
    if names.contains(&"__metadata__") {
        return Err(Error::config(
            "a tensor named `__metadata__` cannot be stored in safetensors",
        ));
    }
    serialize_f32(
        tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape().to_vec(), t.data())),
        None,
    )
}

/// The first bytes of a safetensors file of float32 tensors, up to its data: the 8-byte header
/// length and the header, for `tensors` (`(name, shape)`) whose data follow in this order,
/// without gaps, and `meta` (the `__metadata__` entries, written in key order so that the bytes
/// depend on the contents alone). Listed in increasing byte-wise order of names (as the container
/// lists them), the file is byte for byte what safetensors' own writer writes for the same
/// tensors, so that a writer can stream the values after it one tensor at a time.
///
/// # Errors
/// [`Error::DuplicateTensor`], [`Error::Config`] as [`write_safetensors`];
/// [`Error::ShapeOverflow`] for a model whose byte length overflows; [`Error::Safetensors`] for
/// a header longer than safetensors allows.
pub(crate) fn f32_safetensors_header<'a>(
    tensors: impl ExactSizeIterator<Item = (&'a str, &'a [usize])>,
    meta: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>> {
    use safetensors::tensor::{Metadata, TensorInfo};
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for (name, shape) in tensors {
        if name == "__metadata__" {
            return Err(Error::config(
                "a tensor named `__metadata__` cannot be stored in safetensors",
            ));
        }
        let bytes =
            checked_numel(name, shape)?
                .checked_mul(4)
                .ok_or_else(|| Error::ShapeOverflow {
                    tensor: name.to_owned(),
                    shape: shape.to_vec(),
                })?;
        let end = offset
            .checked_add(bytes)
            .ok_or_else(|| Error::ShapeOverflow {
                tensor: name.to_owned(),
                shape: shape.to_vec(),
            })?;
        infos.push((
            name.to_owned(),
            TensorInfo {
                dtype: Dtype::F32,
                shape: shape.to_vec(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let mut names: Vec<&str> = infos.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::DuplicateTensor {
            tensor: w[0].to_owned(),
        });
    }
    drop(names);
    // The metadata as safetensors writes it (a `HashMap`'s order) and sorted by key.
    let texts = meta.as_ref().and_then(|m| {
        let sorted: std::collections::BTreeMap<&String, &String> = m.iter().collect();
        Some((
            serde_json::to_string(m).ok()?,
            serde_json::to_string(&sorted).ok()?,
        ))
    });
    let meta = Metadata::new(meta, infos)?;
    let json = serde_json::to_string(&meta).map_err(|e| Error::Safetensors {
        source: safetensors::SafeTensorError::JsonError(e),
    })?;
    // As safetensors 0.8 writes it: padded with spaces to a multiple of 8 bytes.
    let n = json.len().next_multiple_of(8);
    if n > crate::safetensors_reader::MAX_HEADER_LEN {
        return Err(Error::Safetensors {
            source: safetensors::SafeTensorError::HeaderTooLarge,
        });
    }
    let mut out = Vec::with_capacity(8 + n);
    out.extend_from_slice(&(n as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(8 + n, b' ');
    Ok(match texts {
        Some((unsorted, sorted)) => with_sorted_metadata(out, &unsorted, &sorted),
        None => out,
    })
}

/// Elements converted at a time by [`write_f32_le`] (64 KiB of bytes).
const WRITE_BLOCK: usize = 16 * 1024;

/// Writes `values` to `out` as f32 little-endian bytes, through a 64 KiB buffer (no copy of
/// the values' size).
///
/// # Errors
/// The writer's.
pub(crate) fn write_f32_le(out: &mut impl std::io::Write, values: &[f32]) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4 * WRITE_BLOCK.min(values.len())];
    for run in values.chunks(WRITE_BLOCK) {
        let bytes = &mut buf[..4 * run.len()];
        for (b, x) in bytes.chunks_exact_mut(4).zip(run) {
            b.copy_from_slice(&x.to_le_bytes());
        }
        out.write_all(bytes)?;
    }
    Ok(())
}

/// Safetensors bytes of `(name, shape, values)` float32 tensors and `meta` (the checks of
/// names are the callers'): for [`write_safetensors`] and the state files. The same bytes as
/// [`f32_safetensors_header`] of the tensors in name order followed by their values.
///
/// # Errors
/// As [`f32_safetensors_header`]; [`Error::Safetensors`] for a shape that does not hold its
/// values.
pub(crate) fn serialize_f32<'a>(
    tensors: impl Iterator<Item = (&'a str, Vec<usize>, &'a [f32])>,
    meta: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut items: Vec<(&str, Vec<usize>, &[f32])> = tensors.collect();
    items.sort_by(|a, b| a.0.cmp(b.0));
    if let Some((_, shape, x)) = items.iter().find(|(_, s, x)| numel(s) != Some(x.len())) {
        return Err(Error::Safetensors {
            source: safetensors::SafeTensorError::InvalidTensorView(
                Dtype::F32,
                shape.clone(),
                4 * x.len(),
            ),
        });
    }
    let mut out = f32_safetensors_header(items.iter().map(|(n, s, _)| (*n, s.as_slice())), meta)?;
    out.reserve(items.iter().map(|(_, _, x)| 4 * x.len()).sum());
    for (_, _, x) in &items {
        write_f32_le(&mut out, x).expect("writing into a Vec cannot fail");
    }
    Ok(out)
}

/// `bytes` (a safetensors file whose header starts with the `__metadata__` object serialized
/// as `unsorted`) with that object written as `sorted`, its entries in key order. safetensors
/// writes them in the order of a `HashMap`, which changes from process to process; sorted, a
/// checkpoint's bytes depend on its contents alone. The object keeps its length, so nothing
/// else moves. Bytes of another layout are returned unchanged (the golden checkpoint test
/// catches such a change).
fn with_sorted_metadata(mut bytes: Vec<u8>, unsorted: &str, sorted: &str) -> Vec<u8> {
    let prefix = b"{\"__metadata__\":";
    let start = 8 + prefix.len();
    let end = start + unsorted.len();
    let in_place = sorted.len() == unsorted.len()
        && bytes.get(8..start) == Some(&prefix[..])
        && bytes.get(start..end) == Some(unsorted.as_bytes());
    if in_place {
        bytes[start..end].copy_from_slice(sorted.as_bytes());
    }
    bytes
}

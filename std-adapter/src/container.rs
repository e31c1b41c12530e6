//! The gradwire container: a bundle on disk, as `gradwire compress` writes it. `FORMAT.md` is
//! the normative specification.
//!
//! A bundle (`FORMAT.md` section 10) carries frames only: names, shapes and the method never
//! travel, the receiver's [`Manifest`] holds them. A file on disk has no receiver, so the
//! container puts a small manifest section in front of the bundle. The reader builds a
//! [`Manifest`] from that section (and, given the receiver's model, checks it against it) and
//! then decodes the bundle against it, with every check of [`Manifest::decode_bundle`].
//!
//! # Layout (version 1)
//! All integers little-endian.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `GWCT` (`47 57 43 54`) |
//! | 4 | 1 | container version, `1` |
//! | 5 | 3 | reserved, `0` |
//! | 8 | 4 | manifest section length `M` (u32) |
//! | 12 | `M` | manifest section (below) |
//! | 12 + `M` | 4 | CRC-32 (IEEE) of bytes `0 .. 12 + M` |
//! | 16 + `M` | rest | the bundle (its own header, entries and CRC-32) |
//!
//! Manifest section:
//!
//! | size | field |
//! |---|---|
//! | 2 | method text length `L` (u16) |
//! | `L` | method text, UTF-8 ([`crate::method::format`]) |
//! | 8 | seed (u64) |
//! | 4 | tensor count `T` (u32) |
//! | per tensor: 2 | name length (u16) |
//! | per tensor: ... | name, UTF-8 |
//! | per tensor: 1 | rank `R` (u8) |
//! | per tensor: `8 R` | dimensions (u64 each) |
//!
//! Tensors are listed in bundle order (sorted by name); each is its own bundle entry (no
//! buckets). The step is the bundle's. A reader refuses: another magic or version, non-zero
//! reserved bytes, a wrong CRC, a section that does not end exactly at `12 + M`, invalid UTF-8,
//! a method it cannot parse, duplicate names, and a model larger than the reader's element
//! bound (so that a small hostile file cannot make it allocate without bound).

use std::collections::HashMap;

use gradwire_core::Method;

use crate::compressor::GradientCompressor;
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::layout::bundle::BundleWriter;
use crate::layout::{BucketConfig, Manifest, ManifestTensor, TensorSpec};
use crate::method::{self, CompressionMethod};
use crate::tensor::Tensor;

/// The first four bytes of a container.
pub(crate) const CONTAINER_MAGIC: [u8; 4] = *b"GWCT";
/// The container version this crate writes and reads.
pub(crate) const CONTAINER_VERSION: u8 = 1;
const PREFIX_LEN: usize = 12;
const CRC_LEN: usize = 4;

/// True when `bytes` starts with the container magic.
pub(crate) fn is_container(bytes: &[u8]) -> bool {
    bytes.starts_with(&CONTAINER_MAGIC)
}

/// What a container's manifest section declares.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ContainerHeader {
    /// The method of every frame.
    pub method: Method,
    /// The run's seed.
    pub seed: u64,
    /// Tensors in bundle order.
    pub tensors: Vec<TensorSpec>,
    /// Byte offset of the bundle in the container.
    pub bundle_offset: usize,
}

/// [`Error::Container`] for an invalid container.
fn invalid(what: impl std::fmt::Display) -> Error {
    Error::Container {
        reason: format!("not a valid gradwire container: {what}"),
    }
}

/// The manifest of a container's tensors: one entry each, in the given order.
fn manifest_of(specs: Vec<TensorSpec>, method: Method, seed: u64) -> Result<Manifest> {
    Manifest::new(
        specs,
        &CompressionMethod::Core(method),
        seed,
        BucketConfig::none(),
    )
}

#[cfg(test)] // a whole-model helper of the unit tests; the tool streams (`compress_each`)
fn specs_of(model: &[(String, Tensor)]) -> Vec<TensorSpec> {
    model
        .iter()
        .map(|(n, t)| TensorSpec::new(n.clone(), t.shape()))
        .collect()
}

#[cfg(test)]
fn grads_of(model: &[(String, Tensor)]) -> HashMap<String, Tensor> {
    model.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
}

/// The container of `bundle`: the prefix and manifest section for `specs` (in bundle order),
/// `method` and `seed`, followed by the bundle.
///
/// # Errors
/// [`Error::Container`] when the method text, a name, a shape's rank or the tensor list is
/// too long for the layout's length fields.
#[cfg(test)] // a whole-model helper of the unit tests; the tool streams (`compress_each`)
pub(crate) fn write(
    specs: &[TensorSpec],
    method: &Method,
    seed: u64,
    bundle: &[u8],
) -> Result<Vec<u8>> {
    let mut out = head(specs, method, seed)?;
    out.reserve_exact(bundle.len());
    out.extend_from_slice(bundle);
    Ok(out)
}

/// The container bytes before the bundle (prefix, manifest section, CRC-32), as [`write`].
fn head(specs: &[TensorSpec], method: &Method, seed: u64) -> Result<Vec<u8>> {
    let too_long = |what: &str| Error::Container {
        reason: format!("{what} is too long for the container"),
    };
    let mut section = Vec::new();
    let text = method::format(method);
    let len = u16::try_from(text.len()).map_err(|_| too_long("the method text"))?;
    section.extend_from_slice(&len.to_le_bytes());
    section.extend_from_slice(text.as_bytes());
    section.extend_from_slice(&seed.to_le_bytes());
    let count = u32::try_from(specs.len()).map_err(|_| too_long("the tensor list"))?;
    section.extend_from_slice(&count.to_le_bytes());
    for s in specs {
        let len = u16::try_from(s.name.len())
            .map_err(|_| too_long(&format!("tensor name `{}`", s.name)))?;
        section.extend_from_slice(&len.to_le_bytes());
        section.extend_from_slice(s.name.as_bytes());
        let rank = u8::try_from(s.shape.len())
            .map_err(|_| too_long(&format!("the shape of tensor `{}`", s.name)))?;
        section.push(rank);
        for &d in &s.shape {
            section.extend_from_slice(&(d as u64).to_le_bytes());
        }
    }
    let m = u32::try_from(section.len()).map_err(|_| too_long("the manifest"))?;
    let mut out = Vec::with_capacity(PREFIX_LEN + section.len() + CRC_LEN);
    out.extend_from_slice(&CONTAINER_MAGIC);
    out.extend_from_slice(&[CONTAINER_VERSION, 0, 0, 0]);
    out.extend_from_slice(&m.to_le_bytes());
    out.extend_from_slice(&section);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Compresses `model` (tensors in bundle order) without error feedback at `step` into a
/// container (rank 0's bundle).
///
/// # Errors
/// As [`compress_each`].
#[cfg(test)] // a whole-model helper of the unit tests; the tool streams (`compress_each`)
pub(crate) fn compress(
    model: &[(String, Tensor)],
    method: Method,
    seed: u64,
    step: u64,
) -> Result<Vec<u8>> {
    let specs = specs_of(model);
    let (out, _) = compress_each(&specs, method, seed, step, None, |i, _| {
        Ok::<_, Error>(model[i].1.clone())
    })?;
    Ok(out)
}

/// Compresses a model one tensor at a time into a container (rank 0's bundle) at `step`:
/// `next(i, spec)` gives tensor `i` of `specs` (bundle order, increasing byte-wise order of
/// names), and is called once per tensor, in order, after the previous tensor's frame is made:
/// so the memory held is one tensor, its frame and the bundle so far, never the model. The
/// bytes are those of [`crate::GradientCompressor::compress_bundle`] over the whole model (a
/// frame depends only on its tensor, the method, the seed, the step and its label).
///
/// With `feedback` (made with `method`; its seed and step must be `seed` and `step`), each
/// tensor's step runs on its own residual, and the updated state is returned. On error the
/// state is dropped: the caller keeps the old one (so the step is all or nothing for it).
///
/// # Errors
/// [`Error::Config`] for a `feedback` of another method, seed or step; every error of
/// [`Manifest::new`] for `specs`; [`Error::ShapeMismatch`] when `next` gives a tensor of
/// another shape; as [`crate::GradientCompressor::compress_bundle`] for each tensor (a NaN,
/// a value beyond the method's range, a residual of another length or shape); any error of
/// `next`; as [`write()`].
pub(crate) fn compress_each<E: From<Error>>(
    specs: &[TensorSpec],
    method: Method,
    seed: u64,
    step: u64,
    mut feedback: Option<ErrorFeedback>,
    mut next: impl FnMut(usize, &TensorSpec) -> std::result::Result<Tensor, E>,
) -> std::result::Result<(Vec<u8>, Option<ErrorFeedback>), E> {
    if let Some(fb) = &feedback
        && (*fb.method() != method || fb.seed() != seed || fb.step() != step)
    {
        return Err(Error::config(format!(
            "the error-feedback state is for method `{}`, seed {}, step {}; the step uses \
             `{}`, seed {seed}, step {step}",
            method::format(fb.method()),
            fb.seed(),
            fb.step(),
            method::format(&method)
        ))
        .into());
    }
    let manifest = manifest_of(specs.to_vec(), method, seed)?;
    let entries = u32::try_from(manifest.entries().len())
        .map_err(|_| Error::config("the model is too large for one bundle"))?;
    let rank = 0;
    let mut bundle = Vec::new();
    let mut writer = BundleWriter::begin(&mut bundle, rank, entries, step);
    let mut one_bundle = Vec::new();
    let core = CompressionMethod::Core(method);
    for (i, spec) in specs.iter().enumerate() {
        let tensor = next(i, spec)?;
        if tensor.shape() != spec.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                tensor: spec.name.clone(),
                rank: None,
                expected: spec.shape.clone(),
                got: tensor.shape().to_vec(),
            }
            .into());
        }
        // The manifest of this tensor alone: its entry (id, label, parameters) is the same as
        // in the model's manifest.
        let one = manifest_of(vec![spec.clone()], method, seed)?;
        let mut c = match feedback.as_mut() {
            Some(fb) => {
                let mut c = GradientCompressor::new(core.clone().with_error_feedback());
                c.restore_feedback(fb.split_off(&spec.name))?;
                c
            }
            None => GradientCompressor::new(core.clone())
                .with_seed(seed)
                .with_step(step),
        };
        let mut grads = HashMap::with_capacity(1);
        grads.insert(spec.name.clone(), tensor);
        let done = c.compress_bundle(&one, &grads, 0, &mut one_bundle);
        // Whatever happened, the residual goes back (on error the whole state is dropped).
        if let (Some(fb), Some(part)) = (feedback.as_mut(), c.take_feedback()) {
            fb.absorb(part);
        }
        done?;
        drop(grads);
        let id = manifest.entries()[i].id;
        one.walk(&one_bundle, None, |_, frame| {
            writer.push(id, frame);
            Ok(())
        })?;
    }
    writer.finish();
    drop(one_bundle);
    if let Some(fb) = feedback.as_mut() {
        fb.advance();
    }
    // The head goes in front of the bundle in place (no second copy of the bundle unless its
    // buffer has no room left).
    let head = head(specs, &method, seed)?;
    bundle.reserve_exact(head.len());
    bundle.splice(0..0, head);
    Ok((bundle, feedback))
}

/// A little-endian reader over the manifest section.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                invalid(format!(
                    "manifest is truncated at byte {}",
                    PREFIX_LEN + self.pos
                ))
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn text(&mut self, n: usize, what: &str) -> Result<&'a str> {
        let at = PREFIX_LEN + self.pos;
        std::str::from_utf8(self.take(n)?)
            .map_err(|_| invalid(format!("manifest: {what} at byte {at} is not UTF-8")))
    }
}

/// Calls `f(name, dimensions)` for each of the `count` tensors of the manifest section at
/// `r`'s position, allocating nothing: the dimensions are an iterator over the section's bytes.
fn for_each_tensor<'a>(
    r: &mut Reader<'a>,
    count: usize,
    mut f: impl FnMut(&'a str, Dims<'a>) -> Result<()>,
) -> Result<()> {
    for _ in 0..count {
        let len = u16::from_le_bytes(r.array()?) as usize;
        let name = r.text(len, "tensor name")?;
        let rank = r.array::<1>()?[0] as usize;
        let dims = r.take(rank * 8)?;
        f(name, Dims(dims.chunks_exact(8)))?;
    }
    Ok(())
}

/// The dimensions of one tensor in the manifest section (`u64` little-endian each).
#[derive(Clone)]
struct Dims<'a>(std::slice::ChunksExact<'a, u8>);

impl Iterator for Dims<'_> {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        self.0.next().map(|c| u64::from_le_bytes(le8(c)))
    }
}

impl ExactSizeIterator for Dims<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
}

fn le8(c: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(c);
    a
}

/// Elements charged to a model's bound for each tensor, whatever its size: what its metadata
/// costs a reader (its entries in the manifest, the bundle's entry list and the output's
/// safetensors header, with the allocator's overhead): 256 elements, 1 KiB.
pub(crate) const TENSOR_CHARGE: u64 = 256;
/// Elements charged per byte of a tensor's name (held several times, and escaped up to six
/// bytes per byte in a JSON header).
pub(crate) const NAME_BYTE_CHARGE: u64 = 4;
/// Elements charged per dimension of a tensor's shape.
pub(crate) const DIMENSION_CHARGE: u64 = 16;

/// What a tensor of `numel` elements, a name of `name_len` bytes and `rank` dimensions counts
/// against a reader's element bound (`--max-elements`): its elements plus [`TENSOR_CHARGE`],
/// [`NAME_BYTE_CHARGE`] per name byte and [`DIMENSION_CHARGE`] per dimension, so that the bound
/// caps the memory of the metadata as well as the values (4 bytes an element): a container of
/// a million empty tensors is refused before its tensor list is allocated.
pub(crate) fn charged_elements(name_len: usize, rank: usize, numel: u64) -> u64 {
    numel
        .saturating_add(TENSOR_CHARGE)
        .saturating_add(NAME_BYTE_CHARGE.saturating_mul(name_len as u64))
        .saturating_add(DIMENSION_CHARGE.saturating_mul(rank as u64))
}

/// The sum over `specs` of each tensor's elements plus [`TENSOR_CHARGE`], [`NAME_BYTE_CHARGE`]
/// per name byte and [`DIMENSION_CHARGE`] per dimension: the smallest `max_elements` that admits a
/// container of exactly this model.
pub(crate) fn model_charge(specs: &[TensorSpec]) -> u64 {
    specs.iter().fold(0u64, |acc, s| {
        let numel = s
            .shape
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d as u64));
        acc.saturating_add(charged_elements(s.name.len(), s.shape.len(), numel))
    })
}

impl ContainerHeader {
    /// Reads and checks the container prefix and manifest section. `max_elements` bounds the
    /// model: its elements plus its metadata's charge ([`charged_elements`]), checked over the
    /// section's bytes before anything is allocated from it.
    ///
    /// # Errors
    /// [`Error::Container`] naming what is wrong (see the module docs).
    pub(crate) fn read(bytes: &[u8], max_elements: u64) -> Result<Self> {
        let bad = invalid;
        if bytes.len() < PREFIX_LEN + CRC_LEN {
            return Err(bad(format!("truncated ({} bytes)", bytes.len())));
        }
        if !is_container(bytes) {
            return Err(bad("bad magic".to_owned()));
        }
        if bytes[4] != CONTAINER_VERSION {
            return Err(bad(format!("unsupported container version {}", bytes[4])));
        }
        if bytes[5..8] != [0, 0, 0] {
            return Err(bad("reserved bytes are not zero".to_owned()));
        }
        let m = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
        let section_end = PREFIX_LEN
            .checked_add(m)
            .filter(|&e| e.checked_add(CRC_LEN).is_some_and(|c| c <= bytes.len()))
            .ok_or_else(|| {
                bad(format!(
                    "truncated: manifest of {m} bytes, file of {}",
                    bytes.len()
                ))
            })?;
        let stored = u32::from_le_bytes([
            bytes[section_end],
            bytes[section_end + 1],
            bytes[section_end + 2],
            bytes[section_end + 3],
        ]);
        let computed = crc32fast::hash(&bytes[..section_end]);
        if stored != computed {
            return Err(bad(format!(
                "manifest checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
            )));
        }
        let mut r = Reader {
            bytes: &bytes[PREFIX_LEN..section_end],
            pos: 0,
        };
        let len = u16::from_le_bytes(r.array()?) as usize;
        let text = r.text(len, "method text")?;
        let method = method::parse(text).map_err(|e| bad(format!("manifest method: {e}")))?;
        let seed = u64::from_le_bytes(r.array()?);
        let count = u32::from_le_bytes(r.array()?) as usize;
        // Each tensor takes at least 3 bytes: the count is bounded by the section.
        if count > m / 3 {
            return Err(bad(format!(
                "manifest declares {count} tensors in {m} bytes"
            )));
        }
        // Pass 1, nothing allocated: every length inside the section, and the model's charge
        // (elements plus what its metadata will cost, see [`charged_elements`]) within the
        // bound. Only then pass 2 allocates the tensor list.
        let tensors_at = r.pos;
        let mut total: u64 = 0;
        for_each_tensor(&mut r, count, |name, dims| {
            let numel = dims.clone().fold(1u64, u64::saturating_mul);
            total = total.saturating_add(charged_elements(name.len(), dims.len(), numel));
            if total > max_elements {
                return Err(bad(format!(
                    "the model has more than {max_elements} elements (counting {} per \
                     tensor, {} per byte of its name and {} per dimension for its metadata; \
                     see --max-elements)",
                    TENSOR_CHARGE, NAME_BYTE_CHARGE, DIMENSION_CHARGE
                )));
            }
            Ok(())
        })?;
        if r.pos != r.bytes.len() {
            return Err(bad(format!(
                "{} unexpected bytes at the end of the manifest",
                r.bytes.len() - r.pos
            )));
        }
        r.pos = tensors_at;
        let mut tensors = Vec::with_capacity(count);
        for_each_tensor(&mut r, count, |name, dims| {
            let mut shape = Vec::with_capacity(dims.len());
            for d in dims {
                shape.push(usize::try_from(d).map_err(|_| {
                    bad(format!(
                        "tensor `{name}`: dimension {d} is too large for this platform"
                    ))
                })?);
            }
            tensors.push(TensorSpec::new(name, shape));
            Ok(())
        })?;
        if r.pos != r.bytes.len() {
            return Err(bad(format!(
                "{} unexpected bytes at the end of the manifest",
                r.bytes.len() - r.pos
            )));
        }
        Ok(ContainerHeader {
            method,
            seed,
            tensors,
            bundle_offset: section_end + CRC_LEN,
        })
    }

    /// The manifest the bundle is decoded against.
    ///
    /// # Errors
    /// As [`Manifest::new`] (a name given twice, a model too large for one bundle).
    pub fn manifest(&self) -> Result<Manifest> {
        manifest_of(self.tensors.clone(), self.method, self.seed)
    }

    /// Checks the container's tensors against the receiver's model `specs` (names and shapes, in
    /// sorted name order).
    ///
    /// # Errors
    /// [`Error::Container`] naming the first tensor that is missing, has another shape, or that
    /// the model does not have.
    pub(crate) fn check_against(&self, specs: &[TensorSpec]) -> Result<()> {
        let header = self;
        let mut theirs: Vec<(&str, &[usize])> = header
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        theirs.sort();
        let mut ours: Vec<(&str, &[usize])> = specs
            .iter()
            .map(|s| (s.name.as_str(), s.shape.as_slice()))
            .collect();
        ours.sort();
        for &(name, shape) in &ours {
            match theirs.iter().find(|(n, _)| *n == name) {
                None => {
                    return Err(Error::container(format!(
                        "tensor `{name}` is missing from the container"
                    )));
                }
                Some((_, s)) if *s != shape => {
                    return Err(Error::container(format!(
                        "tensor `{name}`: the model has shape {shape:?}, the container {s:?}"
                    )));
                }
                Some(_) => {}
            }
        }
        if let Some((name, _)) = theirs
            .iter()
            .find(|(n, _)| !ours.iter().any(|(o, _)| o == n))
        {
            return Err(Error::container(format!(
                "the container holds tensor `{name}`, which the model does not have"
            )));
        }
        Ok(())
    }
}

impl ContainerHeader {
    /// Reads and checks the container prefix and manifest section, then, with `specs` (the
    /// receiver's model), checks that the container describes exactly that model.
    /// `max_elements` bounds the model: its elements plus its metadata's charge (256 elements a
    /// tensor, 4 a name byte, 16 a dimension: [`TENSOR_CHARGE`], [`NAME_BYTE_CHARGE`],
    /// [`DIMENSION_CHARGE`], [`model_charge`]), checked over the section's bytes before anything
    /// is allocated from it.
    ///
    /// # Errors
    /// [`Error::Container`] naming what is wrong (see the module docs), or the first tensor that
    /// differs from `specs`.
    pub fn read_for(bytes: &[u8], specs: Option<&[TensorSpec]>, max_elements: u64) -> Result<Self> {
        let header = ContainerHeader::read(bytes, max_elements)?;
        if let Some(specs) = specs {
            header.check_against(specs)?;
        }
        Ok(header)
    }

    /// Decodes the bundle of `bytes` (the container this header was read from) one tensor at
    /// a time: checks the whole bundle first (framing, checksums, every frame's header), then
    /// calls `f(tensor, values)` for each tensor in bundle order with its dense values in one
    /// buffer, reused: the memory held is the largest tensor's, not the model's.
    ///
    /// # Errors
    /// Every error of [`Manifest::check_bundle`], before `f` is first called;
    /// [`Error::OutOfMemory`] when the largest tensor's buffer cannot be allocated;
    /// [`Error::Core`] naming the tensor for a frame whose body is invalid (`f` has then been
    /// called for the tensors before it: a caller that writes them must discard what it
    /// wrote); any error of `f`.
    pub fn decode_each<E: From<Error>>(
        &self,
        bytes: &[u8],
        mut f: impl FnMut(&ManifestTensor, &[f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let manifest = self.manifest()?;
        let bundle = bytes.get(self.bundle_offset..).unwrap_or_default();
        manifest.check_bundle(bundle, None, None)?;
        let largest = manifest.entries().iter().map(|e| e.len).max().unwrap_or(0);
        let mut buf: Vec<f32> = Vec::new();
        let mut failed: Option<E> = None;
        let walked = manifest.check_bundle_with(bundle, None, None, |e, frame, params| {
            if buf.is_empty() && largest > 0 {
                let tensor = &manifest.entries()[e].label;
                buf.try_reserve_exact(largest)
                    .map_err(|_| Error::OutOfMemory {
                        tensor: tensor.clone(),
                        elements: largest,
                    })?;
                buf.resize(largest, 0.0);
            }
            let entry = &manifest.entries()[e];
            // No buckets: one tensor per entry.
            let t = &manifest.tensors()[entry.members[0]];
            let dst = &mut buf[..entry.len];
            gradwire_core::decode_into(frame, params, dst)
                .map_err(|err| Error::core(&entry.label, None, err))?;
            match f(t, dst) {
                Ok(()) => Ok(()),
                Err(err) => {
                    failed = Some(err);
                    Err(Error::container("stopped by the caller"))
                }
            }
        });
        match (failed, walked) {
            (Some(err), _) => Err(err),
            (None, r) => r.map(|_| ()).map_err(E::from),
        }
    }
}

/// Decodes a container into dense tensors (sorted by name). With `specs` (the receiver's
/// model), the container must describe exactly that model; `max_elements` bounds the model the
/// container may declare (see [`ContainerHeader::read_for`]). It holds the whole model: to write
/// it out tensor by tensor, use [`ContainerHeader::decode_each`].
///
/// # Errors
/// [`Error::Container`] for an invalid container or one of another model; every error of
/// [`ContainerHeader::decode_each`].
#[cfg(test)] // a whole-model helper of the unit tests; the tool streams (`compress_each`)
pub(crate) fn decompress(
    bytes: &[u8],
    specs: Option<&[TensorSpec]>,
    max_elements: u64,
) -> Result<Vec<(String, Tensor)>> {
    let header = ContainerHeader::read_for(bytes, specs, max_elements)?;
    let mut out = Vec::with_capacity(header.tensors.len());
    header.decode_each(bytes, |t, data| -> Result<()> {
        let mut v = Vec::new();
        v.try_reserve_exact(data.len())
            .map_err(|_| Error::OutOfMemory {
                tensor: t.name.clone(),
                elements: data.len(),
            })?;
        v.extend_from_slice(data);
        out.push((t.name.clone(), Tensor::new(t.shape.clone(), v)?));
        Ok(())
    })?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_core::{K, Values};

    fn model() -> Vec<(String, Tensor)> {
        vec![
            (
                "a".to_owned(),
                Tensor::new(vec![2, 3], vec![0.5, -3.0, 0.25, 2.0, 0.0, -1.0]).unwrap(),
            ),
            ("b".to_owned(), Tensor::new(vec![], vec![4.0]).unwrap()),
            ("c".to_owned(), Tensor::new(vec![0], vec![]).unwrap()),
        ]
    }

    /// The container's bundle is the compressor's, at any step (random-k and stochastic
    /// rounding draw from it), and decodes at that step.
    #[test]
    fn bundles_are_the_compressors_at_every_step() {
        let m = model();
        for method in [
            Method::TopK {
                k: K::Ratio(0.5),
                values: Values::F32,
            },
            Method::RandomK {
                k: K::Count(2),
                values: Values::F16,
                unbiased: false,
            },
            Method::Quant {
                bits: 4,
                block: 2,
                rounding: gradwire_core::Rounding::Stochastic,
            },
        ] {
            let manifest = manifest_of(specs_of(&m), method, 7).unwrap();
            for step in [0, 5] {
                let bytes = compress(&m, method, 7, step).unwrap();
                let h = ContainerHeader::read(&bytes, u64::MAX).unwrap();
                assert_eq!(h.manifest().unwrap(), manifest);
                let mut c = GradientCompressor::new(CompressionMethod::Core(method))
                    .with_seed(7)
                    .with_step(step);
                let mut lib = Vec::new();
                c.compress_bundle(&manifest, &grads_of(&m), 0, &mut lib)
                    .unwrap();
                assert_eq!(&bytes[h.bundle_offset..], lib);
                let mut flat = Vec::new();
                let header = manifest.decode_bundle(&lib, Some(0), Some(step), &mut flat);
                assert_eq!(header.unwrap().step, step);
            }
        }
    }

    /// The header [`crate::tensor::f32_safetensors_header`] writes is `write_safetensors`'s.
    #[test]
    fn streamed_safetensors_header_is_write_safetensors_header() {
        let m = model();
        let whole = crate::tensor::write_safetensors(&m).unwrap();
        let head = crate::tensor::f32_safetensors_header(
            m.iter().map(|(n, t)| (n.as_str(), t.shape())),
            None,
        )
        .unwrap();
        assert_eq!(&whole[..head.len()], &head[..]);
        let data: Vec<u8> = m
            .iter()
            .flat_map(|(_, t)| t.data().iter().flat_map(|v| v.to_le_bytes()))
            .collect();
        assert_eq!(&whole[head.len()..], &data[..]);
    }

    /// Fields longer than the layout's length fields are refused, not truncated.
    #[test]
    fn over_long_fields_are_refused() {
        let method = Method::Dense {
            values: Values::F32,
        };
        let long_name = TensorSpec::new("n".repeat(1 << 16), vec![1]);
        let many_dims = TensorSpec::new("w", vec![1; 256]);
        for spec in [long_name, many_dims] {
            let err = write(&[spec], &method, 0, &[]).unwrap_err();
            assert!(matches!(err, Error::Container { .. }), "{err}");
            assert!(
                err.to_string().contains("too long for the container"),
                "{err}"
            );
        }
        let fits = TensorSpec::new("n".repeat(u16::MAX as usize), vec![1; 255]);
        assert!(write(&[fits], &method, 0, &[]).is_ok());
    }

    #[test]
    fn header_round_trips_and_every_prefix_is_refused() {
        let m = model();
        let method = Method::TopK {
            k: K::Count(1),
            values: Values::Int8 { block: 4 },
        };
        let bytes = compress(&m, method, 3, 0).unwrap();
        let h = ContainerHeader::read(&bytes, u64::MAX).unwrap();
        assert_eq!(h.method, method);
        assert_eq!(h.seed, 3);
        assert_eq!(h.tensors, specs_of(&m));
        for len in 0..bytes.len() {
            assert!(
                decompress(&bytes[..len], None, u64::MAX).is_err(),
                "prefix {len}"
            );
        }
        // Any flipped bit is refused (a checksum covers every byte), never a panic.
        for pos in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[pos] ^= bit;
                assert!(decompress(&b, None, u64::MAX).is_err(), "byte {pos}");
            }
        }
        let out = decompress(&bytes, None, u64::MAX).unwrap();
        assert_eq!(out[1].1, Tensor::new(vec![], vec![4.0]).unwrap());
        // 7 elements, and the metadata of `a` [2, 3], `b` [] and `c` [0].
        let charge = 7 + 3 * TENSOR_CHARGE + 3 * NAME_BYTE_CHARGE + 3 * DIMENSION_CHARGE;
        assert_eq!(model_charge(&specs_of(&m)), charge);
        assert!(ContainerHeader::read(&bytes, charge - 1).is_err());
        assert!(ContainerHeader::read(&bytes, charge).is_ok());
    }
}

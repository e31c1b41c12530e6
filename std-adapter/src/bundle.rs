//! Bundles: everything one rank sends in one step, in one message, and the [`Manifest`] a
//! receiver decodes it against.
//!
//! # Bundle layout (version 2)
//! All integers little-endian.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `GWBN` (`47 57 42 4E`) |
//! | 4 | 1 | version, `2` |
//! | 5 | 1 | flags, `0` (reserved) |
//! | 6 | 2 | reserved, `0` |
//! | 8 | 4 | rank of the sender (u32) |
//! | 12 | 4 | entry count `E` (u32) |
//! | 16 | 8 | step (u64) |
//! | 24 | ... | `E` entries, in manifest order |
//! | end - 4 | 4 | CRC-32 (IEEE, as in frames) of every byte before it |
//!
//! Each entry:
//!
//! | size | field |
//! |---|---|
//! | 8 | id (u64): FNV-1a (the hash of [`gradwire_core::tensor_id`]) over the tensor's name, or the bucket's label, and a 0 byte; then for each of its tensors its name, a 0 byte, the dimension count and every dimension (u64 little-endian) |
//! | 4 | frame length `L` (u32) |
//! | `L` | a gradwire frame (`FORMAT.md`) |
//!
//! A bundle costs 28 bytes plus 12 per entry on top of its frames. Names, shapes, the method
//! and the bucketing are not in a bundle: the receiver's [`Manifest`] holds them, and decoding checks
//! the bundle against it: the header (magic, version, reserved fields, checksum, rank, step),
//! the entry count, every entry's id (same tensors in the same shapes, same order) and every
//! frame's element count and parameters (same method). Anything else is an error naming the
//! tensor (or bucket) and the rank. Version 1 ids hashed the name alone, so a tensor with the
//! same name and element count in another shape (a transposed weight) was averaged element by
//! element with the receiver's. Nothing is allocated from lengths read off the wire: the
//! output is sized by the manifest, and a valid bundle is never longer than
//! [`Manifest::max_bundle_len`] (the limit to give [`crate::comm::Communicator::all_gather`]
//! for bundles alone).
//!
//! # Flat layout
//! Decoders and aggregators write into one flat `Vec<f32>` of [`Manifest::flat_len`] elements:
//! the entries' elements one after the other, in bundle order; each tensor is the contiguous
//! range [`ManifestTensor::offset`]`..offset + numel` ([`Manifest::slice`],
//! [`Manifest::to_tensors`]).
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::bucket::BucketConfig;
//! use gradwire::bundle::Manifest;
//! use gradwire::compressor::{CompressionMethod, GradientCompressor};
//! use gradwire::tensor::Tensor;
//!
//! let method = CompressionMethod::top_k_int8(0.5);
//! let mut grads = HashMap::new();
//! grads.insert("a".to_string(), Tensor::from_vec(vec![1.0, -2.0, 0.5, 4.0], &[2, 2])?);
//! grads.insert("b".to_string(), Tensor::scalar(3.0));
//! // Tensors under 2 elements go dense (exact f32); the others are fused up to 64 bytes.
//! let bucketing = BucketConfig::fused(64).with_dense_below(2, gradwire::core::Values::F32);
//! let manifest = Manifest::for_gradients(&grads, &method, 0, bucketing)?;
//!
//! let mut sender = GradientCompressor::new(method);
//! let mut bundle = Vec::new();
//! let step = sender.compress_bundle(&manifest, &grads, 0, &mut bundle)?;
//!
//! let mut flat = Vec::new();
//! manifest.decode_bundle(&bundle, Some(0), Some(step), &mut flat)?;
//! let out = manifest.to_tensors(&flat)?;
//! assert_eq!(out["b"].shape(), &[] as &[usize]);
//! assert_eq!(out["b"].data(), &[3.0]);
//! # Ok::<(), gradwire::error::Error>(())
//! ```

use std::collections::HashMap;

use gradwire_core::{
    Header, K, Method, Params, decode_into, max_frame_len, peek, scratch_len, tensor_id,
};

use crate::bucket::{BucketConfig, TopKScope, plan};
use crate::compressor::CompressionMethod;
use crate::error::{BundleFault, Error, Result};
use crate::tensor::{Tensor, checked_numel};

/// The first four bytes of every bundle.
pub const BUNDLE_MAGIC: [u8; 4] = *b"GWBN";
/// The bundle format version this crate writes and reads.
pub const BUNDLE_VERSION: u8 = 2;
/// Bytes of the bundle header.
pub const HEADER_LEN: usize = 24;
/// Bytes of an entry's id and length.
pub const ENTRY_HEADER_LEN: usize = 12;
/// Bytes of the CRC-32 trailer.
pub const TRAILER_LEN: usize = 4;

/// A tensor a manifest expects: its name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Parameter name.
    pub name: String,
    /// Shape (`[]` for a 0-d tensor).
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A spec from a name and a shape.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.into(),
        }
    }
}

/// A tensor of a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestTensor {
    /// Parameter name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Elements (`product(shape)`).
    pub numel: usize,
    /// Start of the tensor in the flat layout.
    pub offset: usize,
    /// Index of the entry that carries it.
    pub entry: usize,
}

/// What an entry of a bundle carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// One tensor.
    Tensor,
    /// Several tensors fused into one frame.
    Bucket {
        /// Each tensor keeps its own top-k inside the frame ([`TopKScope::PerTensor`]).
        per_tensor_topk: bool,
    },
}

/// An entry of a bundle: one frame carrying one tensor or a bucket.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Id on the wire: a hash of the label and of its tensors' names and shapes (FNV-1a, the
    /// bundle layout in the module docs).
    pub id: u64,
    /// The tensor id of the entry's frames ([`tensor_id`] of the label: the key of random-k's
    /// and stochastic rounding's draws, the same as for the tensor alone).
    pub tensor_id: u64,
    /// The tensor's name, or `bucket[a, b, ...]` for a bucket.
    pub label: String,
    /// The tensors it carries (indices into [`Manifest::tensors`]), in flat order.
    pub members: Vec<usize>,
    /// Start of the entry in the flat layout.
    pub offset: usize,
    /// Elements of the frame (sum of the members' elements).
    pub len: usize,
    /// The method of the frame (for per-tensor top-k, `k` is the sum of the members' k).
    pub method: Method,
    /// Tensor or bucket.
    pub kind: EntryKind,
}

/// Buffer sizes the encoder needs for a manifest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sizes {
    pub(crate) frame: usize,
    pub(crate) scratch: usize,
    pub(crate) bucket: usize,
    pub(crate) kept: usize,
}

/// What a receiver expects: the tensors (names, shapes), the method, the seed and the bucketing,
/// hence the entries of every bundle and their order.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    tensors: Vec<ManifestTensor>,
    entries: Vec<Entry>,
    by_name: Vec<usize>,
    method: Method,
    seed: u64,
    bucketing: BucketConfig,
    flat_len: usize,
    max_bundle_len: usize,
    sizes: Sizes,
}

/// What a bundle's header declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BundleHeader {
    /// Format version.
    pub version: u8,
    /// The sender's rank.
    pub rank: u32,
    /// Number of entries.
    pub entries: u32,
    /// The step the frames were made at.
    pub step: u64,
}

impl BundleHeader {
    /// Reads and checks a bundle's header and checksum (not its entries).
    ///
    /// # Errors
    /// [`Error::Bundle`] with [`BundleFault::Empty`], [`BundleFault::Truncated`],
    /// [`BundleFault::BadMagic`], [`BundleFault::UnsupportedVersion`],
    /// [`BundleFault::Reserved`], [`BundleFault::Incomplete`] or [`BundleFault::Checksum`].
    pub fn read(bundle: &[u8]) -> Result<Self> {
        let fault = |fault| Error::Bundle { rank: None, fault };
        if bundle.is_empty() {
            return Err(fault(BundleFault::Empty));
        }
        if bundle.len() < HEADER_LEN + TRAILER_LEN {
            return Err(fault(BundleFault::Truncated {
                needed: HEADER_LEN + TRAILER_LEN,
                got: bundle.len(),
            }));
        }
        if bundle[..4] != BUNDLE_MAGIC {
            return Err(fault(BundleFault::BadMagic));
        }
        if bundle[4] != BUNDLE_VERSION {
            return Err(fault(BundleFault::UnsupportedVersion {
                version: bundle[4],
            }));
        }
        if bundle[5] != 0 {
            return Err(fault(BundleFault::Reserved { offset: 5 }));
        }
        if bundle[6] != 0 || bundle[7] != 0 {
            return Err(fault(BundleFault::Reserved { offset: 6 }));
        }
        let body = bundle.len() - TRAILER_LEN;
        let stored = u32::from_le_bytes(le(&bundle[body..]));
        let computed = crc32fast::hash(&bundle[..body]);
        if stored != computed {
            // A bundle cut short (a partial transfer or copy) fails its checksum too; when its
            // own entry headers say it needs more bytes than it has, that is the clearer error.
            if let Some(declared) = declared_len(bundle).filter(|&l| l > bundle.len()) {
                return Err(fault(BundleFault::Incomplete {
                    declared,
                    got: bundle.len(),
                }));
            }
            return Err(fault(BundleFault::Checksum { stored, computed }));
        }
        Ok(BundleHeader {
            version: bundle[4],
            rank: u32::from_le_bytes(le(&bundle[8..12])),
            entries: u32::from_le_bytes(le(&bundle[12..16])),
            step: u64::from_le_bytes(le(&bundle[16..24])),
        })
    }
}

/// The length in bytes that a bundle's own headers declare (header, entries as their lengths
/// say, trailer), walking the entries only until one reaches past the bytes present (so at
/// most `bundle.len() / 12` steps); `None` when a length overflows.
fn declared_len(bundle: &[u8]) -> Option<usize> {
    let entries = u32::from_le_bytes(le(bundle.get(12..16)?));
    let mut pos = HEADER_LEN;
    for _ in 0..entries {
        let Some(head) = bundle.get(pos..pos + ENTRY_HEADER_LEN) else {
            return Some(pos + ENTRY_HEADER_LEN + TRAILER_LEN);
        };
        let len = u32::from_le_bytes(le(&head[8..])) as usize;
        pos = pos.checked_add(ENTRY_HEADER_LEN)?.checked_add(len)?;
        if pos.checked_add(TRAILER_LEN)? > bundle.len() {
            break;
        }
    }
    pos.checked_add(TRAILER_LEN)
}

/// The first `N` bytes of `b` as an array (zeros where `b` is shorter; callers check lengths).
fn le<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    for (d, s) in a.iter_mut().zip(b) {
        *d = *s;
    }
    a
}

/// Starts a bundle in `out` (cleared, capacity kept).
pub(crate) fn begin_bundle(out: &mut Vec<u8>, rank: u32, entries: u32, step: u64) {
    out.clear();
    out.extend_from_slice(&BUNDLE_MAGIC);
    out.extend_from_slice(&[BUNDLE_VERSION, 0, 0, 0]);
    out.extend_from_slice(&rank.to_le_bytes());
    out.extend_from_slice(&entries.to_le_bytes());
    out.extend_from_slice(&step.to_le_bytes());
}

/// Appends an entry.
pub(crate) fn push_entry(out: &mut Vec<u8>, id: u64, frame: &[u8]) {
    out.extend_from_slice(&id.to_le_bytes());
    // Frames of a manifest are at most `max_bundle_len`, checked at manifest build.
    out.extend_from_slice(&u32::try_from(frame.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(frame);
}

/// Appends the checksum.
pub(crate) fn finish_bundle(out: &mut Vec<u8>) {
    let crc = crc32fast::hash(out);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Checks a frame's header against what the receiver expects, without decoding its body:
/// checksum, element count and every parameter (the checks of
/// [`gradwire_core::decode_into`] that do not read the body).
///
/// # Errors
/// The core's [`gradwire_core::Error`]: any error of [`peek`];
/// [`gradwire_core::Error::ElementCount`]; [`gradwire_core::Error::ParamMismatch`] naming the
/// first parameter that differs.
pub fn check_frame(
    frame: &[u8],
    expected: &Params,
    n: usize,
) -> std::result::Result<Header, gradwire_core::Error> {
    let h = peek(frame)?;
    h.check(expected, n)?;
    Ok(h)
}

/// [`check_frame`] with the error naming `tensor` (and `rank`, for another rank's frame): a
/// parameter mismatch is [`Error::ParamsDiffer`] with both configurations, any other error
/// [`Error::Core`].
///
/// # Errors
/// As [`check_frame`], wrapped as above.
pub(crate) fn check_frame_of(
    tensor: &str,
    rank: Option<usize>,
    frame: &[u8],
    expected: &Params,
    n: usize,
) -> Result<Header> {
    check_frame(frame, expected, n)
        .map_err(|err| frame_error(tensor, rank, frame, expected, n, err))
}

/// The error `err` of a check or decode of `frame` (of tensor `tensor`, `n` elements, expected
/// with `expected`): [`Error::ParamsDiffer`] with both configurations for a parameter
/// mismatch, [`Error::Core`] otherwise.
pub(crate) fn frame_error(
    tensor: &str,
    rank: Option<usize>,
    frame: &[u8],
    expected: &Params,
    n: usize,
    err: gradwire_core::Error,
) -> Error {
    // Only a parameter mismatch reads the frame's header again (it parsed, or the check
    // would have failed earlier).
    let gradwire_core::Error::ParamMismatch { param } = err else {
        return Error::core(tensor, rank, err);
    };
    match peek(frame) {
        Ok(h) => Error::ParamsDiffer {
            tensor: tensor.to_owned(),
            rank,
            param,
            frame: describe_params(&h.params, n),
            expected: describe_params(expected, n),
        },
        Err(_) => Error::core(tensor, rank, err),
    }
}

/// A frame's parameters for messages: the method (a ratio's `k` followed by the count it
/// gives for `n` elements) and, for random-k, the seed, step and tensor id its indices come
/// from.
fn describe_params(p: &Params, n: usize) -> String {
    let mut s = crate::compressor::format_method(&p.method);
    if let Method::TopK { k, .. } | Method::RandomK { k, .. } = p.method
        && let K::Ratio(_) = k
    {
        s.push_str(&format!(" (k = {} of {n})", k.resolve(n as u64)));
    }
    if let Method::RandomK { .. } = p.method {
        s.push_str(&format!(
            " seed={} step={} tensor_id={:#x}",
            p.seed, p.step, p.tensor_id
        ));
    }
    s
}

impl Manifest {
    /// A manifest for `tensors` (in this order), compressed with `method` (error feedback, a
    /// sender-side matter, is ignored), `seed`, and `bucketing`.
    ///
    /// # Errors
    /// [`Error::DuplicateTensor`] for a name given twice; [`Error::ShapeOverflow`];
    /// [`Error::Config`] for an invalid method or bucketing, or a model too large for one
    /// bundle (`u32` lengths).
    pub fn new(
        tensors: Vec<TensorSpec>,
        method: &CompressionMethod,
        seed: u64,
        bucketing: BucketConfig,
    ) -> Result<Self> {
        let method = method.core_method()?;
        bucketing.validate()?;
        let mut numels = Vec::with_capacity(tensors.len());
        for spec in &tensors {
            numels.push(checked_numel(&spec.name, &spec.shape)?);
        }
        let mut by_name: Vec<usize> = (0..tensors.len()).collect();
        by_name.sort_by(|&a, &b| tensors[a].name.cmp(&tensors[b].name));
        if let Some(w) = by_name
            .windows(2)
            .find(|w| tensors[w[0]].name == tensors[w[1]].name)
        {
            return Err(Error::DuplicateTensor {
                tensor: tensors[w[0]].name.clone(),
            });
        }
        let planned = plan(&numels, &bucketing);
        let mut infos: Vec<ManifestTensor> = tensors
            .into_iter()
            .zip(&numels)
            .map(|(spec, &numel)| ManifestTensor {
                name: spec.name,
                shape: spec.shape,
                numel,
                offset: 0,
                entry: 0,
            })
            .collect();
        let mut entries = Vec::with_capacity(planned.len());
        let mut offset = 0usize;
        let mut sizes = Sizes::default();
        let mut max_bundle = HEADER_LEN + TRAILER_LEN;
        let too_large = || Error::config("the model is too large for one bundle");
        for p in planned {
            let start = offset;
            for &t in &p.members {
                infos[t].offset = offset;
                infos[t].entry = entries.len();
                offset = offset.checked_add(infos[t].numel).ok_or_else(too_large)?;
            }
            let len = offset - start;
            let (kind, label) = if p.members.len() == 1 {
                (EntryKind::Tensor, infos[p.members[0]].name.clone())
            } else {
                let names: Vec<&str> = p.members.iter().map(|&t| infos[t].name.as_str()).collect();
                let per_tensor_topk = !p.dense
                    && bucketing.scope == TopKScope::PerTensor
                    && matches!(method, Method::TopK { .. });
                (
                    EntryKind::Bucket { per_tensor_topk },
                    format!("bucket[{}]", names.join(", ")),
                )
            };
            let entry_method = if p.dense {
                Method::Dense {
                    values: bucketing.dense_values,
                }
            } else {
                match (&kind, method) {
                    (
                        EntryKind::Bucket {
                            per_tensor_topk: true,
                        },
                        Method::TopK { k, values },
                    ) => {
                        let total: u64 = p
                            .members
                            .iter()
                            .map(|&t| k.resolve(infos[t].numel as u64))
                            .sum();
                        Method::TopK {
                            k: K::Count(total),
                            values,
                        }
                    }
                    _ => method,
                }
            };
            let frame = max_frame_len(len, &entry_method);
            if frame > u32::MAX as usize {
                return Err(too_large());
            }
            sizes.frame = sizes.frame.max(frame);
            sizes.scratch = sizes.scratch.max(scratch_len(len, &entry_method));
            if p.members.len() > 1 {
                sizes.bucket = sizes.bucket.max(len);
                if let Method::TopK { k, .. } = entry_method {
                    let k = usize::try_from(k.resolve(len as u64)).map_err(|_| too_large())?;
                    sizes.kept = sizes.kept.max(k);
                }
            }
            max_bundle = max_bundle
                .checked_add(ENTRY_HEADER_LEN.saturating_add(frame))
                .ok_or_else(too_large)?;
            entries.push(Entry {
                id: entry_id(&label, p.members.iter().map(|&t| &infos[t])),
                tensor_id: tensor_id(&label),
                label,
                members: p.members,
                offset: start,
                len,
                method: entry_method,
                kind,
            });
        }
        if u32::try_from(entries.len()).is_err() {
            return Err(too_large());
        }
        Ok(Manifest {
            tensors: infos,
            entries,
            by_name,
            method,
            seed,
            bucketing,
            flat_len: offset,
            max_bundle_len: max_bundle,
            sizes,
        })
    }

    /// A manifest for the names and shapes of `grads`, in sorted name order.
    ///
    /// # Errors
    /// As [`Manifest::new`].
    pub fn for_gradients(
        grads: &HashMap<String, Tensor>,
        method: &CompressionMethod,
        seed: u64,
        bucketing: BucketConfig,
    ) -> Result<Self> {
        let mut specs: Vec<TensorSpec> = grads
            .iter()
            .map(|(n, t)| TensorSpec::new(n.clone(), t.shape()))
            .collect();
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        Self::new(specs, method, seed, bucketing)
    }

    /// The tensors, in the order the manifest was built with.
    pub fn tensors(&self) -> &[ManifestTensor] {
        &self.tensors
    }

    /// The entries of a bundle, in wire order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&ManifestTensor> {
        self.by_name
            .binary_search_by(|&t| self.tensors[t].name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[self.by_name[i]])
    }

    /// The method of the tensors' frames (dense buckets use [`BucketConfig::dense_values`]).
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The run's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The bucketing.
    pub fn bucketing(&self) -> &BucketConfig {
        &self.bucketing
    }

    /// Elements of the flat layout (every tensor's elements).
    pub fn flat_len(&self) -> usize {
        self.flat_len
    }

    /// A stable 64-bit fingerprint of the layout: every tensor's name and shape in manifest
    /// order, and every entry's label (so the bucketing). Two ranks with the same fingerprint
    /// decode each other's bundles; a bundle checks the same by itself (its entry ids hash the
    /// names and shapes), so this is for a transport that wants to compare layouts once, up
    /// front.
    pub fn layout_fingerprint(&self) -> u64 {
        layout_fingerprint(&self.tensors, &self.entries)
    }

    /// The largest bundle this manifest allows, in bytes (pass it as `max_len` to
    /// [`crate::comm::Communicator::all_gather`]).
    pub fn max_bundle_len(&self) -> usize {
        self.max_bundle_len
    }

    pub(crate) fn sizes(&self) -> Sizes {
        self.sizes
    }

    /// The parameters of entry `entry`'s frame at `step`.
    pub fn params(&self, entry: usize, step: u64) -> Params {
        match self.entries.get(entry) {
            Some(e) => Params {
                method: e.method,
                seed: self.seed,
                step,
                tensor_id: e.tensor_id,
            },
            None => Params::new(self.method),
        }
    }

    /// `name`'s elements in a flat buffer of this manifest.
    pub fn slice<'a>(&self, flat: &'a [f32], name: &str) -> Option<&'a [f32]> {
        let t = self.tensor(name)?;
        flat.get(t.offset..t.offset + t.numel)
    }

    /// The tensors of a flat buffer, with their shapes.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `flat` is not [`Manifest::flat_len`] long.
    pub fn to_tensors(&self, flat: &[f32]) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(self.tensors.len());
        self.to_tensors_into(flat, &mut out)?;
        Ok(out)
    }

    /// As [`Manifest::to_tensors`], reusing the tensors already in `out` (no allocation when
    /// `out` came from a previous call); tensors not in the manifest are removed.
    ///
    /// # Errors
    /// As [`Manifest::to_tensors`].
    pub fn to_tensors_into(&self, flat: &[f32], out: &mut HashMap<String, Tensor>) -> Result<()> {
        if flat.len() != self.flat_len {
            return Err(Error::ShapeMismatch {
                tensor: "(flat buffer)".to_owned(),
                rank: None,
                expected: vec![self.flat_len],
                got: vec![flat.len()],
            });
        }
        out.retain(|name, _| self.tensor(name).is_some());
        for t in &self.tensors {
            let data = &flat[t.offset..t.offset + t.numel];
            match out.get_mut(&t.name) {
                Some(tensor) => tensor.assign(&t.shape, data)?,
                None => {
                    out.insert(t.name.clone(), Tensor::new(t.shape.clone(), data.to_vec())?);
                }
            }
        }
        Ok(())
    }

    /// Checks that `grads` holds exactly the manifest's tensors with their shapes.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::UnexpectedTensor`] (the first in sorted order) or
    /// [`Error::ShapeMismatch`], naming the tensor.
    pub fn check_gradients(&self, grads: &HashMap<String, Tensor>) -> Result<()> {
        for &t in &self.by_name {
            let info = &self.tensors[t];
            match grads.get(&info.name) {
                None => {
                    return Err(Error::MissingTensor {
                        tensor: info.name.clone(),
                        rank: None,
                    });
                }
                Some(g) if g.shape() != info.shape.as_slice() => {
                    return Err(Error::ShapeMismatch {
                        tensor: info.name.clone(),
                        rank: None,
                        expected: info.shape.clone(),
                        got: g.shape().to_vec(),
                    });
                }
                Some(_) => {}
            }
        }
        if grads.len() != self.tensors.len() {
            let mut extra: Vec<&String> =
                grads.keys().filter(|n| self.tensor(n).is_none()).collect();
            extra.sort();
            if let Some(name) = extra.first() {
                return Err(Error::UnexpectedTensor {
                    tensor: (*name).clone(),
                    rank: None,
                });
            }
        }
        Ok(())
    }

    /// Checks a bundle against the manifest without decoding its frames' bodies: the header
    /// (magic, version, reserved fields, checksum), the rank and step when given, the entry
    /// count, every entry's id and length, and every frame's checksum, element count and
    /// parameters. Calls `f(entry index, frame, expected parameters)` for every entry, in order, once all checks
    /// passed. Returns the header.
    ///
    /// # Errors
    /// [`Error::Bundle`] for the framing; [`Error::UnexpectedEntry`] when an entry belongs to
    /// another tensor; naming the tensor (or bucket) and the rank for a frame that fails
    /// [`check_frame`]: [`Error::ParamsDiffer`] (made with other parameters, both
    /// configurations given) or [`Error::Core`]; any error `f` returns.
    pub fn check_bundle_with(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
        mut f: impl FnMut(usize, &[u8], &Params) -> Result<()>,
    ) -> Result<BundleHeader> {
        let fault = |rank: Option<usize>, fault| Error::Bundle { rank, fault };
        let header = BundleHeader::read(bundle).map_err(|e| match e {
            Error::Bundle { fault: f, .. } => fault(rank, f),
            other => other,
        })?;
        let declared = usize::try_from(header.rank).ok();
        if let Some(r) = rank
            && declared != Some(r)
        {
            return Err(fault(
                rank,
                BundleFault::Rank {
                    expected: r,
                    got: u64::from(header.rank),
                },
            ));
        }
        let rank = rank.or(declared);
        if let Some(s) = step
            && header.step != s
        {
            return Err(fault(
                rank,
                BundleFault::Step {
                    expected: s,
                    got: header.step,
                },
            ));
        }
        if header.entries as usize != self.entries.len() {
            return Err(fault(
                rank,
                BundleFault::EntryCount {
                    expected: self.entries.len(),
                    got: u64::from(header.entries),
                    first_difference: self.first_difference(bundle, header.entries as usize),
                },
            ));
        }
        let body_end = bundle.len() - TRAILER_LEN;
        // Pass 1: framing and frame headers of every entry.
        let mut pos = HEADER_LEN;
        for (e, entry) in self.entries.iter().enumerate() {
            let (id, frame) = self.entry_at(bundle, body_end, &mut pos, rank)?;
            check_id(e, entry, id, frame, rank)?;
            check_frame_of(
                &entry.label,
                rank,
                frame,
                &self.params(e, header.step),
                entry.len,
            )?;
        }
        if pos != body_end {
            return Err(fault(rank, BundleFault::TrailingBytes { offset: pos }));
        }
        // Valid frames never exceed their bound; kept as a last line of defence.
        if bundle.len() > self.max_bundle_len {
            return Err(fault(
                rank,
                BundleFault::TooLarge {
                    limit: self.max_bundle_len,
                    got: bundle.len(),
                },
            ));
        }
        // Pass 2: hand out the frames.
        self.walk(bundle, rank, |e, frame| {
            f(e, frame, &self.params(e, header.step))
        })?;
        Ok(header)
    }

    /// Calls `f(entry index, frame)` for every entry of a bundle that
    /// [`Manifest::check_bundle`] accepted.
    pub(crate) fn walk(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        mut f: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let body_end = bundle.len().saturating_sub(TRAILER_LEN);
        let mut pos = HEADER_LEN;
        for (e, entry) in self.entries.iter().enumerate() {
            let (id, frame) = self.entry_at(bundle, body_end, &mut pos, rank)?;
            check_id(e, entry, id, frame, rank)?;
            f(e, frame)?;
        }
        Ok(())
    }

    /// For a bundle of `declared` entries where the manifest has another number: the first
    /// entry where the two differ, named by the manifest's label there (a tensor missing on one
    /// side shows there). `None` when the bundle's entries cannot be read that far.
    fn first_difference(&self, bundle: &[u8], declared: usize) -> Option<String> {
        let body_end = bundle.len().checked_sub(TRAILER_LEN)?;
        let mut pos = HEADER_LEN;
        let common = declared.min(self.entries.len());
        for (e, entry) in self.entries[..common].iter().enumerate() {
            let (id, _) = self.entry_at(bundle, body_end, &mut pos, None).ok()?;
            if id != entry.id {
                return Some(format!(
                    "the first that differs is entry {e}, where the manifest has `{}`",
                    entry.label
                ));
            }
        }
        Some(match (self.entries.get(common), common) {
            (Some(entry), _) => format!(
                "the bundle ends before entry {common}, where the manifest has `{}`",
                entry.label
            ),
            (None, 0) => "the manifest has no entries".to_owned(),
            (None, _) => format!("the bundle has more entries after entry {}", common - 1),
        })
    }

    /// Reads the entry at `pos` (its id and frame) and advances `pos`.
    fn entry_at<'b>(
        &self,
        bundle: &'b [u8],
        body_end: usize,
        pos: &mut usize,
        rank: Option<usize>,
    ) -> Result<(u64, &'b [u8])> {
        let truncated = |needed: usize| Error::Bundle {
            rank,
            fault: BundleFault::Truncated {
                needed: needed.saturating_add(TRAILER_LEN),
                got: bundle.len(),
            },
        };
        let head_end = pos.saturating_add(ENTRY_HEADER_LEN);
        let head = bundle
            .get(*pos..head_end)
            .filter(|_| head_end <= body_end)
            .ok_or_else(|| truncated(head_end))?;
        let id = u64::from_le_bytes(le(&head[..8]));
        let len = u32::from_le_bytes(le(&head[8..12])) as usize;
        let end = head_end.saturating_add(len);
        let frame = bundle
            .get(head_end..end)
            .filter(|_| end <= body_end)
            .ok_or_else(|| truncated(end))?;
        *pos = end;
        Ok((id, frame))
    }

    /// Checks a bundle against the manifest (see [`Manifest::check_bundle_with`]).
    ///
    /// # Errors
    /// As [`Manifest::check_bundle_with`].
    pub fn check_bundle(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
    ) -> Result<BundleHeader> {
        self.check_bundle_with(bundle, rank, step, |_, _, _| Ok(()))
    }

    /// Decodes a bundle into `out`, resized to [`Manifest::flat_len`] (no allocation when it
    /// already has the capacity). `rank` and `step`, when given, must match the bundle's.
    /// Returns the bundle's header.
    ///
    /// # Errors
    /// As [`Manifest::check_bundle_with`], and [`Error::Core`] naming the tensor (or bucket)
    /// for a frame whose body is invalid (then `out` is zeroed). On any other error `out` is
    /// untouched.
    pub fn decode_bundle(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
        out: &mut Vec<f32>,
    ) -> Result<BundleHeader> {
        let mut sized = false;
        let result = self.check_bundle_with(bundle, rank, step, |e, frame, params| {
            if !sized {
                out.resize(self.flat_len, 0.0);
                sized = true;
            }
            let entry = &self.entries[e];
            let dst = &mut out[entry.offset..entry.offset + entry.len];
            decode_into(frame, params, dst)
                .map(|_| ())
                .map_err(|err| Error::core(&entry.label, rank, err))
        });
        match result {
            Ok(header) => {
                out.resize(self.flat_len, 0.0);
                Ok(header)
            }
            Err(e) => {
                if sized {
                    out.fill(0.0);
                }
                Err(e)
            }
        }
    }
}

/// [`Error::UnexpectedEntry`] unless `id` is entry `e`'s (with the element count of `frame`,
/// when its header reads: for the same tensor in another shape, that is what differs).
fn check_id(e: usize, entry: &Entry, id: u64, frame: &[u8], rank: Option<usize>) -> Result<()> {
    if id == entry.id {
        return Ok(());
    }
    Err(Error::UnexpectedEntry {
        rank,
        index: e,
        expected: entry.label.clone(),
        expected_elements: entry.len as u64,
        got_elements: peek(frame).ok().map(|h| h.n),
        expected_id: entry.id,
        got_id: id,
    })
}

/// FNV-1a (as [`gradwire_core::tensor_id`]) over every tensor's name and shape, then every
/// entry's label; names end with a 0 byte, dimensions are u64 little-endian after their count.
fn layout_fingerprint(tensors: &[ManifestTensor], entries: &[Entry]) -> u64 {
    let mut h = Fnv::new();
    for t in tensors {
        h.name(&t.name);
        h.shape(&t.shape);
    }
    for e in entries {
        h.name(&e.label);
    }
    h.0
}

/// An entry's id on the wire: FNV-1a (as [`gradwire_core::tensor_id`]) over its label, then
/// the name and shape of each of its tensors, encoded as in [`layout_fingerprint`]. So a peer
/// whose tensor has the same name and element count but another shape (a transposed weight)
/// sends another id, and its bundle is an error naming the tensor, not an element-wise mean of
/// two layouts. (The names are hashed one by one, not only through the bucket's label, which
/// joins them with `", "`: tensors named `a, b` and `c` would otherwise bucket like `a` and
/// `b, c`.)
fn entry_id<'a>(label: &str, members: impl Iterator<Item = &'a ManifestTensor>) -> u64 {
    let mut h = Fnv::new();
    h.name(label);
    for t in members {
        h.name(&t.name);
        h.shape(&t.shape);
    }
    h.0
}

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn eat(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// A name and a 0 byte.
    fn name(&mut self, name: &str) {
        self.eat(name.as_bytes());
        self.eat(&[0]);
    }

    /// The dimension count, then each dimension (u64 little-endian).
    fn shape(&mut self, shape: &[usize]) {
        self.eat(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            self.eat(&(d as u64).to_le_bytes());
        }
    }
}

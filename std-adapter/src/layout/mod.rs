//! What a receiver expects: the [`Manifest`] (tensors, method, seed, bucketing, hence the
//! entries of every bundle and their order), its buckets ([`BucketConfig`]), the bundle format
//! (`FORMAT.md` section 10, [`BundleHeader`]) and per-tensor frames ([`CompressedGradient`]).
//!
//! # Flat layout
//! Decoders and aggregators write into one flat `Vec<f32>` of [`Manifest::flat_len`] elements:
//! the entries' elements one after the other, in bundle order; each tensor is the contiguous
//! range [`ManifestTensor::offset`]`..offset + numel` ([`Manifest::slice`],
//! [`Manifest::to_tensors`]).

mod bucket;
pub(crate) mod bundle;
mod frames;
pub(crate) mod plan;
pub(crate) mod shards;

use std::collections::HashMap;

use gradwire_core::{K, Method, Params, max_frame_len, tensor_id};

pub use self::bucket::{BucketConfig, TopKScope};
pub use self::bundle::BundleHeader;
use self::bundle::ENTRY_HEADER_LEN;
pub use self::frames::CompressedGradient;
pub(crate) use self::frames::{check_frame_of, frame_error, update_with_frame};

use self::bucket::{Group, group};
use self::bundle::{HEADER_LEN, TRAILER_LEN, entry_id};
use self::plan::{EncodePlan, ReducePlan, encode_plan, reduce_plan};
use crate::error::{Error, Result};
use crate::method::CompressionMethod;
use crate::tensor::{Tensor, checked_numel};

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
#[non_exhaustive]
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
    /// How the engine writes the frame.
    pub(crate) encode: EncodePlan,
    /// How aggregation adds the ranks' frames.
    pub(crate) reduce: ReducePlan,
}

/// Buffer sizes the encoder needs for a manifest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sizes {
    /// Largest frame of an entry.
    pub(crate) frame: usize,
    /// Elements of the largest bucket.
    pub(crate) bucket: usize,
    /// Kept entries of the largest top-k bucket.
    pub(crate) kept: usize,
}

/// What a receiver expects: the tensors (names, shapes), the method, the seed and the bucketing,
/// hence the entries of every bundle and their order.
///
/// ```
/// use std::collections::HashMap;
/// use gradwire::{BucketConfig, CompressionMethod, GradientCompressor, Manifest, Tensor};
///
/// let method = CompressionMethod::top_k_int8(0.5);
/// let mut grads = HashMap::new();
/// grads.insert("a".to_string(), Tensor::from_vec(vec![1.0, -2.0, 0.5, 4.0], &[2, 2])?);
/// grads.insert("b".to_string(), Tensor::from_vec(vec![3.0], &[])?);
/// // Tensors under 2 elements go dense (exact f32); the others are fused up to 64 bytes.
/// let bucketing = BucketConfig::fused(64).with_dense_below(2, gradwire::core::Values::F32);
/// let manifest = Manifest::for_gradients(&grads, &method, 0, bucketing)?;
///
/// let mut sender = GradientCompressor::new(method);
/// let mut bundle = Vec::new();
/// let step = sender.compress_bundle(&manifest, &grads, 0, &mut bundle)?;
///
/// let mut flat = Vec::new();
/// manifest.decode_bundle(&bundle, Some(0), Some(step), &mut flat)?;
/// let out = manifest.to_tensors(&flat)?;
/// assert_eq!(out["b"].shape(), &[] as &[usize]);
/// assert_eq!(out["b"].data(), &[3.0]);
/// # Ok::<(), gradwire::Error>(())
/// ```
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

/// [`Error::Config`] for a model whose bundle would not fit the format's `u32` lengths.
fn too_large() -> Error {
    Error::config("the model is too large for one bundle")
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
        let groups = group(&numels, &bucketing);
        let mut m = Manifest {
            tensors: tensors
                .into_iter()
                .zip(&numels)
                .map(|(spec, &numel)| ManifestTensor {
                    name: spec.name,
                    shape: spec.shape,
                    numel,
                    offset: 0,
                    entry: 0,
                })
                .collect(),
            entries: Vec::with_capacity(groups.len()),
            by_name,
            method,
            seed,
            bucketing,
            flat_len: 0,
            max_bundle_len: HEADER_LEN + TRAILER_LEN,
            sizes: Sizes::default(),
        };
        for g in groups {
            m.push_entry(g)?;
        }
        if u32::try_from(m.entries.len()).is_err() {
            return Err(too_large());
        }
        Ok(m)
    }

    /// Appends the entry of `g` (its tensors' offsets, label, id, method, plans) and grows the
    /// flat length, the bundle bound and the encoder's buffer sizes.
    fn push_entry(&mut self, g: Group) -> Result<()> {
        let start = self.flat_len;
        let mut offset = start;
        for &t in &g.members {
            let info = &mut self.tensors[t];
            info.offset = offset;
            info.entry = self.entries.len();
            offset = offset.checked_add(info.numel).ok_or_else(too_large)?;
        }
        self.flat_len = offset;
        let len = offset - start;
        let (kind, label) = match g.members.as_slice() {
            [t] => (EntryKind::Tensor, self.tensors[*t].name.clone()),
            members => {
                let names: Vec<&str> = members
                    .iter()
                    .map(|&t| self.tensors[t].name.as_str())
                    .collect();
                let per_tensor_topk = !g.dense
                    && self.bucketing.scope == TopKScope::PerTensor
                    && matches!(self.method, Method::TopK { .. });
                (
                    EntryKind::Bucket { per_tensor_topk },
                    format!("bucket[{}]", names.join(", ")),
                )
            }
        };
        let method = self.entry_method(&g, &kind);
        let frame = max_frame_len(len, &method);
        if frame > u32::MAX as usize {
            return Err(too_large());
        }
        let sizes = &mut self.sizes;
        sizes.frame = sizes.frame.max(frame);
        if g.members.len() > 1 {
            sizes.bucket = sizes.bucket.max(len);
            if let Method::TopK { k, .. } = method {
                let k = usize::try_from(k.resolve(len as u64)).map_err(|_| too_large())?;
                sizes.kept = sizes.kept.max(k);
            }
        }
        self.max_bundle_len = self
            .max_bundle_len
            .checked_add(ENTRY_HEADER_LEN.saturating_add(frame))
            .ok_or_else(too_large)?;
        self.entries.push(Entry {
            id: entry_id(&label, g.members.iter().map(|&t| &self.tensors[t])),
            tensor_id: tensor_id(&label),
            label,
            members: g.members,
            offset: start,
            len,
            method,
            encode: encode_plan(&kind, len, &method),
            reduce: reduce_plan(len, &method),
            kind,
        });
        Ok(())
    }

    /// The method of the frame of group `g`: the bucketing's dense values for a dense group; for
    /// a per-tensor top-k bucket, top-k with `k` the sum of its tensors' own `k`.
    fn entry_method(&self, g: &Group, kind: &EntryKind) -> Method {
        if g.dense {
            return Method::Dense {
                values: self.bucketing.dense_values,
            };
        }
        match (kind, self.method) {
            (
                EntryKind::Bucket {
                    per_tensor_topk: true,
                },
                Method::TopK { k, values },
            ) => Method::TopK {
                k: K::Count(
                    g.members
                        .iter()
                        .map(|&t| k.resolve(self.tensors[t].numel as u64))
                        .sum(),
                ),
                values,
            },
            _ => self.method,
        }
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

    /// The manifest in `cache` when it was made for `grads` (names and shapes), `method` and
    /// `seed` with `bucketing`; otherwise a new one for them, kept in `cache`.
    ///
    /// # Errors
    /// As [`Manifest::for_gradients`].
    pub(crate) fn cached<'c>(
        cache: &'c mut Option<Manifest>,
        grads: &HashMap<String, Tensor>,
        method: Method,
        seed: u64,
        bucketing: BucketConfig,
    ) -> Result<&'c Manifest> {
        // A steady-state step finds its manifest without allocating.
        let fits = cache.as_ref().is_some_and(|m| {
            m.method == method
                && m.seed == seed
                && m.bucketing == bucketing
                && m.check_gradients(grads).is_ok()
        });
        if fits && let Some(m) = cache {
            return Ok(m);
        }
        let mut specs: Vec<(&str, &[usize])> = grads
            .iter()
            .map(|(name, t)| (name.as_str(), t.shape()))
            .collect();
        specs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        Self::cached_for(cache, &specs, method, seed, bucketing)
    }

    /// As [`Manifest::cached`], for the names and shapes `specs`, sorted by name (the manifest's
    /// tensors follow that order; a name given twice is [`Error::DuplicateTensor`]).
    ///
    /// # Errors
    /// As [`Manifest::new`].
    pub(crate) fn cached_for<'c>(
        cache: &'c mut Option<Manifest>,
        specs: &[(&str, &[usize])],
        method: Method,
        seed: u64,
        bucketing: BucketConfig,
    ) -> Result<&'c Manifest> {
        let fits = cache.as_ref().is_some_and(|m| {
            m.method == method
                && m.seed == seed
                && m.bucketing == bucketing
                && m.tensors.len() == specs.len()
                && m.tensors
                    .iter()
                    .zip(specs)
                    .all(|(t, &(name, shape))| t.name == name && t.shape == shape)
        });
        let manifest = match cache.take().filter(|_| fits) {
            Some(m) => m,
            None => {
                let core = CompressionMethod::Core(method);
                let specs = specs
                    .iter()
                    .map(|&(name, shape)| TensorSpec::new(name, shape))
                    .collect();
                Manifest::new(specs, &core, seed, bucketing)?
            }
        };
        Ok(cache.insert(manifest))
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
    pub(crate) fn tensor(&self, name: &str) -> Option<&ManifestTensor> {
        self.by_name
            .binary_search_by(|&t| self.tensors[t].name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[self.by_name[i]])
    }

    /// The method of the tensors' frames (dense buckets use [`BucketConfig::dense_values`]).
    pub(crate) fn method(&self) -> &Method {
        &self.method
    }

    /// The run's seed.
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// Elements of the flat layout (every tensor's elements).
    pub fn flat_len(&self) -> usize {
        self.flat_len
    }

    /// The largest bundle this manifest allows, in bytes (pass it as `max_len` to
    /// [`crate::comm::Communicator::all_gather`]).
    pub fn max_bundle_len(&self) -> usize {
        self.max_bundle_len
    }

    /// The parameters of `entry`'s frame (an entry of this manifest) at `step`: what its
    /// receiver checks the frame against.
    pub(crate) fn params(&self, entry: &Entry, step: u64) -> Params {
        Params {
            method: entry.method,
            seed: self.seed,
            step,
            tensor_id: entry.tensor_id,
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

    /// Makes `out` hold exactly the manifest's tensors with their shapes, reusing the tensors
    /// already there (no allocation when `out` came from a previous step); their elements are
    /// unspecified, for a caller that writes every one of them.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] naming the first tensor whose memory cannot be had (the tensors
    /// before it are shaped).
    pub(crate) fn shape_outputs(&self, out: &mut HashMap<String, Tensor>) -> Result<()> {
        out.retain(|name, _| self.tensor(name).is_some());
        for t in &self.tensors {
            match out.get_mut(&t.name) {
                Some(tensor) => tensor.reshape_for_overwrite(&t.shape, t.numel, &t.name)?,
                None => {
                    let mut tensor = Tensor::default();
                    tensor.reshape_for_overwrite(&t.shape, t.numel, &t.name)?;
                    out.insert(t.name.clone(), tensor);
                }
            }
        }
        Ok(())
    }

    /// Each tensor's elements in `out` (shaped by [`Manifest::shape_outputs`]), in the
    /// manifest's tensor order. `None` for an `out` that is not shaped for it.
    pub(crate) fn tensor_outputs<'o>(
        &self,
        out: &'o mut HashMap<String, Tensor>,
    ) -> Option<Vec<&'o mut [f32]>> {
        let mut slots: Vec<Option<&'o mut [f32]>> = Vec::new();
        slots.resize_with(self.tensors.len(), || None);
        for (name, tensor) in out.iter_mut() {
            let at = self
                .by_name
                .binary_search_by(|&t| self.tensors[t].name.as_str().cmp(name))
                .ok()?;
            let data = tensor.data_mut();
            let t = self.by_name[at];
            (data.len() == self.tensors[t].numel).then_some(())?;
            slots[t] = Some(data);
        }
        slots.into_iter().collect()
    }

    /// Whether every entry is one tensor, entry `e` the manifest's tensor `e` (no buckets):
    /// the tensors' outputs, in order, are then the entries'.
    pub(crate) fn one_entry_per_tensor(&self) -> bool {
        self.entries.len() == self.tensors.len()
            && self
                .entries
                .iter()
                .enumerate()
                .all(|(e, entry)| entry.members.len() == 1 && entry.members[0] == e)
    }

    /// Each entry's output slice among `outs` (every tensor's elements, in the manifest's
    /// tensor order), in entry order. `None` for a manifest with buckets (an entry spanning
    /// several tensors has no one slice) or `outs` of other lengths.
    pub(crate) fn entry_slices<'s>(
        &self,
        outs: &'s mut [&mut [f32]],
    ) -> Option<Vec<&'s mut [f32]>> {
        if outs.len() != self.tensors.len() {
            return None;
        }
        let mut slots: Vec<Option<&'s mut [f32]>> = outs
            .iter_mut()
            .zip(&self.tensors)
            .map(|(o, t)| (o.len() == t.numel).then_some(&mut **o))
            .collect();
        self.entries
            .iter()
            .map(|e| match e.members[..] {
                [t] if e.kind == EntryKind::Tensor => slots.get_mut(t)?.take(),
                _ => None,
            })
            .collect()
    }

    /// Copies the flat buffer `flat` ([`Manifest::flat_len`] elements) into `outs`, each
    /// tensor's elements in the manifest's tensor order.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `flat` or an output has another length.
    pub(crate) fn write_flat(&self, flat: &[f32], outs: &mut [&mut [f32]]) -> Result<()> {
        let fits = flat.len() == self.flat_len
            && outs.len() == self.tensors.len()
            && outs
                .iter()
                .zip(&self.tensors)
                .all(|(o, t)| o.len() == t.numel);
        if !fits {
            return Err(Error::ShapeMismatch {
                tensor: "(flat buffer)".to_owned(),
                rank: None,
                expected: vec![self.flat_len],
                got: vec![flat.len()],
            });
        }
        for (o, t) in outs.iter_mut().zip(&self.tensors) {
            o.copy_from_slice(&flat[t.offset..t.offset + t.numel]);
        }
        Ok(())
    }

    /// Checks that `grads` holds exactly the manifest's tensors with their shapes.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::UnexpectedTensor`] (the first in sorted order) or
    /// [`Error::ShapeMismatch`], naming the tensor.
    pub(crate) fn check_gradients(&self, grads: &HashMap<String, Tensor>) -> Result<()> {
        self.check_names(grads, None, Tensor::shape)
    }

    /// Checks that `map` holds exactly the manifest's tensors, each with its shape (`shape_of`),
    /// in sorted name order; errors name `rank` (a peer's contribution) when given.
    pub(crate) fn check_names<V>(
        &self,
        map: &HashMap<String, V>,
        rank: Option<usize>,
        shape_of: impl Fn(&V) -> &[usize],
    ) -> Result<()> {
        for &t in &self.by_name {
            let info = &self.tensors[t];
            match map.get(&info.name) {
                None => {
                    return Err(Error::MissingTensor {
                        tensor: info.name.clone(),
                        rank,
                    });
                }
                Some(v) if shape_of(v) != info.shape.as_slice() => {
                    return Err(Error::ShapeMismatch {
                        tensor: info.name.clone(),
                        rank,
                        expected: info.shape.clone(),
                        got: shape_of(v).to_vec(),
                    });
                }
                Some(_) => {}
            }
        }
        if map.len() != self.tensors.len() {
            let mut extra: Vec<&String> = map.keys().filter(|n| self.tensor(n).is_none()).collect();
            extra.sort();
            if let Some(name) = extra.first() {
                return Err(Error::UnexpectedTensor {
                    tensor: (*name).clone(),
                    rank,
                });
            }
        }
        Ok(())
    }

    /// A 64-bit id of the layout: FNV-1a over every entry's id (which hashes its tensors' names
    /// and shapes) and the flat length, for a check that ranks share one layout.
    pub(crate) fn layout_id(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let ids = self
            .entries
            .iter()
            .map(|e| e.id)
            .chain([self.flat_len as u64]);
        for b in ids.flat_map(u64::to_le_bytes) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    /// Buffer sizes the encoder needs for this manifest.
    pub(crate) fn sizes(&self) -> Sizes {
        self.sizes
    }
}

//! Buckets: small tensors fused into one frame, and the encoder that runs a whole
//! [`Manifest`] (tensors and buckets, with or without error feedback).
//!
//! A frame costs a fixed 30-40 bytes of header and checksum plus 12 bytes of bundle entry, and
//! a 384-element bias at top-k 1% keeps 3 values: fusing small tensors saves most of those
//! bytes. [`BucketConfig`] says how:
//!
//! - tensors are walked in manifest order. A tensor whose dense f32 bytes (`4 * n`) reach
//!   [`BucketConfig::bucket_bytes`] gets its own entry; a smaller one joins the open bucket,
//!   which is closed (and a new one opened) when the tensor would push it past the budget.
//!   A bucket takes its place in the bundle when it is opened, so the order is deterministic.
//!   `bucket_bytes == 0` fuses nothing;
//! - tensors with fewer than [`BucketConfig::dense_below`] elements are sent dense (with
//!   [`BucketConfig::dense_values`]), fused in their own dense buckets by the same rule;
//! - a bucket is one frame over the concatenation of its tensors (in manifest order). With a
//!   top-k method, [`TopKScope::PerTensor`] keeps each tensor's own top-k (`k` resolved for the
//!   tensor's `n`) inside the bucket frame; [`TopKScope::PerBucket`] keeps the top-k of the
//!   whole bucket (`k` resolved for the bucket's `n`). Other methods compress the
//!   concatenation as one tensor (block scales may then span two tensors);
//! - a bucket that ends up with one tensor is an ordinary tensor entry.
//!
//! On the receiving side each tensor is a contiguous range of the bucket's frame, so every
//! tensor is recovered exactly as sent.
//!
//! With int8 values, a scale covers [`gradwire_core::Values::Int8`]'s `block` kept values in a
//! row, which may span two tensors of a bucket: a tensor whose gradients are far smaller than
//! its neighbours' (the MiniLM key bias, ~1e-9) then decodes to zeros. Error feedback keeps what
//! is lost, but prefer f16/bf16 values, or no buckets, for models with such tensors. Error feedback keeps residuals per tensor name, also
//! for tensors in buckets: the encoder gathers them around the bucket's frame and scatters them
//! back.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use gradwire_core::{
    Method, ResidualBound, Values, accumulate_into, encode_into, encode_selected_into,
    feedback_step, max_frame_len, select,
};
use rayon::prelude::*;

use crate::bundle::{Entry, EntryKind, Manifest, Sizes};
use crate::error::{Error, Result};
use crate::feedback::{ErrorFeedback, check_step_input};
use crate::parallel::{CHUNK, Parallelism, SPLIT_MIN, Split};
use crate::parallel_select::{Rule, Selected, SparseSplit};
use crate::tensor::Tensor;

/// Which top-k a bucket keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TopKScope {
    /// Each tensor of the bucket keeps its own top-k (`k` resolved for its own `n`), so every
    /// tensor sends as much as it would alone.
    #[default]
    PerTensor,
    /// The bucket keeps the top-k of its concatenation (`k` resolved for the bucket's `n`):
    /// tensors with larger gradients take more of the budget.
    PerBucket,
}

/// How tensors are fused into buckets and which go dense. The default fuses nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketConfig {
    /// Byte budget of a bucket, counted in dense f32 bytes (`4 * n` per tensor). Tensors of at
    /// least this many bytes get their own entry; `0` fuses nothing.
    pub bucket_bytes: usize,
    /// Which top-k a bucket keeps (top-k methods only).
    pub scope: TopKScope,
    /// Tensors with fewer elements than this are sent dense; `0` sends none dense.
    pub dense_below: usize,
    /// Value type of dense tensors: F32 (default), F16 or Bf16.
    pub dense_values: Values,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            bucket_bytes: 0,
            scope: TopKScope::PerTensor,
            dense_below: 0,
            dense_values: Values::F32,
        }
    }
}

impl BucketConfig {
    /// No buckets, nothing dense: one entry per tensor.
    pub fn none() -> Self {
        Self::default()
    }

    /// Buckets of `bucket_bytes` dense f32 bytes, per-tensor top-k, nothing dense.
    pub fn fused(bucket_bytes: usize) -> Self {
        BucketConfig {
            bucket_bytes,
            ..Self::default()
        }
    }

    /// The same configuration with another top-k scope.
    pub fn with_scope(mut self, scope: TopKScope) -> Self {
        self.scope = scope;
        self
    }

    /// The same configuration sending tensors of fewer than `dense_below` elements dense with
    /// `values`.
    pub fn with_dense_below(mut self, dense_below: usize, values: Values) -> Self {
        self.dense_below = dense_below;
        self.dense_values = values;
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] when `dense_values` is int8 (dense frames carry f32, f16 or bf16).
    pub fn validate(&self) -> Result<()> {
        if matches!(self.dense_values, Values::Int8 { .. }) {
            return Err(Error::config(
                "dense tensors travel as f32, f16 or bf16, not int8",
            ));
        }
        Ok(())
    }
}

/// One planned entry: the tensors (indices in manifest order) and whether it is dense.
#[derive(Debug)]
pub(crate) struct Planned {
    pub(crate) members: Vec<usize>,
    pub(crate) dense: bool,
}

/// Plans the entries for tensors of `numels` (manifest order), as the module docs describe.
pub(crate) fn plan(numels: &[usize], config: &BucketConfig) -> Vec<Planned> {
    // A bucket's length must fit the u32 indices of a frame's selection.
    let budget = config
        .bucket_bytes
        .min((u32::MAX as usize).saturating_mul(4));
    let mut entries: Vec<Planned> = Vec::new();
    // Open bucket per class (sparse, dense): entry index and dense bytes so far.
    let mut open: [Option<(usize, usize)>; 2] = [None, None];
    for (t, &n) in numels.iter().enumerate() {
        let dense = n < config.dense_below;
        let bytes = n.saturating_mul(4);
        if budget == 0 || bytes >= budget {
            entries.push(Planned {
                members: vec![t],
                dense,
            });
            continue;
        }
        let class = usize::from(dense);
        match open[class] {
            Some((e, used)) if used.saturating_add(bytes) <= budget => {
                entries[e].members.push(t);
                open[class] = Some((e, used.saturating_add(bytes)));
            }
            _ => {
                entries.push(Planned {
                    members: vec![t],
                    dense,
                });
                open[class] = Some((entries.len() - 1, bytes));
            }
        }
    }
    entries
}

/// Reusable buffers of one encoding task: core scratch, a bucket's gradients and residuals, and
/// the kept indices of per-tensor top-k.
#[derive(Debug, Default)]
struct Bufs {
    scratch: Vec<u32>,
    x: Vec<f32>,
    r: Vec<f32>,
    kept: Vec<u32>,
}

/// Grows `v` to at least `len` elements (never shrinks it).
pub(crate) fn grow<T: Clone + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

impl Bufs {
    /// Grows the buffers to what the entries of a manifest with `sizes` need.
    fn fit(&mut self, sizes: Sizes, feedback: bool) {
        grow(&mut self.scratch, sizes.scratch);
        if self.kept.capacity() < sizes.kept {
            self.kept.reserve(sizes.kept - self.kept.len());
        }
        if feedback {
            grow(&mut self.r, sizes.bucket);
        }
        grow(&mut self.x, sizes.bucket);
    }
}

/// One entry of a step: its frame, the residuals of its tensors while it runs, and for a large
/// top-k, threshold or random-k tensor the buffers of its chunked selection (`selected`: its
/// frame was written while checking).
#[derive(Debug, Default)]
struct Slot {
    frame: Vec<u8>,
    len: usize,
    res: Vec<Vec<f32>>,
    err: Option<Error>,
    split: SparseSplit,
    selected: bool,
    /// A large top-k tensor whose residual bound proved its sums in range in pass 1: encoded
    /// in one pass over g and r in pass 2 ([`SparseSplit::encode_one_pass`]).
    one_pass: bool,
    /// The residual bound that step left, kept by the error feedback afterwards.
    bound_after: Option<ResidualBound>,
}

/// [`Bufs`] taken from the engine's pool for one rayon task, given back when dropped.
struct Lease<'p> {
    pool: &'p Mutex<Vec<Bufs>>,
    bufs: Option<Bufs>,
}

impl Lease<'_> {
    fn get(&mut self, sizes: Sizes, feedback: bool) -> &mut Bufs {
        let pool = self.pool;
        let bufs = self.bufs.get_or_insert_with(|| {
            pool.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop()
                .unwrap_or_default()
        });
        bufs.fit(sizes, feedback);
        bufs
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(bufs) = self.bufs.take() {
            self.pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(bufs);
        }
    }
}

/// Reusable buffers of the encoder: a frame (and residual slots) per entry, and a pool of
/// [`Bufs`] (one per task that runs at the same time; one on a single thread).
#[derive(Debug, Default)]
pub(crate) struct Engine {
    slots: Vec<Slot>,
    pool: Mutex<Vec<Bufs>>,
}

/// Moves the residuals of `members` into `res[..members.len()]` (see
/// [`ErrorFeedback::take_residual`]); on error gives back those already moved.
fn take_members(
    fb: &mut ErrorFeedback,
    manifest: &Manifest,
    members: &[usize],
    res: &mut Vec<Vec<f32>>,
) -> Result<()> {
    if res.len() < members.len() {
        res.resize_with(members.len(), Vec::new);
    }
    for (i, &t) in members.iter().enumerate() {
        let info = &manifest.tensors()[t];
        if let Err(e) = fb.take_residual(&info.name, info.numel, &mut res[i]) {
            put_members(fb, manifest, &members[..i], res);
            return Err(e);
        }
    }
    Ok(())
}

/// Gives back the residuals [`take_members`] moved out.
fn put_members(
    fb: &mut ErrorFeedback,
    manifest: &Manifest,
    members: &[usize],
    res: &mut [Vec<f32>],
) {
    for (&t, r) in members.iter().zip(res.iter_mut()) {
        fb.put_residual(&manifest.tensors()[t].name, r);
    }
}

/// The gradient of tensor `t` of the manifest (empty when missing; checked before).
fn grad_of<'g>(manifest: &Manifest, grads: &'g HashMap<String, Tensor>, t: usize) -> &'g [f32] {
    manifest
        .tensors()
        .get(t)
        .and_then(|info| grads.get(&info.name))
        .map_or(&[], Tensor::data)
}

/// Checks what encoding `entry` reads (see [`check_step_input`]), tensors in member order. With
/// `parallel`, a large tensor is checked in chunks on rayon's pool (the same verdict; the error,
/// if any, found again by the serial check so that it is the same one).
fn check_entry(
    manifest: &Manifest,
    entry: &Entry,
    grads: &HashMap<String, Tensor>,
    feedback: Option<&ErrorFeedback>,
    parallel: bool,
) -> Result<()> {
    let values = entry.method.values();
    for &t in &entry.members {
        let name = &manifest.tensors()[t].name;
        let g = grad_of(manifest, grads, t);
        let residual = feedback.and_then(|fb| fb.residual(name));
        let chunks_ok = |g: &[f32], r: Option<&[f32]>| check_step_input(name, g, r, values).is_ok();
        let quick = parallel
            && g.len() >= SPLIT_MIN
            && match residual {
                None => g.par_chunks(CHUNK).all(|g| chunks_ok(g, None)),
                Some(r) if r.len() == g.len() => g
                    .par_chunks(CHUNK)
                    .zip(r.par_chunks(CHUNK))
                    .all(|(g, r)| chunks_ok(g, Some(r))),
                Some(_) => false,
            };
        if !quick {
            check_step_input(name, g, residual, values)?;
        }
    }
    Ok(())
}

/// Encodes entry `e` of `manifest` at `step` into `frame` (at least the entry's
/// `max_frame_len`) and returns the frame length. With error feedback, `res` holds the residuals
/// of the entry's tensors, in member order, and is updated. The input must have been checked.
fn encode_entry(
    bufs: &mut Bufs,
    manifest: &Manifest,
    e: usize,
    grads: &HashMap<String, Tensor>,
    step: u64,
    res: Option<&mut [Vec<f32>]>,
    frame: &mut [u8],
) -> Result<usize> {
    let tensors = manifest.tensors();
    let entry = &manifest.entries()[e];
    let grad = |t: usize| grad_of(manifest, grads, t);
    let params = manifest.params(e, step);
    let core = |err| Error::core(&entry.label, None, err);
    let len = match (&entry.kind, res) {
        (EntryKind::Tensor, None) => {
            let t = entry.members.first().copied().unwrap_or(0);
            encode_into(grad(t), &params, &mut bufs.scratch, frame).map_err(core)?
        }
        (EntryKind::Tensor, Some(res)) => {
            let t = entry.members.first().copied().unwrap_or(0);
            let residual = res
                .first_mut()
                .ok_or_else(|| Error::config("no residual"))?;
            feedback_step(grad(t), residual, &params, &mut bufs.scratch, frame).map_err(core)?
        }
        (EntryKind::Bucket { per_tensor_topk }, res) => {
            let n = entry.len;
            let x = &mut bufs.x[..n];
            let mut at = 0;
            for &t in &entry.members {
                let g = grad(t);
                x[at..at + g.len()].copy_from_slice(g);
                at += g.len();
            }
            let k = match manifest.method() {
                Method::TopK { k, .. } if *per_tensor_topk => Some(*k),
                _ => None,
            };
            let values = entry.method.values().unwrap_or(Values::F32);
            match res {
                None => match k {
                    Some(k) => {
                        select_per_tensor(
                            manifest,
                            &entry.members,
                            x,
                            k,
                            &mut bufs.scratch,
                            &mut bufs.kept,
                        );
                        encode_selected_into(x, &bufs.kept, values, &mut bufs.scratch, frame)
                            .map_err(core)?
                    }
                    None => encode_into(x, &params, &mut bufs.scratch, frame).map_err(core)?,
                },
                Some(res) => {
                    let r = &mut bufs.r[..n];
                    let mut at = 0;
                    for (&t, old) in entry.members.iter().zip(res.iter()) {
                        let seg = &mut r[at..at + tensors[t].numel];
                        if old.len() == seg.len() {
                            seg.copy_from_slice(old);
                        } else {
                            seg.fill(0.0);
                        }
                        at += seg.len();
                    }
                    let len = match k {
                        Some(k) => {
                            for (ri, xi) in r.iter_mut().zip(x.iter()) {
                                *ri += *xi;
                            }
                            select_per_tensor(
                                manifest,
                                &entry.members,
                                r,
                                k,
                                &mut bufs.scratch,
                                &mut bufs.kept,
                            );
                            let len = encode_selected_into(
                                r,
                                &bufs.kept,
                                values,
                                &mut bufs.scratch,
                                frame,
                            )
                            .map_err(core)?;
                            accumulate_into(&frame[..len], &params, r, -1.0).map_err(core)?;
                            len
                        }
                        None => {
                            feedback_step(x, r, &params, &mut bufs.scratch, frame).map_err(core)?
                        }
                    };
                    let mut at = 0;
                    for (&t, slot) in entry.members.iter().zip(res.iter_mut()) {
                        let numel = tensors[t].numel;
                        slot.clear();
                        slot.extend_from_slice(&r[at..at + numel]);
                        at += numel;
                    }
                    len
                }
            }
        }
    };
    Ok(len)
}

impl Engine {
    /// Encodes every entry of `manifest` at `step`, with error feedback when `feedback` is
    /// given (its step must be `step`), and calls `sink(entry index, frame)` for each entry in
    /// order. Everything is checked before the first residual changes or `sink` is called.
    ///
    /// One path, on one thread or on rayon's pool (`parallelism`): pass 1 checks every entry
    /// (a large top-k, threshold or random-k tensor by its chunked selection, which writes its
    /// frame on the way), pass 2 encodes the others, each entry into its own frame buffer, and
    /// updates the residuals; then `sink` in manifest order. In parallel, entries run on the
    /// pool, and so do chunks of large dense, quantization, sign, top-k, threshold and random-k
    /// tensors; the frames and residuals are the same bytes and bits either way.
    pub(crate) fn encode(
        &mut self,
        manifest: &Manifest,
        grads: &HashMap<String, Tensor>,
        step: u64,
        mut feedback: Option<&mut ErrorFeedback>,
        parallelism: Parallelism,
        mut sink: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        manifest.check_gradients(grads)?;
        let entries = manifest.entries();
        if self.slots.len() < entries.len() {
            self.slots.resize_with(entries.len(), Slot::default);
        }
        let slots = &mut self.slots[..entries.len()];
        let pool = &self.pool;
        let fb = feedback.as_deref_mut();
        if parallelism.is_parallel_for(manifest.flat_len()) {
            // One entry into rayon's pool for the whole step (a call from outside the pool
            // waits for each job it injects).
            rayon::scope(|_| encode_slots(manifest, grads, step, fb, slots, pool, true))?;
        } else {
            encode_slots(manifest, grads, step, fb, slots, pool, false)?;
        }
        for (e, slot) in slots.iter().enumerate() {
            sink(e, &slot.frame[..slot.len]);
        }
        if let Some(fb) = feedback {
            // The step succeeded: each residual remembers its tensor's shape from now on.
            for info in manifest.tensors() {
                fb.remember_shape(&info.name, &info.shape);
            }
            fb.advance();
        }
        Ok(())
    }
}

/// Runs `f(index, item)` for every item, on rayon's pool when `parallel`, else in order.
fn for_each_slot<T: Send>(items: &mut [T], parallel: bool, f: impl Fn(usize, &mut T) + Sync) {
    if parallel {
        items.par_iter_mut().enumerate().for_each(|(i, t)| f(i, t));
    } else {
        items.iter_mut().enumerate().for_each(|(i, t)| f(i, t));
    }
}

/// The work of one step: checks (a large top-k, threshold or random-k tensor's by its chunked
/// selection, which writes its frame), residuals moved into the slots, every other entry
/// encoded into its slot and every residual updated, residuals given back. With `parallel`,
/// entries and chunks of large tensors run on rayon's pool. The first error in manifest order;
/// on a check error nothing changed.
fn encode_slots(
    manifest: &Manifest,
    grads: &HashMap<String, Tensor>,
    step: u64,
    mut feedback: Option<&mut ErrorFeedback>,
    slots: &mut [Slot],
    pool: &Mutex<Vec<Bufs>>,
    parallel: bool,
) -> Result<()> {
    let entries = manifest.entries();
    // Pass 1: every check, before anything changes; the first error in manifest order. A large
    // top-k, threshold or random-k tensor is checked by its chunked selection, which writes its
    // frame on the way (reading the residual, not changing it).
    {
        let fb = feedback.as_deref();
        for_each_slot(slots, parallel, |e, slot| {
            slot.selected = false;
            slot.one_pass = false;
            slot.bound_after = None;
            // A residual restored or kept in another shape (a transposed weight) first.
            if let Some(fb) = fb {
                let shapes = entries[e].members.iter().map(|&t| &manifest.tensors()[t]);
                if let Some(err) = shapes
                    .map(|info| fb.check_shape(&info.name, &info.shape))
                    .find_map(Result::err)
                {
                    slot.err = Some(err);
                    return;
                }
            }
            if let Some(fb) = fb
                && proved_by_bound(manifest, &entries[e], grads, fb, parallel)
            {
                slot.one_pass = true;
                return;
            }
            if select_in_chunks(manifest, e, grads, step, fb, slot, parallel) {
                return;
            }
            slot.err = check_entry(manifest, &entries[e], grads, fb, parallel).err();
        });
    }
    first_error(slots)?;
    // The residuals move into the slots, so that each task owns its entry's.
    if let Some(fb) = feedback.as_deref_mut() {
        for (e, (slot, entry)) in slots.iter_mut().zip(entries).enumerate() {
            if let Err(err) = take_members(fb, manifest, &entry.members, &mut slot.res) {
                for (slot, entry) in slots[..e].iter_mut().zip(entries) {
                    put_members(fb, manifest, &entry.members, &mut slot.res);
                }
                return Err(err);
            }
        }
    }
    // Pass 2: the checks above cover every error of the kernels. Each task takes one set of
    // scratch buffers from the pool for all the entries it encodes.
    let sizes = manifest.sizes();
    let ef = feedback.is_some();
    let work = |lease: &mut Lease<'_>, e: usize, slot: &mut Slot| {
        let entry = &entries[e];
        if slot.selected {
            // The frame is written; with error feedback the residual follows it.
            if let Some(r) = slot.res.first_mut().filter(|_| ef) {
                let t = entry.members.first().copied().unwrap_or(0);
                let g = grad_of(manifest, grads, t);
                slot.bound_after = Some(slot.split.update_residual(g, r, parallel));
            }
            return;
        }
        let need = max_frame_len(entry.len, &entry.method);
        grow(&mut slot.frame, need);
        let frame = &mut slot.frame[..need];
        if slot.one_pass {
            let t = entry.members.first().copied().unwrap_or(0);
            let g = grad_of(manifest, grads, t);
            let params = manifest.params(e, step);
            let done = match slot.res.first_mut().filter(|_| ef) {
                Some(r) => slot.split.encode_one_pass(&params, g, r, frame, parallel),
                None => None,
            };
            match done {
                Some((len, bound)) => {
                    slot.len = len;
                    slot.bound_after = Some(bound);
                }
                None => {
                    // Unreachable after pass 1's proof (a bug if it happens).
                    slot.err = Some(Error::config(format!(
                        "`{}`: the one-pass error-feedback step failed after pass 1 proved its \
                         input in range (a bug in gradwire)",
                        entry.label
                    )));
                }
            }
            return;
        }
        let res = if ef {
            Some(&mut slot.res[..entry.members.len()])
        } else {
            None
        };
        // Split into chunks of tiles also on one thread: `r += g`, encode and `r -= decoded`
        // per tile while it is in cache (one pass over g and r where the core's
        // `feedback_step`, which must check before it writes, makes two).
        let split = match entry.kind {
            EntryKind::Tensor => Split::new(entry.len, &entry.method),
            EntryKind::Bucket { .. } => None,
        };
        let params = manifest.params(e, step);
        let result = match split {
            Some(split) => {
                let t = entry.members.first().copied().unwrap_or(0);
                let g = grad_of(manifest, grads, t);
                let r = res.and_then(|r| r.first_mut()).map(Vec::as_mut_slice);
                split
                    .encode(&params, g, r, frame, parallel)
                    .ok_or_else(|| Error::config(format!("`{}` could not be split", entry.label)))
            }
            None => encode_entry(lease.get(sizes, ef), manifest, e, grads, step, res, frame),
        };
        match result {
            Ok(len) => slot.len = len,
            Err(err) => slot.err = Some(err),
        }
    };
    if parallel {
        slots.par_iter_mut().enumerate().for_each_init(
            || Lease { pool, bufs: None },
            |lease, (e, slot)| work(lease, e, slot),
        );
    } else {
        let mut lease = Lease { pool, bufs: None };
        for (e, slot) in slots.iter_mut().enumerate() {
            work(&mut lease, e, slot);
        }
    }
    if let Some(fb) = feedback {
        for (slot, entry) in slots.iter_mut().zip(entries) {
            put_members(fb, manifest, &entry.members, &mut slot.res);
            if let (Some(bound), Some(&t)) = (slot.bound_after, entry.members.first()) {
                fb.keep_bound(&manifest.tensors()[t].name, bound);
            }
        }
    }
    first_error(slots)
}

/// Whether entry `entry` is one large top-k tensor whose residual's bound and gradient prove
/// every `g + r` in range ([`ResidualBound::proves_in_range`]; a residual not made yet is zeros),
/// so that pass 2 encodes it in one pass ([`SparseSplit::encode_one_pass`]). The gradient is
/// read in chunks on rayon's pool with `parallel`.
fn proved_by_bound(
    manifest: &Manifest,
    entry: &Entry,
    grads: &HashMap<String, Tensor>,
    fb: &ErrorFeedback,
    parallel: bool,
) -> bool {
    let (EntryKind::Tensor, Some(Rule::TopK(_)), Some(&t)) = (
        &entry.kind,
        Rule::of(entry.len, &entry.method),
        entry.members.first(),
    ) else {
        return false;
    };
    let name = &manifest.tensors()[t].name;
    let g = grad_of(manifest, grads, t);
    let bound = match fb.residual(name) {
        None => ResidualBound::ZERO,
        Some(r) if r.len() == g.len() => fb.bound(name),
        Some(_) => return false,
    };
    let values = entry.method.values();
    g.len() == entry.len
        && match parallel {
            true => g
                .par_chunks(CHUNK)
                .all(|c| bound.proves_in_range(c, values)),
            false => bound.proves_in_range(g, values),
        }
}

/// Pass 1 for entry `e` when it is one large top-k, threshold or random-k tensor: selects in
/// chunks (on rayon's pool with `parallel`) and writes its frame into the slot
/// (`slot.selected`), reading the gradient and, with `feedback`, the residual. `true` when done
/// (frame written, or the error of a bad value set); `false` when the entry takes the ordinary
/// check and encoder (another kind of entry, no residual yet, the sample missed).
fn select_in_chunks(
    manifest: &Manifest,
    e: usize,
    grads: &HashMap<String, Tensor>,
    step: u64,
    feedback: Option<&ErrorFeedback>,
    slot: &mut Slot,
    parallel: bool,
) -> bool {
    let entry = &manifest.entries()[e];
    let rule = match entry.kind {
        EntryKind::Tensor => Rule::of(entry.len, &entry.method),
        EntryKind::Bucket { .. } => None,
    };
    let Some(rule) = rule else {
        return false;
    };
    let t = entry.members.first().copied().unwrap_or(0);
    let g = grad_of(manifest, grads, t);
    let r = match feedback {
        None => None,
        // Before its first step a residual is zeros, and `g + 0` is not always `g` (-0.0):
        // that step takes the ordinary way, and sizes the buffers for the next one.
        Some(fb) => match fb.residual(&manifest.tensors()[t].name) {
            Some(r) => Some(r),
            None => {
                slot.split.reserve(entry.len, rule, parallel);
                return false;
            }
        },
    };
    let need = max_frame_len(entry.len, &entry.method);
    grow(&mut slot.frame, need);
    let params = manifest.params(e, step);
    match slot
        .split
        .encode(&params, g, r, &mut slot.frame[..need], parallel)
    {
        Selected::Frame(len) => {
            slot.len = len;
            slot.selected = true;
            true
        }
        Selected::OutOfLimit => {
            // The serial check names the bad value; it cannot pass.
            slot.err = Some(
                check_entry(manifest, entry, grads, feedback, false)
                    .err()
                    .unwrap_or_else(|| Error::config(format!("`{}`: bad value", entry.label))),
            );
            true
        }
        Selected::Serial => false,
    }
}

/// The first error of `slots` in order; every slot's error is cleared.
fn first_error(slots: &mut [Slot]) -> Result<()> {
    let mut first = None;
    for slot in slots {
        if let Some(err) = slot.err.take()
            && first.is_none()
        {
            first = Some(err);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Fills `kept` with each member's own top-k indices (bucket coordinates, ascending).
fn select_per_tensor(
    manifest: &Manifest,
    members: &[usize],
    x: &[f32],
    k: gradwire_core::K,
    scratch: &mut [u32],
    kept: &mut Vec<u32>,
) {
    kept.clear();
    let hist = select::topk_scratch_len(x.len()).min(scratch.len());
    let scratch = &mut scratch[..hist];
    let mut at = 0usize;
    for &t in members {
        let n = manifest.tensors().get(t).map_or(0, |i| i.numel);
        let seg = &x[at..at + n];
        let kt = usize::try_from(k.resolve(n as u64)).unwrap_or(n);
        let sel = select::topk(seg, kt, scratch);
        select::for_each_kept(seg, sel, |i| kept.push((at + i) as u32));
        at += n;
    }
}

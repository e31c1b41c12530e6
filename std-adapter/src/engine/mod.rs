//! The one encoder: every entry of a [`Manifest`], with or without error feedback, on the calling
//! thread or on rayon's pool ([`Exec`]), by the plan the manifest chose for it
//! ([`EncodePlan`]). Compression ([`crate::GradientCompressor`]), the all-reduce and the
//! error-feedback steps ([`ErrorFeedback::step_with`]) all run it.
//!
//! A step has two passes. Pass 1 checks every entry before anything changes (a residual kept in
//! another shape, NaN/Inf in the gradient or in `gradient + residual`, the value type's range);
//! a large top-k, threshold or random-k tensor is checked by its chunked selection, which writes
//! its frame on the way, or, for top-k with error feedback whose residual bound proves every sum
//! in range, by a check of the gradient alone. The first error in manifest order ends the step
//! with nothing changed. Pass 2 encodes every other entry into its own frame buffer and updates
//! the residuals, each in one core call per piece: the core's `encode_into` or
//! `feedback_step_bounded` for a whole tensor, `feedback_step` or the core's encode and
//! `accumulate_into(-1)` for a bucket, and for chunks the same per chunk
//! ([`dense_chunks`], [`sparse_chunks`]). Then the frames go to the caller's sink in manifest
//! order. Entries never share a buffer and every element sees the same operations in the same
//! order on one thread or many, so the bytes and bits are the same.
//!
//! Memory: one frame buffer per entry ([`Manifest::max_bundle_len`] in all), one set of
//! scratch buffers per task running at the same time, and per large top-k, threshold or random-k
//! tensor the lists of its chunked selection; all kept between calls, so that a steady-state
//! step allocates nothing (rayon itself may allocate for its job bookkeeping).

mod buffers;
mod check;
pub(crate) mod dense_chunks;
mod entry;
mod exec;
pub(crate) mod low_rank;
pub(crate) mod randomk_draw;
pub(crate) mod shard;
pub(crate) mod sparse_chunks;
pub(crate) mod sparse_list;
mod steps;

use std::collections::HashMap;

use gradwire_core::{ResidualBound, max_frame_len};

pub use self::exec::Parallelism;

pub(crate) use self::buffers::{Pool, grow};
pub(crate) use self::exec::Exec;

use self::check::check_entry;
use self::dense_chunks::Split;
use self::entry::{Bufs, encode_bucket, encode_whole};
use self::sparse_chunks::{Selected, SparseSplit};
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::layout::plan::{EncodePlan, Rule};
use crate::layout::{Entry, Manifest};
use crate::tensor::Tensor;

/// Gradients for the engine, looked up by the manifest's tensor index (checked against the
/// manifest by the caller).
pub(crate) trait Gradients: Sync {
    /// The gradient of the manifest's tensor `t`.
    fn grad(&self, manifest: &Manifest, t: usize) -> &[f32];
}

impl Gradients for HashMap<String, Tensor> {
    fn grad(&self, manifest: &Manifest, t: usize) -> &[f32] {
        manifest
            .tensors()
            .get(t)
            .and_then(|info| self.get(&info.name))
            .map_or(&[], Tensor::data)
    }
}

impl Gradients for [&[f32]] {
    fn grad(&self, _: &Manifest, t: usize) -> &[f32] {
        self.get(t).copied().unwrap_or(&[])
    }
}

/// Which of the engine's paths the frames of a compressor took, counted over all its steps.
/// For tests and diagnostics: the bytes are the same whichever path runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EncodeStats {
    /// Frames of large top-k, threshold and random-k tensors whose entries the chunked
    /// selection found (rather than the core's selection: the sample missed or overshot, or,
    /// with error feedback, the tensor's first step).
    pub selected_in_chunks: u64,
    /// Error-feedback frames of large top-k tensors written in one pass over the gradient and
    /// the residual (the residual's bound proved every sum in range).
    pub one_pass: u64,
}

/// How a step treats shapes: a shaped step checks each tensor's shape against the one its
/// residual remembers and remembers it; an unshaped one checks element counts only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shapes {
    Checked,
    Ignored,
}

/// What pass 1 did for an entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Pass1 {
    /// Checked: pass 2 encodes it by its plan.
    #[default]
    Checked,
    /// Its frame is written (chunked selection); with error feedback its residual follows.
    Selected,
    /// A large top-k tensor whose residual bound proved its sums in range: pass 2 encodes it
    /// in one pass over g and r.
    OnePass,
}

/// One entry of a step: its frame, the residuals of its tensors while it runs, and for a large
/// sparse tensor the buffers of its chunked selection.
#[derive(Debug)]
struct Slot {
    frame: Vec<u8>,
    len: usize,
    res: Vec<Vec<f32>>,
    err: Option<Error>,
    split: SparseSplit,
    pass1: Pass1,
    /// A whole tensor's residual bound before the step (zero for a new residual).
    bound: ResidualBound,
    /// The residual bound the step left, kept by the error feedback afterwards.
    bound_after: Option<ResidualBound>,
    stats: EncodeStats,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            frame: Vec::new(),
            len: 0,
            res: Vec::new(),
            err: None,
            split: SparseSplit::default(),
            pass1: Pass1::Checked,
            bound: ResidualBound::ZERO,
            bound_after: None,
            stats: EncodeStats::default(),
        }
    }
}

/// Reusable buffers of the encoder: a frame (and residual slots) per entry, and a pool of
/// scratch sets, one per task that runs at the same time.
#[derive(Debug, Default)]
pub(crate) struct Engine {
    slots: Vec<Slot>,
    pool: Pool<Bufs>,
    stats: EncodeStats,
}

impl Engine {
    /// What the steps so far did (see [`EncodeStats`]).
    #[cfg(test)]
    pub(crate) fn stats(&self) -> EncodeStats {
        self.stats
    }

    /// Encodes every entry of `manifest` at `step`, with error feedback when `feedback` is
    /// given (its step must be `step`), and calls `sink(entry index, frame)` for each entry in
    /// order; then the error feedback advances by one step. `grads` was checked against the
    /// manifest (names, shapes). Everything is checked before the first residual changes or
    /// `sink` is called: on error nothing changed.
    pub(crate) fn encode<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        grads: &G,
        step: u64,
        mut feedback: Option<&mut ErrorFeedback>,
        (exec, shapes): (Exec, Shapes),
        mut sink: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        let entries = manifest.entries();
        if self.slots.len() < entries.len() {
            self.slots.resize_with(entries.len(), Slot::default);
        }
        let slots = &mut self.slots[..entries.len()];
        let pool = &self.pool;
        let fb = feedback.as_deref_mut();
        let step_in = Step {
            manifest,
            grads,
            step,
            exec,
            shapes,
        };
        exec.install(|| step_in.run(fb, slots, pool))?;
        for (e, slot) in slots.iter().enumerate() {
            sink(e, &slot.frame[..slot.len]);
            self.stats.selected_in_chunks += slot.stats.selected_in_chunks;
            self.stats.one_pass += slot.stats.one_pass;
        }
        if let Some(fb) = feedback {
            if shapes == Shapes::Checked {
                // The step succeeded: each residual remembers its tensor's shape from now on.
                for info in manifest.tensors() {
                    fb.remember_shape(&info.name, &info.shape);
                }
            }
            fb.advance();
        }
        Ok(())
    }

    /// Puts `sent`, what a step sent of `name` (decoded), back into its residual in
    /// `feedback`, after a collective that failed once the residuals had given those values up:
    /// the step's gradient is then delayed, not lost (`residual + sent` is `gradient + old
    /// residual`, up to the f32 rounding of the error-feedback identity).
    pub(crate) fn give_back(feedback: &mut ErrorFeedback, name: &str, sent: &[f32]) -> Result<()> {
        let r = feedback.residual_for(name, sent.len())?;
        for (r, &x) in r.iter_mut().zip(sent) {
            *r += x;
        }
        Ok(())
    }
}

/// One step's input.
struct Step<'a, G: ?Sized> {
    manifest: &'a Manifest,
    grads: &'a G,
    step: u64,
    exec: Exec,
    shapes: Shapes,
}

impl<G: Gradients + ?Sized> Step<'_, G> {
    /// The gradient of the manifest's tensor `t`.
    fn grad(&self, t: usize) -> &[f32] {
        self.grads.grad(self.manifest, t)
    }

    /// The gradient of a one-tensor entry.
    fn grad_of(&self, entry: &Entry) -> &[f32] {
        entry.members.first().map_or(&[], |&t| self.grad(t))
    }

    /// Both passes (see the module docs). The first error in manifest order; on a check error
    /// nothing changed.
    fn run(
        &self,
        mut feedback: Option<&mut ErrorFeedback>,
        slots: &mut [Slot],
        pool: &Pool<Bufs>,
    ) -> Result<()> {
        let entries = self.manifest.entries();
        {
            let fb = feedback.as_deref();
            self.exec
                .for_each(slots, |e, slot| self.check(&entries[e], fb, slot));
        }
        first_error(slots)?;
        // The residuals move into the slots, so that each task owns its entry's.
        if let Some(fb) = feedback.as_deref_mut() {
            for (e, (slot, entry)) in slots.iter_mut().zip(entries).enumerate() {
                if let Err(err) = take_members(fb, self.manifest, entry, &mut slot.res) {
                    for (slot, entry) in slots[..e].iter_mut().zip(entries) {
                        put_members(fb, self.manifest, entry, &mut slot.res);
                    }
                    return Err(err);
                }
            }
        }
        let ef = feedback.is_some();
        self.exec.for_each_with(
            slots,
            || pool.lease(),
            |lease, e, slot| {
                if let Err(err) = self.encode(lease.get(), &entries[e], slot, ef) {
                    slot.err = Some(err);
                }
            },
        );
        if let Some(fb) = feedback {
            for (slot, entry) in slots.iter_mut().zip(entries) {
                put_members(fb, self.manifest, entry, &mut slot.res);
                if let (Some(bound), Some(&t)) = (slot.bound_after, entry.members.first()) {
                    fb.keep_bound(&self.manifest.tensors()[t].name, bound);
                }
            }
        }
        first_error(slots)
    }

    /// Pass 1 for one entry: its checks, or the chunked selection that checks while it writes
    /// the frame (reading the residual, not changing it).
    fn check(&self, entry: &Entry, fb: Option<&ErrorFeedback>, slot: &mut Slot) {
        slot.pass1 = Pass1::Checked;
        slot.bound = ResidualBound::ZERO;
        slot.bound_after = None;
        slot.stats = EncodeStats::default();
        if let Some(fb) = fb {
            // A residual restored or kept in another shape (a transposed weight) first.
            if self.shapes == Shapes::Checked {
                let tensors = entry.members.iter().map(|&t| &self.manifest.tensors()[t]);
                let mismatch = tensors
                    .map(|info| fb.check_shape(&info.name, &info.shape))
                    .find_map(Result::err);
                if let Some(err) = mismatch {
                    slot.err = Some(err);
                    return;
                }
            }
            if let Some(&t) = entry.members.first() {
                let name = &self.manifest.tensors()[t].name;
                if fb.residual(name).is_some() {
                    slot.bound = fb.residual_bound(name);
                }
            }
        }
        if let EncodePlan::SparseChunks(rule) = entry.encode {
            if let Some(fb) = fb
                && self.proves_one_pass(entry, rule, fb, slot.bound)
            {
                slot.pass1 = Pass1::OnePass;
                return;
            }
            if self.select_in_chunks(entry, rule, fb, slot) {
                return;
            }
        }
        slot.err = check_entry(self.manifest, entry, self.grads, fb, self.exec).err();
    }

    /// Whether the large top-k tensor of `entry` can take the one-pass step: its residual (of
    /// the gradient's length; a new one is zeros) has a `bound` that, with the gradient, proves
    /// every `g + r` in range ([`ResidualBound::proves_in_range`]).
    fn proves_one_pass(
        &self,
        entry: &Entry,
        rule: Rule,
        fb: &ErrorFeedback,
        bound: ResidualBound,
    ) -> bool {
        let (Rule::TopK(_), Some(&t)) = (rule, entry.members.first()) else {
            return false;
        };
        let g = self.grad(t);
        let same_len = fb
            .residual(&self.manifest.tensors()[t].name)
            .is_none_or(|r| r.len() == g.len());
        let values = entry.method.values();
        same_len
            && g.len() == entry.len
            && self.exec.chunks_all(g, crate::layout::plan::CHUNK, |c| {
                bound.proves_in_range(c, values)
            })
    }

    /// Pass 1 of a large sparse tensor by its chunked selection, which writes the frame into
    /// the slot (`Pass1::Selected`), reading the gradient and the residual. `true` when done
    /// (frame written, or the error of a bad value set); `false` when the entry takes the
    /// ordinary check and the core's encoder (no residual yet, the sample missed).
    fn select_in_chunks(
        &self,
        entry: &Entry,
        rule: Rule,
        fb: Option<&ErrorFeedback>,
        slot: &mut Slot,
    ) -> bool {
        let g = self.grad_of(entry);
        let r = match fb {
            None => None,
            // Before its first step a residual is zeros, and `g + 0` is not always `g` (-0.0):
            // that step takes the core's way, and sizes the buffers for the next one.
            Some(fb) => match entry
                .members
                .first()
                .and_then(|&t| fb.residual(&self.manifest.tensors()[t].name))
            {
                Some(r) => Some(r),
                None => {
                    slot.split.reserve(entry.len, rule, self.exec);
                    return false;
                }
            },
        };
        let need = max_frame_len(entry.len, &entry.method);
        grow(&mut slot.frame, need);
        let params = self.manifest.params(entry, self.step);
        let frame = &mut slot.frame[..need];
        match slot.split.encode(rule, &params, g, r, frame, self.exec) {
            Selected::Frame(len) => {
                slot.len = len;
                slot.pass1 = Pass1::Selected;
                slot.stats.selected_in_chunks += 1;
                true
            }
            Selected::OutOfLimit => {
                // The serial check names the bad value; it cannot pass.
                let named = check_entry(self.manifest, entry, self.grads, fb, Exec::Serial).err();
                slot.err = Some(named.unwrap_or_else(|| {
                    Error::internal(format!(
                        "`{}`: a bad value the check did not find",
                        entry.label
                    ))
                }));
                true
            }
            Selected::Serial => false,
        }
    }

    /// Pass 2 for one entry (checked in pass 1): its frame and residual update.
    fn encode(&self, bufs: &mut Bufs, entry: &Entry, slot: &mut Slot, ef: bool) -> Result<()> {
        let g = self.grad_of(entry);
        let exec = self.exec;
        if slot.pass1 == Pass1::Selected {
            // The frame is written; with error feedback the residual follows it.
            if let Some(r) = slot.res.first_mut().filter(|_| ef) {
                slot.bound_after = Some(slot.split.update_residual(g, r, exec));
            }
            return Ok(());
        }
        let need = max_frame_len(entry.len, &entry.method);
        grow(&mut slot.frame, need);
        let frame = &mut slot.frame[..need];
        let params = self.manifest.params(entry, self.step);
        let residual = slot.res.first_mut().filter(|_| ef);
        let internal = |what: &str| Error::internal(format!("`{}`: {what}", entry.label));
        slot.len = match (slot.pass1, entry.encode) {
            (Pass1::OnePass, EncodePlan::SparseChunks(rule)) => {
                let r = residual.ok_or_else(|| internal("one pass without a residual"))?;
                let (len, bound, chunked) = slot
                    .split
                    .encode_one_pass(rule, &params, g, r, frame, exec)
                    .ok_or_else(|| internal("the one-pass step failed after its proof"))?;
                slot.bound_after = Some(bound);
                slot.stats.one_pass += 1;
                slot.stats.selected_in_chunks += u64::from(chunked);
                len
            }
            (_, EncodePlan::DenseChunks) => Split::new(entry.len, &entry.method)
                .and_then(|split| {
                    split.encode(&params, g, residual.map(Vec::as_mut_slice), frame, exec)
                })
                .ok_or_else(|| internal("the chunked encoder refused a checked tensor"))?,
            (_, EncodePlan::Bucket) => {
                let res = ef.then(|| &mut slot.res[..entry.members.len()]);
                let bufs = bufs.fit(self.manifest, ef);
                encode_bucket(bufs, self.manifest, entry, self.grads, &params, res, frame)?
            }
            (_, EncodePlan::Whole | EncodePlan::SparseChunks(_)) => {
                let bufs = bufs.fit(self.manifest, ef);
                let mut bound = slot.bound;
                let len = encode_whole(
                    &mut bufs.scratch,
                    &entry.label,
                    g,
                    &params,
                    residual.map(|r| (r.as_mut_slice(), &mut bound)),
                    frame,
                )?;
                if ef {
                    slot.bound_after = Some(bound);
                }
                len
            }
        };
        Ok(())
    }
}

/// Moves the residuals of `entry`'s tensors into `res[..members]` (see
/// [`ErrorFeedback::take_residual`]); on error gives back those already moved.
fn take_members(
    fb: &mut ErrorFeedback,
    manifest: &Manifest,
    entry: &Entry,
    res: &mut Vec<Vec<f32>>,
) -> Result<()> {
    let members = &entry.members;
    if res.len() < members.len() {
        res.resize_with(members.len(), Vec::new);
    }
    for (i, &t) in members.iter().enumerate() {
        let info = &manifest.tensors()[t];
        if let Err(e) = fb.take_residual(&info.name, info.numel, &mut res[i]) {
            for (&t, r) in members[..i].iter().zip(res.iter_mut()) {
                fb.put_residual(&manifest.tensors()[t].name, r);
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Gives back the residuals [`take_members`] moved out.
fn put_members(fb: &mut ErrorFeedback, manifest: &Manifest, entry: &Entry, res: &mut [Vec<f32>]) {
    for (&t, r) in entry.members.iter().zip(res.iter_mut()) {
        fb.put_residual(&manifest.tensors()[t].name, r);
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

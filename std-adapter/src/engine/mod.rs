//! The one encoder: every entry of a [`Manifest`], with or without error feedback, on the calling
//! thread or on rayon's pool ([`Exec`]), by the plan the manifest chose for it
//! ([`EncodePlan`]). Compression ([`crate::GradientCompressor`]), the all-reduce and the
//! error-feedback steps ([`ErrorFeedback::step_with`]) all run it.
//!
//! A step has two passes. Pass 1 checks every entry before anything changes (a residual kept in
//! another shape, NaN/Inf in the gradient or in `gradient + residual`, without error feedback the
//! value type's range);
//! a large top-k, threshold or random-k tensor is checked by its chunked selection, which writes
//! its frame on the way, or, for top-k with error feedback whose residual bound proves every sum
//! finite, by a check of the gradient alone; a large dense, quantization or sign tensor
//! without error feedback is left to its chunked encoder, which checks each element as it
//! writes it (nothing else changes in such a step, so the gradient is read once; a bad value is
//! then named as the check names it, and an earlier entry left so is checked before a later
//! entry's error is reported). The first error in manifest order ends the step with nothing
//! changed. Pass 2 encodes every other entry into its frame's region and updates the residuals,
//! each in one core call per piece: the core's `encode_into` or `feedback_step_bounded` for a
//! whole tensor, `feedback_step` or the core's encode and `accumulate_into(-1)` for a bucket,
//! and for chunks the same per chunk ([`dense_chunks`], [`sparse_chunks`]). Entries never share
//! a buffer and every element sees the same operations in the same order on one thread or many,
//! so the bytes and bits are the same.
//!
//! Frames are written where they are sent from: [`Engine::encode_bundle`] lays the bundle out
//! with each entry's largest frame, writes every frame in its place, then closes the gaps that
//! shorter frames left (none for dense, quantization, top-k and random-k frames and for sign
//! frames without a zero mask, whose length is fixed); [`Engine::encode`] writes into the
//! engine's own buffer and hands each frame to a sink. A bundle of dense frames without error
//! feedback is written as it is sent instead, window by window, never whole
//! ([`dense_stream`]: its gradients checked first, the same bytes).
//!
//! Memory: the frames ([`Manifest::max_bundle_len`] in all: the caller's bundle, or the
//! engine's buffer for a sink), one set of scratch buffers per task running at the same time,
//! and for the chunked selections of large top-k, threshold and random-k tensors one set of
//! lists sized for the largest of them on one thread, or per tensor on the pool (each also
//! keeps the sent entries it decoded); all kept between calls, so that a steady-state step
//! allocates nothing (rayon itself may allocate for its job bookkeeping).

mod buffers;
mod check;
pub(crate) mod dense_chunks;
pub(crate) mod dense_stream;
mod entry;
mod exec;
pub(crate) mod low_rank;
pub(crate) mod randomk_draw;
pub(crate) mod shard;
pub(crate) mod sparse_chunks;
pub(crate) mod sparse_list;
mod steps;

use std::collections::HashMap;
use std::ops::Range;

use gradwire_core::{ResidualBound, max_frame_len};

pub use self::exec::Parallelism;

pub(crate) use self::buffers::{Lease, Pool, grow};
pub(crate) use self::exec::Exec;

use self::check::check_entry;
use self::dense_chunks::Split;
use self::entry::{Bufs, encode_bucket, encode_whole};
use self::sparse_chunks::{SelectScratch, SelectSizes, Selected, SparseSplit};
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::layout::plan::{EncodePlan, Rule};
use crate::layout::{Entry, Manifest, bundle};
use crate::tensor::Tensor;

/// Gradients for the engine, looked up by the manifest's tensor index (checked against the
/// manifest by the caller).
pub(crate) trait Gradients: Sync {
    /// The gradient of the manifest's tensor `t`.
    fn grad(&self, manifest: &Manifest, t: usize) -> &[f32];

    /// Checks that the gradients are the manifest's tensors with their shapes (nothing to
    /// check for buffers bound to the manifest when they were made).
    ///
    /// # Errors
    /// As [`Manifest::check_gradients`].
    fn check(&self, _manifest: &Manifest) -> Result<()> {
        Ok(())
    }
}

impl Gradients for HashMap<String, Tensor> {
    fn grad(&self, manifest: &Manifest, t: usize) -> &[f32] {
        manifest
            .tensors()
            .get(t)
            .and_then(|info| self.get(&info.name))
            .map_or(&[], Tensor::data)
    }

    fn check(&self, manifest: &Manifest) -> Result<()> {
        manifest.check_gradients(self)
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
    /// Checked (or, with error feedback, every sum proven finite by the residual's bound and
    /// one read of the gradient): pass 2 encodes it by its plan.
    #[default]
    Checked,
    /// Its frame is written (chunked selection); with error feedback its residual follows.
    Selected,
    /// A large top-k tensor whose residual bound proved its sums in range: pass 2 encodes it
    /// in one pass over g and r.
    OnePass,
    /// Not checked: a large dense, quantization or sign tensor without error feedback, whose
    /// chunked encoder checks every element as it writes it (nothing else changes), so that
    /// the gradient is read once; pass 2 names a bad value as the check would.
    Deferred,
}

/// One entry of a step: its frame, the residuals of its tensors while it runs, and for a large
/// sparse tensor the buffers of its chunked selection.
#[derive(Debug)]
struct Slot {
    /// The length of the entry's frame, written in its region of the step's buffer.
    len: usize,
    res: Vec<Vec<f32>>,
    err: Option<Error>,
    split: SparseSplit,
    /// The scratch of its chunked selection on the pool (serial steps share one set).
    scratch: SelectScratch,
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
            len: 0,
            res: Vec::new(),
            err: None,
            split: SparseSplit::default(),
            scratch: SelectScratch::default(),
            pass1: Pass1::Checked,
            bound: ResidualBound::ZERO,
            bound_after: None,
            stats: EncodeStats::default(),
        }
    }
}

/// Reusable buffers of the encoder: residual slots per entry, a pool of scratch sets, one per
/// task that runs at the same time, and the frames of [`Engine::encode`].
#[derive(Debug, Default)]
pub(crate) struct Engine {
    slots: Vec<Slot>,
    pool: Pool<Bufs>,
    /// The chunked selections' scratch, one set per task selecting at the same time.
    selections: Pool<SelectScratch>,
    stats: EncodeStats,
    /// [`Engine::encode`]'s frames: entry `e`'s in `frames[regions[e]]`.
    frames: Vec<u8>,
    regions: Vec<Range<usize>>,
}

impl Engine {
    /// The chunked selections' scratch sets: shared ones (in the pool) and entries' own ones
    /// that hold lists.
    #[cfg(test)]
    pub(crate) fn selection_sets(&self) -> (usize, usize) {
        let own = self
            .slots
            .iter()
            .filter(|s| s.scratch.holds_lists())
            .count();
        (self.selections.free(), own)
    }

    /// How many entries hold a list of sent entries of their own (a one-pass top-k step keeps
    /// them in its selection's scratch instead, one list for all tensors).
    #[cfg(test)]
    pub(crate) fn own_sent_lists(&self) -> usize {
        self.slots.iter().filter(|s| s.split.holds_sent()).count()
    }

    /// The largest core scratch a free set of the pool holds, in elements (capacity).
    #[cfg(test)]
    pub(crate) fn core_scratch(&self) -> usize {
        let mut most = 0;
        self.pool
            .for_each_free(|b| most = most.max(b.scratch.capacity()));
        most
    }

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
        feedback: Option<&mut ErrorFeedback>,
        (exec, shapes): (Exec, Shapes),
        mut sink: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        let mut frames = std::mem::take(&mut self.frames);
        let mut regions = std::mem::take(&mut self.regions);
        regions.clear();
        let mut at = 0usize;
        for entry in manifest.entries() {
            let need = max_frame_len(entry.len, &entry.method);
            regions.push(at..at.saturating_add(need));
            at = at.saturating_add(need);
        }
        grow(&mut frames, at);
        let result = self
            .encode_into(
                manifest,
                grads,
                step,
                feedback,
                (exec, shapes),
                &mut frames,
                &regions,
                None,
            )
            .map(|_| ());
        if result.is_ok() {
            for (e, region) in regions.iter().enumerate() {
                let len = self.frame_len(e).min(region.len());
                sink(e, &frames[region.start..region.start + len]);
            }
        }
        self.frames = frames;
        self.regions = regions;
        result
    }

    /// As [`Engine::encode`], the frames written in place into one bundle of `manifest`'s
    /// entries (`FORMAT.md` section 10) for `rank` at `step`, in `out` after its first `prefix`
    /// bytes (left for an envelope): no frame is written twice. On error `out`'s bytes after
    /// `prefix` are unspecified. With a `gate`, it is called once the checks of every entry
    /// ran and before anything changes, with their outcome; when it returns `true` the step
    /// stops there (`Ok(true)`: nothing changed, `out` unspecified), and its error ends the
    /// step as it is. `Ok(false)`: the bundle was written.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode_bundle<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        grads: &G,
        step: u64,
        feedback: Option<&mut ErrorFeedback>,
        (exec, shapes): (Exec, Shapes),
        (rank, out, prefix): (u32, &mut Vec<u8>, usize),
        gate: Option<Gate<'_>>,
    ) -> Result<bool> {
        let mut regions = std::mem::take(&mut self.regions);
        bundle::lay_out_in_place(out, prefix, manifest, rank, step, &mut regions);
        let result = self.encode_into(
            manifest,
            grads,
            step,
            feedback,
            (exec, shapes),
            out,
            &regions,
            gate,
        );
        if matches!(result, Ok(false)) {
            bundle::close_in_place(out, prefix, manifest, &regions, |e| self.frame_len(e));
        }
        self.regions = regions;
        result
    }

    /// As [`Engine::encode`], each entry `e`'s frame written into `buf[regions[e]]` (at least
    /// its [`max_frame_len`] bytes; the regions in order and disjoint), its length then
    /// [`Engine::frame_len`]`(e)`; `gate` as for [`Engine::encode_bundle`] (`Ok(true)`: stopped
    /// by it, nothing changed).
    #[allow(clippy::too_many_arguments)]
    fn encode_into<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        grads: &G,
        step: u64,
        mut feedback: Option<&mut ErrorFeedback>,
        (exec, shapes): (Exec, Shapes),
        buf: &mut [u8],
        regions: &[Range<usize>],
        gate: Option<Gate<'_>>,
    ) -> Result<bool> {
        let entries = manifest.entries();
        // One region per entry, in order, disjoint, within the buffer, and at least its
        // largest frame: a task never finds its region missing.
        let mut end = 0;
        let fits = regions.len() == entries.len()
            && regions.iter().zip(entries).all(|(r, entry)| {
                let ok = r.start >= end
                    && r.end <= buf.len()
                    && r.len() >= max_frame_len(entry.len, &entry.method);
                end = r.end;
                ok
            });
        if !fits {
            return Err(Error::internal(
                "frame regions that do not fit the entries or the buffer",
            ));
        }
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
            selections: &self.selections,
            select_sizes: select_sizes(manifest),
        };
        let checked = exec.install(|| step_in.check_all(fb.as_deref(), slots, buf, regions));
        // The gate runs on the caller's thread, between the passes: it may wait in a
        // collective, which a pool thread must never do (other ranks' tasks may be queued
        // behind it).
        if let Some(gate) = gate
            && gate(checked.as_ref().map(|_| ()))?
        {
            return Ok(true);
        }
        checked?;
        exec.install(|| step_in.encode_all(fb, slots, pool, buf, regions))?;
        for slot in slots.iter() {
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
        Ok(false)
    }

    /// The length of entry `e`'s frame after a step that succeeded.
    fn frame_len(&self, e: usize) -> usize {
        self.slots.get(e).map_or(0, |slot| slot.len)
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
    selections: &'a Pool<SelectScratch>,
    /// What a selection's scratch holds, for any of the step's tensors.
    select_sizes: SelectSizes,
}

/// A selection's scratch: the serial step's shared set, or an entry's own.
// One on the stack per selection, never moved in bulk: a box would allocate every step.
#[allow(clippy::large_enum_variant)]
enum Scratch<'s> {
    Shared(Lease<'s, SelectScratch>),
    Own(&'s mut SelectScratch),
}

impl Scratch<'_> {
    fn get(&mut self) -> &mut SelectScratch {
        match self {
            Scratch::Shared(lease) => lease.get(),
            Scratch::Own(own) => own,
        }
    }
}

/// The sizes of the chunked selections of `manifest`'s tensors.
fn select_sizes(manifest: &Manifest) -> SelectSizes {
    let mut sizes = SelectSizes::default();
    for entry in manifest.entries() {
        if let EncodePlan::SparseChunks(rule) = entry.encode {
            sizes.add(entry.len, rule);
        }
    }
    sizes
}

impl<G: Gradients + ?Sized> Step<'_, G> {
    /// The scratch of a selection: on one thread one set for every tensor, sized for the
    /// largest (so that a later step allocates nothing), the memory of one tensor's selection
    /// instead of the model's; on the pool the entry's own (`own`), since a task waiting for
    /// its chunks may run another entry's selection meanwhile, and a shared set per task would
    /// then be made during a later step.
    fn selection<'s>(&'s self, own: &'s mut SelectScratch) -> Scratch<'s> {
        match self.exec {
            Exec::Serial => {
                let mut lease = self.selections.lease();
                lease.get().reserve(&self.select_sizes, self.exec);
                Scratch::Shared(lease)
            }
            Exec::Pool => Scratch::Own(own),
        }
    }

    /// The gradient of the manifest's tensor `t`.
    fn grad(&self, t: usize) -> &[f32] {
        self.grads.grad(self.manifest, t)
    }

    /// The gradient of a one-tensor entry.
    fn grad_of(&self, entry: &Entry) -> &[f32] {
        entry.members.first().map_or(&[], |&t| self.grad(t))
    }

    /// Pass 1 (see the module docs): every entry's checks; the first error in manifest order.
    /// Nothing changed.
    fn check_all(
        &self,
        fb: Option<&ErrorFeedback>,
        slots: &mut [Slot],
        buf: &mut [u8],
        regions: &[Range<usize>],
    ) -> Result<()> {
        let entries = self.manifest.entries();
        self.exec
            .for_each_region(slots, buf, regions, &|e, slot, frame| {
                self.check(&entries[e], fb, slot, frame);
            });
        // The first error in manifest order: a deferred entry before the first one found is
        // checked now.
        if let Some(found) = slots.iter().position(|slot| slot.err.is_some()) {
            for (slot, entry) in slots[..found].iter_mut().zip(entries) {
                if slot.pass1 == Pass1::Deferred
                    && let Err(err) = check_entry(self.manifest, entry, self.grads, None, self.exec)
                {
                    slot.err = Some(err);
                    break;
                }
            }
        }
        first_error(slots)
    }

    /// Pass 2 (see the module docs), after [`Step::check_all`] passed: the first error in
    /// manifest order.
    fn encode_all(
        &self,
        mut feedback: Option<&mut ErrorFeedback>,
        slots: &mut [Slot],
        pool: &Pool<Bufs>,
        buf: &mut [u8],
        regions: &[Range<usize>],
    ) -> Result<()> {
        let entries = self.manifest.entries();
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
        self.exec
            .for_each_region(slots, buf, regions, &|e, slot, frame| {
                let mut lease = pool.lease();
                if let Err(err) = self.encode(lease.get(), &entries[e], slot, frame, ef) {
                    slot.err = Some(err);
                }
            });
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
    fn check(&self, entry: &Entry, fb: Option<&ErrorFeedback>, slot: &mut Slot, frame: &mut [u8]) {
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
        if entry.encode == EncodePlan::DenseChunks {
            match fb {
                None => {
                    slot.pass1 = Pass1::Deferred;
                    return;
                }
                // The residual's bound and one read of the gradient prove every sum finite:
                // all the chunked error-feedback step needs of them (a sum beyond the value
                // type saturates), so the residual is not read for the check.
                Some(fb) if self.proves_sums_finite(entry, fb, slot.bound) => return,
                Some(_) => {}
            }
        }
        if let EncodePlan::SparseChunks(rule) = entry.encode {
            if let Some(fb) = fb
                && matches!(rule, Rule::TopK(_))
                && self.proves_sums_finite(entry, fb, slot.bound)
            {
                slot.pass1 = Pass1::OnePass;
                return;
            }
            if self.select_in_chunks(entry, rule, fb, slot, frame) {
                return;
            }
        }
        slot.err = check_entry(self.manifest, entry, self.grads, fb, self.exec).err();
    }

    /// Whether the one tensor of `entry` needs no check pass with error feedback: its residual
    /// (of the gradient's length; a new one is zeros) has a `bound` that, with the gradient,
    /// proves every `g + r` finite ([`ResidualBound::proves_sums_finite`], one read of the
    /// gradient). A large top-k tensor then takes the one-pass step.
    fn proves_sums_finite(&self, entry: &Entry, fb: &ErrorFeedback, bound: ResidualBound) -> bool {
        let ([t], true) = (entry.members.as_slice(), bound.max_abs().is_finite()) else {
            return false;
        };
        let t = *t;
        let g = self.grad(t);
        let same_len = fb
            .residual(&self.manifest.tensors()[t].name)
            .is_none_or(|r| r.len() == g.len());
        same_len
            && g.len() == entry.len
            && self.exec.chunks_all(g, crate::layout::plan::CHUNK, |c| {
                bound.proves_sums_finite(c)
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
        frame: &mut [u8],
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
                    // Top-k's next steps take one pass (the selection's scratch holds its
                    // sent entries); the others keep theirs in the slot until every entry of
                    // the step is encoded.
                    if !matches!(rule, Rule::TopK(_)) {
                        slot.split.reserve(entry.len, rule, self.exec);
                    }
                    // Sized now, so that the next step's selection allocates nothing.
                    let mut sized = SelectSizes::default();
                    sized.add(entry.len, rule);
                    self.selection(&mut slot.scratch)
                        .get()
                        .reserve(&sized, self.exec);
                    return false;
                }
            },
        };
        let need = max_frame_len(entry.len, &entry.method);
        let Some(frame) = frame.get_mut(..need) else {
            slot.err = Some(Error::internal(format!(
                "`{}`: a frame region shorter than the frame",
                entry.label
            )));
            return true;
        };
        let params = self.manifest.params(entry, self.step);
        let mut scratch = self.selection(&mut slot.scratch);
        let selected = slot
            .split
            .encode(scratch.get(), rule, &params, g, r, frame, self.exec);
        drop(scratch);
        match selected {
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
    fn encode(
        &self,
        bufs: &mut Bufs,
        entry: &Entry,
        slot: &mut Slot,
        frame: &mut [u8],
        ef: bool,
    ) -> Result<()> {
        let g = self.grad_of(entry);
        let exec = self.exec;
        if slot.pass1 == Pass1::Selected {
            // The frame is written; with error feedback the residual follows it.
            if let Some(r) = slot.res.first_mut().filter(|_| ef) {
                slot.bound_after = Some(slot.split.update_residual(g, r, exec));
            }
            return Ok(());
        }
        let internal = |what: &str| Error::internal(format!("`{}`: {what}", entry.label));
        let need = max_frame_len(entry.len, &entry.method);
        let frame = frame
            .get_mut(..need)
            .ok_or_else(|| internal("a frame region shorter than the frame"))?;
        let params = self.manifest.params(entry, self.step);
        let residual = slot.res.first_mut().filter(|_| ef);
        slot.len = match (slot.pass1, entry.encode) {
            (Pass1::OnePass, EncodePlan::SparseChunks(rule)) => {
                let r = residual.ok_or_else(|| internal("one pass without a residual"))?;
                let mut scratch = self.selection(&mut slot.scratch);
                let (len, bound, chunked) = slot
                    .split
                    .encode_one_pass(scratch.get(), rule, &params, g, r, frame, exec)
                    .ok_or_else(|| internal("the one-pass step failed after its proof"))?;
                slot.bound_after = Some(bound);
                slot.stats.one_pass += 1;
                slot.stats.selected_in_chunks += u64::from(chunked);
                len
            }
            (pass1, EncodePlan::DenseChunks) => {
                let with_residual = residual.is_some();
                let encoded = Split::new(entry.len, &entry.method).and_then(|split| {
                    split.encode(&params, g, residual.map(Vec::as_mut_slice), frame, exec)
                });
                match (encoded, pass1) {
                    (Some((len, bound)), _) => {
                        if with_residual {
                            slot.bound_after = Some(bound);
                        }
                        len
                    }
                    // The encoder found a bad value: the check names it, as in pass 1.
                    (None, Pass1::Deferred) => {
                        check_entry(self.manifest, entry, self.grads, None, Exec::Serial)?;
                        return Err(internal("the chunked encoder refused a tensor it checks"));
                    }
                    (None, _) => {
                        return Err(internal("the chunked encoder refused a checked tensor"));
                    }
                }
            }
            (_, EncodePlan::Bucket) => {
                let res = ef.then(|| &mut slot.res[..entry.members.len()]);
                let bufs = bufs.fit(self.manifest, entry, ef);
                encode_bucket(bufs, self.manifest, entry, self.grads, &params, res, frame)?
            }
            (_, EncodePlan::Whole | EncodePlan::SparseChunks(_)) => {
                let bufs = bufs.fit(self.manifest, entry, ef);
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

/// A step's gate ([`Engine::encode_bundle`]): told the outcome of every entry's checks before
/// anything changes, it says whether the step stops there (`true`), or ends it with its error.
pub(crate) type Gate<'g> =
    &'g mut (dyn FnMut(std::result::Result<(), &Error>) -> Result<bool> + Send);

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

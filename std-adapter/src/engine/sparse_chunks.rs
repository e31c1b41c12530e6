//! Top-k, threshold and random-k of one large tensor, selected in chunks: on rayon's pool, or
//! one chunk after the other on one thread (where the gain is that the selection is the input
//! check, so `g` and the residual are read twice per step, not three times).
//!
//! The frame of a top-k or threshold tensor depends on the whole tensor (the k-th largest
//! magnitude, one index codec for all kept entries), but finding what it keeps does not have to
//! run on one thread. The core's chunked selection ([`select::topk_floor`],
//! [`select::candidates`], [`select::topk_of_candidates`]) splits it:
//!
//! 1. top-k: a magnitude floor from the same stratified sample the serial selection takes;
//!    threshold: the next float above `t`;
//! 2. every chunk of [`CHUNK`] elements collects its candidates (`|x| >= floor`) into its own
//!    list, checking on the way that every `x` is finite (and, without error feedback, within
//!    the value type's range; with it a sum beyond is sent saturated): the one full read of the
//!    tensor;
//! 3. the lists, concatenated in chunk order, hold every element at or above the floor; with at
//!    least k of them, an exact radix select among them (1-2% of the tensor) keeps the top-k,
//!    ties to the lower index: the same entries as the serial selection, so
//!    [`encode_kept_into`] writes the same frame byte for byte.
//!
//! With error feedback the scanned values are `g + r` (the f32 sum the serial step encodes),
//! read without changing the residual, so that a bad value found on the way leaves everything
//! as it was; once every entry of the step is encoded, [`SparseSplit::update_residual`] writes
//! `r = r + g`, then `r[i] += -decoded[i]` at the kept indices, chunk by chunk: per element
//! the operations of the core's `feedback_step`.
//!
//! **One pass with a residual bound.** When the error feedback knows a bound on the residual's
//! magnitudes ([`gradwire_core::ResidualBound`], left by the tensor's last step; zero for a new
//! residual) and the step's check pass finds the bound and every `|g|` below 2^127, no `g + r`
//! can overflow (a finite sum beyond the value type is sent saturated), so the residual may
//! change while the tensor is scanned: [`SparseSplit::encode_one_pass`] stores `r = g + r` as
//! each chunk collects its candidates ([`select::candidates_update`]), writes the frame, then
//! fixes up the kept
//! entries: g and r are read once after the check, as in the core's `feedback_step_bounded`,
//! with the same frame, residual and bound.
//!
//! Random-k takes the same path with another selection: its indices are drawn in chunks
//! ([`super::randomk_draw`]), each chunk's task checking the chunk first, and the frame is
//! written from them and the values at them.
//!
//! When the sample misses (fewer than k candidates) or overshoots (more than four times what
//! the core's serial selection holds: `2k + n/256 + 64` for top-k, `n/32 + 64` for threshold),
//! the core's own selection runs; both are rare on real gradients, and the result is the same
//! frame either way.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use gradwire_core::feedback::{sparse_fix_up, sparse_update};
use gradwire_core::select::{self, Kept};
use gradwire_core::{Params, ResidualBound, encode_kept_into, values};

use super::buffers::grow;
use super::check::check_step_input;
use super::exec::Exec;
use super::randomk_draw::RandomKDraw;
use super::sparse_list::SparseList;
use crate::layout::plan::{CHUNK, Rule};

/// What [`SparseSplit::encode`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Selected {
    /// The frame is written: its length in bytes.
    Frame(usize),
    /// Some value is NaN, infinite or beyond the value type's range (nothing written that
    /// counts; the serial check names it).
    OutOfLimit,
    /// Not done here (the sample missed or overshot): encode with the core's selection.
    Serial,
}

impl Rule {
    /// Candidates the serial selection holds for `n` elements (one list on one thread).
    fn capacity(self, n: usize) -> usize {
        match self {
            Rule::TopK(k) => select::candidate_capacity(n, k),
            Rule::Threshold(_) => select::threshold_capacity(n),
            Rule::RandomK(k) => k,
        }
    }

    /// Candidates a chunked selection may hold in all: four times [`Rule::capacity`] (past
    /// that, the core's selection runs; chunk lists keep what they grew to up to that much).
    fn bound(self, n: usize) -> usize {
        4 * self.capacity(n)
    }

    /// The first length of each chunk's list: twice its share of [`Rule::capacity`].
    fn chunk_capacity(self, n: usize) -> usize {
        let chunks = n.div_ceil(CHUNK).max(1);
        (2 * self.capacity(n).div_ceil(chunks)).clamp(64, CHUNK)
    }
}

/// One chunk's candidates: `idx[..count]`, `bits[..count]` once the chunk fitted.
#[derive(Debug, Default)]
struct ChunkList {
    idx: Vec<u32>,
    bits: Vec<u32>,
    count: usize,
}

/// What the chunks' scans of one selection found, gathered from every chunk's task.
#[derive(Default)]
struct Scan {
    total: AtomicUsize,
    /// A value out of limit (NaN, infinite, beyond the value type's range).
    bad: AtomicBool,
    /// More candidates than [`Rule::bound`].
    over: AtomicBool,
}

impl Scan {
    /// Records a chunk's scan of `count` candidates (`Err`: a value out of limit); whether its
    /// list may be kept (within the bound, nothing bad yet).
    fn record(&self, count: Result<usize, select::OutOfLimit>, bound: usize) -> Option<usize> {
        let Ok(count) = count else {
            self.bad.store(true, Ordering::Relaxed);
            return None;
        };
        if self.total.fetch_add(count, Ordering::Relaxed) + count > bound {
            self.over.store(true, Ordering::Relaxed);
            return None;
        }
        Some(count)
    }

    fn failed(&self) {
        self.bad.store(true, Ordering::Relaxed);
    }

    /// No chunk found a bad value, and the total stayed within the bound.
    fn clean(&self) -> bool {
        !self.bad.load(Ordering::Relaxed) && !self.over.load(Ordering::Relaxed)
    }
}

/// What the chunked selection of one tensor keeps from one step to the next: the sent
/// entries (decoded, for the residual's update after every entry is encoded) and random-k's
/// draw.
#[derive(Debug, Default)]
pub(crate) struct SparseSplit {
    sent: SparseList,
    draw: RandomKDraw,
}

/// The scratch of one chunked selection while it runs (the chunks' candidate lists, their
/// concatenation, the sample, the radix histogram): leased by each task from the engine's pool
/// and kept between steps, so that it grows with the largest tensor a task selects, not with
/// the model.
#[derive(Debug, Default)]
pub(crate) struct SelectScratch {
    chunks: Vec<ChunkList>,
    idx: Vec<u32>,
    bits: Vec<u32>,
    hist: Vec<u32>,
    samples: Vec<u32>,
    /// Scratch of the core's `topk_kept` for a one-pass step whose sample missed (rare).
    fallback: Vec<u32>,
    /// The kept values saturated to the value type, in the (rare) steps with error feedback
    /// that send a sum beyond it ([`saturated`]).
    saturated: Vec<u32>,
    /// The sent entries of a one-pass step ([`SparseSplit::encode_one_pass`]), decoded to fix
    /// up the residual right after the frame is written: needed only while that tensor is
    /// encoded, so one list per set (the largest tensor's k) rather than one per tensor.
    sent: SparseList,
}

/// `kept` with its values saturated to the range of `params`' value type: with error feedback
/// any finite sum can be sent, a value beyond f16 or bf16 going as the type's largest
/// ([`values::saturate`]) and the residual, updated from the decoded frame, keeping the rest.
/// `kept` itself when every value is in range (every step but rare ones), else its values
/// saturated into `buf`.
fn saturated<'k>(params: &Params, kept: Kept<'k>, buf: &'k mut Vec<u32>) -> Kept<'k> {
    let v = match params.method.values() {
        Some(v @ (gradwire_core::Values::F16 | gradwire_core::Values::Bf16)) => v,
        _ => return kept,
    };
    let sat = |b: u32| values::saturate(v, f32::from_bits(b)).to_bits();
    if kept.bits.iter().all(|&b| sat(b) == b) {
        return kept;
    }
    buf.clear();
    buf.extend(kept.bits.iter().map(|&b| sat(b)));
    Kept {
        idx: kept.idx,
        bits: buf,
    }
}

impl SparseSplit {
    /// Whether it holds room for sent entries (a two-pass step's, or random-k's).
    #[cfg(test)]
    pub(crate) fn holds_sent(&self) -> bool {
        self.sent.holds_any()
    }

    /// Selects the entries of `x = g` (or `g + r` with a residual of the same length) that the
    /// frame of `params` keeps by `rule`, chunks run by `exec`, and writes the frame into
    /// `frame` (at least the method's `max_frame_len` bytes): the bytes of the core's
    /// `encode_into` of `x`. Reads `g` and `r` only.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode(
        &mut self,
        scratch: &mut SelectScratch,
        rule: Rule,
        params: &Params,
        g: &[f32],
        r: Option<&[f32]>,
        frame: &mut [u8],
        exec: Exec,
    ) -> Selected {
        let n = g.len();
        if r.is_some_and(|r| r.len() != n) {
            return Selected::Serial;
        }
        // With error feedback (a residual) any finite sum can be sent, saturating.
        let limit = values::magnitude_limit(params.method.values().filter(|_| r.is_none()));
        self.reserve(n, rule, exec);
        let mut sizes = SelectSizes::default();
        sizes.add(n, rule);
        scratch.reserve(&sizes, exec);
        let (floor, k) = match rule {
            Rule::RandomK(_) => return self.encode_randomk(scratch, params, g, r, frame, exec),
            Rule::Threshold(t) => (select::threshold_floor(t), None),
            Rule::TopK(k) => match select::topk_floor(g, r, k, &mut scratch.samples) {
                Some(floor) => (floor, Some(k)),
                None => return Selected::Serial,
            },
        };
        let count = match scratch.collect(g, r, floor, limit, rule, exec) {
            Ok(Some(count)) if k.is_none_or(|k| count >= k) => count,
            Ok(_) => return Selected::Serial,
            Err(select::OutOfLimit) => return Selected::OutOfLimit,
        };
        // Step 3: the exact top-k among the candidates (threshold: all of them).
        let (idx, bits) = (&mut scratch.idx[..count], &mut scratch.bits[..count]);
        let kept = match k {
            Some(k) => select::topk_of_candidates(idx, bits, k, &mut scratch.hist),
            None => Kept { idx, bits },
        };
        let kept = match r {
            Some(_) => saturated(params, kept, &mut scratch.saturated),
            None => kept,
        };
        let Ok(len) = encode_kept_into(n, params, kept, frame) else {
            return Selected::Serial;
        };
        // With a residual, the sent values are decoded now, so that the update after every
        // entry of the step is encoded cannot fail (no residual may change before all have).
        if r.is_some() && !self.sent.decode(&frame[..len], n, params) {
            return Selected::Serial;
        }
        Selected::Frame(len)
    }

    /// Top-k (`rule`) of `x = g + r` for an error-feedback step whose residual bound proved
    /// every sum finite (`ResidualBound::proves_sums_finite`, in the step's check pass): each
    /// chunk is read once, storing `r = g + r` as it collects its candidates
    /// ([`select::candidates_update`]); the exact top-k among them (when the sample missed,
    /// among all of `r`, which holds the sums by then) is written as the frame into `frame`,
    /// and the kept entries are fixed up (`r[i] += -decoded[i]`). Returns the frame length, the
    /// residual's new bound and whether the chunked selection found the entries: the frame,
    /// residual and bound of the core's `feedback_step_bounded`. `None` only when the proof did
    /// not hold (a sum out of range; `r` holds the sums then) or the rule is not top-k.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode_one_pass(
        &mut self,
        scratch: &mut SelectScratch,
        rule: Rule,
        params: &Params,
        g: &[f32],
        r: &mut [f32],
        frame: &mut [u8],
        exec: Exec,
    ) -> Option<(usize, ResidualBound, bool)> {
        let (n, Rule::TopK(k)) = (g.len(), rule) else {
            return None;
        };
        if r.len() != n {
            return None;
        }
        // Error feedback: any finite sum can be sent, saturating.
        let limit = values::magnitude_limit(None);
        let mut sizes = SelectSizes::default();
        sizes.add(n, rule);
        scratch.reserve(&sizes, exec);
        // The floor samples `g + r` before any chunk changes.
        let floor = select::topk_floor(g, Some(&*r), k, &mut scratch.samples)?;
        let count = scratch
            .collect_updating(g, r, floor, limit, rule, exec)
            .ok()?;
        let chunked = count.filter(|&c| c >= k);
        let kept = match chunked {
            Some(c) => select::topk_of_candidates(
                &mut scratch.idx[..c],
                &mut scratch.bits[..c],
                k,
                &mut scratch.hist,
            ),
            None => {
                // The sample missed or overshot: the exact top-k of `r`, the sums.
                grow(&mut scratch.fallback, select::kept_scratch_len(n, k));
                select::topk_kept(r, k, limit, &mut scratch.fallback).ok()?
            }
        };
        // No element left unsent is larger than the smallest kept.
        let smallest_kept = kept
            .bits
            .iter()
            .map(|&b| f32::from_bits(b & 0x7fff_ffff))
            .fold(f32::INFINITY, f32::min);
        let kept = saturated(params, kept, &mut scratch.saturated);
        let len = encode_kept_into(n, params, kept, frame).ok()?;
        if !scratch.sent.decode(&frame[..len], n, params) {
            return None;
        }
        let (idx, val) = scratch.sent.entries();
        // The lists were decoded from the frame just written: equal lengths, so no error.
        let largest_fixed = exec.chunks_mut_max(r, CHUNK, |j, r| {
            sparse_fix_up(idx, val, j * CHUNK, r).unwrap_or(f32::INFINITY)
        });
        let bound = ResidualBound::at_most(smallest_kept.max(largest_fixed));
        Some((len, bound, chunked.is_some()))
    }

    /// Random-k: the indices drawn in chunks (each chunk's task checks the chunk first, as the
    /// top-k scan does), the values at them gathered (`g`, or the f32 sum `g + r`), the frame
    /// written from the list.
    fn encode_randomk(
        &mut self,
        scratch: &mut SelectScratch,
        params: &Params,
        g: &[f32],
        r: Option<&[f32]>,
        frame: &mut [u8],
        exec: Exec,
    ) -> Selected {
        let n = g.len();
        // The serial path's input check, chunk by chunk (a failing chunk: the serial check
        // names the element).
        // With error feedback any finite sum can be sent (saturating).
        let values = params.method.values().filter(|_| r.is_none());
        let check = |a: usize, e: usize| {
            check_step_input("", &g[a..e], r.map(|r| &r[a..e]), values).is_ok()
        };
        if !self.draw.draw_for(params, n, exec, check) {
            return Selected::OutOfLimit;
        }
        let idx = self.draw.indices();
        grow(&mut scratch.bits, idx.len());
        let bits = &mut scratch.bits[..idx.len()];
        for (b, &i) in bits.iter_mut().zip(idx) {
            let i = i as usize;
            *b = r.map_or(g[i], |r| g[i] + r[i]).to_bits();
        }
        let kept = Kept { idx, bits };
        let kept = match r {
            Some(_) => saturated(params, kept, &mut scratch.saturated),
            None => kept,
        };
        let Ok(len) = encode_kept_into(n, params, kept, frame) else {
            // Unbiased values whose n/k multiple overflows: the serial encoder names one.
            return Selected::Serial;
        };
        if r.is_some() && !self.sent.decode_randomk(&frame[..len], n, params, idx) {
            return Selected::Serial;
        }
        Selected::Frame(len)
    }

    /// Sizes what the tensor keeps for a tensor of `n` elements selected by `rule` (so that a
    /// later step allocates nothing): the decoded sent entries (k, or the threshold's
    /// capacity), random-k's draw.
    pub(crate) fn reserve(&mut self, n: usize, rule: Rule, exec: Exec) {
        match rule {
            Rule::TopK(k) => self.sent.reserve(k),
            Rule::Threshold(_) => self.sent.reserve(rule.capacity(n)),
            Rule::RandomK(k) => {
                self.sent.reserve(k);
                self.draw.reserve(n, k as u64, exec);
            }
        }
    }

    /// The residual update of an error-feedback step whose frame [`SparseSplit::encode`] wrote
    /// from `g` and `r` (with `r` given, so that it decoded the sent values): `r = r + g`, then
    /// `r[i] += -decoded[i]` at the kept indices, chunk by chunk. Returns the new residual's
    /// bound, measured chunk by chunk while each is in cache (so that the next step can take
    /// [`SparseSplit::encode_one_pass`]).
    pub(crate) fn update_residual(&self, g: &[f32], r: &mut [f32], exec: Exec) -> ResidualBound {
        let (idx, val) = self.sent.entries();
        // Equal lengths: the lists come from one frame, the chunks from one tensor.
        let max = exec.chunk_pairs_mut_max(r, g, CHUNK, |j, r, g| {
            sparse_update(idx, val, j * CHUNK, g, r).unwrap_or(f32::INFINITY)
        });
        ResidualBound::at_most(max)
    }
}

/// The sizes a [`SelectScratch`] needs for every chunked selection of a step, the largest of
/// each over the step's tensors: any task may select any of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SelectSizes {
    /// The concatenated lists (the serial selection's candidate capacity; random-k's k).
    cap: usize,
    /// Candidates (top-k or threshold): indices too, and one list per chunk.
    idx: usize,
    hist: usize,
    samples: usize,
    chunks: usize,
    first: usize,
    /// Top-k's k: the one-pass step's list of sent entries.
    sent: usize,
}

impl SelectSizes {
    /// Grown to hold a tensor of `n` elements selected by `rule` too: the sample, the radix
    /// histogram, one list per chunk of its first length, and the concatenation of the lists
    /// (the serial selection's candidate capacity). A step that keeps more than that capacity
    /// (threshold: more than `n/32 + 64` entries) grows the lists once, up to four times it.
    /// Random-k needs none of it but the values' list.
    pub(crate) fn add(&mut self, n: usize, rule: Rule) {
        let cap = rule.capacity(n);
        self.cap = self.cap.max(cap);
        if let Rule::RandomK(_) = rule {
            // The indices are the draw's; no chunk lists of candidates.
            return;
        }
        self.idx = self.idx.max(cap);
        if let Rule::TopK(k) = rule {
            self.sent = self.sent.max(k);
            self.samples = select::SAMPLE_LEN;
            self.hist = self.hist.max(select::candidates_hist_len(cap));
        }
        self.chunks = self.chunks.max(n.div_ceil(CHUNK));
        self.first = self.first.max(rule.chunk_capacity(n));
    }
}

impl SelectScratch {
    /// Whether it holds any list (a set never used holds none).
    #[cfg(test)]
    pub(crate) fn holds_lists(&self) -> bool {
        !self.chunks.is_empty() || self.idx.capacity() > 0
    }

    /// Sizes the scratch for `sizes` (so that a later step allocates nothing); on one thread
    /// without the chunks' own lists, which only chunks on the pool fill.
    pub(crate) fn reserve(&mut self, sizes: &SelectSizes, exec: Exec) {
        grow(&mut self.bits, sizes.cap);
        grow(&mut self.idx, sizes.idx);
        grow(&mut self.samples, sizes.samples);
        grow(&mut self.hist, sizes.hist);
        self.sent.reserve(sizes.sent);
        if let Exec::Serial = exec {
            return;
        }
        if self.chunks.len() < sizes.chunks {
            self.chunks.resize_with(sizes.chunks, ChunkList::default);
        }
        for list in &mut self.chunks[..sizes.chunks] {
            grow(&mut list.idx, sizes.first);
            grow(&mut list.bits, sizes.first);
        }
    }

    /// Every chunk's candidates (`|x| >= floor` of `x = g` or `g + r`, checked against
    /// `limit`), then the lists in chunk order in `self.idx`/`self.bits`; returns their count.
    /// A list too short for its chunk grows to the chunk's count and the chunk is scanned
    /// again, once every chunk is counted and the total is known to stay within
    /// [`Rule::bound`] (`Ok(None)` past it, with nothing grown).
    fn collect(
        &mut self,
        g: &[f32],
        r: Option<&[f32]>,
        floor: f32,
        limit: f32,
        rule: Rule,
        exec: Exec,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        let n = g.len();
        let bound = rule.bound(n);
        let scan = Scan::default();
        let scan_chunk = |j: usize, idx: &mut [u32], bits: &mut [u32]| {
            let start = j * CHUNK;
            let end = (start + CHUNK).min(n);
            let (gc, rc) = (&g[start..end], r.map(|r| &r[start..end]));
            select::candidates(gc, rc, start, floor, limit, idx, bits)
        };
        if let Exec::Serial = exec {
            return self.collect_serial(n, rule, false, scan_chunk, scan_chunk);
        }
        let candidates =
            |j: usize, list: &mut ChunkList| scan_chunk(j, &mut list.idx, &mut list.bits);
        let lists = &mut self.chunks[..n.div_ceil(CHUNK)];
        exec.for_each(lists, |j, list| {
            list.count = scan.record(candidates(j, list), bound).unwrap_or(0);
        });
        if scan.clean() {
            exec.for_each(lists, |j, list| {
                if list.count > list.idx.len() {
                    grow(&mut list.idx, list.count);
                    grow(&mut list.bits, list.count);
                    if candidates(j, list) != Ok(list.count) {
                        scan.failed();
                    }
                }
            });
        }
        self.finish_lists(n, rule, &scan)
    }

    /// [`SelectScratch::collect`] of `g + r` that stores the sums in `r` on the way
    /// ([`select::candidates_update`]); a chunk scanned again reads its sums from `r`.
    fn collect_updating(
        &mut self,
        g: &[f32],
        r: &mut [f32],
        floor: f32,
        limit: f32,
        rule: Rule,
        exec: Exec,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        let n = g.len();
        if let Exec::Serial = exec {
            // The first scan stores the sums; a chunk scanned again reads them from `r`.
            let r = std::cell::RefCell::new(r);
            let first = |j: usize, idx: &mut [u32], bits: &mut [u32]| {
                let start = j * CHUNK;
                let mut r = r.borrow_mut();
                let rc = &mut r[start..(start + CHUNK).min(n)];
                let gc = &g[start..start + rc.len()];
                select::candidates_update(gc, rc, start, floor, limit, idx, bits)
            };
            let again = |j: usize, idx: &mut [u32], bits: &mut [u32]| {
                let start = j * CHUNK;
                let r = r.borrow();
                let rc = &r[start..(start + CHUNK).min(n)];
                select::candidates(rc, None, start, floor, limit, idx, bits)
            };
            return self.collect_serial(n, rule, true, first, again);
        }
        let bound = rule.bound(n);
        let scan = Scan::default();
        let lists = &mut self.chunks[..n.div_ceil(CHUNK)];
        exec.for_each_zip(lists, r, CHUNK, |j, list, rc| {
            let start = j * CHUNK;
            let gc = &g[start..start + rc.len()];
            let first = select::candidates_update(
                gc,
                rc,
                start,
                floor,
                limit,
                &mut list.idx,
                &mut list.bits,
            );
            list.count = scan.record(first, bound).unwrap_or(0);
        });
        if scan.clean() {
            exec.for_each_zip(lists, r, CHUNK, |j, list, rc| {
                if list.count > list.idx.len() {
                    grow(&mut list.idx, list.count);
                    grow(&mut list.bits, list.count);
                    let (idx, bits) = (&mut list.idx, &mut list.bits);
                    if select::candidates(rc, None, j * CHUNK, floor, limit, idx, bits)
                        != Ok(list.count)
                    {
                        scan.failed();
                    }
                }
            });
        }
        self.finish_lists(n, rule, &scan)
    }

    /// The chunks' scans on one thread, one after the other, each writing its candidates
    /// straight after the previous chunk's in `self.idx`/`self.bits` (no list per chunk, no
    /// concatenation): `scan(j, idx, bits)` scans chunk `j` into the room left and returns its
    /// count; a chunk that did not fit is scanned again by `again` once the lists grew (up to
    /// [`Rule::bound`] in all). After an overflow the chunks are still scanned, into no room,
    /// for a bad value (which the pool would report first); after a bad value only with
    /// `every_chunk` (a scan that stores the step's sums). The result of
    /// [`SelectScratch::finish_lists`].
    fn collect_serial(
        &mut self,
        n: usize,
        rule: Rule,
        every_chunk: bool,
        mut scan: impl FnMut(usize, &mut [u32], &mut [u32]) -> Result<usize, select::OutOfLimit>,
        mut again: impl FnMut(usize, &mut [u32], &mut [u32]) -> Result<usize, select::OutOfLimit>,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        let bound = rule.bound(n);
        let (mut total, mut bad, mut over) = (0usize, false, false);
        // The first chunk that did not fit, and where its candidates go: from there on the
        // chunks are only counted, and scanned again once the total is known to be within the
        // bound (lists grow only then, as on the pool).
        let mut spill: Option<(usize, usize)> = None;
        for j in 0..n.div_ceil(CHUNK) {
            if bad {
                if !every_chunk {
                    break;
                }
                let _ = scan(j, &mut [], &mut []);
                continue;
            }
            if over {
                bad = scan(j, &mut [], &mut []).is_err();
                continue;
            }
            let room = self.idx.len().min(self.bits.len());
            let result = match spill {
                Some(_) => scan(j, &mut [], &mut []),
                None => scan(j, &mut self.idx[total..room], &mut self.bits[total..room]),
            };
            match result {
                Err(select::OutOfLimit) => bad = true,
                Ok(count) if total + count > bound => over = true,
                Ok(count) => {
                    if spill.is_none() && total + count > room {
                        spill = Some((j, total));
                    }
                    total += count;
                }
            }
        }
        if bad {
            return Err(select::OutOfLimit);
        }
        if over {
            return Ok(None);
        }
        if let Some((from, mut at)) = spill {
            grow(&mut self.idx, total);
            grow(&mut self.bits, total);
            for j in from..n.div_ceil(CHUNK) {
                let (idx, bits) = (&mut self.idx[at..total], &mut self.bits[at..total]);
                match again(j, idx, bits) {
                    Ok(count) if at + count <= total => at += count,
                    _ => return Err(select::OutOfLimit),
                }
            }
            if at != total {
                return Err(select::OutOfLimit);
            }
        }
        Ok(Some(total))
    }

    /// After the chunks' scans: the error or overflow they flagged, else the lists in chunk
    /// order in `self.idx`/`self.bits` and their count.
    fn finish_lists(
        &mut self,
        n: usize,
        rule: Rule,
        scan: &Scan,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        let (bad, over) = (
            scan.bad.load(Ordering::Relaxed),
            scan.over.load(Ordering::Relaxed),
        );
        if bad || over {
            self.trim_lists(n, rule);
            return if bad {
                Err(select::OutOfLimit)
            } else {
                Ok(None)
            };
        }
        self.idx.clear();
        self.bits.clear();
        for list in &self.chunks[..n.div_ceil(CHUNK)] {
            self.idx.extend_from_slice(&list.idx[..list.count]);
            self.bits.extend_from_slice(&list.bits[..list.count]);
        }
        self.trim_lists(n, rule);
        Ok(Some(self.idx.len()))
    }

    /// Lists keep what they grew to, up to four times the serial capacity beyond their first
    /// lengths in all; past that they go back to their first length, so that the candidates of
    /// large values that move from chunk to chunk over the steps do not pile up.
    fn trim_lists(&mut self, n: usize, rule: Rule) {
        let lists = &mut self.chunks[..n.div_ceil(CHUNK)];
        let first = rule.chunk_capacity(n);
        let held: usize = lists.iter().map(|l| l.idx.len()).sum();
        if held > lists.len() * first + rule.bound(n) {
            for list in lists {
                for v in [&mut list.idx, &mut list.bits] {
                    v.truncate(first);
                    v.shrink_to(first);
                }
            }
        }
    }
}

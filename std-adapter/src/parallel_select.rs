//! Top-k and threshold of one large tensor, selected in chunks: on rayon's pool, or one chunk
//! after the other on one thread (where the gain is that the selection is the input check, so
//! `g` and the residual are read twice per step, not three times).
//!
//! The frame of a top-k or threshold tensor depends on the whole tensor (the k-th largest
//! magnitude, one index codec for all kept entries), but finding what it keeps does not have to
//! run on one thread. The core's chunked selection ([`gradwire_core::select::topk_floor`],
//! [`select::candidates`], [`select::topk_of_candidates`]) splits it:
//!
//! 1. top-k: a magnitude floor from the same stratified sample the serial selection takes
//!    (16 384 loads); threshold: the next float above `t`;
//! 2. every chunk of [`CHUNK`] elements collects its candidates (`|x| >= floor`) into its own
//!    list, checking on the way that every `x` is finite and within the value type's range:
//!    the one full read of the tensor;
//! 3. the lists, concatenated in chunk order, hold every element at or above the floor; with at
//!    least k of them, an exact radix select among them (1-2% of the tensor) keeps the top-k,
//!    ties to the lower index: the same entries as the serial selection, so
//!    [`gradwire_core::encode_kept_into`] writes the same frame byte for byte.
//!
//! With error feedback the scanned values are `g + r` (the f32 sum the serial step encodes),
//! read without changing the residual, so that a bad value found on the way leaves everything
//! as it was; once every entry of the step is encoded, [`SparseSplit::update_residual`] writes
//! `r = r + g`, then `r[i] += -decoded[i]` at the kept indices, chunk by chunk: per element
//! the operations of the core's `feedback_step`.
//!
//! **One pass with a residual bound.** When the error feedback knows a bound on the residual's
//! magnitudes (`gradwire_core::ResidualBound`, left by the tensor's last step; zero for a new
//! residual) and the step's check pass finds every `|g|` below the other half of the value
//! type's range, no `g + r` can be out of range, so the residual may change while the tensor
//! is scanned: [`SparseSplit::encode_one_pass`] stores `r = g + r` as each chunk collects its
//! candidates ([`select::candidates_update`]), writes the frame, then fixes up the kept
//! entries. g and r are read once after the check (16 bytes per element against 20), as in the
//! core's `feedback_step_bounded`, with the same frame, residual and bound. The update above
//! measures the bound when a step could not take this path.
//!
//! Random-k takes the same path with another selection: its indices are drawn in chunks
//! (`parallel_randomk.rs`), each chunk's task checking the chunk first, and the frame is written
//! from them and the values at them.
//!
//! When the sample misses (fewer than k candidates) or overshoots (more than four times what
//! the core's serial selection holds: `2k + n/256 + 64` for top-k, `n/32 + 64` for threshold),
//! the core's own selection runs (`feedback_step` / `encode_into`); both are rare on real
//! gradients, and the result is the same frame either way.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use gradwire_core::select::{self, Kept};
use gradwire_core::{Method, Params, ResidualBound, encode_kept_into, values};
use rayon::prelude::*;

use crate::bucket::grow;
use crate::feedback::check_step_input;
use crate::parallel::{CHUNK, SPLIT_MIN, SparseList};
use crate::parallel_randomk::RandomKDraw;

/// Frames written by the chunked selection in this process (for tests that must know it ran).
static FRAMES: AtomicU64 = AtomicU64::new(0);

/// Frames written by the chunked selection in this process so far.
pub(crate) fn frames_selected_in_chunks() -> u64 {
    FRAMES.load(Ordering::Relaxed)
}

/// Error-feedback frames written by [`SparseSplit::encode_one_pass`] in this process.
static ONE_PASS: AtomicU64 = AtomicU64::new(0);

/// Error-feedback frames written in one pass over the gradient and the residual so far.
pub(crate) fn frames_in_one_pass() -> u64 {
    ONE_PASS.load(Ordering::Relaxed)
}

/// What [`SparseSplit::encode`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Selected {
    /// The frame is written: its length in bytes.
    Frame(usize),
    /// Some value is NaN, infinite or beyond the value type's range (nothing written that
    /// counts; the serial check names it).
    OutOfLimit,
    /// Not done here (sample missed or overshot, or nothing to split): encode serially.
    Serial,
}

/// What a chunked selection keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Rule {
    /// The k largest magnitudes (`0 < k < n`).
    TopK(usize),
    /// Magnitudes above the threshold.
    Threshold(f32),
    /// Random-k's draw of k indices (`0 < k < n`).
    RandomK(usize),
}

impl Rule {
    /// The rule of `method` for a tensor of `n` elements when it is selected in chunks: top-k
    /// or random-k with `0 < k < n`, or threshold, on at least [`SPLIT_MIN`] elements (past the
    /// core's sampling minimum) with `u32` indices.
    pub(crate) fn of(n: usize, method: &Method) -> Option<Rule> {
        if n < SPLIT_MIN.max(select::SAMPLED_MIN) || u32::try_from(n).is_err() {
            return None;
        }
        match *method {
            Method::TopK { k, .. } => {
                let k = k.resolve(n as u64) as usize;
                (k > 0 && k < n).then_some(Rule::TopK(k))
            }
            Method::Threshold { threshold, .. } => Some(Rule::Threshold(threshold)),
            Method::RandomK { k, .. } => {
                let k = k.resolve(n as u64) as usize;
                (k > 0 && k < n).then_some(Rule::RandomK(k))
            }
            _ => None,
        }
    }

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

/// The buffers of the chunked selection of one tensor, kept between steps.
#[derive(Debug, Default)]
pub(crate) struct SparseSplit {
    chunks: Vec<ChunkList>,
    idx: Vec<u32>,
    bits: Vec<u32>,
    hist: Vec<u32>,
    samples: Vec<u32>,
    sent: SparseList,
    draw: RandomKDraw,
    /// Scratch of the core's `topk_kept` for a one-pass step whose sample missed (rare).
    fallback: Vec<u32>,
}

impl SparseSplit {
    /// Selects the entries of `x = g` (or `g + r` with a residual of the same length) that the
    /// frame of `params` keeps, chunks on rayon's pool with `parallel` (else one after the
    /// other), and writes the frame into `frame` (at least the method's `max_frame_len` bytes):
    /// the bytes of the core's `encode_into` of `x`. Reads `g` and `r` only.
    pub(crate) fn encode(
        &mut self,
        params: &Params,
        g: &[f32],
        r: Option<&[f32]>,
        frame: &mut [u8],
        parallel: bool,
    ) -> Selected {
        let n = g.len();
        let (Some(rule), Some(v)) = (Rule::of(n, &params.method), params.method.values()) else {
            return Selected::Serial;
        };
        if r.is_some_and(|r| r.len() != n) {
            return Selected::Serial;
        }
        let limit = values::magnitude_limit(Some(v));
        self.reserve(n, rule, parallel);
        if let Rule::RandomK(_) = rule {
            return self.encode_randomk(params, g, r, frame, parallel);
        }
        let (floor, k) = match rule {
            Rule::Threshold(t) => (select::threshold_floor(t), None),
            Rule::TopK(k) => match select::topk_floor(g, r, k, &mut self.samples) {
                Some(floor) => (floor, Some(k)),
                None => return Selected::Serial,
            },
            Rule::RandomK(_) => return Selected::Serial,
        };
        let count = if parallel {
            match self.collect_in_parallel(g, r, floor, limit, rule) {
                Ok(Some(count)) => count,
                Ok(None) => return Selected::Serial,
                Err(select::OutOfLimit) => return Selected::OutOfLimit,
            }
        } else {
            // One list, at first of the serial selection's capacity; one that is too short
            // grows to the count (up to four times that capacity) and the tensor is scanned
            // again.
            let scan = |idx: &mut [u32], bits: &mut [u32]| {
                select::candidates(g, r, 0, floor, limit, idx, bits)
            };
            match scan(&mut self.idx, &mut self.bits) {
                Ok(count) if count <= self.idx.len() => count,
                Ok(count) if count <= rule.bound(n) => {
                    grow(&mut self.idx, count);
                    grow(&mut self.bits, count);
                    match scan(&mut self.idx, &mut self.bits) {
                        Ok(c) if c == count => count,
                        _ => return Selected::Serial,
                    }
                }
                Ok(_) => return Selected::Serial,
                Err(select::OutOfLimit) => return Selected::OutOfLimit,
            }
        };
        if k.is_some_and(|k| count < k) {
            return Selected::Serial;
        }
        // Step 3: the exact top-k among the candidates (threshold: all of them).
        let (idx, bits) = (&mut self.idx[..count], &mut self.bits[..count]);
        let kept = match k {
            Some(k) => select::topk_of_candidates(idx, bits, k, &mut self.hist),
            None => Kept { idx, bits },
        };
        let Ok(len) = encode_kept_into(n, params, kept, frame) else {
            return Selected::Serial;
        };
        // With a residual, the sent values are decoded now, so that the update after every
        // entry of the step is encoded cannot fail (no residual may change before all have).
        if r.is_some() && !self.sent.decode(&frame[..len], n, &params.method) {
            return Selected::Serial;
        }
        FRAMES.fetch_add(1, Ordering::Relaxed);
        Selected::Frame(len)
    }

    /// Top-k of `x = g + r` for an error-feedback step whose residual bound proved every sum in
    /// range (`ResidualBound::proves_in_range`, in the step's check pass): each chunk is read
    /// once, storing `r = g + r` as it collects its candidates ([`select::candidates_update`]);
    /// the exact top-k among them (when the sample missed, among all of `r`, which holds the sums
    /// by then) is written as the frame into `frame`, and the kept entries are fixed up
    /// (`r[i] += -decoded[i]`). Chunks on rayon's pool with `parallel`. Returns the frame length
    /// and the residual's new bound: the frame, residual and bound of the core's
    /// `feedback_step_bounded`. `None` only when the proof did not hold (a sum out of range; `r`
    /// holds the sums then) or the method is not top-k on a tensor this large.
    pub(crate) fn encode_one_pass(
        &mut self,
        params: &Params,
        g: &[f32],
        r: &mut [f32],
        frame: &mut [u8],
        parallel: bool,
    ) -> Option<(usize, ResidualBound)> {
        let n = g.len();
        let (Some(Rule::TopK(k)), Some(v)) = (Rule::of(n, &params.method), params.method.values())
        else {
            return None;
        };
        if r.len() != n {
            return None;
        }
        let rule = Rule::TopK(k);
        let limit = values::magnitude_limit(Some(v));
        self.reserve(n, rule, parallel);
        // The floor samples `g + r` before any chunk changes.
        let floor = select::topk_floor(g, Some(&*r), k, &mut self.samples)?;
        let count = if parallel {
            self.collect_updating_in_parallel(g, r, floor, limit, rule)
                .ok()?
        } else {
            let c = select::candidates_update(g, r, 0, floor, limit, &mut self.idx, &mut self.bits)
                .ok()?;
            if c <= self.idx.len() {
                Some(c)
            } else if c <= rule.bound(n) {
                grow(&mut self.idx, c);
                grow(&mut self.bits, c);
                select::candidates(r, None, 0, floor, limit, &mut self.idx, &mut self.bits)
                    .ok()
                    .filter(|&again| again == c)
            } else {
                None
            }
        };
        let chunked = count.filter(|&c| c >= k);
        let kept = match chunked {
            Some(c) => select::topk_of_candidates(
                &mut self.idx[..c],
                &mut self.bits[..c],
                k,
                &mut self.hist,
            ),
            None => {
                // The sample missed or overshot: the exact top-k of `r`, the sums.
                grow(&mut self.fallback, select::kept_scratch_len(n, k));
                select::topk_kept(r, k, limit, &mut self.fallback).ok()?
            }
        };
        // No element left unsent is larger than the smallest kept.
        let smallest_kept = kept
            .bits
            .iter()
            .map(|&b| f32::from_bits(b & 0x7fff_ffff))
            .fold(f32::INFINITY, f32::min);
        let len = encode_kept_into(n, params, kept, frame).ok()?;
        if !self.sent.decode(&frame[..len], n, &params.method) {
            return None;
        }
        let sent = &self.sent;
        let fix = |(j, r): (usize, &mut [f32])| sent.subtract_range(j * CHUNK, r);
        let largest_fixed = if parallel {
            r.par_chunks_mut(CHUNK)
                .enumerate()
                .map(fix)
                .reduce(|| 0.0, f32::max)
        } else {
            r.chunks_mut(CHUNK).enumerate().map(fix).fold(0.0, f32::max)
        };
        if chunked.is_some() {
            FRAMES.fetch_add(1, Ordering::Relaxed);
        }
        ONE_PASS.fetch_add(1, Ordering::Relaxed);
        Some((
            len,
            ResidualBound::at_most(smallest_kept.max(largest_fixed)),
        ))
    }

    /// Random-k: the indices drawn in chunks (each chunk's task checks the chunk first, as the
    /// top-k scan does), the values at them gathered (`g`, or the f32 sum `g + r`), the frame
    /// written from the list.
    fn encode_randomk(
        &mut self,
        params: &Params,
        g: &[f32],
        r: Option<&[f32]>,
        frame: &mut [u8],
        parallel: bool,
    ) -> Selected {
        let n = g.len();
        // The serial path's input check, chunk by chunk (a failing chunk: the serial check
        // names the element).
        let values = params.method.values();
        let check = |a: usize, e: usize| {
            check_step_input("", &g[a..e], r.map(|r| &r[a..e]), values).is_ok()
        };
        if !self.draw.draw_for(params, n, parallel, check) {
            return Selected::OutOfLimit;
        }
        let idx = self.draw.indices();
        grow(&mut self.bits, idx.len());
        let bits = &mut self.bits[..idx.len()];
        for (b, &i) in bits.iter_mut().zip(idx) {
            let i = i as usize;
            *b = r.map_or(g[i], |r| g[i] + r[i]).to_bits();
        }
        let kept = Kept { idx, bits };
        let Ok(len) = encode_kept_into(n, params, kept, frame) else {
            // Unbiased values whose n/k multiple overflows: the serial encoder names one.
            return Selected::Serial;
        };
        if r.is_some() && !self.sent.decode_randomk(&frame[..len], n, params, idx) {
            return Selected::Serial;
        }
        FRAMES.fetch_add(1, Ordering::Relaxed);
        Selected::Frame(len)
    }

    /// Sizes the buffers for a tensor of `n` elements selected by `rule` (so that a later step
    /// allocates nothing): the serial selection's candidate capacity, the sample, the radix
    /// histogram, the decoded sent entries (k, or the threshold's capacity) and, with
    /// `parallel`, one list per chunk. A step that keeps more than that capacity (threshold:
    /// more than `n/32 + 64` entries) grows the lists once, up to four times it.
    pub(crate) fn reserve(&mut self, n: usize, rule: Rule, parallel: bool) {
        let cap = rule.capacity(n);
        grow(&mut self.bits, cap);
        match rule {
            Rule::TopK(k) => {
                grow(&mut self.idx, cap);
                grow(&mut self.samples, select::SAMPLE_LEN);
                grow(&mut self.hist, select::candidates_hist_len(cap));
                self.sent.reserve(k);
            }
            Rule::Threshold(_) => {
                grow(&mut self.idx, cap);
                self.sent.reserve(cap);
            }
            Rule::RandomK(k) => {
                // The indices are the draw's; no chunk lists of candidates.
                self.sent.reserve(k);
                self.draw.reserve(n, k as u64, parallel);
                return;
            }
        }
        if parallel {
            let chunks = n.div_ceil(CHUNK);
            if self.chunks.len() < chunks {
                self.chunks.resize_with(chunks, ChunkList::default);
            }
            let first = rule.chunk_capacity(n);
            for list in &mut self.chunks[..chunks] {
                grow(&mut list.idx, first);
                grow(&mut list.bits, first);
            }
        }
    }

    /// Every chunk's candidates on rayon's pool, then the lists in chunk order in
    /// `self.idx`/`self.bits`; returns their count. A list too short for its chunk grows to the
    /// count and the chunk (in the L2 cache by then) is scanned again, while the total stays
    /// within four times the serial selection's capacity (`Ok(None)` past it).
    fn collect_in_parallel(
        &mut self,
        g: &[f32],
        r: Option<&[f32]>,
        floor: f32,
        limit: f32,
        rule: Rule,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        let n = g.len();
        let bound = rule.bound(n);
        let chunks = n.div_ceil(CHUNK);
        let total = AtomicUsize::new(0);
        let bad = AtomicBool::new(false);
        let over = AtomicBool::new(false);
        self.chunks[..chunks]
            .par_iter_mut()
            .enumerate()
            .for_each(|(j, list)| {
                let start = j * CHUNK;
                let end = (start + CHUNK).min(n);
                let (gc, rc) = (&g[start..end], r.map(|r| &r[start..end]));
                list.count = 0;
                let scan = |list: &mut ChunkList| {
                    select::candidates(gc, rc, start, floor, limit, &mut list.idx, &mut list.bits)
                };
                let Ok(count) = scan(list) else {
                    bad.store(true, Ordering::Relaxed);
                    return;
                };
                if total.fetch_add(count, Ordering::Relaxed) + count > bound {
                    over.store(true, Ordering::Relaxed);
                    return;
                }
                if count > list.idx.len() {
                    grow(&mut list.idx, count);
                    grow(&mut list.bits, count);
                    if scan(list) != Ok(count) {
                        bad.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                list.count = count;
            });
        self.finish_lists(n, rule, &bad, &over)
    }

    /// [`SparseSplit::collect_in_parallel`] of `g + r` that stores the sums in `r` on the way
    /// ([`select::candidates_update`]); a chunk collected again reads its sums from `r`.
    fn collect_updating_in_parallel(
        &mut self,
        g: &[f32],
        r: &mut [f32],
        floor: f32,
        limit: f32,
        rule: Rule,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        let n = g.len();
        let bound = rule.bound(n);
        let chunks = n.div_ceil(CHUNK);
        let total = AtomicUsize::new(0);
        let bad = AtomicBool::new(false);
        let over = AtomicBool::new(false);
        self.chunks[..chunks]
            .par_iter_mut()
            .zip(r.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(j, ((list, rc), gc))| {
                let start = j * CHUNK;
                list.count = 0;
                let first = select::candidates_update(
                    gc,
                    rc,
                    start,
                    floor,
                    limit,
                    &mut list.idx,
                    &mut list.bits,
                );
                let Ok(count) = first else {
                    bad.store(true, Ordering::Relaxed);
                    return;
                };
                if total.fetch_add(count, Ordering::Relaxed) + count > bound {
                    over.store(true, Ordering::Relaxed);
                    return;
                }
                if count > list.idx.len() {
                    grow(&mut list.idx, count);
                    grow(&mut list.bits, count);
                    let again = select::candidates(
                        rc,
                        None,
                        start,
                        floor,
                        limit,
                        &mut list.idx,
                        &mut list.bits,
                    );
                    if again != Ok(count) {
                        bad.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                list.count = count;
            });
        self.finish_lists(n, rule, &bad, &over)
    }

    /// After the chunks' scans: the error or overflow they flagged, else the lists in chunk
    /// order in `self.idx`/`self.bits` and their count.
    fn finish_lists(
        &mut self,
        n: usize,
        rule: Rule,
        bad: &AtomicBool,
        over: &AtomicBool,
    ) -> Result<Option<usize>, select::OutOfLimit> {
        if bad.load(Ordering::Relaxed) || over.load(Ordering::Relaxed) {
            self.trim_lists(n, rule);
            return match bad.load(Ordering::Relaxed) {
                true => Err(select::OutOfLimit),
                false => Ok(None),
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

    /// The residual update of an error-feedback step whose frame [`SparseSplit::encode`] wrote
    /// from `g` and `r` (with `r` given, so that it decoded the sent values): `r = r + g`, then
    /// `r[i] += -decoded[i]` at the kept indices, chunks on rayon's pool with `parallel`.
    /// Returns the new residual's bound, measured chunk by chunk while each is in cache (so
    /// that the next step can take [`SparseSplit::encode_one_pass`]).
    pub(crate) fn update_residual(
        &self,
        g: &[f32],
        r: &mut [f32],
        parallel: bool,
    ) -> ResidualBound {
        debug_assert_eq!(g.len(), r.len());
        let sent = &self.sent;
        let update = |(j, (r, g)): (usize, (&mut [f32], &[f32]))| {
            for (r, g) in r.iter_mut().zip(g) {
                *r += *g;
            }
            sent.add_range(j * CHUNK, r, -1.0);
            ResidualBound::of(r).max_abs()
        };
        let max = if parallel {
            r.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .enumerate()
                .map(update)
                .reduce(|| 0.0, f32::max)
        } else {
            r.chunks_mut(CHUNK)
                .zip(g.chunks(CHUNK))
                .enumerate()
                .map(update)
                .fold(0.0, f32::max)
        };
        ResidualBound::at_most(max)
    }
}

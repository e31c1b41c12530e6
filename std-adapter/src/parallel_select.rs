//! Top-k and threshold of one large tensor, selected in chunks on rayon's pool.
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
//!    chunks in parallel, the one full read of the tensor;
//! 3. the lists, concatenated in chunk order, hold every element at or above the floor; with at
//!    least k of them, an exact radix select among them (1-2% of the tensor) keeps the top-k,
//!    ties to the lower index: the same entries as the serial selection, so
//!    [`gradwire_core::encode_kept_into`] writes the same frame byte for byte.
//!
//! With error feedback the scanned values are `g + r` (the f32 sum the serial step encodes),
//! read without changing the residual, so that a bad value found on the way leaves everything
//! as it was; once every entry of the step is encoded, [`SparseSplit::update_residual`] writes
//! `r = r + g`, then `r[i] += -decoded[i]` at the kept indices, chunks in parallel: per element
//! the operations of the core's `feedback_step`.
//!
//! When the sample misses (fewer than k candidates) or overshoots (more than four times what
//! the serial selection would hold), the entry goes the serial way; both are rare on real
//! gradients, and the result is the same frame either way.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use gradwire_core::select::{self, Kept};
use gradwire_core::{Method, Params, encode_kept_into, values};
use rayon::prelude::*;

use crate::parallel::{CHUNK, SPLIT_MIN, SparseList};

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

/// Whether a tensor of `n` elements with `method` is selected in chunks: top-k with
/// `0 < k < n` on at least [`SPLIT_MIN`] elements (past the core's sampling minimum), or
/// threshold, with `u32` indices.
pub(crate) fn splits_selection(n: usize, method: &Method) -> bool {
    let sized = n >= SPLIT_MIN.max(select::SAMPLED_MIN) && u32::try_from(n).is_ok();
    match *method {
        Method::TopK { k, .. } => {
            let k = k.resolve(n as u64);
            sized && k > 0 && k < n as u64
        }
        Method::Threshold { .. } => sized,
        _ => false,
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
}

impl SparseSplit {
    /// Selects the entries of `x = g` (or `g + r` with a residual of the same length) that the
    /// frame of `params` keeps, chunks in parallel, and writes the frame into `frame` (at
    /// least the method's `max_frame_len` bytes): the bytes of the core's `encode_into` of `x`.
    /// Reads `g` and `r` only.
    pub(crate) fn encode(
        &mut self,
        params: &Params,
        g: &[f32],
        r: Option<&[f32]>,
        frame: &mut [u8],
    ) -> Selected {
        let n = g.len();
        if !splits_selection(n, &params.method) || r.is_some_and(|r| r.len() != n) {
            return Selected::Serial;
        }
        let Some(v) = params.method.values() else {
            return Selected::Serial;
        };
        let limit = values::magnitude_limit(Some(v));
        let (floor, k, bound) = match params.method {
            Method::TopK { k, .. } => {
                let k = k.resolve(n as u64) as usize;
                self.samples.resize(select::SAMPLE_LEN, 0);
                let Some(floor) = select::topk_floor(g, r, k, &mut self.samples) else {
                    return Selected::Serial;
                };
                (floor, Some(k), 4 * select::candidate_capacity(n, k))
            }
            Method::Threshold { threshold, .. } => (select::threshold_floor(threshold), None, n),
            _ => return Selected::Serial,
        };
        // Step 2: every chunk's candidates, in parallel. A list too short for its chunk grows
        // to the count and the chunk (in the L2 cache by then) is scanned again, while the
        // total stays within `bound`.
        let chunks = n.div_ceil(CHUNK);
        if self.chunks.len() < chunks {
            self.chunks.resize_with(chunks, ChunkList::default);
        }
        let first = match k {
            Some(k) => (k.div_ceil(chunks) * 2).max(64),
            None => 1024,
        };
        let total = AtomicUsize::new(0);
        let bad = AtomicBool::new(false);
        let over = AtomicBool::new(false);
        self.chunks[..chunks]
            .par_iter_mut()
            .enumerate()
            .for_each(|(j, list)| {
                let start = j * CHUNK;
                let end = (start + CHUNK).min(n);
                let gc = &g[start..end];
                let rc = r.map(|r| &r[start..end]);
                if list.idx.len() < first {
                    list.idx.resize(first, 0);
                    list.bits.resize(first, 0);
                }
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
                    list.idx.resize(count, 0);
                    list.bits.resize(count, 0);
                    if scan(list) != Ok(count) {
                        bad.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                list.count = count;
            });
        if bad.load(Ordering::Relaxed) {
            return Selected::OutOfLimit;
        }
        let total = total.load(Ordering::Relaxed);
        if over.load(Ordering::Relaxed) || k.is_some_and(|k| total < k) {
            return Selected::Serial;
        }
        // Step 3: the lists in chunk order, then the exact top-k among them.
        self.idx.clear();
        self.bits.clear();
        for list in &self.chunks[..chunks] {
            self.idx.extend_from_slice(&list.idx[..list.count]);
            self.bits.extend_from_slice(&list.bits[..list.count]);
        }
        let kept = match k {
            Some(k) => {
                self.hist.resize(select::topk_scratch_len(n), 0);
                select::topk_of_candidates(&mut self.idx, &mut self.bits, k, &mut self.hist)
            }
            None => Kept {
                idx: &self.idx,
                bits: &self.bits,
            },
        };
        match encode_kept_into(n, params, kept, frame) {
            Ok(len) => Selected::Frame(len),
            Err(_) => Selected::Serial,
        }
    }

    /// The residual update of an error-feedback step whose `frame` (made by
    /// [`SparseSplit::encode`] from `g` and `r`, `method` its manifest's method) is complete:
    /// `r = r + g`, then `r[i] += -decoded[i]` at the kept indices, chunks in parallel. `false`
    /// (and `r` unchanged) when the frame does not decode.
    pub(crate) fn update_residual(
        &mut self,
        frame: &[u8],
        method: &Method,
        g: &[f32],
        r: &mut [f32],
    ) -> bool {
        if g.len() != r.len() || !self.sent.decode(frame, g.len(), method) {
            return false;
        }
        let sent = &self.sent;
        r.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(j, (r, g))| {
                for (r, g) in r.iter_mut().zip(g) {
                    *r += *g;
                }
                sent.add_range(j * CHUNK, r, -1.0);
            });
        true
    }
}

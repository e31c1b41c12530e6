//! Magnitude selection: exact top-k, threshold and seeded random-k.
//!
//! These are the entry points the frame encoder uses. They must produce exactly what the
//! [`crate::scalar`] specification produces.
//!
//! ## Fast exact top-k
//! [`topk_kept`] samples [`SAMPLE_LEN`] elements (stratified, at positions from a fixed
//! generator) to estimate a magnitude threshold safely below the k-th largest, collects every
//! element at or above it in one SIMD pass (compare, bitmask, indices and values into scratch),
//! and finishes with an exact radix select among those candidates. When the sample misses (fewer
//! than k candidates) or overshoots (more than the scratch holds), it falls back to the full
//! radix select of [`crate::scalar::topk_cut`]. Either way the result is the exact top-k, ties to
//! the lower index: the sample only decides how fast it gets there.

use crate::lanes::{LANES, One, Source, Sum, bitmask32, load, prefetch_line, region_ahead};
pub use crate::scalar::{Cut, Selection};
use crate::scalar::{TOPK_HIST, magnitude_key};
use wide::f32x8;

/// Elements that [`topk_kept`] samples to estimate its threshold (tensors of at least
/// [`SAMPLED_MIN`] elements).
pub const SAMPLE_LEN: usize = 16_384;

/// Tensors shorter than this select without sampling (radix select over the whole tensor).
pub const SAMPLED_MIN: usize = 1 << 16;

const KEY_MASK: u32 = 0x7fff_ffff;

/// How many groups of `4 * LANES` elements [`scan`] compares before it looks again at the
/// lanes they flagged (2,048 elements: for one buffer the block's lines are still in the L1
/// cache then; for `g + r`, some may be in L2).
const PENDING: usize = 64;

/// Scratch words [`topk_cut`] needs for a tensor of `n` elements.
pub const fn topk_scratch_len(_n: usize) -> usize {
    TOPK_HIST
}

/// Candidates [`topk_kept`] can hold for `k` of `n` elements: `min(n, 2k + n / 256 + 64)`.
pub const fn candidate_capacity(n: usize, k: usize) -> usize {
    let c = k
        .saturating_mul(2)
        .saturating_add(n / 256)
        .saturating_add(64);
    if c < n { c } else { n }
}

/// Elements [`topk_kept`] samples for a tensor of `n` elements: [`SAMPLE_LEN`] from
/// [`SAMPLED_MIN`] on, else 0 (no sampling).
pub const fn sample_len(n: usize) -> usize {
    if n >= SAMPLED_MIN { SAMPLE_LEN } else { 0 }
}

/// Words of `hist` that let [`topk_of_candidates`] take its fast path for `count` candidates
/// (the radix histogram, and room for the keys of the bucket that holds the cut, which on
/// gradient-like data is about 13% of the candidates).
pub const fn candidates_hist_len(count: usize) -> usize {
    TOPK_HIST.saturating_add(count / 4).saturating_add(64)
}

/// Scratch words [`topk_kept`] needs for `k` of `n` elements.
pub const fn kept_scratch_len(n: usize, k: usize) -> usize {
    kept_scratch_len_with(n, k, sample_len(n))
}

/// Scratch words [`topk_kept_with`] needs for `k` of `n` elements and `sample` samples.
pub const fn kept_scratch_len_with(n: usize, k: usize, sample: usize) -> usize {
    TOPK_HIST
        .saturating_add(sample)
        .saturating_add(candidate_capacity(n, k).saturating_mul(2))
}

/// Entries [`threshold_kept`] can hold for `n` elements: `min(n, n / 32 + 64)`.
pub const fn threshold_capacity(n: usize) -> usize {
    let c = n / 32 + 64;
    if c < n { c } else { n }
}

/// Scratch words [`threshold_kept`] needs for `n` elements.
pub const fn threshold_scratch_len(n: usize) -> usize {
    threshold_capacity(n).saturating_mul(2)
}

/// The cut of exact top-k for `1 <= k <= g.len()` (ties to the lower index). `g` must be
/// finite; `scratch` holds at least [`topk_scratch_len`] words.
pub fn topk_cut(g: &[f32], k: usize, scratch: &mut [u32]) -> Cut {
    crate::scalar::topk_cut(g, k, scratch)
}

/// The selection of top-k with `k` resolved for `g.len()`.
pub fn topk(g: &[f32], k: usize, scratch: &mut [u32]) -> Selection {
    if k == 0 {
        Selection::None
    } else if k >= g.len() {
        Selection::All
    } else {
        Selection::TopK(topk_cut(g, k, scratch))
    }
}

/// Calls `f(i)` for every kept index in ascending order.
pub fn for_each_kept(g: &[f32], sel: Selection, mut f: impl FnMut(usize)) {
    match sel {
        Selection::RandomK { key, k } => {
            crate::randomk::for_each(g.len() as u64, k, key, |i| f(i as usize))
        }
        _ => crate::scalar::for_each_kept(g, sel, f),
    }
}

/// The entries a selection keeps, in ascending index order: `idx[j]` and the f32 bits of its
/// value `bits[j]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kept<'a> {
    /// Kept indices, strictly ascending.
    pub idx: &'a [u32],
    /// `f32::to_bits` of the kept values, in the same order.
    pub bits: &'a [u32],
}

/// A scan met an element whose magnitude is not below the limit it was given: NaN, infinite,
/// or beyond the range of the value type (see [`crate::values::magnitude_limit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfLimit;

/// Exact top-k of `g` as a list of kept entries (`k` clamped to `g.len()`), checking on the
/// way that every `|g[i]| < limit` (pass `f32::INFINITY` to check finiteness only).
///
/// `scratch` holds at least [`kept_scratch_len`]`(g.len(), k)` words; `g.len()` must fit in
/// a `u32`. The result equals [`crate::scalar::topk_cut`] + [`crate::scalar::for_each_kept`].
///
/// # Errors
/// [`OutOfLimit`] when some element is NaN or `|g[i]| >= limit`.
///
/// # Panics
/// When `scratch` is too short or `g.len() > u32::MAX`.
pub fn topk_kept<'s>(
    g: &[f32],
    k: usize,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    topk_kept_src(&One(g), k, limit, sample_len(g.len()), scratch)
}

/// [`topk_kept`] with an explicit sample size (0: no sampling; otherwise at most `g.len()`),
/// for tests of both paths; `scratch` holds [`kept_scratch_len_with`] words.
///
/// # Errors
/// As [`topk_kept`].
///
/// # Panics
/// As [`topk_kept`], and when `sample > g.len()`.
pub fn topk_kept_with<'s>(
    g: &[f32],
    k: usize,
    limit: f32,
    sample: usize,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    assert!(sample <= g.len());
    topk_kept_src(&One(g), k, limit, sample, scratch)
}

/// Entries with `|g[i]| > t` (`t` finite, `>= 0`) as a list, checking that every
/// `|g[i]| < limit`. `Ok(None)` when more than [`threshold_capacity`] entries pass.
///
/// # Errors
/// [`OutOfLimit`] as [`topk_kept`].
///
/// # Panics
/// When `scratch` is shorter than [`threshold_scratch_len`] or `g.len() > u32::MAX`.
pub fn threshold_kept<'s>(
    g: &[f32],
    t: f32,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Option<Kept<'s>>, OutOfLimit> {
    threshold_kept_src(&One(g), t, limit, scratch)
}

/// Chunked selection, step 1 of 3 for top-k: a magnitude floor at or below the k-th largest
/// `|x|` of the whole tensor with high probability, where `x = g` or, with `residual`,
/// `x = g + residual` (f32 addition, the input of an error-feedback step). The same floor
/// [`topk_kept`] scans with; `samples` holds at least [`SAMPLE_LEN`] words.
///
/// Chunked top-k (for a tensor split across threads, each chunk scanned on its own): take this
/// floor, collect each chunk's [`candidates`] at or above it, concatenate the lists in chunk
/// order, and when they hold at least `k` entries finish with [`topk_of_candidates`]; the
/// result is exactly [`topk_kept`]'s. When they hold fewer (the sample missed, rare), select
/// on the whole tensor instead.
///
/// `None` when there is nothing to sample: `g.len() <` [`SAMPLED_MIN`], `k == 0`,
/// `k >= g.len()`, or `residual` of another length than `g`.
///
/// # Panics
/// When `samples` is shorter than [`SAMPLE_LEN`].
pub fn topk_floor(
    g: &[f32],
    residual: Option<&[f32]>,
    k: usize,
    samples: &mut [u32],
) -> Option<f32> {
    let n = g.len();
    if n < SAMPLED_MIN || k == 0 || k >= n || residual.is_some_and(|r| r.len() != n) {
        return None;
    }
    let samples = &mut samples[..SAMPLE_LEN];
    let t = match residual {
        None => sample_threshold(&One(g), k, samples),
        Some(r) => sample_threshold(&Sum(g, r), k, samples),
    };
    Some(f32::from_bits(t))
}

/// Chunked selection, step 1 for threshold selection (`|x| > t`, `t` finite and `>= 0`): the
/// floor that [`candidates`] takes, the smallest f32 above `|t|`, so that `|x| >= floor`
/// exactly when `|x| > t`.
pub fn threshold_floor(t: f32) -> f32 {
    f32::from_bits((t.to_bits() & KEY_MASK).saturating_add(1))
}

/// Chunked selection, step 2: the entries of one chunk with `|x| >= floor`, where `x = g` or,
/// with `residual` (same length), `x = g + residual`, checking on the way that every
/// `|x| < limit` (as [`topk_kept`]). The chunk starts at element `offset` of the tensor: the
/// indices written are `offset + i`, ascending; `bits` gets `x.to_bits()`.
///
/// Returns how many entries pass, which may exceed `idx.len()` or `bits.len()`: the lists
/// then hold the first ones only (call again with longer lists).
///
/// # Errors
/// [`OutOfLimit`] when some `x` is NaN or `|x| >= limit`.
///
/// # Panics
/// When `residual` has another length than `g`, or `offset + g.len()` exceeds `u32::MAX + 1`
/// (indices are `u32`).
pub fn candidates(
    g: &[f32],
    residual: Option<&[f32]>,
    offset: usize,
    floor: f32,
    limit: f32,
    idx: &mut [u32],
    bits: &mut [u32],
) -> Result<usize, OutOfLimit> {
    let end = offset.checked_add(g.len());
    assert!(
        end.is_some_and(|e| e as u64 <= 1 << 32),
        "indices beyond u32"
    );
    let (idx, bits) = {
        let m = idx.len().min(bits.len());
        (&mut idx[..m], &mut bits[..m])
    };
    let (count, ok) = match residual {
        None => scan(&One(g), floor, limit, idx, bits, |_| true),
        Some(r) => {
            assert_eq!(r.len(), g.len(), "residual length");
            scan(&Sum(g, r), floor, limit, idx, bits, |_| true)
        }
    };
    if !ok {
        return Err(OutOfLimit);
    }
    if offset > 0 {
        let base = offset as u32;
        let written = count.min(idx.len());
        for i in &mut idx[..written] {
            *i += base;
        }
    }
    Ok(count)
}

/// Chunked selection, step 2 of an error-feedback step that has proved every sum finite
/// ([`crate::ResidualBound::proves_sums_finite`]): [`candidates`] of `x = g + residual` that also
/// stores each sum in `residual` (`residual[i] = g[i] + residual[i]`, the f32 addition, for every
/// element), so that the chunk's `g` and residual are read once and the residual written once.
/// The floor must be taken ([`topk_floor`]) before the first chunk changes.
///
/// Returns the count as [`candidates`] does; when the lists were too short, collect again with
/// [`candidates`] on `residual` alone, which holds the sums by then.
///
/// # Errors
/// [`OutOfLimit`] when some sum is NaN or at or above `limit` (impossible after the proof); the
/// residual holds the sums then.
///
/// # Panics
/// When `residual` has another length than `g`, or `offset + g.len()` exceeds `u32::MAX + 1`.
pub fn candidates_update(
    g: &[f32],
    residual: &mut [f32],
    offset: usize,
    floor: f32,
    limit: f32,
    idx: &mut [u32],
    bits: &mut [u32],
) -> Result<usize, OutOfLimit> {
    let end = offset.checked_add(g.len());
    assert!(
        end.is_some_and(|e| e as u64 <= 1 << 32),
        "indices beyond u32"
    );
    assert_eq!(residual.len(), g.len(), "residual length");
    let m = idx.len().min(bits.len());
    let (idx, bits) = (&mut idx[..m], &mut bits[..m]);
    let (count, ok) = scan_update(g, None, residual, floor, limit, idx, bits);
    if !ok {
        return Err(OutOfLimit);
    }
    let base = offset as u32;
    for i in &mut idx[..count.min(m)] {
        *i += base;
    }
    Ok(count)
}

/// Chunked selection, step 3 for top-k: the exact top-k (ties to the lower index) among
/// candidates `idx`/`bits` (as [`candidates`] writes them, the chunks' lists concatenated in
/// order) that include every element of the tensor with `|x| >=` the floor of [`topk_floor`].
/// With at least `k` of them, this is exactly the tensor's top-k. Keeps the chosen entries in
/// place, in order; `hist` holds at least [`topk_scratch_len`] words, and any words beyond
/// those are working space that makes it faster (a fifth of the candidate count is usually
/// enough; see [`candidates_hist_len`]).
///
/// With `k >= idx.len()` every candidate is kept; with `k == 0`, none.
///
/// # Panics
/// When `idx` and `bits` differ in length or `hist` is too short.
pub fn topk_of_candidates<'s>(
    idx: &'s mut [u32],
    bits: &'s mut [u32],
    k: usize,
    hist: &mut [u32],
) -> Kept<'s> {
    assert_eq!(idx.len(), bits.len(), "candidate lists");
    let count = idx.len();
    let kept = if k == 0 {
        0
    } else if k >= count {
        count
    } else {
        let (hist, spare) = hist.split_at_mut(TOPK_HIST);
        let cut = candidate_cut(bits, k, hist, spare);
        keep_cut(idx, bits, cut)
    };
    Kept {
        idx: &idx[..kept],
        bits: &bits[..kept],
    }
}

pub(crate) fn threshold_kept_src<'s, S: Source>(
    src: &S,
    t: f32,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Option<Kept<'s>>, OutOfLimit> {
    let n = src.len();
    assert!(u32::try_from(n).is_ok());
    let cap = threshold_capacity(n);
    let (idx, rest) = scratch.split_at_mut(cap);
    let bits = &mut rest[..cap];
    // |x| > t  <=>  |x| >= next float above |t| (t finite and >= 0).
    let lo = threshold_floor(t);
    let (count, ok) = scan(src, lo, limit, idx, bits, |_| true);
    if !ok {
        return Err(OutOfLimit);
    }
    if count > cap {
        return Ok(None);
    }
    Ok(Some(Kept {
        idx: &idx[..count],
        bits: &bits[..count],
    }))
}

pub(crate) fn topk_kept_src<'s, S: Source>(
    src: &S,
    k: usize,
    limit: f32,
    sample: usize,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    let n = src.len();
    assert!(u32::try_from(n).is_ok());
    let k = k.min(n);
    let cap = candidate_capacity(n, k);
    let (hist, rest) = scratch.split_at_mut(TOPK_HIST);
    let (samples, rest) = rest.split_at_mut(sample);
    let (idx, rest) = rest.split_at_mut(cap);
    let bits = &mut rest[..cap];
    if k == 0 || k == n {
        // Nothing, or everything: one checking pass.
        let lo = if k == 0 { f32::INFINITY } else { 0.0 };
        let (count, ok) = scan(src, lo, limit, idx, bits, |_| true);
        if !ok {
            return Err(OutOfLimit);
        }
        let count = if k == 0 { 0 } else { count };
        return Ok(Kept {
            idx: &idx[..count],
            bits: &bits[..count],
        });
    }
    if sample > 0 {
        // A sample of zeros (a sparse input: a sum of sparse frames) floors at the smallest
        // non-zero key, so that the candidates are the non-zeros rather than every element;
        // with fewer than k of them the exact selection below runs, as for any miss.
        let t = sample_threshold(src, k, samples).max(1);
        let (count, ok) = scan(src, f32::from_bits(t), limit, idx, bits, |_| true);
        if !ok {
            return Err(OutOfLimit);
        }
        if count >= k && count <= cap {
            // Every element with key >= t is a candidate and there are at least k of them, so
            // the k-th largest key and the ties before it are the same among the candidates.
            let (cand, spare) = idx.split_at_mut(count);
            let cut = candidate_cut(&bits[..count], k, hist, spare);
            let kept = keep_cut(cand, &mut bits[..count], cut);
            debug_assert_eq!(kept, k);
            return Ok(Kept {
                idx: &idx[..k],
                bits: &bits[..k],
            });
        }
    }
    kept_by_radix(src, k, limit, hist, idx, bits)
}

/// Exact top-k of `src` (`0 < k < n`) by a full radix select, then one collecting pass, into
/// the lists `idx` and `bits` (at least `k` long).
fn kept_by_radix<'s, S: Source>(
    src: &S,
    k: usize,
    limit: f32,
    hist: &mut [u32],
    idx: &'s mut [u32],
    bits: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    let n = src.len();
    let cut = radix_cut((0..n).map(|i| magnitude_key(src.at(i))), k, hist);
    let mut ties = cut.take_ties;
    let lo = f32::from_bits(cut.key);
    let (count, ok) = scan(src, lo, limit, idx, bits, |key| {
        if key > cut.key {
            true
        } else if key == cut.key && ties > 0 {
            ties -= 1;
            true
        } else {
            false
        }
    });
    if !ok {
        return Err(OutOfLimit);
    }
    debug_assert_eq!(count, k);
    Ok(Kept {
        idx: &idx[..count],
        bits: &bits[..count],
    })
}

/// Exact top-k of `x = g + r` (`k` clamped to the length) for an error-feedback step run in
/// place: stores every sum in `r` (`r[i] = g[i] + r[i]`, the f32 addition) and returns the
/// kept entries of the sums, as [`topk_kept`] of the sums would (ties to the lower index). On
/// tensors of at least [`SAMPLED_MIN`] elements with `0 < k < n`, `g` and `r` are read once and
/// `r` written once while the candidates are collected; otherwise the sums are stored, then
/// selected.
///
/// The caller checks the sums first (for example [`crate::feedback::first_bad_sum`], or a
/// [`crate::ResidualBound`] that proves them in range): the selection still checks every
/// `|x| < limit`, but `r` holds the sums when it fails.
///
/// `scratch` holds at least [`kept_scratch_len`]`(g.len(), k)` words.
///
/// # Errors
/// [`OutOfLimit`] when some sum is NaN or `|x| >= limit` (`r` holds the sums then).
///
/// # Panics
/// When `g` and `r` differ in length, `scratch` is too short, or the length exceeds
/// `u32::MAX`.
pub fn topk_kept_sum_into<'s>(
    g: &[f32],
    r: &mut [f32],
    k: usize,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    topk_kept_sums(g, None, r, k, limit, scratch)
}

/// As [`topk_kept_sum_into`], with the residual read from `old` and the sums stored in `sums`
/// (`sums[i] = g[i] + old[i]`, the f32 addition; `sums`' earlier values are not read): the
/// error-feedback step of a residual kept in two buffers, the step's new one written while
/// the old one stays as it was (a step that fails later keeps the old one with no copy).
/// The kept entries, the sums and the errors are those of [`topk_kept_sum_into`] run on a
/// copy of `old`, bit for bit.
///
/// # Errors
/// [`OutOfLimit`] when some sum is NaN or `|x| >= limit` (`sums` holds the sums then).
///
/// # Panics
/// When `g`, `old` and `sums` differ in length, `scratch` is shorter than
/// [`kept_scratch_len`]`(g.len(), k)` words, or the length exceeds `u32::MAX`.
pub fn topk_kept_sum_from<'s>(
    g: &[f32],
    old: &[f32],
    sums: &mut [f32],
    k: usize,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    assert_eq!(old.len(), sums.len(), "residual length");
    topk_kept_sums(g, Some(old), sums, k, limit, scratch)
}

/// [`topk_kept_sum_into`] (`old` `None`: the residual is `r`'s own values) and
/// [`topk_kept_sum_from`] (`old` the residual, `r` the sums' buffer).
fn topk_kept_sums<'s>(
    g: &[f32],
    old: Option<&[f32]>,
    r: &mut [f32],
    k: usize,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    assert_eq!(g.len(), r.len(), "residual length");
    let n = r.len();
    assert!(u32::try_from(n).is_ok(), "length beyond u32");
    if n >= SAMPLED_MIN && 0 < k && k < n {
        assert!(scratch.len() >= kept_scratch_len(n, k), "scratch too short");
        return topk_kept_update_from(g, old, r, k, limit, scratch);
    }
    store_sums(g, old, r);
    topk_kept(r, k, limit, scratch)
}

/// `r[i] = g[i] + residual[i]` (the f32 addition), the residual read from `old` when given,
/// else from `r` itself.
fn store_sums(g: &[f32], old: Option<&[f32]>, r: &mut [f32]) {
    match old {
        Some(old) => {
            for ((x, &y), &o) in r.iter_mut().zip(g).zip(old) {
                *x = o + y;
            }
        }
        None => {
            for (x, &y) in r.iter_mut().zip(g) {
                *x += y;
            }
        }
    }
}

/// [`topk_kept_src`] of `g + r` for an error-feedback step that has already checked that no
/// sum can be out of limit: the pass that collects the candidates also stores each sum in `r`
/// (`r[i] = g[i] + r[i]`, the f32 addition of [`Sum`]), so the step reads `g` and `r` once and
/// writes `r` once. Requires `SAMPLED_MIN <= n`, `0 < k < n`, `n` within `u32` and a `scratch`
/// of [`kept_scratch_len`] words; the kept lists sit where [`topk_kept_idx`] finds them. When
/// the sample misses, the exact selection runs on `r`, which holds the sums by then.
///
/// On [`OutOfLimit`] (a sum NaN or at or above `limit`: impossible after the step's check)
/// `r` holds the sums.
pub(crate) fn topk_kept_update<'s>(
    g: &[f32],
    r: &mut [f32],
    k: usize,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    topk_kept_update_from(g, None, r, k, limit, scratch)
}

/// [`topk_kept_update`] with the residual read from `old` when it is given (the sums stored in
/// `r` either way), as [`topk_kept_sum_from`] asks.
fn topk_kept_update_from<'s>(
    g: &[f32],
    old: Option<&[f32]>,
    r: &mut [f32],
    k: usize,
    limit: f32,
    scratch: &'s mut [u32],
) -> Result<Kept<'s>, OutOfLimit> {
    let n = r.len();
    debug_assert!(n >= SAMPLED_MIN && 0 < k && k < n && g.len() == n);
    let cap = candidate_capacity(n, k);
    let (hist, rest) = scratch.split_at_mut(TOPK_HIST);
    let (samples, rest) = rest.split_at_mut(sample_len(n));
    let (idx, rest) = rest.split_at_mut(cap);
    let bits = &mut rest[..cap];
    // As in `topk_kept_src`: a sample of zeros floors at the smallest non-zero key.
    let t = match old {
        Some(old) => sample_threshold(&Sum(g, old), k, samples),
        None => sample_threshold(&Sum(g, r), k, samples),
    }
    .max(1);
    let (count, ok) = scan_update(g, old, r, f32::from_bits(t), limit, idx, bits);
    if !ok {
        return Err(OutOfLimit);
    }
    if count >= k && count <= cap {
        // As in `topk_kept_src`: at least k candidates hold the k-th largest key and its ties.
        let (cand, spare) = idx.split_at_mut(count);
        let cut = candidate_cut(&bits[..count], k, hist, spare);
        let kept = keep_cut(cand, &mut bits[..count], cut);
        debug_assert_eq!(kept, k);
        return Ok(Kept {
            idx: &idx[..k],
            bits: &bits[..k],
        });
    }
    kept_by_radix(&One(r), k, limit, hist, idx, bits)
}

/// Where [`topk_kept_src`] with [`sample_len`]`(n)` samples leaves the indices of the top `k`
/// (`k` cut to `n`) in its `scratch`: after the histogram and the samples. `None` when scratch
/// is too short to hold them.
pub(crate) fn topk_kept_idx(n: usize, k: usize, scratch: &[u32]) -> Option<&[u32]> {
    let at = TOPK_HIST + sample_len(n);
    scratch.get(at..at.checked_add(k.min(n))?)
}

/// A magnitude key at or below the k-th largest with high probability: the r-th largest key of
/// a stratified sample, `r = lambda + 4 sqrt(lambda) + 8` with `lambda = k * s / n`.
fn sample_threshold<S: Source>(src: &S, k: usize, samples: &mut [u32]) -> u32 {
    let n = src.len() as u64;
    let s = samples.len();
    let stride = n / s as u64;
    // One position per stratum of `stride` elements, its offset from a 64-bit linear
    // congruential generator (Knuth's MMIX constants; the high 32 bits): three instructions a
    // sample where a hash of the index took about twelve. The sample only decides how fast the
    // exact selection gets there, never what it selects.
    let mut state = 0x5eed_5a3b_1e00_0000u64;
    for (j, slot) in samples.iter_mut().enumerate() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let h = state >> 32;
        let pos = j as u64 * stride + ((h * stride) >> 32);
        *slot = magnitude_key(src.at(pos as usize));
    }
    let lambda = ((k as u128 * s as u128).div_ceil(n as u128)) as usize;
    let r = (lambda + 4 * lambda.isqrt() + 8).min(s);
    let (_, t, _) = samples.select_nth_unstable(s - r);
    *t
}

/// The digits of the radix select (shift, width), most significant first: those of
/// [`crate::scalar::topk_cut`].
const DIGITS: [(u32, u32); 3] = [(20, 11), (9, 11), (0, 9)];

/// The exact cut of top-k among `keys` (`1 <= k <= count`), by the three-pass radix select of
/// [`crate::scalar::topk_cut`].
fn radix_cut<I: Iterator<Item = u32> + Clone>(keys: I, k: usize, hist: &mut [u32]) -> Cut {
    radix_digits(keys, &DIGITS, 0, 0, k, hist)
}

/// The radix select over `digits`, among the keys that match `prefix` on `prefix_mask`, of the
/// `need`-th largest (`need >= 1`).
fn radix_digits<I: Iterator<Item = u32> + Clone>(
    keys: I,
    digits: &[(u32, u32)],
    mut prefix: u32,
    mut prefix_mask: u32,
    mut need: usize,
    hist: &mut [u32],
) -> Cut {
    let hist = &mut hist[..TOPK_HIST];
    for &(shift, width) in digits {
        hist.fill(0);
        let digit_mask = (1u32 << width) - 1;
        for key in keys.clone() {
            if key & prefix_mask == prefix {
                hist[((key >> shift) & digit_mask) as usize] += 1;
            }
        }
        let d = descend(hist, digit_mask as usize, &mut need);
        prefix |= (d as u32) << shift;
        prefix_mask |= digit_mask << shift;
    }
    Cut {
        key: prefix,
        take_ties: need,
    }
}

/// The bucket, counted down from `top`, that holds the `need`-th largest key; `need` becomes
/// its rank inside that bucket.
fn descend(hist: &[u32], top: usize, need: &mut usize) -> usize {
    let mut d = top;
    loop {
        let c = hist[d] as usize;
        if c >= *need || d == 0 {
            return d;
        }
        *need -= c;
        d -= 1;
    }
}

/// [`radix_cut`] of the keys of `bits` (`1 <= k <= bits.len()`), faster: after the first
/// digit, the keys of the bucket that holds the cut are copied into `spare` when they fit
/// (branch-free), and the last two digits look at those alone instead of every key twice.
fn candidate_cut(bits: &[u32], k: usize, hist: &mut [u32], spare: &mut [u32]) -> Cut {
    let keys = || bits.iter().map(|&b| b & KEY_MASK);
    let (shift, width) = DIGITS[0];
    let hist = &mut hist[..TOPK_HIST];
    hist.fill(0);
    for key in keys() {
        hist[(key >> shift) as usize] += 1;
    }
    let mut need = k;
    let d = descend(hist, (1 << width) - 1, &mut need) as u32;
    let in_bucket = hist[d as usize] as usize;
    if in_bucket >= spare.len() {
        return radix_digits(
            keys(),
            &DIGITS[1..],
            d << shift,
            u32::MAX << shift,
            need,
            hist,
        );
    }
    // Every key is written at `w`, which moves on only for the bucket's keys: `w` stays at
    // most `in_bucket`, below `spare.len()`.
    let mut w = 0usize;
    for key in keys() {
        spare[w] = key;
        w += usize::from(key >> shift == d);
    }
    let bucket = spare[..w].iter().copied();
    radix_digits(
        bucket,
        &DIGITS[1..],
        d << shift,
        u32::MAX << shift,
        need,
        hist,
    )
}

/// Keeps, in place and in order, the candidates that the cut keeps; returns how many. Branch
/// free: every entry is copied to `w`, which moves on for the kept ones.
fn keep_cut(idx: &mut [u32], bits: &mut [u32], cut: Cut) -> usize {
    let mut ties = cut.take_ties;
    let mut w = 0usize;
    for j in 0..idx.len() {
        let (i, b) = (idx[j], bits[j]);
        let key = b & KEY_MASK;
        let tie = key == cut.key && ties > 0;
        ties -= usize::from(tie);
        idx[w] = i;
        bits[w] = b;
        w += usize::from(key > cut.key || tie);
    }
    w
}

/// One SIMD pass: every element with `|x| >= lo` for which `accept(key)` holds goes to
/// `idx`/`bits` (while they have room; the count goes on). Also checks `|x| < limit` for every
/// element. Returns the count and whether every element was below the limit.
///
/// One compare per vector does both: a lane is looked at again when `!(|x| < min(lo, limit))`,
/// which holds for every candidate and every element at or above the limit (NaN included,
/// as an unordered compare); the scalar path then sorts out which it is from the key (NaN keys
/// sort above the key of infinity). The vectors are never spilled to find a passing lane: a
/// lane is read again from the source (in the L1 cache by then; for a sum, the same f32
/// addition gives the same bits).
#[inline]
fn scan<S: Source>(
    src: &S,
    lo: f32,
    limit: f32,
    idx: &mut [u32],
    bits: &mut [u32],
    mut accept: impl FnMut(u32) -> bool,
) -> (usize, bool) {
    let n = src.len();
    let lo_key = lo.to_bits() & KEY_MASK;
    let lim_key = limit.to_bits() & KEY_MASK;
    let either = f32x8::splat(f32::from_bits(lo_key.min(lim_key)));
    let mut bad = false;
    let mut count = 0usize;
    let group = 4 * LANES;
    let full = n / group * group;
    let mut masks = [0u32; PENDING];
    let mut starts = [0usize; PENDING];
    for block in (0..full).step_by(PENDING * group) {
        let len = (full - block).min(PENDING * group);
        // First the SIMD compares of the whole block, keeping only the groups with a lane to
        // look at (no branch: the slot is written for every group and kept for those);
        // then the second looks. A branch per group would be taken at random for about a third
        // of them at k = 1%.
        let mut pending = 0usize;
        let mut base = block;
        for x in src.quads_ahead(block, len) {
            // Bit set: |x| < min(lo, limit), the lane needs no second look.
            let below = bitmask32(x.map(|x| x.abs().simd_lt(either)));
            let m = !below;
            // `pending` is below PENDING here (one slot per group of the block at most): the
            // modulo only spares a bounds check.
            masks[pending % PENDING] = m;
            starts[pending % PENDING] = base;
            pending += usize::from(m != 0);
            base += group;
        }
        for (&m, &start) in masks[..pending].iter().zip(&starts[..pending]) {
            push_lanes(
                src,
                m,
                start,
                (lo_key, lim_key),
                idx,
                bits,
                &mut count,
                &mut bad,
                &mut accept,
            );
        }
    }
    let mut i = full;
    while i < n {
        let live = (n - i).min(LANES);
        let x = if live == LANES {
            src.chunk(i)
        } else {
            src.tail(i)
        };
        let m = !x.abs().simd_lt(either).to_bitmask() & ((1u32 << live) - 1);
        if m != 0 {
            push_lanes(
                src,
                m,
                i,
                (lo_key, lim_key),
                idx,
                bits,
                &mut count,
                &mut bad,
                &mut accept,
            );
        }
        i += LANES;
    }
    (count, !bad)
}

/// How far ahead `scan_update` prefetches g and r, in elements.
const UPDATE_AHEAD: usize = 2048;
// `scan_update` prefetches r past the block it writes.
const _: () = assert!(UPDATE_AHEAD >= PENDING * 4 * LANES);

/// [`scan`] of `g + r` that also stores each sum in `r` (`r[i] = g[i] + r[i]`, every element,
/// whatever the limit check finds); with `old`, of `g + old`, stored in `r` (`r[i] = g[i] +
/// old[i]`, `r`'s earlier values unread). The second look at a flagged lane reads the stored
/// sum.
fn scan_update(
    g: &[f32],
    old: Option<&[f32]>,
    r: &mut [f32],
    lo: f32,
    limit: f32,
    idx: &mut [u32],
    bits: &mut [u32],
) -> (usize, bool) {
    // One loop for each case, so that the in-place one reads no flag per group.
    match old {
        Some(old) => scan_update_with::<true>(g, old, r, lo, limit, idx, bits),
        None => scan_update_with::<false>(g, &[], r, lo, limit, idx, bits),
    }
}

/// [`scan_update`]: the residual read from `old` when `FROM` (of `r`'s length), else from `r`
/// (`old` unused).
fn scan_update_with<const FROM: bool>(
    g: &[f32],
    old: &[f32],
    r: &mut [f32],
    lo: f32,
    limit: f32,
    idx: &mut [u32],
    bits: &mut [u32],
) -> (usize, bool) {
    let n = r.len().min(g.len());
    let lo_key = lo.to_bits() & KEY_MASK;
    let lim_key = limit.to_bits() & KEY_MASK;
    let either = f32x8::splat(f32::from_bits(lo_key.min(lim_key)));
    let mut bad = false;
    let mut count = 0usize;
    let group = 4 * LANES;
    let full = n / group * group;
    let mut masks = [0u32; PENDING];
    let mut starts = [0usize; PENDING];
    let mut take = |_| true;
    for block in (0..full).step_by(PENDING * group) {
        let len = (full - block).min(PENDING * group);
        let mut pending = 0usize;
        // The prefetches read the lines UPDATE_AHEAD elements on, from slices cut once per
        // block, so that no prefetch needs a bounds check of its own; near the end, where that
        // region is past the buffers, they touch the block itself (in cache, harmless).
        let g_ahead = region_ahead(g, block, len, UPDATE_AHEAD);
        // r is written through `cur`; its lines ahead are read from `ahead`, the part of r past
        // the block (UPDATE_AHEAD >= the block's length, so the region starts inside it).
        let (cur, ahead) = r[block..].split_at_mut(len);
        let ahead: &[f32] = ahead;
        // The residual's lines ahead: of `old` when it holds the residual (read from there).
        let r_ahead = if FROM {
            region_ahead(old, block, len, UPDATE_AHEAD)
        } else {
            ahead
                .get(UPDATE_AHEAD - len..UPDATE_AHEAD)
                .unwrap_or(&g_ahead[..len])
        };
        let olds = if FROM { &old[block..block + len] } else { &[] };
        let groups = g[block..block + len].chunks_exact(group);
        let lines = g_ahead.chunks_exact(group).zip(r_ahead.chunks_exact(group));
        for (j, ((gs, rs), (pg, pr))) in groups
            .zip(cur.chunks_exact_mut(group))
            .zip(lines)
            .enumerate()
        {
            let base = block + j * group;
            prefetch_line(&pg[0]);
            prefetch_line(&pg[2 * LANES]);
            prefetch_line(&pr[0]);
            prefetch_line(&pr[2 * LANES]);
            let os = if FROM {
                &olds[j * group..(j + 1) * group]
            } else {
                &[]
            };
            let mut x = [f32x8::splat(0.0); 4];
            for (l, x) in x.iter_mut().enumerate() {
                let at = l * LANES..(l + 1) * LANES;
                let residual = if FROM {
                    load(&os[at.clone()])
                } else {
                    load(&rs[at.clone()])
                };
                *x = load(&gs[at.clone()]) + residual;
                rs[at].copy_from_slice(&x.to_array());
            }
            let below = bitmask32(x.map(|x| x.abs().simd_lt(either)));
            let m = !below;
            masks[pending % PENDING] = m;
            starts[pending % PENDING] = base;
            pending += usize::from(m != 0);
        }
        let stored = One(&*r);
        for (&m, &start) in masks[..pending].iter().zip(&starts[..pending]) {
            let keys = (lo_key, lim_key);
            push_lanes(
                &stored, m, start, keys, idx, bits, &mut count, &mut bad, &mut take,
            );
        }
    }
    store_sums(&g[full..n], FROM.then(|| &old[full..n]), &mut r[full..n]);
    let stored = One(&*r);
    let mut i = full;
    while i < n {
        let live = (n - i).min(LANES);
        let x = if live == LANES {
            stored.chunk(i)
        } else {
            stored.tail(i)
        };
        let m = !x.abs().simd_lt(either).to_bitmask() & ((1u32 << live) - 1);
        if m != 0 {
            let keys = (lo_key, lim_key);
            push_lanes(
                &stored, m, i, keys, idx, bits, &mut count, &mut bad, &mut take,
            );
        }
        i += LANES;
    }
    (count, !bad)
}

/// [`scan`]'s second look at the lanes set in `m` (lane `j` is element `base + j`): elements at
/// or above the limit set `bad`; candidates that `accept` takes go to the list while it has room
/// (the count goes on). `keys` are the keys of `lo` and of the limit.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn push_lanes<S: Source>(
    src: &S,
    m: u32,
    base: usize,
    (lo_key, lim_key): (u32, u32),
    idx: &mut [u32],
    bits: &mut [u32],
    count: &mut usize,
    bad: &mut bool,
    accept: &mut impl FnMut(u32) -> bool,
) {
    let mut m = m;
    while m != 0 {
        let i = base + m.trailing_zeros() as usize;
        let b = src.at(i).to_bits();
        let key = b & KEY_MASK;
        if key >= lim_key {
            *bad = true;
        } else if key >= lo_key && accept(key) {
            if let (Some(x), Some(y)) = (idx.get_mut(*count), bits.get_mut(*count)) {
                *x = i as u32;
                *y = b;
            }
            *count += 1;
        }
        m &= m - 1;
    }
}

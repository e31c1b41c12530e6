//! Random-k's index draw, fast: the indices of Knuth's selection sampling (Algorithm S, FORMAT.md
//! 6.2) exactly as [`crate::scalar::randomk_for_each`] specifies them, at a fraction of its time.
//!
//! Algorithm S keeps index `i` of an `n`-element tensor when
//! `h_i = floor(draw(key, i) * (n - i) / 2^64)` is below the number of indices still needed. The
//! draws are independent of each other; only that number (which never grows) links one index to
//! the next. So the scan splits in two:
//!
//! 1. [`candidates`]: for a run of indices, keep every index with `h_i` below a bound: any
//!    number at least the count still needed when the run starts. That is a superset of what
//!    the run keeps (about `bound / (n - i)` of it). The draws are computed eight at a time
//!    with no dependency between them (the multiplications of one index overlap with the
//!    next's), and compared raw against the span's pass limit (`h_i < bound` exactly when
//!    `draw < ceil(bound * 2^64 / (n - i))`; one 128-bit division per [`SPAN`] indices), so
//!    that only the few that pass are scaled.
//! 2. [`resolve`]: walk the candidates in order with the exact count: keep `i` when `h_i` is
//!    below it, and count down.
//!
//! [`for_each`] alternates the two over windows of [`WINDOW`] indices. A multi-core caller runs
//! step 1 on many runs at once, with a bound that holds with overwhelming probability (the count
//! needed at a position is hypergeometric), and step 2 on one thread over the lists in order,
//! scanning a run again with the exact count where its bound turns out too low.
//!
//! In the default build [`for_each`] computes the draws in eight scalar chains (the
//! multiplications bound it); with AVX2 (`-C target-cpu=native`) in vectors of four lanes, each
//! 64-bit multiply made of three 32-bit ones. Either way the draws are compute-bound, a few
//! 64-bit multiplications per index whatever `k`: what random-k gains from is more cores (the
//! std crate draws chunks in parallel) and, on the receiver, drawing once for every rank's
//! frame.

use crate::rng::{self, GOLDEN};

/// Indices [`for_each`] scans per call of [`candidates`].
pub const WINDOW: u64 = 512;

/// One candidate of random-k's selection sampling: tensor index `index` and
/// `h = floor(draw(key, index) * (n - index) / 2^64)`, which keeps the index when it is below
/// the number of indices still needed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    /// Index into the tensor (elements).
    pub index: u64,
    /// Algorithm S's scaled draw for this index, in `0..n - index`.
    pub h: u64,
}

/// `floor(d * remaining / 2^64)`: Algorithm S's scaled draw of an index with `remaining`
/// indices left from it to the end.
#[inline(always)]
fn scaled(d: u64, remaining: u64) -> u64 {
    ((d as u128 * remaining as u128) >> 64) as u64
}

/// The counter `rng::draw` mixes for index `i`: `i * G + G`.
#[inline(always)]
fn counter(i: u64) -> u64 {
    i.wrapping_mul(GOLDEN).wrapping_add(GOLDEN)
}

/// Indices per span: every span has one pass limit on the raw draws (one 128-bit division).
pub const SPAN: u64 = 512;

/// Lanes [`candidates`] computes side by side.
const LANES: usize = 8;

/// The raw draws of the eight indices whose counters start at `z0`, and which of them are
/// below `limit` (bit `j` for lane `j`). AVX2: two vectors of four lanes. (Without AVX2, the
/// scalar chains below: two-lane SSE2 vectors were slower than they are.)
#[cfg(target_feature = "avx2")]
#[inline(always)]
fn draws8(z0: u64, key: u64, limit: u64) -> ([u64; LANES], u32) {
    use wide::u64x4;
    /// `x * c mod 2^64`. AVX2 has no 64-bit multiply: with `p = xl * cl` (`add_mul_*::<32>`
    /// read the low 32 bits of each lane: one `vpmuludq` per product, both halves of `p` from
    /// the same one), it is `(p mod 2^32) + (((p >> 32) + xh * cl + xl * ch) << 32)`.
    #[inline(always)]
    fn mul_const(x: u64x4, c: u64) -> u64x4 {
        let (cl, ch) = (u64x4::splat(c & 0xffff_ffff), u64x4::splat(c >> 32));
        let high = u64x4::ZERO
            .add_mul_hi::<32>(x, cl)
            .add_mul_lo::<32>(x >> 32, cl)
            .add_mul_lo::<32>(x, ch);
        let high: u64x4 = high << 32;
        high.add_mul_lo::<32>(x, cl)
    }
    /// [`rng::mix64`] on every lane.
    #[inline(always)]
    fn mix64(mut z: u64x4) -> u64x4 {
        z = mul_const(z ^ (z >> 30), 0xbf58_476d_1ce4_e5b9);
        z = mul_const(z ^ (z >> 27), 0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let counters = |j: u64| {
        u64x4::new([j, j + 1, j + 2, j + 3].map(|j| z0.wrapping_add(j.wrapping_mul(GOLDEN))))
    };
    let key = u64x4::splat(key);
    let lo = mix64(key ^ mix64(counters(0)));
    let hi = mix64(key ^ mix64(counters(4)));
    let limit = u64x4::splat(limit);
    let mask = lo.simd_lt(limit).to_bitmask() | (hi.simd_lt(limit).to_bitmask() << 4);
    let (lo, hi) = (lo.to_array(), hi.to_array());
    (
        [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]],
        mask,
    )
}

/// Without AVX2: eight independent scalar chains (the multiplications of one overlap with the
/// others').
#[cfg(not(target_feature = "avx2"))]
#[inline(always)]
fn draws8(z0: u64, key: u64, limit: u64) -> ([u64; LANES], u32) {
    let mut d = [0u64; LANES];
    for (j, d) in d.iter_mut().enumerate() {
        *d = rng::mix64(key ^ rng::mix64(z0.wrapping_add((j as u64).wrapping_mul(GOLDEN))));
    }
    // Almost always no lane passes: one minimum, and the mask only when it is below.
    if d.iter().fold(u64::MAX, |m, &d| m.min(d)) >= limit {
        return (d, 0);
    }
    let mask = d
        .iter()
        .enumerate()
        .fold(0u32, |m, (j, &d)| m | (u32::from(d < limit) << j));
    (d, mask)
}

/// The smallest raw draw that cannot be a candidate anywhere in a span whose last index has
/// `remaining` indices left (`>= 1`): `ceil(bound * 2^64 / remaining)`, the pass limit of the
/// span's fewest remaining (largest limit). `None` when every draw passes.
fn pass_limit(bound: u64, remaining: u64) -> Option<u64> {
    let r = remaining as u128;
    let t = ((bound as u128) << 64).div_ceil(r);
    u64::try_from(t).ok()
}

/// Scans indices `start..end` of an `n`-element tensor in stream `key` and writes, in ascending
/// order, every index whose scaled draw `h` is below `bound` into `out` (see [`Candidate`]).
/// Returns how many it wrote and the first index it did not scan: `max(start, min(end, n))`,
/// or less when `out` filled up first (call again from there). Indices at or past `n` are
/// never scanned.
///
/// With `bound` at least the number of indices Algorithm S still needs at `start`, the output
/// holds every index it keeps in `start..end` ([`resolve`] picks them).
///
/// # Panics
/// Never.
pub fn candidates(
    key: u64,
    n: u64,
    start: u64,
    end: u64,
    bound: u64,
    out: &mut [Candidate],
) -> (usize, u64) {
    let end = end.min(n);
    if bound == 0 || start >= end {
        return (0, end.max(start));
    }
    let mut i = start;
    let mut written = 0usize;
    while i < end && written < out.len() {
        let stop = end.min(i.saturating_add(SPAN));
        // Lanes whose raw draw is at or above the span's limit have `h >= bound` (the limit
        // is that of the span's largest), so only the draws below it are scaled.
        let limit = pass_limit(bound, n - (stop - 1)).unwrap_or(0);
        if limit > 0 {
            while stop - i >= LANES as u64 && written + LANES <= out.len() {
                let (d, mut mask) = draws8(counter(i), key, limit);
                while mask != 0 {
                    let j = mask.trailing_zeros() as usize;
                    mask &= mask - 1;
                    let index = i + j as u64;
                    let h = scaled(d[j], n - index);
                    out[written] = Candidate { index, h };
                    written += usize::from(h < bound);
                }
                i += LANES as u64;
            }
        }
        while i < stop && written < out.len() {
            let h = scaled(rng::draw(key, i), n - i);
            if h < bound {
                out[written] = Candidate { index: i, h };
                written += 1;
            }
            i += 1;
        }
    }
    (written, i)
}

/// Walks `candidates` (ascending, from [`candidates`]) with `needed` the number of indices
/// Algorithm S still needs at the first of them and calls `f(index)` for each one it keeps,
/// counting `needed` down. Exact when every candidate list covering a run was scanned with a
/// bound of at least `needed` at that run's start; the caller checks that before calling.
pub fn resolve(candidates: &[Candidate], needed: &mut u64, mut f: impl FnMut(u64)) {
    for c in candidates {
        if c.h < *needed {
            f(c.index);
            *needed -= 1;
            if *needed == 0 {
                return;
            }
        }
    }
}

/// Calls `f(i)` for each of the `min(k, n)` indices random-k draws from `0..n` with stream
/// `key`, in ascending order: exactly [`crate::scalar::randomk_for_each`]'s indices.
///
/// # Panics
/// Never.
pub fn for_each(n: u64, k: u64, key: u64, mut f: impl FnMut(u64)) {
    let mut needed = k.min(n);
    let mut buf = [Candidate::default(); 64];
    let mut i = 0u64;
    // Algorithm S keeps every index once `needed == n - i`, so `needed` reaches 0 before `n`.
    while needed > 0 && i < n {
        let (count, next) = candidates(key, n, i, i.saturating_add(WINDOW), needed, &mut buf);
        resolve(&buf[..count], &mut needed, &mut f);
        i = next;
    }
}

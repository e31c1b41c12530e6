//! Sign compression: one bit per element (1 = negative, 0 counts as +), with one f32 scale per
//! block (the block's mean |g|, EF-signSGD, Karimireddy et al. 2019) or none (signSGD with
//! majority vote, Bernstein et al. 2018).

use crate::lanes::{LANES, One, Range, Source, load, load_padded};
use crate::scalar::magnitude_key;
use crate::select::OutOfLimit;
use wide::{f32x8, u32x8};

/// Bytes of the scales section for `n` elements (`None`: unscaled).
pub const fn scales_len(n: usize, block: Option<usize>) -> usize {
    match block {
        Some(b) => n.div_ceil(if b == 0 { 1 } else { b }).saturating_mul(4),
        None => 0,
    }
}

/// Bytes of the sign bits: `ceil(n / 8)`.
pub const fn bits_len(n: usize) -> usize {
    n.div_ceil(8)
}

/// Whether the one-pass SIMD kernel encodes these blocks (unscaled, or blocks that are a
/// multiple of 8 elements).
pub const fn is_fast(block: Option<usize>) -> bool {
    match block {
        Some(b) => b > 0 && b.is_multiple_of(LANES),
        None => true,
    }
}

/// Packs the signs of `x` into `signs` and, with `Some(block)`, each block's mean |x| into
/// `scales` (little-endian f32). `x` must be finite (see [`try_encode`]).
///
/// SIMD: one pass per block adds |x| into eight striped lanes (the order of
/// [`crate::scalar::abs_sum_striped`]) and packs the signs through
/// `simd_lt(0).to_bitmask()` (lane 0 is the least significant bit).
pub fn encode(x: &[f32], block: Option<usize>, scales: &mut [u8], signs: &mut [u8]) {
    if is_fast(block) {
        // Finite input cannot fail the check.
        let _ = encode_fast(&One(x), block, scales, signs, |_| {});
    } else {
        let b = block.map_or(1, |b| b.max(1));
        block_scales(x, b, scales);
        pack_signs(x, signs);
    }
}

/// As [`encode`], checking on the way that every element is finite.
///
/// The one-pass kernel writes block by block and detects a NaN or infinity through the
/// block's sum of |x|, so on error `scales` and `signs` hold a prefix of the sections (their
/// contents are unspecified); other block sizes check the whole input before writing.
///
/// # Errors
/// [`OutOfLimit`] when some element is NaN or infinite.
pub fn try_encode(
    x: &[f32],
    block: Option<usize>,
    scales: &mut [u8],
    signs: &mut [u8],
) -> Result<(), OutOfLimit> {
    if is_fast(block) {
        encode_fast(&One(x), block, scales, signs, |_| {})
    } else if crate::values::first_non_finite(x).is_some() {
        Err(OutOfLimit)
    } else {
        encode(x, block, scales, signs);
        Ok(())
    }
}

/// Elements per checked stretch when there are no scales.
const CHECK_RUN: usize = 1024;

/// The one-pass kernel over any element source (one slice, or the sum `g + r` of an
/// error-feedback step), for blocks where [`is_fast`] holds. A block whose sum of |x| is not
/// finite is checked for NaN and infinity (an error) or, when every element is finite but the
/// sum overflowed, gets the specification's overflow-safe scale. `written` is called with each
/// block's sign bytes, in order, right after they are written.
pub(crate) fn encode_fast<S: Source>(
    src: &S,
    block: Option<usize>,
    scales: &mut [u8],
    signs: &mut [u8],
    mut written: impl FnMut(&[u8]),
) -> Result<(), OutOfLimit> {
    let n = src.len();
    let per = block.unwrap_or(CHECK_RUN);
    let mut start = 0usize;
    let mut b = 0usize;
    // Each block's lanes add in one fixed order, a chain of dependent additions: four blocks
    // run side by side so that four chains overlap (and the loads of four streams).
    let quads = if per.is_multiple_of(2 * LANES) {
        n / (4 * per)
    } else {
        0
    };
    for _ in 0..quads {
        let out = &mut signs[start / LANES..(start + 4 * per) / LANES];
        let sums = quad_pass(src, start, per, out);
        for (t, acc) in sums.into_iter().enumerate() {
            finish_block(
                src,
                start + t * per,
                per,
                combine(acc),
                block,
                scales.get_mut(4 * (b + t)..).unwrap_or_default(),
            )?;
        }
        written(out);
        start += 4 * per;
        b += 4;
    }
    while start < n {
        let len = per.min(n - start);
        let out = &mut signs[start / LANES..(start + len).div_ceil(LANES)];
        let sum = combine(block_pass(src, start, len, out));
        let scale = scales.get_mut(4 * b..).unwrap_or_default();
        finish_block(src, start, len, sum, block, scale)?;
        written(out);
        start += len;
        b += 1;
    }
    Ok(())
}

/// Checks a block whose sum of |x| is not finite and writes its scale (with `Some(block)`)
/// into `scale[..4]` (empty without scales).
#[inline]
fn finish_block<S: Source>(
    src: &S,
    start: usize,
    len: usize,
    sum: f32,
    block: Option<usize>,
    scale: &mut [u8],
) -> Result<(), OutOfLimit> {
    if !sum.is_finite() && !crate::values::all_below(&Range(src, start, len), f32::INFINITY) {
        return Err(OutOfLimit);
    }
    if block.is_some() {
        let s = if sum.is_finite() {
            sum / len as f32
        } else {
            overflow_scale(src, start, len)
        };
        scale[..4].copy_from_slice(&s.to_le_bytes());
    }
    Ok(())
}

/// Four full blocks of `per` elements (a multiple of 16) from `start`, side by side: their
/// striped lane sums of |x| (each in the order of [`block_pass`]) and their sign bits into `out`
/// (`4 * per / 8` bytes).
#[inline]
fn quad_pass<S: Source>(src: &S, start: usize, per: usize, out: &mut [u8]) -> [f32x8; 4] {
    let zero = f32x8::splat(0.0);
    let mut acc = [zero; 4];
    let (o0, rest) = out.split_at_mut(per / LANES);
    let (o1, rest) = rest.split_at_mut(per / LANES);
    let (o2, o3) = rest.split_at_mut(per / LANES);
    // With one cache line of each stream, AHEAD elements on.
    let x = src
        .pairs_ahead(start, per)
        .zip(src.pairs_ahead(start + per, per))
        .zip(src.pairs_ahead(start + 2 * per, per))
        .zip(src.pairs_ahead(start + 3 * per, per));
    let o = o0
        .chunks_exact_mut(2)
        .zip(o1.chunks_exact_mut(2))
        .zip(o2.chunks_exact_mut(2))
        .zip(o3.chunks_exact_mut(2));
    for ((((p0, p1), p2), p3), (((q0, q1), q2), q3)) in x.zip(o) {
        for (a, (p, q)) in acc.iter_mut().zip([(p0, q0), (p1, q1), (p2, q2), (p3, q3)]) {
            *a = (*a + p[0].abs()) + p[1].abs();
            let m = p[0].simd_lt(zero).to_bitmask() | (p[1].simd_lt(zero).to_bitmask() << 8);
            q.copy_from_slice(&(m as u16).to_le_bytes());
        }
    }
    acc
}

/// One block: returns the eight striped lane sums of |x| and writes the sign bits of elements
/// `start..start + len` into `out` (`start` a multiple of 8; `ceil(len / 8)` bytes).
#[inline]
fn block_pass<S: Source>(src: &S, start: usize, len: usize, out: &mut [u8]) -> f32x8 {
    let zero = f32x8::splat(0.0);
    let mut acc = zero;
    let full = len / (2 * LANES) * (2 * LANES);
    let (head, tail) = out.split_at_mut(full / LANES);
    for (p, o) in src.pairs(start, full).zip(head.chunks_exact_mut(2)) {
        // Lane j adds elements j, j + 8, j + 16, ... in order: the specification's order.
        acc = (acc + p[0].abs()) + p[1].abs();
        let m = p[0].simd_lt(zero).to_bitmask() | (p[1].simd_lt(zero).to_bitmask() << 8);
        o.copy_from_slice(&(m as u16).to_le_bytes());
    }
    let end = start + len;
    let mut i = start + full;
    for o in tail {
        let x = if i + LANES <= end {
            src.chunk(i)
        } else {
            // Only the last block of the source ends inside a chunk.
            src.tail(i)
        };
        acc += x.abs();
        *o = x.simd_lt(zero).to_bitmask() as u8;
        i += LANES;
    }
    acc
}

/// The specification's scale for a block whose sum of |x| overflowed (every element finite):
/// the striped sum of `|x| * 2^-64`, divided by the length, times `2^64`, capped at the absmax
/// (as [`crate::scalar::sign_block_scale`]).
fn overflow_scale<S: Source>(src: &S, start: usize, len: usize) -> f32 {
    const DOWN: f32 = 1.0 / 18_446_744_073_709_551_616.0; // 2^-64
    const UP: f32 = 18_446_744_073_709_551_616.0; // 2^64
    let mut lanes = [0.0f32; LANES];
    let mut key = 0u32;
    for t in 0..len {
        let v = src.at(start + t);
        lanes[t % LANES] += v.abs() * DOWN;
        key = key.max(magnitude_key(v));
    }
    let s = combine(f32x8::new(lanes));
    ((s / len as f32) * UP).min(f32::from_bits(key))
}

/// Packs the sign bits of `x` into `signs[..ceil(n / 8)]` (bit `i % 8` of byte `i / 8` is 1 when
/// `x[i] < 0`; padding bits zero).
pub fn pack_signs(x: &[f32], signs: &mut [u8]) {
    let zero = f32x8::splat(0.0);
    let signs = &mut signs[..x.len().div_ceil(LANES)];
    // Whole 32-element chunks fill `head`; the tail bytes (a partial chunk) are written below.
    let (head, tail) = signs.split_at_mut(4 * (x.len() / (4 * LANES)));
    let mut xs = x.chunks_exact(4 * LANES);
    for (c, o) in (&mut xs).zip(head.chunks_exact_mut(4)) {
        let m = load(c).simd_lt(zero).to_bitmask()
            | (load(&c[LANES..]).simd_lt(zero).to_bitmask() << 8)
            | (load(&c[2 * LANES..]).simd_lt(zero).to_bitmask() << 16)
            | (load(&c[3 * LANES..]).simd_lt(zero).to_bitmask() << 24);
        o.copy_from_slice(&m.to_le_bytes());
    }
    for (c, o) in xs.remainder().chunks(LANES).zip(tail) {
        *o = load_padded(c).simd_lt(zero).to_bitmask() as u8;
    }
}

/// Writes each block's mean |x| ([`crate::scalar::sign_block_scale`], bit for bit) as a
/// little-endian f32 into `scales` (4 bytes per block of `block >= 1` elements). Four blocks
/// run side by side, each lane adding in the striped order of the specification.
pub fn block_scales(x: &[f32], block: usize, scales: &mut [u8]) {
    let full = x.len() / block;
    let mut b = 0usize;
    while b + 4 <= full {
        let base = b * block;
        let mut acc = [f32x8::splat(0.0); 4];
        let (x0, rest) = x[base..base + 4 * block].split_at(block);
        let (x1, rest) = rest.split_at(block);
        let (x2, x3) = rest.split_at(block);
        let mut c0 = x0.chunks_exact(LANES);
        let mut c1 = x1.chunks_exact(LANES);
        let mut c2 = x2.chunks_exact(LANES);
        let mut c3 = x3.chunks_exact(LANES);
        for (((a, b), c), d) in (&mut c0).zip(&mut c1).zip(&mut c2).zip(&mut c3) {
            acc[0] += load(a).abs();
            acc[1] += load(b).abs();
            acc[2] += load(c).abs();
            acc[3] += load(d).abs();
        }
        if !block.is_multiple_of(LANES) {
            acc[0] += load_padded(c0.remainder()).abs();
            acc[1] += load_padded(c1.remainder()).abs();
            acc[2] += load_padded(c2.remainder()).abs();
            acc[3] += load_padded(c3.remainder()).abs();
        }
        for (t, a) in acc.iter().enumerate() {
            let mut s = combine(*a) / block as f32;
            if !s.is_finite() {
                // The sum overflowed: the specification's fallback (rare, so scalar).
                s = crate::scalar::sign_block_scale(&x[base + t * block..base + (t + 1) * block]);
            }
            scales[4 * (b + t)..4 * (b + t) + 4].copy_from_slice(&s.to_le_bytes());
        }
        b += 4;
    }
    for (j, xs) in x[b * block..].chunks(block).enumerate() {
        let mut acc = f32x8::splat(0.0);
        for c in xs.chunks(LANES) {
            acc += load_padded(c).abs();
        }
        let mut s = if xs.is_empty() {
            0.0
        } else {
            combine(acc) / xs.len() as f32
        };
        if !s.is_finite() {
            s = crate::scalar::sign_block_scale(xs);
        }
        scales[4 * (b + j)..4 * (b + j) + 4].copy_from_slice(&s.to_le_bytes());
    }
}

/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, the fixed order of the specification.
#[inline]
fn combine(a: f32x8) -> f32 {
    let l = a.to_array();
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Decodes validated sections into `out` (`out.len() == n`): overwriting (`weight = None`) or
/// adding `weight * value`, the same values as [`decode`].
pub fn decode_slice(
    block: Option<usize>,
    scales: &[u8],
    signs: &[u8],
    out: &mut [f32],
    weight: Option<f32>,
) {
    let n = out.len();
    let scale = |b: usize| {
        let j = 4 * b;
        f32::from_le_bytes([scales[j], scales[j + 1], scales[j + 2], scales[j + 3]])
    };
    let chunk_scale_ok = match block {
        Some(b) => b > 0 && b.is_multiple_of(LANES),
        None => true,
    };
    if !chunk_scale_ok {
        match weight {
            None => decode(n, block, scales, signs, |i, v| out[i] = v),
            Some(w) => decode(n, block, scales, signs, |i, v| out[i] += w * v),
        }
        return;
    }
    let bit = u32x8::new([1, 2, 4, 8, 16, 32, 64, 128]);
    let zero = u32x8::splat(0);
    let w8 = f32x8::splat(weight.unwrap_or(1.0));
    let per = block.unwrap_or(n.max(1));
    for (b, ob) in out.chunks_mut(per).enumerate() {
        let mag = if block.is_some() { scale(b) } else { 1.0 };
        let m = f32x8::splat(mag);
        let sg = &signs[b * per / LANES..];
        let full = ob.len() / LANES;
        let mut os = ob.chunks_exact_mut(LANES);
        for (o, &byte) in (&mut os).zip(sg) {
            let neg = (u32x8::splat(u32::from(byte)) & bit).simd_ne(zero);
            let v = f32x8::from_bits(neg).select(-m, m);
            let r = match weight {
                None => v,
                Some(_) => load(o) + w8 * v,
            };
            o.copy_from_slice(r.as_array());
        }
        let o = os.into_remainder();
        if !o.is_empty() {
            let byte = sg[full];
            let neg = (u32x8::splat(u32::from(byte)) & bit).simd_ne(zero);
            let v = f32x8::from_bits(neg).select(-m, m);
            let r = match weight {
                None => v,
                Some(_) => load_padded(o) + w8 * v,
            };
            let len = o.len();
            o.copy_from_slice(&r.as_array()[..len]);
        }
    }
}

/// Checks scales (finite, `>= 0`) and that padding bits past `n` are zero.
/// `Err(offset)` within scales + signs.
pub fn validate(n: usize, scales: &[u8], signs: &[u8]) -> Result<(), usize> {
    for (j, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        if !(m.is_finite() && m >= 0.0) {
            return Err(4 * j);
        }
    }
    if !n.is_multiple_of(8)
        && let Some(&last) = signs.last()
        && last >> (n % 8) != 0
    {
        return Err(scales.len() + signs.len() - 1);
    }
    Ok(())
}

/// Decodes validated sections, calling `f(i, value)`: `±scale` of the element's block, or ±1.
///
/// # Panics
/// When the sections were not checked for this `n` and `block`: `scales` or `signs` shorter
/// than they require, or `block == Some(0)`. Untrusted frames go through
/// [`crate::decode_into`] or [`crate::accumulate_into`], which check them first.
pub fn decode(
    n: usize,
    block: Option<usize>,
    scales: &[u8],
    signs: &[u8],
    mut f: impl FnMut(usize, f32),
) {
    for i in 0..n {
        let mag = match block {
            Some(b) => {
                let j = 4 * (i / b);
                f32::from_le_bytes([scales[j], scales[j + 1], scales[j + 2], scales[j + 3]])
            }
            None => 1.0,
        };
        let neg = (signs[i / 8] >> (i % 8)) & 1 == 1;
        f(i, if neg { -mag } else { mag });
    }
}

/// Majority vote over summed ±1 votes: each element becomes +1 when its sum is `>= 0` (ties
/// go to +) and -1 otherwise.
pub fn majority(votes: &mut [f32]) {
    for v in votes {
        *v = if *v >= 0.0 { 1.0 } else { -1.0 };
    }
}

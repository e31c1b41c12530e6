//! b-bit symmetric quantization with per-block absmax scales (QSGD, Alistarh et al. 2017).
//!
//! Codes `q` lie in `[-l, l]` with `l = 2^(b-1) - 1` and travel as `q + l` in `b` bits,
//! least-significant-bit first. A block's scale is its absmax `m` (f32); `q = round((x / m) * l)`
//! and the value decoded is `(q / l) * m`, so that the extremes and constant blocks are exact.

use crate::lanes::{LANES, load, load_padded};
use crate::rng;
use crate::scalar::{dequant, quant_levels};
use wide::{f32x8, i32x8};

/// Bytes of the scales section: 4 per block.
pub const fn scales_len(n: usize, block: usize) -> usize {
    n.div_ceil(if block == 0 { 1 } else { block })
        .saturating_mul(4)
}

/// Bytes of the codes section: `ceil(n * bits / 8)`.
pub const fn codes_len(n: usize, bits: u8) -> usize {
    n.saturating_mul(bits as usize).div_ceil(8)
}

/// Quantizes `x` into `scales` ([`scales_len`] bytes) and `codes` ([`codes_len`] bytes).
/// `stochastic` is `Some((seed, step, tensor_id))` for stochastic rounding. `x` must be finite.
pub fn encode(
    x: &[f32],
    bits: u8,
    block: usize,
    stochastic: Option<(u64, u64, u64)>,
    scales: &mut [u8],
    codes: &mut [u8],
) {
    let key = stochastic.map(|(s, t, id)| rng::key(s, t, id));
    if key.is_none() && (bits == 8 || bits == 4) && block > 0 && block.is_multiple_of(LANES) {
        encode_fast(x, bits, block, scales, codes);
    } else {
        crate::scalar::quant_encode(x, bits, block, key, scales, codes)
    }
}

/// Nearest-even quantization for 8 and 4 bits with blocks that are a multiple of 8: per block
/// the absmax (SIMD max of |x|), then `(x / m) * l` rounded by the same add-and-subtract of
/// 1.5 * 2^23 as [`crate::scalar::round_ties_even`], clamped, `trunc_int()`.
fn encode_fast(x: &[f32], bits: u8, block: usize, scales: &mut [u8], codes: &mut [u8]) {
    let l = quant_levels(bits);
    let lf = f32x8::splat(l as f32);
    let per_byte = 8 / bits as usize;
    for (b, chunk) in x.chunks(block).enumerate() {
        let m = block_absmax(chunk);
        scales[4 * b..4 * b + 4].copy_from_slice(&m.to_le_bytes());
        let out = &mut codes[b * block / per_byte..(b * block + chunk.len()).div_ceil(per_byte)];
        if m == 0.0 {
            let c = if bits == 8 {
                l as u8
            } else {
                (l | (l << 4)) as u8
            };
            out.fill(c);
            if bits == 4 && chunk.len() % 2 == 1 {
                let last = out.len() - 1;
                out[last] &= 0x0f;
            }
            continue;
        }
        let m8 = f32x8::splat(m);
        let code = |v: f32x8| -> [i32; 8] {
            const MAGIC: f32 = 12_582_912.0;
            let y = (v / m8) * lf;
            let q = (y + f32x8::splat(MAGIC)) - f32x8::splat(MAGIC);
            (q.fast_max(-lf).fast_min(lf) + lf).trunc_int().to_array()
        };
        if bits == 8 {
            let mut xs = chunk.chunks_exact(LANES);
            let mut os = out.chunks_exact_mut(LANES);
            for (c, o) in (&mut xs).zip(&mut os) {
                let q = code(load(c));
                for (d, &v) in o.iter_mut().zip(&q) {
                    *d = v as u8;
                }
            }
            let rest = xs.remainder();
            if !rest.is_empty() {
                let q = code(load_padded(rest));
                for (d, &v) in os.into_remainder().iter_mut().zip(&q) {
                    *d = v as u8;
                }
            }
        } else {
            let mut xs = chunk.chunks_exact(LANES);
            let mut os = out.chunks_exact_mut(LANES / 2);
            for (c, o) in (&mut xs).zip(&mut os) {
                let q = code(load(c));
                for (t, d) in o.iter_mut().enumerate() {
                    *d = (q[2 * t] | (q[2 * t + 1] << 4)) as u8;
                }
            }
            let rest = xs.remainder();
            if !rest.is_empty() {
                let q = code(load_padded(rest));
                let done = (chunk.len() - rest.len()) / 2;
                for (t, d) in out[done..].iter_mut().enumerate() {
                    let hi = if 2 * t + 1 < rest.len() {
                        q[2 * t + 1]
                    } else {
                        0
                    };
                    *d = (q[2 * t] | (hi << 4)) as u8;
                }
            }
        }
    }
}

/// Largest |x| of a block (0 for an empty one), bit-equal to [`crate::scalar::abs_max`].
pub fn block_absmax(x: &[f32]) -> f32 {
    let mut acc = [f32x8::splat(0.0); 4];
    let mut chunks = x.chunks_exact(4 * LANES);
    for c in &mut chunks {
        for (t, a) in acc.iter_mut().enumerate() {
            *a = a.fast_max(load(&c[t * LANES..]).abs());
        }
    }
    for c in chunks.remainder().chunks(LANES) {
        acc[0] = acc[0].fast_max(load_padded(c).abs());
    }
    let m = acc[0].fast_max(acc[1]).fast_max(acc[2].fast_max(acc[3]));
    m.to_array().iter().fold(0.0f32, |a, &b| a.max(b))
}

/// Checks codes of 8 or 4 bits (no code above `2l`, zero padding) faster than [`validate`]
/// for those widths; other widths go to [`validate`]. Same result and offsets.
pub fn validate_fast(n: usize, bits: u8, scales: &[u8], codes: &[u8]) -> Result<(), usize> {
    let bad = match bits {
        8 => codes.iter().fold(false, |a, &c| a | (c == 0xff)),
        4 => codes
            .iter()
            .fold(false, |a, &c| a | (c & 0x0f == 0x0f) | (c >> 4 == 0x0f)),
        _ => true,
    };
    if bad || codes.len() != codes_len(n, bits) {
        return validate(n, bits, scales, codes);
    }
    if bits == 4 && n % 2 == 1 && codes.last().is_some_and(|&c| c >> 4 != 0) {
        return validate(n, bits, scales, codes);
    }
    for (j, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        if !(m.is_finite() && m >= 0.0) {
            return Err(4 * j);
        }
    }
    Ok(())
}

/// Decodes validated sections into `out` (`out.len() == n`): overwriting (`weight = None`) or
/// adding `weight * value`; the same values as [`decode`] (`(q / l) * m`).
pub fn decode_slice(
    bits: u8,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
    weight: Option<f32>,
) {
    let n = out.len();
    if !((bits == 8 || bits == 4) && block > 0 && block.is_multiple_of(LANES)) {
        match weight {
            None => decode(n, bits, block, scales, codes, |i, v| out[i] = v),
            Some(w) => decode(n, bits, block, scales, codes, |i, v| out[i] += w * v),
        }
        return;
    }
    let l = quant_levels(bits);
    let lf = f32x8::splat(l as f32);
    let li = i32x8::splat(l as i32);
    let w8 = f32x8::splat(weight.unwrap_or(1.0));
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = &scales[4 * b..4 * b + 4];
        let m8 = f32x8::splat(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
        let per_byte = 8 / bits as usize;
        let cb = &codes[b * block / per_byte..(b * block + ob.len()).div_ceil(per_byte)];
        let conv = |o: &mut [f32], c: [i32; 8]| {
            let q = f32x8::from_i32x8(i32x8::new(c) - li);
            let v = (q / lf) * m8;
            let len = o.len();
            let r = match weight {
                None => v,
                Some(_) if len == LANES => load(o) + w8 * v,
                Some(_) => load_padded(o) + w8 * v,
            };
            o.copy_from_slice(&r.as_array()[..len]);
        };
        let full = ob.len() / LANES * LANES;
        let mut os = ob.chunks_exact_mut(LANES);
        let step = LANES / per_byte;
        let mut cs = cb.chunks_exact(step);
        for (o, c) in (&mut os).zip(&mut cs) {
            let mut q = [0i32; 8];
            if bits == 8 {
                for (v, &b) in q.iter_mut().zip(c) {
                    *v = i32::from(b);
                }
            } else {
                for (t, &b) in c.iter().enumerate() {
                    q[2 * t] = i32::from(b & 0x0f);
                    q[2 * t + 1] = i32::from(b >> 4);
                }
            }
            conv(o, q);
        }
        let o = os.into_remainder();
        if !o.is_empty() {
            let c = &cb[full / per_byte..];
            let mut q = [0i32; 8];
            for (t, &b) in c.iter().enumerate() {
                if bits == 8 {
                    q[t] = i32::from(b);
                } else {
                    q[2 * t] = i32::from(b & 0x0f);
                    q[2 * t + 1] = i32::from(b >> 4);
                }
            }
            conv(o, q);
        }
    }
}

/// Checks scales (finite, `>= 0`) and codes (`<= 2l`; padding zero).
/// `Err(offset)` gives the byte offset within `scales` + `codes` (scales first).
pub fn validate(n: usize, bits: u8, scales: &[u8], codes: &[u8]) -> Result<(), usize> {
    for (j, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        if !(m.is_finite() && m >= 0.0) {
            return Err(4 * j);
        }
    }
    let max = 2 * quant_levels(bits) as u64;
    let mut br = crate::bits::BitReader::new(codes);
    for i in 0..n {
        match br.read(u32::from(bits)) {
            Some(c) if c <= max => {}
            _ => return Err(scales.len() + i * bits as usize / 8),
        }
    }
    if !br.padding_is_zero() || br.bytes_consumed() != codes.len() {
        return Err(scales.len() + codes.len().saturating_sub(1));
    }
    Ok(())
}

/// Decodes validated sections, calling `f(i, value)` for every element in order.
pub fn decode(
    n: usize,
    bits: u8,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    mut f: impl FnMut(usize, f32),
) {
    let l = quant_levels(bits);
    let mut br = crate::bits::BitReader::new(codes);
    for (b, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let start = b * block;
        let end = (start + block).min(n);
        for i in start..end {
            let c = br.read(u32::from(bits)).unwrap_or(0) as i32;
            f(i, dequant(c - l as i32, m, l));
        }
    }
}

//! b-bit symmetric quantization with per-block absmax scales (QSGD, Alistarh et al. 2017).
//!
//! Codes `q` lie in `[-l, l]` with `l = 2^(b-1) - 1` and travel as `q + l` in `b` bits,
//! least-significant-bit first. A block's scale is its absmax `m` (f32); `q = round((x / m) * l)`
//! and the value decoded is `(q / l) * m`, so that the extremes and constant blocks are exact.

use crate::rng;
use crate::scalar::{dequant, quant_levels};

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
    crate::scalar::quant_encode(x, bits, block, key, scales, codes)
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

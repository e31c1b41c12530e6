//! Sign compression: one bit per element (1 = negative, 0 counts as +), with one f32 scale per
//! block (the block's mean |g|, EF-signSGD, Karimireddy et al. 2019) or none (signSGD with
//! majority vote, Bernstein et al. 2018).

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

/// Packs the signs of `x` into `signs` and, with `Some(block)`, each block's mean |x| into
/// `scales` (little-endian f32). `x` must be finite.
pub fn encode(x: &[f32], block: Option<usize>, scales: &mut [u8], signs: &mut [u8]) {
    crate::scalar::sign_encode(x, block, scales, signs)
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

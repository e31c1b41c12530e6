//! The counter-based generator behind random-k and stochastic rounding.
//!
//! A draw is a pure function of (seed, step, tensor id, index): `draw(key(seed, step, id), i)`.
//! Any rank or receiver regenerates any draw without state, in any order. The mixing function is
//! the SplitMix64 finalizer (Steele, Lea & Flood 2014), applied to a keyed counter.

/// SplitMix64's finalizer: a bijective 64-bit mixer.
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The golden-ratio increment of SplitMix64 (`G` in FORMAT.md 6.1).
pub(crate) const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The stream key for (seed, step, tensor id).
#[inline]
pub const fn key(seed: u64, step: u64, tensor_id: u64) -> u64 {
    mix64(
        seed ^ mix64(
            step.wrapping_add(GOLDEN) ^ mix64(tensor_id.wrapping_add(GOLDEN.wrapping_mul(2))),
        ),
    )
}

/// The 64 random bits of draw `index` in stream `key`.
#[inline]
pub const fn draw(key: u64, index: u64) -> u64 {
    mix64(key ^ mix64(index.wrapping_mul(GOLDEN).wrapping_add(GOLDEN)))
}

/// A uniform f32 in `[0, 1)` with 24 random bits, from draw `index` in stream `key`.
#[inline]
pub const fn uniform_f32(key: u64, index: u64) -> f32 {
    (draw(key, index) >> 40) as f32 * (1.0 / 16_777_216.0)
}

//! The zero mask of sign frames (FORMAT.md 3.6): which elements are exactly zero (`0.0` or
//! `-0.0`), so that they decode to zero where a sign bit alone would decode to `±scale`.
//!
//! The tensor is cut into blocks of `block` elements (a multiple of 8; the sign scale block, or
//! [`crate::method::UNSCALED_MASK_BLOCK`] for unscaled sign). The section holds one 2-bit state
//! per block, least significant bits first: [`NONE`] (no element is zero), [`ALL`] (every
//! element is zero), [`MIXED`] (some are); then, for each mixed block in order, a bitmap of
//! [`map_len`] bytes (`block / 8`, or `ceil(n / 8)` for a tensor shorter than a block) whose bit
//! `j` is 1 when element `j` of the block is zero. Blocks that are all zeros or free of zeros
//! (nearly all blocks of a gradient) cost 2 bits.

use crate::lanes::{LANES, load, load_padded};
use wide::f32x8;

/// State of a block without zero elements.
pub const NONE: u8 = 0;
/// State of a block whose every element is zero.
pub const ALL: u8 = 1;
/// State of a block that mixes zeros and non-zeros; its bitmap follows the states.
pub const MIXED: u8 = 2;

/// Blocks of the mask of `n` elements.
pub const fn blocks(n: usize, block: usize) -> usize {
    n.div_ceil(if block == 0 { 1 } else { block })
}

/// Bytes of the states of `n` elements: 2 bits per block, rounded up to whole bytes.
pub const fn states_len(n: usize, block: usize) -> usize {
    blocks(n, block).div_ceil(4)
}

/// Bytes of one mixed block's bitmap for `n` elements: `ceil(min(block, n) / 8)`, so that no
/// bitmap is longer than the tensor needs.
pub const fn map_len(n: usize, block: usize) -> usize {
    (if n < block { n } else { block }).div_ceil(8)
}

/// Bytes of the section with `mixed` mixed blocks, `None` when that overflows a `usize`.
pub const fn section_len(n: usize, block: usize, mixed: usize) -> Option<usize> {
    match mixed.checked_mul(map_len(n, block)) {
        Some(maps) => states_len(n, block).checked_add(maps),
        None => None,
    }
}

/// The largest section for `n` elements (every block mixed), saturating.
pub const fn max_len(n: usize, block: usize) -> usize {
    states_len(n, block).saturating_add(blocks(n, block).saturating_mul(map_len(n, block)))
}

/// Writes the mask of `x` into `out`, which holds at least [`max_len`] bytes, and returns the
/// bytes written and the number of mixed blocks. `block` is a multiple of 8.
///
/// SIMD: the bitmap of eight elements is `simd_eq(0).to_bitmask()` (lane 0 the least
/// significant bit), written for every block into the next free bitmap slot and kept there
/// only when the block is mixed.
pub fn encode(x: &[f32], block: usize, out: &mut [u8]) -> (usize, usize) {
    let s_len = states_len(x.len(), block);
    let m_len = map_len(x.len(), block);
    let (states, maps) = out.split_at_mut(s_len);
    states.fill(0);
    let mut mixed = 0usize;
    for (b, xs) in x.chunks(block).enumerate() {
        let map = &mut maps[mixed * m_len..(mixed + 1) * m_len];
        let state = state_of(zero_bits(xs, map), xs.len());
        states[b / 4] |= state << (2 * (b % 4));
        if state == MIXED {
            mixed += 1;
        }
    }
    (s_len + mixed * m_len, mixed)
}

/// Bitmap of the zero elements of `xs` into `map` (`ceil(xs.len() / 8)` bytes written, the rest
/// of `map` zeroed); returns how many are zero.
fn zero_bits(xs: &[f32], map: &mut [u8]) -> usize {
    let zero = f32x8::splat(0.0);
    let mut count = 0usize;
    let mut chunks = xs.chunks_exact(LANES);
    let mut at = 0usize;
    for c in &mut chunks {
        let m = load(c).simd_eq(zero).to_bitmask() as u8;
        map[at] = m;
        count += m.count_ones() as usize;
        at += 1;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        // Padded lanes are zeros too: keep only the tail's own bits.
        let m = (load_padded(tail).simd_eq(zero).to_bitmask() as u8) & ((1u8 << tail.len()) - 1);
        map[at] = m;
        count += m.count_ones() as usize;
        at += 1;
    }
    map[at..].fill(0);
    count
}

/// The state of a block of `len` elements of which `zeros` are zero.
const fn state_of(zeros: usize, len: usize) -> u8 {
    if zeros == 0 {
        NONE
    } else if zeros == len {
        ALL
    } else {
        MIXED
    }
}

/// The state of block `b`.
fn state(states: &[u8], b: usize) -> u8 {
    (states[b / 4] >> (2 * (b % 4))) & 3
}

/// A checked mask: the states of every block and the bitmaps of the mixed ones. Crate-private:
/// its decoder relies on the section lengths that the frame parser has checked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mask<'a> {
    block: usize,
    states: &'a [u8],
    maps: &'a [u8],
}

impl<'a> Mask<'a> {
    /// Checks the section `mask` of `n` elements against the sign sections it belongs to:
    /// `scales` (4 bytes per block, empty when unscaled) and `signs` (`ceil(n / 8)` bytes),
    /// which directly precede it. Canonical form only: states are 0..=2 with zero padding bits,
    /// exactly `mixed` blocks are mixed, each mixed bitmap has a zero and a non-zero element and
    /// no bits past the tensor's end, zero elements have sign bit 0 and an all-zero block has
    /// scale `+0.0`. `Err(offset)` within `scales`, `signs` and `mask` laid end to end.
    ///
    /// # Errors
    /// The offset of the first byte that breaks a rule (the start of `mask` when a section's
    /// length is not the one `n`, `block` and `mixed` give).
    pub(crate) fn check(
        n: usize,
        block: usize,
        mixed: usize,
        scales: &[u8],
        signs: &[u8],
        mask: &'a [u8],
    ) -> Result<Self, usize> {
        let s_len = states_len(n, block);
        let m_len = map_len(n, block);
        let nb = blocks(n, block);
        let lengths_ok = section_len(n, block, mixed) == Some(mask.len())
            && signs.len() == n.div_ceil(8)
            && (scales.is_empty() || Some(scales.len()) == nb.checked_mul(4));
        if block == 0 || !block.is_multiple_of(LANES) || !lengths_ok {
            return Err(scales.len() + signs.len());
        }
        let (states, maps) = mask.split_at(s_len);
        let at_mask = scales.len() + signs.len();
        let pad = 2 * (nb % 4);
        if pad != 0 && states[s_len - 1] >> pad != 0 {
            return Err(at_mask + s_len - 1);
        }
        let mut seen = 0usize;
        for b in 0..nb {
            let start = b * block;
            let len = block.min(n - start);
            let sign_bytes = &signs[start / 8..(start + len).div_ceil(8)];
            let at_signs = scales.len() + start / 8;
            match state(states, b) {
                NONE => {}
                ALL => {
                    if let Some(j) = sign_bytes.iter().position(|&s| s != 0) {
                        return Err(at_signs + j);
                    }
                    if scales.len() >= 4 * (b + 1) && scales[4 * b..4 * b + 4] != [0; 4] {
                        return Err(4 * b);
                    }
                }
                MIXED => {
                    if seen == mixed {
                        return Err(at_mask + b / 4);
                    }
                    let at_map = s_len + seen * m_len;
                    let map = &maps[seen * m_len..(seen + 1) * m_len];
                    let used = len.div_ceil(8);
                    let last_bits = len - 8 * (used - 1);
                    let padded = last_bits < 8 && map[used - 1] >> last_bits != 0;
                    if padded {
                        return Err(at_mask + at_map + used - 1);
                    }
                    if let Some(j) = map[used..].iter().position(|&m| m != 0) {
                        return Err(at_mask + at_map + used + j);
                    }
                    let zeros: usize = map.iter().map(|m| m.count_ones() as usize).sum();
                    if state_of(zeros, len) != MIXED {
                        return Err(at_mask + at_map);
                    }
                    if let Some(j) = sign_bytes.iter().zip(map).position(|(&s, &m)| s & m != 0) {
                        return Err(at_signs + j);
                    }
                    seen += 1;
                }
                _ => return Err(at_mask + b / 4),
            }
        }
        if seen != mixed {
            return Err(at_mask);
        }
        Ok(Mask {
            block,
            states,
            maps,
        })
    }

    /// The mask of a section that [`Mask::check`] accepted for `n` elements (a frame that
    /// passed validation, or one this crate wrote).
    pub(crate) fn of_checked(n: usize, block: usize, mask: &'a [u8]) -> Self {
        let (states, maps) = mask.split_at(states_len(n, block).min(mask.len()));
        Mask {
            block,
            states,
            maps,
        }
    }

    /// Decodes the checked sign sections with this mask into `out` (`n` elements):
    /// overwriting (`weight = None`) or adding `weight * value`; zero elements are written as
    /// `+0.0` or left as they are. Every other element gets exactly what
    /// [`crate::sign::decode_slice`] gives it.
    pub(crate) fn decode(
        &self,
        scale_block: Option<usize>,
        scales: &[u8],
        signs: &[u8],
        out: &mut [f32],
        weight: Option<f32>,
    ) {
        let block = self.block;
        let m_len = map_len(out.len(), block);
        let mut seen = 0usize;
        for (b, ob) in out.chunks_mut(block).enumerate() {
            let start = b * block;
            let s = scales.get(4 * b..).unwrap_or_default();
            let sg = &signs[start / 8..];
            match state(self.states, b) {
                ALL => {
                    if weight.is_none() {
                        ob.fill(0.0);
                    }
                }
                MIXED => {
                    let map = &self.maps[seen * m_len..(seen + 1) * m_len];
                    seen += 1;
                    let mag = match scale_block {
                        Some(_) => f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
                        None => 1.0,
                    };
                    for (j, o) in ob.iter_mut().enumerate() {
                        let masked = (map[j / 8] >> (j % 8)) & 1 == 1;
                        let neg = (sg[j / 8] >> (j % 8)) & 1 == 1;
                        let v = if neg { -mag } else { mag };
                        match (masked, weight) {
                            (true, None) => *o = 0.0,
                            (true, Some(_)) => {}
                            (false, None) => *o = v,
                            (false, Some(w)) => *o += w * v,
                        }
                    }
                }
                _ => crate::sign::decode_slice(scale_block, s, sg, ob, weight),
            }
        }
    }
}

/// Majority vote over summed votes of masked signs (`+1`, `-1`, or `0` for a zero element):
/// each element becomes `+1` when its sum is positive, `-1` when negative, and `0` on a tie,
/// which includes every rank voting zero. Zero votes abstain: one `+1` and any number of zeros
/// gives `+1`.
pub fn majority(votes: &mut [f32]) {
    for v in votes {
        *v = if *v > 0.0 {
            1.0
        } else if *v < 0.0 {
            -1.0
        } else {
            0.0
        };
    }
}

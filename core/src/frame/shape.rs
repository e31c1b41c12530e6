//! The sections of a dense, quantization or sign frame follow the tensor's elements in order:
//! one scale per block (quantization; sign with scales), then one value, code or sign bit per
//! element. A piece of whole blocks that starts on a whole byte of each section is encoded,
//! decoded and checked on its own, with the bytes and results of the whole frame's.

use super::wire::sign_block;
use crate::method::{Method, Rounding, Values};
use crate::select::OutOfLimit;
use crate::{quant, sign, values};

/// How the sections of a dense, quantization or sign frame hold its elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Shape {
    /// One plain value per element (f32, f16 or bf16), no scales.
    Dense(Values),
    /// One f32 scale per `block` elements, then a `bits`-bit code per element.
    Quant {
        bits: u8,
        block: usize,
        rounding: Rounding,
    },
    /// One f32 scale per `block` elements (none when unscaled), then a bit per element.
    Sign { block: Option<usize> },
}

impl Shape {
    /// The shape of a valid `method`; `None` for top-k, threshold and random-k, and for sign
    /// with a zero mask (whose mask section's length depends on the elements, so the frame
    /// does not cut into chunks).
    pub(crate) fn of(method: &Method) -> Option<Shape> {
        match *method {
            Method::Dense { values } if !matches!(values, Values::Int8 { .. }) => {
                Some(Shape::Dense(values))
            }
            Method::Quant {
                bits,
                block,
                rounding,
            } => Some(Shape::Quant {
                bits,
                block: block as usize,
                rounding,
            }),
            Method::Sign {
                scale,
                zero_mask: false,
            } => Some(Shape::Sign {
                block: sign_block(scale),
            }),
            _ => None,
        }
    }

    /// Bytes of the scales and body sections of a frame of `n` elements, or `None` when one
    /// does not fit a `usize` (a frame the decoder refuses as too large). For `n` where this is
    /// `Some`, [`Shape::scales_len`] and [`Shape::body_len`] of every `elems <= n` are exact.
    pub(crate) fn section_lens(self, n: usize) -> Option<(usize, usize)> {
        Some(match self {
            Shape::Dense(v) => (0, n.checked_mul(v.value_bytes())?),
            Shape::Quant { bits, block, .. } => (
                n.div_ceil(block.max(1)).checked_mul(4)?,
                n.checked_mul(usize::from(bits))?.div_ceil(8),
            ),
            Shape::Sign { block } => {
                let scales = match block {
                    Some(b) => n.div_ceil(b.max(1)).checked_mul(4)?,
                    None => 0,
                };
                (scales, n.div_ceil(8))
            }
        })
    }

    /// Bytes of scales of the first `elems` elements: 4 per started block.
    pub(crate) fn scales_len(self, elems: usize) -> usize {
        match self {
            Shape::Dense(_) => 0,
            Shape::Quant { block, .. } => quant::scales_len(elems, block),
            Shape::Sign { block } => sign::scales_len(elems, block),
        }
    }

    /// Bytes of values, codes or sign bits of the first `elems` elements.
    pub(crate) fn body_len(self, elems: usize) -> usize {
        match self {
            Shape::Dense(v) => elems.saturating_mul(v.value_bytes()),
            Shape::Quant { bits, .. } => quant::codes_len(elems, bits),
            Shape::Sign { .. } => sign::bits_len(elems),
        }
    }

    /// The elements a piece boundary is a multiple of: whole blocks, and whole bytes of codes
    /// or sign bits (`None` when that overflows a `usize`).
    pub(crate) fn align(self) -> Option<usize> {
        let (block, per_byte) = match self {
            Shape::Dense(_) => (1, 1),
            Shape::Quant { bits, block, .. } => (block, 8 / gcd(usize::from(bits), 8)),
            Shape::Sign { block } => (block.unwrap_or(1), 8),
        };
        (block / gcd(block, per_byte))
            .checked_mul(per_byte)
            .filter(|&a| a > 0)
    }

    /// The (seed, step, tensor id) of stochastic rounding, from the frame's `stream`; `None`
    /// for every other shape.
    fn stochastic(self, stream: (u64, u64, u64)) -> Option<(u64, u64, u64)> {
        match self {
            Shape::Quant {
                rounding: Rounding::Stochastic,
                ..
            } => Some(stream),
            _ => None,
        }
    }

    /// Encodes `x`, the elements `first..first + x.len()` of the tensor (`first` a piece
    /// boundary), into the pieces `scales` and `body` of the sections: the bytes of the whole
    /// tensor's frame there. Stochastic rounding draws for each element's index in the tensor
    /// from `stream` (seed, step, tensor id). `x` is finite and within the value type's range.
    pub(crate) fn encode(
        self,
        x: &[f32],
        first: usize,
        stream: (u64, u64, u64),
        scales: &mut [u8],
        body: &mut [u8],
    ) {
        match self {
            Shape::Dense(v) => values::encode_plain(v, x, body),
            Shape::Quant { bits, block, .. } => {
                let stochastic = self.stochastic(stream);
                quant::encode_from(x, first as u64, bits, block, stochastic, scales, body);
            }
            Shape::Sign { block } => sign::encode(x, block, scales, body),
        }
    }

    /// [`Shape::encode`], checking on the way that `x` is finite and within the value type's
    /// range; on error the pieces hold unspecified bytes.
    pub(crate) fn try_encode(
        self,
        x: &[f32],
        first: usize,
        stream: (u64, u64, u64),
        scales: &mut [u8],
        body: &mut [u8],
    ) -> Result<(), OutOfLimit> {
        match self {
            Shape::Dense(v) => values::try_encode_plain(v, x, body),
            Shape::Quant { bits, block, .. } => match self.stochastic(stream) {
                None => quant::try_encode(x, bits, block, None, scales, body),
                Some(_) if values::first_non_finite(x).is_some() => Err(OutOfLimit),
                Some(_) => {
                    self.encode(x, first, stream, scales, body);
                    Ok(())
                }
            },
            Shape::Sign { block } => sign::try_encode(x, block, scales, body),
        }
    }

    /// Decodes the pieces `scales` and `body` of `out.len()` elements into `out`: overwriting
    /// (`weight = None`) or adding `weight * value`. The pieces passed [`Shape::validate`].
    pub(crate) fn decode(self, scales: &[u8], body: &[u8], out: &mut [f32], weight: Option<f32>) {
        match self {
            Shape::Dense(v) => values::decode_plain(v, body, out, weight),
            Shape::Quant { bits, block, .. } => {
                quant::decode_slice(bits, block, scales, body, out, weight);
            }
            Shape::Sign { block } => sign::decode_slice(block, scales, body, out, weight),
        }
    }

    /// Checks the pieces `scales` and `body` of `len` elements (exactly [`Shape::scales_len`]
    /// and [`Shape::body_len`] bytes): values finite, scales finite and `>= 0`, codes in range,
    /// padding bits zero. `Err(offset)` within `scales` followed by `body`.
    pub(crate) fn validate(self, len: usize, scales: &[u8], body: &[u8]) -> Result<(), usize> {
        match self {
            Shape::Dense(v) => match values::first_bad_plain(v, body) {
                Some(j) => Err(j * v.value_bytes()),
                None => Ok(()),
            },
            Shape::Quant { bits, .. } => quant::validate_fast(len, bits, scales, body),
            Shape::Sign { .. } => sign::validate(len, scales, body),
        }
    }
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

//! Value codecs: f32, f16, bf16 (crate `half`, round to nearest even) and int8 with a per-block
//! absmax scale.

use crate::method::Values;
use crate::scalar::{dequant, quant_code};
use half::{bf16, f16};

/// Wire id of a value codec.
pub const fn id(values: Values) -> u8 {
    match values {
        Values::F32 => 0,
        Values::F16 => 1,
        Values::Bf16 => 2,
        Values::Int8 { .. } => 3,
    }
}

/// True when `x` (finite) has a finite representation in `values` (f16 overflows beyond
/// 65504 after rounding; bf16 only next to f32::MAX; f32 and int8 always fit).
#[inline]
pub fn fits(values: Values, x: f32) -> bool {
    match values {
        Values::F16 => f16::from_f32(x).is_finite(),
        Values::Bf16 => bf16::from_f32(x).is_finite(),
        _ => true,
    }
}

/// Index of the first element of `x` that does not fit `values`.
pub fn first_out_of_range(values: Values, x: &[f32]) -> Option<usize> {
    match values {
        Values::F16 | Values::Bf16 => x.iter().position(|&v| !fits(values, v)),
        _ => None,
    }
}

/// Writes `x` as an f32, f16 or bf16 (little-endian) at the start of `out`.
#[inline]
pub fn write_plain(values: Values, x: f32, out: &mut [u8]) {
    match values {
        Values::F16 => out[..2].copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes()),
        Values::Bf16 => out[..2].copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
        _ => out[..4].copy_from_slice(&x.to_le_bytes()),
    }
}

/// Reads an f32, f16 or bf16 from the start of `bytes`; `None` if short or not finite.
#[inline]
pub fn read_plain(values: Values, bytes: &[u8]) -> Option<f32> {
    let v = match values {
        Values::F16 => {
            f16::from_bits(u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?])).to_f32()
        }
        Values::Bf16 => {
            bf16::from_bits(u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?])).to_f32()
        }
        _ => f32::from_le_bytes([
            *bytes.first()?,
            *bytes.get(1)?,
            *bytes.get(2)?,
            *bytes.get(3)?,
        ]),
    };
    if v.is_finite() { Some(v) } else { None }
}

/// The int8 code of `x` in a block with absmax `m`: round-to-nearest-even of `(x / m) * 127`.
#[inline]
pub fn int8_code(x: f32, m: f32) -> i8 {
    quant_code(x, m, 127, None) as i8
}

/// The value of an int8 code in a block with absmax `m`: `(code / 127) * m`.
#[inline]
pub fn int8_value(code: i8, m: f32) -> f32 {
    dequant(i32::from(code), m, 127)
}

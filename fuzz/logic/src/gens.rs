//! Structured generators shared by the targets: methods, parameters and gradients from fuzzer
//! bytes (through [`crate::input::Input`]). No dependency beyond `gradwire-core`, so both
//! replay tests can include this file.

use crate::input::Input;
use gradwire_core::{K, Method, Params, Rounding, SignScale, Values};

/// A block size: mostly small or default-like, sometimes any u32 (0 is invalid).
pub fn gen_block(inp: &mut Input<'_>) -> u32 {
    match inp.u8() % 5 {
        0 => 1 + inp.range(0, 9) as u32,
        1 => 1 + inp.range(0, 700) as u32,
        2 => 512,
        3 => 1024,
        _ => inp.u32(),
    }
}

/// A value codec; int8 only when `int8` (a dense method with int8 is invalid, tried rarely).
pub fn gen_values(inp: &mut Input<'_>, int8: bool) -> Values {
    match inp.u8() % 4 {
        0 => Values::F32,
        1 => Values::F16,
        2 => Values::Bf16,
        _ if int8 => Values::Int8 {
            block: gen_block(inp),
        },
        _ => Values::F32,
    }
}

/// A k for `n` elements: counts around `n`, any count, ratios, or any f64 (maybe invalid).
pub fn gen_k(inp: &mut Input<'_>, n: usize) -> K {
    match inp.u8() % 5 {
        0 => K::Count(inp.range(0, n as u64 + 2)),
        1 => K::Count(inp.u64()),
        2 => K::Ratio(f64::from(inp.u8()) / 200.0),
        3 => K::Ratio([0.0, 0.001, 0.01, 0.1, 0.5, 1.0][inp.u8() as usize % 6]),
        _ => K::Ratio(f64::from_bits(inp.u64())),
    }
}

/// A method for `n` elements; `grad` supplies realistic thresholds. About one in ten is
/// invalid (zero blocks, bad bits, NaN ratio, int8 dense).
pub fn gen_method(inp: &mut Input<'_>, n: usize, grad: &[f32]) -> Method {
    let rare = inp.u8() == 0xff;
    match inp.u8() % 6 {
        0 => Method::Dense {
            values: gen_values(inp, rare),
        },
        1 => Method::TopK {
            k: gen_k(inp, n),
            values: gen_values(inp, true),
        },
        2 => {
            let threshold = match inp.u8() % 4 {
                0 if !grad.is_empty() => grad[inp.range(0, grad.len() as u64 - 1) as usize].abs(),
                1 => 0.0,
                2 => f32::from(inp.u8()) / 64.0,
                _ => inp.f32_bits(),
            };
            Method::Threshold {
                threshold,
                values: gen_values(inp, true),
            }
        }
        3 => Method::RandomK {
            k: gen_k(inp, n),
            values: gen_values(inp, true),
            unbiased: inp.bool(),
        },
        4 => Method::Quant {
            bits: if rare {
                inp.u8()
            } else {
                2 + inp.range(0, 6) as u8
            },
            block: gen_block(inp),
            rounding: if inp.bool() {
                Rounding::Stochastic
            } else {
                Rounding::NearestEven
            },
        },
        _ => {
            // One byte picks the scale mode (2 low bits) and the zero mask (bit 4).
            let mode = inp.u8();
            Method::Sign {
                scale: if mode.is_multiple_of(4) {
                    SignScale::None
                } else {
                    SignScale::MeanAbs {
                        block: gen_block(inp),
                    }
                },
                zero_mask: mode & 0x10 != 0,
            }
        }
    }
}

/// Method plus seed, step and tensor id.
pub fn gen_params(inp: &mut Input<'_>, n: usize, grad: &[f32]) -> Params {
    let method = gen_method(inp, n, grad);
    let (seed, step, tensor_id) = if inp.bool() {
        (inp.u64(), inp.u64(), inp.u64())
    } else {
        (
            u64::from(inp.u8()),
            u64::from(inp.u8()),
            u64::from(inp.u8()),
        )
    };
    Params {
        method,
        seed,
        step,
        tensor_id,
    }
}

/// A gradient of up to `max` elements in one of several shapes: raw bits (NaN, Inf,
/// subnormals, -0.0), finite raw bits, small integers times a power of two (ties, zeros,
/// subnormal and huge magnitudes), or a constant.
pub fn gen_grad(inp: &mut Input<'_>, max: usize) -> Vec<f32> {
    let len = inp.range(0, max as u64) as usize;
    let shape = inp.u8();
    let len = len.min(match shape % 4 {
        // Raw shapes consume 4 bytes per element: keep them within the input.
        0 | 1 => inp.len() / 4 + 1,
        _ => usize::MAX,
    });
    match shape % 4 {
        0 => (0..len).map(|_| inp.f32_bits()).collect(),
        1 => (0..len)
            .map(|_| {
                let x = inp.f32_bits();
                if x.is_finite() {
                    x
                } else {
                    f32::from_bits(x.to_bits() & 0xbf7f_ffff)
                }
            })
            .collect(),
        2 => {
            let e = i32::from(inp.u8()) - 150; // 2^-150 ..= 2^105
            let scale = pow2(e);
            (0..len)
                .map(|_| f32::from(inp.u8() as i8) * scale)
                .collect()
        }
        _ => {
            let c = inp.f32_bits();
            let c = if c.is_finite() { c } else { 1.0 };
            vec![c; len]
        }
    }
}

/// `2^e` as an f32 (0 below the subnormals, inf above the range).
pub fn pow2(e: i32) -> f32 {
    if e < -149 {
        0.0
    } else if e < -126 {
        f32::from_bits(1 << (e + 149))
    } else if e > 127 {
        f32::INFINITY
    } else {
        f32::from_bits(((e + 127) as u32) << 23)
    }
}

//! One test per row of docs/edge-cases.md ("Defined results for edge cases") that concerns the
//! core.

mod common;

use common::*;
use gradwire_core::{
    Error, K, Method, Param, Params, Rounding, SignScale, Values, accumulate_into, decode_into,
    encode_into, feedback_step, max_frame_len, peek, scratch_len,
};

/// Every method (including the ones error feedback refuses), for the rows that hold for all.
fn all_methods() -> Vec<(&'static str, Method)> {
    let mut m = feedback_methods();
    m.push((
        "randomk-unbiased",
        Method::RandomK {
            k: K::Count(3),
            values: Values::F16,
            unbiased: true,
        },
    ));
    m.push((
        "sign-unscaled",
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        },
    ));
    m.push((
        "quant3",
        Method::Quant {
            bits: 3,
            block: 5,
            rounding: Rounding::NearestEven,
        },
    ));
    m.push((
        "topk-count",
        Method::TopK {
            k: K::Count(2),
            values: Values::Int8 { block: 1 },
        },
    ));
    m
}

fn feedback(g: &[f32], r: &mut [f32], p: &Params) -> Result<Vec<u8>, Error> {
    let mut out = vec![0u8; max_frame_len(g.len(), &p.method)];
    let mut scratch = vec![0u32; scratch_len(g.len(), &p.method)];
    let len = feedback_step(g, r, p, &mut scratch, &mut out)?;
    out.truncate(len);
    Ok(out)
}

/// Row: empty tensor (n = 0): a valid frame with n = 0; decodes to nothing; residual untouched.
#[test]
fn empty_tensor() {
    for (name, method) in all_methods() {
        let p = Params::new(method);
        let frame = encode(&[], &p).unwrap();
        let h = peek(&frame).unwrap();
        assert_eq!((h.n, h.kept), (0, 0), "{name}");
        assert_eq!(decode(&frame, &p, 0).unwrap(), Vec::<f32>::new(), "{name}");
        assert_eq!(
            accumulate_into(&frame, &p, &mut [], 1.0).unwrap().n,
            0,
            "{name}"
        );
        if !matches!(name, "randomk-unbiased" | "sign-unscaled") {
            let mut r: [f32; 0] = [];
            let f = feedback(&[], &mut r, &p).unwrap();
            assert_eq!(f, frame, "{name}");
        }
    }
}

/// Row: k = 0: a valid frame with no entries; everything goes to the residual.
#[test]
fn k_zero() {
    let g = [1.0f32, -2.0, 3.0];
    for values in [Values::F32, Values::F16, Values::Int8 { block: 2 }] {
        for method in [
            Method::TopK {
                k: K::Count(0),
                values,
            },
            Method::RandomK {
                k: K::Count(0),
                values,
                unbiased: false,
            },
        ] {
            let p = Params::new(method);
            let frame = encode(&g, &p).unwrap();
            assert_eq!(peek(&frame).unwrap().kept, 0);
            assert_eq!(decode(&frame, &p, 3).unwrap(), vec![0.0; 3]);
            let mut r = [0.5f32, 0.0, -0.25];
            feedback(&g, &mut r, &p).unwrap();
            assert_eq!(r, [1.5, -2.0, 2.75], "{method:?}");
        }
    }
    // A ratio never resolves to 0 for n > 0 (clamped to 1, as the reference layout does).
    assert_eq!(K::Ratio(0.0).resolve(3), 1);
    assert_eq!(K::Ratio(0.0).resolve(0), 0);
}

/// Row: k >= n: every entry kept, lossless for f32 values.
#[test]
fn k_at_least_n_is_lossless() {
    let mut d = Data(1);
    let mut g = d.grads(100);
    g[3] = -0.0;
    g[4] = f32::from_bits(1);
    g[5] = f32::MAX;
    for k in [
        K::Count(100),
        K::Count(101),
        K::Count(u64::MAX),
        K::Ratio(1.0),
        K::Ratio(7.5),
    ] {
        for method in [
            Method::TopK {
                k,
                values: Values::F32,
            },
            Method::RandomK {
                k,
                values: Values::F32,
                unbiased: false,
            },
            Method::RandomK {
                k,
                values: Values::F32,
                unbiased: true,
            },
        ] {
            let p = Params::new(method);
            let frame = encode(&g, &p).unwrap();
            assert_eq!(peek(&frame).unwrap().kept, 100);
            assert!(
                same_bits(&decode(&frame, &p, 100).unwrap(), &g),
                "{method:?}"
            );
        }
    }
    let p = Params::new(Method::Threshold {
        threshold: 0.0,
        values: Values::F32,
    });
    let out = decode(&encode(&g, &p).unwrap(), &p, 100).unwrap();
    // |g| > 0 keeps everything but zeros, which decode to +0.0.
    let want: Vec<f32> = g.iter().map(|&x| if x == 0.0 { 0.0 } else { x }).collect();
    assert!(same_bits(&out, &want));
}

/// Row: ties at the k-th magnitude: the lower index wins, the same on every run.
#[test]
fn ties_go_to_the_lower_index() {
    let g = [1.0f32, -2.0, 2.0, 0.5, -2.0, 2.0, 1.0];
    let p = Params::new(Method::TopK {
        k: K::Count(2),
        values: Values::F32,
    });
    let out = decode(&encode(&g, &p).unwrap(), &p, 7).unwrap();
    assert_eq!(out, [0.0, -2.0, 2.0, 0.0, 0.0, 0.0, 0.0]);
    let p = Params::new(Method::TopK {
        k: K::Count(4),
        values: Values::F32,
    });
    let out = decode(&encode(&g, &p).unwrap(), &p, 7).unwrap();
    assert_eq!(out, [0.0, -2.0, 2.0, 0.0, -2.0, 2.0, 0.0]);
    let p = Params::new(Method::TopK {
        k: K::Count(5),
        values: Values::F32,
    });
    let out = decode(&encode(&g, &p).unwrap(), &p, 7).unwrap();
    assert_eq!(out, [1.0, -2.0, 2.0, 0.0, -2.0, 2.0, 0.0]);
    // -0.0 and 0.0 tie too.
    let z = [0.0f32, -0.0, 0.0, 1.0];
    let p = Params::new(Method::TopK {
        k: K::Count(2),
        values: Values::F32,
    });
    let out = decode(&encode(&z, &p).unwrap(), &p, 4).unwrap();
    assert!(same_bits(&out, &[0.0, 0.0, 0.0, 1.0]));
    // The same bytes on every run.
    let a = encode(&g, &p).unwrap();
    for _ in 0..10 {
        assert_eq!(encode(&g, &p).unwrap(), a);
    }
}

/// Row: NaN or Inf in a gradient: an error naming the first bad index, the residual untouched.
/// On error `out` holds no valid frame: the encoder clears its magic, so neither the blocks
/// written before the bad one nor a frame of an earlier call decodes.
#[test]
fn non_finite_names_the_first_bad_index() {
    for (name, method) in all_methods() {
        let p = Params::new(method);
        for (n, first, second) in [(40usize, 17usize, 30usize), (300, 217, 250)] {
            for bad in [
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::from_bits(0xffc0_0001),
            ] {
                let mut g: Vec<f32> = (0..n).map(|i| 0.25 + (i % 7) as f32 * 0.125).collect();
                let clean = g.clone();
                g[first] = bad;
                g[second] = f32::NAN;
                let mut out = vec![0xeeu8; max_frame_len(n, &method)];
                let mut scratch = vec![0u32; scratch_len(n, &method)];
                // A valid frame of an earlier call in the buffer must not survive the error.
                encode_into(&clean, &p, &mut scratch, &mut out).unwrap();
                let e = encode_into(&g, &p, &mut scratch, &mut out).unwrap_err();
                assert_eq!(e, Error::NonFinite { index: first }, "{name}");
                assert!(peek(&out).is_err(), "{name}: a valid frame on error");
                if matches!(name, "randomk-unbiased" | "sign-unscaled") {
                    continue;
                }
                let mut r: Vec<f32> = (0..n).map(|i| i as f32 * 0.125).collect();
                let before = r.clone();
                encode_into(&clean, &p, &mut scratch, &mut out).unwrap();
                let e = feedback_step(&g, &mut r, &p, &mut scratch, &mut out).unwrap_err();
                assert_eq!(e, Error::NonFinite { index: first }, "{name}");
                assert!(same_bits(&r, &before), "{name}: residual changed");
                assert!(peek(&out).is_err(), "{name}: a valid frame on error");
            }
        }
        if matches!(name, "randomk-unbiased" | "sign-unscaled") {
            continue;
        }
        // A finite gradient whose sum with the residual overflows is non-finite too.
        let mut g = vec![0.25f32; 10];
        g[6] = f32::MAX;
        let mut r = vec![0.0f32; 10];
        r[6] = f32::MAX;
        let before = r.clone();
        let mut out = vec![0u8; max_frame_len(10, &method)];
        let mut scratch = vec![0u32; scratch_len(10, &method)];
        let e = feedback_step(&g, &mut r, &p, &mut scratch, &mut out).unwrap_err();
        assert_eq!(e, Error::NonFinite { index: 6 }, "{name}");
        assert!(same_bits(&r, &before), "{name}");
        // The first bad index of either kind: an overflowing sum before a NaN gradient.
        g[8] = f32::NAN;
        let e = feedback_step(&g, &mut r, &p, &mut scratch, &mut out).unwrap_err();
        assert_eq!(
            e,
            Error::NonFinite { index: 6 },
            "{name}: overflow before a NaN"
        );
        assert!(same_bits(&r, &before), "{name}");
    }
}

/// Row: all-zero or constant tensor: quantization is exact (no 0/0, no NaN).
#[test]
fn zero_and_constant_tensors_quantize_exactly() {
    let mut inputs: Vec<Vec<f32>> = vec![vec![0.0; 37], vec![-0.0; 37]];
    for c in [
        1.0f32,
        -1.0,
        0.3,
        -7.25e-9,
        f32::from_bits(1),
        -f32::MAX,
        65504.0,
    ] {
        inputs.push(vec![c; 37]);
    }
    for x in &inputs {
        for bits in 2..=8u8 {
            for rounding in [Rounding::NearestEven, Rounding::Stochastic] {
                for block in [1u32, 4, 37, 64] {
                    let p = Params::new(Method::Quant {
                        bits,
                        block,
                        rounding,
                    })
                    .with_seed(bits as u64);
                    let out = decode(&encode(x, &p).unwrap(), &p, x.len()).unwrap();
                    assert_eq!(&out, x, "{:e} bits {bits} {rounding:?} block {block}", x[0]);
                    assert!(out.iter().all(|v| !v.is_nan()));
                }
            }
        }
        // An all-zero tensor under sign decodes to zeros; int8 values are exact on constants.
        if x[0] == 0.0 {
            let p = Params::new(Method::Sign {
                scale: SignScale::MeanAbs { block: 8 },
                zero_mask: false,
            });
            let out = decode(&encode(x, &p).unwrap(), &p, x.len()).unwrap();
            assert_eq!(&out, x);
        }
        let p = Params::new(Method::TopK {
            k: K::Count(37),
            values: Values::Int8 { block: 8 },
        });
        let out = decode(&encode(x, &p).unwrap(), &p, x.len()).unwrap();
        assert_eq!(&out, x);
    }
    // A zero block next to a non-zero one: the zero block stays exactly zero.
    let mut x = vec![0.0f32; 16];
    x[12] = 3.0;
    let p = Params::new(Method::Quant {
        bits: 2,
        block: 8,
        rounding: Rounding::Stochastic,
    });
    let out = decode(&encode(&x, &p).unwrap(), &p, 16).unwrap();
    assert!(out[..8].iter().all(|&v| v == 0.0));
}

/// Row: a value beyond f16's range with f16 values is an error, not inf.
#[test]
fn beyond_f16_range_is_an_error_without_error_feedback_and_saturates_with_it() {
    let cases: [(f32, bool); 6] = [
        (65504.0, true),
        (65519.0, true),
        (65520.0, false),
        (-7.0e4, false),
        (1.0e10, false),
        (-65504.0, true),
    ];
    for (v, fits) in cases {
        let g = [1.0, v, 2.0e5];
        for method in [
            Method::Dense {
                values: Values::F16,
            },
            Method::TopK {
                k: K::Count(1),
                values: Values::F16,
            },
            Method::Threshold {
                threshold: 0.0,
                values: Values::F16,
            },
            Method::RandomK {
                k: K::Count(1),
                values: Values::F16,
                unbiased: false,
            },
        ] {
            let p = Params::new(method);
            let e = encode(&g[..2], &p);
            if fits {
                let out = decode(&e.unwrap(), &p, 2).unwrap();
                assert!(out.iter().all(|x| x.is_finite()));
            } else {
                assert_eq!(
                    e.unwrap_err(),
                    Error::ValueOutOfRange { index: 1 },
                    "{v} {method:?}"
                );
            }
            // The first bad index is named, even when a later one is bad too.
            let first = if fits { 2 } else { 1 };
            assert_eq!(
                encode(&g, &p).unwrap_err(),
                Error::ValueOutOfRange { index: first }
            );
            // Error feedback sends a value beyond the range saturated (65504 of its sign) and
            // keeps the excess: sent + residual == gradient, to the bit (|x| < 2^29).
            let mut r = [0.0f32; 3];
            let frame = feedback(&g, &mut r, &p).unwrap_or_else(|e| panic!("{v} {method:?}: {e}"));
            let sent = decode(&frame, &p, 3).unwrap();
            for i in 0..3 {
                assert!(sent[i].abs() <= 65504.0, "{v} {method:?}: {sent:?}");
                assert_eq!(
                    (sent[i] + r[i]).to_bits(),
                    g[i].to_bits(),
                    "{v} {method:?} {i}"
                );
            }
        }
    }
    // A residual that pushes a fitting gradient out of range: sent saturated, the rest kept.
    let p = Params::new(Method::Dense {
        values: Values::F16,
    });
    let mut r = [0.0f32, 60000.0];
    let frame = feedback(&[1.0, 6000.0], &mut r, &p).unwrap();
    assert_eq!(decode(&frame, &p, 2).unwrap(), vec![1.0, 65504.0]);
    assert_eq!(r, [0.0, 66000.0 - 65504.0]);
}

/// Row: a value below f16's smallest subnormal with f16 values encodes as 0; error feedback
/// keeps it in the residual.
#[test]
fn below_f16_subnormal_encodes_as_zero_and_stays_in_the_residual() {
    let tiny = [1.0e-9f32, -2.9e-8, 2.0f32.powi(-25), 5.0e-8];
    let g = [tiny[0], tiny[1], tiny[2], tiny[3], 1.0];
    for method in [
        Method::Dense {
            values: Values::F16,
        },
        Method::TopK {
            k: K::Count(5),
            values: Values::F16,
        },
        Method::RandomK {
            k: K::Count(5),
            values: Values::F16,
            unbiased: false,
        },
    ] {
        let p = Params::new(method);
        let out = decode(&encode(&g, &p).unwrap(), &p, 5).unwrap();
        assert_eq!(&out[..3], &[0.0, 0.0, 0.0], "{method:?}");
        assert_eq!(
            out[3],
            2.0f32.powi(-24),
            "5e-8 rounds up to the smallest subnormal"
        );
        let mut r = [0.0f32; 5];
        let frame = feedback(&g, &mut r, &p).unwrap();
        let sent = decode(&frame, &p, 5).unwrap();
        assert_eq!(
            &r[..3],
            &g[..3],
            "{method:?}: the residual keeps what f16 cannot carry"
        );
        assert_eq!(r[3], 5.0e-8 - 2.0f32.powi(-24));
        for i in 0..5 {
            assert_eq!(sent[i] + r[i], g[i]);
        }
        // It accumulates step after step until it is large enough to travel.
        let mut r = [0.0f32; 1];
        let mut delivered = 0.0f32;
        for _ in 0..100 {
            let frame = feedback(&[1.0e-9], &mut r, &p).unwrap();
            delivered += decode(&frame, &p, 1).unwrap()[0];
        }
        assert!(
            delivered > 0.0,
            "{method:?}: the residual never got through"
        );
        assert!((delivered + r[0] - 1.0e-7).abs() < 1.0e-12);
    }
}

/// Row: a 0-d tensor is one element (the shape itself is the std crate's business).
#[test]
fn zero_dim_tensor_is_one_element() {
    for (name, method) in all_methods() {
        let p = Params::new(method).with_seed(3);
        let frame = encode(&[-0.375], &p).unwrap();
        let h = peek(&frame).unwrap();
        assert_eq!(h.n, 1, "{name}");
        let out = decode(&frame, &p, 1).unwrap();
        assert!(out[0] <= 0.0, "{name}: {out:?}");
        assert!(decode(&frame, &p, 0).is_err() && decode(&frame, &p, 2).is_err());
    }
}

/// Row: a frame made with other parameters than the receiver expects is an error.
#[test]
fn other_parameters_are_an_error() {
    let g = G16;
    let top = |k| {
        Params::new(Method::TopK {
            k: K::Count(k),
            values: Values::F32,
        })
    };
    let frame = encode(&g, &top(4)).unwrap();
    let mut out = [0.0f32; 16];
    assert_eq!(
        decode_into(&frame, &top(5), &mut out).unwrap_err(),
        Error::ParamMismatch { param: Param::K }
    );
    let f16 = Params::new(Method::TopK {
        k: K::Count(4),
        values: Values::F16,
    });
    assert_eq!(
        decode_into(&frame, &f16, &mut out).unwrap_err(),
        Error::ParamMismatch {
            param: Param::Values
        }
    );
    let dense = Params::new(Method::Dense {
        values: Values::F32,
    });
    assert_eq!(
        decode_into(&frame, &dense, &mut out).unwrap_err(),
        Error::ParamMismatch {
            param: Param::Method
        }
    );
    assert_eq!(
        decode_into(&frame, &top(4), &mut [0.0; 15]).unwrap_err(),
        Error::ElementCount {
            expected: 15,
            got: 16
        }
    );
    assert!(out.iter().all(|&x| x == 0.0), "nothing written on error");
    // A ratio that resolves to the frame's k is the same parameter.
    let ratio = Params::new(Method::TopK {
        k: K::Ratio(0.25),
        values: Values::F32,
    });
    decode_into(&frame, &ratio, &mut out).unwrap();
    // Random-k: seed, step and tensor id must match, since they decide the indices.
    let rk = Params::new(Method::RandomK {
        k: K::Count(4),
        values: Values::F32,
        unbiased: false,
    })
    .with_seed(1)
    .at_step(2)
    .for_tensor(3);
    let frame = encode(&g, &rk).unwrap();
    for (other, param) in [
        (rk.with_seed(9), Param::Seed),
        (rk.at_step(9), Param::Step),
        (rk.for_tensor(9), Param::TensorId),
        (
            Params {
                method: Method::RandomK {
                    k: K::Count(4),
                    values: Values::F32,
                    unbiased: true,
                },
                ..rk
            },
            Param::Unbiased,
        ),
    ] {
        assert_eq!(
            decode_into(&frame, &other, &mut out).unwrap_err(),
            Error::ParamMismatch { param }
        );
    }
    // An invalid expectation is refused as such.
    let bad = Params::new(Method::Quant {
        bits: 9,
        block: 4,
        rounding: Rounding::NearestEven,
    });
    let q = Params::new(Method::Quant {
        bits: 4,
        block: 4,
        rounding: Rounding::NearestEven,
    });
    let frame = encode(&g, &q).unwrap();
    assert_eq!(
        decode_into(&frame, &bad, &mut out).unwrap_err(),
        Error::InvalidParams { param: Param::Bits }
    );
}

/// Row: the mean of W contributions: sum in f32, divide once by W: the mean of [3], [3], [3]
/// is [3].
#[test]
fn mean_of_three_threes_is_three() {
    for method in [
        Method::Dense {
            values: Values::F32,
        },
        Method::Dense {
            values: Values::F16,
        },
        Method::TopK {
            k: K::Count(1),
            values: Values::Bf16,
        },
        Method::Quant {
            bits: 4,
            block: 1,
            rounding: Rounding::NearestEven,
        },
    ] {
        let p = Params::new(method);
        let frame = encode(&[3.0], &p).unwrap();
        let mut acc = [0.0f32];
        for _ in 0..3 {
            accumulate_into(&frame, &p, &mut acc, 1.0).unwrap();
        }
        acc[0] /= 3.0;
        assert_eq!(acc, [3.0], "{method:?}");
    }
    // Accumulating adds, it never overwrites (a sparse frame leaves other entries alone).
    let p = Params::new(Method::TopK {
        k: K::Count(1),
        values: Values::F32,
    });
    let frame = encode(&[0.0, 2.0, 1.0], &p).unwrap();
    let mut acc = [10.0f32, 10.0, 10.0];
    accumulate_into(&frame, &p, &mut acc, 0.5).unwrap();
    assert_eq!(acc, [10.0, 11.0, 10.0]);
}

/// Error feedback refuses the two methods whose residual would grow without bound.
#[test]
fn feedback_refuses_unbiased_randomk_and_unscaled_sign() {
    let mut r = [0.0f32; 4];
    let p = Params::new(Method::RandomK {
        k: K::Count(1),
        values: Values::F32,
        unbiased: true,
    });
    assert_eq!(
        feedback(&[1.0; 4], &mut r, &p).unwrap_err(),
        Error::InvalidParams {
            param: Param::Unbiased
        }
    );
    let p = Params::new(Method::Sign {
        scale: SignScale::None,
        zero_mask: false,
    });
    assert_eq!(
        feedback(&[1.0; 4], &mut r, &p).unwrap_err(),
        Error::InvalidParams {
            param: Param::SignScale
        }
    );
    assert_eq!(r, [0.0; 4]);
    let p = Params::new(Method::Dense {
        values: Values::F32,
    });
    assert_eq!(
        feedback(&[1.0; 4], &mut [0.0; 3], &p).unwrap_err(),
        Error::LengthMismatch {
            expected: 4,
            got: 3
        }
    );
}

/// Not a row of the table, but the rule behind "scales finite": a block whose |g| sum overflows
/// f32 (elements near f32::MAX) still gets a finite mean-|g| scale, so the encoder never writes a
/// frame its decoder refuses, and error feedback never fails after touching the residual.
#[test]
fn sign_scale_of_huge_values_stays_finite() {
    let p = Params::new(Method::Sign {
        scale: SignScale::MeanAbs { block: 4 },
        zero_mask: false,
    });
    for g in [
        vec![f32::MAX; 8],
        vec![
            f32::MAX,
            -f32::MAX,
            1.0,
            -1.0e38,
            3.0e38,
            3.0e38,
            3.0e38,
            0.0,
        ],
        vec![-f32::MAX; 37],
    ] {
        let frame = encode(&g, &p).unwrap();
        let out = decode(&frame, &p, g.len()).unwrap();
        assert!(out.iter().all(|x| x.is_finite()));
        if g.iter().all(|&x| x == g[0]) {
            assert!(
                out.iter().all(|&x| x == g[0]),
                "a constant block decodes to itself"
            );
        }
        let mut r = vec![0.0f32; g.len()];
        feedback(&g, &mut r, &p).unwrap();
    }
    let g = [f32::MAX, f32::MAX, 1.0, -1.0e38];
    let out = decode(&encode(&g, &p).unwrap(), &p, 4).unwrap();
    // mean |g| = (2 MAX + 1e38) / 4, computed without overflowing.
    let mean = ((2.0 * f32::MAX as f64) + 1.0e38) / 4.0;
    assert!(
        (out[0] as f64 - mean).abs() < mean * 1.0e-6,
        "{} vs {mean}",
        out[0]
    );
    assert_eq!(out[3], -out[0]);
}

/// Unbiased random-k multiplies every value by n/k when decoding: a kept value whose product
/// overflows f32 is refused by the encoder ([`Error::ValueOutOfRange`], naming the element, no
/// valid frame left in `out`) and by the decoder ([`Error::BadValue`]), never decoded to ±inf.
#[test]
fn unbiased_randomk_never_decodes_to_infinity() {
    let n = 1000usize;
    for values in [
        Values::F32,
        Values::F16,
        Values::Bf16,
        Values::Int8 { block: 2 },
    ] {
        let p = Params {
            seed: 7,
            step: 3,
            tensor_id: 1,
            ..Params::new(Method::RandomK {
                k: K::Count(4),
                values,
                unbiased: true,
            })
        };
        let kept = randomk_oracle(n as u64, 4, 7, 3, 1);
        // Small values (n/k = 250 times them stays finite): encodes and decodes.
        let small = vec![60.0f32; n];
        let frame = encode(&small, &p).unwrap();
        let out = decode(&frame, &p, n).unwrap();
        assert!(out.iter().all(|x| x.is_finite()), "{values:?}");
        assert_eq!(out[kept[0] as usize], 60.0 * 250.0, "{values:?}");
        if matches!(values, Values::F16) {
            continue; // f16 values (<= 65504) times 250 cannot overflow f32.
        }

        // One kept element of 1e37: 250 * 1e37 overflows. The error names it.
        let mut big = small.clone();
        big[kept[2] as usize] = 1.0e37;
        let mut out = vec![0u8; max_frame_len(n, &p.method)];
        let mut scratch = vec![0u32; scratch_len(n, &p.method)];
        assert_eq!(
            encode_into(&big, &p, &mut scratch, &mut out),
            Err(Error::ValueOutOfRange {
                index: kept[2] as usize
            }),
            "{values:?}"
        );
        assert!(
            peek(&out).is_err() || decode(&out, &p, n).is_err(),
            "{values:?}: out must hold no valid frame"
        );
        // The same element outside the kept set is not sent: no error.
        let mut unkept = small.clone();
        let other = (0..n).find(|i| !kept.contains(&(*i as u64))).unwrap();
        unkept[other] = 1.0e37;
        assert!(encode(&unkept, &p).is_ok(), "{values:?}");

        // A hostile frame: a value patched to 1e37 behind a valid checksum.
        let mut frame = encode(&small, &p).unwrap();
        let value_bytes = match values {
            Values::F32 => 1.0e37f32.to_le_bytes().to_vec(),
            Values::Bf16 => half::bf16::from_f32(1.0e37).to_le_bytes().to_vec(),
            // int8: the first block's scale (its codes are 127 for 60.0).
            _ => 1.0e37f32.to_le_bytes().to_vec(),
        };
        let vals_at = frame.len() - 4 - Values::section_len(values, 4);
        frame[vals_at..vals_at + value_bytes.len()].copy_from_slice(&value_bytes);
        fix_crc(&mut frame);
        // The error points at the first value that overflows: for int8 its code byte (after
        // the two block scales), which the patched scale of its block makes overflow.
        let want = match values {
            Values::Int8 { .. } => vals_at + 8,
            _ => vals_at,
        };
        assert_eq!(
            decode(&frame, &p, n),
            Err(Error::BadValue { offset: want }),
            "{values:?}"
        );
        let mut acc = vec![0.0f32; n];
        assert!(
            matches!(
                accumulate_into(&frame, &p, &mut acc, 1.0),
                Err(Error::BadValue { .. })
            ),
            "{values:?}"
        );
        assert!(acc.iter().all(|&x| x == 0.0), "{values:?}: acc untouched");
    }
}

#[test]
fn invalid_parameters_say_what_is_valid() {
    let quant = |bits, block| Method::Quant {
        bits,
        block,
        rounding: Rounding::NearestEven,
    };
    let message = |m: Method| m.validate().unwrap_err().to_string();
    assert_eq!(
        message(quant(9, 512)),
        "invalid parameter: bits (quantization takes 2..=8 bits)"
    );
    assert!(message(quant(1, 512)).contains("2..=8"));
    assert!(message(quant(4, 0)).contains("at least 1 element"));
    let g = [1.0f32, 2.0];
    let mut r = [0.0f32; 2];
    let unbiased = Params::new(Method::RandomK {
        k: K::Count(1),
        values: Values::F32,
        unbiased: true,
    });
    let err = feedback(&g, &mut r, &unbiased).unwrap_err().to_string();
    assert!(err.contains("cannot run with error feedback"), "{err}");
    // Under error feedback a NaN may be gradient + residual: the message says so.
    let mut r = [f32::MAX, 0.0];
    let topk = Params::new(Method::TopK {
        k: K::Count(1),
        values: Values::F32,
    });
    let err = feedback(&[f32::MAX, 0.0], &mut r, &topk).unwrap_err();
    assert_eq!(err, Error::NonFinite { index: 0 });
    assert!(err.to_string().contains("gradient + residual"), "{err}");
    assert!(
        err.to_string().starts_with("NaN or infinity at index 0"),
        "{err}"
    );
}

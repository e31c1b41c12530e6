//! Decoders treat every byte as hostile. Over every golden frame: every truncated prefix is an
//! error (truncated, or incomplete when the checksum fails); every single-byte change is an
//! error (checksum, or incomplete when it enlarges a declared length) and, with the CRC
//! recomputed, an error
//! or a decode without panic that leaves the output untouched on error; a decode against other
//! expected parameters (each parameter changed in turn) is an error.

mod common;

use common::{Golden, fix_crc, golden, testdata};
use gradwire_core::{
    Error, K, Method, Params, Rounding, SignScale, Values, accumulate_into, decode_into, peek,
    validate,
};

fn frames() -> Vec<(Golden, Vec<u8>)> {
    golden()
        .into_iter()
        .map(|c| {
            let p = testdata().join("golden").join(format!("{}.gwf", c.name));
            let f = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (c, f)
        })
        .collect()
}

/// The golden case called `name` and its frame.
fn frame_named(name: &str) -> (Golden, Vec<u8>) {
    frames().into_iter().find(|(c, _)| c.name == name).unwrap()
}

const SENTINEL: u32 = 0x7fc0_beef;

/// Decodes `frame` and checks the decoder's promises: no panic (the caller would see it); on
/// error the output is untouched; on success every element is written and decode_into agrees
/// with accumulate_into into zeros; validate gives decode_into's result without writing.
fn decode_checked(frame: &[u8], p: &Params, n: usize) -> Result<Vec<f32>, Error> {
    let _ = peek(frame);
    let mut out = vec![f32::from_bits(SENTINEL); n];
    let res = decode_into(frame, p, &mut out);
    assert_eq!(validate(frame, p, n), res, "validate and decode disagree");
    let mut acc = vec![0.0f32; n];
    let acc_res = accumulate_into(frame, p, &mut acc, 1.0);
    assert_eq!(
        res.is_ok(),
        acc_res.is_ok(),
        "decode and accumulate disagree: {res:?} {acc_res:?}"
    );
    match res {
        Err(e) => {
            assert!(
                out.iter().all(|x| x.to_bits() == SENTINEL),
                "output written on error {e:?}"
            );
            assert!(
                acc.iter().all(|&x| x.to_bits() == 0),
                "accumulator changed on error {e:?}"
            );
            Err(e)
        }
        Ok(info) => {
            assert_eq!(info.n, n as u64);
            assert!(
                out.iter().all(|x| x.to_bits() != SENTINEL),
                "an element was not written"
            );
            for (a, b) in out.iter().zip(&acc) {
                assert!(
                    a == b || (a.is_nan() && b.is_nan()),
                    "decode {a} != accumulate {b}"
                );
            }
            Ok(out)
        }
    }
}

#[test]
fn every_truncated_prefix_is_an_error() {
    for (case, frame) in frames() {
        let n = case.grad.len();
        decode_checked(&frame, &case.params, n).unwrap();
        for len in 0..frame.len() {
            let e = decode_checked(&frame[..len], &case.params, n);
            assert!(e.is_err(), "{}: prefix of {len} bytes decoded", case.name);
            // A frame cut short is named as such, not as a checksum mismatch: truncated below the
            // fixed header and trailer, incomplete (header read, checksum failed) beyond.
            let e = peek(&frame[..len]);
            let named = match e {
                Err(Error::Truncated { got, .. }) => len < 20 && got == len,
                Err(Error::Incomplete { declared, got }) => declared > len && got == len,
                _ => false,
            };
            assert!(named, "{}: prefix of {len} bytes: {e:?}", case.name);
        }
        // Extra bytes after a valid frame (checksum recomputed) are an error too.
        let mut longer = frame.clone();
        longer.insert(frame.len() - 4, 0);
        fix_crc(&mut longer);
        assert!(
            decode_checked(&longer, &case.params, n).is_err(),
            "{}: trailing byte",
            case.name
        );
    }
}

#[test]
fn every_single_byte_change_is_an_error() {
    for (case, frame) in frames() {
        let n = case.grad.len();
        for at in 0..frame.len() {
            let mut f = frame.clone();
            for v in 0..=255u8 {
                if v == frame[at] {
                    continue;
                }
                f[at] = v;
                assert!(
                    decode_checked(&f, &case.params, n).is_err(),
                    "{}: byte {at} = {v:#04x}",
                    case.name
                );
            }
        }
    }
}

/// With the CRC recomputed, every single-byte change (all 255 other values at every offset)
/// must be an error or decode without panic. Values that decode must be finite except where a
/// frame's own parameters can make them overflow (unbiased random-k scales values by n/k).
#[test]
fn every_single_byte_change_with_a_valid_crc_is_safe() {
    let mut decoded = 0usize;
    let mut refused = 0usize;
    for (case, frame) in frames() {
        let n = case.grad.len();
        let body = frame.len() - 4;
        for at in 0..body {
            let mut f = frame.clone();
            for v in 0..=255u8 {
                if v == frame[at] {
                    continue;
                }
                f[at] = v;
                fix_crc(&mut f);
                match decode_checked(&f, &case.params, n) {
                    Ok(out) => {
                        decoded += 1;
                        let unbiased =
                            matches!(case.params.method, Method::RandomK { unbiased: true, .. });
                        assert!(
                            unbiased || out.iter().all(|x| x.is_finite()),
                            "{}: byte {at} = {v:#04x} decoded a non-finite value",
                            case.name
                        );
                    }
                    Err(_) => refused += 1,
                }
                // The header alone must never panic either, whatever the expectation.
                let _ = peek(&f);
            }
        }
    }
    assert!(
        decoded > 0 && refused > 0,
        "decoded {decoded}, refused {refused}"
    );
}

/// `validate` makes decode_into's checks (a NaN value with a valid CRC included) and writes
/// nothing: a regression for peers checked before the local state changes.
#[test]
fn validate_checks_the_body_as_decode_does() {
    let (case, frame) = frame_named("dense_f32");
    let n = case.grad.len();
    let info = validate(&frame, &case.params, n).unwrap();
    assert_eq!(info.n, n as u64);
    let mut bad = frame.clone();
    bad[17..21].copy_from_slice(&f32::NAN.to_le_bytes());
    fix_crc(&mut bad);
    // The header alone passes: only the body is wrong.
    assert!(peek(&bad).is_ok());
    let e = validate(&bad, &case.params, n).unwrap_err();
    assert_eq!(e, Error::BadValue { offset: 17 });
    let mut out = vec![f32::from_bits(SENTINEL); n];
    assert_eq!(decode_into(&bad, &case.params, &mut out).unwrap_err(), e);
    assert!(out.iter().all(|x| x.to_bits() == SENTINEL));
    assert_eq!(
        validate(&frame, &case.params, n + 1).unwrap_err(),
        decode_into(&frame, &case.params, &mut vec![0.0; n + 1]).unwrap_err()
    );
}

/// Each parameter of the frame's method changed in turn, and the element count.
fn mutations(p: &Params, n: usize) -> Vec<(String, Params, usize)> {
    let n64 = n as u64;
    let mut out: Vec<(String, Params, usize)> = vec![
        ("n + 1".into(), *p, n + 1),
        (
            "method".into(),
            Params {
                method: other_method(&p.method),
                ..*p
            },
            n,
        ),
    ];
    if n > 0 {
        out.push(("n - 1".into(), *p, n - 1));
    }
    let with = |m: Method| Params { method: m, ..*p };
    let other_values = |v: Values| -> Vec<Values> {
        let all = [
            Values::F32,
            Values::F16,
            Values::Bf16,
            Values::Int8 { block: 1 },
            Values::Int8 { block: 4 },
            Values::Int8 { block: 5 },
        ];
        all.into_iter().filter(|&w| w != v).collect()
    };
    let other_k = |k: K| -> Option<K> {
        let r = k.resolve(n64);
        if r > 0 {
            Some(K::Count(r - 1))
        } else if n64 > 0 {
            Some(K::Count(1))
        } else {
            None // n = 0: every k resolves to 0, nothing to disagree on
        }
    };
    match p.method {
        Method::Dense { values } => {
            for v in other_values(values) {
                if !matches!(v, Values::Int8 { .. }) {
                    out.push((
                        format!("values {v:?}"),
                        with(Method::Dense { values: v }),
                        n,
                    ));
                }
            }
        }
        Method::TopK { k, values } => {
            for v in other_values(values) {
                out.push((
                    format!("values {v:?}"),
                    with(Method::TopK { k, values: v }),
                    n,
                ));
            }
            if let Some(k) = other_k(k) {
                out.push(("k".into(), with(Method::TopK { k, values }), n));
            }
        }
        Method::Threshold { threshold, values } => {
            for v in other_values(values) {
                out.push((
                    format!("values {v:?}"),
                    with(Method::Threshold {
                        threshold,
                        values: v,
                    }),
                    n,
                ));
            }
            let t = f32::from_bits(threshold.to_bits() + 1);
            out.push((
                "threshold".into(),
                with(Method::Threshold {
                    threshold: t,
                    values,
                }),
                n,
            ));
        }
        Method::RandomK {
            k,
            values,
            unbiased,
        } => {
            for v in other_values(values) {
                out.push((
                    format!("values {v:?}"),
                    with(Method::RandomK {
                        k,
                        values: v,
                        unbiased,
                    }),
                    n,
                ));
            }
            if let Some(k) = other_k(k) {
                out.push((
                    "k".into(),
                    with(Method::RandomK {
                        k,
                        values,
                        unbiased,
                    }),
                    n,
                ));
            }
            out.push((
                "unbiased".into(),
                with(Method::RandomK {
                    k,
                    values,
                    unbiased: !unbiased,
                }),
                n,
            ));
            out.push(("seed".into(), p.with_seed(p.seed ^ 1), n));
            out.push(("step".into(), p.at_step(p.step + 1), n));
            out.push((
                "tensor id".into(),
                p.for_tensor(p.tensor_id.wrapping_add(1)),
                n,
            ));
        }
        Method::Quant {
            bits,
            block,
            rounding,
        } => {
            for b in (2..=8).filter(|&b| b != bits) {
                out.push((
                    format!("bits {b}"),
                    with(Method::Quant {
                        bits: b,
                        block,
                        rounding,
                    }),
                    n,
                ));
            }
            out.push((
                "block".into(),
                with(Method::Quant {
                    bits,
                    block: block + 1,
                    rounding,
                }),
                n,
            ));
            let r = match rounding {
                Rounding::NearestEven => Rounding::Stochastic,
                Rounding::Stochastic => Rounding::NearestEven,
            };
            out.push((
                "rounding".into(),
                with(Method::Quant {
                    bits,
                    block,
                    rounding: r,
                }),
                n,
            ));
        }
        Method::Sign { scale, zero_mask } => {
            let others = match scale {
                SignScale::MeanAbs { block } => {
                    vec![SignScale::None, SignScale::MeanAbs { block: block + 1 }]
                }
                SignScale::None => vec![SignScale::MeanAbs { block: 5 }],
            };
            for s in others {
                out.push((
                    format!("scale {s:?}"),
                    with(Method::Sign {
                        scale: s,
                        zero_mask,
                    }),
                    n,
                ));
            }
            out.push((
                "zero mask".into(),
                with(Method::Sign {
                    scale,
                    zero_mask: !zero_mask,
                }),
                n,
            ));
        }
    }
    out
}

fn other_method(m: &Method) -> Method {
    match m {
        Method::Dense { .. } => Method::TopK {
            k: K::Ratio(1.0),
            values: Values::F32,
        },
        _ => Method::Dense {
            values: Values::F32,
        },
    }
}

#[test]
fn every_changed_parameter_is_an_error() {
    for (case, frame) in frames() {
        let n = case.grad.len();
        for (what, p, len) in mutations(&case.params, n) {
            let e = decode_checked(&frame, &p, len);
            assert!(e.is_err(), "{}: decoded against another {what}", case.name);
        }
    }
}

/// Other method ids, flags, reserved bytes and versions in a valid-CRC frame are refused.
#[test]
fn reserved_values_are_refused() {
    let (case, frame) = frame_named("topk_delta_f32");
    let n = case.grad.len();
    for (at, v, want) in [
        (4usize, 0u8, Error::UnsupportedVersion { version: 0 }),
        (4, 2, Error::UnsupportedVersion { version: 2 }),
        (5, 6, Error::Malformed { offset: 5 }),
        (5, 255, Error::Malformed { offset: 5 }),
        (6, 1, Error::Malformed { offset: 6 }),
        (7, 1, Error::Malformed { offset: 7 }),
        (16, 4, Error::Malformed { offset: 16 }),
        (25, 3, Error::Malformed { offset: 25 }),
    ] {
        let mut f = frame.clone();
        f[at] = v;
        fix_crc(&mut f);
        assert_eq!(
            decode_checked(&f, &case.params, n).unwrap_err(),
            want,
            "byte {at} = {v}"
        );
    }
    let mut f = frame.clone();
    f[0] = b'X';
    fix_crc(&mut f);
    assert_eq!(peek(&f).unwrap_err(), Error::BadMagic);
}

/// A top-k frame with f32 values assembled by hand from FORMAT.md, with any index section.
fn topk_frame(n: u64, codec: u8, count: u64, index: &[u8], vals: &[f32]) -> Vec<u8> {
    let mut f = b"GWRF".to_vec();
    f.extend_from_slice(&[1, 1, 0, 0]);
    f.extend_from_slice(&n.to_le_bytes());
    f.push(0); // f32 values
    f.extend_from_slice(&count.to_le_bytes());
    f.push(codec);
    f.extend_from_slice(index);
    for v in vals {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f.extend_from_slice(&[0; 4]);
    fix_crc(&mut f);
    f
}

fn bad_index(f: &[u8], n: usize, count: u64) -> bool {
    let p = Params::new(Method::TopK {
        k: K::Count(count),
        values: Values::F32,
    });
    matches!(decode_checked(f, &p, n), Err(Error::BadIndex { .. }))
}

/// Every index rule of FORMAT.md section 8, each on its own.
#[test]
fn each_index_rule_is_enforced() {
    let p2 = Params::new(Method::TopK {
        k: K::Count(2),
        values: Values::F32,
    });
    // Any codec is accepted, chosen or not: indices 3 and 5 of n = 13 in all three.
    for (codec, index) in [
        (0u8, vec![0b0010_1000, 0]),
        (1, vec![3, 0b001_011]),
        (2, vec![3, 5]),
    ] {
        let f = topk_frame(13, codec, 2, &index, &[1.5, -2.0]);
        let out = decode_checked(&f, &p2, 13).unwrap();
        assert_eq!((out[3], out[5]), (1.5, -2.0), "codec {codec}");
    }
    // Raw: not ascending, repeated, out of range.
    for index in [[5u8, 3], [3, 3], [3, 13]] {
        assert!(
            bad_index(&topk_frame(13, 2, 2, &index, &[1.0, 2.0]), 13, 2),
            "raw {index:?}"
        );
    }
    // Bitmap: a third bit set for count 2, a bit past n, one bit for count 2.
    for index in [
        [0b0010_1001u8, 0],
        [0b0010_1000, 0b0010_0000],
        [0b0000_1000, 0],
    ] {
        assert!(
            bad_index(&topk_frame(13, 0, 2, &index, &[1.0, 2.0]), 13, 2),
            "bitmap {index:?}"
        );
    }
    // Delta: width above 64, non-zero padding, a gap past n.
    for index in [vec![65u8, 0, 0], vec![3, 0b1100_1011], vec![3, 0b0011_1111]] {
        assert!(
            bad_index(&topk_frame(13, 1, 2, &index, &[1.0, 2.0]), 13, 2),
            "delta {index:?}"
        );
    }
    // A byte more than the blocks need shifts the values section: the frame is refused.
    let f = topk_frame(13, 1, 2, &[3, 0b001_011, 0], &[1.0, 2.0]);
    assert!(decode_checked(&f, &p2, 13).is_err());
    // Non-minimal delta widths are accepted: w = 8 for gaps 3 and 1.
    let f = topk_frame(13, 1, 2, &[8, 3, 1], &[1.0, 2.0]);
    assert_eq!(decode_checked(&f, &p2, 13).unwrap()[5], 2.0);
}

/// Every value rule of FORMAT.md section 8, each on its own, on golden frames with the CRC
/// recomputed: the decoder names a bad value, and writes nothing.
#[test]
fn each_value_rule_is_enforced() {
    let all = frames();
    let get = |name: &str| all.iter().find(|(c, _)| c.name == name).unwrap().clone();
    let bad_value = |name: &str, at: usize, bytes: &[u8]| {
        let (case, mut f) = get(name);
        f[at..at + bytes.len()].copy_from_slice(bytes);
        fix_crc(&mut f);
        let e = decode_checked(&f, &case.params, case.grad.len());
        assert!(
            matches!(e, Err(Error::BadValue { .. })),
            "{name} @{at} {bytes:02x?}: {e:?}"
        );
    };
    let nan = f32::NAN.to_le_bytes();
    let inf = f32::INFINITY.to_le_bytes();
    let neg = (-1.0f32).to_le_bytes();
    // Plain values (dense values start at 17).
    bad_value("dense_f32", 17, &nan);
    bad_value("dense_f32", 21, &inf);
    bad_value("dense_f16", 19, &[0x00, 0x7c]);
    bad_value("dense_f16", 17, &[0x01, 0xfe]);
    bad_value("dense_bf16", 17, &[0xc0, 0x7f]);
    // int8: scales at 32 (after vspec 5, count 8, codec 1, delta index 2), codes at 40.
    bad_value("topk_delta_int8", 32, &neg);
    bad_value("topk_delta_int8", 36, &nan);
    bad_value("topk_delta_int8", 40, &[0x80]);
    // Quantization: scales at 22; 2-bit codes above 2l = 2; 4-bit codes above 14.
    bad_value("quant2_nearest", 22, &inf);
    bad_value("quant2_nearest", 26, &neg);
    bad_value("quant2_nearest", 34, &[0xff]);
    bad_value("quant4_nearest", 34, &[0x0f]);
    bad_value("quant8_nearest", 34, &[0xff]);
    // Sign: scales at 21.
    bad_value("sign_scaled", 21, &nan);
    bad_value("sign_scaled", 25, &neg);
    // Padding bits past n: quantization (3 bits x 13 = 39 bits) and sign (13 bits).
    let g = &common::G16[..13];
    for method in [
        Method::Quant {
            bits: 3,
            block: 4,
            rounding: Rounding::NearestEven,
        },
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 13 },
            zero_mask: false,
        },
    ] {
        let p = Params::new(method);
        let mut f = common::encode(g, &p).unwrap();
        let last = f.len() - 5;
        f[last] |= 0x80;
        fix_crc(&mut f);
        assert!(
            matches!(decode_checked(&f, &p, 13), Err(Error::BadValue { .. })),
            "{method:?}"
        );
    }
    // Threshold parameter: negative or NaN is malformed.
    let (case, frame) = get("threshold_f32");
    for t in [-1.0f32, f32::NAN, f32::INFINITY] {
        let mut f = frame.clone();
        f[17..21].copy_from_slice(&t.to_le_bytes());
        fix_crc(&mut f);
        assert_eq!(
            decode_checked(&f, &case.params, 16).unwrap_err(),
            Error::Malformed { offset: 17 }
        );
    }
}

/// The index decoders that document "never panics" on an unchecked section keep that promise
/// for delta width bytes over 64 (the bit reader refuses such a width instead of shifting by
/// it, which overflow checks would stop on), and for full blocks whose bytes run short.
#[test]
fn index_decoders_take_any_width_byte() {
    use gradwire_core::index;
    for w in [0u8, 1, 31, 32, 33, 64, 65, 200, 255] {
        for len in [0usize, 1, 4 * 31, 4 * 32, 300] {
            let mut section = vec![0xffu8; 1 + len];
            section[0] = w;
            for count in [1u64, 32, 33] {
                index::for_each_batch(index::DELTA, 1 << 40, count, &section, |b| {
                    assert!(b.len() <= index::BATCH);
                });
                let full = index::for_each_index(index::DELTA, 1 << 40, count, &section, |_| {});
                // validate gives the full decode's verdict on any section
                assert_eq!(
                    index::validate(index::DELTA, 1 << 40, count, &section).is_ok(),
                    full.is_ok(),
                    "width {w}, {len} bytes, count {count}"
                );
            }
        }
    }
}

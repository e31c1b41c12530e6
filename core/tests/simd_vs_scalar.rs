//! Every fast (SIMD) kernel against the scalar specification, byte for byte: lengths 0..=515,
//! every alignment (offset 0..8 into a larger buffer), floats from arbitrary bits, bit widths
//! and block sizes at their extremes. Runs in the default build and with
//! `RUSTFLAGS="-C target-cpu=native"`.

use gradwire_core::scalar::{self, Selection};
use gradwire_core::{
    K, Method, Params, SignScale, Values, accumulate_into, decode_into, encode_into,
    encode_selected_into, feedback_step, max_frame_len, quant, scratch_len, select, sign, values,
};
use quickcheck::{Arbitrary, Gen, QuickCheck, TestResult};

/// A slice at an arbitrary offset of a larger buffer, of finite floats from arbitrary bits
/// (with ties, zeros and -0.0 mixed in).
#[derive(Clone, Debug)]
struct Input {
    buf: Vec<f32>,
    off: usize,
    len: usize,
    k: usize,
    pick: u32,
}

impl Input {
    fn x(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
}

fn finite_from_bits(b: u32) -> f32 {
    let x = f32::from_bits(b);
    if x.is_finite() {
        x
    } else {
        // Clear the lowest exponent bit: finite, still huge.
        f32::from_bits(b & !0x0080_0000)
    }
}

impl Arbitrary for Input {
    fn arbitrary(g: &mut Gen) -> Self {
        let len = usize::from(u16::arbitrary(g)) % 516;
        let off = usize::from(u8::arbitrary(g)) % 8;
        let style = u8::arbitrary(g) % 4;
        let buf: Vec<f32> = (0..len + off + 8)
            .map(|_| {
                let b = u32::arbitrary(g);
                match style {
                    0 => finite_from_bits(b),
                    // Moderate magnitudes, many ties.
                    1 => [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 1e-40][(b % 8) as usize],
                    // Normal-ish values of every sign.
                    2 => (b as i32 as f32) * 1e-9,
                    _ => {
                        if b % 3 == 0 {
                            0.0
                        } else {
                            finite_from_bits(b)
                        }
                    }
                }
            })
            .collect();
        let k = if len == 0 {
            0
        } else {
            usize::from(u16::arbitrary(g)) % (len + 2)
        };
        Input {
            buf,
            off,
            len,
            k,
            pick: u32::arbitrary(g),
        }
    }
}

fn qc(f: fn(Input) -> TestResult) {
    QuickCheck::new().tests(300).quickcheck(f);
}

fn scalar_topk(x: &[f32], k: usize) -> Vec<(u32, u32)> {
    let mut hist = vec![0u32; scalar::TOPK_HIST];
    let sel = if k == 0 {
        Selection::None
    } else if k >= x.len() {
        Selection::All
    } else {
        Selection::TopK(scalar::topk_cut(x, k, &mut hist))
    };
    let mut v = Vec::new();
    scalar::for_each_kept(x, sel, |i| v.push((i as u32, x[i].to_bits())));
    v
}

fn pairs(kept: select::Kept<'_>) -> Vec<(u32, u32)> {
    kept.idx
        .iter()
        .copied()
        .zip(kept.bits.iter().copied())
        .collect()
}

#[test]
fn topk_kept_matches_scalar_for_every_sample_size() {
    fn prop(inp: Input) -> TestResult {
        let x = inp.x();
        let n = x.len();
        let want = scalar_topk(x, inp.k);
        for sample in [0, 1, n / 16, n / 2, n] {
            if sample > n {
                continue;
            }
            let mut scratch = vec![0u32; select::kept_scratch_len_with(n, inp.k, sample)];
            let got = select::topk_kept_with(x, inp.k, f32::INFINITY, sample, &mut scratch);
            if pairs(got.unwrap()) != want {
                return TestResult::error(format!("sample {sample}"));
            }
        }
        let mut scratch = vec![0u32; select::kept_scratch_len(n, inp.k)];
        let got = select::topk_kept(x, inp.k, f32::INFINITY, &mut scratch).unwrap();
        TestResult::from_bool(pairs(got) == want)
    }
    qc(prop);
}

#[test]
fn topk_kept_sampled_on_a_large_tensor() {
    // Past SAMPLED_MIN, with heavy ties and a skewed layout (large values in one region).
    let n = select::SAMPLED_MIN + 1234;
    let x: Vec<f32> = (0..n)
        .map(|i| {
            let h = gradwire_core::rng::mix64(i as u64);
            let v = ((h >> 40) as f32) * 1e-6 * if h & 1 == 0 { 1.0 } else { -1.0 };
            if i > n - 5000 {
                v * 1000.0
            } else {
                (v * 64.0).round() / 64.0
            }
        })
        .collect();
    for k in [1, 7, 100, 655, 6000, n / 3, n - 1, n] {
        let mut scratch = vec![0u32; select::kept_scratch_len(n, k)];
        let got = select::topk_kept(&x, k, f32::INFINITY, &mut scratch).unwrap();
        assert_eq!(pairs(got), scalar_topk(&x, k), "k = {k}");
    }
}

#[test]
fn topk_kept_reports_values_beyond_the_limit() {
    let mut x = vec![1.0f32; 300];
    x[200] = 70_000.0;
    let lim = values::magnitude_limit(Some(Values::F16));
    let mut scratch = vec![0u32; select::kept_scratch_len(300, 3)];
    assert!(select::topk_kept(&x, 3, lim, &mut scratch).is_err());
    x[200] = f32::NAN;
    assert!(select::topk_kept(&x, 3, f32::INFINITY, &mut scratch).is_err());
}

/// One out-of-limit element anywhere (first or last vector, the tail, below or above the
/// selection's threshold) makes every selection an error, whatever k, sample and limit.
#[test]
fn every_selection_reports_one_element_beyond_the_limit() {
    let n = 70_003;
    let base: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618).sin() * (1.0 + (i % 97) as f32))
        .collect();
    let f16 = values::magnitude_limit(Some(Values::F16));
    for pos in [0, 5, 31, 32, 40_000, n - 35, n - 3, n - 1] {
        for (bad, lim) in [
            (f32::NAN, f32::INFINITY),
            (f32::NEG_INFINITY, f32::INFINITY),
            (f32::NAN, f16),
            (70_000.0, f16),
            (-65_520.0, f16),
        ] {
            let mut x = base.clone();
            x[pos] = bad;
            for k in [0, 1, 700, n] {
                for sample in [0, select::sample_len(n)] {
                    let len = select::kept_scratch_len_with(n, k, sample);
                    let mut scratch = vec![0u32; len];
                    let got = select::topk_kept_with(&x, k, lim, sample, &mut scratch);
                    assert!(got.is_err(), "pos {pos}, bad {bad}, k {k}, sample {sample}");
                }
            }
            for t in [0.0, 1.0, 1e30] {
                let mut scratch = vec![0u32; select::threshold_scratch_len(n)];
                let got = select::threshold_kept(&x, t, lim, &mut scratch);
                assert!(got.is_err(), "pos {pos}, bad {bad}, t {t}");
            }
        }
    }
    // Just below the f16 limit is fine, and selected exactly.
    let mut x = base.clone();
    x[n - 1] = -65_519.0;
    for k in [0, 1, 700, n] {
        let mut scratch = vec![0u32; select::kept_scratch_len(n, k)];
        let got = select::topk_kept(&x, k, f16, &mut scratch).unwrap();
        assert_eq!(pairs(got), scalar_topk(&x, k), "k = {k}");
    }
}

#[test]
fn threshold_kept_matches_scalar() {
    fn prop(inp: Input) -> TestResult {
        let x = inp.x();
        let t = if x.is_empty() {
            0.0
        } else {
            x[inp.pick as usize % x.len()].abs()
        };
        for t in [t, 0.0, -0.0, f32::MAX] {
            let mut want = Vec::new();
            scalar::for_each_kept(x, Selection::Threshold(t), |i| {
                want.push((i as u32, x[i].to_bits()))
            });
            let mut scratch = vec![0u32; select::threshold_scratch_len(x.len())];
            match select::threshold_kept(x, t, f32::INFINITY, &mut scratch).unwrap() {
                Some(k) => {
                    if pairs(k) != want {
                        return TestResult::failed();
                    }
                }
                None => {
                    if want.len() <= select::threshold_capacity(x.len()) {
                        return TestResult::failed();
                    }
                }
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

#[test]
fn sign_encode_matches_scalar() {
    fn prop(inp: Input) -> TestResult {
        let x = inp.x();
        let n = x.len();
        for block in [
            None,
            Some(1),
            Some(3),
            Some(8),
            Some(16),
            Some(24),
            Some(1024),
        ] {
            let s_len = sign::scales_len(n, block);
            let mut a = (vec![0xa5u8; s_len], vec![0x5au8; sign::bits_len(n)]);
            let mut b = (vec![0x11u8; s_len], vec![0x22u8; sign::bits_len(n)]);
            sign::encode(x, block, &mut a.0, &mut a.1);
            scalar::sign_encode(x, block, &mut b.0, &mut b.1);
            if a != b {
                return TestResult::error(format!("block {block:?}"));
            }
            // Decoding, overwriting and adding.
            let mut want = vec![0.0f32; n];
            sign::decode(n, block, &b.0, &b.1, |i, v| want[i] = v);
            let mut got = vec![7.0f32; n];
            sign::decode_slice(block, &a.0, &a.1, &mut got, None);
            if bits(&got) != bits(&want) {
                return TestResult::error(format!("decode block {block:?}"));
            }
            let mut want_acc = x.to_vec();
            sign::decode(n, block, &b.0, &b.1, |i, v| want_acc[i] += -0.5 * v);
            let mut got_acc = x.to_vec();
            sign::decode_slice(block, &a.0, &a.1, &mut got_acc, Some(-0.5));
            if bits(&got_acc) != bits(&want_acc) {
                return TestResult::error(format!("accumulate block {block:?}"));
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn quant_encode_and_decode_match_scalar() {
    fn prop(inp: Input) -> TestResult {
        let x = inp.x();
        let n = x.len();
        for bits_ in 2..=8u8 {
            for block in [1usize, 7, 8, 16, 24, 40, 96, 512] {
                let s_len = quant::scales_len(n, block);
                let c_len = quant::codes_len(n, bits_);
                let mut a = (vec![0xa5u8; s_len], vec![0x5au8; c_len]);
                let mut b = (vec![0x11u8; s_len], vec![0x22u8; c_len]);
                quant::encode(x, bits_, block, None, &mut a.0, &mut a.1);
                scalar::quant_encode(x, bits_, block, None, &mut b.0, &mut b.1);
                if a != b {
                    return TestResult::error(format!("bits {bits_} block {block}"));
                }
                if quant::validate_fast(n, bits_, &a.0, &a.1)
                    != quant::validate(n, bits_, &b.0, &b.1)
                {
                    return TestResult::error(format!("validate bits {bits_} block {block}"));
                }
                let mut want = vec![0.0f32; n];
                quant::decode(n, bits_, block, &b.0, &b.1, |i, v| want[i] = v);
                let mut got = vec![3.0f32; n];
                quant::decode_slice(bits_, block, &a.0, &a.1, &mut got, None);
                if super_bits(&got) != super_bits(&want) {
                    return TestResult::error(format!("decode bits {bits_} block {block}"));
                }
                let mut want_acc = x.to_vec();
                quant::decode(n, bits_, block, &b.0, &b.1, |i, v| want_acc[i] += 2.0 * v);
                let mut got_acc = x.to_vec();
                quant::decode_slice(bits_, block, &a.0, &a.1, &mut got_acc, Some(2.0));
                if super_bits(&got_acc) != super_bits(&want_acc) {
                    return TestResult::error(format!("accumulate bits {bits_} block {block}"));
                }
            }
        }
        TestResult::passed()
    }
    fn super_bits(x: &[f32]) -> Vec<u32> {
        bits(x)
    }
    qc(prop);
}

#[test]
fn quant_validate_fast_finds_the_same_bad_code() {
    for bits_ in [4u8, 8] {
        for n in [1usize, 2, 7, 8, 9, 33] {
            let c_len = quant::codes_len(n, bits_);
            let scales = 1.0f32.to_le_bytes();
            for pos in 0..c_len {
                for byte in [0xffu8, 0xf0, 0x0f, 0x10, 0x00] {
                    let mut codes = vec![0u8; c_len];
                    codes[pos] = byte;
                    assert_eq!(
                        quant::validate_fast(n, bits_, &scales, &codes),
                        quant::validate(n, bits_, &scales, &codes),
                        "bits {bits_} n {n} pos {pos} byte {byte:#x}"
                    );
                }
            }
        }
    }
}

/// A value of the input clamped into the range of `v` (f16: |x| < 65520).
fn in_range(v: Values, x: f32) -> f32 {
    let lim = values::magnitude_limit(Some(v));
    if x.abs() < lim {
        x
    } else {
        x.signum() * 65504.0
    }
}

#[test]
fn finite_values_beyond_f16_and_bf16_saturate_alike_on_every_path() {
    // Error feedback sends a sum beyond the value type as its largest finite value: the SIMD
    // cast, the scalar writer and `saturate` then `half` agree at and around each boundary.
    let edges = |top: f32, first_inf: f32| {
        let below = f32::from_bits(first_inf.to_bits() - 1);
        let mid = top + (first_inf - top) * 0.5;
        let mut v = vec![top, mid, below, first_inf, 1.0e10, 3.0e38, f32::MAX, 1.0];
        v.extend(v.clone().iter().map(|x| -x));
        v
    };
    for (v, top, first_inf) in [
        (Values::F16, 65504.0f32, 65520.0f32),
        (
            Values::Bf16,
            f32::from_bits(0x7f7f_0000),
            f32::from_bits(0x7f7f_8000),
        ),
    ] {
        let x = edges(top, first_inf);
        let mut got = vec![0u8; 2 * x.len()];
        values::encode_plain(v, &x, &mut got);
        for (j, &a) in x.iter().enumerate() {
            let mut one = [0u8; 2];
            values::write_plain(v, a, &mut one);
            assert_eq!(got[2 * j..2 * j + 2], one, "{v:?} {a}");
            let back = values::read_plain(v, &one).expect("finite");
            let want = if a.abs() >= first_inf {
                top.copysign(a)
            } else {
                values::read_plain(v, &{
                    let mut w = [0u8; 2];
                    values::write_plain(v, values::saturate(v, a), &mut w);
                    w
                })
                .unwrap()
            };
            assert_eq!(back, want, "{v:?} {a}");
            assert!(back.abs() <= top, "{v:?} {a}");
        }
    }
}

#[test]
fn f16_and_bf16_casts_match_half() {
    fn prop(inp: Input) -> TestResult {
        for v in [Values::F16, Values::Bf16, Values::F32] {
            // Every finite value: beyond f16 or bf16 both paths saturate alike.
            let x: Vec<f32> = inp
                .x()
                .iter()
                .map(|&a| if a.is_finite() { a } else { 1.0 })
                .collect();
            let vb = v.value_bytes();
            let mut got = vec![0xeeu8; x.len() * vb + 3];
            let mut want = vec![0xeeu8; x.len() * vb + 3];
            values::encode_plain(v, &x, &mut got);
            for (j, &a) in x.iter().enumerate() {
                values::write_plain(v, a, &mut want[j * vb..]);
            }
            if got != want {
                return TestResult::error(format!("encode {v:?}"));
            }
            // Decode back, overwriting and adding.
            let bytes = &got[..x.len() * vb];
            if values::first_bad_plain(v, bytes).is_some() {
                return TestResult::error("finite values reported bad");
            }
            let want_dec: Vec<f32> = bytes
                .chunks_exact(vb)
                .map(|c| values::read_plain(v, c).unwrap())
                .collect();
            let mut dec = vec![1.0f32; x.len()];
            values::decode_plain(v, bytes, &mut dec, None);
            if bits(&dec) != bits(&want_dec) {
                return TestResult::error(format!("decode {v:?}"));
            }
            let mut acc = x.clone();
            values::decode_plain(v, bytes, &mut acc, Some(-1.0));
            let want_acc: Vec<f32> = x.iter().zip(&want_dec).map(|(a, d)| a + -1.0 * d).collect();
            if bits(&acc) != bits(&want_acc) {
                return TestResult::error(format!("accumulate {v:?}"));
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

#[test]
fn f16_and_bf16_casts_match_half_over_a_sweep_of_all_bit_patterns() {
    let mut x = Vec::new();
    let mut b = 0u64;
    while b <= u64::from(u32::MAX) {
        let v = f32::from_bits(b as u32);
        x.push(v);
        b += 4093;
    }
    // Every boundary of interest, and its neighbours.
    for c in [
        0x3880_0000u32,
        0x3300_0000,
        0x3380_0000,
        0x477f_e000,
        0x477f_efff,
        0x477f_f000,
        0x7f7f_7fff,
        0x7f7f_8000,
        0x0000_0001,
        0x0080_0000,
    ] {
        for d in 0..=8 {
            x.push(f32::from_bits(c.wrapping_sub(4).wrapping_add(d)));
        }
    }
    for v in [Values::F16, Values::Bf16] {
        let lim = values::magnitude_limit(Some(v));
        for &a in &x {
            if a.is_finite() {
                assert_eq!(a.abs() < lim, values::fits(v, a), "limit of {v:?} at {a:e}");
            }
        }
        let ok: Vec<f32> = x.iter().copied().filter(|a| a.abs() < lim).collect();
        let vb = v.value_bytes();
        let mut got = vec![0u8; ok.len() * vb];
        values::encode_plain(v, &ok, &mut got);
        let mut want = vec![0u8; ok.len() * vb];
        for (j, &a) in ok.iter().enumerate() {
            values::write_plain(v, a, &mut want[j * vb..]);
        }
        assert_eq!(got, want, "{v:?}");
    }
    // Every f16 bit pattern decodes as half does.
    let all: Vec<u8> = (0..=u16::MAX)
        .filter(|h| h & 0x7c00 != 0x7c00)
        .flat_map(|h| h.to_le_bytes())
        .collect();
    let mut dec = vec![0.0f32; all.len() / 2];
    values::decode_plain(Values::F16, &all, &mut dec, None);
    for (j, c) in all.chunks_exact(2).enumerate() {
        let want = values::read_plain(Values::F16, c).unwrap();
        assert_eq!(dec[j].to_bits(), want.to_bits());
    }
}

#[test]
fn first_non_finite_matches_scalar() {
    fn prop(inp: Input) -> TestResult {
        let mut x = inp.x().to_vec();
        if !x.is_empty() {
            let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][inp.pick as usize % 3];
            let at = inp.pick as usize % x.len();
            if !inp.pick.is_multiple_of(5) {
                x[at] = bad;
            }
        }
        TestResult::from_bool(values::first_non_finite(&x) == scalar::first_non_finite(&x))
    }
    qc(prop);
}

/// The first index with `!(|x| < limit)`, by definition.
fn first_at_or_above_by_definition(x: &[f32], limit: f32) -> Option<usize> {
    x.iter()
        .position(|v| v.abs().partial_cmp(&limit) != Some(std::cmp::Ordering::Less))
}

#[test]
fn limit_checks_are_exact_where_the_sums_reach_the_limit() {
    // Runs of large elements, each below the limit, whose sums pass it (or overflow): the
    // check's fast path (sums of |x|) cannot decide them and its element-by-element path must.
    for limit in [65_520.0f32, f32::from_bits(0x7f00_0000), f32::INFINITY] {
        let big = if limit.is_finite() {
            limit * 0.9
        } else {
            f32::MAX
        };
        for n in [7, 1000, 1024, 3001] {
            let mut x: Vec<f32> = (0..n)
                .map(|i| if i % 3 == 0 { -big } else { big })
                .collect();
            assert_eq!(
                values::first_at_or_above(&x, limit),
                None,
                "n {n} limit {limit}"
            );
            for at in [0, n / 2, n - 1] {
                for bad in [limit, -limit, f32::NAN] {
                    let keep = x[at];
                    x[at] = bad;
                    let want = first_at_or_above_by_definition(&x, limit);
                    assert_eq!(want, Some(at));
                    assert_eq!(
                        values::first_at_or_above(&x, limit),
                        want,
                        "n {n} limit {limit} at {at} value {bad}"
                    );
                    x[at] = keep;
                }
            }
        }
    }
}

fn frame(x: &[f32], p: &Params) -> Result<Vec<u8>, gradwire_core::Error> {
    let mut out = vec![0u8; max_frame_len(x.len(), &p.method)];
    let mut scratch = vec![0u32; scratch_len(x.len(), &p.method)];
    let len = encode_into(x, p, &mut scratch, &mut out)?;
    out.truncate(len);
    Ok(out)
}

fn value_kinds() -> [Values; 5] {
    [
        Values::F32,
        Values::F16,
        Values::Bf16,
        Values::Int8 { block: 1 },
        Values::Int8 { block: 32 },
    ]
}

#[test]
fn topk_frames_equal_frames_of_scalar_selections() {
    fn prop(inp: Input) -> TestResult {
        let x: Vec<f32> = inp.x().iter().map(|&a| in_range(Values::F16, a)).collect();
        let n = x.len();
        for v in value_kinds() {
            let p = Params::new(Method::TopK {
                k: K::Count(inp.k as u64),
                values: v,
            });
            let got = frame(&x, &p).unwrap();
            let kept: Vec<u32> = scalar_topk(&x, inp.k).iter().map(|&(i, _)| i).collect();
            let q = Method::TopK {
                k: K::Count(kept.len() as u64),
                values: v,
            };
            let mut want = vec![0u8; max_frame_len(n, &q)];
            let mut scratch = vec![0u32; scratch_len(n, &q)];
            let len = encode_selected_into(&x, &kept, v, &mut scratch, &mut want).unwrap();
            if got != want[..len] {
                return TestResult::error(format!("{v:?}"));
            }
            // Decoding and accumulating against the element-wise definition.
            let mut dec = vec![5.0f32; n];
            decode_into(&got, &p, &mut dec).unwrap();
            let mut acc = x.clone();
            accumulate_into(&got, &p, &mut acc, -1.0).unwrap();
            let want_acc: Vec<f32> = x.iter().zip(&dec).map(|(a, d)| a + -1.0 * d).collect();
            if bits(&acc) != bits(&want_acc) {
                return TestResult::error(format!("accumulate {v:?}"));
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

#[test]
fn threshold_frames_keep_what_the_scalar_rule_keeps() {
    fn prop(inp: Input) -> TestResult {
        let x = inp.x();
        let n = x.len();
        let t = if n == 0 {
            0.0
        } else {
            x[inp.pick as usize % n].abs()
        };
        let p = Params::new(Method::Threshold {
            threshold: t,
            values: Values::F32,
        });
        let got = frame(x, &p).unwrap();
        let mut dec = vec![1.0f32; n];
        decode_into(&got, &p, &mut dec).unwrap();
        let mut want = vec![0.0f32; n];
        scalar::for_each_kept(x, Selection::Threshold(t), |i| want[i] = x[i]);
        TestResult::from_bool(bits(&dec) == bits(&want))
    }
    qc(prop);
}

#[test]
fn feedback_step_equals_its_definition() {
    fn prop(inp: Input) -> TestResult {
        let g: Vec<f32> = inp
            .x()
            .iter()
            .map(|&a| in_range(Values::F16, a) * 1e-3)
            .collect();
        let n = g.len();
        let r0: Vec<f32> = (0..n).map(|i| (i as f32 - 100.0) * 1e-3).collect();
        let methods = [
            Method::TopK {
                k: K::Count(inp.k as u64),
                values: Values::Int8 { block: 16 },
            },
            Method::TopK {
                k: K::Ratio(0.1),
                values: Values::F16,
            },
            Method::Threshold {
                threshold: 0.05,
                values: Values::F32,
            },
            Method::Quant {
                bits: 4,
                block: 64,
                rounding: gradwire_core::Rounding::NearestEven,
            },
            Method::Sign {
                scale: SignScale::MeanAbs { block: 32 },
                zero_mask: false,
            },
        ];
        for m in methods {
            let p = Params::new(m);
            let mut r = r0.clone();
            let mut out = vec![0u8; max_frame_len(n, &m)];
            let mut scratch = vec![0u32; scratch_len(n, &m)];
            let len = feedback_step(&g, &mut r, &p, &mut scratch, &mut out).unwrap();
            // The definition: x = g + r; frame of x; r = x - decoded.
            let mut x: Vec<f32> = g.iter().zip(&r0).map(|(a, b)| a + b).collect();
            let want = frame(&x, &p).unwrap();
            accumulate_into(&want, &p, &mut x, -1.0).unwrap();
            if out[..len] != want[..] || bits(&r) != bits(&x) {
                return TestResult::error(format!("{m:?}"));
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

#[test]
fn feedback_step_leaves_the_residual_untouched_on_error() {
    let g = vec![1.0f32; 300];
    let mut r = vec![0.5f32; 300];
    r[250] = f32::MAX;
    g.iter().for_each(|_| ());
    let mut g2 = g.clone();
    g2[250] = f32::MAX;
    let m = Method::TopK {
        k: K::Count(3),
        values: Values::F32,
    };
    let p = Params::new(m);
    let mut out = vec![0u8; max_frame_len(300, &m)];
    let mut scratch = vec![0u32; scratch_len(300, &m)];
    let before = r.clone();
    let e = feedback_step(&g2, &mut r, &p, &mut scratch, &mut out).unwrap_err();
    assert_eq!(e, gradwire_core::Error::NonFinite { index: 250 });
    assert_eq!(bits(&r), bits(&before));
}

/// The input with a NaN or an infinity written at a position `pick` chooses (or none).
fn with_bad(inp: &Input) -> Vec<f32> {
    let mut x = inp.x().to_vec();
    if !x.is_empty() && !inp.pick.is_multiple_of(4) {
        let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][inp.pick as usize % 3];
        let at = (inp.pick as usize / 4) % x.len();
        x[at] = bad;
    }
    x
}

#[test]
fn try_encode_checks_and_matches_scalar() {
    fn prop(inp: Input) -> TestResult {
        let x = with_bad(&inp);
        let n = x.len();
        let bad = scalar::first_non_finite(&x).is_some();
        for bits_ in [8u8, 4, 3] {
            for block in [7usize, 8, 16, 24, 512] {
                let s_len = quant::scales_len(n, block);
                let c_len = quant::codes_len(n, bits_);
                let mut a = (vec![0xa5u8; s_len], vec![0x5au8; c_len]);
                let got = quant::try_encode(&x, bits_, block, None, &mut a.0, &mut a.1);
                if got.is_err() != bad {
                    return TestResult::error(format!("quant bits {bits_} block {block}"));
                }
                if !bad {
                    let mut b = (vec![0x11u8; s_len], vec![0x22u8; c_len]);
                    scalar::quant_encode(&x, bits_, block, None, &mut b.0, &mut b.1);
                    if a != b {
                        return TestResult::error(format!("quant bytes {bits_} {block}"));
                    }
                }
            }
        }
        for block in [None, Some(3), Some(8), Some(16), Some(1024)] {
            let mut a = (
                vec![0xa5u8; sign::scales_len(n, block)],
                vec![0x5au8; sign::bits_len(n)],
            );
            let got = sign::try_encode(&x, block, &mut a.0, &mut a.1);
            if got.is_err() != bad {
                return TestResult::error(format!("sign block {block:?}"));
            }
            if !bad {
                let mut b = (
                    vec![0x11u8; sign::scales_len(n, block)],
                    vec![0x22u8; sign::bits_len(n)],
                );
                scalar::sign_encode(&x, block, &mut b.0, &mut b.1);
                if a != b {
                    return TestResult::error(format!("sign bytes {block:?}"));
                }
            }
        }
        for v in [Values::F32, Values::F16, Values::Bf16] {
            let lim = values::magnitude_limit(Some(v));
            let mut out = vec![0u8; n * v.value_bytes()];
            let got = values::try_encode_plain(v, &x, &mut out);
            if got.is_err() != values::first_at_or_above(&x, lim).is_some() {
                return TestResult::error(format!("plain {v:?}"));
            }
            if got.is_ok() {
                let mut want = vec![0u8; n * v.value_bytes()];
                values::encode_plain(v, &x, &mut want);
                if out != want {
                    return TestResult::error(format!("plain bytes {v:?}"));
                }
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

/// Methods whose encoders check their input inside the kernels (and every SIMD path of
/// quantization: blocks of 16 run pipelined, blocks of 8 and 24 do not).
fn fused_methods() -> Vec<Method> {
    let mut m = vec![
        Method::TopK {
            k: K::Count(5),
            values: Values::Int8 { block: 4 },
        },
        Method::TopK {
            k: K::Count(3),
            values: Values::F16,
        },
        Method::Threshold {
            threshold: 0.5,
            values: Values::Bf16,
        },
        Method::Dense {
            values: Values::F16,
        },
        Method::Dense {
            values: Values::F32,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 8 },
            zero_mask: false,
        },
        // Four blocks side by side from 64 elements on.
        Method::Sign {
            scale: SignScale::MeanAbs { block: 16 },
            zero_mask: false,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 1024 },
            zero_mask: false,
        },
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        },
    ];
    for bits in [8u8, 4] {
        for block in [8u32, 16, 24, 512] {
            m.push(Method::Quant {
                bits,
                block,
                rounding: gradwire_core::Rounding::NearestEven,
            });
        }
    }
    m
}

/// What a check before encoding reports: the first NaN/Inf, else the first value beyond the
/// value type's range.
fn expected_error(x: &[f32], m: &Method) -> Option<gradwire_core::Error> {
    if let Some(index) = scalar::first_non_finite(x) {
        return Some(gradwire_core::Error::NonFinite { index });
    }
    let v = m.values()?;
    values::first_out_of_range(v, x).map(|index| gradwire_core::Error::ValueOutOfRange { index })
}

#[test]
fn fused_checks_name_the_first_bad_element() {
    fn prop(inp: Input) -> TestResult {
        let mut x = with_bad(&inp);
        let n = x.len();
        // Sometimes also a value beyond f16 range (before or after the bad one).
        if n > 0 && inp.k.is_multiple_of(3) {
            x[inp.k % n] = 70_000.0;
        }
        for m in fused_methods() {
            let p = Params::new(m);
            let got = frame(&x, &p).err();
            if got != expected_error(&x, &m) {
                return TestResult::error(format!("{m:?}: {got:?}"));
            }
            if got.is_none() {
                // The same frame as encoding a copy (the fused path is deterministic).
                if frame(&x, &p).unwrap() != frame(&x.clone(), &p).unwrap() {
                    return TestResult::failed();
                }
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

#[test]
fn fused_feedback_steps_equal_their_definition() {
    fn prop(inp: Input) -> TestResult {
        // Moderate values, and sometimes huge ones whose sign-block sums overflow in f32 (the
        // overflow-safe scale then comes from the sum source).
        let huge = inp.pick.is_multiple_of(3);
        let g: Vec<f32> = inp
            .x()
            .iter()
            .map(|&a| {
                let a = in_range(Values::F16, a);
                if huge { a.signum() * 1.0e38 } else { a * 1e-3 }
            })
            .collect();
        let n = g.len();
        let r0: Vec<f32> = (0..n)
            .map(|i| {
                if huge {
                    ((i % 5) as f32 - 2.0) * 1.0e37
                } else {
                    (i as f32 - 100.0) * 1e-3
                }
            })
            .collect();
        for m in fused_methods() {
            if matches!(
                m,
                Method::Sign {
                    scale: SignScale::None,
                    zero_mask: false,
                }
            ) || (huge && m.values() == Some(Values::F16))
                || (huge && matches!(m, Method::Dense { .. }))
            {
                continue;
            }
            let p = Params::new(m);
            let mut r = r0.clone();
            let mut out = vec![0u8; max_frame_len(n, &m)];
            let mut scratch = vec![0u32; scratch_len(n, &m)];
            let len = match feedback_step(&g, &mut r, &p, &mut scratch, &mut out) {
                Ok(len) => len,
                Err(e) => return TestResult::error(format!("{m:?}: {e:?}")),
            };
            let mut x: Vec<f32> = g.iter().zip(&r0).map(|(a, b)| a + b).collect();
            let want = frame(&x, &p).unwrap();
            accumulate_into(&want, &p, &mut x, -1.0).unwrap();
            if out[..len] != want[..] {
                return TestResult::error(format!("frame {m:?}"));
            }
            if bits(&r) != bits(&x) {
                return TestResult::error(format!("residual {m:?}"));
            }
        }
        TestResult::passed()
    }
    qc(prop);
}

#[test]
fn fused_feedback_steps_leave_the_residual_untouched_on_error() {
    for m in fused_methods() {
        if matches!(
            m,
            Method::Sign {
                scale: SignScale::None,
                zero_mask: false,
            }
        ) {
            continue;
        }
        let p = Params::new(m);
        let n = 3000;
        for (bad_at, in_sum) in [(2900usize, false), (1500, true), (7, false)] {
            let mut g: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.25).collect();
            let mut r: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.125).collect();
            if in_sum {
                // Both finite, their sum is not.
                g[bad_at] = f32::MAX;
                r[bad_at] = f32::MAX;
            } else {
                g[bad_at] = f32::NAN;
            }
            let before = r.clone();
            let mut out = vec![0u8; max_frame_len(n, &m)];
            let mut scratch = vec![0u32; scratch_len(n, &m)];
            let e = feedback_step(&g, &mut r, &p, &mut scratch, &mut out).unwrap_err();
            assert_eq!(
                e,
                gradwire_core::Error::NonFinite { index: bad_at },
                "{m:?}"
            );
            assert_eq!(bits(&r), bits(&before), "{m:?}: residual changed");
        }
    }
}

#[test]
fn quant_reciprocal_overflow_matches_scalar_on_every_path() {
    // Blocks whose absmax is subnormal enough that l / m overflows: the kernel divides instead.
    let tiny = [1u32, 2, 3, 7, 0x0000_0400, 0x0010_0000, 0x0080_0000];
    for len in [16usize, 17, 48, 64, 100] {
        let x: Vec<f32> = (0..len)
            .map(|i| {
                let v = f32::from_bits(tiny[i % tiny.len()]);
                if i % 3 == 1 { -v } else { v }
            })
            .collect();
        for bits_ in [8u8, 4] {
            for block in [8usize, 16, 32] {
                let s_len = quant::scales_len(len, block);
                let c_len = quant::codes_len(len, bits_);
                let mut a = (vec![0u8; s_len], vec![0u8; c_len]);
                let mut b = (vec![1u8; s_len], vec![1u8; c_len]);
                quant::encode(&x, bits_, block, None, &mut a.0, &mut a.1);
                scalar::quant_encode(&x, bits_, block, None, &mut b.0, &mut b.1);
                assert_eq!(a, b, "len {len} bits {bits_} block {block}");
            }
        }
    }
}

#[test]
fn kept_frames_with_wide_gaps_equal_the_generic_path() {
    // A few entries far apart: delta gaps of up to 22 bits, blocks of mixed widths.
    let n = (1usize << 22) + 77;
    let mut g = vec![0.0f32; n];
    let mut pos: Vec<usize> = (0..70u64)
        .map(|j| (gradwire_core::rng::mix64(j) % n as u64) as usize)
        .collect();
    pos.extend([0, 1, 2, 40, n - 1]);
    pos.sort_unstable();
    pos.dedup();
    for (j, &i) in pos.iter().enumerate() {
        g[i] = (j as f32 - 30.0) * 0.37 + 0.01;
    }
    let kept: Vec<u32> = pos.iter().map(|&i| i as u32).collect();
    for v in value_kinds() {
        for m in [
            Method::TopK {
                k: K::Count(kept.len() as u64),
                values: v,
            },
            Method::Threshold {
                threshold: 0.0,
                values: v,
            },
        ] {
            let got = frame(&g, &Params::new(m)).unwrap();
            if m == (Method::TopK {
                k: K::Count(kept.len() as u64),
                values: Values::F32,
            }) {
                assert_eq!(got[16 + 1 + 8], gradwire_core::index::DELTA, "delta codec");
            }
            let q = Method::TopK {
                k: K::Count(kept.len() as u64),
                values: v,
            };
            let mut want = vec![0u8; max_frame_len(n, &q)];
            let mut scratch = vec![0u32; scratch_len(n, &q)];
            let len = encode_selected_into(&g, &kept, v, &mut scratch, &mut want).unwrap();
            // Threshold frames differ in the method id and the threshold field only.
            let (a, b) = if matches!(m, Method::Threshold { .. }) {
                let vs = if matches!(v, Values::Int8 { .. }) {
                    5
                } else {
                    1
                };
                (&got[16 + vs + 4..got.len() - 4], &want[16 + vs..len - 4])
            } else {
                (&got[..], &want[..len])
            };
            assert_eq!(a, b, "{m:?}");
        }
    }
}

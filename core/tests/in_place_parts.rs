//! The kernels of an error-feedback step run in place on the parts of a shard (the two-phase
//! collective's worker and owner): the top-k of `g + r` stored into `r`, a segmented frame
//! written from kept entries alone, and the check of the sums before anything changes.

use gradwire_core::feedback::first_bad_sum;
use gradwire_core::select::{
    Kept, kept_scratch_len, topk_kept, topk_kept_sum_from, topk_kept_sum_into,
};
use gradwire_core::{
    Error, Values, encode_kept_segmented_into, encode_segmented_into, kept_segmented_scratch_len,
    segmented_frame_len, segmented_scratch_len,
};

/// A seeded heavy-tailed vector (xorshift; no two runs differ).
fn vec_of(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            scale * u * u * u * 8.0
        })
        .collect()
}

#[test]
fn topk_of_the_sums_in_place_is_topk_of_the_sums() {
    for &(n, k) in &[
        (0usize, 0usize),
        (1, 1),
        (7, 0),
        (7, 3),
        (7, 7),
        (7, 9),
        (5000, 50),
        (70_000, 700),
        (70_000, 1),
        (70_000, 69_999),
    ] {
        let g = vec_of(n as u64 + 1, n, 1.0);
        let r0 = vec_of(n as u64 + 2, n, 0.5);
        let sums: Vec<f32> = g.iter().zip(&r0).map(|(a, b)| a + b).collect();
        let mut s1 = vec![0u32; kept_scratch_len(n, k)];
        let want = topk_kept(&sums, k, f32::INFINITY, &mut s1).unwrap();
        let (want_idx, want_bits) = (want.idx.to_vec(), want.bits.to_vec());
        let mut r = r0.clone();
        let mut s2 = vec![0u32; kept_scratch_len(n, k)];
        let got = topk_kept_sum_into(&g, &mut r, k, f32::INFINITY, &mut s2).unwrap();
        assert_eq!(got.idx, &want_idx[..], "n {n} k {k}");
        assert_eq!(got.bits, &want_bits[..], "n {n} k {k}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&r), bits(&sums), "the residual holds the sums");
        // From a residual kept apart: the same entries, the sums written over other values,
        // the old residual untouched.
        let mut into = vec![f32::NAN; n];
        let mut s3 = vec![7u32; kept_scratch_len(n, k)];
        let got = topk_kept_sum_from(&g, &r0, &mut into, k, f32::INFINITY, &mut s3).unwrap();
        assert_eq!(got.idx, &want_idx[..], "from: n {n} k {k}");
        assert_eq!(got.bits, &want_bits[..], "from: n {n} k {k}");
        assert_eq!(bits(&into), bits(&sums), "from: the sums");
        assert_eq!(
            bits(&r0),
            bits(&vec_of(n as u64 + 2, n, 0.5)),
            "from: old unread"
        );
    }
}

#[test]
fn topk_of_the_sums_from_a_residual_apart_fails_as_in_place() {
    // A sum at or beyond the limit, or NaN, on the sampled path and on the short one: the same
    // error, and the sums stored either way.
    for &(n, k, at) in &[
        (70_000usize, 700usize, 69_997usize),
        (70_000, 700, 3),
        (40, 4, 39),
    ] {
        for bad in [f32::NAN, 3.0e38] {
            let mut g = vec_of(n as u64 + 5, n, 1.0);
            g[at] = bad;
            let r0 = vec_of(n as u64 + 6, n, 0.5);
            let limit = 1.0e30;
            let mut r = r0.clone();
            let mut s1 = vec![0u32; kept_scratch_len(n, k)];
            let want = topk_kept_sum_into(&g, &mut r, k, limit, &mut s1).map(|_| ());
            let mut into = vec![0.0f32; n];
            let mut s2 = vec![0u32; kept_scratch_len(n, k)];
            let got = topk_kept_sum_from(&g, &r0, &mut into, k, limit, &mut s2).map(|_| ());
            assert!(want.is_err(), "n {n} at {at}");
            assert_eq!(got, want, "n {n} at {at}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&into), bits(&r), "n {n} at {at}");
        }
    }
}

#[test]
fn a_segmented_frame_from_kept_entries_is_the_one_from_the_input() {
    let n = 3000;
    let g = vec_of(9, n, 2.0);
    // Three parts of the input with their own kept indices, one segment each.
    let kept: Vec<u32> = (0..n as u32)
        .filter(|i| (i % 37 == 0 && *i < 1000) || (i % 11 == 3 && *i >= 1400))
        .collect();
    let first = kept.iter().filter(|&&i| i < 1000).count() as u32;
    let second = kept.iter().filter(|&&i| (1000..2000).contains(&i)).count() as u32;
    let segs = [first, second, kept.len() as u32 - first - second, 0];
    let bits: Vec<u32> = kept.iter().map(|&i| g[i as usize].to_bits()).collect();
    for values in [
        Values::F32,
        Values::F16,
        Values::Bf16,
        Values::Int8 { block: 64 },
        Values::Int8 { block: 1 },
    ] {
        let k = kept.len();
        let mut scratch = vec![0u32; segmented_scratch_len(n, k, values, segs.len())];
        let mut want = vec![0u8; segmented_frame_len(n, k, values, segs.len())];
        let len = encode_segmented_into(&g, &kept, &segs, values, &mut scratch, &mut want).unwrap();
        want.truncate(len);
        // Into zeros, and over a buffer that holds other bytes (the two-phase collective
        // writes its frames over the previous step's message): every byte is written.
        for fill in [0u8, 0xa5, 0xff] {
            let mut scratch = vec![fill as u32; kept_segmented_scratch_len(k, values, segs.len())];
            let mut got = vec![fill; segmented_frame_len(n, k, values, segs.len())];
            let entries = Kept {
                idx: &kept,
                bits: &bits,
            };
            let len = encode_kept_segmented_into(n, entries, &segs, values, &mut scratch, &mut got)
                .unwrap();
            assert_eq!(&got[..len], &want[..], "{values:?}, buffers of {fill:#x}");
        }
    }
}

#[test]
fn a_frame_from_kept_entries_refuses_bad_entries() {
    let values = Values::F16;
    let mut out = vec![0u8; segmented_frame_len(10, 2, values, 1)];
    let frame = |idx: &[u32], bits: &[u32], segs: &[u32], out: &mut [u8]| {
        encode_kept_segmented_into(10, Kept { idx, bits }, segs, values, &mut [], out)
    };
    let one = 1.0f32.to_bits();
    assert!(matches!(
        frame(&[3, 2], &[one, one], &[2], &mut out),
        Err(Error::UnsortedIndices { position: 1 })
    ));
    assert!(matches!(
        frame(&[3, 10], &[one, one], &[2], &mut out),
        Err(Error::UnsortedIndices { position: 1 })
    ));
    assert!(matches!(
        frame(&[3, 4], &[one, f32::NAN.to_bits()], &[2], &mut out),
        Err(Error::NonFinite { index: 4 })
    ));
    assert!(matches!(
        frame(&[3, 4], &[one, 70_000f32.to_bits()], &[2], &mut out),
        Err(Error::ValueOutOfRange { index: 4 })
    ));
    assert!(matches!(
        frame(&[3, 4], &[one], &[2], &mut out),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        frame(&[3, 4], &[one, one], &[1], &mut out),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        frame(&[3, 4], &[one, one], &[2], &mut out[..10]),
        Err(Error::BufferTooSmall { .. })
    ));
}

#[test]
fn the_sums_are_checked_before_anything_changes() {
    let g = vec![1.0f32, 2.0, 3.0, 60_000.0, f32::MAX];
    let r = vec![0.0f32, 0.0, 0.0, 10_000.0, f32::MAX];
    assert!(first_bad_sum(&g[..3], &r[..3]).is_none());
    // NaN or infinity, over the whole tensor; a finite sum beyond f16 (70,000) is not bad: an
    // error-feedback step sends it saturated.
    assert!(matches!(
        first_bad_sum(&g, &r),
        Some(Error::NonFinite { index: 4 })
    ));
    assert!(first_bad_sum(&g[..4], &r[..4]).is_none());
    assert!(matches!(
        first_bad_sum(&g[..4], &r[..3]),
        Some(Error::LengthMismatch {
            expected: 4,
            got: 3
        })
    ));
    let long = vec![0.5f32; 10_000];
    let mut bad = vec![0.25f32; 10_000];
    bad[9_999] = f32::NEG_INFINITY;
    assert!(matches!(
        first_bad_sum(&long, &bad),
        Some(Error::NonFinite { index: 9_999 })
    ));
}

#[test]
fn a_frame_decoded_chunk_by_chunk_is_decoded_whole() {
    use gradwire_core::frame::chunk::Sections;
    use gradwire_core::{
        Method, Params, Rounding, SignScale, decode_into, encode_into, max_frame_len, scratch_len,
    };
    let mut x = vec_of(4, 10_000, 1.0);
    // Zeros, negative zeros and a block of them: decoded values of either sign of zero.
    for v in &mut x[100..300] {
        *v = -0.0;
    }
    x[5] = 0.0;
    for method in [
        Method::Quant {
            bits: 4,
            block: 64,
            rounding: Rounding::Stochastic,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 128 },
            zero_mask: false,
        },
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        },
        Method::Dense {
            values: Values::F16,
        },
    ] {
        let params = Params::new(method).with_seed(3).at_step(2).for_tensor(9);
        let mut frame = vec![0u8; max_frame_len(x.len(), &method)];
        let mut scratch = vec![0u32; scratch_len(x.len(), &method)];
        let len = encode_into(&x, &params, &mut scratch, &mut frame).unwrap();
        let frame = &frame[..len];
        let mut whole = vec![7.0f32; x.len()];
        decode_into(frame, &params, &mut whole).unwrap();
        let sections = Sections::of(x.len(), &method).unwrap();
        let chunk = 3 * sections.align();
        let mut pieces = vec![7.0f32; x.len()];
        for start in (0..x.len()).step_by(chunk) {
            let end = (start + chunk).min(x.len());
            sections
                .decode(frame, start, &mut pieces[start..end])
                .unwrap();
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&pieces), bits(&whole), "{method:?}");
        // A chunk off the boundaries is refused (dense frames have a boundary at every
        // element).
        if sections.align() > 1 {
            assert!(sections.decode(frame, 1, &mut pieces[1..10]).is_err());
        }
    }
}

#[test]
fn a_residual_bound_is_the_largest_magnitude_or_unknown() {
    use gradwire_core::ResidualBound;
    for n in [0usize, 1, 7, 8, 31, 32, 33, 100, 1000, 4099] {
        let x = vec_of(n as u64 + 17, n, 3.0);
        let want = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(
            ResidualBound::of(&x).max_abs().to_bits(),
            want.to_bits(),
            "n {n}"
        );
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, n / 2, n.saturating_sub(1)] {
                if n == 0 {
                    continue;
                }
                let mut y = x.clone();
                y[at] = bad;
                assert_eq!(
                    ResidualBound::of(&y),
                    ResidualBound::UNKNOWN,
                    "n {n} at {at}"
                );
            }
        }
    }
}

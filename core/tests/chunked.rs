//! Chunked selection (`select::topk_floor`, `select::candidates`, `select::topk_of_candidates`)
//! and the frame writer from a kept list (`encode_kept_into`) against `encode_into` and the
//! error-feedback step: the same frames byte for byte, whatever the chunk boundaries.

mod common;

use common::{Data, Floats, encode, qc};
use gradwire_core::select::{self, Kept};
use gradwire_core::{
    Error, K, Method, Param, Params, Values, encode_into, encode_kept_into, encode_selected_into,
    feedback_step, max_frame_len, peek, scratch_len, values,
};

/// Chunk boundaries of `n` elements cut at positions drawn from `data` (some empty chunks).
fn cuts(n: usize, pieces: usize, data: &mut Data) -> Vec<usize> {
    let mut c: Vec<usize> = (0..pieces)
        .map(|_| data.below(n as u64 + 1) as usize)
        .collect();
    c.push(0);
    c.push(n);
    c.sort_unstable();
    c
}

/// Every chunk's candidates with `|x| >= floor`, concatenated in order (lists grown and the
/// chunk scanned again when they were too short, as a caller does).
fn chunked_candidates(
    g: &[f32],
    r: Option<&[f32]>,
    bounds: &[usize],
    floor: f32,
    limit: f32,
) -> Result<(Vec<u32>, Vec<u32>), select::OutOfLimit> {
    let (mut idx, mut bits) = (Vec::new(), Vec::new());
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        let mut cap = 3;
        loop {
            let (mut i, mut v) = (vec![0u32; cap], vec![0u32; cap]);
            let count = select::candidates(
                &g[a..b],
                r.map(|r| &r[a..b]),
                a,
                floor,
                limit,
                &mut i,
                &mut v,
            )?;
            if count <= cap {
                idx.extend_from_slice(&i[..count]);
                bits.extend_from_slice(&v[..count]);
                break;
            }
            cap = count;
        }
    }
    Ok((idx, bits))
}

/// The frame of top-k (k resolved for `x`) through the chunked path, with `floor` (the sampled
/// one, or any lower bound of the k-th magnitude); `None` when the candidates are fewer than k.
fn chunked_topk_frame(
    g: &[f32],
    r: Option<&[f32]>,
    bounds: &[usize],
    floor: f32,
    p: &Params,
) -> Option<Vec<u8>> {
    let n = g.len();
    let Method::TopK { k, values } = p.method else {
        unreachable!()
    };
    let k = k.resolve(n as u64) as usize;
    let limit = values::magnitude_limit(Some(values));
    let (mut idx, mut bits) = chunked_candidates(g, r, bounds, floor, limit).ok()?;
    if idx.len() < k {
        return None;
    }
    let mut hist = vec![0u32; select::topk_scratch_len(n)];
    let kept = select::topk_of_candidates(&mut idx, &mut bits, k, &mut hist);
    let mut out = vec![0u8; max_frame_len(n, &p.method)];
    let len = encode_kept_into(n, p, kept, &mut out).unwrap();
    out.truncate(len);
    Some(out)
}

fn value_kinds() -> [Values; 4] {
    [
        Values::F32,
        Values::F16,
        Values::Bf16,
        Values::Int8 { block: 32 },
    ]
}

fn moderate(x: f32) -> f32 {
    if x.abs() > 1000.0 { x.signum() } else { x }
}

#[test]
fn chunked_topk_with_any_lower_floor_equals_encode_into() {
    fn prop(x: Floats, k: u16, pick: u32, seed: u64) -> bool {
        let x: Vec<f32> = x.0.iter().map(|&a| moderate(a)).collect();
        let n = x.len();
        let k = usize::from(k) % (n + 2);
        let mut data = Data(seed);
        let bounds = cuts(n, 1 + (seed % 5) as usize, &mut data);
        for v in value_kinds() {
            let p = Params::new(Method::TopK {
                k: K::Count(k as u64),
                values: v,
            });
            let want = encode(&x, &p).unwrap();
            // Floors at and below the k-th magnitude (a picked element's, or zero).
            let mut mags: Vec<f32> = x.iter().map(|a| a.abs()).collect();
            mags.sort_unstable_by(|a, b| b.total_cmp(a));
            let kth = if k == 0 || n == 0 {
                0.0
            } else {
                mags[(k.min(n)) - 1]
            };
            let picked = if n == 0 { 0.0 } else { mags[pick as usize % n] };
            for floor in [0.0, kth, picked.min(kth)] {
                let got = chunked_topk_frame(&x, None, &bounds, floor, &p);
                if got.as_deref() != Some(&want[..]) {
                    return false;
                }
            }
        }
        true
    }
    qc(300, prop as fn(Floats, u16, u32, u64) -> bool);
}

#[test]
fn chunked_threshold_equals_encode_into() {
    fn prop(x: Floats, pick: u32, seed: u64) -> bool {
        let x: Vec<f32> = x.0.iter().map(|&a| moderate(a)).collect();
        let n = x.len();
        let t = if n == 0 {
            0.0
        } else {
            x[pick as usize % n].abs()
        };
        let mut data = Data(seed);
        let bounds = cuts(n, 1 + (seed % 5) as usize, &mut data);
        for v in value_kinds() {
            let p = Params::new(Method::Threshold {
                threshold: t,
                values: v,
            });
            let want = encode(&x, &p).unwrap();
            let limit = values::magnitude_limit(Some(v));
            let (idx, bits) =
                chunked_candidates(&x, None, &bounds, select::threshold_floor(t), limit).unwrap();
            let mut out = vec![0u8; max_frame_len(n, &p.method)];
            let kept = Kept {
                idx: &idx,
                bits: &bits,
            };
            let len = encode_kept_into(n, &p, kept, &mut out).unwrap();
            if out[..len] != want[..] {
                return false;
            }
        }
        true
    }
    qc(300, prop as fn(Floats, u32, u64) -> bool);
}

/// A large heavy-tailed tensor with ties and one region of large values, and a residual.
fn large(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut d = Data(seed);
    let g = (0..n)
        .map(|i| {
            let v = d.grad();
            if i % 7 == 0 {
                (v * 64.0).round() / 64.0
            } else if (n / 3..n / 3 + 2000).contains(&i) {
                v * 100.0
            } else {
                v
            }
        })
        .collect();
    let r = (0..n).map(|_| d.grad() * 0.5).collect();
    (g, r)
}

#[test]
fn chunked_topk_with_the_sampled_floor_equals_encode_into_and_feedback_step() {
    let n = select::SAMPLED_MIN * 3 + 777;
    let (g, r) = large(n, 7);
    let mut data = Data(11);
    let mut samples = vec![0u32; select::SAMPLE_LEN];
    for (ratio, pieces) in [(0.01, 7), (0.001, 30), (0.3, 2), (0.0, 3)] {
        let bounds = cuts(n, pieces, &mut data);
        for v in value_kinds() {
            let p = Params::new(Method::TopK {
                k: K::Ratio(ratio),
                values: v,
            });
            let k = K::Ratio(ratio).resolve(n as u64) as usize;
            // Plain top-k.
            let floor = select::topk_floor(&g, None, k, &mut samples).unwrap();
            let got = chunked_topk_frame(&g, None, &bounds, floor, &p).expect("enough candidates");
            assert_eq!(got, encode(&g, &p).unwrap(), "ratio {ratio} {v:?}");
            // One error-feedback step: the frame of g + r.
            let floor = select::topk_floor(&g, Some(&r), k, &mut samples).unwrap();
            let got = chunked_topk_frame(&g, Some(&r), &bounds, floor, &p).unwrap();
            let mut res = r.clone();
            let mut want = vec![0u8; max_frame_len(n, &p.method)];
            let mut scratch = vec![0u32; scratch_len(n, &p.method)];
            let len = feedback_step(&g, &mut res, &p, &mut scratch, &mut want).unwrap();
            assert_eq!(got, want[..len], "feedback ratio {ratio} {v:?}");
        }
    }
}

#[test]
fn topk_floor_is_none_where_nothing_is_sampled() {
    let mut samples = vec![0u32; select::SAMPLE_LEN];
    let small = vec![1.0f32; select::SAMPLED_MIN - 1];
    assert_eq!(select::topk_floor(&small, None, 10, &mut samples), None);
    let (g, r) = large(select::SAMPLED_MIN, 3);
    assert_eq!(select::topk_floor(&g, None, 0, &mut samples), None);
    assert_eq!(select::topk_floor(&g, None, g.len(), &mut samples), None);
    assert_eq!(select::topk_floor(&g, Some(&r[1..]), 5, &mut samples), None);
    assert!(select::topk_floor(&g, Some(&r), 5, &mut samples).is_some());
}

#[test]
fn candidates_report_values_beyond_the_limit_and_overflowing_lists() {
    let mut x = vec![0.5f32; 100];
    x[40] = 3.0;
    x[70] = 2.0;
    let (mut i, mut v) = (vec![0u32; 1], vec![0u32; 1]);
    // Two pass; the list holds the first, indices offset.
    assert_eq!(
        select::candidates(&x, None, 1000, 1.5, f32::INFINITY, &mut i, &mut v),
        Ok(2)
    );
    assert_eq!((i[0], v[0]), (1040, 3.0f32.to_bits()));
    x[90] = f32::NAN;
    assert_eq!(
        select::candidates(&x, None, 0, 1.5, f32::INFINITY, &mut i, &mut v),
        Err(select::OutOfLimit)
    );
    x[90] = 70_000.0;
    assert_eq!(
        select::candidates(
            &x,
            None,
            0,
            1.5,
            values::magnitude_limit(Some(Values::F16)),
            &mut i,
            &mut v
        ),
        Err(select::OutOfLimit)
    );
    // With a residual the candidates are of the sum.
    let g = [1.0f32, -1.0, 0.25];
    let r = [1.0f32, 0.5, 0.0];
    let (mut i, mut v) = (vec![0u32; 3], vec![0u32; 3]);
    assert_eq!(
        select::candidates(&g, Some(&r), 0, 0.5, f32::INFINITY, &mut i, &mut v),
        Ok(2)
    );
    assert_eq!(&i[..2], &[0, 1]);
    assert_eq!(&v[..2], &[2.0f32.to_bits(), (-0.5f32).to_bits()]);
}

#[test]
fn encode_kept_into_refuses_what_would_make_an_invalid_frame() {
    let n = 10;
    let topk = |k| {
        Params::new(Method::TopK {
            k: K::Count(k),
            values: Values::F16,
        })
    };
    let mut out = vec![0u8; 1024];
    let one = 1.0f32.to_bits();
    let kept = |idx: &'static [u32], bits: &'static [u32]| Kept { idx, bits };
    let leak: &'static [u32] = Box::leak(vec![one, one].into_boxed_slice());
    assert_eq!(
        encode_kept_into(n, &topk(3), kept(&[1, 2], leak), &mut out),
        Err(Error::InvalidParams { param: Param::K })
    );
    assert_eq!(
        encode_kept_into(n, &topk(2), kept(&[2, 2], leak), &mut out),
        Err(Error::UnsortedIndices { position: 1 })
    );
    assert_eq!(
        encode_kept_into(n, &topk(2), kept(&[2, 10], leak), &mut out),
        Err(Error::UnsortedIndices { position: 1 })
    );
    assert_eq!(
        encode_kept_into(n, &topk(2), kept(&[2, 3], &[1],), &mut out),
        Err(Error::LengthMismatch {
            expected: 2,
            got: 1
        })
    );
    let nan: &'static [u32] = Box::leak(vec![one, f32::NAN.to_bits()].into_boxed_slice());
    assert_eq!(
        encode_kept_into(n, &topk(2), kept(&[2, 7], nan), &mut out),
        Err(Error::NonFinite { index: 7 })
    );
    let big: &'static [u32] = Box::leak(vec![70_000.0f32.to_bits(), one].into_boxed_slice());
    assert_eq!(
        encode_kept_into(n, &topk(2), kept(&[4, 7], big), &mut out),
        Err(Error::ValueOutOfRange { index: 4 })
    );
    let th = Params::new(Method::Threshold {
        threshold: 1.0,
        values: Values::F32,
    });
    assert_eq!(
        encode_kept_into(n, &th, kept(&[2, 3], leak), &mut out),
        Err(Error::InvalidParams {
            param: Param::Threshold
        })
    );
    assert!(matches!(
        encode_kept_into(n, &topk(2), kept(&[2, 3], leak), &mut out[..10]),
        Err(Error::BufferTooSmall { .. })
    ));
    let dense = Params::new(Method::Dense {
        values: Values::F32,
    });
    assert_eq!(
        encode_kept_into(n, &dense, kept(&[2, 3], leak), &mut out),
        Err(Error::InvalidParams {
            param: Param::Method
        })
    );
    // And a valid list is the frame encode_into writes.
    let mut g = vec![0.0f32; n];
    g[2] = 1.0;
    g[3] = 1.0;
    let len = encode_kept_into(n, &topk(2), kept(&[2, 3], leak), &mut out).unwrap();
    assert_eq!(out[..len], encode(&g, &topk(2)).unwrap()[..]);
}

#[test]
fn quantization_in_pieces_equals_the_whole_tensor() {
    use gradwire_core::quant;
    // Pieces that start on whole blocks and whole bytes of codes, stochastic and nearest.
    let n = 10_000 + 37;
    let x = Data(5).grads(n);
    for (bits, block) in [(4u8, 512usize), (3, 64), (8, 100), (2, 8)] {
        for stochastic in [Some((7u64, 3u64, 99u64)), None] {
            let (sl, cl) = (quant::scales_len(n, block), quant::codes_len(n, bits));
            let (mut s1, mut c1) = (vec![0u8; sl], vec![0u8; cl]);
            quant::encode(&x, bits, block, stochastic, &mut s1, &mut c1);
            let (mut s2, mut c2) = (vec![0u8; sl], vec![0u8; cl]);
            // Pieces of whole blocks whose element count is a multiple of 8.
            let piece = block * 8;
            for (p, xs) in x.chunks(piece).enumerate() {
                let first = p * piece;
                let (sa, ca) = (4 * (first / block), first * bits as usize / 8);
                let (se, ce) = (
                    sa + quant::scales_len(xs.len(), block),
                    ca + quant::codes_len(xs.len(), bits),
                );
                quant::encode_from(
                    xs,
                    first as u64,
                    bits,
                    block,
                    stochastic,
                    &mut s2[sa..se],
                    &mut c2[ca..ce],
                );
            }
            assert_eq!(s1, s2, "{bits} bits, block {block}, {stochastic:?}");
            assert_eq!(c1, c2, "{bits} bits, block {block}, {stochastic:?}");
        }
    }
}

#[test]
fn topk_of_candidates_is_the_same_with_and_without_working_space() {
    // The fast path (the cut's bucket copied into the working space beyond the histogram) and
    // the plain one, against a sort, with many ties and keys packed into few buckets.
    fn prop(x: Floats, k: u16, extra: u16) -> bool {
        let n = x.0.len();
        let k = usize::from(k) % (n + 1);
        let idx: Vec<u32> = (0..n as u32).collect();
        let bits: Vec<u32> = x.0.iter().map(|v| v.to_bits()).collect();
        let mut want: Vec<u32> = {
            let mut order: Vec<u32> = idx.clone();
            order.sort_by(|&a, &b| {
                let (ka, kb) = (
                    bits[a as usize] & 0x7fff_ffff,
                    bits[b as usize] & 0x7fff_ffff,
                );
                kb.cmp(&ka).then(a.cmp(&b))
            });
            order.truncate(k);
            order
        };
        want.sort_unstable();
        [
            select::topk_scratch_len(n),
            select::candidates_hist_len(n),
            select::topk_scratch_len(n) + usize::from(extra) % (n + 2),
        ]
        .iter()
        .all(|&len| {
            let (mut i, mut b) = (idx.clone(), bits.clone());
            let mut hist = vec![7u32; len];
            let kept = select::topk_of_candidates(&mut i, &mut b, k, &mut hist);
            kept.idx == want.as_slice()
                && kept
                    .idx
                    .iter()
                    .zip(kept.bits)
                    .all(|(&j, &v)| bits[j as usize] == v)
        })
    }
    qc(500, prop as fn(Floats, u16, u16) -> bool);
    // A large list where the cut's bucket holds many keys (all in one bucket).
    let mut d = Data(9);
    let n = 200_000;
    let x: Vec<f32> = (0..n)
        .map(|_| 1.0 + (d.below(1 << 16) as f32) / 65536.0 * 0.1)
        .collect();
    let bits: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
    for k in [1, 1000, 99_999, n - 1] {
        let mut results = Vec::new();
        for len in [
            select::topk_scratch_len(n),
            select::candidates_hist_len(n),
            4096 + n,
        ] {
            let (mut i, mut b) = ((0..n as u32).collect::<Vec<_>>(), bits.clone());
            let mut hist = vec![0u32; len];
            let kept = select::topk_of_candidates(&mut i, &mut b, k, &mut hist);
            results.push(kept.idx.to_vec());
        }
        assert_eq!(results[0].len(), k);
        assert!(results.iter().all(|r| *r == results[0]), "k = {k}");
    }
}

// ---------------------------------------------------------------------------------------------
// Random-k from its drawn indices

/// Random-k's frame from the indices `randomk::for_each` draws and the values at them.
fn randomk_kept_frame(x: &[f32], p: &Params) -> Result<Vec<u8>, Error> {
    let n = x.len();
    let Method::RandomK { k, .. } = p.method else {
        unreachable!()
    };
    let key = gradwire_core::rng::key(p.seed, p.step, p.tensor_id);
    let mut idx = Vec::new();
    gradwire_core::randomk::for_each(n as u64, k.resolve(n as u64), key, |i| idx.push(i as u32));
    let bits: Vec<u32> = idx.iter().map(|&i| x[i as usize].to_bits()).collect();
    let mut out = vec![0u8; max_frame_len(n, &p.method)];
    let len = encode_kept_into(
        n,
        p,
        Kept {
            idx: &idx,
            bits: &bits,
        },
        &mut out,
    )?;
    out.truncate(len);
    Ok(out)
}

#[test]
fn randomk_frames_from_the_drawn_indices_are_those_of_encode_into_and_feedback_step() {
    let mut data = Data(31);
    for (case, n) in [0usize, 1, 7, 100, 4099, 70_001].into_iter().enumerate() {
        let g: Vec<f32> = data.grads(n).into_iter().map(moderate).collect();
        let r: Vec<f32> = data
            .grads(n)
            .into_iter()
            .map(|x| moderate(x) * 0.25)
            .collect();
        for v in value_kinds() {
            for (k, unbiased) in [
                (K::Ratio(0.01), false),
                (K::Count(3), true),
                (K::Ratio(0.5), false),
            ] {
                let p = Params::new(Method::RandomK {
                    k,
                    values: v,
                    unbiased,
                })
                .with_seed(case as u64)
                .at_step(9)
                .for_tensor(4);
                assert_eq!(
                    randomk_kept_frame(&g, &p),
                    encode(&g, &p),
                    "n {n} {v:?} {k:?}"
                );
                if unbiased {
                    continue;
                }
                // Error feedback encodes g + r (the f32 sums).
                let (mut res, mut out) = (r.clone(), vec![0u8; max_frame_len(n, &p.method)]);
                let mut scratch = vec![0u32; scratch_len(n, &p.method)];
                let len = feedback_step(&g, &mut res, &p, &mut scratch, &mut out).unwrap();
                let x: Vec<f32> = g.iter().zip(&r).map(|(g, r)| g + r).collect();
                assert_eq!(
                    randomk_kept_frame(&x, &p).unwrap(),
                    out[..len],
                    "EF n {n} {v:?}"
                );
                // The residual: `g + r`, then the frame added with weight -1 (the step does it
                // from the indices left in scratch, without drawing them again).
                let mut want = x.clone();
                gradwire_core::accumulate_into(&out[..len], &p, &mut want, -1.0).unwrap();
                assert!(
                    want.iter()
                        .zip(&res)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "EF residual n {n} {v:?}"
                );
            }
        }
    }
}

#[test]
fn randomk_kept_lists_are_checked_like_the_others() {
    let n = 1000;
    let p = |k, unbiased| {
        Params::new(Method::RandomK {
            k: K::Count(k),
            values: Values::F16,
            unbiased,
        })
    };
    let mut out = vec![0u8; max_frame_len(n, &p(4, false).method)];
    const ONE: u32 = 0x3f80_0000; // 1.0
    const BIG: u32 = 0x4788_b800; // 70 000.0
    let kept = |idx: &'static [u32], bits: &'static [u32]| Kept { idx, bits };
    assert_eq!(
        encode_kept_into(n, &p(3, false), kept(&[1, 2], &[ONE, ONE]), &mut out),
        Err(Error::InvalidParams { param: Param::K })
    );
    assert_eq!(
        encode_kept_into(n, &p(2, false), kept(&[5, 2], &[ONE, ONE]), &mut out),
        Err(Error::UnsortedIndices { position: 1 })
    );
    assert_eq!(
        encode_kept_into(n, &p(2, false), kept(&[2, 5], &[ONE, BIG]), &mut out),
        Err(Error::ValueOutOfRange { index: 5 })
    );
    // Unbiased: 1e36 is a finite f32, but times n/k = 500 it would decode to infinity; the
    // error names the element of the tensor, as encode_into's does.
    let unbiased = Params::new(Method::RandomK {
        k: K::Count(2),
        values: Values::F32,
        unbiased: true,
    });
    let mut g = vec![0.0f32; n];
    let key = gradwire_core::rng::key(0, 0, 0);
    let mut idx = Vec::new();
    gradwire_core::randomk::for_each(n as u64, 2, key, |i| idx.push(i as u32));
    g[idx[1] as usize] = 1e36;
    let bits: Vec<u32> = idx.iter().map(|&i| g[i as usize].to_bits()).collect();
    let want = Err(Error::ValueOutOfRange {
        index: idx[1] as usize,
    });
    assert_eq!(encode(&g, &unbiased).map(|_| ()), want);
    let mut out = vec![0u8; max_frame_len(n, &unbiased.method)];
    assert_eq!(
        encode_kept_into(
            n,
            &unbiased,
            Kept {
                idx: &idx,
                bits: &bits
            },
            &mut out
        )
        .map(|_| ()),
        want
    );
    // The error names the element of the list it was given, whatever the indices.
    let bits = [1.0f32.to_bits(), 1e36f32.to_bits()];
    let kept = Kept {
        idx: &[3, 5],
        bits: &bits,
    };
    assert_eq!(
        encode_kept_into(n, &unbiased, kept, &mut out),
        Err(Error::ValueOutOfRange { index: 5 })
    );
}

/// The frame writers from a given list clear the output's magic on error, as `encode_into`
/// does: a frame of an earlier call in the buffer does not survive.
#[test]
fn writers_from_a_list_leave_no_valid_frame_on_error() {
    let x = [1.0f32, -2.0, 3.0, 0.5];
    let p = Params::new(Method::TopK {
        k: K::Count(2),
        values: Values::F32,
    });
    let mut out = vec![0u8; max_frame_len(x.len(), &p.method)];
    let mut scratch = vec![0u32; scratch_len(x.len(), &p.method)];
    let fresh = |out: &mut [u8], scratch: &mut [u32]| {
        encode_into(&x, &p, scratch, out).unwrap();
        assert!(peek(out).is_ok());
    };
    fresh(&mut out, &mut scratch);
    let unsorted = [2u32, 1];
    let e = encode_selected_into(&x, &unsorted, Values::F32, &mut scratch, &mut out).unwrap_err();
    assert_eq!(e, Error::UnsortedIndices { position: 1 });
    assert!(
        peek(&out).is_err(),
        "encode_selected_into left a valid frame"
    );
    fresh(&mut out, &mut scratch);
    let bits: Vec<u32> = [f32::NAN, 3.0].iter().map(|v| v.to_bits()).collect();
    let kept = Kept {
        idx: &[1, 2],
        bits: &bits,
    };
    assert!(encode_kept_into(x.len(), &p, kept, &mut out).is_err());
    assert!(peek(&out).is_err(), "encode_kept_into left a valid frame");
}

//! `accumulate_into` of sparse frames against its definition, entry by entry: decode the frame,
//! then add `fl(weight * value)` to every carried entry in ascending index order. The sparse
//! path decodes in batches and adds each batch one batch later (a software pipeline), so the
//! counts sweep every batch boundary (32 for delta blocks, 64 otherwise), with all three index
//! codecs, random-k (biased and unbiased) and weights other than 1.

use gradwire_core::index::{self, choose_for};
use gradwire_core::{
    Error, K, Method, Param, Params, Values, accumulate_into, decode_into, encode_into,
    encode_selected_into, max_frame_len, rng, scratch_len,
};

/// Nonzero values from a fixed stream (so that `acc + w * 0.0` keeps `acc`'s bits).
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let r = rng::draw(seed, i);
            let m = ((r >> 40) as f32 + 1.0) / (1u64 << 24) as f32;
            if r & 1 == 0 { m } else { -m }
        })
        .collect()
}

/// `count` distinct ascending indices below `n` from `seed`.
fn indices(n: usize, count: usize, seed: u64) -> Vec<u32> {
    let mut keep = vec![false; n];
    let mut left = count.min(n);
    let mut j = 0u64;
    while left > 0 {
        let i = (rng::draw(seed ^ 0x51ed, j) % n as u64) as usize;
        j += 1;
        if !keep[i] {
            keep[i] = true;
            left -= 1;
        }
    }
    (0..n as u32).filter(|&i| keep[i as usize]).collect()
}

/// `accumulate_into(frame)` equals decoding it and adding entry by entry, bit for bit, and the
/// entries the frame does not carry keep their bits.
fn check(frame: &[u8], p: &Params, n: usize, what: &str) {
    let mut dec = vec![0.0f32; n];
    decode_into(frame, p, &mut dec).unwrap();
    let start = values(n, 99);
    for w in [1.0f32, -1.0, 0.3, 3.7] {
        let mut got = start.clone();
        accumulate_into(frame, p, &mut got, w).unwrap();
        let want: Vec<u32> = start
            .iter()
            .zip(&dec)
            .map(|(&a, &d)| if d == 0.0 { a } else { a + w * d }.to_bits())
            .collect();
        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        assert!(got == want, "{what}, weight {w}");
    }
}

fn counts() -> Vec<usize> {
    let mut c: Vec<usize> = (0..=5).collect();
    for b in [32, 64, 96, 128, 192, 1024] {
        c.extend([b - 1, b, b + 1]);
    }
    c.push(4097);
    c
}

#[test]
fn top_k_frames_accumulate_entry_by_entry_across_batch_boundaries() {
    let mut seen = [false; 3];
    for n in [60_000usize, 300, 70_000] {
        let x = values(n, 7);
        for count in counts().into_iter().filter(|&c| c <= n) {
            for seed in [1u64, 2] {
                let kept = indices(n, count, seed + count as u64);
                seen[choose_for(n as u64, &kept).0 as usize] = true;
                for v in [Values::F32, Values::F16, Values::Int8 { block: 64 }] {
                    let m = Method::TopK {
                        k: K::Count(count as u64),
                        values: v,
                    };
                    let mut out = vec![0u8; max_frame_len(n, &m)];
                    let mut scratch = vec![0u32; scratch_len(n, &m)];
                    let len = encode_selected_into(&x, &kept, v, &mut scratch, &mut out).unwrap();
                    let what = format!("top-k n {n} count {count} {v:?}");
                    check(&out[..len], &Params::new(m), n, &what);
                }
            }
        }
    }
    assert_eq!(
        seen,
        [true; 3],
        "codecs bitmap {}, delta {}, raw {} not all exercised",
        index::BITMAP,
        index::DELTA,
        index::RAW
    );
}

#[test]
fn random_k_frames_accumulate_entry_by_entry_across_batch_boundaries() {
    for n in [1usize, 65, 100_003] {
        let x = values(n, 11);
        for k in counts().into_iter().filter(|&k| k <= n) {
            for unbiased in [false, true] {
                let m = Method::RandomK {
                    k: K::Count(k as u64),
                    values: Values::F32,
                    unbiased,
                };
                let p = Params::new(m).with_seed(5).at_step(3).for_tensor(9);
                let mut out = vec![0u8; max_frame_len(n, &m)];
                let mut scratch = vec![0u32; scratch_len(n, &m)];
                let len = encode_into(&x, &p, &mut scratch, &mut out).unwrap();
                let what = format!("random-k n {n} k {k} unbiased {unbiased}");
                check(&out[..len], &p, n, &what);
            }
        }
    }
}

#[test]
fn a_non_finite_weight_is_an_error_and_adds_nothing() {
    let g = values(100, 3);
    let p = Params::new(Method::TopK {
        k: K::Count(10),
        values: Values::F32,
    });
    let mut frame = vec![0u8; max_frame_len(g.len(), &p.method)];
    let mut scratch = vec![0u32; scratch_len(g.len(), &p.method)];
    let len = encode_into(&g, &p, &mut scratch, &mut frame).unwrap();
    for w in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut acc = vec![1.0f32; g.len()];
        let e = accumulate_into(&frame[..len], &p, &mut acc, w).unwrap_err();
        assert_eq!(
            e,
            Error::InvalidParams {
                param: Param::Weight
            },
            "weight {w}"
        );
        assert!(acc.iter().all(|&x| x == 1.0), "weight {w}: acc changed");
    }
    let mut acc = vec![0.0f32; g.len()];
    accumulate_into(&frame[..len], &p, &mut acc, f32::MAX).unwrap();
}

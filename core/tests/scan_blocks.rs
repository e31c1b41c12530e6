//! select::scan's blocks of 64 groups (2,048 elements): candidates against a scalar reference
//! at lengths around block and group boundaries, with flagged groups at the end of blocks,
//! blocks with every group flagged, lists that run out of room, out-of-limit values at a
//! block's last element, and top-k ties cut across blocks (the fallback path's `accept`).

use gradwire_core::select;

const BLOCK: usize = 2048;

fn lens() -> Vec<usize> {
    vec![
        0,
        1,
        31,
        32,
        33,
        2016,
        2047,
        2048,
        2049,
        2080,
        4095,
        4096,
        4103,
        3 * BLOCK + 40 + 5,
        5 * BLOCK + 31,
    ]
}

fn rng(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail the check
fn reference(x: &[f32], floor: f32, limit: f32) -> Result<(Vec<u32>, Vec<u32>), ()> {
    let (mut i, mut b) = (Vec::new(), Vec::new());
    for (j, &v) in x.iter().enumerate() {
        if !(v.abs() < limit) {
            return Err(());
        }
        if v.abs() >= floor {
            i.push(j as u32);
            b.push(v.to_bits());
        }
    }
    Ok((i, b))
}

fn patterns(n: usize) -> Vec<(&'static str, Vec<f32>, f32)> {
    let mut seed = n as u64 + 1;
    let sparse: Vec<f32> = (0..n)
        .map(|_| {
            let r = rng(&mut seed);
            if r.is_multiple_of(97) {
                -1.5
            } else {
                (r % 1000) as f32 * 1e-4
            }
        })
        .collect();
    // Only the last group (and the last element) of every block is flagged, and the scalar tail.
    let last_group: Vec<f32> = (0..n)
        .map(|j| {
            let o = j % BLOCK;
            if o >= BLOCK - 32 && (o.is_multiple_of(5) || o == BLOCK - 1) || j + 3 >= n {
                2.0
            } else {
                0.25
            }
        })
        .collect();
    let all: Vec<f32> = (0..n).map(|j| (j % 7) as f32 - 3.0).collect();
    vec![
        ("sparse", sparse, 1.0),
        ("last_group", last_group, 1.0),
        ("all_flagged", all, 0.0),
    ]
}

#[test]
fn candidates_match_a_scalar_reference_across_blocks() {
    for n in lens() {
        for (name, x, floor) in patterns(n) {
            let r: Vec<f32> = (0..n).map(|j| if j % 3 == 0 { 0.5 } else { 0.0 }).collect();
            let xr: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
            for (res, xs) in [(None, &x), (Some(&r[..]), &xr)] {
                let (wi, wb) = reference(xs, floor, f32::INFINITY).unwrap();
                let c = wi.len();
                for cap in [0, 1, c / 2, c.saturating_sub(1), c, c + 5] {
                    let (mut i, mut b) = (vec![7u32; cap], vec![7u32; cap]);
                    let got = select::candidates(&x, res, 0, floor, f32::INFINITY, &mut i, &mut b)
                        .unwrap();
                    let w = cap.min(c);
                    assert_eq!(got, c, "{name} n={n} cap={cap}");
                    assert_eq!(&i[..w], &wi[..w], "{name} n={n} cap={cap}");
                    assert_eq!(&b[..w], &wb[..w], "{name} n={n} cap={cap}");
                    assert!(i[w..].iter().all(|&v| v == 7));
                }
            }
        }
    }
}

#[test]
fn out_of_limit_at_a_blocks_last_element_or_in_the_tail() {
    for n in lens().into_iter().filter(|&n| n > 0) {
        let mut spots = vec![n - 1, 0];
        let mut b = BLOCK - 1;
        while b < n {
            spots.push(b);
            b += BLOCK;
        }
        for spot in spots {
            for bad in [f32::NAN, f32::INFINITY, -8.0] {
                let mut x = vec![0.5f32; n];
                x[spot] = bad;
                let (mut i, mut v) = (vec![0u32; n], vec![0u32; n]);
                let got = select::candidates(&x, None, 0, 1.0, 8.0, &mut i, &mut v);
                assert_eq!(got, Err(select::OutOfLimit), "n={n} spot={spot} bad={bad}");
            }
        }
    }
}

#[test]
fn topk_ties_cut_across_blocks_on_both_paths() {
    for n in lens().into_iter().chain([70_000, 3 * 65_536 + 17]) {
        let mut seed = 99 + n as u64;
        // Few magnitudes: the cut falls in a run of ties spread over every block.
        let g: Vec<f32> = (0..n)
            .map(|_| {
                let r = rng(&mut seed);
                let m = (1 + r % 4) as f32 * 0.5;
                if r & 64 != 0 { -m } else { m }
            })
            .collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| g[b].abs().partial_cmp(&g[a].abs()).unwrap().then(a.cmp(&b)));
        for k in [0, 1, n / 3, n / 2 + 1, n.saturating_sub(1), n]
            .into_iter()
            .filter(|&k| k <= n)
        {
            let mut want: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
            want.sort_unstable();
            for sample in [0, select::sample_len(n)] {
                let mut s = vec![0u32; select::kept_scratch_len_with(n, k, sample)];
                let kept = select::topk_kept_with(&g, k, f32::INFINITY, sample, &mut s).unwrap();
                assert_eq!(kept.idx, &want[..], "n={n} k={k} sample={sample}");
                let bits: Vec<u32> = want.iter().map(|&i| g[i as usize].to_bits()).collect();
                assert_eq!(kept.bits, &bits[..]);
            }
        }
    }
}

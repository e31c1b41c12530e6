//! Sign with a zero mask (FORMAT.md 3.6): zeros decode to zero inside mixed blocks, with error
//! feedback and in a majority vote, step after step; the mask's bytes and its canonical-form
//! rules; the SIMD bitmap against an oracle; its cost on MiniLM's gradients.

mod common;

use common::{decode, encode, fix_crc, same_bits, testdata};
use gradwire_core::{
    Error, Method, Params, SignScale, accumulate_into, feedback_step, max_frame_len, peek,
    scratch_len, zero_mask,
};
use safetensors::SafeTensors;

fn masked(scale: SignScale) -> Method {
    Method::Sign {
        scale,
        zero_mask: true,
    }
}

fn plain(scale: SignScale) -> Method {
    Method::Sign {
        scale,
        zero_mask: false,
    }
}

const SCALES: [SignScale; 3] = [
    SignScale::MeanAbs { block: 8 },
    SignScale::MeanAbs { block: 1024 },
    SignScale::None,
];

/// A deterministic input of `n` elements where every `zero_every`-th element is zero (of
/// alternating sign) and the stretch `zeros` is all zeros.
fn input(n: usize, zero_every: usize, zeros: std::ops::Range<usize>) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if zeros.contains(&i) || i % zero_every == 3 {
                if i % 2 == 0 { 0.0 } else { -0.0 }
            } else {
                let h = common::mix64(i as u64);
                ((h % 2001) as f32 - 1000.0) / 256.0 + if h & 1 == 0 { 0.01 } else { -0.01 }
            }
        })
        .collect()
}

#[test]
fn zeros_decode_to_zero_inside_mixed_blocks_and_the_rest_as_without_a_mask() {
    for scale in SCALES {
        for n in [1usize, 7, 8, 29, 1024, 3000, 5000] {
            let g = input(n, 37, n / 3..n / 3 + 1100.min(n / 2));
            let frame = encode(&g, &Params::new(masked(scale))).unwrap();
            let unmasked = encode(&g, &Params::new(plain(scale))).unwrap();
            let out = decode(&frame, &Params::new(masked(scale)), n).unwrap();
            let want = decode(&unmasked, &Params::new(plain(scale)), n).unwrap();
            for i in 0..n {
                if g[i] == 0.0 {
                    assert_eq!(out[i].to_bits(), 0, "{scale:?} n {n}: element {i}");
                } else {
                    assert_eq!(out[i].to_bits(), want[i].to_bits(), "{scale:?} n {n}: {i}");
                }
            }
            // Accumulating adds nothing at a zero and exactly the unmasked term elsewhere.
            let mut acc: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 / 7.0).collect();
            let mut acc_plain = acc.clone();
            accumulate_into(&frame, &Params::new(masked(scale)), &mut acc, 0.5).unwrap();
            accumulate_into(&unmasked, &Params::new(plain(scale)), &mut acc_plain, 0.5).unwrap();
            for i in 0..n {
                let want = if g[i] == 0.0 {
                    1.0 + i as f32 / 7.0
                } else {
                    acc_plain[i]
                };
                assert_eq!(acc[i].to_bits(), want.to_bits(), "{scale:?} n {n}: {i}");
            }
        }
    }
}

#[test]
fn the_mask_costs_two_bits_per_block_and_a_bitmap_per_mixed_block() {
    let scale = SignScale::MeanAbs { block: 64 };
    let method = masked(scale);
    // 10 blocks of 64: block 2 all zeros, blocks 5 and 9 mixed, the others free of zeros.
    let mut g: Vec<f32> = (0..640).map(|i| 1.0 + i as f32).collect();
    g[128..192].fill(0.0);
    g[5 * 64 + 7] = -0.0;
    g[639] = 0.0;
    let frame = encode(&g, &Params::new(method)).unwrap();
    let unmasked = encode(&g, &Params::new(plain(scale))).unwrap();
    // 8 bytes of mixed count, 3 bytes of states (10 blocks x 2 bits), 2 bitmaps of 8 bytes.
    assert_eq!(frame.len(), unmasked.len() + 8 + 3 + 2 * 8);
    assert!(frame.len() <= max_frame_len(g.len(), &method));
    assert_eq!(frame[6], 0x02, "the zero-mask flag");
    let h = peek(&frame).unwrap();
    assert_eq!(h.params.method, method);
    assert_eq!(h.kept, 640);
    let mixed = u64::from_le_bytes(frame[21..29].try_into().unwrap());
    assert_eq!(mixed, 2);
    let mask = &frame[frame.len() - 4 - 19..frame.len() - 4];
    assert_eq!(&mask[..3], &[0b0001_0000, 0b0000_1000, 0b0000_1000]);
    assert_eq!(
        mask[3..11],
        [0x80, 0, 0, 0, 0, 0, 0, 0],
        "block 5: element 7"
    );
    assert_eq!(
        mask[11..19],
        [0, 0, 0, 0, 0, 0, 0, 0x80],
        "block 9: element 63"
    );
}

/// Rewrites byte `at` of a masked frame with `f` and fixes its checksum.
fn mutated(frame: &[u8], at: usize, f: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut m = frame.to_vec();
    m[at] = f(m[at]);
    fix_crc(&mut m);
    m
}

#[test]
fn each_mask_rule_is_enforced() {
    let scale = SignScale::MeanAbs { block: 8 };
    let p = Params::new(masked(scale));
    // Blocks: mixed, all zero, none, mixed (4 elements).
    let g = common::ZERO_MASK_28;
    let frame = encode(&g, &p).unwrap();
    decode(&frame, &p, 28).unwrap();
    let end = frame.len() - 4;
    let (states, map0, map3) = (end - 3, end - 2, end - 1);
    let signs = 16 + 5 + 8 + 16;
    let bad_value = |f: &[u8]| matches!(decode(f, &p, 28), Err(Error::BadValue { .. }));
    // A state of 3.
    assert!(bad_value(&mutated(&frame, states, |s| s | 0b1100_0000)));
    // Block 2 marked mixed without a bitmap: more mixed blocks than the count.
    assert!(bad_value(&mutated(&frame, states, |s| s | 0b0010_0000)));
    // Block 0 marked none: fewer mixed blocks than the count.
    assert!(bad_value(&mutated(&frame, states, |s| s & !0b11)));
    // A mixed bitmap that is all ones (an all-zero block) or all zeros (no zero).
    assert!(bad_value(&mutated(&frame, map0, |_| 0xff)));
    assert!(bad_value(&mutated(&frame, map0, |_| 0)));
    // A bit past the tensor's end in the last block's bitmap.
    assert!(bad_value(&mutated(&frame, map3, |m| m | 0x10)));
    // A zero element with its sign bit set, in a mixed block and in an all-zero block.
    assert!(bad_value(&mutated(&frame, signs, |s| s | 0x04)));
    assert!(bad_value(&mutated(&frame, signs + 1, |s| s | 0x01)));
    // An all-zero block whose scale is not +0.0.
    assert!(bad_value(&mutated(&frame, 16 + 5 + 8 + 4 + 3, |_| 0x80)));
    // A mixed count above the block count is malformed; a mask cut short is truncated.
    let mut big = frame.clone();
    big[21..29].copy_from_slice(&5u64.to_le_bytes());
    fix_crc(&mut big);
    assert!(matches!(
        decode(&big, &p, 28),
        Err(Error::Malformed { offset: 21 })
    ));
    let mut short = frame[..end - 1].to_vec();
    short.extend_from_slice(&[0; 4]);
    fix_crc(&mut short);
    assert!(matches!(
        decode(&short, &p, 28),
        Err(Error::Truncated { .. })
    ));
    // The zero-mask flag on another method, and a mask on a block that is not a multiple of 8.
    let dense = encode(
        &g,
        &Params::new(gradwire_core::Method::Dense {
            values: gradwire_core::Values::F32,
        }),
    )
    .unwrap();
    assert!(matches!(
        decode(
            &mutated(&dense, 6, |_| 0x02),
            &Params::new(Method::Dense {
                values: gradwire_core::Values::F32,
            }),
            28
        ),
        Err(Error::Malformed { offset: 6 })
    ));
    let odd = masked(SignScale::MeanAbs { block: 12 });
    assert!(matches!(
        encode(&g, &Params::new(odd)),
        Err(Error::InvalidParams {
            param: gradwire_core::Param::ZeroMask
        })
    ));
    let mut frame12 = encode(&g, &Params::new(plain(SignScale::MeanAbs { block: 12 }))).unwrap();
    frame12[6] = 0x02;
    frame12.splice(21..21, [0u8; 8]);
    fix_crc(&mut frame12);
    assert!(matches!(
        peek(&frame12),
        Err(Error::Malformed { offset: 17 })
    ));
    // A receiver that expects no mask names the parameter.
    assert!(matches!(
        decode(&frame, &Params::new(plain(scale)), 28),
        Err(Error::ParamMismatch {
            param: gradwire_core::Param::ZeroMask
        })
    ));
}

/// The oracle of the mask section (FORMAT.md 3.6), element by element.
fn mask_oracle(x: &[f32], block: usize) -> (Vec<u8>, usize) {
    let blocks = x.len().div_ceil(block);
    let mut states = vec![0u8; blocks.div_ceil(4)];
    let mut maps = Vec::new();
    let mut mixed = 0;
    for (b, xs) in x.chunks(block).enumerate() {
        let zeros = xs.iter().filter(|&&v| v == 0.0).count();
        let state = match zeros {
            0 => 0u8,
            z if z == xs.len() => 1,
            _ => 2,
        };
        states[b / 4] |= state << (2 * (b % 4));
        if state == 2 {
            let mut map = vec![0u8; block.min(x.len()).div_ceil(8)];
            for (j, &v) in xs.iter().enumerate() {
                if v == 0.0 {
                    map[j / 8] |= 1 << (j % 8);
                }
            }
            maps.extend(map);
            mixed += 1;
        }
    }
    states.extend(maps);
    (states, mixed)
}

#[test]
fn the_simd_bitmap_matches_the_oracle() {
    for block in [8usize, 16, 24, 64, 1024] {
        for n in [0usize, 1, 5, 8, 9, 63, 64, 65, 1000, 4099] {
            for every in [1usize, 2, 5, 1000, usize::MAX] {
                let g: Vec<f32> = (0..n)
                    .map(|i| match i % every {
                        0 if i % 3 == 0 => -0.0,
                        0 => 0.0,
                        _ => (i as f32 - 500.0) * 0.01 + 0.001,
                    })
                    .collect();
                let mut out = vec![0xAAu8; zero_mask::max_len(n, block)];
                let (len, mixed) = zero_mask::encode(&g, block, &mut out);
                let (want, want_mixed) = mask_oracle(&g, block);
                assert_eq!(
                    (&out[..len], mixed),
                    (&want[..], want_mixed),
                    "{block} {n} {every}"
                );
            }
        }
    }
}

#[test]
fn error_feedback_keeps_zeros_at_zero_and_loses_nothing() {
    let scale = SignScale::MeanAbs { block: 64 };
    let p = Params::new(masked(scale));
    let n = 1000;
    // Coordinates 100..400 and every 11th are zero on every step (an unused embedding row).
    let dead = |i: usize| (100..400).contains(&i) || i.is_multiple_of(11);
    let mut r = vec![0.0f32; n];
    let mut scratch = vec![0u32; scratch_len(n, &p.method)];
    let mut out = vec![0u8; max_frame_len(n, &p.method)];
    for step in 0..20u64 {
        let g: Vec<f32> = (0..n)
            .map(|i| {
                if dead(i) {
                    0.0
                } else {
                    ((common::mix64(step * 7919 + i as u64) % 1000) as f32 - 499.5) / 300.0
                }
            })
            .collect();
        let before = r.clone();
        let len = feedback_step(&g, &mut r, &p, &mut scratch, &mut out).unwrap();
        let sent = decode(&out[..len], &p, n).unwrap();
        for i in 0..n {
            let x = g[i] + before[i];
            if dead(i) {
                assert_eq!((sent[i], r[i]), (0.0, 0.0), "step {step}: {i}");
            }
            // r_new = x - sent, one f32 rounding: sent + r_new == x to that rounding.
            assert_eq!(r[i].to_bits(), (x - sent[i]).to_bits(), "step {step}: {i}");
        }
    }
}

#[test]
fn majority_vote_ties_and_abstentions() {
    // Sums of ±1 and 0 votes: positive, negative, tie, all abstained, one vote among zeros.
    let mut v = [2.0, -1.0, 0.0, 0.0, 1.0, -0.0];
    zero_mask::majority(&mut v);
    assert!(same_bits(&v, &[1.0, -1.0, 0.0, 0.0, 1.0, 0.0]));
}

#[test]
fn minilm_sign_with_the_mask_costs_at_most_1_05_bits_per_element() {
    let bytes = std::fs::read(testdata().join("minilm_small_grads.safetensors")).unwrap();
    let grads = SafeTensors::deserialize(&bytes).unwrap();
    let method = masked(SignScale::MeanAbs { block: 1024 });
    let (mut elements, mut frame_bytes, mut zeros, mut plain_bytes) = (0usize, 0usize, 0usize, 0);
    for (name, t) in grads.tensors() {
        let g: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let frame = encode(&g, &Params::new(method)).unwrap();
        let out = decode(&frame, &Params::new(method), g.len()).unwrap();
        for (i, (&x, &d)) in g.iter().zip(&out).enumerate() {
            if x == 0.0 {
                assert_eq!(d, 0.0, "{name}[{i}]");
                zeros += 1;
            }
        }
        elements += g.len();
        frame_bytes += frame.len();
        plain_bytes += encode(&g, &Params::new(plain(SignScale::MeanAbs { block: 1024 })))
            .unwrap()
            .len();
    }
    let bits = 8.0 * frame_bytes as f64 / elements as f64;
    let plain_bits = 8.0 * plain_bytes as f64 / elements as f64;
    println!(
        "MiniLM: {elements} elements, {zeros} zeros; sign mean-abs:1024 {plain_bits:.4} bits per \
         element, with the zero mask {bits:.4}"
    );
    assert!(zeros > 160_000, "the test data has its unused rows");
    assert!(bits <= 1.05, "{bits} bits per element");
}

//! Segmented top-k frames (FORMAT.md 3.2.1): int8 scale blocks restart at every segment, so a
//! segment's values decode exactly as a frame of that segment alone would give them, and a
//! decoder refuses every table that breaks the format's rules.

use gradwire_core::frame::chunk::SparseFrame;
use gradwire_core::{
    Error, K, Method, Params, Values, accumulate_into, decode_into, encode_segmented_into,
    encode_selected_into, max_frame_len, scratch_len, segmented_frame_len, segmented_scratch_len,
};

const INT8: Values = Values::Int8 { block: 4 };

fn params(kept: usize, values: Values) -> Params {
    Params::new(Method::TopK {
        k: K::Count(kept as u64),
        values,
    })
}

fn segmented(grad: &[f32], kept: &[u32], segs: &[u32], values: Values) -> Vec<u8> {
    let (n, k) = (grad.len(), kept.len());
    let mut scratch = vec![0u32; segmented_scratch_len(n, k, values, segs.len())];
    let mut out = vec![0u8; segmented_frame_len(n, k, values, segs.len())];
    let len = encode_segmented_into(grad, kept, segs, values, &mut scratch, &mut out).unwrap();
    out.truncate(len);
    out
}

fn selected(grad: &[f32], kept: &[u32], values: Values) -> Vec<u8> {
    let p = params(kept.len(), values);
    let mut scratch = vec![0u32; scratch_len(grad.len(), &p.method)];
    let mut out = vec![0u8; max_frame_len(grad.len(), &p.method)];
    let len = encode_selected_into(grad, kept, values, &mut scratch, &mut out).unwrap();
    out.truncate(len);
    out
}

fn decoded(frame: &[u8], n: usize, kept: usize, values: Values) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    decode_into(frame, &params(kept, values), &mut out).unwrap();
    out
}

/// Two "tensors" side by side: one of small entries (6 kept), one of large ones (5 kept, two
/// of them sharing the first tensor's last int8 block when the blocks run on).
fn two_tensors() -> (Vec<f32>, Vec<u32>, Vec<u32>) {
    let mut g = vec![0.0f32; 40];
    for (i, x) in g.iter_mut().enumerate().take(20) {
        *x = 0.001 * (i as f32 + 1.0) * if i % 2 == 0 { 1.0 } else { -1.0 };
    }
    for (i, x) in g.iter_mut().enumerate().skip(20) {
        *x = 50.0 + i as f32;
    }
    let kept = vec![1, 4, 7, 9, 15, 19, 20, 25, 30, 33, 39];
    (g, kept, vec![6, 5])
}

#[test]
fn each_segment_decodes_as_a_frame_of_its_own() {
    let (g, kept, segs) = two_tensors();
    let frame = segmented(&g, &kept, &segs, INT8);
    let out = decoded(&frame, g.len(), kept.len(), INT8);
    let mut at = 0usize;
    for &len in &segs {
        let part = &kept[at..at + len as usize];
        // The same entries alone, in a tensor that holds nothing else.
        let mut alone = vec![0.0f32; g.len()];
        for &i in part {
            alone[i as usize] = g[i as usize];
        }
        let own = decoded(&selected(&alone, part, INT8), g.len(), part.len(), INT8);
        for &i in part {
            assert_eq!(
                out[i as usize].to_bits(),
                own[i as usize].to_bits(),
                "index {i}"
            );
        }
        at += len as usize;
    }
    // Without segments the first tensor's last block shares the second's scale: its small
    // entries at 15 and 19 decode to zero, a silent loss the segments avoid.
    let run_on = decoded(&selected(&g, &kept, INT8), g.len(), kept.len(), INT8);
    assert_eq!(run_on[19], 0.0);
    assert!((out[19] - g[19]).abs() < g[19].abs() / 100.0, "{}", out[19]);
}

#[test]
fn zero_length_segments_are_skipped_and_one_segment_is_the_plain_frame() {
    let (g, kept, _) = two_tensors();
    let with_zeros = segmented(&g, &kept, &[0, 6, 0, 5, 0], INT8);
    assert_eq!(with_zeros, segmented(&g, &kept, &[6, 5], INT8));
    assert_eq!(
        segmented(&g, &kept, &[0, 11], INT8),
        selected(&g, &kept, INT8)
    );
    // Other value codecs have no scale blocks: the plain frame.
    assert_eq!(
        segmented(&g, &kept, &[6, 5], Values::F16),
        selected(&g, &kept, Values::F16)
    );
}

#[test]
fn a_table_that_does_not_sum_to_the_kept_count_is_refused() {
    let (g, kept, _) = two_tensors();
    let mut scratch = vec![0u32; segmented_scratch_len(g.len(), kept.len(), INT8, 2)];
    let mut out = vec![0u8; segmented_frame_len(g.len(), kept.len(), INT8, 2)];
    let err = encode_segmented_into(&g, &kept, &[6, 4], INT8, &mut scratch, &mut out);
    assert!(matches!(err, Err(Error::LengthMismatch { .. })), "{err:?}");
    assert_ne!(&out[..4], b"GWRF");
}

#[test]
fn chunks_accumulate_and_values_agree_with_decode() {
    // Many segments and blocks: 300 kept entries in segments of 1..=23.
    let n = 1000usize;
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1.5f32.powi((i % 9) as i32))
        .collect();
    let kept: Vec<u32> = (0..n as u32).filter(|i| i % 3 == 0).take(300).collect();
    let mut segs = Vec::new();
    let mut left = kept.len() as u32;
    let mut s = 1u32;
    while left > 0 {
        let len = s.min(left);
        segs.push(len);
        left -= len;
        s = s % 23 + 1;
    }
    let values = Values::Int8 { block: 8 };
    let frame = segmented(&g, &kept, &segs, values);
    let p = params(kept.len(), values);
    let out = decoded(&frame, n, kept.len(), values);
    let mut acc = vec![1.0f32; n];
    accumulate_into(&frame, &p, &mut acc, 1.0).unwrap();
    for i in 0..n {
        assert_eq!(acc[i].to_bits(), (1.0 + out[i]).to_bits());
    }
    let view = SparseFrame::parse(&frame, &p, n).unwrap();
    let mut all = vec![0.0f32; kept.len()];
    view.values(0, &mut all).unwrap();
    for (j, &i) in kept.iter().enumerate() {
        assert_eq!(all[j].to_bits(), out[i as usize].to_bits());
    }
    // Any range on its own, including ones that start mid-segment and mid-block.
    for (first, len) in [(0, 1), (5, 17), (123, 100), (299, 1), (7, 293)] {
        let mut part = vec![0.0f32; len];
        view.values(first, &mut part).unwrap();
        for (a, b) in part.iter().zip(&all[first..first + len]) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }
    // Every value within half a step of its own segment's block scale.
    let mut at = 0usize;
    for &len in &segs {
        let seg = &kept[at..at + len as usize];
        for blk in seg.chunks(8) {
            let m = blk.iter().map(|&i| g[i as usize].abs()).fold(0.0, f32::max);
            for &i in blk {
                let err = (out[i as usize] - g[i as usize]).abs();
                assert!(
                    err <= m / 127.0 * 0.5001 + 1e-6,
                    "index {i}: {err} over {m}"
                );
            }
        }
        at += len as usize;
    }
}

/// Offsets in the two-tensor frame: header 16, vspec 5, count 8, segment count 4 at 29, the
/// table (1 byte each) at 33 and 34, the index codec at 35.
fn resealed(mut f: Vec<u8>) -> Vec<u8> {
    let body = f.len() - 4;
    let crc = crc32fast::hash(&f[..body]);
    f[body..].copy_from_slice(&crc.to_le_bytes());
    f
}

#[test]
fn hostile_tables_are_refused_with_a_clear_error() {
    let (g, kept, segs) = two_tensors();
    let good = segmented(&g, &kept, &segs, INT8);
    assert_eq!(good[6], 4, "the segmented flag");
    assert_eq!(&good[29..33], &2u32.to_le_bytes());
    assert_eq!(&good[33..35], &[6, 5]);
    let p = params(kept.len(), INT8);
    let mut out = vec![0.0f32; g.len()];
    let bad = |f: Vec<u8>| decode_into(&resealed(f), &p, &mut out.clone()).unwrap_err();
    let edit = |at: usize, b: &[u8]| {
        let mut f = good.clone();
        f[at..at + b.len()].copy_from_slice(b);
        f
    };
    // One segment, or more than the kept count.
    assert!(matches!(
        bad(edit(29, &1u32.to_le_bytes())),
        Error::Malformed { offset: 29 }
    ));
    assert!(matches!(
        bad(edit(29, &12u32.to_le_bytes())),
        Error::Malformed { offset: 29 }
    ));
    // A zero length; lengths that do not sum to the count (short and long).
    assert!(matches!(
        bad(edit(33, &[0])),
        Error::Malformed { offset: 33 }
    ));
    assert!(matches!(
        bad(edit(34, &[4])),
        Error::Malformed { offset: 29 }
    ));
    assert!(matches!(
        bad(edit(34, &[9])),
        Error::Malformed { offset: 34 }
    ));
    // A varint not in its shortest form (6 as 0x86 0x00) shifts the frame: refused at the
    // table, not read as something else.
    let mut longer = good[..33].to_vec();
    longer.extend_from_slice(&[0x86, 0x00]);
    longer.extend_from_slice(&good[34..]);
    assert!(matches!(bad(longer), Error::Malformed { offset: 33 }));
    // The flag with another value codec or another method.
    let f16 = selected(&g, &kept, Values::F16);
    let mut flagged = f16.clone();
    flagged[6] = 4;
    let e = decode_into(
        &resealed(flagged),
        &params(kept.len(), Values::F16),
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Malformed { offset: 6 }), "{e:?}");
    // Every truncation is an error, never a panic.
    for cut in 0..good.len() {
        assert!(decode_into(&good[..cut], &p, &mut out).is_err());
    }
    decode_into(&good, &p, &mut out).unwrap();
}

/// The worked example of FORMAT.md 3.2.1, byte for byte, read by hand from the format's text.
#[test]
fn the_worked_example_of_format_md() {
    const HEX: &str = "47 57 52 46 01 01 04 00 28 00 00 00 00 00 00 00 03 04 00 00 00 0b 00 00 \
        00 00 00 00 00 02 00 00 00 06 05 00 92 82 18 42 82 0b d7 23 3c 0b d7 a3 3c 00 00 a6 42 \
        00 00 b2 42 e7 40 9a 81 9a 81 6b 73 7a 7f 7f e9 1c cf d2";
    let want: Vec<u8> = HEX
        .split_whitespace()
        .map(|h| u8::from_str_radix(h, 16).unwrap())
        .collect();
    let (g, kept, segs) = two_tensors();
    let frame = segmented(&g, &kept, &segs, INT8);
    assert_eq!(frame, want);
    // Segments of 6 and 5 values in blocks of 4: blocks of 4, 2 | 4, 1, so 4 scales (16
    // bytes at 41), then 11 codes (at 57), then the CRC-32.
    let scale = |b: usize| f32::from_le_bytes(frame[41 + 4 * b..45 + 4 * b].try_into().unwrap());
    let out = decoded(&frame, g.len(), kept.len(), INT8);
    for (j, &i) in kept.iter().enumerate() {
        let b = [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3][j];
        let code = frame[57 + j] as i8;
        let value = f32::from(code) / 127.0 * scale(b);
        assert_eq!(out[i as usize].to_bits(), value.to_bits(), "entry {j}");
    }
    assert_eq!(frame.len(), 57 + 11 + 4);
}

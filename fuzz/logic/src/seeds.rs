//! Seed inputs for the corpora: real frames of every method (and every value and index codec)
//! for the frame targets, and generator byte strings that select every method for the
//! structured targets. `examples/make_seeds.rs` writes them into `fuzz/corpus/<target>/`.

use crate::core_targets::{decode_seed, roundtrip_seed};
use gradwire_core::rng::mix64;
use gradwire_core::{
    K, Method, Params, Rounding, SignScale, Values, encode_into, max_frame_len, scratch_len,
};

/// Deterministic test gradients: empty, one element, a small heavy-tailed one, one with ties
/// and zeros, and a mostly-zero one (so bitmap, delta and raw index codecs all appear).
pub fn gradients() -> Vec<Vec<f32>> {
    let wave = |n: usize, salt: u64| -> Vec<f32> {
        (0..n)
            .map(|i| {
                let r = mix64(i as u64 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let u = (r >> 40) as f32 / 16_777_216.0 - 0.5;
                u * u * u * 8.0
            })
            .collect()
    };
    let mut ties = wave(300, 2);
    for (i, x) in ties.iter_mut().enumerate() {
        if i % 5 == 0 {
            *x = 0.0;
        } else if i % 7 == 0 {
            *x = -0.25;
        }
    }
    let mut sparse = vec![0.0f32; 1000];
    for i in (3..1000).step_by(97) {
        sparse[i] = (i as f32 - 500.0) / 100.0;
    }
    vec![vec![], vec![-1.5], wave(37, 1), ties, sparse]
}

/// Every method with a spread of parameters.
pub fn methods() -> Vec<Params> {
    let mut m = Vec::new();
    let vals = [
        Values::F32,
        Values::F16,
        Values::Bf16,
        Values::Int8 { block: 1 },
        Values::Int8 { block: 3 },
        Values::Int8 { block: 512 },
    ];
    for v in [Values::F32, Values::F16, Values::Bf16] {
        m.push(Method::Dense { values: v });
    }
    for v in vals {
        m.push(Method::TopK {
            k: K::Ratio(0.1),
            values: v,
        });
        m.push(Method::Threshold {
            threshold: 0.5,
            values: v,
        });
        m.push(Method::RandomK {
            k: K::Ratio(0.05),
            values: v,
            unbiased: false,
        });
    }
    for k in [K::Count(0), K::Count(1), K::Count(10_000), K::Ratio(0.01)] {
        m.push(Method::TopK {
            k,
            values: Values::F32,
        });
    }
    m.push(Method::RandomK {
        k: K::Count(5),
        values: Values::F16,
        unbiased: true,
    });
    for bits in 2..=8 {
        for (block, rounding) in [(512, Rounding::NearestEven), (7, Rounding::Stochastic)] {
            m.push(Method::Quant {
                bits,
                block,
                rounding,
            });
        }
    }
    for scale in [
        SignScale::None,
        SignScale::MeanAbs { block: 1024 },
        SignScale::MeanAbs { block: 5 },
    ] {
        m.push(Method::Sign {
            scale,
            zero_mask: false,
        });
    }
    for scale in [SignScale::None, SignScale::MeanAbs { block: 16 }] {
        m.push(Method::Sign {
            scale,
            zero_mask: true,
        });
    }
    m.into_iter()
        .enumerate()
        .map(|(i, method)| Params {
            method,
            seed: 42,
            step: i as u64,
            tensor_id: gradwire_core::tensor_id("layer.0.weight"),
        })
        .collect()
}

/// Encodes `grad` with `params`.
pub fn frame(grad: &[f32], params: &Params) -> Option<Vec<u8>> {
    let mut out = vec![0u8; max_frame_len(grad.len(), &params.method)];
    let mut scratch = vec![0u32; scratch_len(grad.len(), &params.method)];
    let len = encode_into(grad, params, &mut scratch, &mut out).ok()?;
    out.truncate(len);
    Some(out)
}

/// Every (method, gradient) frame.
pub fn frames() -> Vec<Vec<u8>> {
    let grads = gradients();
    let mut v = Vec::new();
    for p in methods() {
        for g in &grads {
            if let Some(f) = frame(g, &p) {
                v.push(f);
            }
        }
    }
    // Segmented top-k frames (int8 scale blocks restarting at each segment): every third
    // entry kept, cut into segments of 1, 2, 3, ... entries.
    for g in &grads {
        let kept: Vec<u32> = (0..g.len() as u32).step_by(3).collect();
        let mut segs = Vec::new();
        let (mut left, mut len) = (kept.len() as u32, 1u32);
        while left > 0 {
            segs.push(len.min(left));
            left -= len.min(left);
            len += 1;
        }
        let values = Values::Int8 { block: 3 };
        let (n, k) = (g.len(), kept.len());
        let mut out = vec![0u8; gradwire_core::segmented_frame_len(n, k, values, segs.len())];
        let mut scratch =
            vec![0u32; gradwire_core::segmented_scratch_len(n, k, values, segs.len())];
        if let Ok(len) =
            gradwire_core::encode_segmented_into(g, &kept, &segs, values, &mut scratch, &mut out)
        {
            out.truncate(len);
            v.push(out);
        }
    }
    v
}

/// Seeds for the core targets as `(target, bytes)`; `extra_frames` (golden frames) join the
/// frame targets.
pub fn core_seeds(extra_frames: &[Vec<u8>]) -> Vec<(&'static str, Vec<u8>)> {
    let mut frames = frames();
    frames.extend_from_slice(extra_frames);
    let mut out = Vec::new();
    for f in &frames {
        out.push(("decode", decode_seed(f)));
        out.push(("peek_frame", f.clone()));
    }
    // Structured targets: a small gradient, then generator bytes choosing each method.
    let grads = gradients();
    for sel in 0u8..6 {
        for variant in 0u8..4 {
            let g = &grads[(sel + variant) as usize % grads.len()];
            let g = &g[..g.len().min(300)];
            let mut bytes = vec![0, sel, variant, variant * 3 + 1, 2, 7, 1, 0];
            bytes.extend((0..24).map(|i| (mix64(u64::from(sel * 16 + variant) + i) & 0xff) as u8));
            let seed = roundtrip_seed(&bytes, g);
            out.push(("roundtrip", seed.clone()));
            // no_output_leak: same layout, then a few mutations.
            let mut leak = seed;
            leak.extend_from_slice(&[2, 0, 40, 0, 0x10, 2, 0x80, 0, 0x01, 0]);
            out.push(("no_output_leak", leak));
            for which in [sel, sel + 6] {
                let mut simd = vec![which, variant];
                simd.extend_from_slice(&roundtrip_seed(&bytes, g));
                out.push(("simd_scalar", simd));
            }
        }
    }
    out
}

/// Seeds for the std targets: structured bundle inputs selecting every method and bucketing,
/// and reference inputs cut from the real payloads `ref_*_step1.safetensors` in `data` (first
/// two tensors renamed `t0`, `t1`, a few entries each, indices folded into a 12 x 12 shape,
/// original dtypes and entry order kept), plus payloads from `reference::compress`.
#[cfg(feature = "std")]
pub fn std_seeds(data: &std::path::Path) -> Vec<(&'static str, Vec<u8>)> {
    use crate::std_targets::reference_seed;
    use gradwire::reference::{self, Mode};
    use safetensors::SafeTensors;
    use safetensors::tensor::{Dtype, TensorView};

    let mut out = Vec::new();
    for sel in 0u8..6 {
        for variant in 0u8..6 {
            let mut b = vec![variant % 4, 3, 1, 7 + variant, 3, 2, 5, 4];
            b.extend_from_slice(&[0, sel, variant, 3, 1, 2, 0, 1, 9, 0, 0, 0, 0, 0, 0, 0]);
            b.extend(
                (0..200).map(|i| (mix64(u64::from(sel * 8 + variant) * 1000 + i) & 0xff) as u8),
            );
            out.push(("bundle", b));
        }
    }
    let specs = vec![("t0", vec![12, 12]), ("t1", vec![7])];
    let grads: Vec<Vec<f32>> = vec![
        (0..144)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0)
            .collect(),
        vec![0.5, -1.0, 0.0, 2.0, -0.25, 0.0, 3.0],
    ];
    for mode in Mode::ALL {
        let inputs: Vec<reference::Input<'_>> = specs
            .iter()
            .zip(&grads)
            .map(|((n, s), g)| (*n, s.as_slice(), g.as_slice()))
            .collect();
        if let Ok(p) = reference::compress(&inputs, mode, 0.1) {
            out.push(("reference", reference_seed(mode, &specs, &p)));
        }
    }
    out.extend(checkpoint_seeds());
    out.extend(dense_sum_seeds());
    out.extend(method_state_seeds());
    out.extend(windows_seeds());
    let Ok(dir) = std::fs::read_dir(data) else {
        return out;
    };
    for entry in dir.flatten() {
        let path = entry.path();
        let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("");
        if !(name.starts_with("ref_") && name.ends_with("_step1.safetensors")) {
            continue;
        }
        let mode = if name.contains("topk-int8") {
            Mode::TopKInt8
        } else {
            Mode::TopK
        };
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let Ok(st) = SafeTensors::deserialize(&bytes) else {
            continue;
        };
        let mut names: Vec<String> = st
            .names()
            .iter()
            .filter_map(|k| k.strip_suffix("::idx").map(str::to_owned))
            .collect();
        names.sort();
        for take in [3usize, 10] {
            let mut keys: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
            for (t, tensor) in names.iter().take(2).enumerate() {
                let n = if t == 0 { 144 } else { 7 };
                let Ok(idx) = st.tensor(&format!("{tensor}::idx")) else {
                    continue;
                };
                let Ok(val) = st.tensor(&format!("{tensor}::val")) else {
                    continue;
                };
                let mut seen = std::collections::BTreeSet::new();
                let mut ib = Vec::new();
                let mut vb = Vec::new();
                let vsize = if val.dtype() == Dtype::I8 { 1 } else { 4 };
                for (j, c) in idx.data().chunks_exact(8).enumerate() {
                    let i = i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) % n;
                    if seen.len() == take.min(n as usize) || !seen.insert(i) {
                        continue;
                    }
                    ib.extend_from_slice(&i.to_le_bytes());
                    vb.extend_from_slice(&val.data()[j * vsize..(j + 1) * vsize]);
                }
                let k = seen.len();
                keys.push((format!("t{t}::idx"), Dtype::I64, vec![k], ib));
                keys.push((format!("t{t}::val"), val.dtype(), vec![k], vb));
                if let Ok(s) = st.tensor(&format!("{tensor}::scale")) {
                    keys.push((
                        format!("t{t}::scale"),
                        Dtype::F32,
                        vec![1],
                        s.data().to_vec(),
                    ));
                }
            }
            let views: Vec<(String, TensorView<'_>)> = keys
                .iter()
                .filter_map(|(k, d, s, b)| {
                    Some((k.clone(), TensorView::new(*d, s.clone(), b).ok()?))
                })
                .collect();
            if let Ok(p) = safetensors::serialize(views, None) {
                out.push(("reference", reference_seed(mode, &specs, &p)));
            }
        }
    }
    out
}

/// Seeds for the `checkpoint` target: real checkpoints from `ErrorFeedback::to_bytes` (given
/// raw), the regression checkpoint whose offsets add up past `usize::MAX` (raw), and generator
/// byte strings for each mode (a checkpoint from `ErrorFeedback`, the same edited, a hand-built
/// file, the same edited).
#[cfg(feature = "std")]
pub fn checkpoint_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use gradwire::feedback::ErrorFeedback;

    let mut out = Vec::new();
    let methods = [
        Method::TopK {
            k: K::Ratio(0.25),
            values: Values::Int8 { block: 4 },
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 3 },
            zero_mask: false,
        },
        Method::Quant {
            bits: 4,
            block: 8,
            rounding: Rounding::Stochastic,
        },
    ];
    for (i, method) in methods.into_iter().enumerate() {
        let Ok(mut fb) = ErrorFeedback::new(method, 42 + i as u64) else {
            continue;
        };
        let mut g = [0.0f32; 12];
        for (j, v) in g.iter_mut().enumerate() {
            *v = (j as f32 - 5.5) / 4.0;
        }
        let empty: [f32; 0] = [];
        for _ in 0..=i {
            // The first state's residuals have no shape; the others' remember theirs (stored
            // 2-d and 1-d in a version 3 checkpoint).
            let stepped = if i == 0 {
                let grads = [("layer.0.weight", &g[..]), ("b", &g[..3]), ("", &empty[..])];
                fb.step_with(grads, |_, _| {})
            } else {
                let grads: [(&str, &[usize], &[f32]); 3] = [
                    ("layer.0.weight", &[3, 4], &g[..]),
                    ("b", &[3], &g[..3]),
                    ("", &[0], &empty[..]),
                ];
                fb.step_with_shapes(grads, |_, _| {})
            };
            if stepped.is_err() {
                break;
            }
        }
        let _ = fb.set_residual("tiny", vec![f32::from_bits(1), -0.0, f32::MAX]);
        if let Ok(b) = fb.to_bytes() {
            let mut v = vec![0u8];
            v.extend_from_slice(&b);
            out.push(("checkpoint", v));
        }
    }
    // Eight U8 tensors of 2^61 - 1 bytes each: offsets that end past usize::MAX once the
    // header length is added (std-adapter/tests/regressions.rs).
    let size: u64 = (1 << 61) - 1;
    let mut header = String::from(
        "{\"__metadata__\":{\"format\":\"gradwire-error-feedback\",\"version\":\"2\",\
         \"method\":\"topk k=count:1 values=f32\",\"seed\":\"0\",\"step\":\"0\",\"crc32\":\"0\"}",
    );
    for i in 0..8u64 {
        header.push_str(&format!(
            ",\"t{i}\":{{\"dtype\":\"U8\",\"shape\":[{size}],\"data_offsets\":[{},{}]}}",
            i * size,
            (i + 1) * size
        ));
    }
    header.push('}');
    let mut v = vec![0u8];
    v.extend_from_slice(&(header.len() as u64).to_le_bytes());
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(&[0; 16]);
    out.push(("checkpoint", v));
    // Hand-built files (mode 3): a valid checkpoint (top-1, seed 5, step 9, `layer.0.weight` =
    // [1, -1, -0] and an empty `layer.1.weight`, data in reversed order), the same edited, and
    // variants with a 0-d tensor, a NaN value and an I64 tensor.
    let valid = [
        2, 2, 3, 0, 1, 0, 1, 0, 6, 5, 6, 9, 1, 2, 5, 1, 4, 3, 3, 16, 3, 0xf0, 2, 3, 5, 1, 4, 0, 1,
        2, 1, 1, 1, 1,
    ];
    for (sel, tail) in [
        (3u8, &[][..]),
        (0x83, &[1, 3, 7, 3, 0][..]),
        (0x83, &[0, 2, 0][..]),
    ] {
        let mut b = vec![sel];
        b.extend_from_slice(&valid);
        b.extend_from_slice(tail);
        out.push(("checkpoint", b));
    }
    let mut zero_d = vec![3u8];
    zero_d.extend_from_slice(&valid);
    zero_d[27] = 0; // layer.1.weight: shape [] (one element, 0.5)
    zero_d.splice(28..29, [3, 8]);
    out.push(("checkpoint", zero_d));
    let mut nan = vec![3u8];
    nan.extend_from_slice(&valid);
    nan[23] = 2; // the last value of layer.0.weight: NaN
    nan[24] = 0;
    out.push(("checkpoint", nan));
    let mut int = vec![3u8];
    int.extend_from_slice(&valid);
    int[16] = 0; // layer.0.weight: a dtype from the table, I64
    int.insert(17, 1);
    out.push(("checkpoint", int));
    for sel in [1u8, 2, 3, 0x83] {
        for variant in 0u8..6 {
            let mut b = vec![sel];
            b.extend((0..160).map(|i| {
                (mix64(u64::from(sel) * 1000 + u64::from(variant) * 200 + i) & 0xff) as u8
            }));
            out.push(("checkpoint", b));
        }
    }
    out
}

/// Seeds for the `windows` target: every method and collective at three chunk bounds with
/// every message kept, and each damage mode on one of the first calls.
#[cfg(feature = "std")]
pub fn windows_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();
    for flags in 0..6u8 {
        for chunk in [0u8, 30, 255] {
            out.push(("windows", vec![flags, chunk]));
        }
        // Kept calls, then one damaged call (cut 5 bytes; lengthen by 3; flip byte 9; 4 raw
        // bytes), then kept ones.
        for (call, damage) in [
            (1usize, vec![4u8, 5]),
            (2, vec![5, 3, 1, 2, 3]),
            (3, vec![6, 9, 0x40]),
            (4, vec![7, 4, 0x47, 0x57, 0x43, 0x4d]),
        ] {
            let mut b = vec![flags, 30];
            b.extend(std::iter::repeat_n(0u8, call));
            b.extend(damage);
            out.push(("windows", b));
        }
    }
    out
}

/// Seeds for the `dense_sum` target: every world size, a few element counts, every rank as
/// `me`, valid messages (mode 0) of small exact values, and one input per damage mode.
#[cfg(feature = "std")]
pub fn dense_sum_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();
    let value = |i: usize| ((i % 7) as f32 - 3.0) * 0.75;
    for w in 1..=6usize {
        for (n, me) in [(0, 0), (1, w - 1), (w, w / 2), (13, 0), (40, w - 1)] {
            for damage in [0u8, 1, 2, 3, 4] {
                if damage != 0 && (w == 1 || n != 13) {
                    continue;
                }
                let mut b = vec![(w - 1) as u8, me as u8, n as u8];
                let mut at = 0;
                let mut push = |b: &mut Vec<u8>| {
                    b.extend_from_slice(&value(at).to_bits().to_le_bytes());
                    at += 1;
                };
                for _ in 0..n {
                    push(&mut b);
                }
                let shard = |j: usize| (j + 1) * n / w - j * n / w;
                // Phase 1: each peer's shard for `me`; phase 2: each peer's own sum. The first
                // peer's first message carries the damage.
                let mut first = true;
                for phase in 0..2 {
                    for r in (0..w).filter(|&r| r != me) {
                        let mode = if first { damage } else { 0 };
                        first = false;
                        b.push(mode);
                        let values = if phase == 0 { shard(me) } else { shard(r) };
                        for _ in 0..values {
                            push(&mut b);
                        }
                        // Exactly the bytes each mode reads, so that the messages behind
                        // stay aligned: raw bytes (a length of 4, then 4 bytes), a cut of
                        // 1 + 3 bytes, 1 + 3 more bytes, another word.
                        match mode {
                            1 => b.extend_from_slice(&[4, 1, 2, 3, 4]),
                            2 => b.push(3),
                            3 => b.extend_from_slice(&[3, 9, 9, 9, 9]),
                            4 => b.extend_from_slice(&7u64.to_le_bytes()),
                            _ => {}
                        }
                    }
                }
                out.push(("dense_sum", b));
            }
        }
    }
    out
}

/// Seeds for the `method_state` target: each method, file mode and PowerSGD rank, with
/// ordinary gradients (every value byte at least 16, so no raw bits), a few damaged bytes, and
/// one input with a huge gradient value.
#[cfg(feature = "std")]
pub fn method_state_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();
    for flags in [0u8, 1, 2, 3, 4, 5, 6, 7, 16, 18, 20, 22] {
        let mut b = vec![flags];
        b.extend((0..4 * 53).map(|i| 16 + (mix64(i) % 224) as u8));
        match (flags >> 1) % 4 {
            0 => b.extend_from_slice(b"\x40\0\0\0\0\0\0\0{\"__metadata__\":{}}"),
            1 => b.extend_from_slice(&[200, 0, 7, 1, 3, 0, 9, 0]),
            // Edits: a step, a value, a reshaped tensor, an added one.
            3 => b.extend_from_slice(&[
                0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 1, 0, 7, 0, 0, 0x80, 0x7f, 2, 1, 1, 3, 3, 5, 1, 0,
                2, 4,
            ]),
            _ => {}
        }
        out.push(("method_state", b));
    }
    let mut b = vec![4u8, 0];
    b.extend_from_slice(&f32::MAX.to_bits().to_le_bytes());
    out.push(("method_state", b));
    out
}

/// Without the std crate there are no std seeds.
#[cfg(not(feature = "std"))]
pub fn std_seeds(_data: &std::path::Path) -> Vec<(&'static str, Vec<u8>)> {
    Vec::new()
}

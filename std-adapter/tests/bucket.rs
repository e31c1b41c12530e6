//! Buckets: deterministic plans, exact per-tensor recovery, per-tensor and per-bucket top-k,
//! dense small tensors, error feedback across buckets.

mod common;

use std::collections::HashMap;

use common::{Rng, grads, minilm, same_bits};
use gradwire::BucketConfig;
use gradwire::core::{Method, Values};
use gradwire::layout::TopKScope;
use gradwire::layout::{EntryKind, Manifest, TensorSpec};
use gradwire::tensor::Tensor;
use gradwire::{CompressionMethod, GradientCompressor};

fn specs(sizes: &[(&str, usize)]) -> Vec<TensorSpec> {
    sizes
        .iter()
        .map(|(n, s)| TensorSpec::new(*n, [*s]))
        .collect()
}

fn labels(m: &Manifest) -> Vec<String> {
    m.entries().iter().map(|e| e.label.clone()).collect()
}

#[test]
fn plans_are_deterministic() {
    let method = CompressionMethod::TopK { k: 1 };
    // Budget 100 bytes = 25 f32 values.
    let cfg = BucketConfig::fused(100).with_dense_below(3, Values::F32);
    let m = Manifest::new(
        specs(&[
            ("a", 10),
            ("big", 25),
            ("b", 10),
            ("tiny1", 2),
            ("c", 10),
            ("tiny2", 1),
            ("d", 4),
        ]),
        &method,
        0,
        cfg,
    )
    .unwrap();
    // `a` opens a bucket; `big` reaches the budget and goes alone; `b` joins `a`; `tiny1` opens
    // a dense bucket; `c` would pass 25 values: a new bucket; `tiny2` joins `tiny1`; `d` joins `c`.
    assert_eq!(
        labels(&m),
        [
            "bucket[a, b]",
            "big",
            "bucket[tiny1, tiny2]",
            "bucket[c, d]"
        ]
    );
    assert_eq!(
        m.entries()[2].method,
        Method::Dense {
            values: Values::F32
        }
    );
    assert!(matches!(
        m.entries()[0].kind,
        EntryKind::Bucket {
            per_tensor_topk: true
        }
    ));
    // Flat layout: entries one after the other.
    let offsets: Vec<(usize, usize)> = m.entries().iter().map(|e| (e.offset, e.len)).collect();
    assert_eq!(offsets, [(0, 20), (20, 25), (45, 3), (48, 14)]);
    assert_eq!(
        m.tensors().iter().find(|t| t.name == "d").unwrap().offset,
        58
    );
    assert_eq!(m.flat_len(), 62);
    // Same input, same plan.
    let again = Manifest::new(
        m.tensors()
            .iter()
            .map(|t| TensorSpec::new(t.name.clone(), t.shape.clone()))
            .collect(),
        &method,
        0,
        cfg,
    )
    .unwrap();
    assert_eq!(again, m);
    // No budget: one entry per tensor, in order; a lone small tensor is a tensor entry.
    let m = Manifest::new(
        specs(&[("x", 3), ("y", 4)]),
        &method,
        0,
        BucketConfig::none(),
    )
    .unwrap();
    assert_eq!(labels(&m), ["x", "y"]);
    let m = Manifest::new(
        specs(&[("x", 3), ("huge", 100)]),
        &method,
        0,
        BucketConfig::fused(100),
    )
    .unwrap();
    assert!(m.entries().iter().all(|e| e.kind == EntryKind::Tensor));
}

fn decode_bundle(
    method: &CompressionMethod,
    g: &HashMap<String, Tensor>,
    cfg: BucketConfig,
) -> (Manifest, HashMap<String, Tensor>) {
    let manifest = Manifest::for_gradients(g, method, 0, cfg).unwrap();
    let mut c = GradientCompressor::new(method.clone());
    let mut bundle = Vec::new();
    let step = c.compress_bundle(&manifest, g, 0, &mut bundle).unwrap();
    let mut flat = Vec::new();
    manifest
        .decode_bundle(&bundle, Some(0), Some(step), &mut flat)
        .unwrap();
    let out = manifest.to_tensors(&flat).unwrap();
    (manifest, out)
}

/// Per-tensor top-k inside a bucket recovers exactly what each tensor sends alone.
#[test]
fn per_tensor_top_k_recovers_each_tensor_exactly() {
    let g = minilm();
    for values in [Values::F32, Values::F16, Values::Bf16] {
        let method = CompressionMethod::TopKRatio {
            ratio: 0.01,
            values,
        };
        let (manifest, bucketed) = decode_bundle(&method, &g, BucketConfig::fused(64 << 10));
        assert!(
            manifest
                .entries()
                .iter()
                .any(|e| matches!(e.kind, EntryKind::Bucket { .. }))
        );
        let (_, alone) = decode_bundle(&method, &g, BucketConfig::none());
        for (name, t) in &alone {
            assert!(
                same_bits(t.data(), bucketed[name].data()),
                "{name} {values:?}"
            );
            assert_eq!(t.shape(), bucketed[name].shape());
        }
    }
}

#[test]
fn per_tensor_int8_keeps_each_tensors_entries() {
    // With int8 values a scale block may span two tensors: each tensor still sends exactly its
    // own top-k entries, but an entry far below its block's scale decodes to 0 (the key-bias
    // gradients are ~1e-9 next to neighbours of ~1e-1; error feedback keeps what is lost).
    let g = minilm();
    let method = CompressionMethod::top_k_int8(0.01);
    let (_, bucketed) = decode_bundle(&method, &g, BucketConfig::fused(64 << 10));
    let (_, alone) = decode_bundle(&method, &g, BucketConfig::none());
    for (name, t) in &alone {
        let kept = |v: &[f32]| v.iter().map(|x| *x != 0.0).collect::<Vec<_>>();
        let (a, b) = (kept(t.data()), kept(bucketed[name].data()));
        assert!(
            a.iter().zip(&b).all(|(a, b)| *a || !*b),
            "{name}: kept outside its top-k"
        );
        let peak = g[name].data().iter().fold(0.0f32, |m, x| m.max(x.abs()));
        if peak > 1e-4 {
            assert_eq!(a, b, "{name}");
        }
    }
}

#[test]
fn dense_small_tensors_are_exact() {
    let mut rng = Rng(5);
    let g = grads(&[
        ("bias", &[7], rng.vec(7, 1.0)),
        ("gain", &[], vec![0.25]),
        ("weight", &[40, 10], rng.vec(400, 1.0)),
    ]);
    let method = CompressionMethod::TopK { k: 4 };
    let cfg = BucketConfig::fused(1 << 12).with_dense_below(10, Values::F32);
    let (manifest, out) = decode_bundle(&method, &g, cfg);
    assert_eq!(labels(&manifest), ["bucket[bias, gain]", "weight"]);
    assert!(same_bits(out["bias"].data(), g["bias"].data()));
    assert_eq!(out["gain"].data(), &[0.25]);
    assert_eq!(
        out["weight"].data().iter().filter(|x| **x != 0.0).count(),
        4
    );
    // Dense bf16 buckets.
    let cfg = cfg.with_dense_below(10, Values::Bf16);
    let (_, out) = decode_bundle(&method, &g, cfg);
    for (a, b) in out["bias"].data().iter().zip(g["bias"].data()) {
        assert!((a - b).abs() <= b.abs() / 128.0);
    }
}

#[test]
fn other_methods_compress_the_concatenation() {
    let mut rng = Rng(6);
    let g = grads(&[
        ("a", &[100], rng.vec(100, 1.0)),
        ("b", &[50], rng.vec(50, 1.0)),
    ]);
    for method in [
        CompressionMethod::SignSGD,
        CompressionMethod::Quantization { bits: 8 },
        CompressionMethod::Threshold { threshold: 0.5 },
        CompressionMethod::RandomK { k: 30 },
        CompressionMethod::Float16,
    ] {
        let (manifest, out) = decode_bundle(&method, &g, BucketConfig::fused(1 << 12));
        assert_eq!(manifest.entries().len(), 1, "{method:?}");
        assert_eq!(out["a"].data().len(), 100);
        assert_eq!(out["b"].data().len(), 50);
    }
    // Threshold is elementwise: exactly the same as without buckets.
    let t = CompressionMethod::Threshold { threshold: 0.5 };
    let (_, fused) = decode_bundle(&t, &g, BucketConfig::fused(1 << 12));
    let (_, alone) = decode_bundle(&t, &g, BucketConfig::none());
    for name in ["a", "b"] {
        assert!(same_bits(fused[name].data(), alone[name].data()));
    }
}

/// Error feedback with buckets keeps one residual per tensor name, and with f32 values and
/// per-tensor top-k it is exactly the per-tensor computation.
#[test]
fn error_feedback_across_buckets() {
    let mut rng = Rng(7);
    let shapes: [(&str, usize); 4] = [("a", 30), ("b", 20), ("c", 300), ("d", 5)];
    let method = CompressionMethod::TopK { k: 3 }.with_error_feedback();
    let cfg = BucketConfig::fused(400).with_scope(TopKScope::PerTensor);
    let mut model = HashMap::new();
    for (n, s) in shapes {
        model.insert(n.to_owned(), Tensor::vector(vec![0.0; s]));
    }
    let fused = Manifest::for_gradients(&model, &method, 0, cfg).unwrap();
    assert!(fused.entries().len() < 4);
    let alone = Manifest::for_gradients(&model, &method, 0, BucketConfig::none()).unwrap();
    let mut cf = GradientCompressor::new(method.clone());
    let mut ca = GradientCompressor::new(method.clone());
    let (mut bf, mut ba) = (Vec::new(), Vec::new());
    for s in 0..6 {
        let g: HashMap<String, Tensor> = shapes
            .iter()
            .map(|(n, len)| ((*n).to_owned(), Tensor::vector(rng.vec(*len, 1.0))))
            .collect();
        let step = cf.compress_bundle(&fused, &g, 0, &mut bf).unwrap();
        assert_eq!(step, s);
        ca.compress_bundle(&alone, &g, 0, &mut ba).unwrap();
        let (mut ff, mut fa) = (Vec::new(), Vec::new());
        fused.decode_bundle(&bf, None, None, &mut ff).unwrap();
        alone.decode_bundle(&ba, None, None, &mut fa).unwrap();
        let (rf, ra) = (cf.feedback().unwrap(), ca.feedback().unwrap());
        for (n, _) in shapes {
            assert!(same_bits(
                fused.slice(&ff, n).unwrap(),
                alone.slice(&fa, n).unwrap()
            ));
            assert!(
                same_bits(rf.residual(n).unwrap(), ra.residual(n).unwrap()),
                "{n}"
            );
        }
    }
    assert_eq!(cf.feedback().unwrap(), ca.feedback().unwrap());
}

/// With per-bucket top-k and error feedback, nothing is lost per coordinate.
#[test]
fn per_bucket_error_feedback_loses_nothing() {
    let mut rng = Rng(8);
    let method = CompressionMethod::TopK { k: 4 }.with_error_feedback();
    let cfg = BucketConfig::fused(1 << 10).with_scope(TopKScope::PerBucket);
    let model = grads(&[("a", &[10], vec![0.0; 10]), ("b", &[2, 5], vec![0.0; 10])]);
    let manifest = Manifest::for_gradients(&model, &method, 0, cfg).unwrap();
    let mut c = GradientCompressor::new(method);
    let mut old: HashMap<&str, Vec<f32>> =
        HashMap::from([("a", vec![0.0; 10]), ("b", vec![0.0; 10])]);
    let mut bundle = Vec::new();
    for _ in 0..5 {
        let g = grads(&[
            ("a", &[10], rng.vec(10, 1.0)),
            ("b", &[2, 5], rng.vec(10, 1.0)),
        ]);
        c.compress_bundle(&manifest, &g, 0, &mut bundle).unwrap();
        let mut flat = Vec::new();
        manifest
            .decode_bundle(&bundle, None, None, &mut flat)
            .unwrap();
        assert_eq!(flat.iter().filter(|x| **x != 0.0).count(), 4);
        for n in ["a", "b"] {
            let sent = manifest.slice(&flat, n).unwrap();
            let new = c.feedback().unwrap().residual(n).unwrap();
            for i in 0..10 {
                assert_eq!(
                    (sent[i] + new[i]).to_bits(),
                    (g[n].data()[i] + old[n][i]).to_bits()
                );
            }
            old.insert(n, new.to_vec());
        }
    }
}

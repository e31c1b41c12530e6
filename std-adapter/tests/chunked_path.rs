//! The chunked selection of large top-k, threshold and random-k tensors runs where it should,
//! and gives way where it should, counted by the compressor's [`gradwire::EncodeStats`]. (Its
//! bytes are checked against the core's in `tests/parallel.rs`.)

mod common;

use std::collections::HashMap;

use common::Rng;
use gradwire::BucketConfig;
use gradwire::Manifest;
use gradwire::Parallelism;
use gradwire::core::{K, Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{CompressionMethod, GradientCompressor};

/// Frames selected in chunks during `steps` compressions of `grads`.
fn chunked_frames(
    grads: &HashMap<String, Tensor>,
    method: &CompressionMethod,
    parallelism: Parallelism,
    steps: usize,
) -> u64 {
    counted(grads, method, parallelism, steps).0
}

/// Frames selected in chunks, and error-feedback frames written in one pass, during `steps`
/// compressions of `grads`.
fn counted(
    grads: &HashMap<String, Tensor>,
    method: &CompressionMethod,
    parallelism: Parallelism,
    steps: usize,
) -> (u64, u64) {
    let manifest = Manifest::for_gradients(grads, method, 0, BucketConfig::none()).unwrap();
    let mut c = GradientCompressor::new(method.clone()).with_parallelism(parallelism);
    let mut bundle = Vec::new();
    for _ in 0..steps {
        c.compress_bundle(&manifest, grads, 0, &mut bundle).unwrap();
    }
    let stats = c.encode_stats();
    (stats.selected_in_chunks, stats.one_pass)
}

#[test]
fn large_sparse_tensors_are_selected_in_chunks_unless_the_sample_cannot_serve() {
    let mut rng = Rng(3);
    let large = HashMap::from([
        ("w".to_owned(), Tensor::vector(rng.vec(300_000, 1.0))),
        ("small".to_owned(), Tensor::vector(rng.vec(1000, 1.0))),
    ]);
    let topk = CompressionMethod::top_k_int8(0.01);
    let threshold = CompressionMethod::Threshold { threshold: 0.99 };
    for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
        // Every step, with or without error feedback; top-k with error feedback in one pass
        // over g and r, from the first step (a new residual is zeros, its bound 0). The small
        // tensor never.
        assert_eq!(counted(&large, &topk, parallelism, 3), (3, 0));
        assert_eq!(counted(&large, &threshold, parallelism, 3), (3, 0));
        let ef = topk.clone().with_error_feedback();
        assert_eq!(counted(&large, &ef, parallelism, 3), (3, 3));
        // A constant tensor: every element is a candidate, more than the selection holds, so
        // the core's selection runs (same frame); with error feedback, on the residual's sums.
        let flat = HashMap::from([("w".to_owned(), Tensor::vector(vec![0.5; 300_000]))]);
        assert_eq!(counted(&flat, &topk, parallelism, 2), (0, 0));
        let flat_ef = topk.clone().with_error_feedback();
        assert_eq!(counted(&flat, &flat_ef, parallelism, 2), (0, 2));
        // f16 values and a gradient at or above half their range (32,760): the bound proves
        // nothing. The first step has no residual yet, so the core's step runs, and measures
        // the residual's bound; from the second, one pass (selected in chunks).
        let mut big = rng.vec(300_000, 1.0);
        big[7] = 40_000.0;
        let big = HashMap::from([("w".to_owned(), Tensor::vector(big))]);
        let small = HashMap::from([("w".to_owned(), Tensor::vector(rng.vec(300_000, 1.0)))]);
        let f16 = CompressionMethod::Core(Method::TopK {
            k: K::Ratio(0.01),
            values: Values::F16,
        })
        .with_error_feedback();
        let manifest = Manifest::for_gradients(&big, &f16, 0, BucketConfig::none()).unwrap();
        let mut c = GradientCompressor::new(f16.clone()).with_parallelism(parallelism);
        let mut bundle = Vec::new();
        let mut step = |grads: &HashMap<String, Tensor>| {
            let before = c.encode_stats();
            c.compress_bundle(&manifest, grads, 0, &mut bundle).unwrap();
            let after = c.encode_stats();
            (
                after.selected_in_chunks - before.selected_in_chunks,
                after.one_pass - before.one_pass,
            )
        };
        assert_eq!(step(&big), (0, 0));
        assert_eq!(step(&small), (1, 1));
        assert_eq!(step(&small), (1, 1));
        // Threshold keeping more than the lists hold: the core's streaming writer.
        let low = CompressionMethod::Threshold { threshold: 0.0 };
        assert_eq!(chunked_frames(&large, &low, parallelism, 1), 0);
        // Random-k: drawn in chunks every step (with error feedback after the first), unless
        // it keeps nothing or everything.
        let randomk = CompressionMethod::RandomK { k: 3000 };
        assert_eq!(chunked_frames(&large, &randomk, parallelism, 3), 3);
        let ef = randomk.clone().with_error_feedback();
        assert_eq!(chunked_frames(&large, &ef, parallelism, 3), 2);
        let all = CompressionMethod::RandomK { k: 300_000 };
        assert_eq!(chunked_frames(&large, &all, parallelism, 1), 0);
    }
}

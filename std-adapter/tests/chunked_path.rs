//! The chunked selection of large top-k, threshold and random-k tensors runs where it should, and gives
//! way where it should: one test in its own binary, so that the process-wide count of frames
//! selected in chunks moves only with it. (Its bytes are checked against the core's in
//! `tests/parallel.rs`.)

mod common;

use std::collections::HashMap;

use common::Rng;
use gradwire::bucket::BucketConfig;
use gradwire::bundle::Manifest;
use gradwire::compressor::{CompressionMethod, GradientCompressor};
use gradwire::parallel::{Parallelism, frames_selected_in_chunks};
use gradwire::tensor::Tensor;

/// Frames selected in chunks during `steps` compressions of `grads`.
fn chunked_frames(
    grads: &HashMap<String, Tensor>,
    method: &CompressionMethod,
    parallelism: Parallelism,
    steps: usize,
) -> u64 {
    let manifest = Manifest::for_gradients(grads, method, 0, BucketConfig::none()).unwrap();
    let mut c = GradientCompressor::new(method.clone()).with_parallelism(parallelism);
    let mut bundle = Vec::new();
    let before = frames_selected_in_chunks();
    for _ in 0..steps {
        c.compress_bundle(&manifest, grads, 0, &mut bundle).unwrap();
    }
    frames_selected_in_chunks() - before
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
        // Without error feedback every step; with it, every step after the first (the residual
        // does not exist before). The small tensor never.
        assert_eq!(chunked_frames(&large, &topk, parallelism, 3), 3);
        assert_eq!(chunked_frames(&large, &threshold, parallelism, 3), 3);
        let ef = topk.clone().with_error_feedback();
        assert_eq!(chunked_frames(&large, &ef, parallelism, 3), 2);
        // A constant tensor: every element is a candidate, more than the selection holds, so
        // the core's selection runs (same frame).
        let flat = HashMap::from([("w".to_owned(), Tensor::vector(vec![0.5; 300_000]))]);
        assert_eq!(chunked_frames(&flat, &topk, parallelism, 2), 0);
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

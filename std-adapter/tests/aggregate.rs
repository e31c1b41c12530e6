//! Aggregation: sum, mean, majority vote; validation naming tensor and rank; rank order.

mod common;

use std::collections::HashMap;

use common::{Rng, aggregate, bundles, grads, minilm, noisy, same_bits};
use gradwire::Aggregator;
use gradwire::BucketConfig;
use gradwire::Reduction;
use gradwire::core::{Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{BundleFault, Error};
use gradwire::{CompressionMethod, GradientCompressor};
use gradwire::{Manifest, TensorSpec};

/// The sum of the bundles (made at step 0) as the core decodes them, rank by rank, frame by
/// frame, added in rank order.
fn decoded_sum(manifest: &Manifest, bundles: &[Vec<u8>]) -> Vec<f32> {
    let mut sum = vec![0.0f32; manifest.flat_len()];
    for (rank, bundle) in bundles.iter().enumerate() {
        let mut one = Vec::new();
        manifest
            .decode_bundle(bundle, Some(rank), Some(0), &mut one)
            .unwrap();
        for (e, x) in sum.iter_mut().zip(&one) {
            *e += 1.0 * x;
        }
    }
    sum
}

#[test]
fn mean_of_threes_is_three() {
    let method = CompressionMethod::Core(Method::Dense {
        values: Values::F32,
    });
    let g = grads(&[("w", &[1], vec![3.0])]);
    let manifest = Manifest::for_gradients(&g, &method, 0, BucketConfig::none()).unwrap();
    let b = bundles(&manifest, &method, &[g.clone(), g.clone(), g.clone()]);
    assert_eq!(
        aggregate(&manifest, &b, 0, Reduction::Mean).unwrap(),
        vec![3.0]
    );
    assert_eq!(
        aggregate(&manifest, &b, 0, Reduction::Sum).unwrap(),
        vec![9.0]
    );
}

/// Sum and mean equal the f32 sum of each rank's decoded contribution, in rank order, divided
/// once by W: bit for bit.
#[test]
fn sum_and_mean_in_rank_order() {
    let base = minilm();
    let ranks: Vec<HashMap<String, Tensor>> =
        (0..4).map(|r| noisy(&base, &mut Rng(r), 0.5)).collect();
    for (method, cfg) in [
        (CompressionMethod::top_k_int8(0.01), BucketConfig::none()),
        (
            CompressionMethod::top_k_int8(0.01),
            BucketConfig::fused(64 << 10),
        ),
        (CompressionMethod::SignSGD, BucketConfig::none()),
        (
            CompressionMethod::RandomK { k: 500 },
            BucketConfig::fused(64 << 10),
        ),
    ] {
        let manifest = Manifest::for_gradients(&base, &method, 0, cfg).unwrap();
        let b = bundles(&manifest, &method, &ranks);
        let expected = decoded_sum(&manifest, &b);
        let sum = aggregate(&manifest, &b, 0, Reduction::Sum).unwrap();
        assert!(same_bits(&sum, &expected), "{method:?}");
        let mean = aggregate(&manifest, &b, 0, Reduction::Mean).unwrap();
        let expected_mean: Vec<f32> = expected.iter().map(|x| x / 4.0).collect();
        assert!(same_bits(&mean, &expected_mean), "{method:?}");
    }
}

#[test]
fn large_randomk_entries_sum_as_the_core_decodes_them() {
    // Tensors past the split size: the indices are drawn once for all ranks, serially and in
    // parallel; the sum must be the core decoder's frame by frame, with every value codec and
    // the unbiased scaling.
    use gradwire::Parallelism;
    use gradwire::core::K;
    let mut rng = Rng(21);
    let base = HashMap::from([
        ("w".to_owned(), Tensor::vector(rng.vec(300_001, 1.0))),
        ("b".to_owned(), Tensor::vector(rng.vec(70, 1.0))),
    ]);
    let ranks: Vec<HashMap<String, Tensor>> = (0..3)
        .map(|r| noisy(&base, &mut Rng(30 + r), 0.5))
        .collect();
    let core = |values, unbiased| {
        CompressionMethod::Core(Method::RandomK {
            k: K::Ratio(0.02),
            values,
            unbiased,
        })
    };
    for method in [
        CompressionMethod::RandomK { k: 4000 },
        core(Values::Int8 { block: 256 }, true),
        core(Values::Bf16, false),
        core(Values::F16, true),
    ] {
        let manifest = Manifest::for_gradients(&base, &method, 0, BucketConfig::none()).unwrap();
        let b = bundles(&manifest, &method, &ranks);
        let expected = decoded_sum(&manifest, &b);
        let sum = aggregate(&manifest, &b, 0, Reduction::Sum).unwrap();
        assert!(same_bits(&sum, &expected), "{method:?}");
        let mut par = Vec::new();
        Aggregator::new()
            .with_parallelism(Parallelism::Parallel)
            .aggregate_into(&manifest, &b, 0, Reduction::Sum, &mut par)
            .unwrap();
        assert!(same_bits(&par, &expected), "{method:?} in parallel");
    }
}

#[test]
fn majority_vote_ties_go_to_plus() {
    let method = CompressionMethod::SignSGDMajority;
    let votes = [
        vec![1.0, 1.0, -1.0, -1.0, 0.0],
        vec![1.0, -1.0, -1.0, 1.0, -0.0],
        vec![-1.0, -1.0, -1.0, 1.0, -2.0],
        vec![1.0, 1.0, -1.0, -1.0, -3.0],
    ];
    let ranks: Vec<_> = votes
        .iter()
        .map(|v| grads(&[("w", &[5], v.clone())]))
        .collect();
    let manifest = Manifest::for_gradients(&ranks[0], &method, 0, BucketConfig::none()).unwrap();
    let b = bundles(&manifest, &method, &ranks);
    let out = aggregate(&manifest, &b, 0, Reduction::MajorityVote).unwrap();
    // Columns: 3+, 2-2 tie, 4-, 2-2 tie, 0 and -0 count as + (2 vs 2: tie).
    assert_eq!(out, vec![1.0, 1.0, -1.0, 1.0, 1.0]);
    let three = aggregate(&manifest, &b[..3], 0, Reduction::MajorityVote).unwrap();
    assert_eq!(three, vec![1.0, -1.0, -1.0, 1.0, 1.0]);
    // Majority vote of scaled frames is refused.
    let scaled = CompressionMethod::SignSGD;
    let m2 = Manifest::for_gradients(&ranks[0], &scaled, 0, BucketConfig::none()).unwrap();
    let b2 = bundles(&m2, &scaled, &ranks);
    assert!(matches!(
        aggregate(&m2, &b2, 0, Reduction::MajorityVote),
        Err(Error::Config { .. })
    ));
}

/// A peer whose tensor has the same name and element count in another shape (a transposed
/// weight) is an error naming the tensor and the rank, on any transport: the entry ids of a
/// bundle hash the shapes. (Found by a new user's trial: bundle version 1 averaged the two
/// layouts element by element.)
#[test]
fn a_transposed_peer_tensor_is_an_error() {
    let method = CompressionMethod::top_k_int8(0.5);
    let data: Vec<f32> = (0..24).map(|i| i as f32 - 12.5).collect();
    let g0 = grads(&[("w", &[4, 6], data.clone())]);
    let g1 = grads(&[("w", &[6, 4], data)]);
    let m0 = Manifest::for_gradients(&g0, &method, 0, BucketConfig::none()).unwrap();
    let m1 = Manifest::for_gradients(&g1, &method, 0, BucketConfig::none()).unwrap();
    let mut b = bundles(&m0, &method, &[g0.clone(), g0]);
    GradientCompressor::new(method)
        .compress_bundle(&m1, &g1, 1, &mut b[1])
        .unwrap();
    let err = aggregate(&m0, &b, 0, Reduction::Mean).unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedEntry { rank: Some(1), expected, expected_elements: 24, got_elements: Some(24), .. } if expected == "w"),
        "{err}"
    );
}

#[test]
fn contributions_are_checked_first_naming_tensor_and_rank() {
    let method = CompressionMethod::TopK { k: 2 };
    let g = grads(&[
        ("a", &[4], vec![1.0, -2.0, 3.0, 4.0]),
        ("b", &[3], vec![1.0, 2.0, 3.0]),
    ]);
    let manifest = Manifest::for_gradients(&g, &method, 0, BucketConfig::none()).unwrap();
    let mut b = bundles(&manifest, &method, &[g.clone(), g.clone(), g.clone()]);
    let mut out = vec![42.0f32; 2];

    // Rank 2 used another method: error names `a` and rank 2; nothing accumulated.
    let other_method = CompressionMethod::TopK { k: 1 };
    let other = Manifest::for_gradients(&g, &other_method, 0, BucketConfig::none()).unwrap();
    let mut c = GradientCompressor::new(other_method);
    c.compress_bundle(&other, &g, 2, &mut b[2]).unwrap();
    let err = Aggregator::serial()
        .aggregate_into(&manifest, &b, 0, Reduction::Mean, &mut out)
        .unwrap_err();
    assert!(
        matches!(&err, Error::ParamsDiffer { tensor, rank: Some(2), .. } if tensor == "a"),
        "{err}"
    );
    assert_eq!(out, vec![42.0; 2], "untouched");

    // Rank 1 has a different model (`b` longer).
    let g_long = grads(&[("a", &[4], vec![1.0; 4]), ("b", &[5], vec![1.0; 5])]);
    let long = Manifest::for_gradients(&g_long, &method, 0, BucketConfig::none()).unwrap();
    let mut b = bundles(&manifest, &method, &[g.clone(), g.clone()]);
    let mut c = GradientCompressor::new(method.clone());
    c.compress_bundle(&long, &g_long, 1, &mut b[1]).unwrap();
    let err = Aggregator::serial()
        .aggregate_into(&manifest, &b, 0, Reduction::Sum, &mut out)
        .unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedEntry { rank: Some(1), index: 1, expected, expected_elements: 3, got_elements: Some(5), .. } if expected == "b"),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("`b`") && text.contains("rank 1"), "{text}");

    // Bundles out of rank order.
    let b = bundles(&manifest, &method, &[g.clone(), g.clone()]);
    let swapped = vec![b[1].clone(), b[0].clone()];
    let err = Aggregator::serial()
        .aggregate_into(&manifest, &swapped, 0, Reduction::Sum, &mut out)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                rank: Some(0),
                fault: BundleFault::Rank {
                    expected: 0,
                    got: 1
                }
            }
        ),
        "{err}"
    );
    // Another step.
    let err = Aggregator::serial()
        .aggregate_into(&manifest, &b, 3, Reduction::Sum, &mut out)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                fault: BundleFault::Step { .. },
                ..
            }
        ),
        "{err}"
    );
    // Missing tensor: a rank whose manifest lacks `b`.
    let only_a = grads(&[("a", &[4], vec![1.0; 4])]);
    let m_a = Manifest::new(
        vec![TensorSpec::new("a", [4])],
        &method,
        0,
        BucketConfig::none(),
    )
    .unwrap();
    let mut b = bundles(&manifest, &method, &[g.clone(), g.clone()]);
    let mut c = GradientCompressor::new(method.clone());
    c.compress_bundle(&m_a, &only_a, 1, &mut b[1]).unwrap();
    let err = Aggregator::serial()
        .aggregate_into(&manifest, &b, 0, Reduction::Sum, &mut out)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                rank: Some(1),
                fault: BundleFault::EntryCount {
                    expected: 2,
                    got: 1,
                    ..
                }
            }
        ),
        "{err}"
    );
    // The message names the tensor that rank 1 lacks.
    assert_eq!(
        err.to_string(),
        "bundle from rank 1 holds 1 entries, the manifest has 2 (the bundle ends before entry \
         1, where the manifest has `b`)"
    );
    // No contribution.
    let none: [Vec<u8>; 0] = [];
    let err = Aggregator::serial()
        .aggregate_into(&manifest, &none, 0, Reduction::Sum, &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("no contributions"), "{err}");
    assert_eq!(out, vec![42.0; 2], "untouched by every failed check");
}

//! CompressedAllReduce: the original module's semantics, and the communicator path over
//! LocalGroup threads. (Moved from `tests/allreduce.rs`: it runs the crate-private
//! `all_reduce_with_peers_at` and `with_bucketing`.)

use std::collections::HashMap;

use super::test_collectives::contribution;
use super::test_common::{Owned, Rng, aggregate, grads, minilm, noisy, same_bits, views};
use gradwire::BucketConfig;
use gradwire::Collective;
use gradwire::CompressedAllReduce;
use gradwire::Error;
use gradwire::Manifest;
use gradwire::Reduction;
use gradwire::comm::{Communicator, LocalCommunicator, LocalGroup};
use gradwire::core::{Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{CompressedGradient, CompressionMethod, GradientCompressor, Parallelism};

#[test]
fn test_compressed_all_reduce() {
    // Aggregating across 4 ranks with no communicator must be an error, not a rescaling.
    let mut all_reduce = CompressedAllReduce::new(CompressionMethod::TopK { k: 2 }, 4);
    let gradients = grads(&[("param1", &[4], vec![0.4, 0.8, 0.2, -0.6])]);
    let err = all_reduce.all_reduce(&gradients).unwrap_err();
    assert!(
        matches!(err, Error::NoCommunicator { world_size: 4 }),
        "{err}"
    );
    // World size 0 is a configuration error of its own, not a missing communicator.
    let mut none = CompressedAllReduce::new(CompressionMethod::TopK { k: 2 }, 0);
    let err = none.all_reduce(&gradients).unwrap_err();
    assert!(
        matches!(err, Error::Config { .. }) && err.to_string().contains("world size 0"),
        "{err}"
    );
    let err = none.all_reduce_with_peers(&gradients, &[]).unwrap_err();
    assert!(
        matches!(err, Error::Config { .. }) && err.to_string().contains("world size 0"),
        "{err}"
    );
}

#[test]
fn test_single_rank_all_reduce_is_a_round_trip() {
    let gradients = grads(&[("param1", &[2, 2], vec![0.4, -0.8, 0.2, -0.6])]);
    let mut unscaled = CompressedAllReduce::new(CompressionMethod::SignSGDMajority, 1);
    let result = unscaled.all_reduce(&gradients).unwrap();
    assert_eq!(
        result["param1"].data(),
        &[1.0, -1.0, 1.0, -1.0],
        "only the sign"
    );
    assert_eq!(result["param1"].shape(), &[2, 2]);
    // EF-signSGD: ±mean|g| = ±0.5.
    let mut scaled = CompressedAllReduce::new(CompressionMethod::SignSGD, 1);
    let result = scaled.all_reduce(&gradients).unwrap();
    assert_eq!(result["param1"].data(), &[0.5, -0.5, 0.5, -0.5]);
}

#[test]
fn test_all_reduce_with_peers_sums_and_averages() {
    let mut all_reduce = CompressedAllReduce::new(CompressionMethod::SignSGD, 3);
    let local = grads(&[("w", &[2], vec![1.0, 1.0])]);
    // Two peers, both reporting the opposite sign on the second coordinate.
    let mut peer = GradientCompressor::new(CompressionMethod::SignSGD);
    let peer_payload = peer
        .compress(&grads(&[("w", &[2], vec![1.0, -1.0])]))
        .unwrap();
    let result = all_reduce
        .all_reduce_with_peers(&local, &[peer_payload.clone(), peer_payload.clone()])
        .unwrap();
    let values = result["w"].data();
    // Coordinate 0: (1 + 1 + 1) / 3 = 1. Coordinate 1: (1 - 1 - 1) / 3 = -1/3.
    assert_eq!(values[0], 1.0);
    assert_eq!(values[1], (1.0f32 - 1.0 - 1.0) / 3.0);

    // Wrong number of contributions.
    let err = all_reduce
        .all_reduce_with_peers(&local, std::slice::from_ref(&peer_payload))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorldSize {
                expected: 3,
                got: 2
            }
        ),
        "{err}"
    );
    // A peer with another length: error naming the tensor and the rank; nothing changes.
    let step = all_reduce.compressor().step();
    let mut other = GradientCompressor::new(CompressionMethod::SignSGD);
    let longer = other
        .compress(&grads(&[("w", &[3], vec![1.0, -1.0, 1.0])]))
        .unwrap();
    let mut peer = GradientCompressor::new(CompressionMethod::SignSGD);
    peer.compress(&grads(&[("w", &[2], vec![1.0, -1.0])]))
        .unwrap();
    let good = peer
        .compress(&grads(&[("w", &[2], vec![1.0, -1.0])]))
        .unwrap();
    let err = all_reduce
        .all_reduce_with_peers_at(&local, 1, &[good, longer])
        .unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { tensor, rank: Some(2), .. } if tensor == "w"),
        "{err}"
    );
    assert_eq!(
        all_reduce.compressor().step(),
        step,
        "peers are checked first"
    );
}

#[test]
fn told_the_local_rank_every_rank_gets_the_same_bits() {
    let base = minilm();
    let w = 3;
    let ranks: Vec<HashMap<String, Tensor>> = (0..w)
        .map(|r| noisy(&base, &mut Rng(10 + r as u64), 1.0))
        .collect();
    let method = CompressionMethod::top_k_int8(0.01);
    let payloads: Vec<_> = ranks
        .iter()
        .map(|g| GradientCompressor::new(method.clone()).compress(g).unwrap())
        .collect();
    let mut results = Vec::new();
    for (rank, g) in ranks.iter().enumerate() {
        let mut ar = CompressedAllReduce::new(method.clone(), w);
        let peers: Vec<_> = (0..w)
            .filter(|&r| r != rank)
            .map(|r| payloads[r].clone())
            .collect();
        results.push(ar.all_reduce_with_peers_at(g, rank, &peers).unwrap());
    }
    for name in base.keys() {
        for r in 1..w {
            assert!(
                same_bits(results[0][name].data(), results[r][name].data()),
                "{name}"
            );
        }
    }
}

/// Runs `f` on `w` threads, one per rank of a `LocalGroup`, with that rank's communicator;
/// returns each rank's result in rank order.
fn on_every_rank<T: Send + 'static>(
    w: usize,
    f: impl Fn(LocalCommunicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = LocalGroup::new(w)
        .into_communicators()
        .into_iter()
        .map(|comm| {
            let f = std::sync::Arc::clone(&f);
            std::thread::spawn(move || f(comm))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn run_group(
    w: usize,
    method: &CompressionMethod,
    bucketing: BucketConfig,
    reduction: Reduction,
    per_rank: &[Vec<HashMap<String, Tensor>>],
) -> Vec<Vec<HashMap<String, Tensor>>> {
    run_group_with(w, method, bucketing, reduction, Parallelism::Auto, per_rank)
}

fn run_group_with(
    w: usize,
    method: &CompressionMethod,
    bucketing: BucketConfig,
    reduction: Reduction,
    parallelism: Parallelism,
    per_rank: &[Vec<HashMap<String, Tensor>>],
) -> Vec<Vec<HashMap<String, Tensor>>> {
    let (method, per_rank) = (method.clone(), per_rank.to_vec());
    on_every_rank(w, move |comm| {
        let steps = &per_rank[comm.rank()];
        let mut ar = CompressedAllReduce::with_communicator(method.clone(), Box::new(comm))
            .with_seed(9)
            .with_bucketing(bucketing)
            .with_reduction(reduction)
            .with_parallelism(parallelism);
        let mut outs = Vec::new();
        let mut out = HashMap::new();
        for g in steps {
            ar.all_reduce_into(g, &mut out).unwrap();
            outs.push(out.clone());
        }
        outs
    })
}

/// Four ranks as threads: every rank gets bit-identical results, equal to aggregating the
/// bundles the ranks send, step after step (error feedback included), with buckets (through
/// the flat layout) and without (straight into the output tensors), serial and pooled.
#[test]
fn local_group_all_reduce() {
    let topk = CompressionMethod::top_k_int8(0.01).with_error_feedback();
    for (bucketing, parallelism) in [
        (BucketConfig::fused(64 << 10), Parallelism::Auto),
        (BucketConfig::none(), Parallelism::Auto),
        (BucketConfig::none(), Parallelism::Serial),
        (BucketConfig::none(), Parallelism::Parallel),
    ] {
        local_group_all_reduce_with(&topk, bucketing, parallelism);
    }
    // Without error feedback and buckets, dense bundles are written as they are sent (issue
    // 46): the bundles of the compressor all the same.
    for values in [Values::Bf16, Values::F16] {
        let dense = CompressionMethod::Core(Method::Dense { values });
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            local_group_all_reduce_with(&dense, BucketConfig::none(), parallelism);
        }
    }
}

fn local_group_all_reduce_with(
    method: &CompressionMethod,
    bucketing: BucketConfig,
    parallelism: Parallelism,
) {
    let base = minilm();
    let w = 4;
    let steps = 3;
    let per_rank: Vec<Vec<HashMap<String, Tensor>>> = (0..w)
        .map(|r| {
            (0..steps)
                .map(|s| noisy(&base, &mut Rng((r * 100 + s) as u64), 0.5))
                .collect()
        })
        .collect();
    let method = method.clone();
    let results = run_group_with(
        w,
        &method,
        bucketing,
        Reduction::Mean,
        parallelism,
        &per_rank,
    );

    // The same computation by hand: each rank's compressor makes its bundle, aggregated.
    let manifest = Manifest::for_gradients(&base, &method, 9, bucketing).unwrap();
    let mut senders: Vec<_> = (0..w)
        .map(|_| GradientCompressor::new(method.clone()).with_seed(9))
        .collect();
    for s in 0..steps {
        let bundles: Vec<Vec<u8>> = (0..w)
            .map(|r| {
                let mut b = Vec::new();
                senders[r]
                    .compress_bundle(&manifest, &per_rank[r][s], r, &mut b)
                    .unwrap();
                b
            })
            .collect();
        let flat = aggregate(&manifest, &bundles, s as u64, Reduction::Mean).unwrap();
        let expected = manifest.to_tensors(&flat).unwrap();
        for (r, result) in results.iter().enumerate() {
            for (name, t) in &expected {
                assert_eq!(result[s][name].shape(), t.shape());
                assert!(
                    same_bits(result[s][name].data(), t.data()),
                    "{method:?} {bucketing:?} {parallelism:?}: rank {r} step {s} {name}"
                );
            }
        }
    }
}

/// An all-gather whose f32 sum overflows, aggregated straight into the output tensors: every
/// rank returns the same `Error::Overflow` naming the tensor and element, its outputs zeroed,
/// serial and pooled; the next step runs.
#[test]
fn an_all_gather_overflow_names_the_element_and_zeroes_the_outputs() {
    let keep_all = gradwire::core::Method::TopK {
        k: gradwire::core::K::Ratio(1.0),
        values: gradwire::core::Values::F32,
    };
    for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
        let results = on_every_rank(3, move |comm| {
            let rank = comm.rank();
            let mut ar = CompressedAllReduce::with_communicator(
                CompressionMethod::Core(keep_all),
                Box::new(comm),
            )
            .with_parallelism(parallelism);
            let mut big = vec![0.25f32; 100_000];
            big[70_001] = 3e38;
            let g = grads(&[
                ("a", &[3], vec![1.0, 2.0, rank as f32]),
                ("big", &[100_000], big),
            ]);
            let mut out = HashMap::new();
            let err = ar.all_reduce_into(&g, &mut out);
            let zeroed = out.values().all(|t| t.data().iter().all(|&x| x == 0.0));
            let next = ar
                .all_reduce_into(
                    &grads(&[
                        ("a", &[3], vec![1.0; 3]),
                        ("big", &[100_000], vec![0.5; 100_000]),
                    ]),
                    &mut out,
                )
                .map(|()| out["big"].data()[70_001]);
            (err, zeroed, next.map_err(|e| e.to_string()))
        });
        for (rank, (err, zeroed, next)) in results.into_iter().enumerate() {
            let what = format!("{parallelism:?} rank {rank}");
            assert!(
                matches!(&err, Err(Error::Overflow { tensor, index }) if tensor == "big" && *index == 70_001),
                "{what}: {err:?}"
            );
            assert!(zeroed, "{what}: outputs zeroed");
            assert_eq!(next, Ok(0.5), "{what}: the next step");
        }
    }
}

/// A large dense, quantization or sign entry is summed chunk by chunk, each chunk taking the
/// first rank's values as they are (on the all-gather; at the owner of each shard on the
/// two-phase collective): a zero of the result is still 0.0, never -0.0, as in a sum started
/// from 0.0 (here every rank sends -0.0 at even indices), on one, two and three ranks, summed
/// and averaged, serial and pooled; the other coordinates are the exact sums.
#[test]
fn zeros_of_a_chunked_sum_are_positive() {
    // bf16: dense f32 takes the f32 all-reduce, which sums without frames.
    let dense_bf16 = gradwire::core::Method::Dense {
        values: gradwire::core::Values::Bf16,
    };
    let n = 140_000; // above the size from which an entry is summed in chunks (131,072)
    let runs = [1usize, 2, 3].into_iter().flat_map(|w| {
        [Collective::AllGather, Collective::TwoPhase]
            .into_iter()
            .map(move |c| (w, c))
    });
    for (w, collective) in runs {
        for reduction in [Reduction::Sum, Reduction::Mean] {
            for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
                let results = on_every_rank(w, move |comm| {
                    let rank = comm.rank();
                    let mut ar = CompressedAllReduce::with_communicator(
                        CompressionMethod::Core(dense_bf16),
                        Box::new(comm),
                    )
                    .with_collective(collective)
                    .with_reduction(reduction)
                    .with_parallelism(parallelism);
                    let g: Vec<f32> = (0..n)
                        .map(|i| if i % 2 == 0 { -0.0 } else { (rank + 1) as f32 })
                        .collect();
                    let mut out = HashMap::new();
                    ar.all_reduce_into(&grads(&[("big", &[n], g)]), &mut out)
                        .map(|()| out["big"].data().to_vec())
                });
                let sum: f32 = (1..=w).map(|r| r as f32).sum();
                let odd = match reduction {
                    Reduction::Mean => sum / w as f32,
                    _ => sum,
                };
                for (rank, out) in results.into_iter().enumerate() {
                    let what = format!(
                        "W = {w}, {collective:?}, {reduction:?}, {parallelism:?}, rank {rank}"
                    );
                    let out = out.unwrap_or_else(|e| panic!("{what}: {e}"));
                    let negative = out.iter().position(|x| x.to_bits() == (-0.0f32).to_bits());
                    assert_eq!(negative, None, "{what}: a -0.0 in the result");
                    let wrong = (0..n).find(|&i| {
                        let due = if i % 2 == 0 { 0.0f32 } else { odd };
                        out[i].to_bits() != due.to_bits()
                    });
                    assert_eq!(wrong, None, "{what}: a coordinate other than its sum");
                }
            }
        }
    }
}

/// A mean that rounds to zero from below is -0.0, as dividing the sum gives it (review finding:
/// taking -0.0 to 0.0 after the division made it 0.0): rank 0 sends the smallest negative
/// subnormal, the others 0.0; at W = 2, 3 and 4 (multiplied by the inverse at 2 and 4), on
/// both collectives.
#[test]
fn a_negative_mean_that_rounds_to_zero_stays_negative_zero() {
    let keep_all = gradwire::core::Method::TopK {
        k: gradwire::core::K::Ratio(1.0),
        values: gradwire::core::Values::F32,
    };
    let n = 140_000;
    let tiny = f32::from_bits(0x8000_0001);
    for w in [2usize, 3, 4] {
        for collective in [Collective::AllGather, Collective::TwoPhase] {
            let results = on_every_rank(w, move |comm| {
                let rank = comm.rank();
                let mut ar = CompressedAllReduce::with_communicator(
                    CompressionMethod::Core(keep_all),
                    Box::new(comm),
                )
                .with_collective(collective)
                .with_parallelism(Parallelism::Serial);
                let mut g = vec![1.0f32; n];
                g[7] = if rank == 0 { tiny } else { 0.0 };
                let mut out = HashMap::new();
                ar.all_reduce_into(&grads(&[("big", &[n], g)]), &mut out)
                    .map(|()| (out["big"].data()[7].to_bits(), out["big"].data()[8]))
            });
            for (rank, got) in results.into_iter().enumerate() {
                let what = format!("W = {w}, {collective:?}, rank {rank}");
                let (bits, other) = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(bits, 0x8000_0000, "{what}: the mean's bits");
                assert_eq!(other, 1.0, "{what}: another coordinate");
            }
        }
    }
}

#[test]
fn local_group_majority_vote_and_world_size_one() {
    let mut rng = Rng(3);
    let w = 3;
    let per_rank: Vec<Vec<HashMap<String, Tensor>>> = (0..w)
        .map(|_| {
            vec![grads(&[
                ("w", &[10], rng.vec(10, 1.0)),
                ("s", &[], vec![rng.unit()]),
            ])]
        })
        .collect();
    let method = CompressionMethod::SignSGDMajority;
    let results = run_group(
        w,
        &method,
        BucketConfig::none(),
        Reduction::MajorityVote,
        &per_rank,
    );
    for name in ["w", "s"] {
        let n = per_rank[0][0][name].data().len();
        for i in 0..n {
            let votes: i32 = (0..w)
                .map(|r| {
                    if per_rank[r][0][name].data()[i] < 0.0 {
                        -1
                    } else {
                        1
                    }
                })
                .sum();
            let expected = if votes >= 0 { 1.0 } else { -1.0 };
            for result in &results {
                assert_eq!(result[0][name].data()[i], expected);
            }
        }
    }
    // A group of one with a communicator: a round trip.
    let g = grads(&[("w", &[3], vec![1.0, -2.0, 3.0])]);
    let results = run_group(
        1,
        &CompressionMethod::TopK { k: 2 },
        BucketConfig::none(),
        Reduction::Mean,
        &[vec![g]],
    );
    assert_eq!(results[0][0]["w"].data(), &[0.0, -2.0, 3.0]);
}

#[test]
fn ranks_that_disagree_fail_on_every_rank() {
    // Rank 1 has another model: every rank gets the same error, naming the tensor and rank 1
    // (and rank 0, whose configuration the others are compared with).
    let per_rank = [
        grads(&[("w", &[4], vec![1.0, 2.0, 3.0, 4.0])]),
        grads(&[("w", &[5], vec![1.0, 2.0, 3.0, 4.0, 5.0])]),
    ];
    let errors: Vec<String> = all_reduce_errors(
        CompressionMethod::TopK { k: 2 },
        BucketConfig::none(),
        per_rank.to_vec(),
    )
    .into_iter()
    .map(Option::unwrap)
    .collect();
    assert_eq!(
        errors[0],
        "rank 1 is configured differently from rank 0: tensor `w` is `w:[5]` there, `w:[4]` \
         on rank 0"
    );
    assert_eq!(errors[1], errors[0]);
}

/// Runs one `all_reduce` per rank (rank `r` with `per_rank[r]`) on a `LocalGroup` and returns
/// each rank's error message (`None` on success).
fn all_reduce_errors(
    method: CompressionMethod,
    bucketing: BucketConfig,
    per_rank: Vec<HashMap<String, Tensor>>,
) -> Vec<Option<String>> {
    let methods = vec![method; per_rank.len()];
    all_reduce_errors_per_rank(&methods, bucketing, per_rank)
}

/// [`all_reduce_errors`] with rank `r` compressing with `methods[r]`.
fn all_reduce_errors_per_rank(
    methods: &[CompressionMethod],
    bucketing: BucketConfig,
    per_rank: Vec<HashMap<String, Tensor>>,
) -> Vec<Option<String>> {
    let methods = methods.to_vec();
    on_every_rank(per_rank.len(), move |comm| {
        let r = comm.rank();
        let mut ar = CompressedAllReduce::with_communicator(methods[r].clone(), Box::new(comm))
            .with_bucketing(bucketing);
        ar.all_reduce(&per_rank[r]).err().map(|e| e.to_string())
    })
}

#[test]
fn ranks_with_other_methods_are_told_their_configurations_differ() {
    // Rank 0 keeps 1%, rank 1 keeps 2%: every rank is told so, naming the method. (The error
    // once read "rank 1 sent N bytes, more than the limit", as if rank 1's bundle were bad.)
    let data: Vec<f32> = (0..4096).map(|i| (i % 89) as f32 - 44.0).collect();
    let g = grads(&[("w", &[4096], data)]);
    let ratio = |ratio| CompressionMethod::TopKRatio {
        ratio,
        values: gradwire::core::Values::F32,
    };
    let errors = all_reduce_errors_per_rank(
        &[ratio(0.01), ratio(0.02)],
        BucketConfig::none(),
        vec![g.clone(), g],
    );
    for (r, e) in errors.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} succeeded"));
        assert_eq!(
            e,
            "rank 1 is configured differently from rank 0: method is `topk k=ratio:0.02 \
             values=f32` there, `topk k=ratio:0.01 values=f32` on rank 0",
            "rank {r}"
        );
    }
}

#[test]
fn same_counts_in_other_shapes_fail_on_every_rank() {
    // A [256, 64] against a [64, 256] used to be averaged element by element. The layout is
    // part of the configuration every rank checks: the same error everywhere, naming the
    // tensor, its shapes and the rank.
    let data: Vec<f32> = (0..16_384).map(|i| (i % 97) as f32 - 48.0).collect();
    let small: Vec<f32> = (0..24).map(|i| i as f32 - 12.0).collect();
    let cases = [
        (
            CompressionMethod::TopKRatio {
                ratio: 0.01,
                values: gradwire::core::Values::F32,
            }
            .with_error_feedback(),
            BucketConfig::none(),
            [("w", vec![256, 64]), ("w", vec![64, 256])],
            data.clone(),
        ),
        (
            CompressionMethod::Quantization { bits: 4 },
            BucketConfig::none(),
            [("w", vec![4, 6]), ("w", vec![6, 4])],
            small.clone(),
        ),
        (
            CompressionMethod::TopK { k: 3 },
            BucketConfig::fused(1 << 20),
            [("w", vec![4, 6]), ("w", vec![6, 4])],
            small.clone(),
        ),
    ];
    for (method, bucketing, shapes, values) in cases {
        let per_rank: Vec<_> = shapes
            .iter()
            .map(|(name, shape)| {
                let mut g = grads(&[(name, shape.as_slice(), values.clone())]);
                // A second tensor, so that buckets fuse something.
                g.insert("b".to_string(), Tensor::vector(vec![0.5, -1.5, 2.0]));
                g
            })
            .collect();
        let errors = all_reduce_errors(method.clone(), bucketing, per_rank);
        let (s0, s1) = (&shapes[0].1, &shapes[1].1);
        for (r, e) in errors.iter().enumerate() {
            let e = e.as_deref().unwrap_or("");
            assert_eq!(
                e,
                format!(
                    "rank 1 is configured differently from rank 0: tensor `w` is `w:{s1:?}` \
                     there, `w:{s0:?}` on rank 0"
                ),
                "{method:?} rank {r}"
            );
        }
        // The same shapes on both ranks succeed.
        let same: Vec<_> = (0..2)
            .map(|_| {
                let (name, shape) = &shapes[0];
                let mut g = grads(&[(name, shape.as_slice(), values.clone())]);
                g.insert("b".to_string(), Tensor::vector(vec![0.5, -1.5, 2.0]));
                g
            })
            .collect();
        assert_eq!(all_reduce_errors(method, bucketing, same), vec![None, None]);
    }
}

#[test]
fn a_rank_that_fails_locally_does_not_hang_its_peers() {
    let w = 3;
    let per_rank: Vec<HashMap<String, Tensor>> = (0..w)
        .map(|r| {
            let x = if r == 1 { f32::NAN } else { 1.0 };
            grads(&[("w", &[3], vec![1.0, x, 2.0])])
        })
        .collect();
    let results = on_every_rank(w, move |comm| {
        let g = per_rank[comm.rank()].clone();
        let good = grads(&[("w", &[3], vec![1.0, 2.0, 3.0])]);
        let mut ar = CompressedAllReduce::with_communicator(
            CompressionMethod::TopK { k: 1 },
            Box::new(comm),
        );
        let first = ar.all_reduce(&g).map(|_| ()).map_err(|e| e.to_string());
        // The group stays usable.
        let second = ar.all_reduce(&good).unwrap();
        (first, second)
    });
    let err1 = results[1].0.as_ref().unwrap_err();
    assert!(err1.contains("`w`") && err1.contains("NaN"), "{err1}");
    for r in [0, 2] {
        let err = results[r].0.as_ref().unwrap_err();
        assert_eq!(
            err,
            &format!("rank 1 could not take part in this step: {err1}")
        );
    }
    for (_, second) in &results {
        assert_eq!(second["w"].data(), &[0.0, 0.0, 3.0]);
    }
}

/// A step that fails in the collective (here: rank 1's gradient holds a NaN) loses nothing on the
/// ranks whose compression succeeded: their residuals take back what they sent, so they hold
/// the whole gradient of the failed step (bit for bit, for top-k with int8 values), and the
/// next step sends it.
#[test]
fn a_failed_step_gives_the_sent_values_back_to_the_residuals() {
    let w = 3;
    let data = |r: usize| -> Vec<f32> {
        (0..4096)
            .map(|i| ((i * 37 + r * 11) % 101) as f32 - 50.0 + 0.001 * i as f32)
            .collect()
    };
    let per_rank: Vec<HashMap<String, Tensor>> = (0..w)
        .map(|r| {
            let mut d = data(r);
            if r == 1 {
                d[7] = f32::NAN;
            }
            grads(&[("w", &[4096], d)])
        })
        .collect();
    let results = on_every_rank(w, move |comm| {
        let g = &per_rank[comm.rank()];
        let method = CompressionMethod::top_k_int8(0.01).with_error_feedback();
        let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm));
        let failed = ar.all_reduce(g).is_err();
        let residual = ar
            .compressor()
            .feedback()
            .and_then(|f| f.residual("w"))
            .map(<[f32]>::to_vec);
        (failed, residual, ar.compressor().step())
    });
    for (r, (failed, residual, step)) in results.iter().enumerate() {
        assert!(failed, "rank {r}");
        assert_eq!(*step, 1, "rank {r}: the group stays in step");
        let residual = residual.as_deref().unwrap_or(&[]);
        if r == 1 {
            // The rank with the NaN changed nothing.
            assert!(residual.iter().all(|&x| x == 0.0), "rank 1");
        } else {
            assert!(
                same_bits(residual, &data(r)),
                "rank {r}: the residual is the gradient"
            );
        }
    }
}

/// A peer frame whose header is valid but whose body is not (a NaN value, CRC recomputed) fails
/// before the local compression: the step and the residuals do not change.
#[test]
fn a_peer_with_an_invalid_body_changes_no_local_state() {
    let method = CompressionMethod::TopK { k: 1 }.with_error_feedback();
    let g = grads(&[("w", &[3], vec![1.0, -3.0, 0.5])]);
    let mut peer = GradientCompressor::new(method.clone());
    let mut ar = CompressedAllReduce::new(method, 2);
    let residual = |ar: &CompressedAllReduce| {
        ar.compressor()
            .feedback()
            .and_then(|f| f.residual("w"))
            .map(<[f32]>::to_vec)
    };
    let bad = |good: &HashMap<String, CompressedGradient>| {
        let mut frame = good["w"].frame().to_vec();
        let l = frame.len();
        frame[l - 8..l - 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let crc = crc32fast::hash(&frame[..l - 4]);
        frame[l - 4..].copy_from_slice(&crc.to_le_bytes());
        let cg = CompressedGradient::from_frame(frame, vec![3], good["w"].step()).unwrap();
        HashMap::from([("w".to_owned(), cg)])
    };
    for step in 0..2u64 {
        let good = peer.compress(&g).unwrap();
        let before = residual(&ar);
        let err = ar.all_reduce_with_peers(&g, &[bad(&good)]).unwrap_err();
        assert!(
            matches!(&err, Error::Core { tensor, rank: Some(1), .. } if tensor == "w"),
            "{err}"
        );
        assert_eq!(ar.compressor().step(), step);
        assert_eq!(residual(&ar), before);
        // The same step with the peer's good frame goes through.
        ar.all_reduce_with_peers(&g, &[good]).unwrap();
        assert_eq!(ar.compressor().step(), step + 1);
    }
}

/// A transport that fails every all-gather, as a lost peer would.
struct BrokenTransport;

impl Communicator for BrokenTransport {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_gather(
        &mut self,
        _local: &[u8],
        _max_len: usize,
        _out: &mut Vec<Vec<u8>>,
    ) -> Result<(), gradwire::comm::CommError> {
        Err(gradwire::comm::CommError::Transport("peer lost".into()))
    }
    fn all_to_all(
        &mut self,
        _send: &[Vec<u8>],
        _max_len: usize,
        _out: &mut Vec<Vec<u8>>,
    ) -> Result<(), gradwire::comm::CommError> {
        Err(gradwire::comm::CommError::Transport("peer lost".into()))
    }
    fn traffic(&self) -> gradwire::comm::Traffic {
        gradwire::comm::Traffic::default()
    }
}

/// After a transport error the sent values stay sent: peers may have completed the step with
/// them, and giving them back would send them twice.
#[test]
fn after_a_transport_error_the_sent_values_stay_sent() {
    let g = grads(&[("w", &[4], vec![1.0, -3.0, 0.5, 2.0])]);
    let method = CompressionMethod::TopK { k: 1 }.with_error_feedback();
    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(BrokenTransport));
    let err = ar.all_reduce(&g).unwrap_err();
    assert!(matches!(err, Error::Comm { .. }), "{err}");
    let residual = ar.compressor().feedback().and_then(|f| f.residual("w"));
    assert_eq!(residual, Some(&[1.0, 0.0, 0.5, 2.0][..]));
    assert_eq!(ar.compressor().step(), 1);
}

/// (Moved from `tests/regressions.rs`.)
/// Issue 24 item 7 (and scope 3): ranks configured with different reductions (mean on one,
/// sum on another), top-k scopes or rounding seeds each "succeeded" with different results.
/// The configuration fingerprint holds each of them: every rank fails naming the field.
#[test]
fn ranks_with_other_reductions_scopes_or_seeds_fail_naming_the_field() {
    use gradwire::comm::LocalGroup;
    use gradwire::layout::TopKScope;
    use gradwire::{BucketConfig, CompressedAllReduce, CompressionMethod, Reduction, Tensor};
    use std::collections::HashMap;

    type Make = fn(usize, Box<dyn gradwire::comm::Communicator>) -> CompressedAllReduce;
    let cases: [(&str, Make); 3] = [
        ("reduction", |r, c| {
            let red = if r == 1 {
                Reduction::Sum
            } else {
                Reduction::Mean
            };
            CompressedAllReduce::with_communicator(CompressionMethod::TopK { k: 4 }, c)
                .with_reduction(red)
        }),
        ("bucketing", |r, c| {
            let scope = if r == 1 {
                TopKScope::PerBucket
            } else {
                TopKScope::PerTensor
            };
            CompressedAllReduce::with_communicator(CompressionMethod::TopK { k: 4 }, c)
                .with_bucketing(BucketConfig::fused(1 << 16).with_scope(scope))
        }),
        ("seed", |r, c| {
            CompressedAllReduce::with_communicator(CompressionMethod::Quantization { bits: 4 }, c)
                .with_seed(if r == 1 { 2 } else { 1 })
        }),
    ];
    for (field, make) in cases {
        let comms = LocalGroup::new(2).into_communicators();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                std::thread::spawn(move || {
                    let g = HashMap::from([
                        (
                            "a".to_string(),
                            Tensor::vector((0..64).map(|i| i as f32 - 30.0).collect()),
                        ),
                        ("b".to_string(), Tensor::vector(vec![1.0, -2.0, 3.0])),
                    ]);
                    make(r, Box::new(comm))
                        .all_reduce(&g)
                        .err()
                        .map(|e| e.to_string())
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let e = h
                .join()
                .unwrap()
                .unwrap_or_else(|| panic!("{field}: rank {r} succeeded"));
            assert!(
                e.contains("rank 1 is configured differently") && e.contains(field),
                "{field}: rank {r}: {e}"
            );
        }
    }
}

/// Issue 46: a dense bundle written as it is sent checks every gradient first: a bad one (a
/// value beyond f16, NaN after it in a later tensor) is this rank's error, named as the
/// compressor names it for a bundle written whole; the peers fail naming the rank, and nothing
/// of it left (no window before the verdict).
#[test]
fn a_bad_gradient_of_a_streamed_bundle_is_named_as_the_compressor_names_it() {
    let method = CompressionMethod::Core(Method::Dense {
        values: Values::F16,
    });
    let gradients = |r: usize| {
        let values = |n: usize| {
            (0..n)
                .map(|i| (i % 17) as f32 * 0.25 - 2.0)
                .collect::<Vec<f32>>()
        };
        let (mut big, mut c) = (values(150_000), values(40));
        if r == 1 {
            big[140_000] = 70_000.0;
            c[3] = f32::NAN;
        }
        grads(&[
            ("a", &[300], values(300)),
            ("big", &[150_000], big),
            ("c", &[40], c),
        ])
    };
    let manifest =
        Manifest::for_gradients(&gradients(1), &method, 0, BucketConfig::none()).unwrap();
    let want = GradientCompressor::new(method.clone())
        .compress_bundle(&manifest, &gradients(1), 1, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(want.contains("big") && want.contains("140000"), "{want}");
    let (m, g) = (method.clone(), gradients);
    let errors = on_every_rank(3, move |comm| {
        let r = comm.rank();
        let mut ar = CompressedAllReduce::with_communicator(m.clone(), Box::new(comm))
            .with_chunk_bytes(4096);
        let err = ar.all_reduce(&g(r)).unwrap_err().to_string();
        // The next step runs.
        ar.all_reduce(&g(0)).unwrap();
        err
    });
    assert_eq!(errors[1], want);
    for r in [0, 2] {
        assert!(
            errors[r].contains("rank 1") && errors[r].contains("140000"),
            "rank {r}: {}",
            errors[r]
        );
    }
}

/// Issue 46: a group of one reads its own dense bundle as it is written, window by window: the
/// result is the decoded bundle the compressor writes whole, in place and not.
#[test]
fn a_group_of_one_reads_its_streamed_bundle_as_it_is_written() {
    let values = |n: usize, k: usize| {
        (0..n)
            .map(|i| ((i * 7 + k) % 23) as f32 * 0.37 - 4.0)
            .collect::<Vec<f32>>()
    };
    let g = grads(&[
        ("a", &[300], values(300, 1)),
        ("big", &[150_000], values(150_000, 2)),
        ("s", &[], values(1, 3)),
    ]);
    for v in [Values::Bf16, Values::F16, Values::F32] {
        let method = CompressionMethod::Core(Method::Dense { values: v });
        let manifest = Manifest::for_gradients(&g, &method, 0, BucketConfig::none()).unwrap();
        let mut bundle = Vec::new();
        GradientCompressor::new(method.clone())
            .compress_bundle(&manifest, &g, 0, &mut bundle)
            .unwrap();
        let mut flat = Vec::new();
        manifest
            .decode_bundle(&bundle, None, None, &mut flat)
            .unwrap();
        let want = manifest.to_tensors(&flat).unwrap();
        for chunk in [4096, 1 << 23] {
            let comm = LocalGroup::new(1).into_communicators().pop().unwrap();
            let mut ar = CompressedAllReduce::with_communicator(method.clone(), Box::new(comm))
                .with_chunk_bytes(chunk);
            let mut out = HashMap::new();
            for _ in 0..2 {
                ar.all_reduce_into(&g, &mut out).unwrap();
                for (name, t) in &want {
                    assert!(
                        same_bits(out[name].data(), t.data()),
                        "{v:?} {chunk} {name}"
                    );
                }
            }
            let mut owned = owned_copy(&g);
            ar.all_reduce_in_place(&mut views(&mut owned)).unwrap();
            for (name, _, data) in &owned {
                assert!(
                    same_bits(data, want[name].data()),
                    "{v:?} {chunk} {name}: in place"
                );
            }
        }
    }
}

/// Issue 46: the f32 all-reduce cuts its chunks at tensor boundaries (a tensor of a quarter of
/// a chunk or more in equal pieces of its own, reduced where it lies; smaller ones gathered
/// until the next does not fit): W = 3, 4 KiB chunks (1,024 elements), tensors from empty to
/// five chunks long (a run of small tensors that fills a chunk, empty tensors alone between two
/// large ones), mean and sum, in place and apart: every rank gets the rank-order sum
/// `(x0 + x1) + x2` (divided once by 3), no call passes more than a chunk, and an overflow in a
/// piece, or in a gathered tensor that is not its chunk's first, is named by tensor and index
/// on every rank.
#[test]
fn the_f32_all_reduce_cut_at_tensor_boundaries_gives_the_rank_order_sums() {
    const CHUNK: usize = 4096;
    const SHAPES: [(&str, usize); 15] = [
        ("a.small", 100),
        ("b.empty", 0),
        ("c.quarter", 256),
        ("d.just_below", 255),
        ("d1.small", 250),
        ("d2.small", 250),
        ("d3.small", 250),
        ("d4.small", 250),
        ("e.large", 5 * 1024 + 17),
        ("e1.empty", 0),
        ("e2.empty", 0),
        ("f.medium", 700),
        ("g.chunk", 1024),
        ("h.scalar", 1),
        ("i.small", 3),
    ];
    // Overflows: in the fourth of six pieces of `e.large`, and at the end of `d2.small`, the
    // third tensor of the chunk that `d.just_below` starts and `d4.small` does not fit.
    const BAD: [(usize, usize); 2] = [(8, 3 * 1024 + 5), (5, 249)];
    // Magnitudes far apart, so that the order of the additions shows in the bits.
    let values = |r: usize, t: usize, n: usize| contribution(t, r, n);
    let gradients = move |r: usize, bad: Option<(usize, usize)>| -> HashMap<String, Tensor> {
        SHAPES
            .iter()
            .enumerate()
            .map(|(t, &(name, n))| {
                let mut v = values(r, t, n);
                if let Some((bt, bi)) = bad
                    && bt == t
                {
                    v[bi] = 3e38;
                }
                let shape: &[usize] = if n == 1 { &[] } else { &[n] };
                (name.to_string(), Tensor::new(shape.to_vec(), v).unwrap())
            })
            .collect()
    };
    let method = CompressionMethod::Core(Method::Dense {
        values: Values::F32,
    });
    for reduction in [Reduction::Mean, Reduction::Sum] {
        for in_place in [false, true] {
            let m = method.clone();
            let results = on_every_rank(3, move |comm| {
                let r = comm.rank();
                let (comm, largest) = super::test_common::Recording::new(comm);
                let mut ar = CompressedAllReduce::with_communicator(m.clone(), Box::new(comm))
                    .with_reduction(reduction)
                    .with_chunk_bytes(CHUNK);
                // A good step, then one overflow each.
                let steps = [None, Some(BAD[0]), Some(BAD[1])]
                    .into_iter()
                    .map(|bad| {
                        let g = gradients(r, bad);
                        if in_place {
                            let mut owned = owned_copy(&g);
                            let result = ar.all_reduce_in_place(&mut views(&mut owned));
                            result.map(|()| {
                                owned
                                    .into_iter()
                                    .map(|(n, _, d)| (n, d))
                                    .collect::<HashMap<_, _>>()
                            })
                        } else {
                            let mut out = HashMap::new();
                            ar.all_reduce_into(&g, &mut out).map(|()| {
                                out.into_iter()
                                    .map(|(n, t)| (n, t.data().to_vec()))
                                    .collect::<HashMap<_, _>>()
                            })
                        }
                    })
                    .collect::<Vec<_>>();
                (steps, largest.load(std::sync::atomic::Ordering::Relaxed))
            });
            let what = format!("{reduction:?}, in place {in_place}");
            for (r, (steps, largest)) in results.iter().enumerate() {
                assert!(*largest <= CHUNK, "{what}: rank {r} passed {largest} bytes");
                let good = steps[0].as_ref().unwrap();
                for (t, &(name, n)) in SHAPES.iter().enumerate() {
                    let x: Vec<Vec<f32>> = (0..3).map(|r| values(r, t, n)).collect();
                    let want: Vec<f32> = (0..n)
                        .map(|i| {
                            let sum = (x[0][i] + x[1][i]) + x[2][i];
                            if reduction == Reduction::Mean {
                                sum / 3.0
                            } else {
                                sum
                            }
                        })
                        .collect();
                    assert!(same_bits(&good[name], &want), "{what}: rank {r}, {name}");
                }
                for (s, (t, index)) in [(1, BAD[0]), (2, BAD[1])] {
                    let tensor = SHAPES[t].0;
                    assert!(
                        matches!(&steps[s], Err(Error::Overflow { tensor: n, index: i }) if n == tensor && *i == index),
                        "{what}: rank {r}, step {s}: {:?}",
                        steps[s].as_ref().err()
                    );
                }
            }
        }
    }
}

/// A copy of `g` as owned tensors (name, shape, elements) for `all_reduce_in_place`.
fn owned_copy(g: &HashMap<String, Tensor>) -> Owned {
    g.iter()
        .map(|(n, t)| (n.clone(), t.shape().to_vec(), t.data().to_vec()))
        .collect()
}

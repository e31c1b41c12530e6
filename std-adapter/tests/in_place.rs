//! `CompressedAllReduce::all_reduce_in_place` and `all_reduce_in_place_on` (issue 46 scope
//! 1): the gradient buffers read and the result written over them, through the same engine as the `HashMap` API, on every
//! route (all-gather, bucketed all-gather, two-phase, dense f32), in windows of the chunk
//! bound: the same bits, the same residuals, the same failures.

use std::collections::HashMap;

use gradwire::comm::{LocalCommunicator, LocalGroup};
use gradwire::core::{K, Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{
    BucketConfig, Collective, CompressedAllReduce, CompressionMethod, Error, Reduction,
};

mod common;
#[path = "common/ranks.rs"]
mod ranks;
use common::{Owned, Rng, same_bits, views};
use ranks::run_ranks;

const W: usize = 3;
const STEPS: u64 = 3;

/// Rank `r`'s gradients at step `s`: names not in sorted order, sizes below and above a
/// block and a window, a 0-d tensor.
fn gradients(r: usize, s: u64) -> Owned {
    let mut rng = Rng(7919 * r as u64 + 31 * s + 5);
    vec![
        ("layer.2.weight".into(), vec![60, 70], rng.vec(4200, 1.0)),
        ("embed".into(), vec![30_000], rng.vec(30_000, 0.5)),
        ("layer.1.bias".into(), vec![90], rng.vec(90, 2.0)),
        ("scale".into(), vec![], rng.vec(1, 1.0)),
        ("layer.1.weight".into(), vec![5, 1300], rng.vec(6500, 0.1)),
        // Aggregated in chunks, so that the all-gather reads it in pieces.
        ("blocks.big".into(), vec![140_000], rng.vec(140_000, 0.3)),
    ]
}

fn as_map(g: &[(String, Vec<usize>, Vec<f32>)]) -> HashMap<String, Tensor> {
    g.iter()
        .map(|(n, shape, data)| (n.clone(), Tensor::new(shape.clone(), data.clone()).unwrap()))
        .collect()
}

/// Each tensor's values in sorted name order, then every residual in sorted name order.
type Trace = Vec<(Vec<f32>, Vec<f32>)>;

fn residuals(ar: &CompressedAllReduce, names: &[String]) -> Vec<f32> {
    let fb = ar.compressor().feedback();
    names
        .iter()
        .flat_map(|n| fb.and_then(|f| f.residual(n)).unwrap_or(&[]))
        .copied()
        .collect()
}

fn sorted_names(g: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<String> {
    let mut names: Vec<String> = g.iter().map(|t| t.0.clone()).collect();
    names.sort();
    names
}

/// How a rank builds its all-reduce.
type Make = fn(LocalCommunicator) -> CompressedAllReduce;

/// Which entry point a step calls.
#[derive(Clone, Copy, PartialEq)]
enum Api {
    /// `all_reduce_into`.
    Apart,
    /// `all_reduce_in_place`, on the all-reduce's own communicator.
    InPlace,
    /// `all_reduce_in_place_on`, on a communicator the caller keeps (the all-reduce holds a
    /// communicator of another group, never used).
    InPlaceOn,
}

/// `STEPS` steps on `W` ranks through `api`.
fn run(make: Make, api: Api) -> Vec<Trace> {
    let kept: Vec<Option<LocalCommunicator>> = LocalGroup::new(W)
        .into_communicators()
        .into_iter()
        .map(Some)
        .collect();
    let kept = std::sync::Arc::new(std::sync::Mutex::new(kept));
    run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
        let rank = gradwire::comm::Communicator::rank(&comm);
        let mut kept = kept.lock().unwrap()[rank].take().unwrap();
        let mut ar = make(comm);
        let mut out = HashMap::new();
        let mut trace = Trace::new();
        for s in 0..STEPS {
            let mut g = gradients(rank, s);
            let names = sorted_names(&g);
            let result = if api != Api::Apart {
                let mut tensors = views(&mut g);
                if api == Api::InPlace {
                    ar.all_reduce_in_place(&mut tensors).unwrap();
                } else {
                    ar.all_reduce_in_place_on(&mut kept, &mut tensors).unwrap();
                }
                let by_name: HashMap<&str, &[f32]> = g
                    .iter()
                    .map(|(n, _, d)| (n.as_str(), d.as_slice()))
                    .collect();
                names
                    .iter()
                    .flat_map(|n| by_name[n.as_str()])
                    .copied()
                    .collect()
            } else {
                ar.all_reduce_into(&as_map(&g), &mut out).unwrap();
                names.iter().flat_map(|n| out[n].data()).copied().collect()
            };
            trace.push((result, residuals(&ar, &names)));
        }
        trace
    })
}

fn with(comm: LocalCommunicator, method: CompressionMethod) -> CompressedAllReduce {
    CompressedAllReduce::with_communicator(method, Box::new(comm))
}

fn topk_int8() -> CompressionMethod {
    CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.05),
        values: Values::Int8 { block: 64 },
    })
    .with_error_feedback()
}

#[test]
fn in_place_steps_are_the_hashmap_steps_bit_for_bit_on_every_route() {
    let routes: [(&str, Make); 11] = [
        ("top-k all-gather", |c| with(c, topk_int8())),
        ("top-k all-gather in 4 KiB windows", |c| {
            with(c, topk_int8()).with_chunk_bytes(4096)
        }),
        ("top-k bucketed all-gather", |c| {
            with(c, topk_int8()).with_bucketing(BucketConfig::fused(16 << 10))
        }),
        ("top-k two-phase in 4 KiB windows", |c| {
            with(c, topk_int8())
                .with_collective(Collective::TwoPhase)
                .with_chunk_bytes(4096)
        }),
        ("sign two-phase", |c| {
            with(c, CompressionMethod::SignSGD.with_error_feedback())
                .with_collective(Collective::TwoPhase)
        }),
        ("4-bit all-gather, sum", |c| {
            with(
                c,
                CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
            )
            .with_reduction(Reduction::Sum)
        }),
        (
            "dense bf16 all-gather, written as it is sent, in 4 KiB windows",
            |c| {
                with(
                    c,
                    CompressionMethod::Core(Method::Dense {
                        values: Values::Bf16,
                    }),
                )
                .with_chunk_bytes(4096)
            },
        ),
        ("dense f16 all-gather, written as it is sent", |c| {
            with(
                c,
                CompressionMethod::Core(Method::Dense {
                    values: Values::F16,
                }),
            )
        }),
        ("dense bf16 two-phase", |c| {
            with(
                c,
                CompressionMethod::Core(Method::Dense {
                    values: Values::Bf16,
                }),
            )
            .with_collective(Collective::TwoPhase)
        }),
        ("dense f32 in 4 KiB chunks", |c| {
            with(
                c,
                CompressionMethod::Core(Method::Dense {
                    values: Values::F32,
                }),
            )
            .with_chunk_bytes(4096)
        }),
        ("dense f32 auto", |c| {
            with(
                c,
                CompressionMethod::Core(Method::Dense {
                    values: Values::F32,
                }),
            )
            .with_collective(Collective::Auto)
        }),
    ];
    for (what, make) in routes {
        let apart = run(make, Api::Apart);
        let in_place = run(make, Api::InPlace);
        let kept = run(make, Api::InPlaceOn);
        let traces_match = kept.len() == in_place.len()
            && kept.iter().zip(&in_place).all(|(a, b)| {
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .all(|((ma, ra), (mb, rb))| same_bits(ma, mb) && same_bits(ra, rb))
            });
        assert!(traces_match, "{what}: all_reduce_in_place_on");
        for (rank, (a, b)) in apart.iter().zip(&in_place).enumerate() {
            for (s, ((ma, ra), (mb, rb))) in a.iter().zip(b).enumerate() {
                assert!(!ma.is_empty(), "{what}");
                assert!(same_bits(ma, mb), "{what}: rank {rank}, step {s}: results");
                assert!(
                    same_bits(ra, rb),
                    "{what}: rank {rank}, step {s}: residuals"
                );
            }
            // Every rank holds the same result.
            for (s, (m, _)) in b.iter().enumerate() {
                assert!(
                    same_bits(m, &in_place[0][s].0),
                    "{what}: rank {rank}, step {s}"
                );
            }
        }
    }
}

/// A buffer that does not hold its shape's elements, or a name given twice, is that rank's
/// error; it still takes part, so every peer fails naming it, and the next step runs.
#[test]
fn a_bad_buffer_fails_every_rank_and_the_next_step_runs() {
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        for fault in ["short", "twice"] {
            let results = run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
                let rank = gradwire::comm::Communicator::rank(&comm);
                let mut ar = with(comm, topk_int8()).with_collective(collective);
                let mut g = gradients(rank, 0);
                if rank == 1 && fault == "short" {
                    g[0].2.pop();
                }
                if rank == 1 && fault == "twice" {
                    g[2].0 = g[4].0.clone();
                    g[2].1 = g[4].1.clone();
                    g[2].2 = g[4].2.clone();
                }
                let mut tensors = views(&mut g);
                let first = ar.all_reduce_in_place(&mut tensors);
                let mut g = gradients(rank, 1);
                let mut tensors = views(&mut g);
                let second = ar.all_reduce_in_place(&mut tensors);
                (
                    first,
                    second.map(|()| g.iter().flat_map(|t| t.2.clone()).collect::<Vec<f32>>()),
                )
            });
            let what = format!("{collective:?}, {fault}");
            for (rank, (first, second)) in results.iter().enumerate() {
                match (rank, first, fault) {
                    (1, Err(Error::ShapeMismatch { tensor, .. }), "short") => {
                        assert_eq!(tensor, "layer.2.weight", "{what}");
                    }
                    (1, Err(Error::DuplicateTensor { tensor }), "twice") => {
                        assert_eq!(tensor, "layer.1.weight", "{what}");
                    }
                    (0 | 2, Err(Error::PeerFailed { rank: 1, .. }), _) => {}
                    other => panic!("{what}: rank {rank}: {other:?}"),
                }
                let second = second.as_ref().unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(
                    same_bits(second, results[0].1.as_ref().unwrap()),
                    "{what}: rank {rank}"
                );
            }
        }
    }
}

/// Without a communicator (world size 1), the step of `all_reduce`, written in place.
#[test]
fn a_group_of_one_without_a_communicator_writes_in_place() {
    let g = gradients(0, 0);
    let mut apart = CompressedAllReduce::new(topk_int8(), 1);
    let expected = apart.all_reduce(&as_map(&g)).unwrap();
    let mut ar = CompressedAllReduce::new(topk_int8(), 1);
    let mut g = g;
    let mut tensors = views(&mut g);
    ar.all_reduce_in_place(&mut tensors).unwrap();
    for (name, _, data) in &g {
        assert!(same_bits(data, expected[name].data()), "{name}");
    }
}

/// A group of one (a communicator of one rank) writes its dense message as it reads it, each
/// value checked as it is encoded instead of all of them first: a bad value past windows that
/// were already written over the gradients (in place) fails the step with the error a check
/// first gives (the same rank's error in a group of two, where nothing may leave before the
/// check), and the next step runs and gives the result of a group of one that never failed.
#[test]
fn a_group_of_one_names_a_bad_dense_value_as_a_check_first_does() {
    let method = CompressionMethod::Core(Method::Dense {
        values: Values::F16,
    });
    // (tensor, a value beyond f16, a NaN after it: named first, as a check first names it).
    // "blocks.big" is the first tensor in name order: its bad values lie past its first piece
    // of 65,536 elements, which was decoded over its gradient; "layer.2.weight" comes after
    // three tensors already written over theirs.
    for (tensor, (at_big, at_nan)) in [
        ("blocks.big", (100_000, 120_000)),
        ("layer.2.weight", (10, 3000)),
    ] {
        let bad = move |rank: usize| {
            let mut g = gradients(rank, 0);
            if rank == 0 {
                let t = g.iter_mut().find(|t| t.0 == tensor).unwrap();
                t.2[at_big] = 1e9;
                t.2[at_nan] = f32::NAN;
            }
            g
        };
        let errors: Vec<String> = [1usize, 2]
            .into_iter()
            .map(|world| {
                let each = method.clone();
                let results = run_ranks(LocalGroup::new(world).into_communicators(), move |comm| {
                    let rank = gradwire::comm::Communicator::rank(&comm);
                    let mut ar = with(comm, each.clone()).with_chunk_bytes(4096);
                    let mut g = bad(rank);
                    let failed = ar.all_reduce_in_place(&mut views(&mut g)).unwrap_err();
                    let mut g = gradients(rank, 1);
                    ar.all_reduce_in_place(&mut views(&mut g)).unwrap();
                    (failed.to_string(), g)
                });
                if world == 1 {
                    // The step after the failure: a group of one's result at its second step.
                    let mut fresh = CompressedAllReduce::with_communicator(
                        method.clone(),
                        Box::new(LocalGroup::new(1).into_communicators().remove(0)),
                    )
                    .with_chunk_bytes(4096);
                    let mut g = gradients(0, 0);
                    fresh.all_reduce_in_place(&mut views(&mut g)).unwrap();
                    let mut g = gradients(0, 1);
                    fresh.all_reduce_in_place(&mut views(&mut g)).unwrap();
                    for ((name, _, got), (_, _, want)) in results[0].1.iter().zip(&g) {
                        assert!(same_bits(got, want), "{tensor}: {name}");
                    }
                }
                results[0].0.clone()
            })
            .collect();
        assert!(errors[0].contains(tensor), "{}", errors[0]);
        assert!(errors[0].contains(&at_nan.to_string()), "{}", errors[0]);
        assert_eq!(errors[0], errors[1], "{tensor}");
    }
}

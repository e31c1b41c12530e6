//! Mixed precision (issue 47 scope 5): `CompressedAllReduce::with_skip_non_finite` skips a
//! step in which some rank's gradient is not finite (or, without error feedback, beyond the
//! method's value type) on every rank, with every output NaN and no state changed, and
//! `scale_residuals` keeps the residuals in the units of a loss scale that changed.

use gradwire::comm::{Communicator, LocalCommunicator, LocalGroup};
use gradwire::core::{K, Method, Values};
use gradwire::{Collective, CompressedAllReduce, CompressionMethod, Error};

mod common;
#[path = "common/ranks.rs"]
mod ranks;
use common::{Owned, Rng, views};
use ranks::run_ranks;

const W: usize = 3;

/// Rank `r`'s gradients at step `s`, every value multiplied by `scale`.
fn gradients(r: usize, s: u64, scale: f32) -> Owned {
    let mut rng = Rng(7919 * r as u64 + 31 * s + 5);
    let mut g: Owned = vec![
        ("embed".into(), vec![30_000], rng.vec(30_000, 0.5)),
        ("layer.bias".into(), vec![90], rng.vec(90, 2.0)),
        ("layer.weight".into(), vec![60, 70], rng.vec(4200, 1.0)),
    ];
    for (_, _, data) in &mut g {
        data.iter_mut().for_each(|x| *x *= scale);
    }
    g
}

fn topk_int8_ef() -> CompressionMethod {
    CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.05),
        values: Values::Int8 { block: 64 },
    })
    .with_error_feedback()
}

fn dense_f16() -> CompressionMethod {
    CompressionMethod::Core(Method::Dense {
        values: Values::F16,
    })
}

/// What a rank does before a step.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    /// A step on the gradients of step `s`, scaled by `scale`, with `poison` written into
    /// `(rank, index of "embed")` first when given.
    Step {
        s: u64,
        scale: f32,
        poison: Option<(usize, usize, f32)>,
    },
    /// `scale_residuals(factor)`.
    Rescale(f32),
}

/// One rank's record of a step: the outputs (every tensor in sorted name order), whether it
/// was skipped, the step counter after it, every worker residual after it.
type Record = (Vec<f32>, bool, u64, Vec<f32>);

fn run(
    method: fn() -> CompressionMethod,
    collective: Collective,
    acts: &'static [Act],
) -> Vec<Vec<Record>> {
    run_ranks(
        LocalGroup::new(W).into_communicators(),
        move |comm: LocalCommunicator| {
            let rank = comm.rank();
            let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                .with_collective(collective)
                .with_skip_non_finite(true);
            let mut records = Vec::new();
            for act in acts {
                match *act {
                    Act::Rescale(factor) => ar.scale_residuals(factor).unwrap(),
                    Act::Step { s, scale, poison } => {
                        let mut g = gradients(rank, s, scale);
                        if let Some((r, i, v)) = poison
                            && r == rank
                        {
                            g[0].2[i] = v;
                        }
                        let mut tensors = views(&mut g);
                        ar.all_reduce_in_place(&mut tensors).unwrap();
                        let outputs = g.iter().flat_map(|t| t.2.iter().copied()).collect();
                        records.push((
                            outputs,
                            ar.last_step_skipped(),
                            ar.compressor().step(),
                            worker_residuals(&ar),
                        ));
                    }
                }
            }
            records
        },
    )
}

/// Every worker residual, in name order, one after the other (none without error feedback).
fn worker_residuals(ar: &CompressedAllReduce) -> Vec<f32> {
    ar.compressor()
        .feedback()
        .map(|fb| {
            fb.residuals()
                .flat_map(|(_, r)| r.iter().copied())
                .collect()
        })
        .unwrap_or_default()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

const fn step(s: u64) -> Act {
    Act::Step {
        s,
        scale: 1.0,
        poison: None,
    }
}

#[test]
fn a_non_finite_gradient_skips_the_step_on_every_rank_and_changes_nothing() {
    // Step 1 has an infinity (then a NaN) on rank 1 only: skipped on every rank, every output
    // NaN; steps 2 and 3 then equal a run in which step 1 never happened, bit for bit (worker
    // residuals, server residuals through the outputs, the step counter).
    const INF: &[Act] = &[
        step(0),
        Act::Step {
            s: 1,
            scale: 1.0,
            poison: Some((1, 17, f32::INFINITY)),
        },
        step(2),
        step(3),
    ];
    const NAN: &[Act] = &[
        step(0),
        Act::Step {
            s: 1,
            scale: 1.0,
            poison: Some((1, 29_999, f32::NAN)),
        },
        step(2),
        step(3),
    ];
    const WITHOUT: &[Act] = &[step(0), step(2), step(3)];
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let want = run(topk_int8_ef, collective, WITHOUT);
        for acts in [INF, NAN] {
            let got = run(topk_int8_ef, collective, acts);
            for (rank, (got, want)) in got.iter().zip(&want).enumerate() {
                let at = format!("{collective:?}, rank {rank}");
                let (skipped_out, skipped, counter, residuals) = &got[1];
                assert!(*skipped, "{at}: step 1 not skipped");
                assert!(
                    skipped_out.iter().all(|x| x.is_nan()),
                    "{at}: outputs not NaN"
                );
                assert_eq!(*counter, got[0].2, "{at}: the step counter advanced");
                assert_eq!(bits(residuals), bits(&got[0].3), "{at}: residuals changed");
                for (g, w) in [
                    (&got[0], &want[0]),
                    (&got[2], &want[1]),
                    (&got[3], &want[2]),
                ] {
                    assert!(!g.1, "{at}: a finite step was skipped");
                    assert_eq!(bits(&g.0), bits(&w.0), "{at}: outputs differ");
                    assert_eq!(g.2, w.2, "{at}: step counters differ");
                    assert_eq!(bits(&g.3), bits(&w.3), "{at}: residuals differ");
                }
            }
        }
    }
}

#[test]
fn without_error_feedback_a_value_beyond_the_type_skips_the_step() {
    // Dense f16 without error feedback: 70,000 on rank 2 is beyond f16, which the step would
    // refuse; skipped on every rank. Without the mode the same step fails on every rank.
    const ACTS: &[Act] = &[
        step(0),
        Act::Step {
            s: 1,
            scale: 1.0,
            poison: Some((2, 5, 70_000.0)),
        },
        step(2),
    ];
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let got = run(dense_f16, collective, ACTS);
        for records in &got {
            assert!(
                !records[0].1 && records[1].1 && !records[2].1,
                "{collective:?}"
            );
            assert!(records[1].0.iter().all(|x| x.is_nan()), "{collective:?}");
            assert!(records[2].0.iter().all(|x| x.is_finite()), "{collective:?}");
        }
        let failed = run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
            let rank = comm.rank();
            let mut ar = CompressedAllReduce::with_communicator(dense_f16(), Box::new(comm))
                .with_collective(collective);
            let mut g = gradients(rank, 1, 1.0);
            if rank == 2 {
                g[0].2[5] = 70_000.0;
            }
            ar.all_reduce_in_place(&mut views(&mut g)).is_err()
        });
        assert_eq!(failed, vec![true; W], "{collective:?}");
    }
}

#[test]
fn a_group_of_one_skips_without_a_communicator() {
    let mut ar = CompressedAllReduce::new(topk_int8_ef(), 1).with_skip_non_finite(true);
    let mut g = gradients(0, 0, 1.0);
    g[1].2[3] = f32::NEG_INFINITY;
    ar.all_reduce_in_place(&mut views(&mut g)).unwrap();
    assert!(ar.last_step_skipped());
    assert!(g.iter().all(|t| t.2.iter().all(|x| x.is_nan())));
    assert_eq!(ar.compressor().step(), 0);
    assert!(
        ar.compressor()
            .feedback()
            .is_none_or(|fb| fb.residuals().count() == 0)
    );
    let mut g = gradients(0, 0, 1.0);
    ar.all_reduce_in_place(&mut views(&mut g)).unwrap();
    assert!(!ar.last_step_skipped());
    assert_eq!(ar.compressor().step(), 1);
    // The HashMap API: the outputs are NaN tensors of the gradients' shapes.
    let mut g = gradients(0, 1, 1.0);
    g[2].2[0] = f32::NAN;
    let map = g
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                gradwire::tensor::Tensor::new(s.clone(), d.clone()).unwrap(),
            )
        })
        .collect();
    let mut out = std::collections::HashMap::new();
    ar.all_reduce_into(&map, &mut out).unwrap();
    assert!(ar.last_step_skipped());
    assert_eq!(out.len(), 3);
    assert_eq!(out["layer.weight"].shape(), &[60, 70]);
    assert!(out.values().all(|t| t.data().iter().all(|x| x.is_nan())));
}

#[test]
fn ranks_that_disagree_on_the_mode_fail_every_rank_and_none_waits() {
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let errors = run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
            let rank = comm.rank();
            let mut ar = CompressedAllReduce::with_communicator(topk_int8_ef(), Box::new(comm))
                .with_collective(collective)
                .with_skip_non_finite(rank == 0);
            let errors = (0..2)
                .map(|s| {
                    let mut g = gradients(rank, s, 1.0);
                    ar.all_reduce_in_place(&mut views(&mut g)).err()
                })
                .collect::<Vec<Option<Error>>>();
            // Nothing lost: a rank that compressed and sent nothing holds the two steps'
            // gradients in its residual (up to the rounding of the error-feedback identity).
            if rank > 0 {
                let want: Vec<f32> =
                    (0..2)
                        .map(|s| gradients(rank, s, 1.0))
                        .fold(vec![0.0f32; 34_290], |acc, g| {
                            let flat = g.iter().flat_map(|t| t.2.iter().copied());
                            acc.iter().zip(flat).map(|(a, b)| a + b).collect()
                        });
                for (g, w) in worker_residuals(&ar).iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{collective:?}: {g} {w}"
                    );
                }
            }
            errors
        });
        // The same error on every rank at each call (the transport refuses the pairing of the
        // round with the other ranks' first call), and the next call again.
        for (rank, calls) in errors.iter().enumerate() {
            for (s, e) in calls.iter().enumerate() {
                let e = e.as_ref().map(ToString::to_string);
                assert!(e.is_some(), "{collective:?}: rank {rank} ran step {s}");
                assert_eq!(
                    e,
                    errors[0][s].as_ref().map(ToString::to_string),
                    "{collective:?}"
                );
            }
        }
    }
}

#[test]
fn residuals_scaled_with_the_loss_scale_equal_a_run_at_one_scale() {
    // A run whose loss scale doubles after step 0 and halves after step 1 (residuals scaled
    // by 2, then by 1/2) against one at scale 1: step 1's outputs are exactly twice the other
    // run's, and step 2's outputs and the residuals after it are the same bits (powers of two
    // scale exactly), on both collectives (server residuals included).
    const SCALED: &[Act] = &[
        step(0),
        Act::Rescale(2.0),
        Act::Step {
            s: 1,
            scale: 2.0,
            poison: None,
        },
        Act::Rescale(0.5),
        step(2),
    ];
    const PLAIN: &[Act] = &[step(0), step(1), step(2)];
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let got = run(topk_int8_ef, collective, SCALED);
        let want = run(topk_int8_ef, collective, PLAIN);
        for (rank, (got, want)) in got.iter().zip(&want).enumerate() {
            let at = format!("{collective:?}, rank {rank}");
            let doubled: Vec<f32> = want[1].0.iter().map(|x| 2.0 * x).collect();
            assert_eq!(bits(&got[1].0), bits(&doubled), "{at}: step 1");
            assert_eq!(bits(&got[2].0), bits(&want[2].0), "{at}: step 2");
            assert_eq!(bits(&got[2].3), bits(&want[2].3), "{at}: residuals");
        }
    }
    let mut ar = CompressedAllReduce::new(topk_int8_ef(), 1);
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(ar.scale_residuals(bad), Err(Error::Config { .. })));
    }
    let mut g = gradients(0, 0, 1.0e38);
    ar.all_reduce_in_place(&mut views(&mut g)).unwrap();
    let before = bits(&worker_residuals(&ar));
    assert!(matches!(
        ar.scale_residuals(1.0e10),
        Err(Error::Config { .. })
    ));
    assert_eq!(
        before,
        bits(&worker_residuals(&ar)),
        "a refused scaling changed a residual"
    );
}

#[test]
fn a_non_finite_rank_skips_the_step_beside_a_rank_that_fails_otherwise() {
    // Step 1: rank 1's gradient has a NaN, rank 2's `embed` another length than its residual
    // (a failure of its own, which the all-gather's checks find and the two-phase route's
    // first check does not): skipped on every rank alike, on both collectives, and step 2
    // runs everywhere. Step 3: rank 2's other length alone fails every rank (no rank waits).
    // Rank 2's failure: another length (shape and values), or values that do not fill the
    // shape (refused before any check, without a model of the step).
    for (collective, shape_too) in [
        (Collective::AllGather, true),
        (Collective::AllGather, false),
        (Collective::TwoPhase, true),
        (Collective::TwoPhase, false),
    ] {
        let results = run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
            let rank = comm.rank();
            let mut ar = CompressedAllReduce::with_communicator(topk_int8_ef(), Box::new(comm))
                .with_collective(collective)
                .with_skip_non_finite(true);
            let mut outcomes = Vec::new();
            for s in 0..4 {
                let mut g = gradients(rank, s, 1.0);
                if s == 1 && rank == 1 {
                    g[0].2[3] = f32::NAN;
                }
                if (s == 1 || s == 3) && rank == 2 {
                    if shape_too {
                        g[0].1 = vec![29_999];
                    }
                    g[0].2.pop();
                }
                let result = ar.all_reduce_in_place(&mut views(&mut g));
                outcomes.push((result.is_ok(), ar.last_step_skipped()));
            }
            outcomes
        });
        for (rank, outcomes) in results.iter().enumerate() {
            assert_eq!(
                outcomes,
                &[(true, false), (true, true), (true, false), (false, false)],
                "{collective:?} ({shape_too}): rank {rank}"
            );
        }
    }
}

#[test]
fn the_round_is_made_on_the_callers_thread_with_more_ranks_than_pool_threads() {
    // Every step on the pool (`Parallel`), W above the pool's threads: a round made on a pool
    // thread could wait there while another rank's step, queued on the same thread, never
    // reached its own round. Ranks give up after 20 s instead of the default deadline.
    use std::time::Duration;
    let w = rayon::current_num_threads() + 2;
    let comms = LocalGroup::new(w)
        .with_timeout(Some(Duration::from_secs(20)))
        .into_communicators();
    let results = run_ranks(comms, move |comm| {
        let rank = comm.rank();
        let mut ar = CompressedAllReduce::with_communicator(topk_int8_ef(), Box::new(comm))
            .with_parallelism(gradwire::Parallelism::Parallel)
            .with_skip_non_finite(true);
        (0..3)
            .map(|s| {
                let mut g = gradients(rank, s, 1.0);
                if s == 1 && rank == 1 {
                    g[0].2[3] = f32::NAN;
                }
                let ok = ar.all_reduce_in_place(&mut views(&mut g)).is_ok();
                (ok, ar.last_step_skipped())
            })
            .collect::<Vec<_>>()
    });
    for outcomes in results {
        assert_eq!(outcomes, [(true, false), (true, true), (true, false)]);
    }
}

#[test]
fn the_dense_f32_all_reduce_skips_a_non_finite_step() {
    // Uncompressed f32 (the rank-order f32 all-reduce): an infinity on rank 0 skips the step;
    // the steps around it give the sums of a run without the mode, bit for bit.
    fn dense_f32() -> CompressionMethod {
        CompressionMethod::Core(Method::Dense {
            values: Values::F32,
        })
    }
    const ACTS: &[Act] = &[
        step(0),
        Act::Step {
            s: 1,
            scale: 1.0,
            poison: Some((0, 9, f32::NEG_INFINITY)),
        },
        step(2),
    ];
    let got = run(dense_f32, Collective::Auto, ACTS);
    const WITHOUT: &[Act] = &[step(0), step(2)];
    let want = run(dense_f32, Collective::Auto, WITHOUT);
    for (got, want) in got.iter().zip(&want) {
        assert_eq!((got[0].1, got[1].1, got[2].1), (false, true, false));
        assert!(got[1].0.iter().all(|x| x.is_nan()));
        assert_eq!(bits(&got[0].0), bits(&want[0].0));
        assert_eq!(bits(&got[2].0), bits(&want[1].0));
    }
}

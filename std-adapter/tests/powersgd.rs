//! PowerSGD over threads: every rank gets the same bits; nothing is lost (the results plus the
//! ranks' residuals add up to the gradients); uncompressed tensors are the exact rank-order
//! mean; a rank that fails, or is configured otherwise, fails every rank at the same call.

mod common;

use std::collections::HashMap;

use common::{Rng, minilm, noisy, same_bits};
use gradwire::comm::{Communicator, LocalGroup};
use gradwire::powersgd::{PowerSgd, PowerSgdConfig};
use gradwire::{Error, Tensor};

const W: usize = 4;

/// Rank `rank`'s MiniLM-shaped gradients at `step`.
fn gradients(rank: usize, step: u64) -> HashMap<String, Tensor> {
    noisy(&minilm(), &mut Rng(1000 * step + rank as u64), 0.5)
}

/// Runs `steps` steps on W threads, each rank with `config(rank)` and `grads(rank, step)`;
/// returns each rank's results (or errors) and, after the last step, its residuals.
#[allow(clippy::type_complexity)]
fn run(
    steps: u64,
    config: impl Fn(usize) -> PowerSgdConfig + Send + Sync + Clone + 'static,
    grads: impl Fn(usize, u64) -> HashMap<String, Tensor> + Send + Sync + Clone + 'static,
) -> Vec<(
    Vec<Result<HashMap<String, Tensor>, Error>>,
    HashMap<String, Vec<f32>>,
)> {
    let handles: Vec<_> = LocalGroup::new(W)
        .into_communicators()
        .into_iter()
        .map(|mut comm| {
            let (config, grads) = (config.clone(), grads.clone());
            std::thread::spawn(move || {
                let rank = comm.rank();
                let mut psgd = PowerSgd::new(config(rank)).unwrap();
                let results: Vec<_> = (0..steps)
                    .map(|s| psgd.all_reduce_mean(&mut comm, &grads(rank, s)))
                    .collect();
                let residuals = grads(rank, 0)
                    .keys()
                    .filter_map(|n| psgd.residual(n).map(|r| (n.clone(), r.to_vec())))
                    .collect();
                (results, residuals)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ranks_agree_bit_for_bit_and_nothing_is_lost() {
    let steps = 6;
    for rank in [1usize, 4] {
        let runs = run(steps, move |_| PowerSgdConfig::with_rank(rank), gradients);
        let outs: Vec<Vec<HashMap<String, Tensor>>> = runs
            .iter()
            .map(|(r, _)| r.iter().map(|x| x.as_ref().unwrap().clone()).collect())
            .collect();
        for s in 0..steps as usize {
            for (name, t) in &outs[0][s] {
                for other in &outs[1..] {
                    assert!(
                        same_bits(t.data(), other[s][name].data()),
                        "{name} step {s}"
                    );
                }
            }
        }
        // Error feedback telescopes: Σ_t result_t + mean residual_T == Σ_t mean gradient_t,
        // up to f32 rounding (the results are means of what each rank sent).
        for (name, t) in &gradients(0, 0) {
            let n = t.data().len();
            let mut lhs = vec![0.0f64; n];
            let mut rhs = vec![0.0f64; n];
            for s in 0..steps {
                for (i, x) in outs[0][s as usize][name].data().iter().enumerate() {
                    lhs[i] += f64::from(*x);
                }
                for rank in 0..W {
                    for (i, x) in gradients(rank, s)[name].data().iter().enumerate() {
                        rhs[i] += f64::from(*x) / W as f64;
                    }
                }
            }
            for (_, residuals) in &runs {
                if let Some(r) = residuals.get(name) {
                    for (i, x) in r.iter().enumerate() {
                        lhs[i] += f64::from(*x) / W as f64;
                    }
                }
            }
            let scale = rhs.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
            let worst = lhs
                .iter()
                .zip(&rhs)
                .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-4 * scale,
                "rank {rank}, {name}: {worst} of {scale}"
            );
        }
        // Compressed: the 2-d tensors of at least rate 2; the biases and norms are not.
        let has_residual = |name: &str| runs[0].1.contains_key(name);
        assert!(has_residual("encoder.layer.0.attention.self.query.weight"));
        assert!(!has_residual("encoder.layer.0.attention.self.query.bias"));
    }
}

#[test]
fn uncompressed_tensors_are_the_exact_rank_order_mean() {
    // A bias (1-d), a 3x3 matrix (rate 9 / 6 < 2) and, before the start step, everything.
    let grads = |rank: usize, step: u64| {
        let v = |n: usize, salt: u64| Rng(salt * 31 + rank as u64 + 7 * step).vec(n, 1.0);
        HashMap::from([
            ("b".to_owned(), Tensor::vector(v(5, 1))),
            (
                "small".to_owned(),
                Tensor::new(vec![3, 3], v(9, 2)).unwrap(),
            ),
            (
                "w".to_owned(),
                Tensor::new(vec![16, 12], v(192, 3)).unwrap(),
            ),
        ])
    };
    let config = |_| PowerSgdConfig {
        start_step: 2,
        ..PowerSgdConfig::with_rank(1)
    };
    let runs = run(3, config, grads);
    for s in 0..3u64 {
        let out = runs[0].0[s as usize].as_ref().unwrap();
        for name in ["b", "small", "w"] {
            let mut sum = vec![0.0f32; out[name].data().len()];
            for rank in 0..W {
                for (a, x) in sum.iter_mut().zip(grads(rank, s)[name].data()) {
                    *a += x;
                }
            }
            let mean: Vec<f32> = sum.iter().map(|x| x / W as f32).collect();
            let exact = same_bits(out[name].data(), &mean);
            // `w` is compressed from the start step on, the others never.
            assert_eq!(exact, name != "w" || s < 2, "{name} at step {s}");
        }
    }
}

/// Issue 48 class 7: a rank at or above a tensor's smaller side, with no minimum compression
/// rate to stop it, overflowed `rows * r` (`usize::MAX / 2`) or aborted on allocating `P`
/// (`1 << 40`): such a tensor travels as it is, the exact rank-order mean, and a tensor whose
/// sides are larger than the rank is still compressed.
#[test]
fn a_rank_beyond_a_tensors_sides_sends_it_as_it_is() {
    let grads = |rank: usize, step: u64| {
        let v = |n: usize, salt: u64| Rng(salt * 31 + rank as u64 + 7 * step).vec(n, 1.0);
        HashMap::from([
            ("m".to_owned(), Tensor::new(vec![8, 6], v(48, 1)).unwrap()),
            (
                "w".to_owned(),
                Tensor::new(vec![40, 30], v(1200, 2)).unwrap(),
            ),
        ])
    };
    for rank in [usize::MAX / 2, 1 << 40, 6, 7] {
        let config = move |_| PowerSgdConfig {
            min_compression_rate: 0.0,
            ..PowerSgdConfig::with_rank(rank)
        };
        let runs = run(2, config, grads);
        for s in 0..2u64 {
            let out = runs[0].0[s as usize].as_ref().unwrap();
            let mut sum = [0.0f32; 48];
            for r in 0..W {
                for (a, x) in sum.iter_mut().zip(grads(r, s)["m"].data()) {
                    *a += x;
                }
            }
            let mean: Vec<f32> = sum.iter().map(|x| x / W as f32).collect();
            assert!(same_bits(out["m"].data(), &mean), "rank {rank}, step {s}");
            // `w` (40 x 30) is compressed at ranks below 30 only.
            let w_exact = {
                let mut sum = vec![0.0f32; 1200];
                for r in 0..W {
                    for (a, x) in sum.iter_mut().zip(grads(r, s)["w"].data()) {
                        *a += x;
                    }
                }
                let mean: Vec<f32> = sum.iter().map(|x| x / W as f32).collect();
                same_bits(out["w"].data(), &mean)
            };
            assert_eq!(w_exact, rank >= 30, "rank {rank}, step {s}");
            for (other, (results, _)) in runs.iter().enumerate() {
                let theirs = results[s as usize].as_ref().unwrap();
                assert!(
                    same_bits(theirs["w"].data(), out["w"].data()),
                    "rank {other}"
                );
            }
        }
    }
}

#[test]
fn a_failed_or_misconfigured_rank_fails_every_rank_at_the_same_call() {
    let grads = |rank: usize, step: u64| {
        let mut g = Rng(rank as u64 + 10 * step).vec(64, 1.0);
        if rank == 2 && step == 1 {
            g[5] = f32::NAN;
        }
        HashMap::from([("w".to_owned(), Tensor::new(vec![8, 8], g).unwrap())])
    };
    let runs = run(3, |_| PowerSgdConfig::with_rank(2), grads);
    for (rank, (results, _)) in runs.iter().enumerate() {
        assert!(results[0].is_ok() && results[2].is_ok(), "rank {rank}");
        match (&results[1], rank) {
            (Err(Error::Core { tensor, .. }), 2) => assert_eq!(tensor, "w"),
            (Err(Error::PeerFailed { rank: 2, .. }), _) => {}
            (other, _) => panic!("rank {rank}: {other:?}"),
        }
    }
    // Rank 3 with another seed: every rank names it.
    let config = |rank: usize| PowerSgdConfig {
        seed: if rank == 3 { 9 } else { 0 },
        ..PowerSgdConfig::with_rank(2)
    };
    let runs = run(1, config, |rank, _| {
        HashMap::from([(
            "w".to_owned(),
            Tensor::new(vec![8, 8], Rng(rank as u64).vec(64, 1.0)).unwrap(),
        )])
    });
    for (results, _) in &runs {
        assert!(
            matches!(&results[0], Err(Error::ConfigDiffers { rank: 3, .. })),
            "{:?}",
            results[0]
        );
    }
}

#[test]
fn bad_configurations_are_refused() {
    assert!(PowerSgd::new(PowerSgdConfig::with_rank(0)).is_err());
    for rate in [f64::NAN, -1.0, f64::INFINITY] {
        let c = PowerSgdConfig {
            min_compression_rate: rate,
            ..PowerSgdConfig::default()
        };
        assert!(PowerSgd::new(c).is_err(), "{rate}");
    }
}

/// Each rank's closure over its communicator, on W threads; the results in rank order.
fn on_ranks<T: Send + 'static>(
    f: impl Fn(&mut dyn Communicator) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = LocalGroup::new(W)
        .into_communicators()
        .into_iter()
        .map(|mut comm| {
            let f = f.clone();
            std::thread::spawn(move || f(&mut comm))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_step_of_zero_gradients_does_not_leave_q_stuck_at_zero() {
    // Step 0 is all zeros on every rank (a LoRA factor whose partner starts at zero, say):
    // the summed P is zero, so Q = Mᵀ P is too. Without a redraw P = M Q would stay zero and
    // the tensor would never be sent again, its residual growing without end.
    let grads = |rank: usize, step: u64| {
        let g = if step == 0 {
            vec![0.0; 96]
        } else {
            Rng(rank as u64 + 10 * step).vec(96, 1.0)
        };
        HashMap::from([("w".to_owned(), Tensor::new(vec![12, 8], g).unwrap())])
    };
    let outs = on_ranks(move |comm| {
        let mut psgd = PowerSgd::new(PowerSgdConfig::with_rank(2)).unwrap();
        let (mut out, rank) = (Vec::new(), comm.rank());
        for s in 0..4 {
            let mean = psgd.all_reduce_mean(comm, &grads(rank, s)).unwrap();
            out.push(mean["w"].data().to_vec());
            if s == 0 {
                assert!(psgd.q("w").unwrap().iter().all(|&x| x == 0.0));
            }
        }
        (out, psgd.residual("w").unwrap().to_vec())
    });
    let (steps, _) = &outs[0];
    assert!(steps[0].iter().all(|&x| x == 0.0));
    for (s, out) in steps.iter().enumerate().skip(1) {
        let energy: f32 = out.iter().map(|x| x * x).sum();
        assert!(energy > 1e-3, "step {s} sent nothing: {energy}");
    }
    for (other, _) in &outs[1..] {
        for s in 0..4 {
            assert!(same_bits(&steps[s], &other[s]), "step {s}");
        }
    }
}

#[test]
fn a_restored_checkpoint_continues_bit_for_bit() {
    let config = || PowerSgdConfig {
        start_step: 1,
        seed: 5,
        ..PowerSgdConfig::with_rank(2)
    };
    let outs = on_ranks(move |comm| {
        let rank = comm.rank();
        let step = |psgd: &mut PowerSgd, comm: &mut dyn Communicator, s: u64| {
            let mean = psgd.all_reduce_mean(comm, &gradients(rank, s)).unwrap();
            let mut names: Vec<_> = mean.into_iter().collect();
            names.sort_by(|a, b| a.0.cmp(&b.0));
            names
        };
        let mut whole = PowerSgd::new(config()).unwrap();
        let uninterrupted: Vec<_> = (0..5).map(|s| step(&mut whole, comm, s)).collect();
        let mut first = PowerSgd::new(config()).unwrap();
        for s in 0..3 {
            step(&mut first, comm, s);
        }
        let bytes = first.to_bytes().unwrap();
        assert_eq!(
            bytes,
            first.to_bytes().unwrap(),
            "bytes depend on the state alone"
        );
        let mut resumed = PowerSgd::from_bytes(config(), &bytes).unwrap();
        assert_eq!(resumed.step(), 3);
        let continued: Vec<_> = (3..5).map(|s| step(&mut resumed, comm, s)).collect();
        let state = |p: &PowerSgd| {
            let mut names: Vec<_> = gradients(0, 0).into_keys().collect();
            names.sort();
            names
                .into_iter()
                .map(|n| {
                    (
                        p.q(&n).map(<[f32]>::to_vec),
                        p.residual(&n).map(<[f32]>::to_vec),
                    )
                })
                .collect::<Vec<_>>()
        };
        (
            uninterrupted,
            continued,
            state(&whole),
            state(&resumed),
            bytes,
        )
    });
    for (rank, (uninterrupted, continued, whole, resumed, _)) in outs.iter().enumerate() {
        for (s, (a, b)) in uninterrupted[3..].iter().zip(continued).enumerate() {
            for ((name, x), (_, y)) in a.iter().zip(b) {
                assert!(
                    same_bits(x.data(), y.data()),
                    "rank {rank} step {} {name}",
                    s + 3
                );
            }
        }
        assert!(whole == resumed, "rank {rank}: the final states differ");
        assert!(whole.iter().any(|(q, r)| q.is_some() && r.is_some()));
    }
    // A checkpoint of another setup, or a damaged one, is refused with a reason.
    let bytes = &outs[1].4;
    let other = PowerSgdConfig {
        seed: 6,
        ..config()
    };
    match PowerSgd::from_bytes(other, bytes) {
        Err(Error::Checkpoint { reason }) => assert!(reason.contains("seed=5"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let mut damaged = bytes.clone();
    let last = damaged.len() - 3;
    damaged[last] ^= 0x10;
    match PowerSgd::from_bytes(config(), &damaged) {
        Err(Error::Checkpoint { reason }) => assert!(reason.contains("checksum"), "{reason}"),
        other => panic!("{other:?}"),
    }
    for cut in [0, 7, 8, bytes.len() / 2, bytes.len() - 1] {
        assert!(
            PowerSgd::from_bytes(config(), &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
}

#[test]
fn a_rank_that_fails_before_the_step_fails_its_peers_at_that_step() {
    let grads = |rank: usize| {
        HashMap::from([(
            "w".to_owned(),
            Tensor::new(vec![8, 8], Rng(rank as u64).vec(64, 1.0)).unwrap(),
        )])
    };
    let outs = on_ranks(move |comm| {
        let rank = comm.rank();
        let mut psgd = PowerSgd::new(PowerSgdConfig::with_rank(1)).unwrap();
        let g = grads(rank);
        let first = psgd.all_reduce_mean(comm, &g).map(|_| ());
        let second = if rank == 1 {
            Err(psgd.all_reduce_failed(
                comm,
                &g,
                Error::Config {
                    reason: "the loop lost its place".into(),
                },
            ))
        } else {
            psgd.all_reduce_mean(comm, &g).map(|_| ())
        };
        let third = psgd.all_reduce_mean(comm, &g).map(|_| ());
        (first, second, third, psgd.step())
    });
    for (rank, (first, second, third, step)) in outs.iter().enumerate() {
        assert!(first.is_ok() && third.is_ok(), "rank {rank}");
        assert_eq!(*step, 3);
        match (second, rank) {
            (Err(Error::Config { .. }), 1) => {}
            (Err(Error::PeerFailed { rank: 1, .. }), _) => {}
            (other, _) => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn a_failed_first_step_leaves_every_rank_the_same_q() {
    // Rank 1 fails before step 0 and rank 2 inside it (a NaN): every rank still draws Q.
    let outs = on_ranks(|comm| {
        let rank = comm.rank();
        let mut g = Rng(rank as u64).vec(64, 1.0);
        if rank == 2 {
            g[3] = f32::NAN;
        }
        let grads = HashMap::from([("w".to_owned(), Tensor::new(vec![8, 8], g).unwrap())]);
        let mut psgd = PowerSgd::new(PowerSgdConfig::with_rank(2)).unwrap();
        let failed = if rank == 1 {
            Err(psgd.all_reduce_failed(
                comm,
                &grads,
                Error::Internal {
                    what: "test".into(),
                },
            ))
        } else {
            psgd.all_reduce_mean(comm, &grads).map(|_| ())
        };
        assert!(failed.is_err(), "rank {rank}");
        psgd.q("w").map(<[f32]>::to_vec)
    });
    assert!(outs[0].is_some());
    for (rank, q) in outs.iter().enumerate() {
        assert_eq!(q, &outs[0], "rank {rank}");
    }
}

#[test]
fn a_rank_with_huge_values_fails_every_rank_and_keeps_its_gradient() {
    // On rank 1 one column holds 3e38: P's sums stay finite, its Q = Mᵀ P does not (so the
    // sum of Q overflows on every rank). Every rank fails at this call with the same error;
    // every residual takes its M. (A Q that stays finite while M - P Qᵀ does not takes the
    // same road through a NaN in Q; that case needs a P nearly orthogonal to the column.)
    let grads = |rank: usize| {
        let mut g = Rng(rank as u64 + 40).vec(32, 1.0);
        if rank == 1 {
            for i in 0..8 {
                g[4 * i + 2] = 3e38;
            }
        }
        HashMap::from([("w".to_owned(), Tensor::new(vec![8, 4], g).unwrap())])
    };
    let outs = on_ranks(move |comm| {
        let rank = comm.rank();
        let config = PowerSgdConfig {
            min_compression_rate: 0.0,
            ..PowerSgdConfig::with_rank(1)
        };
        let mut psgd = PowerSgd::new(config).unwrap();
        let result = psgd.all_reduce_mean(comm, &grads(rank)).map(|_| ());
        (result, psgd.residual("w").map(<[f32]>::to_vec))
    });
    for (rank, (result, residual)) in outs.iter().enumerate() {
        match result {
            Err(Error::Overflow { tensor, .. }) => assert_eq!(tensor, "w"),
            other => panic!("rank {rank}: {other:?}"),
        }
        let m = grads(rank)["w"].data().to_vec();
        assert!(same_bits(residual.as_ref().unwrap(), &m), "rank {rank}");
    }
}

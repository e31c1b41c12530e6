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

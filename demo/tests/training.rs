//! A short data-parallel run (2 workers, dense f32): the loss goes down, the replicas stay
//! identical, dense f32 moves a ring all-reduce's bytes, and the same seed gives the same report
//! (timings aside).

use gradwire::comm::{Communicator, Traffic};
use gradwire_demo::DemoError;
use gradwire_demo::codec::{Collective, GradientCodec, Method, new_codec};
use gradwire_demo::launch::{ThreadLauncher, run_sweep};
use gradwire_demo::train::TrainConfig;

fn short() -> TrainConfig {
    TrainConfig {
        steps: 12,
        batch_size: 32,
        warmup_steps: 2,
        eval_every: 4,
        ..TrainConfig::default()
    }
}

#[test]
fn short_run_learns_and_is_reproducible() {
    let config = short();
    let launcher = ThreadLauncher::new(2).expect("launcher");
    let reports = launcher
        .run_all(&config, Method::DenseF32, 7, None)
        .expect("run");
    assert_eq!(reports.len(), 2);
    // run_all already refuses diverged replicas; check it here too.
    assert_eq!(reports[0].param_digest, reports[1].param_digest);
    let r = &reports[0];
    assert!(
        r.train_loss < 0.8 * r.initial_train_loss,
        "loss {} -> {}",
        r.initial_train_loss,
        r.train_loss
    );
    // Dense f32 goes through gradwire's f32 all-reduce: the raw values, and on the link a ring
    // all-reduce's 2 (W - 1) / W x 4n bytes per rank, plus the envelope round and the
    // protocol's length exchanges (a few hundred bytes).
    let raw = 85_002.0 * 4.0;
    assert_eq!(r.bytes_per_worker_per_step, raw);
    let ring = 2.0 * (2.0 - 1.0) / 2.0 * raw;
    let received = r.traffic.received_max;
    assert!(
        received >= ring && received < ring + 512.0,
        "{received} bytes received, ring {ring}"
    );
    let steps: Vec<usize> = r.curve.iter().map(|p| p.step).collect();
    assert_eq!(steps, [0, 4, 8, 12]);
    assert!(reports[1].curve.is_empty());

    // A second run with the same seed, through the sweep: the same results, bit for bit.
    let mut launcher = launcher;
    let a = run_sweep(&mut launcher, &config, &[Method::DenseF32], &[7], false)
        .expect("sweep")
        .expect("root");
    let run = &a.results[0].runs[0];
    assert_eq!(run.param_digest, format!("{:016x}", r.param_digest));
    assert_eq!(run.test_accuracy.to_bits(), r.test_accuracy.to_bits());
    assert_eq!(run.train_loss.to_bits(), r.train_loss.to_bits());
    assert_eq!(run.curve, r.curve);
    let full = serde_json::to_value(&a).expect("json");
    assert!(full.get("timing").is_some());
    assert!(a.reproducible_json().expect("json").get("timing").is_none());

    let png = std::env::temp_dir().join(format!("gradwire-demo-{}.png", std::process::id()));
    gradwire_demo::plot::draw(&a, &png).expect("plot");
    let bytes = std::fs::read(&png).expect("png written");
    let _ = std::fs::remove_file(&png);
    assert!(bytes.starts_with(b"\x89PNG"));
}

#[test]
fn compressed_methods_learn_and_send_fewer_bytes() {
    let config = short();
    let launcher = ThreadLauncher::new(2).expect("launcher");
    // The DGC rows' 12 steps are in their warm-up (25 %, then 6.25 %): more bytes.
    for (method, max_bytes) in [
        (Method::TopK1EfInt8, 3_000.0),
        (Method::SignEf, 11_500.0),
        (Method::TopK1DgcInt8, 60_000.0),
        (Method::RandK1Dgc, 100_000.0),
    ] {
        let reports = launcher.run_all(&config, method, 7, None).expect("run");
        assert_eq!(reports[0].param_digest, reports[1].param_digest, "{method}");
        let r = &reports[0];
        assert!(
            r.train_loss < r.initial_train_loss,
            "{method}: loss {} -> {}",
            r.initial_train_loss,
            r.train_loss
        );
        assert!(
            r.bytes_per_worker_per_step < max_bytes,
            "{method}: {} bytes",
            r.bytes_per_worker_per_step
        );
    }
}

/// `dense-f32-allreduce` calls MPI_Allreduce itself: the threads transport refuses it before
/// anything runs (in a build without `mpi`, as a method this build does not have).
#[test]
fn dense_f32_allreduce_needs_mpi() {
    let mut launcher = ThreadLauncher::new(2).expect("launcher");
    let err = run_sweep(
        &mut launcher,
        &short(),
        &[Method::DenseF32, Method::DenseF32Allreduce],
        &[7],
        false,
    )
    .expect_err("threads cannot run MPI_Allreduce");
    let text = err.to_string();
    assert!(text.contains("dense-f32-allreduce"), "{text}");
    assert!(text.contains("mpi"), "{text}");
    assert!(!Method::ALL.contains(&Method::DenseF32Allreduce));
}

#[test]
fn minilm_replay_runs_the_same_loop_at_minilm_size() {
    use gradwire_demo::codec::Collective;
    use gradwire_demo::train::Workload;
    let launcher = ThreadLauncher::new(2).expect("launcher");
    for (method, collective) in [
        (Method::TopK1EfInt8, Collective::AllGather),
        (Method::TopK1EfInt8, Collective::TwoPhase),
        (Method::DenseF32, Collective::AllGather),
    ] {
        let config = TrainConfig {
            steps: 3,
            eval_every: 3,
            workload: Workload::MinilmReplay,
            collective,
            ..short()
        };
        let reports = launcher.run_all(&config, method, 7, None).expect("run");
        let r = &reports[0];
        // run_all refuses diverged replicas; the replay's parameters moved.
        assert_eq!(r.param_digest, reports[1].param_digest, "{method}");
        assert_eq!(r.mean_digest, reports[1].mean_digest, "{method}");
        assert!(r.curve.is_empty(), "a replay has no model to evaluate");
        let dense = 789_504.0 * 4.0;
        if method == Method::DenseF32 {
            assert_eq!(r.bytes_per_worker_per_step, dense);
        } else {
            // top-k 1 % with int8 values: at least 150x under dense f32 at this size.
            assert!(
                r.bytes_per_worker_per_step < dense / 150.0,
                "{method} {collective:?}: {} bytes",
                r.bytes_per_worker_per_step
            );
        }
    }
    let other_seed = TrainConfig {
        steps: 2,
        eval_every: 2,
        workload: Workload::MinilmReplay,
        ..short()
    };
    let a = launcher
        .run_all(&other_seed, Method::SignEf, 1, None)
        .expect("run");
    let b = launcher
        .run_all(&other_seed, Method::SignEf, 2, None)
        .expect("run");
    let c = launcher
        .run_all(&other_seed, Method::SignEf, 1, None)
        .expect("run");
    assert_ne!(
        a[0].mean_digest, b[0].mean_digest,
        "the seed draws the noise"
    );
    assert_eq!(
        a[0].mean_digest, c[0].mean_digest,
        "the same seed, the same run"
    );
}

/// A blocking codec that hands out the mean of the step before (zeros at the first step): the
/// update the delayed methods make, with nothing behind the next step.
struct StaleMean {
    inner: Box<dyn GradientCodec>,
    /// The step's own mean (or, staged, its gradients), written by the inner codec.
    fresh: Vec<Vec<f32>>,
    /// The step before's mean.
    before: Vec<Vec<f32>>,
}

impl StaleMean {
    /// Hands out the step before's mean and keeps this step's.
    fn hand_out_stale(&mut self, out: &mut [Vec<f32>]) {
        for ((o, b), f) in out.iter_mut().zip(&mut self.before).zip(&self.fresh) {
            o.copy_from_slice(b);
            b.copy_from_slice(f);
        }
    }
}

impl GradientCodec for StaleMean {
    fn method(&self) -> Method {
        self.inner.method()
    }

    fn max_message_len(&self) -> usize {
        self.inner.max_message_len()
    }

    fn encode(&mut self, step: u64, grads: &[&[f32]], out: &mut Vec<u8>) -> Result<(), DemoError> {
        self.inner.encode(step, grads, out)
    }

    fn decode_mean(
        &mut self,
        step: u64,
        messages: &[Vec<u8>],
        out: &mut [Vec<f32>],
    ) -> Result<(), DemoError> {
        self.inner.decode_mean(step, messages, &mut self.fresh)?;
        self.hand_out_stale(out);
        Ok(())
    }

    fn runs_own_collective(&self) -> bool {
        self.inner.runs_own_collective()
    }

    fn stage(&mut self, grads: &[&[f32]], _out: &mut [Vec<f32>]) -> Result<(), DemoError> {
        self.inner.stage(grads, &mut self.fresh)
    }

    fn all_reduce(
        &mut self,
        comm: &mut dyn Communicator,
        step: u64,
        grads: &[&[f32]],
        out: &mut [Vec<f32>],
    ) -> Result<usize, DemoError> {
        let bytes = self.inner.all_reduce(comm, step, grads, &mut self.fresh)?;
        self.hand_out_stale(out);
        Ok(bytes)
    }

    fn own_traffic(&self) -> Traffic {
        self.inner.own_traffic()
    }
}

#[test]
fn a_delayed_method_applies_the_mean_of_the_step_before_while_the_next_step_computes() {
    for (delayed, blocking, collective, workers) in [
        (
            Method::TopK1EfInt8Delayed,
            Method::TopK1EfInt8,
            Collective::AllGather,
            2,
        ),
        (
            Method::SignEfDelayed,
            Method::SignEf,
            Collective::TwoPhase,
            3,
        ),
    ] {
        let config = TrainConfig {
            collective,
            ..short()
        };
        let launcher = ThreadLauncher::new(workers).expect("launcher");
        let overlapped = launcher
            .run_all(&config, delayed, 5, None)
            .expect("delayed run");
        // The same update from a blocking loop: the codec of the method without the delay,
        // handing out the step before's mean, at the delayed methods' momentum.
        let by_hand = TrainConfig {
            momentum: config.delayed_momentum,
            ..config.clone()
        };
        let reference = launcher
            .run_all_with(&by_hand, 5, None, &|ctx| {
                let zeros: Vec<Vec<f32>> = ctx.specs.iter().map(|p| vec![0.0; p.len()]).collect();
                Ok(Box::new(StaleMean {
                    inner: new_codec(blocking, ctx)?,
                    fresh: zeros.clone(),
                    before: zeros,
                }))
            })
            .expect("reference run");
        for (a, b) in overlapped.iter().zip(&reference) {
            assert_eq!(a.method, delayed);
            assert_eq!(
                a.param_digest, b.param_digest,
                "{delayed}, rank {}: other parameters than the blocking loop's",
                a.rank
            );
            assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits());
            assert_eq!(a.bytes_per_worker_per_step, b.bytes_per_worker_per_step);
            assert_eq!(a.traffic, b.traffic);
        }
        // And not the blocking method's parameters.
        let undelayed = launcher
            .run_all(&by_hand, blocking, 5, None)
            .expect("blocking run");
        assert_ne!(overlapped[0].param_digest, undelayed[0].param_digest);
    }

    // The timing mode's barrier splits a blocking exchange; a delayed method refuses it, and
    // a sweep refuses it before its first run.
    let barrier = TrainConfig {
        wait_barrier: true,
        ..short()
    };
    let mut launcher = ThreadLauncher::new(2).expect("launcher");
    let refused = launcher.run_all(&barrier, Method::SignEfDelayed, 5, None);
    assert!(
        matches!(&refused, Err(DemoError::Config(m)) if m.contains("--wait-barrier")),
        "{refused:?}"
    );
    let sweep = run_sweep(&mut launcher, &barrier, &Method::ALL, &[5], false);
    assert!(
        matches!(&sweep, Err(DemoError::Config(m)) if m.contains("pass --methods")),
        "{:?}",
        sweep.map(|_| ())
    );
}

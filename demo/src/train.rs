//! One rank's training loop: [`run_rank`].
//!
//! Every step: sample a mini-batch of this rank's shard, compute the gradient with candle,
//! [`GradientCodec::encode`] it, all-gather the messages, [`GradientCodec::decode_mean`] them
//! and apply the same SGD-with-momentum update as every other rank. With
//! [`Workload::MinilmReplay`] the gradients are the replayed MiniLM tensors
//! ([`crate::replay`]) instead of the MLP's, and the same loop runs without a model.
//!
//! The delayed methods ([`Method::delayed`]) run each step's exchange (encode, collective,
//! decode) on a thread of its own, behind the next step's forward and backward pass: step t
//! copies its gradients out for that thread, waits for step t - 1's exchange, starts its own
//! and applies step t - 1's mean (zeros at the first step; the last step's mean is exchanged
//! and never applied), Psyche's overlapped pipeline. The thread borrows the communicator and
//! the codec for the length of one exchange; under MPI that makes it the only MPI caller
//! meanwhile (`MPI_THREAD_SERIALIZED`, which gradwire's communicator asks for).

use std::sync::OnceLock;
use std::thread::{self, ScopedJoinHandle};
use std::time::Instant;

use gradwire::comm::Communicator;
use indicatif::ProgressBar;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::DemoError;
use crate::codec::{CodecContext, Collective, GradientCodec, Method, new_codec};
use crate::data::{Digits, Samples};
use crate::model::{Mlp, ParamSpec, digest, init_params, param_specs, single_threaded_matmul};
use crate::replay::{ReplayGradients, gpt2_specs, minilm_specs};

/// What the ranks train: where each step's gradients come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// The MLP (64-256-256-10) on the digits data set: 85,002 parameters in 6 tensors.
    #[default]
    #[value(name = "digits-mlp")]
    DigitsMlp,
    /// No model: the real MiniLM gradients of `testdata/` (789,504 values in 12 tensors) with
    /// per-rank noise, every step ([`crate::replay`]); no accuracy.
    #[value(name = "minilm-replay")]
    MinilmReplay,
    /// No model: GPT-2 small's 148 shapes (124,439,808 values) filled with the MiniLM
    /// gradients, tiled, with per-rank noise, every step ([`crate::replay`]); no accuracy.
    #[value(name = "gpt2-replay")]
    Gpt2Replay,
}

impl Workload {
    /// The name on the command line and in the reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Workload::DigitsMlp => "digits-mlp",
            Workload::MinilmReplay => "minilm-replay",
            Workload::Gpt2Replay => "gpt2-replay",
        }
    }

    /// The tensors of one message, name order.
    ///
    /// # Errors
    /// [`DemoError::Config`] if the replay's embedded file does not parse.
    pub fn specs(self) -> Result<Vec<ParamSpec>, DemoError> {
        match self {
            Workload::DigitsMlp => Ok(param_specs()),
            Workload::MinilmReplay => minilm_specs(),
            Workload::Gpt2Replay => gpt2_specs(),
        }
    }
}

impl serde::Serialize for Workload {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Hyper-parameters of a run, identical on every rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainConfig {
    /// Number of SGD steps.
    pub steps: usize,
    /// Images per worker per step (the global batch is `batch_size * W`); a batch larger than
    /// the shard takes the whole shard.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Momentum of SGD (0 for plain SGD).
    pub momentum: f32,
    /// Momentum of SGD for the delayed methods ([`Method::delayed`]). A one-step delay adds
    /// momentum of its own (Mitliagkas et al., "Asynchrony begets momentum", 2016), so a
    /// delayed run keeps less of the explicit kind; the default was measured on the digits
    /// (README).
    pub delayed_momentum: f32,
    /// Steps of linear warm-up to the peak learning rate; cosine decay to 0 follows.
    pub warmup_steps: usize,
    /// Test accuracy is evaluated (on rank 0) every this many steps, and after the last step.
    pub eval_every: usize,
    /// The collective the gradients travel by.
    pub collective: Collective,
    /// Timing mode: every rank waits for every other at a barrier (an all-gather of empty
    /// messages) right before the collective, so that [`Timing::wait_s`] holds the time spent
    /// waiting for the slowest rank and [`Timing::comm_s`] the transfer alone. The barrier costs
    /// one latency round per step and a few bytes on the wire (not in the program's traffic
    /// count); results are unchanged.
    pub wait_barrier: bool,
    /// Steps at the start whose phases are not timed (the first touches of the model-sized
    /// buffers of the loop, the codec and the transport): [`Timing`] covers the steps after
    /// them, and so do the learning curve's seconds. Traffic counts every step.
    pub untimed_steps: usize,
    /// Where the gradients come from.
    pub workload: Workload,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 300,
            batch_size: 32,
            lr: 0.05,
            momentum: 0.9,
            delayed_momentum: 0.8,
            warmup_steps: 10,
            eval_every: 10,
            collective: Collective::AllGather,
            wait_barrier: false,
            untimed_steps: 0,
            workload: Workload::DigitsMlp,
        }
    }
}

impl TrainConfig {
    /// The learning rate at `step` (0-based): linear warm-up, then cosine decay to 0.
    #[must_use]
    pub fn lr_at(&self, step: usize) -> f32 {
        #[allow(clippy::cast_precision_loss)]
        if step < self.warmup_steps {
            self.lr * (step + 1) as f32 / self.warmup_steps as f32
        } else {
            let span = self.steps.saturating_sub(self.warmup_steps).max(1) as f32;
            let t = (step - self.warmup_steps) as f32 / span;
            0.5 * self.lr * (1.0 + (std::f32::consts::PI * t).cos())
        }
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`DemoError::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<(), DemoError> {
        let bad = |m: &str| Err(DemoError::Config(m.into()));
        if self.steps == 0 {
            return bad("steps must be at least 1");
        }
        if self.untimed_steps >= self.steps {
            return bad("untimed steps must be fewer than the steps");
        }
        if self.batch_size == 0 {
            return bad("batch size must be at least 1");
        }
        if self.eval_every == 0 {
            return bad("eval_every must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("learning rate must be positive");
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad("momentum must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.delayed_momentum) {
            return bad("delayed momentum (--delayed-momentum) must be in [0, 1)");
        }
        Ok(())
    }
}

/// One point of a learning curve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CurvePoint {
    /// Steps done.
    pub step: usize,
    /// Test accuracy in [0, 1].
    pub test_accuracy: f32,
    /// Bytes each worker has sent so far (mean over workers).
    pub bytes_per_worker: f64,
}

/// Wall-clock seconds one rank spent in each phase of its steps. Not reproducible: kept apart
/// from the rest of the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Forward and backward (candle), batch assembly included.
    pub compute_s: f64,
    /// [`GradientCodec::encode`]. For a delayed method: copying the step's gradients out for
    /// the exchange thread (its codec runs there, behind the compute, and is not counted).
    pub encode_s: f64,
    /// The collective: waiting for peers included, unless [`TrainConfig::wait_barrier`] moved
    /// that into [`Timing::wait_s`]. For a delayed method: waiting for the step before's
    /// exchange (what the compute did not hide).
    pub comm_s: f64,
    /// Waiting for the slowest rank at the barrier before the collective
    /// ([`TrainConfig::wait_barrier`]; 0 without it).
    pub wait_s: f64,
    /// [`GradientCodec::decode_mean`].
    pub decode_s: f64,
    /// The SGD update and copying the parameters into the model (and the loop's digest of the
    /// mean it applies).
    pub update_s: f64,
    /// Evaluation on the test set (rank 0), not part of a step.
    pub eval_s: f64,
    /// Bytes the network interface named by `GRADWIRE_DEMO_NETDEV` (e.g. `eth0`) sent during
    /// the training loop, from its kernel counter (`/sys/class/net/IFACE/statistics/tx_bytes`,
    /// read before the first step and after the last): every packet of this host, headers
    /// included. 0 when the variable is unset or the counter cannot be read.
    pub netdev_tx_bytes: f64,
    /// The same for the bytes it received (`rx_bytes`).
    pub netdev_rx_bytes: f64,
}

impl Timing {
    const FIELDS: usize = 9;

    /// Adds `other`'s seconds and bytes, field by field.
    fn add(&mut self, other: &Timing) {
        let (mine, theirs) = (self.to_array(), other.to_array());
        let mut sum = [0.0; Self::FIELDS];
        for ((s, a), b) in sum.iter_mut().zip(mine).zip(theirs) {
            *s = a + b;
        }
        *self = Timing::from_array(sum);
    }

    /// Seconds of the steps proper (evaluation excluded).
    #[must_use]
    pub fn step_s(&self) -> f64 {
        self.compute_s + self.encode_s + self.wait_s + self.comm_s + self.decode_s + self.update_s
    }

    /// Share of step time spent compressing and decoding, in [0, 1].
    #[must_use]
    pub fn codec_share(&self) -> f64 {
        let s = self.step_s();
        if s > 0.0 {
            (self.encode_s + self.decode_s) / s
        } else {
            0.0
        }
    }

    fn to_array(self) -> [f64; Self::FIELDS] {
        [
            self.compute_s,
            self.encode_s,
            self.comm_s,
            self.decode_s,
            self.update_s,
            self.eval_s,
            self.netdev_tx_bytes,
            self.netdev_rx_bytes,
            self.wait_s,
        ]
    }

    fn from_array(a: [f64; Self::FIELDS]) -> Timing {
        Timing {
            compute_s: a[0],
            encode_s: a[1],
            comm_s: a[2],
            decode_s: a[3],
            update_s: a[4],
            eval_s: a[5],
            netdev_tx_bytes: a[6],
            netdev_rx_bytes: a[7],
            wait_s: a[8],
        }
    }

    /// The mean of several ranks' timings.
    #[must_use]
    pub fn mean(timings: &[Timing]) -> Timing {
        let mut sum = [0.0; Self::FIELDS];
        for t in timings {
            for (s, v) in sum.iter_mut().zip(t.to_array()) {
                *s += v;
            }
        }
        #[allow(clippy::cast_precision_loss)]
        let n = timings.len().max(1) as f64;
        Timing::from_array(sum.map(|s| s / n))
    }
}

/// Bytes per rank per step (mean over the run's steps), over ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepTraffic {
    /// Bytes sent: the largest over ranks.
    pub sent_max: f64,
    /// Bytes sent: the mean over ranks.
    pub sent_mean: f64,
    /// Bytes received: the largest over ranks.
    pub received_max: f64,
    /// Bytes received: the mean over ranks.
    pub received_mean: f64,
}

/// What one rank reports after a run. Everything but `timing` is reproducible: the same seed
/// gives the same values, bit for bit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankReport {
    /// The method.
    pub method: Method,
    /// The run's seed.
    pub seed: u64,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Test accuracy of the final model, in [0, 1].
    pub test_accuracy: f32,
    /// Mean cross-entropy of the final model over the whole training set.
    pub train_loss: f32,
    /// Mean cross-entropy of the initial model over the whole training set.
    pub initial_train_loss: f32,
    /// Mean bytes one worker sent per step (every byte of the message, mean over workers and
    /// steps): its bundle (all-gather), its shard messages (two-phase).
    pub bytes_per_worker_per_step: f64,
    /// Bytes per rank per step that crossed the communicator (its logical counters, the same
    /// on every transport), mean over steps: the largest over ranks and the mean over ranks.
    pub traffic: StepTraffic,
    /// Learning curve: evaluated on rank 0 only (empty on the other ranks).
    pub curve: Vec<CurvePoint>,
    /// Rank 0's wall-clock seconds of training at each point of `curve` (the steps' time so
    /// far, evaluation excluded): the time-to-accuracy axis. Not reproducible.
    pub curve_s: Vec<f64>,
    /// Digest of the final parameters ([`digest`]): equal on every rank.
    pub param_digest: u64,
    /// Digest of the aggregated mean gradient of every step, folded in step order: equal on
    /// every rank (checked at the end of the run).
    pub mean_digest: u64,
    /// This rank's timing.
    pub timing: Timing,
    /// Mean timing over all ranks (gathered after the last step).
    pub mean_timing: Timing,
}

fn digits() -> &'static Digits {
    static DIGITS: OnceLock<Digits> = OnceLock::new();
    DIGITS.get_or_init(Digits::load)
}

/// Draws mini-batches from a shard: a seeded permutation per epoch, cut into batches.
struct Batches {
    order: Vec<usize>,
    next: usize,
    rng: ChaCha8Rng,
}

impl Batches {
    fn new(len: usize, seed: u64, rank: usize) -> Batches {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Stream 0 draws the initial weights; rank r's batches use stream r + 1.
        rng.set_stream(rank as u64 + 1);
        Batches {
            order: (0..len).collect(),
            next: len,
            rng,
        }
    }

    fn next_batch(&mut self, size: usize) -> Vec<usize> {
        let size = size.min(self.order.len());
        if self.next + size > self.order.len() {
            self.order.shuffle(&mut self.rng);
            self.next = 0;
        }
        let batch = self.order[self.next..self.next + size].to_vec();
        self.next += size;
        batch
    }
}

/// Where one rank's gradients come from ([`Workload`]).
#[allow(clippy::large_enum_variant)] // one value per rank and run
enum Source {
    /// The MLP, this rank's shard of the training set, its mini-batches and the last step's
    /// gradients.
    Mlp(Mlp, Samples, Batches, Vec<Vec<f32>>),
    /// The replayed MiniLM gradients.
    Replay(ReplayGradients),
}

impl Source {
    /// Rank `rank`'s source for `workload` and its starting parameters.
    fn new(
        workload: Workload,
        specs: &[ParamSpec],
        data: &Digits,
        seed: u64,
        rank: usize,
        world_size: usize,
    ) -> Result<(Vec<Vec<f32>>, Source), DemoError> {
        Ok(match workload {
            Workload::DigitsMlp => {
                let params = init_params(specs, seed);
                let shard = data.train.shard(rank, world_size);
                let batches = Batches::new(shard.len(), seed, rank);
                let model = Mlp::new(&params)?;
                (params, Source::Mlp(model, shard, batches, Vec::new()))
            }
            Workload::MinilmReplay => (
                specs.iter().map(|s| vec![0.0; s.len()]).collect(),
                Source::Replay(ReplayGradients::new(seed, rank)?),
            ),
            Workload::Gpt2Replay => (
                specs.iter().map(|s| vec![0.0; s.len()]).collect(),
                Source::Replay(ReplayGradients::tiled(specs, seed, rank)?),
            ),
        })
    }

    /// The model, where there is one (a replay has none).
    fn model(&self) -> Option<&Mlp> {
        match self {
            Source::Mlp(model, ..) => Some(model),
            Source::Replay(_) => None,
        }
    }

    /// The next step's gradients: of a mini-batch of `batch_size`, or the next replayed step.
    fn next_gradients(&mut self, batch_size: usize) -> Result<&[Vec<f32>], DemoError> {
        match self {
            Source::Mlp(model, shard, batches, grads) => {
                let batch: Samples = shard.select(&batches.next_batch(batch_size));
                *grads = model.loss_and_grads(&batch)?.1;
                Ok(grads)
            }
            Source::Replay(replay) => Ok(replay.next_step()),
        }
    }

    /// Gives the model the updated parameters (a replay ignores them).
    fn set_params(&self, params: &[Vec<f32>]) -> Result<(), DemoError> {
        if let Some(model) = self.model() {
            model.set_params(params)?;
        }
        Ok(())
    }
}

/// The kernel's byte counters (sent, received) of the network interface named by
/// `GRADWIRE_DEMO_NETDEV`, or `None` when it is unset or unreadable (see
/// [`Timing::netdev_tx_bytes`]; the slow-network harness `netsim/` sets it to each host's link).
/// One rank's side of a step's exchange: the communicator, the codec, their buffers and the
/// mean gradient the exchange writes. The delayed methods move it to a thread for the length
/// of an exchange (behind the next step's compute) and get it back at the join.
struct Exchange<'a> {
    comm: &'a mut dyn Communicator,
    codec: &'a mut dyn GradientCodec,
    wait_barrier: bool,
    max_len: usize,
    message: Vec<u8>,
    gathered: Vec<Vec<u8>>,
    barrier_out: Vec<Vec<u8>>,
    /// The mean gradient, one vector per parameter, name order.
    mean: Vec<Vec<f32>>,
}

/// What one exchange took (seconds, on the thread that ran it) and moved (bytes).
#[derive(Debug, Default)]
struct Exchanged {
    /// Its encode, wait, communication and decode seconds (the other fields 0).
    timing: Timing,
    /// The message bytes of the step, as [`RankReport::bytes_per_worker_per_step`] counts them.
    bytes: f64,
    sent: u64,
    received: u64,
}

/// An exchange back from its thread: the exchange, the gradients it read, its result.
type Finished<'a> = (Exchange<'a>, Vec<Vec<f32>>, Result<Exchanged, DemoError>);

impl Exchange<'_> {
    /// This rank's `grads` (one slice per parameter, name order) of `step` through the codec
    /// and the collective, the mean into `self.mean`.
    fn run(&mut self, step: usize, grads: &[&[f32]]) -> Result<Exchanged, DemoError> {
        let t1 = Instant::now();
        let step = step as u64;
        let mut done = Exchanged::default();
        let (t2, t3, before, own_before) = if self.codec.runs_own_collective() {
            self.codec.stage(grads, &mut self.mean)?;
            done.timing.wait_s = self.barrier()?;
            let (before, own_before) = (self.comm.traffic(), self.codec.own_traffic());
            // Compression, collective and decode are one call: timed as communication.
            let t2 = Instant::now();
            #[allow(clippy::cast_precision_loss)]
            {
                done.bytes = self
                    .codec
                    .all_reduce(&mut *self.comm, step, grads, &mut self.mean)?
                    as f64;
            }
            (t2, Instant::now(), before, own_before)
        } else {
            self.codec.encode(step, grads, &mut self.message)?;
            done.timing.wait_s = self.barrier()?;
            let (before, own_before) = (self.comm.traffic(), self.codec.own_traffic());
            let t2 = Instant::now();
            self.comm
                .all_gather(&self.message, self.max_len, &mut self.gathered)?;
            let t3 = Instant::now();
            self.codec
                .decode_mean(step, &self.gathered, &mut self.mean)?;
            #[allow(clippy::cast_precision_loss)]
            {
                done.bytes = self.gathered.iter().map(Vec::len).sum::<usize>() as f64
                    / self.gathered.len() as f64;
            }
            (t2, t3, before, own_before)
        };
        let t4 = Instant::now();
        let moved = self.comm.traffic().since(before);
        let own = self.codec.own_traffic().since(own_before);
        done.sent = moved.sent + own.sent;
        done.received = moved.received + own.received;
        done.timing.encode_s = (t2 - t1).as_secs_f64() - done.timing.wait_s;
        done.timing.comm_s = (t3 - t2).as_secs_f64();
        done.timing.decode_s = (t4 - t3).as_secs_f64();
        Ok(done)
    }

    /// The timing mode's barrier ([`TrainConfig::wait_barrier`]), right before the collective
    /// (for a codec that runs its own collective that is before its encode): the seconds
    /// waited.
    fn barrier(&mut self) -> Result<f64, DemoError> {
        if !self.wait_barrier {
            return Ok(0.0);
        }
        let t = Instant::now();
        self.comm.all_gather(&[], 0, &mut self.barrier_out)?;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Waits for an exchange's thread (a panic there is resumed here).
fn join<'a>(running: ScopedJoinHandle<'_, Finished<'a>>) -> Finished<'a> {
    running
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// A rank's running totals over its exchanges, in step order.
#[derive(Debug, Default)]
struct Books {
    /// Message bytes (see [`Exchanged::bytes`]).
    bytes_total: f64,
    sent_total: f64,
    received_total: f64,
    /// Digest of every step's mean gradient, folded in step order: equal on every rank.
    mean_digest: u64,
}

impl Books {
    fn record(&mut self, done: &Exchanged, mean: &[Vec<f32>]) {
        self.bytes_total += done.bytes;
        #[allow(clippy::cast_precision_loss)]
        {
            self.sent_total += done.sent as f64;
            self.received_total += done.received as f64;
        }
        self.mean_digest = (self.mean_digest ^ digest(mean))
            .rotate_left(17)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

fn netdev_counters() -> Option<(u64, u64)> {
    let iface = std::env::var("GRADWIRE_DEMO_NETDEV").ok()?;
    if iface.is_empty() || iface.contains('/') || iface.starts_with('.') {
        return None;
    }
    let read = |what: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{iface}/statistics/{what}"))
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    };
    Some((read("tx_bytes")?, read("rx_bytes")?))
}

/// Runs one rank of a data-parallel training run with the codec of `method`.
///
/// Every rank of `comm` must call this with the same `config`, `method` and `seed`. `progress`
/// (normally given to rank 0 only) advances by one per step.
///
/// # Errors
/// [`DemoError::NotWired`] when the method has no codec yet; codec, candle and communication
/// errors.
pub fn run_rank(
    comm: &mut dyn Communicator,
    config: &TrainConfig,
    method: Method,
    seed: u64,
    progress: Option<&ProgressBar>,
) -> Result<RankReport, DemoError> {
    let specs = config.workload.specs()?;
    let ctx = CodecContext {
        specs: &specs,
        rank: comm.rank(),
        world_size: comm.world_size(),
        seed,
        collective: config.collective,
        momentum: config.momentum,
    };
    let codec = new_codec(method, &ctx)?;
    run_rank_with_codec(comm, config, codec, seed, progress)
}

/// [`run_rank`] with a codec built by the caller (e.g. an experimental one).
///
/// # Errors
/// Codec, candle and communication errors.
#[allow(clippy::too_many_lines)]
pub fn run_rank_with_codec(
    comm: &mut dyn Communicator,
    config: &TrainConfig,
    mut codec: Box<dyn GradientCodec>,
    seed: u64,
    progress: Option<&ProgressBar>,
) -> Result<RankReport, DemoError> {
    config.validate()?;
    single_threaded_matmul();
    let rank = comm.rank();
    let world_size = comm.world_size();
    let data = digits();
    let specs: Vec<ParamSpec> = config.workload.specs()?;
    let (mut params, mut source) =
        Source::new(config.workload, &specs, data, seed, rank, world_size)?;
    let mut velocity: Vec<Vec<f32>> = specs.iter().map(|s| vec![0.0; s.len()]).collect();
    // A codec with DGC's momentum correction has applied the momentum already.
    let momentum = if codec.owns_momentum() {
        0.0
    } else if codec.method().delayed() {
        config.delayed_momentum
    } else {
        config.momentum
    };
    let delayed = codec.method().delayed();
    if delayed && config.wait_barrier {
        return Err(DemoError::Config(format!(
            "`{}` runs each exchange behind the next step's compute: --wait-barrier, which splits \
             a blocking exchange's time, does not apply to it",
            codec.method()
        )));
    }
    let max_len = codec.max_message_len();
    let mut timing = Timing::default();
    let mut curve = Vec::new();
    let mut curve_s = Vec::new();
    let mut books = Books::default();
    let initial_train_loss = match source.model() {
        Some(model) => model.evaluate(&data.train)?.0,
        None => 0.0,
    };

    let evaluate = |source: &Source, step: usize, bytes: f64, timing: &mut Timing| {
        let Some(model) = source.model() else {
            return Ok(None); // a replay has no model to evaluate
        };
        let t = Instant::now();
        let (_, acc) = model.evaluate(&data.test)?;
        timing.eval_s += t.elapsed().as_secs_f64();
        Ok::<_, DemoError>(Some(CurvePoint {
            step,
            test_accuracy: acc,
            bytes_per_worker: bytes,
        }))
    };
    if rank == 0
        && let Some(point) = evaluate(&source, 0, 0.0, &mut timing)?
    {
        curve.push(point);
        curve_s.push(0.0);
    }

    let netdev_before = netdev_counters();
    let exchange = Exchange {
        comm: &mut *comm,
        codec: codec.as_mut(),
        wait_barrier: config.wait_barrier,
        max_len,
        message: Vec::with_capacity(max_len),
        gathered: Vec::new(),
        barrier_out: Vec::new(),
        mean: velocity.clone(),
    };
    // The mean each step applies: its own, or with a delay the step before's (zeros at the
    // first step).
    let mut applied: Vec<Vec<f32>> = velocity.clone();
    // With a delay: this step's gradients, copied out of the source for the exchange that runs
    // behind the next step, and the buffer the exchange in flight gives back.
    let (mut handover, mut returned) = if delayed {
        (velocity.clone(), Some(velocity.clone()))
    } else {
        (Vec::new(), None)
    };
    thread::scope(|scope| -> Result<(), DemoError> {
        let mut idle = Some(exchange);
        let mut in_flight: Option<ScopedJoinHandle<'_, Finished<'_>>> = None;
        let taken = || DemoError::Transport("the exchange is not back from its thread".into());
        for step in 0..config.steps {
            let t0 = Instant::now();
            let grads = source.next_gradients(config.batch_size)?;
            let t1 = Instant::now();
            let mut phases = Timing {
                compute_s: (t1 - t0).as_secs_f64(),
                ..Timing::default()
            };
            // The exchange that ended in this step (with a delay, the step before's).
            let mut finished = None;
            if delayed {
                for (h, g) in handover.iter_mut().zip(grads) {
                    h.copy_from_slice(g);
                }
                let t2 = Instant::now();
                phases.encode_s = (t2 - t1).as_secs_f64();
                if let Some(running) = in_flight.take() {
                    let (mut ex, grads_back, result) = join(running);
                    finished = Some(result?);
                    std::mem::swap(&mut applied, &mut ex.mean);
                    idle = Some(ex);
                    returned = Some(grads_back);
                }
                phases.comm_s = t2.elapsed().as_secs_f64();
                let mut ex = idle.take().ok_or_else(taken)?;
                let to_send = std::mem::replace(&mut handover, returned.take().ok_or_else(taken)?);
                in_flight = Some(scope.spawn(move || {
                    let result = {
                        let views: Vec<&[f32]> = to_send.iter().map(Vec::as_slice).collect();
                        ex.run(step, &views)
                    };
                    (ex, to_send, result)
                }));
            } else {
                let ex = idle.as_mut().ok_or_else(taken)?;
                let views: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
                let done = ex.run(step, &views)?;
                std::mem::swap(&mut applied, &mut ex.mean);
                phases.add(&done.timing);
                finished = Some(done);
            }
            // The loop's own bookkeeping of the mean it applies (its digest): timed with the
            // update, not the codec.
            let t4 = Instant::now();
            if let Some(done) = finished {
                books.record(&done, &applied);
            }
            let lr = config.lr_at(step);
            for ((p, v), g) in params.iter_mut().zip(&mut velocity).zip(&applied) {
                for ((p, v), g) in p.iter_mut().zip(v.iter_mut()).zip(g) {
                    *v = momentum * *v + *g;
                    *p -= lr * *v;
                }
            }
            source.set_params(&params)?;
            phases.update_s = t4.elapsed().as_secs_f64();
            if step >= config.untimed_steps {
                timing.add(&phases);
            }
            let done = step + 1;
            if rank == 0
                && (done % config.eval_every == 0 || done == config.steps)
                && let Some(point) = evaluate(&source, done, books.bytes_total, &mut timing)?
            {
                if let Some(pb) = progress {
                    pb.set_message(format!("test acc {:.1}%", 100.0 * point.test_accuracy));
                }
                curve.push(point);
                curve_s.push(timing.step_s());
            }
            if let Some(pb) = progress {
                pb.inc(1);
            }
        }
        // The last step's exchange: its mean is never applied (a further step would), but
        // every rank completes it and it counts in the traffic and the digest.
        if let Some(running) = in_flight.take() {
            let t = Instant::now();
            let (ex, _, result) = join(running);
            books.record(&result?, &ex.mean);
            timing.comm_s += t.elapsed().as_secs_f64();
        }
        Ok(())
    })?;
    let mut gathered: Vec<Vec<u8>> = Vec::new();

    if let (Some((tx0, rx0)), Some((tx1, rx1))) = (netdev_before, netdev_counters()) {
        #[allow(clippy::cast_precision_loss)]
        {
            timing.netdev_tx_bytes = tx1.saturating_sub(tx0) as f64;
            timing.netdev_rx_bytes = rx1.saturating_sub(rx0) as f64;
        }
    }
    let (test_accuracy, train_loss) = match source.model() {
        Some(model) => (
            model.evaluate(&data.test)?.1,
            model.evaluate(&data.train)?.0,
        ),
        None => (0.0, 0.0),
    };

    // Every rank's traffic per step, for the largest and the mean over ranks.
    #[allow(clippy::cast_precision_loss)]
    let per_step = config.steps.max(1) as f64;
    let mine: Vec<u8> = [books.sent_total / per_step, books.received_total / per_step]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    comm.all_gather(&mine, 16, &mut gathered)?;
    let mut traffic = StepTraffic::default();
    for m in &gathered {
        if m.len() != 16 {
            return Err(DemoError::Transport(format!(
                "a rank sent {} bytes of traffic counters, not 16",
                m.len()
            )));
        }
        let at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&m[8 * i..8 * i + 8]);
            f64::from_le_bytes(b)
        };
        let (sent, received) = (at(0), at(1));
        traffic.sent_max = traffic.sent_max.max(sent);
        traffic.received_max = traffic.received_max.max(received);
        #[allow(clippy::cast_precision_loss)]
        {
            traffic.sent_mean += sent / gathered.len() as f64;
            traffic.received_mean += received / gathered.len() as f64;
        }
    }

    // Gather every rank's timing so that rank 0 (which prints the table) knows the mean.
    let mine: Vec<u8> = timing
        .to_array()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    comm.all_gather(&mine, Timing::FIELDS * 8, &mut gathered)?;
    let all: Vec<Timing> = gathered
        .iter()
        .map(|m| {
            let mut a = [0.0; Timing::FIELDS];
            for (v, b) in a.iter_mut().zip(m.chunks_exact(8)) {
                *v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
            }
            Timing::from_array(a)
        })
        .collect();

    // Every rank must hold the same aggregated gradient at every step and the same final
    // parameters, on threads and under MPI alike.
    let param_digest = digest(&params);
    let mut mine = [0u8; 16];
    mine[..8].copy_from_slice(&param_digest.to_le_bytes());
    mine[8..].copy_from_slice(&books.mean_digest.to_le_bytes());
    comm.all_gather(&mine, 16, &mut gathered)?;
    if let Some(other) = gathered
        .iter()
        .position(|m| m.as_slice() != mine.as_slice())
    {
        return Err(DemoError::Transport(format!(
            "replicas diverged: rank {other} aggregated other gradients or holds other parameters \
             than rank {rank}"
        )));
    }

    #[allow(clippy::cast_precision_loss)]
    let bytes_per_worker_per_step = books.bytes_total / config.steps as f64;
    Ok(RankReport {
        method: codec.method(),
        seed,
        rank,
        world_size,
        test_accuracy,
        train_loss,
        initial_train_loss,
        bytes_per_worker_per_step,
        traffic,
        curve,
        curve_s,
        param_digest,
        mean_digest: books.mean_digest,
        timing,
        mean_timing: Timing::mean(&all),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_and_decays() {
        let c = TrainConfig {
            steps: 100,
            warmup_steps: 10,
            lr: 1.0,
            ..TrainConfig::default()
        };
        assert!((c.lr_at(0) - 0.1).abs() < 1e-6);
        assert!((c.lr_at(9) - 1.0).abs() < 1e-6);
        assert!((c.lr_at(10) - 1.0).abs() < 1e-6);
        assert!(c.lr_at(99) < 0.01);
    }

    #[test]
    fn batches_cover_the_shard() {
        let mut b = Batches::new(10, 7, 0);
        let mut seen: Vec<usize> = (0..3).flat_map(|_| b.next_batch(3)).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 9);
        assert_eq!(Batches::new(4, 7, 0).next_batch(10).len(), 4);
    }
}

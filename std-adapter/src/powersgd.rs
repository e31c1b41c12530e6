//! PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): each gradient tensor, reshaped to a
//! `rows x cols` matrix (`rows` = its first dimension), is approximated by a rank-`r` product
//! `P Qᵀ` from one step of subspace iteration, warm-started from the previous step's `Q`. Its
//! messages are dense factors that are summed, so they travel through the
//! [`Communicator`]'s rank-order [`Communicator::all_reduce_sum_f32`], and their size does not
//! grow with the world size: `(rows + cols) x r` values per tensor instead of `rows x cols`.
//!
//! One step ([`PowerSgd::all_reduce_mean`]), the same on every rank:
//! 1. `M = gradient + residual` (with error feedback); `P = M Q` (Q from the previous step, or
//!    drawn from the shared seed at the first; a column of zeros, left by a step whose summed
//!    `P` had one, is drawn again, salted by the step, since it would otherwise stay zero);
//! 2. all-reduce #1: every tensor's `P`, every uncompressed tensor's gradient (they are
//!    batched into the same call) and a control block: each rank's failure flag and the
//!    fingerprint of its configuration, step and model layout, so that a rank that failed
//!    locally still takes part and every rank returns an error naming it at the same call;
//! 3. `P` orthogonalized (Gram-Schmidt), `Q = Mᵀ P`; all-reduce #2: every tensor's `Q`;
//! 4. the result `P (Σ Q / W)ᵀ`, the uncompressed tensors' `Σ g / W`; the residual
//!    `M - P Q_localᵀ`, so that for every coordinate `sent + residual_new == gradient +
//!    residual_old` up to the rounding of that subtraction, where `sent = P Q_localᵀ` is this
//!    rank's share of the result (the mean of the ranks' `sent` is the result).
//!
//! Which tensors go compressed is decided from shapes and configuration alone (so every rank
//! agrees): a tensor with fewer than two rows or columns, one whose compression rate
//! `rows cols / ((rows + cols) r)` is below [`PowerSgdConfig::min_compression_rate`], and every
//! tensor before [`PowerSgdConfig::start_step`] goes uncompressed, as PyTorch's PowerSGD
//! hook does; so does a tensor whose smaller side is at most `r` (PyTorch lowers `r` to that
//! side instead, and then sends at least the tensor's own number of values). Unlike that hook, error feedback and `Q` are kept by tensor name, so they do not
//! depend on how buckets are formed, and every product and sum is in a fixed order
//! ([`gradwire_core::powersgd`]): every rank and every transport gives the same bits.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use gradwire_core::powersgd::{back_project, init_q, orthogonalize, project, reconstruct};
use gradwire_core::tensor_id;
use gradwire_core::values::first_non_finite;

use crate::comm::Communicator;
use crate::engine::low_rank;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

mod checkpoint;

/// PowerSGD's settings; every rank must use the same.
#[derive(Clone, Debug, PartialEq)]
pub struct PowerSgdConfig {
    /// Rank `r` of the approximation (at least 1).
    pub rank: usize,
    /// Steps before this one (counted from 0) send every tensor uncompressed; PyTorch's
    /// `start_powerSGD_iter`, which its authors advise setting to about a tenth of training.
    pub start_step: u64,
    /// A tensor is compressed only if `rows cols / ((rows + cols) r)` is at least this
    /// (finite, `>= 0`), and its smaller side is larger than `rank`.
    pub min_compression_rate: f64,
    /// Keep what the approximation does not send, by tensor name, and add it to the next step.
    pub error_feedback: bool,
    /// Start each step's power iteration from the previous step's `Q` (otherwise from a fresh
    /// draw of the shared seed every step).
    pub warm_start: bool,
    /// The seed `Q` is drawn from, with the tensor's name: the same on every rank.
    pub seed: u64,
}

impl Default for PowerSgdConfig {
    /// Rank 1, compressed from the first step, minimum compression rate 2, error feedback and
    /// warm start on, seed 0 (PyTorch's defaults but for the start step).
    fn default() -> Self {
        PowerSgdConfig {
            rank: 1,
            start_step: 0,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
            seed: 0,
        }
    }
}

impl PowerSgdConfig {
    /// Rank `rank` with the other settings at their defaults.
    pub fn with_rank(rank: usize) -> Self {
        PowerSgdConfig {
            rank,
            ..Self::default()
        }
    }

    fn check(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::config("PowerSGD rank 0: the rank is at least 1"));
        }
        if !(self.min_compression_rate.is_finite() && self.min_compression_rate >= 0.0) {
            return Err(Error::config(format!(
                "PowerSGD minimum compression rate {}: finite and >= 0",
                self.min_compression_rate
            )));
        }
        Ok(())
    }

    /// The text every rank's fingerprint hashes.
    fn text(&self) -> String {
        format!(
            "powersgd rank={} start={} min_rate={} ef={} warm={} seed={}",
            self.rank,
            self.start_step,
            self.min_compression_rate,
            self.error_feedback,
            self.warm_start,
            self.seed
        )
    }
}

/// How one tensor travels at a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// As it is, summed and divided by W.
    Dense,
    /// As `P` (`rows x r`) and `Q` (`cols x r`).
    LowRank { rows: usize, cols: usize },
}

/// Where one tensor's values sit in the step's two messages, decided once per step.
#[derive(Clone, Debug)]
struct Span {
    plan: Plan,
    /// The tensor (dense) or its `P`, within the first message after the control block.
    first: Range<usize>,
    /// Its `Q` within the second message (empty for a dense tensor).
    second: Range<usize>,
    /// Its slot in the per-step buffers of low-rank tensors (0 for a dense one).
    slot: usize,
}

/// What PowerSGD keeps for one tensor between steps.
#[derive(Clone, Debug, PartialEq)]
struct TensorState {
    shape: Vec<usize>,
    /// `Q` of the last compressed step (`cols x r`, column by column), or empty.
    q: Vec<f32>,
    /// The error-feedback residual (`rows x cols`), or empty.
    residual: Vec<f32>,
}

/// Per-step buffers, kept between steps.
#[derive(Debug, Default)]
struct Buffers {
    first: Vec<f32>,
    second: Vec<f32>,
    /// Each low-rank tensor's `M`, `Q_local` and new residual, by slot.
    m: Vec<Vec<f32>>,
    q_local: Vec<Vec<f32>>,
    residual: Vec<Vec<f32>>,
}

/// PowerSGD over a [`Communicator`]: one per rank, all built with the same
/// [`PowerSgdConfig`], each called with its rank's gradients at every step.
///
/// ```
/// use std::collections::HashMap;
/// use gradwire::comm::{Communicator, LocalGroup};
/// use gradwire::powersgd::{PowerSgd, PowerSgdConfig};
/// use gradwire::Tensor;
///
/// let comms = LocalGroup::new(2).into_communicators();
/// let handles: Vec<_> = comms
///     .into_iter()
///     .map(|mut comm| {
///         std::thread::spawn(move || {
///             let r = comm.rank() as f32;
///             let mut psgd = PowerSgd::new(PowerSgdConfig::with_rank(1)).unwrap();
///             // A rank-1 matrix (outer product) is sent exactly, up to rounding.
///             let w: Vec<f32> = (0..12).map(|t| (1 + t / 4) as f32 * (t % 4) as f32 * (1.0 + r)).collect();
///             let grads = HashMap::from([
///                 ("w".to_string(), Tensor::new(vec![3, 4], w).unwrap()),
///                 ("b".to_string(), Tensor::vector(vec![r, 2.0])),
///             ]);
///             psgd.all_reduce_mean(&mut comm, &grads)
///         })
///     })
///     .collect();
/// for h in handles {
///     let mean = h.join().unwrap().unwrap();
///     assert_eq!(mean["b"].data(), &[0.5, 2.0]); // uncompressed: one dimension
///     let w = mean["w"].data();
///     assert!((w[4 + 3] - 2.0 * 3.0 * 1.5).abs() < 1e-4);
/// }
/// ```
#[derive(Debug)]
pub struct PowerSgd {
    config: PowerSgdConfig,
    step: u64,
    tensors: BTreeMap<String, TensorState>,
    buffers: Buffers,
    message_bytes: usize,
}

/// Values per rank in the control block: a failure flag and 4 fingerprint words of 16 bits.
const CONTROL_PER_RANK: usize = 5;

impl PowerSgd {
    /// PowerSGD with `config`, at step 0, with no state yet.
    ///
    /// # Errors
    /// [`Error::Config`] for rank 0 or a minimum compression rate that is negative or not
    /// finite.
    pub fn new(config: PowerSgdConfig) -> Result<Self> {
        config.check()?;
        Ok(PowerSgd {
            config,
            step: 0,
            tensors: BTreeMap::new(),
            buffers: Buffers::default(),
            message_bytes: 0,
        })
    }

    /// The settings.
    pub fn config(&self) -> &PowerSgdConfig {
        &self.config
    }

    /// The step the next call runs (every call counts, failed ones too, so that the ranks of a
    /// group stay in step).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The f32 bytes this rank gave the last step's two all-reduces (control block, `P`s and
    /// uncompressed tensors, then `Q`s): its message, which the all-reduces move as a ring
    /// does (`2 (W - 1) / W` times each way).
    pub fn last_message_bytes(&self) -> usize {
        self.message_bytes
    }

    /// This rank's error-feedback residual of `name` (row-major), if it has one.
    pub fn residual(&self, name: &str) -> Option<&[f32]> {
        self.tensors
            .get(name)
            .map(|t| t.residual.as_slice())
            .filter(|r| !r.is_empty())
    }

    /// The `Q` factor (`cols x r`, column by column) of `name`'s last compressed step, which
    /// its next step starts from (a column of zeros redrawn first), if it has one; the same
    /// on every rank.
    pub fn q(&self, name: &str) -> Option<&[f32]> {
        self.tensors
            .get(name)
            .map(|t| t.q.as_slice())
            .filter(|q| !q.is_empty())
    }

    fn plan(&self, shape: &[usize]) -> Plan {
        let (Some(&rows), true) = (shape.first(), shape.len() >= 2) else {
            return Plan::Dense;
        };
        let n: usize = shape.iter().product();
        let cols = n.checked_div(rows).unwrap_or(0);
        let r = self.config.rank;
        let rate = (rows as f64 * cols as f64) / ((rows as f64 + cols as f64) * r as f64);
        // A rank at or above the smaller side approximates nothing (`P` and `Q` would hold at
        // least the tensor's own values): such a tensor travels as it is, and `P` and `Q`
        // never hold more values than the tensor, whatever the configured rank.
        if self.step < self.config.start_step
            || rows < 2
            || cols < 2
            || r >= rows.min(cols)
            || rate < self.config.min_compression_rate
        {
            Plan::Dense
        } else {
            Plan::LowRank { rows, cols }
        }
    }

    /// The 64-bit fingerprint of this rank's configuration, world size, step and layout (names,
    /// shapes, plans), FNV-1a over their text.
    fn fingerprint(&self, world_size: usize, names: &[(&String, &Tensor)]) -> u64 {
        let mut text = format!(
            "{} world={world_size} step={}",
            self.config.text(),
            self.step
        );
        for (name, t) in names {
            text.push_str(&format!(
                " {name}:{:?}:{:?}",
                t.shape(),
                self.plan(t.shape())
            ));
        }
        tensor_id(&text)
    }

    /// The mean over the group of every rank's `gradients`, through PowerSGD (see the module
    /// docs). Every rank calls it with tensors of the same names and shapes at the same point
    /// of its sequence of collectives.
    ///
    /// # Errors
    /// On this rank alone, before anything is sent: [`Error::Config`] for a tensor whose shape
    /// changed since an earlier step; [`Error::Core`] naming the tensor and index of a NaN or
    /// infinity in a gradient or in `gradient + residual`. This rank still takes part in the
    /// first all-reduce, so its peers fail at the same call with [`Error::PeerFailed`] naming
    /// the first failed rank. On every rank alike: [`Error::ConfigDiffers`] when a rank's
    /// configuration, step or model layout differs from rank 0's; [`Error::Overflow`] when a
    /// sum or the result is not finite, or a rank's new residual would not be (that rank
    /// sends a NaN in the tensor's `Q`, so every rank's result fails there); [`Error::Comm`]
    /// when the transport fails (ranks whose tensors hold another number of values fail there
    /// too, with a length mismatch). After an error the residuals are as before the call and
    /// `Q` is the last step's, or the draw this step made (a first draw, or a redrawn column of
    /// zeros: the same on every rank), except that when the error is one every rank sees
    /// alike (not a transport error), the residuals of compressed tensors take the step's
    /// `M = gradient + residual`, so its gradient is delayed, not lost.
    pub fn all_reduce_mean(
        &mut self,
        comm: &mut dyn Communicator,
        gradients: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let result = self.step_on(comm, gradients, None);
        self.step = self.step.wrapping_add(1);
        result
    }

    /// Takes part in this step as a rank that failed before it (its training loop found
    /// something wrong, say) and returns `error`: the rank joins the step's first all-reduce
    /// with its failure flag set, so that every peer fails at the same call with
    /// [`Error::PeerFailed`] naming it, instead of waiting for a message that never comes.
    /// `gradients` gives only the names and shapes (the values are not read); the step counts.
    pub fn all_reduce_failed(
        &mut self,
        comm: &mut dyn Communicator,
        gradients: &HashMap<String, Tensor>,
        error: Error,
    ) -> Error {
        let result = self.step_on(comm, gradients, Some(error));
        self.step = self.step.wrapping_add(1);
        match result {
            Err(e) => e,
            Ok(_) => Error::Internal {
                what: "a failed PowerSGD step succeeded".into(),
            },
        }
    }

    /// Each tensor's place in the step's messages, in name order, and the two messages'
    /// lengths (the first without its control block).
    fn spans(&self, names: &[(&String, &Tensor)]) -> (Vec<Span>, usize, usize) {
        let r = self.config.rank;
        let (mut first, mut second, mut slot) = (0usize, 0usize, 0usize);
        let spans = names
            .iter()
            .map(|(_, t)| {
                let plan = self.plan(t.shape());
                let (p_len, q_len) = match plan {
                    Plan::Dense => (t.data().len(), 0),
                    Plan::LowRank { rows, cols } => (rows * r, cols * r),
                };
                let span = Span {
                    plan,
                    first: first..first + p_len,
                    second: second..second + q_len,
                    slot,
                };
                first += p_len;
                second += q_len;
                slot += usize::from(q_len > 0);
                span
            })
            .collect();
        (spans, first, second)
    }

    fn step_on(
        &mut self,
        comm: &mut dyn Communicator,
        gradients: &HashMap<String, Tensor>,
        failed_before: Option<Error>,
    ) -> Result<HashMap<String, Tensor>> {
        let (world, me) = (comm.world_size(), comm.rank());
        let mut names: Vec<(&String, &Tensor)> = gradients.iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        let (spans, first_len, _) = self.spans(&names);
        let control = CONTROL_PER_RANK * world;
        let mut first = std::mem::take(&mut self.buffers.first);
        first.clear();
        first.resize(control + first_len, 0.0);
        self.draw_q(&names, &spans);
        let local = match failed_before {
            Some(e) => Err(e),
            None => self.prepare(&names, &spans, &mut first[control..]),
        };
        let fp = self.fingerprint(world, &names);
        for w in 0..4 {
            first[world + 4 * me + w] = ((fp >> (16 * w)) & 0xffff) as f32;
        }
        if local.is_err() {
            first[me] = 1.0;
            first[control..].fill(0.0);
        }
        let outcome = self.exchange(comm, &names, &spans, &mut first, local.is_err());
        self.buffers.first = first;
        match (local, outcome) {
            (Err(e), _) => Err(e),
            (Ok(()), Ok(out)) => Ok(out),
            (Ok(()), Err(e)) => {
                if !matches!(e, Error::Comm { .. }) && self.config.error_feedback {
                    // Every rank failed alike: the step's gradient waits in the residuals.
                    self.keep_m(&names, &spans);
                }
                Err(e)
            }
        }
    }

    /// Gives every tensor its state and every low-rank tensor this step's `Q`: drawn from the
    /// seed at its first compressed step (and every step without warm start, salted by the
    /// step), a column of zeros drawn again salted by the step (it would stay zero forever:
    /// `P = M 0 = 0`, then `Q = Mᵀ 0`). It reads only shapes and `Q`, which every rank shares,
    /// and never fails, so that every rank, a failed one too, holds the same `Q` after it.
    fn draw_q(&mut self, names: &[(&String, &Tensor)], spans: &[Span]) {
        let (r, seed, warm) = (self.config.rank, self.config.seed, self.config.warm_start);
        let step = self.step;
        for ((name, t), span) in names.iter().zip(spans) {
            let state = self
                .tensors
                .entry((*name).clone())
                .or_insert_with(|| TensorState {
                    shape: t.shape().to_vec(),
                    q: Vec::new(),
                    residual: Vec::new(),
                });
            let Plan::LowRank { cols, .. } = span.plan else {
                continue;
            };
            if state.q.len() != cols * r || !warm {
                state.q.resize(cols * r, 0.0);
                let salt = if warm { 0 } else { step };
                init_q(&mut state.q, seed ^ salt, tensor_id(name));
            } else if state
                .q
                .chunks_exact(cols)
                .any(|c| c.iter().all(|&x| x == 0.0))
            {
                let mut fresh = vec![0.0f32; cols * r];
                init_q(&mut fresh, seed ^ step, tensor_id(name));
                for (c, f) in state.q.chunks_exact_mut(cols).zip(fresh.chunks_exact(cols)) {
                    if c.iter().all(|&x| x == 0.0) {
                        c.copy_from_slice(f);
                    }
                }
            }
        }
    }

    /// Checks this rank's gradients and writes its part of the first all-reduce: each
    /// low-rank tensor's `P = M Q` and each dense tensor's values; `M` and the state stay in
    /// the buffers (residuals unchanged).
    fn prepare(
        &mut self,
        names: &[(&String, &Tensor)],
        spans: &[Span],
        out: &mut [f32],
    ) -> Result<()> {
        let ef = self.config.error_feedback;
        for (name, t) in names {
            if let Some(s) = self.tensors.get(*name)
                && s.shape != t.shape()
            {
                return Err(Error::config(format!(
                    "PowerSGD: tensor `{name}` has shape {:?}, it had {:?} at an earlier step",
                    t.shape(),
                    s.shape
                )));
            }
            if let Some(index) = first_non_finite(t.data()) {
                return Err(Error::core(
                    name,
                    None,
                    gradwire_core::Error::NonFinite { index },
                ));
            }
        }
        let slots = spans.iter().filter(|s| !s.second.is_empty()).count();
        self.buffers.m.resize_with(slots, Vec::new);
        self.buffers.q_local.resize_with(slots, Vec::new);
        self.buffers.residual.resize_with(slots, Vec::new);
        for ((name, t), span) in names.iter().zip(spans) {
            let Some(state) = self.tensors.get(*name) else {
                return Err(Error::Internal {
                    what: format!("PowerSGD has no state for `{name}`"),
                });
            };
            let out = &mut out[span.first.clone()];
            let Plan::LowRank { rows, cols } = span.plan else {
                out.copy_from_slice(t.data());
                continue;
            };
            let m = &mut self.buffers.m[span.slot];
            let residual = ef.then_some(state.residual.as_slice());
            if let Some(index) = low_rank::feedback_input(m, t.data(), residual) {
                return Err(Error::core(
                    name,
                    None,
                    gradwire_core::Error::NonFinite { index },
                ));
            }
            project(m, rows, cols, &state.q, out).map_err(|e| Error::core(name, None, e))?;
        }
        Ok(())
    }

    /// Both all-reduces and the result, after [`PowerSgd::prepare`] (`failed`: it failed on
    /// this rank, which then takes part in the first all-reduce only).
    fn exchange(
        &mut self,
        comm: &mut dyn Communicator,
        names: &[(&String, &Tensor)],
        spans: &[Span],
        first: &mut [f32],
        failed: bool,
    ) -> Result<HashMap<String, Tensor>> {
        let world = comm.world_size();
        comm.all_reduce_sum_f32(first)?;
        if let Some(rank) = (0..world).find(|&w| first[w] != 0.0) {
            return Err(Error::PeerFailed {
                rank,
                reason: "its gradients failed the step's checks there (see that rank's error)"
                    .into(),
            });
        }
        let fp_of = |w: usize| -> u64 {
            (0..4).fold(0u64, |fp, k| {
                fp | ((first[world + 4 * w + k] as u64) << (16 * k))
            })
        };
        if let Some(rank) = (1..world).find(|&w| fp_of(w) != fp_of(0)) {
            return Err(Error::ConfigDiffers {
                rank,
                field: "PowerSGD configuration, step or model layout".into(),
                expected: format!("{:016x}", fp_of(0)),
                got: format!("{:016x}", fp_of(rank)),
            });
        }
        if failed {
            return Err(Error::Internal {
                what: "a failed rank found no failure flag".into(),
            });
        }
        let control = CONTROL_PER_RANK * world;
        let sums = &mut first[control..];
        // Every rank sees the same sums, so every rank finds the same overflow.
        for ((name, _), span) in names.iter().zip(spans) {
            if let Some(index) = first_non_finite(&sums[span.first.clone()]) {
                let index = if span.plan == Plan::Dense { index } else { 0 };
                return Err(Error::Overflow {
                    tensor: (*name).clone(),
                    index,
                });
            }
        }
        // Q = Mᵀ P and the new residual M - P Q_localᵀ for every low-rank tensor, then
        // all-reduce #2.
        let ef = self.config.error_feedback;
        let mut second = std::mem::take(&mut self.buffers.second);
        second.clear();
        for ((name, _), span) in names.iter().zip(spans) {
            let Plan::LowRank { rows, cols } = span.plan else {
                continue;
            };
            let p = &mut sums[span.first.clone()];
            orthogonalize(p, rows).map_err(|e| Error::core(name, None, e))?;
            let m = &self.buffers.m[span.slot];
            let q = &mut self.buffers.q_local[span.slot];
            q.clear();
            q.resize(span.second.len(), 0.0);
            back_project(m, rows, cols, p, q).map_err(|e| Error::core(name, None, e))?;
            if ef {
                let residual = &mut self.buffers.residual[span.slot];
                let finite = low_rank::residual_after(m, p, q, rows, cols, residual)
                    .map_err(|e| Error::core(name, None, e))?;
                if !finite {
                    // This rank could not keep what it does not send. A NaN in its Q makes
                    // every rank's sum, and so every rank's result, fail at this tensor.
                    q[0] = f32::NAN;
                }
            }
            second.extend_from_slice(q);
        }
        self.message_bytes = 4 * (control + sums.len() + second.len());
        let reduced = comm.all_reduce_sum_f32(&mut second);
        let result = reduced
            .map_err(Error::from)
            .and_then(|()| self.finish(names, spans, sums, &mut second, world));
        self.buffers.second = second;
        result
    }

    /// The result from the reduced `P` (orthogonalized, in `sums`) and `Σ Q` (in `second`);
    /// then, only when every tensor's result is finite, the new `Q` and residuals.
    fn finish(
        &mut self,
        names: &[(&String, &Tensor)],
        spans: &[Span],
        sums: &[f32],
        second: &mut [f32],
        world: usize,
    ) -> Result<HashMap<String, Tensor>> {
        let w = world as f32;
        for x in second.iter_mut() {
            *x /= w;
        }
        let mut out = HashMap::with_capacity(names.len());
        for ((name, t), span) in names.iter().zip(spans) {
            let mut values = vec![0.0f32; t.data().len()];
            let sum = &sums[span.first.clone()];
            match span.plan {
                Plan::Dense => {
                    for (o, &s) in values.iter_mut().zip(sum) {
                        *o = s / w;
                    }
                }
                Plan::LowRank { rows, cols } => {
                    let q = &second[span.second.clone()];
                    reconstruct(sum, q, rows, cols, &mut values, None)
                        .map_err(|e| Error::core(name, None, e))?;
                }
            }
            if let Some(index) = first_non_finite(&values) {
                return Err(Error::Overflow {
                    tensor: (*name).clone(),
                    index,
                });
            }
            out.insert((*name).clone(), Tensor::new(t.shape().to_vec(), values)?);
        }
        // Everything succeeded: keep Q (the same on every rank) and the residuals.
        for ((name, _), span) in names.iter().zip(spans) {
            if span.plan == Plan::Dense {
                continue;
            }
            let Some(state) = self.tensors.get_mut(*name) else {
                return Err(Error::Internal {
                    what: format!("PowerSGD lost the state of `{name}`"),
                });
            };
            state.q.clear();
            state.q.extend_from_slice(&second[span.second.clone()]);
            if self.config.error_feedback {
                std::mem::swap(&mut state.residual, &mut self.buffers.residual[span.slot]);
            }
        }
        Ok(out)
    }

    /// After a step that every rank failed alike: each compressed tensor's residual becomes
    /// the step's `M` (gradient + old residual).
    fn keep_m(&mut self, names: &[(&String, &Tensor)], spans: &[Span]) {
        for ((name, _), span) in names.iter().zip(spans) {
            if span.plan == Plan::Dense {
                continue;
            }
            if let (Some(state), Some(m)) =
                (self.tensors.get_mut(*name), self.buffers.m.get(span.slot))
            {
                low_rank::residual_unsent(m, &mut state.residual);
            }
        }
    }
}

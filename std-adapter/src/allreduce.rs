//! [`CompressedAllReduce`]: the original module's compressed all-reduce, over any
//! [`Communicator`].
//!
//! Semantics, as in the original module:
//! - world size 1 without a communicator: the local rank is the group; the gradient is
//!   compressed and decompressed (so the caller sees the real compression error) and returned;
//! - world size > 1 without a communicator: [`CompressedAllReduce::all_reduce`] is an error
//!   ([`Error::NoCommunicator`]); [`CompressedAllReduce::all_reduce_with_peers`] takes the other
//!   ranks' compressed gradients and returns the true mean of all contributions;
//! - with a communicator ([`CompressedAllReduce::with_communicator`]),
//!   [`CompressedAllReduce::all_reduce`] compresses the local gradients into one bundle,
//!   all-gathers every rank's bundle and aggregates them (checks first, then every frame added
//!   into the result in rank order, so every rank gets bit-identical results).
//!
//! The result is the mean by default; [`CompressedAllReduce::with_reduction`] selects the sum or
//! a sign majority vote. [`CompressedAllReduce::with_collective`] selects the collective: the
//! all-gather (default), the two-phase shard-owner all-reduce (bytes per link flat in W, with
//! server residuals at the owners), or whichever moves fewer bytes ([`Collective::Auto`]).
//! Uncompressed f32 gradients always go through [`Communicator::all_reduce_sum_f32`].
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::comm::{Communicator, LocalGroup};
//! use gradwire::{CompressedAllReduce, CompressionMethod, Tensor};
//!
//! let comms = LocalGroup::new(2).into_communicators();
//! let handles: Vec<_> = comms
//!     .into_iter()
//!     .map(|comm| {
//!         std::thread::spawn(move || {
//!             let rank = comm.rank() as f32;
//!             let mut ar = CompressedAllReduce::with_communicator(
//!                 CompressionMethod::TopK { k: 2 },
//!                 Box::new(comm),
//!             );
//!             let grads = HashMap::from([(
//!                 "w".to_string(),
//!                 Tensor::vector(vec![1.0 + rank, 0.0, -4.0]),
//!             )]);
//!             ar.all_reduce(&grads)
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     let mean = h.join().unwrap().unwrap();
//!     assert_eq!(mean["w"].data(), &[1.5, 0.0, -4.0]);
//! }
//! ```

use std::collections::HashMap;
use std::fmt;

mod non_blocking;
pub use non_blocking::{NonBlockingAllReduce, PendingAllReduce};

use crate::aggregate::{Aggregator, Reduction, check_contribution};
use crate::collective::buffers::StepBuffers;
use crate::collective::dense::{self, DenseAllReduce};
use crate::collective::non_finite::{self, Verdict};
use crate::collective::two_phase::{self, TwoPhase};
use crate::collective::{AllGather, Collective, Config, Local};
use crate::comm::{CommError, Communicator};
use crate::compressor::GradientCompressor;
use crate::engine::Parallelism;
use crate::error::{Error, Result};
use crate::layout::{BucketConfig, CompressedGradient, Manifest};
use crate::method::CompressionMethod;
use crate::tensor::{Tensor, TensorMut};
use gradwire_core::{Method, Values};

/// The bundle of an all-gather message the compressor wrote after the room for its envelope.
fn bundle_of(message: &[u8]) -> &[u8] {
    message
        .get(crate::collective::ENVELOPE_LEN..)
        .unwrap_or(&[])
}

/// [`Error::Core`] naming the tensor and index of the first NaN or infinity of the gradients
/// in `bufs` (in the manifest's order).
fn check_finite(manifest: &Manifest, bufs: &StepBuffers<'_>) -> Result<()> {
    for (t, g) in manifest.tensors().iter().zip(bufs.gradients()) {
        if let Some(index) = gradwire_core::values::first_non_finite(g) {
            return Err(Error::core(
                &t.name,
                None,
                gradwire_core::Error::NonFinite { index },
            ));
        }
    }
    Ok(())
}

/// Whether some value of `gradients` skips a step under `compressor`'s method
/// ([`CompressedAllReduce::with_skip_non_finite`]): NaN or an infinity with error feedback,
/// whose encoder saturates; without it also a value at or above the value type's limit, which
/// the step would refuse.
fn skips<'g>(compressor: &GradientCompressor, gradients: impl Iterator<Item = &'g [f32]>) -> bool {
    let values = match compressor.method().core_method() {
        Ok(method) if !compressor.method().uses_error_feedback() => method.values(),
        _ => None,
    };
    let limit = gradwire_core::values::magnitude_limit(values);
    overflows(gradients, limit, compressor.parallelism())
}

/// Whether some value of `gradients` is NaN or at or above `limit` in magnitude: read in
/// pieces of 2^18 values, on the pool where `parallelism` says so for their number.
fn overflows<'g>(
    gradients: impl Iterator<Item = &'g [f32]>,
    limit: f32,
    parallelism: Parallelism,
) -> bool {
    const PIECE: usize = 1 << 18;
    let pieces: Vec<&[f32]> = gradients.flat_map(|g| g.chunks(PIECE)).collect();
    let n = pieces.iter().map(|p| p.len()).sum();
    let bad = |_, piece: &&[f32]| match gradwire_core::values::first_at_or_above(piece, limit) {
        Some(_) => Err(()),
        None => Ok(()),
    };
    parallelism.exec_for(n).first_err(&pieces, bad).is_err()
}

/// Whether `e` is a check's finding of a value that skips a step
/// ([`CompressedAllReduce::with_skip_non_finite`]): NaN or an infinity (in the gradient, or in
/// gradient + residual), or a value beyond the value type.
fn is_non_finite(e: &Error) -> bool {
    matches!(
        e,
        Error::Core {
            source: gradwire_core::Error::NonFinite { .. }
                | gradwire_core::Error::ValueOutOfRange { .. },
            ..
        }
    )
}

/// Distributed gradient aggregation with compression (see the module docs).
pub struct CompressedAllReduce {
    compressor: GradientCompressor,
    world_size: usize,
    comm: Option<Box<dyn Communicator>>,
    reduction: Reduction,
    bucketing: BucketConfig,
    /// Per-tensor manifest for the peers path.
    tensors: Option<Manifest>,
    /// Bundle manifest for the communicator path.
    bundles: Option<Manifest>,
    send: Vec<u8>,
    collective: AllGather,
    two_phase: TwoPhase,
    dense: DenseAllReduce,
    choice: Collective,
    /// The collective `Auto` picked, for (layout id, world size).
    picked: Option<(u64, usize, Collective)>,
    /// The rank of the last communicator used (for `all_reduce_on`).
    rank_seen: usize,
    /// Bytes of this rank's compressed gradient in the last step.
    message_bytes: usize,
    /// The largest buffer a step passes to the communicator, in bytes (every route).
    chunk_bytes: usize,
    flat: Vec<f32>,
    aggregator: Aggregator,
    /// Why the all-reduce's own communicator was closed (a transport failure of a step): every
    /// later step fails with it, touching nothing.
    broken: Option<String>,
    /// Whether a step whose gradients are not all finite on some rank is skipped
    /// ([`CompressedAllReduce::with_skip_non_finite`]).
    skip_non_finite: bool,
    /// Whether the last step was skipped.
    skipped: bool,
    /// The messages of the round of non-finite gradients (kept between steps).
    non_finite_round: Vec<Vec<u8>>,
}

/// Whether a transport error may leave the ranks out of step, so that the communicator is
/// closed: not the group's common verdict on a length, which every rank reaches at the same
/// call before anything moves. A [`CommError::Mismatch`] (ranks at different collectives, or
/// other element counts in one sum) does break the group: every route of a step opens with
/// the same all-gather of envelopes, so ranks that reach different collectives of a step are
/// out of step, and a communicator the caller also uses for other collectives
/// ([`CompressedAllReduce::all_reduce_on`]) is closed as well.
fn breaks_group(e: &CommError) -> bool {
    !matches!(
        e,
        CommError::TooLarge { .. } | CommError::LimitsDiffer { .. }
    )
}

/// Closes `comm` after a step that failed with a transport error that may leave the ranks out
/// of step; returns the first failure it was closed for.
fn close_after(comm: &mut dyn Communicator, result: &Result<()>) -> Option<String> {
    match result {
        Err(Error::Comm { source }) if breaks_group(source) => {
            // The first failure the communicator records (the group's, when it broke
            // elsewhere first), else this rank's.
            let first = match source {
                CommError::Broken { first } => comm.close(first).unwrap_or_else(|| first.clone()),
                other => {
                    let reason = other.to_string();
                    comm.close(&reason)
                        .unwrap_or_else(|| format!("rank {}: {reason}", comm.rank()))
                }
            };
            Some(first)
        }
        _ => None,
    }
}

/// The chunk bound of [`CompressedAllReduce::with_chunk_bytes`] by default: 4 MiB (the
/// windows a rank holds in flight, about W + 2 of them, stay within the step's memory
/// budget at W = 4; docs/scale.md, round 12).
const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// The configuration every rank must share for a collective step of `manifest` (checked
/// through the collective's fingerprints).
fn group_config(
    world_size: usize,
    manifest: &Manifest,
    reduction: Reduction,
    bucketing: &BucketConfig,
    collective: &str,
    chunk_bytes: usize,
) -> Config {
    Config::new(
        [
            ("world_size", world_size.to_string()),
            ("collective", collective.to_owned()),
            ("chunk_bytes", chunk_bytes.to_string()),
            ("method", crate::method::format(manifest.method())),
            ("seed", manifest.seed().to_string()),
            ("reduction", format!("{reduction:?}")),
            ("bucketing", format!("{bucketing:?}")),
            ("layout", format!("{:016x}", manifest.layout_id())),
        ],
        manifest
            .tensors()
            .iter()
            .map(|t| format!("{}:{:?}", t.name, t.shape))
            .collect(),
    )
}

/// How a step travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    AllGather,
    TwoPhase,
    /// Uncompressed f32: [`Communicator::all_reduce_sum_f32`].
    Dense,
}

/// The collective for `manifest`: the configured one, or what `Auto` picks (once per layout
/// and world size, kept in `picked`) from the bytes each would make a rank receive at most.
fn pick(
    picked: &mut Option<(u64, usize, Collective)>,
    choice: Collective,
    world_size: usize,
    manifest: &Manifest,
    holds_server_residuals: impl FnOnce() -> bool,
) -> Route {
    let key = (manifest.layout_id(), world_size);
    let c = match *picked {
        Some((id, w, c)) if (id, w) == key => c,
        // `Auto` never leaves the two-phase collective while server residuals are held: the
        // step stays there and reports them (they belong to the old layout). Asked only on a
        // change of layout: the answer reads every server residual.
        Some((_, _, Collective::TwoPhase)) if holds_server_residuals() => Collective::TwoPhase,
        _ => {
            let c = match choice {
                Collective::Auto if world_size > 1 => {
                    match crate::layout::shards::ShardLayout::new(manifest, world_size) {
                        Ok(layout) => {
                            let all_gather = (world_size - 1)
                                * (crate::collective::ENVELOPE_LEN + manifest.max_bundle_len());
                            let two = (0..world_size)
                                .map(|r| TwoPhase::received_bytes(&layout, r))
                                .max()
                                .unwrap_or(0);
                            if two < all_gather {
                                Collective::TwoPhase
                            } else {
                                Collective::AllGather
                            }
                        }
                        Err(_) => Collective::AllGather,
                    }
                }
                Collective::Auto => Collective::AllGather,
                c => c,
            };
            *picked = Some((key.0, key.1, c));
            c
        }
    };
    match c {
        Collective::TwoPhase => Route::TwoPhase,
        _ => Route::AllGather,
    }
}

impl fmt::Debug for CompressedAllReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompressedAllReduce")
            .field("compressor", &self.compressor)
            .field("world_size", &self.world_size)
            .field("rank", &self.rank())
            .field("has_communicator", &self.comm.is_some())
            .field("reduction", &self.reduction)
            .field("bucketing", &self.bucketing)
            .finish_non_exhaustive()
    }
}

impl CompressedAllReduce {
    /// [`Error::Config`] for world size 0 (before it reads as a missing communicator or a
    /// peer count that cannot match).
    fn check_world_size(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(Error::config("world size 0: a group has at least one rank"));
        }
        Ok(())
    }

    /// An all-reduce over `world_size` ranks without a communicator (see the module docs).
    pub fn new(compression_method: CompressionMethod, world_size: usize) -> Self {
        CompressedAllReduce {
            compressor: GradientCompressor::new(compression_method),
            world_size,
            comm: None,
            reduction: Reduction::Mean,
            bucketing: BucketConfig::none(),
            tensors: None,
            bundles: None,
            send: Vec::new(),
            collective: AllGather::default(),
            two_phase: TwoPhase::default(),
            dense: DenseAllReduce::default(),
            choice: Collective::AllGather,
            picked: None,
            rank_seen: 0,
            broken: None,
            message_bytes: 0,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            flat: Vec::new(),
            aggregator: Aggregator::new(),
            skip_non_finite: false,
            skipped: false,
            non_finite_round: Vec::new(),
        }
    }

    /// An all-reduce over the group of `comm` (its world size and rank):
    /// [`CompressedAllReduce::all_reduce`] runs compress, bundle, all-gather and aggregate.
    pub fn with_communicator(
        compression_method: CompressionMethod,
        comm: Box<dyn Communicator>,
    ) -> Self {
        let world_size = comm.world_size();
        let mut ar = Self::new(compression_method, world_size);
        ar.comm = Some(comm);
        ar
    }

    /// The same all-reduce with another seed (every rank must use the same one).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.compressor = self.compressor.with_seed(seed);
        self.tensors = None;
        self.bundles = None;
        self
    }

    /// The same all-reduce combining contributions with `reduction` (default: mean).
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// The same all-reduce fusing small tensors into buckets in the bundles of the
    /// communicator path (every rank must use the same configuration): fewer frames, so fewer
    /// headers and checksums per step, as DDP's gradient buckets.
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use gradwire::comm::{Communicator, LocalGroup};
    /// use gradwire::{BucketConfig, CompressedAllReduce, CompressionMethod, Tensor};
    ///
    /// let comms = LocalGroup::new(2).into_communicators();
    /// let handles: Vec<_> = comms
    ///     .into_iter()
    ///     .map(|comm| {
    ///         std::thread::spawn(move || {
    ///             let rank = comm.rank() as f32;
    ///             // Both tensors (3 + 1 values) in one bucket of at most 1 KiB.
    ///             let mut ar =
    ///                 CompressedAllReduce::with_communicator(CompressionMethod::Float16, Box::new(comm))
    ///                     .with_bucketing(BucketConfig::fused(1024));
    ///             let grads = HashMap::from([
    ///                 ("a.weight".to_string(), Tensor::vector(vec![1.0 + rank, 0.0, -4.0])),
    ///                 ("a.bias".to_string(), Tensor::vector(vec![2.0 * rank])),
    ///             ]);
    ///             ar.all_reduce(&grads)
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     let mean = h.join().unwrap().unwrap();
    ///     assert_eq!(mean["a.weight"].data(), &[1.5, 0.0, -4.0]);
    ///     assert_eq!(mean["a.bias"].data(), &[1.0]);
    /// }
    /// ```
    pub fn with_bucketing(mut self, bucketing: BucketConfig) -> Self {
        self.bucketing = bucketing;
        self.bundles = None;
        self
    }

    /// The same all-reduce compressing and aggregating with `parallelism` (default
    /// [`Parallelism::Auto`]: every core of rayon's pool when it has more than one thread). The
    /// results are the same bits with every setting.
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.compressor.set_parallelism(parallelism);
        self.aggregator = Aggregator::new().with_parallelism(parallelism);
        self
    }

    /// The same all-reduce running `collective` on its communicator (default
    /// [`Collective::AllGather`]; every rank must use the same one). Uncompressed f32 gradients
    /// go through [`Communicator::all_reduce_sum_f32`] whichever is chosen.
    pub fn with_collective(mut self, collective: Collective) -> Self {
        self.choice = collective;
        self.picked = None;
        self
    }

    /// The same all-reduce passing buffers of at most `bytes` (4 MiB by default) to the
    /// communicator, on every route. Uncompressed f32: the model crosses it in chunks of at
    /// most that size cut at tensor boundaries (at least one element; one
    /// [`Communicator::all_reduce_sum_f32`] each, summed in rank order as one call over the
    /// whole model would be: the same bits; a tensor of a quarter of the bound or more is
    /// reduced in its output, in pieces, smaller ones gathered into a chunk), and the step
    /// keeps one chunk, not a copy of the model. All-gather and two-phase: each message longer
    /// than the bound goes in windows of that size (at least 4 KiB: a smaller bound is raised
    /// to it there), one call each, so that the transport's deadline applies per window and
    /// not to a whole model-sized message on a slow link (`FORMAT.md` 14.1: an all-gather of
    /// messages shorter than the bound is one call, as before; the windows add a header call
    /// of 16 bytes per rank, and the two-phase all-to-all one of `8 (W + 1)` bytes whenever
    /// its messages may exceed the bound). The step's first small calls (the two-phase
    /// agreement round, the naming of a configuration difference) are not windowed. The bound
    /// is part of the configuration the ranks compare: every rank must use the same.
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes;
        self
    }

    /// Mixed precision: with `skip` set, a step in which some rank's gradient holds NaN or an
    /// infinity (or, for a method without error feedback, a value beyond its value type, which
    /// the step would refuse) is skipped on every rank instead of failing: every output
    /// element is NaN, no residual (worker or server) changes and the step counter does not
    /// advance, so that a loss scaler that checks the result for infinities (PyTorch's
    /// `GradScaler`, as after a plain all-reduce) skips the optimizer step and lowers its
    /// scale, and the next call is the same step again; also when another rank's step fails
    /// otherwise at that call (it fails at its next step if the cause stays). The verdict is
    /// taken before anything changes, in one more all-gather of 16 bytes per rank
    /// (`FORMAT.md` 18): with error feedback on the all-gather, between the step's own checks
    /// of every tensor and its encode (no pass of its own); on the other routes after a read
    /// of the gradients of its own. Every rank must set the same:
    /// a rank that does not open its step with that round is named by every rank
    /// ([`Error::Collective`]), or the transport refuses the pairing of the two calls
    /// ([`CommError::LimitsDiffer`]). [`CompressedAllReduce::last_step_skipped`] tells a
    /// skipped step. Without it (the default) such a gradient fails the step on every rank.
    ///
    /// The mode applies to every step over a communicator and to a group of one without one;
    /// [`CompressedAllReduce::all_reduce_with_peers`] (the peers' bundles given) does not use
    /// it.
    ///
    /// Residuals hold what was not sent yet in the units of the gradients; when a loss scale
    /// changes, scale them by new / old with [`CompressedAllReduce::scale_residuals`].
    pub fn with_skip_non_finite(mut self, skip: bool) -> Self {
        self.skip_non_finite = skip;
        self
    }

    /// Whether the last step was skipped for a non-finite gradient
    /// ([`CompressedAllReduce::with_skip_non_finite`]); `false` before the first step and
    /// after a step that ran or failed.
    pub fn last_step_skipped(&self) -> bool {
        self.skipped
    }

    /// Multiplies every residual this rank keeps (the worker's, and the two-phase collective's
    /// server residuals, loaded ones not yet used included) by `factor`: after a loss scale
    /// changed from `old` to `new`, `factor = new / old` keeps them in the units of the next
    /// gradients. A power of two changes no value's bits but its exponent (exact), unless a
    /// value becomes subnormal, zero or infinite; any other factor rounds each value once.
    /// Every rank must scale alike, between the same steps.
    ///
    /// # Errors
    /// [`Error::Config`] when `factor` is not finite and positive, or when a scaled value
    /// would be infinite; nothing changes then.
    pub fn scale_residuals(&mut self, factor: f32) -> Result<()> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::config(format!(
                "residuals scaled by {factor}: the factor must be finite and positive"
            )));
        }
        let worker = self.compressor.feedback().map(|fb| fb.residuals());
        let largest = worker
            .into_iter()
            .flatten()
            .map(|(_, r)| r)
            .chain(self.two_phase.server_values())
            .flat_map(|r| r.iter())
            .fold(0.0f32, |m, &x| m.max(x.abs()));
        if !(largest * factor).is_finite() {
            return Err(Error::config(format!(
                "residuals scaled by {factor}: a residual of magnitude {largest} would overflow"
            )));
        }
        self.compressor.scale_residuals(factor);
        self.two_phase.scale_server_residuals(factor);
        Ok(())
    }

    /// The collective the last step ran, once a step ran with a communicator:
    /// [`Collective::AllGather`] or [`Collective::TwoPhase`] (what [`Collective::Auto`] picked).
    pub fn collective_in_use(&self) -> Option<Collective> {
        self.picked.map(|(_, _, c)| c)
    }

    /// This rank's server residual of tensor `name` (two-phase): the tensor's element indices
    /// of the shard this rank owns, in shard order, and the residual at each. `None` before the
    /// first two-phase step or for a tensor this rank owns no element of.
    #[cfg(test)]
    pub(crate) fn server_residual(&self, name: &str) -> Option<(Vec<usize>, &[f32])> {
        let layout = self.two_phase.layout()?;
        let t = layout.tensors.iter().position(|t| t.name == name)?;
        let rank = self.rank();
        let values = self
            .two_phase
            .server_residuals()
            .find(|(n, _)| *n == name)?
            .1;
        let indices = layout.range(t, rank).collect();
        Some((indices, values))
    }

    /// The two-phase collective's bytes held, between steps, by each buffer of the received
    /// phase-1 messages and by the agreement round's buffers in all (capacities).
    #[cfg(test)]
    pub(crate) fn two_phase_received_capacity(&self) -> (Vec<usize>, usize) {
        self.two_phase.received_capacity()
    }

    /// Sets this rank's server residuals (two-phase) for a resume: `name -> values` in the
    /// order [`CompressedAllReduce::server_residual`] gives, saved by rank `saved_at.1` of a
    /// group of `saved_at.0` ranks; tensors left out start from zeros. They are checked against
    /// the shard layout at the next step (a length other than this rank's shard fails that
    /// step, on every rank, until they are discarded or replaced).
    ///
    /// # Errors
    /// [`Error::Config`] when `saved_at` is not this group's world size and rank (the residuals
    /// belong to another shard layout: discard them for an elastic restart); nothing changes.
    #[cfg(test)]
    pub(crate) fn set_server_residuals(
        &mut self,
        saved_at: (usize, usize),
        residuals: HashMap<String, Vec<f32>>,
    ) -> Result<()> {
        let here = (self.world_size, self.rank());
        if saved_at != here {
            return Err(Error::config(format!(
                "server residuals saved by rank {} of {} ranks cannot resume rank {} of {}: \
                 the shard layout differs (discard them to restart at another world size)",
                saved_at.1, saved_at.0, here.1, here.0
            )));
        }
        self.two_phase.set_server_residuals(residuals);
        Ok(())
    }

    /// Bytes of this rank's compressed gradient in the last step over a communicator, without
    /// the collective's envelopes: its bundle (all-gather), its shard messages to every owner,
    /// its own included (two-phase), `4 n` (uncompressed f32). 0 before the first step, and after
    /// a failed step (except on the all-gather, once the bundle was written).
    pub fn last_message_bytes(&self) -> usize {
        self.message_bytes
    }

    /// The bytes this rank's communicator moved so far (zeros without one).
    pub fn traffic(&self) -> crate::comm::Traffic {
        self.comm.as_ref().map(|c| c.traffic()).unwrap_or_default()
    }

    /// Saves this rank's server residuals (two-phase) to `path`, for a bit-identical resume
    /// with [`CompressedAllReduce::load_server_residuals`] next to the worker's own checkpoint
    /// ([`GradientCompressor::save_feedback`] through
    /// [`CompressedAllReduce::compressor_mut`]). The file is an error-feedback checkpoint
    /// (`FORMAT.md` section 12) of the residuals of this rank's shard, named by tensor, with
    /// the world size, the rank and the shard layout in its metadata (section 15).
    ///
    /// # Errors
    /// [`Error::Config`] before the first two-phase step or for a method without server
    /// residuals (no error feedback, majority vote); [`Error::Io`] naming the file.
    pub fn save_server_residuals(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let seed_step = (self.compressor.seed(), self.compressor.step());
        crate::feedback::checkpoint::write_replacing(path.as_ref(), |out, on_io| {
            self.two_phase
                .write_server_checkpoint(out, seed_step, on_io)
        })
    }

    /// Loads server residuals that [`CompressedAllReduce::save_server_residuals`] wrote; they
    /// apply at the next step, which checks them against this model's shard layout (another
    /// layout fails that step on every rank, until they are discarded).
    ///
    /// # Errors
    /// [`Error::Io`] naming the file; [`Error::Checkpoint`] for a file that is not such a
    /// checkpoint, is damaged (checksums), holds a NaN or infinite value, or was saved
    /// by another rank or world size (an elastic restart discards them:
    /// [`CompressedAllReduce::discard_server_residuals`]); nothing changes then.
    pub fn load_server_residuals(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        use crate::feedback::checkpoint::{io_error, open_regular};
        let path = path.as_ref();
        let (mut file, len) = open_regular(path)?;
        let rank = self.rank();
        self.two_phase.load_server_checkpoint(
            (&mut file, len),
            &io_error(path),
            self.world_size,
            rank,
        )
    }

    /// Drops this rank's server residuals (two-phase), for example before a restart at another
    /// world size (the residuals belong to one shard layout): the next step starts them at
    /// zero. A run whose first step (on any collective) is past step 0, its workers resumed
    /// from a checkpoint, fails every two-phase step that keeps server residuals with
    /// [`Error::Config`] until it either loads the server residuals of the same moment
    /// ([`CompressedAllReduce::load_server_residuals`]) or calls this.
    pub fn discard_server_residuals(&mut self) {
        self.two_phase.discard_server_residuals();
    }

    /// This rank: the communicator's, or that of the last one [`CompressedAllReduce::all_reduce_on`]
    /// used (0 before).
    pub(crate) fn rank(&self) -> usize {
        self.comm.as_ref().map_or(self.rank_seen, |c| c.rank())
    }

    /// The local compressor (method, seed, step, error-feedback state).
    pub fn compressor(&self) -> &GradientCompressor {
        &self.compressor
    }

    /// The local compressor, mutable (for example to load an error-feedback checkpoint).
    pub fn compressor_mut(&mut self) -> &mut GradientCompressor {
        &mut self.compressor
    }

    /// Compresses, aggregates and averages gradients across the group.
    ///
    /// With a communicator: compress into a bundle, all-gather it, aggregate (a peer whose
    /// tensor has the same element count in another shape is an error naming the tensor: the
    /// bundle's entry ids hash the shapes). Without one: with
    /// world size 1, a compression round trip; otherwise an error (scaling the local gradient
    /// by the world size is not a sum across workers).
    ///
    /// # Errors
    /// [`Error::Config`] for world size 0; [`Error::NoCommunicator`] when the world size is
    /// not 1 and no communicator is configured; [`Error::Comm`] when the transport fails; any
    /// error of [`GradientCompressor::compress_bundle`] and [`Aggregator::aggregate_into`]
    /// (naming tensor and rank); [`Error::OutOfMemory`] when the output map, a new residual
    /// or the server residuals cannot be allocated (a local failure, taken part with).
    /// A rank whose local compression fails still takes part in the all-gather (with an empty
    /// bundle) and returns its own error; its peers then fail naming that rank, so no rank
    /// waits forever. Every rank's step advances by one on such a failed call, so the group
    /// stays in step and can call again. Nothing is lost: the failing rank's residuals stay as
    /// they were, and on every rank whose compression succeeded but whose step then failed
    /// after the all-gather (a peer's error, another model layout, an overflowing aggregate:
    /// every rank sees the same messages and fails alike) the residuals take back what the
    /// rank sent, so they hold the step's gradient (`residual + sent == gradient + old
    /// residual`, up to the f32 rounding of that identity) and the next step sends it. On a
    /// transport error ([`Error::Comm`]) the residuals stay as the compression left them: a
    /// transport may fail on some ranks only, and peers that completed the step have used this
    /// rank's values. Such an error (other than the group's common verdict on a length,
    /// [`CommError::TooLarge`] or [`CommError::LimitsDiffer`]) may leave the ranks out of
    /// step, so the communicator is closed ([`Communicator::close`]): this and every later
    /// call fails with [`CommError::Broken`] naming the first failure, touching nothing and
    /// calling no collective; peers that wait for this rank learn it (`LocalGroup`) or fail at
    /// their deadline, and under MPI the job ends. Recovery needs a new group: build new
    /// communicators and all-reduces and resume them from the last checkpoints
    /// ([`GradientCompressor::save_feedback`], [`CompressedAllReduce::save_server_residuals`]).
    pub fn all_reduce(
        &mut self,
        gradients: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(gradients.len());
        self.all_reduce_into(gradients, &mut out)?;
        Ok(out)
    }

    /// As [`CompressedAllReduce::all_reduce`], writing into `out` and reusing its tensors.
    ///
    /// # Errors
    /// As [`CompressedAllReduce::all_reduce`]. After an error `out`'s values are unspecified:
    /// the uncompressed f32 route writes the model chunk by chunk
    /// ([`CompressedAllReduce::with_chunk_bytes`]), so a failure in a later chunk leaves it
    /// partly written.
    pub fn all_reduce_into(
        &mut self,
        gradients: &HashMap<String, Tensor>,
        out: &mut HashMap<String, Tensor>,
    ) -> Result<()> {
        self.skipped = false;
        self.check_world_size()?;
        if self.comm.is_none() {
            if self.world_size != 1 {
                return Err(Error::NoCommunicator {
                    world_size: self.world_size,
                });
            }
            self.skipped = self.skip_non_finite
                && skips(&self.compressor, gradients.values().map(Tensor::data));
            if self.skipped {
                out.clear();
                for (name, t) in gradients {
                    let nan = Tensor::new(t.shape().to_vec(), vec![f32::NAN; t.data().len()])?;
                    out.insert(name.clone(), nan);
                }
                return Ok(());
            }
            let result = self.all_reduce_with_peers_at(gradients, 0, &[])?;
            *out = result;
            return Ok(());
        }
        self.check_broken()?;
        let mut comm = self.comm.take();
        let result = match comm.as_deref_mut() {
            Some(c) => {
                let result = self.step_on(c, gradients, out);
                self.broken = close_after(c, &result);
                result
            }
            None => Err(Error::NoCommunicator {
                world_size: self.world_size,
            }),
        };
        self.comm = comm;
        result
    }

    /// As [`CompressedAllReduce::all_reduce_into`], on tensors in the caller's memory: each
    /// tensor's gradient is read from its `data` and the result (the mean, or the configured
    /// reduction) is written over it, with no copy of the model and no output tensors (a
    /// training loop's gradient buffers, a DDP bucket). The tensors may come in any order; the
    /// step, its messages and its results are those of `all_reduce_into` on the same
    /// gradients, bit for bit. Every route reads an element's gradient before it writes that
    /// element's result. Without a communicator (world size 1) the step runs as
    /// [`CompressedAllReduce::all_reduce`] does and its result is copied in.
    ///
    /// # Errors
    /// As [`CompressedAllReduce::all_reduce`]; [`Error::ShapeMismatch`] when a tensor's `data`
    /// does not hold the product of its `shape` (taking part in the step with that error, as a
    /// rank whose compression fails does); [`Error::DuplicateTensor`] for a name given twice.
    /// After an error the tensors' values are unspecified: a failure found after the
    /// exchange began leaves them partly overwritten (the residuals keep the step's gradient,
    /// as for `all_reduce`, so the next step sends it).
    pub fn all_reduce_in_place(&mut self, tensors: &mut [TensorMut<'_>]) -> Result<()> {
        self.skipped = false;
        self.check_world_size()?;
        let Some(mut comm) = self.comm.take() else {
            if self.world_size != 1 {
                return Err(Error::NoCommunicator {
                    world_size: self.world_size,
                });
            }
            return self.in_place_alone(tensors);
        };
        let result = self.check_broken().and_then(|()| {
            let result = self.step_in_place(comm.as_mut(), tensors);
            self.broken = close_after(comm.as_mut(), &result);
            result
        });
        self.comm = Some(comm);
        result
    }

    /// [`CompressedAllReduce::all_reduce_in_place`] without a communicator: the step of
    /// [`CompressedAllReduce::all_reduce`], its result copied into the tensors.
    fn in_place_alone(&mut self, tensors: &mut [TensorMut<'_>]) -> Result<()> {
        self.skipped =
            self.skip_non_finite && skips(&self.compressor, tensors.iter().map(|t| &*t.data));
        if self.skipped {
            for t in tensors.iter_mut() {
                t.data.fill(f32::NAN);
            }
            return Ok(());
        }
        let mut gradients = HashMap::with_capacity(tensors.len());
        for t in tensors.iter() {
            let tensor = Tensor::new(t.shape.to_vec(), t.data.to_vec())?;
            if gradients.insert(t.name.to_owned(), tensor).is_some() {
                return Err(Error::DuplicateTensor {
                    tensor: t.name.to_owned(),
                });
            }
        }
        let result = self.all_reduce_with_peers_at(&gradients, 0, &[])?;
        for t in tensors.iter_mut() {
            let reduced = result
                .get(t.name)
                .ok_or_else(|| Error::internal("a reduced tensor is missing"))?;
            t.data.copy_from_slice(reduced.data());
        }
        Ok(())
    }

    /// One in-place step over `comm`.
    fn step_in_place(
        &mut self,
        comm: &mut dyn Communicator,
        tensors: &mut [TensorMut<'_>],
    ) -> Result<()> {
        // The manifest's order (sorted by name), as the `HashMap` API builds it: the same
        // manifest, bundles and shard layout for the same model.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_unstable_by(|&a, &b| tensors[a].name.cmp(tensors[b].name));
        let specs: Vec<(&str, &[usize])> = order
            .iter()
            .map(|&i| (tensors[i].name, tensors[i].shape))
            .collect();
        self.step_with(comm, &specs, |manifest| {
            let mut slots: Vec<Option<&mut [f32]>> =
                tensors.iter_mut().map(|t| Some(&mut *t.data)).collect();
            let mut bufs = Vec::with_capacity(order.len());
            for (&i, info) in order.iter().zip(manifest.tensors()) {
                let data = slots[i]
                    .take()
                    .ok_or_else(|| Error::internal("a tensor bound twice"))?;
                if data.len() != info.numel {
                    return Err(Error::ShapeMismatch {
                        tensor: info.name.clone(),
                        rank: None,
                        expected: info.shape.clone(),
                        got: vec![data.len()],
                    });
                }
                bufs.push(data);
            }
            StepBuffers::in_place(manifest, bufs)
        })
    }

    /// As [`CompressedAllReduce::all_reduce_into`], over `comm`, a communicator the caller
    /// keeps (for example one a training loop also uses for other collectives); the all-reduce
    /// must have been made for its world size ([`CompressedAllReduce::new`]), and every rank
    /// calls it at the same point of its sequence of collectives.
    ///
    /// # Errors
    /// [`Error::WorldSize`] when `comm`'s world size is not the all-reduce's (this rank still
    /// takes part in the step's first collective with that error, so its peers fail naming it
    /// instead of waiting); otherwise as [`CompressedAllReduce::all_reduce`].
    pub fn all_reduce_on(
        &mut self,
        comm: &mut dyn Communicator,
        gradients: &HashMap<String, Tensor>,
        out: &mut HashMap<String, Tensor>,
    ) -> Result<()> {
        self.on_borrowed(comm, |ar, comm| ar.step_on(comm, gradients, out))
    }

    /// As [`CompressedAllReduce::all_reduce_in_place`], over `comm`, a communicator the caller
    /// keeps, as for [`CompressedAllReduce::all_reduce_on`]: the step of a training loop that
    /// runs its own collectives too, on its gradient buffers, with no copy of the model.
    ///
    /// # Errors
    /// As [`CompressedAllReduce::all_reduce_on`] and
    /// [`CompressedAllReduce::all_reduce_in_place`]; as there, a failure that may leave the
    /// group out of step closes `comm` ([`Communicator::close`]), the caller's communicator.
    pub fn all_reduce_in_place_on(
        &mut self,
        comm: &mut dyn Communicator,
        tensors: &mut [TensorMut<'_>],
    ) -> Result<()> {
        self.on_borrowed(comm, |ar, comm| ar.step_in_place(comm, tensors))
    }

    /// One step over a communicator the caller keeps: refused (taking part with the error)
    /// when its world size is not this all-reduce's; the communicator closed after a failure
    /// that may leave the group out of step.
    fn on_borrowed(
        &mut self,
        comm: &mut dyn Communicator,
        step: impl FnOnce(&mut Self, &mut dyn Communicator) -> Result<()>,
    ) -> Result<()> {
        self.skipped = false;
        if comm.world_size() != self.world_size {
            // Takes part with the error, so that the peers fail naming this rank.
            let error = Error::WorldSize {
                expected: self.world_size,
                got: comm.world_size(),
            };
            // In skip mode a step opens with the round of non-finite gradients: this rank takes
            // part in it as failed first (its peers may skip the step there).
            if self.skip_non_finite {
                let step = self.compressor.step();
                if non_finite::round(comm, Verdict::Failed, step, &mut self.non_finite_round)? {
                    return Err(error);
                }
            }
            return Err(crate::collective::take_part_failed(comm, error));
        }
        let result = step(self, comm);
        close_after(comm, &result);
        result
    }

    /// [`Error::Comm`] with [`CommError::Broken`] when this all-reduce's own communicator was
    /// closed after a transport failure.
    fn check_broken(&self) -> Result<()> {
        match &self.broken {
            Some(first) => Err(Error::Comm {
                source: CommError::Broken {
                    first: first.clone(),
                },
            }),
            None => Ok(()),
        }
    }

    /// One step over `comm`, on the tensors of the `HashMap` API.
    fn step_on(
        &mut self,
        comm: &mut dyn Communicator,
        gradients: &HashMap<String, Tensor>,
        out: &mut HashMap<String, Tensor>,
    ) -> Result<()> {
        let mut specs: Vec<(&str, &[usize])> = gradients
            .iter()
            .map(|(name, t)| (name.as_str(), t.shape()))
            .collect();
        specs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        self.step_with(comm, &specs, |manifest| {
            StepBuffers::apart(manifest, gradients, out)
        })
    }

    /// One step over `comm` for the tensors named and shaped by `specs` (sorted by name),
    /// whose buffers `bind` gives once the manifest is known: the one engine of every API.
    fn step_with<'b>(
        &mut self,
        comm: &mut dyn Communicator,
        specs: &[(&str, &[usize])],
        bind: impl FnOnce(&Manifest) -> Result<StepBuffers<'b>>,
    ) -> Result<()> {
        self.rank_seen = comm.rank();
        self.message_bytes = 0;
        // Everything that can fail before the collective: the method, the manifest, the
        // compression. A failure still takes part (with its reason), so that no peer waits for
        // this rank; the step advances as on the peers, so the group stays in step.
        let rank = comm.rank();
        let step = self.compressor.step();
        self.two_phase.note_step(step);
        let method = self.compressor.method().core_method();
        let seed = self.compressor.seed();
        let method_ok = method.as_ref().ok().copied();
        let manifest = method.and_then(|method| {
            Manifest::cached_for(&mut self.bundles, specs, method, seed, self.bucketing)
        });
        // The caller's buffers, in the manifest's order; a rank that cannot bind them fails as
        // one without a manifest would.
        let (manifest, mut bufs) = match manifest {
            Ok(m) => match bind(m) {
                Ok(bufs) => (Ok(m), bufs),
                Err(e) => (Err(e), StepBuffers::none()),
            },
            Err(e) => (Err(e), StepBuffers::none()),
        };
        // The route: every rank takes the same one, a failed rank included (from its
        // configuration alone when it has no manifest), so that all call the same primitives.
        let route = match (method_ok, &manifest) {
            (_, Ok(m)) if dense::applies(m, self.reduction) => Route::Dense,
            (_, Ok(m)) => pick(&mut self.picked, self.choice, self.world_size, m, || {
                self.two_phase.holds_server_residuals()
            }),
            (
                Some(Method::Dense {
                    values: Values::F32,
                }),
                Err(_),
            ) if self.reduction != Reduction::MajorityVote => Route::Dense,
            (_, Err(_)) => match (self.choice, self.picked) {
                (Collective::TwoPhase, _) => Route::TwoPhase,
                (Collective::Auto, Some((_, _, Collective::TwoPhase))) => Route::TwoPhase,
                _ => Route::AllGather,
            },
        };
        // With error feedback the all-gather's own checks (before anything changes) give the
        // verdict of the round of non-finite gradients, which then runs between the checks and
        // the encode (`gated`); every other route checks first and opens with the round.
        let gated = self.skip_non_finite
            && route == Route::AllGather
            && self.compressor.method().uses_error_feedback();
        // Whether every rank's gradients were found finite (and within the value type) by the
        // round: the dense f32 route's own check of them is then not made again.
        let mut prechecked = false;
        if self.skip_non_finite && !gated {
            // Before anything changes: every rank's verdict on its gradients.
            let verdict = match &manifest {
                Ok(_) if skips(&self.compressor, bufs.gradients()) => Verdict::NonFinite,
                Ok(_) => Verdict::Finite,
                Err(_) => Verdict::Failed,
            };
            if non_finite::round(comm, verdict, step, &mut self.non_finite_round)? {
                self.skipped = bufs.skip_step();
                return Ok(());
            }
            prechecked = verdict == Verdict::Finite;
        }
        if route != Route::AllGather {
            let manifest_error = manifest.err();
            return self.all_reduce_sharded(comm, manifest_error, route, &mut bufs, prechecked);
        }
        // Without error feedback, a bundle of dense frames is written as it is sent, never
        // whole (its gradients checked first, so that nothing fails once a window has left;
        // nothing is given back after a failure). A group of one, whose message never leaves,
        // checks each value as it is written instead: the gradients are read once.
        if let Ok(manifest) = &manifest
            && !self.compressor.method().uses_error_feedback()
            && crate::engine::dense_stream::streams(manifest)
        {
            let config = group_config(
                self.world_size,
                manifest,
                self.reduction,
                &self.bucketing,
                "all-gather",
                self.chunk_bytes,
            );
            let envelope = crate::collective::payload_envelope(&config, step);
            let streamed = self.compressor.stream_bundle(
                manifest,
                &bufs,
                rank,
                &envelope,
                &mut self.send,
                comm.world_size() > 1,
            );
            let mut stream;
            let local = match streamed {
                Ok(made) => {
                    stream = made;
                    self.message_bytes = stream.len() - crate::collective::ENVELOPE_LEN;
                    Local::Streamed {
                        manifest,
                        message: &mut stream,
                        step,
                        config: &config,
                    }
                }
                Err(error) => {
                    self.compressor.set_step(step.wrapping_add(1));
                    Local::Failed {
                        manifest: Some(manifest),
                        error,
                    }
                }
            };
            let result = self.collective.run(
                comm,
                local,
                self.reduction,
                self.chunk_bytes,
                &mut self.aggregator,
                &mut bufs,
            );
            if result.is_err() && comm.world_size() == 1 {
                // A group of one's message stopped where a value failed: never whole.
                self.message_bytes = 0;
            }
            return result;
        }
        // The round of non-finite gradients when `gated`: its outcome, once it ran.
        let mut round: Option<std::result::Result<bool, ()>> = None;
        let compressed = match &manifest {
            Ok(manifest) => {
                let (comm, msgs) = (&mut *comm, &mut self.non_finite_round);
                let mut gate = |checked: std::result::Result<(), &Error>| -> Result<bool> {
                    let verdict = match checked {
                        Ok(()) => Verdict::Finite,
                        Err(e) if is_non_finite(e) => Verdict::NonFinite,
                        Err(_) => Verdict::Failed,
                    };
                    let outcome = non_finite::round(comm, verdict, step, msgs);
                    round = Some(outcome.as_ref().map(|&skip| skip).map_err(|_| ()));
                    outcome
                };
                self.compressor
                    .compress_bundle_gated(
                        manifest,
                        &bufs,
                        rank,
                        (&mut self.send, crate::collective::ENVELOPE_LEN),
                        if gated { Some(&mut gate) } else { None },
                    )
                    .map(|_| ())
            }
            Err(_) => Ok(()),
        };
        // This rank failed before its checks ran (or has no model): it takes part in the round
        // with its failure; the step then goes on to fail alike, unless another rank's
        // gradient skips it.
        if gated && round.is_none() {
            let skip = non_finite::round(comm, Verdict::Failed, step, &mut self.non_finite_round)?;
            round = Some(Ok(skip));
        }
        match round {
            // Skipped on every rank: nothing changed.
            Some(Ok(true)) => {
                self.skipped = bufs.skip_step();
                return Ok(());
            }
            // The round itself failed (alike on every rank): the step ends with its error.
            Some(Err(())) => return compressed,
            Some(Ok(false)) | None => {}
        }
        let local = match (manifest, compressed) {
            (Ok(manifest), Ok(())) => Ok(manifest),
            (Ok(manifest), Err(error)) => Err((Some(manifest), error)),
            (Err(error), _) => Err((None, error)),
        };
        let manifest = match local {
            Ok(manifest) => manifest,
            Err((manifest, error)) => {
                self.compressor.set_step(step.wrapping_add(1));
                let failed = Local::Failed { manifest, error };
                let result = self.collective.run(
                    comm,
                    failed,
                    self.reduction,
                    self.chunk_bytes,
                    &mut self.aggregator,
                    &mut bufs,
                );
                // The collective reports this rank's own error (or an earlier rank's).
                return result;
            }
        };
        // The bundle, after the room left for its envelope.
        self.message_bytes = self
            .send
            .len()
            .saturating_sub(crate::collective::ENVELOPE_LEN);
        let config = group_config(
            self.world_size,
            manifest,
            self.reduction,
            &self.bucketing,
            "all-gather",
            self.chunk_bytes,
        );
        let local = Local::Bundle {
            manifest,
            message: &mut self.send,
            step,
            config: &config,
        };
        // The collective's checks name the rank and the field or tensor at fault: a rank that
        // failed, another configuration, another element count or shape (the entry ids hash
        // the shapes), a corrupted bundle.
        let result = self.collective.run(
            comm,
            local,
            self.reduction,
            self.chunk_bytes,
            &mut self.aggregator,
            &mut bufs,
        );
        // The residuals gave up what this rank sent. When the step failed after the
        // all-gather, every rank saw the same messages and failed alike, so they take it back
        // (the error of the step is the one to report; the own bundle always decodes); so they
        // do after the group's common verdict on a length, found before any rank used a byte.
        // After another transport error, peers may have completed the step with this rank's
        // values: they stay sent.
        let given_to_none = |e: &Error| match e {
            Error::Comm { source } => matches!(
                source,
                CommError::TooLarge { .. } | CommError::LimitsDiffer { .. }
            ),
            _ => true,
        };
        if matches!(&result, Err(e) if given_to_none(e)) {
            let given_back = self.compressor.give_back_bundle(
                manifest,
                bundle_of(&self.send),
                step,
                &mut self.flat,
            );
            debug_assert!(given_back.is_ok(), "{given_back:?}");
        }
        result
    }

    /// A step on the dense or two-phase route (see [`CompressedAllReduce::all_reduce`]), with
    /// the manifest in `self.bundles` unless `manifest_error` says why there is none;
    /// `prechecked` when every gradient was found finite before the step (the round of
    /// non-finite gradients), so that the dense route does not check them again.
    fn all_reduce_sharded(
        &mut self,
        comm: &mut dyn Communicator,
        manifest_error: Option<Error>,
        route: Route,
        bufs: &mut StepBuffers<'_>,
        prechecked: bool,
    ) -> Result<()> {
        let step = self.compressor.step();
        let seed = self.compressor.seed();
        let reduction = self.reduction;
        let name = if route == Route::Dense {
            "all-reduce-f32"
        } else {
            "two-phase"
        };
        let world_size = self.world_size;
        let bucketing = self.bucketing;
        let (manifest, manifest_error) = match manifest_error {
            None => match self.bundles.as_ref() {
                Some(m) => (Some(m), None),
                None => (None, Some(Error::internal("no manifest"))),
            },
            error => (None, error),
        };
        // The chunk bound is part of the configuration: ranks with other bounds would make
        // calls of other lengths.
        let chunk_bytes = self.chunk_bytes;
        let config =
            manifest.map(|m| group_config(world_size, m, reduction, &bucketing, name, chunk_bytes));
        if route == Route::Dense {
            let local = match (manifest, &config, manifest_error) {
                (Some(m), Some(c), _) if prechecked => Ok((m, c, step)),
                (Some(m), Some(c), _) => check_finite(m, bufs).map(|()| (m, c, step)),
                (_, _, error) => Err(error.unwrap_or_else(|| Error::internal("no configuration"))),
            };
            let result = self
                .dense
                .run(comm, local, reduction, self.chunk_bytes, bufs);
            self.compressor.set_step(step.wrapping_add(1));
            self.message_bytes = match (manifest, &result) {
                (Some(m), Ok(())) => 4 * m.flat_len(),
                _ => 0,
            };
            return result;
        }
        let result = match (route, manifest, &config, manifest_error) {
            (_, Some(m), Some(c), _) => {
                let exec = self.compressor.parallelism().exec_for(m.flat_len());
                let local = self
                    .compressor
                    .prepare()
                    .map(|(_, feedback)| two_phase::Step {
                        manifest: m,
                        feedback,
                        seed,
                        step,
                        config: c,
                        reduction,
                        exec,
                    });
                self.two_phase.run(comm, local, self.chunk_bytes, bufs)
            }
            (_, _, _, error) => {
                let error = error.unwrap_or_else(|| Error::internal("no configuration"));
                self.two_phase.run(comm, Err(error), self.chunk_bytes, bufs)
            }
        };
        self.compressor.set_step(step.wrapping_add(1));
        self.message_bytes = match (route, manifest, &result) {
            (Route::TwoPhase, Some(_), Ok(())) => self.two_phase.sent_payload_bytes(),
            _ => 0,
        };
        result
    }

    /// Aggregates the local gradients with the peers' compressed gradients, the local rank
    /// being rank 0 and `peers[i]` rank `i + 1`. Each tensor's contributions are summed in rank
    /// order and divided once by the number of ranks: the true mean of the compressed
    /// gradients (or another reduction, see [`CompressedAllReduce::with_reduction`]).
    ///
    /// # Errors
    /// [`Error::WorldSize`] when `peers.len() + 1` is not the world size; [`Error::Config`] for
    /// world size 0 or an invalid method; naming the tensor and the
    /// rank, when a peer's gradients differ in names, shapes, step, method or seed
    /// (as [`Aggregator::aggregate_into`] checks bundles), or a peer's frame body is invalid
    /// ([`Error::Core`], the error of [`gradwire_core::validate`]); any error of
    /// [`GradientCompressor::compress`]. The peers, frame bodies included, are checked before
    /// the local gradients are compressed: on those errors nothing changes.
    /// [`Error::Overflow`] when the aggregate overflows f32 (naming the tensor and the element,
    /// as for [`Aggregator::aggregate_into`]); that is known only after the local
    /// compression, so the step has advanced, and the residuals take back what was sent (as
    /// for [`CompressedAllReduce::all_reduce`]).
    pub fn all_reduce_with_peers(
        &mut self,
        gradients: &HashMap<String, Tensor>,
        peers: &[HashMap<String, CompressedGradient>],
    ) -> Result<HashMap<String, Tensor>> {
        self.all_reduce_with_peers_at(gradients, 0, peers)
    }

    /// As [`CompressedAllReduce::all_reduce_with_peers`], the local rank being `rank`:
    /// `peers` holds the other ranks' contributions in rank order (rank `rank` left out), so
    /// that every rank sums in the same order and gets bit-identical results. Errors as
    /// [`CompressedAllReduce::all_reduce_with_peers`], and [`Error::Config`] for a rank outside
    /// the group.
    pub(crate) fn all_reduce_with_peers_at(
        &mut self,
        gradients: &HashMap<String, Tensor>,
        rank: usize,
        peers: &[HashMap<String, CompressedGradient>],
    ) -> Result<HashMap<String, Tensor>> {
        self.check_world_size()?;
        if peers.len() + 1 != self.world_size {
            return Err(Error::WorldSize {
                expected: self.world_size,
                got: peers.len() + 1,
            });
        }
        if rank >= self.world_size {
            return Err(Error::config(format!(
                "rank {rank} is outside a group of {} ranks",
                self.world_size
            )));
        }
        let method = self.compressor.method().core_method()?;
        let seed = self.compressor.seed();
        let manifest = Manifest::cached(
            &mut self.tensors,
            gradients,
            method,
            seed,
            BucketConfig::none(),
        )?;
        let step = self.compressor.step();
        let peer_rank = |i: usize| if i < rank { i } else { i + 1 };
        for (i, peer) in peers.iter().enumerate() {
            check_contribution(manifest, peer, peer_rank(i), step)?;
        }
        // The frame bodies too (check_contribution reads the headers only), so that a bad peer
        // fails before the local compression changes the residuals and the step; after every
        // peer's headers, so that a missing tensor or another shape is reported first.
        for (i, peer) in peers.iter().enumerate() {
            for entry in manifest.entries() {
                if let Some(cg) = peer.get(&entry.label) {
                    let params = manifest.params(entry, step);
                    gradwire_core::validate(cg.frame(), &params, entry.len)
                        .map_err(|err| Error::core(&entry.label, Some(peer_rank(i)), err))?;
                }
            }
        }
        let local = self.compressor.compress(gradients)?;
        let mut contributions: Vec<&HashMap<String, CompressedGradient>> = peers.iter().collect();
        contributions.insert(rank, &local);
        let result = self.aggregator.aggregate_compressed_into(
            manifest,
            &contributions,
            step,
            self.reduction,
            &mut self.flat,
        );
        if let Err(e) = result {
            // As in `all_reduce_into`: the residuals take back what the failed step sent.
            let given_back = self.compressor.give_back_frames(&local);
            debug_assert!(given_back.is_ok(), "{given_back:?}");
            return Err(e);
        }
        manifest.to_tensors(&self.flat)
    }

    /// Compresses the local gradients for transmission to the other ranks (one frame per
    /// tensor; the step advances).
    ///
    /// # Errors
    /// As [`GradientCompressor::compress`].
    #[deprecated(
        note = "the original module's name, kept for one release: use `compressor_mut().compress(gradients)`"
    )]
    pub fn compress_for_transmission(
        &mut self,
        gradients: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, CompressedGradient>> {
        self.compressor.compress(gradients)
    }
}

/// The integration tests' helpers (MiniLM gradients, seeded noise), for the unit tests below.
#[cfg(test)]
#[path = "../tests/common/mod.rs"]
mod test_common;

/// The transports' shared checks and their test values (`contribution`), for the unit tests below.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../tests/common/collectives.rs"]
mod test_collectives;

#[cfg(test)]
mod allreduce_tests;

#[cfg(test)]
mod two_phase_tests;

/// [`Aggregator::aggregate_compressed_into`], the aggregate of per-tensor compressed gradients
/// that [`CompressedAllReduce::all_reduce_with_peers`] runs (moved from `tests/aggregate.rs`).
#[cfg(test)]
mod compressed_maps_tests {
    use std::collections::HashMap;

    use gradwire_core::{Method, Values};

    use super::test_common::{bundles, grads};
    use crate::aggregate::{Aggregator, Reduction};
    use crate::compressor::GradientCompressor;
    use crate::engine::Parallelism;
    use crate::error::Error;
    use crate::layout::{BucketConfig, CompressedGradient, Manifest};
    use crate::method::CompressionMethod;
    use crate::tensor::Tensor;

    /// Finite contributions whose f32 sum overflows: an error naming the tensor and the element
    /// within it (never an infinite aggregate), the same on the serial and the parallel path (small
    /// entries, a dense entry cut into chunks, a large top-k entry, a bucket), `out` zeroed.
    #[test]
    fn an_aggregate_that_overflows_f32_is_an_error() {
        let dense = CompressionMethod::Core(Method::Dense {
            values: Values::F32,
        });
        let small = grads(&[("a", &[3], vec![1.0; 3]), ("w", &[2], vec![3e38, 1.0])]);
        let n = 300_001;
        let at = 200_003;
        let mut big = vec![0.5f32; n];
        big[at] = 3e38;
        let large = grads(&[("a", &[3], vec![1.0; 3]), ("big", &[n], big)]);
        let cases = [
            (&dense, &small, BucketConfig::none(), "w", 0),
            (&dense, &small, BucketConfig::fused(64 << 10), "w", 0),
            (&dense, &large, BucketConfig::none(), "big", at),
            (
                &CompressionMethod::TopK { k: 3 },
                &large,
                BucketConfig::none(),
                "big",
                at,
            ),
        ];
        let is_overflow = |err: &Error, name: &str, at: usize| matches!(err, Error::Overflow { tensor, index } if tensor == name && *index == at);
        for (method, g, cfg, name, at) in cases {
            let manifest = Manifest::for_gradients(g, method, 0, cfg).unwrap();
            let b = bundles(&manifest, method, &[g.clone(), g.clone()]);
            for reduction in [Reduction::Sum, Reduction::Mean] {
                let what = format!("{method:?} {cfg:?} {reduction:?}");
                let mut out = vec![42.0; 3];
                let err = Aggregator::serial()
                    .aggregate_into(&manifest, &b, 0, reduction, &mut out)
                    .unwrap_err();
                assert!(is_overflow(&err, name, at), "{what}: {err}");
                assert_eq!(out, vec![0.0; manifest.flat_len()], "{what}");
                let mut par = vec![f32::NAN; 3];
                let par_err = Aggregator::new()
                    .with_parallelism(Parallelism::Parallel)
                    .aggregate_into(&manifest, &b, 0, reduction, &mut par)
                    .unwrap_err();
                assert_eq!(par_err.to_string(), err.to_string(), "{what} in parallel");
                assert!(is_overflow(&par_err, name, at), "{what}: {par_err}");
                assert_eq!(par, out, "{what} in parallel");
                if cfg == BucketConfig::none() {
                    let c: Vec<_> = (0..2)
                        .map(|_| GradientCompressor::new(method.clone()).compress_once(g))
                        .collect();
                    let err = Aggregator::serial()
                        .aggregate_compressed_into(
                            &manifest,
                            &[&c[0], &c[1]],
                            0,
                            reduction,
                            &mut out,
                        )
                        .unwrap_err();
                    assert!(is_overflow(&err, name, at), "{what} per tensor: {err}");
                    assert_eq!(out, vec![0.0; manifest.flat_len()], "{what}");
                }
            }
        }
    }

    #[test]
    fn compressed_gradient_maps() {
        let method = CompressionMethod::TopK { k: 2 };
        let g0 = grads(&[("w", &[2, 2], vec![1.0, 2.0, 3.0, 4.0])]);
        let g1 = grads(&[("w", &[2, 2], vec![4.0, 3.0, 2.0, 1.0])]);
        let manifest = Manifest::for_gradients(&g0, &method, 0, BucketConfig::none()).unwrap();
        let c0 = GradientCompressor::new(method.clone()).compress_once(&g0);
        let c1 = GradientCompressor::new(method.clone()).compress_once(&g1);
        let mut out = Vec::new();
        Aggregator::serial()
            .aggregate_compressed_into(&manifest, &[&c0, &c1], 0, Reduction::Mean, &mut out)
            .unwrap();
        assert_eq!(out, vec![2.0, 1.5, 1.5, 2.0]);
        // A peer with another shape.
        let g_bad = grads(&[("w", &[4], vec![1.0; 4])]);
        let c_bad = GradientCompressor::new(method.clone()).compress_once(&g_bad);
        let err = Aggregator::serial()
            .aggregate_compressed_into(&manifest, &[&c0, &c_bad], 0, Reduction::Mean, &mut out)
            .unwrap_err();
        assert!(
            matches!(&err, Error::ShapeMismatch { tensor, rank: Some(1), .. } if tensor == "w"),
            "{err}"
        );
        // A peer at another step.
        let mut late = GradientCompressor::new(method.clone());
        late.compress_once(&g1);
        let c_late = late.compress_once(&g1);
        let err = Aggregator::serial()
            .aggregate_compressed_into(&manifest, &[&c0, &c_late], 0, Reduction::Mean, &mut out)
            .unwrap_err();
        assert!(
            matches!(&err, Error::Disagreement { rank: Some(1), .. }),
            "{err}"
        );
        // A peer with an extra tensor.
        let mut extra = c1.clone();
        extra.insert("z".to_owned(), c1["w"].clone());
        let err = Aggregator::serial()
            .aggregate_compressed_into(&manifest, &[&c0, &extra], 0, Reduction::Sum, &mut out)
            .unwrap_err();
        assert!(
            matches!(&err, Error::UnexpectedTensor { tensor, rank: Some(1) } if tensor == "z"),
            "{err}"
        );
        let empty: HashMap<String, CompressedGradient> = HashMap::new();
        let err = Aggregator::serial()
            .aggregate_compressed_into(&manifest, &[&empty], 0, Reduction::Sum, &mut out)
            .unwrap_err();
        assert!(
            matches!(&err, Error::MissingTensor { tensor, rank: Some(0) } if tensor == "w"),
            "{err}"
        );
    }

    trait CompressOnce {
        fn compress_once(
            &mut self,
            g: &HashMap<String, Tensor>,
        ) -> HashMap<String, CompressedGradient>;
    }

    impl CompressOnce for GradientCompressor {
        fn compress_once(
            &mut self,
            g: &HashMap<String, Tensor>,
        ) -> HashMap<String, CompressedGradient> {
            self.compress(g).unwrap()
        }
    }
}

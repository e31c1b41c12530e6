//! The two-phase shard-owner compressed all-reduce (DeepSpeed's 1-bit all-reduce, Bagua's
//! ByteGrad, CocktailSGD, in one shape for every method it covers).
//!
//! 1. Phase 1, all-to-all: each rank cuts every tensor into the shards of
//!    [`crate::layout::shards`], compresses shard `j` with its worker error feedback (the
//!    residual keyed by the tensor's name, as for the all-gather; the engine's
//!    [`crate::engine::shard`]) and sends it to rank `j` (`FORMAT.md` section 15).
//! 2. The owner of shard `j` decodes the W contributions, adds them in rank order into zeros,
//!    applies the reduction once (the mean divided once by W, before any cast), adds its server
//!    residual (keyed by name and shard), compresses with the same method (a tensor id distinct
//!    from the workers', so stochastic rounding draws other numbers) and keeps what it did not
//!    send. A majority vote is exact at the owner (the summed ±1 votes become ±1, sent as
//!    unscaled signs: no server residual).
//! 3. Phase 2, all-gather of the owners' frames: every rank decodes every shard into the same
//!    result, bit for bit.
//!
//! Nothing lost, on both sides: the worker's `sent + residual_new == gradient + residual_old`
//! per coordinate, and the owner's `owner_sent + server_residual_new == reduced +
//! server_residual_old` (bit-exact for f32 values: the core's error-feedback step).
//!
//! Faults: every rank makes the same calls in every step, whatever fails (an agreement round,
//! then one all-to-all and one all-gather, each in windows of the chunk bound when its messages
//! are longer, `comm::Windows`, and one more all-gather naming a configuration difference), so
//! no rank waits for a message that never comes. A rank that fails before phase 1 sends its reason to every owner; an owner
//! that finds a rank's message bad, a rank failed, or a fingerprint differing from rank 0's,
//! sends that in phase 2 instead of its shard, so every rank sees it and returns the same error.
//! A step's local errors (a NaN or infinite `gradient + residual`; without error feedback a
//! value beyond the value type's range, which error feedback sends saturated) are found before
//! any residual changes. After a failure the group sees (a
//! peer's error, a bad message, an overflow, a limit), the worker's residuals take back what
//! this rank sent (its frames decoded and added back: the step's gradient is delayed, not lost,
//! up to f32 rounding, as on the all-gather) and the server residual returns exactly to its
//! value before the step (from a copy of this rank's `n / W` elements).

use std::collections::HashMap;

use gradwire_core::values::first_non_finite;
use gradwire_core::{Method, Params, ResidualBound};

use super::buffers::StepBuffers;
use super::shard_message::{self, Phase};
use super::{
    Config, ENVELOPE_LEN, MAX_REASON_LEN, Opened, PAYLOAD, RELAY_BAD, RELAY_FAILED, RELAY_OVERFLOW,
    agree, fingerprint_at, open, peer_text, seal_failure, seal_in_place, seal_relay,
};
use crate::aggregate::{Reduction, divide, majority};
use crate::comm::{CommError, Communicator, Windows};
use crate::engine::Exec;
use crate::engine::Gradients;
use crate::engine::shard::{Apply, Buffers, Part, apply_frame, encode_parts, parts_of, targets_of};
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::feedback::checkpoint::{Stored, write_checkpoint};
use crate::layout::Manifest;
use crate::layout::shards::ShardLayout;

/// This rank's part of a step.
pub(crate) struct Step<'a> {
    pub(crate) manifest: &'a Manifest,
    /// The worker's error feedback, when the method uses it.
    pub(crate) feedback: Option<&'a mut ErrorFeedback>,
    pub(crate) seed: u64,
    pub(crate) step: u64,
    pub(crate) config: &'a Config,
    pub(crate) reduction: Reduction,
    /// Where the step's pieces run (the parts' selections, the frames' chunks, the checks and
    /// passes over the parts): on the calling thread or on the pool, with the same results.
    pub(crate) exec: Exec,
}

/// What this rank sends in phase 2 when it does not send its reduced shard.
enum Verdict {
    /// This rank's own error.
    Own(Error),
    /// A rank failed (`bad_message` false) or sent a bad message.
    Relay {
        rank: usize,
        bad_message: bool,
        reason: String,
    },
}

/// Where a rank's server residuals come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ServerOrigin {
    /// The run began at step 0: they start at zero.
    Fresh,
    /// The run began past step 0 (its workers resumed) and they were neither loaded nor
    /// discarded: a step that keeps them fails until one of the two.
    Resumed,
    /// Loaded from a checkpoint (checked against the run at the next step).
    Loaded,
    /// Discarded by the caller: zeros by choice.
    Discarded,
}

/// Buffers and server residuals of the two-phase collective, kept between calls.
#[derive(Debug, Default)]
pub(crate) struct TwoPhase {
    layout: Option<ShardLayout>,
    /// This rank's server residual: its whole shard (every tensor's part, in manifest order).
    server: Vec<f32>,
    /// Server residuals to restore, set before the layout is known (checked when it is).
    pending: Option<HashMap<String, Vec<f32>>>,
    /// The shard layout pending residuals were saved with (block, layout id), when known.
    pending_layout: Option<(usize, u64)>,
    /// The method the pending server residuals were saved with.
    pending_method: Option<Method>,
    /// The step the pending server residuals were saved before (the run's next step then).
    pending_step: Option<u64>,
    /// This rank (of the last step).
    rank: usize,
    /// The server residuals this step's owner encode writes (from `server`, which it leaves as
    /// it was), valid while `next_valid`, and made `server` when the step succeeds (the two
    /// buffers swap): a failed step keeps `server` with no copy made. Kept between steps (its
    /// memory is written once).
    server_next: Vec<f32>,
    next_valid: bool,
    /// Whether the last step's owner kept a server residual (error feedback, mean or sum).
    server_feedback: bool,
    /// Where this rank's server residuals come from, decided at the all-reduce's first step
    /// ([`TwoPhase::note_step`]) and by loads and discards.
    origin: Option<ServerOrigin>,
    /// The step of the all-reduce's first call.
    first_step: u64,
    /// Owners whose phase-1 frames this rank made in the current step (what a failed step
    /// gives back to the worker's residuals).
    made: usize,
    /// The worker's residuals, moved out of its error feedback while a step works on them.
    taken: Vec<Vec<f32>>,
    /// The bounds the worker's error feedback kept for its residuals before the step (one per
    /// tensor), and the step's new ones.
    worker_bounds: Vec<ResidualBound>,
    new_bounds: Vec<f32>,
    /// This rank's phase-1 messages, one per owner (read again by a failed step's give-back).
    send: Vec<Vec<u8>>,
    /// The phase-1 messages received, one per worker; between steps, the buffers phase 2
    /// gathered into (see [`TwoPhase::run`]).
    recv: Vec<Vec<u8>>,
    /// This rank's phase-2 message: its reduced shard, or a verdict. Kept at its length
    /// between steps, so that the next step's shard is written over its bytes.
    phase2: Vec<u8>,
    /// This rank's envelope of the agreement round (its own buffer: written into `phase2`, it
    /// cut that message to an envelope, and the next reduced shard wrote its bytes twice).
    agreement: Vec<u8>,
    /// The agreement round's envelopes; during phase 2, the phase-2 messages, one per owner.
    gathered: Vec<Vec<u8>>,
    /// The windows the messages cross the communicator in.
    windows: Windows,
    bufs: Buffers,
}

impl TwoPhase {
    /// The bytes of a collective message of a step with `manifest` over `world` ranks at most
    /// (an envelope and the largest shard message, or a relay's reason); a failure's envelope
    /// when the manifest has no shard layout (every rank then fails alike, sending only that).
    fn message_limit(&self, manifest: &Manifest, world: usize) -> usize {
        let of = |l: &ShardLayout| {
            ENVELOPE_LEN
                + (0..world)
                    .map(|j| shard_message::limit_len(l, j))
                    .max()
                    .unwrap_or(0)
                    .max(MAX_REASON_LEN + 5)
        };
        match &self.layout {
            Some(l) if l.layout_id == manifest.layout_id() && l.world == world => of(l),
            _ => ShardLayout::new(manifest, world)
                .map_or(ENVELOPE_LEN + MAX_REASON_LEN + 5, |l| of(&l)),
        }
    }

    /// The shard layout for `manifest` over `world` ranks (built once per layout).
    ///
    /// # Errors
    /// As [`ShardLayout::new`]; [`Error::Config`] when server residuals of another layout are
    /// held (they would be lost: see [`TwoPhase::discard_server_residuals`]).
    pub(crate) fn layout_for(&mut self, manifest: &Manifest, world: usize) -> Result<&ShardLayout> {
        let fits = self
            .layout
            .as_ref()
            .is_some_and(|l| l.layout_id == manifest.layout_id() && l.world == world);
        if !fits {
            if self.server.iter().any(|&x| x != 0.0) {
                return Err(Error::config(
                    "the model layout or world size changed while server residuals of the old \
                     one are held; discard them first (CompressedAllReduce::discard_server_residuals)",
                ));
            }
            let layout = ShardLayout::new(manifest, world)?;
            self.server = Vec::new();
            self.layout = Some(layout);
        }
        let layout = self
            .layout
            .as_ref()
            .ok_or_else(|| Error::internal("layout"))?;
        Ok(layout)
    }

    /// This rank's server residuals and the pending ones, as slices of values.
    pub(crate) fn server_values(&self) -> impl Iterator<Item = &[f32]> {
        std::iter::once(&self.server[..])
            .chain(self.pending.iter().flat_map(|p| p.values().map(|v| &v[..])))
    }

    /// Multiplies this rank's server residuals and the pending ones by `factor` (finite and
    /// positive; the caller checked that no value overflows).
    pub(crate) fn scale_server_residuals(&mut self, factor: f32) {
        self.server.iter_mut().for_each(|x| *x *= factor);
        for values in self.pending.iter_mut().flat_map(|p| p.values_mut()) {
            values.iter_mut().for_each(|x| *x *= factor);
        }
        // A step in flight never holds new ones here (they are made and kept within a step).
        self.next_valid = false;
    }

    /// Whether this rank holds a server residual that is not zero (pending ones included).
    pub(crate) fn holds_server_residuals(&self) -> bool {
        self.server.iter().any(|&x| x != 0.0)
            || self
                .pending
                .as_ref()
                .is_some_and(|p| p.values().flatten().any(|&x| x != 0.0))
    }

    /// Bytes held, between steps, by each buffer of the received phase-1 messages and by the
    /// agreement round's buffers in all (capacities).
    #[cfg(test)]
    pub(crate) fn received_capacity(&self) -> (Vec<usize>, usize) {
        let recv = self.recv.iter().map(Vec::capacity).collect();
        (recv, self.gathered.iter().map(Vec::capacity).sum())
    }

    /// The layout in use, if any.
    #[cfg(test)]
    pub(crate) fn layout(&self) -> Option<&ShardLayout> {
        self.layout.as_ref()
    }

    /// This rank's server residuals: `(name, shard values)` per tensor with a non-empty shard.
    pub(crate) fn server_residuals(&self) -> impl Iterator<Item = (&str, &[f32])> {
        let rank = self.rank;
        self.layout.iter().flat_map(move |l| {
            l.tensors
                .iter()
                .filter(move |t| t.lens[rank] > 0 && self.server.len() == l.shard_lens[rank])
                .map(move |t| {
                    let at = t.starts[rank];
                    (t.name.as_str(), &self.server[at..at + t.lens[rank]])
                })
        })
    }

    /// Sets this rank's server residuals from `(name, values)` pairs, applied at the next step
    /// (when the layout is known).
    #[cfg(test)]
    pub(crate) fn set_server_residuals(&mut self, residuals: HashMap<String, Vec<f32>>) {
        self.origin = Some(ServerOrigin::Loaded);
        self.pending = Some(residuals);
        self.pending_layout = None;
        self.pending_method = None;
        self.pending_step = None;
    }

    /// Writes this rank's server residuals as a checkpoint to `out`: the error-feedback
    /// checkpoint format (`FORMAT.md` section 12: residuals named by tensor, checksummed, value
    /// ranges checked on load) with the shard layout in metadata (`FORMAT.md` section 15),
    /// streamed from the residuals (no copy of them).
    ///
    /// # Errors
    /// [`Error::Config`] before the first two-phase step, or for a method without server
    /// residuals; errors of the checkpoint writer; `on_io` of the writer's error.
    pub(crate) fn write_server_checkpoint(
        &self,
        out: &mut impl std::io::Write,
        (seed, step): (u64, u64),
        on_io: &dyn Fn(std::io::Error) -> Error,
    ) -> Result<()> {
        let Some(layout) = &self.layout else {
            return Err(Error::config(
                "no server residuals yet: run a two-phase step first",
            ));
        };
        if !self.server_feedback || ErrorFeedback::new(layout.method, seed).is_err() {
            return Err(Error::config(format!(
                "{} keeps no server residuals (they need error feedback, and a mean or a sum)",
                crate::method::format(&layout.method)
            )));
        }
        let mut residuals: Vec<Stored<'_>> = self
            .server_residuals()
            .map(|(name, values)| Stored {
                name,
                shape: None,
                values,
            })
            .collect();
        residuals.sort_unstable_by(|a, b| a.name.cmp(b.name));
        let text = shard_text(layout.world, self.rank, layout.block, layout.layout_id);
        let crc = format!("{:08x}", crc32fast::hash(text.as_bytes()));
        write_checkpoint(
            out,
            (&layout.method, seed, step),
            &residuals,
            &[(SHARDS_KEY, &text), (SHARDS_CRC_KEY, &crc)],
            on_io,
        )
    }

    /// Reads server residuals that [`TwoPhase::write_server_checkpoint`] wrote (`len` bytes
    /// from the start of `input`), for rank `rank` of `world` ranks; they apply at the next
    /// step, which checks the shard layout. The shard layout's metadata is checked before any
    /// residual is read.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for bytes that are not such a checkpoint (or damaged); for one
    /// saved by another rank or world size (discard the server residuals to restart
    /// elsewhere); `on_io` of the reader's error; nothing changes then.
    pub(crate) fn load_server_checkpoint<R: std::io::Read + std::io::Seek>(
        &mut self,
        (input, len): (&mut R, u64),
        on_io: &dyn Fn(std::io::Error) -> Error,
        world: usize,
        rank: usize,
    ) -> Result<()> {
        let mut saved_layout = None;
        let fb = ErrorFeedback::read_from(input, len, on_io, |meta| {
            let (block, layout_id) = shard_layout_of(meta, world, rank)?;
            saved_layout = Some((block as usize, layout_id));
            Ok(())
        })?;
        self.pending_method = Some(*fb.method());
        self.pending_step = Some(fb.step());
        self.pending = Some(fb.into_residuals().collect());
        self.pending_layout = saved_layout;
        self.origin = Some(ServerOrigin::Loaded);
        Ok(())
    }

    /// Applies pending server residuals to the layout's zeros.
    ///
    /// # Errors
    /// [`Error::Config`] for residuals saved with another method, before another step than
    /// `step` (the worker's checkpoint of another moment, or none), for another shard layout,
    /// for a name the layout lacks or a length other than this rank's shard; the residuals stay
    /// pending (every step fails until they are discarded or replaced).
    fn apply_pending(&mut self, rank: usize, step: u64) -> Result<()> {
        let (Some(layout), Some(pending)) = (&self.layout, &self.pending) else {
            return Ok(());
        };
        if let Some(saved) = &self.pending_method
            && *saved != layout.method
        {
            return Err(Error::config(format!(
                "the server residuals were saved with method `{}`; this run's is `{}`: \
                 discard them to restart",
                crate::method::format(saved),
                crate::method::format(&layout.method)
            )));
        }
        if let Some(saved) = self.pending_step
            && saved != step
        {
            return Err(Error::config(format!(
                "the server residuals were saved before step {saved}; this run is at step \
                 {step}: load the worker's checkpoint of the same moment, or discard them"
            )));
        }
        if let Some((block, id)) = self.pending_layout
            && (block, id) != (layout.block, layout.layout_id)
        {
            return Err(Error::config(format!(
                "the server residuals were saved for another shard layout (block {block}, \
                 layout {id:016x}; this model's: block {}, layout {:016x}): discard them to \
                 restart",
                layout.block, layout.layout_id
            )));
        }
        let mut server = crate::tensor::written_zeros(layout.shard_lens[rank], SERVER_RESIDUALS)?;
        let mut names: Vec<&String> = pending.keys().collect();
        names.sort();
        for name in names {
            let values = &pending[name];
            let Some(t) = layout.tensors.iter().find(|t| &t.name == name) else {
                return Err(Error::config(format!(
                    "server residual of `{name}`: the model has no such tensor"
                )));
            };
            if values.len() != t.lens[rank] {
                return Err(Error::config(format!(
                    "server residual of `{name}`: {} values, this rank's shard has {} (another \
                     world size or shard layout: discard the server residuals to restart)",
                    values.len(),
                    t.lens[rank]
                )));
            }
            if let Some(i) = gradwire_core::values::first_non_finite(values) {
                return Err(Error::config(format!(
                    "server residual of `{name}`: NaN or infinity at shard index {i}"
                )));
            }
            server[t.starts[rank]..t.starts[rank] + t.lens[rank]].copy_from_slice(values);
        }
        self.server = server;
        self.pending = None;
        self.pending_layout = None;
        self.pending_method = None;
        self.pending_step = None;
        Ok(())
    }

    /// Records the step of the all-reduce's first call, on any route and whatever its outcome:
    /// a run that begins past step 0 resumed its workers, and its server residuals (if the
    /// two-phase collective ever keeps them) must be loaded or discarded by the caller; one
    /// that begins at step 0 starts them at zero.
    pub(crate) fn note_step(&mut self, step: u64) {
        if self.origin.is_none() {
            self.first_step = step;
            self.origin = Some(if step == 0 {
                ServerOrigin::Fresh
            } else {
                ServerOrigin::Resumed
            });
        }
    }

    /// Drops every server residual (for example before a restart at another world size).
    pub(crate) fn discard_server_residuals(&mut self) {
        self.origin = Some(ServerOrigin::Discarded);
        self.server.clear();
        self.server_next = Vec::new();
        self.next_valid = false;
        self.pending = None;
        self.pending_layout = None;
        self.pending_method = None;
        self.pending_step = None;
    }

    /// Bytes of this rank's phase-1 shard messages of the last step (envelopes left out; 0
    /// when its step failed before the collective).
    pub(crate) fn sent_payload_bytes(&self) -> usize {
        self.send
            .iter()
            .map(|m| m.len().saturating_sub(ENVELOPE_LEN))
            .sum()
    }

    /// Bytes this rank receives per step at most (both phases, envelopes included), unless an
    /// owner's shard goes escaped (FORMAT.md 15: f32 values, a step of values beyond f16/bf16).
    pub(crate) fn received_bytes(layout: &ShardLayout, rank: usize) -> usize {
        let w = layout.world;
        let own = ENVELOPE_LEN + shard_message::max_len(layout, rank);
        let others: usize = (0..w)
            .filter(|&j| j != rank)
            .map(|j| ENVELOPE_LEN + shard_message::max_len(layout, j))
            .sum();
        (w - 1) * own + others
    }

    /// One step (see the module docs): `bufs` holds the gradients, read in phase 1, and
    /// receives the result (in place or apart), written after phase 1; after an error its
    /// outputs are unspecified. Each message crosses `comm` in
    /// windows of at most `chunk` bytes ([`Windows`]; every rank passes the same `chunk`).
    ///
    /// # Errors
    /// This rank's own error when its step failed; [`Error::PeerFailed`] naming the first rank
    /// whose step failed; [`Error::Collective`] naming a rank whose message was bad;
    /// [`Error::ConfigDiffers`]; [`Error::Overflow`]; [`Error::Comm`]. Every rank returns the
    /// same error, except a failed rank, which returns its own. On every error but
    /// [`Error::Comm`] the worker and server residuals are as before the step.
    pub(crate) fn run(
        &mut self,
        comm: &mut dyn Communicator,
        local: std::result::Result<Step<'_>, Error>,
        chunk: usize,
        bufs: &mut StepBuffers<'_>,
    ) -> Result<()> {
        let world = comm.world_size();
        let me = comm.rank();
        self.rank = me;
        self.made = 0;
        self.next_valid = false;
        // The agreement round, before anything changes: every route of a step starts with this
        // all-gather of envelopes (the all-gather's bundles, the dense all-reduce's envelopes),
        // so ranks that took another route, failed before the collective or are configured
        // otherwise are found by every rank at the same call, and none waits in an all-to-all
        // that its peers do not make.
        let mut step = agree(comm, local, &mut self.agreement, &mut self.gathered)?;
        // Every rank past the agreement holds the step's fingerprint and model, a rank whose
        // phase 1 fails too: it checks the phase-2 messages as its peers do.
        let fingerprint = fingerprint_at(step.config, step.step);
        let manifest = step.manifest;
        let mut step_data = None;
        let mut own_error = None;
        let made = self.phase1_local(&mut step, bufs, world, me);
        // The messages' limit, from the manifest every rank agreed on (a failed rank's too):
        // the windowed calls a rank makes depend on it.
        let limit = self.message_limit(step.manifest, world);
        match made {
            Ok(()) => step_data = Some(step),
            Err(e) => {
                // Phase 1 gave back what it had made before the error.
                own_error = Some(e);
            }
        }
        if let Some(e) = &own_error {
            self.send.resize_with(world, Vec::new);
            for msg in &mut self.send {
                seal_failure(e, msg);
            }
        }
        // A group of one sends its shard message to itself: it is read where it was written
        // (the buffers swap for the owner's part, and back).
        let alone = world == 1;
        if alone {
            std::mem::swap(&mut self.send, &mut self.recv);
        } else if let Err(e) =
            self.windows
                .all_to_all(comm, &self.send, limit, chunk, &mut self.recv)
        {
            // A length over the limit is the group's common verdict, before anyone used a
            // byte: the step is undone. Other transport errors may strike some ranks only, and
            // peers may have completed the step with this rank's values: they stay sent.
            if matches!(
                e,
                CommError::TooLarge { .. } | CommError::LimitsDiffer { .. }
            ) && let Some(mut step) = step_data
            {
                self.give_back(&mut step);
            }
            return Err(e.into());
        }
        let verdict = if self.recv.len() != world {
            Err(Error::WorldSize {
                expected: world,
                got: self.recv.len(),
            })
        } else {
            // The owner's part.
            Ok(match (own_error.take(), &step_data) {
                (Some(e), _) => Some(Verdict::Own(e)),
                (None, Some(step)) => self.reduce_own_shard(step, world, me, bufs.outs()).err(),
                (None, None) => Some(Verdict::Own(Error::internal("no step and no error"))),
            })
        };
        if alone {
            std::mem::swap(&mut self.send, &mut self.recv);
        }
        let verdict = verdict?;
        let mut own_error = None;
        match verdict {
            None => {}
            // An overflow is the group's (the sum of every rank's values), not this owner's
            // own failure: every rank returns it as `Error::Overflow`.
            Some(Verdict::Own(Error::Overflow { tensor, index })) => {
                seal_relay(
                    me,
                    RELAY_OVERFLOW,
                    &format!("{index}\n{tensor}"),
                    &mut self.phase2,
                );
            }
            Some(Verdict::Own(e)) => {
                seal_failure(&e, &mut self.phase2);
                own_error = Some(e);
            }
            Some(Verdict::Relay {
                rank,
                bad_message,
                reason,
            }) => seal_relay(
                rank,
                if bad_message { RELAY_BAD } else { RELAY_FAILED },
                &reason,
                &mut self.phase2,
            ),
        }
        if alone {
            // As in phase 1: the owner's message is read where it was written.
            self.gathered.truncate(1);
            self.gathered.resize_with(1, Vec::new);
            std::mem::swap(&mut self.phase2, &mut self.gathered[0]);
        } else {
            // Phase 2 gathers into the buffers phase 1 received into (no shard message is
            // read again): one set of W messages a step, not two. Each owner's reduced shard
            // is about the size of a worker's shard message (the same for dense, quantization
            // and sign frames), so the buffers rarely grow. They go back to `recv` after the
            // step, for the next step's phase 1; the agreement round keeps its own.
            std::mem::swap(&mut self.recv, &mut self.gathered);
            if let Err(e) = self.windows.all_gather(
                comm,
                &self.phase2,
                limit,
                chunk,
                &mut self.gathered,
                |_| false,
            ) {
                std::mem::swap(&mut self.recv, &mut self.gathered);
                // As for phase 1: a length over the limit is a common verdict, before anyone
                // used a byte of this round; the step is undone on both sides. Other transport
                // errors keep what this owner sent (peers may have used it).
                if matches!(
                    e,
                    CommError::TooLarge { .. } | CommError::LimitsDiffer { .. }
                ) {
                    if let Some(mut step) = step_data {
                        self.give_back(&mut step);
                    }
                    self.restore_server();
                } else {
                    self.commit_server();
                }
                return Err(e.into());
            }
        }

        let result = self.finish(
            (me, world),
            (fingerprint, manifest),
            own_error,
            step_data.as_ref(),
            bufs.outs(),
        );
        if alone {
            std::mem::swap(&mut self.phase2, &mut self.gathered[0]);
        } else {
            std::mem::swap(&mut self.recv, &mut self.gathered);
        }
        if result.is_ok() {
            self.commit_server();
        } else {
            if let Some(mut step) = step_data {
                self.give_back(&mut step);
            }
            self.restore_server();
        }
        result
    }

    /// The decision from the phase-2 messages (the same on every rank), then the decode.
    fn finish(
        &mut self,
        (me, world): (usize, usize),
        (fingerprint, manifest): (u64, &Manifest),
        mut own_error: Option<Error>,
        step: Option<&Step<'_>>,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        if self.gathered.len() != world {
            return Err(Error::WorldSize {
                expected: world,
                got: self.gathered.len(),
            });
        }
        for (rank, msg) in self.gathered.iter().enumerate() {
            match open(msg) {
                // Made for this step and configuration.
                Opened::Payload { fingerprint: f } => {
                    if f != fingerprint {
                        return Err(Error::Collective {
                            rank,
                            reason: "its reduced shard was made for another configuration or \
                                     step"
                                .into(),
                        });
                    }
                }
                Opened::Failure(reason) => {
                    return Err(match own_error.take() {
                        Some(e) if rank == me => e,
                        _ => Error::PeerFailed { rank, reason },
                    });
                }
                Opened::Relay {
                    rank: at_fault,
                    kind,
                    reason,
                } => {
                    // A relay the protocol cannot produce is a bad message from its sender:
                    // decided from the messages every rank holds, so every rank alike.
                    let relay =
                        check_relay(&self.gathered, manifest, rank, at_fault, kind, &reason);
                    return Err(match (relay, own_error.take()) {
                        (Err(why), _) => Error::Collective { rank, reason: why },
                        (Ok(()), Some(e)) if at_fault == me && kind == RELAY_FAILED => e,
                        (Ok(()), _) if kind == RELAY_OVERFLOW => overflow_of(&reason),
                        (Ok(()), _) if kind == RELAY_BAD => Error::Collective {
                            rank: at_fault,
                            reason: peer_text(&reason),
                        },
                        (Ok(()), _) => Error::PeerFailed {
                            rank: at_fault,
                            reason: peer_text(&reason),
                        },
                    });
                }
                Opened::Invalid => {
                    return Err(Error::Collective {
                        rank,
                        reason: "its message is not a gradwire collective envelope (version 1)"
                            .into(),
                    });
                }
            }
        }
        let (Some(step), Some(layout)) = (step, &self.layout) else {
            return Err(Error::internal("a failed rank's own message was not found"));
        };
        // Every element of every tensor is in one owner's shard: the outputs are written
        // whole, in place, each owner's frame decoded into its parts.
        let mut outs = step
            .manifest
            .entry_slices(outs)
            .ok_or_else(|| Error::internal("two-phase outputs of another layout"))?;
        for (owner, msg) in self.gathered.iter().enumerate() {
            let mut frames = shard_message::open(
                &msg[ENVELOPE_LEN..],
                owner,
                Phase::Reduced,
                step.step,
                owner,
                layout.frames_of(owner),
            )?;
            if layout.shard_lens[owner] == 0 {
                continue;
            }
            let frame = frames.next_frame()?;
            let params = owner_params(layout.methods[owner], step, layout.owner_ids[owner]);
            let mut targets = targets_of(layout, owner, &mut outs);
            let mut decoded = apply_frame(
                layout,
                owner,
                frame,
                &params,
                &mut targets,
                Apply::Write,
                &mut self.bufs,
                step.exec,
            );
            // An owner whose reduced values left f16 or bf16 sent its shard escaped, with f32
            // values (FORMAT.md 15): the method's frame is refused at its header for its value
            // codec, before a value is written, and the escaped one is tried. Another fault is
            // named as the method's frame found it.
            if let Err(gradwire_core::Error::ParamMismatch {
                param: gradwire_core::Param::Values,
            }) = decoded
                && let Some(escape) = crate::layout::shards::escaped(&params.method)
            {
                let escaped = Params {
                    method: escape,
                    ..params
                };
                let again = apply_frame(
                    layout,
                    owner,
                    frame,
                    &escaped,
                    &mut targets,
                    Apply::Write,
                    &mut self.bufs,
                    step.exec,
                );
                if again.is_ok() {
                    decoded = again;
                }
            }
            decoded.map_err(|e| Error::Collective {
                rank: owner,
                reason: format!("its reduced shard: {e}"),
            })?;
        }
        Ok(())
    }

    /// Compresses this rank's shards into `self.send` (phase 1), in place on the gradients
    /// and the worker's residuals, after checking every tensor (a local error changes no
    /// residual).
    fn phase1_local(
        &mut self,
        step: &mut Step<'_>,
        grads: &StepBuffers<'_>,
        world: usize,
        me: usize,
    ) -> Result<()> {
        crate::aggregate::check_reduction(step.manifest, step.reduction, world)?;
        self.layout_for(step.manifest, world)?;
        let Some(layout) = &self.layout else {
            return Err(Error::internal("layout"));
        };
        // Server residuals only where the owner's step keeps one (error feedback, a mean or
        // sum): a method without error feedback holds none (nor the buffer of its next values).
        self.server_feedback = has_server_feedback(step);
        if self.server_feedback
            && self.origin == Some(ServerOrigin::Resumed)
            && self.pending.is_none()
        {
            // Zeros here would silently drop what the owners kept before the resume (issue 48
            // class 4): the caller says which state the run continues from.
            return Err(Error::config(format!(
                "this run began at step {} with server residuals on the two-phase collective \
                 but holds none (a worker checkpoint resumed without its server residuals?): \
                 load_server_residuals with the file saved at the same moment, or \
                 discard_server_residuals to start them at zero",
                self.first_step
            )));
        }
        if self.server_feedback && self.server.len() != layout.shard_lens[me] {
            self.server = crate::tensor::written_zeros(layout.shard_lens[me], SERVER_RESIDUALS)?;
        }
        self.apply_pending(me, step.step)?;
        if let (Some(fb), Some(layout)) = (step.feedback.as_deref(), &self.layout) {
            for ts in &layout.tensors {
                fb.check_shape(&ts.name, &ts.shape)?;
            }
        }
        self.worker_bounds.clear();
        if let (Some(fb), Some(layout)) = (step.feedback.as_deref(), &self.layout) {
            self.worker_bounds
                .extend(layout.tensors.iter().map(|ts| fb.residual_bound(&ts.name)));
        }
        self.take_residuals(step)?;
        let result = self.encode_phase1(step, grads, world);
        if result.is_err() {
            // Only a frame that could not be made after the checks passed: the owners'
            // frames made before it are given back.
            self.give_back_taken(step);
        }
        self.put_residuals(step);
        if result.is_ok()
            && let (Some(fb), Some(layout)) = (step.feedback.as_deref_mut(), &self.layout)
        {
            for (ts, &bound) in layout.tensors.iter().zip(&self.new_bounds) {
                fb.remember_shape(&ts.name, &ts.shape);
                fb.keep_bound(&ts.name, ResidualBound::at_most(bound));
            }
        }
        result
    }

    /// Moves the worker's residuals (zeros for a tensor without one) into `self.taken`, one
    /// per tensor of the layout; none without error feedback.
    fn take_residuals(&mut self, step: &mut Step<'_>) -> Result<()> {
        let Some(layout) = &self.layout else {
            return Err(Error::internal("layout"));
        };
        let Some(fb) = step.feedback.as_deref_mut() else {
            self.taken.clear();
            return Ok(());
        };
        self.taken.resize_with(layout.tensors.len(), Vec::new);
        for (t, ts) in layout.tensors.iter().enumerate() {
            if let Err(e) = fb.take_residual(&ts.name, ts.n, &mut self.taken[t]) {
                for (u, ts) in layout.tensors.iter().enumerate().take(t) {
                    fb.put_residual(&ts.name, &mut self.taken[u]);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Gives the residuals [`TwoPhase::take_residuals`] moved out back to the feedback.
    fn put_residuals(&mut self, step: &mut Step<'_>) {
        let (Some(fb), Some(layout)) = (step.feedback.as_deref_mut(), &self.layout) else {
            return;
        };
        for (ts, r) in layout.tensors.iter().zip(self.taken.iter_mut()) {
            fb.put_residual(&ts.name, r);
        }
    }

    /// Checks every tensor, then writes each owner's message into `self.send`.
    fn encode_phase1(
        &mut self,
        step: &Step<'_>,
        gradients: &StepBuffers<'_>,
        world: usize,
    ) -> Result<()> {
        let Some(layout) = &self.layout else {
            return Err(Error::internal("layout"));
        };
        // The layout's tensors are the manifest's entries, one tensor each.
        let mut grads = Vec::with_capacity(layout.tensors.len());
        for entry in step.manifest.entries() {
            grads.push(gradients.grad(step.manifest, entry.members[0]));
        }
        let values = layout.method.values();
        // Without error feedback nothing changes before the messages leave, and the dense,
        // quantization and sign encoders check every element as they write it: the gradient
        // is read once, and a failed encode is named by the check (the same error as a check
        // first).
        let deferred = step.feedback.is_none()
            && matches!(
                layout.method,
                Method::Dense { .. } | Method::Quant { .. } | Method::Sign { .. }
            );
        let check = |taken: &[Vec<f32>], bounds: &[ResidualBound]| {
            check_worker_input(step.exec, layout, &grads, taken, bounds, values)
        };
        if !deferred {
            check(&self.taken, &self.worker_bounds)?;
        }
        let fingerprint = fingerprint_at(step.config, step.step);
        let mut encode = || -> Result<()> {
            self.send.resize_with(world, Vec::new);
            self.new_bounds.clear();
            self.new_bounds.resize(layout.tensors.len(), 0.0);
            for j in 0..world {
                let msg = &mut self.send[j];
                // Laid out over last step's bytes, overwritten: no write pass of zeros.
                let at = shard_message::lay_out(
                    msg,
                    ENVELOPE_LEN,
                    Phase::Contribution,
                    step.step,
                    j,
                    layout.frames_of(j),
                    layout.max_frame_len(j),
                );
                seal_in_place(PAYLOAD, fingerprint, msg)?;
                if layout.shard_lens[j] == 0 {
                    shard_message::finish(msg, ENVELOPE_LEN);
                    self.made = j + 1;
                    continue;
                }
                let mut parts = parts_of(layout, j, &grads, &mut self.taken);
                let params = worker_params(layout, step, j);
                let written = encode_parts(
                    layout,
                    j,
                    &mut parts,
                    &params,
                    &mut self.bufs,
                    &mut msg[at..],
                    step.exec,
                )?;
                for (part, &bound) in parts.iter().zip(self.bufs.part_bounds()) {
                    let b = &mut self.new_bounds[part.tensor];
                    *b = b.max(bound);
                }
                shard_message::commit_frame(msg, at, written);
                shard_message::finish(msg, ENVELOPE_LEN);
                self.made = j + 1;
            }
            Ok(())
        };
        let encoded = encode();
        if deferred && encoded.is_err() {
            check(&self.taken, &self.worker_bounds)?;
        }
        encoded
    }

    /// After a failed step: the worker's residuals take back what this rank's phase-1 frames
    /// sent (each frame decoded and added back into the residual it came from).
    fn give_back(&mut self, step: &mut Step<'_>) {
        if step.feedback.is_none() || self.made == 0 {
            return;
        }
        if self.take_residuals(step).is_ok() {
            self.give_back_taken(step);
            self.put_residuals(step);
        }
    }

    /// [`TwoPhase::give_back`] on the residuals in `self.taken`.
    fn give_back_taken(&mut self, step: &Step<'_>) {
        let Some(layout) = &self.layout else { return };
        if self.taken.len() != layout.tensors.len() {
            return;
        }
        for j in 0..self.made.min(self.send.len()) {
            if layout.shard_lens[j] == 0 {
                continue;
            }
            let Some(body) = self.send[j].get(ENVELOPE_LEN..) else {
                continue;
            };
            let Ok(mut frames) = shard_message::open(
                body,
                j,
                Phase::Contribution,
                step.step,
                j,
                layout.frames_of(j),
            ) else {
                continue;
            };
            let Ok(frame) = frames.next_frame() else {
                continue;
            };
            let params = worker_params(layout, step, j);
            let mut targets = targets_of(layout, j, &mut self.taken);
            // This rank's own frame, just made: it decodes.
            let given = apply_frame(
                layout,
                j,
                frame,
                &params,
                &mut targets,
                Apply::Add,
                &mut self.bufs,
                step.exec,
            );
            debug_assert!(given.is_ok(), "{given:?}");
        }
        self.made = 0;
    }

    /// Drops the server residuals [`TwoPhase::reduce_own_shard`] wrote for a step that failed:
    /// `server` still holds the ones before it.
    fn restore_server(&mut self) {
        self.next_valid = false;
    }

    /// Makes the server residuals this step's owner encode wrote the kept ones, once the step
    /// succeeded.
    fn commit_server(&mut self) {
        if self.next_valid && self.server_next.len() == self.server.len() {
            std::mem::swap(&mut self.server, &mut self.server_next);
        }
        self.next_valid = false;
    }

    /// Reduces this rank's shard from the W contributions in `self.recv` and writes its
    /// phase-2 message into `self.phase2`.
    fn reduce_own_shard(
        &mut self,
        step: &Step<'_>,
        world: usize,
        me: usize,
        outs: &mut [&mut [f32]],
    ) -> std::result::Result<(), Verdict> {
        let own = |e: Error| Verdict::Own(e);
        let bad = |rank: usize, e: Error| Verdict::Relay {
            rank,
            bad_message: true,
            reason: e.to_string(),
        };
        // The agreement round compared the configurations: a phase-1 envelope sealed for
        // another configuration or step is a bad message, not a second disagreement.
        let expected = fingerprint_at(step.config, step.step);
        for (rank, msg) in self.recv.iter().enumerate() {
            match open(msg) {
                Opened::Payload { fingerprint } if fingerprint == expected => {}
                Opened::Payload { .. } => {
                    return Err(bad(
                        rank,
                        Error::Collective {
                            rank,
                            reason: "its shard message was sealed for another configuration \
                                     or step"
                                .into(),
                        },
                    ));
                }
                Opened::Failure(reason) => {
                    return Err(Verdict::Relay {
                        rank,
                        bad_message: false,
                        reason,
                    });
                }
                _ => {
                    return Err(Verdict::Relay {
                        rank,
                        bad_message: true,
                        reason: "its message is not a gradwire collective envelope (version 1)"
                            .into(),
                    });
                }
            }
        }
        let Some(layout) = &self.layout else {
            return Err(own(Error::internal("layout")));
        };
        let mut opened = Vec::with_capacity(world);
        for (rank, msg) in self.recv.iter().enumerate() {
            let frames = shard_message::open(
                &msg[ENVELOPE_LEN..],
                rank,
                Phase::Contribution,
                step.step,
                me,
                layout.frames_of(me),
            )
            .map_err(|e| bad(rank, e))?;
            opened.push(frames);
        }
        let server_feedback = has_server_feedback(step);
        if server_feedback && self.server.len() != layout.shard_lens[me] {
            return Err(own(Error::internal("a server residual of another shard")));
        }
        // Sized once (its zeros written at the first step only), then written by the encode.
        self.next_valid = false;
        if server_feedback {
            crate::tensor::resize_or_refuse(
                &mut self.server_next,
                self.server.len(),
                SERVER_RESIDUALS,
            )
            .map_err(own)?;
        }
        // Laid out over last step's bytes, overwritten: no write pass of zeros.
        let mut at = lay_out_reduced(&mut self.phase2, layout, step, me, false);
        seal_in_place(
            PAYLOAD,
            fingerprint_at(step.config, step.step),
            &mut self.phase2,
        )
        .map_err(own)?;
        if layout.shard_lens[me] > 0 {
            // The W contributions summed in rank order (from zeros), in this rank's parts of the
            // output tensors (every rank overwrites them with the decoded shards in `finish`).
            let worker = worker_params(layout, step, me);
            let mut outs = step
                .manifest
                .entry_slices(outs)
                .ok_or_else(|| own(Error::internal("two-phase outputs of another layout")))?;
            let mut targets = targets_of(layout, me, &mut outs);
            for (rank, frames) in opened.iter_mut().enumerate() {
                let frame = frames.next_frame().map_err(|e| bad(rank, e))?;
                // Rank 0's values are written as the sum's first term: no pass of zeros.
                let how = if rank == 0 { Apply::Start } else { Apply::Add };
                apply_frame(
                    layout,
                    me,
                    frame,
                    &worker,
                    &mut targets,
                    how,
                    &mut self.bufs,
                    step.exec,
                )
                .map_err(|e| {
                    bad(
                        rank,
                        Error::Collective {
                            rank,
                            reason: format!("its shard for owner {me}: {e}"),
                        },
                    )
                })?;
            }
            step.exec
                .for_each(&mut targets, |_, target| match step.reduction {
                    Reduction::Sum => {}
                    // Division by 1 is exact: one rank's mean is its sum.
                    Reduction::Mean if world == 1 => {}
                    Reduction::Mean => divide(target.data, None, world),
                    Reduction::MajorityVote => majority(target.data, &worker.method),
                });
            drop(targets);
            let params = owner_params(layout.methods[me], step, layout.owner_ids[me]);
            // Each part's server residual: read from `server`, the new one written into
            // `server_next` (made `server` when the step succeeds).
            let mut server_parts = Vec::new();
            let (mut old_rest, mut rest) = if server_feedback {
                (&self.server[..], &mut self.server_next[..])
            } else {
                (&[][..], &mut [][..])
            };
            let mut parts = Vec::new();
            for (t, ts) in layout.tensors.iter().enumerate() {
                if ts.lens[me] == 0 {
                    continue;
                }
                let part = if server_feedback {
                    let (old, old_tail) = old_rest.split_at(ts.lens[me]);
                    old_rest = old_tail;
                    let (part, tail) = std::mem::take(&mut rest).split_at_mut(ts.lens[me]);
                    rest = tail;
                    Some((old, part))
                } else {
                    None
                };
                server_parts.push((t, part));
            }
            let reduced: Vec<&[f32]> = outs.iter().map(|o| &o[..]).collect();
            for (t, part) in server_parts {
                let ts = &layout.tensors[t];
                let (old, residual) = part.unzip();
                parts.push(Part {
                    tensor: t,
                    at: ts.starts[me],
                    x: &reduced[t][ts.begins[me]..ts.begins[me] + ts.lens[me]],
                    residual,
                    old,
                });
            }
            // No check before the encode: the encoders check every sum on their way (a chunk
            // before it changes), and a failed step keeps the server residual it read (the
            // encode writes the new one apart).
            // Only a failure names its cause: reduced values beyond f32 are the group's
            // overflow. Owners never clamp what the ranks summed (FORMAT.md 15): a reduced
            // value beyond f16 or bf16 sends the shard escaped, with f32 values. Without a
            // server residual the encoder finds it (nothing has changed then: the shard is
            // encoded again, escaped); with one, an error-feedback encode would saturate it,
            // so the sums are looked at first (f16 and bf16 methods only).
            let escape = crate::layout::shards::escaped(&params.method);
            let mut params = params;
            let mut escaped_now = match (escape, params.method.values()) {
                (Some(_), Some(values)) if server_feedback => parts
                    .iter()
                    .any(|p| crate::engine::shard::beyond(values, p.x, p.residual_before())),
                _ => false,
            };
            let written = loop {
                if let (true, Some(escape)) = (escaped_now, escape) {
                    params.method = escape;
                    at = lay_out_reduced(&mut self.phase2, layout, step, me, true);
                }
                let written = encode_parts(
                    layout,
                    me,
                    &mut parts,
                    &params,
                    &mut self.bufs,
                    &mut self.phase2[at..],
                    step.exec,
                );
                let out_of_range = matches!(
                    &written,
                    Err(Error::Core {
                        source: gradwire_core::Error::ValueOutOfRange { .. },
                        ..
                    })
                );
                if escaped_now || server_feedback || escape.is_none() || !out_of_range {
                    break written;
                }
                escaped_now = true;
            };
            let msg = &mut self.phase2;
            let written = match written {
                Ok(w) => {
                    // The encode wrote every element of the new server residuals.
                    self.next_valid = server_feedback;
                    w
                }
                Err(e) => {
                    let overflow = parts.iter().find_map(|p| {
                        let i = first_non_finite(p.x)?;
                        let ts = &layout.tensors[p.tensor];
                        Some(Error::Overflow {
                            tensor: ts.name.clone(),
                            index: ts.begins[me] + i,
                        })
                    });
                    return Err(own(overflow.unwrap_or(e)));
                }
            };
            shard_message::commit_frame(msg, at, written);
        }
        shard_message::finish(&mut self.phase2, ENVELOPE_LEN);
        Ok(())
    }
}

/// Whether a relay from `sender` about `at_fault` of `kind` could come from a rank that follows
/// the protocol, judged from the phase-2 messages and the model every rank holds: the rank at
/// fault is in the group; a relayed failure names a rank whose own phase-2 message is its
/// failure (a rank that fails sends its failure to every owner, and again in phase 2); an
/// overflow is the sender's own shard, its reason a decimal index, a newline and a tensor of
/// the model that has that element.
///
/// # Errors
/// Why the relay is impossible, for [`Error::Collective`] naming the sender.
fn check_relay(
    gathered: &[Vec<u8>],
    manifest: &Manifest,
    sender: usize,
    at_fault: usize,
    kind: u8,
    reason: &[u8],
) -> std::result::Result<(), String> {
    let world = gathered.len();
    if at_fault >= world {
        return Err(format!(
            "it relayed a fault of rank {at_fault}, outside the group of {world}"
        ));
    }
    match kind {
        RELAY_FAILED if !matches!(open(&gathered[at_fault]), Opened::Failure(_)) => Err(format!(
            "it relayed a failure of rank {at_fault}, whose own message shows none"
        )),
        RELAY_OVERFLOW if at_fault != sender => Err(format!(
            "it relayed an overflow of rank {at_fault}'s shard, not its own"
        )),
        RELAY_OVERFLOW => match overflow_parts(reason) {
            None => Err("its overflow relay does not name an index and a tensor".into()),
            Some((index, tensor)) => match manifest
                .tensors()
                .iter()
                .find(|t| t.name.as_bytes() == tensor)
            {
                None => Err(format!(
                    "its overflow relay names `{}`, not a tensor of the model",
                    peer_text(tensor)
                )),
                Some(t) if index >= t.numel => Err(format!(
                    "its overflow relay names element {index} of `{}`, which has {}",
                    t.name, t.numel
                )),
                Some(_) => Ok(()),
            },
        },
        _ => Ok(()),
    }
}

/// The index and tensor of an overflow relay's reason (`index`, a newline, the tensor).
fn overflow_parts(reason: &[u8]) -> Option<(usize, &[u8])> {
    let at = reason.iter().position(|&b| b == b'\n')?;
    let digits = &reason[..at];
    if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let index = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some((index, &reason[at + 1..]))
}

/// [`Error::Overflow`] of a checked overflow relay's reason.
fn overflow_of(reason: &[u8]) -> Error {
    let (index, tensor) = overflow_parts(reason).unwrap_or((0, &[]));
    Error::Overflow {
        tensor: peer_text(tensor),
        index,
    }
}

/// Lays out owner `me`'s phase-2 message over `msg`'s bytes ([`shard_message::lay_out`]) with
/// room for its frame, or with `escaped` for its escaped frame (FORMAT.md 15); returns where
/// the frame goes.
fn lay_out_reduced(
    msg: &mut Vec<u8>,
    layout: &ShardLayout,
    step: &Step<'_>,
    me: usize,
    escaped: bool,
) -> usize {
    let bound = if escaped {
        layout.max_escaped_frame_len(me)
    } else {
        layout.max_frame_len(me)
    };
    shard_message::lay_out(
        msg,
        ENVELOPE_LEN,
        Phase::Reduced,
        step.step,
        me,
        layout.frames_of(me),
        bound,
    )
}

/// Checks what a worker's phase-1 encode reads, before anything changes: every `g + r` (with a
/// residual in `taken`; a kept bound in `bounds` proves them finite by one read of the
/// gradient) or every gradient value against the method's value type (without). The tensors at
/// once on the pool; the first error in tensor order either way.
fn check_worker_input(
    exec: Exec,
    layout: &ShardLayout,
    grads: &[&[f32]],
    taken: &[Vec<f32>],
    bounds: &[ResidualBound],
    values: Option<gradwire_core::Values>,
) -> Result<()> {
    exec.first_err_largest_first(
        &layout.tensors,
        |ts| ts.n,
        |t, ts| {
            // A kept bound proves the sums finite by one read of the gradient (a sum beyond the
            // value type saturates; the residual keeps the excess).
            let proven = taken.get(t).is_some()
                && bounds
                    .get(t)
                    .is_some_and(|b| b.proves_sums_finite(grads[t]));
            if proven {
                return Ok(());
            }
            let bad = match taken.get(t) {
                Some(r) => gradwire_core::feedback::first_bad_sum(grads[t], r),
                None => crate::engine::shard::first_bad(grads[t], values),
            };
            match bad {
                Some(e) => Err(Error::core(&ts.name, None, e)),
                None => Ok(()),
            }
        },
    )
}

/// Whether the owner's step of `step` keeps a server residual: with error feedback, for a mean
/// or a sum (a majority vote's result is a sign, with nothing to feed back).
fn has_server_feedback(step: &Step<'_>) -> bool {
    step.feedback.is_some() && step.reduction != Reduction::MajorityVote
}

/// The `(block, layout id)` of a server checkpoint's shard layout metadata (`FORMAT.md`
/// section 15), checked: its own checksum, its version, and that it was saved by rank `rank`
/// of `world` ranks.
///
/// # Errors
/// [`Error::Checkpoint`] naming what is missing or differs.
fn shard_layout_of(
    meta: &HashMap<String, String>,
    world: usize,
    rank: usize,
) -> Result<(u64, u64)> {
    let get = |k: &str| meta.get(k).cloned();
    let (Some(text), Some(crc)) = (get(SHARDS_KEY), get(SHARDS_CRC_KEY)) else {
        return Err(Error::checkpoint(
            "not a server-residual checkpoint (no shard layout in its metadata)",
        ));
    };
    if format!("{:08x}", crc32fast::hash(text.as_bytes())) != crc {
        return Err(Error::checkpoint("shard layout: checksum mismatch"));
    }
    let field = |key: &str| {
        text.split(';')
            .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .ok_or_else(|| Error::checkpoint(format!("shard layout: no `{key}`")))
    };
    let num = |key: &str| -> Result<u64> {
        field(key)?
            .parse()
            .map_err(|_| Error::checkpoint(format!("shard layout: `{key}` is not a number")))
    };
    match field("version").ok().map(str::parse::<u64>) {
        Some(Ok(SHARDS_VERSION)) => {}
        Some(Ok(v)) => {
            return Err(Error::checkpoint(format!(
                "shard layout version {v}; this gradwire reads version {SHARDS_VERSION}"
            )));
        }
        Some(Err(_)) => {
            return Err(Error::checkpoint("shard layout: `version` is not a number"));
        }
        None => {
            return Err(Error::checkpoint(format!(
                "shard layout version 1 (block-cyclic shards, an earlier gradwire): its \
                         residual parts hold other elements than this version's (version \
                         {SHARDS_VERSION}); discard the server residuals to resume"
            )));
        }
    }
    let (saved_world, saved_rank, block) = (num("world_size")?, num("rank")?, num("block")?);
    let layout_id = u64::from_str_radix(field("layout")?, 16)
        .map_err(|_| Error::checkpoint("shard layout: `layout` is not hex"))?;
    if (saved_world, saved_rank) != (world as u64, rank as u64) {
        return Err(Error::checkpoint(format!(
            "server residuals saved by rank {saved_rank} of {saved_world} ranks cannot \
                     resume rank {rank} of {world}: the shard layout differs (discard the server \
                     residuals to restart at another world size)"
        )));
    }
    Ok((block, layout_id))
}

/// What an allocation of this rank's server residuals (either buffer) that fails names.
const SERVER_RESIDUALS: &str = crate::error::SERVER_RESIDUALS;

/// Metadata key of a server-residual checkpoint's shard layout, and of its CRC-32.
const SHARDS_KEY: &str = "server_shards";
const SHARDS_CRC_KEY: &str = "server_shards_crc32";
/// The shard layout's version in a server-residual checkpoint: 2, contiguous runs per tensor
/// (`FORMAT.md` section 15). Files without it were saved with version 1's block-cyclic shards,
/// whose residual parts hold other elements: they are refused.
const SHARDS_VERSION: u64 = 2;

/// The shard layout's text in a server-residual checkpoint.
fn shard_text(world: usize, rank: usize, block: usize, layout_id: u64) -> String {
    format!(
        "version={SHARDS_VERSION};world_size={world};rank={rank};block={block};layout={layout_id:016x}"
    )
}

/// The parameters of a worker's frame for owner `j`.
fn worker_params(layout: &ShardLayout, step: &Step<'_>, j: usize) -> Params {
    Params {
        method: layout.methods[j],
        seed: step.seed,
        step: step.step,
        tensor_id: layout.worker_ids[j],
    }
}

/// The parameters of an owner's frame.
fn owner_params(method: Method, step: &Step<'_>, tensor_id: u64) -> Params {
    Params {
        method,
        seed: step.seed,
        step: step.step,
        tensor_id,
    }
}

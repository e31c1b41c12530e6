//! Uncompressed f32 gradients: the fault rules' envelopes all-gathered (20 bytes per rank: the
//! configuration fingerprint, or the reason a rank failed), then
//! [`Communicator::all_reduce_sum_f32`] of the flat gradient (reduce-scatter, rank-order sum,
//! all-gather: a ring all-reduce's `2 (W - 1) / W x 4n` bytes per rank), then
//! the mean divided once by W: the same bits as the all-gather's rank-order mean.

use gradwire_core::values::first_non_finite;

use super::buffers::StepBuffers;
use super::{Config, ENVELOPE_LEN, MAX_REASON_LEN, PAYLOAD, fingerprint_at, seal};
use super::{check_fingerprints, gathered_fingerprints, seal_failure};
use crate::aggregate::{Reduction, divide};
use crate::comm::Communicator;
use crate::engine::Gradients;
use crate::error::{Error, Result};
use crate::layout::Manifest;

/// Whether `manifest`'s gradients travel uncompressed (every entry dense f32) under
/// `reduction`, so that the step is an f32 all-reduce.
pub(crate) fn applies(manifest: &Manifest, reduction: Reduction) -> bool {
    reduction != Reduction::MajorityVote
        && manifest.entries().iter().all(|e| {
            matches!(
                e.method,
                gradwire_core::Method::Dense {
                    values: gradwire_core::Values::F32
                }
            )
        })
}

/// This rank's part of a step: its manifest, configuration and step.
pub(crate) type Part<'a> = (&'a Manifest, &'a Config, u64);

/// Buffers kept between calls: one chunk of the flat gradient, and the envelopes.
#[derive(Debug, Default)]
pub(crate) struct DenseAllReduce {
    send: Vec<u8>,
    gathered: Vec<Vec<u8>>,
    chunk: Vec<f32>,
}

impl DenseAllReduce {
    /// One step: `local` is this rank's manifest and configuration, or the error that stopped
    /// it; `bufs` holds its gradients, and receives the reduced tensors (in place or apart).
    /// The flat gradient (the manifest's tensors in order) crosses the
    /// communicator in chunks of at most `chunk_bytes` (at least one element each), one
    /// [`Communicator::all_reduce_sum_f32`] per chunk, so that no buffer of the model's size is
    /// made: the sums are the same rank-order sums as one call over the whole model; each chunk
    /// is read from the gradients before its sums are written. With one rank the mean is the
    /// gradient (checked finite), copied into the outputs (in place: left where it is).
    ///
    /// # Errors
    /// As the all-gather's: this rank's own error; [`Error::PeerFailed`];
    /// [`Error::ConfigDiffers`]; [`Error::Comm`]; [`Error::Overflow`] when the sum overflows.
    /// After an error that follows the envelopes' check, the outputs are partly written.
    pub(crate) fn run(
        &mut self,
        comm: &mut dyn Communicator,
        local: std::result::Result<Part<'_>, Error>,
        reduction: Reduction,
        chunk_bytes: usize,
        bufs: &mut StepBuffers<'_>,
    ) -> Result<()> {
        let own = match local {
            Ok((manifest, config, step)) => {
                seal(PAYLOAD, fingerprint_at(config, step), &[], &mut self.send);
                Ok((manifest, config, step))
            }
            Err(error) => {
                seal_failure(&error, &mut self.send);
                Err(error)
            }
        };
        comm.all_gather(
            &self.send,
            ENVELOPE_LEN + MAX_REASON_LEN,
            &mut self.gathered,
        )?;
        let (mut own_error, ours) = match own {
            Ok(part) => (None, Some(part)),
            Err(e) => (Some(e), None),
        };
        let fingerprints = gathered_fingerprints(&self.gathered, comm.rank(), &mut own_error)?;
        let Some((manifest, config, step)) = ours else {
            return Err(Error::internal("a failed rank's own message was not found"));
        };
        check_fingerprints(comm, &fingerprints, config, step, &mut self.gathered)?;
        let tensors = manifest.tensors();
        if bufs.outs().len() != tensors.len() {
            return Err(Error::internal("outputs of another manifest"));
        }
        let w = comm.world_size();
        if w == 1 {
            // One rank's sum is its values, and x / 1 is x: the mean is the (finite) gradient.
            bufs.copy_gradients_to_outputs();
            return Ok(());
        }
        let chunk_len = (chunk_bytes / 4).max(1);
        let n = manifest.flat_len();
        // The tensor holding the chunk's first element, and that element's index within it.
        let (mut first, mut within) = (0usize, 0usize);
        let mut at = 0usize;
        while at < n {
            let len = chunk_len.min(n - at);
            self.chunk.clear();
            let (mut t, mut i) = (first, within);
            while self.chunk.len() < len {
                let g = bufs.grad(manifest, t);
                let take = (g.len() - i).min(len - self.chunk.len());
                self.chunk.extend_from_slice(&g[i..i + take]);
                (t, i) = if i + take == g.len() {
                    (t + 1, 0)
                } else {
                    (t, i + take)
                };
            }
            comm.all_reduce_sum_f32(&mut self.chunk)?;
            // Each tensor's piece of the chunk: the mean written into the output, then checked
            // there while it is in the cache (the first non-finite element in chunk order is the
            // first in the model).
            let mut from = 0;
            while from < len {
                let t = &tensors[first];
                let dst = &mut bufs.outs()[first][within..];
                let take = dst.len().min(len - from);
                let (dst, src) = (&mut dst[..take], &self.chunk[from..from + take]);
                if reduction == Reduction::Mean {
                    divide(dst, Some(src), w);
                } else {
                    dst.copy_from_slice(src);
                }
                if let Some(k) = first_non_finite(dst) {
                    return Err(Error::Overflow {
                        tensor: t.name.clone(),
                        index: within + k,
                    });
                }
                from += take;
                (first, within) = if within + take == t.numel {
                    (first + 1, 0)
                } else {
                    (first, within + take)
                };
            }
            at += len;
        }
        Ok(())
    }
}

//! Uncompressed f32 gradients: the fault rules' envelopes all-gathered (20 bytes per rank: the
//! configuration fingerprint, or the reason a rank failed), then
//! [`Communicator::all_reduce_sum_f32`] of the gradients, in chunks cut at tensor boundaries
//! (reduce-scatter, rank-order sum, all-gather: a ring all-reduce's `2 (W - 1) / W x 4n` bytes
//! per rank), then the mean divided once by W: the same bits as the all-gather's rank-order
//! mean.

use super::buffers::StepBuffers;
use super::{Config, ENVELOPE_LEN, MAX_REASON_LEN, PAYLOAD, fingerprint_at, seal};
use super::{check_fingerprints, gathered_fingerprints, seal_failure};
use crate::aggregate::{Reduction, map_then_check};
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

/// Buffers kept between calls: one chunk of small tensors, and the envelopes.
#[derive(Debug, Default)]
pub(crate) struct DenseAllReduce {
    send: Vec<u8>,
    gathered: Vec<Vec<u8>>,
    chunk: Vec<f32>,
}

impl DenseAllReduce {
    /// One step: `local` is this rank's manifest and configuration, or the error that stopped
    /// it; `bufs` holds its gradients, and receives the reduced tensors (in place or apart).
    /// The gradients cross the communicator in chunks of at most `chunk_bytes` (at least one
    /// element each) cut at tensor boundaries, one [`Communicator::all_reduce_sum_f32`] per
    /// chunk, so that no buffer of the model's size is made: a tensor of at least a quarter of
    /// a chunk in pieces of its own, reduced in its output (in place: where it lies, without a
    /// copy), smaller ones gathered in order into a chunk kept across steps. The sums are the
    /// same rank-order sums as one call over the whole model; each chunk is read from the
    /// gradients before its sums are written. With one rank the mean is the
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
        // A tensor of at least a quarter of a chunk is reduced where it lies, in pieces of at
        // most a chunk (in place no copy is made of it); smaller tensors are gathered, in
        // order, into chunks of at most `chunk_len` elements. Every call but a gathered chunk
        // cut short by the large tensor after it carries at least a quarter of a chunk: at
        // most four calls per chunk of elements, plus one per large tensor.
        let direct_min = (chunk_len / 4).max(1);
        let mut t = 0;
        while t < tensors.len() {
            let numel = tensors[t].numel;
            if numel >= direct_min {
                // Pieces of equal length (the last shorter by less than their number), so that
                // no call carries a tensor's last few elements alone.
                let piece = numel.div_ceil(numel.div_ceil(chunk_len));
                let mut at = 0;
                while at < numel {
                    let len = piece.min(numel - at);
                    let x = bufs.output_holding_gradient(t, at..at + len);
                    comm.all_reduce_sum_f32(x)?;
                    if let Some(k) = finish(x, None, reduction, w) {
                        return Err(Error::Overflow {
                            tensor: tensors[t].name.clone(),
                            index: at + k,
                        });
                    }
                    at += len;
                }
                t += 1;
                continue;
            }
            let first = t;
            self.chunk.clear();
            while t < tensors.len()
                && tensors[t].numel < direct_min
                && self.chunk.len() + tensors[t].numel <= chunk_len
            {
                self.chunk.extend_from_slice(bufs.grad(manifest, t));
                t += 1;
            }
            if self.chunk.is_empty() {
                continue;
            }
            comm.all_reduce_sum_f32(&mut self.chunk)?;
            // Each tensor's part of the chunk: the mean written into its output and checked
            // there tile by tile (the first non-finite element in chunk order is the first in
            // the model).
            let mut from = 0;
            for (u, out) in bufs.outs()[first..t].iter_mut().enumerate() {
                let src = &self.chunk[from..from + out.len()];
                if let Some(k) = finish(out, Some(src), reduction, w) {
                    return Err(Error::Overflow {
                        tensor: tensors[first + u].name.clone(),
                        index: k,
                    });
                }
                from += out.len();
            }
        }
        Ok(())
    }
}

/// Writes the result of the sums `src` (`None`: `dst` holds them) into `dst` under
/// `reduction` (the mean divided once by `w`, as `aggregate::divide` divides), and
/// returns the index of its first element that is not finite.
fn finish(dst: &mut [f32], src: Option<&[f32]>, reduction: Reduction, w: usize) -> Option<usize> {
    let wf = w as f32;
    match reduction {
        // The same bits as dividing, at a multiplication's cost (see `divide`).
        Reduction::Mean if w.is_power_of_two() => {
            let inverse = 1.0 / wf;
            map_then_check(dst, src, |x| x * inverse)
        }
        Reduction::Mean => map_then_check(dst, src, |x| x / wf),
        _ => map_then_check(dst, src, |x| x),
    }
}

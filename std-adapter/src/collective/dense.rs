//! Uncompressed f32 gradients: the fault rules' envelopes all-gathered (20 bytes per rank: the
//! configuration fingerprint, or the reason a rank failed), then
//! [`Communicator::all_reduce_sum_f32`] of the flat gradient (reduce-scatter, rank-order sum,
//! all-gather: a ring all-reduce's `2 (W - 1) / W x 4n` bytes per rank), then
//! the mean divided once by W: the same bits as the all-gather's rank-order mean.

use std::collections::HashMap;

use gradwire_core::values::first_non_finite;

use super::{Config, ENVELOPE_LEN, MAX_REASON_LEN, PAYLOAD, fingerprint_at, seal};
use super::{check_fingerprints, gathered_fingerprints, seal_failure};
use crate::aggregate::Reduction;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::layout::Manifest;
use crate::tensor::Tensor;

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

/// This rank's part of a step: its manifest, gradients, configuration and step.
pub(crate) type Part<'a> = (&'a Manifest, &'a HashMap<String, Tensor>, &'a Config, u64);

/// Buffers kept between calls: one chunk of the flat gradient, and the envelopes.
#[derive(Debug, Default)]
pub(crate) struct DenseAllReduce {
    send: Vec<u8>,
    gathered: Vec<Vec<u8>>,
    chunk: Vec<f32>,
}

impl DenseAllReduce {
    /// One step: `local` is this rank's gradients with their manifest and configuration, or
    /// the error that stopped it; `out` receives the reduced tensors, written in place (its
    /// tensors reused). The flat gradient (the manifest's tensors in order) crosses the
    /// communicator in chunks of at most `chunk_bytes` (at least one element each), one
    /// [`Communicator::all_reduce_sum_f32`] per chunk, so that no buffer of the model's size is
    /// made: the sums are the same rank-order sums as one call over the whole model. With one
    /// rank the mean is the gradient (checked finite), copied into `out`.
    ///
    /// # Errors
    /// As the all-gather's: this rank's own error; [`Error::PeerFailed`];
    /// [`Error::ConfigDiffers`]; [`Error::Comm`]; [`Error::Overflow`] when the sum overflows.
    /// After an error that follows the envelopes' check, `out` is partly written.
    pub(crate) fn run(
        &mut self,
        comm: &mut dyn Communicator,
        local: std::result::Result<Part<'_>, Error>,
        reduction: Reduction,
        chunk_bytes: usize,
        out: &mut HashMap<String, Tensor>,
    ) -> Result<()> {
        let own = match local {
            Ok((manifest, grads, config, step)) => {
                seal(PAYLOAD, fingerprint_at(config, step), &[], &mut self.send);
                Ok((manifest, grads, config, step))
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
        let Some((manifest, grads, config, step)) = ours else {
            return Err(Error::internal("a failed rank's own message was not found"));
        };
        check_fingerprints(comm, &fingerprints, config, step, &mut self.gathered)?;
        manifest.shape_outputs(out);
        let tensors = manifest.tensors();
        let gradient = |i: usize| {
            grads
                .get(&tensors[i].name)
                .map(Tensor::data)
                .ok_or_else(|| Error::internal("a checked gradient is missing"))
        };
        let w = comm.world_size();
        if w == 1 {
            // One rank's sum is its values, and x / 1 is x: the mean is the (finite) gradient.
            for (i, t) in tensors.iter().enumerate() {
                let g = gradient(i)?;
                output(out, &t.name)?.copy_from_slice(g);
            }
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
                let g = gradient(t)?;
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
                let dst = &mut output(out, &t.name)?[within..];
                let take = dst.len().min(len - from);
                let (dst, src) = (&mut dst[..take], &self.chunk[from..from + take]);
                if reduction == Reduction::Mean {
                    let w = w as f32;
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d = s / w);
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

/// The elements of `out`'s tensor `name` (shaped by [`Manifest::shape_outputs`]).
fn output<'o>(out: &'o mut HashMap<String, Tensor>, name: &str) -> Result<&'o mut [f32]> {
    out.get_mut(name)
        .map(Tensor::data_mut)
        .ok_or_else(|| Error::internal("a shaped output is missing"))
}

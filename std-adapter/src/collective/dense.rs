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

/// Buffers kept between calls.
#[derive(Debug, Default)]
pub(crate) struct DenseAllReduce {
    send: Vec<u8>,
    gathered: Vec<Vec<u8>>,
}

impl DenseAllReduce {
    /// One step: `local` is this rank's gradients with their manifest and configuration, or
    /// the error that stopped it; `out` receives the reduced flat layout.
    ///
    /// # Errors
    /// As the all-gather's: this rank's own error; [`Error::PeerFailed`];
    /// [`Error::ConfigDiffers`]; [`Error::Comm`]; [`Error::Overflow`] when the sum overflows.
    pub(crate) fn run(
        &mut self,
        comm: &mut dyn Communicator,
        local: std::result::Result<Part<'_>, Error>,
        reduction: Reduction,
        out: &mut Vec<f32>,
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
        out.clear();
        out.resize(manifest.flat_len(), 0.0);
        for t in manifest.tensors() {
            let g = grads
                .get(&t.name)
                .ok_or_else(|| Error::internal("a checked gradient is missing"))?;
            out[t.offset..t.offset + t.numel].copy_from_slice(g.data());
        }
        comm.all_reduce_sum_f32(out)?;
        if reduction == Reduction::Mean {
            let w = comm.world_size() as f32;
            for x in out.iter_mut() {
                *x /= w;
            }
        }
        if let Some(at) = first_non_finite(out) {
            let (tensor, index) = manifest
                .tensors()
                .iter()
                .find(|t| (t.offset..t.offset + t.numel).contains(&at))
                .map_or((String::new(), at), |t| (t.name.clone(), at - t.offset));
            return Err(Error::Overflow { tensor, index });
        }
        Ok(())
    }
}

//! Collectives over a [`Communicator`] for compressed bundles: today the all-gather (every
//! rank's bundle to every rank, each aggregating all of them in rank order). Per-link bytes grow
//! as `(W - 1) x` bundle: right for small W or tiny bundles.

use crate::aggregate::{Aggregator, Reduction};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::layout::Manifest;

/// Exchanges this rank's `bundle` (made with `manifest` at `step`) with every rank of `comm`
/// into `gathered` and aggregates them into `out` (the flat layout of `manifest`).
///
/// # Errors
/// [`Error::Comm`] when the transport fails; [`Error::WorldSize`] when the group has another
/// size than `world_size`; any error of [`Aggregator::aggregate_into`] (the same on every
/// rank, which all see the same bundles).
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_gather(
    comm: &mut dyn Communicator,
    world_size: usize,
    manifest: &Manifest,
    bundle: &[u8],
    step: u64,
    reduction: Reduction,
    aggregator: &mut Aggregator,
    gathered: &mut Vec<Vec<u8>>,
    out: &mut Vec<f32>,
) -> Result<()> {
    comm.all_gather(bundle, manifest.max_bundle_len(), gathered)?;
    if gathered.len() != world_size {
        return Err(Error::WorldSize {
            expected: world_size,
            got: gathered.len(),
        });
    }
    aggregator.aggregate_into(manifest, gathered, step, reduction, out)
}

/// Takes part in the all-gather of a step this rank could not compress (an empty bundle, which
/// its peers' checks name as this rank's failure), so that no peer waits forever. The
/// transport's own error, if any, is dropped: the caller reports its local one.
pub(crate) fn all_gather_failed(
    comm: &mut dyn Communicator,
    manifest: &Manifest,
    gathered: &mut Vec<Vec<u8>>,
) {
    let _ = comm.all_gather(&[], manifest.max_bundle_len(), gathered);
}

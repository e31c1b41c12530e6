//! Collective communication between ranks: the [`Communicator`] trait (an all-gather of
//! variable-size byte buffers), [`LocalGroup`] (ranks as threads in one process) and, with the
//! `mpi` feature, `MpiCommunicator` (Open MPI through the `mpi` crate).
//!
//! Sparse frames differ per rank, so they cannot be summed on the wire: every rank gathers every
//! other rank's bundle and accumulates locally, always in rank order, so that all ranks compute
//! bit-identical results.
//!
//! # Size limits are collective
//! Every rank passes a `max_len` to [`Communicator::all_gather`]. The transports exchange the
//! lengths (and the limits) first, so every rank takes the same decision: when any rank's buffer
//! is longer than the smallest `max_len` of the group, every rank's call fails with the same
//! [`CommError::TooLarge`] naming the first such rank ([`CommError::LimitsDiffer`] when that
//! buffer is within its sender's own, larger limit: the ranks are configured differently),
//! `out` is left as it was, and no rank allocates or copies more than its own `max_len` for
//! any buffer. The group stays usable for the next call.
//!
//! # Example
//! ```
//! use gradwire::comm::{Communicator, LocalGroup};
//!
//! let comms = LocalGroup::new(3).into_communicators();
//! let handles: Vec<_> = comms
//!     .into_iter()
//!     .map(|mut comm| {
//!         std::thread::spawn(move || {
//!             let mut out = Vec::new();
//!             let local = vec![comm.rank() as u8; comm.rank()];
//!             comm.all_gather(&local, 1 << 20, &mut out)?;
//!             Ok::<_, gradwire::comm::CommError>(out)
//!         })
//!     })
//!     .collect();
//! for handle in handles {
//!     let out = handle.join().unwrap().unwrap();
//!     assert_eq!(out, vec![vec![], vec![1], vec![2, 2]]);
//! }
//! ```

mod local;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(any(test, feature = "mpi"))]
mod rounds;

pub use self::local::{LocalCommunicator, LocalGroup};
#[cfg(feature = "mpi")]
pub use self::mpi::MpiCommunicator;

/// Errors of a collective operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A rank offered more bytes than the receiver allows.
    #[error("rank {rank} sent {len} bytes, more than the limit of {limit} bytes")]
    TooLarge {
        /// The rank whose buffer was too large.
        rank: usize,
        /// Its length in bytes.
        len: usize,
        /// The receiver's limit in bytes.
        limit: usize,
    },
    /// A rank offered more bytes than the group's smallest limit but no more than its own,
    /// larger limit. Callers derive the limit from their configuration (for a compressed
    /// all-reduce, from the method, the model and the bucketing), so ranks whose limits differ
    /// are configured differently: the buffer is valid for its sender's configuration.
    #[error(
        "rank {rank} sent {len} bytes, more than the limit of {limit} bytes that rank {limit_rank} passed; the ranks passed different limits, so their configurations differ (method, ratio, model or bucketing must be the same on every rank)"
    )]
    LimitsDiffer {
        /// The first rank whose buffer was longer than the smallest limit.
        rank: usize,
        /// Its length in bytes.
        len: usize,
        /// The smallest limit in bytes.
        limit: usize,
        /// The first rank that passed the smallest limit.
        limit_rank: usize,
    },
    /// The transport failed (a peer disappeared, MPI reported an error, ...).
    #[error("transport failure: {0}")]
    Transport(String),
}

/// An all-gather of variable-size byte buffers among `world_size` ranks.
///
/// Every rank calls [`Communicator::all_gather`] the same number of times, in the same order.
pub trait Communicator: Send {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group (at least 1).
    fn world_size(&self) -> usize;
    /// Gathers every rank's `local` buffer (bytes) into `out`, one entry per rank in rank
    /// order (`out[self.rank()]` is a copy of `local`). `out` is resized to `world_size()`
    /// and its buffers are reused, so a steady-state caller does not allocate.
    ///
    /// Ranks should pass the same `max_len`; if they differ, the group applies the smallest.
    ///
    /// # Errors
    /// [`CommError::TooLarge`] when any rank's buffer is longer than `max_len` bytes (checked
    /// before anything of that size is allocated; every rank gets the same error and `out` is
    /// left as it was); [`CommError::LimitsDiffer`] instead when that buffer is within its
    /// sender's own, larger limit; [`CommError::Transport`] when the transport fails.
    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError>;
}

impl<C: Communicator + ?Sized> Communicator for &mut C {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_gather(local, max_len, out)
    }
}

impl<C: Communicator + ?Sized> Communicator for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_gather(local, max_len, out)
    }
}

/// Every rank's `(length, limit)` checked against the smallest limit: the first rank whose
/// length exceeds it, as the error every rank reports ([`CommError::LimitsDiffer`] when that
/// buffer is within its sender's own, larger limit, naming the rank that passed the smallest;
/// [`CommError::TooLarge`] otherwise).
fn check_lengths(posted: impl Iterator<Item = (usize, usize)> + Clone) -> Result<(), CommError> {
    let Some((limit_rank, limit)) = posted
        .clone()
        .map(|(_, limit)| limit)
        .enumerate()
        .min_by_key(|&(_, limit)| limit)
    else {
        return Ok(());
    };
    let differ = posted.clone().any(|(_, l)| l != limit);
    match posted.enumerate().find(|&(_, (len, _))| len > limit) {
        // Within its sender's own limit: valid for the sender's configuration, not the group's.
        Some((rank, (len, own))) if differ && len <= own => Err(CommError::LimitsDiffer {
            rank,
            len,
            limit,
            limit_rank,
        }),
        Some((rank, (len, _))) => Err(CommError::TooLarge { rank, len, limit }),
        None => Ok(()),
    }
}

/// Resizes `out` to `world_size` entries and empties them, keeping their capacity.
fn reset_out(out: &mut Vec<Vec<u8>>, world_size: usize) {
    out.truncate(world_size);
    out.resize_with(world_size, Vec::new);
    for buf in out.iter_mut() {
        buf.clear();
    }
}

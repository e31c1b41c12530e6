//! Collective communication between ranks: the [`Communicator`] trait (an all-gather and an
//! all-to-all of variable-size byte buffers, and a rank-order dense f32 sum built on them),
//! [`LocalGroup`] (ranks as threads in one process) and, with the `mpi` feature,
//! `MpiCommunicator` (Open MPI through the `mpi` crate).
//!
//! # Size limits are collective
//! Every rank passes a `max_len` to [`Communicator::all_gather`] and
//! [`Communicator::all_to_all`]. The transports exchange the lengths (and the limits) first, so
//! every rank takes the same decision: when any buffer is longer than the smallest `max_len` of
//! the group, every rank's call fails with the same [`CommError::TooLarge`] naming the first
//! such sender ([`CommError::LimitsDiffer`] when that buffer is within its sender's own, larger
//! limit: the ranks are configured differently), `out` is left as it was, and no rank
//! allocates or copies more than its own `max_len` for any buffer. The group stays usable for
//! the next call.
//!
//! # No rank waits forever
//! Every transport has a deadline (300 s unless configured): a call that waits
//! longer for its peers fails with [`CommError::Deadline`] naming the ranks that did not
//! arrive ([`LocalGroup`]), or, where a pending collective cannot be cancelled (MPI), ends the
//! job with a message naming them.
//!
//! # Bytes on the wire
//! Every communicator counts the bytes of its calls ([`Communicator::traffic`]): logical bytes,
//! the same on every transport: `sent` is what this rank addressed to peers (a buffer gathered
//! by `W - 1` peers counts `W - 1` times), `received` what peers addressed to it, and each call
//! adds its length exchange (16 bytes to and from each peer: a length and a limit). The counts
//! of a call that fails are the transport's own (what it moved before it stopped).
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
mod reduce;
#[cfg(any(test, feature = "mpi"))]
mod rounds;
mod windows;

pub use self::local::{LocalCommunicator, LocalGroup};
#[cfg(feature = "mpi")]
pub use self::mpi::MpiCommunicator;
pub(crate) use self::windows::{MIN_WINDOW, Outgoing, Stream, Windows};

/// How long a call waits for its peers before it fails, by default. `CompressedAllReduce` passes
/// buffers of at most its chunk bound (4 MiB by default) per call, so one of its calls moves at
/// most `(W - 1) x 4 MiB` to a rank: about 10 s at W = 4 over a 10 Mbit/s link, whatever the
/// model's size. A caller of its own that passes whole model-sized buffers (a dense bf16 bundle
/// of a 124M-parameter model is 249 MB, 600 s at W = 4 and 10 Mbit/s) needs a longer deadline.
pub(crate) const DEFAULT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(300);

/// Bytes one rank's calls moved, counted as the module docs say (the same on every transport).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes this rank addressed to its peers.
    pub sent: u64,
    /// Bytes its peers addressed to it.
    pub received: u64,
}

impl Traffic {
    /// Bytes of the length exchange of one call, each way, per peer.
    pub(crate) const LENGTHS: u64 = 16;

    /// Adds one call: `sent` and `received` payload bytes, and the length exchange with
    /// `peers` peers.
    pub(crate) fn add(&mut self, sent: usize, received: usize, peers: usize) {
        let header = Self::LENGTHS * peers as u64;
        self.sent = self.sent.saturating_add(sent as u64 + header);
        self.received = self.received.saturating_add(received as u64 + header);
    }

    /// What `self` adds to `before` (the traffic of the calls in between).
    pub fn since(self, before: Traffic) -> Traffic {
        Traffic {
            sent: self.sent.saturating_sub(before.sent),
            received: self.received.saturating_sub(before.received),
        }
    }
}

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
    /// A call waited longer than the deadline for its peers: `missing` did not arrive.
    #[error(
        "waited {waited:?} for ranks {missing:?} in round {round} (the deadline); the group is \
         broken"
    )]
    Deadline {
        /// How long the call waited.
        waited: std::time::Duration,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
        /// The number of the call (0 for the first one of the group).
        round: u64,
    },
    /// Ranks called different collectives at the same round.
    #[error("ranks called different collectives in round {round}: {detail}")]
    Mismatch {
        /// The number of the call.
        round: u64,
        /// Which rank called what.
        detail: String,
    },
    /// The transport failed (a peer disappeared, MPI reported an error, ...).
    #[error("transport failure: {0}")]
    Transport(String),
    /// The group can no longer make progress: a call of this rank or of a peer failed in a
    /// way that leaves the ranks out of step (a transport error, a deadline), and the
    /// communicator was closed ([`Communicator::close`]). Every later call fails with this
    /// error without moving a byte; recovery needs a new group (and a resume from checkpoints).
    #[error("the group is broken: {first}")]
    Broken {
        /// The first failure, as the rank that closed the group saw it (naming that rank).
        first: String,
    },
}

/// Collectives of variable-size byte buffers among `world_size` ranks.
///
/// Every rank calls the same collectives the same number of times, in the same order.
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
    /// sender's own, larger limit; [`CommError::Deadline`] or [`CommError::Transport`] when
    /// peers do not arrive or the transport fails.
    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError>;

    /// As [`Communicator::all_gather`], except that each rank's buffer is appended to `out[r]`
    /// (its earlier bytes kept; `out` is first resized to `world_size()` buffers, new ones
    /// empty), so that a message gathered in pieces is not copied again to be put together.
    /// The default gathers into a buffer of its own and appends from it (one more copy); a
    /// transport overrides it to write in place. After an error `out` is unspecified.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let mut got = Vec::new();
        self.all_gather(local, max_len, &mut got)?;
        out.resize_with(got.len(), Vec::new);
        for (dst, src) in out.iter_mut().zip(&got) {
            dst.extend_from_slice(src);
        }
        Ok(())
    }

    /// Sends `send[j]` to rank `j` (`send` has `world_size()` buffers; `send[self.rank()]`
    /// stays here) and receives into `out[i]` what rank `i` sent to this rank (MPI_Alltoallv).
    /// `out` is resized to `world_size()` and its buffers are reused.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`], for the first sender (in rank order of the receivers,
    /// then of the senders) of a buffer longer than the group's smallest `max_len`; every rank
    /// gets the same error. [`CommError::Mismatch`] when `send` does not hold `world_size()`
    /// buffers (on this rank; a transport that can tell fails every rank).
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError>;

    /// As [`Communicator::all_to_all`], except that the buffers to send are borrowed
    /// (`send[j]` for rank `j`) and what rank `i` sent is appended to `out[i]` (its earlier
    /// bytes kept; `out` is resized to `world_size()` buffers, new ones empty), so that a
    /// message exchanged in pieces is neither copied into owned buffers to be sent nor copied
    /// again to be put together. The default copies `send` into buffers of its own, exchanges
    /// them with [`Communicator::all_to_all`] and appends from what it received (two more
    /// copies); a transport overrides it to read and write in place. After an error `out` is
    /// unspecified.
    ///
    /// # Errors
    /// As [`Communicator::all_to_all`].
    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let owned: Vec<Vec<u8>> = send.iter().map(|b| b.to_vec()).collect();
        let mut got = Vec::new();
        self.all_to_all(&owned, max_len, &mut got)?;
        out.resize_with(got.len(), Vec::new);
        for (dst, src) in out.iter_mut().zip(&got) {
            dst.extend_from_slice(src);
        }
        Ok(())
    }

    /// The bytes this communicator's calls moved so far (see the module docs).
    fn traffic(&self) -> Traffic;

    /// Closes this communicator after a failure that may leave the group out of step (a
    /// transport error, a deadline; `reason` names it): every later call fails with
    /// [`CommError::Broken`] naming the first reason, without any collective of the
    /// transport, so that this rank never pairs a later call with a peer's earlier one. Peers
    /// the transport can reach learn it: `LocalGroup` marks the group broken and wakes the
    /// ranks that wait; `MpiCommunicator` sends the failure to its peers, which print it, and
    /// ends the job (a pending MPI collective cannot be cancelled). `CompressedAllReduce` calls
    /// it once after such a failure of a step. Returns the first failure the communicator
    /// records (naming the rank that found it), when it keeps one: after the group broke
    /// elsewhere first, that failure rather than `reason`, so that every rank names the same
    /// one. The default does nothing and returns `None` (a transport without state of its own
    /// relies on its peers' deadlines); a communicator that wraps another forwards it.
    fn close(&mut self, reason: &str) -> Option<String> {
        let _ = reason;
        None
    }

    /// The sum of every rank's `x` over the group, written into `x` on every rank, bit for bit
    /// the same everywhere and on every transport: the elements are cut into `world_size()`
    /// contiguous shards (shard `j` is `j * n / W .. (j + 1) * n / W`), shard `j` is summed by
    /// rank `j` in rank order (`((x_0 + x_1) + x_2) + ...`, in f32) after an all-to-all, and the
    /// sums are all-gathered: `2 (W - 1) / W x 4n` bytes each way per rank, a ring
    /// all-reduce's. Every rank must pass the same length. A transport may move the shards on
    /// its own schedule (`MpiCommunicator` exchanges them pairwise, one message each way per
    /// step); the bits and the [`Communicator::traffic`] counts are the same.
    ///
    /// # Errors
    /// As [`Communicator::all_to_all`] and [`Communicator::all_gather`];
    /// [`CommError::Mismatch`] when the ranks' lengths differ (every rank gets it).
    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        reduce::sum_f32(self, x)
    }
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

    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_gather_append(local, max_len, out)
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_to_all(send, max_len, out)
    }

    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_to_all_append(send, max_len, out)
    }

    fn traffic(&self) -> Traffic {
        (**self).traffic()
    }

    fn close(&mut self, reason: &str) -> Option<String> {
        (**self).close(reason)
    }

    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        (**self).all_reduce_sum_f32(x)
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

    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_gather_append(local, max_len, out)
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_to_all(send, max_len, out)
    }

    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        (**self).all_to_all_append(send, max_len, out)
    }

    fn traffic(&self) -> Traffic {
        (**self).traffic()
    }

    fn close(&mut self, reason: &str) -> Option<String> {
        (**self).close(reason)
    }

    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        (**self).all_reduce_sum_f32(x)
    }
}

/// Every rank's `(length, limit)`, in rank order, checked against the smallest limit: the
/// first rank whose length exceeds it, as the error every rank reports
/// ([`CommError::LimitsDiffer`] when that buffer is within its sender's own, larger limit,
/// naming the rank that passed the smallest; [`CommError::TooLarge`] otherwise).
///
/// The decision every transport takes after its length exchange (see "Size limits are
/// collective" in the module docs); a [`Communicator`] written outside this crate calls it on
/// the lengths and limits it exchanged, so that its ranks fail alike.
///
/// # Errors
/// As above; `Ok` when every length is within the smallest limit (or there are no ranks).
pub fn check_lengths(
    posted: impl Iterator<Item = (usize, usize)> + Clone,
) -> Result<(), CommError> {
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

//! [`MpiCommunicator`]: the all-gather over MPI's world communicator (crate `mpi`, Open MPI).
//!
//! One call is:
//! 1. `MPI_Allgather` of three `u64` per rank: buffer length, `max_len`, round budget;
//! 2. the same decision on every rank: any length above the group's smallest `max_len` fails
//!    every rank with the same [`CommError::TooLarge`] (or [`CommError::LimitsDiffer`]), before
//!    anything is allocated;
//! 3. one `MPI_Allgatherv` per round into a reused staging buffer, then a copy into each
//!    rank's `out` entry. MPI counts and displacements are `i32`, so a round moves at most
//!    `i32::MAX` bytes in all (or the group's smallest [`MpiCommunicator::round_limit`]); a
//!    larger gather is split into rounds, each a window of every rank's buffer (see `rounds`).
//!
//! Every step is computed from exchanged values only, so all ranks issue the same sequence of
//! MPI calls.

use std::fmt;
use std::thread::{self, ThreadId};

use ::mpi::Count;
use ::mpi::Threading;
use ::mpi::datatype::PartitionMut;
use ::mpi::environment::Universe;
use ::mpi::traits::{Communicator as _, CommunicatorCollectives as _};

use super::rounds::Rounds;
use super::{CommError, Communicator, check_lengths, reset_out};

/// A [`Communicator`] over MPI's world communicator (feature `mpi`).
///
/// It owns the MPI [`Universe`]: MPI stays initialised exactly as long as this value (or the
/// universe taken back with [`MpiCommunicator::into_universe`]) lives, and is finalised when
/// it is dropped. Keep it alive until the last collective call of the program; use
/// [`MpiCommunicator::universe`] for anything else that needs MPI.
///
/// Errors that MPI itself detects abort the whole job (MPI's default error handler,
/// `MPI_ERRORS_ARE_FATAL`); the errors this type returns are the ones it detects itself.
///
/// # Threads
/// [`MpiCommunicator::init`] asks MPI for `MPI_THREAD_SERIALIZED`, so the communicator may be
/// moved to another thread (it is `Send`, and `&mut self` keeps calls from overlapping). When
/// the library provides less, or when the universe came from elsewhere with less
/// ([`MpiCommunicator::new`]), calls are accepted only on the thread that built the
/// communicator and fail with [`CommError::Transport`] on any other.
///
/// ```no_run
/// use gradwire::comm::{Communicator, MpiCommunicator};
///
/// let mut comm = MpiCommunicator::init()?; // run under `mpirun -np 4`
/// let mut out = Vec::new();
/// comm.all_gather(&[comm.rank() as u8], 1 << 20, &mut out)?;
/// assert_eq!(out.len(), comm.world_size());
/// drop(comm); // finalises MPI
/// # Ok::<(), gradwire::comm::CommError>(())
/// ```
pub struct MpiCommunicator {
    universe: Universe,
    rank: usize,
    world_size: usize,
    round_limit: usize,
    threading: Threading,
    home: ThreadId,
    /// Exchanged header: (length, max_len, round limit) per rank.
    header: Vec<u64>,
    lens: Vec<usize>,
    counts: Vec<usize>,
    mpi_counts: Vec<Count>,
    mpi_displs: Vec<Count>,
    staging: Vec<u8>,
    rounds: Rounds,
}

impl fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("round_limit", &self.round_limit)
            .field("threading", &self.threading)
            .finish_non_exhaustive()
    }
}

impl MpiCommunicator {
    /// The most bytes one `MPI_Allgatherv` moves in all: MPI counts are `i32`.
    pub const MAX_ROUND_BYTES: usize = i32::MAX as usize;

    /// Initialises MPI (requesting `MPI_THREAD_SERIALIZED`) and wraps its world communicator.
    ///
    /// # Errors
    /// [`CommError::Transport`] when MPI was already initialised in this process (then build
    /// the communicator from that universe with [`MpiCommunicator::new`]) or reports a rank or
    /// size that does not fit.
    pub fn init() -> Result<Self, CommError> {
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                CommError::Transport(
                    "MPI is already initialised: build the communicator from its Universe \
                     with MpiCommunicator::new"
                        .into(),
                )
            })?;
        Self::with_threading(universe, threading)
    }

    /// Wraps the world communicator of an already initialised `universe`, taking ownership of
    /// it (see [`MpiCommunicator::into_universe`] to get it back). Build it on the thread that
    /// initialised MPI.
    ///
    /// # Errors
    /// [`CommError::Transport`] when MPI reports a rank or size that does not fit.
    pub fn new(universe: Universe) -> Result<Self, CommError> {
        let threading = ::mpi::environment::threading_support();
        Self::with_threading(universe, threading)
    }

    fn with_threading(universe: Universe, threading: Threading) -> Result<Self, CommError> {
        let world = universe.world();
        let (rank, size) = (world.rank(), world.size());
        let rank = usize::try_from(rank)
            .map_err(|_| CommError::Transport(format!("MPI reported rank {rank}")))?;
        let world_size = usize::try_from(size)
            .ok()
            .filter(|&w| w > rank)
            .ok_or_else(|| CommError::Transport(format!("MPI reported world size {size}")))?;
        Ok(Self {
            universe,
            rank,
            world_size,
            round_limit: Self::MAX_ROUND_BYTES,
            threading,
            home: thread::current().id(),
            header: Vec::new(),
            lens: Vec::new(),
            counts: Vec::new(),
            mpi_counts: Vec::new(),
            mpi_displs: Vec::new(),
            staging: Vec::new(),
            rounds: Rounds::default(),
        })
    }

    /// Sets the most bytes one `MPI_Allgatherv` round moves in all ranks together, clamped to
    /// `1..=`[`MpiCommunicator::MAX_ROUND_BYTES`] (the default). The group uses the smallest
    /// value of all ranks, so ranks may differ. A smaller value bounds the staging buffer
    /// (this communicator keeps one of up to this many bytes) at the cost of more rounds; tests
    /// use a tiny value to exercise the splitting.
    #[must_use]
    pub fn with_round_limit(mut self, bytes: usize) -> Self {
        self.round_limit = bytes.clamp(1, Self::MAX_ROUND_BYTES);
        self
    }

    /// Like [`MpiCommunicator::with_round_limit`], in place.
    pub fn set_round_limit(&mut self, bytes: usize) {
        self.round_limit = bytes.clamp(1, Self::MAX_ROUND_BYTES);
    }

    /// This rank's round limit in bytes (see [`MpiCommunicator::with_round_limit`]).
    #[must_use]
    pub fn round_limit(&self) -> usize {
        self.round_limit
    }

    /// The thread support level MPI provides.
    #[must_use]
    pub fn threading(&self) -> Threading {
        self.threading
    }

    /// The MPI universe, for other MPI work (it must not be used concurrently with
    /// [`Communicator::all_gather`] unless MPI provides `MPI_THREAD_MULTIPLE`).
    #[must_use]
    pub fn universe(&self) -> &Universe {
        &self.universe
    }

    /// Gives the universe back; MPI is finalised when it is dropped.
    #[must_use]
    pub fn into_universe(self) -> Universe {
        self.universe
    }

    fn check_thread(&self) -> Result<(), CommError> {
        if self.threading < Threading::Serialized && thread::current().id() != self.home {
            return Err(CommError::Transport(format!(
                "MPI provides only {:?} thread support: call all_gather on the thread that \
                 built the communicator",
                self.threading
            )));
        }
        Ok(())
    }
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn to_count(n: usize) -> Result<Count, CommError> {
    Count::try_from(n)
        .map_err(|_| CommError::Transport(format!("{n} does not fit an MPI count (i32)")))
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.check_thread()?;
        let world = self.universe.world();
        let w = self.world_size;

        // 1. Lengths, limits and round budgets of every rank.
        let header_len = w
            .checked_mul(3)
            .filter(|&n| Count::try_from(n).is_ok())
            .ok_or_else(|| CommError::Transport(format!("world size {w} is too large")))?;
        let mine = [
            to_u64(local.len()),
            to_u64(max_len),
            to_u64(self.round_limit),
        ];
        self.header.clear();
        self.header.resize(header_len, 0);
        world.all_gather_into(&mine[..], &mut self.header[..]);

        // 2. The same decision on every rank, from the exchanged values only.
        let mut budget = to_u64(Self::MAX_ROUND_BYTES);
        for peer in self.header.chunks_exact(3) {
            budget = budget.min(peer[2]);
        }
        let as_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        check_lengths(
            self.header
                .chunks_exact(3)
                .map(|peer| (as_usize(peer[0]), as_usize(peer[1]))),
        )?;
        // Every length is now at most the smallest limit, which came from some rank's usize.
        self.lens.clear();
        self.lens.extend(
            self.header
                .chunks_exact(3)
                .map(|peer| usize::try_from(peer[0]).unwrap_or(usize::MAX)),
        );
        let budget = usize::try_from(budget)
            .unwrap_or(Self::MAX_ROUND_BYTES)
            .clamp(1, Self::MAX_ROUND_BYTES);

        reset_out(out, w);
        for (buf, &len) in out.iter_mut().zip(&self.lens) {
            buf.reserve(len);
        }

        // 3. Rounds of MPI_Allgatherv. Every rank computes the same plan; the errors below
        // cannot happen for a consistent plan and would hit every rank alike.
        self.rounds.start(w);
        self.counts.clear();
        self.counts.resize(w, 0);
        loop {
            let total = self.rounds.next(&self.lens, budget, &mut self.counts);
            if total == 0 {
                break;
            }
            self.mpi_counts.clear();
            self.mpi_displs.clear();
            let mut at = 0usize;
            for &count in &self.counts {
                self.mpi_counts.push(to_count(count)?);
                self.mpi_displs.push(to_count(at)?);
                at += count;
            }
            let start = self
                .rounds
                .window_start(self.rank, &self.counts)
                .ok_or_else(|| CommError::Transport("inconsistent round plan".into()))?;
            let send = start
                .checked_add(self.counts[self.rank])
                .and_then(|end| local.get(start..end))
                .ok_or_else(|| CommError::Transport("inconsistent round plan".into()))?;
            if self.staging.len() < total {
                self.staging.resize(total, 0);
            }
            {
                let mut partition = PartitionMut::new(
                    &mut self.staging[..total],
                    &self.mpi_counts[..],
                    &self.mpi_displs[..],
                );
                world.all_gather_varcount_into(send, &mut partition);
            }
            let mut at = 0usize;
            for (buf, &count) in out.iter_mut().zip(&self.counts) {
                buf.extend_from_slice(&self.staging[at..at + count]);
                at += count;
            }
        }
        Ok(())
    }
}

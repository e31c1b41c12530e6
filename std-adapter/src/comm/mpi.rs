//! [`MpiCommunicator`]: the all-gather over MPI's world communicator (crate `mpi`, Open MPI).
//!
//! One call is:
//! 1. `MPI_Allgather` of four `u64` per rank (the call's kind, buffer length, `max_len`, round
//!    budget) and, when the buffer holds at most [`INLINE_BYTES`] bytes, the buffer itself;
//! 2. the same decision on every rank: any length above the group's smallest `max_len` fails
//!    every rank with the same [`CommError::TooLarge`] (or [`CommError::LimitsDiffer`]), before
//!    anything is allocated; when every buffer came inline, the call ends here (the envelopes
//!    of the collectives take one MPI call, not two);
//! 3. otherwise one `MPI_Allgatherv` per round into a reused staging buffer, then a copy into each
//!    rank's `out` entry. MPI counts and displacements are `i32`, so a round moves at most
//!    `i32::MAX` bytes in all (or the group's smallest [`MpiCommunicator::round_limit`]); a
//!    larger gather is split into rounds, each a window of every rank's buffer (see `rounds`).
//!
//! An all-to-all is an `MPI_Alltoall` of (length, limit) pairs, an `MPI_Allgather` of each
//! receiver's verdict on the lengths it will receive (so that every rank fails alike), then
//! `MPI_Alltoallv`.
//!
//! The rank-order f32 sum ([`Communicator::all_reduce_sum_f32`]) is an `MPI_Allgather` of every
//! rank's element count, in a header of the all-gather's shape (a difference, or a rank in an
//! all-gather at that point, fails every rank alike), then the same shards, sums and
//! byte counts as on every transport, moved pairwise: in step `s = 1 .. W - 1` each rank sends
//! one message to rank `me + s` and receives one from rank `me - s` (mod `W`), first its
//! shards (the reduce-scatter), then its shard's sum (the all-gather). Each step loads every
//! link with one message each way, where `MPI_Alltoallv` sends `W - 1` shards into one
//! receiver's link at once; the f32 values travel as they are, with no byte staging. A
//! message that holds another number of values than the agreed counts give (a corrupted or
//! mismatched build: every rank computes the same sizes) ends the job with a message, as a
//! deadline does, rather than sum a partly filled buffer.
//!
//! Every step is computed from exchanged values only, so all ranks issue the same sequence of
//! MPI calls. Every MPI call is nonblocking and waited for with a deadline
//! ([`MpiCommunicator::with_deadline`], [`super::DEFAULT_DEADLINE`] by default): a pending
//! collective cannot be cancelled, so a rank whose call outlives the deadline runs an arrival
//! round (a message to every peer, and whatever comes back within a few seconds), prints the
//! ranks it did not hear from and ends the job with `MPI_Abort`. So does a call on a thread
//! MPI does not support, which one rank alone could otherwise leave its peers waiting on.

use std::fmt;
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use ::mpi::Count;
use ::mpi::Threading;
use ::mpi::datatype::Equivalence as _;
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::environment::Universe;
use ::mpi::point_to_point::Status;
use ::mpi::request::{Request, Scope, StaticScope};
use ::mpi::traits::{
    Communicator as _, CommunicatorCollectives as _, Destination as _, Source as _,
};

use super::reduce::{add_in_rank_order, logical_traffic, shard};
use super::rounds::Rounds;
use super::{CommError, Communicator, DEFAULT_DEADLINE, Traffic, check_lengths, reset_out};

/// Buffers of at most this many bytes travel inside [`Communicator::all_gather`]'s header
/// exchange (a multiple of 8: they travel as `u64` words).
const INLINE_BYTES: usize = 64;
/// The header of one rank in [`Communicator::all_gather`]: the call's kind, length, `max_len`,
/// round budget, then the inline bytes. The rank-order sum opens with an exchange of the same
/// shape (its kind and its element count), so that ranks that call the two at the same point
/// fail alike with [`CommError::Mismatch`] instead of misreading each other's words.
const HEADER_WORDS: usize = 4 + INLINE_BYTES / 8;
/// The kind word of [`Communicator::all_gather`]'s header.
const KIND_ALL_GATHER: u64 = 1;
/// The kind word of the rank-order sum's first exchange.
const KIND_SUM: u64 = 2;

/// The tag of the arrival round after a deadline.
const ARRIVAL_TAG: i32 = 0x6777;
/// The tags of the rank-order sum's point-to-point messages: its reduce-scatter, its all-gather.
const SCATTER_TAG: i32 = 0x6778;
const GATHER_TAG: i32 = 0x6779;
/// The tag of a closed rank's notice to its peers (the first failure's text), and of their
/// answer ([`MpiCommunicator`]'s `close`).
const BROKEN_TAG: i32 = 0x677a;
const BROKEN_ACK_TAG: i32 = 0x677b;
/// The longest failure text a notice carries.
const BROKEN_TEXT: usize = 1024;
/// What a rank sends in the arrival round.
static HERE: [u8; 1] = [1];
/// How long the arrival round listens for peers.
const ARRIVAL_GRACE: Duration = Duration::from_secs(5);

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
/// # Other MPI work on the same processes
/// The calls run on `MPI_COMM_WORLD` (a duplicate would need a communicator handle that is not
/// `Send`): besides collectives, the rank-order sum, the deadline's arrival round and a closed
/// rank's notice of its failure ([`Communicator::close`]) send point-to-point messages with
/// tags `0x6777`-`0x677b`. Other code must not use those tags on `MPI_COMM_WORLD`, nor have a
/// receive with `MPI_ANY_TAG` pending there while a call of this type runs or after a rank
/// closed its communicator; duplicate the world communicator for its own messages.
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
    /// Exchanged header: (length, max_len, round limit, inline bytes) per rank.
    header: Vec<u64>,
    lens: Vec<usize>,
    counts: Vec<usize>,
    mpi_counts: Vec<Count>,
    mpi_displs: Vec<Count>,
    staging: Vec<u8>,
    /// The rank-order sum's received shards, one slot per rank.
    shards: Vec<f32>,
    rounds: Rounds,
    deadline: Duration,
    round: u64,
    traffic: Traffic,
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
            shards: Vec::new(),
            rounds: Rounds::default(),
            deadline: DEFAULT_DEADLINE,
            round: 0,
            traffic: Traffic::default(),
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

    /// Sets how long a call waits for its peers before the job is ended (see the module docs).
    #[must_use]
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
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
    /// [`Communicator::all_gather`] unless MPI provides `MPI_THREAD_MULTIPLE`, and must keep off
    /// this type's message tags: see [`MpiCommunicator`]).
    #[must_use]
    pub fn universe(&self) -> &Universe {
        &self.universe
    }

    /// Gives the universe back; MPI is finalised when it is dropped.
    #[must_use]
    pub fn into_universe(self) -> Universe {
        self.universe
    }

    /// The all-to-all of [`Communicator::all_to_all`] over borrowed buffers; what arrives is
    /// appended to `out` (`append`) or replaces it.
    fn exchange(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
        append: bool,
    ) -> Result<(), CommError> {
        self.check_thread("all_to_all");
        self.round = self.round.wrapping_add(1);
        let waiter = self.waiter("all_to_all", Instant::now());
        let world = self.universe.world();
        let (w, me) = (self.world_size, self.rank);
        let pairs = w
            .checked_mul(2)
            .filter(|&n| Count::try_from(n).is_ok())
            .ok_or_else(|| CommError::Transport(format!("world size {w} is too large")))?;
        // 1. (length, limit) to every rank: a wrong number of buffers is sent as lengths of
        // u64::MAX, which every receiver refuses, so that every rank fails alike.
        let mut mine = vec![0u64; pairs];
        for j in 0..w {
            let len = if send.len() == w {
                to_u64(send[j].len())
            } else {
                u64::MAX
            };
            mine[2 * j] = len;
            mine[2 * j + 1] = to_u64(max_len);
        }
        let mut theirs = vec![0u64; pairs];
        ::mpi::request::scope(|scope| {
            waiter.wait(world.immediate_all_to_all_into(scope, &mine[..], &mut theirs[..]));
        });
        // 2. Each receiver's verdict on what it will receive, gathered, so that every rank
        // returns the first receiver's error.
        let as_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let column =
            check_lengths((0..w).map(|i| (as_usize(theirs[2 * i]), as_usize(theirs[2 * i + 1]))));
        let recv_total: u64 = (0..w).map(|i| theirs[2 * i]).fold(0, u64::saturating_add);
        let send_total: u64 = (0..w).map(|j| mine[2 * j]).fold(0, u64::saturating_add);
        let verdict: [u64; 5] = match &column {
            Ok(()) if recv_total > i32::MAX as u64 || send_total > i32::MAX as u64 => {
                [3, me as u64, recv_total.max(send_total), i32::MAX as u64, 0]
            }
            Ok(()) => [0; 5],
            Err(CommError::TooLarge { rank, len, limit }) => {
                [1, *rank as u64, *len as u64, *limit as u64, 0]
            }
            Err(CommError::LimitsDiffer {
                rank,
                len,
                limit,
                limit_rank,
            }) => [
                2,
                *rank as u64,
                *len as u64,
                *limit as u64,
                *limit_rank as u64,
            ],
            Err(_) => [3, me as u64, 0, 0, 0],
        };
        let mut verdicts = vec![0u64; 5 * w];
        ::mpi::request::scope(|scope| {
            waiter.wait(world.immediate_all_gather_into(scope, &verdict[..], &mut verdicts[..]));
        });
        if let Some(v) = verdicts.chunks_exact(5).find(|v| v[0] != 0) {
            let u = as_usize;
            return Err(match v[0] {
                1 => CommError::TooLarge {
                    rank: u(v[1]),
                    len: u(v[2]),
                    limit: u(v[3]),
                },
                2 => CommError::LimitsDiffer {
                    rank: u(v[1]),
                    len: u(v[2]),
                    limit: u(v[3]),
                    limit_rank: u(v[4]),
                },
                _ => CommError::Transport(format!(
                    "all_to_all: rank {} would move {} bytes, more than one MPI_Alltoallv \
                     (i32 counts) holds",
                    v[1], v[2]
                )),
            });
        }
        // 3. The data.
        let mut send_counts = Vec::with_capacity(w);
        let mut send_displs = Vec::with_capacity(w);
        let mut recv_counts = Vec::with_capacity(w);
        let mut recv_displs = Vec::with_capacity(w);
        let (mut at_s, mut at_r) = (0usize, 0usize);
        for j in 0..w {
            let (sl, rl) = (send[j].len(), as_usize(theirs[2 * j]));
            send_counts.push(to_count(sl)?);
            send_displs.push(to_count(at_s)?);
            recv_counts.push(to_count(rl)?);
            recv_displs.push(to_count(at_r)?);
            at_s += sl;
            at_r += rl;
        }
        let mut packed = Vec::with_capacity(at_s);
        for buf in send {
            packed.extend_from_slice(buf);
        }
        if self.staging.len() < at_r {
            self.staging.resize(at_r, 0);
        }
        {
            let partition = Partition::new(&packed[..], &send_counts[..], &send_displs[..]);
            let mut received = PartitionMut::new(
                &mut self.staging[..at_r],
                &recv_counts[..],
                &recv_displs[..],
            );
            ::mpi::request::scope(|scope| {
                waiter.wait(world.immediate_all_to_all_varcount_into(
                    scope,
                    &partition,
                    &mut received,
                ));
            });
        }
        if append {
            out.resize_with(w, Vec::new);
        } else {
            reset_out(out, w);
        }
        let mut at = 0usize;
        for (i, buf) in out.iter_mut().enumerate() {
            let len = as_usize(theirs[2 * i]);
            buf.extend_from_slice(&self.staging[at..at + len]);
            at += len;
        }
        let sent = at_s - send[me].len();
        let received = at_r - as_usize(theirs[2 * me]);
        self.traffic.add(sent, received, w - 1);
        Ok(())
    }

    /// Ends the job when called on a thread MPI does not support: this rank alone failing
    /// would leave its peers waiting in the collective.
    fn check_thread(&self, what: &str) {
        if self.threading < Threading::Serialized && thread::current().id() != self.home {
            say(format_args!(
                "gradwire: rank {}: {what} called on another thread than the one that built \
                 the communicator, and MPI provides only {:?} thread support: aborting the job \
                 (MPI_Abort)",
                self.rank, self.threading
            ));
            self.universe.world().abort(2);
        }
    }

    /// The waiter of one call named `what` that started at `started`.
    fn waiter(&self, what: &'static str, started: Instant) -> Waiter {
        Waiter {
            world: self.universe.world(),
            rank: self.rank,
            world_size: self.world_size,
            deadline: self.deadline,
            round: self.round,
            what,
            started,
        }
    }
}

/// Waits for one call's requests, with the call's deadline.
struct Waiter {
    world: ::mpi::topology::SimpleCommunicator,
    rank: usize,
    world_size: usize,
    deadline: Duration,
    round: u64,
    what: &'static str,
    started: Instant,
}

impl Waiter {
    /// Waits for `req`, polling; past the deadline ends the job ([`Waiter::give_up`]).
    fn wait<'a, D: ?Sized, S: Scope<'a>>(&self, mut req: Request<'a, D, S>) -> Status {
        let mut polls = 0u32;
        loop {
            match req.test() {
                Ok(status) => return status,
                Err(pending) => req = pending,
            }
            if self.started.elapsed() >= self.deadline {
                // A pending request cannot be dropped or cancelled: the job ends here.
                std::mem::forget(req);
                self.give_up();
            }
            polls = polls.saturating_add(1);
            if polls < 2000 {
                thread::yield_now();
            } else {
                // A call this long may wait for a rank that closed its communicator.
                if polls.is_multiple_of(64) {
                    self.heed_broken();
                }
                thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// One pairwise step of the rank-order sum: `send` to rank `dst` and, at the same time,
    /// exactly `recv.len()` values from rank `src` into `recv`, both tagged `tag`.
    ///
    /// Ends the job when the message from `src` holds another number of values (MPI fills a
    /// larger buffer only in part): the peers agreed on the counts, so this is a corrupted or
    /// mismatched build, and summing the buffer's old contents would be a wrong answer that
    /// this rank alone sees.
    fn exchange(&self, send: &[f32], dst: usize, recv: &mut [f32], src: usize, tag: i32) {
        let expected = recv.len();
        let status = ::mpi::request::scope(|scope| {
            let sent = self
                .world
                .process_at_rank(dst as i32)
                .immediate_send_with_tag(scope, send, tag);
            let got = self
                .world
                .process_at_rank(src as i32)
                .immediate_receive_into_with_tag(scope, recv, tag);
            let status = self.wait(got);
            self.wait(sent);
            status
        });
        let got = status.count(f32::equivalent_datatype());
        if usize::try_from(got).ok() != Some(expected) {
            say(format_args!(
                "gradwire: rank {}: {} (call {}) received {got} values from rank {src} where \
                 the agreed counts give {expected}: aborting the job (MPI_Abort)",
                self.rank, self.what, self.round
            ));
            self.world.abort(4);
        }
    }

    /// When a peer closed its communicator (a notice tagged [`BROKEN_TAG`] with its first
    /// failure): prints it as this rank's, answers, and waits for the job to end (the closed
    /// rank ends it with `MPI_Abort` once every rank has printed, or after a grace).
    fn heed_broken(&self) {
        let Some((msg, status)) = self
            .world
            .any_process()
            .immediate_matched_probe_with_tag(BROKEN_TAG)
        else {
            return;
        };
        let mut text = vec![0u8; BROKEN_TEXT];
        let got = msg.matched_receive_into(&mut text[..]);
        let len = usize::try_from(got.count(u8::equivalent_datatype()))
            .unwrap_or(0)
            .min(BROKEN_TEXT);
        // A peer's text, printed escaped (no control characters reach the terminal).
        let first = String::from_utf8_lossy(&text[..len])
            .escape_debug()
            .to_string();
        say(format_args!(
            "gradwire: rank {}: the group is broken: {first}: {} (call {}) ends with the job \
             (MPI_Abort by rank {})",
            self.rank,
            self.what,
            self.round,
            status.source_rank()
        ));
        let req = self
            .world
            .process_at_rank(status.source_rank())
            .immediate_send_with_tag(StaticScope, &HERE[..], BROKEN_ACK_TAG);
        std::mem::forget(req);
        // The closed rank ends the job; should it not, this rank's own deadline does (a
        // deadline too large for the clock: the closed rank's grace alone).
        let until = self.started.checked_add(self.deadline);
        while until.is_none_or(|until| Instant::now() < until) {
            thread::sleep(Duration::from_millis(10));
        }
        self.give_up();
    }

    /// The deadline passed: the arrival round, a message naming the ranks this rank did not
    /// hear from, and `MPI_Abort`.
    fn give_up(&self) -> ! {
        let waited = self.started.elapsed();
        let world = &self.world;
        let (w, me) = (self.world_size, self.rank);
        for peer in (0..w).filter(|&p| p != me) {
            let req = world.process_at_rank(peer as i32).immediate_send_with_tag(
                StaticScope,
                &HERE[..],
                ARRIVAL_TAG,
            );
            std::mem::forget(req);
        }
        let mut heard = vec![false; w];
        heard[me] = true;
        let until = Instant::now() + ARRIVAL_GRACE;
        while Instant::now() < until && heard.iter().any(|h| !h) {
            match world
                .any_process()
                .immediate_matched_probe_with_tag(ARRIVAL_TAG)
            {
                Some((msg, status)) => {
                    let mut byte = [0u8; 1];
                    msg.matched_receive_into(&mut byte[..]);
                    if let Some(h) = usize::try_from(status.source_rank())
                        .ok()
                        .and_then(|r| heard.get_mut(r))
                    {
                        *h = true;
                    }
                }
                None => thread::sleep(Duration::from_millis(10)),
            }
        }
        let missing: Vec<usize> = (0..w).filter(|&r| !heard[r]).collect();
        say(format_args!(
            "gradwire: rank {me}: {} (call {}) waited {:?}, past the deadline of {:?}, for \
             ranks {missing:?}, which did not answer the arrival round: aborting the job \
             (MPI_Abort)",
            self.what, self.round, waited, self.deadline
        ));
        world.abort(3)
    }
}

/// [`CommError::Mismatch`] when a rank's header (`HEADER_WORDS` words each) is of another call
/// than `kind`: the same verdict on every rank, from the exchanged words.
fn check_kinds(header: &[u64], kind: u64, round: u64, what: &str) -> Result<(), CommError> {
    let name = |k: u64| match k {
        KIND_ALL_GATHER => "all_gather",
        KIND_SUM => "all_reduce_sum_f32",
        _ => "an unknown call",
    };
    match header
        .chunks_exact(HEADER_WORDS)
        .position(|peer| peer[0] != kind)
    {
        Some(r) => Err(CommError::Mismatch {
            round,
            detail: format!(
                "{what}: rank {r} called {} at the same point",
                name(header[r * HEADER_WORDS])
            ),
        }),
        None => Ok(()),
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
        self.check_thread("all_gather");
        self.round = self.round.wrapping_add(1);
        let waiter = self.waiter("all_gather", Instant::now());
        let world = self.universe.world();
        let w = self.world_size;

        // 1. Lengths, limits and round budgets of every rank, and the small buffers themselves.
        let header_len = w
            .checked_mul(HEADER_WORDS)
            .filter(|&n| Count::try_from(n).is_ok())
            .ok_or_else(|| CommError::Transport(format!("world size {w} is too large")))?;
        let mut mine = [0u64; HEADER_WORDS];
        mine[..4].copy_from_slice(&[
            KIND_ALL_GATHER,
            to_u64(local.len()),
            to_u64(max_len),
            to_u64(self.round_limit),
        ]);
        if local.len() <= INLINE_BYTES {
            for (word, bytes) in mine[4..].iter_mut().zip(local.chunks(8)) {
                let mut le = [0u8; 8];
                le[..bytes.len()].copy_from_slice(bytes);
                *word = u64::from_le_bytes(le);
            }
        }
        self.header.clear();
        self.header.resize(header_len, 0);
        {
            let header = &mut self.header;
            ::mpi::request::scope(|scope| {
                waiter.wait(world.immediate_all_gather_into(scope, &mine[..], &mut header[..]));
            });
        }

        // 2. The same decision on every rank, from the exchanged values only.
        check_kinds(&self.header, KIND_ALL_GATHER, self.round, "all_gather")?;
        let mut budget = to_u64(Self::MAX_ROUND_BYTES);
        for peer in self.header.chunks_exact(HEADER_WORDS) {
            budget = budget.min(peer[3]);
        }
        let as_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        check_lengths(
            self.header
                .chunks_exact(HEADER_WORDS)
                .map(|peer| (as_usize(peer[1]), as_usize(peer[2]))),
        )?;
        // Every length is now at most the smallest limit, which came from some rank's usize.
        self.lens.clear();
        self.lens.extend(
            self.header
                .chunks_exact(HEADER_WORDS)
                .map(|peer| usize::try_from(peer[1]).unwrap_or(usize::MAX)),
        );
        let received: usize = (0..w)
            .filter(|&r| r != self.rank)
            .map(|r| self.lens[r])
            .sum();
        if self.lens.iter().all(|&len| len <= INLINE_BYTES) {
            reset_out(out, w);
            for ((buf, &len), peer) in out
                .iter_mut()
                .zip(&self.lens)
                .zip(self.header.chunks_exact(HEADER_WORDS))
            {
                for word in &peer[4..] {
                    buf.extend_from_slice(&word.to_le_bytes());
                }
                buf.truncate(len);
            }
            self.traffic.add(local.len() * (w - 1), received, w - 1);
            return Ok(());
        }
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
                ::mpi::request::scope(|scope| {
                    waiter.wait(world.immediate_all_gather_varcount_into(
                        scope,
                        send,
                        &mut partition,
                    ));
                });
            }
            let mut at = 0usize;
            for (buf, &count) in out.iter_mut().zip(&self.counts) {
                buf.extend_from_slice(&self.staging[at..at + count]);
                at += count;
            }
        }
        self.traffic.add(local.len() * (w - 1), received, w - 1);
        Ok(())
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let send: Vec<&[u8]> = send.iter().map(Vec::as_slice).collect();
        self.exchange(&send, max_len, out, false)
    }

    /// Sends the borrowed buffers and appends what arrives (no copy into owned buffers first).
    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.exchange(send, max_len, out, true)
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    /// Ends the job (`MPI_Abort`): peers inside an MPI collective that this rank will not
    /// complete would wait until their deadline, and a later call of this rank would pair with
    /// a peer's earlier one. This rank prints `reason` (the first failure) and sends it to
    /// every peer; a peer waiting in a call prints it too and answers; the job ends once every
    /// peer answered, or after a grace of a few seconds (a peer busy outside any call).
    fn close(&mut self, reason: &str) -> Option<String> {
        let (w, me) = (self.world_size, self.rank);
        let first = format!("rank {me}: {reason}");
        say(format_args!(
            "gradwire: rank {me}: the group is broken: {first}: aborting the job (MPI_Abort)"
        ));
        let world = self.universe.world();
        let mut text = first.into_bytes();
        text.truncate(BROKEN_TEXT);
        // The sends are never waited for (the job ends below): their buffer lives to the end.
        let text: &'static [u8] = Box::leak(text.into_boxed_slice());
        for peer in (0..w).filter(|&p| p != me) {
            let req = world.process_at_rank(peer as i32).immediate_send_with_tag(
                StaticScope,
                text,
                BROKEN_TAG,
            );
            std::mem::forget(req);
        }
        let mut answered = 0;
        let until = Instant::now() + ARRIVAL_GRACE;
        while Instant::now() < until && answered + 1 < w {
            match world
                .any_process()
                .immediate_matched_probe_with_tag(BROKEN_ACK_TAG)
            {
                Some((msg, _)) => {
                    let mut byte = [0u8; 1];
                    msg.matched_receive_into(&mut byte[..]);
                    answered += 1;
                }
                None => thread::sleep(Duration::from_millis(10)),
            }
        }
        world.abort(5);
    }

    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        self.check_thread("all_reduce_sum_f32");
        self.round = self.round.wrapping_add(1);
        let waiter = self.waiter("all_reduce_sum_f32", Instant::now());
        let world = self.universe.world();
        let (w, me, n) = (self.world_size, self.rank, x.len());

        // 1. Every rank's element count: the message sizes below follow from it, so ranks must
        // agree before any of them is posted.
        let mut mine = [0u64; HEADER_WORDS];
        mine[..2].copy_from_slice(&[KIND_SUM, to_u64(n)]);
        let mut header = vec![0u64; w * HEADER_WORDS];
        ::mpi::request::scope(|scope| {
            waiter.wait(world.immediate_all_gather_into(scope, &mine[..], &mut header[..]));
        });
        check_kinds(&header, KIND_SUM, self.round, "all_reduce_sum_f32")?;
        let counts: Vec<u64> = header.chunks_exact(HEADER_WORDS).map(|p| p[1]).collect();
        if let Some(r) = counts.iter().position(|&c| c != counts[0]) {
            return Err(CommError::Mismatch {
                round: self.round,
                detail: format!(
                    "all_reduce_sum_f32: rank {r} passed {} elements, rank 0 {}",
                    counts[r], counts[0]
                ),
            });
        }
        // The same counts on every rank, so the same verdict.
        to_count(n / w + 1)?;

        // 2. Reduce-scatter, pairwise: shard `dst` of `x` to rank `dst`, shard `me` of rank
        // `src` into slot `src`.
        let own = shard(n, w, me);
        let len = own.len();
        self.shards.clear();
        self.shards.resize(w * len, 0.0);
        for s in 1..w {
            let (dst, src) = ((me + s) % w, (me + w - s) % w);
            let recv = &mut self.shards[src * len..(src + 1) * len];
            waiter.exchange(&x[shard(n, w, dst)], dst, recv, src, SCATTER_TAG);
        }
        self.shards[me * len..(me + 1) * len].copy_from_slice(&x[own.clone()]);
        let (sum, rest) = self.shards.split_at_mut(len);
        for r in 1..w {
            add_in_rank_order(sum, r, rest[(r - 1) * len..r * len].iter().copied());
        }

        // 3. All-gather, pairwise: this rank's sum to rank `dst`, rank `src`'s into `x`.
        let sum = &self.shards[..len];
        x[own].copy_from_slice(sum);
        for s in 1..w {
            let (dst, src) = ((me + s) % w, (me + w - s) % w);
            waiter.exchange(sum, dst, &mut x[shard(n, w, src)], src, GATHER_TAG);
        }
        let t = logical_traffic(n, w, me);
        self.traffic.sent = self.traffic.sent.saturating_add(t.sent);
        self.traffic.received = self.traffic.received.saturating_add(t.received);
        Ok(())
    }
}

/// Prints `line` and a newline to stderr in one write: the ranks of a job share `mpirun`'s
/// output, and a line written in pieces (as `eprintln!` writes its arguments) can be cut by
/// another rank's.
fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut text = line.to_string();
    text.push('\n');
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

//! [`LocalGroup`]: ranks as threads of one process, synchronised with a mutex and a condition
//! variable.
//!
//! Protocol of one round (one collective call): each rank posts which collective it calls, its
//! limit, and its buffers (one for an all-gather, one per destination for an all-to-all) into
//! its slot of the shared state, then waits until all ranks have posted. Every rank then checks
//! every posted length against the group's smallest limit (the same verdict everywhere) and
//! copies what is addressed to it into its `out`. The last rank to finish reading opens the
//! next round, so a fast rank that calls again waits until every peer has read the previous
//! round: no slot is overwritten while someone still reads it.
//!
//! A communicator that is dropped (its thread returned early or panicked) marks the group
//! broken: every peer that waits gets [`CommError::Transport`] instead of waiting forever. The
//! deadline ([`LocalGroup::with_timeout`], [`super::DEFAULT_DEADLINE`] by default) covers peers
//! that are alive but never call: the waiting ranks fail with [`CommError::Deadline`] naming
//! them. [`Communicator::close`] breaks the group on purpose (after a rank's own transport
//! failure): the waiting ranks fail with [`CommError::Broken`]. Every call that starts in a
//! broken group fails with [`CommError::Broken`] naming the group's first failure.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::reduce::{add_in_rank_order, logical_traffic, shard};
use super::{CommError, Communicator, DEFAULT_DEADLINE, Traffic, check_lengths, reset_out};

/// A group of `world_size` ranks living as threads of one process.
///
/// Build it with [`LocalGroup::new`], optionally set a timeout, then split it with
/// [`LocalGroup::into_communicators`] and move each [`LocalCommunicator`] into its own thread.
///
/// ```
/// use std::time::Duration;
/// use gradwire::comm::{Communicator, LocalGroup};
///
/// let comms = LocalGroup::new(2)
///     .with_timeout(Some(Duration::from_secs(600)))
///     .into_communicators();
/// assert_eq!(comms.len(), 2);
/// assert_eq!(comms[1].rank(), 1);
/// assert_eq!(comms[1].world_size(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct LocalGroup {
    world_size: usize,
    timeout: Option<Duration>,
}

impl LocalGroup {
    /// A group of `world_size` ranks with the default deadline (300 s).
    /// A group of 0 ranks is valid and yields no communicators.
    #[must_use]
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: Some(DEFAULT_DEADLINE),
        }
    }

    /// Sets how long a rank waits for its peers in one call before failing with
    /// [`CommError::Deadline`] (and marking the group broken); `None` waits for as long as the
    /// peers live (a dropped or panicked peer is detected without a deadline, so it only
    /// matters for a peer that is alive but never calls).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// One communicator per rank, in rank order. Each is `Send`: move it into the thread that
    /// plays that rank. Dropping one breaks the group for the others.
    #[must_use]
    pub fn into_communicators(self) -> Vec<LocalCommunicator> {
        let w = self.world_size;
        let shared = Arc::new(Shared {
            world_size: w,
            timeout: self.timeout,
            state: Mutex::new(State {
                round: 0,
                arrived: 0,
                departed: 0,
                posted: vec![false; w],
                read: vec![false; w],
                slots: (0..w).map(|_| Slot::default()).collect(),
                broken: None,
                broken_by: None,
            }),
            changed: Condvar::new(),
        });
        (0..w)
            .map(|rank| LocalCommunicator {
                rank,
                shared: Arc::clone(&shared),
                traffic: Traffic::default(),
                staging: Vec::new(),
                incoming: Vec::new(),
                sum: Vec::new(),
                closed: None,
            })
            .collect()
    }
}

/// One rank of a [`LocalGroup`]; implements [`Communicator`].
pub struct LocalCommunicator {
    rank: usize,
    shared: Arc<Shared>,
    traffic: Traffic,
    /// This rank's copies of its next post, made outside the lock; after the post, its
    /// previous one (no peer holds it any more: that round closed), reused.
    staging: Vec<Arc<Vec<u8>>>,
    /// The posts this rank reads in the current round, held while it copies them unlocked.
    incoming: Vec<Arc<Vec<u8>>>,
    /// This rank's shard sum of [`Communicator::all_reduce_sum_f32`], kept between calls.
    sum: Vec<f32>,
    /// The first reason this communicator was closed with ([`Communicator::close`]).
    closed: Option<String>,
}

impl fmt::Debug for LocalCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("timeout", &self.shared.timeout)
            .finish_non_exhaustive()
    }
}

/// Which collective a rank posted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Op {
    #[default]
    AllGather,
    AllToAll,
    /// Phase 1 of [`Communicator::all_reduce_sum_f32`]: every rank's whole f32 buffer.
    SumInputs,
    /// Phase 2: each rank's sum of its shard.
    SumShards,
}

/// What one rank posted in a round: its collective, its limit and its buffers (one for an
/// all-gather; one per destination for an all-to-all), each copied only when within its own
/// limit; lengths are kept either way. The buffers are shared, so that readers copy them
/// outside the lock, all at once.
#[derive(Default)]
struct Slot {
    op: Op,
    limit: usize,
    lens: Vec<usize>,
    bufs: Vec<Arc<Vec<u8>>>,
}

struct Shared {
    world_size: usize,
    timeout: Option<Duration>,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Number of the round being collected or read.
    round: u64,
    /// Ranks that posted in the current round; `== world_size` while it is being read.
    arrived: usize,
    /// Ranks that finished reading the current round.
    departed: usize,
    /// Which ranks posted / finished reading in the current round (for the deadline's error).
    posted: Vec<bool>,
    read: Vec<bool>,
    slots: Vec<Slot>,
    /// Why the group can no longer make progress.
    broken: Option<CommError>,
    /// The rank that found it (a deadline's waiter, a dropped rank), when known.
    broken_by: Option<usize>,
}

/// The group's first failure as [`CommError::Broken`] names it: the failure, prefixed with
/// the rank that found it when known.
fn first_failure(why: &CommError, by: Option<usize>) -> String {
    match (why, by) {
        (CommError::Broken { first }, _) => first.clone(),
        (other, Some(rank)) => format!("rank {rank}: {other}"),
        (other, None) => other.to_string(),
    }
}

/// A copy of an error kept in the shared state (each waiting rank returns its own).
fn copy(e: &CommError) -> CommError {
    match e {
        CommError::Deadline {
            waited,
            missing,
            round,
        } => CommError::Deadline {
            waited: *waited,
            missing: missing.clone(),
            round: *round,
        },
        CommError::Broken { first } => CommError::Broken {
            first: first.clone(),
        },
        // Its text as it is, not its display ("transport failure: " would come twice).
        CommError::Transport(why) => CommError::Transport(why.clone()),
        other => CommError::Transport(other.to_string()),
    }
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>, CommError> {
        self.state
            .lock()
            .map_err(|_| CommError::Transport("a peer panicked inside a collective".into()))
    }

    /// Waits while `blocked` holds, failing when the group breaks or the deadline passes (the
    /// error names the ranks `missing` gives, those not yet where this rank waits for them).
    fn wait_while<'a>(
        &self,
        me: usize,
        mut guard: MutexGuard<'a, State>,
        started: Instant,
        blocked: impl Fn(&State) -> bool,
        missing: impl Fn(&State) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        let deadline = self.timeout.and_then(|t| started.checked_add(t));
        loop {
            if !blocked(&guard) {
                return Ok(guard);
            }
            if let Some(why) = &guard.broken {
                return Err(copy(why));
            }
            guard = match deadline {
                None => self.changed.wait(guard).map_err(|_| ()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let err = CommError::Deadline {
                            waited: now - started,
                            missing: missing(&guard),
                            round: guard.round,
                        };
                        if guard.broken.is_none() {
                            guard.broken = Some(copy(&err));
                            guard.broken_by = Some(me);
                        }
                        self.changed.notify_all();
                        return Err(err);
                    }
                    self.changed
                        .wait_timeout(guard, deadline - now)
                        .map(|(guard, _)| guard)
                        .map_err(|_| ())
                }
            }
            .map_err(|()| CommError::Transport("a peer panicked inside a collective".into()))?;
        }
    }
}

fn unset(flags: &[bool]) -> Vec<usize> {
    flags
        .iter()
        .enumerate()
        .filter(|(_, f)| !**f)
        .map(|(r, _)| r)
        .collect()
}

impl LocalCommunicator {
    /// One round: copies `bufs` (each within `limit`) and posts them with `op` and `limit`,
    /// waits for every rank, checks every length, and copies into `out[src]` what each rank
    /// posted for this one. Returns the bytes received (payload). The copies are made outside
    /// the group's lock, so the ranks make them at the same time.
    fn round(
        &mut self,
        op: Op,
        limit: usize,
        bufs: &[&[u8]],
        out: &mut Vec<Vec<u8>>,
    ) -> Result<usize, CommError> {
        let w = self.shared.world_size;
        let me = self.rank;
        self.round_with(op, limit, bufs, |posts| {
            reset_out(out, w);
            let mut received = 0;
            for (src, (dst, post)) in out.iter_mut().zip(posts).enumerate() {
                dst.extend_from_slice(own_or_post(op, bufs, post, src, me));
                if src != me {
                    received += post.len();
                }
            }
            Ok(received)
        })
    }

    /// One round as [`LocalCommunicator::round`], reading the posts with `read` (each rank's
    /// buffer for this one, in rank order) outside the lock, when the round's verdict allows.
    fn round_with<R>(
        &mut self,
        op: Op,
        limit: usize,
        bufs: &[&[u8]],
        read: impl FnOnce(&[Arc<Vec<u8>>]) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        if let Some(first) = &self.closed {
            return Err(CommError::Broken {
                first: first.clone(),
            });
        }
        let shared = Arc::clone(&self.shared);
        let w = shared.world_size;
        let me = self.rank;
        let started = Instant::now();
        self.staging.resize_with(bufs.len(), Default::default);
        for (j, (dst, src)) in self.staging.iter_mut().zip(bufs).enumerate() {
            if Arc::get_mut(dst).is_none() {
                *dst = Arc::default();
            }
            if let Some(dst) = Arc::get_mut(dst) {
                dst.clear();
                // An all-to-all's buffer for this rank is read by this rank alone: from where
                // it lies ([`own_or_post`]), not staged.
                let own = op == Op::AllToAll && j == me;
                if src.len() <= limit && !own {
                    dst.extend_from_slice(src);
                }
            }
        }
        let guard = shared.lock()?;
        // A call that starts in a broken group is refused as a closed communicator's is.
        if let Some(why) = &guard.broken {
            return Err(CommError::Broken {
                first: first_failure(why, guard.broken_by),
            });
        }
        // The previous round is still being read by slower peers: wait until it is closed.
        let mut state =
            shared.wait_while(me, guard, started, |s| s.arrived == w, |s| unset(&s.read))?;

        let slot = &mut state.slots[me];
        slot.op = op;
        slot.limit = limit;
        slot.lens.clear();
        slot.lens.extend(bufs.iter().map(|b| b.len()));
        // This rank's previous post comes back to `staging`, for the next call's copies.
        std::mem::swap(&mut slot.bufs, &mut self.staging);
        state.posted[me] = true;
        state.arrived += 1;
        if state.arrived == w {
            state.read.iter_mut().for_each(|r| *r = false);
            shared.changed.notify_all();
        }

        // The round cannot close before this rank has read it, so `arrived` stays at `w` until
        // then.
        let state =
            shared.wait_while(me, state, started, |s| s.arrived < w, |s| unset(&s.posted))?;
        let verdict = check_round(&state.slots, op, state.round);
        self.incoming.clear();
        if verdict.is_ok() {
            self.incoming.extend(state.slots.iter().map(|slot| {
                Arc::clone(match op {
                    Op::AllToAll => &slot.bufs[me],
                    Op::AllGather | Op::SumInputs | Op::SumShards => &slot.bufs[0],
                })
            }));
        }
        drop(state);
        let result = verdict.and_then(|()| read(&self.incoming));
        // Released before the round closes, so that each post's owner gets it back alone.
        self.incoming.clear();

        let mut state = shared.lock()?;
        state.read[me] = true;
        state.departed += 1;
        if state.departed == w {
            state.arrived = 0;
            state.departed = 0;
            state.posted.iter_mut().for_each(|p| *p = false);
            state.round = state.round.wrapping_add(1);
            shared.changed.notify_all();
        }
        result
    }
}

/// The verdict of one round, the same on every rank: every rank called the same collective
/// (with one buffer per destination for an all-to-all), and every length is within the group's
/// smallest limit (receivers in rank order, then senders).
fn check_round(slots: &[Slot], op: Op, round: u64) -> Result<(), CommError> {
    let w = slots.len();
    if let Some((r, s)) = slots
        .iter()
        .enumerate()
        .find(|(_, s)| s.op != op || s.lens.len() != if op == Op::AllToAll { w } else { 1 })
    {
        return Err(CommError::Mismatch {
            round,
            detail: format!(
                "rank {r} called {:?} with {} buffers, another rank {op:?}",
                s.op,
                s.lens.len()
            ),
        });
    }
    match op {
        Op::AllGather => check_lengths(slots.iter().map(|s| (s.lens[0], s.limit))),
        Op::AllToAll => {
            (0..w).try_for_each(|dst| check_lengths(slots.iter().map(|s| (s.lens[dst], s.limit))))
        }
        // Every rank passes its element count: the readers compare them.
        Op::SumInputs | Op::SumShards => Ok(()),
    }
}

/// Adds rank `r`'s post of f32 values to `sum` ([`add_in_rank_order`]): read as f32 where the
/// allocation is aligned for f32, as allocators align it (a loop the compiler vectorises);
/// decoded otherwise.
fn add_post(sum: &mut [f32], r: usize, post: &[u8]) {
    match bytemuck::try_cast_slice::<u8, f32>(post) {
        Ok(values) => add_in_rank_order(sum, r, values.iter().copied()),
        Err(_) => add_in_rank_order(sum, r, ne_values(post)),
    }
}

/// Writes a post of f32 values into `dst` (of its length): one copy where the allocation is
/// aligned for f32; decoded otherwise.
fn copy_post(dst: &mut [f32], post: &[u8]) {
    match bytemuck::try_cast_slice::<u8, f32>(post) {
        Ok(values) => dst.copy_from_slice(values),
        Err(_) => dst
            .iter_mut()
            .zip(ne_values(post))
            .for_each(|(d, v)| *d = v),
    }
}

/// The f32 values of a post's bytes (in this machine's byte order: posts never leave it).
fn ne_values(post: &[u8]) -> impl Iterator<Item = f32> + '_ {
    post.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let received = self.round(Op::AllGather, max_len, &[local], out)?;
        let peers = self.shared.world_size.saturating_sub(1);
        self.traffic.add(local.len() * peers, received, peers);
        Ok(())
    }

    /// Appends each rank's post straight to `out[r]`, as [`LocalCommunicator::all_gather`]
    /// copies it: no buffer of its own.
    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let (w, me) = (self.shared.world_size, self.rank);
        let received = self.round_with(Op::AllGather, max_len, &[local], |posts| {
            Ok(append_posts(Op::AllGather, &[local], out, posts, me))
        })?;
        let peers = w.saturating_sub(1);
        self.traffic.add(local.len() * peers, received, peers);
        Ok(())
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let bufs: Vec<&[u8]> = send.iter().map(Vec::as_slice).collect();
        let received = self.round(Op::AllToAll, max_len, &bufs, out)?;
        let peers = self.shared.world_size.saturating_sub(1);
        let sent: usize = bufs
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != self.rank)
            .map(|(_, b)| b.len())
            .sum();
        self.traffic.add(sent, received, peers);
        Ok(())
    }

    /// Stages the borrowed buffers in this rank's posts (the one copy every call makes) and
    /// appends each rank's post for this rank straight to `out[r]`, as
    /// [`LocalCommunicator::all_to_all`] copies it: no other buffers.
    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let (w, me) = (self.shared.world_size, self.rank);
        let received = self.round_with(Op::AllToAll, max_len, send, |posts| {
            Ok(append_posts(Op::AllToAll, send, out, posts, me))
        })?;
        let peers = w.saturating_sub(1);
        let sent: usize = send
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != me)
            .map(|(_, b)| b.len())
            .sum();
        self.traffic.add(sent, received, peers);
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    /// Marks the group broken with `reason` (unless it already is), waking every rank that
    /// waits in a call: they and every later call of any rank fail with
    /// [`CommError::Broken`] naming the group's first failure (this rank and `reason`, when
    /// the group was whole until then).
    fn close(&mut self, reason: &str) -> Option<String> {
        if let Some(first) = &self.closed {
            return Some(first.clone());
        }
        let mut state = match self.shared.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        let first = match &state.broken {
            Some(why) => first_failure(why, state.broken_by),
            None => {
                let first = format!("rank {}: {reason}", self.rank);
                state.broken = Some(CommError::Broken {
                    first: first.clone(),
                });
                first
            }
        };
        self.shared.changed.notify_all();
        drop(state);
        self.closed = Some(first.clone());
        Some(first)
    }

    /// The rank-order sum of [`Communicator::all_reduce_sum_f32`], with the same bits and, for
    /// a call that succeeds, the same traffic counts as the default path (a failed call counts
    /// nothing: it moved no message), moving f32 between the threads without
    /// messages: each rank posts `x`, sums its shard of every rank's post in place, posts that
    /// sum, and copies every rank's sum into `x`.
    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        let (w, me, n) = (self.shared.world_size, self.rank, x.len());
        let mut sum = std::mem::take(&mut self.sum);
        let any = usize::MAX;
        let phase1 = self.round_with(Op::SumInputs, any, &[bytemuck::cast_slice(x)], |posts| {
            if let Some(r) = posts.iter().position(|p| p.len() != 4 * n) {
                return Err(CommError::Mismatch {
                    round: 0,
                    detail: format!(
                        "all_reduce_sum_f32: rank {r} passed {} elements, rank {me} {n}",
                        posts[r].len() / 4
                    ),
                });
            }
            let mine = shard(n, w, me);
            sum.clear();
            sum.resize(mine.len(), 0.0);
            for (r, post) in posts.iter().enumerate() {
                let part = post.get(4 * mine.start..4 * mine.end).unwrap_or(&[]);
                add_post(&mut sum, r, part);
            }
            Ok(())
        });
        // A failed first round fails alike on every rank (every rank reads every post, and the
        // round's verdict is common), so every rank returns here and the group stays in step.
        if let Err(e) = phase1 {
            self.sum = sum;
            return Err(e);
        }
        let sum_bytes: &[u8] = bytemuck::cast_slice(&sum);
        let phase2 = self.round_with(Op::SumShards, any, &[sum_bytes], |posts| {
            if let Some(j) = (0..w).find(|&j| posts[j].len() != 4 * shard(n, w, j).len()) {
                return Err(CommError::Mismatch {
                    round: 0,
                    detail: format!(
                        "all_reduce_sum_f32: rank {j} got another element count, or sent a sum \
                         of another length"
                    ),
                });
            }
            for (j, post) in posts.iter().enumerate() {
                let dst = &mut x[shard(n, w, j)];
                copy_post(dst, post);
            }
            Ok(())
        });
        self.sum = sum;
        phase2?;
        let t = logical_traffic(n, w, me);
        self.traffic.sent = self.traffic.sent.saturating_add(t.sent);
        self.traffic.received = self.traffic.received.saturating_add(t.received);
        Ok(())
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut state = match self.shared.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        if state.broken.is_none() {
            state.broken = Some(CommError::Transport(format!(
                "rank {} of {} left the group (its communicator was dropped) in round {}",
                self.rank, self.shared.world_size, state.round
            )));
        }
        self.shared.changed.notify_all();
    }
}

/// Appends each rank's post for this rank (`me`; its own buffer of an all-to-all from `bufs`,
/// [`own_or_post`]) to `out[r]`, `out` resized to the group's size first; returns the bytes
/// that came from peers.
fn append_posts(
    op: Op,
    bufs: &[&[u8]],
    out: &mut Vec<Vec<u8>>,
    posts: &[Arc<Vec<u8>>],
    me: usize,
) -> usize {
    out.resize_with(posts.len(), Vec::new);
    let mut received = 0;
    for (src, (dst, post)) in out.iter_mut().zip(posts).enumerate() {
        dst.extend_from_slice(own_or_post(op, bufs, post, src, me));
        if src != me {
            received += post.len();
        }
    }
    received
}

/// What rank `src` sent this rank (`me`) in a round whose verdict allowed reading: its post, or
/// for this rank's own buffer of an all-to-all (not staged: no other rank reads it) the buffer
/// where the caller holds it.
fn own_or_post<'a>(
    op: Op,
    bufs: &'a [&'a [u8]],
    post: &'a [u8],
    src: usize,
    me: usize,
) -> &'a [u8] {
    match bufs.get(me) {
        Some(own) if op == Op::AllToAll && src == me => own,
        _ => post,
    }
}

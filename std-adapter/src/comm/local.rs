//! [`LocalGroup`]: ranks as threads of one process, synchronised with a mutex and a condition
//! variable.
//!
//! Protocol of one round: each rank posts its length and limit and (when the length is within
//! its own limit) a copy of its buffer into its slot of the shared state, then waits until all
//! ranks have posted. Every rank then checks the lengths against the group's smallest limit and
//! copies all slots into its `out`. The last rank to finish reading opens the next round, so a
//! fast rank that calls again waits until every peer has read the previous round: no slot is
//! overwritten while someone still reads it.
//!
//! A communicator that is dropped (its thread returned early or panicked) marks the group
//! broken: every peer that waits, or calls again, gets [`CommError::Transport`] instead of
//! waiting forever. An optional timeout ([`LocalGroup::with_timeout`]) also covers peers that
//! are alive but never call.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{CommError, Communicator, check_lengths, reset_out};

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
    /// A group of `world_size` ranks, with no timeout. A group of 0 ranks is valid and yields no
    /// communicators.
    #[must_use]
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: None,
        }
    }

    /// Sets how long a rank waits for its peers in one call before failing with
    /// [`CommError::Transport`] (and marking the group broken). `None`, the default, waits for
    /// as long as the peers live: a dropped or panicked peer is detected without a timeout, so
    /// the timeout only matters for a peer that is alive but never calls.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Number of ranks in the group.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// One communicator per rank, in rank order. Each is `Send`: move it into the thread that
    /// plays that rank. Dropping one breaks the group for the others.
    #[must_use]
    pub fn into_communicators(self) -> Vec<LocalCommunicator> {
        let shared = Arc::new(Shared {
            world_size: self.world_size,
            timeout: self.timeout,
            state: Mutex::new(State {
                round: 0,
                arrived: 0,
                departed: 0,
                lens: vec![0; self.world_size],
                limits: vec![0; self.world_size],
                slots: vec![Vec::new(); self.world_size],
                broken: None,
            }),
            changed: Condvar::new(),
        });
        (0..self.world_size)
            .map(|rank| LocalCommunicator {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

/// One rank of a [`LocalGroup`]; implements [`Communicator`].
pub struct LocalCommunicator {
    rank: usize,
    shared: Arc<Shared>,
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

struct Shared {
    world_size: usize,
    timeout: Option<Duration>,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Number of the round being collected or read (for diagnostics).
    round: u64,
    /// Ranks that posted in the current round; `== world_size` while it is being read.
    arrived: usize,
    /// Ranks that finished reading the current round.
    departed: usize,
    /// Posted lengths, one per rank.
    lens: Vec<usize>,
    /// Posted limits (`max_len`), one per rank.
    limits: Vec<usize>,
    /// Posted buffers, one per rank; capacity is kept between rounds.
    slots: Vec<Vec<u8>>,
    /// Why the group can no longer make progress.
    broken: Option<String>,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>, CommError> {
        self.state
            .lock()
            .map_err(|_| CommError::Transport("a peer panicked inside all_gather".into()))
    }

    /// Waits while `blocked` holds, failing when the group breaks or the deadline passes.
    fn wait_while<'a>(
        &self,
        mut guard: MutexGuard<'a, State>,
        deadline: Option<Instant>,
        what: &str,
        blocked: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        loop {
            if !blocked(&guard) {
                return Ok(guard);
            }
            if let Some(why) = &guard.broken {
                return Err(CommError::Transport(why.clone()));
            }
            guard = match deadline {
                None => self.changed.wait(guard).map_err(|_| ()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let why = format!(
                            "timed out after {:?} waiting for peers to {what} (round {})",
                            self.timeout.unwrap_or_default(),
                            guard.round
                        );
                        guard.broken = Some(why.clone());
                        self.changed.notify_all();
                        return Err(CommError::Transport(why));
                    }
                    self.changed
                        .wait_timeout(guard, deadline - now)
                        .map(|(guard, _)| guard)
                        .map_err(|_| ())
                }
            }
            .map_err(|()| CommError::Transport("a peer panicked inside all_gather".into()))?;
        }
    }
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
        let shared = &*self.shared;
        let world_size = shared.world_size;
        let deadline = shared.timeout.and_then(|t| Instant::now().checked_add(t));
        let guard = shared.lock()?;
        if let Some(why) = &guard.broken {
            return Err(CommError::Transport(why.clone()));
        }
        // The previous round is still being read by slower peers: wait until it is closed.
        let mut state = shared.wait_while(guard, deadline, "finish the previous round", |s| {
            s.arrived == world_size
        })?;

        // Post. The copy is bounded by this rank's own limit; readers check every length.
        let me = self.rank;
        state.lens[me] = local.len();
        state.limits[me] = max_len;
        if local.len() <= max_len {
            let slot = &mut state.slots[me];
            slot.clear();
            slot.extend_from_slice(local);
        }
        state.arrived += 1;
        if state.arrived == world_size {
            shared.changed.notify_all();
        }

        // The round cannot close before this rank has read it, so `arrived` stays at
        // `world_size` until then.
        let mut state =
            shared.wait_while(state, deadline, "contribute", |s| s.arrived < world_size)?;

        let result = check_lengths(state.lens.iter().copied().zip(state.limits.iter().copied()));
        if result.is_ok() {
            reset_out(out, world_size);
            for (dst, src) in out.iter_mut().zip(&state.slots) {
                dst.extend_from_slice(src);
            }
        }

        state.departed += 1;
        if state.departed == world_size {
            state.arrived = 0;
            state.departed = 0;
            state.round = state.round.wrapping_add(1);
            shared.changed.notify_all();
        }
        result
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut state = match self.shared.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        if state.broken.is_none() {
            state.broken = Some(format!(
                "rank {} of {} left the group (its communicator was dropped) in round {}",
                self.rank, self.shared.world_size, state.round
            ));
        }
        self.shared.changed.notify_all();
    }
}

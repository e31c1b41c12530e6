//! Collective calls whose buffers cross the communicator in windows of a bounded size.
//!
//! A compressed step's messages grow with the model (a dense bf16 bundle of GPT-2-small is
//! 249 MB). Passed whole, one call holds every rank's message at once and runs as long as the
//! link needs for all of it, so its deadline must cover the slowest link and the largest model.
//! [`Windows`] moves them instead in calls of at most `chunk` bytes per buffer: every call has
//! its own deadline, which then bounds how long a silent peer goes unnoticed whatever the
//! model's size, and a transport never sees a buffer beyond the bound.
//!
//! The protocol, run alike by every rank, with no byte added to a message that fits:
//!
//! - **All-gather.** Round 0 gathers each rank's first window (its first `min(len, chunk)`
//!   bytes) under the limit `min(max_len, chunk)`. When no window is full (`chunk` bytes), every
//!   message was whole: done, exactly the single call of before. When the caller's `stop`
//!   holds for the first windows (they show a verdict already: a failed rank, another
//!   configuration), it ends there too, every rank alike, since every rank holds the same
//!   windows. Otherwise every rank saw a full window, so every rank goes on: a header round
//!   gathers each rank's total length and limit (16 bytes), every rank applies
//!   [`check_lengths`] to the totals (the group's smallest limit, the same verdict everywhere,
//!   before any buffer grows), then rounds of windows follow until every message is whole.
//! - **All-to-all.** No rank sees what the others receive, so the decision cannot come from
//!   round 0. Callers pass a `max_len` that is the same on every rank (derived from the
//!   configuration every rank agreed on): at most `chunk`, the single call of before; above it,
//!   a header round first (each rank's limit and the length of each of its buffers: `8 (W + 1)`
//!   bytes, within a window up to W = 511), the limits checked on the totals receiver by
//!   receiver, then rounds of windows.
//!
//! Every rank must pass the same `chunk` (the callers make it part of the configuration they
//! compare), at least [`MIN_WINDOW`] bytes (a smaller one is raised to it), so that a failure's
//! envelope and the headers always fit one window. A window's length is fixed by the totals,
//! so every receiver knows what each round must bring; a peer that sends another length is
//! named ([`CommError::Transport`]). The windows are slices of the messages sent, appended in
//! place to the messages received ([`Communicator::all_gather_append`],
//! [`Communicator::all_to_all_append`]): no window is copied into a buffer of this module's.

use super::{CommError, Communicator, check_lengths};

/// A message that [`Windows::all_gather_streamed`] sends: its length, known before its first
/// window leaves, and its bytes, asked for window by window in order, so that a message may
/// be written as it is sent.
pub(crate) trait Outgoing {
    /// Bytes of the whole message.
    fn len(&self) -> usize;

    /// The message's bytes `from..to` (`to` at most [`Outgoing::len`]); each call asks for the
    /// bytes after the last call's.
    fn bytes(&mut self, from: usize, to: usize) -> &[u8];
}

/// Both ends of [`Windows::all_gather_streamed`] on one rank: this rank's message, and what
/// arrives, handed over as it comes.
pub(crate) trait Stream: Outgoing {
    /// Takes the messages as they arrived (it may remove bytes from their fronts: the bytes
    /// it has used), `last` once every message arrived whole.
    fn consume(&mut self, bufs: &mut [Vec<u8>], last: bool);
}

/// A message held whole (with nothing to consume, for [`Windows::all_gather`]).
pub(crate) struct Whole<'a>(pub(crate) &'a [u8]);

impl Outgoing for Whole<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn bytes(&mut self, from: usize, to: usize) -> &[u8] {
        self.0.get(from..to).unwrap_or(&[])
    }
}

impl Stream for Whole<'_> {
    fn consume(&mut self, _: &mut [Vec<u8>], _: bool) {}
}

/// Bytes of one rank's all-gather header: total length, limit (`u64` LE each).
const GATHER_HEADER: usize = 16;

/// The smallest window: a failure's envelope (20 bytes and a reason of at most 1 KiB) and the
/// all-to-all's header of a group of up to 511 ranks fit one.
pub(crate) const MIN_WINDOW: usize = 4096;

/// `msg` grown to hold `more` bytes, or the transport error naming `sender`.
fn reserve(msg: &mut Vec<u8>, more: usize, sender: usize) -> Result<(), CommError> {
    msg.try_reserve_exact(more).map_err(|_| {
        CommError::Transport(format!(
            "cannot allocate {more} bytes for the message of rank {sender}"
        ))
    })
}

/// Ranks up to which [`Windows::all_to_all`] keeps its list of window slices on the stack.
const STACK_WINDOWS: usize = 16;

/// Buffers of windowed calls, kept between calls so that a steady-state step allocates nothing
/// (but, above [`STACK_WINDOWS`] ranks, a list of `W` slices per all-to-all).
#[derive(Debug, Default)]
pub(crate) struct Windows {
    /// This rank's header.
    header: Vec<u8>,
    /// Every rank's header.
    headers: Vec<Vec<u8>>,
    /// Total lengths: per sender (all-gather) or sender-major matrix (all-to-all).
    totals: Vec<usize>,
    /// Each message's length before a window round appended to it.
    lens: Vec<usize>,
    /// Bytes of each message arrived so far (a stream's consumer may have removed some).
    arrived: Vec<usize>,
}

fn read_u64(bytes: &[u8], at: usize) -> usize {
    let mut word = [0u8; 8];
    if let Some(b) = bytes.get(at..at + 8) {
        word.copy_from_slice(b);
    }
    usize::try_from(u64::from_le_bytes(word)).unwrap_or(usize::MAX)
}

fn window_error(sender: usize, got: usize, due: usize) -> CommError {
    CommError::Transport(format!(
        "rank {sender} sent a window of {got} bytes where {due} were due (its peers disagree on \
         the message's length or the window size)"
    ))
}

impl Windows {
    /// [`Communicator::all_gather`] of `local`, each call passing at most `chunk` bytes (at
    /// least [`MIN_WINDOW`]). Results and limits as the single call, except that a message over
    /// the limit may be reported by its first window's length, and that after an error `out` is
    /// unspecified. When `stop` holds for the first windows (every rank's first `chunk` bytes at
    /// most), nothing more is gathered and `Ok(false)` returned with `out` holding them; `stop`
    /// must depend on those bytes alone, so that every rank decides alike. `Ok(true)`: every
    /// message is whole.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`]; [`CommError::Transport`] naming a rank whose header or
    /// window does not match the protocol, or whose message cannot be allocated.
    pub(crate) fn all_gather(
        &mut self,
        comm: &mut dyn Communicator,
        local: &[u8],
        max_len: usize,
        chunk: usize,
        out: &mut Vec<Vec<u8>>,
        stop: impl Fn(&[Vec<u8>]) -> bool,
    ) -> Result<bool, CommError> {
        self.gather(comm, &mut Whole(local), false, max_len, chunk, out, &stop)
    }

    /// As [`Windows::all_gather`] of `io`'s message, asked for window by window (this rank's
    /// message need not be held whole either), handing the messages to `io` as they arrive
    /// ([`Stream::consume`]): after the first windows (unless `stop` holds for them) and after
    /// every later round, with `true` after the last. `io` may remove bytes from the front of
    /// any message (the bytes it has used); what arrives later is appended to what it left. A
    /// message is then never held whole unless `io` keeps it, and `out` holds, after the call,
    /// what `io` left. `Ok(false)` as for [`Windows::all_gather`] (then nothing was consumed).
    ///
    /// # Errors
    /// As [`Windows::all_gather`].
    pub(crate) fn all_gather_streamed(
        &mut self,
        comm: &mut dyn Communicator,
        io: &mut dyn Stream,
        max_len: usize,
        chunk: usize,
        out: &mut Vec<Vec<u8>>,
        stop: impl Fn(&[Vec<u8>]) -> bool,
    ) -> Result<bool, CommError> {
        self.gather(comm, io, true, max_len, chunk, out, &stop)
    }

    /// The all-gather of [`Windows::all_gather`], its messages handed to `local` as they
    /// arrive when `streamed`.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &mut self,
        comm: &mut dyn Communicator,
        local: &mut dyn Stream,
        streamed: bool,
        max_len: usize,
        chunk: usize,
        out: &mut Vec<Vec<u8>>,
        stop: &dyn Fn(&[Vec<u8>]) -> bool,
    ) -> Result<bool, CommError> {
        let chunk = chunk.max(MIN_WINDOW);
        let len = local.len();
        let first = len.min(chunk);
        comm.all_gather(local.bytes(0, first), max_len.min(chunk), out)?;
        if out.iter().all(|w| w.len() < chunk) {
            if streamed {
                local.consume(out, true);
            }
            return Ok(true);
        }
        if stop(out) {
            return Ok(false);
        }
        self.header.clear();
        self.header.extend_from_slice(&(len as u64).to_le_bytes());
        self.header
            .extend_from_slice(&(max_len as u64).to_le_bytes());
        comm.all_gather(&self.header, GATHER_HEADER, &mut self.headers)?;
        if self.headers.len() != out.len() {
            return Err(CommError::Transport(format!(
                "a header round gathered {} buffers, the first windows {}",
                self.headers.len(),
                out.len()
            )));
        }
        if let Some(r) = self.headers.iter().position(|h| h.len() != GATHER_HEADER) {
            return Err(CommError::Transport(format!(
                "rank {r} sent a header of {} bytes, not {GATHER_HEADER}",
                self.headers[r].len()
            )));
        }
        self.totals.clear();
        self.totals
            .extend(self.headers.iter().map(|h| read_u64(h, 0)));
        check_lengths(
            self.totals
                .iter()
                .zip(&self.headers)
                .map(|(&total, h)| (total, read_u64(h, 8))),
        )?;
        // The first window is the message's start: full exactly when the message is longer.
        self.arrived.clear();
        for (r, (&total, got)) in self.totals.iter().zip(out.iter_mut()).enumerate() {
            let due = total.min(chunk);
            if got.len() != due {
                return Err(window_error(r, got.len(), due));
            }
            self.arrived.push(due);
            // Within the group's smallest limit, at most this rank's own `max_len`. A stream
            // grows its messages window by window instead (its consumer removes what it used).
            if !streamed {
                reserve(got, total - due, r)?;
            }
        }
        let mut whole = self.arrived == self.totals;
        if streamed {
            local.consume(out, whole);
        }
        let mut done = first;
        while !whole {
            let next = len.min(done + chunk);
            self.lens.clear();
            self.lens.extend(out.iter().map(Vec::len));
            if streamed {
                for (r, (msg, (&total, &arrived))) in out
                    .iter_mut()
                    .zip(self.totals.iter().zip(&self.arrived))
                    .enumerate()
                {
                    let due = (total - arrived).min(chunk);
                    if msg.capacity() - msg.len() < due {
                        msg.try_reserve(due).map_err(|_| {
                            CommError::Transport(format!(
                                "cannot allocate {due} bytes for the message of rank {r}"
                            ))
                        })?;
                    }
                }
            }
            comm.all_gather_append(local.bytes(done, next), chunk, out)?;
            done = next;
            if out.len() != self.totals.len() {
                return Err(CommError::Transport(format!(
                    "a window round gathered {} buffers from a group of {}",
                    out.len(),
                    self.totals.len()
                )));
            }
            for (r, ((msg, &before), (&total, arrived))) in out
                .iter()
                .zip(&self.lens)
                .zip(self.totals.iter().zip(self.arrived.iter_mut()))
                .enumerate()
            {
                let due = (total - *arrived).min(chunk);
                if msg.len() != before + due {
                    return Err(window_error(r, msg.len().saturating_sub(before), due));
                }
                *arrived += due;
            }
            whole = self.arrived == self.totals;
            if streamed {
                local.consume(out, whole);
            }
        }
        Ok(true)
    }

    /// [`Communicator::all_to_all`] of `send`, each call passing buffers of at most `chunk`
    /// bytes (at least [`MIN_WINDOW`]) when `max_len` is above it (then a header call first,
    /// even when every buffer fits). `max_len` must be the same on every rank (the calls a rank
    /// makes depend on it). Results, limits and errors as the single call, except that after an
    /// error `out` is unspecified.
    ///
    /// # Errors
    /// As [`Communicator::all_to_all`] (a rank whose `send` does not hold one buffer per rank
    /// fails every rank with [`CommError::Mismatch`]); [`CommError::Transport`] naming a rank
    /// whose header or window does not match the protocol.
    pub(crate) fn all_to_all(
        &mut self,
        comm: &mut dyn Communicator,
        send: &[Vec<u8>],
        max_len: usize,
        chunk: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let chunk = chunk.max(MIN_WINDOW);
        if max_len <= chunk {
            return comm.all_to_all(send, max_len, out);
        }
        let (w, me) = (comm.world_size(), comm.rank());
        // Header: the limit, then one length per receiver; a rank holding another number of
        // buffers sends one word more (the limit, its count, zeros), and every rank names it.
        let header_len = 8 * (w + 1);
        self.header.clear();
        self.header
            .extend_from_slice(&(max_len as u64).to_le_bytes());
        if send.len() == w {
            for buf in send {
                self.header
                    .extend_from_slice(&(buf.len() as u64).to_le_bytes());
            }
        } else {
            self.header
                .extend_from_slice(&(send.len() as u64).to_le_bytes());
            self.header.resize(header_len + 8, 0);
        }
        comm.all_gather(&self.header, header_len + 8, &mut self.headers)?;
        if self.headers.len() != w {
            return Err(CommError::Transport(format!(
                "a header round gathered {} buffers from a group of {w}",
                self.headers.len()
            )));
        }
        if let Some(r) = self.headers.iter().position(|h| h.len() != header_len) {
            return Err(CommError::Mismatch {
                round: 0,
                detail: format!(
                    "all_to_all: rank {r} passed {} buffers to a group of {w}",
                    read_u64(&self.headers[r], 8)
                ),
            });
        }
        // totals[s * w + d]: what rank s sends to rank d.
        self.totals.clear();
        for h in &self.headers {
            self.totals.extend((0..w).map(|d| read_u64(h, 8 * (d + 1))));
        }
        for d in 0..w {
            check_lengths(
                self.headers
                    .iter()
                    .enumerate()
                    .map(|(s, h)| (self.totals[s * w + d], read_u64(h, 0))),
            )?;
        }
        out.truncate(w);
        out.resize_with(w, Vec::new);
        for (s, msg) in out.iter_mut().enumerate() {
            msg.clear();
            // Within the group's smallest limit, at most this rank's own `max_len`.
            reserve(msg, self.totals[s * w + me], s)?;
        }
        let rounds = self
            .totals
            .iter()
            .map(|t| t.div_ceil(chunk))
            .max()
            .unwrap_or(0);
        // Each round sends slices of the messages and appends what arrives to each message:
        // neither side copies a window into a buffer of its own. The list of slices lives on
        // the stack up to `STACK_WINDOWS` ranks (a list on the heap per call above).
        let mut on_stack: [&[u8]; STACK_WINDOWS] = [&[]; STACK_WINDOWS];
        let mut on_heap: Vec<&[u8]> = Vec::new();
        let windows: &mut [&[u8]] = if w <= STACK_WINDOWS {
            &mut on_stack[..w]
        } else {
            on_heap.resize(w, &[]);
            &mut on_heap
        };
        for round in 0..rounds {
            let from = round * chunk;
            for (window, buf) in windows.iter_mut().zip(send) {
                *window = buf.get(from..buf.len().min(from + chunk)).unwrap_or(&[]);
            }
            self.lens.clear();
            self.lens.extend(out.iter().map(Vec::len));
            comm.all_to_all_append(windows, chunk, out)?;
            if out.len() != w {
                return Err(CommError::Transport(format!(
                    "a window round received {} buffers in a group of {w}",
                    out.len()
                )));
            }
            for (s, (msg, &before)) in out.iter().zip(&self.lens).enumerate() {
                let due = self.totals[s * w + me].saturating_sub(from).min(chunk);
                let got = msg.len().saturating_sub(before);
                if got != due {
                    return Err(window_error(s, got, due));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Windows;
    use crate::comm::{CommError, Communicator, LocalGroup, Traffic};

    /// Delegates to a communicator and records the largest buffer passed to it.
    struct Largest<C> {
        inner: C,
        largest: usize,
    }

    impl<C: Communicator> Communicator for Largest<C> {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn all_gather(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.largest = self.largest.max(local.len());
            self.inner.all_gather(local, max_len, out)
        }
        fn all_gather_append(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.largest = self.largest.max(local.len());
            self.inner.all_gather_append(local, max_len, out)
        }
        fn all_to_all(
            &mut self,
            send: &[Vec<u8>],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            let most = send.iter().map(Vec::len).max().unwrap_or(0);
            self.largest = self.largest.max(most);
            self.inner.all_to_all(send, max_len, out)
        }
        fn traffic(&self) -> Traffic {
            self.inner.traffic()
        }
    }

    fn message(rank: usize, to: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i * 31 + rank * 7 + to * 13) as u8)
            .collect()
    }

    /// Runs `f` on every rank of a group of `w` threads and returns each rank's result and the
    /// largest buffer it passed.
    fn run<T: Send + 'static>(
        w: usize,
        f: impl Fn(&mut dyn Communicator, &mut Windows) -> T + Send + Sync + Copy + 'static,
    ) -> Vec<(T, usize)> {
        let handles: Vec<_> = LocalGroup::new(w)
            .into_communicators()
            .into_iter()
            .map(|inner| {
                std::thread::spawn(move || {
                    let mut comm = Largest { inner, largest: 0 };
                    let mut windows = Windows::default();
                    let got = f(&mut comm, &mut windows);
                    (got, comm.largest)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    const C: usize = super::MIN_WINDOW;

    #[test]
    fn all_gather_in_windows_equals_one_call() {
        // Lengths below, at and above the window, with empty messages, at W = 1 and 3; twice
        // per rank, so that kept buffers are reused. A chunk below the smallest window is
        // raised to it.
        for w in [1, 3] {
            for lens in [
                [5usize, 0, 3],
                [C, C, C],
                [3 * C + 7, 0, 17],
                [0, 0, 0],
                [C - 1, 2 * C, C + 1],
            ] {
                let got = run(w, move |comm, windows| {
                    let me = comm.rank();
                    let mut out = Vec::new();
                    for chunk in [C, 16] {
                        let local = message(me, 0, lens[me]);
                        let whole = windows
                            .all_gather(comm, &local, 1 << 20, chunk, &mut out, |_| false)
                            .unwrap();
                        assert!(whole);
                        let want: Vec<_> = (0..w).map(|r| message(r, 0, lens[r])).collect();
                        assert_eq!(out, want, "{lens:?}");
                    }
                });
                for (_, largest) in got {
                    assert!(largest <= C, "{largest}");
                }
            }
        }
    }

    #[test]
    fn all_gather_stops_after_the_first_windows_when_asked() {
        // Rank 1's first byte says "stop": every rank stops after one call, with the first
        // windows, and the next call pairs as it should.
        let got = run(3, |comm, windows| {
            let me = comm.rank();
            let mut local = message(me, 0, 3 * C);
            local[0] = u8::from(me == 1);
            let mut out = Vec::new();
            let whole = windows
                .all_gather(comm, &local, 1 << 20, C, &mut out, |first| first[1][0] == 1)
                .unwrap();
            assert!(!whole);
            assert!(out.iter().all(|m| m.len() == C));
            windows
                .all_gather(comm, &[me as u8], 1, C, &mut out, |_| true)
                .unwrap();
            out
        });
        for (out, _) in got {
            assert_eq!(out, vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn all_to_all_in_windows_equals_one_call() {
        for w in [1, 3] {
            for max_len in [C, 3 * C, 1 << 20] {
                let got = run(w, move |comm, windows| {
                    let me = comm.rank();
                    let len = |s: usize, d: usize| (s * 1100 + d * 2500) % max_len.min(9000);
                    let send: Vec<_> = (0..w).map(|d| message(me, d, len(me, d))).collect();
                    let mut out = Vec::new();
                    for _ in 0..2 {
                        windows
                            .all_to_all(comm, &send, max_len, C, &mut out)
                            .unwrap();
                        let want: Vec<_> = (0..w).map(|s| message(s, me, len(s, me))).collect();
                        assert_eq!(out, want);
                    }
                });
                for (_, largest) in got {
                    assert!(largest <= C, "{largest}");
                }
            }
        }
    }

    #[test]
    fn limits_apply_to_the_whole_message_on_every_rank() {
        // All-gather: rank 1's 3C bytes over a limit of 2C.
        let got = run(3, |comm, windows| {
            let len = if comm.rank() == 1 { 3 * C } else { C + 20 };
            let mut out = Vec::new();
            windows
                .all_gather(comm, &vec![1u8; len], 2 * C, C, &mut out, |_| false)
                .unwrap_err()
                .to_string()
        });
        for (e, _) in &got {
            assert_eq!(e, &got[0].0);
            assert!(e.contains(&format!("rank 1 sent {} bytes", 3 * C)), "{e}");
        }
        // All-to-all: rank 2 sends 2C + 1 bytes to rank 0 under a limit of 2C.
        let got = run(3, |comm, windows| {
            let me = comm.rank();
            let send: Vec<_> = (0..3)
                .map(|d| vec![0u8; if me == 2 && d == 0 { 2 * C + 1 } else { 30 }])
                .collect();
            let mut out = Vec::new();
            windows
                .all_to_all(comm, &send, 2 * C, C, &mut out)
                .unwrap_err()
                .to_string()
        });
        for (e, _) in &got {
            assert_eq!(e, &got[0].0);
            assert!(
                e.contains(&format!("rank 2 sent {} bytes", 2 * C + 1)),
                "{e}"
            );
        }
        // A rank with the wrong number of buffers: every rank names it.
        let got = run(3, |comm, windows| {
            let n = if comm.rank() == 1 { 2 } else { 3 };
            let mut out = Vec::new();
            windows
                .all_to_all(comm, &vec![vec![0u8; 20]; n], 2 * C, C, &mut out)
                .unwrap_err()
                .to_string()
        });
        for (e, _) in &got {
            assert!(e.contains("rank 1 passed 2 buffers"), "{e}");
        }
    }
}

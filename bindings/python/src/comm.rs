//! A [`Communicator`] over a Python object's raw collectives, with the library's rules on top.
//!
//! The Python object (for example `gradwire.comm.TorchDistributed`) has `rank` and
//! `world_size` and two raw collectives of byte buffers whose lengths every rank already knows:
//! - `all_gather(data: bytes, lengths: list[int]) -> list[bytes]`: every rank's buffer, in rank
//!   order (`lengths[i]` is rank `i`'s length);
//! - `all_to_all(send: list[bytes], recv_lengths: list[int]) -> list[bytes]`: `send[j]` to rank
//!   `j`; returns what each rank sent here (`recv_lengths[i]` bytes from rank `i`).
//!
//! This module supplies what makes them a gradwire transport: an opening exchange before every
//! call, the collective size-limit decision (every rank refuses alike, before anything of that
//! size is moved), a check that what arrived has the announced lengths, and the byte counts
//! (`traffic`, logical: 16 bytes per peer for the length exchange, the same as every other
//! transport's).
//!
//! The opening is one raw all-gather of the same size on every rank and at every call: the
//! call's kind, this rank's limit and its W lengths (one per destination for an all-to-all), 8
//! (W + 2) bytes. So ranks at different calls (one in an all-gather, another in an all-to-all)
//! pair the same raw operation and fail alike with `CommError::Mismatch`, instead of pairing
//! buffers of other sizes inside the process group (gloo aborts the process on that), and
//! every rank reaches the same length verdict without a second round.
//!
//! The deadline is the Python transport's own (for `torch.distributed`, the process group's
//! timeout): a raw call that raises, on timeout or otherwise, fails this rank's call with
//! `CommError::Transport` carrying the Python exception's text, and closes the communicator:
//! this rank's later calls fail with `CommError::Broken` without calling the transport again
//! (a later raw call could pair with a peer's earlier one), and its peers, inside a raw call
//! this rank will not make, fail at the group's timeout. So does
//! [`Communicator::close`], which `CompressedAllReduce` calls after a transport failure.

use gradwire::comm::{CommError, Communicator, Traffic, check_lengths};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// Bytes of the logical length exchange per peer and call (a length and a limit), counted in
/// `traffic` as every transport counts it.
const HEADER: usize = 16;

/// The kinds of call an opening names.
const ALL_GATHER: u64 = 1;
const ALL_TO_ALL: u64 = 2;

/// The Python object's collectives as a [`Communicator`].
pub(crate) struct PyCommunicator {
    object: Py<PyAny>,
    rank: usize,
    world_size: usize,
    traffic: Traffic,
    /// Calls made so far (the round number of a mismatch).
    calls: u64,
    /// Why this communicator was closed: every later call fails with it.
    closed: Option<String>,
}

fn transport(e: impl std::fmt::Display) -> CommError {
    CommError::Transport(e.to_string())
}

fn u64_at(bytes: &[u8], word: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(src) = bytes.get(8 * word..8 * word + 8) {
        w.copy_from_slice(src);
    }
    u64::from_le_bytes(w)
}

fn as_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// One rank's opening: the kind of call, its limit and its `lengths` (one per rank), as
/// little-endian u64.
fn opening(kind: u64, limit: usize, lengths: &[u64]) -> Vec<u8> {
    let mut h = Vec::with_capacity(8 * (2 + lengths.len()));
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&(limit as u64).to_le_bytes());
    for len in lengths {
        h.extend_from_slice(&len.to_le_bytes());
    }
    h
}

fn kind_name(kind: u64) -> String {
    match kind {
        ALL_GATHER => "all_gather".into(),
        ALL_TO_ALL => "all_to_all".into(),
        other => format!("an unknown call ({other})"),
    }
}

impl PyCommunicator {
    /// Wraps `object`, reading its `rank` and `world_size`.
    pub(crate) fn new(object: Bound<'_, PyAny>) -> PyResult<Self> {
        let rank: usize = object.getattr("rank")?.extract()?;
        let world_size: usize = object.getattr("world_size")?.extract()?;
        if world_size == 0 || rank >= world_size {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "communicator says rank {rank} of world size {world_size}"
            )));
        }
        for name in ["all_gather", "all_to_all"] {
            if !object.getattr(name)?.is_callable() {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "the communicator's `{name}` is not callable"
                )));
            }
        }
        Ok(PyCommunicator {
            object: object.unbind(),
            rank,
            world_size,
            traffic: Traffic::default(),
            calls: 0,
            closed: None,
        })
    }

    /// Starts a call: fails with `Broken` on a closed communicator, without a raw call.
    fn begin(&mut self) -> Result<u64, CommError> {
        if let Some(first) = &self.closed {
            return Err(CommError::Broken {
                first: first.clone(),
            });
        }
        self.calls += 1;
        Ok(self.calls - 1)
    }

    /// Closes this communicator when `result` is a transport failure (a raw call raised or
    /// returned other lengths): a later raw call could pair with a peer's earlier one.
    fn closing_on_failure<T>(&mut self, result: Result<T, CommError>) -> Result<T, CommError> {
        if let Err(CommError::Transport(why)) = &result {
            self.closed
                .get_or_insert_with(|| format!("rank {}: transport failure: {why}", self.rank));
        }
        result
    }

    /// The opening exchange of call `round`: every rank's opening (kind, limit, `lengths`),
    /// checked to name the same kind of call; returns each rank's limit and lengths.
    fn open(
        &mut self,
        round: u64,
        kind: u64,
        limit: usize,
        lengths: &[u64],
    ) -> Result<Vec<(usize, Vec<usize>)>, CommError> {
        let w = self.world_size;
        let size = 8 * (2 + w);
        let mine = opening(kind, limit, lengths);
        let got = self.raw_all_gather(&mine, &vec![size; w]);
        let got = self.closing_on_failure(got)?;
        if let Some((r, other)) = got.iter().enumerate().find(|(_, o)| u64_at(o, 0) != kind) {
            return Err(CommError::Mismatch {
                round,
                detail: format!(
                    "rank {r} called {}, rank {} {}",
                    kind_name(u64_at(other, 0)),
                    self.rank,
                    kind_name(kind)
                ),
            });
        }
        Ok(got
            .iter()
            .map(|o| {
                let lens = (0..w).map(|j| as_usize(u64_at(o, 2 + j))).collect();
                (as_usize(u64_at(o, 1)), lens)
            })
            .collect())
    }

    /// The raw all-gather of buffers of known lengths; checks the lengths that came back.
    fn raw_all_gather(&self, data: &[u8], lengths: &[usize]) -> Result<Vec<Vec<u8>>, CommError> {
        let got: Vec<Vec<u8>> = Python::attach(|py| {
            let result = self.object.bind(py).call_method1(
                "all_gather",
                (PyBytes::new(py, data), PyList::new(py, lengths)?),
            )?;
            result.extract::<Vec<Vec<u8>>>()
        })
        .map_err(|e| transport(format!("all_gather: {e}")))?;
        check_arrived("all_gather", &got, lengths)?;
        Ok(got)
    }

    /// The raw all-to-all of buffers of known lengths; checks the lengths that came back.
    fn raw_all_to_all(
        &self,
        send: &[Vec<u8>],
        recv_lengths: &[usize],
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let got: Vec<Vec<u8>> = Python::attach(|py| {
            let buffers: Vec<Bound<'_, PyBytes>> =
                send.iter().map(|b| PyBytes::new(py, b)).collect();
            let result = self.object.bind(py).call_method1(
                "all_to_all",
                (PyList::new(py, buffers)?, PyList::new(py, recv_lengths)?),
            )?;
            result.extract::<Vec<Vec<u8>>>()
        })
        .map_err(|e| transport(format!("all_to_all: {e}")))?;
        check_arrived("all_to_all", &got, recv_lengths)?;
        Ok(got)
    }

    fn count(&mut self, sent: usize, received: usize) {
        let header = (HEADER * (self.world_size - 1)) as u64;
        self.traffic.sent = self.traffic.sent.saturating_add(sent as u64 + header);
        self.traffic.received = self
            .traffic
            .received
            .saturating_add(received as u64 + header);
    }
}

fn check_arrived(call: &str, got: &[Vec<u8>], lengths: &[usize]) -> Result<(), CommError> {
    if got.len() != lengths.len() {
        return Err(transport(format!(
            "{call}: the Python transport returned {} buffers for {} ranks",
            got.len(),
            lengths.len()
        )));
    }
    match got.iter().zip(lengths).position(|(b, &l)| b.len() != l) {
        Some(rank) => Err(transport(format!(
            "{call}: rank {rank}'s buffer arrived with {} bytes, {} announced",
            got[rank].len(),
            lengths[rank]
        ))),
        None => Ok(()),
    }
}

impl Communicator for PyCommunicator {
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
        let round = self.begin()?;
        let w = self.world_size;
        let mut lengths = vec![0u64; w];
        lengths[0] = local.len() as u64;
        let opened = self.open(round, ALL_GATHER, max_len, &lengths)?;
        check_lengths(opened.iter().map(|(limit, lens)| (lens[0], *limit)))?;
        let lengths: Vec<usize> = opened.iter().map(|(_, lens)| lens[0]).collect();
        let got = self.raw_all_gather(local, &lengths);
        let got = self.closing_on_failure(got)?;
        let received: usize = (0..w).filter(|&i| i != self.rank).map(|i| lengths[i]).sum();
        *out = got;
        self.count(local.len() * (w - 1), received);
        Ok(())
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let round = self.begin()?;
        let (w, me) = (self.world_size, self.rank);
        // A wrong number of buffers is announced as lengths of u64::MAX: every rank refuses it
        // alike.
        let lengths: Vec<u64> = (0..w)
            .map(|j| match send.get(j) {
                Some(b) if send.len() == w => b.len() as u64,
                _ => u64::MAX,
            })
            .collect();
        let opened = self.open(round, ALL_TO_ALL, max_len, &lengths)?;
        if let Some(r) = opened
            .iter()
            .position(|(_, lens)| lens.contains(&usize::MAX))
        {
            return Err(CommError::Mismatch {
                round,
                detail: format!("rank {r} passed another number of buffers than {w}"),
            });
        }
        // Every rank holds every rank's lengths: the verdict of the receivers in rank order,
        // then of the senders, is the same everywhere.
        (0..w).try_for_each(|dst| {
            check_lengths(opened.iter().map(|(limit, lens)| (lens[dst], *limit)))
        })?;
        let recv_lengths: Vec<usize> = opened.iter().map(|(_, lens)| lens[me]).collect();
        let got = self.raw_all_to_all(send, &recv_lengths);
        let got = self.closing_on_failure(got)?;
        let sent: usize = (0..w).filter(|&j| j != me).map(|j| send[j].len()).sum();
        let received: usize = (0..w).filter(|&i| i != me).map(|i| recv_lengths[i]).sum();
        *out = got;
        self.count(sent, received);
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    /// Makes every later call fail with `Broken` naming `reason` (or the transport failure
    /// that closed it first), without a raw call.
    fn close(&mut self, reason: &str) -> Option<String> {
        let rank = self.rank;
        Some(
            self.closed
                .get_or_insert_with(|| format!("rank {rank}: {reason}"))
                .clone(),
        )
    }
}

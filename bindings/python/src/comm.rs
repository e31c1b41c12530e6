//! A [`Communicator`] over a Python object's raw collectives, with the library's rules on top.
//!
//! The Python object (for example `gradwire.comm.TorchDistributed`) has `rank` and
//! `world_size` and two raw collectives of byte buffers whose lengths every rank already knows:
//! - `all_gather(data: bytes, lengths: list[int]) -> list[bytes]`: every rank's buffer, in rank
//!   order (`lengths[i]` is rank `i`'s length);
//! - `all_to_all(send: list[bytes], recv_lengths: list[int]) -> list[bytes]`: `send[j]` to rank
//!   `j`; returns what each rank sent here (`recv_lengths[i]` bytes from rank `i`).
//!
//! This module supplies what makes them a gradwire transport: the length exchange before every
//! call (16 bytes per peer: a length and a limit), the collective size-limit decision (every
//! rank refuses alike, before anything of that size is moved), a check that what arrived has
//! the announced lengths, and the byte counts (`traffic`), the same as every other transport's.
//! The deadline is the Python transport's own (for `torch.distributed`, the process group's
//! timeout): a raw call that raises, on timeout or otherwise, fails this rank's call with
//! `CommError::Transport` carrying the Python exception's text.

use gradwire::comm::{CommError, Communicator, Traffic, check_lengths};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// Bytes of one rank's `(length, limit)` header.
const HEADER: usize = 16;

/// Bytes of one rank's verdict on what it receives in an all-to-all: kind, rank, length,
/// limit, limit rank (5 little-endian u64).
const VERDICT: usize = 40;

/// The Python object's collectives as a [`Communicator`].
pub(crate) struct PyCommunicator {
    object: Py<PyAny>,
    rank: usize,
    world_size: usize,
    traffic: Traffic,
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

fn header(len: usize, limit: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER);
    h.extend_from_slice(&(len as u64).to_le_bytes());
    h.extend_from_slice(&(limit as u64).to_le_bytes());
    h
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
        })
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
        let w = self.world_size;
        let headers = self.raw_all_gather(&header(local.len(), max_len), &vec![HEADER; w])?;
        let posted: Vec<(usize, usize)> = headers
            .iter()
            .map(|h| (as_usize(u64_at(h, 0)), as_usize(u64_at(h, 1))))
            .collect();
        check_lengths(posted.iter().copied())?;
        let lengths: Vec<usize> = posted.iter().map(|&(len, _)| len).collect();
        let got = self.raw_all_gather(local, &lengths)?;
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
        let (w, me) = (self.world_size, self.rank);
        // 1. (length, limit) to every rank; a wrong number of buffers is announced as lengths
        // of u64::MAX, which every receiver refuses, so that every rank fails alike.
        let headers: Vec<Vec<u8>> = (0..w)
            .map(|j| {
                let len = if send.len() == w {
                    send[j].len()
                } else {
                    usize::MAX
                };
                header(len, max_len)
            })
            .collect();
        let theirs = self.raw_all_to_all(&headers, &vec![HEADER; w])?;
        let posted: Vec<(usize, usize)> = theirs
            .iter()
            .map(|h| (as_usize(u64_at(h, 0)), as_usize(u64_at(h, 1))))
            .collect();
        // 2. Each receiver's verdict, gathered, so that every rank returns the first one's.
        let verdict: [u64; 5] = match check_lengths(posted.iter().copied()) {
            Ok(()) => [0; 5],
            Err(CommError::TooLarge { rank, len, limit }) => {
                [1, rank as u64, len as u64, limit as u64, 0]
            }
            Err(CommError::LimitsDiffer {
                rank,
                len,
                limit,
                limit_rank,
            }) => [2, rank as u64, len as u64, limit as u64, limit_rank as u64],
            Err(_) => [3, me as u64, 0, 0, 0],
        };
        let verdict_bytes: Vec<u8> = verdict.iter().flat_map(|v| v.to_le_bytes()).collect();
        let verdicts = self.raw_all_gather(&verdict_bytes, &vec![VERDICT; w])?;
        if let Some(v) = verdicts.iter().find(|v| u64_at(v, 0) != 0) {
            let word = |i| as_usize(u64_at(v, i));
            return Err(match u64_at(v, 0) {
                1 => CommError::TooLarge {
                    rank: word(1),
                    len: word(2),
                    limit: word(3),
                },
                2 => CommError::LimitsDiffer {
                    rank: word(1),
                    len: word(2),
                    limit: word(3),
                    limit_rank: word(4),
                },
                _ => transport(format!(
                    "all_to_all: rank {} refused the lengths it was offered",
                    word(1)
                )),
            });
        }
        // 3. The data.
        let recv_lengths: Vec<usize> = posted.iter().map(|&(len, _)| len).collect();
        let got = self.raw_all_to_all(send, &recv_lengths)?;
        let sent: usize = (0..w).filter(|&j| j != me).map(|j| send[j].len()).sum();
        let received: usize = (0..w).filter(|&i| i != me).map(|i| recv_lengths[i]).sum();
        *out = got;
        // The verdict round is part of this protocol's length exchange (not counted, as the
        // other transports do not count theirs).
        self.count(sent, received);
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }
}

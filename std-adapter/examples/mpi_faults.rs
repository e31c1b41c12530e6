//! Faults under `mpirun -np 4`, for `tests/mpi.rs`: a compressed all-reduce of a small model
//! for a few steps, with one fault on one rank, given as the first argument:
//!
//! - `wrong-ratio`: rank 2 keeps 2% where the others keep 1%;
//! - `corrupt`: rank 1's transport flips a byte of its bundle on the way out at step 1;
//! - `silent`: rank 3 stops calling at step 1 (alive, asleep) until the others' deadline (5 s)
//!   ends the job;
//! - `kill`: rank 3 dies at step 1 (`abort`);
//! - `transport`: rank 1's transport fails its all-gather at step 1 without taking part: the
//!   all-reduce closes the communicator, which ends the job naming the failure.
//!
//! Every rank prints `step S rank R: ok` or `step S rank R: error: ...` for every step, so that
//! the test can check that every rank failed alike, at the same step.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

use gradwire::comm::{CommError, Communicator, MpiCommunicator, Traffic};
use gradwire::core::Values;
use gradwire::{CompressedAllReduce, CompressionMethod, Tensor};

/// A transport that flips one byte of this rank's outgoing messages at call `at`, or fails
/// call `fail` without taking part.
struct Corrupting {
    inner: MpiCommunicator,
    call: u64,
    at: Option<u64>,
    fail: Option<u64>,
}

impl Communicator for Corrupting {
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
        self.call += 1;
        if Some(self.call) == self.fail {
            return Err(CommError::Transport("the link went down".into()));
        }
        if Some(self.call) == self.at && local.len() > 40 {
            let mut bad = local.to_vec();
            bad[40] ^= 0x10;
            return self.inner.all_gather(&bad, max_len, out);
        }
        self.inner.all_gather(local, max_len, out)
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.inner.all_to_all(send, max_len, out)
    }
    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
    fn close(&mut self, reason: &str) -> Option<String> {
        self.inner.close(reason)
    }
}

fn grads(rank: usize, step: usize) -> HashMap<String, Tensor> {
    let w: Vec<f32> = (0..4096)
        .map(|i| ((i * 31 + rank * 7 + step * 3) % 101) as f32 - 50.0)
        .collect();
    HashMap::from([
        ("w".to_owned(), Tensor::new(vec![64, 64], w).unwrap()),
        ("b".to_owned(), Tensor::vector(vec![0.5, -1.0, 2.0])),
    ])
}

fn main() -> ExitCode {
    let fault = std::env::args().nth(1).unwrap_or_default();
    let comm = match MpiCommunicator::init() {
        Ok(comm) => comm.with_deadline(Duration::from_secs(5)),
        Err(err) => {
            eprintln!("mpi_faults: {err}");
            return ExitCode::FAILURE;
        }
    };
    let rank = comm.rank();
    let ratio = if fault == "wrong-ratio" && rank == 2 {
        0.02
    } else {
        0.01
    };
    let method = CompressionMethod::TopKRatio {
        ratio,
        values: Values::Int8 { block: 256 },
    }
    .with_error_feedback();
    let comm = Corrupting {
        inner: comm,
        call: 0,
        at: (fault == "corrupt" && rank == 1).then_some(2),
        fail: (fault == "transport" && rank == 1).then_some(2),
    };
    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm));
    for step in 0..3 {
        if step == 1 && rank == 3 {
            match fault.as_str() {
                "silent" => std::thread::sleep(Duration::from_secs(3600)),
                "kill" => std::process::abort(),
                _ => {}
            }
        }
        match ar.all_reduce(&grads(rank, step)) {
            Ok(_) => println!("step {step} rank {rank}: ok"),
            Err(e) => println!("step {step} rank {rank}: error: {e}"),
        }
    }
    ExitCode::SUCCESS
}

//! Ranks of a `LocalGroup` as threads, for the integration tests that run a collective.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use gradwire::comm::{Communicator, LocalCommunicator};

/// A test that hangs fails after this long instead of blocking the suite.
pub const WATCHDOG: Duration = Duration::from_secs(120);

/// Runs `body` once per rank, each in its own thread, and returns the results in rank order.
/// Panics (failing the test) if any rank does not finish within [`WATCHDOG`].
pub fn run_ranks<T, F>(comms: Vec<LocalCommunicator>, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(LocalCommunicator) -> T + Send + Sync + Clone + 'static,
{
    let world_size = comms.len();
    let (tx, rx) = mpsc::channel();
    for comm in comms {
        let tx = tx.clone();
        let body = body.clone();
        thread::spawn(move || {
            let rank = comm.rank();
            let result = body(comm);
            let _ = tx.send((rank, result));
        });
    }
    drop(tx);
    let mut results: Vec<Option<T>> = (0..world_size).map(|_| None).collect();
    for _ in 0..world_size {
        let (rank, result) = rx
            .recv_timeout(WATCHDOG)
            .expect("a rank hung or panicked without reporting");
        results[rank] = Some(result);
    }
    results.into_iter().map(Option::unwrap).collect()
}

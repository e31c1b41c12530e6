//! Issue 48 class 3: a transport error on one rank must not leave the group out of step. The
//! rank whose transport call failed closes its communicator (`Communicator::close`): its later
//! calls fail with `CommError::Broken` naming the first failure without any collective, and
//! its peers (`LocalGroup`: the group marked broken) stop waiting and fail alike. Before,
//! rank 1's failed call left ranks 0 and 2 in an all-to-all that rank 1's next all-gather
//! answered (`Mismatch`), and every later step failed with `ConfigDiffers: step`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use gradwire::comm::{CommError, Communicator, LocalCommunicator, LocalGroup, Traffic};
use gradwire::tensor::Tensor;
use gradwire::{Collective, CompressedAllReduce, CompressionMethod, Error};

#[path = "common/ranks.rs"]
mod ranks;
use ranks::run_ranks;

/// A transport that fails its `fail_at`-th collective call (counting from 0) without taking
/// part, and counts every call it passes on to the group after that.
struct Faulty {
    inner: LocalCommunicator,
    fail_at: Option<usize>,
    calls: usize,
    after: Arc<AtomicUsize>,
    closed_with: Option<String>,
}

impl Faulty {
    fn call(&mut self) -> Result<(), CommError> {
        let n = self.calls;
        self.calls += 1;
        match self.fail_at {
            Some(at) if n == at => Err(CommError::Transport("the link went down".into())),
            Some(at) if n > at => {
                self.after.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl Communicator for Faulty {
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
        self.call()?;
        self.inner.all_gather(local, max_len, out)
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.call()?;
        self.inner.all_to_all(send, max_len, out)
    }
    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        self.call()?;
        self.inner.all_reduce_sum_f32(x)
    }
    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
    fn close(&mut self, reason: &str) -> Option<String> {
        self.closed_with.get_or_insert_with(|| reason.to_owned());
        self.inner.close(reason)
    }
}

fn gradients(rank: usize, step: u64) -> HashMap<String, Tensor> {
    let n = 20_000;
    let data = (0..n)
        .map(|i| ((i as u64 * 7 + rank as u64 * 13 + step * 31) % 101) as f32 / 50.0 - 1.0)
        .collect();
    HashMap::from([("w".to_owned(), Tensor::new(vec![n], data).unwrap())])
}

fn broken_text(e: &Error) -> Option<&str> {
    match e {
        Error::Comm {
            source: CommError::Broken { first },
        } => Some(first),
        _ => None,
    }
}

#[test]
fn a_transport_error_on_one_rank_breaks_the_group_alike_and_no_rank_waits() {
    let dense = CompressionMethod::Core(gradwire::core::Method::Dense {
        values: gradwire::core::Values::F32,
    });
    let cases = [
        // (method, collective, the failing call of rank 1: its index among its calls)
        (
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            Collective::TwoPhase,
            1, // phase 1's all-to-all (after the agreement round)
        ),
        (
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            Collective::AllGather,
            0, // the bundles' all-gather
        ),
        (dense, Collective::AllGather, 1), // the sum, after the envelopes
    ];
    for (method, collective, fail_at) in cases {
        let after = Arc::new(AtomicUsize::new(0));
        let comms = LocalGroup::new(3).into_communicators();
        let results = run_ranks(comms, {
            let after = Arc::clone(&after);
            let method = method.clone();
            move |comm| {
                let rank = comm.rank();
                let faulty = Faulty {
                    inner: comm,
                    fail_at: (rank == 1).then_some(fail_at),
                    calls: 0,
                    after: Arc::clone(&after),
                    closed_with: None,
                };
                let mut ar =
                    CompressedAllReduce::with_communicator(method.clone(), Box::new(faulty))
                        .with_collective(collective);
                let residual = |ar: &CompressedAllReduce| -> Vec<u32> {
                    let fb = ar.compressor().feedback();
                    let r = fb.and_then(|f| f.residual("w")).unwrap_or(&[]);
                    r.iter().map(|x| x.to_bits()).collect()
                };
                let mut steps = vec![ar.all_reduce(&gradients(rank, 0))];
                let after_first = residual(&ar);
                steps.extend((1..3).map(|s| ar.all_reduce(&gradients(rank, s))));
                (steps, after_first == residual(&ar))
            }
        });
        let what = format!("{method:?}, {collective:?}");
        let first = "rank 1: transport failure: the link went down";
        for (rank, (steps, _)) in results.iter().enumerate() {
            match (&steps[0], rank) {
                (
                    Err(Error::Comm {
                        source: CommError::Transport(why),
                    }),
                    1,
                ) => assert_eq!(why, "the link went down", "{what}"),
                (Err(e), 0 | 2) => assert_eq!(broken_text(e), Some(first), "{what}: rank {rank}"),
                (other, _) => panic!("{what}: rank {rank}, step 0: {other:?}"),
            }
            for (s, later) in steps.iter().enumerate().skip(1) {
                let e = later.as_ref().err();
                assert_eq!(
                    e.and_then(broken_text),
                    Some(first),
                    "{what}: rank {rank}, step {s}: {later:?}"
                );
                let text = e.map(ToString::to_string).unwrap_or_default();
                assert!(
                    text.contains("the group is broken: rank 1: transport failure"),
                    "{text}"
                );
            }
        }
        // The rank that failed made no call of its transport after the failure.
        assert_eq!(after.load(Ordering::SeqCst), 0, "{what}");
        // Later steps touched nothing: every rank's residuals are as step 0 left them.
        for (rank, (_, unchanged)) in results.iter().enumerate() {
            assert!(unchanged, "{what}: rank {rank}");
        }
    }
}

/// A closed `LocalCommunicator` fails every later call with `Broken` naming the first reason,
/// and wakes a peer that waits in a call.
#[test]
fn closing_a_local_communicator_wakes_its_peers_and_refuses_later_calls() {
    let results = run_ranks(LocalGroup::new(2).into_communicators(), |mut comm| {
        let mut out = Vec::new();
        if comm.rank() == 0 {
            comm.close("gave up");
            comm.close("a second reason is not kept");
        }
        let first = comm.all_gather(&[1, 2], 8, &mut out);
        let second = comm.all_gather(&[1, 2], 8, &mut out);
        (first, second)
    });
    for (rank, (first, second)) in results.iter().enumerate() {
        for r in [first, second] {
            match r {
                Err(CommError::Broken { first }) => assert_eq!(first, "rank 0: gave up", "{rank}"),
                other => panic!("rank {rank}: {other:?}"),
            }
        }
    }
}

/// A rank that comes late, past the deadline: the ranks that waited fail with the deadline,
/// the late one with the broken group, and every later call of every rank names the same first
/// failure (the rank that found the deadline, and the rank it waited for).
#[test]
fn after_a_deadline_every_rank_names_the_same_first_failure() {
    let comms = LocalGroup::new(3)
        .with_timeout(Some(Duration::from_millis(300)))
        .into_communicators();
    let results = run_ranks(comms, |comm| {
        let rank = comm.rank();
        let mut ar = CompressedAllReduce::with_communicator(
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            Box::new(comm),
        );
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(2000));
        }
        let first = ar.all_reduce(&gradients(rank, 0)).err();
        let later = ar.all_reduce(&gradients(rank, 1)).err();
        (first, later)
    });
    let names = |e: &Option<Error>| e.as_ref().and_then(broken_text).map(str::to_owned);
    let group_first = names(&results[0].1).expect("rank 0's later call: the broken group");
    assert!(
        group_first.contains("waited") && group_first.contains("for ranks [2]"),
        "{group_first}"
    );
    for (rank, (first, later)) in results.iter().enumerate() {
        match (rank, first) {
            (0 | 1, Some(Error::Comm { source })) => assert!(
                matches!(source, CommError::Deadline { .. } | CommError::Transport(_)),
                "rank {rank}: {source:?}"
            ),
            (2, Some(e)) => assert_eq!(broken_text(e), Some(group_first.as_str())),
            other => panic!("rank {rank}: {other:?}"),
        }
        assert_eq!(names(later), Some(group_first.clone()), "rank {rank}");
    }
}

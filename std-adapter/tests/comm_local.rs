//! `LocalGroup`: ranks as threads, all-gather semantics, errors, and no hang on a lost peer.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use gradwire::comm::{CommError, Communicator, LocalGroup};

#[path = "common/collectives.rs"]
mod collectives;
#[path = "common/ranks.rs"]
mod ranks;
use ranks::{WATCHDOG, run_ranks};

/// The bytes rank `rank` sends in round `round`: length and content depend on both.
fn payload(round: usize, rank: usize) -> Vec<u8> {
    let len = (round * 7 + rank * 13) % 61;
    (0..len)
        .map(|i| (round.wrapping_mul(31) ^ rank.wrapping_mul(17) ^ i) as u8)
        .collect()
}

#[test]
fn gathers_in_rank_order_for_several_world_sizes() {
    for world_size in [1, 2, 3, 8] {
        let results = run_ranks(
            LocalGroup::new(world_size).into_communicators(),
            move |mut comm| {
                assert_eq!(comm.world_size(), world_size);
                let local = vec![comm.rank() as u8 + 1; comm.rank() * 3 + 1];
                let mut out = Vec::new();
                comm.all_gather(&local, 1024, &mut out).map(|()| out)
            },
        );
        let expected: Vec<Vec<u8>> = (0..world_size)
            .map(|rank| vec![rank as u8 + 1; rank * 3 + 1])
            .collect();
        for (rank, result) in results.into_iter().enumerate() {
            assert_eq!(result.unwrap(), expected, "world {world_size}, rank {rank}");
        }
    }
}

/// Review finding: a rank that sums while its peer all-gathers fails at that call with the
/// peer, and both stay in step: the next all-gathers pair with each other, not with a second
/// round of the failed sum.
#[test]
fn a_sum_against_another_collective_fails_alike_and_the_group_stays_in_step() {
    let results = run_ranks(LocalGroup::new(2).into_communicators(), |mut comm| {
        let rank = comm.rank();
        let mut out = Vec::new();
        let first = if rank == 0 {
            comm.all_reduce_sum_f32(&mut [1.0, 2.0]).is_err()
        } else {
            comm.all_gather(&[9], 16, &mut out).is_err()
        };
        let mut later = Vec::new();
        for k in 1..=3u8 {
            comm.all_gather(&[k * 10 + rank as u8], 16, &mut out)
                .unwrap();
            later.push(out.clone());
        }
        (first, later)
    });
    for (rank, (failed, later)) in results.into_iter().enumerate() {
        assert!(failed, "rank {rank}: the mismatched call fails");
        for (k, got) in (1..=3u8).zip(later) {
            assert_eq!(
                got,
                vec![vec![k * 10], vec![k * 10 + 1]],
                "rank {rank}, call {k}"
            );
        }
    }
}

#[test]
fn communicators_report_rank_and_world_size() {
    let comms = LocalGroup::new(5).into_communicators();
    for (rank, comm) in comms.iter().enumerate() {
        assert_eq!(comm.rank(), rank);
        assert_eq!(comm.world_size(), 5);
    }
    assert!(LocalGroup::new(0).into_communicators().is_empty());
    assert_eq!(LocalGroup::new(4).into_communicators().len(), 4);
}

#[test]
fn empty_buffers() {
    for world_size in [1, 2, 3, 8] {
        let results = run_ranks(
            LocalGroup::new(world_size).into_communicators(),
            |mut comm| {
                // Stale contents and a wrong length in `out` are replaced.
                let mut out = vec![vec![9u8; 5]; 11];
                comm.all_gather(&[], 0, &mut out).map(|()| out)
            },
        );
        for result in results {
            assert_eq!(result.unwrap(), vec![Vec::<u8>::new(); world_size]);
        }
    }
}

#[test]
fn a_thousand_rounds_with_changing_sizes() {
    const ROUNDS: usize = 1000;
    for world_size in [2, 3, 8] {
        let results = run_ranks(
            LocalGroup::new(world_size).into_communicators(),
            |mut comm| {
                let w = comm.world_size();
                let mut out = Vec::new();
                for round in 0..ROUNDS {
                    let local = payload(round, comm.rank());
                    comm.all_gather(&local, 64, &mut out)?;
                    assert_eq!(out.len(), w);
                    for (rank, got) in out.iter().enumerate() {
                        if *got != payload(round, rank) {
                            return Err(CommError::Transport(format!(
                                "round {round}: wrong bytes from rank {rank}"
                            )));
                        }
                    }
                }
                Ok(())
            },
        );
        for result in results {
            result.unwrap();
        }
    }
}

#[test]
fn steady_state_reuses_out_buffers() {
    let results = run_ranks(LocalGroup::new(3).into_communicators(), |mut comm| {
        let mut out = Vec::new();
        comm.all_gather(&[1u8; 100], 100, &mut out).unwrap();
        let pointers: Vec<*const u8> = out.iter().map(|b| b.as_ptr()).collect();
        for round in 0..50u8 {
            let local = vec![round; usize::from(round) % 100];
            comm.all_gather(&local, 100, &mut out).unwrap();
        }
        out.iter()
            .zip(&pointers)
            .all(|(b, &p)| std::ptr::eq(b.as_ptr(), p))
    });
    assert!(results.into_iter().all(|same| same));
}

#[test]
fn too_large_fails_every_rank_and_the_group_recovers() {
    let results = run_ranks(LocalGroup::new(4).into_communicators(), |mut comm| {
        let mut out = vec![vec![7u8; 3]];
        let len = if comm.rank() == 2 { 11 } else { 4 };
        let first = comm.all_gather(&vec![1u8; len], 10, &mut out);
        let untouched = out == vec![vec![7u8; 3]];
        let second = comm
            .all_gather(&[comm.rank() as u8], 10, &mut out)
            .map(|()| out);
        (first, untouched, second)
    });
    for (first, untouched, second) in results {
        match first {
            Err(CommError::TooLarge { rank, len, limit }) => {
                assert_eq!((rank, len, limit), (2, 11, 10));
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(untouched, "out must be left as it was on TooLarge");
        assert_eq!(second.unwrap(), vec![vec![0], vec![1], vec![2], vec![3]]);
    }
}

#[test]
fn limits_that_differ_name_the_first_rank_and_the_smallest_limit() {
    let results = run_ranks(LocalGroup::new(3).into_communicators(), |mut comm| {
        // Rank 0 allows only 5 bytes; ranks 1 and 2 send 6 and 7.
        let max_len = if comm.rank() == 0 { 5 } else { 100 };
        let local = vec![0u8; 5 + comm.rank()];
        let mut out = Vec::new();
        comm.all_gather(&local, max_len, &mut out)
    });
    for result in results {
        match result {
            Err(
                e @ CommError::LimitsDiffer {
                    rank,
                    len,
                    limit,
                    limit_rank,
                },
            ) => {
                assert_eq!((rank, len, limit, limit_rank), (1, 6, 5, 0));
                assert!(e.to_string().contains("configurations differ"), "{e}");
            }
            other => panic!("expected LimitsDiffer, got {other:?}"),
        }
    }
}

#[test]
fn a_buffer_over_its_own_limit_is_too_large_even_when_limits_differ() {
    // Rank 0 passes 5 and sends 6: over its own limit, so not a configuration difference.
    let results = run_ranks(LocalGroup::new(2).into_communicators(), |mut comm| {
        let (max_len, len) = if comm.rank() == 0 { (5, 6) } else { (100, 1) };
        let mut out = Vec::new();
        comm.all_gather(&vec![0u8; len], max_len, &mut out)
    });
    for result in results {
        match result {
            Err(CommError::TooLarge { rank, len, limit }) => {
                assert_eq!((rank, len, limit), (0, 6, 5));
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
}

#[test]
fn a_dropped_peer_is_an_error_not_a_hang() {
    let mut comms = LocalGroup::new(3).into_communicators();
    drop(comms.pop()); // rank 2 never takes part
    let results = run_ranks(comms, |mut comm| {
        let mut out = Vec::new();
        comm.all_gather(&[1, 2, 3], 16, &mut out)
    });
    // The group broke before the call: the call is refused as in a broken group, naming the
    // rank that left.
    for result in results {
        match result {
            Err(CommError::Broken { first }) => assert!(first.contains("rank 2"), "{first}"),
            other => panic!("expected Broken, got {other:?}"),
        }
    }
}

#[test]
fn a_peer_leaving_mid_run_is_an_error_not_a_hang() {
    let results = run_ranks(LocalGroup::new(4).into_communicators(), |mut comm| {
        let mut out = Vec::new();
        let rounds = if comm.rank() == 1 { 10 } else { 1000 };
        for round in 0..rounds {
            comm.all_gather(&payload(round, comm.rank()), 64, &mut out)?;
        }
        Ok(())
    });
    for (rank, result) in results.into_iter().enumerate() {
        if rank == 1 {
            result.unwrap();
        } else {
            // Waiting when rank 1 left, or calling after: a transport error or a broken group.
            assert!(
                matches!(
                    result,
                    Err(CommError::Transport(_) | CommError::Broken { .. })
                ),
                "{result:?}"
            );
        }
    }
}

#[test]
fn a_panicking_peer_is_an_error_not_a_hang() {
    let comms = LocalGroup::new(3).into_communicators();
    let (tx, rx) = mpsc::channel();
    let mut handles = Vec::new();
    for mut comm in comms {
        let tx = tx.clone();
        handles.push(thread::spawn(move || {
            let mut out = Vec::new();
            for round in 0..100 {
                assert!(
                    !(comm.rank() == 0 && round == 7),
                    "rank 0 panics on purpose in round 7"
                );
                if let Err(err) = comm.all_gather(&payload(round, comm.rank()), 64, &mut out) {
                    let _ = tx.send((comm.rank(), err));
                    return;
                }
            }
            panic!("rank {} finished 100 rounds without rank 0", comm.rank());
        }));
    }
    drop(tx);
    let mut failed = Vec::new();
    for _ in 0..2 {
        let (rank, err) = rx.recv_timeout(WATCHDOG).expect("a rank hung");
        assert!(
            matches!(err, CommError::Transport(_) | CommError::Broken { .. }),
            "{err:?}"
        );
        failed.push(rank);
    }
    failed.sort_unstable();
    assert_eq!(failed, vec![1, 2]);
    for (rank, handle) in handles.into_iter().enumerate() {
        assert_eq!(handle.join().is_err(), rank == 0);
    }
}

#[test]
fn a_silent_peer_times_out() {
    let mut comms = LocalGroup::new(2)
        .with_timeout(Some(Duration::from_millis(200)))
        .into_communicators();
    let silent = comms.pop().unwrap(); // alive, but never calls
    let results = run_ranks(comms, |mut comm| {
        let mut out = Vec::new();
        let first = comm.all_gather(&[1], 16, &mut out);
        let second = comm.all_gather(&[1], 16, &mut out);
        (first, second)
    });
    drop(silent);
    let (first, second) = results.into_iter().next().unwrap();
    match first {
        Err(CommError::Deadline { missing, round, .. }) => {
            assert_eq!((missing, round), (vec![1], 0))
        }
        other => panic!("expected a deadline naming rank 1, got {other:?}"),
    }
    // A call in a group that a deadline broke is refused, naming that first failure.
    match second {
        Err(CommError::Broken { first }) => {
            assert!(first.starts_with("rank 0: waited"), "{first}");
            assert!(first.contains("for ranks [1] in round 0"), "{first}");
        }
        other => panic!("expected the broken group, got {other:?}"),
    }
}

/// The deadline names every rank that did not arrive, on every rank that waits, and a group
/// built without a timeout gets the default one.
#[test]
fn the_deadline_names_the_missing_ranks() {
    let mut comms = LocalGroup::new(5)
        .with_timeout(Some(Duration::from_millis(300)))
        .into_communicators();
    let silent: Vec<_> = [comms.remove(4), comms.remove(1)].into();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            thread::spawn(move || {
                let mut out = Vec::new();
                comm.all_gather(&[1], 16, &mut out)
            })
        })
        .collect();
    for h in handles {
        let r = h.join().unwrap();
        match r {
            Err(CommError::Deadline { missing, .. }) => assert_eq!(missing, vec![1, 4]),
            other => panic!("{other:?}"),
        }
    }
    drop(silent);
    let debug = format!("{:?}", LocalGroup::new(2).into_communicators()[0]);
    assert!(debug.contains("300s"), "{debug}");
}

/// The all-to-all, the rank-order sum and the traffic counters, as `examples/mpi_selftest.rs`
/// checks them under MPI (`tests/common/collectives.rs`).
#[test]
fn all_to_all_sum_and_traffic_on_threads() {
    for w in 1..=5 {
        let results = run_ranks(LocalGroup::new(w).into_communicators(), |mut comm| {
            collectives::run_all(&mut comm)
        });
        for (rank, r) in results.into_iter().enumerate() {
            assert_eq!(r, Ok(()), "world size {w}, rank {rank}");
        }
    }
}

/// Ranks that call different collectives, or pass another number of buffers, fail alike.
#[test]
fn mismatched_calls_fail_every_rank() {
    let results = run_ranks(LocalGroup::new(3).into_communicators(), |mut comm| {
        let mut out = Vec::new();
        if comm.rank() == 2 {
            comm.all_gather(&[1], 16, &mut out)
        } else {
            comm.all_to_all(&[vec![1], vec![2], vec![3]], 16, &mut out)
        }
    });
    for r in results {
        assert!(
            matches!(r, Err(CommError::Mismatch { round: 0, .. })),
            "{r:?}"
        );
    }
    let results = run_ranks(LocalGroup::new(2).into_communicators(), |mut comm| {
        let mut x = vec![1.0f32; 10 + comm.rank()];
        comm.all_reduce_sum_f32(&mut x)
    });
    for r in results {
        assert!(r.is_err(), "{r:?}");
    }
}

/// Takes any communicator by value: `&mut C` and `Box<dyn Communicator>` qualify.
fn gather_via<C: Communicator>(mut comm: C, local: &[u8], out: &mut Vec<Vec<u8>>) {
    comm.all_gather(local, 1, out).unwrap();
}

#[test]
fn works_through_box_dyn_and_mut_ref() {
    let comms = LocalGroup::new(2).into_communicators();
    let results = run_ranks(comms, |comm| {
        let mut boxed: Box<dyn Communicator> = Box::new(comm);
        let mut out = Vec::new();
        let rank = boxed.rank() as u8;
        boxed.all_gather(&[rank], 1, &mut out).unwrap();
        gather_via(&mut boxed, &[rank + 10], &mut out);
        out
    });
    for out in results {
        assert_eq!(out, vec![vec![10], vec![11]]);
    }
}

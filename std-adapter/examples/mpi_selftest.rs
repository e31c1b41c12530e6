//! Self-test of `MpiCommunicator`: run it under `mpirun -np 4`. Every rank checks a series of
//! all-gathers (rank-dependent sizes, empty buffers, buffers around the inline size, forced
//! multi-round splits, a too-large buffer), then the checks every transport runs
//! (`tests/common/collectives.rs`), and prints `mpi_selftest rank R/W ok`, or
//! `... FAILED: why` and exits with 1.

use std::process::ExitCode;

use gradwire::comm::{CommError, Communicator, MpiCommunicator};
use mpi::traits::Communicator as _;

/// The bytes `rank` sends in `case`; length given by the caller.
fn payload(case: usize, rank: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (case.wrapping_mul(101) ^ rank.wrapping_mul(37) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

/// One all-gather where rank `r` sends `len_of(r)` bytes, verified on this rank.
fn check_round(
    comm: &mut MpiCommunicator,
    case: usize,
    max_len: usize,
    len_of: impl Fn(usize) -> usize,
    out: &mut Vec<Vec<u8>>,
) -> Result<(), String> {
    let local = payload(case, comm.rank(), len_of(comm.rank()));
    comm.all_gather(&local, max_len, out)
        .map_err(|err| format!("case {case}: {err}"))?;
    if out.len() != comm.world_size() {
        return Err(format!("case {case}: {} buffers", out.len()));
    }
    for (rank, got) in out.iter().enumerate() {
        if *got != payload(case, rank, len_of(rank)) {
            return Err(format!(
                "case {case}: wrong bytes from rank {rank} ({} bytes)",
                got.len()
            ));
        }
    }
    Ok(())
}

#[path = "../tests/common/collectives.rs"]
mod collectives;

fn run(comm: &mut MpiCommunicator) -> Result<(), String> {
    let w = comm.world_size();
    let mut out = Vec::new();
    let mut case = 0;

    // Rank-dependent sizes; rank 1 (or 0 alone) sends nothing; one round each.
    for round in 0..5 {
        case += 1;
        check_round(
            comm,
            case,
            1 << 16,
            |r| if r == 1 % w { 0 } else { 100 * r + round },
            &mut out,
        )?;
    }
    // Every buffer empty.
    case += 1;
    check_round(comm, case, 0, |_| 0, &mut out)?;
    // Around the 64 bytes that travel inside the header exchange: all at it, some one above,
    // lengths that are not multiples of 8.
    for len_of in [|_| 64, |r| 64 + r % 2, |r| 57 + r] as [fn(usize) -> usize; 3] {
        case += 1;
        check_round(comm, case, 4096, len_of, &mut out)?;
    }

    // Forced splits: tiny round budgets, including 1 byte per round and a budget that only
    // rank 0 sets (the group uses the smallest). Above 64 bytes, so that the buffers do not
    // travel inline and the rounds of MPI_Allgatherv run.
    for budget in [1, 7, 64, 1000] {
        comm.set_round_limit(budget);
        case += 1;
        check_round(comm, case, 4096, |r| 65 + 10 * r + 3 * (r % 2), &mut out)?;
        case += 1;
        check_round(comm, case, 4096, |r| if r == 0 { 0 } else { 257 }, &mut out)?;
    }
    comm.set_round_limit(if comm.rank() == 0 { 5 } else { 1 << 20 });
    case += 1;
    check_round(comm, case, 4096, |r| 65 + r, &mut out)?;

    // A megabyte per rank in 100 kB rounds.
    comm.set_round_limit(100_000);
    case += 1;
    check_round(comm, case, 2 << 20, |r| (1 << 20) + r * 1111, &mut out)?;
    comm.set_round_limit(MpiCommunicator::MAX_ROUND_BYTES);

    // The last rank sends one byte too many: every rank fails alike, `out` is untouched,
    // and the next round works.
    let last = w - 1;
    let local = vec![0u8; if comm.rank() == last { 11 } else { 3 }];
    let before = out.clone();
    match comm.all_gather(&local, 10, &mut out) {
        Err(CommError::TooLarge { rank, len, limit }) if (rank, len, limit) == (last, 11, 10) => {}
        other => {
            return Err(format!(
                "too large: expected TooLarge for rank {last}: {other:?}"
            ));
        }
    }
    if out != before {
        return Err("too large: out was modified".into());
    }
    case += 1;
    check_round(comm, case, 64, |r| r + 1, &mut out)?;
    // Rank 0 in the rank-order sum while the others all-gather (an application bug): every
    // rank fails alike, and the next calls work.
    let mut x = vec![1.0f32; 4];
    let r = if comm.rank() == 0 {
        comm.all_reduce_sum_f32(&mut x)
    } else {
        comm.all_gather(&[1, 2], 64, &mut out)
    };
    match r {
        Err(CommError::Mismatch { .. }) if w > 1 => {}
        Ok(()) if w == 1 => {}
        other => return Err(format!("sum against all-gather: {other:?}")),
    }
    // The all-to-all, the rank-order sum and the traffic counters, as the threads' test runs
    // them.
    collectives::run_all(comm)
}

fn main() -> ExitCode {
    let mut comm = match MpiCommunicator::init() {
        Ok(comm) => comm,
        Err(err) => {
            eprintln!("mpi_selftest: {err}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, w) = (comm.rank(), comm.world_size());
    match run(&mut comm) {
        Ok(()) => {
            println!("mpi_selftest rank {rank}/{w} ok");
            ExitCode::SUCCESS
        }
        Err(why) => {
            println!("mpi_selftest rank {rank}/{w} FAILED: {why}");
            // The peers may be waiting in a collective call that this rank will never make:
            // end the whole job rather than let it hang.
            comm.universe().world().abort(1)
        }
    }
}

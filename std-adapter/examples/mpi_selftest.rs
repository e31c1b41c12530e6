//! Self-test of `MpiCommunicator`: run it under `mpirun -np 4`. Every rank checks a series of
//! all-gathers (rank-dependent sizes, empty buffers, buffers around the inline size, forced
//! multi-round splits, a too-large buffer), then the checks every transport runs
//! (`tests/common/collectives.rs`), then non-blocking steps of a compressed all-reduce against
//! the blocking calls of the same group simulated on threads, and prints
//! `mpi_selftest rank R/W ok`, or `... FAILED: why` and exits with 1.

use std::process::ExitCode;

use gradwire::comm::{CommError, Communicator, LocalGroup, MpiCommunicator};
use gradwire::core::{K, Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{
    Collective, CompressedAllReduce, CompressionMethod, NonBlockingAllReduce, TensorMut,
};
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

/// A bucket: name, shape and values of each of its tensors.
type Bucket = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Rank `rank`'s buckets at step `step`: three buckets of a small model, seeded noise.
fn buckets(rank: usize, step: u64) -> Vec<Bucket> {
    let mut state = 0x9e37_79b9_u64 ^ (rank as u64) << 20 ^ step;
    let mut t = |name: &str, shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|_| {
                // SplitMix64, then a value in [-1, 1).
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        (name.to_string(), shape, data)
    };
    vec![
        vec![t("head.weight", vec![40, 50]), t("head.bias", vec![40])],
        vec![t("block.mlp", vec![3000])],
        vec![t("embed", vec![120, 100]), t("norm", vec![7])],
    ]
}

/// The all-reduce of the non-blocking check: top-k 5% int8 with error feedback, on the
/// all-gather (the two-phase collective runs through handles in `tests/non_blocking.rs`).
fn all_reduce(comm: Box<dyn Communicator>) -> CompressedAllReduce {
    let method = CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.05),
        values: Values::Int8 { block: 64 },
    })
    .with_error_feedback();
    CompressedAllReduce::with_communicator(method, comm).with_collective(Collective::AllGather)
}

/// Steps of the non-blocking check: every call's results (bits), then every residual.
type Steps = (Vec<Vec<u32>>, Vec<u32>);

const NB_STEPS: u64 = 10;

#[path = "../tests/common/residuals.rs"]
mod residuals;
use residuals::residual_bits;

/// The blocking calls of a group of `w` ranks, simulated on `LocalGroup` threads, every
/// bucket of a model step at its number.
fn blocking_group(w: usize) -> Result<Vec<Steps>, String> {
    let ranks: Vec<_> = LocalGroup::new(w)
        .into_communicators()
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || -> Result<Steps, String> {
                let rank = comm.rank();
                let mut ar = all_reduce(Box::new(comm));
                let mut calls = Vec::new();
                for s in 0..NB_STEPS {
                    for mut bucket in buckets(rank, s) {
                        ar.compressor_mut().set_step(s);
                        let mut views: Vec<TensorMut<'_>> = bucket
                            .iter_mut()
                            .map(|(name, shape, data)| TensorMut { name, shape, data })
                            .collect();
                        ar.all_reduce_in_place(&mut views)
                            .map_err(|e| format!("blocking step {s}: {e}"))?;
                        calls.push(
                            bucket
                                .iter()
                                .flat_map(|t| t.2.iter().map(|x| x.to_bits()))
                                .collect(),
                        );
                    }
                }
                Ok((calls, residual_bits(&ar)))
            })
        })
        .collect();
    ranks
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| "a simulated rank panicked".to_string())?
        })
        .collect()
}

/// The same steps through `NonBlockingAllReduce` on `ar`, every bucket of a step started
/// before the first is waited for (three in flight), the last one ending the model step.
fn through_handles(ar: CompressedAllReduce, rank: usize) -> Result<Steps, String> {
    let mut nb = NonBlockingAllReduce::spawn(ar, 3).map_err(|e| e.to_string())?;
    let mut calls = Vec::new();
    for s in 0..NB_STEPS {
        let mut pending = Vec::new();
        let model = buckets(rank, s);
        let last = model.len() - 1;
        for (i, bucket) in model.into_iter().enumerate() {
            let tensors = bucket
                .into_iter()
                .map(|(name, shape, data)| Ok((name, Tensor::new(shape, data)?)))
                .collect::<gradwire::Result<Vec<_>>>()
                .map_err(|e| e.to_string())?;
            pending.push(nb.start(tensors, i == last).map_err(|e| e.to_string())?);
        }
        for p in pending {
            let (tensors, result) = p.wait();
            result.map_err(|e| format!("non-blocking step {s}: {e}"))?;
            calls.push(
                tensors
                    .iter()
                    .flat_map(|(_, t)| t.data().iter().map(|x| x.to_bits()))
                    .collect(),
            );
        }
    }
    let ar = nb.finish().map_err(|e| e.to_string())?;
    Ok((calls, residual_bits(&ar)))
}

/// Non-blocking steps over MPI (issue 47 scope 1): ten steps of three buckets, three in
/// flight, through `NonBlockingAllReduce` on this communicator (its calls made on the
/// all-reduce's thread, not the one that built it), against the blocking calls of a group of
/// the same size simulated on threads in this process: this rank's results and residuals bit
/// for bit. Takes the communicator (MPI ends when the all-reduce is dropped); every rank
/// fails alike (the same thread level, collective errors, the same comparison), so none
/// waits.
fn non_blocking(comm: MpiCommunicator) -> Result<(), String> {
    let threading = comm.threading();
    if threading < mpi::Threading::Serialized {
        // A call from the all-reduce's thread would end the job (MPI_Abort): fail with why.
        return Err(format!(
            "MPI provides {threading:?} thread support; steps on a thread of their own need \
             MPI_THREAD_SERIALIZED"
        ));
    }
    let (rank, w) = (comm.rank(), comm.world_size());
    let want = blocking_group(w)?;
    let got = through_handles(all_reduce(Box::new(comm)), rank)?;
    if got != want[rank] {
        return Err("non-blocking steps differ from the blocking calls".into());
    }
    Ok(())
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
    if let Err(why) = run(&mut comm) {
        println!("mpi_selftest rank {rank}/{w} FAILED: {why}");
        // The peers may be waiting in a collective call that this rank will never make:
        // end the whole job rather than let it hang.
        comm.universe().world().abort(1)
    }
    match non_blocking(comm) {
        Ok(()) => {
            println!("mpi_selftest rank {rank}/{w} ok");
            ExitCode::SUCCESS
        }
        Err(why) => {
            println!("mpi_selftest rank {rank}/{w} FAILED: {why}");
            ExitCode::FAILURE
        }
    }
}

//! Self-test of `MpiCommunicator`: run it under `mpirun -np 4`. Every rank checks a series of
//! all-gathers (rank-dependent sizes, empty buffers, buffers around the inline size, forced
//! multi-round splits, a too-large buffer), then the checks every transport runs
//! (`tests/common/collectives.rs`), then non-blocking steps of a compressed all-reduce against
//! the blocking calls of the same group simulated on threads, and prints
//! `mpi_selftest rank R/W ok`, or `... FAILED: why` and exits with 1.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

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

/// The all-reduce of the non-blocking check: top-k 5% int8 with error feedback.
fn all_reduce(comm: Box<dyn Communicator>, collective: Collective) -> CompressedAllReduce {
    let method = CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.05),
        values: Values::Int8 { block: 64 },
    })
    .with_error_feedback();
    CompressedAllReduce::with_communicator(method, comm).with_collective(collective)
}

/// Steps of the non-blocking check: every call's results (bits), then every residual.
type Steps = (Vec<Vec<u32>>, Vec<u32>);

const NB_STEPS: u64 = 10;

/// Each step's model: its three buckets on the all-gather, the whole model as one on the
/// two-phase collective (its server residuals belong to one layout).
fn step_buckets(rank: usize, step: u64, collective: Collective) -> Vec<Bucket> {
    let b = buckets(rank, step);
    match collective {
        Collective::TwoPhase => vec![b.into_iter().flatten().collect()],
        _ => b,
    }
}

fn residual_bits(ar: &CompressedAllReduce) -> Vec<u32> {
    ar.compressor()
        .feedback()
        .map(|fb| {
            fb.residuals()
                .flat_map(|(_, r)| r.iter().map(|x| x.to_bits()))
                .collect()
        })
        .unwrap_or_default()
}

/// The blocking calls of a group of `w` ranks, simulated on `LocalGroup` threads.
fn blocking_group(w: usize, collective: Collective) -> Result<Vec<Steps>, String> {
    let ranks: Vec<_> = LocalGroup::new(w)
        .into_communicators()
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || -> Result<Steps, String> {
                let rank = comm.rank();
                let mut ar = all_reduce(Box::new(comm), collective);
                let mut calls = Vec::new();
                for s in 0..NB_STEPS {
                    for mut bucket in step_buckets(rank, s, collective) {
                        // Every bucket of a model step at its number, as the handles run them.
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

/// The same steps through `NonBlockingAllReduce` on `comm`, every bucket of a step started
/// before the first is waited for (three in flight), the last one ending the model step.
fn through_handles(
    ar: CompressedAllReduce,
    rank: usize,
    collective: Collective,
) -> Result<Steps, String> {
    let mut nb = NonBlockingAllReduce::spawn(ar, 3).map_err(|e| e.to_string())?;
    let mut calls = Vec::new();
    for s in 0..NB_STEPS {
        let mut pending = Vec::new();
        let model = step_buckets(rank, s, collective);
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

/// The MPI communicator shared between the all-reduces of the non-blocking check (each owns
/// its communicator) and `main`, which keeps it to end the job on a failure.
#[derive(Clone)]
struct Shared(Arc<Mutex<MpiCommunicator>>);

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, MpiCommunicator> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Communicator for Shared {
    fn rank(&self) -> usize {
        self.lock().rank()
    }
    fn world_size(&self) -> usize {
        self.lock().world_size()
    }
    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.lock().all_gather(local, max_len, out)
    }
    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.lock().all_gather_append(local, max_len, out)
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.lock().all_to_all(send, max_len, out)
    }
    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.lock().all_to_all_append(send, max_len, out)
    }
    fn traffic(&self) -> gradwire::comm::Traffic {
        self.lock().traffic()
    }
    fn close(&mut self, reason: &str) -> Option<String> {
        self.lock().close(reason)
    }
    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        self.lock().all_reduce_sum_f32(x)
    }
}

/// Non-blocking steps over MPI (issue 47 scope 1), on the all-gather and then the two-phase
/// collective: ten steps, three in flight, through `NonBlockingAllReduce` on this
/// communicator (its calls made on the all-reduce's thread, not the one that built it),
/// against the blocking calls of a group of the same size simulated on threads in this
/// process: this rank's results and residuals bit for bit.
fn non_blocking(comm: &Shared) -> Result<(), String> {
    let threading = comm.lock().threading();
    if threading < mpi::Threading::Serialized {
        // A call from the all-reduce's thread would end the job (MPI_Abort): fail with why.
        return Err(format!(
            "MPI provides {threading:?} thread support; steps on a thread of their own need \
             MPI_THREAD_SERIALIZED"
        ));
    }
    let (rank, w) = (comm.rank(), comm.world_size());
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let want = blocking_group(w, collective)?;
        let got = through_handles(
            all_reduce(Box::new(comm.clone()), collective),
            rank,
            collective,
        )?;
        if got != want[rank] {
            return Err(format!(
                "{collective:?}: non-blocking steps differ from the blocking calls"
            ));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let comm = match MpiCommunicator::init() {
        Ok(comm) => comm,
        Err(err) => {
            eprintln!("mpi_selftest: {err}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, w) = (comm.rank(), comm.world_size());
    let shared = Shared(Arc::new(Mutex::new(comm)));
    // The guard of `run`'s lock ends with its statement, before the all-reduces lock it.
    let result = run(&mut shared.lock());
    let result = result.and_then(|()| non_blocking(&shared));
    match result {
        Ok(()) => {
            println!("mpi_selftest rank {rank}/{w} ok");
            ExitCode::SUCCESS
        }
        Err(why) => {
            println!("mpi_selftest rank {rank}/{w} FAILED: {why}");
            // The peers may be waiting in a collective call that this rank will never make:
            // end the whole job rather than let it hang.
            shared.lock().universe().world().abort(1)
        }
    }
}

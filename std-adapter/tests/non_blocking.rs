//! Non-blocking steps (issue 47 scope 1): `NonBlockingAllReduce` runs the blocking calls of
//! `CompressedAllReduce` on a thread of its own, the tensors moved in at `start` and given back
//! by `wait`, every bucket of a model step at that step's number. Buckets started with several
//! in flight give the blocking calls' results and residuals bit for bit (each blocking call at
//! the model step's number); every fault of the blocking path fails the same call alike; after
//! a transport error every later call fails naming the first failure.

use gradwire::comm::{CommError, Communicator, LocalCommunicator, LocalGroup};
use gradwire::core::{K, Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{
    Collective, CompressedAllReduce, CompressionMethod, Error, NonBlockingAllReduce,
    PendingAllReduce,
};

mod common;
#[path = "common/ranks.rs"]
mod ranks;
#[path = "common/residuals.rs"]
mod residuals;
use common::{Owned, Rng, views};
use ranks::run_ranks;
use residuals::residual_bits;

const W: usize = 3;
const STEPS: u64 = 10;

/// Rank `r`'s buckets at step `s`: three buckets of the model (a step each).
fn buckets(r: usize, s: u64) -> Vec<Owned> {
    let mut rng = Rng(7919 * r as u64 + 31 * s + 5);
    let mut t = |name: &str, shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        (name.to_string(), shape, rng.vec(n, scale))
    };
    vec![
        vec![
            t("head.weight", vec![40, 50], 1.0),
            t("head.bias", vec![40], 2.0),
        ],
        vec![t("block.mlp", vec![3000], 0.5)],
        vec![t("embed", vec![120, 100], 0.25), t("norm", vec![7], 3.0)],
    ]
}

/// The whole model at step `s` as one bucket (the two-phase collective with error feedback
/// keeps server residuals of one layout).
fn whole(r: usize, s: u64) -> Vec<Owned> {
    vec![buckets(r, s).into_iter().flatten().collect()]
}

/// A bucket's tensors moved into `Tensor`s (no copy), for `NonBlockingAllReduce::start`.
fn tensors(bucket: Owned) -> Vec<(String, Tensor)> {
    bucket
        .into_iter()
        .map(|(name, shape, data)| (name, Tensor::new(shape, data).unwrap()))
        .collect()
}

fn topk_int8_ef() -> CompressionMethod {
    CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.05),
        values: Values::Int8 { block: 64 },
    })
    .with_error_feedback()
}

fn sign_ef() -> CompressionMethod {
    CompressionMethod::Core(Method::Sign {
        scale: gradwire::core::SignScale::MeanAbs { block: 32 },
        zero_mask: false,
    })
    .with_error_feedback()
}

fn quant4_ef() -> CompressionMethod {
    CompressionMethod::Core(Method::Quant {
        bits: 4,
        block: 64,
        rounding: gradwire::core::Rounding::NearestEven,
    })
    .with_error_feedback()
}

fn randomk_ef() -> CompressionMethod {
    // Its indices are drawn from (seed, step, tensor): the step number of each bucket shows.
    CompressionMethod::Core(Method::RandomK {
        k: K::Ratio(0.1),
        values: Values::F16,
        unbiased: false,
    })
    .with_error_feedback()
}

fn dense_f32() -> CompressionMethod {
    CompressionMethod::Core(Method::Dense {
        values: Values::F32,
    })
}

/// A configuration under test: method, collective, how a step's model is cut.
type Setup = (
    fn() -> CompressionMethod,
    Collective,
    fn(usize, u64) -> Vec<Owned>,
);

/// One rank's record: every bucket's results (as bits) or error text, step by step, then
/// every worker residual (name order) after the last step.
type Record = (Vec<std::result::Result<Vec<u32>, String>>, Vec<u32>);

fn bits<'a>(values: impl IntoIterator<Item = &'a [f32]>) -> Vec<u32> {
    values
        .into_iter()
        .flat_map(|v| v.iter().map(|x| x.to_bits()))
        .collect()
}

fn all_reduce(setup: Setup, comm: LocalCommunicator) -> CompressedAllReduce {
    CompressedAllReduce::with_communicator((setup.0)(), Box::new(comm)).with_collective(setup.1)
}

/// Rank `rank`'s buckets at step `s`; `poison` writes a NaN into rank `.0`'s first bucket at
/// step `.1`.
fn gradients(setup: Setup, rank: usize, s: u64, poison: Option<(usize, u64)>) -> Vec<Owned> {
    let mut b = (setup.2)(rank, s);
    if poison == Some((rank, s)) {
        b[0][0].2[3] = f32::NAN;
    }
    b
}

/// The blocking calls, bucket by bucket, each at its model step's number.
fn blocking(setup: Setup, poison: Option<(usize, u64)>) -> Vec<Record> {
    run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
        let rank = comm.rank();
        let mut ar = all_reduce(setup, comm);
        let mut results = Vec::new();
        for s in 0..STEPS {
            for mut bucket in gradients(setup, rank, s, poison) {
                ar.compressor_mut().set_step(s);
                let result = ar.all_reduce_in_place(&mut views(&mut bucket));
                let out = bits(bucket.iter().map(|t| t.2.as_slice()));
                results.push(result.map(|()| out).map_err(|e| e.to_string()));
            }
        }
        assert_eq!(ar.compressor().step(), STEPS);
        (results, residual_bits(&ar))
    })
}

/// Starts every bucket of a model step, the last one ending it.
fn start_all(nb: &mut NonBlockingAllReduce, model: Vec<Owned>) -> Vec<PendingAllReduce> {
    let last = model.len() - 1;
    model
        .into_iter()
        .enumerate()
        .map(|(i, bucket)| nb.start(tensors(bucket), i == last).unwrap())
        .collect()
}

/// The same steps through handles: every bucket of a step started, then waited for (the last
/// first), `in_flight` at most at a time.
fn non_blocking(setup: Setup, poison: Option<(usize, u64)>, in_flight: usize) -> Vec<Record> {
    run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
        let rank = comm.rank();
        let mut nb = NonBlockingAllReduce::spawn(all_reduce(setup, comm), in_flight).unwrap();
        let mut results = Vec::new();
        for s in 0..STEPS {
            let handles = start_all(&mut nb, gradients(setup, rank, s, poison));
            let mut done: Vec<_> = handles.into_iter().rev().map(|h| h.wait()).collect();
            done.reverse();
            for (tensors, result) in done {
                let out = bits(tensors.iter().map(|(_, t)| t.data()));
                results.push(result.map(|()| out).map_err(|e| e.to_string()));
            }
        }
        let ar = nb.finish().unwrap();
        assert_eq!(ar.compressor().step(), STEPS);
        (results, residual_bits(&ar))
    })
}

const SETUPS: [Setup; 6] = [
    (topk_int8_ef, Collective::AllGather, buckets),
    (randomk_ef, Collective::AllGather, buckets),
    (sign_ef, Collective::AllGather, buckets),
    (quant4_ef, Collective::TwoPhase, whole),
    (topk_int8_ef, Collective::TwoPhase, whole),
    (dense_f32, Collective::AllGather, buckets),
];

#[test]
fn steps_in_flight_equal_the_blocking_calls_bit_for_bit() {
    for (i, setup) in SETUPS.into_iter().enumerate() {
        let want = blocking(setup, None);
        for in_flight in [1, 3] {
            let got = non_blocking(setup, None, in_flight);
            for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.0.len(), w.0.len(), "setup {i} rank {rank}");
                for (call, (a, b)) in g.0.iter().zip(&w.0).enumerate() {
                    assert!(a.is_ok(), "setup {i} rank {rank} call {call}: {a:?}");
                    assert_eq!(a, b, "setup {i} rank {rank} call {call}: results differ");
                }
                assert_eq!(g.1, w.1, "setup {i} rank {rank}: residuals differ");
            }
        }
    }
}

#[test]
fn a_rank_s_local_error_fails_that_step_on_every_rank_alike_and_later_steps_run() {
    // Rank 1's first bucket holds a NaN at step 4: that call fails on every rank (rank 1 with
    // its own error, the others naming rank 1), as the blocking calls fail; every other call
    // succeeds with the blocking results, and the residuals end the same.
    for setup in [SETUPS[0], SETUPS[3]] {
        let poison = Some((1, 4));
        let want = blocking(setup, poison);
        let got = non_blocking(setup, poison, 3);
        for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "rank {rank}");
            let failed: Vec<usize> = (0..g.0.len()).filter(|&c| g.0[c].is_err()).collect();
            let per_step = (setup.2)(0, 0).len();
            assert_eq!(failed, vec![4 * per_step], "rank {rank}: {:?}", g.0);
        }
    }
}

#[test]
fn after_a_transport_error_every_later_step_fails_naming_the_first_failure() {
    // Rank 2 runs two steps, then leaves the group (its communicator dropped); ranks 0 and 1
    // have four more steps in flight: the first fails naming rank 2's departure (at the
    // transport, or refused in the broken group), every later one with `Broken` naming that
    // same failure, and no rank waits forever.
    let setup = SETUPS[0];
    let got = run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
        let rank = comm.rank();
        let mut nb = NonBlockingAllReduce::spawn(all_reduce(setup, comm), 6).unwrap();
        let whole_steps = if rank == 2 { 2 } else { 6 };
        let mut results = Vec::new();
        for s in 0..whole_steps {
            let h = nb.start(tensors(whole(rank, s).remove(0)), true).unwrap();
            results.push(h);
        }
        // Every step in flight at once on ranks 0 and 1 when rank 2 leaves.
        let results: Vec<_> = results.into_iter().map(|h| h.wait().1).collect();
        drop(nb.finish().unwrap());
        results
    });
    assert!(got[2].iter().all(Result::is_ok), "{:?}", got[2]);
    for (rank, r) in got.iter().enumerate().take(2) {
        assert_eq!(r.len(), 6);
        assert!(r[..2].iter().all(Result::is_ok), "rank {rank}: {r:?}");
        // The failure itself when the step was under way as rank 2 left; the group's record
        // of it when the step started after (a call in a broken group is refused).
        let first = match &r[2] {
            Err(Error::Comm {
                source: CommError::Broken { first },
            }) => first.clone(),
            Err(Error::Comm { source }) => source.to_string(),
            other => panic!("rank {rank}: {other:?}"),
        };
        assert!(first.contains("rank 2"), "rank {rank}: {first}");
        for later in &r[3..] {
            match later {
                Err(Error::Comm {
                    source: CommError::Broken { first: f },
                }) => assert_eq!(f, &first, "rank {rank}"),
                other => panic!("rank {rank}: {other:?}"),
            }
        }
    }
}

#[test]
fn the_all_reduce_given_back_goes_on_as_the_blocking_one() {
    // After `finish`, a blocking step continues the same step sequence: its results and
    // residuals are those of an all-reduce that made every call blocking.
    let setup = SETUPS[0];
    let run = |through_handles: bool| {
        run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
            let rank = comm.rank();
            let mut ar = all_reduce(setup, comm);
            let mut first: Owned = buckets(rank, 0).into_iter().flatten().collect();
            let first_bits = if through_handles {
                let mut nb = NonBlockingAllReduce::spawn(ar, 2).unwrap();
                let (t, r) = nb.start(tensors(first), true).unwrap().wait();
                r.unwrap();
                ar = nb.finish().unwrap();
                bits(t.iter().map(|(_, t)| t.data()))
            } else {
                ar.all_reduce_in_place(&mut views(&mut first)).unwrap();
                bits(first.iter().map(|t| t.2.as_slice()))
            };
            let mut second: Owned = buckets(rank, 1).into_iter().flatten().collect();
            ar.all_reduce_in_place(&mut views(&mut second)).unwrap();
            let second_bits = bits(second.iter().map(|t| t.2.as_slice()));
            (
                first_bits,
                second_bits,
                residual_bits(&ar),
                ar.compressor().step(),
            )
        })
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn no_step_or_too_many_in_flight_are_refused() {
    for bad in [0, 1025, usize::MAX] {
        let ar = CompressedAllReduce::new(topk_int8_ef(), 1);
        assert!(
            matches!(
                NonBlockingAllReduce::spawn(ar, bad),
                Err(Error::Config { .. })
            ),
            "{bad}"
        );
    }
    let ar = CompressedAllReduce::new(topk_int8_ef(), 1);
    assert!(NonBlockingAllReduce::spawn(ar, 1024).is_ok());
}

/// One rank's record of a mixed-precision run: each step's buckets as bits (its error text
/// otherwise), the step number at the end, every worker residual, and whether error-feedback
/// state exists.
type SkipRecord = (
    Vec<Vec<std::result::Result<Vec<u32>, String>>>,
    u64,
    Vec<u32>,
    bool,
);

/// A non-blocking all-reduce of `method` with `with_skip_non_finite`, three steps in flight.
fn skipping_all_reduce(method: CompressionMethod, comm: LocalCommunicator) -> NonBlockingAllReduce {
    let ar =
        CompressedAllReduce::with_communicator(method, Box::new(comm)).with_skip_non_finite(true);
    NonBlockingAllReduce::spawn(ar, 3).unwrap()
}

/// `STEPS` model steps of `model`'s buckets through handles with `with_skip_non_finite`, all
/// in flight before the first wait; `poison`: rank 1's bucket `.0` holds a NaN at step `.1`;
/// `omit`: step `.1` is left out (the run that never had it).
fn skipping(
    method: fn() -> CompressionMethod,
    model: fn(usize, u64) -> Vec<Owned>,
    poison: (usize, u64),
    omit: bool,
) -> Vec<SkipRecord> {
    run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
        let rank = comm.rank();
        let mut nb = skipping_all_reduce(method(), comm);
        let mut steps = Vec::new();
        for s in 0..STEPS {
            if omit && s == poison.1 {
                continue;
            }
            let mut buckets = model(rank, s);
            if !omit && rank == 1 && s == poison.1 {
                buckets[poison.0][0].2[3] = f32::NAN;
            }
            let step = start_all(&mut nb, buckets)
                .into_iter()
                .map(|h| {
                    let (tensors, result) = h.wait();
                    let out = bits(tensors.iter().map(|(_, t)| t.data()));
                    result.map(|()| out).map_err(|e| e.to_string())
                })
                .collect();
            steps.push(step);
        }
        let ar = nb.finish().unwrap();
        let has_feedback = ar.compressor().feedback().is_some();
        (
            steps,
            ar.compressor().step(),
            residual_bits(&ar),
            has_feedback,
        )
    })
}

/// Three buckets of which the first two both hold a tensor named `shared` (a name may come in
/// two buckets of one model step: its residual is stepped twice).
fn shared_name(r: usize, s: u64) -> Vec<Owned> {
    let mut b = buckets(r, s);
    let mut rng = Rng(911 * r as u64 + 17 * s + 3);
    b[0].insert(0, ("shared".to_string(), vec![300], rng.vec(300, 1.0)));
    b[1].push(("shared".to_string(), vec![300], rng.vec(300, 1.0)));
    b
}

/// Mixed precision through handles (issue 47 scope 5): a model step with a NaN in one rank's
/// bucket is skipped whole. That bucket and every later one of the step come back all NaN on
/// every rank (the later ones without an exchange), the residuals of the buckets before it are
/// put back (a name stepped in two of them too), and the step number stays; every other step,
/// the step number and the residuals at the end are those of a run that never had that step,
/// bit for bit (random-k: its indices follow the step number); a skip at the first step leaves
/// no error-feedback state, as before it.
#[test]
fn a_model_step_with_a_non_finite_bucket_is_skipped_whole_and_its_earlier_buckets_give_back() {
    let nan = f32::NAN.to_bits();
    let mut cases = Vec::new();
    for method in [topk_int8_ef as fn() -> CompressionMethod, randomk_ef] {
        for bucket in 0..3 {
            for step in [0, 4] {
                cases.push((
                    method,
                    buckets as fn(usize, u64) -> Vec<Owned>,
                    (bucket, step),
                ));
            }
        }
        cases.push((method, shared_name, (2, 4)));
    }
    for (method, model, poison) in cases {
        let bucket = poison.0;
        let skipped = skipping(method, model, poison, false);
        let never = skipping(method, model, poison, true);
        for (rank, (with, without)) in skipped.iter().zip(&never).enumerate() {
            let at = usize::try_from(poison.1).unwrap();
            for (i, result) in with.0[at].iter().enumerate() {
                let out = result.as_ref().unwrap();
                if i >= bucket {
                    assert!(out.iter().all(|&x| x == nan), "rank {rank}, bucket {i}");
                } else {
                    // Handed back before the verdict: void, and finite.
                    assert!(out.iter().all(|&x| f32::from_bits(x).is_finite()));
                }
            }
            let mut others = with.0.clone();
            others.remove(at);
            // (Compared as booleans: a difference would print megabytes of bits.)
            assert!(
                others == without.0,
                "rank {rank}: other results, poison {poison:?}"
            );
            assert_eq!(with.1, STEPS - 1);
            assert_eq!(with.1, without.1);
            assert!(
                with.2 == without.2,
                "rank {rank}: other residuals, poison {poison:?}"
            );
            assert_eq!(with.3, without.3);
        }
    }

    // A skip at the very first step: its first bucket created the error-feedback state, and
    // none is left, as before the step.
    let fresh = run_ranks(LocalGroup::new(W).into_communicators(), |comm| {
        let rank = comm.rank();
        let mut nb = skipping_all_reduce(topk_int8_ef(), comm);
        let mut model = buckets(rank, 0);
        if rank == 1 {
            model[2][0].2[0] = f32::INFINITY;
        }
        for h in start_all(&mut nb, model) {
            h.wait().1.unwrap();
        }
        let ar = nb.finish().unwrap();
        (
            ar.last_step_skipped(),
            ar.compressor().step(),
            ar.compressor().feedback().is_none(),
        )
    });
    assert!(fresh.iter().all(|&r| r == (true, 0, true)), "{fresh:?}");

    // A rank whose own call fails before it could write its tensors (a name given twice) while
    // another rank's gradient is not finite: the group's verdict is the skip, and that rank's
    // bucket comes back all NaN too.
    let mixed = run_ranks(LocalGroup::new(W).into_communicators(), |comm| {
        let rank = comm.rank();
        let mut nb = skipping_all_reduce(topk_int8_ef(), comm);
        let mut model = buckets(rank, 0);
        match rank {
            0 => model[2][1].0 = model[2][0].0.clone(),
            1 => model[2][0].2[0] = f32::NAN,
            _ => {}
        }
        let done: Vec<_> = start_all(&mut nb, model)
            .into_iter()
            .map(|h| h.wait())
            .collect();
        let (last, result) = &done[2];
        (
            result.is_ok(),
            last.iter()
                .all(|(_, t)| t.data().iter().all(|x| x.is_nan())),
        )
    });
    assert!(mixed.iter().all(|&r| r == (true, true)), "{mixed:?}");
}

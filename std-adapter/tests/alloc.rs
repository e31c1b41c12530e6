//! Steady state allocates nothing: a second `compress_into` (and bundle, decode and aggregate
//! calls) of the same model allocates no memory. Counted with a global allocator, in its own
//! test binary. These run the serial path ([`Parallelism::Serial`]); `alloc_parallel.rs`
//! counts the parallel path.

mod common;

use std::collections::HashMap;

use common::{Rng, minilm, noisy};
use gradwire::BucketConfig;
use gradwire::Manifest;
use gradwire::Parallelism;
use gradwire::tensor::Tensor;
use gradwire::{Aggregator, Reduction};
use gradwire::{CompressionMethod, GradientCompressor};

#[path = "common/counting.rs"]
mod counting;

use counting::allocations;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

#[test]
fn counter_works() {
    let n = allocations(|| {
        let v = vec![1u8; 10];
        std::hint::black_box(v);
    });
    assert_eq!(n, 1);
}

#[test]
fn second_compress_into_allocates_nothing() {
    let base = minilm();
    let step0 = noisy(&base, &mut Rng(1), 0.5);
    let step1 = noisy(&base, &mut Rng(2), 0.5);
    for method in [
        CompressionMethod::top_k_int8(0.01),
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        CompressionMethod::Threshold { threshold: 1e-3 }.with_error_feedback(),
        CompressionMethod::SignSGD.with_error_feedback(),
        CompressionMethod::Quantization { bits: 4 },
        CompressionMethod::RandomK { k: 1000 },
    ] {
        let mut c = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial);
        let mut out = HashMap::new();
        c.compress_into(&step0, &mut out).unwrap();
        let n = allocations(|| c.compress_into(&step0, &mut out).unwrap());
        assert_eq!(
            n, 0,
            "{method:?}: second compress_into of the same gradients"
        );
        let n = allocations(|| c.compress_into(&step1, &mut out).unwrap());
        assert_eq!(
            n, 0,
            "{method:?}: compress_into of the next step's gradients"
        );
    }
}

#[test]
fn steady_state_bundles_decode_and_aggregate_allocate_nothing() {
    let base = minilm();
    let ranks: Vec<HashMap<String, Tensor>> = (0..3)
        .map(|r| noisy(&base, &mut Rng(10 + r), 0.5))
        .collect();
    let method = CompressionMethod::top_k_int8(0.01).with_error_feedback();
    for bucketing in [BucketConfig::none(), BucketConfig::fused(64 << 10)] {
        let manifest = Manifest::for_gradients(&base, &method, 0, bucketing).unwrap();
        let mut senders: Vec<GradientCompressor> = (0..3)
            .map(|_| GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial))
            .collect();
        let mut bundles: Vec<Vec<u8>> = vec![Vec::new(); 3];
        let mut flat = Vec::new();
        let mut decoded = Vec::new();
        let mut tensors = HashMap::new();
        let mut agg = Aggregator::serial();
        for step in 0..3u64 {
            let mut run = || {
                for (r, sender) in senders.iter_mut().enumerate() {
                    sender
                        .compress_bundle(&manifest, &ranks[r], r, &mut bundles[r])
                        .unwrap();
                }
                manifest
                    .decode_bundle(&bundles[1], Some(1), Some(step), &mut decoded)
                    .unwrap();
                agg.aggregate_into(&manifest, &bundles, step, Reduction::Mean, &mut flat)
                    .unwrap();
                manifest.to_tensors_into(&flat, &mut tensors).unwrap();
            };
            let n = allocations(&mut run);
            if step > 0 {
                assert_eq!(n, 0, "step {step} with {bucketing:?}");
            }
        }
    }
}

#[test]
fn chunked_selection_allocates_nothing_after_the_first_step() {
    // A large threshold or top-k tensor with error feedback: its first step goes the core's
    // way (no residual yet) and sizes the chunked selection's buffers, so the steps after it,
    // selected in chunks on the serial path, allocate nothing, also when the first step's
    // gradients are tiny (nothing kept) and later ones keep 1%.
    let n = 300_000;
    let step = |seed: u64, scale: f32| {
        HashMap::from([("w".to_owned(), Tensor::vector(Rng(seed).vec(n, scale)))])
    };
    let steps = [step(1, 0.01), step(2, 1.0), step(3, 0.01), step(4, 1.0)];
    for method in [
        CompressionMethod::Threshold { threshold: 0.99 }.with_error_feedback(),
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
    ] {
        let mut c = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial);
        let mut out = HashMap::new();
        c.compress_into(&steps[0], &mut out).unwrap();
        for (s, g) in steps.iter().enumerate().skip(1) {
            let n = allocations(|| c.compress_into(g, &mut out).unwrap());
            assert_eq!(n, 0, "{method:?}: step {s}");
        }
    }
}

/// Issue 46 scope 1 and issue 47: a steady-state in-place step (`all_reduce_in_place`) makes
/// no allocation in proportion to the model on any route, so the Python path that calls it
/// (`AllReduce.all_reduce_`) adds none either: the peak of what the step allocates on this
/// thread (a group of one over `LocalGroup`, serial: every call runs here) stays below a
/// small bound while the model is 3.2 MB. What it allocates is per tensor (the sorted names,
/// the buffers' order), not per element.
#[test]
fn in_place_steps_allocate_nothing_in_proportion_to_the_model() {
    use gradwire::comm::LocalGroup;
    use gradwire::core::{Method, Values};
    use gradwire::{Collective, CompressedAllReduce};

    let base = minilm();
    let model_bytes: usize = base.values().map(|t| 4 * t.data().len()).sum();
    let dense = |values| CompressionMethod::Core(Method::Dense { values });
    for (method, collective) in [
        (
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            Collective::AllGather,
        ),
        (
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            Collective::TwoPhase,
        ),
        (
            CompressionMethod::SignSGD.with_error_feedback(),
            Collective::TwoPhase,
        ),
        (dense(Values::Bf16), Collective::AllGather),
        (dense(Values::F32), Collective::AllGather),
    ] {
        let comm = LocalGroup::new(1).into_communicators().remove(0);
        let mut ar = CompressedAllReduce::with_communicator(method.clone(), Box::new(comm))
            .with_collective(collective)
            .with_parallelism(Parallelism::Serial);
        let mut peaks = Vec::new();
        for s in 0..4u64 {
            let g = noisy(&base, &mut Rng(s + 1), 0.5);
            let mut bufs: common::Owned = g
                .into_iter()
                .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
                .collect();
            let mut tensors = common::views(&mut bufs);
            let ((), bytes) = counting::peak(|| ar.all_reduce_in_place(&mut tensors).unwrap());
            peaks.push(bytes);
        }
        // Steps after the first two (which size the state and the reusable buffers).
        for (s, &bytes) in peaks.iter().enumerate().skip(2) {
            assert!(
                bytes < 16 << 10,
                "{method:?} {collective:?}: step {s} allocated a peak of {bytes} bytes \
                 (model {model_bytes} bytes; every step: {peaks:?})"
            );
        }
    }
}

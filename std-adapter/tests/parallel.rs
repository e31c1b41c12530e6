//! The parallel paths ([`Parallelism::Parallel`]) give the same bytes and bits as the serial
//! path: bundles and per-tensor frames byte for byte, residuals and aggregates bit for bit, and
//! the same errors, on the real MiniLM gradients and on a synthetic model with one large tensor
//! (split into chunks) and many small ones.

mod common;

use std::collections::HashMap;

use common::{MINILM, Rng, minilm, same_bits};
use gradwire::BucketConfig;
use gradwire::Manifest;
use gradwire::Parallelism;
use gradwire::core::{K, Method, Params, Rounding, SignScale, Values, tensor_id};

use gradwire::tensor::Tensor;
use gradwire::{Aggregator, Reduction};
use gradwire::{CompressionMethod, GradientCompressor};

/// Elements of the large tensor of the synthetic model (not a multiple of any block or chunk).
const LARGE: usize = 4_000_037;

/// One large tensor, one mid-sized, and 40 small ones of varied sizes (some 0-d).
fn synthetic(rng: &mut Rng) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    // Heavy-tailed, with exact zeros and repeated magnitudes.
    let big: Vec<f32> = (0..LARGE)
        .map(|i| {
            let u = rng.unit();
            match i % 97 {
                0 => 0.0,
                1 => 0.25,
                _ => u * u * u * 3.0,
            }
        })
        .collect();
    out.insert(
        "large.weight".to_owned(),
        Tensor::new(vec![LARGE], big).unwrap(),
    );
    out.insert(
        "mid.weight".to_owned(),
        Tensor::new(vec![641, 512], rng.vec(641 * 512, 0.01)).unwrap(),
    );
    for t in 0..40usize {
        let name = format!("small.{t:02}");
        if t % 13 == 0 {
            out.insert(name, Tensor::new(vec![], vec![rng.unit()]).unwrap());
        } else {
            let n = 1 + (t * 977) % 5000;
            out.insert(name, Tensor::vector(rng.vec(n, 1e-3 * (t as f32 + 1.0))));
        }
    }
    out
}

/// `base` with every value scaled by a per-(rank, step) factor and a little seeded noise.
fn vary(base: &HashMap<String, Tensor>, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = Rng(seed);
    let f = 0.5 + (seed % 7) as f32 * 0.1;
    base.iter()
        .map(|(n, t)| {
            let data = t
                .data()
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    if i % 64 == 0 {
                        x * f + rng.unit() * 1e-3
                    } else {
                        x * f
                    }
                })
                .collect();
            (n.clone(), Tensor::new(t.shape().to_vec(), data).unwrap())
        })
        .collect()
}

fn methods() -> Vec<CompressionMethod> {
    vec![
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        CompressionMethod::SignSGD.with_error_feedback(),
        CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
    ]
}

fn bucketings() -> Vec<BucketConfig> {
    vec![
        BucketConfig::none(),
        BucketConfig::fused(64 << 10).with_dense_below(8, Values::F32),
    ]
}

/// Runs `steps` steps of `ranks` ranks, serial and parallel side by side, and checks bundles,
/// residuals and aggregates (the mean; also the sum with `sum`).
fn check_same(
    base: &HashMap<String, Tensor>,
    method: &CompressionMethod,
    bucketing: BucketConfig,
    ranks: usize,
    steps: u64,
    sum: bool,
) {
    let manifest = Manifest::for_gradients(base, method, 3, bucketing).unwrap();
    let new = |p| {
        GradientCompressor::new(method.clone())
            .with_seed(3)
            .with_parallelism(p)
    };
    let mut serial: Vec<GradientCompressor> =
        (0..ranks).map(|_| new(Parallelism::Serial)).collect();
    let mut parallel: Vec<GradientCompressor> =
        (0..ranks).map(|_| new(Parallelism::Parallel)).collect();
    let mut agg = Aggregator::new().with_parallelism(Parallelism::Parallel);
    let (mut flat_s, mut flat_p) = (Vec::new(), Vec::new());
    let ctx = format!("{method:?} {bucketing:?}");
    for step in 0..steps {
        let mut bundles_s = Vec::new();
        let mut bundles_p = Vec::new();
        for r in 0..ranks {
            let grads = vary(base, 100 * step + r as u64);
            let (mut bs, mut bp) = (Vec::new(), Vec::new());
            let ss = serial[r]
                .compress_bundle(&manifest, &grads, r, &mut bs)
                .unwrap();
            let sp = parallel[r]
                .compress_bundle(&manifest, &grads, r, &mut bp)
                .unwrap();
            assert_eq!(ss, sp, "{ctx}: step");
            assert!(bs == bp, "{ctx}: bundle of rank {r} at step {step}");
            assert!(
                serial[r].feedback() == parallel[r].feedback(),
                "{ctx}: residuals of rank {r} after step {step}"
            );
            bundles_s.push(bs);
            bundles_p.push(bp);
        }
        let reductions: &[Reduction] = if sum {
            &[Reduction::Sum, Reduction::Mean]
        } else {
            &[Reduction::Mean]
        };
        for &reduction in reductions {
            Aggregator::serial()
                .aggregate_into(&manifest, &bundles_s, step, reduction, &mut flat_s)
                .unwrap();
            // Garbage in the output buffer must not leak into the result.
            flat_p.clear();
            flat_p.resize(manifest.flat_len(), f32::NAN);
            agg.aggregate_into(&manifest, &bundles_p, step, reduction, &mut flat_p)
                .unwrap();
            assert!(
                same_bits(&flat_s, &flat_p),
                "{ctx}: {reduction:?} at step {step}"
            );
        }
    }
}

#[test]
fn minilm_parallel_equals_serial() {
    let base = minilm();
    for method in methods() {
        for bucketing in bucketings() {
            check_same(&base, &method, bucketing, 3, 3, true);
        }
    }
}

#[test]
fn synthetic_large_tensor_parallel_equals_serial() {
    let base = synthetic(&mut Rng(5));
    for method in methods() {
        for bucketing in bucketings() {
            check_same(&base, &method, bucketing, 2, 2, false);
        }
    }
}

/// Unbiased random-k with int8 values (no error feedback: the residual would grow).
fn unbiased_randomk() -> CompressionMethod {
    CompressionMethod::Core(Method::RandomK {
        k: K::Ratio(0.02),
        values: Values::Int8 { block: 256 },
        unbiased: true,
    })
}

#[test]
fn other_split_methods_parallel_equal_serial() {
    // Every kind of frame that splits into chunks (stochastic rounding too), without and with
    // error feedback.
    let mut rng = Rng(9);
    let mut base = HashMap::new();
    base.insert("w".to_owned(), Tensor::vector(rng.vec(600_001, 2.0)));
    base.insert("b".to_owned(), Tensor::vector(rng.vec(333, 1.0)));
    let core = |m| CompressionMethod::Core(m);
    for method in [
        core(Method::Dense {
            values: Values::F16,
        }),
        core(Method::Dense {
            values: Values::Bf16,
        }),
        core(Method::Quant {
            bits: 8,
            block: 100,
            rounding: Rounding::NearestEven,
        }),
        core(Method::Quant {
            bits: 3,
            block: 512,
            rounding: Rounding::NearestEven,
        }),
        core(Method::Quant {
            bits: 4,
            block: 512,
            rounding: Rounding::Stochastic,
        }),
        core(Method::Sign {
            scale: SignScale::MeanAbs { block: 1000 },
            zero_mask: false,
        }),
        CompressionMethod::SignSGDMajority,
        CompressionMethod::Threshold { threshold: 1.5 },
        CompressionMethod::RandomK { k: 6_000 },
        unbiased_randomk(),
    ] {
        check_same(&base, &method, BucketConfig::none(), 3, 1, false);
        if method != CompressionMethod::SignSGDMajority && method != unbiased_randomk() {
            check_same(
                &base,
                &method.with_error_feedback(),
                BucketConfig::none(),
                2,
                2,
                false,
            );
        }
    }
}

#[test]
fn majority_vote_parallel_equals_serial() {
    let mut rng = Rng(11);
    let base = HashMap::from([("w".to_owned(), Tensor::vector(rng.vec(700_001, 1.0)))]);
    let method = CompressionMethod::SignSGDMajority;
    let manifest = Manifest::for_gradients(&base, &method, 0, BucketConfig::none()).unwrap();
    let bundles: Vec<Vec<u8>> = (0..4)
        .map(|r| {
            let mut b = Vec::new();
            GradientCompressor::new(method.clone())
                .compress_bundle(&manifest, &vary(&base, r), r as usize, &mut b)
                .unwrap();
            b
        })
        .collect();
    let serial = common::aggregate(&manifest, &bundles, 0, Reduction::MajorityVote).unwrap();
    let mut parallel = Vec::new();
    Aggregator::new()
        .with_parallelism(Parallelism::Parallel)
        .aggregate_into(
            &manifest,
            &bundles,
            0,
            Reduction::MajorityVote,
            &mut parallel,
        )
        .unwrap();
    assert!(same_bits(&serial, &parallel));
}

#[test]
fn compress_into_parallel_equals_serial() {
    let base = synthetic(&mut Rng(6));
    for method in methods() {
        let mut s = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial);
        let mut p = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Parallel);
        let (mut out_s, mut out_p) = (HashMap::new(), HashMap::new());
        for step in 0..2 {
            let grads = vary(&base, step);
            s.compress_into(&grads, &mut out_s).unwrap();
            p.compress_into(&grads, &mut out_p).unwrap();
            assert!(out_s == out_p, "{method:?} at step {step}");
            assert!(s.feedback() == p.feedback(), "{method:?} at step {step}");
            assert_eq!(
                s.get_compression_ratio().to_bits(),
                p.get_compression_ratio().to_bits()
            );
        }
    }
}

#[test]
fn a_wider_pool_gives_the_same_bits() {
    // More threads than cores: other interleavings, same results.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(5)
        .build()
        .unwrap();
    let base = synthetic(&mut Rng(7));
    let method = CompressionMethod::SignSGD.with_error_feedback();
    pool.install(|| {
        // Which sizes `Auto` pools is checked in the crate's unit tests (`engine::exec`).
        assert_eq!(Parallelism::Auto.threads(), 5);
        check_same(&base, &method, BucketConfig::fused(64 << 10), 2, 1, true);
    });
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one.install(|| {
        assert_eq!(Parallelism::Auto.threads(), 1);
        check_same(&base, &method, BucketConfig::none(), 2, 1, false);
    });
    assert_eq!(Parallelism::Serial.threads(), 1);
}

#[test]
fn a_nan_changes_nothing_on_either_path() {
    let base = synthetic(&mut Rng(8));
    let f16_topk = CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.01),
        values: Values::F16,
    });
    // 4-bit splits into chunks; top-k, threshold and random-k select in chunks (from the
    // second step on, when the residuals exist), and check on the way.
    for method in [
        CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        CompressionMethod::Threshold { threshold: 0.5 }.with_error_feedback(),
        f16_topk.clone(),
        f16_topk.clone().with_error_feedback(),
        CompressionMethod::RandomK { k: 40_000 }.with_error_feedback(),
        CompressionMethod::Core(Method::RandomK {
            k: K::Ratio(0.01),
            values: Values::F16,
            unbiased: false,
        }),
    ] {
        let manifest = Manifest::for_gradients(&base, &method, 0, BucketConfig::none()).unwrap();
        let mut s = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial);
        let mut p = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Parallel);
        let (mut bs, mut bp) = (Vec::new(), Vec::new());
        s.compress_bundle(&manifest, &base, 0, &mut bs).unwrap();
        p.compress_bundle(&manifest, &base, 0, &mut bp).unwrap();
        for (name, index, bad_value) in [
            ("large.weight", LARGE - 3, f32::NAN),
            ("large.weight", 70_000, f32::NAN),
            ("large.weight", 1_000_000, f32::NEG_INFINITY),
            ("large.weight", 2_000_000, 1e6),
            ("small.05", 2, f32::NAN),
        ] {
            let mut bad = vary(&base, 1);
            let mut data = bad[name].data().to_vec();
            data[index] = bad_value;
            bad.insert(
                name.to_owned(),
                Tensor::new(bad[name].shape().to_vec(), data).unwrap(),
            );
            let before = p.feedback().cloned();
            let es = s.compress_bundle(&manifest, &bad, 0, &mut bs);
            let ep = p.compress_bundle(&manifest, &bad, 0, &mut bp);
            let ctx = format!("{method:?}: {bad_value} at {name}[{index}]");
            assert_eq!(format!("{es:?}"), format!("{ep:?}"), "{ctx}");
            if bad_value.is_finite() && !matches!(method, CompressionMethod::Core(_)) {
                // 1e6 fits every value type but f16: both paths encode it.
                assert!(bs == bp, "{ctx}");
                assert!(s.feedback() == p.feedback(), "{ctx}");
                continue;
            }
            let ep = ep.unwrap_err();
            assert!(format!("{ep}").contains(&index.to_string()), "{ctx}: {ep}");
            assert!(
                p.feedback().cloned() == before,
                "{ctx}: no residual changes"
            );
            assert_eq!(s.step(), p.step(), "{ctx}");
        }
    }
}

#[test]
fn tie_heavy_tensors_select_in_chunks_as_serially() {
    // A constant tensor (every element a candidate: the chunked selection gives up, the
    // serial one runs), a mostly-zero one (ties at zero among the top-k), and threshold
    // keeping everything non-zero; several steps with error feedback.
    let mut rng = Rng(12);
    let ones = vec![1.0f32; 300_001];
    let sparse: Vec<f32> = (0..400_003)
        .map(|i| if i % 20 == 0 { rng.unit() - 0.5 } else { 0.0 })
        .collect();
    let base = HashMap::from([
        ("ones".to_owned(), Tensor::vector(ones)),
        ("sparse".to_owned(), Tensor::vector(sparse)),
    ]);
    for method in [
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        CompressionMethod::Core(Method::TopK {
            k: K::Ratio(0.2),
            values: Values::F32,
        }),
        CompressionMethod::Core(Method::TopK {
            k: K::Ratio(0.1),
            values: Values::Bf16,
        })
        .with_error_feedback(),
        CompressionMethod::Threshold { threshold: 0.0 }.with_error_feedback(),
    ] {
        check_same(&base, &method, BucketConfig::none(), 2, 3, true);
    }
}

/// Rewrites the bundle's and the frame's checksums after an edit inside entry 0's frame.
fn reseal(bundle: &mut [u8], frame_start: usize, frame_len: usize) {
    let end = frame_start + frame_len - 4;
    let crc = crc32(&bundle[frame_start..end]);
    bundle[end..end + 4].copy_from_slice(&crc.to_le_bytes());
    let body = bundle.len() - 4;
    let crc = crc32(&bundle[..body]);
    bundle[body..].copy_from_slice(&crc.to_le_bytes());
}

/// CRC-32 (IEEE), bit by bit: the test does not depend on the crate's.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[test]
fn invalid_frame_bodies_give_the_serial_errors() {
    // A large single-tensor manifest: entry 0's frame starts after the bundle header (24 bytes)
    // and the entry header (12).
    let mut rng = Rng(12);
    let base = HashMap::from([("w".to_owned(), Tensor::vector(rng.vec(600_000, 1.0)))]);
    let frame_start = 24 + 12;
    for (method, poke) in [
        // Sign: a NaN scale (the first scale follows the 21-byte header).
        (CompressionMethod::SignSGD, 21 + 4 * 7),
        // 4-bit: a code of 15 (above 2l = 14) in the codes section.
        (
            CompressionMethod::Quantization { bits: 4 },
            22 + 4 * 600_000usize.div_ceil(512) + 1000,
        ),
        // Top-k int8: a code of -128 at the end of the values section.
        (CompressionMethod::top_k_int8(0.01), usize::MAX),
        // Unbiased random-k (f32 values, n/k = 100): a value of 1e37 decodes to infinity.
        (
            CompressionMethod::Core(Method::RandomK {
                k: K::Ratio(0.01),
                values: Values::F32,
                unbiased: true,
            }),
            usize::MAX - 1,
        ),
    ] {
        let manifest = Manifest::for_gradients(&base, &method, 0, BucketConfig::none()).unwrap();
        let mut bundles: Vec<Vec<u8>> = (0..3)
            .map(|r| {
                let mut b = Vec::new();
                GradientCompressor::new(method.clone())
                    .compress_bundle(&manifest, &vary(&base, r), r as usize, &mut b)
                    .unwrap();
                b
            })
            .collect();
        let bundle = &mut bundles[1];
        let frame_len = u32::from_le_bytes(bundle[32..36].try_into().unwrap()) as usize;
        let at = match poke {
            usize::MAX => frame_start + frame_len - 5,
            p if p == usize::MAX - 1 => frame_start + frame_len - 8,
            p => frame_start + p,
        };
        match method {
            CompressionMethod::SignSGD => {
                bundle[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            CompressionMethod::Quantization { .. } => bundle[at] = 0xff,
            CompressionMethod::Core(Method::RandomK { .. }) => {
                bundle[at..at + 4].copy_from_slice(&1e37f32.to_le_bytes());
            }
            _ => bundle[at] = 0x80,
        }
        reseal(bundle, frame_start, frame_len);
        let mut serial = vec![1.0f32; 5];
        let es = Aggregator::serial()
            .aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut serial)
            .unwrap_err();
        let mut parallel = vec![1.0f32; 5];
        let ep = Aggregator::new()
            .with_parallelism(Parallelism::Parallel)
            .aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut parallel)
            .unwrap_err();
        assert_eq!(format!("{es:?}"), format!("{ep:?}"), "{method:?}");
        assert!(format!("{ep}").contains("rank 1"), "{ep}");
        assert!(
            same_bits(&serial, &parallel),
            "{method:?}: out as the serial path leaves it"
        );
        // Framing errors (found before anything is added) as well.
        bundles[2][30] ^= 1;
        let es = Aggregator::serial()
            .aggregate_into(&manifest, &bundles, 0, Reduction::Sum, &mut serial)
            .unwrap_err();
        let ep = Aggregator::new()
            .with_parallelism(Parallelism::Parallel)
            .aggregate_into(&manifest, &bundles, 0, Reduction::Sum, &mut parallel)
            .unwrap_err();
        assert_eq!(format!("{es:?}"), format!("{ep:?}"), "{method:?}");
    }
}

#[test]
fn the_data_file_is_there() {
    assert!(std::path::Path::new(MINILM).exists());
}

/// Compresses `grads(step)` for `steps` steps with `method` on `parallelism` (seed 4) and
/// checks tensor `name`'s frame, and with error feedback its residual, against the core's
/// `encode_into` / `feedback_step` on that tensor alone, step after step.
fn check_against_the_core_step(
    method: &CompressionMethod,
    parallelism: Parallelism,
    name: &str,
    steps: u64,
    grads: impl Fn(u64) -> HashMap<String, Tensor>,
) {
    use gradwire::core::{encode_into, feedback_step, max_frame_len, scratch_len};
    let mut c = GradientCompressor::new(method.clone())
        .with_seed(4)
        .with_parallelism(parallelism);
    let mut residual = Vec::new();
    let mut out = HashMap::new();
    let ef = matches!(method, CompressionMethod::ErrorFeedback { .. });
    for step in 0..steps {
        let grads = grads(step);
        c.compress_into(&grads, &mut out).unwrap();
        let p = Params {
            method: method.core_method().unwrap(),
            seed: 4,
            step,
            tensor_id: tensor_id(name),
        };
        let g = grads[name].data();
        residual.resize(g.len(), 0.0);
        let mut frame = vec![0u8; max_frame_len(g.len(), &p.method)];
        let mut scratch = vec![0u32; scratch_len(g.len(), &p.method)];
        let len = match ef {
            true => feedback_step(g, &mut residual, &p, &mut scratch, &mut frame),
            false => encode_into(g, &p, &mut scratch, &mut frame),
        }
        .unwrap();
        let ctx = format!("{method:?} {parallelism:?} step {step}");
        assert!(out[name].frame() == &frame[..len], "{ctx}: frame");
        if ef {
            let r = c.feedback().unwrap().residual(name).unwrap();
            assert!(same_bits(r, &residual), "{ctx}: residual");
        }
    }
}

#[test]
fn large_sparse_frames_equal_the_core_step() {
    // Both paths select a large top-k or threshold tensor in chunks; their frames and
    // residuals must be the core's, step after step.
    let base = synthetic(&mut Rng(13));
    for method in [
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        CompressionMethod::top_k_int8(0.001),
        CompressionMethod::Threshold { threshold: 1.0 }.with_error_feedback(),
        CompressionMethod::Threshold { threshold: 2.0 },
    ] {
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            check_against_the_core_step(&method, parallelism, "large.weight", 3, |step| {
                vary(&base, 7 + step)
            });
        }
    }
}

#[test]
fn one_pass_frames_equal_the_core_step() {
    // Top-k with error feedback takes one pass over g and r once the residual's bound proves
    // the sums in range. A constant tensor (the sample overshoots: the exact top-k of the
    // stored sums), and f16 values with a gradient above half their range at step 0 (checked
    // and selected as before; the update measures the bound, and the next steps take one
    // pass): frames and residuals must be the core's.
    let mut rng = Rng(15);
    let flat = HashMap::from([("w".to_owned(), Tensor::vector(vec![0.5; 300_001]))]);
    let mut big = rng.vec(300_001, 1.0);
    big[11] = 40_000.0;
    let big = HashMap::from([("w".to_owned(), Tensor::vector(big))]);
    let small = HashMap::from([("w".to_owned(), Tensor::vector(rng.vec(300_001, 2.0)))]);
    let f16 = CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.01),
        values: Values::F16,
    })
    .with_error_feedback();
    for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
        let int8 = CompressionMethod::top_k_int8(0.01).with_error_feedback();
        check_against_the_core_step(&int8, parallelism, "w", 3, |_| flat.clone());
        check_against_the_core_step(&f16, parallelism, "w", 3, |step| match step {
            0 => big.clone(),
            _ => small.clone(),
        });
    }
}

#[test]
fn large_randomk_frames_equal_the_core_step() {
    // Both paths draw a large random-k tensor's indices in chunks (on one thread: the core's
    // draw) and write the frame from them; frames and residuals must be the core's.
    let base = synthetic(&mut Rng(14));
    let core = |k, values, unbiased| {
        CompressionMethod::Core(Method::RandomK {
            k,
            values,
            unbiased,
        })
    };
    for method in [
        CompressionMethod::RandomK { k: 40_000 }.with_error_feedback(),
        CompressionMethod::RandomK { k: 1 },
        core(K::Ratio(0.01), Values::Int8 { block: 256 }, false).with_error_feedback(),
        core(K::Ratio(0.6), Values::Bf16, false).with_error_feedback(),
        core(K::Count(999), Values::F16, true),
    ] {
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            check_against_the_core_step(&method, parallelism, "large.weight", 3, |step| {
                vary(&base, 9 + step)
            });
        }
    }
}

#[test]
fn split_frames_and_residuals_equal_the_core_step() {
    // Dense, quantization and sign tensors split into tiles on one thread too: frames and
    // residuals must be the core's, step after step, with -0.0, subnormals and large values in
    // the gradient.
    const N: usize = 600_001;
    let grads = |step: u64| {
        let mut rng = Rng(77 + step);
        let mut v = rng.vec(N, 3.0);
        for (i, x) in v.iter_mut().enumerate() {
            match i % 101 {
                0 => *x = -0.0,
                1 => *x = 1e-42,
                2 => *x = -1e-30,
                3 => {
                    *x = if step.is_multiple_of(2) {
                        6000.0
                    } else {
                        -6000.0
                    }
                }
                _ => {}
            }
        }
        HashMap::from([
            ("w".to_owned(), Tensor::vector(v)),
            ("b".to_owned(), Tensor::vector(rng.vec(333, 1.0))),
        ])
    };
    let q = |bits, block, rounding| Method::Quant {
        bits,
        block,
        rounding,
    };
    for m in [
        Method::Dense {
            values: Values::F16,
        },
        Method::Dense {
            values: Values::Bf16,
        },
        q(8, 100, Rounding::NearestEven),
        q(3, 512, Rounding::NearestEven),
        q(4, 512, Rounding::Stochastic),
        q(2, 7, Rounding::Stochastic),
        Method::Sign {
            scale: SignScale::MeanAbs { block: 1000 },
            zero_mask: false,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 3 },
            zero_mask: false,
        },
    ] {
        for method in [
            CompressionMethod::Core(m),
            CompressionMethod::Core(m).with_error_feedback(),
        ] {
            for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
                check_against_the_core_step(&method, parallelism, "w", 3, grads);
            }
        }
    }
}

#[test]
fn threshold_lists_that_grow_equal_the_core_step() {
    // Steps keeping between the core's threshold capacity (n/32) and four times it: the
    // chunked lists grow, and the frames are still the core's.
    let n = 500_000;
    let grads = |step: u64| {
        let scale = if step.is_multiple_of(2) { 0.01 } else { 1.0 };
        HashMap::from([("w".to_owned(), Tensor::vector(Rng(40 + step).vec(n, scale)))])
    };
    for t in [0.95f32, 0.90] {
        for method in [
            CompressionMethod::Threshold { threshold: t },
            CompressionMethod::Threshold { threshold: t }.with_error_feedback(),
        ] {
            for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
                check_against_the_core_step(&method, parallelism, "w", 4, grads);
            }
        }
    }
}

/// The two-phase collective on the pool: at W = 3, the parts' top-k selections and the chunks
/// of dense-shaped frames run as pool tasks (a large tensor spans many chunks and, cut into
/// three runs, chunks that span two parts), and every step's outputs and worker residuals are
/// bit for bit those of the serial path, server residuals included (they feed the outputs).
#[test]
fn two_phase_on_the_pool_equals_serial() {
    use gradwire::comm::{Communicator, LocalGroup};
    use gradwire::{Collective, CompressedAllReduce};
    let base = synthetic(&mut Rng(8));
    let methods = [
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        CompressionMethod::SignSGD.with_error_feedback(),
        CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
    ];
    for method in methods {
        let run = |parallelism: Parallelism| {
            let comms = LocalGroup::new(3).into_communicators();
            std::thread::scope(|scope| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .map(|comm| {
                        let (method, base) = (method.clone(), &base);
                        scope.spawn(move || {
                            let rank = comm.rank();
                            let mut ar =
                                CompressedAllReduce::with_communicator(method, Box::new(comm))
                                    .with_collective(Collective::TwoPhase)
                                    .with_parallelism(parallelism);
                            let mut outs = Vec::new();
                            for step in 0..3u64 {
                                let grads = vary(base, 100 * step + rank as u64);
                                let mut out = HashMap::new();
                                ar.all_reduce_into(&grads, &mut out).expect("a step");
                                outs.push(out);
                            }
                            (outs, ar.compressor().feedback().cloned())
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a rank"))
                    .collect::<Vec<_>>()
            })
        };
        let serial = run(Parallelism::Serial);
        let pooled = run(Parallelism::Parallel);
        for (rank, ((so, sf), (po, pf))) in serial.iter().zip(&pooled).enumerate() {
            assert!(sf == pf, "{method:?}: rank {rank}'s residuals");
            for (step, (s, p)) in so.iter().zip(po).enumerate() {
                for (name, t) in s {
                    assert!(
                        same_bits(t.data(), p[name].data()),
                        "{method:?}: rank {rank}, step {step}, `{name}`"
                    );
                }
            }
        }
    }
}

#[test]
fn sums_beyond_f16_saturate_as_the_core_step_on_every_large_path() {
    // Issue 48 class 2 on the large tensors' own paths (selection in chunks, the one pass,
    // random-k drawn in chunks, serial and on the pool): a gradient with 1% of its values at
    // +-1e5 (beyond f16) sends them saturated and keeps the rest, with the frames and residuals
    // of the core's step, step after step.
    const N: usize = 300_001;
    let grads = |step: u64| {
        let mut rng = Rng(31 + step);
        let mut v = rng.vec(N, 2.0);
        for (i, x) in v.iter_mut().enumerate() {
            if (i + step as usize).is_multiple_of(97) {
                *x = if i % 2 == 0 { 1.0e5 } else { -7.0e4 };
            }
        }
        HashMap::from([("w".to_owned(), Tensor::vector(v))])
    };
    let f16 = |method| CompressionMethod::Core(method).with_error_feedback();
    for method in [
        f16(Method::TopK {
            k: K::Ratio(0.01),
            values: Values::F16,
        }),
        f16(Method::Threshold {
            threshold: 1.99,
            values: Values::F16,
        }),
        f16(Method::RandomK {
            k: K::Ratio(0.02),
            values: Values::F16,
            unbiased: false,
        }),
        f16(Method::Dense {
            values: Values::F16,
        }),
    ] {
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            check_against_the_core_step(&method, parallelism, "w", 4, grads);
        }
    }
}

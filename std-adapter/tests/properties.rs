//! quickcheck properties of the std crate, for every method:
//! - error feedback loses nothing: over many steps, everything delivered plus the final
//!   residual equals the sum of all gradients (within float rounding; bit-exact step by step
//!   where values travel as f32);
//! - aggregation is linear: the mean (sum) of W contributions equals the mean (sum) of their
//!   decoded frames, bit for bit (majority vote for unscaled sign);
//! - checkpoints restore exactly: a run restored from `to_bytes`/`from_bytes` (and from
//!   `save`/`load`) has the same residuals, and continues with the same frames and residuals.
//!
//! Gradients come from a seeded generator; some elements are built from raw u32 bits, so
//! subnormals and -0.0 appear (NaN/Inf and values beyond f16's range are excluded: they are
//! errors, tested elsewhere).

mod common;

use std::collections::{BTreeMap, HashMap};

use common::aggregate;
use gradwire::BucketConfig;
use gradwire::Reduction;
use gradwire::feedback::ErrorFeedback;
use gradwire::tensor::Tensor;
use gradwire::{CompressionMethod, GradientCompressor};
use gradwire::{Manifest, TensorSpec};
use gradwire_core::{K, Method, Params, Rounding, SignScale, Values, decode_into, tensor_id};
use quickcheck::{QuickCheck, TestResult};

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// A finite value within f16's range: mostly heavy-tailed, sometimes from raw bits
    /// (subnormals, -0.0, tiny and large magnitudes), sometimes an exact tie.
    fn value(&mut self) -> f32 {
        match self.below(10) {
            0 | 1 => {
                let x = f32::from_bits(self.next() as u32);
                if x.is_finite() && x.abs() < 1.0e4 {
                    x
                } else {
                    -0.0
                }
            }
            2 => 0.25,
            _ => {
                let u = (self.next() >> 40) as f32 / 16_777_216.0 - 0.5;
                u * u * u * 16.0
            }
        }
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

/// Every method error feedback accepts (and, with `majority`, unscaled sign).
fn method(sel: u8, majority: bool) -> Method {
    match sel % 13 {
        0 => Method::TopK {
            k: K::Ratio(0.1),
            values: Values::F32,
        },
        1 => Method::TopK {
            k: K::Count(3),
            values: Values::Int8 { block: 4 },
        },
        2 => Method::TopK {
            k: K::Ratio(0.3),
            values: Values::F16,
        },
        3 => Method::Threshold {
            threshold: 0.5,
            values: Values::F32,
        },
        4 => Method::Threshold {
            threshold: 0.1,
            values: Values::Bf16,
        },
        5 => Method::RandomK {
            k: K::Ratio(0.2),
            values: Values::F32,
            unbiased: false,
        },
        6 => Method::RandomK {
            k: K::Count(5),
            values: Values::Int8 { block: 2 },
            unbiased: false,
        },
        7 => Method::Quant {
            bits: 4,
            block: 16,
            rounding: Rounding::NearestEven,
        },
        8 => Method::Quant {
            bits: 2,
            block: 5,
            rounding: Rounding::Stochastic,
        },
        9 => Method::Quant {
            bits: 8,
            block: 512,
            rounding: Rounding::NearestEven,
        },
        10 => Method::Sign {
            scale: if majority {
                SignScale::None
            } else {
                SignScale::MeanAbs { block: 8 }
            },
            zero_mask: false,
        },
        11 => Method::Dense {
            values: Values::F16,
        },
        _ => Method::Dense {
            values: Values::F32,
        },
    }
}

/// True when every value of the method travels as an exact f32.
fn exact_f32(m: &Method) -> bool {
    matches!(
        m,
        Method::TopK {
            values: Values::F32,
            ..
        } | Method::Threshold {
            values: Values::F32,
            ..
        } | Method::RandomK {
            values: Values::F32,
            ..
        } | Method::Dense {
            values: Values::F32
        }
    )
}

fn qc() -> QuickCheck {
    QuickCheck::new().tests(60).max_tests(600)
}

/// Error feedback over `steps` steps of two tensors loses nothing.
fn feedback_loses_nothing(seed: u64, sel: u8, sizes: (u8, u8), steps: u8) -> TestResult {
    let m = method(sel, false);
    let steps = 1 + usize::from(steps % 24);
    let names = ["a.weight", "b.bias"];
    let ns = [usize::from(sizes.0) + 1, usize::from(sizes.1 % 40)];
    let mut rng = Rng(seed);
    let mut fb = ErrorFeedback::new(m, seed).expect("method valid for error feedback");
    // Per coordinate, in f64: the sum of the gradients, of what was delivered, and of the
    // magnitudes involved (for the rounding tolerance).
    let mut total: Vec<Vec<f64>> = ns.iter().map(|&n| vec![0.0; n]).collect();
    let mut delivered: Vec<Vec<f64>> = total.clone();
    let mut mag: Vec<Vec<f64>> = total.clone();
    for _ in 0..steps {
        let grads: Vec<Vec<f32>> = ns.iter().map(|&n| rng.vec(n)).collect();
        let before: Vec<Vec<f32>> = names
            .iter()
            .zip(&ns)
            .map(|(name, &n)| fb.residual(name).map_or(vec![0.0; n], <[f32]>::to_vec))
            .collect();
        let params: Vec<Params> = names
            .iter()
            .map(|n| {
                Params::new(*fb.method())
                    .with_seed(fb.seed())
                    .at_step(fb.step())
                    .for_tensor(tensor_id(n))
            })
            .collect();
        let mut frames = BTreeMap::new();
        let input: Vec<(&str, &[f32])> = names
            .iter()
            .zip(&grads)
            .map(|(n, g)| (*n, g.as_slice()))
            .collect();
        fb.step_with(input.iter().copied(), |name, frame| {
            frames.insert(name.to_owned(), frame.to_vec());
        })
        .expect("step");
        for (t, name) in names.iter().enumerate() {
            let mut d = vec![0.0f32; ns[t]];
            decode_into(&frames[*name], &params[t], &mut d).expect("decode own frame");
            let r = fb.residual(name).expect("residual");
            for i in 0..ns[t] {
                let x = grads[t][i] + before[t][i];
                if exact_f32(&m) {
                    // Bit-exact step by step: sent + residual_new == gradient + residual_old.
                    if d[i] + r[i] != x {
                        return TestResult::error(format!(
                            "{m:?} {name}[{i}]: sent {} + residual {} != {x}",
                            d[i], r[i]
                        ));
                    }
                }
                total[t][i] += f64::from(grads[t][i]);
                delivered[t][i] += f64::from(d[i]);
                mag[t][i] +=
                    f64::from(grads[t][i].abs()) + f64::from(d[i].abs()) + f64::from(x.abs());
            }
        }
    }
    for (t, name) in names.iter().enumerate() {
        let r = fb.residual(name).expect("residual");
        for i in 0..ns[t] {
            let got = delivered[t][i] + f64::from(r[i]);
            let tol = 4.0 * f64::from(f32::EPSILON) * (mag[t][i] + f64::from(r[i].abs())) + 1e-40;
            if (got - total[t][i]).abs() > tol {
                return TestResult::error(format!(
                    "{m:?} {name}[{i}] after {steps} steps: delivered + residual = {got}, \
                     gradients sum to {}",
                    total[t][i]
                ));
            }
        }
    }
    TestResult::passed()
}

#[test]
fn error_feedback_loses_nothing() {
    qc().quickcheck(feedback_loses_nothing as fn(u64, u8, (u8, u8), u8) -> TestResult);
}

#[test]
fn error_feedback_loses_nothing_for_every_method() {
    for sel in 0..13 {
        for seed in 0..4 {
            let r = feedback_loses_nothing(seed, sel, (200, 33), 20);
            assert!(!r.is_failure(), "method {sel}, seed {seed}: {r:?}");
        }
    }
}

fn specs(ns: (u8, u8)) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("enc.weight", vec![usize::from(ns.0 % 30) + 1, 3]),
        TensorSpec::new("enc.bias", vec![usize::from(ns.1 % 20)]),
        TensorSpec::new("temp", Vec::<usize>::new()),
    ]
}

fn grads(specs: &[TensorSpec], rng: &mut Rng) -> HashMap<String, Tensor> {
    specs
        .iter()
        .map(|s| {
            let n: usize = s.shape.iter().product();
            let t = Tensor::new(s.shape.clone(), rng.vec(n)).expect("tensor");
            (s.name.clone(), t)
        })
        .collect()
}

/// The mean (sum, majority vote) of W bundles equals the reduction of their decoded frames.
fn aggregation_is_linear(seed: u64, sel: u8, ns: (u8, u8), w: u8, bucket: bool) -> TestResult {
    let majority = sel % 13 == 10 && (sel / 13) % 2 == 1;
    let m = method(sel, majority);
    let w = 1 + usize::from(w % 5);
    let specs = specs(ns);
    let bucketing = if bucket {
        BucketConfig::fused(256)
    } else {
        BucketConfig::none()
    };
    let cm = CompressionMethod::Core(m);
    let manifest = Manifest::new(specs.clone(), &cm, seed, bucketing).expect("manifest");
    let mut rng = Rng(seed);
    let mut bundles = Vec::new();
    for rank in 0..w {
        let mut sender = GradientCompressor::new(cm.clone()).with_seed(seed);
        let mut b = Vec::new();
        sender
            .compress_bundle(&manifest, &grads(&specs, &mut rng), rank, &mut b)
            .expect("compress_bundle");
        bundles.push(b);
    }
    let mut sum = vec![0.0f32; manifest.flat_len()];
    for (rank, b) in bundles.iter().enumerate() {
        let mut d = Vec::new();
        manifest
            .decode_bundle(b, Some(rank), Some(0), &mut d)
            .expect("decode_bundle");
        for (s, x) in sum.iter_mut().zip(&d) {
            *s += *x;
        }
    }
    let reductions: &[Reduction] = if majority {
        &[Reduction::Sum, Reduction::MajorityVote]
    } else {
        &[Reduction::Sum, Reduction::Mean]
    };
    for &red in reductions {
        let got = aggregate(&manifest, &bundles, 0, red).expect("aggregate");
        let want: Vec<f32> = match red {
            Reduction::Sum => sum.clone(),
            Reduction::Mean => sum.iter().map(|s| s / w as f32).collect(),
            Reduction::MajorityVote => sum
                .iter()
                .map(|&s| if s >= 0.0 { 1.0 } else { -1.0 })
                .collect(),
        };
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            return TestResult::error(format!(
                "{m:?} {red:?} of {w} at {i}: {} != {}",
                got[i], want[i]
            ));
        }
    }
    TestResult::passed()
}

#[test]
fn aggregation_is_linear_in_the_decoded_frames() {
    qc().quickcheck(aggregation_is_linear as fn(u64, u8, (u8, u8), u8, bool) -> TestResult);
}

#[test]
fn aggregation_is_linear_for_every_method() {
    for sel in 0..13 {
        for w in [1, 3, 4] {
            let r = aggregation_is_linear(u64::from(sel), sel, (17, 9), w, sel % 2 == 0);
            assert!(!r.is_failure(), "method {sel}, W = {w}: {r:?}");
        }
    }
    // Majority vote of unscaled sign frames.
    let r = aggregation_is_linear(5, 10 + 13, (20, 5), 4, false);
    assert!(!r.is_failure(), "{r:?}");
}

/// A run restored from a checkpoint continues bit-identically to the uninterrupted run.
fn checkpoint_restores_exactly(seed: u64, sel: u8, n: u8, before: u8, after: u8) -> TestResult {
    let m = method(sel, false);
    let n = usize::from(n) + 1;
    let mut rng = Rng(seed);
    let mut fb = ErrorFeedback::new(m, seed ^ 0x55).expect("method");
    let names = ["layer.0.w", "layer.1.w"];
    let step = |fb: &mut ErrorFeedback, gs: &[Vec<f32>]| {
        let input: Vec<(&str, &[f32])> = names
            .iter()
            .zip(gs)
            .map(|(a, g)| (*a, g.as_slice()))
            .collect();
        let mut frames = Vec::new();
        fb.step_with(input.iter().copied(), |_, f| frames.push(f.to_vec()))
            .expect("step");
        frames
    };
    let gen_grads = |rng: &mut Rng| vec![rng.vec(n), rng.vec(n / 2)];
    for _ in 0..before % 6 {
        let gs = gen_grads(&mut rng);
        step(&mut fb, &gs);
    }
    let bytes = fb.to_bytes().expect("to_bytes");
    let mut restored = ErrorFeedback::from_bytes(&bytes).expect("from_bytes");
    let same = |a: &ErrorFeedback, b: &ErrorFeedback| {
        a.step() == b.step()
            && a.seed() == b.seed()
            && a.method() == b.method()
            && a.residuals().count() == b.residuals().count()
            && a.residuals()
                .zip(b.residuals())
                .all(|((na, ra), (nb, rb))| {
                    na == nb
                        && ra.len() == rb.len()
                        && ra.iter().zip(rb).all(|(x, y)| x.to_bits() == y.to_bits())
                })
    };
    if !same(&fb, &restored) {
        return TestResult::error(format!("{m:?}: restored state differs"));
    }
    for s in 0..1 + after % 5 {
        let gs = gen_grads(&mut rng);
        let f1 = step(&mut fb, &gs);
        let f2 = step(&mut restored, &gs);
        if f1 != f2 || !same(&fb, &restored) {
            return TestResult::error(format!("{m:?}: diverged {s} steps after the restore"));
        }
    }
    TestResult::passed()
}

#[test]
fn checkpoints_restore_exactly() {
    qc().quickcheck(checkpoint_restores_exactly as fn(u64, u8, u8, u8, u8) -> TestResult);
}

#[test]
fn checkpoint_file_round_trip_for_every_method() {
    let dir = std::env::temp_dir().join(format!("gradwire-props-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for sel in 0..13 {
        let r = checkpoint_restores_exactly(u64::from(sel) * 7, sel, 90, 3, 3);
        assert!(!r.is_failure(), "method {sel}: {r:?}");
        let mut fb = ErrorFeedback::new(method(sel, false), 3).expect("method");
        let mut rng = Rng(u64::from(sel));
        let g = rng.vec(50);
        fb.step_with([("w", &g[..])], |_, _| {}).expect("step");
        let path = dir.join(format!("m{sel}.safetensors"));
        std::fs::write(&path, fb.to_bytes().expect("to_bytes")).expect("save");
        let back = ErrorFeedback::from_bytes(&std::fs::read(&path).expect("read")).expect("load");
        assert_eq!(back.step(), fb.step());
        let (a, b) = (fb.residual("w").unwrap(), back.residual("w").unwrap());
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

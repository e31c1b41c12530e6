//! Error feedback: residuals keyed by name, all-or-nothing steps, checkpoints that resume
//! bit-identically.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use common::{Rng, Stepper, grads, minilm, same_bits};
use gradwire::bucket::BucketConfig;
use gradwire::bundle::Manifest;
use gradwire::compressor::{CompressionMethod, DEFAULT_INT8_BLOCK, GradientCompressor};
use gradwire::core::{K, Method, Rounding, SignScale, Values, tensor_id};
use gradwire::error::Error;
use gradwire::feedback::ErrorFeedback;
use gradwire::tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gradwire-test-{}-{name}.safetensors",
        std::process::id()
    ))
}

fn topk_int8() -> Method {
    Method::TopK {
        k: K::Ratio(0.01),
        values: Values::Int8 {
            block: DEFAULT_INT8_BLOCK,
        },
    }
}

fn sorted(g: &HashMap<String, Tensor>) -> Vec<(&str, &[f32])> {
    let mut v: Vec<(&str, &[f32])> = g.iter().map(|(n, t)| (n.as_str(), t.data())).collect();
    v.sort_by(|a, b| a.0.cmp(b.0));
    v
}

/// Runs steps `from..to`, returning every frame of every step.
fn run(fb: &mut ErrorFeedback, base: &Stepper, from: u64, to: u64) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    for s in from..to {
        assert_eq!(fb.step(), s);
        let g = base.at(s);
        let mut step_frames = Vec::new();
        fb.step_with(sorted(&g), |_, f| step_frames.extend_from_slice(f))
            .unwrap();
        frames.push(step_frames);
    }
    frames
}

/// 50 steps over the real gradients with seeded noise, checkpointed and restored at step 20:
/// every frame and the final state are bit-identical to an uninterrupted run.
#[test]
fn resume_at_step_20_is_bit_identical() {
    let base = Stepper::new(&minilm(), 1000, 0.2);
    let mut straight = ErrorFeedback::new(topk_int8(), 42).unwrap();
    let head = run(&mut straight, &base, 0, 20);
    let path = temp("resume");
    straight.save(&path).unwrap();
    let tail_straight = run(&mut straight, &base, 20, 50);
    assert_eq!(head.len() + tail_straight.len(), 50);

    let mut resumed = ErrorFeedback::load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(resumed.step(), 20);
    assert_eq!(resumed.seed(), 42);
    assert_eq!(*resumed.method(), topk_int8());
    assert_eq!(resumed.len(), 12);
    let tail = run(&mut resumed, &base, 20, 50);
    for (s, (a, b)) in tail_straight.iter().zip(&tail).enumerate() {
        assert!(a == b, "frames of step {} differ", s + 20);
    }
    assert_eq!(resumed, straight, "final residuals, step, seed and method");
    // Something was kept back all along (error feedback is doing work).
    assert!(
        resumed
            .residuals()
            .all(|(_, r)| r.iter().any(|x| *x != 0.0))
    );
}

/// The same through the compressor, with buckets, random draws (stochastic rounding keyed by
/// seed, step and tensor id) and bundles.
#[test]
fn compressor_resume_with_buckets_and_stochastic_rounding() {
    let model = minilm();
    let base = Stepper::new(&model, 2000, 0.2);
    let method = CompressionMethod::Core(Method::Quant {
        bits: 4,
        block: 512,
        rounding: Rounding::Stochastic,
    })
    .with_error_feedback();
    let manifest =
        Manifest::for_gradients(&model, &method, 5, BucketConfig::fused(64 << 10)).unwrap();
    assert!(manifest.entries().len() < 12);
    let bundles = |c: &mut GradientCompressor, from: u64, to: u64| {
        (from..to)
            .map(|s| {
                let mut out = Vec::new();
                let step = c
                    .compress_bundle(&manifest, &base.at(s), 0, &mut out)
                    .unwrap();
                assert_eq!(step, s);
                out
            })
            .collect::<Vec<_>>()
    };
    let mut straight = GradientCompressor::new(method.clone()).with_seed(5);
    let all = bundles(&mut straight, 0, 8);
    let mut first = GradientCompressor::new(method.clone()).with_seed(5);
    let head = bundles(&mut first, 0, 3);
    let path = temp("compressor");
    first.save_feedback(&path).unwrap();
    let mut resumed = GradientCompressor::new(method.clone());
    resumed.load_feedback(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!((resumed.seed(), resumed.step()), (5, 3));
    let tail = bundles(&mut resumed, 3, 8);
    assert!(all == [head, tail].concat());
    assert_eq!(resumed.feedback(), straight.feedback());
}

#[test]
fn nothing_lost_per_coordinate() {
    // sent + residual_new == gradient + residual_old, bit-exact for f32 values.
    let method = Method::TopK {
        k: K::Count(3),
        values: Values::F32,
    };
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    let mut rng = Rng(9);
    for _ in 0..5 {
        let g = rng.vec(40, 1.0);
        let old = fb.residual("w").map_or(vec![0.0; 40], <[f32]>::to_vec);
        let params = fb.params("w");
        let mut frame = Vec::new();
        fb.step_with([("w", &g[..])], |_, f| frame = f.to_vec())
            .unwrap();
        let mut sent = vec![0.0; 40];
        gradwire::core::decode_into(&frame, &params, &mut sent).unwrap();
        let new = fb.residual("w").unwrap();
        for i in 0..40 {
            assert_eq!((sent[i] + new[i]).to_bits(), (g[i] + old[i]).to_bits());
        }
    }
}

#[test]
fn params_come_from_seed_step_and_name() {
    let method = Method::RandomK {
        k: K::Count(2),
        values: Values::F32,
        unbiased: false,
    };
    let mut fb = ErrorFeedback::new(method, 77).unwrap();
    fb.step_with([("layer.w", &[1.0f32, 2.0, 3.0][..])], |_, _| {})
        .unwrap();
    let p = fb.params("layer.w");
    assert_eq!((p.seed, p.step, p.tensor_id), (77, 1, tensor_id("layer.w")));
    assert_eq!(p.method, method);
}

#[test]
fn the_first_bad_index_of_either_kind_is_named() {
    // An overflowing gradient + residual at index 0 comes before a NaN gradient at index 2.
    let method = Method::TopK {
        k: K::Count(1),
        values: Values::F32,
    };
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    let big = f32::MAX * 0.75;
    fb.step_with([("w", &[big, f32::MAX, 1.0][..])], |_, _| {})
        .unwrap();
    let before = fb.clone();
    let err = fb
        .step_with([("w", &[big, 1.0, f32::NAN][..])], |_, _| {})
        .unwrap_err();
    assert!(
        matches!(&err, Error::Core { tensor, source: gradwire::core::Error::NonFinite { index: 0 }, .. } if tensor == "w"),
        "{err}"
    );
    assert_eq!(fb, before);
}

#[test]
fn a_step_is_all_or_nothing() {
    let method = Method::TopK {
        k: K::Count(1),
        values: Values::F16,
    };
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    let a = [1.0f32, 2.0, 3.0];
    let b = [3.0f32, 2.0, 1.0];
    fb.step_with([("a", &a[..]), ("b", &b[..])], |_, _| {})
        .unwrap();
    let before = fb.clone();
    let mut calls = 0;
    let nan = [1.0f32, 1.0, f32::NAN];
    let err = fb
        .step_with([("a", &a[..]), ("b", &nan[..])], |_, _| calls += 1)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Core { tensor, source: gradwire::core::Error::NonFinite { index: 2 }, .. } if tensor == "b"),
        "{err}"
    );
    // Beyond f16's range once the residual is added.
    let big = [1.0f32, 70000.0, 1.0];
    let err = fb
        .step_with([("a", &big[..]), ("b", &b[..])], |_, _| calls += 1)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Core { tensor, source: gradwire::core::Error::ValueOutOfRange { index: 1 }, .. } if tensor == "a"),
        "{err}"
    );
    // Residual + gradient overflowing to infinity.
    let huge = [f32::MAX, f32::MAX, f32::MAX];
    assert!(fb.step_with([("a", &huge[..])], |_, _| calls += 1).is_err());
    let longer = [1.0f32; 4];
    let err = fb
        .step_with([("a", &a[..]), ("b", &longer[..])], |_, _| calls += 1)
        .unwrap_err();
    assert!(
        matches!(&err, Error::LengthChanged { tensor, expected: 3, got: 4 } if tensor == "b"),
        "{err}"
    );
    let err = fb
        .step_with([("a", &a[..]), ("a", &a[..])], |_, _| calls += 1)
        .unwrap_err();
    assert!(
        matches!(&err, Error::DuplicateTensor { tensor } if tensor == "a"),
        "{err}"
    );
    assert_eq!(calls, 0);
    assert_eq!(fb, before);
    assert_eq!(fb.step(), 1);
}

#[test]
fn new_tensors_and_absent_tensors() {
    let method = Method::TopK {
        k: K::Count(1),
        values: Values::F32,
    };
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    fb.step_with([("a", &[1.0f32, 2.0][..])], |_, _| {})
        .unwrap();
    // `a` absent this step: its residual stays; `b` starts from zero.
    fb.step_with([("b", &[5.0f32, 1.0][..])], |_, _| {})
        .unwrap();
    assert_eq!(fb.residual("a"), Some(&[1.0f32, 0.0][..]));
    assert_eq!(fb.residual("b"), Some(&[0.0f32, 1.0][..]));
    let out = fb
        .step_tensors(&grads(&[
            ("a", &[2], vec![0.5, 0.5]),
            ("b", &[2], vec![0.0, 0.0]),
        ]))
        .unwrap();
    assert_eq!(out.keys().collect::<Vec<_>>(), ["a", "b"]);
}

#[test]
fn methods_that_cannot_feed_back() {
    for m in [
        Method::Sign {
            scale: SignScale::None,
        },
        Method::RandomK {
            k: K::Count(1),
            values: Values::F32,
            unbiased: true,
        },
        Method::Quant {
            bits: 12,
            block: 4,
            rounding: Rounding::NearestEven,
        },
    ] {
        assert!(matches!(
            ErrorFeedback::new(m, 0),
            Err(Error::Config { .. })
        ));
    }
}

fn checkpoint(meta: &[(&str, &str)], tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta: HashMap<String, String> = meta
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

/// A flipped bit anywhere in a stored residual, or in the step, is an error (found by a new
/// user's trial: version 1 checkpoints had no checksum and loaded a corrupted residual).
#[test]
fn a_corrupted_checkpoint_is_an_error() {
    let method = Method::TopK {
        k: K::Count(1),
        values: Values::F32,
    };
    let mut fb = ErrorFeedback::new(method, 7).unwrap();
    let grad: Vec<f32> = (0..64).map(|i| i as f32 * 0.25 - 3.0).collect();
    fb.step_with([("w", &grad[..])], |_, _| {}).unwrap();
    let bytes = fb.to_bytes().unwrap();
    assert_eq!(ErrorFeedback::from_bytes(&bytes).unwrap(), fb);
    // The last residual value: the data section ends the file.
    let mut flipped = bytes.clone();
    let at = flipped.len() - 2;
    flipped[at] ^= 0x10;
    let err = ErrorFeedback::from_bytes(&flipped).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    // The step, in the header's metadata: `"step":"1"` becomes `"step":"3"`.
    let key = b"\"step\":\"1\"";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("step entry")
        + key.len()
        - 2;
    let mut edited = bytes.clone();
    edited[at] = b'3';
    let err = ErrorFeedback::from_bytes(&edited).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
}

#[test]
fn checkpoints_are_checked() {
    let good_meta = [
        ("format", "gradwire-error-feedback"),
        ("version", "1"),
        ("method", "topk k=ratio:0.01 values=int8:256"),
        ("seed", "3"),
        ("step", "9"),
    ];
    let one = 1.5f32.to_le_bytes().to_vec();
    let ok = checkpoint(&good_meta, &[("w", Dtype::F32, vec![1], one.clone())]);
    let fb = ErrorFeedback::from_bytes(&ok).unwrap();
    assert_eq!((fb.seed(), fb.step()), (3, 9));
    assert_eq!(fb.residual("w"), Some(&[1.5f32][..]));
    assert_eq!(
        ErrorFeedback::from_bytes(&fb.to_bytes().unwrap()).unwrap(),
        fb
    );

    for (key, value) in [
        ("format", "something-else"),
        ("version", "2"),
        ("method", "topk"),
        ("method", "sign scale=none"),
        ("seed", "-1"),
        ("step", "x"),
    ] {
        let mut meta = good_meta.to_vec();
        for m in meta.iter_mut() {
            if m.0 == key {
                m.1 = value;
            }
        }
        let bytes = checkpoint(&meta, &[("w", Dtype::F32, vec![1], one.clone())]);
        let err = ErrorFeedback::from_bytes(&bytes).unwrap_err();
        assert!(
            matches!(err, Error::Checkpoint { .. }),
            "{key}={value}: {err}"
        );
        assert!(err.to_string().contains(key), "{err}");
    }
    let missing = checkpoint(&good_meta[..4], &[]);
    assert!(
        ErrorFeedback::from_bytes(&missing)
            .unwrap_err()
            .to_string()
            .contains("step")
    );
    let wrong_dtype = checkpoint(&good_meta, &[("w", Dtype::I32, vec![1], one.clone())]);
    assert!(
        ErrorFeedback::from_bytes(&wrong_dtype)
            .unwrap_err()
            .to_string()
            .contains("`w`")
    );
    let two_d = checkpoint(&good_meta, &[("w", Dtype::F32, vec![1, 1], one)]);
    assert!(ErrorFeedback::from_bytes(&two_d).is_err());
    let nan = checkpoint(
        &good_meta,
        &[("w", Dtype::F32, vec![1], f32::NAN.to_le_bytes().to_vec())],
    );
    assert!(
        ErrorFeedback::from_bytes(&nan)
            .unwrap_err()
            .to_string()
            .contains("NaN")
    );
    assert!(matches!(
        ErrorFeedback::from_bytes(b"not safetensors"),
        Err(Error::Safetensors { .. })
    ));
    let err = ErrorFeedback::load("/nonexistent/dir/ckpt.safetensors").unwrap_err();
    assert!(
        matches!(err, Error::Io { .. }) && err.to_string().contains("ckpt"),
        "{err}"
    );

    let mut fb = ErrorFeedback::new(topk_int8(), 0).unwrap();
    fb.set_residual("__metadata__", vec![1.0]).unwrap();
    assert!(matches!(fb.to_bytes(), Err(Error::Checkpoint { .. })));
    assert!(fb.set_residual("x", vec![f32::INFINITY]).is_err());
}

#[test]
fn compressor_refuses_a_checkpoint_of_another_method() {
    let fb = ErrorFeedback::new(topk_int8(), 0).unwrap();
    let mut c = GradientCompressor::new(CompressionMethod::TopK { k: 3 }.with_error_feedback());
    assert!(matches!(
        c.restore_feedback(fb.clone()),
        Err(Error::Checkpoint { .. })
    ));
    let mut plain = GradientCompressor::new(CompressionMethod::top_k_int8(0.01));
    assert!(plain.restore_feedback(fb.clone()).is_err());
    let mut ok = GradientCompressor::new(CompressionMethod::top_k_int8(0.01).with_error_feedback());
    ok.restore_feedback(fb).unwrap();
    let g = grads(&[("w", &[3], vec![1.0, 2.0, 3.0])]);
    let a = ok.compress(&g).unwrap();
    assert!(same_bits(
        &ok.decompress(&a).unwrap()["w"].data()[..2],
        &[0.0, 0.0]
    ));
}

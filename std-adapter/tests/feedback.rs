//! Error feedback: residuals keyed by name, all-or-nothing steps, checkpoints that resume
//! bit-identically.

mod common;
#[path = "common/ranks.rs"]
mod ranks;

use std::collections::HashMap;
use std::path::PathBuf;

use common::{Rng, Stepper, grads, minilm, same_bits};
use gradwire::BucketConfig;
use gradwire::Error;
use gradwire::Manifest;
use gradwire::comm::Communicator as _;
use gradwire::core::{K, Method, Params, Rounding, SignScale, Values, tensor_id};
use gradwire::feedback::ErrorFeedback;
use gradwire::method::DEFAULT_INT8_BLOCK;
use gradwire::tensor::Tensor;
use gradwire::{CompressionMethod, GradientCompressor};
use safetensors::tensor::{Dtype, TensorView};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gradwire-test-{}-{name}.safetensors",
        std::process::id()
    ))
}

/// Top-k of `k` elements with `values`.
fn topk(k: u64, values: Values) -> Method {
    Method::TopK {
        k: K::Count(k),
        values,
    }
}

fn topk_int8() -> Method {
    Method::TopK {
        k: K::Ratio(0.01),
        values: Values::Int8 {
            block: DEFAULT_INT8_BLOCK,
        },
    }
}

/// One shaped step over `g` in name order, returning each tensor's frame (what
/// `ErrorFeedback::step_with_shapes` gives its sink).
fn step_tensors_of(
    fb: &mut ErrorFeedback,
    g: &HashMap<String, Tensor>,
) -> gradwire::Result<std::collections::BTreeMap<String, Vec<u8>>> {
    let mut sorted: Vec<(&str, &[usize], &[f32])> = g
        .iter()
        .map(|(n, t)| (n.as_str(), t.shape(), t.data()))
        .collect();
    sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut out = std::collections::BTreeMap::new();
    fb.step_with_shapes(sorted, |name, frame| {
        out.insert(name.to_owned(), frame.to_vec());
    })?;
    Ok(out)
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
    std::fs::write(&path, straight.to_bytes().unwrap()).unwrap();
    let tail_straight = run(&mut straight, &base, 20, 50);
    assert_eq!(head.len() + tail_straight.len(), 50);

    let mut resumed = ErrorFeedback::from_bytes(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(resumed.step(), 20);
    assert_eq!(resumed.seed(), 42);
    assert_eq!(*resumed.method(), topk_int8());
    assert_eq!(resumed.residuals().count(), 12);
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
    assert_eq!((resumed.feedback().unwrap().seed(), resumed.step()), (5, 3));
    let tail = bundles(&mut resumed, 3, 8);
    assert!(all == [head, tail].concat());
    assert_eq!(resumed.feedback(), straight.feedback());
}

#[test]
fn nothing_lost_per_coordinate() {
    // sent + residual_new == gradient + residual_old, bit-exact for f32 values.
    let method = topk(3, Values::F32);
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    let mut rng = Rng(9);
    for _ in 0..5 {
        let g = rng.vec(40, 1.0);
        let old = fb.residual("w").map_or(vec![0.0; 40], <[f32]>::to_vec);
        let params = Params::new(method)
            .at_step(fb.step())
            .for_tensor(tensor_id("w"));
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
    let mut frame = Vec::new();
    fb.step_with([("layer.w", &[1.0f32, 2.0, 3.0][..])], |_, f| {
        frame = f.to_vec()
    })
    .unwrap();
    // The frame of step 0 carries the parameters it was made with; the next step is 1.
    let p = gradwire::core::peek(&frame).unwrap().params;
    assert_eq!((p.seed, p.step, p.tensor_id), (77, 0, tensor_id("layer.w")));
    assert_eq!(p.method, method);
    assert_eq!(fb.step(), 1);
}

#[test]
fn the_first_bad_index_of_either_kind_is_named() {
    // An overflowing gradient + residual at index 0 comes before a NaN gradient at index 2.
    let method = topk(1, Values::F32);
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
    let method = topk(1, Values::F16);
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
    // (A sum beyond f16's range is sent saturated: see
    // `sums_beyond_the_value_type_saturate_and_the_excess_stays_in_the_residual`.)
    // (A residual + gradient that overflows to infinity: `the_first_bad_index_of_either_kind_is_named`.)
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
    let method = topk(1, Values::F32);
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    fb.step_with([("a", &[1.0f32, 2.0][..])], |_, _| {})
        .unwrap();
    // `a` absent this step: its residual stays; `b` starts from zero.
    fb.step_with([("b", &[5.0f32, 1.0][..])], |_, _| {})
        .unwrap();
    assert_eq!(fb.residual("a"), Some(&[1.0f32, 0.0][..]));
    assert_eq!(fb.residual("b"), Some(&[0.0f32, 1.0][..]));
    let out = step_tensors_of(
        &mut fb,
        &grads(&[("a", &[2], vec![0.5, 0.5]), ("b", &[2], vec![0.0, 0.0])]),
    )
    .unwrap();
    assert_eq!(out.keys().collect::<Vec<_>>(), ["a", "b"]);
}

#[test]
fn methods_that_cannot_feed_back() {
    for m in [
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
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
    let method = topk(1, Values::F32);
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
    // Version 2 with the checksum of residual `w` = [1.5], method, seed 3 and step 9 (CRC-32 of
    // "w\0" [1.5 f32 LE] "topk k=ratio:0.01 values=int8:256\0" "3\0" "9\0").
    let method_text = "topk k=ratio:0.01 values=int8:256";
    let mut hashed = b"w\0".to_vec();
    hashed.extend_from_slice(&1.5f32.to_le_bytes());
    for text in [method_text, "3", "9"] {
        hashed.extend_from_slice(text.as_bytes());
        hashed.push(0);
    }
    let crc = crc32fast::hash(&hashed).to_string();
    let good_meta = [
        ("format", "gradwire-error-feedback"),
        ("version", "2"),
        ("method", method_text),
        ("seed", "3"),
        ("step", "9"),
        ("crc32", crc.as_str()),
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
        ("version", "4"),
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
    let missing = checkpoint(&[&good_meta[..4], &good_meta[5..]].concat(), &[]);
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
    let err = GradientCompressor::new(CompressionMethod::Core(topk_int8()).with_error_feedback())
        .load_feedback("/nonexistent/dir/ckpt.safetensors")
        .unwrap_err();
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

fn testdata(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata")
        .join(rel)
}

/// A weight transposed between steps keeps its element count, so a residual kept by name and
/// length would be added to the wrong coordinates, silently. A residual remembers its shape
/// (in memory and in checkpoints); another shape is an error and changes nothing.
#[test]
fn a_transposed_tensor_is_refused_not_fed_its_old_residual() {
    let w = vec![1.0f32, -3.0, 0.25, 4.5, -0.75, 2.5];
    let mut fb = ErrorFeedback::new(topk(1, Values::F32), 5).unwrap();
    step_tensors_of(&mut fb, &grads(&[("w", &[2, 3], w.clone())])).unwrap();
    assert_eq!(fb.residual_shape("w"), Some(&[2usize, 3][..]));
    let before = fb.clone();
    let err = step_tensors_of(&mut fb, &grads(&[("w", &[3, 2], w.clone())])).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeChanged { tensor, expected, got }
            if tensor == "w" && expected == &[2, 3] && got == &[3, 2]),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "tensor `w`: its residual is kept in shape [2, 3], the gradient has shape [3, 2] \
         (drop or re-set that residual to go on)"
    );
    assert_eq!(fb, before, "nothing changes on error");
    // A shape that does not hold the gradient's values is refused as such.
    let err = fb
        .step_with_shapes([("w", &[2usize, 2][..], &w[..])], |_, _| {})
        .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    assert_eq!(fb, before);

    // The shape survives a checkpoint (version 3), and so does the check.
    let bytes = fb.to_bytes().unwrap();
    let mut restored = ErrorFeedback::from_bytes(&bytes).unwrap();
    assert_eq!(restored, fb);
    assert_eq!(restored.residual_shape("w"), Some(&[2usize, 3][..]));
    assert!(matches!(
        step_tensors_of(&mut restored, &grads(&[("w", &[3, 2], w.clone())])),
        Err(Error::ShapeChanged { .. })
    ));
    step_tensors_of(&mut restored, &grads(&[("w", &[2, 3], w.clone())])).unwrap();

    // The same through the compressor (its bundle path knows every tensor's shape).
    let mut c = GradientCompressor::new(CompressionMethod::TopK { k: 1 }.with_error_feedback());
    c.restore_feedback(ErrorFeedback::from_bytes(&bytes).unwrap())
        .unwrap();
    let err = c
        .compress(&grads(&[("w", &[3, 2], w.clone())]))
        .unwrap_err();
    assert!(matches!(err, Error::ShapeChanged { .. }), "{err}");
    assert_eq!(
        c.feedback(),
        Some(&ErrorFeedback::from_bytes(&bytes).unwrap())
    );
    c.compress(&grads(&[("w", &[2, 3], w)])).unwrap();
}

/// `step_with` has no shapes: its residuals have none until a shaped step gives one, and
/// checkpoints list them in `unshaped`.
#[test]
fn residuals_without_a_shape_take_the_first_one_given() {
    let w = [1.0f32, -3.0, 0.25, 4.5, -0.75, 2.5];
    let mut fb = ErrorFeedback::new(topk(1, Values::F32), 5).unwrap();
    fb.step_with([("a", &w[..]), ("w", &w[..])], |_, _| {})
        .unwrap();
    assert_eq!(fb.residual_shape("w"), None);
    let bytes = fb.to_bytes().unwrap();
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains(r#""unshaped":"[\"a\",\"w\"]""#), "{text}");
    assert_eq!(ErrorFeedback::from_bytes(&bytes).unwrap(), fb);
    fb.step_with_shapes([("w", &[3usize, 2][..], &w[..])], |_, _| {})
        .unwrap();
    assert_eq!(fb.residual_shape("w"), Some(&[3usize, 2][..]));
    let restored = ErrorFeedback::from_bytes(&fb.to_bytes().unwrap()).unwrap();
    assert_eq!(restored.residual_shape("w"), Some(&[3usize, 2][..]));
    assert_eq!(restored.residual_shape("a"), None);
    // A flat step checks the element count only; set_residual forgets the shape.
    fb.step_with([("w", &w[..])], |_, _| {}).unwrap();
    assert_eq!(fb.residual_shape("w"), Some(&[3usize, 2][..]));
    fb.set_residual("w", vec![0.0; 6]).unwrap();
    assert_eq!(fb.residual_shape("w"), None);
    fb.set_residual_with_shape("w", &[2, 3], vec![0.0; 6])
        .unwrap();
    assert_eq!(fb.residual_shape("w"), Some(&[2usize, 3][..]));
    let before = fb.clone();
    assert!(matches!(
        fb.set_residual_with_shape("w", &[4], vec![0.0; 6]),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(fb, before);
    // A checkpoint holds shapes of at most 64 dimensions (what every reader accepts).
    let mut deep = fb.clone();
    deep.set_residual_with_shape("deep", &[1; 65], vec![0.5])
        .unwrap();
    let err = deep.to_bytes().unwrap_err().to_string();
    assert!(err.contains("65 dimensions"), "{err}");
    // What `clear` drops is checked in the crate's unit tests (`feedback::tests`).
}

/// A checkpoint that the previous version (2, flat residuals) wrote still loads: its residuals
/// have no shape, so the next shaped step adopts the tensors' shapes and the checkpoint after it
/// is version 3 with shapes.
#[test]
fn a_version_2_checkpoint_still_loads() {
    let bytes = std::fs::read(testdata("checkpoint_v2/state.safetensors")).unwrap();
    let mut fb = ErrorFeedback::from_bytes(&bytes).unwrap();
    assert_eq!(
        (fb.seed(), fb.step(), *fb.method()),
        (5, 1, topk(1, Values::F32))
    );
    // Step 1 of top-1 sent 4.5 (`w`'s largest magnitude) and 2.0 (`b`'s); the rest is kept.
    assert!(same_bits(
        fb.residual("w").unwrap(),
        &[1.0, -3.0, 0.25, 0.0, -0.75, 2.5]
    ));
    assert!(same_bits(fb.residual("b").unwrap(), &[0.5, -1.25, 0.0]));
    assert_eq!(fb.residual_shape("w"), None);
    let g = grads(&[("b", &[3], vec![0.0; 3]), ("w", &[2, 3], vec![0.0; 6])]);
    step_tensors_of(&mut fb, &g).unwrap();
    assert_eq!(fb.residual_shape("w"), Some(&[2usize, 3][..]));
    let v3 = fb.to_bytes().unwrap();
    assert!(String::from_utf8_lossy(&v3).contains(r#""version":"3""#));
    assert_eq!(ErrorFeedback::from_bytes(&v3).unwrap(), fb);
}

/// Version 3 metadata and shapes are checked: a shape edited in the header (`[2,3]` to
/// `[3,2]`: the same byte count, so safetensors cannot tell) is a checksum mismatch, and a
/// missing, malformed or inconsistent `unshaped` entry is named.
#[test]
fn version_3_shapes_and_unshaped_are_checked() {
    let w = vec![1.0f32, -3.0, 0.25, 4.5, -0.75, 2.5];
    let mut fb = ErrorFeedback::new(topk(1, Values::F32), 5).unwrap();
    step_tensors_of(&mut fb, &grads(&[("w", &[2, 3], w)])).unwrap();
    let bytes = fb.to_bytes().unwrap();
    let edit = |from: &[u8], to: &[u8]| {
        let at = bytes
            .windows(from.len())
            .position(|x| x == from)
            .unwrap_or_else(|| panic!("{} in the header", String::from_utf8_lossy(from)));
        let mut b = bytes.clone();
        b[at..at + from.len()].copy_from_slice(to);
        ErrorFeedback::from_bytes(&b).unwrap_err().to_string()
    };
    assert!(edit(b"[2,3]", b"[3,2]").contains("checksum mismatch"));
    let err = edit(br#""unshaped":"[]""#, br#""unshaped":"{}""#);
    assert!(err.contains("`unshaped`"), "{err}");
    let err = edit(br#""unshaped":"[]""#, br#""unshapex":"[]""#);
    assert!(err.contains("`unshaped` is missing"), "{err}");
    // One flipped bit turns version 3 into 1 or 2: refused, not read without checksum or shapes.
    let err = edit(br#""version":"3""#, br#""version":"1""#);
    assert!(err.contains("`crc32` in a version 1 checkpoint"), "{err}");
    let err = edit(br#""version":"3""#, br#""version":"2""#);
    assert!(
        err.contains("`unshaped` in a version 2 checkpoint"),
        "{err}"
    );

    let meta = |unshaped: &'static str| {
        vec![
            ("format", "gradwire-error-feedback"),
            ("version", "3"),
            ("method", "topk k=count:1 values=f32"),
            ("seed", "5"),
            ("step", "1"),
            ("unshaped", unshaped),
            ("crc32", "0"),
        ]
    };
    let one = f32_bytes(&[1.5, 2.5]);
    let err = ErrorFeedback::from_bytes(&checkpoint(
        &meta(r#"["v"]"#),
        &[("w", Dtype::F32, vec![2], one.clone())],
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("names `v`"), "{err}");
    let err = ErrorFeedback::from_bytes(&checkpoint(
        &meta(r#"["w"]"#),
        &[("w", Dtype::F32, vec![1, 2], one)],
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("expected F32 with shape [n]"), "{err}");
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Checkpoint files are read only from regular files (their length is known before anything is
/// read: a FIFO or a device would be read until it ends or memory runs out), saved through a
/// partial file renamed into place (a failed save leaves the file that was there, and no
/// partial file), and never saved over a path that is not a regular file.
#[test]
fn checkpoint_files_are_regular_files_replaced_whole() {
    let mut fb = ErrorFeedback::new(topk(1, Values::F32), 3).unwrap();
    fb.set_residual("w", vec![0.25; 10]).unwrap();
    let dir = temp("special-files");
    std::fs::create_dir_all(&dir).unwrap();

    // A directory and a FIFO are refused, the FIFO without blocking (nobody writes to it).
    let fifo = dir.join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(
        made.is_ok_and(|s| s.success()),
        "this test needs `mkfifo` (coreutils) to make a FIFO"
    );
    for path in [&dir, &fifo] {
        match ErrorFeedback::load(path) {
            Err(Error::Checkpoint { reason }) => {
                assert!(reason.contains("not a regular file"), "{reason}")
            }
            other => panic!("{}: {other:?}", path.display()),
        }
    }
    let mut c = GradientCompressor::new(CompressionMethod::TopK { k: 1 }.with_error_feedback());
    c.restore_feedback(fb.clone()).unwrap();
    match c.save_feedback(&fifo) {
        Err(Error::Checkpoint { reason }) => assert!(reason.contains("not a regular file")),
        other => panic!("save over a FIFO: {other:?}"),
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());

    // A save that fails leaves the earlier file as it was and no partial file beside it.
    let path = dir.join("state");
    c.save_feedback(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    assert!(before == fb.to_bytes().unwrap());
    assert!(ErrorFeedback::load(&path).unwrap() == fb);
    let mut bad = ErrorFeedback::new(topk(1, Values::F32), 3).unwrap();
    bad.set_residual("__metadata__", vec![1.0; 4]).unwrap();
    let mut c2 = GradientCompressor::new(CompressionMethod::TopK { k: 1 }.with_error_feedback());
    c2.restore_feedback(bad).unwrap();
    assert!(matches!(
        c2.save_feedback(&path),
        Err(Error::Checkpoint { .. })
    ));
    assert!(std::fs::read(&path).unwrap() == before);
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A checkpoint file read from its path is what `from_bytes` reads from its bytes, refusals
/// included (the same reader runs over both): damaged, truncated and extended files.
#[test]
fn checkpoint_file_reads_as_its_bytes() {
    let mut fb = ErrorFeedback::new(topk_int8(), 9).unwrap();
    fb.set_residual_with_shape("w", &[2, 3], vec![0.5, -1.0, 2.0, 0.0, 1.5, -0.25])
        .unwrap();
    fb.set_residual("b", vec![3.0; 5]).unwrap();
    let good = fb.to_bytes().unwrap();
    let path = temp("reads-as-bytes");
    let mut cases = vec![good.clone(), good[..good.len() - 1].to_vec()];
    let mut longer = good.clone();
    longer.push(0);
    cases.push(longer);
    let mut rng = Rng(4);
    for _ in 0..50 {
        let mut b = good.clone();
        let at = (rng.next_u64() % b.len() as u64) as usize;
        b[at] ^= 1 << (rng.next_u64() % 8);
        cases.push(b);
    }
    for bytes in &cases {
        std::fs::write(&path, bytes).unwrap();
        let from_file = ErrorFeedback::load(&path).map_err(|e| e.to_string());
        let from_bytes = ErrorFeedback::from_bytes(bytes).map_err(|e| e.to_string());
        assert_eq!(from_file, from_bytes);
    }
    std::fs::remove_file(&path).ok();
}

/// `x` as the value type sends it when error feedback saturates it: the nearest of the type's
/// finite values (the largest one beyond its range).
fn sent_as(values: Values, x: f32) -> f32 {
    use half::{bf16, f16};
    match values {
        Values::F16 => f16::from_f32(x.clamp(-65504.0, 65504.0)).to_f32(),
        Values::Bf16 => bf16::from_f32(x.clamp(-bf16::MAX.to_f32(), bf16::MAX.to_f32())).to_f32(),
        _ => x,
    }
}

#[test]
fn sums_beyond_the_value_type_saturate_and_the_excess_stays_in_the_residual() {
    // Issue 48 class 2: top-k of one f16 value, 12 elements of 7000 every step. The largest
    // residual passes 65504 at step 9; before, every step from there failed. Now the sent value
    // saturates at 65504 and the residual keeps the rest: 100 steps, the error-feedback
    // identity bit for bit at every coordinate (every sum is below 2^29), the sent
    // coordinate's value and residual as computed by hand.
    let method = topk(1, Values::F16);
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    let grad = [7000.0f32; 12];
    let mut saturated = 0;
    for step in 0..100 {
        let old = fb.residual("w").map_or(vec![0.0; 12], <[f32]>::to_vec);
        let params = Params::new(method).at_step(step).for_tensor(tensor_id("w"));
        let mut frame = Vec::new();
        fb.step_with([("w", &grad[..])], |_, f| frame = f.to_vec())
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        let mut sent = vec![0.0; 12];
        gradwire::core::decode_into(&frame, &params, &mut sent).unwrap();
        let new = fb.residual("w").unwrap();
        let kept: Vec<usize> = (0..12).filter(|&i| sent[i] != 0.0).collect();
        assert_eq!(kept.len(), 1, "step {step}: {sent:?}");
        let i = kept[0];
        let x = grad[i] + old[i];
        assert_eq!(sent[i], sent_as(Values::F16, x), "step {step}");
        assert_eq!(new[i], x - sent_as(Values::F16, x), "step {step}");
        saturated += usize::from(x > 65504.0);
        for j in 0..12 {
            assert_eq!((sent[j] + new[j]).to_bits(), (grad[j] + old[j]).to_bits());
        }
    }
    assert!(saturated > 80, "{saturated} saturated steps");
    // A checkpoint saved after a clamp (residuals beyond the value type) loads.
    assert!(fb.residual("w").unwrap().iter().any(|r| r.abs() > 65504.0));
    let bytes = fb.to_bytes().unwrap();
    assert_eq!(ErrorFeedback::from_bytes(&bytes).unwrap(), fb);

    // bf16 holds nearly all of f32: a sum between its largest value and f32's saturates, and
    // a sum that overflows f32 is the step's error (NaN or infinity), as any overflow is.
    let method = topk(1, Values::Bf16);
    let mut fb = ErrorFeedback::new(method, 0).unwrap();
    let grad = [3.395e38f32, 0.0];
    let top = half::bf16::MAX.to_f32();
    let mut x = grad[0];
    for step in 0..2 {
        let params = Params::new(method).at_step(step).for_tensor(tensor_id("w"));
        let mut frame = Vec::new();
        fb.step_with([("w", &grad[..])], |_, f| frame = f.to_vec())
            .unwrap_or_else(|e| panic!("bf16 step {step}: {e}"));
        let mut sent = [0.0f32; 2];
        gradwire::core::decode_into(&frame, &params, &mut sent).unwrap();
        assert_eq!(sent, [top, 0.0], "step {step}");
        assert_eq!(fb.residual("w").unwrap()[0], x - top, "step {step}");
        x = grad[0] + (x - top);
    }
    let before = fb.clone();
    let err = fb.step_with([("w", &grad[..])], |_, _| {}).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Core {
                source: gradwire::core::Error::NonFinite { index: 0 },
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(fb, before);
}

#[test]
fn every_collective_sends_saturated_f16_sums_alike() {
    // Issue 48 class 2 on the collectives: top-k 1 of 12 with f16 values and error feedback,
    // every rank 7000 everywhere (W = 1 and 3, mean and sum): 40 steps succeed on the
    // all-gather, the two-phase collective and Auto, and give the same values.
    use gradwire::comm::LocalGroup;
    use gradwire::{Collective, CompressedAllReduce, Reduction};
    use ranks::run_ranks;
    let mut results: Vec<Vec<Vec<f32>>> = Vec::new();
    for w in [1usize, 3] {
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let mut per_collective = Vec::new();
            for collective in [
                Collective::AllGather,
                Collective::TwoPhase,
                Collective::Auto,
            ] {
                let outs = run_ranks(LocalGroup::new(w).into_communicators(), move |mut comm| {
                    let method =
                        CompressionMethod::Core(topk(1, Values::F16)).with_error_feedback();
                    let mut ar = CompressedAllReduce::new(method, w)
                        .with_collective(collective)
                        .with_reduction(reduction);
                    let g = grads(&[("w", &[12], vec![7000.0; 12])]);
                    let mut out = HashMap::new();
                    let mut all = Vec::new();
                    for step in 0..40 {
                        ar.all_reduce_on(&mut comm, &g, &mut out)
                            .unwrap_or_else(|e| panic!("{collective:?} W={w} step {step}: {e}"));
                        all.extend_from_slice(out["w"].data());
                    }
                    all
                });
                assert!(
                    outs.iter().all(|o| same_bits(o, &outs[0])),
                    "{collective:?} W={w}"
                );
                assert!(outs[0].iter().all(|x| x.is_finite()));
                per_collective.push(outs[0].clone());
            }
            results.push(per_collective);
        }
    }
    // At W = 1 every collective sends the worker's frame unchanged: the same values.
    for per_collective in &results[..2] {
        for o in per_collective {
            assert!(same_bits(o, &per_collective[0]));
        }
    }
}

#[test]
fn large_and_bucketed_tensors_send_saturated_sums_on_both_collectives() {
    // The same on the paths of large tensors (the two-phase shard selection, the chunked
    // selection) and of buckets with per-tensor top-k: W = 2, 1% of the values at +-1e5, top-k
    // 1% with f16 values and error feedback: four steps succeed on every rank with the same
    // finite mean. (Frames and residuals against the core's step: `tests/parallel.rs`.)
    use gradwire::comm::LocalGroup;
    use gradwire::{Collective, CompressedAllReduce};
    use ranks::run_ranks;
    let combinations = [
        (Collective::AllGather, BucketConfig::none()),
        (Collective::AllGather, BucketConfig::fused(64 << 10)),
        (Collective::TwoPhase, BucketConfig::none()),
    ];
    for (collective, bucketing) in combinations {
        {
            let outs = run_ranks(LocalGroup::new(2).into_communicators(), move |mut comm| {
                let rank = comm.rank() as u64;
                let method = CompressionMethod::Core(Method::TopK {
                    k: K::Ratio(0.01),
                    values: Values::F16,
                })
                .with_error_feedback();
                let mut ar = CompressedAllReduce::new(method, 2)
                    .with_collective(collective)
                    .with_bucketing(bucketing);
                let mut out = HashMap::new();
                let mut all = Vec::new();
                for step in 0..4u64 {
                    let mut rng = Rng(100 * rank + step);
                    let mut big = |n: usize| {
                        let mut v = rng.vec(n, 2.0);
                        for (i, x) in v.iter_mut().enumerate() {
                            if (i + step as usize).is_multiple_of(97) {
                                *x = if i % 2 == 0 { 1.0e5 } else { -7.0e4 };
                            }
                        }
                        v
                    };
                    let g = grads(&[
                        ("big", &[300_001], big(300_001)),
                        ("a", &[1000], big(1000)),
                        ("b", &[2000], big(2000)),
                    ]);
                    ar.all_reduce_on(&mut comm, &g, &mut out)
                        .unwrap_or_else(|e| {
                            panic!("{collective:?} {bucketing:?} step {step}: {e}")
                        });
                    for name in ["big", "a", "b"] {
                        all.extend_from_slice(out[name].data());
                    }
                }
                all
            });
            assert!(same_bits(&outs[0], &outs[1]), "{collective:?}");
            assert!(outs[0].iter().all(|x| x.is_finite() && x.abs() <= 65504.0));
            assert!(outs[0].iter().any(|x| x.abs() == 65504.0), "{collective:?}");
        }
    }
    // A bucket's per-tensor top-k, one rank: what was sent plus the new residual is the
    // gradient plus the old residual, to the bit, sent or not, beyond f16 or not.
    let method = CompressionMethod::Core(Method::TopK {
        k: K::Ratio(0.01),
        values: Values::F16,
    })
    .with_error_feedback();
    let mut c = GradientCompressor::new(method.clone());
    let mut rng = Rng(5);
    let mut g_of = |n: usize, step: usize| {
        let mut v = rng.vec(n, 2.0);
        for (i, x) in v.iter_mut().enumerate() {
            if (i + step).is_multiple_of(97) {
                *x = if i % 2 == 0 { 1.0e5 } else { -7.0e4 };
            }
        }
        v
    };
    for step in 0..4 {
        let g = grads(&[
            ("a", &[1000], g_of(1000, step)),
            ("b", &[2000], g_of(2000, step)),
        ]);
        let manifest =
            Manifest::for_gradients(&g, &method, 0, BucketConfig::fused(64 << 10)).unwrap();
        let old: Vec<Vec<f32>> = ["a", "b"]
            .iter()
            .map(|t| {
                let n = g[*t].data().len();
                c.feedback()
                    .and_then(|f| f.residual(t))
                    .map_or(vec![0.0; n], <[f32]>::to_vec)
            })
            .collect();
        let mut bundle = Vec::new();
        c.compress_bundle(&manifest, &g, 0, &mut bundle).unwrap();
        let mut sent = Vec::new();
        gradwire::Aggregator::new()
            .aggregate_into(
                &manifest,
                &[bundle],
                step as u64,
                gradwire::Reduction::Sum,
                &mut sent,
            )
            .unwrap();
        for (t, old) in ["a", "b"].iter().zip(&old) {
            let sent = manifest.slice(&sent, t).unwrap();
            let new = c.feedback().unwrap().residual(t).unwrap();
            let grad = g[*t].data();
            assert!(sent.iter().any(|x| x.abs() == 65504.0), "step {step} {t}");
            for i in 0..grad.len() {
                assert_eq!(
                    (sent[i] + new[i]).to_bits(),
                    (grad[i] + old[i]).to_bits(),
                    "step {step} {t}[{i}]"
                );
            }
        }
    }
}

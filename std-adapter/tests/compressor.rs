//! The original module's unit tests, adapted (payload bytes are now real frame bytes), plus the
//! new guarantees: determinism, error feedback rules, method texts.

mod common;

use std::collections::HashMap;

use common::{Rng, grads, same_bits};
use gradwire::Error;
use gradwire::core::{K, Method, Param, Rounding, SignScale, Values};
use gradwire::method::{
    DEFAULT_QUANT_BLOCK, DEFAULT_SIGN_BLOCK, format as format_method, parse as parse_method,
};
use gradwire::tensor::Tensor;
use gradwire::{CompressedGradient, CompressionMethod, GradientCompressor};

/// Frame bytes before the method parameters (magic, version, method, flags, reserved, n) and
/// the CRC trailer.
const FIXED: usize = 16 + 4;

fn one(name: &str, data: Vec<f32>) -> HashMap<String, Tensor> {
    HashMap::from([(name.to_owned(), Tensor::vector(data))])
}

fn round_trip(method: CompressionMethod, data: Vec<f32>) -> (CompressedGradient, Vec<f32>) {
    let mut c = GradientCompressor::new(method);
    let compressed = c.compress(&one("test", data)).unwrap();
    let restored = c.decompress(&compressed).unwrap();
    (compressed["test"].clone(), restored["test"].data().to_vec())
}

#[test]
fn test_topk_compression() {
    let gradient = vec![0.1, 0.8, 0.2, -0.9, 0.3, -0.1];
    let (compressed, restored) = round_trip(CompressionMethod::TopK { k: 3 }, gradient);
    let header = gradwire::core::peek(compressed.frame()).unwrap();
    assert_eq!(header.kept, 3);
    assert_eq!(compressed.original_size(), 6);
    // The largest magnitudes survive: -0.9, 0.8, 0.3.
    assert_eq!(restored, vec![0.0, 0.8, 0.0, -0.9, 0.3, 0.0]);

    // On a tensor of realistic size the frame is a small fraction of the dense bytes.
    let mut rng = Rng(1);
    let (compressed, _) = round_trip(CompressionMethod::TopK { k: 30 }, rng.vec(3000, 1.0));
    assert!(
        compressed.compression_ratio() < 0.1,
        "{}",
        compressed.compression_ratio()
    );
}

#[test]
fn test_threshold_compression() {
    let gradient = vec![0.1, 0.8, 0.2, -0.9, 0.3, -0.1];
    let (compressed, restored) =
        round_trip(CompressionMethod::Threshold { threshold: 0.5 }, gradient);
    // Only |g| > 0.5: 0.8 and -0.9.
    assert_eq!(gradwire::core::peek(compressed.frame()).unwrap().kept, 2);
    assert_eq!(restored, vec![0.0, 0.8, 0.0, -0.9, 0.0, 0.0]);
}

#[test]
fn test_signsgd_compression() {
    let gradient = vec![0.1, -0.8, 0.2, -0.9, 0.3, -0.1];
    // Unscaled sign: every value decodes to ±1.
    let (compressed, restored) = round_trip(CompressionMethod::SignSGDMajority, gradient.clone());
    assert_eq!(restored, vec![1.0, -1.0, 1.0, -1.0, 1.0, -1.0]);
    // 1 parameter byte (scale mode), 1 byte of signs.
    assert_eq!(compressed.payload_bytes(), FIXED + 1 + 1);
    // EF-signSGD: ±mean|g| of the block.
    let (_, restored) = round_trip(CompressionMethod::SignSGD, gradient.clone());
    let mean = gradient.iter().map(|x| x.abs()).sum::<f32>() / 6.0;
    for (r, g) in restored.iter().zip(&gradient) {
        assert!((r.abs() - mean).abs() < 1e-6, "{r} vs {mean}");
        assert_eq!(r.is_sign_negative(), g.is_sign_negative());
    }
    // On a large tensor, one bit per element: the ratio approaches 1/32.
    let n = 1 << 16;
    let (compressed, _) = round_trip(CompressionMethod::SignSGD, vec![0.5; n]);
    let scales = 4 * n / DEFAULT_SIGN_BLOCK as usize;
    assert_eq!(compressed.payload_bytes(), FIXED + 5 + scales + n / 8);
    let ratio = compressed.compression_ratio();
    assert!(ratio > 1.0 / 32.0 && ratio < 1.04 / 32.0, "{ratio}");
}

#[test]
fn test_compression_decompression_roundtrip() {
    let mut compressor = GradientCompressor::new(CompressionMethod::TopK { k: 3 });
    let grad_data = vec![0.1, 0.8, 0.2, -0.9, 0.3, -0.1];
    let gradients = HashMap::from([(
        "param1".to_string(),
        Tensor::from_vec(grad_data.clone(), &[2, 3]).unwrap(),
    )]);
    let compressed = compressor.compress(&gradients).unwrap();
    let decompressed = compressor.decompress(&compressed).unwrap();
    let result = &decompressed["param1"];
    assert_eq!(result.shape(), &[2, 3]);
    assert_eq!(result.data().len(), grad_data.len());
    assert!(result.data().contains(&0.8));
    assert!(result.data().contains(&-0.9));
}

#[test]
fn test_payload_bytes_reflects_the_method() {
    let gradient = vec![0.1_f32; 64];
    let (compressed, _) = round_trip(CompressionMethod::SignSGD, gradient.clone());
    // Scale mode + block (5), one f32 scale, 64 sign bits.
    assert_eq!(compressed.payload_bytes(), FIXED + 5 + 4 + 8);
    assert_eq!(compressed.payload_bytes(), compressed.frame().len());
    assert_eq!(compressed.dense_bytes(), 256);

    // Top-4 of a constant tensor keeps indices 0..4 (ties to the lower index): values spec (1),
    // count (8), index codec (1), one delta block of zero gaps (1 byte), 4 f32 values.
    let (compressed, restored) = round_trip(CompressionMethod::TopK { k: 4 }, gradient);
    assert_eq!(compressed.payload_bytes(), FIXED + 1 + 8 + 1 + 1 + 16);
    assert_eq!(&restored[..5], &[0.1, 0.1, 0.1, 0.1, 0.0]);
}

#[test]
fn test_dense_round_trip_preserves_positions() {
    let gradient = vec![-1.0_f32, -0.5, 0.0, 0.5, 1.0];
    let (compressed, restored) = round_trip(
        CompressionMethod::Quantization { bits: 8 },
        gradient.clone(),
    );
    // bits, rounding, block (6), one scale, 5 codes.
    assert_eq!(compressed.payload_bytes(), FIXED + 6 + 4 + 5);
    for (a, b) in restored.iter().zip(&gradient) {
        assert!((a - b).abs() < 0.005, "8-bit round trip: {a} vs {b}");
    }
}

#[test]
fn every_original_method_round_trips() {
    let mut rng = Rng(2);
    let data = rng.vec(2000, 1.0);
    for method in [
        CompressionMethod::TopK { k: 20 },
        CompressionMethod::RandomK { k: 20 },
        CompressionMethod::Threshold { threshold: 0.9 },
        CompressionMethod::Quantization { bits: 2 },
        CompressionMethod::Quantization { bits: 4 },
        CompressionMethod::SignSGD,
        CompressionMethod::SignSGDMajority,
        CompressionMethod::Float16,
        CompressionMethod::BFloat16,
        CompressionMethod::top_k_int8(0.01),
        CompressionMethod::RandomKRatio {
            ratio: 0.01,
            values: Values::Int8 { block: 256 },
        },
        CompressionMethod::ErrorFeedback {
            base_method: Box::new(CompressionMethod::TopK { k: 20 }),
        },
        CompressionMethod::Core(Method::Quant {
            bits: 3,
            block: 64,
            rounding: Rounding::Stochastic,
        }),
    ] {
        let (compressed, restored) = round_trip(method.clone(), data.clone());
        assert_eq!(restored.len(), data.len(), "{method:?}");
        assert!(
            compressed.payload_bytes() < compressed.dense_bytes(),
            "{method:?}"
        );
        assert!(restored.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn random_k_by_ratio_keeps_that_fraction_of_each_tensor() {
    // k = floor(n * ratio) per tensor, at least 1: 20 of 2000, 1 of 50; the same frames as the
    // core's method, with error feedback too.
    let mut rng = Rng(4);
    let g = grads(&[
        ("big", &[2000], rng.vec(2000, 1.0)),
        ("small", &[50], rng.vec(50, 1.0)),
    ]);
    let method = CompressionMethod::RandomKRatio {
        ratio: 0.01,
        values: Values::F16,
    };
    assert_eq!(
        method.core_method().unwrap(),
        Method::RandomK {
            k: K::Ratio(0.01),
            values: Values::F16,
            unbiased: false,
        }
    );
    for m in [method.clone(), method.with_error_feedback()] {
        let mut c = GradientCompressor::new(m.clone());
        let out = c.compress(&g).unwrap();
        let restored = c.decompress(&out).unwrap();
        let nonzero = |name: &str| restored[name].data().iter().filter(|x| **x != 0.0).count();
        assert_eq!(nonzero("big"), 20, "{m:?}");
        assert_eq!(nonzero("small"), 1, "{m:?}");
    }
}

#[test]
fn sorted_and_deterministic() {
    let mut rng = Rng(3);
    let g = grads(&[
        ("b", &[50], rng.vec(50, 1.0)),
        ("a", &[5, 10], rng.vec(50, 1.0)),
        ("c", &[], vec![0.5]),
    ]);
    let method = CompressionMethod::RandomK { k: 7 }.with_error_feedback();
    let run = || {
        let mut c = GradientCompressor::new(method.clone()).with_seed(11);
        (0..3).map(|_| c.compress(&g).unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
    let mut c = GradientCompressor::new(CompressionMethod::RandomK { k: 7 });
    let first = c.compress(&g).unwrap();
    let second = c.compress(&g).unwrap();
    assert_eq!(first["a"].step(), 0);
    assert_eq!(second["a"].step(), 1);
    assert_ne!(
        first["a"].frame(),
        second["a"].frame(),
        "random-k draws per step"
    );
}

#[test]
fn compress_into_reuses_and_prunes() {
    let g = grads(&[
        ("a", &[4], vec![1.0, 2.0, 3.0, 4.0]),
        ("b", &[2], vec![1.0, 2.0]),
    ]);
    let mut c = GradientCompressor::new(CompressionMethod::TopK { k: 1 });
    let mut out = HashMap::new();
    c.compress_into(&g, &mut out).unwrap();
    assert_eq!(out.len(), 2);
    let only_a = grads(&[("a", &[4], vec![1.0, 2.0, 3.0, 5.0])]);
    c.compress_into(&only_a, &mut out).unwrap();
    assert_eq!(out.len(), 1);
    let restored = c.decompress(&out).unwrap();
    assert_eq!(restored["a"].data(), &[0.0, 0.0, 0.0, 5.0]);
    assert!(c.get_compression_ratio() > 0.0);
}

#[test]
fn error_feedback_nothing_lost() {
    // sent + residual_new == gradient + residual_old, bit-exact with f32 values.
    let mut rng = Rng(4);
    let method = CompressionMethod::TopK { k: 5 }.with_error_feedback();
    let mut c = GradientCompressor::new(method);
    let mut residual = vec![0.0f32; 100];
    for _ in 0..10 {
        let g = one("w", rng.vec(100, 1.0));
        let compressed = c.compress(&g).unwrap();
        let sent = c.decompress(&compressed).unwrap();
        let new_residual = c.feedback().unwrap().residual("w").unwrap();
        for i in 0..100 {
            let lhs = sent["w"].data()[i] + new_residual[i];
            let rhs = g["w"].data()[i] + residual[i];
            assert_eq!(lhs.to_bits(), rhs.to_bits(), "index {i}");
        }
        residual = new_residual.to_vec();
    }
    c.reset_error_buffer();
    assert!(c.feedback().unwrap().residuals().next().is_none());
    assert_eq!(c.step(), 10);
}

#[test]
fn error_feedback_step_is_all_or_nothing() {
    let method = CompressionMethod::TopK { k: 1 }.with_error_feedback();
    let mut c = GradientCompressor::new(method);
    let good = grads(&[
        ("a", &[3], vec![1.0, 2.0, 3.0]),
        ("b", &[3], vec![3.0, 2.0, 1.0]),
    ]);
    c.compress(&good).unwrap();
    let before = c.feedback().unwrap().clone();
    // NaN in `b` (sorted after `a`): neither residual changes, nor the step.
    let bad = grads(&[
        ("a", &[3], vec![5.0, 6.0, 7.0]),
        ("b", &[3], vec![1.0, f32::NAN, 1.0]),
    ]);
    let mut out = HashMap::new();
    let err = c.compress_into(&bad, &mut out).unwrap_err();
    match &err {
        Error::Core { tensor, source, .. } => {
            assert_eq!(tensor, "b");
            assert_eq!(*source, gradwire::core::Error::NonFinite { index: 1 });
        }
        other => panic!("{other}"),
    }
    assert!(out.is_empty(), "no output on error");
    assert_eq!(c.feedback().unwrap(), &before);
    assert_eq!(c.step(), 1);
    // A tensor whose length changes is an error, never truncated.
    let longer = grads(&[("a", &[4], vec![1.0; 4]), ("b", &[3], vec![1.0; 3])]);
    let err = c.compress(&longer).unwrap_err();
    assert!(
        matches!(&err, Error::LengthChanged { tensor, expected: 3, got: 4 } if tensor == "a"),
        "{err}"
    );
    assert_eq!(c.feedback().unwrap(), &before);
}

#[test]
fn f16_out_of_range_is_an_error() {
    let mut c = GradientCompressor::new(CompressionMethod::Float16);
    let err = c.compress(&one("w", vec![1.0, 1e6])).unwrap_err();
    assert!(
        matches!(&err, Error::Core { tensor, source: gradwire::core::Error::ValueOutOfRange { index: 1 }, .. } if tensor == "w"),
        "{err}"
    );
}

#[test]
fn invalid_methods_are_errors() {
    for method in [
        CompressionMethod::Quantization { bits: 9 },
        CompressionMethod::Quantization { bits: 1 },
        CompressionMethod::Threshold {
            threshold: f32::NAN,
        },
        CompressionMethod::Threshold { threshold: -1.0 },
        CompressionMethod::TopKRatio {
            ratio: -0.5,
            values: Values::F32,
        },
        CompressionMethod::RandomKRatio {
            ratio: f64::NAN,
            values: Values::F16,
        },
        CompressionMethod::SignSGDMajority.with_error_feedback(),
        CompressionMethod::ErrorFeedback {
            base_method: Box::new(CompressionMethod::SignSGD.with_error_feedback()),
        },
        CompressionMethod::Core(Method::RandomK {
            k: K::Count(3),
            values: Values::F32,
            unbiased: true,
        })
        .with_error_feedback(),
        CompressionMethod::Core(Method::Dense {
            values: Values::Int8 { block: 4 },
        }),
    ] {
        let mut c = GradientCompressor::new(method.clone());
        let err = c.compress(&one("w", vec![1.0, 2.0])).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{method:?}: {err}");
        assert_eq!(c.step(), 0);
    }
}

#[test]
fn decompress_checks_the_receivers_method() {
    let g = one("w", vec![1.0, 2.0, 3.0]);
    let mut sender = GradientCompressor::new(CompressionMethod::TopK { k: 2 });
    let compressed = sender.compress(&g).unwrap();
    let receiver = GradientCompressor::new(CompressionMethod::TopK { k: 1 });
    let err = receiver.decompress(&compressed).unwrap_err();
    assert!(
        matches!(&err, Error::ParamsDiffer { tensor, param: Param::K, .. } if tensor == "w"),
        "{err}"
    );
    // The frame is bound to its tensor for random-k (tensor id) and to the seed.
    let mut sender = GradientCompressor::new(CompressionMethod::RandomK { k: 2 }).with_seed(1);
    let compressed = sender.compress(&g).unwrap();
    let receiver = GradientCompressor::new(CompressionMethod::RandomK { k: 2 }).with_seed(2);
    assert!(receiver.decompress(&compressed).is_err());
    let renamed = HashMap::from([("v".to_owned(), compressed["w"].clone())]);
    let receiver = GradientCompressor::new(CompressionMethod::RandomK { k: 2 }).with_seed(1);
    assert!(receiver.decompress(&renamed).is_err());
    assert!(receiver.decompress(&compressed).is_ok());
}

#[test]
fn received_frames() {
    let g = one("w", vec![1.0, 2.0, 3.0, 4.0]);
    let mut c = GradientCompressor::new(CompressionMethod::TopK { k: 2 });
    let frame = c.compress(&g).unwrap()["w"].frame().to_vec();
    let cg = CompressedGradient::from_frame(frame.clone(), vec![2, 2], 0).unwrap();
    let out = c
        .decompress(&HashMap::from([("w".to_owned(), cg)]))
        .unwrap();
    assert_eq!(out["w"].shape(), &[2, 2]);
    assert_eq!(out["w"].data(), &[0.0, 0.0, 3.0, 4.0]);
    assert!(CompressedGradient::from_frame(frame.clone(), vec![5], 0).is_err());
    assert!(CompressedGradient::from_frame(frame[..frame.len() - 1].to_vec(), vec![4], 0).is_err());
}

#[test]
fn method_texts_round_trip() {
    let methods = [
        Method::Dense {
            values: Values::F32,
        },
        Method::Dense {
            values: Values::Bf16,
        },
        Method::TopK {
            k: K::Ratio(0.01),
            values: Values::Int8 { block: 256 },
        },
        Method::TopK {
            k: K::Count(17),
            values: Values::F16,
        },
        Method::Threshold {
            threshold: 1e-7,
            values: Values::F32,
        },
        Method::RandomK {
            k: K::Ratio(1.0 / 3.0),
            values: Values::Bf16,
            unbiased: true,
        },
        Method::Quant {
            bits: 4,
            block: DEFAULT_QUANT_BLOCK,
            rounding: Rounding::NearestEven,
        },
        Method::Quant {
            bits: 7,
            block: 3,
            rounding: Rounding::Stochastic,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 1024 },
            zero_mask: false,
        },
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        },
    ];
    for m in methods {
        let text = format_method(&m);
        assert_eq!(parse_method(&text).unwrap(), m, "{text}");
    }
    for bad in [
        "",
        "topk",
        "topk k=count:1",
        "topk k=count:1 values=f64",
        "topk k=count:1 values=f32 extra=1",
        "topk k=count:1 k=count:2 values=f32",
        "quant bits=9 block=4 rounding=stochastic",
        "sign scale=mean-abs:0",
        "nope",
    ] {
        assert!(parse_method(bad).is_err(), "{bad}");
    }
}

#[test]
fn tensors_check_their_shape() {
    assert!(Tensor::new(vec![2, 3], vec![0.0; 6]).is_ok());
    assert!(matches!(
        Tensor::new(vec![2, 3], vec![0.0; 5]),
        Err(Error::Shape {
            expected: 6,
            got: 5,
            ..
        })
    ));
    assert!(matches!(
        Tensor::from_vec(vec![], &[usize::MAX, 2]),
        Err(Error::ShapeOverflow { .. })
    ));
    let s = Tensor::new(vec![], vec![2.0]).unwrap();
    assert_eq!((s.shape(), s.data().len()), (&[] as &[usize], 1));
    assert_eq!(Tensor::zeros(&[0, 4]).unwrap().data().len(), 0);
    let (c, r) = round_trip(CompressionMethod::TopK { k: 1 }, vec![]);
    assert_eq!((c.original_size(), r.len()), (0, 0));
    assert!(same_bits(&r, &[]));
}

#[test]
fn resuming_at_a_step_without_error_feedback() {
    let mut rng = Rng(12);
    let g = grads(&[("w", &[100], rng.vec(100, 1.0))]);
    let method = CompressionMethod::RandomK { k: 10 };
    let mut straight = GradientCompressor::new(method.clone()).with_seed(4);
    for _ in 0..5 {
        straight.compress(&g).unwrap();
    }
    let mut resumed = GradientCompressor::new(method).with_seed(4);
    resumed.set_step(5);
    assert_eq!(resumed.step(), 5);
    assert_eq!(
        straight.compress(&g).unwrap(),
        resumed.compress(&g).unwrap()
    );
    // Taking the error-feedback state out and giving it back.
    let mut ef = GradientCompressor::new(CompressionMethod::TopK { k: 10 }.with_error_feedback());
    ef.compress(&g).unwrap();
    let state = ef.feedback().unwrap().clone();
    assert_eq!(state.step(), 1);
    ef.restore_feedback(state).unwrap();
    assert_eq!(ef.step(), 1);
}

/// The library reads a model's gradients from safetensors (a new user had to unpack them by
/// hand): the MiniLM file, bit for bit as the tests' own reader does, and a float16 tensor is
/// an error naming it.
#[test]
fn read_safetensors_reads_a_models_gradients() {
    use gradwire::tensor::{read_safetensors, write_safetensors};
    let bytes = std::fs::read(common::MINILM).unwrap();
    let read = read_safetensors(&bytes).unwrap();
    let expected = common::minilm();
    assert_eq!(read.len(), expected.len());
    assert!(read.windows(2).all(|w| w[0].0 < w[1].0), "sorted by name");
    for (name, t) in &read {
        assert_eq!(t.shape(), expected[name].shape(), "{name}");
        assert!(same_bits(t.data(), expected[name].data()), "{name}");
    }
    assert_eq!(
        read_safetensors(&write_safetensors(&read).unwrap()).unwrap(),
        read
    );

    let half = [0u8; 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::tensor::Dtype::F16, vec![2], &half)
            .unwrap();
    let bytes = safetensors::serialize([("h", view)], None).unwrap();
    let err = read_safetensors(&bytes).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor `h` has dtype F16; gradwire reads float32 tensors"
    );
    assert!(matches!(
        read_safetensors(b"not safetensors"),
        Err(Error::Safetensors { .. })
    ));
}

/// `write_safetensors` refuses what safetensors cannot store or read back (a cold review found
/// that a name given twice panicked inside safetensors).
#[test]
fn write_safetensors_refuses_duplicate_and_reserved_names() {
    use gradwire::tensor::write_safetensors;
    let t = |n: usize| Tensor::vector(vec![1.0; n]);
    let twice = vec![("w".to_string(), t(2)), ("w".to_string(), t(3))];
    assert!(matches!(
        write_safetensors(&twice),
        Err(Error::DuplicateTensor { tensor }) if tensor == "w"
    ));
    let reserved = vec![("__metadata__".to_string(), t(1))];
    assert!(matches!(
        write_safetensors(&reserved),
        Err(Error::Config { .. })
    ));
}

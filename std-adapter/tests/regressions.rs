//! Named regression tests for what the fuzz targets found in the std crate (FUZZING.md lists
//! them). Each runs on stable; the inputs are inline.

mod common;
use gradwire::TensorSpec;
use gradwire::reference::{self, Entry, Mode, ReferenceError};

/// Found by the `reference` target's finiteness check: a `topk-int8` payload whose scale is
/// finite but so large that `127 × scale` overflows passed `parse`, and `decode` then turned code 127 into
/// infinity in the receiver's gradient. Such a scale is now `BadScale`; the largest scale that
/// keeps every code finite (here `f32::MAX / 128`) still decodes.
#[test]
fn reference_int8_scale_that_overflows_is_rejected() {
    let spec = [TensorSpec::new("w", vec![4])];
    for (scale, ok) in [
        (1.0e38f32, false),
        (f32::MAX, false),
        (f32::MAX / 128.0, true),
        (1.0, true),
    ] {
        let e = Entry::TopKInt8 {
            indices: vec![1, 3],
            codes: vec![127, -127],
            scale,
        };
        let payload = reference::to_bytes([("w", &[4usize][..], &e)]).expect("payload");
        let r = reference::decode(&payload, Mode::TopKInt8, &spec);
        if ok {
            let d = r.expect("decodes");
            assert!(d[0].iter().all(|v| v.is_finite()), "{scale}: {d:?}");
        } else {
            assert!(
                matches!(r, Err(ReferenceError::BadScale { .. })),
                "{scale}: {r:?}"
            );
        }
    }
}

/// A checkpoint header whose tensors declare data that, added up, ends past `usize::MAX`:
/// eight `U8` tensors of `2^61 - 1` bytes each, contiguous offsets, over a file of a few
/// hundred bytes. safetensors 0.8 adds the declared data end to the header length unchecked,
/// which panicked ("attempt to add with overflow") wherever overflow checks are on (debug
/// builds, the fuzz build). `from_bytes` must refuse it with an error, allocating nothing of
/// the declared size.
#[test]
fn checkpoint_with_data_offsets_near_usize_max_is_an_error() {
    use gradwire::feedback::ErrorFeedback;
    let bytes = common::safetensors_with_offsets_near_usize_max(
        "\"__metadata__\":{\"format\":\"gradwire-error-feedback\",\"version\":\"1\",\
         \"method\":\"topk k=count:1 values=f32\",\"seed\":\"0\",\"step\":\"0\"}",
    );
    let r = ErrorFeedback::from_bytes(&bytes);
    assert!(r.is_err(), "{r:?}");
}

/// The same overflow through the reference layout's readers (payloads from the network): an
/// error, never a panic (the workspace builds safetensors with overflow checks on, so this test
/// fails in release builds too if a reader skips the checked header parse).
#[test]
fn reference_payload_with_offsets_near_usize_max_is_an_error() {
    use gradwire::TensorSpec;
    use gradwire::reference::{Mode, decode, parse, summarize};
    let bytes = common::safetensors_with_offsets_near_usize_max("");
    let specs = [TensorSpec::new("t0", vec![4])];
    for mode in Mode::ALL {
        assert!(parse(&bytes, mode, &specs).is_err(), "{mode:?}");
        assert!(decode(&bytes, mode, &specs).is_err(), "{mode:?}");
    }
    assert!(summarize(&bytes).is_err());
    assert!(gradwire::safetensors_reader::deserialize(&bytes).is_err());
}

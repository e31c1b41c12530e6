//! Named regression tests for what the fuzz targets found in the std crate (FUZZING.md lists
//! them). Each runs on stable; the inputs are inline.

use gradwire::bundle::TensorSpec;
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

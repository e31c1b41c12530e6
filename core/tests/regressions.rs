//! Named regression tests for what the fuzz targets found in `gradwire-core` (FUZZING.md lists
//! them). Each runs on stable; the crashing inputs are inline.

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/input.rs"]
mod input;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/gens.rs"]
mod gens;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/core_targets.rs"]
mod core_targets;

use gradwire_core::{
    K, Method, Params, Rounding, SignScale, Values, encode_into, max_frame_len, scratch_len,
};

fn methods() -> Vec<Method> {
    let mut v = vec![
        Method::Dense {
            values: Values::F32,
        },
        Method::Dense {
            values: Values::F16,
        },
        Method::Dense {
            values: Values::Bf16,
        },
        Method::TopK {
            k: K::Ratio(0.1),
            values: Values::Int8 { block: 3 },
        },
        Method::TopK {
            k: K::Ratio(0.5),
            values: Values::F16,
        },
        Method::Threshold {
            threshold: 0.3,
            values: Values::F32,
        },
        Method::RandomK {
            k: K::Ratio(0.2),
            values: Values::Bf16,
            unbiased: true,
        },
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        },
    ];
    for block in [1, 7, 8, 64, 1024] {
        v.push(Method::Sign {
            scale: SignScale::MeanAbs { block },
            zero_mask: false,
        });
        for bits in [2, 3, 4, 5, 8] {
            v.push(Method::Quant {
                bits,
                block,
                rounding: Rounding::NearestEven,
            });
        }
    }
    v
}

/// Found by `roundtrip` (encoder is not deterministic) while the SIMD sign packer was being
/// written: for n = 537 (and other lengths with a partial 32-element chunk) the last bytes of
/// the sign section were left unwritten, so the frame carried whatever the caller's buffer held
/// before. Every method, every length around the SIMD chunk sizes: the frame must not depend
/// on the previous contents of the output or scratch buffers.
#[test]
fn frames_do_not_depend_on_previous_buffer_contents() {
    let lens: Vec<usize> = (0..=72)
        .chain([
            127, 128, 129, 255, 256, 257, 511, 512, 513, 515, 537, 1023, 1025,
        ])
        .collect();
    for m in methods() {
        let params = Params::new(m).with_seed(3).at_step(1).for_tensor(9);
        for &n in &lens {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 613) as f32 - 306.0) / 64.0)
                .collect();
            let max = max_frame_len(n, &m);
            let sl = scratch_len(n, &m);
            let mut a = vec![0x00u8; max];
            let mut b = vec![0xa5u8; max];
            let la = encode_into(&g, &params, &mut vec![0; sl], &mut a).expect("encode");
            let lb = encode_into(&g, &params, &mut vec![u32::MAX; sl], &mut b).expect("encode");
            assert_eq!(
                a[..la],
                b[..lb],
                "{m:?}, n = {n}: frame depends on the buffer"
            );
        }
    }
}

/// The `roundtrip` input of the finding above (sign, block 1024 after the generator, n = 537),
/// as the fuzz target reads it.
#[test]
fn roundtrip_sign_537() {
    let mut data = vec![0x19, 0x02, 0x02, 0x92];
    // 537 elements: small integers times 2^-4 (generator shape 2), then the method bytes:
    // not rare, selector 5 (sign), scale byte 1 (mean |g|), block selector 3 (1024).
    data.extend((0..537u32).map(|i| (i * 37 % 251) as u8));
    data.extend_from_slice(&[0, 5, 1, 3, 0, 0, 0, 0]);
    core_targets::roundtrip(&data);
}

/// Issue "Hostile input and faults, round 2", item 1: a 21-byte dense frame whose element count
/// makes its section end within 4 bytes of `usize::MAX` (n = 2^62 - 5 f32 values: the section
/// ends at 2^64 - 3). Building the `Truncated` error added the trailer's 4 bytes unchecked: a
/// panic with overflow checks on (debug and fuzz builds), and in release a wrapped `needed` of
/// 1 byte, reported as a frame that "declares at least 1 byte" (the re-parse of the "cut short
/// or checksum?" diagnosis reached it too, so a wrong CRC did not protect). Every reader of the
/// frame must refuse it with a count above what the frame has.
#[test]
#[cfg(target_pointer_width = "64")]
fn a_section_ending_near_usize_max_is_truncated_not_wrapped() {
    use gradwire_core::{Error, decode_into, peek, validate};
    for (values, width) in [(Values::F32, 4u64), (Values::F16, 2), (Values::Bf16, 2)] {
        let method = Method::Dense { values };
        let mut frame = vec![0u8; max_frame_len(1, &method)];
        let len = encode_into(&[1.0], &Params::new(method), &mut [], &mut frame).unwrap();
        frame.truncate(len);
        // The fixed header, the value spec, one value, the CRC: drop the value, then declare
        // element counts whose section ends at usize::MAX - 3 ..= usize::MAX.
        frame.drain(17..17 + width as usize);
        assert_eq!(frame.len(), 21);
        for back in 0..4u64 {
            // The section ends at 17 + n * width: within `width` of usize::MAX for back = 0.
            let n = (u64::MAX - 17) / width - back;
            for fix_crc in [false, true] {
                let mut f = frame.clone();
                f[8..16].copy_from_slice(&n.to_le_bytes());
                if fix_crc {
                    let crc = crc32fast::hash(&f[..17]);
                    f[17..].copy_from_slice(&crc.to_le_bytes());
                }
                let params = Params::new(method);
                let mut out = [0.0f32; 1];
                for err in [
                    peek(&f).unwrap_err(),
                    validate(&f, &params, 1).unwrap_err(),
                    decode_into(&f, &params, &mut out).unwrap_err(),
                ] {
                    match err {
                        Error::Truncated { needed, got }
                        | Error::Incomplete {
                            declared: needed,
                            got,
                        } => assert!(needed > got, "{values:?} n {n}: {err}"),
                        Error::ElementCount { .. } => {}
                        other => panic!("{values:?} n {n}: unexpected {other}"),
                    }
                }
            }
        }
    }
}

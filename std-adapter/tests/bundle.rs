//! Bundles: layout, bytes on the wire for the MiniLM gradients, validation against the manifest.

mod common;

use std::collections::HashMap;

use common::{MINILM_VALUES, grads, minilm};
use gradwire::core::{K, Method, Param, Values};
use gradwire::layout::{Manifest, TensorSpec};

// The bundle's framing, as FORMAT.md section 10 specifies it (independent of the crate's
// constants): magic, header, entry header and CRC-32 trailer lengths.
const BUNDLE_MAGIC: [u8; 4] = *b"GWBN";
const HEADER_LEN: usize = 24;
const ENTRY_HEADER_LEN: usize = 12;
const TRAILER_LEN: usize = 4;
use gradwire::BucketConfig;
use gradwire::layout::TopKScope;
use gradwire::method::{DEFAULT_INT8_BLOCK, format as format_method};
use gradwire::tensor::Tensor;
use gradwire::{BundleFault, Error};
use gradwire::{CompressionMethod, GradientCompressor};

fn bundle_of(
    method: &CompressionMethod,
    grads: &HashMap<String, Tensor>,
    bucketing: BucketConfig,
    rank: usize,
) -> (Manifest, Vec<u8>, u64) {
    let manifest = Manifest::for_gradients(grads, method, 0, bucketing).unwrap();
    let mut c = GradientCompressor::new(method.clone());
    let mut out = Vec::new();
    let step = c.compress_bundle(&manifest, grads, rank, &mut out).unwrap();
    (manifest, out, step)
}

fn kept_of(manifest: &Manifest) -> u64 {
    manifest
        .entries()
        .iter()
        .map(|e| match e.method {
            Method::TopK { k, .. } => k.resolve(e.len as u64),
            _ => e.len as u64,
        })
        .sum()
}

/// DESIGN's bytes targets, counting every byte of the bundle.
#[test]
fn minilm_bytes_targets() {
    let g = minilm();
    assert_eq!(g.len(), 12);
    assert_eq!(
        g.values().map(|t| t.data().len()).sum::<usize>(),
        MINILM_VALUES
    );
    let cases: [(&str, CompressionMethod, BucketConfig); 4] = [
        (
            "top-k 1% int8",
            CompressionMethod::top_k_int8(0.01),
            BucketConfig::none(),
        ),
        (
            "top-k 1% int8, 64 KiB buckets",
            CompressionMethod::top_k_int8(0.01),
            BucketConfig::fused(64 << 10),
        ),
        (
            "top-k 1% f16",
            CompressionMethod::TopKRatio {
                ratio: 0.01,
                values: Values::F16,
            },
            BucketConfig::none(),
        ),
        (
            "top-k 1% f16, 64 KiB buckets",
            CompressionMethod::TopKRatio {
                ratio: 0.01,
                values: Values::F16,
            },
            BucketConfig::fused(64 << 10),
        ),
    ];
    for (what, method, bucketing) in cases {
        let (manifest, bundle, _) = bundle_of(&method, &g, bucketing, 0);
        let kept = kept_of(&manifest);
        let per_kept = bundle.len() as f64 / kept as f64;
        println!(
            "{what}: {} entries, {} bytes, {kept} kept, {per_kept:.4} bytes per kept element",
            manifest.entries().len(),
            bundle.len()
        );
        let limit = if what.contains("int8") { 2.3 } else { 3.3 };
        assert!(per_kept <= limit, "{what}: {per_kept} > {limit}");
    }
    for (what, method, limit) in [
        ("sign", CompressionMethod::SignSGD, 1.05),
        ("4-bit", CompressionMethod::Quantization { bits: 4 }, 4.1),
    ] {
        let (_, bundle, _) = bundle_of(&method, &g, BucketConfig::none(), 0);
        let bits = bundle.len() as f64 * 8.0 / MINILM_VALUES as f64;
        println!("{what}: {} bytes, {bits:.4} bits per element", bundle.len());
        assert!(bits <= limit, "{what}: {bits} > {limit}");
    }
}

#[test]
fn layout_is_as_documented() {
    let g = grads(&[("a", &[3], vec![1.0, -2.0, 3.0]), ("b", &[], vec![5.0])]);
    let method = CompressionMethod::Core(Method::Dense {
        values: Values::F32,
    });
    let (manifest, bundle, step) = bundle_of(&method, &g, BucketConfig::none(), 7);
    assert_eq!(step, 0);
    assert_eq!(&bundle[..4], &BUNDLE_MAGIC);
    assert_eq!(bundle[4], 2);
    assert_eq!(&bundle[5..8], &[0, 0, 0]);
    assert_eq!(u32::from_le_bytes(bundle[8..12].try_into().unwrap()), 7);
    assert_eq!(u32::from_le_bytes(bundle[12..16].try_into().unwrap()), 2);
    assert_eq!(u64::from_le_bytes(bundle[16..24].try_into().unwrap()), 0);
    let mut pos = HEADER_LEN;
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        let id = u64::from_le_bytes(bundle[pos..pos + 8].try_into().unwrap());
        // FNV-1a over the label (here the name) and a 0 byte, then the tensor's name, a 0 byte
        // and its shape: [3] for `a`, [] for `b`.
        let shape: &[u64] = if name == "a" { &[3] } else { &[] };
        let mut hashed = Vec::new();
        for _ in 0..2 {
            hashed.extend_from_slice(name.as_bytes());
            hashed.push(0);
        }
        hashed.extend_from_slice(&(shape.len() as u64).to_le_bytes());
        for d in shape {
            hashed.extend_from_slice(&d.to_le_bytes());
        }
        assert_eq!(id, fnv1a(&hashed));
        assert_eq!(manifest.entries()[i].id, id);
        // The frames' tensor id (the key of random draws) is the name's alone.
        assert_eq!(
            manifest.entries()[i].tensor_id,
            gradwire::core::tensor_id(name)
        );
        let len = u32::from_le_bytes(bundle[pos + 8..pos + 12].try_into().unwrap()) as usize;
        let frame = &bundle[pos + ENTRY_HEADER_LEN..pos + ENTRY_HEADER_LEN + len];
        assert_eq!(&frame[..4], b"GWRF");
        pos += ENTRY_HEADER_LEN + len;
    }
    assert_eq!(pos + TRAILER_LEN, bundle.len());
    let crc = crc32(&bundle[..pos]);
    assert_eq!(u32::from_le_bytes(bundle[pos..].try_into().unwrap()), crc);
    let h = manifest.check_bundle(&bundle, None, None).unwrap();
    assert_eq!((h.version, h.rank, h.entries, h.step), (2, 7, 2, 0));
}

/// FNV-1a, 64 bits, independent of the crate's.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Bitwise CRC-32 (IEEE), independent of the crate's.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn decode_matches_per_tensor_decompress() {
    let g = minilm();
    for method in [
        CompressionMethod::top_k_int8(0.01),
        CompressionMethod::SignSGD,
        CompressionMethod::Quantization { bits: 4 },
        CompressionMethod::RandomK { k: 100 },
        CompressionMethod::Float16,
    ] {
        let (manifest, bundle, step) = bundle_of(&method, &g, BucketConfig::none(), 0);
        let mut flat = Vec::new();
        manifest
            .decode_bundle(&bundle, Some(0), Some(step), &mut flat)
            .unwrap();
        let decoded = manifest.to_tensors(&flat).unwrap();
        let mut c = GradientCompressor::new(method.clone());
        let compressed = c.compress(&g).unwrap();
        let per_tensor = c.decompress(&compressed).unwrap();
        assert_eq!(decoded.len(), per_tensor.len());
        for (name, t) in &per_tensor {
            assert_eq!(decoded[name].shape(), t.shape(), "{name}");
            assert!(
                common::same_bits(decoded[name].data(), t.data()),
                "{method:?} {name}"
            );
        }
    }
}

#[test]
fn every_truncation_and_bit_flip_is_an_error() {
    let g = grads(&[
        ("a", &[40], (0..40).map(|i| i as f32 - 20.0).collect()),
        ("b", &[2, 3], vec![0.5, -0.25, 4.0, 0.0, 1.0, -8.0]),
    ]);
    let method = CompressionMethod::TopK { k: 3 };
    let (manifest, bundle, step) = bundle_of(&method, &g, BucketConfig::fused(1024), 0);
    let mut out = vec![7.0f32; 3];
    for len in 0..bundle.len() {
        assert!(
            manifest
                .decode_bundle(&bundle[..len], Some(0), Some(step), &mut out)
                .is_err(),
            "prefix {len}"
        );
        assert_eq!(out, vec![7.0f32; 3], "output touched by prefix {len}");
        // A bundle cut short is named as such, not as a checksum mismatch: empty, truncated
        // below the fixed header and trailer, incomplete (checksum failed) beyond.
        let e = manifest.check_bundle(&bundle[..len], None, None);
        let named = match &e {
            Err(Error::Bundle { fault, .. }) => match *fault {
                BundleFault::Empty => len == 0,
                BundleFault::Truncated { got, .. } => {
                    len > 0 && len < HEADER_LEN + TRAILER_LEN && got == len
                }
                BundleFault::Incomplete { declared, got } => declared > len && got == len,
                _ => false,
            },
            _ => false,
        };
        assert!(named, "prefix {len}: {e:?}");
    }
    for i in 0..bundle.len() {
        for bit in [0, 3, 7] {
            let mut bad = bundle.clone();
            bad[i] ^= 1 << bit;
            assert!(
                manifest
                    .decode_bundle(&bad, Some(0), Some(step), &mut out)
                    .is_err(),
                "flip at {i}"
            );
            // Past the magic, version and reserved bytes, the bundle's checksum names every
            // flip (or, for an entry count or length that now runs past the end, the cut),
            // whether it falls in the framing, a frame's body or a frame's trailer (the
            // checksum is combined from the frames' own when they pass, and read over the bytes
            // when anything fails).
            if i >= 8 {
                let e = manifest.check_bundle(&bad, Some(0), Some(step));
                assert!(
                    matches!(
                        e,
                        Err(Error::Bundle {
                            fault: BundleFault::Checksum { .. } | BundleFault::Incomplete { .. },
                            ..
                        })
                    ),
                    "flip at {i}: {e:?}"
                );
            }
        }
    }
    let mut longer = bundle.clone();
    longer.push(0);
    assert!(manifest.check_bundle(&longer, Some(0), Some(step)).is_err());
    manifest.check_bundle(&bundle, Some(0), Some(step)).unwrap();
}

#[test]
fn rank_and_step_must_match() {
    let g = grads(&[("w", &[4], vec![1.0, 2.0, 3.0, 4.0])]);
    let method = CompressionMethod::TopK { k: 2 };
    let (manifest, bundle, step) = bundle_of(&method, &g, BucketConfig::none(), 2);
    let err = manifest
        .check_bundle(&bundle, Some(1), Some(step))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                rank: Some(1),
                fault: BundleFault::Rank {
                    expected: 1,
                    got: 2
                }
            }
        ),
        "{err}"
    );
    let err = manifest
        .check_bundle(&bundle, Some(2), Some(5))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                rank: Some(2),
                fault: BundleFault::Step {
                    expected: 5,
                    got: 0
                }
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("rank 2"), "{err}");
    // Unspecified rank and step: taken from the bundle.
    let h = manifest.check_bundle(&bundle, None, None).unwrap();
    assert_eq!((h.rank, h.step), (2, 0));
}

#[test]
fn manifest_mismatches_name_tensor_and_rank() {
    let g = grads(&[
        ("a", &[4], vec![1.0, 2.0, 3.0, 4.0]),
        ("b", &[3], vec![1.0, -2.0, 3.0]),
    ]);
    let method = CompressionMethod::TopK { k: 2 };
    let (_, bundle, _) = bundle_of(&method, &g, BucketConfig::none(), 3);

    // Another method: the frame of `a` is refused, naming `a` and rank 3.
    let other = Manifest::for_gradients(
        &g,
        &CompressionMethod::TopK { k: 1 },
        0,
        BucketConfig::none(),
    )
    .unwrap();
    let err = other.check_bundle(&bundle, Some(3), Some(0)).unwrap_err();
    match &err {
        Error::ParamsDiffer {
            tensor,
            rank,
            param,
            frame,
            expected,
        } => {
            assert_eq!((tensor.as_str(), *rank, *param), ("a", Some(3), Param::K));
            assert!(frame.contains("k=count:") && expected.contains("k=count:1"));
            assert!(err.to_string().contains("from rank 3"), "{err}");
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("`a`") && err.to_string().contains("rank 3"));

    // Another element count.
    let specs = vec![TensorSpec::new("a", [5]), TensorSpec::new("b", [3])];
    let other = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
    let err = other.check_bundle(&bundle, Some(3), Some(0)).unwrap_err();
    // The entry id hashes the shape: another entry, with both element counts in the message.
    assert!(
        matches!(&err, Error::UnexpectedEntry { rank: Some(3), index: 0, expected, expected_elements: 5, got_elements: Some(4), .. } if expected == "a"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("from rank 3: entry 0 is not `a` as the manifest has it (another tensor or bucket, or another shape: the frame has 4 elements, the manifest 5;"),
        "{err}"
    );

    // Another tensor name at a position: the entry id differs.
    let specs = vec![TensorSpec::new("a", [4]), TensorSpec::new("c", [3])];
    let other = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
    let err = other.check_bundle(&bundle, Some(3), Some(0)).unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedEntry { rank: Some(3), index: 1, expected, .. } if expected == "c"),
        "{err}"
    );

    // Another number of tensors.
    let specs = vec![TensorSpec::new("a", [4])];
    let other = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
    let err = other.check_bundle(&bundle, Some(3), Some(0)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                rank: Some(3),
                fault: BundleFault::EntryCount {
                    expected: 1,
                    got: 2,
                    ..
                },
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .ends_with("(the bundle has more entries after entry 0)"),
        "{err}"
    );
    // A tensor missing in the middle: the first entry that differs names it.
    let specs = vec![
        TensorSpec::new("a", [4]),
        TensorSpec::new("a2", [2]),
        TensorSpec::new("b", [3]),
    ];
    let other = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
    let err = other.check_bundle(&bundle, Some(3), Some(0)).unwrap_err();
    assert!(
        err.to_string().ends_with(
            "holds 2 entries, the manifest has 3 (the first that differs is entry 1, where the \
             manifest has `a2`)"
        ),
        "{err}"
    );

    // Another order.
    let specs = vec![TensorSpec::new("b", [3]), TensorSpec::new("a", [4])];
    let other = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
    let err = other.check_bundle(&bundle, Some(3), Some(0)).unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedEntry { index: 0, expected, .. } if expected == "b"),
        "{err}"
    );
}

#[test]
fn bounded_by_the_manifest() {
    let g = grads(&[("w", &[8], vec![1.0; 8])]);
    let method = CompressionMethod::TopK { k: 2 };
    let (manifest, bundle, _) = bundle_of(&method, &g, BucketConfig::none(), 0);
    assert!(bundle.len() <= manifest.max_bundle_len());
    // A header claiming a huge entry count and a huge frame is refused before anything is
    // allocated: the output is sized by the manifest only.
    let mut evil = bundle.clone();
    evil[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let n = evil.len();
    let crc = crc32(&evil[..n - 4]);
    evil[n - 4..].copy_from_slice(&crc.to_le_bytes());
    let err = manifest.check_bundle(&evil, Some(0), Some(0)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                fault: BundleFault::EntryCount {
                    expected: 1,
                    got: 4_294_967_295,
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
    let mut evil = bundle.clone();
    evil[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&u32::MAX.to_le_bytes());
    let crc = crc32(&evil[..n - 4]);
    evil[n - 4..].copy_from_slice(&crc.to_le_bytes());
    let err = manifest.check_bundle(&evil, Some(0), Some(0)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Bundle {
                fault: BundleFault::Truncated { .. },
                ..
            }
        ),
        "{err}"
    );
    let mut big = bundle.clone();
    big.resize(manifest.max_bundle_len() + 1, 0);
    assert!(manifest.check_bundle(&big, Some(0), Some(0)).is_err());
}

#[test]
fn manifest_rejects_bad_input() {
    let method = CompressionMethod::TopK { k: 1 };
    let err = Manifest::new(
        vec![TensorSpec::new("a", [1]), TensorSpec::new("a", [2])],
        &method,
        0,
        BucketConfig::none(),
    )
    .unwrap_err();
    assert!(matches!(&err, Error::DuplicateTensor { tensor } if tensor == "a"));
    let err = Manifest::new(
        vec![TensorSpec::new("big", [usize::MAX, 2])],
        &method,
        0,
        BucketConfig::none(),
    )
    .unwrap_err();
    assert!(matches!(&err, Error::ShapeOverflow { tensor, .. } if tensor == "big"));
    let err = Manifest::new(
        vec![TensorSpec::new("a", [1])],
        &CompressionMethod::Quantization { bits: 9 },
        0,
        BucketConfig::none(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err}");
    let dense_int8 = BucketConfig::none().with_dense_below(10, Values::Int8 { block: 4 });
    assert!(Manifest::new(vec![], &method, 0, dense_int8).is_err());
}

#[test]
fn gradients_must_match_the_manifest() {
    let g = grads(&[("a", &[2, 2], vec![1.0; 4])]);
    let method = CompressionMethod::TopK { k: 1 };
    let manifest = Manifest::for_gradients(&g, &method, 0, BucketConfig::none()).unwrap();
    let mut c = GradientCompressor::new(method);
    let mut out = Vec::new();
    let wrong_shape = grads(&[("a", &[4], vec![1.0; 4])]);
    let err = c
        .compress_bundle(&manifest, &wrong_shape, 0, &mut out)
        .unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { tensor, .. } if tensor == "a"),
        "{err}"
    );
    let extra = grads(&[("a", &[2, 2], vec![1.0; 4]), ("z", &[1], vec![1.0])]);
    let err = c
        .compress_bundle(&manifest, &extra, 0, &mut out)
        .unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedTensor { tensor, .. } if tensor == "z"),
        "{err}"
    );
    let missing = grads(&[("b", &[2, 2], vec![1.0; 4])]);
    let err = c
        .compress_bundle(&manifest, &missing, 0, &mut out)
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "a"),
        "{err}"
    );
    assert!(out.is_empty());
    assert_eq!(c.step(), 0, "a failed step does not advance");
    // A manifest for another method or seed is refused.
    let other = Manifest::for_gradients(
        &g,
        &CompressionMethod::TopK { k: 2 },
        0,
        BucketConfig::none(),
    )
    .unwrap();
    assert!(matches!(
        c.compress_bundle(&other, &g, 0, &mut out),
        Err(Error::Config { .. })
    ));
    let seeded = Manifest::for_gradients(
        &g,
        &CompressionMethod::TopK { k: 1 },
        9,
        BucketConfig::none(),
    )
    .unwrap();
    assert!(matches!(
        c.compress_bundle(&seeded, &g, 0, &mut out),
        Err(Error::Config { .. })
    ));
}

#[test]
fn empty_and_zero_d_tensors() {
    let g = grads(&[("empty", &[0, 3], vec![]), ("scalar", &[], vec![-2.5])]);
    for method in [
        CompressionMethod::TopK { k: 1 },
        CompressionMethod::SignSGD,
        CompressionMethod::Float16,
        CompressionMethod::top_k_int8(0.5).with_error_feedback(),
    ] {
        for bucketing in [BucketConfig::none(), BucketConfig::fused(1 << 10)] {
            let (manifest, bundle, step) = bundle_of(&method, &g, bucketing, 0);
            let mut flat = Vec::new();
            manifest
                .decode_bundle(&bundle, Some(0), Some(step), &mut flat)
                .unwrap();
            let out = manifest.to_tensors(&flat).unwrap();
            assert_eq!(out["empty"].shape(), &[0, 3]);
            assert_eq!(out["scalar"].shape(), &[] as &[usize]);
            assert_eq!(out["scalar"].data().len(), 1);
            if !matches!(method, CompressionMethod::SignSGD) {
                assert_eq!(
                    out["scalar"].data(),
                    &[-2.5],
                    "{}",
                    format_method(&method.core_method().unwrap())
                );
            }
        }
    }
}

#[test]
fn int8_default_block() {
    assert_eq!(
        CompressionMethod::top_k_int8(0.01).core_method().unwrap(),
        Method::TopK {
            k: K::Ratio(0.01),
            values: Values::Int8 {
                block: DEFAULT_INT8_BLOCK
            }
        }
    );
}

#[test]
fn per_bucket_scope_is_one_top_k() {
    let g = grads(&[
        ("a", &[4], vec![1.0, 9.0, 2.0, 3.0]),
        ("b", &[4], vec![8.0, 0.5, 7.0, 0.25]),
    ]);
    let method = CompressionMethod::TopK { k: 3 };
    let cfg = BucketConfig::fused(1 << 10).with_scope(TopKScope::PerBucket);
    let (manifest, bundle, step) = bundle_of(&method, &g, cfg, 0);
    assert_eq!(manifest.entries().len(), 1);
    let mut flat = Vec::new();
    manifest
        .decode_bundle(&bundle, Some(0), Some(step), &mut flat)
        .unwrap();
    assert_eq!(manifest.slice(&flat, "a").unwrap(), &[0.0, 9.0, 0.0, 0.0]);
    assert_eq!(manifest.slice(&flat, "b").unwrap(), &[8.0, 0.0, 7.0, 0.0]);
}

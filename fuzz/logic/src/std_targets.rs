//! Bodies of the fuzz targets over the std crate `gradwire`: the bundle decoder against an
//! arbitrary receiver manifest, and the reference-layout (safetensors) reader against
//! arbitrary receiver shapes. `std-adapter/tests/fuzz_replay.rs` includes this file (with
//! `input.rs` and `gens.rs`) and replays `fuzz/corpus/{bundle,reference}/`.

use std::collections::HashMap;

use crate::gens::{gen_method, pow2};
use crate::input::{Input, crc32, with_crc};
use gradwire::bucket::{BucketConfig, TopKScope};
use gradwire::bundle::{Manifest, TensorSpec};
use gradwire::compressor::{CompressionMethod, GradientCompressor};
use gradwire::error::Error;
use gradwire::reference::{self, Mode, ReferenceError};
use gradwire::tensor::Tensor;
use gradwire_core::Values;

/// Largest flat layout (elements) a target's manifest may have.
pub const MAX_FLAT: usize = 4096;

/// A NaN with a payload no decoder writes.
const SENTINEL: u32 = 0x7fc0_dead;

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// 1..=4 tensors with small shapes of rank 0..=3 (names occasionally collide or hold `::`).
pub fn gen_specs(inp: &mut Input<'_>) -> Vec<TensorSpec> {
    let count = 1 + inp.range(0, 3) as usize;
    (0..count)
        .map(|i| {
            let name = match inp.u8() % 16 {
                0 => format!("t{}", inp.u8() % 3),
                1 => format!("bad::{i}"),
                2 => String::new(),
                _ => format!("layer.{i}.weight"),
            };
            let rank = inp.u8() % 4;
            let shape: Vec<usize> = (0..rank).map(|_| inp.range(0, 12) as usize).collect();
            TensorSpec::new(name, shape)
        })
        .collect()
}

fn gen_bucketing(inp: &mut Input<'_>) -> BucketConfig {
    let mut b = match inp.u8() % 4 {
        0 | 1 => BucketConfig::none(),
        2 => BucketConfig::fused(4 * inp.range(0, 600) as usize),
        _ => BucketConfig::fused(usize::MAX),
    };
    if inp.bool() {
        b = b.with_scope(TopKScope::PerBucket);
    }
    if inp.u8().is_multiple_of(3) {
        let v = match inp.u8() % 4 {
            0 => Values::F16,
            1 => Values::Bf16,
            2 => Values::Int8 { block: 4 },
            _ => Values::F32,
        };
        b = b.with_dense_below(inp.range(0, 64) as usize, v);
    }
    b
}

/// Finite values that fit f16 (so that every method can encode them).
fn gen_data(inp: &mut Input<'_>, n: usize) -> Vec<f32> {
    // |value| <= 128 * 2^8 = 32768: within f16's range.
    let scale = pow2(i32::from(inp.u8() % 39) - 30);
    (0..n).map(|_| f32::from(inp.u8() as i8) * scale).collect()
}

/// A copy of `b` with every frame's CRC trailer and the bundle's trailer recomputed, as far as
/// the entries' declared lengths allow: mutated bundles then reach the frame decoders.
pub fn repair_bundle(b: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    if v.len() < 28 {
        return v;
    }
    let body_end = v.len() - 4;
    let mut pos = 24usize;
    while pos + 12 <= body_end {
        let len = u32::from_le_bytes([v[pos + 8], v[pos + 9], v[pos + 10], v[pos + 11]]) as usize;
        let start = pos + 12;
        let Some(end) = start.checked_add(len).filter(|&e| e <= body_end) else {
            break;
        };
        if len >= 4 {
            let crc = crc32(&v[start..end - 4]);
            v[end - 4..end].copy_from_slice(&crc.to_le_bytes());
        }
        pos = end;
    }
    let crc = crc32(&v[..body_end]);
    v[body_end..].copy_from_slice(&crc.to_le_bytes());
    v
}

/// Applies up to 8 mutations (xor, set, truncate, append, overwrite a u32 length field).
fn mutate(b: &mut Vec<u8>, inp: &mut Input<'_>) {
    let muts = inp.u8() % 9;
    for _ in 0..muts {
        let op = inp.u8();
        let pos = inp.u16() as usize;
        let byte = inp.u8();
        match op % 5 {
            0 | 1 if !b.is_empty() => {
                let p = pos % b.len();
                if op.is_multiple_of(5) {
                    b[p] ^= byte.max(1);
                } else {
                    b[p] = byte;
                }
            }
            2 => b.truncate(pos % (b.len() + 1)),
            3 if b.len() >= 4 => {
                let p = pos % (b.len() - 3);
                let v =
                    [0xffff_ffffu32, 0x7fff_ffff, 1 << 20, u32::from(byte)][op as usize / 5 % 4];
                b[p..p + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => b.push(byte),
        }
    }
}

/// Input: a receiver manifest (tensors, method, seed, bucketing), then either raw bundle bytes,
/// or gradients that a real sender compresses into a bundle, optionally mutated. Each bundle is
/// checked as is, with its trailer repaired, and with every frame's trailer repaired too:
/// - `decode_bundle` never panics; on success the output has the manifest's flat length, every
///   element written, no NaN, the bundle is within `max_bundle_len`, and `check_bundle` agrees;
///   on error the output is untouched or zeroed (a frame body error), never partly written;
/// - `check_bundle` fails exactly when `decode_bundle` fails for a reason other than a frame
///   body, with the same error;
/// - an unmutated bundle from a real sender decodes.
pub fn bundle(data: &[u8]) {
    let mut inp = Input::new(data);
    let specs = gen_specs(&mut inp);
    let method = gen_method(&mut inp, 64, &[]);
    let seed = u64::from(inp.u8() % 4);
    let bucketing = gen_bucketing(&mut inp);
    let Ok(manifest) = Manifest::new(
        specs.clone(),
        &CompressionMethod::Core(method),
        seed,
        bucketing,
    ) else {
        return;
    };
    if manifest.flat_len() > MAX_FLAT {
        return;
    }
    let mode = inp.u8();
    let rank = usize::from(inp.u8() % 4);
    let out_len = match inp.u8() % 4 {
        0 => 0,
        1 => manifest.flat_len() + 3,
        _ => manifest.flat_len(),
    };
    let (expect_rank, expect_step) = match mode >> 4 & 3 {
        0 => (None, None),
        1 => (Some(rank), Some(0)),
        2 => (Some(rank + 1), None),
        _ => (None, Some(1)),
    };
    let bytes = if mode.is_multiple_of(3) {
        inp.rest().to_vec()
    } else {
        let grads: HashMap<String, Tensor> = specs
            .iter()
            .map(|s| {
                let n: usize = s.shape.iter().product();
                let t = Tensor::new(s.shape.clone(), gen_data(&mut inp, n)).expect("shape");
                (s.name.clone(), t)
            })
            .collect();
        let mut sender = GradientCompressor::new(CompressionMethod::Core(method)).with_seed(seed);
        let mut b = Vec::new();
        if let Err(e) = sender.compress_bundle(&manifest, &grads, rank, &mut b) {
            // Values are finite and fit every value type; only configuration may fail.
            assert!(
                matches!(e, Error::Config { .. }),
                "compress_bundle failed: {e}"
            );
            return;
        }
        assert!(
            b.len() <= manifest.max_bundle_len(),
            "bundle beyond max_bundle_len"
        );
        if mode % 3 == 1 {
            let mut out = Vec::new();
            if let Err(e) = manifest.decode_bundle(&b, Some(rank), Some(0), &mut out) {
                panic!("a fresh bundle does not decode: {e}");
            }
        }
        mutate(&mut b, &mut inp);
        b
    };
    check_bundle_bytes(&manifest, &bytes, expect_rank, expect_step, out_len);
    if let Some(fixed) = with_crc(&bytes)
        && fixed != bytes
    {
        check_bundle_bytes(&manifest, &fixed, expect_rank, expect_step, out_len);
    }
    let fixed = repair_bundle(&bytes);
    if fixed != bytes {
        check_bundle_bytes(&manifest, &fixed, expect_rank, expect_step, out_len);
    }
}

fn check_bundle_bytes(
    m: &Manifest,
    b: &[u8],
    rank: Option<usize>,
    step: Option<u64>,
    out_len: usize,
) {
    let mut out = vec![f32::from_bits(SENTINEL); out_len];
    let before = out.clone();
    let r = m.decode_bundle(b, rank, step, &mut out);
    let c = m.check_bundle(b, rank, step);
    match r {
        Ok(h) => {
            let ch = c.expect("check_bundle fails where decode_bundle succeeds");
            assert_eq!(ch, h);
            assert_eq!(out.len(), m.flat_len());
            assert_eq!(h.entries as usize, m.entries().len());
            if let Some(r) = rank {
                assert_eq!(h.rank as usize, r);
            }
            if let Some(s) = step {
                assert_eq!(h.step, s);
            }
            assert!(
                b.len() <= m.max_bundle_len(),
                "accepted a bundle beyond max_bundle_len"
            );
            if let Some(i) = out.iter().position(|v| v.to_bits() == SENTINEL) {
                panic!("decode_bundle left element {i} unwritten");
            }
            assert!(
                !out.iter().any(|v| v.is_nan()),
                "decode_bundle produced NaN"
            );
        }
        Err(e) => {
            let zeroed = out.len() == m.flat_len() && out.iter().all(|v| v.to_bits() == 0);
            assert!(
                same_bits(&out, &before) || zeroed,
                "decode_bundle failed ({e}) with the output partly written"
            );
            match c {
                Err(ce) => assert_eq!(e.to_string(), ce.to_string()),
                Ok(_) => assert!(
                    matches!(e, Error::Core { .. }) && zeroed,
                    "decode_bundle failed ({e}) where check_bundle passed"
                ),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// reference: the reference Python layout (safetensors)
// ---------------------------------------------------------------------------------------------

const DTYPES: [(&str, usize); 8] = [
    ("F32", 4),
    ("I64", 8),
    ("I8", 1),
    ("F16", 2),
    ("U8", 1),
    ("BOOL", 1),
    ("F64", 8),
    ("BF16", 2),
];

/// A safetensors file built from fuzzer choices, so that the JSON header is valid and the
/// reader's own checks are reached: keys drawn from what `specs` expect in `mode` (and a few
/// others), dtypes, shapes (rank 0..=2, occasionally huge dims), data offsets (consistent or
/// not) and element values (small indices, finite or raw floats, raw codes).
pub fn gen_safetensors(inp: &mut Input<'_>, specs: &[TensorSpec], mode: Mode) -> Vec<u8> {
    let mut expected: Vec<String> = specs
        .iter()
        .flat_map(|s| reference::keys(&s.name, mode))
        .collect();
    expected.push("stray".to_owned());
    expected.push("w::idx".to_owned());
    let nkeys = inp.range(0, 7) as usize;
    let mut header = String::from("{");
    let mut data = Vec::new();
    let mut used = Vec::new();
    for j in 0..nkeys {
        let key = if inp.u8().is_multiple_of(8) {
            format!("k{}", inp.u8() % 4)
        } else {
            expected[inp.range(0, expected.len() as u64 - 1) as usize].clone()
        };
        if used.contains(&key) && !inp.u8().is_multiple_of(4) {
            continue;
        }
        used.push(key.clone());
        let natural = if key.ends_with("::idx") {
            1
        } else if key.ends_with("::val") {
            if mode == Mode::TopKInt8 { 2 } else { 0 }
        } else {
            0
        };
        let (dtype, size) = if inp.u8().is_multiple_of(4) {
            DTYPES[inp.range(0, 7) as usize]
        } else {
            DTYPES[natural]
        };
        let shape: Vec<u64> = match inp.u8() % 8 {
            0 => vec![],
            1 => vec![inp.range(0, 5), inp.range(0, 5)],
            2 => vec![inp.u64() >> (inp.u8() % 64)],
            3 => vec![1],
            _ => vec![inp.range(0, 24)],
        };
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let len = match numel.and_then(|n| n.checked_mul(size as u64)) {
            Some(l) if l <= 1 << 12 => l as usize,
            _ => inp.range(0, 64) as usize,
        };
        let start = data.len();
        for _ in 0..len / size.max(1) {
            match dtype {
                "I64" => {
                    let v = i64::from(inp.u8() % 40) - i64::from(inp.u8() == 0xff);
                    data.extend_from_slice(&v.to_le_bytes());
                }
                "F32" => {
                    let v = if inp.u8() == 0xff {
                        inp.f32_bits()
                    } else {
                        f32::from(inp.u8() as i8) / 8.0
                    };
                    data.extend_from_slice(&v.to_le_bytes());
                }
                _ => data.extend(
                    inp.bytes(size)
                        .iter()
                        .copied()
                        .chain(std::iter::repeat(0))
                        .take(size),
                ),
            }
        }
        data.resize(start + len, 0);
        let (a, b) = if inp.u8().is_multiple_of(16) {
            (inp.range(0, 64) as usize, inp.range(0, 64) as usize)
        } else {
            (start, start + len)
        };
        let shape_s: Vec<String> = shape.iter().map(u64::to_string).collect();
        if j > 0 && header.len() > 1 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{key}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{a},{b}]}}",
            shape_s.join(",")
        ));
    }
    if inp.u8().is_multiple_of(8) {
        if header.len() > 1 {
            header.push(',');
        }
        header.push_str("\"__metadata__\":{\"format\":\"pt\"}");
    }
    header.push('}');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    if inp.u8().is_multiple_of(16) {
        out.extend_from_slice(inp.bytes(8));
    }
    out
}

/// Builds a `reference` input around a payload (used to seed the corpus from real payloads).
pub fn reference_seed(mode: Mode, specs: &[(&str, Vec<usize>)], payload: &[u8]) -> Vec<u8> {
    let mut v = vec![specs.len().saturating_sub(1) as u8];
    for (name, shape) in specs {
        v.push(3); // a plain name
        let _ = name;
        v.push(shape.len() as u8);
        for &d in shape {
            v.push((d % 13) as u8);
        }
    }
    v.push(Mode::ALL.iter().position(|&m| m == mode).unwrap_or(0) as u8);
    v.push(0); // raw payload
    v.extend_from_slice(payload);
    v
}

/// Input: the receiver's tensors (names, shapes), a mode, then a payload: raw bytes, a
/// generated safetensors file, or a real payload from `reference::compress`, mutated. Checks:
/// `parse`, `decode` and `summarize` never panic; `parse` and `decode` fail together with the
/// same error; on success there is one entry per spec, of the spec's mode, carrying at most n
/// entries, and each decodes (into a sentinel-filled buffer, every element overwritten) to
/// exactly `decode`'s finite dense tensor of the spec's element count.
pub fn reference(data: &[u8]) {
    let mut inp = Input::new(data);
    let count = 1 + inp.range(0, 2) as usize;
    let specs: Vec<TensorSpec> = (0..count)
        .map(|i| {
            let name = match inp.u8() % 16 {
                0 => "x::y".to_owned(),
                1 => "w".to_owned(),
                _ => format!("t{i}"),
            };
            let rank = inp.u8() % 3;
            let shape: Vec<usize> = (0..rank).map(|_| inp.range(0, 12) as usize).collect();
            TensorSpec::new(name, shape)
        })
        .collect();
    let mode = Mode::ALL[inp.u8() as usize % 3];
    let payload = match inp.u8() % 3 {
        0 => inp.rest().to_vec(),
        1 => gen_safetensors(&mut inp, &specs, mode),
        _ => {
            let ratio = f64::from(inp.u8()) / 128.0;
            let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = specs
                .iter()
                .map(|s| {
                    let n: usize = s.shape.iter().product();
                    (s.name.clone(), s.shape.clone(), gen_data(&mut inp, n))
                })
                .collect();
            let inputs: Vec<reference::Input<'_>> = tensors
                .iter()
                .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
                .collect();
            let Ok(mut p) = reference::compress(&inputs, mode, ratio) else {
                return;
            };
            if inp.u8().is_multiple_of(4) {
                // Unmutated: must parse against the sender's own shapes.
                if let Err(e) = reference::parse(&p, mode, &specs) {
                    panic!("a fresh payload does not parse: {e}");
                }
            }
            mutate(&mut p, &mut inp);
            p
        }
    };
    check_reference(&payload, mode, &specs);
}

fn check_reference(payload: &[u8], mode: Mode, specs: &[TensorSpec]) {
    let p = reference::parse(payload, mode, specs);
    let d = reference::decode(payload, mode, specs);
    let _ = reference::summarize(payload);
    match (p, d) {
        (Ok(entries), Ok(dense)) => {
            assert_eq!(entries.len(), specs.len());
            assert_eq!(dense.len(), specs.len());
            for ((spec, e), x) in specs.iter().zip(&entries).zip(&dense) {
                let n: usize = spec.shape.iter().product();
                assert_eq!(x.len(), n);
                assert_eq!(e.mode(), mode);
                assert!(e.kept() <= n, "{} entries for {n} elements", e.kept());
                if let Some(i) = x.iter().position(|v| !v.is_finite()) {
                    panic!("decode produced {} at {i} of {}", x[i], spec.name);
                }
                let mut out = vec![f32::from_bits(SENTINEL); n];
                e.decode_into(&mut out)
                    .expect("entry decodes into its spec");
                assert!(same_bits(&out, x), "Entry::decode_into differs from decode");
            }
        }
        // safetensors validates header entries in HashMap order (randomly seeded), so with
        // several bad entries its message may differ between two reads of the same bytes.
        (Err(ReferenceError::Safetensors(_)), Err(ReferenceError::Safetensors(_))) => {}
        // Compared as text: a NaN scale in an error is not equal to itself.
        (Err(a), Err(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
        (a, b) => panic!("parse and decode disagree: {:?} / {:?}", a.err(), b.err()),
    }
}

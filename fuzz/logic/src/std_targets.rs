//! Bodies of the fuzz targets over the std crate `gradwire`: the bundle decoder against an
//! arbitrary receiver manifest, the reference-layout (safetensors) reader against arbitrary
//! receiver shapes, and the error-feedback checkpoint reader. `std-adapter/tests/fuzz_replay.rs`
//! includes this file (with `input.rs` and `gens.rs`) and replays
//! `fuzz/corpus/{bundle,reference,checkpoint}/`.

use std::collections::HashMap;

use crate::gens::{gen_grad, gen_method, pow2};
use crate::input::{Input, crc32, with_crc};
use gradwire::BucketConfig;
use gradwire::Error;
use gradwire::feedback::{CHECKPOINT_VERSION, ErrorFeedback};
use gradwire::layout::TopKScope;
use gradwire::method::{format as format_method, parse as parse_method};
use gradwire::reference::{self, Mode, ReferenceError};
use gradwire::tensor::Tensor;
use gradwire::{CompressionMethod, GradientCompressor};
use gradwire::{Manifest, TensorSpec};
use gradwire_core::{K, Method, Values};

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

// ---------------------------------------------------------------------------------------------
// checkpoint: error-feedback checkpoints (safetensors), `ErrorFeedback::from_bytes`
// ---------------------------------------------------------------------------------------------

/// `s` as a JSON string literal (quotes, backslashes and control characters escaped).
fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A residual name: plain, colliding, empty, non-ASCII, needing JSON escapes, or the key
/// safetensors reserves.
fn gen_residual_name(inp: &mut Input<'_>, i: usize) -> String {
    match inp.u8() % 16 {
        0 => format!("t{}", inp.u8() % 3),
        1 => String::new(),
        2 => "λ.é/∂".to_owned(),
        3 => "a\"b\\c\n".to_owned(),
        4 => "__metadata__".to_owned(),
        _ => format!("layer.{i}.weight"),
    }
}

/// A residual of up to 48 values (raw bits, so NaN, infinities, subnormals and -0.0 appear).
fn gen_residual(inp: &mut Input<'_>) -> Vec<f32> {
    match inp.u8() % 8 {
        0 => Vec::new(),
        1 => vec![f32::from_bits(inp.u32() & 0x807f_ffff)], // a subnormal or a zero
        _ => gen_grad(inp, 48),
    }
}

/// A shape for a residual of `len` values from fuzzer choices: `[len]`, `[1, len]`, `[len, 1]`,
/// `[2, len / 2]`, `[]` (0-d) or `[len, 0]`, and whether it holds `len` values.
fn gen_residual_shape(inp: &mut Input<'_>, len: usize) -> (Vec<usize>, bool) {
    let shape = match inp.u8() % 6 {
        0 => vec![len],
        1 => vec![1, len],
        2 => vec![len, 1],
        3 => vec![2, len / 2],
        4 => Vec::new(),
        _ => vec![len, 0],
    };
    let holds = shape.iter().product::<usize>() == len;
    (shape, holds)
}

/// An error-feedback state from fuzzer choices: a method (an invalid one is replaced by
/// top-1), a seed, a step and residuals, some set with a shape (non-finite residuals are
/// refused by `set_residual`, shapes that do not hold the values by `set_residual_with_shape`,
/// checked, and nothing changes then). A state without shapes goes through a checkpoint with
/// the fuzzer's step (rewritten as version 1, which has no checksum); one with shapes through
/// its own version 3 checkpoint, with the fuzzer's step and a recomputed checksum when every
/// residual has a shape, else with step 0. `None` when `to_bytes` refuses the state (a residual
/// named `__metadata__`, checked to be the reason), or when the checkpoint's step is
/// `u64::MAX`, which a checkpoint refuses (no step can follow it; checked).
pub fn gen_feedback(inp: &mut Input<'_>) -> Option<ErrorFeedback> {
    let method = gen_method(inp, 64, &[]);
    let (seed, step) = match inp.u8() % 3 {
        0 => (u64::from(inp.u8()), u64::from(inp.u8())),
        1 => (inp.u64(), inp.u64()),
        _ => (u64::MAX, u64::MAX),
    };
    let mut fb = ErrorFeedback::new(method, seed).unwrap_or_else(|_| {
        let top1 = Method::TopK {
            k: K::Count(1),
            values: Values::F32,
        };
        ErrorFeedback::new(top1, seed).expect("top-1 is a valid error-feedback method")
    });
    let count = inp.range(0, 4) as usize;
    let mut reserved = false;
    for i in 0..count {
        let name = gen_residual_name(inp, i);
        let r = gen_residual(inp);
        // Finite, as `set_residual` requires (a value beyond the method's value type is
        // accepted: a step sends it saturated and keeps the rest).
        let finite = r.iter().all(|&v| v.is_finite());
        if inp.u8().is_multiple_of(2) {
            let (shape, holds) = gen_residual_shape(inp, r.len());
            let before = fb.clone();
            match fb.set_residual_with_shape(&name, &shape, r) {
                Ok(()) => {
                    assert!(
                        finite && holds,
                        "set_residual_with_shape accepted {shape:?}"
                    );
                    assert_eq!(fb.residual_shape(&name), Some(&shape[..]));
                    reserved |= name == "__metadata__";
                }
                Err(e) => {
                    assert!(!finite || !holds, "set_residual_with_shape refused: {e}");
                    assert_same_state(&fb, &before, "a refused set_residual_with_shape");
                }
            }
            continue;
        }
        match fb.set_residual(&name, r) {
            Ok(()) => {
                assert!(finite, "set_residual accepted a non-finite residual");
                assert_eq!(
                    fb.residual_shape(&name),
                    None,
                    "set_residual forgets shapes"
                );
                reserved |= name == "__metadata__";
            }
            Err(e) => assert!(!finite, "set_residual refused a finite residual: {e}"),
        }
    }
    let shaped = fb.residuals().any(|(n, _)| fb.residual_shape(n).is_some());
    let all_shaped = fb.residuals().all(|(n, _)| fb.residual_shape(n).is_some());
    match fb.to_bytes() {
        Ok(_) if reserved => panic!("to_bytes stored a residual named __metadata__"),
        Ok(b) if shaped => {
            // Version 3 keeps the shapes. With every residual shaped its `unshaped` text is
            // `[]`, so the step can be rewritten and the checksum recomputed here; otherwise the
            // state loads back as saved (step 0).
            let (b, want) = match all_shaped {
                true => (
                    with_step_v3(&b, &fb, step).expect("to_bytes wrote v3 entries"),
                    step,
                ),
                false => (b, fb.step()),
            };
            if want == u64::MAX {
                refused_as_the_last_step(ErrorFeedback::from_bytes(&b).map(|_| ()));
                return None;
            }
            let back = ErrorFeedback::from_bytes(&b)
                .unwrap_or_else(|e| panic!("a checkpoint from to_bytes does not load: {e}"));
            assert_eq!(back.step(), want);
            let again =
                ErrorFeedback::from_bytes(&back.to_bytes().expect("it saves")).expect("and loads");
            assert_same_state(&again, &back, "a shaped state through its checkpoint");
            for (n, r) in fb.residuals() {
                assert!(same_bits(r, back.residual(n).expect("kept")), "`{n}`");
                assert_eq!(back.residual_shape(n), fb.residual_shape(n), "`{n}`");
            }
            Some(back)
        }
        Ok(b) => {
            // `ErrorFeedback` has no public step setter and running `step` steps is out of
            // reach: the step goes into the checkpoint text, which must then load.
            let b = with_step(&b, &fb, step).expect("to_bytes wrote a `step` entry");
            if step == u64::MAX {
                refused_as_the_last_step(ErrorFeedback::from_bytes(&b).map(|_| ()));
                return None;
            }
            let fb = ErrorFeedback::from_bytes(&b)
                .unwrap_or_else(|e| panic!("a checkpoint from to_bytes does not load: {e}"));
            assert_eq!(fb.step(), step);
            Some(fb)
        }
        Err(e) => {
            assert!(
                reserved && matches!(e, Error::Checkpoint { .. }),
                "to_bytes failed: {e}"
            );
            None
        }
    }
}

/// A checkpoint of step `u64::MAX` refused, saying why (the step after it would wrap to 0).
fn refused_as_the_last_step(loaded: Result<(), Error>) {
    match loaded {
        Err(Error::Checkpoint { reason }) if reason.contains("wrap to 0") => {}
        other => panic!("a checkpoint of step u64::MAX: {other:?}"),
    }
}

/// `b`, the version 3 checkpoint of `fb` (every residual shaped, so `unshaped` is `[]`), with its
/// `step` metadata set to `step` and its `crc32` recomputed from the layout's definition
/// ([`checkpoint_crc_spec`]; header rewritten, data kept). `None` when `b` lacks an entry.
fn with_step_v3(b: &[u8], fb: &ErrorFeedback, step: u64) -> Option<Vec<u8>> {
    let n = usize::try_from(u64::from_le_bytes(b.get(..8)?.try_into().ok()?)).ok()?;
    let header = std::str::from_utf8(b.get(8..8usize.checked_add(n)?)?).ok()?;
    // The text of a string entry (method and seed texts hold no quote or backslash).
    let text = |key: &str| -> Option<(usize, usize)> {
        let at = header.find(&format!("\"{key}\":\""))? + key.len() + 4;
        Some((at, at + header[at..].find('"')?))
    };
    let method = &header[text("method")?.0..text("method")?.1];
    let seed = &header[text("seed")?.0..text("seed")?.1];
    let built: Vec<Built> = fb
        .residuals()
        .map(|(name, r)| {
            let shape: Vec<u64> = fb.residual_shape(name)?.iter().map(|&d| d as u64).collect();
            let bits = r.iter().map(|v| v.to_bits()).collect();
            Some((name.to_owned(), bits, shape.clone(), Some(shape)))
        })
        .collect::<Option<_>>()?;
    let texts = [method, seed, &step.to_string(), "[]"].map(str::to_owned);
    let crc = checkpoint_crc_spec(&built, true, &texts);
    let mut new = header.to_owned();
    for (key, value) in [("step", step.to_string()), ("crc32", crc.to_string())] {
        let (at, end) = {
            let at = new.find(&format!("\"{key}\":\""))? + key.len() + 4;
            (at, at + new[at..].find('"')?)
        };
        new.replace_range(at..end, &value);
    }
    let mut out = (new.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(new.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    Some(out)
}

/// `b` (the checkpoint of `fb`, every residual stored `[n]` without a shape) with its `step`
/// metadata set to `step` (header rewritten, data kept), as a version 2 checkpoint (no
/// `unshaped` entry; its `crc32` recomputed from the layout's definition without shapes,
/// [`checkpoint_crc_spec`]). `None` when `b` lacks one of the entries.
fn with_step(b: &[u8], fb: &ErrorFeedback, step: u64) -> Option<Vec<u8>> {
    let n = usize::try_from(u64::from_le_bytes(b.get(..8)?.try_into().ok()?)).ok()?;
    let header = std::str::from_utf8(b.get(8..8usize.checked_add(n)?)?).ok()?;
    let text = |key: &str| -> Option<String> {
        let at = header.find(&format!("\"{key}\":\""))? + key.len() + 4;
        Some(header[at..at + header[at..].find('"')?].to_owned())
    };
    let built: Vec<Built> = fb
        .residuals()
        .map(|(name, r)| {
            let bits = r.iter().map(|v| v.to_bits()).collect();
            (name.to_owned(), bits, vec![r.len() as u64], None)
        })
        .collect();
    let texts = [text("method")?, text("seed")?, step.to_string()];
    let crc = checkpoint_crc_spec(&built, false, &texts);
    let mut new = drop_entry(header, "unshaped")?;
    let version = format!("\"version\":\"{CHECKPOINT_VERSION}\"");
    new = new.replacen(&version, "\"version\":\"2\"", 1);
    for (key, value) in [("step", step.to_string()), ("crc32", crc.to_string())] {
        let (at, end) = {
            let at = new.find(&format!("\"{key}\":\""))? + key.len() + 4;
            (at, at + new[at..].find('"')?)
        };
        new.replace_range(at..end, &value);
    }
    let mut out = (new.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(new.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    Some(out)
}

/// `header` (safetensors JSON) without its string entry `key` (and one comma next to it); `None`
/// when it has none.
fn drop_entry(header: &str, key: &str) -> Option<String> {
    let start = header.find(&format!("\"{key}\":\""))?;
    let value = start + key.len() + 4;
    let mut escaped = false;
    let close = header[value..].char_indices().find_map(|(i, c)| {
        let end = !escaped && c == '"';
        escaped = !escaped && c == '\\';
        end.then_some(value + i)
    })?;
    let (mut from, mut to) = (start, close + 1);
    if header[to..].starts_with(',') {
        to += 1;
    } else if header[..from].ends_with(',') {
        from -= 1;
    }
    Some(format!("{}{}", &header[..from], &header[to..]))
}

/// What a hand-built checkpoint must load as: `Some(Ok(state))` when it is valid,
/// `Some(Err(()))` when its structure is valid safetensors but its content is not a
/// checkpoint (a metadata entry wrong, a residual not F32 or of a shape its version does not
/// allow, a NaN or infinite value), `None` when the safetensors structure itself may be broken
/// (offsets or lengths edited, names repeated), so anything but a panic goes. A residual is
/// its name, its values' bits and the shape it must remember (none for versions 1 and 2 and
/// for the names version 3 lists in `unshaped`).
type Expect = Option<Result<(String, u64, u64, Vec<Residual>), ()>>;

/// A residual of a hand-built checkpoint: name, values' bits, the shape it must remember.
type Residual = (String, Vec<u32>, Option<Vec<u64>>);

/// A residual as [`gen_checkpoint_file`] builds it: name, values' bits, the shape it is stored
/// in, the shape it must remember.
type Built = (String, Vec<u32>, Vec<u64>, Option<Vec<u64>>);

/// A safetensors file built from fuzzer choices around the checkpoint layout, with what it must
/// load as: metadata entries right, missing or wrong (unknown format or version, methods
/// valid, invalid or not error-feedback methods, seeds and steps beyond u64 or signed; in
/// version 3 an `unshaped` list right, naming a missing tensor, malformed or missing), up to 9
/// tensors (names as [`gen_residual_name`]) of F32 or another dtype, shapes `[n]`, 0-d, 2-d,
/// huge or the largest a dtype allows, values as raw bits (NaN, infinities, subnormals), data
/// in listed or reversed order, offsets consistent, accumulated from the declared sizes (so
/// that a few tensors declare more than `usize::MAX` bytes in all) or arbitrary, and the
/// header length right or edited.
pub fn gen_checkpoint_file(inp: &mut Input<'_>) -> (Vec<u8>, Expect) {
    let mut structure_ok = true;
    let mut content_ok = true;
    // Metadata.
    let mut meta: Vec<(String, String)> = Vec::new();
    match inp.u8() % 8 {
        0 => content_ok = false,
        1 => {
            meta.push(("format".into(), "pt".into()));
            content_ok = false;
        }
        _ => meta.push(("format".into(), "gradwire-error-feedback".into())),
    }
    // The version whose checksum and shape rules the file follows (1: no checksum, refused).
    let mut version = 1;
    match inp.u8() % 8 {
        0 => content_ok = false,
        1 => {
            meta.push(("version".into(), "4".into()));
            content_ok = false;
        }
        2 | 3 => {
            meta.push(("version".into(), "2".into()));
            version = 2;
        }
        4 | 5 => {
            meta.push(("version".into(), "3".into()));
            version = 3;
        }
        _ => {
            meta.push(("version".into(), "1".into()));
            content_ok = false;
        }
    }
    let method_text = match inp.u8() % 8 {
        0 => None,
        1 => Some("topk  k=count:3\tvalues=f32".to_owned()),
        2 => Some(
            ["sign scale=none", "topk", "dense values=int8:4", "nope x=1"][inp.u8() as usize % 4]
                .to_owned(),
        ),
        _ => Some(format_method(&gen_method(inp, 64, &[]))),
    };
    let method = method_text
        .as_deref()
        .and_then(|t| parse_method(t).ok())
        .filter(|m| ErrorFeedback::new(*m, 0).is_ok());
    if method.is_none() {
        content_ok = false;
    }
    if let Some(t) = &method_text {
        meta.push(("method".into(), t.clone()));
    }
    fn number(inp: &mut Input<'_>) -> Option<String> {
        let s = match inp.u8() % 10 {
            0 => return None,
            1 => "18446744073709551616".to_owned(),
            2 => "-1".to_owned(),
            3 => "+7".to_owned(),
            4 => String::new(),
            5 => u64::MAX.to_string(),
            _ => inp.u8().to_string(),
        };
        Some(s)
    }
    let seed_text = number(inp);
    let step_text = number(inp);
    let seed = seed_text.as_deref().and_then(|s| s.parse::<u64>().ok());
    let step = step_text.as_deref().and_then(|s| s.parse::<u64>().ok());
    // A step of u64::MAX is refused: no step can follow it.
    if seed.is_none() || step.is_none_or(|s| s == u64::MAX) {
        content_ok = false;
    }
    if let Some(s) = &seed_text {
        meta.push(("seed".into(), s.clone()));
    }
    if let Some(s) = &step_text {
        meta.push(("step".into(), s.clone()));
    }
    if inp.u8().is_multiple_of(8) {
        meta.push(("note".into(), "extra entries are ignored".into()));
    }
    // Tensors.
    struct T {
        name: String,
        dtype: &'static str,
        shape: Vec<u64>,
        declared: u64,
        data: Vec<u8>,
    }
    let count = inp.range(0, 9) as usize;
    let mut tensors: Vec<T> = Vec::new();
    let mut residuals: Vec<Built> = Vec::new();
    let mut unshaped: Vec<String> = Vec::new();
    for i in 0..count {
        let name = gen_residual_name(inp, i);
        // Version 3 stores a residual in its shape unless `unshaped` names it.
        let flat = version < 3 || inp.bool();
        if version == 3 && flat {
            unshaped.push(name.clone());
        }
        let (dtype, size) = if inp.u8().is_multiple_of(8) {
            DTYPES[inp.range(0, 7) as usize]
        } else {
            DTYPES[0]
        };
        let shape: Vec<u64> = match inp.u8() % 16 {
            0 => vec![],
            1 => vec![inp.range(0, 3), inp.range(0, 3)],
            2 => vec![inp.u64() >> (inp.u8() % 64)],
            // The largest element count whose bit size fits usize, and just below it.
            3 => vec![(u64::MAX / (8 * size as u64)) - u64::from(inp.u8() % 4)],
            _ => vec![inp.range(0, 24)],
        };
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let declared = numel.and_then(|n| n.checked_mul(size as u64));
        let mut data = Vec::new();
        let mut finite = true;
        match declared {
            Some(l) if l <= 1 << 12 => {
                for _ in 0..l / size as u64 {
                    if dtype == "F32" {
                        let v = match inp.u8() % 16 {
                            0 => inp.f32_bits(),
                            1 => f32::from_bits(inp.u32() & 0x807f_ffff),
                            2 => [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, f32::MAX]
                                [inp.u8() as usize % 5],
                            _ => f32::from(inp.u8() as i8) / 16.0,
                        };
                        // Only a NaN or an infinity is refused (a residual beyond the
                        // method's value type is what a saturated step leaves).
                        finite &= v.is_finite();
                        data.extend_from_slice(&v.to_le_bytes());
                    } else {
                        data.extend(
                            inp.bytes(size)
                                .iter()
                                .copied()
                                .chain(std::iter::repeat(0))
                                .take(size),
                        );
                    }
                }
            }
            _ => {
                // Declared beyond what is written: structurally broken.
                structure_ok = false;
                data.resize(inp.range(0, 16) as usize, 0);
            }
        }
        if dtype != "F32" || (flat && shape.len() != 1) || !finite {
            content_ok = false;
        }
        if name == "__metadata__" || residuals.iter().any(|r| r.0 == name) {
            structure_ok = false;
        }
        let bits = data
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let remembered = (!flat).then(|| shape.clone());
        residuals.push((name.clone(), bits, shape.clone(), remembered));
        tensors.push(T {
            name,
            dtype,
            shape,
            declared: declared.unwrap_or(u64::MAX),
            data,
        });
    }
    // Version 3: the names stored `[n]` without a shape, right, naming a tensor the file lacks,
    // malformed or missing.
    let mut unshaped_text = String::new();
    if version == 3 {
        // Written in name order (strictly increasing), as the reader requires; sometimes not.
        unshaped.sort();
        if unshaped.windows(2).any(|w| w[0] == w[1]) {
            content_ok = false;
        }
        if unshaped.len() > 1 && inp.u8().is_multiple_of(16) {
            unshaped.reverse();
            content_ok = false;
        }
        let names: Vec<String> = unshaped.iter().map(|n| json_str(n)).collect();
        unshaped_text = format!("[{}]", names.join(","));
        match inp.u8() % 16 {
            0 => content_ok = false,
            1 => {
                unshaped_text = ["{}", "[1]", "x", "[\"a\"", ""][inp.u8() as usize % 5].to_owned();
                content_ok = false;
                meta.push(("unshaped".into(), unshaped_text.clone()));
            }
            2 if !residuals.iter().any(|r| r.0 == "absent") => {
                unshaped_text = format!(
                    "[{}]",
                    [&names[..], &["\"absent\"".to_owned()]].concat().join(",")
                );
                content_ok = false;
                meta.push(("unshaped".into(), unshaped_text.clone()));
            }
            _ => meta.push(("unshaped".into(), unshaped_text.clone())),
        }
    }
    // Versions 2 and 3: the checksum, computed here from the layout's definition (feedback
    // module docs), right, wrong, malformed or missing.
    if version >= 2 {
        let mut texts: Vec<String> = [&method_text, &seed_text, &step_text]
            .iter()
            .map(|t| (*t).clone().unwrap_or_default())
            .collect();
        if version == 3 {
            texts.push(unshaped_text);
        }
        let crc = checkpoint_crc_spec(&residuals, version == 3, &texts);
        match inp.u8() % 8 {
            0 => content_ok = false,
            1 => {
                meta.push(("crc32".into(), (crc ^ 1).to_string()));
                content_ok = false;
            }
            2 => {
                let bad = ["4294967296", "-1", "", "0x10"][inp.u8() as usize % 4];
                meta.push(("crc32".into(), bad.into()));
                content_ok = false;
            }
            // Rust's u32 parsing takes a leading `+`.
            3 => meta.push(("crc32".into(), format!("+{crc}"))),
            _ => meta.push(("crc32".into(), crc.to_string())),
        }
    }
    // Data section, in listed or reversed order.
    let reversed = inp.bool();
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    if reversed {
        order.reverse();
    }
    let mut offsets = vec![(0u64, 0u64); tensors.len()];
    let mut data = Vec::new();
    for &i in &order {
        let start = data.len() as u64;
        data.extend_from_slice(&tensors[i].data);
        offsets[i] = (start, data.len() as u64);
    }
    match inp.u8() % 16 {
        // Offsets accumulated from the declared sizes (wrapping), whatever was written.
        0 => {
            structure_ok = false;
            let mut at = 0u64;
            for &i in &order {
                let end = at.wrapping_add(tensors[i].declared);
                offsets[i] = (at, end);
                at = end;
            }
        }
        // One offset pair arbitrary.
        1 if !tensors.is_empty() => {
            structure_ok = false;
            let i = inp.range(0, tensors.len() as u64 - 1) as usize;
            offsets[i] = match inp.u8() % 3 {
                0 => (inp.range(0, 64), inp.range(0, 64)),
                1 => (offsets[i].0, u64::MAX),
                _ => (offsets[i].1, offsets[i].0),
            };
        }
        _ => {}
    }
    // Header.
    let mut header = String::from("{");
    let mut items = Vec::new();
    if !meta.is_empty() || inp.u8().is_multiple_of(4) {
        let entries: Vec<String> = meta
            .iter()
            .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
            .collect();
        items.push(format!("\"__metadata__\":{{{}}}", entries.join(",")));
    }
    for (t, (a, b)) in tensors.iter().zip(&offsets) {
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        items.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{a},{b}]}}",
            json_str(&t.name),
            t.dtype,
            shape.join(",")
        ));
    }
    if inp.u8().is_multiple_of(2) && items.len() > 1 {
        // The metadata entry last instead of first.
        let m = items.remove(0);
        items.push(m);
    }
    header.push_str(&items.join(","));
    header.push('}');
    if inp.u8().is_multiple_of(4) {
        // safetensors pads headers with spaces.
        header.push_str(&" ".repeat(inp.range(0, 7) as usize));
    }
    let declared_len = match inp.u8() % 16 {
        0 => {
            structure_ok = false;
            [
                header.len() as u64 + 1,
                (header.len() as u64).wrapping_sub(1),
                u64::MAX,
                1 << 63,
                100_000_000,
                (header.len() + data.len()) as u64 + 8,
            ][inp.u8() as usize % 6]
        }
        _ => header.len() as u64,
    };
    let mut out = declared_len.to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    if inp.u8().is_multiple_of(16) {
        structure_ok = false;
        out.extend_from_slice(inp.bytes(8));
    }
    let expect = if !structure_ok {
        None
    } else if let (true, Some(m), Some(seed), Some(step)) = (content_ok, method, seed, step) {
        residuals.sort_by(|a, b| a.0.cmp(&b.0));
        let residuals = residuals
            .into_iter()
            .map(|(n, b, _, s)| (n, b, s))
            .collect();
        Some(Ok((format_method(&m), seed, step, residuals)))
    } else {
        Some(Err(()))
    };
    (out, expect)
}

/// The `crc32` of a version 2 or (`shapes`) 3 checkpoint as the feedback module's docs define
/// it: for each residual in name order its name, a 0 byte, in version 3 its stored shape (rank
/// as u32, dimensions as u64, little-endian), and its values (little-endian); then the texts
/// (method, seed, step and, in version 3, unshaped), each followed by a 0 byte.
fn checkpoint_crc_spec(residuals: &[Built], shapes: bool, texts: &[String]) -> u32 {
    let mut sorted: Vec<_> = residuals.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut h = crc32fast::Hasher::new();
    for (name, bits, shape, _) in sorted {
        h.update(name.as_bytes());
        h.update(&[0]);
        if shapes {
            h.update(&(shape.len() as u32).to_le_bytes());
            for d in shape {
                h.update(&d.to_le_bytes());
            }
        }
        for b in bits {
            h.update(&b.to_le_bytes());
        }
    }
    for t in texts {
        h.update(t.as_bytes());
        h.update(&[0]);
    }
    h.finalize()
}

/// Bit-exact equality of two error-feedback states: method (compared as text and by `==`),
/// seed, step, names, lengths, shapes and every residual's bits.
fn assert_same_state(a: &ErrorFeedback, b: &ErrorFeedback, what: &str) {
    assert_eq!(
        format!("{:?}", a.method()),
        format!("{:?}", b.method()),
        "{what}: method"
    );
    assert_eq!(a.seed(), b.seed(), "{what}: seed");
    assert_eq!(a.step(), b.step(), "{what}: step");
    let names_a: Vec<&str> = a.residuals().map(|(n, _)| n).collect();
    let names_b: Vec<&str> = b.residuals().map(|(n, _)| n).collect();
    assert_eq!(names_a, names_b, "{what}: residual names");
    for ((n, x), (_, y)) in a.residuals().zip(b.residuals()) {
        assert!(same_bits(x, y), "{what}: residual `{n}` differs");
        assert_eq!(
            a.residual_shape(n),
            b.residual_shape(n),
            "{what}: residual `{n}`'s shape"
        );
    }
    assert!(
        a == b,
        "{what}: PartialEq disagrees with a bit-exact comparison"
    );
}

/// `from_bytes` on `bytes`, then the properties every result must have: no panic; success
/// means every residual is finite, the residuals hold no more than the input's bytes, the
/// state saves (`to_bytes`), loads back bit for bit, and a compressor with error feedback
/// around its method takes it over. Returns the state.
fn check_checkpoint(bytes: &[u8]) -> Option<ErrorFeedback> {
    let fb = match ErrorFeedback::from_bytes(bytes) {
        Ok(fb) => fb,
        Err(e) => {
            assert!(!e.to_string().is_empty(), "an error without a message");
            return None;
        }
    };
    let mut total = 0usize;
    for (name, r) in fb.residuals() {
        if let Some(i) = r.iter().position(|v| !v.is_finite()) {
            panic!("from_bytes accepted residual `{name}` with {} at {i}", r[i]);
        }
        total += 4 * r.len() + name.len();
    }
    assert!(
        total <= bytes.len(),
        "{total} bytes of residuals from a {}-byte checkpoint",
        bytes.len()
    );
    let again = fb
        .to_bytes()
        .unwrap_or_else(|e| panic!("to_bytes of a loaded checkpoint fails: {e}"));
    let back = ErrorFeedback::from_bytes(&again)
        .unwrap_or_else(|e| panic!("a re-saved checkpoint does not load: {e}"));
    assert_same_state(&fb, &back, "re-saved checkpoint");
    let mut c =
        GradientCompressor::new(CompressionMethod::Core(*fb.method()).with_error_feedback());
    if let Err(e) = c.restore_feedback(fb.clone()) {
        panic!("a compressor does not take over a loaded checkpoint: {e}");
    }
    Some(fb)
}

/// Edits of a checkpoint's safetensors framing: the 8-byte header length set to a nearby or
/// huge value, a number in the header (a shape or an offset) replaced, or the file cut.
fn edit_checkpoint(b: &mut Vec<u8>, inp: &mut Input<'_>) {
    let Some(n) = b
        .get(..8)
        .and_then(|h| h.try_into().ok())
        .map(u64::from_le_bytes)
    else {
        return;
    };
    match inp.u8() % 4 {
        0 => {
            let v = [
                n.wrapping_add(1),
                n.wrapping_sub(1),
                u64::MAX,
                1 << 40,
                b.len() as u64,
                0,
            ][inp.u8() as usize % 6];
            b[..8].copy_from_slice(&v.to_le_bytes());
        }
        1 | 2 => {
            // The k-th run of digits inside the header becomes another number (same JSON
            // shape, so safetensors reads it): a shape dimension, an offset or a metadata value.
            let end = usize::try_from(n).map_or(b.len(), |n| n.saturating_add(8).min(b.len()));
            let mut runs = Vec::new();
            let mut i = 8;
            while i < end {
                if b[i].is_ascii_digit() {
                    let s = i;
                    while i < end && b[i].is_ascii_digit() {
                        i += 1;
                    }
                    runs.push((s, i));
                } else {
                    i += 1;
                }
            }
            if runs.is_empty() {
                return;
            }
            let (s, e) = runs[inp.u8() as usize % runs.len()];
            let old: u64 = std::str::from_utf8(&b[s..e])
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            let v = match inp.u8() % 6 {
                0 => old.wrapping_add(1),
                1 => old.wrapping_sub(1),
                2 => old.wrapping_mul(2),
                3 => u64::MAX,
                4 => 1 << 61,
                _ => u64::from(inp.u8()),
            };
            let text = v.to_string();
            let mut out = b[..s].to_vec();
            out.extend_from_slice(text.as_bytes());
            out.extend_from_slice(&b[e..]);
            // Keep the header length in step with the new text.
            if let Some(nn) = n
                .checked_add(text.len() as u64)
                .and_then(|x| x.checked_sub((e - s) as u64))
            {
                out[..8].copy_from_slice(&nn.to_le_bytes());
            }
            *b = out;
        }
        _ => b.truncate(inp.u16() as usize % (b.len() + 1)),
    }
}

/// Input: a first byte choosing raw bytes, a checkpoint written by `ErrorFeedback::to_bytes`
/// from fuzzer-chosen state, or a hand-built safetensors file around the checkpoint layout
/// ([`gen_checkpoint_file`]); the last two are then optionally edited ([`edit_checkpoint`],
/// [`mutate`]). Checks:
/// - `ErrorFeedback::from_bytes` never panics, and what it accepts is finite, within the
///   input's size, saves and loads back bit for bit, and is taken over by a compressor;
/// - a checkpoint written by `to_bytes` loads back bit for bit (names, shapes, residual bits,
///   method, seed, step);
/// - an unedited hand-built file loads exactly as built when it is a valid checkpoint, and is
///   an error when its safetensors structure is valid but its content is not.
///
/// Memory stays bounded by the input: libFuzzer's `-rss_limit_mb`/`-malloc_limit_mb` fail the
/// run on a large allocation, and `std-adapter/tests/alloc_bound.rs` measures the peak.
pub fn checkpoint(data: &[u8]) {
    let mut inp = Input::new(data);
    let sel = inp.u8();
    let bytes = match sel % 4 {
        0 => inp.rest().to_vec(),
        1 | 2 => {
            let Some(fb) = gen_feedback(&mut inp) else {
                return;
            };
            let mut b = fb.to_bytes().expect("to_bytes of a state that saved once");
            let back = ErrorFeedback::from_bytes(&b)
                .unwrap_or_else(|e| panic!("a checkpoint from to_bytes does not load: {e}"));
            assert_same_state(&fb, &back, "checkpoint from to_bytes");
            if sel % 4 == 2 {
                edit_checkpoint(&mut b, &mut inp);
                mutate(&mut b, &mut inp);
            }
            b
        }
        _ => {
            let (mut b, expect) = gen_checkpoint_file(&mut inp);
            let edited = sel & 0x80 != 0;
            if edited {
                edit_checkpoint(&mut b, &mut inp);
                mutate(&mut b, &mut inp);
            }
            let got = check_checkpoint(&b);
            match (edited, expect, got) {
                (true, _, _) | (false, None, _) => {}
                (false, Some(Ok((method, seed, step, residuals))), Some(fb)) => {
                    assert_eq!(format_method(fb.method()), method);
                    assert_eq!((fb.seed(), fb.step()), (seed, step));
                    let got: Vec<Residual> = fb
                        .residuals()
                        .map(|(n, r)| {
                            let shape = fb
                                .residual_shape(n)
                                .map(|s| s.iter().map(|&d| d as u64).collect());
                            (n.to_owned(), r.iter().map(|v| v.to_bits()).collect(), shape)
                        })
                        .collect();
                    assert!(got == residuals, "a valid checkpoint loads other residuals");
                }
                (false, Some(Ok(_)), None) => {
                    let e = ErrorFeedback::from_bytes(&b).err();
                    panic!("a valid hand-built checkpoint does not load: {e:?}");
                }
                (false, Some(Err(())), Some(_)) => {
                    panic!("an invalid checkpoint (bad metadata, dtype, shape or value) loads")
                }
                (false, Some(Err(())), None) => {}
            }
            return;
        }
    };
    check_checkpoint(&bytes);
}

//! The reference Python layout against the reference implementation's own runs.
//!
//! The payloads of the three reference runs are copied into `testdata/reference/`; their 3.2 MB
//! `_dense` and `_residual` files are pinned by a CRC-32 of each tensor's f32 bytes (and its
//! non-zero count) in `testdata/reference/checksums.tsv` (see the README there).

use std::collections::BTreeMap;
use std::path::PathBuf;

use gradwire::TensorSpec;
use gradwire::feedback::ErrorFeedback;
use gradwire::reference::{self, Entry, Mode, ReferenceError as Error};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

fn testdata(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata")
        .join(rel)
}

fn read(rel: &str) -> Vec<u8> {
    let path = testdata(rel);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (name, shape, data) of every tensor of a float32 safetensors file, sorted by name.
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn load_f32(bytes: &[u8]) -> Tensors {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let mut out: Tensors = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            assert_eq!(v.dtype(), Dtype::F32);
            let data = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, v.shape().to_vec(), data)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn grads() -> Tensors {
    load_f32(&read("minilm_small_grads.safetensors"))
}

fn specs(t: &Tensors) -> Vec<TensorSpec> {
    t.iter()
        .map(|(n, s, _)| TensorSpec::new(n.clone(), s.clone()))
        .collect()
}

fn inputs(t: &Tensors) -> Vec<(&str, &[usize], &[f32])> {
    t.iter()
        .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
        .collect()
}

/// CRC-32 (IEEE, as zlib computes it) of the little-endian bytes of `x`.
fn crc32_f32(x: &[f32]) -> u32 {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    crc32fast::hash(&bytes)
}

/// Pinned facts of one tensor of a `_dense` / `_residual` file.
#[derive(Debug, PartialEq)]
struct Pinned {
    n: usize,
    nonzero: usize,
    crc: u32,
}

/// `checksums.tsv` rows of `file`, by tensor name.
fn pinned(file: &str) -> BTreeMap<String, Pinned> {
    let text = String::from_utf8(read("reference/checksums.tsv")).unwrap();
    let rows: BTreeMap<String, Pinned> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .filter(|f| f[0] == file)
        .map(|f| {
            let p = Pinned {
                n: f[3].parse().unwrap(),
                nonzero: f[4].parse().unwrap(),
                crc: u32::from_str_radix(f[5], 16).unwrap(),
            };
            (f[1].to_owned(), p)
        })
        .collect();
    assert_eq!(rows.len(), 12, "{file}");
    rows
}

fn facts(x: &[f32]) -> Pinned {
    Pinned {
        n: x.len(),
        nonzero: x.iter().filter(|v| **v != 0.0).count(),
        crc: crc32_f32(x),
    }
}

const RUNS: [(&str, Mode, f64); 3] = [
    ("ref_topk_0.01_step1", Mode::TopK, 0.01),
    ("ref_topk_0.1_step1", Mode::TopK, 0.1),
    ("ref_topk-int8_0.01_step1", Mode::TopKInt8, 0.01),
];

#[test]
fn pinned_checksums_match_the_shapes_of_the_gradients() {
    let g = grads();
    for (run, _, _) in RUNS {
        for kind in ["dense", "residual"] {
            let p = pinned(&format!("{run}_{kind}.safetensors"));
            for (name, _, data) in &g {
                assert_eq!(p[name].n, data.len(), "{run} {kind} {name}");
            }
        }
    }
}

#[test]
fn decoding_each_reference_payload_gives_its_dense_file() {
    let g = grads();
    let specs = specs(&g);
    for (run, mode, _) in RUNS {
        let payload = read(&format!("reference/{run}.safetensors"));
        let dense = reference::decode(&payload, mode, &specs).unwrap();
        let p = pinned(&format!("{run}_dense.safetensors"));
        for (spec, d) in specs.iter().zip(&dense) {
            assert_eq!(facts(d), p[&spec.name], "{run} {}", spec.name);
        }
    }
}

/// (index, value bits) pairs sorted by index, and the int8 scale if any.
fn kept(e: &Entry) -> (Vec<(u64, u32)>, Option<u32>) {
    let (indices, scale, vals): (&[u64], Option<u32>, Vec<u32>) = match e {
        Entry::TopK { indices, values } => {
            (indices, None, values.iter().map(|v| v.to_bits()).collect())
        }
        Entry::TopKInt8 {
            indices,
            codes,
            scale,
        } => (
            indices,
            Some(scale.to_bits()),
            codes.iter().map(|&c| c as u8 as u32).collect(),
        ),
        Entry::Dense(_) => panic!("dense entry"),
    };
    let mut pairs: Vec<(u64, u32)> = indices.iter().copied().zip(vals).collect();
    pairs.sort_unstable();
    (pairs, scale)
}

#[test]
fn compressing_the_gradients_gives_the_reference_payload_entries() {
    let g = grads();
    let specs = specs(&g);
    for (run, mode, ratio) in RUNS {
        let theirs =
            reference::parse(&read(&format!("reference/{run}.safetensors")), mode, &specs).unwrap();
        let payload = reference::compress(&inputs(&g), mode, ratio).unwrap();
        let ours = reference::parse(&payload, mode, &specs).unwrap();
        for ((spec, a), b) in specs.iter().zip(&ours).zip(&theirs) {
            let n = spec.shape.iter().product::<usize>();
            assert_eq!(
                a.kept() as u64,
                gradwire::core::k_from_ratio(n as u64, ratio)
            );
            assert_eq!(kept(a), kept(b), "{run} {}", spec.name);
        }
        // And our own payload decodes to the reference's dense file.
        let dense = reference::decode(&payload, mode, &specs).unwrap();
        let p = pinned(&format!("{run}_dense.safetensors"));
        for (spec, d) in specs.iter().zip(&dense) {
            assert_eq!(facts(d), p[&spec.name], "{run} {}", spec.name);
        }
    }
}

#[test]
fn feedback_residual_matches_the_reference() {
    let g = grads();
    let specs = specs(&g);
    for (run, mode, ratio) in RUNS {
        let mut residuals: Vec<Vec<f32>> = g.iter().map(|(_, _, d)| vec![0.0; d.len()]).collect();
        let payload =
            reference::compress_with_residuals(&inputs(&g), &mut residuals, mode, ratio).unwrap();
        // The payload is the same as without feedback (empty residual).
        assert_eq!(
            payload,
            reference::compress(&inputs(&g), mode, ratio).unwrap()
        );
        let p = pinned(&format!("{run}_residual.safetensors"));
        let entries = reference::parse(&payload, mode, &specs).unwrap();
        for (((spec, r), e), (_, _, x)) in specs.iter().zip(&residuals).zip(&entries).zip(&g) {
            let sent = {
                let mut d = vec![0.0; r.len()];
                e.decode_into(&mut d).unwrap();
                d
            };
            // Nothing lost, bit-exact: sent + residual == gradient.
            for i in 0..r.len() {
                assert_eq!(
                    (sent[i] + r[i]).to_bits(),
                    x[i].to_bits(),
                    "{run} {} {i}",
                    spec.name
                );
            }
            if mode == Mode::TopK {
                assert_eq!(facts(r), p[&spec.name], "{run} {}", spec.name);
            } else {
                // The reference drops the int8 rounding error; gradwire keeps it at the kept
                // entries. Off the kept entries both are the input.
                let mut dropped = r.clone();
                if let Entry::TopKInt8 { indices, .. } = e {
                    for &i in indices {
                        dropped[i as usize] = 0.0;
                    }
                }
                assert_eq!(facts(&dropped), p[&spec.name], "{run} {}", spec.name);
                assert!(r.iter().zip(&dropped).any(|(a, b)| a != b) || e.kept() == 0);
            }
        }
    }
}

#[test]
fn second_feedback_step_carries_the_residual() {
    let g = grads();
    // The same gradient again as step 2: what differs is the residual it is added to.
    let g2 = g.clone();
    let mut residuals: Vec<Vec<f32>> = g.iter().map(|(_, _, d)| vec![0.0; d.len()]).collect();
    reference::compress_with_residuals(&inputs(&g), &mut residuals, Mode::TopK, 0.01).unwrap();
    let before = residuals.clone();
    let p2 =
        reference::compress_with_residuals(&inputs(&g2), &mut residuals, Mode::TopK, 0.01).unwrap();
    // Step 2 compresses gradient + residual, so it differs from compressing the gradient alone.
    assert_ne!(
        p2,
        reference::compress(&inputs(&g2), Mode::TopK, 0.01).unwrap()
    );
    let entries = reference::parse(&p2, Mode::TopK, &specs(&g)).unwrap();
    for ((((_, _, x), r0), r1), e) in g2.iter().zip(&before).zip(&residuals).zip(&entries) {
        let mut sent = vec![0.0; x.len()];
        e.decode_into(&mut sent).unwrap();
        for i in 0..x.len() {
            assert_eq!((sent[i] + r1[i]).to_bits(), (x[i] + r0[i]).to_bits());
        }
    }
}

#[test]
fn mode_names_round_trip() {
    for m in Mode::ALL {
        assert_eq!(m.as_str().parse::<Mode>().unwrap(), m);
        assert_eq!(m.to_string(), m.as_str());
    }
    assert!(matches!(
        "topk8".parse::<Mode>(),
        Err(Error::UnknownMode(_))
    ));
}

#[test]
fn summarize_detects_the_mode_without_shapes() {
    for (run, mode, _) in RUNS {
        let (m, list) =
            reference::summarize(&read(&format!("reference/{run}.safetensors"))).unwrap();
        assert_eq!(m, mode);
        assert_eq!(list.len(), 12);
        let bytes: usize = list.iter().map(|s| s.data_bytes).sum();
        let per = if mode == Mode::TopK { 12 } else { 9 };
        let kept: usize = list.iter().map(|s| s.kept).sum();
        assert_eq!(
            bytes,
            per * kept + if mode == Mode::TopK { 0 } else { 4 * 12 }
        );
    }
    let g = grads();
    let dense = reference::compress(&inputs(&g), Mode::None, 1.0).unwrap();
    let (m, list) = reference::summarize(&dense).unwrap();
    assert_eq!(m, Mode::None);
    assert_eq!(list[0].shape.as_deref(), Some(&[512usize, 384][..]));
}

#[test]
fn mode_none_round_trips_and_zero_d_and_empty_tensors_work() {
    let scalar = [2.5f32];
    let empty: [f32; 0] = [];
    let t: Vec<(&str, &[usize], &[f32])> = vec![
        ("s", &[], &scalar),
        ("e", &[0, 3], &empty),
        ("v", &[3], &[1.0, -4.0, 2.0]),
    ];
    let specs = vec![
        TensorSpec::new("s", vec![]),
        TensorSpec::new("e", vec![0, 3]),
        TensorSpec::new("v", vec![3]),
    ];
    for mode in Mode::ALL {
        let payload = reference::compress(&t, mode, 0.5).unwrap();
        let dense = reference::decode(&payload, mode, &specs).unwrap();
        assert_eq!(dense[0], [2.5]);
        assert!(dense[1].is_empty());
        match mode {
            Mode::None => assert_eq!(dense[2], [1.0, -4.0, 2.0]),
            Mode::TopK => assert_eq!(dense[2], [0.0, -4.0, 0.0]), // k = floor(1.5) = 1
            Mode::TopKInt8 => assert_eq!(dense[2], [0.0, -4.0, 0.0]),
        }
    }
}

/// One tensor `x` compressed in `mode`, through a payload and back: its entry.
fn compress_one(x: &[f32], mode: Mode, ratio: f64) -> Result<Entry, Error> {
    let shape = [x.len()];
    let payload = reference::compress(&[("t", &shape[..], x)], mode, ratio)?;
    let mut entries = reference::parse(&payload, mode, &[TensorSpec::new("t", vec![x.len()])])?;
    Ok(entries.remove(0))
}

#[test]
fn int8_of_all_zero_values_uses_scale_one() {
    let z = [0.0f32; 4];
    let e = compress_one(&z, Mode::TopKInt8, 0.5).unwrap();
    assert_eq!(
        e,
        Entry::TopKInt8 {
            indices: vec![0, 1],
            codes: vec![0, 0],
            scale: 1.0
        }
    );
}

/// A peak near `f32::MAX`: the reference's `peak / 127` makes `127 × scale` overflow, a payload
/// no decoder accepts and an infinite residual. The scale steps down instead: the payload
/// decodes finite, the residual stays finite, and its checkpoint loads.
#[test]
fn int8_of_a_peak_near_f32_max_decodes_finite() {
    let x = [f32::MAX, 0.0];
    let t: Vec<(&str, &[usize], &[f32])> = vec![("w", &[2], &x)];
    let specs = [TensorSpec::new("w", vec![2])];
    let payload = reference::compress(&t, Mode::TopKInt8, 0.5).unwrap();
    let d = reference::decode(&payload, Mode::TopKInt8, &specs).unwrap();
    assert!(d[0][0].is_finite() && d[0][0] > 0.0, "{:?}", d[0]);
    assert_eq!(d[0][1], 0.0);
    let mut fb = ErrorFeedback::new(reference::feedback_method(Mode::TopKInt8, 0.5), 0).unwrap();
    let payload =
        reference::compress_with_error_feedback(&t, &mut fb, Mode::TopKInt8, 0.5).unwrap();
    let sent = reference::decode(&payload, Mode::TopKInt8, &specs).unwrap();
    let r = fb.residual("w").unwrap().to_vec();
    assert!(r.iter().all(|v| v.is_finite()), "{r:?}");
    assert_eq!(sent[0][0] + r[0], f32::MAX, "nothing lost");
    let mut restored = ErrorFeedback::from_bytes(&fb.to_bytes().unwrap()).unwrap();
    assert_eq!(restored.residual("w"), Some(&r[..]));
    assert_eq!(restored.step(), 1);
    let next = [1.0f32, -2.0];
    let t: Vec<(&str, &[usize], &[f32])> = vec![("w", &[2], &next)];
    let payload =
        reference::compress_with_error_feedback(&t, &mut restored, Mode::TopKInt8, 0.5).unwrap();
    reference::decode(&payload, Mode::TopKInt8, &specs).unwrap();
}

/// A subnormal peak: `peak / 127` underflows to 0 (the reference divides by it); the scale is
/// the smallest positive f32 instead, so the codes are exact and nothing is lost.
#[test]
fn int8_of_a_subnormal_peak_is_exact() {
    let tiny = f32::from_bits(1);
    let specs = [TensorSpec::new("w", vec![2])];
    let x = [tiny, 0.0];
    let t: Vec<(&str, &[usize], &[f32])> = vec![("w", &[2], &x)];
    let e = compress_one(&x, Mode::TopKInt8, 0.5).unwrap();
    assert_eq!(
        e,
        Entry::TopKInt8 {
            indices: vec![0],
            codes: vec![1],
            scale: tiny
        }
    );
    let payload = reference::compress(&t, Mode::TopKInt8, 0.5).unwrap();
    let d = reference::decode(&payload, Mode::TopKInt8, &specs).unwrap();
    assert_eq!(d[0][0].to_bits(), 1);
    assert_eq!(d[0][1], 0.0);
    // Error feedback: what is sent plus the residual is the gradient, exactly.
    let x = [f32::from_bits(40), -f32::from_bits(3)];
    let t: Vec<(&str, &[usize], &[f32])> = vec![("w", &[2], &x)];
    let mut r = vec![vec![0.0f32; 2]];
    let payload = reference::compress_with_residuals(&t, &mut r, Mode::TopKInt8, 0.5).unwrap();
    let sent = reference::decode(&payload, Mode::TopKInt8, &specs).unwrap();
    assert_eq!(sent[0], [x[0], 0.0]);
    for i in 0..2 {
        assert_eq!(sent[0][i] + r[0][i], x[i], "element {i}");
    }
}

#[test]
fn the_first_bad_position_of_either_kind_is_named() {
    // An overflowing gradient + residual at 0 comes before a NaN gradient at 2, in one tensor
    // and across tensors.
    let big = f32::MAX * 0.75;
    let mut r = vec![vec![big, 0.0, 0.0]];
    let g = [big, 1.0, f32::NAN];
    let one: Vec<(&str, &[usize], &[f32])> = vec![("g", &[3], &g)];
    let e = reference::compress_with_residuals(&one, &mut r, Mode::TopK, 0.5).unwrap_err();
    assert_eq!(
        e,
        Error::NonFinite {
            key: "g".into(),
            position: 0
        }
    );
    assert_eq!(r, vec![vec![big, 0.0, 0.0]]);
    let a = [big, 1.0];
    let nan = [1.0f32, f32::NAN, 1.0];
    let t: Vec<(&str, &[usize], &[f32])> = vec![("a", &[2], &a), ("b", &[3], &nan)];
    let mut rs = vec![vec![big, 0.0], vec![0.0; 3]];
    let e = reference::compress_with_residuals(&t, &mut rs, Mode::TopK, 0.5).unwrap_err();
    assert_eq!(
        e,
        Error::NonFinite {
            key: "a".into(),
            position: 0
        }
    );
}

#[test]
fn bad_inputs_are_refused_before_any_residual_changes() {
    let a = [1.0f32, 2.0];
    let b = [3.0f32, f32::NAN];
    let t: Vec<(&str, &[usize], &[f32])> = vec![("a", &[2], &a), ("b", &[2], &b)];
    let mut r = vec![vec![0.5f32; 2], vec![0.0; 2]];
    let e = reference::compress_with_residuals(&t, &mut r, Mode::TopK, 0.5).unwrap_err();
    assert_eq!(
        e,
        Error::NonFinite {
            key: "b".into(),
            position: 1
        }
    );
    assert_eq!(r, vec![vec![0.5f32; 2], vec![0.0; 2]]);

    let t: Vec<(&str, &[usize], &[f32])> = vec![("a", &[2], &a)];
    let mut r = vec![vec![f32::MAX; 2]];
    let big = [f32::MAX, 0.0];
    let tb: Vec<(&str, &[usize], &[f32])> = vec![("a", &[2], &big)];
    assert!(matches!(
        reference::compress_with_residuals(&tb, &mut r, Mode::TopK, 0.5),
        Err(Error::NonFinite { position: 0, .. })
    ));
    assert_eq!(r, vec![vec![f32::MAX; 2]]);
    assert!(matches!(
        reference::compress(&t, Mode::TopK, f64::NAN),
        Err(Error::InvalidRatio(_))
    ));
    assert!(matches!(
        reference::compress(&t, Mode::TopK, -0.1),
        Err(Error::InvalidRatio(_))
    ));
    let wrong: Vec<(&str, &[usize], &[f32])> = vec![("a", &[3], &a)];
    assert!(matches!(
        reference::compress(&wrong, Mode::TopK, 0.5),
        Err(Error::ElementCount { .. })
    ));
    let dup: Vec<(&str, &[usize], &[f32])> = vec![("a", &[2], &a), ("a", &[2], &a)];
    assert!(matches!(
        reference::compress(&dup, Mode::TopK, 0.5),
        Err(Error::BadName(_))
    ));
    let colon: Vec<(&str, &[usize], &[f32])> = vec![("a::idx", &[2], &a)];
    assert!(matches!(
        reference::compress(&colon, Mode::TopK, 0.5),
        Err(Error::BadName(_))
    ));
    // safetensors reserves `__metadata__`: such a payload could not be read back.
    let meta: Vec<(&str, &[usize], &[f32])> = vec![("__metadata__", &[2], &a)];
    for mode in Mode::ALL {
        assert_eq!(
            reference::compress(&meta, mode, 0.5),
            Err(Error::BadName("__metadata__".into())),
            "{mode}"
        );
        let mut r = vec![vec![0.5f32; 2]];
        assert_eq!(
            reference::compress_with_residuals(&meta, &mut r, mode, 0.5),
            Err(Error::BadName("__metadata__".into()))
        );
        assert_eq!(r, vec![vec![0.5f32; 2]]);
    }
    let mut fb = ErrorFeedback::new(reference::feedback_method(Mode::None, 0.5), 0).unwrap();
    assert_eq!(
        reference::compress_with_error_feedback(&meta, &mut fb, Mode::None, 0.5),
        Err(Error::BadName("__metadata__".into()))
    );
    assert_eq!((fb.step(), fb.residual("__metadata__")), (0, None));
    let mut short = vec![vec![0.0f32; 1]];
    assert!(matches!(
        reference::compress_with_residuals(&t, &mut short, Mode::TopK, 0.5),
        Err(Error::ElementCount { .. })
    ));
}

// ---- hostile payloads -------------------------------------------------------------------

/// A payload from raw keys: (key, dtype, shape, bytes).
fn payload(keys: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(&str, TensorView<'_>)> = keys
        .iter()
        .map(|(k, d, s, b)| (*k, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn i64s(x: &[i64]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn spec4() -> Vec<TensorSpec> {
    vec![TensorSpec::new("w", vec![2, 2])]
}

fn topk(idx: &[i64], val: &[f32]) -> Vec<u8> {
    payload(&[
        ("w::idx", Dtype::I64, vec![idx.len()], i64s(idx)),
        ("w::val", Dtype::F32, vec![val.len()], f32s(val)),
    ])
}

fn int8(idx: &[i64], codes: &[i8], scale: f32) -> Vec<u8> {
    payload(&[
        ("w::idx", Dtype::I64, vec![idx.len()], i64s(idx)),
        (
            "w::val",
            Dtype::I8,
            vec![codes.len()],
            codes.iter().map(|&c| c as u8).collect(),
        ),
        ("w::scale", Dtype::F32, vec![1], f32s(&[scale])),
    ])
}

#[test]
fn valid_hand_made_payloads_decode_in_any_index_order() {
    let d = reference::decode(&topk(&[3, 0], &[1.5, -2.0]), Mode::TopK, &spec4()).unwrap();
    assert_eq!(d, vec![vec![-2.0, 0.0, 0.0, 1.5]]);
    let d = reference::decode(&int8(&[2, 1], &[127, -3], 0.5), Mode::TopKInt8, &spec4()).unwrap();
    assert_eq!(d, vec![vec![0.0, -1.5, 63.5, 0.0]]);
    // Empty top-k keys are valid (nothing kept).
    let d = reference::decode(&topk(&[], &[]), Mode::TopK, &spec4()).unwrap();
    assert_eq!(d, vec![vec![0.0; 4]]);
}

#[test]
fn hostile_payloads_are_clear_errors() {
    let s = spec4();
    let cases: Vec<(Vec<u8>, Mode, &str)> = vec![
        (
            topk(&[0], &[1.0]),
            Mode::TopKInt8,
            "w::val\" has dtype F32, expected I8",
        ),
        (
            int8(&[0], &[1], 1.0),
            Mode::TopK,
            "unexpected key \"w::scale\"",
        ),
        (
            topk(&[4], &[1.0]),
            Mode::TopK,
            "index 4 out of range for 4 elements",
        ),
        (topk(&[-1], &[1.0]), Mode::TopK, "index -1 out of range"),
        (
            topk(&[1, 2, 1], &[1.0, 2.0, 3.0]),
            Mode::TopK,
            "index 1 appears more than once",
        ),
        (topk(&[1, 2], &[1.0]), Mode::TopK, "2 indices but 1 values"),
        (
            topk(&[1, 2], &[1.0, f32::INFINITY]),
            Mode::TopK,
            "position 1 is NaN or infinite",
        ),
        (topk(&[1], &[f32::NAN]), Mode::TopK, "NaN or infinite"),
        (
            int8(&[1], &[1], 0.0),
            Mode::TopKInt8,
            "invalid int8 scale 0",
        ),
        (
            int8(&[1], &[1], -1.0),
            Mode::TopKInt8,
            "invalid int8 scale -1",
        ),
        (
            int8(&[1], &[1], f32::NAN),
            Mode::TopKInt8,
            "invalid int8 scale NaN",
        ),
        (
            int8(&[1, 2], &[1, -128], 1.0),
            Mode::TopKInt8,
            "code -128 at position 1",
        ),
        (
            payload(&[("w::idx", Dtype::I64, vec![1], i64s(&[0]))]),
            Mode::TopK,
            "no key \"w::val\"",
        ),
        (
            payload(&[("w::val", Dtype::F32, vec![1], f32s(&[0.0]))]),
            Mode::TopK,
            "no key \"w::idx\"",
        ),
        (
            payload(&[
                ("w::idx", Dtype::I32, vec![1], vec![0; 4]),
                ("w::val", Dtype::F32, vec![1], f32s(&[1.0])),
            ]),
            Mode::TopK,
            "w::idx\" has dtype I32, expected I64",
        ),
        (
            payload(&[
                ("w::idx", Dtype::I64, vec![1, 1], i64s(&[0])),
                ("w::val", Dtype::F32, vec![1], f32s(&[1.0])),
            ]),
            Mode::TopK,
            "w::idx\" has shape [1, 1], expected a flat [k]",
        ),
        (
            payload(&[
                ("w::idx", Dtype::I64, vec![1], i64s(&[0])),
                ("w::val", Dtype::I8, vec![1], vec![1]),
                ("w::scale", Dtype::F32, vec![2], f32s(&[1.0, 1.0])),
            ]),
            Mode::TopKInt8,
            "w::scale\" has shape [2], expected [1]",
        ),
        (
            payload(&[
                ("w::idx", Dtype::I64, vec![1], i64s(&[0])),
                ("w::val", Dtype::F32, vec![1], f32s(&[1.0])),
                ("x::idx", Dtype::I64, vec![1], i64s(&[0])),
            ]),
            Mode::TopK,
            "unexpected key \"x::idx\"",
        ),
        (
            payload(&[("w", Dtype::F32, vec![4], f32s(&[0.0; 4]))]),
            Mode::None,
            "shape [4], expected [2, 2]",
        ),
        (
            payload(&[("w", Dtype::F64, vec![2, 2], vec![0; 32])]),
            Mode::None,
            "dtype F64, expected F32",
        ),
        (
            payload(&[("v", Dtype::F32, vec![2, 2], f32s(&[0.0; 4]))]),
            Mode::None,
            "unexpected key \"v\"",
        ),
        (payload(&[]), Mode::None, "no key \"w\""),
        (
            b"not a safetensors file".to_vec(),
            Mode::TopK,
            "invalid safetensors payload",
        ),
        (Vec::new(), Mode::TopK, "invalid safetensors payload"),
    ];
    for (bytes, mode, want) in cases {
        let e = reference::decode(&bytes, mode, &s).unwrap_err();
        assert!(e.to_string().contains(want), "{e} does not contain {want}");
    }
    // Bad receiver specs.
    let dup = vec![TensorSpec::new("w", vec![4]), TensorSpec::new("w", vec![4])];
    assert!(matches!(
        reference::decode(&topk(&[], &[]), Mode::TopK, &dup),
        Err(Error::BadName(_))
    ));
    let meta = vec![TensorSpec::new("__metadata__", vec![2])];
    for mode in Mode::ALL {
        assert_eq!(
            reference::decode(&payload(&[]), mode, &meta),
            Err(Error::BadName("__metadata__".into())),
            "{mode}"
        );
    }
    let huge = vec![TensorSpec::new("w", vec![usize::MAX, 2])];
    assert!(matches!(
        reference::decode(&topk(&[], &[]), Mode::TopK, &huge),
        Err(Error::ShapeOverflow { .. })
    ));
}

#[test]
fn truncated_and_corrupted_payloads_never_panic() {
    let g = grads();
    let specs = specs(&g);
    let bytes = read("reference/ref_topk-int8_0.01_step1.safetensors");
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let prefixes = (0..header + 64).chain((header + 64..bytes.len()).step_by(997));
    for len in prefixes {
        assert!(
            reference::decode(&bytes[..len], Mode::TopKInt8, &specs).is_err(),
            "prefix {len}"
        );
        let _ = reference::summarize(&bytes[..len]);
    }
    // Flipping bytes anywhere gives an error or a valid decode, never a panic.
    for pos in (0..bytes.len()).step_by(211) {
        let mut b = bytes.clone();
        b[pos] ^= 0x5a;
        let _ = reference::decode(&b, Mode::TopKInt8, &specs);
        let _ = reference::summarize(&b);
    }
}

/// The reference layout's error feedback keeps residuals in an `ErrorFeedback`, so a residual
/// remembers its tensor's shape there too: a transposed weight is refused, nothing changes.
#[test]
fn a_transposed_tensor_is_refused_by_reference_feedback() {
    let x = [1.0f32, -3.0, 0.25, 4.5, -0.75, 2.5];
    let mut fb = ErrorFeedback::new(reference::feedback_method(Mode::TopK, 0.5), 0).unwrap();
    let t: Vec<(&str, &[usize], &[f32])> = vec![("w", &[2, 3], &x)];
    reference::compress_with_error_feedback(&t, &mut fb, Mode::TopK, 0.5).unwrap();
    assert_eq!(fb.residual_shape("w"), Some(&[2usize, 3][..]));
    let before = fb.clone();
    let t: Vec<(&str, &[usize], &[f32])> = vec![("w", &[3, 2], &x)];
    let err = reference::compress_with_error_feedback(&t, &mut fb, Mode::TopK, 0.5).unwrap_err();
    assert!(
        matches!(&err, reference::ReferenceError::WrongShape { key, got, .. }
            if key == "w" && got == &[3, 2]),
        "{err}"
    );
    assert!(err.to_string().contains("[2, 3]"), "{err}");
    assert_eq!(fb, before);
}

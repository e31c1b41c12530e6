//! Golden bundles, error-feedback checkpoints and containers (`testdata/golden/bundle`,
//! `testdata/golden/checkpoint`, `testdata/golden/container`), as `core/tests/golden.rs` pins
//! frames: today's code must write each file byte for byte from the same inputs, each file must
//! decode (a checkpoint must load and save again to the same bytes), and no stale file may be
//! left. The files were first written by the code of commit 01c8e63, before the std crate was
//! redesigned, so that the redesign is held to the bytes it started from.
//!
//! After a deliberate format change (a version bump), rewrite them with
//! `GRADWIRE_BLESS=1 cargo test --release -p gradwire --test golden_formats`.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::Rng;
use gradwire::core::{K, Method, Rounding, Values};
use gradwire::feedback::ErrorFeedback;
use gradwire::layout::TopKScope;
use gradwire::{
    BucketConfig, CompressionMethod, GradientCompressor, Manifest, Parallelism, Tensor,
};

fn golden_dir(kind: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/golden")
        .join(kind)
}

fn bless() -> bool {
    std::env::var_os("GRADWIRE_BLESS").is_some()
}

/// Checks `bytes` against the golden file `name` of `kind` (writes it when blessing).
fn check_golden(kind: &str, name: &str, bytes: &[u8]) {
    let path = golden_dir(kind).join(name);
    if bless() {
        fs::create_dir_all(golden_dir(kind)).unwrap();
        fs::write(&path, bytes).unwrap();
        return;
    }
    let want = fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        want == bytes,
        "{} differs from what today's code writes ({} bytes against {}; first difference at \
         byte {:?})",
        path.display(),
        want.len(),
        bytes.len(),
        want.iter().zip(bytes).position(|(a, b)| a != b)
    );
}

/// The files of `kind` on disk must be exactly `expected` (no stale golden file).
fn check_listing(kind: &str, expected: &BTreeSet<String>) {
    if bless() {
        return;
    }
    let on_disk: BTreeSet<String> = fs::read_dir(golden_dir(kind))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(&on_disk, expected, "golden {kind} files");
}

/// A small model with the shapes that matter: a matrix, a bias, a mostly-zero embedding, a 0-d
/// tensor and an empty one; with `big`, a tensor large enough for the chunked paths (past two
/// chunks of 65,536 elements). Values from a seeded generator, new ones every step.
fn model(step: u64, big: bool) -> HashMap<String, Tensor> {
    let mut rng = Rng(0x5eed_0000 + step);
    let mut emb = rng.vec(600, 0.25);
    for (i, x) in emb.iter_mut().enumerate() {
        if i % 5 != 0 {
            *x = 0.0;
        }
    }
    let mut out = HashMap::from([
        (
            "attn.w".to_owned(),
            Tensor::new(vec![32, 24], rng.vec(768, 1.0)).unwrap(),
        ),
        (
            "attn.b".to_owned(),
            Tensor::new(vec![24], rng.vec(24, 0.01)).unwrap(),
        ),
        ("emb".to_owned(), Tensor::new(vec![3, 200], emb).unwrap()),
        (
            "ln".to_owned(),
            Tensor::new(vec![], vec![rng.unit() * 3.0]).unwrap(),
        ),
        ("empty".to_owned(), Tensor::new(vec![0], vec![]).unwrap()),
    ]);
    if big {
        out.insert(
            "big".to_owned(),
            Tensor::new(vec![350, 400], rng.vec(140_000, 0.5)).unwrap(),
        );
    }
    out
}

/// One bundle case: a method, its bucketing and seed, the step it starts at, how many steps it
/// runs (every step's bundle is pinned), and whether the model has the large tensor.
struct BundleCase {
    name: &'static str,
    method: CompressionMethod,
    bucketing: BucketConfig,
    seed: u64,
    start: u64,
    steps: u64,
    big: bool,
}

fn core(method: Method) -> CompressionMethod {
    CompressionMethod::Core(method)
}

fn bundle_cases() -> Vec<BundleCase> {
    let case = |name, method, steps| BundleCase {
        name,
        method,
        bucketing: BucketConfig::none(),
        seed: 0,
        start: 0,
        steps,
        big: false,
    };
    vec![
        case(
            "topk_f32",
            CompressionMethod::TopKRatio {
                ratio: 0.05,
                values: Values::F32,
            },
            1,
        ),
        BundleCase {
            bucketing: BucketConfig::fused(4096).with_dense_below(30, Values::F16),
            seed: 1,
            ..case(
                "topk_int8_ef_fused",
                CompressionMethod::top_k_int8(0.05).with_error_feedback(),
                2,
            )
        },
        BundleCase {
            bucketing: BucketConfig::fused(8192).with_scope(TopKScope::PerBucket),
            ..case("topk_per_bucket", CompressionMethod::TopK { k: 7 }, 1)
        },
        case(
            "quant4_ef",
            CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
            2,
        ),
        BundleCase {
            seed: 9,
            start: 5,
            ..case(
                "quant3_stochastic",
                core(Method::Quant {
                    bits: 3,
                    block: 64,
                    rounding: Rounding::Stochastic,
                }),
                1,
            )
        },
        BundleCase {
            big: true,
            ..case(
                "sign_ef",
                CompressionMethod::SignSGD.with_error_feedback(),
                2,
            )
        },
        case("sign_majority", CompressionMethod::SignSGDMajority, 1),
        BundleCase {
            seed: 3,
            start: 2,
            ..case(
                "randomk_f16",
                CompressionMethod::RandomKRatio {
                    ratio: 0.1,
                    values: Values::F16,
                },
                1,
            )
        },
        case(
            "threshold",
            CompressionMethod::Threshold { threshold: 0.5 },
            1,
        ),
        case("dense_bf16", CompressionMethod::BFloat16, 1),
        case("dense_f16", CompressionMethod::Float16, 1),
        BundleCase {
            big: true,
            ..case(
                "topk_big_ef_int8",
                core(Method::TopK {
                    k: K::Ratio(0.001),
                    values: Values::Int8 { block: 256 },
                })
                .with_error_feedback(),
                3,
            )
        },
        BundleCase {
            big: true,
            seed: 4,
            ..case(
                "randomk_big_ef",
                core(Method::RandomK {
                    k: K::Ratio(0.002),
                    values: Values::F32,
                    unbiased: false,
                })
                .with_error_feedback(),
                2,
            )
        },
    ]
}

/// The bundles of a case (rank 1), one per step, and the compressor after the last step.
fn run_case(case: &BundleCase, parallelism: Parallelism) -> (Vec<Vec<u8>>, GradientCompressor) {
    let grads0 = model(case.start, case.big);
    let manifest = Manifest::for_gradients(&grads0, &case.method, case.seed, case.bucketing)
        .expect("manifest");
    let mut c = GradientCompressor::new(case.method.clone())
        .with_seed(case.seed)
        .with_parallelism(parallelism);
    c.set_step(case.start);
    let mut bundles = Vec::new();
    for s in case.start..case.start + case.steps {
        let mut bundle = Vec::new();
        let step = c
            .compress_bundle(&manifest, &model(s, case.big), 1, &mut bundle)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(step, s);
        bundles.push(bundle);
    }
    (bundles, c)
}

#[test]
fn golden_bundles_and_checkpoints() {
    let mut bundle_files = BTreeSet::new();
    let mut checkpoint_files = BTreeSet::new();
    for case in bundle_cases() {
        let (bundles, c) = run_case(&case, Parallelism::Serial);
        let (pooled, _) = run_case(&case, Parallelism::Parallel);
        assert_eq!(
            bundles, pooled,
            "{}: serial and pooled bundles differ",
            case.name
        );
        let manifest =
            Manifest::for_gradients(&model(0, case.big), &case.method, case.seed, case.bucketing)
                .unwrap();
        for (i, bundle) in bundles.iter().enumerate() {
            let step = case.start + i as u64;
            let file = format!("{}_step{step}.gwb", case.name);
            check_golden("bundle", &file, bundle);
            bundle_files.insert(file.clone());
            // The golden bytes decode against the receiver's manifest, at their rank and step.
            let golden = fs::read(golden_dir("bundle").join(&file)).unwrap();
            let mut flat = Vec::new();
            let header = manifest
                .decode_bundle(&golden, Some(1), Some(step), &mut flat)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(header.step, step);
            assert_eq!(flat.len(), manifest.flat_len());
            assert!(flat.iter().all(|x| x.is_finite()), "{file}");
        }
        if let Some(fb) = c.feedback() {
            let file = format!("{}.safetensors", case.name);
            let bytes = fb.to_bytes().unwrap();
            check_golden("checkpoint", &file, &bytes);
            checkpoint_files.insert(file.clone());
            let golden = fs::read(golden_dir("checkpoint").join(&file)).unwrap();
            let loaded =
                ErrorFeedback::from_bytes(&golden).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(&loaded == fb, "{file}: loads to another state");
            assert_eq!(loaded.step(), case.start + case.steps, "{file}");
            assert_eq!(loaded.to_bytes().unwrap(), golden, "{file}: saved again");
        }
    }
    // A state whose residuals have no shape (a step without shapes), and its neighbour with
    // shapes, as checkpoint version 3 stores both.
    let method = Method::TopK {
        k: K::Count(2),
        values: Values::F16,
    };
    let mut fb = ErrorFeedback::new(method, 21).unwrap();
    let (a, w) = (
        [0.5f32, -1.5, 2.25, 0.0],
        [3.0f32, -0.125, 1.0, 7.5, -2.0, 0.75],
    );
    fb.step_with([("a", &a[..]), ("w", &w[..])], |_, _| {})
        .unwrap();
    fb.step_with_shapes([("w", &[2usize, 3][..], &w[..])], |_, _| {})
        .unwrap();
    let bytes = fb.to_bytes().unwrap();
    check_golden("checkpoint", "unshaped_and_shaped.safetensors", &bytes);
    checkpoint_files.insert("unshaped_and_shaped.safetensors".to_owned());
    let golden =
        fs::read(golden_dir("checkpoint").join("unshaped_and_shaped.safetensors")).unwrap();
    let loaded = ErrorFeedback::from_bytes(&golden).unwrap();
    assert!(loaded == fb);
    assert_eq!(loaded.residual_shape("a"), None);
    assert_eq!(loaded.residual_shape("w"), Some(&[2usize, 3][..]));
    assert_eq!(loaded.to_bytes().unwrap(), golden);
    check_listing("bundle", &bundle_files);
    check_listing("checkpoint", &checkpoint_files);
}

/// A checkpoint's bytes depend on its contents alone: the same state saved twice, and saved
/// by a state loaded from it, gives the same bytes (safetensors writes its metadata in a
/// `HashMap`'s order; gradwire sorts it).
#[test]
fn checkpoint_bytes_are_deterministic() {
    let case = &bundle_cases()[1];
    let (_, c) = run_case(case, Parallelism::Serial);
    let fb = c.feedback().unwrap();
    let first = fb.to_bytes().unwrap();
    for _ in 0..8 {
        let again = fb.clone();
        assert_eq!(again.to_bytes().unwrap(), first);
        assert_eq!(
            ErrorFeedback::from_bytes(&first)
                .unwrap()
                .to_bytes()
                .unwrap(),
            first
        );
    }
}

const BIN: &str = env!("CARGO_BIN_EXE_gradwire");

fn gradwire(args: &[&str]) {
    let out = Command::new(BIN).args(args).output().expect("run gradwire");
    assert!(
        out.status.success(),
        "gradwire {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn scratch() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("golden_formats");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The model's tensors as a safetensors file, as the `gradwire` tool reads gradients.
fn write_model(path: &Path, step: u64) {
    let mut tensors: Vec<(String, Tensor)> = model(step, false).into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    fs::write(path, gradwire::tensor::write_safetensors(&tensors).unwrap()).unwrap();
}

/// Containers written by `gradwire compress`, each decoded by `gradwire decompress` (the
/// dense result pinned too); the error-feedback run pins its state file after each step.
#[test]
fn golden_containers() {
    let dir = scratch();
    let (g0, g1) = (
        dir.join("grads0.safetensors"),
        dir.join("grads1.safetensors"),
    );
    write_model(&g0, 0);
    write_model(&g1, 1);
    let mut files = BTreeSet::new();
    let mut pin = |name: &str, produced: &Path| {
        let bytes = fs::read(produced).unwrap();
        check_golden("container", name, &bytes);
        files.insert(name.to_owned());
    };
    let cases: [(&str, &[&str]); 5] = [
        (
            "topk_int8",
            &["--method", "topk", "--ratio", "0.05", "--values", "int8"],
        ),
        (
            "quant4_stochastic",
            &[
                "--method",
                "quant",
                "--bits",
                "4",
                "--stochastic",
                "--seed",
                "11",
                "--step",
                "3",
            ],
        ),
        ("sign", &["--method", "sign"]),
        (
            "randomk_k5",
            &[
                "--method", "randomk", "--k", "5", "--seed", "2", "--step", "7",
            ],
        ),
        ("dense_f16", &["--method", "f16"]),
    ];
    for (name, args) in cases {
        let out = dir.join(format!("{name}.gwct"));
        let mut all = vec!["compress", s(&g0), "-o", s(&out)];
        all.extend_from_slice(args);
        gradwire(&all);
        pin(&format!("{name}.gwct"), &out);
        decode_container(&dir, name, &mut pin);
    }
    // Two error-feedback steps through a state file.
    let state = dir.join("state.safetensors");
    for (step, grads) in [(0, &g0), (1, &g1)] {
        let name = format!("topk_int8_ef_step{step}");
        let out = dir.join(format!("{name}.gwct"));
        gradwire(&[
            "compress",
            s(grads),
            "-o",
            s(&out),
            "--method",
            "topk",
            "--ratio",
            "0.05",
            "--values",
            "int8",
            "--seed",
            "5",
            "--residual",
            s(&state),
        ]);
        pin(&format!("{name}.gwct"), &out);
        pin(&format!("{name}.state.safetensors"), &state);
        decode_container(&dir, &name, &mut pin);
    }
    check_listing("container", &files);
}

/// Decodes the golden container `name` with `gradwire decompress` and pins the result.
fn decode_container(dir: &Path, name: &str, pin: &mut impl FnMut(&str, &Path)) {
    let golden = golden_dir("container").join(format!("{name}.gwct"));
    let dense = dir.join(format!("{name}.dense.safetensors"));
    gradwire(&["decompress", s(&golden), "-o", s(&dense)]);
    pin(&format!("{name}.dense.safetensors"), &dense);
}

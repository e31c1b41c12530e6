//! The `wire` binary (bytes on the wire for the real MiniLM gradients) with `--json`: it exits
//! 0, prints one JSON object per line for every method, every row with a target carries
//! DESIGN.md's limit (written here, not read from the binary) and meets it, and the kept counts
//! are what the methods mean on these tensors (computed here from the file). Byte counts are
//! deterministic, so the targets are asserted; std-adapter's `tests/bundle.rs` checks the same
//! targets against the library directly.

mod common;

use common::{field, run_json};

use gradwire::core::k_from_ratio;
use gradwire::tensor::read_safetensors;

/// DESIGN.md's bytes targets: row, unit, limit.
const DESIGN_TARGETS: [(&str, &str, f64); 5] = [
    ("topk_1pct_int8", "bytes_per_kept", 2.3),
    ("topk_1pct_int8_buckets_64k", "bytes_per_kept", 2.3),
    ("topk_1pct_f16", "bytes_per_kept", 3.3),
    ("sign_scaled", "bits_per_element", 1.05),
    ("quant_4bit", "bits_per_element", 4.1),
];

/// The number in field `key` of a JSON line.
fn number(line: &str, key: &str) -> f64 {
    field(line, key)
        .unwrap_or_else(|| panic!("{key} in {line}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is a number in {line}"))
}

#[test]
fn wire_json_meets_every_bytes_target() {
    let text = run_json(env!("CARGO_BIN_EXE_wire"), &["--json"]);
    let mut rows = Vec::new();
    for line in text.lines() {
        assert!(line.starts_with('{') && line.ends_with('}'), "{line}");
        let name = field(line, "name")
            .expect("name")
            .trim_matches('"')
            .to_owned();
        let (bytes, n, kept) = (
            number(line, "bytes"),
            number(line, "n"),
            number(line, "kept"),
        );
        assert_eq!(n, 789_504.0, "{line}");
        assert!(bytes > 0.0 && kept > 0.0 && kept <= n, "{line}");
        assert!(
            (number(line, "bytes_per_kept") - bytes / kept).abs() < 1e-3,
            "{line}"
        );
        assert!(
            (number(line, "bits_per_element") - 8.0 * bytes / n).abs() < 1e-3,
            "{line}"
        );
        let met = field(line, "met").expect("met");
        match DESIGN_TARGETS.iter().find(|t| t.0 == name) {
            Some(&(_, unit, max)) => {
                assert_eq!(met, "true", "{line}");
                assert_eq!(
                    field(line, "unit"),
                    Some(format!("\"{unit}\"").as_str()),
                    "{line}"
                );
                assert_eq!(number(line, "max"), max, "DESIGN.md's limit in {line}");
                let value = if unit == "bytes_per_kept" {
                    bytes / kept
                } else {
                    8.0 * bytes / n
                };
                assert!(value <= max, "{line}");
            }
            None => assert_eq!(met, "null", "a target DESIGN.md does not set: {line}"),
        }
        rows.push((name, bytes, kept));
    }
    let row = |name: &str| {
        rows.iter()
            .find(|r| r.0 == name)
            .unwrap_or_else(|| panic!("row {name}"))
    };
    let bytes_of = |name: &str| row(name).1;
    // Kept entries as the methods define them, from the tensors' sizes.
    let file = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/minilm_small_grads.safetensors"
    ))
    .expect("testdata");
    let sizes: Vec<u64> = read_safetensors(&file)
        .expect("safetensors")
        .iter()
        .map(|(_, t)| t.data().len() as u64)
        .collect();
    let n: u64 = sizes.iter().sum();
    let k = |ratio: f64| sizes.iter().map(|&s| k_from_ratio(s, ratio)).sum::<u64>() as f64;
    for (name, expected) in [
        ("topk_1pct_f32", k(0.01)),
        ("topk_1pct_int8", k(0.01)),
        ("topk_1pct_int8_buckets_64k", k(0.01)),
        ("topk_0.1pct_int8", k(0.001)),
        ("randomk_1pct_int8", k(0.01)),
        ("reference_topk_1pct_int8", k(0.01)),
        // One threshold for the model at its 1% magnitude: floor(n / 100) entries above it.
        ("threshold_1pct_int8", (n / 100) as f64),
        ("sign_scaled", n as f64),
        ("quant_4bit", n as f64),
        ("dense_f32", n as f64),
    ] {
        assert_eq!(row(name).2, expected, "kept entries of {name}");
    }
    // Every DESIGN.md target has its row; every method family is measured.
    for (name, _, _) in DESIGN_TARGETS {
        row(name);
    }
    for name in [
        "topk_1pct_f32",
        "threshold_1pct_int8",
        "randomk_1pct_int8",
        "sign_majority",
        "quant_8bit",
        "qsgd_4bit_stochastic",
        "dense_f32",
        "dense_f16",
        "dense_bf16",
        "reference_topk_1pct_int8",
    ] {
        bytes_of(name);
    }
    // The dense f32 bundle is the payload plus its framing; the reference layout, which spends
    // 8 bytes on each index, is more than four times gradwire's int8 top-k.
    assert!(bytes_of("dense_f32") >= 4.0 * 789_504.0);
    assert!(bytes_of("reference_topk_1pct_int8") > 4.0 * bytes_of("topk_1pct_int8"));
}

//! The `wire` binary (bytes on the wire for the real MiniLM gradients) with `--json`: it exits
//! 0 (every DESIGN.md bytes target met), prints one JSON object per line for every method, and
//! its counts add up. Byte counts are deterministic, so the targets are asserted here; the
//! same targets are also checked against the library directly in std-adapter's
//! `tests/bundle.rs`.

use std::process::Command;

/// The text after `"key":` up to the next `,` or `}` of a flat JSON object line (the `target`
/// object's fields are looked up by their own keys).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    Some(&rest[..rest.find([',', '}'])?])
}

fn number(line: &str, key: &str) -> f64 {
    field(line, key)
        .unwrap_or_else(|| panic!("{key} in {line}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is a number in {line}"))
}

#[test]
fn wire_json_meets_every_bytes_target() {
    let out = Command::new(env!("CARGO_BIN_EXE_wire"))
        .arg("--json")
        .output()
        .expect("run wire");
    assert!(
        out.status.success(),
        "wire failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
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
        if met != "null" {
            assert_eq!(met, "true", "{line}");
            let max = number(line, "max");
            let value = match field(line, "unit") {
                Some("\"bytes_per_kept\"") => bytes / kept,
                Some("\"bits_per_element\"") => 8.0 * bytes / n,
                other => panic!("unit {other:?} in {line}"),
            };
            assert!(value <= max, "{line}");
        }
        rows.push((name, bytes, met != "null"));
    }
    let bytes_of = |name: &str| {
        rows.iter()
            .find(|r| r.0 == name)
            .unwrap_or_else(|| panic!("row {name}"))
            .1
    };
    // DESIGN.md's four targets are rows with a target; every method family is measured.
    for name in [
        "topk_1pct_int8",
        "topk_1pct_int8_buckets_64k",
        "topk_1pct_f16",
        "sign_scaled",
        "quant_4bit",
    ] {
        assert!(
            rows.iter().any(|r| r.0 == name && r.2),
            "{name} has a target"
        );
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

//! The `ratios` binary as CI runs it (`--n 100000`, here with `--json`): it exits 0 and prints
//! one JSON object per line with the fields issue 5 names (`name`, `n`, `median_s`,
//! `ratio_to_read`, `ratio_to_baseline`, `build`), for every kernel it names. No timing is
//! asserted beyond "positive". Being an integration test of this package, it also makes the
//! README's test command build `target/release/ratios`, which CI's ratios stage then runs
//! without building it again.

use std::process::Command;

/// The text after `"key":` up to the next `,` or `}` of a flat JSON object line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    Some(&rest[..rest.find([',', '}'])?])
}

#[test]
fn ratios_json_has_every_kernel_and_field() {
    let out = Command::new(env!("CARGO_BIN_EXE_ratios"))
        .args(["--n", "100000", "--json"])
        .output()
        .expect("run ratios");
    assert!(
        out.status.success(),
        "ratios failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let mut names = Vec::new();
    for line in text.lines() {
        assert!(line.starts_with('{') && line.ends_with('}'), "{line}");
        let name = field(line, "name").expect("name").trim_matches('"');
        let data = field(line, "data").expect("data");
        // The real MiniLM rows have their own n; the synthetic buffer's is the one asked for.
        if data == "\"heavy_tailed\"" {
            assert_eq!(field(line, "n"), Some("100000"), "{line}");
        }
        let median: f64 = field(line, "median_s")
            .expect("median_s")
            .parse()
            .expect("number");
        assert!(median > 0.0, "{line}");
        for key in ["ratio_to_read", "ratio_to_baseline"] {
            assert!(field(line, key).is_some(), "{key} in {line}");
        }
        let build = field(line, "build").expect("build");
        assert!(build == "\"default\"" || build == "\"native\"", "{line}");
        names.push(name.to_owned());
    }
    let kernels = [
        "topk_1pct",
        "topk_0.1pct",
        "threshold",
        "randomk_1pct",
        "sign",
        "quant_int8",
        "quant_4bit",
        "f16_cast",
        "bf16_cast",
    ];
    for k in kernels {
        for name in [
            k.to_owned(),
            format!("decode_{k}"),
            format!("accumulate_{k}"),
        ] {
            assert!(names.contains(&name), "no row {name}");
        }
    }
    assert!(names.iter().any(|n| n == "ef_step"), "no row ef_step");
}

//! The `ratios` binary as CI runs it (`--n 100000`, here with `--json`): it exits 0 and prints
//! one JSON object per line with the fields issue 5 names (`name`, `n`, `median_s`,
//! `ratio_to_read`, `ratio_to_baseline`, `build`), for every kernel it names. No timing is
//! asserted beyond "positive". Being an integration test of this package, it also makes the
//! README's test command build `target/release/ratios`, which CI's ratios stage then runs
//! without building it again.

mod common;

use common::{field, run_json};

#[test]
fn ratios_json_has_every_kernel_and_field() {
    let text = run_json(env!("CARGO_BIN_EXE_ratios"), &["--n", "100000", "--json"]);
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

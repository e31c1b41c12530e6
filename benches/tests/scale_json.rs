//! The `scale` binary as `--small --json PATH` runs it (about 5 s in a release build on two
//! cores): it exits 0, writes the `gradwire-scale/1` document, every row has every field with
//! its JSON type, the small set's rows are all there (every method and collective at W = 1 and
//! 3, dense f32 once per W), every row without an error is bit-identical across ranks, and its
//! memory per rank beyond the gradients and outputs stays within the state its method keeps
//! plus 64 MB, and its checkpoints (rows with error feedback) are saved and loaded within 64 MB of
//! the step phase's peak. No timing is asserted beyond "positive".

mod common;

use common::run_json;
use serde_json::Value;

/// What a field may hold.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Str,
    Int,
    Num,
    Bool,
    Nums,
}

/// Every field of a row, its type, and whether it may be null on a row without an error.
const FIELDS: &[(&str, Kind, bool)] = &[
    ("shapes", Kind::Str, false),
    ("parameters", Kind::Int, false),
    ("tensors", Kind::Int, false),
    ("method", Kind::Str, false),
    ("label", Kind::Str, false),
    ("error_feedback", Kind::Bool, false),
    ("collective", Kind::Str, false),
    // Null on the dense route.
    ("collective_in_use", Kind::Str, true),
    ("workers", Kind::Int, false),
    ("parallelism", Kind::Str, false),
    ("chunk_bytes", Kind::Int, false),
    ("steps", Kind::Int, false),
    ("step_wall_s", Kind::Nums, false),
    ("step_cpu_per_rank_s", Kind::Nums, false),
    ("median_cpu_s", Kind::Num, false),
    ("median_wall_s", Kind::Num, false),
    ("first_step_over_later", Kind::Num, false),
    ("state_bytes_per_rank", Kind::Int, false),
    ("fresh_write_s", Kind::Num, false),
    ("first_step_over_allowance", Kind::Num, false),
    ("read_pass_s", Kind::Num, false),
    ("read_passes", Kind::Num, false),
    ("kernel_floor_s", Kind::Num, false),
    ("kernel_floor_wall_s", Kind::Num, false),
    ("floor", Kind::Str, false),
    ("floor_of", Kind::Str, false),
    ("floor_ratio", Kind::Num, false),
    ("max_message_bytes", Kind::Int, false),
    ("sent_bytes", Kind::Int, false),
    ("received_bytes", Kind::Int, false),
    // Null where /proc/self/clear_refs cannot be written (`rss_note` says why).
    ("rss_baseline_bytes", Kind::Int, true),
    ("peak_rss_bytes", Kind::Int, true),
    ("peak_over_baseline_mb", Kind::Num, true),
    ("bytes_per_param_beyond", Kind::Num, true),
    ("rss_note", Kind::Str, true),
    ("identical", Kind::Bool, false),
    ("output_hash", Kind::Str, false),
    // Null on rows without error feedback (asserted below for the others).
    ("checkpoint_bytes", Kind::Int, true),
    ("checkpoint_save_s", Kind::Num, true),
    ("checkpoint_load_s", Kind::Num, true),
    ("checkpoint_save_over_step_mb", Kind::Num, true),
    ("checkpoint_load_over_step_mb", Kind::Num, true),
    ("generate_s", Kind::Num, false),
    ("row_wall_s", Kind::Num, false),
    ("error", Kind::Str, true),
    ("refused", Kind::Bool, false),
];

/// Whether `v` is of `kind`.
fn is(v: &Value, kind: Kind) -> bool {
    match kind {
        Kind::Str => v.is_string(),
        Kind::Int => v.is_u64(),
        Kind::Num => v.is_number(),
        Kind::Bool => v.is_boolean(),
        Kind::Nums => v
            .as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_number)),
    }
}

#[test]
fn scale_small_json_has_every_row_and_field() {
    let path = std::env::temp_dir().join(format!("gradwire-scale-{}.json", std::process::id()));
    let path_s = path.to_str().expect("UTF-8 temp path");
    run_json(env!("CARGO_BIN_EXE_scale"), &["--small", "--json", path_s]);
    let text = std::fs::read_to_string(&path).expect("the JSON document");
    let _ = std::fs::remove_file(&path);
    let doc: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(doc["schema"], "gradwire-scale/1");
    let build = doc["build"].as_str().expect("build");
    assert!(build == "default" || build == "native", "{build}");
    let rows = doc["rows"].as_array().expect("rows");

    let mut measured = 0;
    for row in rows {
        let obj = row.as_object().expect("a row is an object");
        let failed = !obj["error"].is_null();
        for &(key, kind, nullable) in FIELDS {
            let v = obj
                .get(key)
                .unwrap_or_else(|| panic!("no field {key} in {row}"));
            let ok = is(v, kind) || (v.is_null() && (nullable || failed));
            assert!(ok, "{key} is not {kind:?} in {row}");
        }
        assert_eq!(obj["shapes"], "small", "{row}");
        assert_eq!(obj["steps"], 3, "{row}");
        assert_eq!(obj["parallelism"], "serial", "{row}");
        if failed {
            // Only the library's refusal is allowed (the binary exits 1 otherwise).
            assert_eq!(obj["refused"], true, "{row}");
            continue;
        }
        assert_eq!(obj["identical"], true, "{row}");
        assert_eq!(
            obj["step_wall_s"].as_array().map(Vec::len),
            Some(3),
            "{row}"
        );
        for key in [
            "median_cpu_s",
            "read_pass_s",
            "kernel_floor_s",
            "kernel_floor_wall_s",
        ] {
            assert!(obj[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {row}");
        }
        // The message bound (`CompressedAllReduce::with_chunk_bytes`; `--small` runs 64 KiB):
        // every buffer passed to the communicator, on every route.
        assert_eq!(obj["chunk_bytes"], 64 << 10, "{row}");
        let largest = obj["max_message_bytes"].as_u64().expect("max message");
        assert!(largest <= 64 << 10, "{row}");
        // The memory bound of issue 46 per rank beyond the caller's gradients and outputs:
        // the state the method keeps (with error feedback 4 bytes per parameter on the
        // all-gather, 4 + 8/W on the two-phase collective: worker residual, server residual
        // and its copy) plus 64 MB.
        if let Some(beyond) = obj["bytes_per_param_beyond"].as_f64() {
            let params = obj["parameters"].as_f64().expect("parameters");
            let w = obj["workers"].as_f64().expect("workers");
            let state = match (
                obj["error_feedback"].as_bool(),
                obj["collective_in_use"].as_str(),
            ) {
                (Some(true), Some("two-phase")) => 4.0 + 8.0 / w,
                (Some(true), _) => 4.0,
                _ => 0.0,
            };
            let allowed = state * params + 64e6;
            assert!(
                beyond * params <= allowed,
                "memory beyond the bound in {row}"
            );
        }
        // Checkpoints of the state (issue 46 scope 4): saved and loaded on every row with error
        // feedback, each within 64 MB of the step phase's peak RSS (where it was measured).
        if obj["error_feedback"] == true {
            let bytes = obj["checkpoint_bytes"].as_u64().expect("checkpoint bytes");
            assert!(bytes > 0, "{row}");
            for key in [
                "checkpoint_save_over_step_mb",
                "checkpoint_load_over_step_mb",
            ] {
                if let Some(mb) = obj[key].as_f64() {
                    assert!(mb <= 64.0, "{key} in {row}");
                }
            }
        }
        let hash = obj["output_hash"].as_str().expect("hash");
        assert!(
            hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
            "{row}"
        );
        measured += 1;
    }
    // Every row of the small set (a refused row counts as present: it is checked above).
    let mut expected = Vec::new();
    for w in [1u64, 3] {
        for label in ["topk-1%-int8-ef", "sign-ef", "quant4-ef", "dense-bf16"] {
            for c in ["all-gather", "two-phase", "auto"] {
                expected.push((label.to_owned(), c.to_owned(), w));
            }
        }
        expected.push(("dense-f32".to_owned(), "all-reduce".to_owned(), w));
    }
    let present: Vec<(String, String, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["label"].as_str().unwrap_or_default().to_owned(),
                r["collective"].as_str().unwrap_or_default().to_owned(),
                r["workers"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    for e in &expected {
        assert!(present.contains(e), "no row {e:?}");
    }
    assert_eq!(rows.len(), expected.len(), "one row each");
    assert!(measured > 0, "every row refused");
}

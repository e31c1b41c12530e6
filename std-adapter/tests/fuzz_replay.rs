//! Replays every file of the checked-in fuzz corpora of the std targets
//! (`fuzz/corpus/{bundle,reference,checkpoint,two_phase,server_checkpoint,dense_sum,method_state,windows}/`) through the same
//! target bodies the fuzzers run, on stable. The bodies live in `fuzz/logic/src/std_targets.rs`
//! `collective_targets.rs` and `state_targets.rs` and are included here by path (no dependency on the fuzz crate,
//! whose workspace is separate); see FUZZING.md.

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/input.rs"]
mod input;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/gens.rs"]
mod gens;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/std_targets.rs"]
mod std_targets;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/collective_targets.rs"]
mod collective_targets;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/state_targets.rs"]
mod state_targets;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/window_targets.rs"]
mod window_targets;

use std::path::{Path, PathBuf};

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn replay(target: &str, body: fn(&[u8])) {
    let files = corpus(target);
    assert!(!files.is_empty(), "corpus of {target} is empty");
    for f in &files {
        let data = std::fs::read(f).expect("read corpus file");
        let r = std::panic::catch_unwind(|| body(&data));
        assert!(r.is_ok(), "{target}: {} fails", f.display());
    }
    eprintln!("{target}: {} inputs replayed", files.len());
}

#[test]
fn replay_bundle() {
    replay("bundle", std_targets::bundle);
}

#[test]
fn replay_reference() {
    replay("reference", std_targets::reference);
}

#[test]
fn replay_checkpoint() {
    replay("checkpoint", std_targets::checkpoint);
}

#[test]
fn replay_two_phase() {
    replay("two_phase", collective_targets::two_phase);
}

#[test]
fn replay_server_checkpoint() {
    replay("server_checkpoint", collective_targets::server_checkpoint);
}

#[test]
fn replay_dense_sum() {
    replay("dense_sum", collective_targets::dense_sum);
}

#[test]
fn replay_windows() {
    replay("windows", window_targets::windows);
}

#[test]
fn replay_method_state() {
    replay("method_state", state_targets::method_state);
}

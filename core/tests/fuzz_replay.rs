//! Replays every file of the checked-in fuzz corpora of the core targets
//! (`fuzz/corpus/<target>/`) through the same target bodies the fuzzers run, on stable, so CI
//! covers the corpora without nightly or cargo-fuzz. The bodies live in
//! `fuzz/logic/src/core_targets.rs` and are included here by path (no dependency on the fuzz
//! crate, whose workspace is separate); see FUZZING.md.

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/input.rs"]
mod input;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/gens.rs"]
mod gens;

#[allow(dead_code)]
#[path = "../../fuzz/logic/src/core_targets.rs"]
mod core_targets;

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
fn replay_decode() {
    replay("decode", core_targets::decode);
}

#[test]
fn replay_peek_frame() {
    replay("peek_frame", core_targets::peek_frame);
}

#[test]
fn replay_roundtrip() {
    replay("roundtrip", core_targets::roundtrip);
}

#[test]
fn replay_no_output_leak() {
    replay("no_output_leak", core_targets::no_output_leak);
}

#[test]
fn replay_simd_scalar() {
    replay("simd_scalar", core_targets::simd_scalar);
}

/// The replay helpers' CRC-32 equals `crc32fast` (the frame trailer's), so the CRC-repairing
/// variants really produce a valid trailer.
#[test]
fn crc_helper_matches_crc32fast() {
    for len in [0usize, 1, 3, 4, 100, 1000] {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        assert_eq!(input::crc32(&data), crc32fast::hash(&data));
    }
}

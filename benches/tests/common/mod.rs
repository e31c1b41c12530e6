//! Shared helpers of the tests that run this package's report binaries with `--json`.
#![allow(dead_code)]

use std::process::Command;

/// Runs the binary at `bin` with `args`, asserts that it exits 0, and returns its standard
/// output (one JSON object per line).
pub fn run_json(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .output()
        .expect("run the binary");
    assert!(
        out.status.success(),
        "{bin} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The text after `"key":` up to the next `,` or `}` of a flat JSON object line (the fields of
/// a nested object are looked up by their own keys).
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    Some(&rest[..rest.find([',', '}'])?])
}

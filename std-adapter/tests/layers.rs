//! The layers of both crates (`docs/architecture.md`): every module uses only modules of layers
//! listed before its own, so no import runs up the list and no two modules import each other.
//! A layer is a top-level module with all its files (`layout/` is one layer); the test reads
//! every `use crate::…` item and every `crate::…` path in the code (comments left out) of each
//! source file and checks it against the list.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// gradwire-core's modules, bottom to top.
const CORE: &[&str] = &[
    "bits",
    "lanes",
    "rng",
    "error",
    "method",
    "scalar",
    "index",
    "randomk",
    "select",
    "values",
    "quant",
    "sign",
    "zero_mask",
    "powersgd",
    "frame",
    "feedback",
];

/// gradwire's modules, bottom to top.
const STD: &[&str] = &[
    "comm",
    "error",
    "safetensors_reader",
    "tensor",
    "method",
    "layout",
    "feedback",
    "engine",
    "aggregate",
    "collective",
    "powersgd",
    "reference",
    "compressor",
    "dgc",
    "allreduce",
    "container",
    "cli",
];

fn root(krate: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

/// Every `.rs` file under `dir`.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a source file: comments (line and doc comments) removed, strings kept.
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules that `code` names through `crate::`: inline paths (`crate::x::y`)
/// and every item of `use crate::{x, y::z, …}` groups.
fn used(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // The group's top-level items, up to its closing brace.
            let mut depth = 1;
            let mut item = String::new();
            let mut items = Vec::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => items.push(std::mem::take(&mut item)),
                    _ if depth == 1 => item.push(c),
                    _ => {}
                }
            }
            items.push(item);
            for it in items {
                let name: String = it
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
        rest = after;
    }
    out
}

/// The layer (top-level module) a file belongs to; `None` for the crate root and binaries.
fn layer_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_owned();
    match first.as_str() {
        "lib.rs" | "main.rs" | "bin" => None,
        f => Some(f.trim_end_matches(".rs").to_owned()),
    }
}

/// Checks one crate; returns the violations, `file: uses x (layer i) above its own (layer j)`.
fn violations(krate: &str, layers: &[&str]) -> Vec<String> {
    let src = root(krate);
    let mut all = Vec::new();
    files(&src, &mut all);
    all.sort();
    let rank = |m: &str| layers.iter().position(|l| *l == m);
    let mut bad = Vec::new();
    let mut seen = BTreeSet::new();
    for file in &all {
        let Some(own) = layer_of(&src, file) else {
            continue;
        };
        seen.insert(own.clone());
        let Some(own_rank) = rank(&own) else {
            bad.push(format!(
                "{}: module `{own}` is not in the layer list",
                file.display()
            ));
            continue;
        };
        let text = fs::read_to_string(file).unwrap();
        for m in used(&code(&text)) {
            // Items of the crate root (re-exports) and the module itself are not layers.
            match rank(&m) {
                Some(r) if r > own_rank => bad.push(format!(
                    "{}: `{own}` (layer {own_rank}) uses `{m}` (layer {r}), a layer above it",
                    file.display()
                )),
                Some(_) => {}
                // `crate::Error`, `crate::core`: items and re-exports of the crate root.
                None if m.starts_with(char::is_uppercase) || m == "core" => {}
                None => bad.push(format!(
                    "{}: uses `crate::{m}`, which is not a layer",
                    file.display()
                )),
            }
        }
    }
    for l in layers {
        if !seen.contains(*l) {
            bad.push(format!("{krate}: layer `{l}` has no source file"));
        }
    }
    bad
}

#[test]
fn core_modules_look_down_only() {
    let bad = violations("core", CORE);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn std_modules_look_down_only() {
    let bad = violations("std-adapter", STD);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The checker finds what it must: a use group, an inline path, a nested group, and nothing in
/// comments.
#[test]
fn the_checker_reads_use_groups_and_paths() {
    let text = "use crate::{a, b::{c, d}, e::F};\n// crate::hidden\nfn f() { crate::g::h(); }";
    let got: Vec<String> = used(&code(text)).into_iter().collect();
    assert_eq!(got, ["a", "b", "e", "g"]);
}

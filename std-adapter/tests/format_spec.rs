//! The std crate's formats checked against FORMAT.md (sections 10-13: bundle version 2, method
//! text, error-feedback checkpoint version 3, container version 1) by an independent reader
//! written from FORMAT.md alone, as `core/tests/golden.rs` checks frames. It uses no API of the
//! `gradwire` crate (being redesigned): only `gradwire_core` (frames, through `peek` only: the
//! frame format is checked elsewhere), `crc32fast`, `serde_json` and `safetensors`.
//!
//! Every golden file of `testdata/golden/{bundle,checkpoint,container}` is parsed by hand and
//! checked against what the spec and the inputs of `golden_formats.rs` (its model's names and
//! shapes, each case's method, bucketing, seed and steps) determine. The files on disk must be
//! exactly those, and their bytes are pinned by one digest (`DIGEST`), so a changed golden file
//! fails here as well as in `golden_formats.rs`. FORMAT.md's worked examples must be those files,
//! byte for byte.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use gradwire_core::{K, Method, Rounding, SignScale, Values, peek};
use safetensors::Dtype;
use serde_json::Value;

/// FNV-1a 64 over every golden file of the three folders in name order: its name, a 0 byte, its
/// length (u64) and its bytes. After a deliberate change (a version bump, FORMAT.md updated),
/// the failure message prints the new value. Last change: the `gradwire` tool's residual states
/// (`container/*_ef_step*.state.safetensors`) gained the `output_len` and `output_sha256`
/// entries of FORMAT.md 12.2, keys that every checkpoint version 3 reader ignores: the
/// checkpoint format and the library's checkpoints (`checkpoint/`) are unchanged, so no
/// version moved.
const DIGEST: u64 = 0x2f1d_d237_e6b7_faa2;

/// Bundle cases of `golden_formats.rs` (rank 1): first step, steps, bucket budget B, dense
/// below D (dense tensors go as f16), top-k scope, with the large tensor or not, seed, error
/// feedback (then the case's checkpoint is a golden file too), method.
const BUNDLES: &str = "
topk_f32           0 1    0  0 tensor -   0 -  topk k=ratio:0.05 values=f32
topk_int8_ef_fused 0 2 4096 30 tensor -   1 ef topk k=ratio:0.05 values=int8:256
topk_per_bucket    0 1 8192  0 bucket -   0 -  topk k=count:7 values=f32
quant4_ef          0 2    0  0 tensor -   0 ef quant bits=4 block=512 rounding=nearest-even
quant3_stochastic  5 1    0  0 tensor -   9 -  quant bits=3 block=64 rounding=stochastic
sign_ef            0 2    0  0 tensor big 0 ef sign scale=mean-abs:1024
sign_majority      0 1    0  0 tensor -   0 -  sign scale=none
randomk_f16        2 1    0  0 tensor -   3 -  randomk k=ratio:0.1 values=f16 unbiased=false
threshold          0 1    0  0 tensor -   0 -  threshold t=0.5 values=f32
dense_bf16         0 1    0  0 tensor -   0 -  dense values=bf16
dense_f16          0 1    0  0 tensor -   0 -  dense values=f16
topk_big_ef_int8   0 3    0  0 tensor big 0 ef topk k=ratio:0.001 values=int8:256
randomk_big_ef     0 2    0  0 tensor big 4 ef randomk k=ratio:0.002 values=f32 unbiased=false
";

/// Containers of `golden_formats.rs` (rank 0, no buckets): seed, step, method.
const CONTAINERS: &str = "
topk_int8           0 0 topk k=ratio:0.05 values=int8:256
quant4_stochastic  11 3 quant bits=4 block=512 rounding=stochastic
sign                0 0 sign scale=mean-abs:1024
randomk_k5          2 7 randomk k=count:5 values=f32 unbiased=false
dense_f16           0 0 dense values=f16
topk_int8_ef_step0  5 0 topk k=ratio:0.05 values=int8:256
topk_int8_ef_step1  5 1 topk k=ratio:0.05 values=int8:256
";

/// The rows of a table: the first `n` words of each line, and the rest of the line.
fn table(t: &'static str, n: usize) -> impl Iterator<Item = (Vec<&'static str>, &'static str)> {
    t.lines().filter(|l| !l.is_empty()).map(move |l| {
        let (mut words, mut rest) = (Vec::new(), l);
        for _ in 0..n {
            let (w, r) = rest.split_once(' ').unwrap();
            words.push(w);
            rest = r.trim_start();
        }
        (words, rest)
    })
}

fn int(s: &str) -> u64 {
    s.parse()
        .unwrap_or_else(|_| panic!("`{s}` is not a number"))
}

/// The golden files the cases above make.
fn golden_files() -> BTreeSet<String> {
    let mut files = BTreeSet::from(["checkpoint/unshaped_and_shaped.safetensors".to_owned()]);
    for (w, _) in table(BUNDLES, 9) {
        let steps = int(w[1])..int(w[1]) + int(w[2]);
        files.extend(steps.map(|s| format!("bundle/{}_step{s}.gwb", w[0])));
        if w[8] == "ef" {
            files.insert(format!("checkpoint/{}.safetensors", w[0]));
        }
    }
    for (w, _) in table(CONTAINERS, 3) {
        files.insert(format!("container/{}.gwct", w[0]));
        files.insert(format!("container/{}.dense.safetensors", w[0]));
    }
    files.extend((0..2).map(|s| format!("container/topk_int8_ef_step{s}.state.safetensors")));
    files
}

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn golden(name: &str) -> Vec<u8> {
    eprintln!("reading {name}");
    std::fs::read(testdata().join("golden").join(name)).unwrap()
}

/// A tensor: name and shape.
type Spec<'a> = (&'a str, &'a [u64]);

/// The model of `golden_formats.rs`, in name order (`big` only in some cases).
const MODEL: [Spec<'static>; 6] = [
    ("attn.b", &[24]),
    ("attn.w", &[32, 24]),
    ("big", &[350, 400]),
    ("emb", &[3, 200]),
    ("empty", &[0]),
    ("ln", &[]),
];

fn model(big: bool) -> Vec<Spec<'static>> {
    MODEL.into_iter().filter(|t| big || t.0 != "big").collect()
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a 64 (FORMAT.md 7.3), continuing from `h`.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A little-endian cursor; a read past the end panics, naming the offset.
struct Rd<'a>(&'a [u8], usize);

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let end = self.1.checked_add(n).filter(|&e| e <= self.0.len());
        let s = &self.0[self.1..end.unwrap_or_else(|| panic!("truncated at {}", self.1))];
        self.1 += n;
        s
    }
    fn int<const N: usize>(&mut self) -> u64 {
        let mut a = [0u8; 8];
        a[..N].copy_from_slice(self.take(N));
        u64::from_le_bytes(a)
    }
}

// ---------------------------------------------------------------------------------------------
// Method text (FORMAT.md 11)

/// Checks that `text` is a valid method text in canonical form.
fn check_method(text: &str) {
    let mut words = text.split(' ');
    let keys: &[&str] = match words.next().unwrap() {
        "dense" => &["values"],
        "topk" => &["k", "values"],
        "threshold" => &["t", "values"],
        "randomk" => &["k", "values", "unbiased"],
        "quant" => &["bits", "block", "rounding"],
        // The zero mask's `mask=zeros` is written only when it is on.
        "sign" if text.ends_with(" mask=zeros") => &["scale", "mask"],
        "sign" => &["scale"],
        w => panic!("`{text}`: unknown method `{w}`"),
    };
    let words: Vec<&str> = words.collect();
    assert_eq!(words.len(), keys.len(), "`{text}`: parameters");
    // Decimal without sign or leading zero, in `min..=max`; floats finite (an infinity prints
    // as `inf`), not negative, in Rust's `Display`.
    let n = |s: &str, min, max| int(s).to_string() == s && (min..=max).contains(&int(s));
    let block = |s: &str| n(s, 1, u32::MAX.into());
    for (k, w) in keys.iter().zip(words) {
        let v = w
            .strip_prefix(k)
            .and_then(|w| w.strip_prefix('='))
            .expect(text);
        let ok = match (*k, v.split_once(':')) {
            ("values", Some(("int8", b))) => block(b) && !text.starts_with("dense"),
            ("values", _) => ["f32", "f16", "bf16"].contains(&v),
            ("k", Some(("count", c))) => n(c, 0, u64::MAX),
            ("k", Some(("ratio", r))) => {
                r.parse().is_ok_and(|x: f64| x >= 0.0 && x.to_string() == r)
            }
            ("t", _) => v.parse().is_ok_and(|x: f32| x >= 0.0 && x.to_string() == v),
            ("unbiased", _) => v == "true" || v == "false",
            ("bits", _) => n(v, 2, 8),
            ("block", _) => block(v),
            ("rounding", _) => v == "nearest-even" || v == "stochastic",
            ("scale", Some(("mean-abs", b))) => block(b),
            ("mask", _) => v == "zeros",
            _ => *k == "scale" && v == "none",
        };
        assert!(ok, "`{text}`: `{w}` is not valid");
    }
}

/// The text of a frame's method as `peek` reports it (`k` a count).
fn format_method(m: &Method) -> String {
    let v = |v: &Values| match v {
        Values::Int8 { block } => format!("int8:{block}"),
        other => format!("{other:?}").to_lowercase(),
    };
    let k = |k: &K| match k {
        K::Count(c) => format!("count:{c}"),
        K::Ratio(r) => format!("ratio:{r}"),
    };
    let stochastic = ["nearest-even", "stochastic"];
    match *m {
        Method::Dense { values } => format!("dense values={}", v(&values)),
        Method::TopK { k: c, values } => format!("topk k={} values={}", k(&c), v(&values)),
        Method::Threshold {
            threshold: t,
            values,
        } => format!("threshold t={t} values={}", v(&values)),
        Method::RandomK {
            k: c,
            values,
            unbiased: u,
        } => {
            format!("randomk k={} values={} unbiased={u}", k(&c), v(&values))
        }
        Method::Quant {
            bits,
            block,
            rounding: r,
        } => {
            let r = stochastic[usize::from(r == Rounding::Stochastic)];
            format!("quant bits={bits} block={block} rounding={r}")
        }
        Method::Sign { scale, zero_mask } => {
            let mask = if zero_mask { " mask=zeros" } else { "" };
            match scale {
                SignScale::MeanAbs { block } => format!("sign scale=mean-abs:{block}{mask}"),
                SignScale::None => format!("sign scale=none{mask}"),
            }
        }
    }
}

/// `k` (`count:N` or `ratio:R`) resolved for `n` elements (FORMAT.md 7.1).
fn resolve(k: &str, n: u64) -> u64 {
    match k.split_once(':').unwrap() {
        ("count", c) => int(c).min(n),
        _ if n == 0 => 0,
        (_, r) => ((n as f64 * r.parse::<f64>().unwrap()).floor() as u64).clamp(1, n),
    }
}

// ---------------------------------------------------------------------------------------------
// Bundle (FORMAT.md 10)

/// What a receiver holds (10.4): tensors in order, method, seed and the bucketing (budget B,
/// dense below D, per-bucket scope).
struct Manifest<'a>(Vec<Spec<'a>>, &'a str, u64, (u64, u64, bool));

impl Manifest<'_> {
    /// The entries (10.4): members (indices into the tensors) and whether they go dense.
    fn entries(&self) -> Vec<(Vec<usize>, bool)> {
        let ((b, d, _), mut entries) = (self.3, Vec::<(Vec<usize>, bool)>::new());
        let b = b.min(4 * u64::from(u32::MAX));
        let mut open: [Option<(usize, u64)>; 2] = [None, None];
        for (t, (_, shape)) in self.0.iter().enumerate() {
            let (bytes, dense) = (4 * numel(shape), numel(shape) < d);
            match &mut open[usize::from(dense)] {
                _ if b == 0 || bytes >= b => entries.push((vec![t], dense)),
                Some((e, used)) if *used + bytes <= b => {
                    entries[*e].0.push(t);
                    *used += bytes;
                }
                slot => {
                    *slot = Some((entries.len(), bytes));
                    entries.push((vec![t], dense));
                }
            }
        }
        entries
    }

    fn label(&self, members: &[usize]) -> String {
        let names: Vec<&str> = members.iter().map(|&t| self.0[t].0).collect();
        match names[..] {
            [one] => one.to_owned(),
            _ => format!("bucket[{}]", names.join(", ")),
        }
    }

    /// The entry id (10.3).
    fn id(&self, members: &[usize]) -> u64 {
        let mut h = fnv(fnv(FNV0, self.label(members).as_bytes()), &[0]);
        for (name, shape) in members.iter().map(|&t| self.0[t]) {
            h = fnv(fnv(h, name.as_bytes()), &[0]);
            for d in [shape.len() as u64].iter().chain(shape) {
                h = fnv(h, &d.to_le_bytes());
            }
        }
        h
    }

    /// The text of the method of an entry's frame, `k` resolved to a count (10.2).
    fn frame_method(&self, members: &[usize], dense: bool) -> String {
        if dense {
            return "dense values=f16".to_owned();
        }
        let Some(k) = self.1.split(' ').find_map(|w| w.strip_prefix("k=")) else {
            return self.1.to_owned();
        };
        let n = members.iter().map(|&t| numel(self.0[t].1));
        let count: u64 = if self.1.starts_with("topk") && !self.3.2 {
            n.map(|n| resolve(k, n)).sum() // per-tensor scope: each tensor's own k
        } else {
            resolve(k, n.sum())
        };
        self.1
            .replace(&format!("k={k}"), &format!("k=count:{count}"))
    }
}

/// Reads a bundle as 10.1-10.5 say; returns each entry's label and kept count.
fn read_bundle(b: &[u8], man: &Manifest, rank: u64, step: u64) -> Vec<(String, u64)> {
    assert!(b.len() >= 28, "shorter than a header and a trailer");
    let mut r = Rd(b, 0);
    assert_eq!(r.take(4), b"GWBN", "magic");
    let header = [r.int::<1>(), r.int::<1>(), r.int::<2>(), r.int::<4>()];
    assert_eq!(header, [2, 0, 0, rank], "version, flags, reserved, rank");
    let (count, got_step) = (r.int::<4>() as usize, r.int::<8>());
    assert_eq!(got_step, step, "step");
    let body = b.len() - 4;
    assert_eq!(b[body..], crc32fast::hash(&b[..body]).to_le_bytes());
    let entries = man.entries();
    assert_eq!(count, entries.len(), "entry count");
    let mut out = Vec::new();
    for (members, dense) in &entries {
        let label = man.label(members);
        eprintln!("  entry {label}");
        let (id, len) = (r.int::<8>(), r.int::<4>() as usize);
        assert_eq!(id, man.id(members), "id");
        let frame = r.take(len);
        assert!(r.1 <= body, "the entry runs into the trailer");
        let h = peek(frame).unwrap();
        let n: u64 = members.iter().map(|&t| numel(man.0[t].1)).sum();
        assert_eq!((h.frame_len, h.n), (len, n), "frame length, n");
        let method = format_method(&h.params.method);
        assert_eq!(method, man.frame_method(members, *dense));
        if method.starts_with("randomk") {
            let key = (h.params.seed, h.params.step, h.params.tensor_id);
            assert_eq!(key, (man.2, step, fnv(FNV0, label.as_bytes())));
        }
        out.push((label, h.kept));
    }
    assert_eq!(r.1, body, "the entries end at the trailer");
    out
}

#[test]
fn golden_bundles_read_as_the_spec_says() {
    for (w, method) in table(BUNDLES, 9) {
        check_method(method);
        let bucketing = (int(w[3]), int(w[4]), w[5] == "bucket");
        let man = Manifest(model(w[6] == "big"), method, int(w[7]), bucketing);
        let names: Vec<&str> = man.0.iter().map(|t| t.0).collect();
        for step in int(w[1])..int(w[1]) + int(w[2]) {
            let file = format!("bundle/{}_step{step}.gwb", w[0]);
            let entries = read_bundle(&golden(&file), &man, 1, step);
            let labels: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
            match w[0] {
                "topk_per_bucket" => assert_eq!(entries[0].1, 7),
                "topk_int8_ef_fused" => assert_eq!(labels[0], "bucket[attn.b, empty, ln]"),
                _ => assert_eq!(labels, names),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checkpoint (FORMAT.md 12)

/// A checkpoint's metadata; name, shape and values of each residual, in name order; and the
/// names in `unshaped`.
type Checkpoint = (
    BTreeMap<String, String>,
    Vec<(String, Vec<u64>, Vec<f32>)>,
    Vec<String>,
);

/// Version, method, seed, step and the residuals' names and shapes.
fn summary(c: &Checkpoint) -> (&str, &str, u64, u64, Vec<Spec<'_>>) {
    let shapes = c.1.iter().map(|(n, s, _)| (n.as_str(), &s[..])).collect();
    let m = |k: &str| c.0[k].as_str();
    (
        m("version"),
        m("method"),
        int(m("seed")),
        int(m("step")),
        shapes,
    )
}

fn read_checkpoint(b: &[u8]) -> Checkpoint {
    let n = Rd(b, 0).int::<8>() as usize;
    let (header, data) = (&b[8..8 + n], &b[8 + n..]);
    let json: BTreeMap<String, Value> = serde_json::from_slice(header).unwrap();
    let mut meta = BTreeMap::new();
    for (k, v) in json["__metadata__"].as_object().unwrap() {
        meta.insert(k.clone(), v.as_str().unwrap().to_owned());
    }
    let get = |k: &str| meta.get(k).unwrap_or_else(|| panic!("no `{k}`")).as_str();
    let (version, v3) = (get("version"), get("version") == "3");
    assert!(["1", "2", "3"].contains(&version), "version");
    assert_eq!(get("format"), "gradwire-error-feedback");
    check_method(get("method"));
    for k in ["seed", "step"] {
        assert_eq!(int(get(k)).to_string(), get(k), "{k} in decimal");
    }
    assert_eq!(
        version != "1",
        meta.contains_key("crc32"),
        "crc32 from version 2"
    );
    assert_eq!(v3, meta.contains_key("unshaped"), "unshaped in version 3");
    let mut unshaped: Vec<String> = Vec::new();
    if v3 {
        unshaped = serde_json::from_str(get("unshaped")).unwrap();
        let compact = serde_json::to_string(&unshaped).unwrap();
        assert_eq!(compact, get("unshaped"), "unshaped compact");
        assert!(unshaped.windows(2).all(|w| w[0] < w[1]), "in order");
    }
    // Tensors in name order (a BTreeMap of Strings: byte-wise), their data one after the other.
    let (mut residuals, mut end, mut crc) = (Vec::new(), 0, crc32fast::Hasher::new());
    let mut tensors_json = String::new(); // the tensors' part of the header, as 12.4 says
    for (name, info) in json.iter().filter(|t| t.0 != "__metadata__") {
        eprintln!("  residual {name}");
        assert_eq!(info["dtype"], "F32");
        let shape: Vec<u64> = serde_json::from_value(info["shape"].clone()).unwrap();
        let offsets = serde_json::from_value(info["data_offsets"].clone());
        let [start, e]: [usize; 2] = offsets.unwrap();
        assert_eq!([start, e - start], [end, 4 * numel(&shape) as usize]);
        end = e;
        assert!(shape.len() == 1 || (v3 && !unshaped.contains(name)), "[n]");
        let values: Vec<f32> = (data[start..e].chunks_exact(4))
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(values.iter().all(|x| x.is_finite()), "finite");
        crc.update(name.as_bytes());
        crc.update(&[0]);
        if v3 {
            crc.update(&(shape.len() as u32).to_le_bytes());
            shape.iter().for_each(|d| crc.update(&d.to_le_bytes()));
        }
        crc.update(&data[start..e]);
        let (q, d) = (
            Value::from(&name[..]),
            serde_json::to_string(&shape).unwrap(),
        );
        let info = format!("{{\"dtype\":\"F32\",\"shape\":{d},\"data_offsets\":[{start},{e}]}}");
        tensors_json += &format!(",{q}:{info}");
        residuals.push((name.clone(), shape, values));
    }
    assert_eq!(end, data.len(), "the data ends with the last tensor");
    assert!(unshaped.iter().all(|u| json.contains_key(u)), "unshaped");
    let texts = ["method", "seed", "step", "unshaped"];
    for t in &texts[..if v3 { 4 } else { 3 }] {
        crc.update(get(t).as_bytes());
        crc.update(&[0]);
    }
    if version != "1" {
        assert_eq!(get("crc32"), crc.finalize().to_string(), "crc32 (12.3)");
    }
    if v3 {
        let q = |s: &String| Value::from(&s[..]);
        let pairs: Vec<String> = meta
            .iter()
            .map(|(k, v)| format!("{}:{}", q(k), q(v)))
            .collect();
        let mut want = format!("{{\"__metadata__\":{{{}}}{tensors_json}}}", pairs.join(","));
        while want.len() % 8 != 0 {
            want.push(' ');
        }
        assert_eq!(want.as_bytes(), header, "header bytes (12.4)");
    }
    (meta, residuals, unshaped)
}

#[test]
fn golden_checkpoints_read_as_the_spec_says() {
    let read = |file: String| read_checkpoint(&golden(&file));
    for (w, method) in table(BUNDLES, 9).filter(|(w, _)| w[8] == "ef") {
        let c = read(format!("checkpoint/{}.safetensors", w[0]));
        let step = int(w[1]) + int(w[2]);
        let want = ("3", method, int(w[7]), step, model(w[6] == "big"));
        assert_eq!((summary(&c), c.2.len()), (want, 0));
    }
    let c = read("checkpoint/unshaped_and_shaped.safetensors".to_owned());
    let shapes = vec![("a", &[4][..]), ("w", &[2, 3][..])];
    assert_eq!(
        summary(&c),
        ("3", "topk k=count:2 values=f16", 21, 2, shapes)
    );
    assert_eq!(c.1[0].2, [0.5, 0.0, 0.0, 0.0]);
    assert_eq!(c.1[1].2, [3.0, -0.25, 2.0, 0.0, 0.0, 1.5]);
    assert_eq!(c.2, ["a"]);
    for step in [0, 1] {
        let c = read(format!(
            "container/topk_int8_ef_step{step}.state.safetensors"
        ));
        let method = "topk k=ratio:0.05 values=int8:256";
        assert_eq!(summary(&c), ("3", method, 5, step + 1, model(false)));
    }
    // A version 2 file (12.5), written before the metadata was sorted.
    let v2 = std::fs::read(testdata().join("checkpoint_v2/state.safetensors"));
    let c = read_checkpoint(&v2.unwrap());
    let shapes = vec![("b", &[3][..]), ("w", &[6][..])];
    assert_eq!(
        summary(&c),
        ("2", "topk k=count:1 values=f32", 5, 1, shapes)
    );
}

// ---------------------------------------------------------------------------------------------
// Container (FORMAT.md 13)

/// Reads a container's prefix and manifest section: method text, seed, tensors, bundle offset.
fn read_container(b: &[u8]) -> (String, u64, Vec<(String, Vec<u64>)>, usize) {
    assert!(b.len() >= 16, "too short");
    let mut r = Rd(b, 0);
    assert_eq!(r.take(4), b"GWCT", "magic");
    assert_eq!([r.int::<1>(), r.int::<3>()], [1, 0], "version, reserved");
    let m = r.int::<4>() as usize;
    assert!(12 + m + 4 <= b.len(), "the section runs past the end");
    let crc = crc32fast::hash(&b[..12 + m]).to_le_bytes();
    assert_eq!(b[12 + m..16 + m], crc, "CRC");
    let mut s = Rd(&b[12..12 + m], 0);
    let text = |s: &mut Rd, n| String::from_utf8(s.take(n as usize).to_vec()).unwrap();
    let len = s.int::<2>();
    let (method, seed, count) = (text(&mut s, len), s.int::<8>(), s.int::<4>());
    assert!(count as usize <= m / 3, "tensor count");
    let mut tensors = Vec::new();
    for _ in 0..count {
        let len = s.int::<2>();
        let name = text(&mut s, len);
        let rank = s.int::<1>();
        tensors.push((name, (0..rank).map(|_| s.int::<8>()).collect()));
    }
    assert_eq!(s.1, m, "the section ends at 12 + M");
    assert!(tensors.windows(2).all(|w| w[0].0 < w[1].0), "sorted");
    (method, seed, tensors, 16 + m)
}

#[test]
fn golden_containers_read_as_the_spec_says() {
    for (w, want) in table(CONTAINERS, 3) {
        let file = format!("container/{}.gwct", w[0]);
        let b = golden(&file);
        let (method, seed, tensors, at) = read_container(&b);
        assert_eq!((method.as_str(), seed), (want, int(w[1])));
        check_method(&method);
        let specs: Vec<Spec> = tensors.iter().map(|(n, d)| (&n[..], &d[..])).collect();
        assert_eq!(specs, model(false));
        let man = Manifest(specs, &method, seed, (0, 0, false));
        assert_eq!(read_bundle(&b[at..], &man, 0, int(w[2])).len(), 5);
        // What `gradwire decompress` made of it: the model's tensors, dense f32, no metadata.
        let out = format!("container/{}.dense.safetensors", w[0]);
        let dense = golden(&out);
        let st = safetensors::SafeTensors::deserialize(&dense).unwrap();
        let mut got: Vec<(String, Vec<u64>)> = Vec::new();
        for (name, t) in st.tensors() {
            assert_eq!(t.dtype(), Dtype::F32);
            got.push((name, t.shape().iter().map(|&d| d as u64).collect()));
        }
        got.sort();
        assert_eq!(got, tensors);
        let meta = safetensors::SafeTensors::read_metadata(&dense).unwrap().1;
        assert!(meta.metadata().is_none(), "no metadata");
    }
}

// ---------------------------------------------------------------------------------------------
// The golden files and FORMAT.md's worked examples

#[test]
fn golden_files_are_the_ones_read_here() {
    let (mut on_disk, mut h) = (BTreeSet::new(), FNV0);
    for kind in ["bundle", "checkpoint", "container"] {
        for e in std::fs::read_dir(testdata().join("golden").join(kind)).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            on_disk.insert(format!("{kind}/{name}"));
        }
    }
    assert_eq!(on_disk, golden_files(), "the golden files on disk");
    for name in &on_disk {
        let b = golden(name);
        let len = (b.len() as u64).to_le_bytes();
        for part in [name.as_bytes(), &[0], &len, &b] {
            h = fnv(h, part);
        }
    }
    let msg = "a golden file changed: a format change needs a version bump and FORMAT.md";
    assert_eq!(h, DIGEST, "{msg}, then DIGEST = {h:#x}");
}

/// The code blocks of FORMAT.md after the first occurrence of `marker`.
fn blocks_after<'a>(doc: &'a str, marker: &str) -> Vec<&'a str> {
    let at = doc.find(marker).expect(marker);
    let parts = doc[at..].split("```").skip(1).step_by(2);
    parts.map(|b| b.split_once('\n').unwrap().1).collect()
}

/// The bytes of a hex block: on each line, the hex before the first three spaces.
fn hex(block: &str) -> Vec<u8> {
    let lines = block.lines().map(|l| l.split("   ").next().unwrap());
    let words = lines.flat_map(str::split_whitespace);
    words.map(|h| u8::from_str_radix(h, 16).expect(h)).collect()
}

#[test]
fn format_md_worked_examples_are_the_golden_files() {
    let doc = std::fs::read_to_string(testdata().join("../FORMAT.md")).unwrap();
    let example = |f: &str| blocks_after(&doc, &format!("Worked example: `testdata/golden/{f}`"));
    let file = "bundle/topk_per_bucket_step0.gwb";
    assert_eq!(hex(example(file)[0]), golden(file), "10.6 is out of date");
    let file = "checkpoint/unshaped_and_shaped.safetensors";
    let b = example(file);
    let mut bytes = hex(b[0]);
    bytes.extend(b[1].lines().flat_map(|l| l.trim_start().bytes()));
    bytes.extend(hex(b[2]));
    assert_eq!(bytes, golden(file), "12.6 is out of date");
    let (file, n) = ("container/topk_int8.gwct", 16 + 132 + 24 + 12);
    let bytes = hex(example(file)[0]);
    assert_eq!(bytes, golden(file)[..n], "13.1 is out of date");
    // Every example of the method table (11) is a valid method text in canonical form.
    let table = &doc[doc.find("## 11. Method text").unwrap()..doc.find("## 12.").unwrap()];
    let rows = table
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| method"));
    let cells = rows.map(|r| r.split('|').nth(3).unwrap());
    let examples: Vec<&str> = cells
        .flat_map(|c| c.split('`').skip(1).step_by(2))
        .collect();
    examples.iter().for_each(|t| check_method(t));
    assert_eq!(examples.len(), 7, "the examples of 11");
}

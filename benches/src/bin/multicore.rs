//! Serial vs parallel: `GradientCompressor::compress_bundle` and aggregation of W = 8 bundles
//! (`Aggregator` on one thread vs on rayon's pool), on a model of one large
//! tensor plus 50 small ones (2.5e7 elements in all) and on the real MiniLM gradients, for top-k
//! 1% int8, sign, 4-bit, threshold (|g| > 0.01) and random-k 1% (f32 values), each with error
//! feedback, and QSGD (4-bit stochastic rounding, no error feedback). Serial and parallel runs alternate (which
//! one goes first alternates too) and every parallel result is checked against the serial one
//! (bundles byte for byte, aggregates bit for bit). Medians of the repetitions.
//!
//! `cargo run --release -p gradwire-benches --bin multicore -- [--reps R] [--n N]
//! [--only large|minilm] [--method top-k|sign|4-bit|QSGD|threshold|random-k] [--ranks W] [--gate X]` (defaults: 11
//! repetitions, N = 2.5e7, W = 8, X = 1.8).
//!
//! Other work on a shared machine takes cores away for a while, so the bench measures what
//! two threads give over one at that moment: the "2-thread capacity", two units of a
//! compute-bound loop on one thread over one unit on each of two (2.00x on two idle cores).
//! A repetition counts only when the capacity is at least X just before and just after it
//! (`--gate 0` keeps every repetition); the table gives the medians of the kept repetitions,
//! how many were kept out of how many run, the speed-up of the medians over all repetitions,
//! and that of the fastest serial and fastest parallel run (other work only ever adds time).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use gradwire::BucketConfig;
use gradwire::Manifest;
use gradwire::Parallelism;
use gradwire::core::{K, Method, Rounding, Values};
use gradwire::tensor::Tensor;
use gradwire::{Aggregator, Reduction};
use gradwire::{CompressionMethod, GradientCompressor};
use gradwire_benches::{build_name, heavy_tailed, repo_root};
use safetensors::SafeTensors;

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// One tensor of `n - 50 * 20_000` elements and 50 tensors of 20 000.
fn large_model(n: usize) -> HashMap<String, Tensor> {
    let small = 20_000usize;
    let big = n.saturating_sub(50 * small).max(1);
    let mut out = HashMap::new();
    out.insert(
        "big.weight".to_owned(),
        Tensor::vector(heavy_tailed(big, 1)),
    );
    for t in 0..50u64 {
        out.insert(
            format!("small.{t:02}"),
            Tensor::vector(heavy_tailed(small, 100 + t)),
        );
    }
    out
}

/// The 12 MiniLM gradient tensors, by name.
fn minilm_model() -> Result<HashMap<String, Tensor>, String> {
    let path = repo_root().join("testdata/minilm_small_grads.safetensors");
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut out = HashMap::new();
    for (name, view) in st.iter() {
        let data: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let t = Tensor::new(view.shape().to_vec(), data).map_err(|e| e.to_string())?;
        out.insert(name.to_owned(), t);
    }
    Ok(out)
}

/// Rank `r`'s gradients: every tensor rotated by a rank-dependent offset and scaled, so that
/// ranks keep different indices.
fn rank_grads(base: &HashMap<String, Tensor>, r: usize) -> HashMap<String, Tensor> {
    let f = 1.0 + 0.05 * r as f32;
    base.iter()
        .map(|(name, t)| {
            let mut data = t.data().to_vec();
            if !data.is_empty() {
                let len = data.len();
                data.rotate_left((r * 7919) % len);
            }
            for x in &mut data {
                *x *= f;
            }
            (name.clone(), Tensor::new(t.shape().to_vec(), data).unwrap())
        })
        .collect()
}

/// A compute-bound unit of work: a dependent xorshift chain of `steps` steps.
fn compute_unit(steps: u32) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..steps {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    x
}

/// A memory-bound unit of work: sums a buffer far larger than the caches.
fn memory_unit(buf: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for c in buf.chunks_exact(8) {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum()
}

/// What two threads give on this machine right now: the time of two units of work on one
/// thread over the time of one unit on each of two threads (2.0 on two idle cores). Returns
/// (compute-bound, memory-bound) medians.
fn calibrate(reps: usize) -> (f64, f64) {
    let bufs: Vec<Vec<f32>> = (0..2).map(|i| vec![i as f32; 25_000_000]).collect();
    let (mut c, mut m) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        c.push(capacity(50_000_000));
        let t = Instant::now();
        black_box(memory_unit(&bufs[0]));
        black_box(memory_unit(&bufs[1]));
        let one = t.elapsed().as_secs_f64();
        let t = Instant::now();
        std::thread::scope(|s| {
            let h = s.spawn(|| memory_unit(&bufs[0]));
            black_box(memory_unit(&bufs[1]));
            black_box(h.join().unwrap());
        });
        m.push(one / t.elapsed().as_secs_f64());
    }
    (median(&c), median(&m))
}

/// Two units of compute-bound work on one thread over one unit on each of two threads: 2.0
/// when two cores are free for this process, 1.0 when only one is.
fn capacity(steps: u32) -> f64 {
    let t = Instant::now();
    black_box(compute_unit(steps));
    black_box(compute_unit(steps));
    let one = t.elapsed().as_secs_f64();
    let t = Instant::now();
    std::thread::scope(|s| {
        let h = s.spawn(|| compute_unit(steps));
        black_box(compute_unit(steps));
        black_box(h.join().unwrap());
    });
    one / t.elapsed().as_secs_f64()
}

struct Row {
    model: String,
    method: &'static str,
    op: &'static str,
    stats: Stats,
}

/// Medians of the repetitions that ran while two cores were free, and of all repetitions.
struct Stats {
    serial: f64,
    parallel: f64,
    kept: usize,
    all_serial: f64,
    all_parallel: f64,
    tried: usize,
    /// Fastest serial and parallel run over all repetitions.
    best_serial: f64,
    best_parallel: f64,
}

/// Elements of the xorshift chain of one capacity probe (a few milliseconds).
const PROBE: u32 = 4_000_000;

/// Runs `rep(serial_first)` (one serial and one parallel run in that order, checked against
/// each other; their times) until `reps` repetitions ran with a [`capacity`] of at least `gate`
/// just before and just after them (at most `20 * reps` tries; `gate <= 0` keeps every one).
fn measure(reps: usize, gate: f64, mut rep: impl FnMut(bool) -> (f64, f64)) -> Stats {
    let (mut ks, mut kp, mut all_s, mut all_p) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut tried = 0usize;
    while ks.len() < reps && tried < 20 * reps {
        let before = if gate > 0.0 { capacity(PROBE) } else { 2.0 };
        let (s, p) = rep(tried.is_multiple_of(2));
        let after = if gate > 0.0 { capacity(PROBE) } else { 2.0 };
        all_s.push(s);
        all_p.push(p);
        if before.min(after) >= gate {
            ks.push(s);
            kp.push(p);
        }
        tried += 1;
    }
    let med = |v: &[f64]| if v.is_empty() { f64::NAN } else { median(v) };
    let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    Stats {
        serial: med(&ks),
        parallel: med(&kp),
        kept: ks.len(),
        all_serial: med(&all_s),
        all_parallel: med(&all_p),
        tried,
        best_serial: best(&all_s),
        best_parallel: best(&all_p),
    }
}

/// `(time of a, time of b)`, running `a` first when `a_first`.
fn pair(a_first: bool, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    if a_first {
        let ta = time(&mut a);
        (ta, time(&mut b))
    } else {
        let tb = time(&mut b);
        (time(&mut a), tb)
    }
}

fn bench_model(
    model: &str,
    base: &HashMap<String, Tensor>,
    ranks: usize,
    reps: usize,
    gate: f64,
    method_filter: Option<&str>,
    rows: &mut Vec<Row>,
) {
    let methods: [(&'static str, CompressionMethod); 6] = [
        (
            "top-k 1% int8 + EF",
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        ),
        (
            "sign + EF",
            CompressionMethod::SignSGD.with_error_feedback(),
        ),
        (
            "4-bit + EF",
            CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
        ),
        (
            "QSGD 4-bit stochastic",
            CompressionMethod::Core(Method::Quant {
                bits: 4,
                block: 512,
                rounding: Rounding::Stochastic,
            }),
        ),
        (
            "threshold + EF",
            CompressionMethod::Threshold { threshold: 0.01 }.with_error_feedback(),
        ),
        (
            "random-k 1% + EF",
            CompressionMethod::Core(Method::RandomK {
                k: K::Ratio(0.01),
                values: Values::F32,
                unbiased: false,
            })
            .with_error_feedback(),
        ),
    ];
    for (label, method) in methods {
        if method_filter.is_some_and(|m| !label.starts_with(m)) {
            continue;
        }
        let manifest = Manifest::for_gradients(base, &method, 0, BucketConfig::none()).unwrap();
        // compress_bundle: two compressors in lockstep, so that their bundles must match.
        let mut cs = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial);
        let mut cp =
            GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Parallel);
        let (mut bs, mut bp) = (Vec::new(), Vec::new());
        cs.compress_bundle(&manifest, base, 0, &mut bs).unwrap();
        cp.compress_bundle(&manifest, base, 0, &mut bp).unwrap();
        let stats = measure(reps, gate, |serial_first| {
            let t = pair(
                serial_first,
                || {
                    cs.compress_bundle(&manifest, base, 0, &mut bs).unwrap();
                },
                || {
                    cp.compress_bundle(&manifest, base, 0, &mut bp).unwrap();
                },
            );
            assert!(bs == bp, "{model} {label}: parallel bundle differs");
            t
        });
        rows.push(Row {
            model: model.to_owned(),
            method: label,
            op: "compress_bundle",
            stats,
        });
        drop((cs, cp, bs, bp));

        // Aggregation of `ranks` bundles, made one rank at a time.
        let bundles: Vec<Vec<u8>> = (0..ranks)
            .map(|r| {
                let grads = rank_grads(base, r);
                let mut c = GradientCompressor::new(method.clone());
                let mut b = Vec::new();
                c.compress_bundle(&manifest, &grads, r, &mut b).unwrap();
                b
            })
            .collect();
        let mut agg = Aggregator::new().with_parallelism(Parallelism::Parallel);
        let mut serial = Aggregator::serial();
        let (mut fs, mut fp) = (Vec::new(), Vec::new());
        serial
            .aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut fs)
            .unwrap();
        agg.aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut fp)
            .unwrap();
        let stats = measure(reps, gate, |serial_first| {
            let t = pair(
                serial_first,
                || {
                    serial
                        .aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut fs)
                        .unwrap()
                },
                || {
                    agg.aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut fp)
                        .unwrap();
                },
            );
            assert!(
                fs.len() == fp.len() && fs.iter().zip(&fp).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{model} {label}: parallel aggregate differs"
            );
            t
        });
        black_box(&fp);
        rows.push(Row {
            model: model.to_owned(),
            method: label,
            op: "aggregate (W bundles)",
            stats,
        });
    }
}

fn main() {
    let mut reps = 11usize;
    let mut n = 25_000_000usize;
    let mut ranks = 8usize;
    let mut only: Option<String> = None;
    let mut method: Option<String> = None;
    let mut gate = 1.8f64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--reps" => reps = value().parse().expect("--reps R"),
            "--n" => n = value().parse().expect("--n N"),
            "--ranks" => ranks = value().parse().expect("--ranks W"),
            "--only" => only = Some(value()),
            "--method" => method = Some(value()),
            "--gate" => gate = value().parse().expect("--gate X"),
            other => panic!("unknown argument {other}"),
        }
    }
    let threads = Parallelism::Auto.threads();
    println!(
        "# multicore: serial vs parallel, {threads} rayon threads, build {}, {reps} repetitions kept \
         (2-thread capacity >= {gate} before and after each), W = {ranks}",
        build_name()
    );
    let (cal_c, cal_m) = calibrate(reps.min(7));
    println!(
        "# two threads vs one right now (ideal 2.00x): compute-bound {cal_c:.2}x, memory-bound {cal_m:.2}x"
    );
    let mut rows = Vec::new();
    if only.as_deref().is_none_or(|o| o == "large") {
        let base = large_model(n);
        let name = format!("1 x {} + 50 x 20000", n.saturating_sub(1_000_000));
        bench_model(
            &name,
            &base,
            ranks,
            reps,
            gate,
            method.as_deref(),
            &mut rows,
        );
    }
    if only.as_deref().is_none_or(|o| o == "minilm") {
        match minilm_model() {
            Ok(base) => bench_model(
                "MiniLM (789 504)",
                &base,
                ranks,
                reps,
                gate,
                method.as_deref(),
                &mut rows,
            ),
            Err(e) => eprintln!("MiniLM skipped: {e}"),
        }
    }
    println!(
        "| model | method | operation | serial ms | parallel ms | speed-up | reps kept / run | speed-up, all reps | speed-up, fastest runs |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let st = &r.stats;
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2}x | {} / {} | {:.2}x | {:.2}x |",
            r.model,
            r.method,
            r.op,
            st.serial * 1e3,
            st.parallel * 1e3,
            st.serial / st.parallel,
            st.kept,
            st.tried,
            st.all_serial / st.all_parallel,
            st.best_serial / st.best_parallel
        );
    }
    let (cal_c, cal_m) = calibrate(reps.min(7));
    println!(
        "# two threads vs one after the runs (ideal 2.00x): compute-bound {cal_c:.2}x, memory-bound {cal_m:.2}x"
    );
}

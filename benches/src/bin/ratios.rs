//! The ratio report: every kernel's median time over the read pass's (the faster of the plain
//! sum of |g| and the same sum with a software prefetch), and over its baseline's, measured in
//! one process with the runs interleaved (repetition r runs every kernel once before repetition
//! r + 1 starts, beginning at kernel r so that no kernel always follows the same one), on a heavy-tailed buffer from a fixed seed and on the real MiniLM gradients.
//!
//! `cargo run --release -p gradwire-benches --bin ratios -- [--n N] [--reps R] [--json]
//! [--only NAME,NAME,..] [--clock cpu|wall] [--data both|synthetic|minilm] [--list]`
//! (defaults: N = 2.5e7, 11 repetitions, at least 9 are run; both buffers; CPU clock).
//! `--only` keeps the two read passes and the named rows with their baselines; a name matches every
//! row that starts with it, and a name that matches none is an error that lists the rows
//! (`--list` lists them). `--clock cpu` times each run by the thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`) rather than the wall clock, so that time the thread spends
//! preempted by other jobs on a shared machine does not count (their memory traffic still
//! does). `--data` picks the buffers. The targets are defined at N = 2.5e7, past every cache;
//! at a smaller N the read pass runs from cache and the "met / MISSED" column means little.

use gradwire_benches::{
    Codec, add_pass, add_pass_prefetch, build_name, byte_pass, byte_pass_prefetch, ef_method,
    heavy_tailed, int8_plain, methods, minilm, read_pass, read_pass_prefetch, read_pass2,
    read_pass2_prefetch, scatter_add_prefetch, sign_bitvec, topk_select_nth,
};
use gradwire_core::scalar::{self, Selection};
use gradwire_core::{Method, ResidualBound, Values, k_from_ratio, values};
use std::cell::RefCell;
use std::hint::black_box;
use std::rc::Rc;
use std::time::Instant;

struct Task<'a> {
    name: String,
    baseline: Option<&'static str>,
    run: Box<dyn FnMut() + 'a>,
    times: Vec<f64>,
}

fn task<'a>(name: &str, baseline: Option<&'static str>, run: impl FnMut() + 'a) -> Task<'a> {
    Task {
        name: name.to_string(),
        baseline,
        run: Box::new(run),
        times: Vec::new(),
    }
}

/// The read passes; every ratio is over the faster one's median.
const READS: [&str; 2] = ["read", "read_prefetch"];

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// The performance targets (docs/perf-log.md, "Targets"): (name, default, native).
const TARGETS: &[(&str, f64, f64)] = &[
    ("topk_1pct", 2.5, 2.0),
    ("topk_0.1pct", 2.0, 1.6),
    ("threshold", 1.5, 1.5),
    ("sign", 1.1, 1.1),
    ("kernel_sign", 1.1, 1.1),
    ("quant_int8", 1.5, 1.5),
    ("kernel_quant_int8", 1.5, 1.5),
    ("kernel_threshold", 1.5, 1.5),
    ("accumulate_topk_1pct", 0.4, 0.4),
    ("ef_step", 4.0, 4.0),
];

fn main() {
    let mut n = 25_000_000usize;
    let mut reps = 11usize;
    let mut json = false;
    let mut only: Vec<String> = Vec::new();
    let mut cpu = true;
    let mut list = false;
    let mut data = String::from("both");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--n" => {
                n = args
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .expect("--n N") as usize
            }
            "--reps" => reps = args.next().and_then(|v| v.parse().ok()).expect("--reps R"),
            "--json" => json = true,
            "--list" => list = true,
            "--only" => {
                only = args
                    .next()
                    .expect("--only NAME,NAME,..")
                    .split(',')
                    .map(str::to_string)
                    .collect()
            }
            "--data" => data = args.next().expect("--data both|synthetic|minilm"),
            "--clock" => {
                cpu = match args.next().as_deref() {
                    Some("cpu") => true,
                    Some("wall") => false,
                    _ => {
                        eprintln!("--clock cpu|wall");
                        std::process::exit(2);
                    }
                }
            }
            _ => {
                let usage = "usage: ratios [--n N] [--reps R] [--json] [--only NAME,NAME,..] \
                     [--clock cpu|wall] [--data both|synthetic|minilm] [--list]\n\
                     defaults: --n 2.5e7 --reps 11 (at least 9) --clock cpu --data both; \
                     --list prints the row names, --only keeps the rows starting with a name";
                // Asked for, the usage is the output (stdout, as `wire --help`); otherwise an error.
                if a == "--help" || a == "-h" {
                    println!("{usage}");
                    std::process::exit(0);
                }
                eprintln!("{usage}");
                std::process::exit(2);
            }
        }
    }
    if reps < 9 {
        eprintln!("--reps {reps}: running 9, the fewest whose median this report trusts");
    }
    let reps = reps.max(9);
    let clock = if cpu { Clock::Cpu } else { Clock::Wall };
    if list {
        // The rows of a run on a small buffer (the row names do not depend on n).
        run("list", &heavy_tailed(4096, 42), 0, json, &only, clock);
        return;
    }
    if data != "minilm" {
        let synthetic = heavy_tailed(n, 42);
        run("heavy_tailed", &synthetic, reps, json, &only, clock);
    }
    if data != "synthetic" {
        match minilm() {
            Ok(real) => run("minilm", &real, reps, json, &only, clock),
            Err(e) => eprintln!("minilm gradients skipped: {e}"),
        }
    }
}

/// What a run's time is measured by.
#[derive(Clone, Copy, PartialEq)]
enum Clock {
    /// Elapsed time (`Instant`).
    Wall,
    /// CPU time of this thread.
    Cpu,
}

impl Clock {
    fn now(self) -> f64 {
        match self {
            Clock::Wall => {
                static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
                START.get_or_init(Instant::now).elapsed().as_secs_f64()
            }
            Clock::Cpu => {
                let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
                t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            Clock::Wall => "wall",
            Clock::Cpu => "cpu",
        }
    }
}

fn run(data: &str, x: &[f32], reps: usize, json: bool, only: &[String], clock: Clock) {
    let n = x.len();
    let out = Rc::new(RefCell::new(vec![0.0f32; n]));
    let acc = Rc::new(RefCell::new(vec![0.0f32; n]));
    let mut tasks: Vec<Task<'_>> = Vec::new();
    tasks.push(task("read", None, move || {
        black_box(read_pass(black_box(x)));
    }));
    // The same sum with a software prefetch 8 KiB ahead: faster on machines whose hardware
    // prefetcher keeps too few lines in flight for one core (docs/perf-log.md, round 10), slower on
    // others; the denominator is the faster of the two.
    tasks.push(task("read_prefetch", None, move || {
        black_box(read_pass_prefetch(black_box(x)));
    }));

    for (name, method) in methods(x) {
        let codec = Rc::new(RefCell::new(Codec::new(method, n)));
        codec.borrow_mut().encode(x);
        let baseline = match name {
            "topk_1pct" | "topk_0.1pct" => Some("topk_select_nth"),
            "sign" => Some("sign_bitvec"),
            "quant_int8" => Some("int8_plain"),
            _ => Some("scalar_spec"),
        };
        let c = Rc::clone(&codec);
        tasks.push(task(name, baseline, move || {
            black_box(c.borrow_mut().encode(black_box(x)));
        }));
        let c = Rc::clone(&codec);
        let o = Rc::clone(&out);
        tasks.push(task(&format!("decode_{name}"), None, move || {
            c.borrow().decode(&mut o.borrow_mut());
        }));
        let c = Rc::clone(&codec);
        let a = Rc::clone(&acc);
        let base = if name == "topk_1pct" {
            Some("scatter_add_plain")
        } else {
            None
        };
        tasks.push(task(&format!("accumulate_{name}"), base, move || {
            c.borrow().accumulate(&mut a.borrow_mut());
        }));
        let c2 = Rc::clone(&codec);
        tasks.push(task(&format!("validate_{name}"), None, move || {
            c2.borrow().validate(n);
        }));
        // Baselines.
        match name {
            "topk_1pct" | "topk_0.1pct" => {
                let k = if name == "topk_1pct" {
                    k_from_ratio(n as u64, 0.01)
                } else {
                    k_from_ratio(n as u64, 0.001)
                } as usize;
                let mut work = Vec::with_capacity(n);
                tasks.push(task(&format!("{name}:topk_select_nth"), None, move || {
                    black_box(topk_select_nth(black_box(x), k, &mut work));
                }));
                if name == "topk_1pct" {
                    let mut idx = Vec::new();
                    let mut hist = vec![0u32; scalar::TOPK_HIST];
                    let cut = scalar::topk_cut(x, k, &mut hist);
                    scalar::for_each_kept(x, Selection::TopK(cut), |i| idx.push(i));
                    let vals: Vec<f32> = idx.iter().map(|&i| x[i]).collect();
                    let a = Rc::clone(&acc);
                    let (idx2, vals2, a2) = (idx.clone(), vals.clone(), Rc::clone(&a));
                    tasks.push(task(
                        "accumulate_topk_1pct:scatter_add_plain",
                        None,
                        move || {
                            let mut a = a.borrow_mut();
                            for (&i, &v) in idx.iter().zip(&vals) {
                                a[i] += v;
                            }
                        },
                    ));
                    tasks.push(task("floor_scatter_prefetch", None, move || {
                        scatter_add_prefetch(&mut a2.borrow_mut(), &idx2, &vals2);
                    }));
                }
            }
            "threshold" => {
                let Method::Threshold { threshold, .. } = method else {
                    unreachable!()
                };
                let mut idx = Vec::with_capacity(n / 50);
                let mut vals = Vec::with_capacity(n / 50);
                tasks.push(task(&format!("{name}:scalar_spec"), None, move || {
                    idx.clear();
                    vals.clear();
                    scalar::for_each_kept(x, Selection::Threshold(threshold), |i| {
                        idx.push(i as u32);
                        vals.push(x[i]);
                    });
                    black_box((&idx, &vals));
                }));
            }
            "randomk_1pct" => {
                let k = k_from_ratio(n as u64, 0.01);
                let mut vals = Vec::with_capacity(k as usize);
                tasks.push(task(&format!("{name}:scalar_spec"), None, move || {
                    vals.clear();
                    let key = gradwire_core::rng::key(7, 1, 3);
                    scalar::randomk_for_each(n as u64, k, key, |i| vals.push(x[i as usize]));
                    black_box(&vals);
                }));
            }
            "sign" => {
                let mut bv = bitvec::vec::BitVec::with_capacity(n);
                tasks.push(task("sign:sign_bitvec", None, move || {
                    sign_bitvec(black_box(x), &mut bv);
                    black_box(&bv);
                }));
                let mut scales = vec![0u8; n.div_ceil(1024) * 4];
                let mut signs = vec![0u8; n.div_ceil(8)];
                tasks.push(task("sign:scalar_spec", None, move || {
                    scalar::sign_encode(black_box(x), Some(1024), &mut scales, &mut signs);
                    black_box(&signs);
                }));
            }
            "quant_int8" | "quant_4bit" => {
                let bits = if name == "quant_int8" { 8 } else { 4 };
                if bits == 8 {
                    let mut scales = vec![0f32; n.div_ceil(512)];
                    let mut codes = vec![0i8; n];
                    tasks.push(task("quant_int8:int8_plain", None, move || {
                        int8_plain(black_box(x), 512, &mut scales, &mut codes);
                        black_box(&codes);
                    }));
                }
                let mut scales = vec![0u8; n.div_ceil(512) * 4];
                let mut codes = vec![0u8; (n * bits as usize).div_ceil(8)];
                tasks.push(task(&format!("{name}:scalar_spec"), None, move || {
                    scalar::quant_encode(black_box(x), bits, 512, None, &mut scales, &mut codes);
                    black_box(&codes);
                }));
            }
            "f16_cast" | "bf16_cast" => {
                let v = if name == "f16_cast" {
                    Values::F16
                } else {
                    Values::Bf16
                };
                let mut bytes = vec![0u8; 2 * n];
                tasks.push(task(&format!("{name}:scalar_spec"), None, move || {
                    for (j, &a) in black_box(x).iter().enumerate() {
                        values::write_plain(v, a, &mut bytes[2 * j..]);
                    }
                    black_box(&bytes);
                }));
            }
            _ => {}
        }
    }

    // The kernels alone (no input check, no frame, no checksum): what the encoders spend on
    // top of the check pass that the "nothing written on error" rule puts before them.
    let mut scales = vec![0u8; n.div_ceil(1024) * 4];
    let mut signs = vec![0u8; n.div_ceil(8)];
    tasks.push(task("kernel_sign", Some("sign_bitvec"), move || {
        gradwire_core::sign::encode(black_box(x), Some(1024), &mut scales, &mut signs);
        black_box(&signs);
    }));
    let mut bv = bitvec::vec::BitVec::with_capacity(n);
    tasks.push(task("kernel_sign:sign_bitvec", None, move || {
        sign_bitvec(black_box(x), &mut bv);
        black_box(&bv);
    }));
    let mut qs = vec![0u8; n.div_ceil(512) * 4];
    let mut qc = vec![0u8; n];
    tasks.push(task("kernel_quant_int8", Some("int8_plain"), move || {
        gradwire_core::quant::encode(black_box(x), 8, 512, None, &mut qs, &mut qc);
        black_box(&qc);
    }));
    let mut ps = vec![0f32; n.div_ceil(512)];
    let mut pc = vec![0i8; n];
    tasks.push(task("kernel_quant_int8:int8_plain", None, move || {
        int8_plain(black_box(x), 512, &mut ps, &mut pc);
        black_box(&pc);
    }));
    let t1 = gradwire_benches::threshold_for_one_percent(x);
    let mut ts = vec![0u32; gradwire_core::select::threshold_scratch_len(n)];
    tasks.push(task("kernel_threshold", None, move || {
        let k = gradwire_core::select::threshold_kept(black_box(x), t1, f32::INFINITY, &mut ts);
        black_box(k.map(|k| k.map(|k| k.idx.len())).ok());
    }));
    let mut check = 0usize;
    tasks.push(task("check_pass", None, move || {
        check += usize::from(values::first_non_finite(black_box(x)).is_some());
        black_box(check);
    }));

    // Floors: the memory traffic the targets cannot avoid, without the arithmetic.
    let mut bytes = vec![0u8; n];
    tasks.push(task("floor_byte_pass", None, move || {
        byte_pass(black_box(x), &mut bytes);
        black_box(&bytes);
    }));
    let frame_bytes: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(37)).collect();
    tasks.push(task("floor_crc_n_bytes", None, move || {
        black_box(crc32fast::hash(black_box(&frame_bytes)));
    }));
    // The same n bytes' CRC-32 from the L1 cache, 1 KiB at a time: what the int8 and sign
    // kernels pay, since they fold each run of codes into the checksum right after writing it
    // (quantization in runs of at least 1 KiB, sign in runs of four blocks' bits).
    // `floor_crc_n_bytes` reads its bytes from memory, so it counts the traffic of a byte pass
    // a second time.
    let run: Vec<u8> = (0..1024usize).map(|i| (i as u8).wrapping_mul(37)).collect();
    tasks.push(task("floor_crc_n_bytes_l1", None, move || {
        let mut h = crc32fast::Hasher::new();
        let mut left = n;
        while left > 0 {
            let m = left.min(run.len());
            h.update(black_box(&run[..m]));
            left -= m;
        }
        black_box(h.finalize());
    }));
    // Every floor twice, plain and with a software prefetch (`_prefetch`): like the read pass,
    // a floor is the faster of the two on the machine at hand (docs/perf-log.md, round 10).
    let mut bytes = vec![0u8; n];
    tasks.push(task("floor_byte_pass_prefetch", None, move || {
        byte_pass_prefetch(black_box(x), &mut bytes);
        black_box(&bytes);
    }));
    for prefetch in [false, true] {
        let suffix = if prefetch { "_prefetch" } else { "" };
        let read2: fn(&[f32], &[f32]) -> f32 = if prefetch {
            read_pass2_prefetch
        } else {
            read_pass2
        };
        let add: fn(&mut [f32], &[f32]) = if prefetch {
            add_pass_prefetch
        } else {
            add_pass
        };
        let mut r3 = vec![0.0f32; n];
        tasks.push(task(&format!("floor_ef{suffix}"), None, move || {
            black_box(read2(black_box(x), &r3));
            add(&mut r3, black_box(x));
            black_box(&r3);
        }));
        // floor_ef's two passes alone: the selection scan over `g + r` runs above the first,
        // the update pass at the second (docs/perf-log.md, round 9). Filled with ones, so that
        // every page is mapped before the first read.
        let r4 = Rc::new(RefCell::new(vec![1.0f32; n]));
        let r4_read = Rc::clone(&r4);
        tasks.push(task(&format!("floor_read2{suffix}"), None, move || {
            black_box(read2(black_box(x), &r4_read.borrow()));
        }));
        tasks.push(task(&format!("floor_add{suffix}"), None, move || {
            add(&mut r4.borrow_mut(), black_box(x));
            black_box(&r4);
        }));
    }

    // The whole error-feedback step, and a naive one (r += g, select_nth top-k, r -= kept).
    // The step as `ErrorFeedback` runs it (with the residual's bound: one pass after the
    // gradient's check), and the two-pass `feedback_step` without one.
    let mut ef = Codec::new(ef_method(), n);
    let mut residual = vec![0.0f32; n];
    let mut bound = ResidualBound::ZERO;
    tasks.push(task("ef_step", Some("ef_naive"), move || {
        black_box(ef.feedback_bounded(black_box(x), &mut residual, &mut bound));
    }));
    let mut ef2 = Codec::new(ef_method(), n);
    let mut residual2 = vec![0.0f32; n];
    tasks.push(task("ef_step_two_pass", None, move || {
        black_box(ef2.feedback(black_box(x), &mut residual2));
    }));
    let k = k_from_ratio(n as u64, 0.01) as usize;
    let mut r2 = vec![0.0f32; n];
    let mut work = Vec::with_capacity(n);
    let mut sent = Vec::with_capacity(k);
    tasks.push(task("ef_step:ef_naive", None, move || {
        for (r, &g) in r2.iter_mut().zip(x) {
            *r += g;
        }
        topk_select_nth(&r2, k, &mut work);
        sent.clear();
        for &i in &work {
            sent.push((i, r2[i as usize]));
            r2[i as usize] = 0.0;
        }
        black_box(&sent);
    }));

    // `--list` runs with no repetitions: print the rows and stop. An `--only` name that matches
    // no row prints them too, as an error.
    let unknown: Vec<&String> = only
        .iter()
        .filter(|o| !tasks.iter().any(|t| t.name.starts_with(o.as_str())))
        .collect();
    if reps == 0 || !unknown.is_empty() {
        if !unknown.is_empty() {
            eprintln!("--only: no row starts with {unknown:?}; the rows are:");
        }
        for t in &tasks {
            println!("{}", t.name);
        }
        if !unknown.is_empty() {
            std::process::exit(2);
        }
        return;
    }
    if !only.is_empty() {
        tasks.retain(|t| {
            READS.contains(&t.name.as_str()) || only.iter().any(|o| t.name.starts_with(o.as_str()))
        });
    }
    // Repetition r starts at task r (mod the count), so no kernel always follows the same one
    // (a task right after a long one is preempted more often on a shared machine).
    let count = tasks.len();
    for r in 0..reps {
        for j in 0..count {
            let t = &mut tasks[(r + j) % count];
            let t0 = clock.now();
            (t.run)();
            t.times.push(clock.now() - t0);
        }
    }

    // The denominator: the faster of the two read passes (both are the first two tasks).
    let (plain, prefetched) = (median(&tasks[0].times), median(&tasks[1].times));
    let (read, read_name) = if plain <= prefetched {
        (plain, READS[0])
    } else {
        (prefetched, READS[1])
    };
    let med = |name: &str| {
        tasks
            .iter()
            .find(|t| t.name == name)
            .map(|t| median(&t.times))
    };
    let build = build_name();
    let read_gbps = (n * 4) as f64 / read / 1e9;
    let l3 = l3_size();
    if !json {
        println!(
            "\n{data}: n = {n}, build = {build}, {reps} interleaved repetitions, medians, {} clock; read pass ({read_name}, the faster of read and read_prefetch) = {:.3} ms ({read_gbps:.1} GB/s); L3 {}",
            clock.name(),
            read * 1e3,
            l3.as_deref().unwrap_or("unknown")
        );
        if n < 25_000_000 {
            println!("(the targets are defined at n = 2.5e7; this buffer may sit in cache)");
        } else if l3
            .as_deref()
            .and_then(cache_bytes)
            .is_some_and(|c| c >= n * 4)
        {
            println!(
                "(this buffer of {} MB fits in the L3: the read pass measures the cache, not main memory; compare rows within this table only)",
                n * 4 / 1_000_000
            );
        }
        println!(
            "{:<42} {:>11} {:>9} {:>12} {:>8}",
            "kernel", "median ms", "x read", "x baseline", "target"
        );
    }
    for t in &tasks {
        let m = median(&t.times);
        let base = t
            .baseline
            .and_then(|b| med(&format!("{}:{b}", t.name)))
            .map(|b| m / b);
        let target = TARGETS
            .iter()
            .find(|x| x.0 == t.name)
            .map(|x| if build == "native" { x.2 } else { x.1 });
        if json {
            let base_s = base.map_or("null".to_string(), |b| format!("{b:.4}"));
            println!(
                "{{\"name\":\"{}\",\"data\":\"{data}\",\"n\":{n},\"median_s\":{m:.6e},\"ratio_to_read\":{:.4},\"ratio_to_baseline\":{base_s},\"baseline\":{},\"target\":{},\"build\":\"{build}\",\"clock\":\"{}\",\"read_pass\":\"{read_name}\",\"read_gbps\":{read_gbps:.2},\"l3\":{}}}",
                t.name,
                m / read,
                t.baseline
                    .map_or("null".to_string(), |b| format!("\"{b}\"")),
                target.map_or("null".to_string(), |x| format!("{x}")),
                clock.name(),
                l3.as_deref()
                    .map_or("null".to_string(), |x| format!("\"{x}\"")),
            );
        } else {
            let base_s = match (base, t.baseline) {
                (Some(b), Some(name)) => format!("{b:.3} ({name})"),
                _ => String::new(),
            };
            let target_s = target.map_or(String::new(), |x| {
                let ok = m / read <= x;
                format!("<= {x} {}", if ok { "met" } else { "MISSED" })
            });
            println!(
                "{:<42} {:>11.3} {:>9.3} {:>12} {}",
                t.name,
                m * 1e3,
                m / read,
                base_s,
                target_s
            );
        }
    }
}

/// Bytes of a cache size as `/sys` writes it (`32768K`, `300M`, or plain bytes).
fn cache_bytes(size: &str) -> Option<usize> {
    let (digits, unit) = match size.strip_suffix('K') {
        Some(d) => (d, 1 << 10),
        None => match size.strip_suffix('M') {
            Some(d) => (d, 1 << 20),
            None => (size, 1),
        },
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

/// The size of the last-level (L3) cache of CPU 0 as Linux reports it (`/sys`, e.g. `32768K`),
/// so that every table says which kind of machine it came from.
fn l3_size() -> Option<String> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    (0..8).find_map(|i| {
        let index = dir.join(format!("index{i}"));
        let level = std::fs::read_to_string(index.join("level")).ok()?;
        if level.trim() != "3" {
            return None;
        }
        let size = std::fs::read_to_string(index.join("size")).ok()?;
        Some(size.trim().to_owned())
    })
}

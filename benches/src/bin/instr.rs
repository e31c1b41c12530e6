//! One kernel, run once (or `--reps R` times), for instruction counts under callgrind (where
//! hardware counters are unavailable, as in a VM):
//!
//! ```sh
//! valgrind --tool=callgrind --toggle-collect='instr::measured' \
//!     target/release/instr KERNEL [--n N] [--reps R]
//! ```
//!
//! `--reps R` runs the kernel R times (default 1), for a sampling profile of the kernel alone
//! (`perf record -e cpu-clock target/release/instr ef_step --n 2.5e7 --reps 150`). Kernels that
//! write their input (`ef_step`, `add_pass`, `accumulate_*`) change it on every repetition;
//! their work per call stays the same.
//!
//! The setup (data, frames, warm-up) runs outside `measured`, so callgrind's total is the
//! kernel's instructions alone. Kernels: `read`, `read2`, `check`, `byte_pass`, `add_pass`,
//! `sign`, `quant_int8`, `kernel_sign`, `kernel_quant_int8`, `topk_1pct`, `threshold`,
//! `accumulate_topk_1pct`, `scatter_add_plain`, `ef_step` (with the residual bound, as
//! `ErrorFeedback` runs it), `ef_step_two_pass` (`feedback_step`), `floor_ef`.

use gradwire_benches::{
    Codec, add_pass, byte_pass, ef_method, heavy_tailed, methods, read_pass, read_pass2,
};
use gradwire_core::scalar::{self, Selection};
use gradwire_core::{ResidualBound, k_from_ratio, values};
use std::hint::black_box;

/// Everything a kernel may need, built before the measured call.
struct Setup {
    x: Vec<f32>,
    r: Vec<f32>,
    bytes: Vec<u8>,
    scales: Vec<u8>,
    codec: Option<Codec>,
    idx: Vec<usize>,
    vals: Vec<f32>,
    bound: ResidualBound,
}

#[inline(never)]
fn measured(kernel: &str, s: &mut Setup) {
    let x = &s.x;
    match kernel {
        "read" => {
            black_box(read_pass(black_box(x)));
        }
        "read2" => {
            black_box(read_pass2(black_box(x), &s.r));
        }
        "check" => {
            black_box(values::first_non_finite(black_box(x)));
        }
        "byte_pass" => byte_pass(black_box(x), &mut s.bytes),
        "add_pass" => add_pass(&mut s.r, black_box(x)),
        "floor_ef" => {
            black_box(read_pass2(black_box(x), &s.r));
            add_pass(&mut s.r, black_box(x));
        }
        "kernel_sign" => {
            gradwire_core::sign::encode(black_box(x), Some(1024), &mut s.scales, &mut s.bytes)
        }
        "kernel_quant_int8" => {
            gradwire_core::quant::encode(black_box(x), 8, 512, None, &mut s.scales, &mut s.bytes)
        }
        "sign" | "quant_int8" | "topk_1pct" | "threshold" => {
            if let Some(c) = s.codec.as_mut() {
                black_box(c.encode(black_box(x)));
            }
        }
        "accumulate_topk_1pct" => {
            if let Some(c) = s.codec.as_ref() {
                c.accumulate(&mut s.r);
            }
        }
        "scatter_add_plain" => {
            for (&i, &v) in s.idx.iter().zip(&s.vals) {
                s.r[i] += v;
            }
        }
        "ef_step" => {
            if let Some(c) = s.codec.as_mut() {
                black_box(c.feedback_bounded(black_box(x), &mut s.r, &mut s.bound));
            }
        }
        "ef_step_two_pass" => {
            if let Some(c) = s.codec.as_mut() {
                black_box(c.feedback(black_box(x), &mut s.r));
            }
        }
        other => {
            eprintln!("unknown kernel {other}");
            std::process::exit(2);
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let kernel = args.next().unwrap_or_else(|| "read".into());
    let mut n = 1_000_000usize;
    let mut reps = 1usize;
    while let Some(a) = args.next() {
        let value = args.next().and_then(|v| v.parse::<f64>().ok());
        match a.as_str() {
            "--n" => n = value.expect("--n N") as usize,
            "--reps" => reps = value.expect("--reps R") as usize,
            other => panic!("unknown argument {other}"),
        }
    }
    let x = heavy_tailed(n, 42);
    let codec_name = match kernel.as_str() {
        "accumulate_topk_1pct" => "topk_1pct",
        k => k,
    };
    let mut codec = methods(&x)
        .into_iter()
        .find(|(name, _)| *name == codec_name)
        .map(|(_, m)| Codec::new(m, n));
    if kernel.starts_with("ef_step") {
        codec = Some(Codec::new(ef_method(), n));
    }
    let k = k_from_ratio(n as u64, 0.01) as usize;
    let mut hist = vec![0u32; scalar::TOPK_HIST];
    let cut = scalar::topk_cut(&x, k, &mut hist);
    let mut idx = Vec::new();
    scalar::for_each_kept(&x, Selection::TopK(cut), |i| idx.push(i));
    let vals = idx.iter().map(|&i| x[i]).collect();
    let mut s = Setup {
        r: vec![0.0; n],
        bytes: vec![0; n],
        scales: vec![0; n.div_ceil(512) * 4],
        codec,
        idx,
        vals,
        x,
        bound: ResidualBound::UNKNOWN,
    };
    if let Some(c) = s.codec.as_mut() {
        c.encode(&s.x);
    }
    if kernel.starts_with("ef_step") {
        // A residual from earlier steps, as in a training run.
        let (x, r) = (&s.x, &mut s.r);
        if let Some(c) = s.codec.as_mut() {
            c.feedback_bounded(x, r, &mut s.bound);
        }
    }
    for _ in 0..reps {
        measured(&kernel, &mut s);
    }
}

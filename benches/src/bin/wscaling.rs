//! Bytes per link as the world grows: the all-gather, the two-phase shard-owner collective,
//! `Auto`, and the dense f32 ring all-reduce, measured on `LocalGroup` threads.
//!
//! `cargo run --release -p gradwire-benches --bin wscaling -- [--workers 2,4,8,16,32,64]
//! [--steps 2] [--data PATH]`
//!
//! Every rank's gradient is the MiniLM tensors of `testdata/` plus seeded per-rank noise of
//! 0.3 x the RMS of the tensor's non-zero entries, added to the non-zero entries only (so the
//! exact zeros of the embeddings stay zeros, as in real gradients). Each configuration runs
//! `--steps` steps (the last one is reported: residuals are warm); bytes are the communicator's
//! logical counters of that step (`gradwire::comm::Traffic`: the same on every transport), per
//! rank: the maximum over ranks and the mean. `bundle` is rank 0's all-gather bundle at that
//! step, in bytes. Byte counts are deterministic: no timing.
//!
//! Checks (exit status 1 when one fails): two-phase maximum received at most 2.3 x the bundle
//! for the dense-shaped methods, 3.5 x for top-k 1% int8, 5 x for top-k 0.1%; `Auto` never more
//! than 5% above the smaller of all-gather and two-phase.

use std::collections::HashMap;
use std::process::ExitCode;

use gradwire::comm::LocalGroup;
use gradwire::core::{K, Method, Values};
use gradwire::tensor::{Tensor, read_safetensors};
use gradwire::{
    BucketConfig, Collective, CompressedAllReduce, CompressionMethod, GradientCompressor, Manifest,
    Parallelism,
};

const DEFAULT_DATA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/minilm_small_grads.safetensors"
);

/// SplitMix64, for the per-rank noise.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `base` plus rank `rank`'s noise at `step` (see the module docs).
fn noisy(base: &[(String, Tensor)], rank: usize, step: u64) -> HashMap<String, Tensor> {
    let mut rng = Rng(0x5eed ^ ((rank as u64) << 32) ^ step);
    base.iter()
        .map(|(name, t)| {
            let nonzero: Vec<f32> = t.data().iter().copied().filter(|x| *x != 0.0).collect();
            let rms = if nonzero.is_empty() {
                0.0
            } else {
                (nonzero
                    .iter()
                    .map(|x| f64::from(*x) * f64::from(*x))
                    .sum::<f64>()
                    / nonzero.len() as f64)
                    .sqrt() as f32
            };
            // Uniform noise of standard deviation 0.3 x RMS: amplitude sqrt(3) x that.
            let amp = 0.3 * rms * 3f32.sqrt();
            let data = t
                .data()
                .iter()
                .map(|&x| if x == 0.0 { 0.0 } else { x + amp * rng.unit() })
                .collect();
            (
                name.clone(),
                Tensor::new(t.shape().to_vec(), data).expect("same shape"),
            )
        })
        .collect()
}

/// Per-rank bytes of the last step: (max sent, mean sent, max received, mean received).
#[derive(Clone, Copy, Debug, Default)]
struct Bytes {
    sent_max: u64,
    sent_mean: f64,
    recv_max: u64,
    recv_mean: f64,
}

fn run(
    base: &[(String, Tensor)],
    method: &CompressionMethod,
    collective: Collective,
    w: usize,
    steps: u64,
) -> Result<(Bytes, Option<Collective>), String> {
    let comms = LocalGroup::new(w).into_communicators();
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let method = method.clone();
                scope.spawn(move || {
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                        .with_collective(collective)
                        .with_parallelism(Parallelism::Serial);
                    let mut last = Default::default();
                    for s in 0..steps {
                        let g = noisy(base, rank, s);
                        let before = ar.traffic();
                        ar.all_reduce(&g).map_err(|e| e.to_string())?;
                        last = ar.traffic().since(before);
                    }
                    Ok::<_, String>((last, ar.collective_in_use()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut bytes = Bytes::default();
    let mut used = None;
    for r in &results {
        let (t, c) = r.as_ref().map_err(Clone::clone)?;
        bytes.sent_max = bytes.sent_max.max(t.sent);
        bytes.recv_max = bytes.recv_max.max(t.received);
        bytes.sent_mean += t.sent as f64 / w as f64;
        bytes.recv_mean += t.received as f64 / w as f64;
        used = *c;
    }
    Ok((bytes, used))
}

/// Rank 0's bundle length at step `steps - 1` (its residuals warm from the steps before).
fn bundle_len(
    g0: &HashMap<String, Tensor>,
    base: &[(String, Tensor)],
    method: &CompressionMethod,
    steps: u64,
) -> Result<usize, gradwire::Error> {
    let manifest = Manifest::for_gradients(g0, method, 0, BucketConfig::none())?;
    let mut c = GradientCompressor::new(method.clone()).with_parallelism(Parallelism::Serial);
    let mut bundle = Vec::new();
    for s in 0..steps {
        c.compress_bundle(&manifest, &noisy(base, 0, s), 0, &mut bundle)?;
    }
    Ok(bundle.len())
}

fn main() -> ExitCode {
    let mut workers = vec![2usize, 4, 8, 16, 32, 64];
    let mut steps = 2u64;
    let mut data = DEFAULT_DATA.to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = args.next();
        match (a.as_str(), value) {
            ("--workers", Some(v)) => {
                workers = match v.split(',').map(str::parse).collect() {
                    Ok(w) => w,
                    Err(e) => {
                        eprintln!("--workers {v}: {e}");
                        return ExitCode::from(2);
                    }
                }
            }
            ("--steps", Some(v)) => match v.parse() {
                Ok(s) if s >= 1 => steps = s,
                _ => {
                    eprintln!("--steps {v}: a count of at least 1");
                    return ExitCode::from(2);
                }
            },
            ("--data", Some(v)) => data = v,
            _ => {
                eprintln!("usage: wscaling [--workers 2,4,8,16,32,64] [--steps 2] [--data PATH]");
                return ExitCode::from(2);
            }
        }
    }
    let base = match std::fs::read(&data)
        .map_err(|e| e.to_string())
        .and_then(|b| read_safetensors(&b).map_err(|e| e.to_string()))
    {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{data}: {e}");
            return ExitCode::from(2);
        }
    };
    let numel: usize = base.iter().map(|(_, t)| t.data().len()).sum();
    let methods: Vec<(&str, CompressionMethod, f64)> = vec![
        ("dense-f16", CompressionMethod::Float16, 2.3),
        (
            "quant4-ef",
            CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
            2.3,
        ),
        (
            "sign-ef",
            CompressionMethod::SignSGD.with_error_feedback(),
            2.3,
        ),
        (
            "topk-1%-ef-int8",
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            3.5,
        ),
        (
            "topk-0.1%-ef",
            CompressionMethod::Core(Method::TopK {
                k: K::Ratio(0.001),
                values: Values::F32,
            })
            .with_error_feedback(),
            5.0,
        ),
    ];
    let dense = CompressionMethod::Core(Method::Dense {
        values: Values::F32,
    });
    println!("# Bytes per rank per step, {numel} elements, {steps} steps (the last reported)");
    println!();
    println!(
        "| method | W | bundle | all-gather sent max / mean | all-gather recv max / mean | \
         two-phase sent max / mean | two-phase recv max / mean | auto recv max (picked) | \
         dense f32 ring sent max / mean | dense f32 ring recv max / mean | two-phase recv max / \
         bundle | ring / two-phase |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut failed = 0;
    for &w in &workers {
        let ring = match run(&base, &dense, Collective::AllGather, w, 1) {
            Ok((b, _)) => b,
            Err(e) => {
                eprintln!("dense f32 W={w}: {e}");
                return ExitCode::from(2);
            }
        };
        for (label, method, bound) in &methods {
            // One rank's real bundle at the reported step (top-k bundles are well below the
            // manifest's bound: the index codec adapts to the gaps).
            let g0: HashMap<String, Tensor> = base.iter().cloned().collect();
            let bundle = match bundle_len(&g0, &base, method, steps) {
                Ok(b) => b as f64,
                Err(e) => {
                    eprintln!("{label}: {e}");
                    return ExitCode::from(2);
                }
            };
            let measure = |c| run(&base, method, c, w, steps);
            let (ag, tp, auto) = match (
                measure(Collective::AllGather),
                measure(Collective::TwoPhase),
                measure(Collective::Auto),
            ) {
                (Ok(a), Ok(t), Ok(x)) => (a.0, t.0, x),
                (a, t, x) => {
                    eprintln!("{label} W={w}: {:?} {:?} {:?}", a.err(), t.err(), x.err());
                    return ExitCode::from(2);
                }
            };
            let ratio = tp.recv_max as f64 / bundle;
            let best = ag.recv_max.min(tp.recv_max) as f64;
            let auto_ok = auto.0.recv_max as f64 <= 1.05 * best;
            let ok = ratio <= *bound && auto_ok;
            if !ok {
                failed += 1;
            }
            let pair = |max: u64, mean: f64| format!("{max} / {mean:.0}");
            println!(
                "| {label} | {w} | {bundle:.0} | {} | {} | {} | {} | {} ({}) | {} | {} | \
                 {ratio:.2}{} | {:.2} |",
                pair(ag.sent_max, ag.sent_mean),
                pair(ag.recv_max, ag.recv_mean),
                pair(tp.sent_max, tp.sent_mean),
                pair(tp.recv_max, tp.recv_mean),
                auto.0.recv_max,
                match auto.1 {
                    Some(Collective::TwoPhase) => "two-phase",
                    _ => "all-gather",
                },
                pair(ring.sent_max, ring.sent_mean),
                pair(ring.recv_max, ring.recv_mean),
                if ok { "" } else { " MISSED" },
                ring.recv_max as f64 / tp.recv_max as f64,
            );
        }
    }
    println!();
    if failed == 0 {
        println!("every bound met");
        ExitCode::SUCCESS
    } else {
        println!("{failed} rows missed a bound");
        ExitCode::from(1)
    }
}

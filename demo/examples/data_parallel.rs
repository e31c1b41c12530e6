//! Data-parallel training of an MLP on the digits data set with every gradient compression
//! method, several seeds each; prints a table, writes a PNG plot and, on request, a JSON
//! report.
//!
//! ```text
//! cargo run --release --example data_parallel
//! cargo run --release --example data_parallel -- --methods dense-f32 --seeds 1 --json out/r.json
//! ```
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::Parser;
use gradwire_demo::DemoError;
use gradwire_demo::codec::{Collective, Method};
use gradwire_demo::launch::{Transport, launcher, run_sweep};
use gradwire_demo::train::{TrainConfig, Workload};

/// Data-parallel training demo for gradwire: W workers train an MLP (64-256-256-10) on the
/// digits data set, exchanging compressed gradients every step.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Number of workers (ranks) [default: 8]; with `--transport mpi` the MPI world size
    /// decides, and a different value here is an error.
    #[arg(long)]
    workers: Option<usize>,
    /// SGD steps per run.
    #[arg(long, default_value_t = TrainConfig::default().steps)]
    steps: usize,
    /// Methods to run, comma-separated (default: all).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Method::ALL)]
    methods: Vec<Method>,
    /// Seeds, comma-separated: each method runs once per seed.
    #[arg(long, value_delimiter = ',', default_values_t = [1u64, 2, 3])]
    seeds: Vec<u64>,
    /// Where to write the PNG plot (test accuracy against step and against bytes).
    #[arg(long, default_value = "out/data_parallel.png")]
    plot: PathBuf,
    /// Do not draw the plot.
    #[arg(long)]
    no_plot: bool,
    /// Where to write the JSON report (`config` and `results` are reproducible, `timing` is
    /// not).
    #[arg(long)]
    json: Option<PathBuf>,
    /// How the workers exchange messages.
    #[arg(long, value_enum, default_value_t = Transport::Threads)]
    transport: Transport,
    /// Images per worker per step.
    #[arg(long, default_value_t = TrainConfig::default().batch_size)]
    batch_size: usize,
    /// Peak learning rate (linear warm-up, then cosine decay).
    #[arg(long, default_value_t = TrainConfig::default().lr)]
    lr: f32,
    /// SGD momentum.
    #[arg(long, default_value_t = TrainConfig::default().momentum)]
    momentum: f32,
    /// SGD momentum of the delayed methods (`*-delayed`), whose one-step delay adds momentum
    /// of its own.
    #[arg(long, default_value_t = TrainConfig::default().delayed_momentum)]
    delayed_momentum: f32,
    /// Evaluate the test accuracy every this many steps (for the curves).
    #[arg(long, default_value_t = TrainConfig::default().eval_every)]
    eval_every: usize,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
    /// The collective the gradients travel by: the all-gather of every rank's bundle, gradwire's
    /// two-phase shard-owner all-reduce (random-k stays on the all-gather), or whichever moves
    /// fewer bytes.
    #[arg(long, value_enum, default_value_t = Collective::AllGather)]
    collective: Collective,
    /// Timing mode: a barrier before every step's collective, so that the report splits the
    /// communication time into waiting for the slowest rank and the transfer itself.
    #[arg(long)]
    wait_barrier: bool,
    /// Steps at the start left out of the timing (the first touches of model-sized buffers);
    /// the report's times per step cover the steps after them.
    #[arg(long, default_value_t = 0)]
    untimed_steps: usize,
    /// What the ranks train: the MLP on the digits data set, or no model and the real MiniLM
    /// gradients of `testdata/` (789,504 values) replayed every step with per-rank noise, to
    /// time codecs and transfers at a transformer layer's size (no accuracy; use
    /// `--no-plot`).
    #[arg(long, value_enum, default_value_t = Workload::DigitsMlp)]
    workload: Workload,
}

fn create_parent(path: &Path) -> Result<(), DemoError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|source| DemoError::Io {
                path: dir.display().to_string(),
                source,
            })
        }
        _ => Ok(()),
    }
}

fn run(args: &Args) -> Result<(), DemoError> {
    let config = TrainConfig {
        steps: args.steps,
        batch_size: args.batch_size,
        lr: args.lr,
        momentum: args.momentum,
        delayed_momentum: args.delayed_momentum,
        eval_every: args.eval_every,
        collective: args.collective,
        wait_barrier: args.wait_barrier,
        untimed_steps: args.untimed_steps,
        workload: args.workload,
        ..TrainConfig::default()
    };
    let start = Instant::now();
    let mut launcher = launcher(args.transport, args.workers.unwrap_or(8))?;
    if let Some(w) = args.workers
        && w != launcher.world_size()
    {
        return Err(DemoError::Config(format!(
            "--workers {w}, but the MPI world has {} ranks",
            launcher.world_size()
        )));
    }
    if args.transport == Transport::Mpi
        && launcher.is_root()
        && std::env::var_os("RAYON_NUM_THREADS").is_none()
    {
        eprintln!(
            "hint: RAYON_NUM_THREADS is unset; with several ranks per machine, \
             `mpirun -x RAYON_NUM_THREADS=1 ...` keeps candle from spinning threads per rank"
        );
    }
    let Some(report) = run_sweep(
        launcher.as_mut(),
        &config,
        &args.methods,
        &args.seeds,
        !args.quiet,
    )?
    else {
        return Ok(()); // not the root rank
    };
    println!("{}", report.table());
    if let Some(path) = &args.json {
        create_parent(path)?;
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").map_err(|source| DemoError::Io {
            path: path.display().to_string(),
            source,
        })?;
        println!("JSON report: {}", path.display());
    }
    if !args.no_plot {
        create_parent(&args.plot)?;
        gradwire_demo::plot::draw(&report, &args.plot)?;
        println!("plot: {}", args.plot.display());
    }
    println!("total {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}

/// candle 0.11 reads `RAYON_NUM_THREADS` at every matrix product (and at every product without
/// it, `/proc/cpuinfo`) and hands element-wise operations on 64 Ki elements or more to a pool of
/// spinning threads. The demo runs W ranks as threads already; with 8 ranks on 2 cores, those
/// spinning helpers made a run about 2x slower (one rank's step 3x). Rust 2024 makes setting
/// a variable of one's own process `unsafe`, so the threads launcher re-runs this program with
/// `RAYON_NUM_THREADS=1` when it is unset, and passes the exit status through. `None`: go on
/// in this process.
fn rerun_single_threaded(args: &Args) -> Option<ExitCode> {
    if args.transport != Transport::Threads || std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let status = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("RAYON_NUM_THREADS", "1")
        .status()
        .ok()?;
    Some(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(code) = rerun_single_threaded(&args) {
        return code;
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

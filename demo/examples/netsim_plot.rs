//! The slow-network report's plot (`docs/netsim.md`, time to accuracy): test accuracy against
//! rank 0's seconds of training, one panel per link, one curve per method and collective, from
//! the demo JSON reports that `netsim/run-report.sh` wrote and its manifest lists.
//!
//! ```text
//! cargo run --release -p gradwire-demo --example netsim_plot -- \
//!     [--manifest out/netsim/manifest-tta.txt] [--dir out/netsim] [--out out/netsim/tta.png]
//! ```
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gradwire_demo::DemoError;
use gradwire_demo::plot::{TimePanel, draw_time_panels};
use serde_json::Value;

/// Draws test accuracy against seconds of training, one panel per link.
#[derive(Debug, Parser)]
struct Args {
    /// The manifest: one line per run, `LINK METHOD COLLECTIVE TAG`.
    #[arg(long, default_value = "out/netsim/manifest-tta.txt")]
    manifest: PathBuf,
    /// Where `TAG.json` lies.
    #[arg(long, default_value = "out/netsim")]
    dir: PathBuf,
    /// The PNG to write.
    #[arg(long, default_value = "out/netsim/tta.png")]
    out: PathBuf,
}

fn link_title(link: &str) -> String {
    let (rate, delay) = link.split_once(':').unwrap_or((link, ""));
    let rate = if rate == "none" { "unshaped" } else { rate };
    if delay.is_empty() {
        rate.to_string()
    } else {
        format!("{rate}, {delay} ms one-way delay")
    }
}

fn read(path: &std::path::Path) -> Result<String, DemoError> {
    std::fs::read_to_string(path).map_err(|source| DemoError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// One run's curve: (seconds, accuracy %) per evaluation.
fn curve(report: &Value) -> Option<Vec<(f64, f64)>> {
    let acc = report["results"][0]["runs"][0]["curve"].as_array()?;
    let secs = report["timing"][0]["runs"][0]["curve_s"].as_array()?;
    acc.iter()
        .zip(secs)
        .map(|(p, s)| Some((s.as_f64()?, 100.0 * p["test_accuracy"].as_f64()?)))
        .collect()
}

fn run(args: &Args) -> Result<(), DemoError> {
    let mut panels: Vec<TimePanel> = Vec::new();
    let mut workers = 0;
    for line in read(&args.manifest)?.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [link, method, collective, tag] = fields[..] else {
            return Err(DemoError::Config(format!("manifest line `{line}`")));
        };
        let path = args.dir.join(format!("{tag}.json"));
        let report: Value = serde_json::from_str(&read(&path)?)?;
        workers = report["config"]["workers"].as_u64().unwrap_or(0);
        let points = curve(&report).ok_or_else(|| {
            DemoError::Config(format!("{}: no curve with seconds", path.display()))
        })?;
        let title = link_title(link);
        let label = match (method, collective) {
            ("dense-f32-allreduce", "ring") => "dense-f32-allreduce (ring)".to_string(),
            ("dense-f32-allreduce" | "dense-f32", _) => method.to_string(),
            _ => format!("{method} {collective}"),
        };
        match panels.iter_mut().find(|p| p.title == title) {
            Some(p) => p.curves.push((label, points)),
            None => panels.push(TimePanel {
                title,
                curves: vec![(label, points)],
            }),
        }
    }
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| DemoError::Io {
            path: dir.display().to_string(),
            source,
        })?;
    }
    let title = format!("MLP on digits, W = {workers}: test accuracy against seconds of training");
    draw_time_panels(&title, &panels, &args.out)?;
    println!("plot: {}", args.out.display());
    Ok(())
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

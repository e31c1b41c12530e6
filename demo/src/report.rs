//! The summary over seeds: the table printed at the end and the JSON report.
//!
//! The JSON report has three top-level keys: `config`, `results` and `timing`. Everything
//! under `config` and `results` is reproducible (the same seeds give the same bytes); wall
//! clock measurements live under `timing` only.

use serde::Serialize;

use crate::codec::Method;
use crate::train::{CurvePoint, RankReport, StepTraffic, Timing, TrainConfig};

/// The reproducible outcome of one run (rank 0's view).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    /// The run's seed.
    pub seed: u64,
    /// Final test accuracy in [0, 1].
    pub test_accuracy: f32,
    /// Final mean cross-entropy over the training set.
    pub train_loss: f32,
    /// Mean cross-entropy of the initial model over the training set.
    pub initial_train_loss: f32,
    /// Mean bytes per worker per step.
    pub bytes_per_worker_per_step: f64,
    /// Bytes per rank per step on the communicator (largest and mean over ranks).
    pub traffic: StepTraffic,
    /// Digest of the final parameters (equal on every rank).
    pub param_digest: String,
    /// Digest of every step's aggregated mean gradient (equal on every rank).
    pub mean_digest: String,
    /// Test accuracy against step and bytes.
    pub curve: Vec<CurvePoint>,
}

/// Mean and spread of a quantity over seeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 for one run).
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (all zero for none).
    #[must_use]
    pub fn of(values: &[f64]) -> Spread {
        if values.is_empty() {
            return Spread {
                mean: 0.0,
                std: 0.0,
                min: 0.0,
                max: 0.0,
            };
        }
        #[allow(clippy::cast_precision_loss)]
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = if values.len() > 1 {
            values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        Spread {
            mean,
            std: var.sqrt(),
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// One method's row: its runs and their summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MethodResult {
    /// The method.
    pub method: Method,
    /// Final test accuracy over seeds, in percent.
    pub test_accuracy_pct: Spread,
    /// Final training loss over seeds.
    pub train_loss: Spread,
    /// Mean bytes per worker per step over seeds.
    pub bytes_per_worker_per_step: f64,
    /// Dense f32 bytes divided by this method's bytes (compression ratio).
    pub ratio_vs_dense_f32: f64,
    /// Bytes received per rank per step, the largest over ranks (mean over seeds).
    pub received_max: f64,
    /// Bytes received per rank per step, the mean over ranks (mean over seeds).
    pub received_mean: f64,
    /// A dense f32 ring all-reduce's bytes received per rank (`2 (W - 1) / W x 4n`) divided by
    /// [`MethodResult::received_max`]: below 1, more bytes than not compressing at all.
    pub ratio_vs_ring: f64,
    /// Every run, in seed order.
    pub runs: Vec<RunResult>,
}

/// One run's timing (mean over ranks).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunTiming {
    /// The run's seed.
    pub seed: u64,
    /// Seconds per step (evaluation excluded).
    pub step_ms: f64,
    /// Share of step time spent in encode and decode.
    pub codec_share: f64,
    /// Every phase, in seconds over the whole run.
    pub phases: Timing,
    /// Wall-clock seconds of the whole run as the launcher saw it.
    pub wall_s: f64,
    /// Rank 0's seconds of training at each point of the run's curve
    /// ([`RunResult::curve`]; [`RankReport::curve_s`]).
    pub curve_s: Vec<f64>,
}

/// One method's timing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MethodTiming {
    /// The method.
    pub method: Method,
    /// Mean over seeds of [`RunTiming::codec_share`].
    pub codec_share: f64,
    /// Mean over seeds of [`RunTiming::step_ms`].
    pub step_ms: f64,
    /// Every run.
    pub runs: Vec<RunTiming>,
}

/// The settings of a sweep, as written into the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepConfig {
    /// Number of workers (ranks).
    pub workers: usize,
    /// The training hyper-parameters.
    pub train: TrainConfig,
    /// The seeds, in order.
    pub seeds: Vec<u64>,
    /// Number of model parameters.
    pub parameters: usize,
    /// Bytes of one dense f32 message (the ratio's numerator).
    pub dense_f32_bytes: usize,
    /// Training set size.
    pub train_images: usize,
    /// Test set size.
    pub test_images: usize,
}

/// The whole report of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The settings.
    pub config: SweepConfig,
    /// One entry per method, in the order they ran (reproducible).
    pub results: Vec<MethodResult>,
    /// Wall-clock measurements (not reproducible).
    pub timing: Vec<MethodTiming>,
}

/// Collects the runs of a sweep into a [`Report`].
#[derive(Debug)]
pub struct ReportBuilder {
    report: Report,
}

impl ReportBuilder {
    /// An empty report for `config`.
    #[must_use]
    pub fn new(config: SweepConfig) -> ReportBuilder {
        ReportBuilder {
            report: Report {
                config,
                results: Vec::new(),
                timing: Vec::new(),
            },
        }
    }

    /// Adds rank 0's report of one run that took `wall_s` seconds.
    pub fn add(&mut self, r: &RankReport, wall_s: f64) {
        let dense = self.report.config.dense_f32_bytes;
        let results = &mut self.report.results;
        let i = match results.iter().position(|m| m.method == r.method) {
            Some(i) => i,
            None => {
                results.push(MethodResult {
                    method: r.method,
                    test_accuracy_pct: Spread::of(&[]),
                    train_loss: Spread::of(&[]),
                    bytes_per_worker_per_step: 0.0,
                    ratio_vs_dense_f32: 0.0,
                    received_max: 0.0,
                    received_mean: 0.0,
                    ratio_vs_ring: 0.0,
                    runs: Vec::new(),
                });
                self.report.timing.push(MethodTiming {
                    method: r.method,
                    codec_share: 0.0,
                    step_ms: 0.0,
                    runs: Vec::new(),
                });
                results.len() - 1
            }
        };
        let m = &mut results[i];
        m.runs.push(RunResult {
            seed: r.seed,
            test_accuracy: r.test_accuracy,
            train_loss: r.train_loss,
            initial_train_loss: r.initial_train_loss,
            bytes_per_worker_per_step: r.bytes_per_worker_per_step,
            traffic: r.traffic,
            param_digest: format!("{:016x}", r.param_digest),
            mean_digest: format!("{:016x}", r.mean_digest),
            curve: r.curve.clone(),
        });
        let acc: Vec<f64> = m
            .runs
            .iter()
            .map(|x| 100.0 * f64::from(x.test_accuracy))
            .collect();
        let loss: Vec<f64> = m.runs.iter().map(|x| f64::from(x.train_loss)).collect();
        let bytes: Vec<f64> = m.runs.iter().map(|x| x.bytes_per_worker_per_step).collect();
        m.test_accuracy_pct = Spread::of(&acc);
        m.train_loss = Spread::of(&loss);
        m.bytes_per_worker_per_step = Spread::of(&bytes).mean;
        #[allow(clippy::cast_precision_loss)]
        let dense = dense as f64;
        m.ratio_vs_dense_f32 = if m.bytes_per_worker_per_step > 0.0 {
            dense / m.bytes_per_worker_per_step
        } else {
            f64::INFINITY
        };
        let recv_max: Vec<f64> = m.runs.iter().map(|x| x.traffic.received_max).collect();
        let recv_mean: Vec<f64> = m.runs.iter().map(|x| x.traffic.received_mean).collect();
        m.received_max = Spread::of(&recv_max).mean;
        m.received_mean = Spread::of(&recv_mean).mean;
        #[allow(clippy::cast_precision_loss)]
        let w = self.report.config.workers as f64;
        let ring = 2.0 * (w - 1.0) / w * dense;
        m.ratio_vs_ring = if m.received_max > 0.0 {
            ring / m.received_max
        } else {
            f64::INFINITY
        };

        let t = &mut self.report.timing[i];
        let train = &self.report.config.train;
        let steps = train.steps.saturating_sub(train.untimed_steps).max(1);
        let phases = r.mean_timing;
        #[allow(clippy::cast_precision_loss)]
        t.runs.push(RunTiming {
            seed: r.seed,
            step_ms: 1e3 * phases.step_s() / steps as f64,
            codec_share: phases.codec_share(),
            phases,
            wall_s,
            curve_s: r.curve_s.clone(),
        });
        let shares: Vec<f64> = t.runs.iter().map(|x| x.codec_share).collect();
        let step_ms: Vec<f64> = t.runs.iter().map(|x| x.step_ms).collect();
        t.codec_share = Spread::of(&shares).mean;
        t.step_ms = Spread::of(&step_ms).mean;
    }

    /// The report so far.
    #[must_use]
    pub fn report(&self) -> &Report {
        &self.report
    }

    /// The finished report.
    #[must_use]
    pub fn finish(self) -> Report {
        self.report
    }
}

impl Report {
    /// The reproducible part of the report as JSON (`config` and `results`, no `timing`).
    ///
    /// # Errors
    /// If serialisation fails (it does not for finite values).
    pub fn reproducible_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        let mut v = serde_json::to_value(self)?;
        if let Some(o) = v.as_object_mut() {
            o.remove("timing");
        }
        Ok(v)
    }

    /// The table printed at the end of a sweep.
    #[must_use]
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let c = &self.config;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} workers, {} steps, batch {} per worker, {} parameters, seeds {:?}",
            c.workers, c.train.steps, c.train.batch_size, c.parameters, c.seeds
        );
        let _ = writeln!(
            s,
            "collective {}: bytes received per rank per step, the largest and the mean over \
             ranks; \"vs ring\": a dense f32 ring all-reduce's bytes over the largest",
            c.train.collective.name()
        );
        let _ = writeln!(
            s,
            "{:<23} {:>22} {:>20} {:>16} {:>9} {:>12} {:>12} {:>8} {:>8} {:>8}",
            "method",
            "test acc % (sd) [min]",
            "train loss (sd)",
            "bytes/worker/step",
            "ratio",
            "recv max",
            "recv mean",
            "vs ring",
            "codec %",
            "ms/step"
        );
        for (m, t) in self.results.iter().zip(&self.timing) {
            let _ = writeln!(
                s,
                "{:<23} {:>22} {:>20} {:>16} {:>9} {:>12.0} {:>12.0} {:>8} {:>8.1} {:>8.2}",
                m.method.name(),
                format!(
                    "{:.2} ({:.2}) [{:.2}]",
                    m.test_accuracy_pct.mean, m.test_accuracy_pct.std, m.test_accuracy_pct.min
                ),
                format!("{:.4} ({:.4})", m.train_loss.mean, m.train_loss.std),
                format!("{:.0}", m.bytes_per_worker_per_step),
                format!("{:.1}x", m.ratio_vs_dense_f32),
                m.received_max,
                m.received_mean,
                format!("{:.1}x", m.ratio_vs_ring),
                100.0 * t.codec_share,
                t.step_ms,
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_sample_std() {
        let s = Spread::of(&[1.0, 2.0, 3.0]);
        assert!((s.mean - 2.0).abs() < 1e-12);
        assert!((s.std - 1.0).abs() < 1e-12);
        assert_eq!((s.min, s.max), (1.0, 3.0));
        assert_eq!(Spread::of(&[5.0]).std, 0.0);
    }
}

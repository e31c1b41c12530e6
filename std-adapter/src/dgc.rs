//! Deep Gradient Compression's recipe (Lin, Han, Mao, Wang & Dally, ICLR 2018) around top-k or
//! random-k with error feedback: momentum correction, momentum factor masking, local gradient
//! clipping and a density warm-up.
//!
//! One step on one rank ([`Dgc::compress_bundle`]), for every tensor:
//! 1. local clipping: with [`DgcConfig::clip_norm`] `c`, the rank's whole gradient (every
//!    tensor, name order, L2 norm in f64) is scaled by `c / norm` when its norm exceeds `c`.
//!    DGC clips each rank at `N^(-1/2)` times the global threshold: pass that;
//! 2. momentum correction: the velocity `u = m u + g` (`m` = [`DgcConfig::momentum`]),
//!    accumulated on the rank before anything is selected;
//! 3. error feedback over `u`: the residual `v` keeps what is not sent, `v + u` is compressed
//!    with top-k (or random-k) at the step's density, and `sent + v_new == u + v_old` for every
//!    coordinate (to the f32 rounding of the error-feedback step);
//! 4. momentum factor masking: `u = 0` wherever the step sent a non-zero value, so that what
//!    was sent does not keep pushing through the momentum.
//!
//! The compressor owns the momentum: the optimizer must apply the mean of what the ranks sent
//! as a plain SGD step (`w -= lr * mean`), with its own momentum set to 0, or the momentum is
//! applied twice.
//!
//! The density of each step comes from a [`DensitySchedule`] that is part of the configuration,
//! so every rank, and a run restored from a checkpoint, agrees on it; receivers decode a step's
//! bundles with [`Dgc::manifest_at`] of that step.

use std::collections::{BTreeMap, HashMap};

use gradwire_core::Values;

use crate::compressor::GradientCompressor;
use crate::engine::Parallelism;
use crate::error::{Error, Result};
use crate::feedback::{ErrorFeedback, state_file};
use crate::layout::{BucketConfig, Manifest, TensorSpec};
use crate::method::CompressionMethod;
use crate::tensor::Tensor;

/// Which entries of `residual + velocity` a step sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DgcSelection {
    /// The `k` of largest magnitude (DGC's choice).
    TopK,
    /// `k` drawn from (seed, step, tensor id), which receivers regenerate.
    RandomK,
}

/// The fraction of each tensor a step sends: `start` for the first `stage_steps` steps, then
/// divided by `factor` every `stage_steps` steps, never below `target`. DGC's warm-up over its
/// first epochs is 25 %, 6.25 %, 1.5625 %, 0.39 %, then the target ([`DensitySchedule::warm_up`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DensitySchedule {
    /// Density of the first stage, in `(0, 1]`.
    pub start: f64,
    /// Division per stage, finite and `>= 1`.
    pub factor: f64,
    /// Steps per stage, at least 1.
    pub stage_steps: u64,
    /// The density from the stage where the division reaches it on, in `(0, start]`.
    pub target: f64,
}

impl DensitySchedule {
    /// `density` at every step.
    pub fn constant(density: f64) -> Self {
        DensitySchedule {
            start: density,
            factor: 1.0,
            stage_steps: 1,
            target: density,
        }
    }

    /// DGC's warm-up: 25 % (or `target` if larger), divided by 4 every `stage_steps` steps down
    /// to `target`.
    pub fn warm_up(target: f64, stage_steps: u64) -> Self {
        DensitySchedule {
            start: target.max(0.25),
            factor: 4.0,
            stage_steps,
            target,
        }
    }

    /// The density of `step`: `max(target, start / factor^stage)`, `stage = step /
    /// stage_steps`, the division done stage by stage in f64 (the same bits on every rank; at
    /// most [`DensitySchedule::MAX_STAGES`] divisions for a schedule [`Dgc::new`] accepts).
    pub fn density(&self, step: u64) -> f64 {
        let stage = step / self.stage_steps.max(1);
        let mut d = self.start;
        for _ in 0..stage {
            if d <= self.target || self.factor <= 1.0 {
                break;
            }
            d /= self.factor;
        }
        d.max(self.target)
    }

    /// Stages a schedule may take to reach its target, so that [`DensitySchedule::density`]
    /// costs at most this many divisions at any step.
    pub const MAX_STAGES: u32 = 1024;

    fn check(&self) -> Result<()> {
        let ok = self.target > 0.0
            && self.target <= self.start
            && self.start <= 1.0
            && self.factor.is_finite()
            && self.factor >= 1.0
            && self.stage_steps >= 1;
        let mut d = self.start;
        let mut stages = 0u32;
        while ok && self.factor > 1.0 && d > self.target && stages <= Self::MAX_STAGES {
            d /= self.factor;
            stages += 1;
        }
        if ok && stages > Self::MAX_STAGES {
            return Err(Error::config(format!(
                "DGC density schedule {self:?} takes more than {} stages to reach its target: \
                 a larger factor",
                Self::MAX_STAGES
            )));
        }
        if ok {
            Ok(())
        } else {
            Err(Error::config(format!(
                "DGC density schedule {self:?}: needs 0 < target <= start <= 1, a finite factor \
                 >= 1 and at least 1 step per stage"
            )))
        }
    }
}

/// DGC's settings; every rank must use the same.
#[derive(Clone, Debug, PartialEq)]
pub struct DgcConfig {
    /// Top-k or random-k.
    pub selection: DgcSelection,
    /// Value codec of the sent entries.
    pub values: Values,
    /// Momentum `m` of the velocity, in `[0, 1)`; the optimizer's own momentum must be 0.
    pub momentum: f32,
    /// Local clipping: the L2 norm this rank's whole gradient is scaled down to when above it
    /// (finite, `> 0`), or none.
    pub clip_norm: Option<f32>,
    /// The density of each step.
    pub schedule: DensitySchedule,
}

impl DgcConfig {
    /// `selection` with `schedule`, f32 values, momentum 0.9 and no clipping.
    pub fn new(selection: DgcSelection, schedule: DensitySchedule) -> Self {
        DgcConfig {
            selection,
            values: Values::F32,
            momentum: 0.9,
            clip_norm: None,
            schedule,
        }
    }

    fn check(&self) -> Result<()> {
        self.schedule.check()?;
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(Error::config(format!(
                "DGC momentum {}: in [0, 1)",
                self.momentum
            )));
        }
        if let Some(c) = self.clip_norm
            && !(c.is_finite() && c > 0.0)
        {
            return Err(Error::config(format!("DGC clip norm {c}: finite and > 0")));
        }
        Ok(())
    }

    /// The text a checkpoint records and compares.
    fn text(&self) -> String {
        let s = &self.schedule;
        let select = match self.selection {
            DgcSelection::TopK => "top-k",
            DgcSelection::RandomK => "random-k",
        };
        let values = match self.values {
            Values::F32 => "f32".to_owned(),
            Values::F16 => "f16".to_owned(),
            Values::Bf16 => "bf16".to_owned(),
            Values::Int8 { block } => format!("int8/{block}"),
        };
        let clip = self.clip_norm.map_or("none".to_owned(), |c| c.to_string());
        format!(
            "dgc select={select} values={values} momentum={} clip={clip} start={} factor={} \
             stage={} target={}",
            self.momentum, s.start, s.factor, s.stage_steps, s.target
        )
    }
}

/// DGC for one rank: the velocity by tensor name, the error-feedback residuals and the step.
///
/// ```
/// use std::collections::HashMap;
/// use gradwire::dgc::{DensitySchedule, Dgc, DgcConfig, DgcSelection};
/// use gradwire::{Aggregator, Reduction, Tensor, TensorSpec};
///
/// let config = DgcConfig::new(DgcSelection::TopK, DensitySchedule::warm_up(0.01, 100));
/// let mut dgc = Dgc::new(config, 7)?;
/// let spec = vec![TensorSpec::new("w", vec![40, 50])];
/// let g = HashMap::from([("w".to_string(), Tensor::new(vec![40, 50], vec![0.5; 2000])?)]);
/// let manifest = dgc.manifest_at(spec, 0)?; // 25 % at the first stage
/// let mut bundle = Vec::new();
/// dgc.compress_bundle(&manifest, &g, 0, &mut bundle)?;
/// let mut mean = Vec::new();
/// Aggregator::new().aggregate_into(&manifest, &[bundle], 0, Reduction::Mean, &mut mean)?;
/// assert_eq!(mean.iter().filter(|&&x| x != 0.0).count(), 500);
/// // What was sent left the velocity; the rest keeps it.
/// assert_eq!(dgc.velocity("w").unwrap().iter().filter(|&&x| x == 0.0).count(), 500);
/// # Ok::<(), gradwire::Error>(())
/// ```
#[derive(Debug)]
pub struct Dgc {
    config: DgcConfig,
    seed: u64,
    step: u64,
    velocity: BTreeMap<String, Vec<f32>>,
    shapes: BTreeMap<String, Vec<usize>>,
    compressor: GradientCompressor,
    parallelism: Parallelism,
    corrected: HashMap<String, Tensor>,
    scratch: Vec<f32>,
    sent: Vec<f32>,
}

/// Value of the checkpoint's `format` entry.
const FORMAT: &str = "gradwire-dgc";
/// Value of the checkpoint's `version` entry.
const VERSION: &str = "1";

impl Dgc {
    /// DGC with `config` and `seed` (random-k draws), at step 0, with no state.
    ///
    /// # Errors
    /// [`Error::Config`] for a schedule, momentum or clip norm out of range.
    pub fn new(config: DgcConfig, seed: u64) -> Result<Self> {
        config.check()?;
        let mut dgc = Dgc {
            compressor: GradientCompressor::new(CompressionMethod::Float16),
            config,
            seed,
            step: 0,
            velocity: BTreeMap::new(),
            shapes: BTreeMap::new(),
            parallelism: Parallelism::Auto,
            corrected: HashMap::new(),
            scratch: Vec::new(),
            sent: Vec::new(),
        };
        dgc.compressor = dgc.new_compressor(dgc.method_at(0));
        Ok(dgc)
    }

    /// The same DGC using `parallelism` for its compression (the bytes are the same).
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.parallelism = parallelism;
        self.compressor.set_parallelism(parallelism);
        self
    }

    /// The settings.
    pub fn config(&self) -> &DgcConfig {
        &self.config
    }

    /// The next step to run.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The velocity `u` of `name` after the last step (masked), if it has one.
    pub fn velocity(&self, name: &str) -> Option<&[f32]> {
        self.velocity.get(name).map(Vec::as_slice)
    }

    /// The error-feedback residual `v` of `name`, if it has one.
    pub fn residual(&self, name: &str) -> Option<&[f32]> {
        self.compressor.feedback().and_then(|f| f.residual(name))
    }

    /// The method of `step`: error feedback around top-k (or random-k) by ratio, the ratio the
    /// schedule's density of that step.
    pub fn method_at(&self, step: u64) -> CompressionMethod {
        let ratio = self.config.schedule.density(step);
        let values = self.config.values;
        let base = match self.config.selection {
            DgcSelection::TopK => CompressionMethod::TopKRatio { ratio, values },
            DgcSelection::RandomK => CompressionMethod::RandomKRatio { ratio, values },
        };
        base.with_error_feedback()
    }

    /// The manifest that `step`'s bundles are made and decoded with, for a model of `tensors`.
    ///
    /// # Errors
    /// As [`Manifest::new`].
    pub fn manifest_at(&self, tensors: Vec<TensorSpec>, step: u64) -> Result<Manifest> {
        Manifest::new(
            tensors,
            &self.method_at(step),
            self.seed,
            BucketConfig::none(),
        )
    }

    fn new_compressor(&self, method: CompressionMethod) -> GradientCompressor {
        let mut c = GradientCompressor::new(method)
            .with_seed(self.seed)
            .with_parallelism(self.parallelism);
        c.set_step(self.step);
        c
    }

    /// Moves the residuals to a compressor of `method` (a new stage of the schedule).
    fn switch_to(&mut self, method: CompressionMethod) -> Result<()> {
        if *self.compressor.method() == method {
            return Ok(());
        }
        // Built beside the old one, then swapped: an error leaves the residuals where they were.
        let mut next = self.new_compressor(method.clone());
        if let Some(old) = self.compressor.feedback() {
            let mut fb = ErrorFeedback::new(method.core_method()?, self.seed)?;
            fb.set_step(self.step);
            for (name, r) in old.residuals() {
                match old.residual_shape(name) {
                    Some(shape) => fb.set_residual_with_shape(name, shape, r.to_vec())?,
                    None => fb.set_residual(name, r.to_vec())?,
                }
            }
            next.restore_feedback(fb)?;
        }
        self.compressor = next;
        Ok(())
    }

    /// Runs one step of the recipe (see the module docs) on this rank's `gradients` and writes
    /// its bundle for `manifest` (which must be [`Dgc::manifest_at`] of this step) into `out`.
    /// Returns the step.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::UnexpectedTensor`] or [`Error::ShapeMismatch`] when
    /// `gradients` does not match the manifest; [`Error::Config`] when the manifest is of
    /// another step's density or another seed, or a tensor whose size changed since its
    /// velocity was made; [`Error::LengthChanged`] when it changed since its residual was
    /// made; [`Error::Core`] naming the tensor and index of a NaN
    /// or infinity in the gradient or in the corrected velocity `m u + g`. On error nothing
    /// changes (velocity, residuals, step) and `out` is cleared.
    pub fn compress_bundle(
        &mut self,
        manifest: &Manifest,
        gradients: &HashMap<String, Tensor>,
        rank: usize,
        out: &mut Vec<u8>,
    ) -> Result<u64> {
        out.clear();
        let step = self.step;
        self.switch_to(self.method_at(step))?;
        manifest.check_gradients(gradients)?;
        let mut names: Vec<(&String, &Tensor)> = gradients.iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        let scale = match self.config.clip_norm {
            Some(c) => {
                let sq: f64 = names
                    .iter()
                    .flat_map(|(_, t)| t.data())
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum();
                let norm = sq.sqrt();
                if norm > f64::from(c) {
                    (f64::from(c) / norm) as f32
                } else {
                    1.0
                }
            }
            None => 1.0,
        };
        let m = self.config.momentum;
        for (name, t) in &names {
            let g = t.data();
            let u = &mut self.scratch;
            u.clear();
            match self.velocity.get(*name) {
                Some(old) if old.len() == g.len() => {
                    u.extend(old.iter().zip(g).map(|(&u, &g)| m * u + scale * g));
                }
                Some(old) => {
                    return Err(Error::config(format!(
                        "DGC: the velocity of `{name}` has {} values, its gradient {} (a \
                         checkpoint of another model?)",
                        old.len(),
                        g.len()
                    )));
                }
                None => u.extend(g.iter().map(|&g| scale * g)),
            }
            match self.corrected.get_mut(*name) {
                Some(c) => c.assign(t.shape(), u)?,
                None => {
                    let c = Tensor::new(t.shape().to_vec(), u.clone())?;
                    self.corrected.insert((*name).clone(), c);
                }
            }
        }
        self.corrected.retain(|n, _| gradients.contains_key(n));
        self.compressor.set_step(step);
        self.compressor
            .compress_bundle(manifest, &self.corrected, rank, out)?;
        // Momentum factor masking: what was sent leaves the velocity too.
        // The rank's own bundle, just written: it decodes unless this crate has a bug.
        manifest
            .decode_bundle(out, None, Some(step), &mut self.sent)
            .map_err(|e| Error::Internal {
                what: format!("DGC could not decode its own bundle: {e}"),
            })?;
        for t in manifest.tensors() {
            let sent = &self.sent[t.offset..t.offset + t.numel];
            let Some(u) = self.corrected.get(&t.name) else {
                continue;
            };
            let v = self.velocity.entry(t.name.clone()).or_default();
            v.clear();
            v.extend(
                u.data()
                    .iter()
                    .zip(sent)
                    .map(|(&u, &s)| if s != 0.0 { 0.0 } else { u }),
            );
            self.shapes.insert(t.name.clone(), t.shape.clone());
        }
        self.step = self.step.wrapping_add(1);
        Ok(step)
    }

    /// This rank's state as a state file (`FORMAT.md` section 17) of format `gradwire-dgc`,
    /// version `1`: tensors `velocity:<name>` and `residual:<name>` in their tensors' shapes
    /// (a residual without a known shape as `[n]`); entries `config` (the configuration's
    /// text), `seed` and `step`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a shape of more dimensions than the safetensors reader takes;
    /// [`Error::Safetensors`] when serialization fails.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let entries = BTreeMap::from([
            ("config".to_owned(), self.config.text()),
            ("seed".to_owned(), self.seed.to_string()),
            ("step".to_owned(), self.step.to_string()),
        ]);
        let mut tensors: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for (name, u) in &self.velocity {
            let shape = self.shapes.get(name).cloned().unwrap_or(vec![u.len()]);
            tensors.push((format!("velocity:{name}"), shape, u));
        }
        if let Some(fb) = self.compressor.feedback() {
            for (name, r) in fb.residuals() {
                let shape = fb
                    .residual_shape(name)
                    .map_or(vec![r.len()], <[usize]>::to_vec);
                tensors.push((format!("residual:{name}"), shape, r));
            }
        }
        state_file::write(FORMAT, VERSION, &entries, &tensors)
    }

    /// The rank [`Dgc::to_bytes`] saved, for a run with `config`: it continues bit for bit.
    ///
    /// # Errors
    /// [`Error::Config`] as [`Dgc::new`]; [`Error::Safetensors`] for bytes that are not
    /// safetensors; [`Error::Checkpoint`] for what `FORMAT.md` section 17 refuses in any state
    /// file, a checkpoint of another configuration (both texts in the message), a `seed` or
    /// `step` that is not a u64, a tensor not named `velocity:` or `residual:`.
    pub fn from_bytes(config: DgcConfig, bytes: &[u8]) -> Result<Dgc> {
        let file = state_file::read(bytes, FORMAT, VERSION)?;
        let (text, ours) = (file.entry("config")?, config.text());
        if text != ours {
            return Err(Error::checkpoint(format!(
                "the checkpoint is of `{text}`, this run is `{ours}`"
            )));
        }
        let mut dgc = Dgc::new(config, file.number("seed")?)?;
        dgc.step = state_file::checked_step(file.number("step")?)?;
        let method = dgc.method_at(dgc.step);
        let mut fb = ErrorFeedback::new(method.core_method()?, dgc.seed)?;
        fb.set_step(dgc.step);
        for (key, (shape, values)) in file.tensors {
            match key.split_once(':') {
                Some(("velocity", name)) => {
                    dgc.shapes.insert(name.to_owned(), shape);
                    dgc.velocity.insert(name.to_owned(), values);
                }
                Some(("residual", name)) => fb
                    .set_residual_with_shape(name, &shape, values)
                    .map_err(|e| Error::checkpoint(format!("tensor `{key}`: {e}")))?,
                _ => {
                    return Err(Error::checkpoint(format!(
                        "tensor `{key}` is neither `velocity:<name>` nor `residual:<name>`"
                    )));
                }
            }
        }
        dgc.compressor = dgc.new_compressor(method);
        dgc.compressor.restore_feedback(fb)?;
        Ok(dgc)
    }
}

#[cfg(test)]
mod tests {
    use super::{DensitySchedule, Dgc, DgcConfig, DgcSelection};
    use crate::feedback::state_file::tests::refused_as_the_last_step;

    /// Issue 48 class 4: a DGC checkpoint of step `u64::MAX` (valid checksums) wrapped to step
    /// 0 one step later; it is refused, `u64::MAX - 1` is taken.
    #[test]
    fn a_checkpoint_with_no_step_after_its_own_is_refused() {
        let config = DgcConfig::new(DgcSelection::TopK, DensitySchedule::constant(0.01));
        for (step, ok) in [(u64::MAX, false), (u64::MAX - 1, true)] {
            let mut dgc = Dgc::new(config.clone(), 3).unwrap();
            dgc.step = step;
            let loaded = Dgc::from_bytes(config.clone(), &dgc.to_bytes().unwrap());
            if ok {
                loaded.unwrap();
            } else {
                refused_as_the_last_step(loaded);
            }
        }
    }

    /// Issue 48 class 2: a DGC checkpoint whose velocity is 3e38 (finite, valid checksums)
    /// loads, as any finite state does (FORMAT.md section 12); the step after the load runs,
    /// and the step whose `velocity + residual` overflows f32 fails naming the tensor, the
    /// index and the overflow, changing nothing (velocity, residual, step), so it fails again
    /// until the state is reset, as any overflowing aggregate does. A velocity of infinity or
    /// NaN is refused at load, naming the tensor and the index.
    #[test]
    fn a_finite_velocity_near_the_f32_limit_loads_and_the_step_it_overflows_fails_alike() {
        use crate::{Error, Tensor, TensorSpec};
        use std::collections::HashMap;
        let config = DgcConfig::new(DgcSelection::TopK, DensitySchedule::constant(0.25));
        let spec = || vec![TensorSpec::new("w", vec![8])];
        let grads = HashMap::from([("w".to_owned(), Tensor::vector(vec![1.0; 8]))]);
        let mut saved = Dgc::new(config.clone(), 3).unwrap();
        saved.shapes.insert("w".to_owned(), vec![8]);
        saved.velocity.insert("w".to_owned(), vec![3e38; 8]);
        let bytes = saved.to_bytes().unwrap();
        let mut dgc = Dgc::from_bytes(config.clone(), &bytes).unwrap();
        assert_eq!(dgc.velocity("w").unwrap(), &[3e38f32; 8][..]);
        let mut out = Vec::new();
        // Step 0: u = 0.9 * 3e38 + 1 and v = u: finite; two of eight sent.
        let manifest = dgc.manifest_at(spec(), 0).unwrap();
        assert_eq!(
            dgc.compress_bundle(&manifest, &grads, 0, &mut out).unwrap(),
            0
        );
        // Step 1: v = 2.7e38 + 2.43e38 overflows where nothing was sent.
        let manifest = dgc.manifest_at(spec(), 1).unwrap();
        let before = (
            dgc.velocity("w").unwrap().to_vec(),
            dgc.residual("w").unwrap().to_vec(),
        );
        for _ in 0..2 {
            let e = dgc
                .compress_bundle(&manifest, &grads, 0, &mut out)
                .unwrap_err()
                .to_string();
            assert!(e.contains("tensor `w`") && e.contains("overflow"), "{e}");
            assert!(out.is_empty());
            assert_eq!(dgc.step(), 1);
            assert_eq!(dgc.velocity("w").unwrap(), &before.0[..]);
            assert_eq!(dgc.residual("w").unwrap(), &before.1[..]);
        }
        // A non-finite velocity is refused at load, naming the tensor and the index.
        for bad in [f32::INFINITY, f32::NAN] {
            let mut v = vec![1.0f32; 8];
            v[5] = bad;
            saved.velocity.insert("w".to_owned(), v);
            match Dgc::from_bytes(config.clone(), &saved.to_bytes().unwrap()) {
                Err(Error::Checkpoint { reason }) => {
                    assert!(
                        reason.contains("velocity:w") && reason.contains("index 5"),
                        "{reason}"
                    )
                }
                other => panic!("{bad}: {:?}", other.map(|_| ())),
            }
        }
    }
}

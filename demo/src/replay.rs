//! The MiniLM replay workload (`--workload minilm-replay`): real gradients of a realistic size
//! instead of the MLP's, so that a step's codec and transfer time show at the size of a
//! transformer layer. The GPT-2 replay (`--workload gpt2-replay`) fills GPT-2 small's 148
//! shapes (124,439,808 values, `testdata/shapes/gpt2-small.txt`) with the same MiniLM values,
//! tiled: tensor after tensor in name order, the MiniLM tensors' values (name order,
//! concatenated) repeated from where the previous tensor stopped, with the same per-rank noise
//! (its scale from each GPT-2 tensor's own tiled values). The statistics are MiniLM's, the
//! size and the tensor boundaries GPT-2's.
//!
//! The gradients are the 12 f32 tensors (789,504 values) of all-MiniLM-L6-v2 in
//! `testdata/minilm_small_grads.safetensors` (one real training step; provenance in
//! `testdata/README.md`), embedded in the binary so that every MPI rank has them wherever it
//! runs. There is no model to train: every step, each rank's gradient is that step's tensors
//! with seeded noise of its own ([`ReplayGradients`]), and the mean gradient the collective
//! delivers moves a parameter vector (zeros at the start) by the same SGD-with-momentum update
//! as the MLP's, so that the replicas' agreement is checked exactly as in training. Accuracy and
//! loss are not defined (reported as 0).

use std::sync::OnceLock;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use crate::DemoError;
use crate::model::ParamSpec;

/// The safetensors file of the replay (copied unchanged from the shared data set).
const MINILM_GRADS: &[u8] = include_bytes!("../../testdata/minilm_small_grads.safetensors");

/// Standard deviation of each rank's noise, as a share of the tensor's RMS over its non-zero
/// elements: the ranks' gradients differ about as much as per-worker mini-batch gradients of
/// one step do, so top-k keeps partly different coordinates on every rank.
pub const NOISE_SHARE: f32 = 0.3;

/// The MiniLM tensors' specs and values, name order.
pub type Tensors = (Vec<ParamSpec>, Vec<Vec<f32>>);

/// The MiniLM tensors, name order: their specs and values, parsed once per process.
///
/// # Errors
/// [`DemoError::Config`] if the embedded file does not parse (it does).
pub fn minilm() -> Result<&'static Tensors, DemoError> {
    static PARSED: OnceLock<Result<Tensors, String>> = OnceLock::new();
    PARSED
        .get_or_init(|| {
            let mut tensors = gradwire::tensor::read_safetensors(MINILM_GRADS)
                .map_err(|e| format!("the embedded MiniLM gradients: {e}"))?;
            tensors.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(tensors
                .into_iter()
                .map(|(name, t)| {
                    let spec = ParamSpec {
                        name,
                        shape: t.shape().to_vec(),
                    };
                    (spec, t.data().to_vec())
                })
                .unzip())
        })
        .as_ref()
        .map_err(|e| DemoError::Config(e.clone()))
}

/// Specs of the MiniLM tensors, name order.
///
/// # Errors
/// As [`minilm`].
pub fn minilm_specs() -> Result<Vec<ParamSpec>, DemoError> {
    Ok(minilm()?.0.clone())
}

/// GPT-2 small's shapes, one tensor per line (name, then dimensions).
const GPT2_SHAPES: &str = include_str!("../../testdata/shapes/gpt2-small.txt");

/// Specs of GPT-2 small's 148 tensors (124,439,808 values), name order.
///
/// # Errors
/// [`DemoError::Config`] if the embedded list does not parse (it does).
pub fn gpt2_specs() -> Result<Vec<ParamSpec>, DemoError> {
    let mut specs = GPT2_SHAPES
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next().unwrap_or_default().to_owned();
            let shape = words
                .map(str::parse)
                .collect::<Result<Vec<usize>, _>>()
                .map_err(|e| DemoError::Config(format!("GPT-2 shapes, `{line}`: {e}")))?;
            Ok(ParamSpec { name, shape })
        })
        .collect::<Result<Vec<_>, DemoError>>()?;
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(specs)
}

/// The MiniLM values, name order, concatenated (the source every replay reads, cycled).
///
/// # Errors
/// As [`minilm`].
fn minilm_flat() -> Result<&'static [f32], DemoError> {
    static FLAT: OnceLock<Vec<f32>> = OnceLock::new();
    let values = &minilm()?.1;
    Ok(FLAT.get_or_init(|| values.iter().flatten().copied().collect()))
}

/// One rank's gradients of the replay: the MiniLM tensors plus, on every non-zero element,
/// uniform noise of standard deviation [`NOISE_SHARE`] x the tensor's RMS, drawn from
/// `(seed, rank)` step after step (the exact zeros of the embedding gradients stay zero, as
/// rows no token hit do in training). The GPT-2 replay reads the same values, tiled over its
/// shapes ([`ReplayGradients::tiled`]); no copy of them is kept beside the gradients.
#[derive(Debug)]
pub struct ReplayGradients {
    /// The MiniLM values, name order, concatenated.
    source: &'static [f32],
    /// Where each tensor's values start in `source` (read on, cycled, for its length).
    starts: Vec<usize>,
    amplitude: Vec<f32>,
    rng: SmallRng,
    grads: Vec<Vec<f32>>,
}

/// The base values from `start` of `source` on, cycled.
fn cycled(source: &[f32], start: usize) -> impl Iterator<Item = f32> + '_ {
    source[start.min(source.len())..]
        .iter()
        .chain(source.iter().cycle())
        .copied()
}

impl ReplayGradients {
    /// The gradients of `rank` for a run with `seed`.
    ///
    /// # Errors
    /// As [`minilm`].
    pub fn new(seed: u64, rank: usize) -> Result<ReplayGradients, DemoError> {
        Self::tiled(&minilm()?.0, seed, rank)
    }

    /// The gradients of `rank` for a run with `seed` in the shapes of `specs`, filled with the
    /// MiniLM values tiled (see the module docs): with the MiniLM specs, the MiniLM tensors.
    ///
    /// # Errors
    /// As [`minilm`].
    pub fn tiled(
        specs: &[ParamSpec],
        seed: u64,
        rank: usize,
    ) -> Result<ReplayGradients, DemoError> {
        let source = minilm_flat()?;
        let mut starts = Vec::with_capacity(specs.len());
        let mut at = 0;
        for spec in specs {
            starts.push(at);
            at = (at + spec.len()) % source.len().max(1);
        }
        let amplitude = specs
            .iter()
            .zip(&starts)
            .map(|(spec, &start)| {
                let (sum, n) = cycled(source, start)
                    .take(spec.len())
                    .filter(|x| *x != 0.0)
                    .fold((0.0f64, 0usize), |(s, n), x| {
                        (s + f64::from(x) * f64::from(x), n + 1)
                    });
                #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
                let rms = if n == 0 {
                    0.0
                } else {
                    (sum / n as f64).sqrt() as f32
                };
                // Uniform on [-a, a] has standard deviation a / sqrt(3).
                NOISE_SHARE * rms * 3f32.sqrt()
            })
            .collect();
        // One generator per (seed, rank); "replay" in the seed keeps it apart from the MLP's.
        let rng = SmallRng::seed_from_u64(
            (seed ^ 0x7265_706c_6179).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ rank as u64,
        );
        let grads = specs.iter().map(|s| vec![0.0; s.len()]).collect();
        Ok(ReplayGradients {
            source,
            starts,
            amplitude,
            rng,
            grads,
        })
    }

    /// The next step's gradients, one slice per tensor in name order.
    ///
    /// The noise is cheap on purpose (a fast generator, two values per 64-bit draw, no
    /// rejection): it stands in for the backward pass, whose time is not what the replay
    /// measures.
    pub fn next_step(&mut self) -> &[Vec<f32>] {
        for ((g, &start), &a) in self.grads.iter_mut().zip(&self.starts).zip(&self.amplitude) {
            let mut base = cycled(self.source, start);
            for g in g.chunks_mut(2) {
                let bits = self.rng.next_u64();
                #[allow(clippy::cast_possible_truncation)]
                let halves = [bits as u32, (bits >> 32) as u32];
                for (g, h) in g.iter_mut().zip(halves) {
                    let b = base.next().unwrap_or(0.0);
                    // 23 random mantissa bits: a value in [1, 2), then in [-1, 1).
                    let unit = f32::from_bits(0x3f80_0000 | (h >> 9)) * 2.0 - 3.0;
                    *g = if b == 0.0 { 0.0 } else { b + a * unit };
                }
            }
        }
        &self.grads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replay_has_the_minilm_tensors() {
        let (specs, values) = minilm().expect("embedded file");
        assert_eq!(specs.len(), 12);
        assert_eq!(specs.iter().map(ParamSpec::len).sum::<usize>(), 789_504);
        assert!(specs.windows(2).all(|w| w[0].name < w[1].name));
        assert!(specs.iter().zip(values).all(|(s, v)| s.len() == v.len()));
    }

    #[test]
    fn ranks_and_steps_differ_zeros_stay_and_runs_repeat() {
        let mut a = ReplayGradients::new(1, 0).expect("embedded file");
        let mut b = ReplayGradients::new(1, 1).expect("embedded file");
        let a1 = a.next_step().to_vec();
        let a2 = a.next_step().to_vec();
        let b1 = b.next_step().to_vec();
        assert_ne!(a1, a2);
        assert_ne!(a1, b1);
        assert_eq!(
            ReplayGradients::new(1, 0).expect("file").next_step(),
            &a1[..]
        );
        let (_, base) = minilm().expect("embedded file");
        for (g, b) in a1.iter().flatten().zip(base.iter().flatten()) {
            assert_eq!(*g == 0.0, *b == 0.0);
            assert!(g.is_finite());
        }
    }

    #[test]
    fn the_gpt2_replay_tiles_minilm_over_gpt2_shapes() {
        let specs = gpt2_specs().expect("embedded list");
        assert_eq!(specs.len(), 148);
        assert_eq!(specs.iter().map(ParamSpec::len).sum::<usize>(), 124_439_808);
        assert!(specs.windows(2).all(|w| w[0].name < w[1].name));
        // Small shapes (the tiling does not depend on the sizes): values follow the MiniLM
        // values, across tensors and around the end.
        let small = [
            ParamSpec {
                name: "a".into(),
                shape: vec![500_000],
            },
            ParamSpec {
                name: "b".into(),
                shape: vec![600_000],
            },
        ];
        let mut replay = ReplayGradients::tiled(&small, 1, 0).expect("embedded file");
        let source = minilm_flat().expect("file");
        let n = source.len();
        let flat: Vec<f32> = replay.next_step().iter().flatten().copied().collect();
        assert_eq!(flat.len(), 1_100_000);
        // Zeros where the cycled MiniLM values are zero, within the noise of them elsewhere.
        for (i, g) in flat.iter().enumerate() {
            let b = source[i % n];
            assert_eq!(*g == 0.0, b == 0.0, "{i}");
            assert!(g.is_finite());
        }
        assert!(flat[n] != 0.0 || source[0] == 0.0);
    }
}

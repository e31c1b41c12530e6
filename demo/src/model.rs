//! The MLP (64-256-256-10, ReLU) built with candle on the CPU.
//!
//! Parameters are named like PyTorch's (`l1.weight` of shape `[out, in]`, `l1.bias`, ...) and
//! always handled in name order: initialisation draws, gradients, messages and updates.
//! candle's CPU random generator cannot be seeded, so the weights are drawn here from a
//! ChaCha generator seeded by the run's seed.

use candle_core::{D, DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand::distr::{Distribution, Uniform};
use rand_chacha::ChaCha8Rng;

use crate::data::{CLASSES, FEATURES, Samples};

/// Width of the two hidden layers.
pub const HIDDEN: usize = 256;

/// Name and shape of one parameter tensor.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ParamSpec {
    /// Name, e.g. `l2.weight`.
    pub name: String,
    /// Shape, e.g. `[256, 256]` (`[out, in]` for weights).
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The parameters of the MLP in name order.
#[must_use]
pub fn param_specs() -> Vec<ParamSpec> {
    let layers = [(FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, CLASSES)];
    let mut specs = Vec::new();
    for (i, &(fan_in, fan_out)) in layers.iter().enumerate() {
        specs.push(ParamSpec {
            name: format!("l{}.bias", i + 1),
            shape: vec![fan_out],
        });
        specs.push(ParamSpec {
            name: format!("l{}.weight", i + 1),
            shape: vec![fan_out, fan_in],
        });
    }
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    specs
}

/// Draws the initial parameters from `seed`, in name order: weights Kaiming-uniform for ReLU
/// (bound `sqrt(6 / fan_in)`), biases uniform in `±1 / sqrt(fan_in)` (PyTorch's default for
/// `nn.Linear` biases).
#[must_use]
pub fn init_params(specs: &[ParamSpec], seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    specs
        .iter()
        .map(|spec| {
            let fan_in = if spec.name.ends_with(".weight") {
                spec.shape[1]
            } else {
                // The bias of layer i has the fan-in of layer i's weight.
                let weight = format!("{}weight", spec.name.trim_end_matches("bias"));
                specs
                    .iter()
                    .find(|s| s.name == weight)
                    .map_or(spec.shape[0], |w| w.shape[1])
            };
            #[allow(clippy::cast_precision_loss)]
            let fan_in = fan_in as f32;
            let bound = if spec.name.ends_with(".weight") {
                (6.0 / fan_in).sqrt()
            } else {
                1.0 / fan_in.sqrt()
            };
            let dist = Uniform::new_inclusive(-bound, bound).expect("finite bound");
            (0..spec.len()).map(|_| dist.sample(&mut rng)).collect()
        })
        .collect()
}

/// The MLP: one candle [`Var`] per parameter, in name order.
#[derive(Debug)]
pub struct Mlp {
    specs: Vec<ParamSpec>,
    vars: Vec<Var>,
    device: Device,
}

impl Mlp {
    /// Builds the model on the CPU with the given parameter values (name order).
    ///
    /// # Errors
    /// If a value vector does not match its tensor's size.
    pub fn new(params: &[Vec<f32>]) -> candle_core::Result<Mlp> {
        let device = Device::Cpu;
        let specs = param_specs();
        if params.len() != specs.len() {
            candle_core::bail!("expected {} tensors, got {}", specs.len(), params.len());
        }
        let vars = specs
            .iter()
            .zip(params)
            .map(|(s, v)| Var::from_slice(v, s.shape.as_slice(), &device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Mlp {
            specs,
            vars,
            device,
        })
    }

    /// The parameter names and shapes, in name order.
    #[must_use]
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Overwrites every parameter with `params` (name order).
    ///
    /// # Errors
    /// If a value vector does not match its tensor's size.
    pub fn set_params(&self, params: &[Vec<f32>]) -> candle_core::Result<()> {
        for ((var, spec), v) in self.vars.iter().zip(&self.specs).zip(params) {
            var.set(&Tensor::from_slice(v, spec.shape.as_slice(), &self.device)?)?;
        }
        Ok(())
    }

    fn var(&self, name: &str) -> &Var {
        let i = self
            .specs
            .iter()
            .position(|s| s.name == name)
            .expect("known parameter name");
        &self.vars[i]
    }

    fn linear(&self, x: &Tensor, layer: usize) -> candle_core::Result<Tensor> {
        let w = self.var(&format!("l{layer}.weight"));
        let b = self.var(&format!("l{layer}.bias"));
        x.matmul(&w.as_tensor().t()?)?.broadcast_add(b.as_tensor())
    }

    /// The logits `[n, CLASSES]` of `x` (`[n, FEATURES]`).
    ///
    /// # Errors
    /// If `x` has the wrong shape.
    pub fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.linear(x, 1)?.relu()?;
        let h = self.linear(&h, 2)?.relu()?;
        self.linear(&h, 3)
    }

    fn inputs(&self, samples: &Samples) -> candle_core::Result<(Tensor, Tensor)> {
        let x = Tensor::from_slice(&samples.x, (samples.len(), FEATURES), &self.device)?;
        let y = Tensor::from_slice(&samples.y, samples.len(), &self.device)?;
        Ok((x, y))
    }

    /// Mean cross-entropy over `batch` and its gradient, one flat vector per parameter in
    /// name order (computed by candle's autograd).
    ///
    /// # Errors
    /// If candle fails, or a parameter got no gradient.
    pub fn loss_and_grads(&self, batch: &Samples) -> candle_core::Result<(f32, Vec<Vec<f32>>)> {
        let (x, y) = self.inputs(batch)?;
        let loss = candle_nn::loss::cross_entropy(&self.logits(&x)?, &y)?;
        let grads = loss.backward()?;
        let flat = self
            .vars
            .iter()
            .zip(&self.specs)
            .map(|(var, spec)| match grads.get(var.as_tensor()) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>(),
                None => candle_core::bail!("no gradient for {}", spec.name),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((loss.to_scalar::<f32>()?, flat))
    }

    /// Mean cross-entropy and accuracy (share of correct predictions) over `samples`.
    ///
    /// # Errors
    /// If candle fails.
    pub fn evaluate(&self, samples: &Samples) -> candle_core::Result<(f32, f32)> {
        let (x, y) = self.inputs(samples)?;
        let logits = self.logits(&x)?.detach();
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?;
        let correct = logits
            .argmax(D::Minus1)?
            .eq(&y)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        #[allow(clippy::cast_precision_loss)]
        let accuracy = correct / samples.len() as f32;
        Ok((loss, accuracy))
    }
}

/// Makes candle's matrix products run on the calling thread only (process-wide).
///
/// The demo parallelises over ranks (threads, or processes under MPI); candle would otherwise
/// hand every small matrix product to rayon's pool, which all ranks then share: measured here
/// 3x slower for one rank. On one thread, a rank's arithmetic also does not depend on how many
/// cores the machine has.
pub fn single_threaded_matmul() {
    gemm::set_threading_threshold(usize::MAX);
}

/// A 64-bit digest of the parameters' bits (name order; four interleaved FNV-1a lanes): equal digests on two ranks
/// mean bit-identical replicas.
#[must_use]
pub fn digest(params: &[Vec<f32>]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    // Four FNV-1a lanes over the values' bit patterns, one 32-bit word per multiply, so that
    // four multiply chains are in flight (a byte-wise chain took about 4 ms per step for the
    // 789,504 values of the MiniLM replay); each tensor's length is folded in after it.
    let mut lanes = [0u64, 1, 2, 3].map(|i| 0xcbf2_9ce4_8422_2325 ^ i);
    for tensor in params {
        for chunk in tensor.chunks(4) {
            for (lane, v) in lanes.iter_mut().zip(chunk) {
                *lane = (*lane ^ u64::from(v.to_bits())).wrapping_mul(PRIME);
            }
        }
        lanes[0] = (lanes[0] ^ tensor.len() as u64).wrapping_mul(PRIME);
    }
    lanes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &l| (h ^ l).wrapping_mul(PRIME))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_in_name_order() {
        let names: Vec<String> = param_specs().into_iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "l1.bias",
                "l1.weight",
                "l2.bias",
                "l2.weight",
                "l3.bias",
                "l3.weight"
            ]
        );
        let n: usize = param_specs().iter().map(ParamSpec::len).sum();
        assert_eq!(n, 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
    }

    #[test]
    fn init_is_seeded() {
        let specs = param_specs();
        assert_eq!(init_params(&specs, 1), init_params(&specs, 1));
        assert_ne!(init_params(&specs, 1), init_params(&specs, 2));
        let p = init_params(&specs, 3);
        let bound = (6.0f32 / 64.0).sqrt();
        assert!(p[1].iter().all(|v| v.abs() <= bound));
    }
}

//! The error-feedback steps of [`ErrorFeedback`] over named slices: each builds a manifest of
//! the given tensors (one entry each, in the given order) and runs the engine on the calling
//! thread, so that they write the same frames and residuals as a compressor does.

use super::{Engine, Exec, Shapes};
use crate::error::Result;
use crate::feedback::{ErrorFeedback, check_holds};
use crate::layout::{BucketConfig, Manifest, TensorSpec};
use crate::method::CompressionMethod;

impl ErrorFeedback {
    /// One step over a model: for every `(name, gradient)` of `grads`, in that order, encodes
    /// `gradient + residual` with `Params { method, seed, step, tensor_id: tensor_id(name) }`,
    /// updates the residual and
    /// hands the frame to `sink(name, frame)`. Then the step counter advances.
    ///
    /// No shapes: element counts are checked, shapes are not (see the module docs); prefer
    /// [`ErrorFeedback::step_with_shapes`] when the tensors have them. Runs on the calling
    /// thread and allocates its frame buffers each call; for a steady state that allocates
    /// nothing, or for every core, use a [`crate::GradientCompressor`].
    ///
    /// # Errors
    /// Nothing changes on error (no residual, not the step counter, no call of `sink`):
    /// [`crate::Error::DuplicateTensor`] for a name given twice;
    /// [`crate::Error::LengthChanged`] when a tensor's element count differs from its
    /// residual's; [`crate::Error::Core`] naming the tensor for NaN/Inf in the gradient or in
    /// `gradient + residual` ([`gradwire_core::Error::NonFinite`], with the first bad index; a
    /// finite sum beyond the range of f16/bf16 values is sent saturated, its excess kept).
    pub fn step_with<'a, I>(&mut self, grads: I, sink: impl FnMut(&str, &[u8])) -> Result<()>
    where
        I: IntoIterator<Item = (&'a str, &'a [f32])>,
    {
        let items = grads
            .into_iter()
            .map(|(name, g)| (TensorSpec::new(name, [g.len()]), g))
            .collect();
        self.run_step(items, Shapes::Ignored, Exec::Serial, sink)
    }

    /// [`ErrorFeedback::step_with`] for tensors with shapes: `grads` yields `(name, shape,
    /// gradient)` with `gradient.len()` the product of `shape` (row-major, as safetensors and
    /// [`crate::Tensor`] keep it; `[]` for a 0-d tensor). A residual remembers its tensor's shape, and a
    /// tensor that comes back in another shape is an error, as is one whose residual was
    /// restored from a checkpoint in another shape.
    ///
    /// # Errors
    /// As [`ErrorFeedback::step_with`]; [`crate::Error::ShapeChanged`] (nothing changes) when a
    /// tensor comes in another shape of the same element count as the one its residual
    /// remembers (another count is [`crate::Error::LengthChanged`]);
    /// [`crate::Error::ShapeMismatch`] when `gradient.len()` is not the product of `shape`
    /// (`got` is then `[gradient.len()]`).
    pub fn step_with_shapes<'a, I>(&mut self, grads: I, sink: impl FnMut(&str, &[u8])) -> Result<()>
    where
        I: IntoIterator<Item = (&'a str, &'a [usize], &'a [f32])>,
    {
        let mut items = Vec::new();
        for (name, shape, g) in grads {
            check_holds(name, shape, g.len())?;
            items.push((TensorSpec::new(name, shape), g));
        }
        self.run_step(items, Shapes::Checked, Exec::Serial, sink)
    }

    /// The engine's step over `items` (a manifest of them, one entry each, in order), run by
    /// `exec` (the public steps run on the calling thread).
    fn run_step(
        &mut self,
        items: Vec<(TensorSpec, &[f32])>,
        shapes: Shapes,
        exec: Exec,
        mut sink: impl FnMut(&str, &[u8]),
    ) -> Result<()> {
        let grads: Vec<&[f32]> = items.iter().map(|(_, g)| *g).collect();
        let specs = items.into_iter().map(|(spec, _)| spec).collect();
        let method = CompressionMethod::Core(*self.method());
        let manifest = Manifest::new(specs, &method, self.seed(), BucketConfig::none())?;
        let step = self.step();
        Engine::default().encode(
            &manifest,
            grads.as_slice(),
            step,
            Some(self),
            (exec, shapes),
            |e, frame| sink(&manifest.entries()[e].label, frame),
        )
    }
}

#[cfg(test)]
mod tests {
    use gradwire_core::{K, Method, Params, ResidualBound, Values, tensor_id};

    use crate::error::Error;
    use crate::feedback::ErrorFeedback;
    use crate::method::DEFAULT_INT8_BLOCK;

    /// The integration tests' generator (`tests/common`): SplitMix64.
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

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    fn topk_int8() -> Method {
        Method::TopK {
            k: K::Ratio(0.01),
            values: Values::Int8 {
                block: DEFAULT_INT8_BLOCK,
            },
        }
    }

    /// Large dense, quantization and sign tensors with error feedback are encoded in chunks,
    /// and each step keeps its new residual's largest magnitude, measured tile by tile, as the
    /// residual's bound: the next step's check then reads the gradient alone. Frames and
    /// residuals are the plain `feedback_step`'s on the same residual; the kept bound is the
    /// residual's largest magnitude exactly, after every step (serial and pooled); a NaN in
    /// another tensor still changes nothing, and a gradient at 2^127 (its sum finite, but not
    /// proven by the bound) still steps.
    #[test]
    fn chunked_dense_steps_keep_the_residual_bound() {
        use super::{Exec, Shapes, TensorSpec};
        use gradwire_core::{SignScale, feedback_step, max_frame_len, scratch_len};
        let n = 140_000; // above the size from which a tensor is encoded in chunks (131,072)
        let methods = [
            Method::Quant {
                bits: 4,
                block: 512,
                rounding: gradwire_core::Rounding::NearestEven,
            },
            Method::Sign {
                scale: SignScale::MeanAbs { block: 32 },
                zero_mask: false,
            },
            Method::Dense {
                values: Values::F16,
            },
        ];
        for method in methods {
            for exec in [Exec::Serial, Exec::Pool] {
                let what = format!("{method:?}, {exec:?}");
                let mut rng = Rng(0xd5);
                let mut fb = ErrorFeedback::new(method, 3).unwrap();
                let mut plain = [vec![0.0f32; n], vec![0.0f32; n]];
                let mut scratch = vec![0u32; scratch_len(n, &method)];
                let mut out = vec![0u8; max_frame_len(n, &method)];
                let names = ["a", "b"];
                for step in 0..4 {
                    let mut g: Vec<Vec<f32>> = (0..2)
                        .map(|_| (0..n).map(|_| rng.unit() * (1 + step) as f32).collect())
                        .collect();
                    if step == 3 {
                        // Finite, with a finite sum, but beyond what the bound proves: the full
                        // check runs and passes (f16 saturates it, the residual keeps the rest).
                        g[0][n / 2] = 2.0f32.powi(127);
                    }
                    let mut frames = Vec::new();
                    let items = names
                        .iter()
                        .zip(&g)
                        .map(|(name, g)| (TensorSpec::new(*name, [n]), &g[..]))
                        .collect();
                    fb.run_step(items, Shapes::Ignored, exec, |_, f| frames.push(f.to_vec()))
                        .unwrap_or_else(|e| panic!("{what}, step {step}: {e}"));
                    for (t, name) in names.iter().enumerate() {
                        let params = Params::new(method)
                            .with_seed(3)
                            .at_step(step)
                            .for_tensor(tensor_id(name));
                        let len =
                            feedback_step(&g[t], &mut plain[t], &params, &mut scratch, &mut out)
                                .unwrap();
                        assert_eq!(frames[t], out[..len], "{what}, step {step} `{name}`: frame");
                        assert!(
                            same_bits(fb.residual(name).unwrap(), &plain[t]),
                            "{what}, step {step} `{name}`: residual"
                        );
                        let measured = ResidualBound::of(&plain[t]).max_abs();
                        let bound = fb.residual_bound(name).max_abs();
                        assert_eq!(bound, measured, "{what}, step {step} `{name}`: bound");
                    }
                }
                a_nan_changes_nothing(&mut fb, &mut rng, n, &what);
            }
        }
    }

    /// Large top-k tensors take the core's one-pass step with the bound each residual keeps: the
    /// frames and residuals are those of the plain `feedback_step` on the same residual, across a
    /// `set_residual`, a clone and a checkpoint round trip (each restarts from a measured or unknown
    /// bound), and a NaN in another tensor still changes nothing.
    #[test]
    fn steps_with_residual_bounds_equal_plain_steps() {
        use gradwire_core::{feedback_step, max_frame_len, scratch_len};
        let method = topk_int8();
        let n = 70_000; // above the core's sampling minimum (65,536)
        let mut rng = Rng(0xb0);
        let mut fb = ErrorFeedback::new(method, 3).unwrap();
        let mut plain = [vec![0.0f32; n], vec![0.0f32; n]];
        let mut scratch = vec![0u32; scratch_len(n, &method)];
        let mut out = vec![0u8; max_frame_len(n, &method)];
        let names = ["a", "b"];
        for step in 0..8 {
            let g: Vec<Vec<f32>> = (0..2)
                .map(|_| (0..n).map(|_| rng.unit() * (1 + step) as f32).collect())
                .collect();
            let mut frames = Vec::new();
            fb.step_with(names.iter().zip(&g).map(|(n, g)| (*n, &g[..])), |_, f| {
                frames.push(f.to_vec())
            })
            .unwrap();
            for (t, name) in names.iter().enumerate() {
                let params = Params::new(method)
                    .with_seed(3)
                    .at_step(step)
                    .for_tensor(tensor_id(name));
                let len =
                    feedback_step(&g[t], &mut plain[t], &params, &mut scratch, &mut out).unwrap();
                assert_eq!(frames[t], out[..len], "step {step} `{name}`: frame");
                assert!(
                    same_bits(fb.residual(name).unwrap(), &plain[t]),
                    "step {step} `{name}`: residual"
                );
            }
            // Each step leaves a bound that holds: the first after a load measures the residual
            // (two passes); the others are one pass, whose bound (the smallest kept magnitude) is
            // above the residual's largest here.
            for name in names {
                let measured = ResidualBound::of(fb.residual(name).unwrap()).max_abs();
                let bound = fb.residual_bound(name).max_abs();
                match step {
                    5 => assert_eq!(bound, measured, "step {step} `{name}`"),
                    _ => assert!(bound > measured, "step {step} `{name}`"),
                }
            }
            match step {
                2 => fb.set_residual("a", plain[0].clone()).unwrap(),
                4 => {
                    fb = ErrorFeedback::from_bytes(&fb.to_bytes().unwrap()).unwrap();
                    assert_eq!(fb.residual_bound("a"), ResidualBound::UNKNOWN);
                }
                5 => fb = fb.clone(),
                _ => {}
            }
        }
        a_nan_changes_nothing(&mut fb, &mut rng, n, "top-k");
    }

    /// All or nothing: a step of "a" (passing the bound's check) and "b" (a NaN in its last
    /// element) fails naming "b", hands out no frame and changes nothing.
    fn a_nan_changes_nothing(fb: &mut ErrorFeedback, rng: &mut Rng, n: usize, what: &str) {
        let before = fb.clone();
        let a: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let mut b = a.clone();
        b[n - 1] = f32::NAN;
        let mut calls = 0;
        let err = fb
            .step_with([("a", &a[..]), ("b", &b[..])], |_, _| calls += 1)
            .unwrap_err();
        assert!(
            matches!(&err, Error::Core { tensor, source: gradwire_core::Error::NonFinite { index }, .. } if tensor == "b" && *index == n - 1),
            "{what}: {err}"
        );
        assert_eq!((calls, &*fb), (0, &before), "{what}");
    }
}

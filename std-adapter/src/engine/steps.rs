//! The error-feedback steps of [`ErrorFeedback`] over named slices: each builds a manifest of
//! the given tensors (one entry each, in the given order) and runs the engine on the calling
//! thread, so that they write the same frames and residuals as a compressor does.

use std::collections::{BTreeMap, HashMap};

use super::{Engine, Exec, Shapes};
use crate::error::Result;
use crate::feedback::{ErrorFeedback, check_holds};
use crate::layout::{BucketConfig, Manifest, TensorSpec};
use crate::method::CompressionMethod;
use crate::tensor::Tensor;

impl ErrorFeedback {
    /// One step over a model: for every `(name, gradient)` of `grads`, in that order, encodes
    /// `gradient + residual` with [`ErrorFeedback::params`]`(name)`, updates the residual and
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
    /// `gradient + residual` ([`gradwire_core::Error::NonFinite`], with the first bad index) or
    /// a value beyond the range of f16/bf16 values ([`gradwire_core::Error::ValueOutOfRange`]).
    pub fn step_with<'a, I>(&mut self, grads: I, sink: impl FnMut(&str, &[u8])) -> Result<()>
    where
        I: IntoIterator<Item = (&'a str, &'a [f32])>,
    {
        let items = grads
            .into_iter()
            .map(|(name, g)| (TensorSpec::new(name, [g.len()]), g))
            .collect();
        self.run_step(items, Shapes::Ignored, sink)
    }

    /// [`ErrorFeedback::step_with`] for tensors with shapes: `grads` yields `(name, shape,
    /// gradient)` with `gradient.len()` the product of `shape` (row-major, as safetensors and
    /// [`Tensor`] keep it; `[]` for a 0-d tensor). A residual remembers its tensor's shape, and a
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
        self.run_step(items, Shapes::Checked, sink)
    }

    /// One step over named tensors in sorted name order (see
    /// [`ErrorFeedback::step_with_shapes`]), returning each tensor's frame.
    ///
    /// # Errors
    /// As [`ErrorFeedback::step_with_shapes`].
    pub fn step_tensors(
        &mut self,
        grads: &HashMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        let mut sorted: Vec<(&str, &[usize], &[f32])> = grads
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape(), t.data()))
            .collect();
        sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut out = BTreeMap::new();
        self.step_with_shapes(sorted, |name, frame| {
            out.insert(name.to_owned(), frame.to_vec());
        })?;
        Ok(out)
    }

    /// The engine's step over `items` (a manifest of them, one entry each, in order).
    fn run_step(
        &mut self,
        items: Vec<(TensorSpec, &[f32])>,
        shapes: Shapes,
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
            (Exec::Serial, shapes),
            |e, frame| sink(&manifest.entries()[e].label, frame),
        )
    }
}

//! The caller's tensors during one step of a collective: the gradients it reads and the
//! outputs it writes, either apart (the `HashMap` API: gradients borrowed, output tensors
//! reused) or one buffer per tensor read and then overwritten with the result (the in-place
//! API). Every route reads the gradients (its encode, its finiteness check) before it writes
//! the outputs of the same elements, so one engine serves both.

use std::collections::HashMap;

use crate::engine::Gradients;
use crate::error::{Error, Result};
use crate::layout::Manifest;
use crate::tensor::Tensor;

/// One step's gradients and outputs, each tensor's elements in the manifest's tensor order.
pub(crate) struct StepBuffers<'a> {
    /// The gradients when they are apart from the outputs; empty in place.
    grads: Vec<&'a [f32]>,
    /// The outputs (in place: the gradients too).
    outs: Vec<&'a mut [f32]>,
    in_place: bool,
}

impl<'a> StepBuffers<'a> {
    /// No buffers: a rank whose step failed before it had a manifest.
    pub(crate) fn none() -> Self {
        StepBuffers {
            grads: Vec::new(),
            outs: Vec::new(),
            in_place: false,
        }
    }

    /// The tensors of `grads` read and those of `out` written, `out` first shaped as the
    /// manifest's tensors (its tensors reused, others removed).
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when `grads` lacks a tensor of the manifest (a manifest made
    /// for other gradients); [`Error::OutOfMemory`] when an output cannot be allocated.
    pub(crate) fn apart(
        manifest: &Manifest,
        grads: &'a HashMap<String, Tensor>,
        out: &'a mut HashMap<String, Tensor>,
    ) -> Result<Self> {
        let grads = manifest
            .tensors()
            .iter()
            .map(|t| {
                grads
                    .get(&t.name)
                    .map(Tensor::data)
                    .ok_or_else(|| Error::MissingTensor {
                        tensor: t.name.clone(),
                        rank: None,
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        manifest.shape_outputs(out)?;
        let outs = manifest
            .tensor_outputs(out)
            .ok_or_else(|| Error::internal("outputs shaped for another manifest"))?;
        Ok(StepBuffers {
            grads,
            outs,
            in_place: false,
        })
    }

    /// Each tensor read and then overwritten with its result: `bufs` in the manifest's tensor
    /// order, each of its tensor's length.
    ///
    /// # Errors
    /// An internal error when `bufs` does not match the manifest.
    pub(crate) fn in_place(manifest: &Manifest, bufs: Vec<&'a mut [f32]>) -> Result<Self> {
        let fits = bufs.len() == manifest.tensors().len()
            && bufs
                .iter()
                .zip(manifest.tensors())
                .all(|(b, t)| b.len() == t.numel);
        if !fits {
            return Err(Error::internal("in-place buffers of another model"));
        }
        Ok(StepBuffers {
            grads: Vec::new(),
            outs: bufs,
            in_place: true,
        })
    }

    /// The outputs, each tensor's elements in the manifest's tensor order. In place they are
    /// the gradients: a route writes an element only after it has read it.
    pub(crate) fn outs(&mut self) -> &mut [&'a mut [f32]] {
        &mut self.outs
    }

    /// Writes NaN into every output element: the result of a step skipped for a non-finite
    /// gradient (`CompressedAllReduce::with_skip_non_finite`). Returns `true`.
    pub(crate) fn skip_step(&mut self) -> bool {
        for out in &mut self.outs {
            out.fill(f32::NAN);
        }
        true
    }

    /// Writes each gradient into its output (a group of one's uncompressed mean); in place
    /// there is nothing to write.
    pub(crate) fn copy_gradients_to_outputs(&mut self) {
        if self.in_place {
            return;
        }
        for (o, g) in self.outs.iter_mut().zip(&self.grads) {
            o.copy_from_slice(g);
        }
    }

    /// Elements `range` of tensor `t`'s output holding its gradient's values (copied there
    /// when the two are apart), for a route that reduces them where they lie.
    ///
    /// # Panics
    /// When `t` or `range` is outside the manifest's tensors (a caller's bug, not input data).
    pub(crate) fn output_holding_gradient(
        &mut self,
        t: usize,
        range: std::ops::Range<usize>,
    ) -> &mut [f32] {
        let out = &mut self.outs[t][range.clone()];
        if !self.in_place {
            out.copy_from_slice(&self.grads[t][range]);
        }
        out
    }

    /// Every gradient, in the manifest's tensor order.
    pub(crate) fn gradients(&self) -> impl Iterator<Item = &[f32]> {
        (0..self.outs.len()).map(|t| self.tensor(t))
    }

    fn tensor(&self, t: usize) -> &[f32] {
        if self.in_place {
            self.outs.get(t).map_or(&[], |s| &**s)
        } else {
            self.grads.get(t).copied().unwrap_or(&[])
        }
    }
}

impl Gradients for StepBuffers<'_> {
    fn grad(&self, _: &Manifest, t: usize) -> &[f32] {
        self.tensor(t)
    }
}

//! [`ErrorFeedback`]: residuals keyed by parameter name over
//! [`gradwire_core::feedback_step_bounded`], with checkpoints.
//!
//! Each step encodes `gradient + residual` for every tensor and keeps in the residual what the
//! frame does not deliver (dropped entries, rounding and quantization error), so for every
//! coordinate `sent + residual_new == gradient + residual_old`, in f32 arithmetic: bit for bit
//! where values travel as f32, and for top-k with int8 values and nearest-even quantization,
//! whose sent value is within a factor of two of the input, so that the residual's subtraction
//! is exact (Sterbenz). Where the sent value can be far larger than the coordinate (sign's
//! block scale against a tiny gradient, stochastic rounding), the identity holds up to one f32
//! rounding of the sum: sign sends 0.5 for a coordinate of 1e-9 in a block whose scale is
//! 0.5, and the residual `1e-9 - 0.5` rounds to -0.5. The frames of step `s` are
//! made with `Params { method, seed, step: s, tensor_id: tensor_id(name) }`.
//!
//! Rules:
//! - a tensor seen for the first time starts from a zero residual; a tensor whose element count
//!   changes is an error ([`Error::LengthChanged`]), never truncated or padded;
//! - a residual remembers its tensor's shape once a step gave one ([`ErrorFeedback::step_tensors`],
//!   [`ErrorFeedback::step_with_shapes`], and the bundle and compressor paths, which know their
//!   tensors' shapes): a tensor that comes back with the same element count in another shape (a
//!   transposed weight) is an error ([`Error::ShapeChanged`]), since its old residual would be
//!   added to the wrong coordinates. [`ErrorFeedback::step_with`] gives no shapes: it checks
//!   element counts only, and a residual it creates has no shape until a shaped step gives one;
//! - a step is all or nothing: every tensor is checked (lengths, NaN/Inf in the gradient and in
//!   `gradient + residual`, the value type's range) before any residual changes, so a NaN in one
//!   tensor leaves every residual, and the step counter, unchanged. Each residual keeps the
//!   bound its last step left ([`gradwire_core::ResidualBound`]), so that for top-k a gradient
//!   below half the value type's range is checked alone (one read), where the sums would be
//!   read; a residual set, restored or loaded starts with an unknown bound or its measured one;
//! - [`ErrorFeedback::save`] writes a safetensors file holding every residual (f32, exact bits,
//!   in its tensor's shape) and, in its `__metadata__`, the step, the seed and the method; a run
//!   restored with [`ErrorFeedback::load`] continues bit-identically to one that was never
//!   interrupted, shape checks included.
//!
//! # Checkpoint layout
//! A safetensors file with one F32 tensor per residual, keyed by the parameter name, in the
//! shape the residual remembers (`[n]` for one without a shape), and these `__metadata__`
//! entries:
//!
//! | key | value |
//! |---|---|
//! | `format` | `gradwire-error-feedback` |
//! | `version` | `3` |
//! | `method` | [`crate::compressor::format_method`] of the method |
//! | `seed` | the seed, decimal |
//! | `step` | the next step to run, decimal |
//! | `unshaped` | a compact JSON array (no whitespace needed; at most 6 bytes per byte of each name, as JSON escapes) of the names whose residual has no shape (stored as `[n]`), in strictly increasing byte-wise (UTF-8, code point) order; usually `[]` |
//! | `crc32` | CRC-32 (IEEE, as in frames), decimal, of: for each residual in name order, its name, a 0 byte, its stored shape (the number of dimensions as u32, then each dimension as u64, little-endian) and its values (f32 little-endian); then the `method`, `seed`, `step` and `unshaped` texts, each followed by a 0 byte |
//!
//! A residual has at most [`crate::safetensors_checked::MAX_DIMS`] dimensions. The checksum makes
//! a flipped bit in a stored residual, shape or step an error, as it is in frames and bundles.
//! Version 2 files (the same without shapes: every residual `[n]`, no `unshaped`, and a checksum
//! without the shape and `unshaped` parts) and version 1 files (no `crc32`) still load; their
//! residuals have no shape until a shaped step gives one.
//!
//! ```
//! use gradwire::core::{K, Method, Values};
//! use gradwire::feedback::ErrorFeedback;
//!
//! let method = Method::TopK { k: K::Count(1), values: Values::F32 };
//! let mut fb = ErrorFeedback::new(method, 7)?;
//! let grad = [1.0_f32, -3.0, 0.5];
//! let mut sent = Vec::new();
//! fb.step_with([("w", &grad[..])], |_name, frame| sent.push(frame.len()))?;
//! assert_eq!(fb.step(), 1);
//! // -3.0 was sent; the rest waits in the residual.
//! assert_eq!(fb.residual("w"), Some(&[1.0_f32, 0.0, 0.5][..]));
//! # Ok::<(), gradwire::error::Error>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use gradwire_core::{
    Method, Params, ResidualBound, SignScale, Values, feedback_step_bounded, max_frame_len, scalar,
    scratch_len, tensor_id, values,
};
use safetensors::tensor::Dtype;

use crate::compressor::{format_method, parse_method};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Value of the `format` metadata entry of a checkpoint.
pub const CHECKPOINT_FORMAT: &str = "gradwire-error-feedback";
/// Value of the `version` metadata entry of a checkpoint.
pub const CHECKPOINT_VERSION: &str = "3";

/// Residuals keyed by parameter name, the method, the seed and the step counter of an
/// error-feedback run.
#[derive(Clone, Debug)]
pub struct ErrorFeedback {
    method: Method,
    seed: u64,
    step: u64,
    residuals: BTreeMap<String, Vec<f32>>,
    /// The shape of each residual whose step gave one (element count = the residual's length).
    shapes: BTreeMap<String, Vec<usize>>,
    /// A bound on each residual's magnitudes, left by its last step (see
    /// [`gradwire_core::ResidualBound`]); a residual without one has an unknown bound. Made
    /// unknown wherever a residual changes outside a step of this type.
    bounds: BTreeMap<String, ResidualBound>,
    scratch: Vec<u32>,
    frame: Vec<u8>,
    ids: Vec<u64>,
}

impl PartialEq for ErrorFeedback {
    /// Equal when method, seed, step, every residual (bit for bit) and every residual's shape
    /// are equal.
    fn eq(&self, other: &Self) -> bool {
        self.method == other.method
            && self.seed == other.seed
            && self.step == other.step
            && self.shapes == other.shapes
            && self.residuals.len() == other.residuals.len()
            && self
                .residuals
                .iter()
                .zip(&other.residuals)
                .all(|((na, a), (nb, b))| {
                    na == nb
                        && a.len() == b.len()
                        && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                })
    }
}

/// Checks the method for error feedback.
fn check_method(method: &Method) -> Result<()> {
    method
        .validate()
        .map_err(|e| Error::config(format!("{} ({e})", format_method(method))))?;
    match method {
        Method::Sign {
            scale: SignScale::None,
        } => Err(Error::config(
            "error feedback needs a scaled sign: with unscaled sign the residual grows without bound",
        )),
        Method::RandomK { unbiased: true, .. } => Err(Error::config(
            "error feedback with unbiased random-k: the residual grows without bound",
        )),
        _ => Ok(()),
    }
}

/// Checks what one error-feedback step on `grad` would read, before anything changes: the
/// residual's length, NaN/Inf in `grad` and in `grad + residual`, and the value type's range.
/// Indices in errors are within the tensor, and are those the core reports.
pub(crate) fn check_step_input(
    tensor: &str,
    grad: &[f32],
    residual: Option<&[f32]>,
    values: Option<Values>,
) -> Result<()> {
    if let Some(r) = residual
        && r.len() != grad.len()
    {
        return Err(Error::LengthChanged {
            tensor: tensor.to_owned(),
            expected: r.len(),
            got: grad.len(),
        });
    }
    // Fast path: one SIMD pass over `grad + residual` against the value type's magnitude
    // limit (NaN and infinity never pass).
    let limit = values::magnitude_limit(values);
    let within = match residual {
        None => values::first_at_or_above(grad, limit).is_none(),
        Some(r) => {
            const CHUNK: usize = 1024;
            let mut sum = [0.0f32; CHUNK];
            grad.chunks(CHUNK).zip(r.chunks(CHUNK)).all(|(g, r)| {
                let s = &mut sum[..g.len()];
                for ((s, g), r) in s.iter_mut().zip(g).zip(r) {
                    *s = g + r;
                }
                values::first_at_or_above(s, limit).is_none()
            })
        }
    };
    if within {
        return Ok(());
    }
    // Something is out of limit: the first offender, in the core's order (a non-finite
    // gradient makes its sum non-finite, so one walk over the sums names either kind).
    let core = |e| Err(Error::core(tensor, None, e));
    let sum_at = |i: usize| grad[i] + residual.and_then(|r| r.get(i)).copied().unwrap_or(0.0);
    if let Some(index) = (0..grad.len()).position(|i| !sum_at(i).is_finite()) {
        return core(gradwire_core::Error::NonFinite { index });
    }
    // Every sum is finite here, so only the range of the value type remains.
    if let Some(index) = (0..grad.len()).position(|i| sum_at(i).abs() >= limit) {
        return core(gradwire_core::Error::ValueOutOfRange { index });
    }
    Ok(())
}

/// The element count of `shape` (`None` when it overflows `usize`).
fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// [`Error::ShapeMismatch`] (`got` is `[len]`) unless `shape` holds `len` elements.
fn check_holds(name: &str, shape: &[usize], len: usize) -> Result<()> {
    if element_count(shape) == Some(len) {
        return Ok(());
    }
    Err(Error::ShapeMismatch {
        tensor: name.to_owned(),
        rank: None,
        expected: shape.to_vec(),
        got: vec![len],
    })
}

/// The residual of `name` for a tensor of `n` elements, created as zeros when missing.
fn residual_slot<'m>(
    residuals: &'m mut BTreeMap<String, Vec<f32>>,
    name: &str,
    n: usize,
) -> Result<&'m mut Vec<f32>> {
    if !residuals.contains_key(name) {
        residuals.insert(name.to_owned(), vec![0.0; n]);
    }
    match residuals.get_mut(name) {
        Some(r) if r.len() == n => Ok(r),
        Some(r) => Err(Error::LengthChanged {
            tensor: name.to_owned(),
            expected: r.len(),
            got: n,
        }),
        None => Err(Error::MissingTensor {
            tensor: name.to_owned(),
            rank: None,
        }),
    }
}

impl ErrorFeedback {
    /// Error feedback with `method` and `seed`, at step 0, with no residuals.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method, unscaled sign or unbiased random-k (their
    /// residual would grow without bound).
    pub fn new(method: Method, seed: u64) -> Result<Self> {
        check_method(&method)?;
        Ok(ErrorFeedback {
            method,
            seed,
            step: 0,
            residuals: BTreeMap::new(),
            shapes: BTreeMap::new(),
            bounds: BTreeMap::new(),
            scratch: Vec::new(),
            frame: Vec::new(),
            ids: Vec::new(),
        })
    }

    /// The method every frame is made with.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The run's seed (random-k and stochastic rounding).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next step to run (0 before the first).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The parameters of `name`'s frame at the current step.
    pub fn params(&self, name: &str) -> Params {
        Params {
            method: self.method,
            seed: self.seed,
            step: self.step,
            tensor_id: tensor_id(name),
        }
    }

    /// The residual of `name`, if it has one.
    pub fn residual(&self, name: &str) -> Option<&[f32]> {
        self.residuals.get(name).map(Vec::as_slice)
    }

    /// Sets `name`'s residual and the shape it remembers (for example to restore state kept
    /// elsewhere, with [`ErrorFeedback::residual_shape`]).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `residual.len()` is not the product of `shape` (`got` is
    /// `[residual.len()]`); as [`ErrorFeedback::set_residual`]. Nothing changes then.
    pub fn set_residual_with_shape(
        &mut self,
        name: &str,
        shape: &[usize],
        residual: Vec<f32>,
    ) -> Result<()> {
        check_holds(name, shape, residual.len())?;
        self.set_residual(name, residual)?;
        self.remember_shape(name, shape);
        Ok(())
    }

    /// The shape `name`'s residual remembers (see the module docs), if it has one.
    pub fn residual_shape(&self, name: &str) -> Option<&[usize]> {
        self.shapes.get(name).map(Vec::as_slice)
    }

    /// Every residual, in name order.
    pub fn residuals(&self) -> impl Iterator<Item = (&str, &[f32])> {
        self.residuals
            .iter()
            .map(|(n, r)| (n.as_str(), r.as_slice()))
    }

    /// Number of residuals.
    pub fn len(&self) -> usize {
        self.residuals.len()
    }

    /// True when no residual is kept.
    pub fn is_empty(&self) -> bool {
        self.residuals.is_empty()
    }

    /// Drops every residual and its shape (the step counter, seed and method stay).
    pub fn clear(&mut self) {
        self.residuals.clear();
        self.shapes.clear();
        self.bounds.clear();
    }

    /// Sets `name`'s residual (for example to restore state kept elsewhere). The residual has
    /// no shape until a shaped step gives one (a shape `name` had before is forgotten).
    ///
    /// # Errors
    /// [`Error::Core`] with [`gradwire_core::Error::NonFinite`] when a value is NaN or
    /// infinite; nothing changes then.
    pub fn set_residual(&mut self, name: &str, residual: Vec<f32>) -> Result<()> {
        if let Some(index) = scalar::first_non_finite(&residual) {
            return Err(Error::core(
                name,
                None,
                gradwire_core::Error::NonFinite { index },
            ));
        }
        self.bounds
            .insert(name.to_owned(), ResidualBound::of(&residual));
        self.residuals.insert(name.to_owned(), residual);
        self.shapes.remove(name);
        Ok(())
    }

    /// The bound on the magnitudes of `name`'s residual that this error feedback keeps
    /// ([`ResidualBound::UNKNOWN`] when it keeps none: no residual, a residual loaded from a
    /// checkpoint and not stepped yet, or one a step could not bound). A top-k step whose
    /// gradient and bound prove every sum in range reads the gradient and the residual once
    /// after its check (see [`gradwire_core::feedback_step_bounded`]).
    pub fn residual_bound(&self, name: &str) -> ResidualBound {
        self.bound(name)
    }

    /// The bound `name`'s residual's last step left ([`ResidualBound::UNKNOWN`] when none).
    pub(crate) fn bound(&self, name: &str) -> ResidualBound {
        self.bounds
            .get(name)
            .copied()
            .unwrap_or(ResidualBound::UNKNOWN)
    }

    /// Makes `name`'s residual's bound unknown (its residual is about to change outside a
    /// step of this type). The entry stays, so that the bound a later step keeps is written in
    /// place: a steady-state step allocates nothing.
    fn forget_bound(&mut self, name: &str) {
        self.keep_bound(name, ResidualBound::UNKNOWN);
    }

    /// Keeps `bound` for `name`'s residual (after a step that computed it).
    pub(crate) fn keep_bound(&mut self, name: &str, bound: ResidualBound) {
        match self.bounds.get_mut(name) {
            Some(b) => *b = bound,
            None => {
                self.bounds.insert(name.to_owned(), bound);
            }
        }
    }

    /// Checks `shape`, the shape of `name`'s gradient, against the shape its residual
    /// remembers: [`Error::ShapeChanged`] when they differ in the same element count. Another
    /// element count, and a residual without a shape, pass here: the element count is checked
    /// with the gradient's values ([`Error::LengthChanged`]).
    pub(crate) fn check_shape(&self, name: &str, shape: &[usize]) -> Result<()> {
        match self.shapes.get(name) {
            Some(known)
                if known.as_slice() != shape && element_count(known) == element_count(shape) =>
            {
                Err(Error::ShapeChanged {
                    tensor: name.to_owned(),
                    expected: known.clone(),
                    got: shape.to_vec(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Remembers `shape` for `name`'s residual (after a step that checked it succeeded).
    pub(crate) fn remember_shape(&mut self, name: &str, shape: &[usize]) {
        match self.shapes.get_mut(name) {
            Some(known) if known.as_slice() == shape => {}
            Some(known) => {
                known.clear();
                known.extend_from_slice(shape);
            }
            None => {
                self.shapes.insert(name.to_owned(), shape.to_vec());
            }
        }
    }

    /// The residual of `name` for a tensor of `n` elements, created as zeros when missing.
    pub(crate) fn residual_for(&mut self, name: &str, n: usize) -> Result<&mut Vec<f32>> {
        self.forget_bound(name);
        residual_slot(&mut self.residuals, name, n)
    }

    /// Moves `name`'s residual (created as zeros of `n` elements when missing) into `into`,
    /// leaving an empty vector in the map until [`ErrorFeedback::put_residual`] gives it back:
    /// so that tasks on several threads can each own the residuals of their tensors. Allocates
    /// only when the residual is new.
    pub(crate) fn take_residual(
        &mut self,
        name: &str,
        n: usize,
        into: &mut Vec<f32>,
    ) -> Result<()> {
        self.forget_bound(name);
        std::mem::swap(residual_slot(&mut self.residuals, name, n)?, into);
        Ok(())
    }

    /// Gives back a residual that [`ErrorFeedback::take_residual`] moved out (`from` is left
    /// empty).
    pub(crate) fn put_residual(&mut self, name: &str, from: &mut Vec<f32>) {
        if let Some(slot) = self.residuals.get_mut(name) {
            std::mem::swap(slot, from);
        }
    }

    /// Sets the step counter (for a compressor taking over its state).
    pub(crate) fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Ends a step that a caller ran through [`ErrorFeedback::residual_for`].
    pub(crate) fn advance(&mut self) {
        self.step = self.step.wrapping_add(1);
    }

    /// One step over a model: for every `(name, gradient)` of `grads`, in that order, encodes
    /// `gradient + residual` with [`ErrorFeedback::params`]`(name)`, updates the residual and
    /// hands the frame to `sink(name, frame)`. Then the step counter advances.
    ///
    /// No shapes: element counts are checked, shapes are not (see the module docs); prefer
    /// [`ErrorFeedback::step_with_shapes`] when the tensors have them.
    ///
    /// `grads` is iterated twice (checks, then work), so its iterator must be `Clone` (slices,
    /// arrays and map iterators are). Buffers are reused: a steady-state step allocates nothing.
    ///
    /// # Errors
    /// Nothing changes on error (no residual, not the step counter, no call of `sink`):
    /// [`Error::DuplicateTensor`] for a name given twice; [`Error::LengthChanged`] when a
    /// tensor's element count differs from its residual's; [`Error::Core`] naming the tensor
    /// for NaN/Inf in the gradient or in `gradient + residual`
    /// ([`gradwire_core::Error::NonFinite`], with the first bad index) or a value beyond the
    /// range of f16/bf16 values ([`gradwire_core::Error::ValueOutOfRange`]).
    pub fn step_with<'a, I>(&mut self, grads: I, sink: impl FnMut(&str, &[u8])) -> Result<()>
    where
        I: IntoIterator<Item = (&'a str, &'a [f32])>,
        I::IntoIter: Clone,
    {
        self.step_items(grads.into_iter().map(|(n, g)| (n, None, g)), sink)
    }

    /// [`ErrorFeedback::step_with`] for tensors with shapes: `grads` yields `(name, shape,
    /// gradient)` with `gradient.len()` the product of `shape` (row-major, as safetensors and
    /// [`Tensor`] keep it; `[]` for a 0-d tensor). A residual remembers its tensor's shape, and a
    /// tensor that comes back in another shape is an error, as is one whose residual was
    /// restored from a checkpoint in another shape.
    ///
    /// # Errors
    /// As [`ErrorFeedback::step_with`]; [`Error::ShapeChanged`] (nothing changes) when a
    /// tensor comes in another shape of the same element count as the one its residual
    /// remembers (another count is [`Error::LengthChanged`]); [`Error::ShapeMismatch`] when
    /// `gradient.len()` is not the product of `shape` (`got` is then `[gradient.len()]`).
    pub fn step_with_shapes<'a, I>(&mut self, grads: I, sink: impl FnMut(&str, &[u8])) -> Result<()>
    where
        I: IntoIterator<Item = (&'a str, &'a [usize], &'a [f32])>,
        I::IntoIter: Clone,
    {
        self.step_items(grads.into_iter().map(|(n, s, g)| (n, Some(s), g)), sink)
    }

    /// The step of [`ErrorFeedback::step_with`] and [`ErrorFeedback::step_with_shapes`].
    fn step_items<'a, I>(&mut self, iter: I, mut sink: impl FnMut(&str, &[u8])) -> Result<()>
    where
        I: Iterator<Item = (&'a str, Option<&'a [usize]>, &'a [f32])> + Clone,
    {
        let values = self.method.values();
        // Pass 1: every check, and the buffer sizes.
        self.ids.clear();
        let (mut frame_len, mut scratch) = (0usize, 0usize);
        for (name, shape, g) in iter.clone() {
            if let Some(shape) = shape {
                check_holds(name, shape, g.len())?;
                self.check_shape(name, shape)?;
            }
            // A residual's bound and a gradient below half the range prove every sum in range
            // with one read of the gradient; otherwise the sums are checked.
            let residual = self.residual(name);
            let same_len = residual.is_some_and(|r| r.len() == g.len());
            if !(same_len && self.bound(name).proves_in_range(g, values)) {
                check_step_input(name, g, residual, values)?;
            }
            self.ids.push(tensor_id(name));
            frame_len = frame_len.max(max_frame_len(g.len(), &self.method));
            scratch = scratch.max(scratch_len(g.len(), &self.method));
        }
        self.ids.sort_unstable();
        if self.ids.windows(2).any(|w| w[0] == w[1]) {
            // Same hash: confirm with the names (rare, so this may allocate).
            let mut names: Vec<&str> = iter.clone().map(|(n, _, _)| n).collect();
            names.sort_unstable();
            if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
                return Err(Error::DuplicateTensor {
                    tensor: w[0].to_owned(),
                });
            }
        }
        if self.frame.len() < frame_len {
            self.frame.resize(frame_len, 0);
        }
        if self.scratch.len() < scratch {
            self.scratch.resize(scratch, 0);
        }
        // Pass 2: cannot fail after the checks above.
        for (name, shape, g) in iter {
            let params = self.params(name);
            let mut bound = match self.residuals.contains_key(name) {
                true => self.bound(name),
                false => ResidualBound::ZERO, // created as zeros below
            };
            let residual = residual_slot(&mut self.residuals, name, g.len())?;
            let len = feedback_step_bounded(
                g,
                residual,
                &mut bound,
                &params,
                &mut self.scratch,
                &mut self.frame,
            )
            .map_err(|e| Error::core(name, None, e))?;
            self.keep_bound(name, bound);
            if let Some(shape) = shape {
                self.remember_shape(name, shape);
            }
            sink(name, &self.frame[..len]);
        }
        self.advance();
        Ok(())
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
        self.step_with_shapes(sorted.iter().copied(), |name, frame| {
            out.insert(name.to_owned(), frame.to_vec());
        })?;
        Ok(out)
    }

    /// The checkpoint as safetensors bytes (layout in the module docs).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a residual named `__metadata__` (reserved by safetensors) or one
    /// whose shape has more than [`crate::safetensors_checked::MAX_DIMS`] dimensions;
    /// [`Error::Safetensors`] when serialization fails.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        if self.residuals.contains_key("__metadata__") {
            return Err(Error::checkpoint(
                "a tensor named `__metadata__` cannot be stored in safetensors",
            ));
        }
        if let Some((name, shape)) = self
            .shapes
            .iter()
            .find(|(_, s)| s.len() > crate::safetensors_checked::MAX_DIMS)
        {
            return Err(Error::checkpoint(format!(
                "residual `{name}` has {} dimensions; a checkpoint holds at most {}",
                shape.len(),
                crate::safetensors_checked::MAX_DIMS
            )));
        }
        let mut meta = HashMap::new();
        meta.insert("format".to_owned(), CHECKPOINT_FORMAT.to_owned());
        meta.insert("version".to_owned(), CHECKPOINT_VERSION.to_owned());
        let method = format_method(&self.method);
        let (seed, step) = (self.seed.to_string(), self.step.to_string());
        let unshaped: Vec<&str> = self
            .residuals
            .keys()
            .filter(|n| !self.shapes.contains_key(*n))
            .map(String::as_str)
            .collect();
        let unshaped = serde_json::to_string(&unshaped)
            .map_err(|e| Error::checkpoint(format!("cannot write `unshaped`: {e}")))?;
        let crc = checkpoint_crc(
            &self.residuals,
            Some(&self.shapes),
            &[&method, &seed, &step, &unshaped],
        );
        meta.insert("crc32".to_owned(), crc.to_string());
        meta.insert("method".to_owned(), method);
        meta.insert("seed".to_owned(), seed);
        meta.insert("step".to_owned(), step);
        meta.insert("unshaped".to_owned(), unshaped);
        // Each residual in the shape it remembers, else `[n]`.
        crate::tensor::serialize_f32(
            self.residuals.iter().map(|(n, r)| {
                let shape = self.shapes.get(n).cloned().unwrap_or_else(|| vec![r.len()]);
                (n.as_str(), shape, r.as_slice())
            }),
            Some(meta),
        )
    }

    /// Restores a checkpoint from the bytes [`ErrorFeedback::to_bytes`] wrote.
    ///
    /// # Errors
    /// [`Error::Safetensors`] for bytes that are not safetensors; [`Error::Checkpoint`] naming
    /// what is wrong: a missing or unknown `format`, `version`, `method`, `seed`, `step` or
    /// (version 3) `unshaped` (not a compact JSON array of the file's residual names in strictly
    /// increasing order, or naming one the file lacks), a `crc32` entry in a version 1 file or an
    /// `unshaped` entry in a version 1 or 2 file (a damaged version number), a tensor that is
    /// not F32 (or, in versions 1 and 2, not 1-d), an `unshaped` residual that is not 1-d, a NaN
    /// or infinite residual value, a checksum that does not match.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let (header, data) = crate::safetensors_checked::read_header(bytes)?;
        let empty = HashMap::new();
        let meta = header.metadata().as_ref().unwrap_or(&empty);
        let get = |key: &str| {
            meta.get(key)
                .map(String::as_str)
                .ok_or_else(|| Error::checkpoint(format!("metadata entry `{key}` is missing")))
        };
        let format = get("format")?;
        if format != CHECKPOINT_FORMAT {
            return Err(Error::checkpoint(format!(
                "format `{format}` is not `{CHECKPOINT_FORMAT}`"
            )));
        }
        let version = get("version")?;
        if !["1", "2", CHECKPOINT_VERSION].contains(&version) {
            return Err(Error::checkpoint(format!(
                "version `{version}` is not supported (this build reads `1`, `2` and \
                 `{CHECKPOINT_VERSION}`)"
            )));
        }
        // Sorted, so that the error for a checkpoint with several bad residuals is always the
        // same one (the header's map has no order).
        let mut tensors: Vec<_> = header.tensors().into_iter().collect();
        tensors.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        // Version 3: the names whose residual has no shape (stored as `[n]`), in name order.
        let unshaped: Option<(&str, Vec<String>)> = if version == CHECKPOINT_VERSION {
            let text = get("unshaped")?;
            // At most every name of the file, each escaped as JSON may (6 bytes a character),
            // so that a hostile list costs no more than the names it could hold.
            // Counted before parsing too: no more entries than the file has residuals.
            let most: usize = 2 + tensors.iter().map(|(n, _)| 6 * n.len() + 3).sum::<usize>();
            let entries = crate::safetensors_checked::longest_array(text.as_bytes());
            let names: Vec<String> = (text.len() <= most && entries <= tensors.len().max(1))
                .then(|| serde_json::from_str(text).ok())
                .flatten()
                .filter(|names: &Vec<String>| names.windows(2).all(|w| w[0] < w[1]))
                .ok_or_else(|| {
                    Error::checkpoint(format!(
                        "metadata `unshaped` = `{}` is not a JSON array of the file's residual \
                         names in name order",
                        text.chars().take(100).collect::<String>()
                    ))
                })?;
            if let Some(name) = names
                .iter()
                .find(|n| tensors.binary_search_by(|(t, _)| t.cmp(n)).is_err())
            {
                return Err(Error::checkpoint(format!(
                    "metadata `unshaped` names `{name}`, which the file holds no residual for"
                )));
            }
            Some((text, names))
        } else {
            None
        };
        // An entry of a later version in an earlier one is a damaged version number (one bit
        // turns `3` into `1` or `2`), not a file to read without its checksum or shapes.
        for (key, older) in [("crc32", &["1"][..]), ("unshaped", &["1", "2"][..])] {
            if older.contains(&version) && meta.contains_key(key) {
                return Err(Error::checkpoint(format!(
                    "metadata entry `{key}` in a version {version} checkpoint (a damaged version \
                     number?)"
                )));
            }
        }
        let stored_crc = if version == "1" {
            None
        } else {
            let text = meta.get("crc32").ok_or_else(|| {
                Error::checkpoint(format!(
                    "metadata entry `crc32` is missing (version {version} checkpoints carry one)"
                ))
            })?;
            Some(text.parse::<u32>().map_err(|_| {
                Error::checkpoint(format!("metadata `crc32` = `{text}` is not a u32"))
            })?)
        };
        let method = parse_method(get("method")?)
            .map_err(|e| Error::checkpoint(format!("metadata `method`: {e}")))?;
        let number = |key: &str| -> Result<u64> {
            let s = get(key)?;
            s.parse::<u64>()
                .map_err(|_| Error::checkpoint(format!("metadata `{key}` = `{s}` is not a u64")))
        };
        let mut fb = ErrorFeedback::new(method, number("seed")?)
            .map_err(|e| Error::checkpoint(format!("metadata `method`: {e}")))?;
        fb.step = number("step")?;
        for (name, info) in tensors {
            let flat = match &unshaped {
                None => true,
                Some((_, names)) => names.binary_search(&name).is_ok(),
            };
            if info.dtype != Dtype::F32 || (flat && info.shape.len() != 1) {
                let expected = if flat { " with shape [n]" } else { "" };
                return Err(Error::checkpoint(format!(
                    "residual `{name}` is {:?} with shape {:?}, expected F32{expected}",
                    info.dtype, info.shape
                )));
            }
            if !flat {
                fb.shapes.insert(name.clone(), info.shape.clone());
            }
            // In range: `read_header` checked every offset against the data section.
            let (start, end) = info.data_offsets;
            let raw = data.get(start..end).ok_or_else(|| {
                Error::checkpoint(format!("residual `{name}` lies outside the file"))
            })?;
            let r: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(index) = scalar::first_non_finite(&r) {
                return Err(Error::checkpoint(format!(
                    "residual `{name}` is NaN or infinite at index {index}"
                )));
            }
            fb.residuals.insert(name, r);
        }
        if let Some(stored) = stored_crc {
            let texts = [get("method")?, get("seed")?, get("step")?];
            let computed = match &unshaped {
                // Version 2: no shapes.
                None => checkpoint_crc(&fb.residuals, None, &texts),
                Some((text, _)) => {
                    let [method, seed, step] = texts;
                    let texts = [method, seed, step, text];
                    checkpoint_crc(&fb.residuals, Some(&fb.shapes), &texts)
                }
            };
            if stored != computed {
                return Err(Error::checkpoint(format!(
                    "checksum mismatch (stored {stored}, computed {computed}): the file is \
                     corrupted"
                )));
            }
        }
        Ok(fb)
    }

    /// Writes the checkpoint to `path` (layout in the module docs).
    ///
    /// # Errors
    /// As [`ErrorFeedback::to_bytes`]; [`Error::Io`] naming the file when writing fails.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })
    }

    /// Reads a checkpoint that [`ErrorFeedback::save`] wrote.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when reading fails; otherwise as
    /// [`ErrorFeedback::from_bytes`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }
}

/// The `crc32` of a checkpoint (layout in the module docs): with `shapes` (the remembered ones;
/// `[n]` for the others) as version 3 computes it, without as version 2 did.
fn checkpoint_crc(
    residuals: &BTreeMap<String, Vec<f32>>,
    shapes: Option<&BTreeMap<String, Vec<usize>>>,
    texts: &[&str],
) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut buf = [0u8; 4096];
    for (name, r) in residuals {
        h.update(name.as_bytes());
        h.update(&[0]);
        if let Some(shapes) = shapes {
            let flat = [r.len()];
            let shape = shapes.get(name).map_or(&flat[..], Vec::as_slice);
            // Ranks and dimensions are far below u32 / u64 (safetensors checked the shape).
            h.update(&(shape.len() as u32).to_le_bytes());
            for &d in shape {
                h.update(&(d as u64).to_le_bytes());
            }
        }
        for run in r.chunks(buf.len() / 4) {
            for (b, x) in buf.chunks_exact_mut(4).zip(run) {
                b.copy_from_slice(&x.to_le_bytes());
            }
            h.update(&buf[..4 * run.len()]);
        }
    }
    for t in texts {
        h.update(t.as_bytes());
        h.update(&[0]);
    }
    h.finalize()
}

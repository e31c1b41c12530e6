//! [`ErrorFeedback`]: the residuals of error feedback, keyed by parameter name, with their
//! shapes and bounds, and their checkpoints (`FORMAT.md` section 12). The engine
//! (`engine`) runs the steps.
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
//! - a residual remembers its tensor's shape once a step gave one ([`ErrorFeedback::step_with_shapes`],
//!   and the bundle and compressor paths, which know their
//!   tensors' shapes): a tensor that comes back with the same element count in another shape (a
//!   transposed weight) is an error ([`Error::ShapeChanged`]), since its old residual would be
//!   added to the wrong coordinates. [`ErrorFeedback::step_with`] gives no shapes: it checks
//!   element counts only, and a residual it creates has no shape until a shaped step gives one;
//! - a step is all or nothing: every tensor is checked (lengths, NaN/Inf in the gradient and in
//!   `gradient + residual`) before any residual changes, so a NaN in one tensor leaves every
//!   residual, and the step counter, unchanged. A finite sum beyond the value type (f16, bf16)
//!   is sent saturated, its excess kept in the residual. Each residual keeps the bound its last
//!   step left ([`gradwire_core::ResidualBound`]), so that for top-k a gradient below 2^127 is
//!   checked alone (one read), where the sums would be read; a residual set, restored or
//!   loaded starts with an unknown bound or its measured one;
//! - [`ErrorFeedback::to_bytes`] writes a safetensors file holding every residual (f32, exact
//!   bits, in its tensor's shape) and, in its `__metadata__`, the step, the seed and the method;
//!   a run restored with [`ErrorFeedback::from_bytes`] continues bit-identically to one that was never
//!   interrupted, shape checks included (layout in `FORMAT.md` section 12).
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
//! # Ok::<(), gradwire::Error>(())
//! ```

pub(crate) mod checkpoint;
pub(crate) mod state_file;

use std::collections::BTreeMap;

use gradwire_core::{Method, ResidualBound, scalar};

use crate::error::{Error, Result};
use crate::method::check_for_feedback;

pub use self::checkpoint::CHECKPOINT_VERSION;

/// One tensor's residual state as [`ErrorFeedback::keep`] copied it: its values (when it had
/// a residual), the shape and the bound kept with it.
#[derive(Debug, Default)]
pub(crate) struct KeptResidual {
    name: String,
    had: bool,
    values: Vec<f32>,
    had_shape: bool,
    shape: Vec<usize>,
    bound: Option<ResidualBound>,
}

impl KeptResidual {
    /// The tensor whose state this holds (empty before the first copy).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Holds `name`'s state: its residual, shape and bound, each `None` where it has none.
    fn fill(
        &mut self,
        name: &str,
        residual: Option<&[f32]>,
        shape: Option<&[usize]>,
        bound: Option<ResidualBound>,
    ) {
        self.name.clear();
        self.name.push_str(name);
        self.had = copy_into(residual, &mut self.values);
        self.had_shape = copy_into(shape, &mut self.shape);
        self.bound = bound;
    }
}

/// Copies `from` into `into` (cleared first, its capacity kept); whether there was a `from`.
fn copy_into<T: Copy>(from: Option<&[T]>, into: &mut Vec<T>) -> bool {
    into.clear();
    from.map(|v| into.extend_from_slice(v)).is_some()
}

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

/// The element count of `shape` (`None` when it overflows `usize`).
fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// [`Error::ShapeMismatch`] (`got` is `[len]`) unless `shape` holds `len` elements.
pub(crate) fn check_holds(name: &str, shape: &[usize], len: usize) -> Result<()> {
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
        residuals.insert(name.to_owned(), crate::tensor::written_zeros(n, name)?);
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
        check_for_feedback(&method)?;
        Ok(ErrorFeedback {
            method,
            seed,
            step: 0,
            residuals: BTreeMap::new(),
            shapes: BTreeMap::new(),
            bounds: BTreeMap::new(),
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

    /// Multiplies every residual by `factor` (finite and positive; the caller checked that no
    /// value overflows), and each bound kept with it: rounding is monotone, so `|r| <= b`
    /// gives `|r x factor| <= b x factor` as both round (an unknown bound stays unknown).
    pub(crate) fn scale(&mut self, factor: f32) {
        for r in self.residuals.values_mut() {
            r.iter_mut().for_each(|x| *x *= factor);
        }
        for bound in self.bounds.values_mut() {
            *bound = ResidualBound::at_most(bound.max_abs() * factor);
        }
    }

    /// Drops every residual and its shape (the step counter, seed and method stay).
    pub(crate) fn clear(&mut self) {
        self.residuals.clear();
        self.shapes.clear();
        self.bounds.clear();
    }

    /// Sets `name`'s residual (for example to restore state kept elsewhere). The residual has
    /// no shape until a shaped step gives one (a shape `name` had before is forgotten).
    ///
    /// # Errors
    /// [`Error::Core`] with [`gradwire_core::Error::NonFinite`] when a value is NaN or
    /// infinite; nothing changes then. Any finite value is accepted, also one beyond the range
    /// of the method's value type: a step sends such a coordinate saturated and keeps the rest
    /// (as a step leaves it); a state that makes `gradient + residual` overflow f32 fails that
    /// step, as any non-finite sum does.
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
    /// gradient and bound prove every sum finite reads the gradient and the residual once
    /// after its check (see [`gradwire_core::feedback_step_bounded`]).
    pub(crate) fn residual_bound(&self, name: &str) -> ResidualBound {
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

    /// Moves `name`'s residual, shape and bound (when it has them) out into a state of the same
    /// method, seed and step that holds only them: for a step over one tensor at a time. Give
    /// them back with [`ErrorFeedback::absorb`].
    pub(crate) fn split_off(&mut self, name: &str) -> ErrorFeedback {
        let mut part = ErrorFeedback {
            method: self.method,
            seed: self.seed,
            step: self.step,
            residuals: BTreeMap::new(),
            shapes: BTreeMap::new(),
            bounds: BTreeMap::new(),
        };
        if let Some((k, v)) = self.residuals.remove_entry(name) {
            part.residuals.insert(k, v);
        }
        if let Some((k, v)) = self.shapes.remove_entry(name) {
            part.shapes.insert(k, v);
        }
        if let Some((k, v)) = self.bounds.remove_entry(name) {
            part.bounds.insert(k, v);
        }
        part
    }

    /// Takes back every residual, shape and bound of `part` (a state [`ErrorFeedback::split_off`]
    /// made, after its step); `part`'s step counter is dropped.
    pub(crate) fn absorb(&mut self, part: ErrorFeedback) {
        self.residuals.extend(part.residuals);
        self.shapes.extend(part.shapes);
        self.bounds.extend(part.bounds);
    }

    /// Copies `name`'s residual state (values, shape, bound, or that it has none) into `into`,
    /// reusing its buffers, for [`ErrorFeedback::put_back`].
    pub(crate) fn keep(&self, name: &str, into: &mut KeptResidual) {
        into.fill(
            name,
            self.residuals.get(name).map(Vec::as_slice),
            self.shapes.get(name).map(Vec::as_slice),
            self.bounds.get(name).copied(),
        );
    }

    /// [`ErrorFeedback::keep`] of a tensor without any error-feedback state: no residual.
    pub(crate) fn keep_none(name: &str, into: &mut KeptResidual) {
        into.fill(name, None, None, None);
    }

    /// Puts back the residual state [`ErrorFeedback::keep`] copied, exactly (a residual that
    /// did not exist then is removed).
    pub(crate) fn put_back(&mut self, kept: &KeptResidual) {
        let name = kept.name.as_str();
        if kept.had {
            match self.residuals.get_mut(name) {
                Some(r) => {
                    r.clear();
                    r.extend_from_slice(&kept.values);
                }
                None => {
                    self.residuals.insert(name.to_owned(), kept.values.clone());
                }
            }
        } else {
            self.residuals.remove(name);
        }
        if kept.had_shape {
            self.remember_shape(name, &kept.shape);
        } else {
            self.shapes.remove(name);
        }
        match kept.bound {
            Some(bound) => self.keep_bound(name, bound),
            None => {
                self.bounds.remove(name);
            }
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
}

#[cfg(test)]
mod tests {
    use gradwire_core::{K, Method, Values};

    use super::ErrorFeedback;

    #[test]
    fn clear_drops_every_residual_and_shape() {
        let method = Method::TopK {
            k: K::Count(1),
            values: Values::F32,
        };
        let mut fb = ErrorFeedback::new(method, 5).unwrap();
        fb.set_residual_with_shape("w", &[2, 3], vec![0.0; 6])
            .unwrap();
        fb.set_residual("b", vec![1.0]).unwrap();
        fb.clear();
        assert_eq!((fb.residuals().count(), fb.residual_shape("w")), (0, None));
    }

    #[test]
    fn scaled_residuals_keep_a_bound_that_holds() {
        let method = Method::TopK {
            k: K::Count(1),
            values: Values::F32,
        };
        let mut fb = ErrorFeedback::new(method, 5).unwrap();
        // Values whose products round (factor 0.3), a subnormal, one near the top of f32.
        fb.set_residual("w", vec![0.1, -3.7, 1.0e-40, 2.9]).unwrap();
        fb.set_residual("big", vec![3.0e38, 1.0]).unwrap();
        for factor in [0.3, 2.0, 0.5] {
            fb.scale(factor);
            for (name, r) in fb.residuals() {
                let largest = r.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let bound = fb.residual_bound(name).max_abs();
                assert!(largest <= bound, "{name} x {factor}: {largest} > {bound}");
            }
        }
        assert!(fb.residual_bound("w").max_abs().is_finite());
    }
}

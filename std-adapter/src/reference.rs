//! The reference Python layout: safetensors payloads with `NAME::idx`, `NAME::val` and
//! `NAME::scale` keys, as the reference Python compressor writes and reads them.
//!
//! For each gradient tensor `NAME` of the model (of `n` elements):
//!
//! | key | dtype | shape | meaning |
//! |---|---|---|---|
//! | `NAME::idx` | int64 | `[k]` | flat (row-major) indices of the kept entries, in any order |
//! | `NAME::val` | float32 ([`Mode::TopK`]) or int8 ([`Mode::TopKInt8`]) | `[k]` | kept values |
//! | `NAME::scale` | float32 | `[1]` | [`Mode::TopKInt8`] only: value = int8 × scale |
//!
//! In [`Mode::None`] the payload holds every tensor densely under its own name (f32, its own
//! shape). `k = max(1, min(n, floor(n × ratio)))` ([`gradwire_core::k_from_ratio`]; `n` when
//! `ratio >= 1`; `0` for an empty tensor, which the reference cannot compress at all). Shapes
//! never travel: the receiver decodes against its own model's names and shapes
//! ([`TensorSpec`]), and the mode travels out of band (the reference's HTTP header
//! `X-Compression`, see [`Mode::as_str`]).
//!
//! # Selection and quantization
//! The kept entries are the exact top-k by magnitude of the core ([`gradwire_core::select`],
//! ties to the lower index); this crate writes them in ascending index order (the reference
//! writes them in no particular order, and the decoder accepts any order). In
//! [`Mode::TopKInt8`], `scale = max|val| / 127` computed in f32 (`1.0` when every kept value is
//! zero, as the reference does), codes are `round_half_even(val / scale)` clamped to
//! `[-127, 127]`, and a code decodes to `code × scale` in f32. Where the reference's scale is
//! unusable (`127 × scale` overflows for a peak near `f32::MAX`; `max|val| / 127` underflows to
//! 0 for a subnormal peak) the scale is the nearest one below that fits, or the smallest
//! positive f32: every payload written decodes to finite values.
//!
//! # Error feedback: where gradwire differs from the reference
//! Each error-feedback step ([`compress_with_residuals`], [`compress_with_error_feedback`])
//! adds the residual to the gradient of each tensor, compresses the sum `x`, and leaves in
//! the residual what was not delivered:
//! - [`Mode::TopK`]: `x` with the kept entries set to zero, identical to the reference;
//! - [`Mode::TopKInt8`]: additionally, at each kept entry, the int8 rounding error
//!   `x - code × scale`. **The reference loses that error** (its residual is zero at the kept
//!   entries); gradwire keeps it, so nothing is lost over steps. The payload itself is identical
//!   to the reference's for the same input `x`; only the residual differs.
//! - [`Mode::None`]: `x` is sent densely and the residual becomes zero (the reference ignores
//!   the residual in this mode).
//!
//! Over a model, [`compress_with_residuals`] takes one residual slice per tensor, and
//! [`compress_with_error_feedback`] keeps them in an [`ErrorFeedback`], so that they are saved
//! and restored as its checkpoints ([`ErrorFeedback::to_bytes`], [`ErrorFeedback::from_bytes`]; the
//! checkpoint's method is [`feedback_method`]). Both steps are all or nothing: every tensor is
//! checked before any residual changes.
//!
//! # Decoding hostile payloads
//! [`parse`] and [`decode`] check everything before returning: the safetensors header, that
//! every expected key is present with the right dtype and rank, that no unexpected key is
//! present, that `::idx` and `::val` have the same length, that every index is in `0..n` and
//! appears once, that values and scales are finite (scales also positive) and int8 codes lie in
//! `[-127, 127]`. Memory is bounded by the receiver's model, never by the payload's header.
//!
//! # Example
//! ```
//! use gradwire::TensorSpec;
//! use gradwire::reference::{self, Mode};
//!
//! let grad = [0.5_f32, -3.0, 0.25, 2.0];
//! let payload = reference::compress(&[("w", &[2, 2][..], &grad[..])], Mode::TopK, 0.5).unwrap();
//! let specs = [TensorSpec::new("w", vec![2, 2])];
//! let dense = reference::decode(&payload, Mode::TopK, &specs).unwrap();
//! assert_eq!(dense[0], [0.0, -3.0, 0.0, 2.0]);
//! ```

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use gradwire_core::{K, Method, Values, select};

use crate::feedback::ErrorFeedback;
use crate::layout::TensorSpec;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// Key suffix of the flat indices.
pub(crate) const IDX: &str = "::idx";
/// Key suffix of the kept values.
pub(crate) const VAL: &str = "::val";
/// Key suffix of the int8 scale.
pub(crate) const SCALE: &str = "::scale";

/// Compression mode of a reference payload (the value of the HTTP header `X-Compression`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Dense f32 tensors under their own names.
    None,
    /// Top-k with f32 values.
    TopK,
    /// Top-k with int8 values and one f32 scale per tensor.
    TopKInt8,
}

impl Mode {
    /// Every mode, in the reference's order.
    pub const ALL: [Mode; 3] = [Mode::None, Mode::TopK, Mode::TopKInt8];

    /// The mode's name as the reference spells it: `none`, `topk` or `topk-int8`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::TopK => "topk",
            Mode::TopKInt8 => "topk-int8",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = ReferenceError;

    /// Parses `none`, `topk` or `topk-int8`.
    ///
    /// # Errors
    /// [`ReferenceError::UnknownMode`] for anything else.
    fn from_str(s: &str) -> Result<Self, ReferenceError> {
        Mode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| ReferenceError::UnknownMode(s.to_owned()))
    }
}

/// Errors of the reference layout.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// The mode is not `none`, `topk` or `topk-int8`.
    #[error("unknown reference mode {0:?} (expected none, topk or topk-int8)")]
    UnknownMode(String),
    /// The ratio is NaN, infinite or negative.
    #[error("invalid ratio {0} (must be finite and >= 0)")]
    InvalidRatio(f64),
    /// The bytes are not a valid safetensors file.
    #[error("invalid safetensors payload: {0}")]
    Safetensors(String),
    /// A key the receiver expects is missing.
    #[error("payload has no key {0:?}")]
    MissingKey(String),
    /// The payload holds a key the receiver does not expect.
    #[error("payload has an unexpected key {0:?}")]
    UnexpectedKey(String),
    /// A key has another dtype than the mode requires.
    #[error("key {key:?} has dtype {got}, expected {expected}")]
    WrongDtype {
        /// The key.
        key: String,
        /// The dtype the mode requires.
        expected: &'static str,
        /// The dtype found.
        got: String,
    },
    /// A key has another shape than expected.
    #[error("key {key:?} has shape {got:?}, expected {expected}")]
    WrongShape {
        /// The key.
        key: String,
        /// What was expected, in words.
        expected: String,
        /// The shape found.
        got: Vec<usize>,
    },
    /// `::idx` and `::val` have different lengths.
    #[error("tensor {name:?}: {indices} indices but {values} values")]
    LengthMismatch {
        /// Tensor name.
        name: String,
        /// Length of `::idx`.
        indices: usize,
        /// Length of `::val`.
        values: usize,
    },
    /// An index is negative or not below the tensor's element count.
    #[error("tensor {name:?}: index {index} out of range for {n} elements")]
    IndexOutOfRange {
        /// Tensor name.
        name: String,
        /// The index.
        index: i64,
        /// Element count of the tensor.
        n: usize,
    },
    /// An index appears twice.
    #[error("tensor {name:?}: index {index} appears more than once")]
    DuplicateIndex {
        /// Tensor name.
        name: String,
        /// The index.
        index: u64,
    },
    /// A value is NaN or infinite.
    #[error("key {key:?}: value at position {position} is NaN or infinite")]
    NonFinite {
        /// The key holding the value (a `::val` key, a dense tensor, or an input tensor).
        key: String,
        /// Position of the first bad value in that key.
        position: usize,
    },
    /// An int8 scale is NaN, infinite, zero or negative, or so large that `127 × scale`
    /// overflows (a code would decode to infinity).
    #[error("tensor {name:?}: invalid int8 scale {scale}")]
    BadScale {
        /// Tensor name.
        name: String,
        /// The scale.
        scale: f32,
    },
    /// An int8 code is -128 (the reference clamps codes to [-127, 127]).
    #[error("tensor {name:?}: int8 code -128 at position {position} (codes are in [-127, 127])")]
    BadCode {
        /// Tensor name.
        name: String,
        /// Position of the code.
        position: usize,
    },
    /// A shape's element count overflows `usize`.
    #[error("tensor {name:?}: shape {shape:?} is too large")]
    ShapeOverflow {
        /// Tensor name.
        name: String,
        /// The shape.
        shape: Vec<usize>,
    },
    /// A tensor's data length differs from what its shape or the residual requires.
    #[error("tensor {name:?}: {got} elements, expected {expected}")]
    ElementCount {
        /// Tensor name.
        name: String,
        /// Elements expected.
        expected: usize,
        /// Elements found.
        got: usize,
    },
    /// The same tensor name appears twice in the input, a name contains `::`, or a name is
    /// `__metadata__` (reserved by safetensors).
    #[error("invalid tensor name {0:?} (duplicate, contains \"::\", or is \"__metadata__\")")]
    BadName(String),
    /// An error-feedback state was made for another method (mode or ratio) than this step.
    #[error(
        "residual state was made with method `{state}`, this step uses `{step}` (use a new \
         state file, or the same mode and ratio)"
    )]
    FeedbackMethod {
        /// The state's method ([`crate::method::format`]).
        state: String,
        /// The method of this step.
        step: String,
    },
}

impl From<safetensors::SafeTensorError> for ReferenceError {
    fn from(e: safetensors::SafeTensorError) -> Self {
        ReferenceError::Safetensors(crate::safetensors_reader::describe(&e))
    }
}

fn numel(name: &str, shape: &[usize]) -> Result<usize, ReferenceError> {
    crate::tensor::numel(shape).ok_or_else(|| ReferenceError::ShapeOverflow {
        name: name.to_owned(),
        shape: shape.to_vec(),
    })
}

/// One tensor of a reference payload.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// [`Mode::None`]: every element.
    Dense(Vec<f32>),
    /// [`Mode::TopK`]: kept indices and their f32 values.
    TopK {
        /// Flat indices, each once, in payload order.
        indices: Vec<u64>,
        /// Values, one per index.
        values: Vec<f32>,
    },
    /// [`Mode::TopKInt8`]: kept indices, int8 codes and the scale.
    TopKInt8 {
        /// Flat indices, each once, in payload order.
        indices: Vec<u64>,
        /// Codes in `[-127, 127]`, one per index.
        codes: Vec<i8>,
        /// Scale: a code decodes to `code × scale`.
        scale: f32,
    },
}

impl Entry {
    /// The mode this entry belongs to.
    pub const fn mode(&self) -> Mode {
        match self {
            Entry::Dense(_) => Mode::None,
            Entry::TopK { .. } => Mode::TopK,
            Entry::TopKInt8 { .. } => Mode::TopKInt8,
        }
    }

    /// Entries carried: `k` for top-k, `n` for dense.
    pub fn kept(&self) -> usize {
        match self {
            Entry::Dense(v) => v.len(),
            Entry::TopK { indices, .. } | Entry::TopKInt8 { indices, .. } => indices.len(),
        }
    }

    /// The decoded value at each carried position, in payload order (`code × scale` for int8).
    pub fn values(&self) -> Vec<f32> {
        match self {
            Entry::Dense(v) | Entry::TopK { values: v, .. } => v.clone(),
            Entry::TopKInt8 { codes, scale, .. } => {
                codes.iter().map(|&c| f32::from(c) * *scale).collect()
            }
        }
    }

    /// Writes the dense tensor into `out`: every element is overwritten (0 where nothing is
    /// carried). On error `out` is untouched.
    ///
    /// # Errors
    /// [`ReferenceError::ElementCount`] when a dense entry's length differs from `out`'s;
    /// [`ReferenceError::IndexOutOfRange`] when an index is not below `out.len()` (entries from
    /// [`parse`] always fit their spec). The errors carry an empty tensor name.
    pub fn decode_into(&self, out: &mut [f32]) -> Result<(), ReferenceError> {
        match self {
            Entry::Dense(v) => {
                if v.len() != out.len() {
                    return Err(ReferenceError::ElementCount {
                        name: String::new(),
                        expected: out.len(),
                        got: v.len(),
                    });
                }
                out.copy_from_slice(v);
            }
            Entry::TopK { indices, .. } | Entry::TopKInt8 { indices, .. } => {
                let n = out.len();
                if let Some(&bad) = indices.iter().find(|&&i| i >= n as u64) {
                    return Err(ReferenceError::IndexOutOfRange {
                        name: String::new(),
                        index: i64::try_from(bad).unwrap_or(i64::MAX),
                        n,
                    });
                }
                out.fill(0.0);
                for (&i, v) in indices.iter().zip(self.values()) {
                    out[i as usize] = v;
                }
            }
        }
        Ok(())
    }
}

fn check_ratio(ratio: f64) -> Result<(), ReferenceError> {
    if ratio.is_finite() && ratio >= 0.0 {
        Ok(())
    } else {
        Err(ReferenceError::InvalidRatio(ratio))
    }
}

fn first_non_finite(name: &str, x: &[f32]) -> Result<(), ReferenceError> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(position) => Err(ReferenceError::NonFinite {
            key: name.to_owned(),
            position,
        }),
        None => Ok(()),
    }
}

/// The kept indices of exact top-k on `x` (ascending), `k` from `ratio`. `x` must be finite.
fn select_topk(x: &[f32], ratio: f64) -> Vec<u64> {
    let k = gradwire_core::k_from_ratio(x.len() as u64, ratio) as usize;
    let mut scratch = vec![0u32; select::topk_scratch_len(x.len())];
    let sel = select::topk(x, k, &mut scratch);
    let mut kept = Vec::with_capacity(k);
    select::for_each_kept(x, sel, |i| kept.push(i as u64));
    kept
}

/// The reference's int8 quantization of the kept values: `(codes, scale)`.
///
/// `scale = peak / 127` in f32, as the reference computes it, except at the two ends of the f32
/// range, where the reference writes payloads that no decoder can use and this function a
/// scale that [`parse`] (and the reference's decoder) accept, so that every code decodes to a
/// finite value:
/// - a peak near `f32::MAX`, where `127 × scale` overflows: the scale is stepped down
///   ([`f32::next_down`]) until `127 × scale` is finite (codes are clamped to `[-127, 127]`);
/// - a subnormal peak, where `peak / 127` underflows to 0 (the reference would divide by 0):
///   the scale is the smallest positive f32, so codes are small integers that decode exactly.
fn quantize_int8(values: &[f32]) -> (Vec<i8>, f32) {
    let peak = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let mut scale = if peak > 0.0 { peak / 127.0 } else { 1.0 };
    if scale == 0.0 {
        scale = f32::from_bits(1);
    }
    // Near f32::MAX, `peak / 127` rounds to at most one step above the largest scale that
    // fits (the scale is finite: so is the input).
    while !(127.0 * scale).is_finite() {
        scale = scale.next_down();
    }
    let codes = values
        .iter()
        .map(|&v| (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8)
        .collect();
    (codes, scale)
}

fn compress_checked(x: &[f32], mode: Mode, ratio: f64) -> Entry {
    if mode == Mode::None {
        return Entry::Dense(x.to_vec());
    }
    let indices = select_topk(x, ratio);
    let values: Vec<f32> = indices.iter().map(|&i| x[i as usize]).collect();
    if mode == Mode::TopK {
        Entry::TopK { indices, values }
    } else {
        let (codes, scale) = quantize_int8(&values);
        Entry::TopKInt8 {
            indices,
            codes,
            scale,
        }
    }
}

fn check_step(
    name: &str,
    grad: &[f32],
    residual: &[f32],
    ratio: f64,
) -> Result<(), ReferenceError> {
    check_ratio(ratio)?;
    if grad.len() != residual.len() {
        return Err(ReferenceError::ElementCount {
            name: name.to_owned(),
            expected: grad.len(),
            got: residual.len(),
        });
    }
    // A NaN or infinite gradient makes its sum non-finite too: one walk names the first bad
    // position of either kind, as the core's feedback_step does.
    match grad
        .iter()
        .zip(residual)
        .position(|(g, r)| !(g + r).is_finite())
    {
        Some(position) => Err(ReferenceError::NonFinite {
            key: name.to_owned(),
            position,
        }),
        None => Ok(()),
    }
}

fn feedback_checked(grad: &[f32], residual: &mut [f32], mode: Mode, ratio: f64) -> Entry {
    // The entry compresses `grad + residual`; the residual update is the core's
    // (`sparse_update`: `residual + grad`, then `-value` at each sent index), per element the
    // operations of the reference: its values are the sums (the update leaves exact zeros
    // there), its int8 codes decode to `code * scale`.
    let sum: Vec<f32> = grad
        .iter()
        .zip(residual.iter())
        .map(|(g, r)| g + r)
        .collect();
    let entry = compress_checked(&sum, mode, ratio);
    let (idx, sent): (Vec<u32>, Vec<f32>) = match &entry {
        // Everything is sent: nothing is left.
        Entry::Dense(_) => {
            residual.fill(0.0);
            return entry;
        }
        Entry::TopK { indices, values } => {
            (indices.iter().map(|&i| i as u32).collect(), values.clone())
        }
        Entry::TopKInt8 {
            indices,
            codes,
            scale,
        } => (
            indices.iter().map(|&i| i as u32).collect(),
            codes.iter().map(|&c| f32::from(c) * *scale).collect(),
        ),
    };
    // Indices come sorted from the selection; lengths match: no error.
    let _ = gradwire_core::feedback::sparse_update(&idx, &sent, 0, grad, residual);
    entry
}

/// One input tensor: `(name, shape, data)`.
pub type Input<'a> = (&'a str, &'a [usize], &'a [f32]);

/// Whether `name` cannot name a tensor of a payload: it contains `::`, or it is
/// `__metadata__`, the key safetensors reserves.
fn reserved_name(name: &str) -> bool {
    name.contains("::") || name == "__metadata__"
}

/// Names and lengths of every tensor and, with `finite`, that every value is finite (error
/// feedback checks values itself, tensor by tensor, on `gradient + residual`).
fn check_inputs(tensors: &[Input<'_>], finite: bool) -> Result<(), ReferenceError> {
    let mut seen = BTreeSet::new();
    for &(name, shape, data) in tensors {
        if reserved_name(name) || !seen.insert(name) {
            return Err(ReferenceError::BadName(name.to_owned()));
        }
        let n = numel(name, shape)?;
        if n != data.len() {
            return Err(ReferenceError::ElementCount {
                name: name.to_owned(),
                expected: n,
                got: data.len(),
            });
        }
        if finite {
            first_non_finite(name, data)?;
        }
    }
    Ok(())
}

/// Compresses a model's gradients into a reference payload (safetensors bytes), without error
/// feedback.
///
/// # Errors
/// [`ReferenceError::BadName`] for a duplicate name, one containing `::`, or `__metadata__`;
/// [`ReferenceError::ElementCount`] when a tensor's data does not match its shape;
/// [`ReferenceError::NonFinite`] naming the first bad tensor and position;
/// [`ReferenceError::InvalidRatio`]; [`ReferenceError::Safetensors`] if serialization fails.
pub fn compress(tensors: &[Input<'_>], mode: Mode, ratio: f64) -> Result<Vec<u8>, ReferenceError> {
    check_ratio(ratio)?;
    check_inputs(tensors, true)?;
    let entries: Vec<(&str, &[usize], Entry)> = tensors
        .iter()
        .map(|&(name, shape, data)| (name, shape, compress_checked(data, mode, ratio)))
        .collect();
    to_bytes(entries.iter().map(|(n, s, e)| (*n, *s, e)))
}

/// Compresses a model's gradients into a reference payload with error feedback: one residual
/// per tensor, in the order of `tensors`, each as long as its tensor (zeros before the first
/// step). The step is all or nothing: every check runs before any residual changes.
///
/// # Errors
/// As [`compress`]; [`ReferenceError::ElementCount`] when the number of residuals or a residual's
/// length differs; [`ReferenceError::NonFinite`] where `grad + residual` is not finite.
pub fn compress_with_residuals(
    tensors: &[Input<'_>],
    residuals: &mut [Vec<f32>],
    mode: Mode,
    ratio: f64,
) -> Result<Vec<u8>, ReferenceError> {
    check_ratio(ratio)?;
    check_inputs(tensors, false)?;
    if residuals.len() != tensors.len() {
        return Err(ReferenceError::ElementCount {
            name: "(residuals)".to_owned(),
            expected: tensors.len(),
            got: residuals.len(),
        });
    }
    for (&(name, _, data), r) in tensors.iter().zip(residuals.iter()) {
        check_step(name, data, r, ratio)?;
    }
    let entries: Vec<(&str, &[usize], Entry)> = tensors
        .iter()
        .zip(residuals.iter_mut())
        .map(|(&(name, shape, data), r)| (name, shape, feedback_checked(data, r, mode, ratio)))
        .collect();
    to_bytes(entries.iter().map(|(n, s, e)| (*n, *s, e)))
}

/// The method an [`ErrorFeedback`] state records for a reference run in `mode` at `ratio`:
/// dense f32 for [`Mode::None`], top-k by ratio with f32 values for [`Mode::TopK`], and for
/// [`Mode::TopKInt8`] top-k by ratio with int8 values in blocks of `u32::MAX` (the reference
/// has one scale per tensor; its codes are `round(val / (max|val| / 127))`, see the module docs).
pub const fn feedback_method(mode: Mode, ratio: f64) -> Method {
    match mode {
        Mode::None => Method::Dense {
            values: Values::F32,
        },
        Mode::TopK => Method::TopK {
            k: K::Ratio(ratio),
            values: Values::F32,
        },
        Mode::TopKInt8 => Method::TopK {
            k: K::Ratio(ratio),
            values: Values::Int8 { block: u32::MAX },
        },
    }
}

/// One error-feedback step of a reference run over a model, with the residuals kept in an
/// [`ErrorFeedback`] (so they are saved and restored with [`ErrorFeedback::to_bytes`] /
/// [`ErrorFeedback::from_bytes`]). `feedback` must have been made with
/// [`feedback_method`]`(mode, ratio)`; a tensor seen for the first time starts from a zero
/// residual. The step is all or nothing: on error no residual and not the step counter change.
/// On success the step counter advances.
///
/// # Errors
/// As [`compress`]; [`ReferenceError::FeedbackMethod`] when `feedback` was made for another
/// mode or ratio; [`ReferenceError::ElementCount`] when a tensor's element count differs from
/// its stored residual's; [`ReferenceError::WrongShape`] when a tensor comes with its residual's
/// element count in another shape than the one the residual remembers (a transposed weight; see
/// [`crate::feedback`]);
/// [`ReferenceError::NonFinite`] where `grad + residual` is not finite.
pub fn compress_with_error_feedback(
    tensors: &[Input<'_>],
    feedback: &mut ErrorFeedback,
    mode: Mode,
    ratio: f64,
) -> Result<Vec<u8>, ReferenceError> {
    check_ratio(ratio)?;
    let method = feedback_method(mode, ratio);
    if *feedback.method() != method {
        return Err(ReferenceError::FeedbackMethod {
            state: crate::method::format(feedback.method()),
            step: crate::method::format(&method),
        });
    }
    check_inputs(tensors, false)?;
    for &(name, shape, data) in tensors {
        match feedback.residual(name) {
            Some(r) if r.len() != data.len() => {
                return Err(ReferenceError::ElementCount {
                    name: name.to_owned(),
                    expected: r.len(),
                    got: data.len(),
                });
            }
            Some(r) => check_step(name, data, r, ratio)?,
            None => first_non_finite(name, data)?,
        }
        // The same element count in another shape (a transposed weight): the feedback
        // module's rule, reported in this layout's terms.
        if let Err(crate::error::Error::ShapeChanged { expected, got, .. }) =
            feedback.check_shape(name, shape)
        {
            return Err(ReferenceError::WrongShape {
                key: name.to_owned(),
                expected: format!("{expected:?}, the shape its residual was kept in"),
                got,
            });
        }
    }
    let mut entries: Vec<(&str, &[usize], Entry)> = Vec::with_capacity(tensors.len());
    for &(name, shape, data) in tensors {
        // Cannot fail: the lengths were checked above.
        let r =
            feedback
                .residual_for(name, data.len())
                .map_err(|_| ReferenceError::ElementCount {
                    name: name.to_owned(),
                    expected: data.len(),
                    got: 0,
                })?;
        entries.push((name, shape, feedback_checked(data, r, mode, ratio)));
        feedback.remember_shape(name, shape);
    }
    feedback.advance();
    to_bytes(entries.iter().map(|(n, s, e)| (*n, *s, e)))
}

fn le_bytes<T: Copy, const W: usize>(x: &[T], f: impl Fn(T) -> [u8; W]) -> Vec<u8> {
    x.iter().flat_map(|&v| f(v)).collect()
}

/// Serializes entries into a reference payload. `shape` is used only for [`Entry::Dense`]
/// (top-k keys are flat `[k]`).
///
/// # Errors
/// [`ReferenceError::BadName`] for a name containing `::` or `__metadata__`;
/// [`ReferenceError::ElementCount`] when a dense entry does not match its shape;
/// [`ReferenceError::Safetensors`] if serialization fails.
pub fn to_bytes<'a>(
    entries: impl IntoIterator<Item = (&'a str, &'a [usize], &'a Entry)>,
) -> Result<Vec<u8>, ReferenceError> {
    let mut keys: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape, entry) in entries {
        if reserved_name(name) {
            return Err(ReferenceError::BadName(name.to_owned()));
        }
        match entry {
            Entry::Dense(v) => {
                let n = numel(name, shape)?;
                if n != v.len() {
                    return Err(ReferenceError::ElementCount {
                        name: name.to_owned(),
                        expected: n,
                        got: v.len(),
                    });
                }
                keys.push((
                    name.to_owned(),
                    Dtype::F32,
                    shape.to_vec(),
                    le_bytes(v, f32::to_le_bytes),
                ));
            }
            Entry::TopK { indices, values } => {
                let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
                keys.push((
                    format!("{name}{IDX}"),
                    Dtype::I64,
                    vec![idx.len()],
                    le_bytes(&idx, i64::to_le_bytes),
                ));
                keys.push((
                    format!("{name}{VAL}"),
                    Dtype::F32,
                    vec![values.len()],
                    le_bytes(values, f32::to_le_bytes),
                ));
            }
            Entry::TopKInt8 {
                indices,
                codes,
                scale,
            } => {
                let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
                keys.push((
                    format!("{name}{IDX}"),
                    Dtype::I64,
                    vec![idx.len()],
                    le_bytes(&idx, i64::to_le_bytes),
                ));
                keys.push((
                    format!("{name}{VAL}"),
                    Dtype::I8,
                    vec![codes.len()],
                    le_bytes(codes, i8::to_le_bytes),
                ));
                keys.push((
                    format!("{name}{SCALE}"),
                    Dtype::F32,
                    vec![1],
                    scale.to_le_bytes().to_vec(),
                ));
            }
        }
    }
    let views = keys
        .iter()
        .map(|(k, dtype, shape, bytes)| {
            Ok((k.as_str(), TensorView::new(*dtype, shape.clone(), bytes)?))
        })
        .collect::<Result<Vec<_>, ReferenceError>>()?;
    Ok(safetensors::serialize(views, None)?)
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

fn expect_dtype(
    key: &str,
    view: &TensorView<'_>,
    dtype: Dtype,
    name: &'static str,
) -> Result<(), ReferenceError> {
    if view.dtype() == dtype {
        Ok(())
    } else {
        Err(ReferenceError::WrongDtype {
            key: key.to_owned(),
            expected: name,
            got: dtype_name(view.dtype()),
        })
    }
}

fn expect_rank1(key: &str, view: &TensorView<'_>) -> Result<usize, ReferenceError> {
    match *view.shape() {
        [len] => Ok(len),
        ref other => Err(ReferenceError::WrongShape {
            key: key.to_owned(),
            expected: "a flat [k]".to_owned(),
            got: other.to_vec(),
        }),
    }
}

fn get<'a>(st: &SafeTensors<'a>, key: &str) -> Result<TensorView<'a>, ReferenceError> {
    st.tensor(key)
        .map_err(|_| ReferenceError::MissingKey(key.to_owned()))
}

fn read_f32(key: &str, bytes: &[u8]) -> Result<Vec<f32>, ReferenceError> {
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    first_non_finite(key, &v)?;
    Ok(v)
}

fn read_indices(
    name: &str,
    key: &str,
    view: &TensorView<'_>,
    n: usize,
) -> Result<Vec<u64>, ReferenceError> {
    expect_dtype(key, view, Dtype::I64, "I64")?;
    expect_rank1(key, view)?;
    let mut indices = Vec::with_capacity(view.data().len() / 8);
    for c in view.data().chunks_exact(8) {
        let i = i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        match u64::try_from(i) {
            Ok(u) if u < n as u64 => indices.push(u),
            _ => {
                return Err(ReferenceError::IndexOutOfRange {
                    name: name.to_owned(),
                    index: i,
                    n,
                });
            }
        }
    }
    let mut sorted = indices.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(ReferenceError::DuplicateIndex {
            name: name.to_owned(),
            index: w[0],
        });
    }
    Ok(indices)
}

fn check_specs(specs: &[TensorSpec]) -> Result<Vec<usize>, ReferenceError> {
    let mut seen = BTreeSet::new();
    specs
        .iter()
        .map(|s| {
            if reserved_name(&s.name) || !seen.insert(s.name.as_str()) {
                return Err(ReferenceError::BadName(s.name.clone()));
            }
            numel(&s.name, &s.shape)
        })
        .collect()
}

/// The keys a payload in `mode` holds for the tensor `name`.
pub fn keys(name: &str, mode: Mode) -> Vec<String> {
    match mode {
        Mode::None => vec![name.to_owned()],
        Mode::TopK => vec![format!("{name}{IDX}"), format!("{name}{VAL}")],
        Mode::TopKInt8 => {
            vec![
                format!("{name}{IDX}"),
                format!("{name}{VAL}"),
                format!("{name}{SCALE}"),
            ]
        }
    }
}

/// Parses and validates a reference payload against the receiver's model: one [`Entry`] per
/// spec, in the order of `specs`. Nothing about the payload is trusted (see the module docs).
///
/// # Errors
/// [`ReferenceError::Safetensors`] for bytes that are not a safetensors file;
/// [`ReferenceError::BadName`] for a duplicate spec name, one containing `::`, or
/// `__metadata__`;
/// [`ReferenceError::ShapeOverflow`]; [`ReferenceError::UnexpectedKey`] (the first in sorted order)
/// and [`ReferenceError::MissingKey`]; [`ReferenceError::WrongDtype`],
/// [`ReferenceError::WrongShape`], [`ReferenceError::LengthMismatch`],
/// [`ReferenceError::IndexOutOfRange`], [`ReferenceError::DuplicateIndex`],
/// [`ReferenceError::NonFinite`], [`ReferenceError::BadScale`], [`ReferenceError::BadCode`].
pub fn parse(
    payload: &[u8],
    mode: Mode,
    specs: &[TensorSpec],
) -> Result<Vec<Entry>, ReferenceError> {
    let st = crate::safetensors_reader::deserialize(payload)?;
    let ns = check_specs(specs)?;
    let expected: BTreeSet<String> = specs.iter().flat_map(|s| keys(&s.name, mode)).collect();
    let mut names = st.names();
    names.sort_unstable();
    if let Some(k) = names.iter().find(|k| !expected.contains(**k)) {
        return Err(ReferenceError::UnexpectedKey((*k).to_owned()));
    }
    specs
        .iter()
        .zip(ns)
        .map(|(spec, n)| parse_one(&st, mode, spec, n))
        .collect()
}

fn parse_one(
    st: &SafeTensors<'_>,
    mode: Mode,
    spec: &TensorSpec,
    n: usize,
) -> Result<Entry, ReferenceError> {
    let name = spec.name.as_str();
    if mode == Mode::None {
        let view = get(st, name)?;
        expect_dtype(name, &view, Dtype::F32, "F32")?;
        if view.shape() != spec.shape.as_slice() {
            return Err(ReferenceError::WrongShape {
                key: name.to_owned(),
                expected: format!("{:?}", spec.shape),
                got: view.shape().to_vec(),
            });
        }
        return Ok(Entry::Dense(read_f32(name, view.data())?));
    }
    let idx_key = format!("{name}{IDX}");
    let val_key = format!("{name}{VAL}");
    let idx_view = get(st, &idx_key)?;
    let val_view = get(st, &val_key)?;
    let val_len = expect_rank1(&val_key, &val_view)?;
    if mode == Mode::TopK {
        expect_dtype(&val_key, &val_view, Dtype::F32, "F32")?;
    } else {
        expect_dtype(&val_key, &val_view, Dtype::I8, "I8")?;
    }
    let idx_len = expect_rank1(&idx_key, &idx_view)?;
    if idx_len != val_len {
        return Err(ReferenceError::LengthMismatch {
            name: name.to_owned(),
            indices: idx_len,
            values: val_len,
        });
    }
    let indices = read_indices(name, &idx_key, &idx_view, n)?;
    if mode == Mode::TopK {
        let values = read_f32(&val_key, val_view.data())?;
        return Ok(Entry::TopK { indices, values });
    }
    let scale_key = format!("{name}{SCALE}");
    let scale_view = get(st, &scale_key)?;
    expect_dtype(&scale_key, &scale_view, Dtype::F32, "F32")?;
    if scale_view.shape() != [1] {
        return Err(ReferenceError::WrongShape {
            key: scale_key,
            expected: "[1]".to_owned(),
            got: scale_view.shape().to_vec(),
        });
    }
    let scale = match *scale_view.data() {
        [a, b, c, d] => f32::from_le_bytes([a, b, c, d]),
        _ => f32::NAN,
    };
    // A code decodes to `code × scale`: beyond f32::MAX / 127 that would be infinite.
    if !(scale.is_finite() && scale > 0.0 && (127.0 * scale).is_finite()) {
        return Err(ReferenceError::BadScale {
            name: name.to_owned(),
            scale,
        });
    }
    let codes: Vec<i8> = val_view.data().iter().map(|&b| b as i8).collect();
    if let Some(position) = codes.iter().position(|&c| c == i8::MIN) {
        return Err(ReferenceError::BadCode {
            name: name.to_owned(),
            position,
        });
    }
    Ok(Entry::TopKInt8 {
        indices,
        codes,
        scale,
    })
}

/// `err` with its tensor name set (for errors of [`Entry::decode_into`]).
fn named(err: ReferenceError, tensor: &str) -> ReferenceError {
    match err {
        ReferenceError::ElementCount { expected, got, .. } => ReferenceError::ElementCount {
            name: tensor.to_owned(),
            expected,
            got,
        },
        ReferenceError::IndexOutOfRange { index, n, .. } => ReferenceError::IndexOutOfRange {
            name: tensor.to_owned(),
            index,
            n,
        },
        other => other,
    }
}

/// Decodes a reference payload into one dense f32 tensor per spec (flat, row-major), in the
/// order of `specs`; what the reference decoder rebuilds.
///
/// # Errors
/// Every error of [`parse`].
pub fn decode(
    payload: &[u8],
    mode: Mode,
    specs: &[TensorSpec],
) -> Result<Vec<Vec<f32>>, ReferenceError> {
    let entries = parse(payload, mode, specs)?;
    specs
        .iter()
        .zip(&entries)
        .map(|(spec, e)| {
            let mut out = vec![0.0f32; numel(&spec.name, &spec.shape)?];
            // Cannot fail: `parse` checked every index against the spec.
            e.decode_into(&mut out)
                .map_err(|err| named(err, &spec.name))?;
            Ok(out)
        })
        .collect()
}

/// What a payload holds for one tensor, read without the receiver's shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Tensor name.
    pub name: String,
    /// Entries carried (`k`; the element count for a dense tensor).
    pub kept: usize,
    /// Tensor bytes of its keys (safetensors' JSON header not counted).
    pub data_bytes: usize,
    /// The shape of a dense tensor ([`Mode::None`]); `None` for top-k keys (shapes do not travel).
    pub shape: Option<Vec<usize>>,
}

/// Guesses the mode of a payload from its keys and dtypes and lists its tensors (sorted by
/// name), without validating indices or values: for inspection only. Use [`parse`] to decode.
///
/// # Errors
/// [`ReferenceError::Safetensors`]; [`ReferenceError::WrongDtype`] when a `::val` key is neither
/// F32 nor I8; [`ReferenceError::MissingKey`] when a tensor lacks its `::idx` or `::val` key;
/// [`ReferenceError::UnexpectedKey`] for a key that fits no mode.
pub fn summarize(payload: &[u8]) -> Result<(Mode, Vec<Summary>), ReferenceError> {
    let st = crate::safetensors_reader::deserialize(payload)?;
    let mut names = st.names();
    names.sort_unstable();
    let sparse = names.iter().any(|k| k.contains("::"));
    if !sparse {
        let list = names
            .iter()
            .map(|&k| {
                let v = get(&st, k)?;
                Ok(Summary {
                    name: k.to_owned(),
                    kept: v.shape().iter().product(),
                    data_bytes: v.data().len(),
                    shape: Some(v.shape().to_vec()),
                })
            })
            .collect::<Result<Vec<_>, ReferenceError>>()?;
        return Ok((Mode::None, list));
    }
    let mut mode = None;
    let mut list = Vec::new();
    for &k in &names {
        let Some(name) = k.strip_suffix(VAL) else {
            if !(k.ends_with(IDX) || k.ends_with(SCALE)) {
                return Err(ReferenceError::UnexpectedKey(k.to_owned()));
            }
            continue;
        };
        let val = get(&st, k)?;
        let m = match val.dtype() {
            Dtype::F32 => Mode::TopK,
            Dtype::I8 => Mode::TopKInt8,
            other => {
                return Err(ReferenceError::WrongDtype {
                    key: k.to_owned(),
                    expected: "F32 or I8",
                    got: dtype_name(other),
                });
            }
        };
        if *mode.get_or_insert(m) != m {
            return Err(ReferenceError::WrongDtype {
                key: k.to_owned(),
                expected: if m == Mode::TopK { "I8" } else { "F32" },
                got: dtype_name(val.dtype()),
            });
        }
        let mut data_bytes = val.data().len();
        for key in keys(name, m).iter().filter(|key| key.as_str() != k) {
            data_bytes += get(&st, key)?.data().len();
        }
        list.push(Summary {
            name: name.to_owned(),
            kept: val.shape().iter().product(),
            data_bytes,
            shape: None,
        });
    }
    // Every ::idx / ::scale key must belong to a listed tensor.
    let listed: BTreeSet<String> = list
        .iter()
        .flat_map(|s| keys(&s.name, mode.unwrap_or(Mode::TopK)))
        .collect();
    if let Some(k) = names.iter().find(|k| !listed.contains(**k)) {
        return Err(ReferenceError::UnexpectedKey((*k).to_owned()));
    }
    Ok((mode.unwrap_or(Mode::TopK), list))
}

//! Python exceptions for the library's errors.
//!
//! - `ValueError`: the caller's own input is unusable (NaN or Inf in a gradient, an unknown
//!   mode or method, a shape that differs from the model's, a bad ratio or name);
//! - `gradwire.PayloadError` (a `gradwire.GradwireError`): bytes or arrays that came from
//!   elsewhere (a peer's bundle, a reference payload, a checkpoint file) are invalid;
//! - `OSError`: a file could not be read or written;
//! - `MemoryError`: a model (its shapes, a checkpoint's residuals) larger than memory;
//! - `gradwire.GradwireError`: anything else the library refuses.

use gradwire::Error;
use gradwire::reference::ReferenceError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyOSError, PyValueError};
use pyo3::{PyErr, PyResult};

create_exception!(
    gradwire,
    GradwireError,
    PyException,
    "An error of the gradwire library."
);
create_exception!(
    gradwire,
    PayloadError,
    GradwireError,
    "Bytes or arrays from elsewhere (a bundle, a reference payload, a checkpoint) are invalid."
);

/// A reference-layout error as a Python exception: on the input side (compressing the caller's
/// gradients) a `ValueError`; decoding, a `PayloadError` unless the mode or the receiver's own
/// shapes are at fault.
pub(crate) fn reference_error(e: ReferenceError, side: Side) -> PyErr {
    let message = e.to_string();
    match e {
        ReferenceError::UnknownMode(_)
        | ReferenceError::InvalidRatio(_)
        | ReferenceError::BadName(_)
        | ReferenceError::ShapeOverflow { .. } => PyValueError::new_err(message),
        ReferenceError::ElementCount { .. } | ReferenceError::NonFinite { .. }
            if side == Side::Input =>
        {
            PyValueError::new_err(message)
        }
        _ => PayloadError::new_err(message),
    }
}

/// Which side of a call an error came from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Compressing the caller's gradients: a core error is bad input (NaN, a value beyond f16).
    Input,
    /// Decoding bytes from elsewhere: a core error is a bad payload.
    Payload,
    /// A collective step of this rank: a core error about its own gradients (no rank, or this
    /// one) is bad input, about a peer's contribution a bad payload.
    Collective {
        /// This rank.
        rank: usize,
    },
}

/// A copy of `values` for the library, or `MemoryError` naming `what` when its memory cannot
/// be had (a failed allocation in Rust aborts the interpreter; Python code expects
/// `MemoryError`).
pub(crate) fn copied(values: &[f32], what: &str) -> PyResult<Vec<f32>> {
    zeros_then(values.len(), what).map(|mut v| {
        v.extend_from_slice(values);
        v
    })
}

/// An empty vector with room for `n` values, or `MemoryError` naming `what` (see [`copied`]).
pub(crate) fn zeros_then(n: usize, what: &str) -> PyResult<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| PyMemoryError::new_err(format!("{what}: cannot allocate {n} elements")))?;
    Ok(v)
}

/// A library error as a Python exception.
pub(crate) fn library_error(e: Error, side: Side) -> PyErr {
    let message = e.to_string();
    let input = match (&e, side) {
        (Error::Core { rank, .. }, Side::Collective { rank: me }) => rank.is_none_or(|r| r == me),
        (_, Side::Collective { .. }) => true,
        (_, s) => s == Side::Input,
    };
    match e {
        Error::Io { .. } => PyOSError::new_err(message),
        // A model larger than memory (a manifest's shapes, a checkpoint's residuals): what
        // Python raises for an allocation it cannot make, instead of an aborted interpreter.
        Error::OutOfMemory { .. } => PyMemoryError::new_err(message),
        Error::Core { .. } if input => PyValueError::new_err(message),
        Error::Config { .. }
        | Error::Shape { .. }
        | Error::ShapeOverflow { .. }
        | Error::ShapeMismatch { .. }
        | Error::ShapeChanged { .. }
        | Error::LengthChanged { .. }
        | Error::MissingTensor { .. }
        | Error::UnexpectedTensor { .. }
        | Error::DuplicateTensor { .. }
            if input =>
        {
            PyValueError::new_err(message)
        }
        // A peer failed or is configured otherwise: its own error is not this rank's input,
        // nor a damaged payload.
        Error::Internal { .. }
        | Error::Comm { .. }
        | Error::NoCommunicator { .. }
        | Error::PeerFailed { .. }
        | Error::ConfigDiffers { .. }
        | Error::Disagreement { .. }
        | Error::WorldSize { .. } => GradwireError::new_err(message),
        _ => PayloadError::new_err(message),
    }
}

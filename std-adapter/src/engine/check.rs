//! The checks of a step, before anything changes: what one step on a tensor reads (the
//! residual's length, NaN/Inf in the gradient and in `gradient + residual`; without error
//! feedback the value type's range: with it a value beyond the range saturates and the
//! residual keeps the excess), for a whole entry, in chunks on the pool when it is large.

use gradwire_core::{Values, values};

use super::Gradients;
use super::exec::Exec;
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::layout::plan::{CHUNK, SPLIT_MIN};
use crate::layout::{Entry, Manifest};

/// Checks what one step on `grad` would read, before anything changes: the residual's length,
/// NaN/Inf in `grad` and in `grad + residual`, and the range of `values` (pass `None` for a
/// step with error feedback, whose encoder saturates a value beyond its type's range).
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

/// Checks what encoding `entry` reads ([`check_step_input`]), tensors in member order. On the
/// pool a large tensor is checked in chunks first (the same verdict); the error, if any, is
/// found again by the serial check, so that it is the same one.
pub(crate) fn check_entry<G: Gradients + ?Sized>(
    manifest: &Manifest,
    entry: &Entry,
    grads: &G,
    feedback: Option<&ErrorFeedback>,
    exec: Exec,
) -> Result<()> {
    // With error feedback any finite sum can be sent (saturating); without, the gradient must
    // fit the value type.
    let values = match feedback {
        Some(_) => None,
        None => entry.method.values(),
    };
    for &t in &entry.members {
        let name = &manifest.tensors()[t].name;
        let g = grads.grad(manifest, t);
        let residual = feedback.and_then(|fb| fb.residual(name));
        let ok = |g: &[f32], r: Option<&[f32]>| check_step_input(name, g, r, values).is_ok();
        let passed_in_chunks = exec == Exec::Pool
            && g.len() >= SPLIT_MIN
            && match residual {
                None => exec.chunks_all(g, CHUNK, |g| ok(g, None)),
                Some(r) if r.len() == g.len() => {
                    exec.chunk_pairs_all(g, r, CHUNK, |g, r| ok(g, Some(r)))
                }
                Some(_) => false,
            };
        if !passed_in_chunks {
            check_step_input(name, g, residual, values)?;
        }
    }
    Ok(())
}

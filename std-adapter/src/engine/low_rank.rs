//! Error feedback of a low-rank method (PowerSGD, `crate::powersgd`): a step compresses
//! `M = G + R` into factors `P` and `Q`, and the new residual is what they do not carry,
//! `R = M - P Q^T` (the product is the core's `gradwire_core::powersgd::reconstruct`).

use gradwire_core::powersgd::reconstruct;
use gradwire_core::values::first_non_finite;

/// Sets `m` to the matrix a step compresses: the gradient `g`, plus the `residual` with error
/// feedback when it has `g`'s length (a tensor's first step has none yet). Returns the first
/// index whose sum is not finite.
pub(crate) fn feedback_input(
    m: &mut Vec<f32>,
    g: &[f32],
    residual: Option<&[f32]>,
) -> Option<usize> {
    m.clear();
    m.extend_from_slice(g);
    let residual = residual.filter(|r| r.len() == g.len())?;
    for (x, e) in m.iter_mut().zip(residual) {
        *x += e;
    }
    first_non_finite(m)
}

/// The new residual `m - p q^T` of a `rows x cols` matrix `m` (row-major; `p` is `rows x r`,
/// `q` is `cols x r`) into `residual`. Returns whether it is finite: a rank whose residual is
/// not cannot keep what it does not send.
///
/// # Errors
/// As `reconstruct`, for factors whose lengths do not fit the shape.
pub(crate) fn residual_after(
    m: &[f32],
    p: &[f32],
    q: &[f32],
    rows: usize,
    cols: usize,
    residual: &mut Vec<f32>,
) -> Result<bool, gradwire_core::Error> {
    // Start from all of `m`, then take away what the factors carry.
    residual_unsent(m, residual);
    reconstruct(p, q, rows, cols, residual, Some(-1.0))?;
    Ok(first_non_finite(residual).is_none())
}

/// The residual of a step that failed on every rank alike: all of `m` (nothing was sent).
pub(crate) fn residual_unsent(m: &[f32], residual: &mut Vec<f32>) {
    residual.clear();
    residual.extend_from_slice(m);
}

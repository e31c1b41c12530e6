//! PowerSGD's kernels (Vogels, Karimireddy & Jaggi, NeurIPS 2019): one step of subspace
//! (power) iteration for a rank-`r` approximation `M ≈ P Qᵀ` of a gradient reshaped to a
//! `rows x cols` matrix, in caller buffers.
//!
//! A step, as the std crate runs it: `P = M Q` ([`project`]), all-reduce P, orthogonalize its
//! columns ([`orthogonalize`]), `Q = Mᵀ P` ([`back_project`]), all-reduce Q; the step's result
//! is `P Qᵀ` ([`reconstruct`]) and, with error feedback, the residual is `M - P Q_localᵀ`.
//!
//! Layout: `M` is row-major (`m[i * cols + k]`); `P` and `Q` are stored column by column, `r`
//! columns of `rows` (`p[j * rows + i] = P[i][j]`) and of `cols` (`q[j * cols + k] = Q[k][j]`)
//! elements. The rank is `q.len() / cols`.
//!
//! Summation orders, fixed so that every build and every SIMD level gives the same bits
//! ([`crate::scalar`] holds the same loops written plainly):
//! - a dot product `a · b` ([`project`], [`orthogonalize`]) adds `a[t] * b[t]` into eight lane
//!   sums, lane `l` taking `t = l, l + 8, l + 16, ...` in order from `+0.0`, then combines them
//!   as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` (the order of sign's scales);
//! - [`back_project`]'s `Q[k][j] = Σ_i M[i][k] P[i][j]` adds in order of `i` from `+0.0`;
//! - [`reconstruct`]'s `(P Qᵀ)[i][k] = Σ_j P[i][j] Q[k][j]` adds in order of `j` from `+0.0`;
//! - every product and sum is one f32 operation (no fused multiply-add).

use crate::error::Error;
use crate::lanes::{LANES, load, load_padded};
use crate::rng;
use wide::f32x8;

/// Checks that `m` holds `rows x cols` elements, `q` whole columns of `cols` and `p` as many
/// columns of `rows`; returns the rank.
fn shapes(m: usize, rows: usize, cols: usize, p: usize, q: usize) -> Result<usize, Error> {
    let n = rows.checked_mul(cols).ok_or(Error::LengthMismatch {
        expected: usize::MAX,
        got: m,
    })?;
    if m != n {
        return Err(Error::LengthMismatch {
            expected: n,
            got: m,
        });
    }
    let r = q.checked_div(cols).unwrap_or(0);
    if r.checked_mul(cols) != Some(q) {
        return Err(Error::LengthMismatch {
            expected: r * cols,
            got: q,
        });
    }
    let want = r.saturating_mul(rows);
    if p != want {
        return Err(Error::LengthMismatch {
            expected: want,
            got: p,
        });
    }
    Ok(r)
}

/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
#[inline]
fn combine(a: f32x8) -> f32 {
    let l = a.to_array();
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The striped dot product of two slices of one length (see the module docs). A tail lane
/// adds `+0.0 * +0.0`, which changes nothing: a sum that starts at `+0.0` is never `-0.0`.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = f32x8::splat(0.0);
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        acc += load(x) * load(y);
    }
    if !ca.remainder().is_empty() {
        acc += load_padded(ca.remainder()) * load_padded(cb.remainder());
    }
    combine(acc)
}

/// `y[t] = fl(y[t] + fl(x[t] * s))`.
#[inline]
fn axpy(y: &mut [f32], x: &[f32], s: f32) {
    let s8 = f32x8::splat(s);
    let mut cy = y.chunks_exact_mut(LANES);
    let mut cx = x.chunks_exact(LANES);
    for (o, v) in (&mut cy).zip(&mut cx) {
        let r = load(o) + load(v) * s8;
        o.copy_from_slice(r.as_array());
    }
    for (o, &v) in cy.into_remainder().iter_mut().zip(cx.remainder()) {
        *o += v * s;
    }
}

/// `P = M Q`: `p[j * rows + i]` is the dot product of row `i` of `m` with column `j` of `q`.
///
/// # Errors
/// [`Error::LengthMismatch`] when `m` is not `rows x cols`, `q` not whole columns of `cols`, or
/// `p` not as many columns of `rows`.
pub fn project(m: &[f32], rows: usize, cols: usize, q: &[f32], p: &mut [f32]) -> Result<(), Error> {
    let r = shapes(m.len(), rows, cols, p.len(), q.len())?;
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        for j in 0..r {
            p[j * rows + i] = dot(row, &q[j * cols..(j + 1) * cols]);
        }
    }
    Ok(())
}

/// `Q = Mᵀ P`: `q[j * cols + k] = Σ_i m[i * cols + k] * p[j * rows + i]`, in order of `i`.
///
/// # Errors
/// As [`project`].
pub fn back_project(
    m: &[f32],
    rows: usize,
    cols: usize,
    p: &[f32],
    q: &mut [f32],
) -> Result<(), Error> {
    let r = shapes(m.len(), rows, cols, p.len(), q.len())?;
    q.fill(0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        for j in 0..r {
            axpy(&mut q[j * cols..(j + 1) * cols], row, p[j * rows + i]);
        }
    }
    Ok(())
}

/// Orthonormalizes the columns of `p` (each of `rows` elements) in place by modified
/// Gram-Schmidt, in column order: column `j` loses its projection on each earlier column
/// (`p_j[i] = fl(p_j[i] + fl(p_l[i] * -d))` with `d = p_j · p_l`), then is divided by its norm
/// `sqrt(p_j · p_j)` (`fl(p_j[i] / norm)`). When that sum of squares is not a normal f32 (it
/// overflowed, or is subnormal or zero), the column is divided by its largest magnitude `s`
/// and then by `sqrt(y · y)`, `y` the column so divided. A column of zeros stays zero (it then
/// adds nothing to the approximation).
///
/// # Errors
/// [`Error::LengthMismatch`] when `p` is not whole columns of `rows`; [`Error::NonFinite`]
/// naming the first element that is NaN or infinite (checked first; nothing changes).
pub fn orthogonalize(p: &mut [f32], rows: usize) -> Result<(), Error> {
    if rows == 0 || !p.len().is_multiple_of(rows) {
        if p.is_empty() {
            return Ok(());
        }
        return Err(Error::LengthMismatch {
            expected: p.len() - p.len() % rows.max(1),
            got: p.len(),
        });
    }
    if let Some(index) = crate::scalar::first_non_finite(p) {
        return Err(Error::NonFinite { index });
    }
    let r = p.len() / rows;
    for j in 0..r {
        let (done, rest) = p.split_at_mut(j * rows);
        let pj = &mut rest[..rows];
        for l in 0..j {
            let pl = &done[l * rows..(l + 1) * rows];
            let d = dot(pj, pl);
            axpy(pj, pl, -d);
        }
        match norm(pj) {
            Norm::Zero => pj.fill(0.0),
            Norm::Plain(root) => divide(pj, root),
            Norm::Scaled(scale, root) => {
                divide(pj, scale);
                divide(pj, root);
            }
        }
    }
    Ok(())
}

/// How a column is normalized: by its norm, or by its largest magnitude and then by the
/// norm of the scaled column (when the plain sum of squares is not a normal f32).
enum Norm {
    Zero,
    Plain(f32),
    Scaled(f32, f32),
}

/// The norm of a finite column (see [`orthogonalize`]).
fn norm(x: &[f32]) -> Norm {
    let sq = dot(x, x);
    if sq.is_normal() {
        return Norm::Plain(libm::sqrtf(sq));
    }
    let s = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if s == 0.0 {
        return Norm::Zero;
    }
    let mut acc = f32x8::splat(0.0);
    let s8 = f32x8::splat(s);
    let mut c = x.chunks_exact(LANES);
    for v in &mut c {
        let y = load(v) / s8;
        acc += y * y;
    }
    if !c.remainder().is_empty() {
        let y = load_padded(c.remainder()) / s8;
        acc += y * y;
    }
    Norm::Scaled(s, libm::sqrtf(combine(acc)))
}

/// `x[t] = fl(x[t] / d)`.
fn divide(x: &mut [f32], d: f32) {
    let d8 = f32x8::splat(d);
    let mut c = x.chunks_exact_mut(LANES);
    for o in &mut c {
        let v = load(o) / d8;
        o.copy_from_slice(v.as_array());
    }
    for o in c.into_remainder() {
        *o /= d;
    }
}

/// `out = P Qᵀ` (`weight = None`) or `out += weight * P Qᵀ`, element `(i, k)` summed over
/// the columns `j` in order: `out[i * cols + k] = Σ_j p[j * rows + i] * q[j * cols + k]`. With
/// weight `-1`, `out = M - P Qᵀ` from `out = M`: the error-feedback residual.
///
/// # Errors
/// As [`project`] (`out` in place of `m`).
pub fn reconstruct(
    p: &[f32],
    q: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    weight: Option<f32>,
) -> Result<(), Error> {
    let r = shapes(out.len(), rows, cols, p.len(), q.len())?;
    let w8 = f32x8::splat(weight.unwrap_or(1.0));
    for i in 0..rows {
        let row = &mut out[i * cols..(i + 1) * cols];
        let mut k = 0;
        while k < cols {
            let len = LANES.min(cols - k);
            let mut acc = f32x8::splat(0.0);
            for j in 0..r {
                let qj = &q[j * cols + k..j * cols + k + len];
                let qv = if len == LANES {
                    load(qj)
                } else {
                    load_padded(qj)
                };
                acc += f32x8::splat(p[j * rows + i]) * qv;
            }
            let o = &mut row[k..k + len];
            let v = match weight {
                None => acc,
                Some(_) => load_padded(o) + w8 * acc,
            };
            o.copy_from_slice(&v.as_array()[..len]);
            k += len;
        }
    }
    Ok(())
}

/// The stream of [`init_q`] in the counter-based generator: the step slot of the key holds
/// this constant, so it never meets a random-k or stochastic-rounding stream of a step.
const INIT_STREAM: u64 = u64::MAX;

/// Fills `q` with uniform values in `[-1, 1)` drawn from `(seed, tensor_id)`: element `t` is
/// `2 u_t - 1` with `u_t` the generator's uniform draw `t` ([`crate::rng::uniform_f32`]), so
/// every rank starts from the same `Q`.
pub fn init_q(q: &mut [f32], seed: u64, tensor_id: u64) {
    let key = rng::key(seed, INIT_STREAM, tensor_id);
    for (t, x) in q.iter_mut().enumerate() {
        *x = 2.0 * rng::uniform_f32(key, t as u64) - 1.0;
    }
}

//! PowerSGD's kernels: bit for bit the scalar specification at every shape, warm-started steps
//! on a matrix with a spectral gap reach the truncated SVD's error (f64 in the test), the
//! error-feedback residual is exactly `M - P Qᵀ`, and bad shapes or values are errors.

mod common;

use common::same_bits;
use gradwire_core::powersgd::{back_project, init_q, orthogonalize, project, reconstruct};
use gradwire_core::{Error, scalar};

/// Deterministic values in about `[-scale, scale)`, some exact zeros.
fn values(n: usize, salt: u64, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = common::mix64(i as u64 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            if h.is_multiple_of(17) {
                0.0
            } else {
                ((h >> 40) as f32 / 16_777_216.0 - 0.5) * 2.0 * scale
            }
        })
        .collect()
}

#[test]
fn every_kernel_matches_the_scalar_specification() {
    for (rows, cols) in [(1, 1), (3, 5), (8, 8), (17, 9), (33, 70), (64, 1), (1, 100)] {
        for r in [1usize, 2, 4] {
            for (salt, scale) in [(1u64, 1.0f32), (2, 1e-25), (3, 1e19), (4, 3e-39)] {
                let m = values(rows * cols, salt, scale);
                let mut q = vec![0.0f32; r * cols];
                init_q(&mut q, salt, 7);
                let (mut p, mut p_spec) = (vec![0.0f32; r * rows], vec![0.0f32; r * rows]);
                project(&m, rows, cols, &q, &mut p).unwrap();
                scalar::powersgd_project(&m, rows, cols, &q, &mut p_spec);
                assert!(
                    same_bits(&p, &p_spec),
                    "project {rows}x{cols} r {r} scale {scale}"
                );
                if p.iter().all(|x| x.is_finite()) {
                    orthogonalize(&mut p, rows).unwrap();
                    scalar::powersgd_orthogonalize(&mut p_spec, rows);
                    assert!(
                        same_bits(&p, &p_spec),
                        "orthogonalize {rows}x{cols} r {r} {scale}"
                    );
                }
                let (mut q2, mut q2_spec) = (vec![0.0f32; r * cols], vec![0.0f32; r * cols]);
                back_project(&m, rows, cols, &p, &mut q2).unwrap();
                scalar::powersgd_back_project(&m, rows, cols, &p, &mut q2_spec);
                assert!(same_bits(&q2, &q2_spec), "back_project {rows}x{cols} r {r}");
                for weight in [None, Some(-1.0), Some(0.25)] {
                    let mut out = m.clone();
                    let mut spec = m.clone();
                    reconstruct(&p, &q2, rows, cols, &mut out, weight).unwrap();
                    scalar::powersgd_reconstruct(&p, &q2, rows, cols, &mut spec, weight);
                    assert!(
                        same_bits(&out, &spec),
                        "reconstruct {rows}x{cols} r {r} {weight:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn orthogonalized_columns_are_orthonormal_and_zero_columns_stay_zero() {
    let rows = 50;
    let mut p = values(4 * rows, 9, 3.0);
    p[2 * rows..3 * rows].fill(0.0);
    orthogonalize(&mut p, rows).unwrap();
    for a in 0..4 {
        for b in 0..4 {
            let d: f64 = (0..rows)
                .map(|i| f64::from(p[a * rows + i]) * f64::from(p[b * rows + i]))
                .sum();
            let want = if a == b && a != 2 { 1.0 } else { 0.0 };
            assert!((d - want).abs() < 1e-5, "columns {a}, {b}: {d}");
        }
    }
    // A column so small that its sum of squares underflows is normalized all the same.
    let mut tiny = vec![1e-30f32; 8];
    orthogonalize(&mut tiny, 8).unwrap();
    for x in &tiny {
        assert!((x - 8f32.sqrt().recip()).abs() < 1e-6, "{x}");
    }
}

// ---------------------------------------------------------------------------------------------
// Convergence to the truncated SVD.

/// `count` orthonormal f64 vectors of length `n` (Gram-Schmidt of deterministic ones).
fn orthonormal(n: usize, count: usize, salt: u64) -> Vec<Vec<f64>> {
    let mut basis: Vec<Vec<f64>> = Vec::new();
    for c in 0..count {
        let mut v: Vec<f64> = values(n, salt * 1000 + c as u64, 1.0)
            .iter()
            .map(|&x| f64::from(x) + 0.01)
            .collect();
        for _ in 0..2 {
            for b in &basis {
                let d: f64 = v.iter().zip(b).map(|(x, y)| x * y).sum();
                v.iter_mut().zip(b).for_each(|(x, y)| *x -= d * y);
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter_mut().for_each(|x| *x /= norm);
        basis.push(v);
    }
    basis
}

/// One warm-started PowerSGD step on one worker: returns the approximation and the new Q.
fn step(m: &[f32], rows: usize, cols: usize, q: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let r = q.len() / cols;
    let mut p = vec![0.0f32; r * rows];
    project(m, rows, cols, q, &mut p).unwrap();
    orthogonalize(&mut p, rows).unwrap();
    let mut q_new = vec![0.0f32; r * cols];
    back_project(m, rows, cols, &p, &mut q_new).unwrap();
    let mut approx = vec![0.0f32; rows * cols];
    reconstruct(&p, &q_new, rows, cols, &mut approx, None).unwrap();
    (approx, q_new)
}

#[test]
fn warm_started_steps_reach_the_truncated_svd_error() {
    let (rows, cols) = (96, 64);
    // Singular values with a gap after each rank tested: 4 large, then a slow tail.
    let sigma: Vec<f64> = (0..cols)
        .map(|i| match i {
            0 => 20.0,
            1..=3 => 12.0 - 2.0 * i as f64,
            _ => 2.0 * 0.97f64.powi(i as i32),
        })
        .collect();
    let u = orthonormal(rows, cols, 1);
    let v = orthonormal(cols, cols, 2);
    let m64: Vec<f64> = (0..rows * cols)
        .map(|t| {
            let (i, k) = (t / cols, t % cols);
            (0..cols).map(|s| u[s][i] * sigma[s] * v[s][k]).sum()
        })
        .collect();
    let m: Vec<f32> = m64.iter().map(|&x| x as f32).collect();
    let frob = |approx: &[f32]| -> f64 {
        m.iter()
            .zip(approx)
            .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    for r in [1usize, 4] {
        // The rank-r truncated SVD's error: the norm of the singular values past r.
        let best = sigma[r..].iter().map(|s| s * s).sum::<f64>().sqrt();
        let mut q = vec![0.0f32; r * cols];
        init_q(&mut q, 42, 3);
        let first = frob(&step(&m, rows, cols, &q).0);
        let mut err = f64::INFINITY;
        for _ in 0..30 {
            let (approx, q_new) = step(&m, rows, cols, &q);
            err = frob(&approx);
            q = q_new;
        }
        println!(
            "rank {r}: first step {first:.4}, after 30 steps {err:.4}, truncated SVD {best:.4}"
        );
        assert!(err <= best * 1.01, "rank {r}: {err} against {best}");
        assert!(
            err >= best * (1.0 - 1e-4),
            "rank {r}: below the optimum? {err} < {best}"
        );
    }
}

#[test]
fn the_residual_is_exactly_m_minus_the_reconstruction() {
    let (rows, cols, r) = (40, 30, 2);
    let g = values(rows * cols, 5, 0.1);
    let residual = values(rows * cols, 6, 0.05);
    let m: Vec<f32> = g.iter().zip(&residual).map(|(a, b)| a + b).collect();
    let mut q = vec![0.0f32; r * cols];
    init_q(&mut q, 1, 2);
    let mut p = vec![0.0f32; r * rows];
    project(&m, rows, cols, &q, &mut p).unwrap();
    orthogonalize(&mut p, rows).unwrap();
    back_project(&m, rows, cols, &p, &mut q).unwrap();
    let mut sent = vec![0.0f32; rows * cols];
    reconstruct(&p, &q, rows, cols, &mut sent, None).unwrap();
    let mut new_residual = m.clone();
    reconstruct(&p, &q, rows, cols, &mut new_residual, Some(-1.0)).unwrap();
    for t in 0..rows * cols {
        // sent + residual_new == gradient + residual_old, to the rounding of one subtraction.
        assert_eq!(new_residual[t].to_bits(), (m[t] - sent[t]).to_bits(), "{t}");
    }
}

#[test]
fn bad_shapes_and_values_are_errors() {
    let m = vec![1.0f32; 12];
    let q = vec![0.5f32; 8];
    let mut p = vec![0.0f32; 6];
    assert!(matches!(
        project(&m[..11], 3, 4, &q, &mut p),
        Err(Error::LengthMismatch { expected: 12, .. })
    ));
    assert!(matches!(
        project(&m, 3, 4, &q[..7], &mut p),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        project(&m, 3, 4, &q, &mut p[..5]),
        Err(Error::LengthMismatch { expected: 6, .. })
    ));
    let mut q2 = vec![0.0f32; 9];
    assert!(back_project(&m, 3, 4, &p, &mut q2).is_err());
    let mut out = vec![0.0f32; 11];
    assert!(reconstruct(&p, &q, 3, 4, &mut out, None).is_err());
    let mut bad = vec![1.0, f32::NAN, 2.0, 3.0];
    assert_eq!(
        orthogonalize(&mut bad, 2),
        Err(Error::NonFinite { index: 1 })
    );
    assert!(same_bits(&bad[..1], &[1.0]), "nothing changes on error");
    assert!(orthogonalize(&mut [1.0, 2.0, 3.0], 2).is_err());
    assert!(orthogonalize(&mut [], 0).is_ok());
}

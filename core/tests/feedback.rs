//! Error feedback loses nothing: for every method, over 1,000 random steps, every coordinate
//! satisfies `sent + residual_new == gradient + residual_old`, exactly where values travel as
//! f32 and within one f32 rounding of the dequantized value otherwise.

mod common;

use common::{Data, decode, feedback_methods};
use gradwire_core::{Method, Params, Values, feedback_step, max_frame_len, scratch_len};

const STEPS: u64 = 1000;
const N: usize = 300;

fn ulp(x: f32) -> f64 {
    let a = x.abs();
    if a >= f32::MAX {
        return a as f64 * f64::powi(2.0, -23);
    }
    f32::from_bits(a.to_bits() + 1) as f64 - a as f64
}

/// Values travel as f32: the identity holds exactly.
fn exact(method: &Method) -> bool {
    matches!(method.values(), Some(Values::F32))
}

#[test]
fn nothing_is_lost_over_1000_steps_for_every_method() {
    for (name, method) in feedback_methods() {
        let mut d = Data(0xfeed ^ name.len() as u64);
        let mut residual = vec![0.0f32; N];
        let mut out = vec![0u8; max_frame_len(N, &method)];
        let mut scratch = vec![0u32; scratch_len(N, &method)];
        let mut worst = 0.0f64;
        for step in 0..STEPS {
            let params = Params::new(method)
                .with_seed(99)
                .at_step(step)
                .for_tensor(7);
            let mut g = d.grads(N);
            // Some steps carry ties, zeros of both signs and a constant run.
            if step % 7 == 0 {
                g[..40].fill(0.5);
                g[40] = -0.0;
                g[41] = 0.0;
            }
            let old = residual.clone();
            let len = feedback_step(&g, &mut residual, &params, &mut scratch, &mut out)
                .unwrap_or_else(|e| panic!("{name} step {step}: {e}"));
            let sent = decode(&out[..len], &params, N).unwrap();
            for i in 0..N {
                let x = g[i] + old[i];
                let back = sent[i] + residual[i];
                if exact(&method) {
                    assert!(
                        back == x,
                        "{name} step {step} [{i}]: {} + {} != {x}",
                        sent[i],
                        residual[i]
                    );
                } else {
                    // residual_new = fl(x - sent): one rounding, at most half an ulp of the
                    // larger of |x| and |sent|; compared in f64 so the check adds none.
                    let err = (sent[i] as f64 + residual[i] as f64 - x as f64).abs();
                    let tol = 0.5 * ulp(x).max(ulp(sent[i]));
                    assert!(
                        err <= tol,
                        "{name} step {step} [{i}]: error {err:e} > {tol:e}"
                    );
                    worst = worst.max(err);
                }
                assert!(residual[i].is_finite());
            }
        }
        // The residual stays bounded (it would grow without bound if values were lost).
        let max_r = residual.iter().fold(0.0f32, |m, r| m.max(r.abs()));
        assert!(max_r < 1.0e3, "{name}: residual grew to {max_r}");
    }
}

//! `feedback_step_bounded` (the one-pass top-k step) equals `feedback_step` bit for bit: frame,
//! residual and errors, step after step, on every path (sample hit, sample miss, small
//! tensors, other methods, gradients too large for the proof), and the bound it keeps holds.

mod common;

use common::{Data, same_bits};
use gradwire_core::select::SAMPLED_MIN;
use gradwire_core::{
    Error, K, Method, Params, ResidualBound, Values, feedback_step, feedback_step_bounded,
    max_frame_len, scratch_len,
};

/// Runs both steps on copies of one residual and checks that they agree; returns the result.
struct Pair {
    plain: Vec<f32>,
    bounded: Vec<f32>,
    bound: ResidualBound,
    scratch: Vec<u32>,
    out: Vec<u8>,
    out2: Vec<u8>,
}

impl Pair {
    fn new(n: usize, method: &Method) -> Self {
        Pair {
            plain: vec![0.0; n],
            bounded: vec![0.0; n],
            bound: ResidualBound::ZERO,
            scratch: vec![0; scratch_len(n, method)],
            out: vec![0; max_frame_len(n, method)],
            out2: vec![0; max_frame_len(n, method)],
        }
    }

    fn step(&mut self, g: &[f32], params: &Params, what: &str) -> Result<usize, Error> {
        let before = self.bound;
        let a = feedback_step(g, &mut self.plain, params, &mut self.scratch, &mut self.out);
        let b = feedback_step_bounded(
            g,
            &mut self.bounded,
            &mut self.bound,
            params,
            &mut self.scratch,
            &mut self.out2,
        );
        assert_eq!(a, b, "{what}: results");
        if let Ok(len) = a {
            assert_eq!(self.out[..len], self.out2[..len], "{what}: frames");
            let held = ResidualBound::of(&self.bounded).max_abs();
            assert!(
                held <= self.bound.max_abs(),
                "{what}: bound {} below the residual's {held}",
                self.bound.max_abs()
            );
        } else {
            assert_eq!(self.bound, before, "{what}: bound changed on error");
        }
        assert!(same_bits(&self.plain, &self.bounded), "{what}: residuals");
        a
    }
}

fn topk(k: K, values: Values) -> Method {
    Method::TopK { k, values }
}

fn grads(d: &mut Data, n: usize, scale: f32) -> Vec<f32> {
    d.grads(n).into_iter().map(|x| x * scale).collect()
}

#[test]
fn one_pass_topk_equals_the_two_pass_step() {
    let n = SAMPLED_MIN * 3 + 13; // a tail that is not a whole group
    let methods = [
        topk(K::Ratio(0.01), Values::Int8 { block: 256 }),
        topk(K::Ratio(0.001), Values::F32),
        topk(K::Count(1), Values::F16),
        topk(K::Count(n as u64 - 1), Values::Bf16),
        topk(K::Ratio(0.3), Values::F32),
    ];
    for (m, method) in methods.iter().enumerate() {
        let mut d = Data(0xb0d ^ m as u64);
        let mut pair = Pair::new(n, method);
        for step in 0..6u64 {
            let params = Params::new(*method).at_step(step);
            let mut g = grads(&mut d, n, 1.0 + step as f32);
            if step == 0 {
                // With the residual zero, ties everywhere: more candidates than the lists
                // hold, so the exact selection runs on the stored sums.
                g.fill(0.25);
            }
            pair.step(&g, &params, &format!("method {m} step {step}"))
                .unwrap_or_else(|e| panic!("method {m} step {step}: {e}"));
            // The one pass leaves the smallest kept magnitude as the bound, above every
            // residual here; the two-pass path would have measured the residual's maximum.
            // (Not for method 3, which keeps all but one: its largest rounding error, not a
            // kept magnitude, is the bound.)
            if step > 0 && m != 3 {
                let measured = ResidualBound::of(&pair.bounded).max_abs();
                assert!(
                    pair.bound.max_abs() > measured,
                    "method {m} step {step}: the one-pass step did not run"
                );
            }
        }
    }
}

#[test]
fn every_other_path_keeps_the_plain_steps_result() {
    let mut d = Data(0x5eed);
    // A small tensor, k = 0, k = n, a method without the one-pass path: plain path.
    let cases = [
        (1000, topk(K::Ratio(0.01), Values::F32)),
        (SAMPLED_MIN, topk(K::Count(0), Values::F32)),
        (SAMPLED_MIN, topk(K::Count(SAMPLED_MIN as u64), Values::F32)),
        (
            SAMPLED_MIN,
            Method::Threshold {
                threshold: 0.5,
                values: Values::F32,
            },
        ),
    ];
    for (c, (n, method)) in cases.iter().enumerate() {
        let mut pair = Pair::new(*n, method);
        for step in 0..3u64 {
            let g = grads(&mut d, *n, 1.0);
            pair.step(
                &g,
                &Params::new(*method).at_step(step),
                &format!("case {c}"),
            )
            .unwrap();
        }
    }
}

#[test]
fn errors_leave_residual_and_bound_untouched() {
    let n = SAMPLED_MIN * 2;
    let method = topk(K::Ratio(0.01), Values::F16);
    let mut d = Data(7);
    let mut pair = Pair::new(n, &method);
    let params = Params::new(method);
    pair.step(&grads(&mut d, n, 1.0), &params, "warm").unwrap();
    // NaN and infinity in the gradient.
    for bad in [f32::NAN, f32::INFINITY] {
        let mut g = grads(&mut d, n, 1.0);
        g[n - 5] = bad;
        let e = pair.step(&g, &params, "non-finite").unwrap_err();
        assert_eq!(e, Error::NonFinite { index: n - 5 });
    }
    // A sum beyond f16's range is sent saturated by the one pass and by the plain path alike
    // (same frame, same residual: `Pair::step` compares them), the excess kept.
    let mut g = grads(&mut d, n, 1.0);
    g[100] = 70_000.0;
    let old = pair.plain[100];
    pair.step(&g, &params, "beyond f16").unwrap();
    assert_eq!(pair.plain[100], (70_000.0 + old) - 65_504.0);
    g[100] = 40_000.0;
    pair.step(&g, &params, "large").unwrap();
    pair.step(&grads(&mut d, n, 1.0), &params, "after").unwrap();
    pair.step(&grads(&mut d, n, 1.0), &params, "after 2")
        .unwrap();
}

#[test]
fn sums_near_f32_max_stay_finite_or_are_refused() {
    let n = SAMPLED_MIN;
    let method = topk(K::Count(1), Values::F32);
    let mut d = Data(11);
    let params = Params::new(method);
    // Just below 2^127 (the proof's edge for f32 values): element 4 is left unsent, so its
    // residual is that value, and the next step, in one pass, sums it to f32::MAX exactly.
    let below = f32::from_bits(0x7eff_ffff);
    let mut pair = Pair::new(n, &method);
    let mut g = grads(&mut d, n, 1.0);
    g[3] = below;
    g[4] = below;
    pair.step(&g, &params, "edge 1").unwrap();
    assert_eq!(pair.bound.max_abs(), below);
    let mut g = grads(&mut d, n, 1.0);
    g[4] = below;
    pair.step(&g, &params, "edge 2").unwrap();
    assert_eq!(pair.plain[4], 0.0); // f32::MAX was sent
    // At f32::MAX: the residual left is above half the range, so the next step takes the plain
    // path, which refuses the overflowing sum and changes nothing.
    let mut pair = Pair::new(n, &method);
    let mut g = grads(&mut d, n, 1.0);
    g[9] = f32::MAX;
    g[10] = f32::MAX;
    pair.step(&g, &params, "max 1").unwrap();
    assert_eq!(pair.bound.max_abs(), f32::MAX);
    let mut g = grads(&mut d, n, 1.0);
    g[10] = f32::MAX;
    let e = pair.step(&g, &params, "max 2").unwrap_err();
    assert_eq!(e, Error::NonFinite { index: 10 });
}

#[test]
fn residual_bound_of_a_slice() {
    assert_eq!(ResidualBound::of(&[]).max_abs(), 0.0);
    assert_eq!(ResidualBound::of(&[1.0, -3.5, 2.0]).max_abs(), 3.5);
    assert_eq!(ResidualBound::of(&[1.0, f32::NAN]), ResidualBound::UNKNOWN);
    assert_eq!(
        ResidualBound::of(&[f32::NEG_INFINITY]),
        ResidualBound::UNKNOWN
    );
    assert_eq!(ResidualBound::ZERO.max_abs(), 0.0);
    assert_eq!(ResidualBound::UNKNOWN.max_abs(), f32::INFINITY);
}

//! quickcheck properties of every kernel against independent oracles (tests/common), one macro
//! per kernel generating the property for each variant. Inputs are built from arbitrary `u32`
//! bits (NaN/Inf mapped to finite), so -0.0, subnormals, ties and extremes appear; lengths are
//! 0..=515. One deterministic large case (n >= 10^6) per kernel follows the properties.

mod common;

use common::*;
use gradwire_core::index::{self, IndexSizer, IndexWriter};
use gradwire_core::scalar::Selection;
use gradwire_core::{
    Error, K, Method, Params, Rounding, SignScale, Values, decode_into, encode_selected_into,
    max_frame_len, quant, rng, scratch_len, select, sign,
};
use quickcheck::TestResult;

const CASES: u64 = 200;

// ---------------------------------------------------------------------------------------------
// Top-k

fn kernel_topk(g: &[f32], k: usize) -> Vec<usize> {
    let mut scratch = vec![0u32; select::topk_scratch_len(g.len())];
    let sel = select::topk(g, k, &mut scratch);
    let mut idx = Vec::new();
    select::for_each_kept(g, sel, |i| idx.push(i));
    idx
}

fn first_unfit(v: Values, g: &[f32]) -> Option<usize> {
    g.iter().position(|&x| match v {
        Values::F16 => !half::f16::from_f32(x).is_finite(),
        Values::Bf16 => !half::bf16::from_f32(x).is_finite(),
        _ => false,
    })
}

/// Encodes a sparse frame and checks its decode against `idx` (the oracle's kept indices).
fn check_sparse_frame(g: &[f32], params: &Params, idx: &[usize]) -> Result<(), String> {
    let v = params.method.values().unwrap();
    let frame = match encode(g, params) {
        Ok(f) => f,
        Err(e) => {
            return match first_unfit(v, g) {
                Some(i) if e == (Error::ValueOutOfRange { index: i }) => Ok(()),
                _ => Err(format!("encode: {e:?}")),
            };
        }
    };
    if let Some(i) = first_unfit(v, g) {
        return Err(format!("{i} does not fit {v:?} but encode succeeded"));
    }
    let kept: Vec<f32> = idx.iter().map(|&i| g[i]).collect();
    let want = scatter(g.len(), idx, &sparse_values_oracle(v, &kept));
    let mut out = vec![f32::NAN; g.len()];
    let info = decode_into(&frame, params, &mut out).map_err(|e| format!("decode: {e:?}"))?;
    if info.kept != idx.len() as u64 {
        return Err(format!("kept {} != {}", info.kept, idx.len()));
    }
    if !same_bits(&out, &want) {
        return Err(format!("decoded {out:?}\nwanted  {want:?}"));
    }
    Ok(())
}

fn check_topk(g: &[f32], kseed: u32, v: Values) -> TestResult {
    let n = g.len();
    let k = kseed as usize % (n + 2); // 0..=n+1: k = 0 and k > n included
    let want = topk_oracle(g, k.min(n));
    let got = kernel_topk(g, k);
    if got != want {
        return TestResult::error(format!("k={k}: kernel {got:?} != oracle {want:?}"));
    }
    let params = Params::new(Method::TopK {
        k: K::Count(k as u64),
        values: v,
    });
    match check_sparse_frame(g, &params, &want) {
        Ok(()) => TestResult::passed(),
        Err(e) => TestResult::error(format!("k={k}: {e}")),
    }
}

macro_rules! topk_props {
    ($($name:ident: $values:expr,)*) => {$(
        #[test]
        fn $name() {
            fn prop(g: Floats, kseed: u32) -> TestResult {
                check_topk(&g.0, kseed, $values)
            }
            qc(CASES, prop as fn(Floats, u32) -> TestResult);
            fn moderate(g: Moderate, kseed: u32) -> TestResult {
                check_topk(&g.0, kseed, $values)
            }
            qc(CASES / 2, moderate as fn(Moderate, u32) -> TestResult);
        }
    )*};
}

topk_props! {
    topk_f32: Values::F32,
    topk_f16: Values::F16,
    topk_bf16: Values::Bf16,
    topk_int8_block1: Values::Int8 { block: 1 },
    topk_int8_block7: Values::Int8 { block: 7 },
    topk_int8_block256: Values::Int8 { block: 256 },
}

/// n = 10^6 with about 62,500 elements at each of 16 magnitudes: the cut falls inside a tie
/// class, so ties must go to the lower index.
#[test]
fn topk_large_with_ties() {
    let mut d = Data(11);
    let g: Vec<f32> = (0..1_000_000)
        .map(|_| {
            let r = d.next_u64();
            let mag = (1 + (r % 16)) as f32 * 0.125;
            if r & (1 << 40) != 0 { -mag } else { mag }
        })
        .collect();
    // The oracle's order once: (|x| descending, index ascending).
    let mut order: Vec<usize> = (0..g.len()).collect();
    order.sort_by(|&a, &b| g[b].abs().partial_cmp(&g[a].abs()).unwrap().then(a.cmp(&b)));
    for k in [1usize, 70_000, 100_000] {
        let mut want = order[..k].to_vec();
        want.sort_unstable();
        assert_eq!(kernel_topk(&g, k), want, "k = {k}");
        let params = Params::new(Method::TopK {
            k: K::Count(k as u64),
            values: Values::F32,
        });
        check_sparse_frame(&g, &params, &want).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Top-k frames at caller-chosen indices (encode_selected_into)

fn selected(g: &[f32], kept: &[u32], v: Values) -> Result<Vec<u8>, Error> {
    let m = Method::TopK {
        k: K::Count(kept.len() as u64),
        values: v,
    };
    let mut out = vec![0xeeu8; max_frame_len(g.len(), &m)];
    let mut scratch = vec![0u32; scratch_len(g.len(), &m)];
    match encode_selected_into(g, kept, v, &mut scratch, &mut out) {
        Ok(len) => {
            out.truncate(len);
            Ok(out)
        }
        Err(e) => {
            assert!(
                gradwire_core::peek(&out).is_err(),
                "a valid frame on error {e:?}"
            );
            Err(e)
        }
    }
}

fn check_selected(g: &[f32], mask: &[bool], kseed: u32, v: Values) -> TestResult {
    let n = g.len();
    // An arbitrary ascending subset decodes to exactly those entries.
    let idx: Vec<usize> = (0..n)
        .filter(|&i| mask.get(i).copied().unwrap_or(false))
        .collect();
    let kept: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    let params = Params::new(Method::TopK {
        k: K::Count(idx.len() as u64),
        values: v,
    });
    match selected(g, &kept, v) {
        Ok(frame) => {
            let vals: Vec<f32> = idx.iter().map(|&i| g[i]).collect();
            let want = scatter(n, &idx, &sparse_values_oracle(v, &vals));
            match decode(&frame, &params, n) {
                Ok(out) if same_bits(&out, &want) => {}
                other => return TestResult::error(format!("{other:?} != {want:?}")),
            }
        }
        Err(e) => match first_unfit(v, g) {
            Some(i) if e == (Error::ValueOutOfRange { index: i }) => {}
            _ => return TestResult::error(format!("encode_selected_into: {e:?}")),
        },
    }
    // The top-k oracle's indices give the same bytes as top-k itself.
    let k = kseed as usize % (n + 1);
    let top: Vec<u32> = topk_oracle(g, k).iter().map(|&i| i as u32).collect();
    let params = Params::new(Method::TopK {
        k: K::Count(k as u64),
        values: v,
    });
    if selected(g, &top, v).ok() != encode(g, &params).ok() {
        return TestResult::error(format!("k={k}: selected top-k differs from top-k"));
    }
    // A list that is not strictly ascending, or reaches n, is refused naming its position
    // (an input that does not fit the value codec is refused first).
    if first_unfit(v, g).is_some() {
        return TestResult::passed();
    }
    if kept.len() >= 2 {
        let mut bad = kept.clone();
        bad.swap(0, 1);
        if selected(g, &bad, v).err() != Some(Error::UnsortedIndices { position: 1 }) {
            return TestResult::error("unsorted list accepted");
        }
    }
    let mut bad = kept.clone();
    bad.push(n as u32);
    if selected(g, &bad, v).err()
        != Some(Error::UnsortedIndices {
            position: kept.len(),
        })
    {
        return TestResult::error("index n accepted");
    }
    TestResult::passed()
}

macro_rules! selected_props {
    ($($name:ident: $values:expr,)*) => {$(
        #[test]
        fn $name() {
            fn prop(g: Floats, mask: Vec<bool>, kseed: u32) -> TestResult {
                check_selected(&g.0, &mask, kseed, $values)
            }
            qc(CASES / 2, prop as fn(Floats, Vec<bool>, u32) -> TestResult);
        }
    )*};
}

selected_props! {
    selected_f32: Values::F32,
    selected_bf16: Values::Bf16,
    selected_int8: Values::Int8 { block: 4 },
}

// ---------------------------------------------------------------------------------------------
// Threshold

fn check_threshold(g: &[f32], t: f32, v: Values) -> TestResult {
    let t = t.abs();
    let want = threshold_oracle(g, t);
    let mut got = Vec::new();
    select::for_each_kept(g, Selection::Threshold(t), |i| got.push(i));
    if got != want {
        return TestResult::error(format!("t={t}: kernel {got:?} != oracle {want:?}"));
    }
    let params = Params::new(Method::Threshold {
        threshold: t,
        values: v,
    });
    match check_sparse_frame(g, &params, &want) {
        Ok(()) => TestResult::passed(),
        Err(e) => TestResult::error(format!("t={t}: {e}")),
    }
}

macro_rules! threshold_props {
    ($($name:ident: $values:expr,)*) => {$(
        #[test]
        fn $name() {
            fn prop(g: Floats, tbits: u32, from_input: usize) -> TestResult {
                // Half the time the threshold is one of the input's magnitudes (ties at t).
                let t = if from_input % 2 == 0 && !g.0.is_empty() {
                    g.0[from_input % g.0.len()]
                } else {
                    finite_from_bits(tbits)
                };
                check_threshold(&g.0, t, $values)
            }
            qc(CASES, prop as fn(Floats, u32, usize) -> TestResult);
        }
    )*};
}

threshold_props! {
    threshold_f32: Values::F32,
    threshold_f16: Values::F16,
    threshold_int8_block5: Values::Int8 { block: 5 },
}

#[test]
fn threshold_large() {
    let mut d = Data(12);
    let g = d.grads(1_000_000);
    let t = 1.0e-2;
    let want = threshold_oracle(&g, t);
    assert!(want.len() > 1000 && want.len() < 500_000);
    let params = Params::new(Method::Threshold {
        threshold: t,
        values: Values::F32,
    });
    check_sparse_frame(&g, &params, &want).unwrap();
    // The threshold equal to an element's magnitude: that element is not kept (|g| > t only).
    let t = g[want[0]].abs();
    let params = Params::new(Method::Threshold {
        threshold: t,
        values: Values::Bf16,
    });
    check_sparse_frame(&g, &params, &threshold_oracle(&g, t)).unwrap();
    assert!(!threshold_oracle(&g, t).contains(&want[0]));
}

// ---------------------------------------------------------------------------------------------
// Quantization

const BLOCKS: [usize; 5] = [1, 3, 8, 64, 512];

/// One ulp of `m` (the gap to the next f32), at least the smallest subnormal.
fn ulp(m: f32) -> f64 {
    if m >= f32::MAX {
        return m as f64 * f64::powi(2.0, -23);
    }
    (f32::from_bits(m.to_bits() + 1) as f64 - m as f64).max(f64::powi(2.0, -149))
}

/// Checks quantization of `x`: kernel bytes against the bitvec oracle, the frame's decode against
/// the oracle's values, and the error bound.
///
/// Nearest rounding: `|x - d| <= scale / 2 + 4 ulp(m)` with `scale = m / l`. The slack is float
/// rounding only: `y = fl(fl(x / m) * l)` is within `2u * l` of `x * l / m` (u = 2^-24), so the
/// rounded code is within `1/2 + 2u * l` steps of the exact position; the decode
/// `fl(fl(q / l) * m)` adds at most `2u * m`; together `4u * m <= 4 ulp(m)`. For a subnormal `m`
/// the product's absolute error (at most 2^-150) is also below one ulp(m) = 2^-149.
/// Stochastic rounding: the error is below one step: `|x - d| <= scale + 4 ulp(m)`.
fn check_quant(
    x: &[f32],
    bits: u8,
    block: usize,
    rounding: Rounding,
    seed: u64,
) -> Result<(), String> {
    let stochastic = match rounding {
        Rounding::Stochastic => Some((seed, 3, 9)),
        Rounding::NearestEven => None,
    };
    let key = stochastic.map(|(s, t, i)| rng_key(s, t, i));
    let (want_scales, want_codes, want_values) = quant_oracle(x, bits, block, key);
    let mut scales = vec![0u8; quant::scales_len(x.len(), block)];
    let mut codes = vec![0xa5u8; quant::codes_len(x.len(), bits)];
    quant::encode(x, bits, block, stochastic, &mut scales, &mut codes);
    if scales != want_scales {
        return Err(format!("scales {scales:?} != oracle {want_scales:?}"));
    }
    if codes != want_codes {
        return Err(format!("codes {codes:02x?} != oracle {want_codes:02x?}"));
    }
    let params = Params::new(Method::Quant {
        bits,
        block: block as u32,
        rounding,
    })
    .with_seed(seed)
    .at_step(3)
    .for_tensor(9);
    let frame = encode(x, &params).map_err(|e| format!("encode: {e:?}"))?;
    let out = decode(&frame, &params, x.len()).map_err(|e| format!("decode: {e:?}"))?;
    if !same_bits(&out, &want_values) {
        return Err(format!("decoded {out:?} != oracle {want_values:?}"));
    }
    let l = levels(bits) as f64;
    for (b, chunk) in x.chunks(block).enumerate() {
        let m = absmax(chunk);
        let step = m as f64 / l;
        let bound = match rounding {
            Rounding::NearestEven => step / 2.0,
            Rounding::Stochastic => step,
        } + 4.0 * ulp(m);
        for (j, &v) in chunk.iter().enumerate() {
            let d = out[b * block + j];
            let err = (v as f64 - d as f64).abs();
            if err > bound {
                return Err(format!(
                    "x={v:e} decoded {d:e}: error {err:e} > {bound:e} (m={m:e})"
                ));
            }
        }
    }
    Ok(())
}

macro_rules! quant_props {
    ($($name:ident: $bits:expr, $rounding:expr;)*) => {$(
        #[test]
        fn $name() {
            fn prop(x: Floats, block: u8, seed: u64) -> TestResult {
                let block = BLOCKS[block as usize % BLOCKS.len()];
                match check_quant(&x.0, $bits, block, $rounding, seed) {
                    Ok(()) => TestResult::passed(),
                    Err(e) => TestResult::error(format!("block {block}: {e}")),
                }
            }
            qc(CASES, prop as fn(Floats, u8, u64) -> TestResult);
        }
    )*};
}

quant_props! {
    quant2_nearest: 2, Rounding::NearestEven;
    quant3_nearest: 3, Rounding::NearestEven;
    quant4_nearest: 4, Rounding::NearestEven;
    quant5_nearest: 5, Rounding::NearestEven;
    quant6_nearest: 6, Rounding::NearestEven;
    quant7_nearest: 7, Rounding::NearestEven;
    quant8_nearest: 8, Rounding::NearestEven;
    quant2_stochastic: 2, Rounding::Stochastic;
    quant3_stochastic: 3, Rounding::Stochastic;
    quant4_stochastic: 4, Rounding::Stochastic;
    quant5_stochastic: 5, Rounding::Stochastic;
    quant6_stochastic: 6, Rounding::Stochastic;
    quant7_stochastic: 7, Rounding::Stochastic;
    quant8_stochastic: 8, Rounding::Stochastic;
}

#[test]
fn quant_large() {
    let mut d = Data(13);
    let x = d.grads(1_000_000);
    check_quant(&x, 4, 512, Rounding::NearestEven, 0).unwrap();
    check_quant(&x, 3, 1000, Rounding::Stochastic, 5).unwrap();
}

/// The mean over N seeds of a stochastically rounded value is within 4 sigma / sqrt(N) of the
/// input, where sigma is the standard deviation of one draw: the value lies at a fraction `p`
/// of a step above a code, so a draw is `lo + step * Bernoulli(p)`, sigma = step * sqrt(p(1-p)).
#[test]
fn stochastic_rounding_is_unbiased() {
    const N: u64 = 4000;
    for bits in [2u8, 4, 8] {
        let l = levels(bits) as f32;
        for p in [0.25f32, 0.5, 0.75, 0.1] {
            for base in [0.0f32, 1.0, -2.0] {
                if base.abs() + 1.0 > l {
                    continue;
                }
                // Block [1.0 (absmax), x]: step = 1 / l; x sits at fraction p above `base` steps.
                let x = (base + p) / l;
                let step = 1.0 / l as f64;
                let params = |seed| {
                    Params::new(Method::Quant {
                        bits,
                        block: 2,
                        rounding: Rounding::Stochastic,
                    })
                    .with_seed(seed)
                };
                let mut sum = 0.0f64;
                for seed in 0..N {
                    let frame = encode(&[1.0, x], &params(seed)).unwrap();
                    let d = decode(&frame, &params(seed), 2).unwrap()[1] as f64;
                    let lo = base as f64 * step;
                    assert!(
                        d >= lo - 1e-6 && d <= lo + step + 1e-6,
                        "draw {d} outside its step"
                    );
                    sum += d;
                }
                let mean = sum / N as f64;
                let sigma = step * ((p * (1.0 - p)) as f64).sqrt();
                let tol = 4.0 * sigma / (N as f64).sqrt();
                assert!(
                    (mean - x as f64).abs() <= tol,
                    "bits {bits} x {x}: mean {mean} off by {} > {tol}",
                    (mean - x as f64).abs()
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sign

fn check_sign(x: &[f32], block: Option<usize>) -> Result<(), String> {
    let (want_scales, want_bits) = sign_oracle(x, block);
    let mut scales = vec![0u8; sign::scales_len(x.len(), block)];
    let mut bits = vec![0xa5u8; sign::bits_len(x.len())];
    sign::encode(x, block, &mut scales, &mut bits);
    if scales != want_scales {
        return Err(format!("scales {scales:02x?} != oracle {want_scales:02x?}"));
    }
    if bits != want_bits {
        return Err(format!("bits {bits:02x?} != oracle {want_bits:02x?}"));
    }
    let scale = match block {
        Some(block) => SignScale::MeanAbs {
            block: block as u32,
        },
        None => SignScale::None,
    };
    let params = Params::new(Method::Sign {
        scale,
        zero_mask: false,
    });
    let frame = encode(x, &params).map_err(|e| format!("encode: {e:?}"))?;
    let out = decode(&frame, &params, x.len()).map_err(|e| format!("decode: {e:?}"))?;
    let b = block.unwrap_or(x.len()).max(1);
    for (c, chunk) in x.chunks(b).enumerate() {
        let s = match block {
            Some(_) => sign_scale_oracle(chunk),
            None => 1.0,
        };
        // The scale is the block's mean |x|: compare with an f64 mean (float slack n * u).
        let mean = chunk.iter().map(|v| v.abs() as f64).sum::<f64>() / chunk.len() as f64;
        if block.is_some() && (s as f64 - mean).abs() > mean * chunk.len() as f64 * 1.2e-7 + 1e-45 {
            return Err(format!("scale {s:e} is not the mean {mean:e}"));
        }
        for (j, &v) in chunk.iter().enumerate() {
            let d = out[c * b + j];
            let want = if v < 0.0 { -s } else { s };
            if d.to_bits() != want.to_bits() {
                return Err(format!("x={v:e} decoded {d:e}, want {want:e}"));
            }
            if s == 0.0 && d != 0.0 {
                return Err("zero block must decode to 0".into());
            }
        }
    }
    Ok(())
}

macro_rules! sign_props {
    ($($name:ident: $scaled:expr,)*) => {$(
        #[test]
        fn $name() {
            fn prop(x: Floats, block: u8) -> TestResult {
                let block = $scaled.then_some(BLOCKS[block as usize % BLOCKS.len()]);
                match check_sign(&x.0, block) {
                    Ok(()) => TestResult::passed(),
                    Err(e) => TestResult::error(format!("block {block:?}: {e}")),
                }
            }
            qc(CASES, prop as fn(Floats, u8) -> TestResult);
            fn moderate(x: Moderate, block: u8) -> TestResult {
                let block = $scaled.then_some(BLOCKS[block as usize % BLOCKS.len()]);
                match check_sign(&x.0, block) {
                    Ok(()) => TestResult::passed(),
                    Err(e) => TestResult::error(format!("block {block:?}: {e}")),
                }
            }
            qc(CASES / 2, moderate as fn(Moderate, u8) -> TestResult);
        }
    )*};
}

sign_props! {
    sign_scaled: true,
    sign_unscaled: false,
}

#[test]
fn sign_large() {
    let mut d = Data(14);
    let mut x = d.grads(1_000_003);
    x[2048..3072].fill(0.0); // one all-zero block of 1024
    x[5000] = -0.0;
    check_sign(&x, Some(1024)).unwrap();
    check_sign(&x, None).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Random-k

fn kernel_randomk(n: usize, k: u64, seed: u64, step: u64, id: u64) -> Vec<u64> {
    let g = vec![0.0f32; n];
    let mut idx = Vec::new();
    let key = rng::key(seed, step, id);
    select::for_each_kept(&g, Selection::RandomK { key, k }, |i| idx.push(i as u64));
    idx
}

fn check_randomk(
    g: &[f32],
    kseed: u32,
    seed: u64,
    step: u64,
    id: u64,
    v: Values,
    unbiased: bool,
) -> TestResult {
    let n = g.len();
    let k = kseed as u64 % (n as u64 + 2);
    let want = randomk_oracle(n as u64, k, seed, step, id);
    let got = kernel_randomk(n, k, seed, step, id);
    if got != want {
        return TestResult::error(format!("kernel {got:?} != oracle {want:?}"));
    }
    if got.windows(2).any(|w| w[0] >= w[1]) || got.len() as u64 != k.min(n as u64) {
        return TestResult::error("not k strictly increasing indices");
    }
    // Another step draws from another stream: the generator is keyed by it.
    if rng::key(seed, step, id) == rng::key(seed, step.wrapping_add(1), id) {
        return TestResult::error("step does not change the key");
    }
    let params = Params::new(Method::RandomK {
        k: K::Count(k),
        values: v,
        unbiased,
    })
    .with_seed(seed)
    .at_step(step)
    .for_tensor(id);
    let idx: Vec<usize> = want.iter().map(|&i| i as usize).collect();
    if !unbiased {
        return match check_sparse_frame(g, &params, &idx) {
            Ok(()) => TestResult::passed(),
            Err(e) => TestResult::error(e),
        };
    }
    let Ok(frame) = encode(g, &params) else {
        return TestResult::from_bool(first_unfit(v, g).is_some());
    };
    let kept: Vec<f32> = idx.iter().map(|&i| g[i]).collect();
    let s = if k.min(n as u64) > 0 {
        (n as f64 / k.min(n as u64) as f64) as f32
    } else {
        1.0
    };
    let vals: Vec<f32> = sparse_values_oracle(v, &kept)
        .iter()
        .map(|&x| x * s)
        .collect();
    let want = scatter(n, &idx, &vals);
    match decode(&frame, &params, n) {
        Ok(out) if same_bits(&out, &want) => TestResult::passed(),
        other => TestResult::error(format!("{other:?} != {want:?}")),
    }
}

macro_rules! randomk_props {
    ($($name:ident: $values:expr, $unbiased:expr;)*) => {$(
        #[test]
        fn $name() {
            fn prop(g: Moderate, kseed: u32, seed: u64, step: u64, id: u64) -> TestResult {
                check_randomk(&g.0, kseed, seed, step, id, $values, $unbiased)
            }
            qc(CASES, prop as fn(Moderate, u32, u64, u64, u64) -> TestResult);
        }
    )*};
}

randomk_props! {
    randomk_f32: Values::F32, false;
    randomk_f16_unbiased: Values::F16, true;
    randomk_int8: Values::Int8 { block: 3 }, false;
    randomk_bf16_unbiased: Values::Bf16, true;
}

#[test]
fn randomk_same_key_same_indices_other_step_other_set() {
    for step in 0..200u64 {
        let a = kernel_randomk(1000, 10, 77, step, 5);
        assert_eq!(a, kernel_randomk(1000, 10, 77, step, 5));
        assert_eq!(a, randomk_oracle(1000, 10, 77, step, 5));
        assert_ne!(a, kernel_randomk(1000, 10, 77, step + 1, 5), "step {step}");
        assert_ne!(
            a,
            kernel_randomk(1000, 10, 78, step, 5),
            "seed at step {step}"
        );
        assert_ne!(
            a,
            kernel_randomk(1000, 10, 77, step, 6),
            "tensor id at step {step}"
        );
    }
}

#[test]
fn randomk_large() {
    let n = 1_000_000u64;
    let got = kernel_randomk(n as usize, 10_000, 3, 4, 5);
    assert_eq!(got, randomk_oracle(n, 10_000, 3, 4, 5));
}

/// Pearson's chi-square test that each index is drawn with probability k / n: 16,000 draws of
/// k = 4 of n = 16 (fixed seeds, so the outcome is deterministic). With 15 degrees of freedom
/// the statistic exceeds 37.70 with probability 0.001 under uniformity.
#[test]
fn randomk_marginals_are_uniform_chi_square() {
    let (n, k, draws) = (16usize, 4u64, 16_000u64);
    let mut counts = vec![0u64; n];
    for d in 0..draws {
        for i in kernel_randomk(n, k, 2024, d / 100, d % 100) {
            counts[i as usize] += 1;
        }
    }
    let expected = (draws * k) as f64 / n as f64;
    let chi2: f64 = counts
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    assert!(chi2 < 37.70, "chi-square {chi2} over {counts:?}");
    // Also the joint draw: the first index position is uniform over C(16, 4) subsets' minimum
    // only in distribution; check that pairs (0, j) appear about equally: 15 cells.
    let mut pairs = vec![0u64; n];
    let mut with0 = 0u64;
    for d in 0..draws {
        let idx = kernel_randomk(n, k, 7, d, 0);
        if idx[0] == 0 {
            with0 += 1;
            for &j in &idx[1..] {
                pairs[j as usize] += 1;
            }
        }
    }
    let expected = (with0 * (k - 1)) as f64 / (n - 1) as f64;
    let chi2: f64 = pairs[1..]
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    // 14 degrees of freedom: p = 0.001 at 36.12.
    assert!(chi2 < 36.12, "pair chi-square {chi2} over {pairs:?}");
}

// ---------------------------------------------------------------------------------------------
// Index codecs

/// Ascending indices from arbitrary gaps of up to `max_width` bits; n is past the last one.
fn indices_from(gaps: &[u64], max_width: u32, extra: u64) -> (u64, Vec<u64>) {
    let mask = if max_width == 64 {
        u64::MAX
    } else {
        (1u64 << max_width) - 1
    };
    let mut idx = Vec::with_capacity(gaps.len());
    let mut next = 0u64;
    for &g in gaps {
        let w = (g >> 58) as u32 % (max_width + 1); // vary the widths within a list
        let g = g & mask & if w == 0 { 0 } else { u64::MAX >> (64 - w) };
        next += g;
        idx.push(next);
        next += 1;
    }
    (next + extra % 9, idx)
}

fn check_index(codec: u8, n: u64, idx: &[u64]) -> Result<(), String> {
    let (bitmap, delta, raw) = index_oracle(n, idx);
    let want = match codec {
        index::BITMAP => &bitmap,
        index::DELTA => &delta,
        _ => &raw,
    };
    let mut section = vec![0xa5u8; want.len()];
    let mut w = IndexWriter::new(codec, n, &mut section);
    idx.iter().for_each(|&i| w.push(i));
    w.finish();
    if &section != want {
        return Err(format!(
            "codec {codec}: {section:02x?} != oracle {want:02x?}"
        ));
    }
    let count = idx.len() as u64;
    if index::section_len(codec, n, count, &section).ok() != Some(want.len()) {
        return Err("section_len".into());
    }
    let mut back = Vec::new();
    index::for_each_index(codec, n, count, &section, |i| back.push(i))
        .map_err(|_| "decode refused a valid section".to_string())?;
    if back != idx {
        return Err(format!("round trip {back:?}"));
    }
    if index::validate(codec, n, count, &section).is_err() {
        return Err("validate refused a valid section".into());
    }
    let mut batched = Vec::new();
    index::for_each_batch(codec, n, count, &section, |b| {
        batched.extend(b.iter().map(|&i| i as u64))
    });
    if batched != idx {
        return Err(format!("batches {batched:?}"));
    }
    // The sizer measures every codec and picks the smallest (ties: delta, bitmap, raw).
    let mut sizer = IndexSizer::new(n);
    idx.iter().for_each(|&i| sizer.push(i));
    let (d, b, r) = (delta.len(), n.div_ceil(8) as usize, raw.len());
    let best = if d <= b && d <= r {
        (index::DELTA, d)
    } else if b <= r {
        (index::BITMAP, b)
    } else {
        (index::RAW, r)
    };
    if sizer.choose() != best {
        return Err(format!("sizer chose other than {best:?}"));
    }
    Ok(())
}

macro_rules! index_props {
    ($($name:ident: $codec:expr, $max_width:expr;)*) => {$(
        #[test]
        fn $name() {
            fn prop(gaps: Vec<u64>, extra: u64) -> TestResult {
                let (n, idx) = indices_from(&gaps, $max_width, extra);
                match check_index($codec, n, &idx) {
                    Ok(()) => TestResult::passed(),
                    Err(e) => TestResult::error(format!("n={n} {idx:?}: {e}")),
                }
            }
            qc(CASES, prop as fn(Vec<u64>, u64) -> TestResult);
        }
    )*};
}

index_props! {
    index_bitmap: index::BITMAP, 5;
    index_delta_narrow: index::DELTA, 6;
    index_delta_wide: index::DELTA, 56;
    index_raw: index::RAW, 40;
}

/// The cheap validation walk (`index::validate`, used by the frame decoders) gives the verdict
/// of the full decode (`index::for_each_index`) on valid sections with one byte changed, a
/// count off by one or a smaller n, including delta widths past 56 bits (the bit-reader path);
/// on the sections both accept, the batch decoder yields the same indices.
#[test]
fn index_validate_agrees_with_the_full_decode() {
    fn prop(gaps: Vec<u64>, extra: u64, pos: usize, mask: u8, how: u8) -> TestResult {
        let gaps = &gaps[..gaps.len().min(70)];
        // Up to 62-bit gaps, few enough that the indices fit a u64.
        let width = [5u32, 9, 56, 60, 62][usize::from(how) % 5];
        let gaps: Vec<u64> = gaps
            .iter()
            .take(if width > 56 { 3 } else { 70 })
            .copied()
            .collect();
        let (n, idx) = indices_from(&gaps, width, extra);
        for codec in [index::BITMAP, index::DELTA, index::RAW] {
            if codec == index::BITMAP && n > 1 << 16 {
                continue;
            }
            let (bitmap, delta, raw) = index_oracle(n, &idx);
            let mut bytes = match codec {
                index::BITMAP => bitmap,
                index::DELTA => delta,
                _ => raw,
            };
            let (mut n2, mut count) = (n, idx.len() as u64);
            match how / 5 % 4 {
                0 if !bytes.is_empty() => {
                    let at = pos % bytes.len();
                    bytes[at] ^= mask;
                }
                1 => count = count.saturating_sub(1),
                2 => count += 1,
                3 => n2 = n.saturating_sub(1 + extra % 3),
                _ => {}
            }
            let Ok(len) = index::section_len(codec, n2, count, &bytes) else {
                continue;
            };
            let section = &bytes[..len];
            let mut full = Vec::new();
            let want = index::for_each_index(codec, n2, count, section, |i| full.push(i));
            let got = index::validate(codec, n2, count, section);
            if want.is_ok() != got.is_ok() {
                return TestResult::error(format!(
                    "codec {codec} n {n2} count {count}: decode {want:?}, validate {got:?}"
                ));
            }
            if got.is_ok() {
                let mut batched = Vec::new();
                index::for_each_batch(codec, n2, count, section, |b| {
                    batched.extend(b.iter().map(|&i| i as u64))
                });
                if batched != full {
                    return TestResult::error(format!("codec {codec}: batches differ"));
                }
            }
        }
        TestResult::passed()
    }
    qc(
        CASES,
        prop as fn(Vec<u64>, u64, usize, u8, u8) -> TestResult,
    );
}

/// Full delta blocks (32 gaps) at every width take the unrolled paths of `index::write_u32`,
/// `index::validate` and `index::for_each_batch` (one copy per width 1..=32): at each width
/// 0..=34, the bytes equal the oracle's and the streaming writer's, every decoder gives the
/// indices back, and the validation's sum of the gaps rejects an `n` one short of the last
/// index.
#[test]
fn index_full_delta_blocks_at_every_width() {
    let mut d = Data(29);
    for w in 0..=34u32 {
        let below = |d: &mut Data, bits: u32| match bits {
            0 => 0,
            b => d.below(1u64 << b),
        };
        // Three full blocks and a partial one, random gaps below 2^w, gap 5 of each block at
        // the full width.
        let mut gaps: Vec<u64> = (0..3 * 32 + 7).map(|_| below(&mut d, w)).collect();
        for b in 0..4 {
            if w > 0 {
                gaps[32 * b + 5] |= 1 << (w - 1);
            }
        }
        // The same widths with indices that fit a u32, for the u32 writer: one full block whose
        // other gaps stay below 2^(w - 6), and a partial one.
        let mut small: Vec<u64> = (0..32 + 3)
            .map(|_| below(&mut d, w.saturating_sub(6).min(w.saturating_sub(1))))
            .collect();
        if (1..=32).contains(&w) {
            small[5] = 1 << (w - 1);
        }
        for (case, gaps) in [gaps, small].iter().enumerate() {
            let mut idx = Vec::new();
            let mut next = 0u64;
            for &g in gaps {
                next += g;
                idx.push(next);
                next += 1;
            }
            let n = next;
            let (_, want, _) = index_oracle(n, &idx);
            let mut section = vec![0xa5u8; want.len()];
            let mut writer = IndexWriter::new(index::DELTA, n, &mut section);
            idx.iter().for_each(|&i| writer.push(i));
            writer.finish();
            assert_eq!(section, want, "width {w} case {case}: streaming writer");
            if let Ok(idx32) = idx
                .iter()
                .map(|&i| u32::try_from(i))
                .collect::<Result<Vec<_>, _>>()
            {
                let mut packed = vec![0xa5u8; want.len()];
                index::write_u32(index::DELTA, n, &idx32, &mut packed);
                assert_eq!(packed, want, "width {w} case {case}: write_u32");
            } else {
                assert!(case == 0 || w > 32, "width {w}: the u32 case must fit");
            }
            let count = idx.len() as u64;
            assert_eq!(
                index::validate(index::DELTA, n, count, &want),
                Ok(()),
                "width {w}"
            );
            let mut batched = Vec::new();
            index::for_each_batch(index::DELTA, n, count, &want, |b| {
                batched.extend(b.iter().map(|&i| i as u64))
            });
            assert_eq!(batched, idx, "width {w} case {case}: batches");
            let mut full = Vec::new();
            index::for_each_index(index::DELTA, n, count, &want, |i| full.push(i)).unwrap();
            assert_eq!(full, idx, "width {w} case {case}: full decode");
            assert!(
                index::validate(index::DELTA, n - 1, count, &want).is_err(),
                "width {w} case {case}: the last index must be below n"
            );
        }
    }
}

#[test]
fn index_large() {
    let mut d = Data(15);
    let n = 2_000_000u64;
    let idx: Vec<u64> = (0..n).filter(|_| d.below(100) == 0).collect();
    for codec in [index::BITMAP, index::DELTA, index::RAW] {
        check_index(codec, n, &idx).unwrap();
    }
}

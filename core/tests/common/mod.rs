//! Helpers shared by the integration tests: buffers sized by the crate, an arbitrary-float
//! generator built from `u32` bits, a deterministic data generator, independent oracles written
//! from `FORMAT.md` (never calling the code under test), and the table of golden frames.
#![allow(dead_code)]

use std::path::PathBuf;

use bitvec::field::BitField;
use bitvec::prelude::{BitVec, Lsb0};
use gradwire_core::{
    Error, K, Method, Params, Rounding, SignScale, Values, decode_into, encode_into, max_frame_len,
    scratch_len,
};
use quickcheck::{Arbitrary, Gen};

// ---------------------------------------------------------------------------------------------
// Encode / decode with buffers sized by the crate.

/// Encodes `g` with `p` into a fresh buffer of `max_frame_len` bytes; returns the frame.
pub fn encode(g: &[f32], p: &Params) -> Result<Vec<u8>, Error> {
    let mut out = vec![0u8; max_frame_len(g.len(), &p.method)];
    let mut scratch = vec![0u32; scratch_len(g.len(), &p.method)];
    let len = encode_into(g, p, &mut scratch, &mut out)?;
    out.truncate(len);
    Ok(out)
}

/// Decodes `frame` into `n` elements (pre-filled with a sentinel so leaks would show).
pub fn decode(frame: &[u8], p: &Params, n: usize) -> Result<Vec<f32>, Error> {
    let mut out = vec![f32::from_bits(0x7fc0_dead); n];
    decode_into(frame, p, &mut out)?;
    Ok(out)
}

/// Bit-level equality of two f32 slices (so -0.0 and 0.0 differ, NaN payloads count).
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The `testdata/` folder at the repository root.
pub fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("testdata")
}

/// Replaces the CRC-32 trailer of a frame with the checksum of its other bytes.
pub fn fix_crc(frame: &mut [u8]) {
    let body = frame.len() - 4;
    let crc = crc32fast::hash(&frame[..body]);
    frame[body..].copy_from_slice(&crc.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Arbitrary floats.

/// Maps arbitrary `u32` bits to a finite f32: NaN and infinities lose their exponent, becoming
/// a subnormal (NaN) or a signed zero (infinity), so -0.0 and subnormals are common.
pub fn finite_from_bits(bits: u32) -> f32 {
    let x = f32::from_bits(bits);
    if x.is_finite() {
        x
    } else {
        f32::from_bits(bits & 0x807f_ffff)
    }
}

/// Values drawn often so that ties, zeros of both signs, subnormals and extremes appear.
pub const POOL: [f32; 16] = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -0.5,
    2.0,
    -3.0,
    3.0,
    1.0e-9,
    f32::MIN_POSITIVE,
    -f32::MIN_POSITIVE,
    f32::from_bits(1),
    -f32::from_bits(1),
    f32::MAX,
    -1.0e38,
];

/// One arbitrary finite element in one of four styles: 0 raw bits, 1 pool (ties), 2 moderate
/// gradient-like magnitudes (|x| < 64, f16-safe), 3 a per-element mix of the three.
pub fn element(g: &mut Gen, style: u8) -> f32 {
    let bits = u32::arbitrary(g);
    let style = if style == 3 {
        (bits >> 29) as u8 % 3
    } else {
        style
    };
    match style {
        0 => finite_from_bits(u32::arbitrary(g)),
        1 => POOL[(bits % POOL.len() as u32) as usize],
        _ => {
            // sign, exponent 2^-30 ..= 2^5, random mantissa.
            let exp = 97 + (bits >> 23) % 36;
            f32::from_bits((bits & 0x8000_0000) | (exp << 23) | (u32::arbitrary(g) & 0x007f_ffff))
        }
    }
}

/// An arbitrary finite gradient of length 0..=515.
#[derive(Clone, Debug)]
pub struct Floats(pub Vec<f32>);

impl Arbitrary for Floats {
    fn arbitrary(g: &mut Gen) -> Self {
        let len = (u32::arbitrary(g) % 516) as usize;
        let style = u8::arbitrary(g) % 4;
        Floats((0..len).map(|_| element(g, style)).collect())
    }

    fn shrink(&self) -> Box<dyn Iterator<Item = Self>> {
        Box::new(shorter(&self.0).into_iter().map(Floats))
    }
}

/// Shrinking candidates that stay cheap on long inputs: halves, the input without a quarter,
/// without its first or last element, and with its first non-zero element zeroed.
fn shorter(v: &[f32]) -> Vec<Vec<f32>> {
    let n = v.len();
    let mut out = Vec::new();
    if n == 0 {
        return out;
    }
    if n >= 2 {
        out.push(v[..n / 2].to_vec());
        out.push(v[n / 2..].to_vec());
    }
    if n >= 4 {
        for q in 0..4 {
            let (a, b) = (q * n / 4, (q + 1) * n / 4);
            out.push([&v[..a], &v[b..]].concat());
        }
    }
    out.push(v[1..].to_vec());
    out.push(v[..n - 1].to_vec());
    if let Some(i) = v.iter().position(|&x| x != 0.0) {
        let mut w = v.to_vec();
        w[i] = 0.0;
        out.push(w);
    }
    out
}

/// An arbitrary gradient whose values are moderate (f16-safe, style 1 without extremes or 2).
#[derive(Clone, Debug)]
pub struct Moderate(pub Vec<f32>);

impl Arbitrary for Moderate {
    fn arbitrary(g: &mut Gen) -> Self {
        let len = (u32::arbitrary(g) % 516) as usize;
        let v = (0..len)
            .map(|_| {
                let style = 1 + u8::arbitrary(g) % 2;
                let x = element(g, style);
                if x.abs() > 64.0 { 1.5 } else { x }
            })
            .collect();
        Moderate(v)
    }

    fn shrink(&self) -> Box<dyn Iterator<Item = Self>> {
        Box::new(shorter(&self.0).into_iter().map(Moderate))
    }
}

/// Runs a quickcheck property with `tests` cases (overridable by `QUICKCHECK_TESTS`).
pub fn qc<A: quickcheck::Testable>(tests: u64, f: A) {
    quickcheck::QuickCheck::new()
        .tests(tests)
        .max_tests(tests * 100)
        .quickcheck(f);
}

// ---------------------------------------------------------------------------------------------
// Deterministic data.

/// SplitMix64 stream for test data (not the crate's generator: an independent source).
#[derive(Clone, Debug)]
pub struct Data(pub u64);

impl Data {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` (53 bits).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A heavy-tailed gradient-like value: normal times a log-uniform scale in [1e-6, 1].
    pub fn grad(&mut self) -> f32 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        let scale = 10f64.powf(-6.0 * self.unit());
        (normal * scale) as f32
    }

    /// `n` gradient-like values.
    pub fn grads(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.grad()).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Oracles, written from FORMAT.md.

/// Top-k by sorting: indices by (|x| descending, index ascending), the first k, ascending.
pub fn topk_oracle(g: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..g.len()).collect();
    idx.sort_by(|&a, &b| g[b].abs().partial_cmp(&g[a].abs()).unwrap().then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// Threshold selection: every index with `|x| > t`.
pub fn threshold_oracle(g: &[f32], t: f32) -> Vec<usize> {
    (0..g.len()).filter(|&i| g[i].abs() > t).collect()
}

/// SplitMix64's finalizer (FORMAT.md, "Random draws").
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN_RATIO: u64 = 0x9e37_79b9_7f4a_7c15;

/// Stream key of (seed, step, tensor id).
pub fn rng_key(seed: u64, step: u64, tensor_id: u64) -> u64 {
    let a = mix64(tensor_id.wrapping_add(GOLDEN_RATIO.wrapping_mul(2)));
    let b = mix64(step.wrapping_add(GOLDEN_RATIO) ^ a);
    mix64(seed ^ b)
}

/// Draw `i` of stream `key`.
pub fn rng_draw(key: u64, i: u64) -> u64 {
    mix64(key ^ mix64(i.wrapping_mul(GOLDEN_RATIO).wrapping_add(GOLDEN_RATIO)))
}

/// Uniform `[0, 1)` with 24 bits from draw `i` of stream `key`.
pub fn rng_uniform(key: u64, i: u64) -> f32 {
    (rng_draw(key, i) >> 40) as f32 / 16_777_216.0
}

/// Random-k indices by selection sampling (Knuth's Algorithm S) as FORMAT.md states it.
pub fn randomk_oracle(n: u64, k: u64, seed: u64, step: u64, tensor_id: u64) -> Vec<u64> {
    let key = rng_key(seed, step, tensor_id);
    let k = k.min(n);
    let mut out = Vec::with_capacity(k as usize);
    let mut i = 0u64;
    while (out.len() as u64) < k {
        let needed = k - out.len() as u64;
        let r = rng_draw(key, i);
        if ((r as u128 * (n - i) as u128) >> 64) < needed as u128 {
            out.push(i);
        }
        i += 1;
    }
    out
}

/// `2^(b-1) - 1`.
pub fn levels(bits: u8) -> u32 {
    (1u32 << (bits - 1)) - 1
}

/// Largest |x| as an f32 (0 for an empty slice).
pub fn absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m })
}

/// The quantization code of `x` in a block with absmax `m` (FORMAT.md 3.5): with the block's
/// reciprocal `inv = l / m`, `y = x * inv` (or `(x / m) * l` when `inv` is infinite), then round
/// to nearest even (`u = None`) or `floor(y + u)`, clamped to `[-l, l]`; 0 when `m == 0`.
pub fn quant_code_oracle(x: f32, m: f32, l: u32, u: Option<f32>) -> i32 {
    if m == 0.0 {
        return 0;
    }
    let lf = l as f32;
    let inv = lf / m;
    let y = if inv.is_finite() {
        x * inv
    } else {
        (x / m) * lf
    };
    let q = match u {
        None => y.round_ties_even(),
        Some(u) => (y + u).floor(),
    };
    q.clamp(-lf, lf) as i32
}

/// The value of code `q`: `(q / l) * m`.
pub fn dequant_oracle(q: i32, m: f32, l: u32) -> f32 {
    (q as f32 / l as f32) * m
}

/// Quantization sections (scales, codes) built with `bitvec`, LSB first.
pub fn quant_oracle(
    x: &[f32],
    bits: u8,
    block: usize,
    key: Option<u64>,
) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let l = levels(bits);
    let mut scales = Vec::new();
    let mut bv: BitVec<u8, Lsb0> = BitVec::with_capacity(x.len() * bits as usize);
    let mut decoded = Vec::with_capacity(x.len());
    for (b, chunk) in x.chunks(block).enumerate() {
        let m = absmax(chunk);
        scales.extend_from_slice(&m.to_le_bytes());
        for (j, &v) in chunk.iter().enumerate() {
            let i = (b * block + j) as u64;
            let u = key.map(|k| rng_uniform(k, i));
            let q = quant_code_oracle(v, m, l, u);
            let c = (q + l as i32) as u32;
            let at = bv.len();
            bv.resize(at + bits as usize, false);
            bv[at..].store_le(c); // the b bits of c, least significant first
            decoded.push(dequant_oracle(q, m, l));
        }
    }
    (scales, bv.into_vec(), decoded)
}

/// Sum of |x| in the fixed striped order of FORMAT.md: eight lanes (lane j adds elements
/// j, j+8, ... in order), then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
pub fn striped_abs_sum(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for (i, v) in x.iter().enumerate() {
        lanes[i % 8] += v.abs();
    }
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

/// A sign block's scale (FORMAT.md): striped sum / len; if that sum overflows, the striped sum
/// of |x| * 2^-64, divided by len, times 2^64, capped at the block's absmax.
pub fn sign_scale_oracle(x: &[f32]) -> f32 {
    let s = striped_abs_sum(x) / x.len() as f32;
    if s.is_finite() {
        return s;
    }
    let down: Vec<f32> = x.iter().map(|v| v.abs() * f32::powi(2.0, -64)).collect();
    ((striped_abs_sum(&down) / x.len() as f32) * f32::powi(2.0, 64)).min(absmax(x))
}

/// Sign sections (scales, bits) built with `bitvec`: bit 1 for x < 0 (both zeros are +).
pub fn sign_oracle(x: &[f32], block: Option<usize>) -> (Vec<u8>, Vec<u8>) {
    let mut scales = Vec::new();
    if let Some(block) = block {
        for chunk in x.chunks(block) {
            let s = sign_scale_oracle(chunk);
            scales.extend_from_slice(&s.to_le_bytes());
        }
    }
    let mut bv: BitVec<u8, Lsb0> = BitVec::new();
    for &v in x {
        bv.push(v < 0.0);
    }
    (scales, bv.into_vec())
}

/// Bytes per raw index for `n` elements: the fewest bytes that hold `n - 1`, at least 1.
pub fn raw_width_oracle(n: u64) -> usize {
    let mut w = 1;
    while w < 8 && n.saturating_sub(1) >> (8 * w) != 0 {
        w += 1;
    }
    w
}

/// The three index sections of an ascending index list: (bitmap, delta, raw), with `bitvec`.
pub fn index_oracle(n: u64, idx: &[u64]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    // The bitmap only for sizes a test can hold (empty otherwise; its length is ceil(n / 8)).
    let mut bitmap: BitVec<u8, Lsb0> =
        BitVec::repeat(false, if n <= 1 << 24 { n as usize } else { 0 });
    if n <= 1 << 24 {
        for &i in idx {
            bitmap.set(i as usize, true);
        }
    }
    let mut delta = Vec::new();
    let mut prev_next = 0u64;
    let gaps: Vec<u64> = idx
        .iter()
        .map(|&i| {
            let g = i - prev_next;
            prev_next = i + 1;
            g
        })
        .collect();
    for block in gaps.chunks(32) {
        let or = block.iter().fold(0u64, |a, &g| a | g);
        let w = 64 - or.leading_zeros();
        delta.push(w as u8);
        let mut bv: BitVec<u8, Lsb0> = BitVec::new();
        for &g in block {
            for t in 0..w {
                bv.push((g >> t) & 1 == 1);
            }
        }
        delta.extend_from_slice(&bv.into_vec());
    }
    let w = raw_width_oracle(n);
    let mut raw = Vec::new();
    for &i in idx {
        raw.extend_from_slice(&i.to_le_bytes()[..w]);
    }
    (bitmap.into_vec(), delta, raw)
}

/// The value a sparse value codec delivers for each kept value (int8 blocks over kept values).
pub fn sparse_values_oracle(v: Values, kept: &[f32]) -> Vec<f32> {
    match v {
        Values::F32 => kept.to_vec(),
        Values::F16 => kept
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect(),
        Values::Bf16 => kept
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        Values::Int8 { block } => {
            let mut out = Vec::with_capacity(kept.len());
            for chunk in kept.chunks(block as usize) {
                let m = absmax(chunk);
                for &x in chunk {
                    out.push(dequant_oracle(quant_code_oracle(x, m, 127, None), m, 127));
                }
            }
            out
        }
    }
}

/// The dense output a sparse frame should decode to.
pub fn scatter(n: usize, idx: &[usize], vals: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    for (&i, &v) in idx.iter().zip(vals) {
        out[i] = v;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Methods.

/// Every method that error feedback accepts, with a short name.
pub fn feedback_methods() -> Vec<(&'static str, Method)> {
    let mut m = vec![
        (
            "dense-f32",
            Method::Dense {
                values: Values::F32,
            },
        ),
        (
            "dense-f16",
            Method::Dense {
                values: Values::F16,
            },
        ),
        (
            "dense-bf16",
            Method::Dense {
                values: Values::Bf16,
            },
        ),
    ];
    for (name, values) in [
        ("topk-f32", Values::F32),
        ("topk-f16", Values::F16),
        ("topk-bf16", Values::Bf16),
        ("topk-int8", Values::Int8 { block: 64 }),
    ] {
        m.push((
            name,
            Method::TopK {
                k: K::Ratio(0.05),
                values,
            },
        ));
    }
    m.push((
        "threshold-f32",
        Method::Threshold {
            threshold: 1.0e-3,
            values: Values::F32,
        },
    ));
    m.push((
        "threshold-int8",
        Method::Threshold {
            threshold: 1.0e-3,
            values: Values::Int8 { block: 16 },
        },
    ));
    m.push((
        "randomk-f32",
        Method::RandomK {
            k: K::Ratio(0.1),
            values: Values::F32,
            unbiased: false,
        },
    ));
    m.push((
        "randomk-bf16",
        Method::RandomK {
            k: K::Count(7),
            values: Values::Bf16,
            unbiased: false,
        },
    ));
    for bits in [2u8, 4, 8] {
        for (r, rounding) in [
            ("nearest", Rounding::NearestEven),
            ("stochastic", Rounding::Stochastic),
        ] {
            let name: &'static str = Box::leak(format!("quant{bits}-{r}").into_boxed_str());
            m.push((
                name,
                Method::Quant {
                    bits,
                    block: 64,
                    rounding,
                },
            ));
        }
    }
    m.push((
        "sign-scaled",
        Method::Sign {
            scale: SignScale::MeanAbs { block: 32 },
            zero_mask: false,
        },
    ));
    m
}

// ---------------------------------------------------------------------------------------------
// Golden frames.

/// One golden frame: its file name in `testdata/golden/`, input, parameters, and (for sparse
/// frames with an index section) the index codec it must exercise.
#[derive(Clone, Debug)]
pub struct Golden {
    /// File stem.
    pub name: &'static str,
    /// Input gradient.
    pub grad: Vec<f32>,
    /// Parameters.
    pub params: Params,
    /// Index codec id the frame must use (0 bitmap, 1 delta, 2 raw), if it has an index.
    pub codec: Option<u8>,
}

/// Inputs whose int8 codes differ between `x * (127 / m)` and `(x / m) * 127` (FORMAT.md 3.5),
/// then a block with a subnormal absmax.
pub const RECIPROCAL: [f32; 16] = [
    3.0,
    0.318_897_63,
    -1.641_732_2,
    1.948_819,
    -3.0,
    0.5,
    -0.25,
    1.0,
    f32::from_bits(3),
    -f32::from_bits(1),
    f32::from_bits(2),
    0.0,
    -0.0,
    -f32::from_bits(3),
    f32::from_bits(1),
    0.0,
];

/// The 16-element input of most golden frames: ties (3.0 / -3.0, 0.5 / -0.5), zeros of both
/// signs, a subnormal-free mix of magnitudes.
pub const G16: [f32; 16] = [
    0.5, -1.25, 0.0, 3.0, -3.0, 0.125, -0.0, 2.5, -0.75, 1.0, 0.0, -2.0, 0.0625, 1.5, -0.5, 0.25,
];

/// The input of the scaled zero-mask golden frame, in blocks of 8: G16's first block (zeros
/// of both signs among non-zeros: mixed), a block of zeros of both signs (all zero), a block
/// without zeros (none), and a last block of 4 elements that is mixed (bits past the tensor's
/// end stay 0).
pub const ZERO_MASK_28: [f32; 28] = [
    0.5, -1.25, 0.0, 3.0, -3.0, 0.125, -0.0, 2.5, 0.0, -0.0, 0.0, 0.0, 0.0, 0.0, -0.0, 0.0, -0.75,
    1.0, 0.25, -2.0, 0.0625, 1.5, -0.5, 0.25, 1.0, 0.0, -2.0, -0.0,
];

/// A 300-element input whose single largest magnitude sits at index 290 (raw index codec).
pub fn g300() -> Vec<f32> {
    (0..300)
        .map(|i| {
            if i == 290 {
                -7.5
            } else {
                ((i % 13) as f32 - 6.0) * 0.0625
            }
        })
        .collect()
}

/// A 16-element input whose top 8 are at 0..=6 and 9 (bitmap index codec).
pub const G16_BITMAP: [f32; 16] = [
    9.0, -8.0, 7.0, -6.0, 5.0, -4.0, 3.5, 0.25, -0.125, 2.75, 0.5, -0.375, 0.0, 1.0, -1.5, 2.0,
];

/// The input of FORMAT.md's worked example (top-k, k = 3, f32 values: indices 1, 2, 5).
pub const WORKED: [f32; 20] = [
    0.5, -2.0, 4.0, 0.25, -0.125, 3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.5, 0.0,
    0.0, 0.75,
];

/// The table of golden frames.
pub fn golden() -> Vec<Golden> {
    let p = |method| Params::new(method);
    let g = |name, grad: &[f32], params, codec| Golden {
        name,
        grad: grad.to_vec(),
        params,
        codec,
    };
    let topk = |k, values| Method::TopK {
        k: K::Count(k),
        values,
    };
    let mut v = vec![
        g(
            "dense_f32",
            &G16,
            p(Method::Dense {
                values: Values::F32,
            }),
            None,
        ),
        g(
            "dense_f16",
            &G16,
            p(Method::Dense {
                values: Values::F16,
            }),
            None,
        ),
        g(
            "dense_bf16",
            &G16,
            p(Method::Dense {
                values: Values::Bf16,
            }),
            None,
        ),
        g(
            "topk_bitmap_f32",
            &G16_BITMAP,
            p(topk(8, Values::F32)),
            Some(0),
        ),
        g("topk_delta_f32", &G16, p(topk(4, Values::F32)), Some(1)),
        g("topk_raw_f32", &g300(), p(topk(1, Values::F32)), Some(2)),
        g("topk_delta_f16", &G16, p(topk(4, Values::F16)), Some(1)),
        g("topk_delta_bf16", &G16, p(topk(4, Values::Bf16)), Some(1)),
        g(
            "topk_delta_int8",
            &G16,
            p(topk(4, Values::Int8 { block: 3 })),
            Some(1),
        ),
        g("topk_k0", &G16, p(topk(0, Values::F32)), Some(1)),
        g("topk_all", &G16[..5], p(topk(9, Values::F32)), Some(1)),
        g(
            "threshold_f32",
            &G16,
            p(Method::Threshold {
                threshold: 1.0,
                values: Values::F32,
            }),
            Some(0),
        ),
        g(
            "randomk_f32",
            &G16,
            p(Method::RandomK {
                k: K::Count(4),
                values: Values::F32,
                unbiased: false,
            })
            .with_seed(42)
            .at_step(7)
            .for_tensor(gradwire_core::tensor_id("layer.0.weight")),
            None,
        ),
        g(
            "randomk_unbiased_f16",
            &G16,
            p(Method::RandomK {
                k: K::Count(4),
                values: Values::F16,
                unbiased: true,
            })
            .with_seed(42)
            .at_step(8)
            .for_tensor(gradwire_core::tensor_id("layer.0.weight")),
            None,
        ),
        g(
            "randomk_int8",
            &G16,
            p(Method::RandomK {
                k: K::Count(5),
                values: Values::Int8 { block: 2 },
                unbiased: false,
            })
            .with_seed(1),
            None,
        ),
    ];
    for bits in [2u8, 4, 8] {
        for (r, rounding) in [
            ("nearest", Rounding::NearestEven),
            ("stochastic", Rounding::Stochastic),
        ] {
            let name: &'static str = Box::leak(format!("quant{bits}_{r}").into_boxed_str());
            v.push(g(
                name,
                &G16,
                p(Method::Quant {
                    bits,
                    block: 6,
                    rounding,
                })
                .with_seed(3)
                .at_step(2)
                .for_tensor(5),
                None,
            ));
        }
    }
    v.push(g(
        "sign_scaled",
        &G16,
        p(Method::Sign {
            scale: SignScale::MeanAbs { block: 5 },
            zero_mask: false,
        }),
        None,
    ));
    v.push(g(
        "sign_unscaled",
        &G16,
        p(Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        }),
        None,
    ));
    v.push(g(
        "sign_scaled_zero_mask",
        &ZERO_MASK_28,
        p(Method::Sign {
            scale: SignScale::MeanAbs { block: 8 },
            zero_mask: true,
        }),
        None,
    ));
    v.push(g(
        "sign_unscaled_zero_mask",
        &G16,
        p(Method::Sign {
            scale: SignScale::None,
            zero_mask: true,
        }),
        None,
    ));
    v.push(g(
        "empty_dense_f32",
        &[],
        p(Method::Dense {
            values: Values::F32,
        }),
        None,
    ));
    v.push(g(
        "empty_topk_f32",
        &[],
        p(Method::TopK {
            k: K::Ratio(0.01),
            values: Values::F32,
        }),
        Some(1),
    ));
    v.push(g(
        "empty_quant4",
        &[],
        p(Method::Quant {
            bits: 4,
            block: 8,
            rounding: Rounding::NearestEven,
        }),
        None,
    ));
    v.push(g(
        "empty_sign_scaled",
        &[],
        p(Method::Sign {
            scale: SignScale::MeanAbs { block: 8 },
            zero_mask: false,
        }),
        None,
    ));
    // x * (l / m) and (x / m) * l round differently for elements 1..=3 of the first block
    // (0.31889763 * (127 / 3) = 13.499999 -> 13, where (0.31889763 / 3) * 127 = 13.5 -> 14);
    // the second block's absmax is subnormal, so 127 / m overflows and (x / m) * 127 applies.
    v.push(g(
        "quant8_reciprocal",
        &RECIPROCAL,
        p(Method::Quant {
            bits: 8,
            block: 8,
            rounding: Rounding::NearestEven,
        }),
        None,
    ));
    v.push(g(
        "topk_int8_reciprocal",
        &RECIPROCAL,
        p(topk(6, Values::Int8 { block: 8 })),
        Some(1),
    ));
    v.push(g(
        "worked_example",
        &WORKED,
        p(topk(3, Values::F32)),
        Some(1),
    ));
    v
}

/// The index codec byte of a top-k or threshold frame (FORMAT.md: after count).
pub fn codec_byte(frame: &[u8], method: &Method) -> Option<u8> {
    let vspec = match method.values() {
        Some(Values::Int8 { .. }) => 5,
        _ => 1,
    };
    match method {
        Method::TopK { .. } => Some(frame[16 + vspec + 8]),
        Method::Threshold { .. } => Some(frame[16 + vspec + 4 + 8]),
        _ => None,
    }
}

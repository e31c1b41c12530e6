//! Benchmarks and the ratio report for gradwire: the read pass that every ratio is measured
//! against, test data (heavy-tailed values from a fixed seed; the real MiniLM gradients), the
//! naive baselines each kernel is shown next to, and one runner per kernel through the public
//! API.

use gradwire_core::{
    K, Method, Params, ResidualBound, Rounding, SignScale, Values, accumulate_into, decode_into,
    encode_into, feedback_step, feedback_step_bounded, max_frame_len, scratch_len, validate,
};
use std::path::{Path, PathBuf};
use wide::f32x8;

/// The read pass, the denominator of every ratio: the fastest sum of |g|, `wide` f32x8 with four
/// independent accumulators. Every ratio is a kernel's time over the faster of this pass and
/// [`read_pass_prefetch`] on the same buffer.
pub fn read_pass(x: &[f32]) -> f32 {
    read_pass_ahead::<0>(x)
}

/// How far ahead of its reads a `_prefetch` pass asks for each cache line, in f32 elements
/// (8 KiB; on the Xeon of docs/perf-log.md round 10, 1024 to 4096 elements are within 2% of each
/// other).
pub const PREFETCH_AHEAD: usize = 2048;

/// [`read_pass`] with a software prefetch of each cache line [`PREFETCH_AHEAD`] elements before
/// it is read (`safe_arch::prefetch_t0`; nothing on targets without one). On some machines one
/// core's hardware prefetcher keeps too few lines in flight and this is the faster sum of |g|
/// (the Xeon of round 10: 0.68-0.80 of the plain pass's time); on others it is slower (the EPYC of
/// docs/perf-log.md, "Software prefetch"). The ratio report measures both and divides by the
/// faster, so that the denominator is the fastest read pass of the machine it runs on.
pub fn read_pass_prefetch(x: &[f32]) -> f32 {
    read_pass_ahead::<PREFETCH_AHEAD>(x)
}

fn read_pass_ahead<const AHEAD: usize>(x: &[f32]) -> f32 {
    let mut acc = [f32x8::splat(0.0); 4];
    let mut chunks = x.chunks_exact(32);
    for (j, c) in (&mut chunks).enumerate() {
        prefetch_line_pair::<AHEAD>(x, 32 * j);
        for (t, a) in acc.iter_mut().enumerate() {
            let mut l = [0.0f32; 8];
            l.copy_from_slice(&c[8 * t..8 * t + 8]);
            *a += f32x8::new(l).abs();
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3]))
        .to_array()
        .iter()
        .sum::<f32>();
    s += chunks.remainder().iter().map(|v| v.abs()).sum::<f32>();
    s
}

/// With `AHEAD > 0`, asks for the two cache lines of `x[i + AHEAD..i + AHEAD + 32]`. With
/// `AHEAD == 0`, nothing: the plain passes compile without it.
#[inline(always)]
fn prefetch_line_pair<const AHEAD: usize>(x: &[f32], i: usize) {
    if AHEAD > 0 {
        prefetch(x, i + AHEAD);
        prefetch(x, i + AHEAD + 16);
    }
}

/// Asks for the cache line of `x[i]` (a hint: nothing past the end, nor on targets without a
/// prefetch instruction).
#[inline(always)]
fn prefetch(x: &[f32], i: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    if let Some(v) = x.get(i) {
        safe_arch::prefetch_t0(v);
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = (x, i);
}

/// The read pass over two buffers at once: the sum of |g + r| (`wide` f32x8, four independent
/// accumulators). The traffic an error-feedback step needs before it may touch `r`.
pub fn read_pass2(g: &[f32], r: &[f32]) -> f32 {
    read_pass2_ahead::<0>(g, r)
}

/// [`read_pass2`] with a software prefetch of both buffers (as [`read_pass_prefetch`]).
pub fn read_pass2_prefetch(g: &[f32], r: &[f32]) -> f32 {
    read_pass2_ahead::<PREFETCH_AHEAD>(g, r)
}

fn read_pass2_ahead<const AHEAD: usize>(g: &[f32], r: &[f32]) -> f32 {
    let mut acc = [f32x8::splat(0.0); 4];
    let mut gc = g.chunks_exact(32);
    let mut rc = r.chunks_exact(32);
    for (j, (a, b)) in (&mut gc).zip(&mut rc).enumerate() {
        prefetch_line_pair::<AHEAD>(g, 32 * j);
        prefetch_line_pair::<AHEAD>(r, 32 * j);
        for (t, s) in acc.iter_mut().enumerate() {
            let mut x = [0.0f32; 8];
            let mut y = [0.0f32; 8];
            x.copy_from_slice(&a[8 * t..8 * t + 8]);
            y.copy_from_slice(&b[8 * t..8 * t + 8]);
            *s += (f32x8::new(x) + f32x8::new(y)).abs();
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3]))
        .to_array()
        .iter()
        .sum::<f32>();
    s += gc
        .remainder()
        .iter()
        .zip(rc.remainder())
        .map(|(a, b)| (a + b).abs())
        .sum::<f32>();
    s
}

/// `r[i] += g[i]`: read two buffers, write one (the update pass of an error-feedback step).
pub fn add_pass(r: &mut [f32], g: &[f32]) {
    for (a, &b) in r.iter_mut().zip(g) {
        *a += b;
    }
}

/// [`add_pass`] with a software prefetch of both buffers (as [`read_pass_prefetch`]).
pub fn add_pass_prefetch(r: &mut [f32], g: &[f32]) {
    let n = r.len().min(g.len());
    let whole = n - n % 32;
    for j in (0..whole).step_by(32) {
        prefetch_line_pair::<PREFETCH_AHEAD>(g, j);
        prefetch_line_pair::<PREFETCH_AHEAD>(r, j);
        let a: &mut [f32; 32] = (&mut r[j..j + 32]).try_into().expect("32 elements");
        let b: &[f32; 32] = g[j..j + 32].try_into().expect("32 elements");
        for (a, &b) in a.iter_mut().zip(b) {
            *a += b;
        }
    }
    add_pass(&mut r[whole..n], &g[whole..n]);
}

/// `out[i] += v` for every pair of an index/value list already decoded, with a software prefetch
/// of the line of the entry 32 places ahead: the floor of accumulating a sparse frame on machines
/// where the prefetch helps (docs/perf-log.md, round 10); `ratios` also measures the plain loop.
/// Pairs whose index is out of bounds are skipped.
pub fn scatter_add_prefetch(out: &mut [f32], idx: &[usize], vals: &[f32]) {
    const AHEAD: usize = 32;
    for (j, (&i, &v)) in idx.iter().zip(vals).enumerate() {
        if let Some(&ahead) = idx.get(j + AHEAD) {
            prefetch(out, ahead);
        }
        if let Some(o) = out.get_mut(i) {
            *o += v;
        }
    }
}

/// Read `x`, write one byte per element (the traffic of int8 quantization, no arithmetic).
pub fn byte_pass(x: &[f32], out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v.to_bits() >> 24) as u8;
    }
}

/// [`byte_pass`] with a software prefetch of `x` (as [`read_pass_prefetch`]).
pub fn byte_pass_prefetch(x: &[f32], out: &mut [u8]) {
    let mut xc = x.chunks_exact(32);
    let mut oc = out.chunks_exact_mut(32);
    for (j, (v, o)) in (&mut xc).zip(&mut oc).enumerate() {
        prefetch_line_pair::<PREFETCH_AHEAD>(x, 32 * j);
        byte_pass(v, o);
    }
    byte_pass(xc.remainder(), oc.into_remainder());
}

/// A uniform f64 in (0, 1) from draw `i` of a fixed stream.
fn uniform(seed: u64, i: u64) -> f64 {
    let r = gradwire_core::rng::draw(seed, i);
    ((r >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// `n` heavy-tailed values from `seed`: a standard normal times `exp` of another (lognormal
/// scale), like real gradients whose magnitudes span several binades.
pub fn heavy_tailed(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let u1 = uniform(seed, 4 * i);
            let u2 = uniform(seed, 4 * i + 1);
            let u3 = uniform(seed, 4 * i + 2);
            let u4 = uniform(seed, 4 * i + 3);
            let r1 = (-2.0 * u1.ln()).sqrt();
            let z1 = r1 * (2.0 * std::f64::consts::PI * u2).cos();
            let r2 = (-2.0 * u3.ln()).sqrt();
            let z2 = r2 * (2.0 * std::f64::consts::PI * u4).cos();
            (z1 * z2.exp() * 1e-3) as f32
        })
        .collect()
}

/// The repository root (the parent of this crate's folder).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// Every f32 tensor of a safetensors file, concatenated in the file's order.
///
/// # Errors
/// When the file cannot be read or parsed.
pub fn load_safetensors(path: &Path) -> Result<Vec<f32>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let t = st.tensor(&name).map_err(|e| e.to_string())?;
        if t.dtype() == safetensors::Dtype::F32 {
            out.extend(
                t.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
    }
    Ok(out)
}

/// The real MiniLM gradients: `testdata/minilm_small_grads.safetensors` (copied there from
/// `../shared/data` when absent).
///
/// # Errors
/// When neither copy can be read.
pub fn minilm() -> Result<Vec<f32>, String> {
    let path = repo_root().join("testdata/minilm_small_grads.safetensors");
    if !path.exists() {
        let shared = repo_root().join("../shared/data/minilm_small_grads.safetensors");
        std::fs::copy(&shared, &path).map_err(|e| format!("{}: {e}", shared.display()))?;
    }
    load_safetensors(&path)
}

// ---------------------------------------------------------------------------------------------
// Baselines

/// Exact top-k with `select_nth_unstable_by` on (|x|, index), then the kept indices sorted
/// ascending (what a careful std-only implementation does).
pub fn topk_select_nth(x: &[f32], k: usize, work: &mut Vec<u32>) -> usize {
    work.clear();
    work.extend(0..x.len() as u32);
    let k = k.min(x.len());
    if k > 0 && k < x.len() {
        work.select_nth_unstable_by(k - 1, |&a, &b| {
            let (ka, kb) = (x[a as usize].abs(), x[b as usize].abs());
            kb.total_cmp(&ka).then(a.cmp(&b))
        });
    }
    work.truncate(k);
    work.sort_unstable();
    work.len()
}

/// The original module's top-k: pair every element with its magnitude, sort all pairs by
/// magnitude (descending), keep the first k (indices and values).
pub fn topk_full_sort(x: &[f32], k: usize) -> (Vec<usize>, Vec<f32>) {
    let mut pairs: Vec<(usize, f32)> = x.iter().map(|v| v.abs()).enumerate().collect();
    pairs.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
    let k = k.min(x.len());
    let idx: Vec<usize> = pairs[..k].iter().map(|p| p.0).collect();
    let vals = idx.iter().map(|&i| x[i]).collect();
    (idx, vals)
}

/// Sign packing one bit at a time through `bitvec` (LSB-first bytes).
pub fn sign_bitvec(x: &[f32], out: &mut bitvec::vec::BitVec<u8, bitvec::order::Lsb0>) {
    out.clear();
    for &v in x {
        out.push(v < 0.0);
    }
}

/// A plain scalar int8 quantizer: per block absmax, `round(x / m * 127)` with std's `round`.
pub fn int8_plain(x: &[f32], block: usize, scales: &mut [f32], codes: &mut [i8]) {
    for (b, (xs, cs)) in x.chunks(block).zip(codes.chunks_mut(block)).enumerate() {
        let m = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        scales[b] = m;
        let inv = if m > 0.0 { 127.0 / m } else { 0.0 };
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = (v * inv).round() as i8;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Codecs through the public API

/// One codec: its parameters and the buffers its encoder and decoder need.
pub struct Codec {
    /// Method and parameters.
    pub params: Params,
    /// Encoder scratch.
    pub scratch: Vec<u32>,
    /// Frame buffer (`max_frame_len`).
    pub frame: Vec<u8>,
    /// Length of the last frame encoded.
    pub len: usize,
}

impl Codec {
    /// Buffers for `method` on `n` elements.
    pub fn new(method: Method, n: usize) -> Self {
        let mut params = Params::new(method);
        params.seed = 7;
        params.step = 1;
        params.tensor_id = 3;
        Codec {
            params,
            scratch: vec![0; scratch_len(n, &method)],
            frame: vec![0; max_frame_len(n, &method)],
            len: 0,
        }
    }

    /// Encodes `x` with `encode_into`; returns the frame length.
    ///
    /// # Panics
    /// When encoding fails (the bench inputs are valid).
    pub fn encode(&mut self, x: &[f32]) -> usize {
        self.len = encode_into(x, &self.params, &mut self.scratch, &mut self.frame).unwrap();
        self.len
    }

    /// Decodes the last frame into `out` with `decode_into`.
    ///
    /// # Panics
    /// When decoding fails.
    pub fn decode(&self, out: &mut [f32]) {
        decode_into(&self.frame[..self.len], &self.params, out).unwrap();
    }

    /// Validates the last frame for `n` output elements with [`validate`], writing nothing (the
    /// checks that [`accumulate_into`] makes before its first write).
    ///
    /// # Panics
    /// When the frame does not validate.
    pub fn validate(&self, n: usize) {
        validate(&self.frame[..self.len], &self.params, n).unwrap();
    }

    /// Adds the last frame into `acc` with `accumulate_into`.
    ///
    /// # Panics
    /// When decoding fails.
    pub fn accumulate(&self, acc: &mut [f32]) {
        accumulate_into(&self.frame[..self.len], &self.params, acc, 1.0).unwrap();
    }

    /// One error-feedback step of `g` on `residual` with `feedback_step_bounded`, keeping the
    /// residual's bound in `bound` (start with `ResidualBound::ZERO` for a residual of zeros).
    ///
    /// # Panics
    /// When the step fails.
    pub fn feedback_bounded(
        &mut self,
        g: &[f32],
        residual: &mut [f32],
        bound: &mut ResidualBound,
    ) -> usize {
        self.len = feedback_step_bounded(
            g,
            residual,
            bound,
            &self.params,
            &mut self.scratch,
            &mut self.frame,
        )
        .unwrap();
        self.len
    }

    /// One error-feedback step of `g` on `residual` with `feedback_step`.
    ///
    /// # Panics
    /// When the step fails.
    pub fn feedback(&mut self, g: &[f32], residual: &mut [f32]) -> usize {
        self.len = feedback_step(
            g,
            residual,
            &self.params,
            &mut self.scratch,
            &mut self.frame,
        )
        .unwrap();
        self.len
    }
}

/// The |x| at which `x` keeps about 1% of its elements (for the threshold kernel).
pub fn threshold_for_one_percent(x: &[f32]) -> f32 {
    let mut a: Vec<f32> = x.iter().step_by(7).map(|v| v.abs()).collect();
    if a.is_empty() {
        return 0.0;
    }
    let j = a.len() - 1 - a.len() / 100;
    let (_, t, _) = a.select_nth_unstable_by(j, f32::total_cmp);
    *t
}

/// The methods of the ratio report and the benches, by name.
pub fn methods(x: &[f32]) -> Vec<(&'static str, Method)> {
    vec![
        (
            "topk_1pct",
            Method::TopK {
                k: K::Ratio(0.01),
                values: Values::F32,
            },
        ),
        (
            "topk_0.1pct",
            Method::TopK {
                k: K::Ratio(0.001),
                values: Values::F32,
            },
        ),
        (
            "threshold",
            Method::Threshold {
                threshold: threshold_for_one_percent(x),
                values: Values::F32,
            },
        ),
        (
            "randomk_1pct",
            Method::RandomK {
                k: K::Ratio(0.01),
                values: Values::F32,
                unbiased: false,
            },
        ),
        (
            "sign",
            Method::Sign {
                scale: SignScale::MeanAbs { block: 1024 },
                zero_mask: false,
            },
        ),
        (
            "quant_int8",
            Method::Quant {
                bits: 8,
                block: 512,
                rounding: Rounding::NearestEven,
            },
        ),
        (
            "quant_4bit",
            Method::Quant {
                bits: 4,
                block: 512,
                rounding: Rounding::NearestEven,
            },
        ),
        (
            "f16_cast",
            Method::Dense {
                values: Values::F16,
            },
        ),
        (
            "bf16_cast",
            Method::Dense {
                values: Values::Bf16,
            },
        ),
    ]
}

/// The error-feedback method of the report: top-k 1% with int8 values.
pub fn ef_method() -> Method {
    Method::TopK {
        k: K::Ratio(0.01),
        values: Values::Int8 { block: 256 },
    }
}

/// Whether this build has AVX2 (`"native"` on this project's machine) or not (`"default"`).
pub fn build_name() -> &'static str {
    if cfg!(target_feature = "avx2") {
        "native"
    } else {
        "default"
    }
}

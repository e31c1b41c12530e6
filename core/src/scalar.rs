//! The executable specification: plain loops for every kernel.
//!
//! The fast paths in [`crate::select`], [`crate::quant`] and [`crate::sign`] must produce
//! exactly what these functions produce (tests, fuzz targets and benches compare them).

use crate::rng;

/// Index of the first NaN or infinite element, if any.
pub fn first_non_finite(g: &[f32]) -> Option<usize> {
    g.iter().position(|x| !x.is_finite())
}

/// Index of the first element `i` where `g[i] + r[i]` (computed in f32) is not finite.
/// `g` and `r` must have the same length.
pub fn first_non_finite_sum(g: &[f32], r: &[f32]) -> Option<usize> {
    g.iter().zip(r).position(|(a, b)| !(a + b).is_finite())
}

/// The magnitude key of a finite f32: its bits without the sign. For finite values the key order
/// is the order of `|x|` (and -0.0 and 0.0 share key 0).
#[inline]
pub const fn magnitude_key(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// Largest magnitude (absolute value) in `x`; `0.0` for an empty slice.
pub fn abs_max(x: &[f32]) -> f32 {
    f32::from_bits(x.iter().map(|&v| magnitude_key(v)).max().unwrap_or(0))
}

/// Where exact top-k cuts: keep every element whose magnitude key is `> key`, plus the first
/// `take_ties` elements (lowest indices) whose key equals `key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Magnitude key of the k-th largest magnitude.
    pub key: u32,
    /// How many elements with exactly that key are kept, lowest index first.
    pub take_ties: usize,
}

/// Histogram words [`topk_cut`] needs in its scratch.
pub const TOPK_HIST: usize = 2048;

/// The cut of exact top-k by magnitude for `1 <= k <= g.len()`, by a three-pass radix select on
/// the 31-bit magnitude keys (11, 11 and 9 bits). `g` must be finite; `hist` holds at least
/// [`TOPK_HIST`] words.
pub fn topk_cut(g: &[f32], k: usize, hist: &mut [u32]) -> Cut {
    let hist = &mut hist[..TOPK_HIST];
    // (shift, width) of each digit, most significant first.
    const DIGITS: [(u32, u32); 3] = [(20, 11), (9, 11), (0, 9)];
    let mut prefix: u32 = 0; // key bits fixed so far
    let mut prefix_mask: u32 = 0;
    let mut need = k; // how many still to take among keys matching the prefix
    for (shift, width) in DIGITS {
        hist.fill(0);
        let digit_mask = (1u32 << width) - 1;
        for &x in g {
            let key = magnitude_key(x);
            if key & prefix_mask == prefix {
                hist[((key >> shift) & digit_mask) as usize] += 1;
            }
        }
        // Walk the digits from the largest down until `need` is reached.
        let mut d = digit_mask as usize;
        loop {
            let c = hist[d] as usize;
            if c >= need || d == 0 {
                break;
            }
            need -= c;
            d -= 1;
        }
        prefix |= (d as u32) << shift;
        prefix_mask |= digit_mask << shift;
    }
    Cut {
        key: prefix,
        take_ties: need,
    }
}

/// Which elements a sparse method keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Selection {
    /// Nothing.
    None,
    /// Every element.
    All,
    /// Top-k by a [`Cut`].
    TopK(Cut),
    /// `|g| > t`.
    Threshold(f32),
    /// Random-k: k indices drawn by selection sampling from stream `key`.
    RandomK {
        /// Stream key ([`rng::key`]).
        key: u64,
        /// Entries to draw.
        k: u64,
    },
}

/// Random-k's rule (Knuth's selection sampling, Algorithm S): index `i` is kept when the
/// draw `r_i` satisfies `floor(r_i * (n - i) / 2^64) < k - kept_so_far`. Every k-subset is
/// equally likely; indices come out ascending and the receiver regenerates them from the key.
#[inline]
pub fn randomk_keeps(key: u64, i: u64, remaining: u64, needed: u64) -> bool {
    let r = rng::draw(key, i);
    (((r as u128) * (remaining as u128)) >> 64) < needed as u128
}

/// Calls `f(i)` for every kept index of `g` in ascending order. For `RandomK` only `n`
/// matters, so `g` may be any slice of length `n` (or use [`randomk_for_each`]).
pub fn for_each_kept(g: &[f32], sel: Selection, mut f: impl FnMut(usize)) {
    match sel {
        Selection::None => {}
        Selection::All => (0..g.len()).for_each(f),
        Selection::TopK(cut) => {
            let mut ties = cut.take_ties;
            for (i, &x) in g.iter().enumerate() {
                let key = magnitude_key(x);
                if key > cut.key {
                    f(i);
                } else if key == cut.key && ties > 0 {
                    ties -= 1;
                    f(i);
                }
            }
        }
        Selection::Threshold(t) => {
            for (i, &x) in g.iter().enumerate() {
                if x.abs() > t {
                    f(i);
                }
            }
        }
        Selection::RandomK { key, k } => {
            randomk_for_each(g.len() as u64, k, key, |i| f(i as usize))
        }
    }
}

/// Calls `f(i)` for each of the `k` indices random-k draws from `0..n` with stream `key`.
pub fn randomk_for_each(n: u64, k: u64, key: u64, mut f: impl FnMut(u64)) {
    let k = k.min(n);
    let mut kept = 0u64;
    let mut i = 0u64;
    while kept < k {
        if randomk_keeps(key, i, n - i, k - kept) {
            f(i);
            kept += 1;
        }
        i += 1;
    }
}

/// Round to nearest, ties to even, for `|y| < 2^22`, with the add-and-subtract trick that the
/// SIMD lanes repeat exactly.
#[inline]
pub fn round_ties_even(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (y + MAGIC) - MAGIC
}

/// Floor for `|y| < 2^22`, built on [`round_ties_even`].
#[inline]
pub fn floor(y: f32) -> f32 {
    let r = round_ties_even(y);
    if r > y { r - 1.0 } else { r }
}

/// Largest code magnitude of b-bit symmetric quantization: `2^(b-1) - 1`.
pub const fn quant_levels(bits: u8) -> u32 {
    (1u32 << (bits - 1)) - 1
}

/// The per-block reciprocal of b-bit quantization: `l / m` (infinite when `m` is so small that
/// `l / m` overflows, and for `m == 0`).
#[inline]
pub fn quant_inv(m: f32, l: u32) -> f32 {
    l as f32 / m
}

/// The scaled position of `x` in a block with absmax `m`, `l` levels and `inv` =
/// [`quant_inv`]`(m, l)`: `x * inv` when `inv` is finite, else `(x / m) * l`. One division per
/// block and a multiply per element; the same in every build (no fused multiply-add).
#[inline]
pub fn quant_scaled(x: f32, m: f32, inv: f32, l: u32) -> f32 {
    if inv.is_finite() {
        x * inv
    } else {
        (x / m) * l as f32
    }
}

/// The signed code of `x` in a block with absmax `m` and `l` levels: `y` = [`quant_scaled`]
/// rounded to nearest even, or down after adding `u` in `[0, 1)` (stochastic: pass the draw;
/// nearest: pass `None`), clamped to `[-l, l]`. A block with `m == 0` codes everything as 0.
#[inline]
pub fn quant_code(x: f32, m: f32, l: u32, u: Option<f32>) -> i32 {
    quant_code_inv(x, m, quant_inv(m, l), l, u)
}

/// [`quant_code`] with the block's reciprocal `inv` = [`quant_inv`]`(m, l)` computed once.
#[inline]
pub fn quant_code_inv(x: f32, m: f32, inv: f32, l: u32, u: Option<f32>) -> i32 {
    if m == 0.0 {
        return 0;
    }
    let lf = l as f32;
    let y = quant_scaled(x, m, inv, l);
    let q = match u {
        None => round_ties_even(y),
        Some(u) => floor(y + u),
    };
    (q.clamp(-lf, lf)) as i32
}

/// The value a code decodes to: `(q / l) * m`, so that `q = ±l` gives back `±m` exactly.
#[inline]
pub fn dequant(q: i32, m: f32, l: u32) -> f32 {
    (q as f32 / l as f32) * m
}

/// Sum of `|x|` in the fixed order every build repeats: eight striped lanes (lane `j` adds
/// elements `j, j + 8, ...` in order, zero-padded), then `((l0 + l1) + (l2 + l3)) + ((l4 + l5)
/// + (l6 + l7))`.
pub fn abs_sum_striped(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for chunk in x.chunks(8) {
        for (j, &v) in chunk.iter().enumerate() {
            lanes[j] += v.abs();
        }
    }
    combine_lanes(&lanes)
}

/// The pairwise combination of eight lane sums every striped sum ends with:
/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
fn combine_lanes(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The sign scale of a block: mean |x| = [`abs_sum_striped`] / len; 0 for an empty block.
///
/// When that sum overflows (elements near `f32::MAX`), the same striped sum is taken over
/// `|x| * 2^-64`, divided by len and multiplied by `2^64`, and capped at the block's absmax, so
/// the scale is always finite (a frame with an infinite scale would be refused by its decoder).
/// Fast paths may call this function for a block whose sum overflowed.
pub fn sign_block_scale(x: &[f32]) -> f32 {
    if x.is_empty() {
        return 0.0;
    }
    let s = abs_sum_striped(x);
    if s.is_finite() {
        return s / x.len() as f32;
    }
    const DOWN: f32 = 1.0 / 18_446_744_073_709_551_616.0; // 2^-64
    const UP: f32 = 18_446_744_073_709_551_616.0; // 2^64
    let mut lanes = [0.0f32; 8];
    for chunk in x.chunks(8) {
        for (j, &v) in chunk.iter().enumerate() {
            lanes[j] += v.abs() * DOWN;
        }
    }
    let s = combine_lanes(&lanes);
    ((s / x.len() as f32) * UP).min(abs_max(x))
}

/// The sign bit of an element: 1 when `x < 0` (so both zeros count as +).
#[inline]
pub fn sign_bit(x: f32) -> u8 {
    u8::from(x < 0.0)
}

/// Quantizes `x` (one tensor) into `scales` (one little-endian f32 absmax per `block` elements)
/// and `codes` (`q + l` in `bits` bits each, packed least-significant-bit first), the
/// specification of [`crate::quant::encode`].
pub fn quant_encode(
    x: &[f32],
    bits: u8,
    block: usize,
    stochastic_key: Option<u64>,
    scales: &mut [u8],
    codes: &mut [u8],
) {
    quant_encode_from(x, 0, bits, block, stochastic_key, scales, codes)
}

/// [`quant_encode`] of the elements `first..first + x.len()` of a tensor: stochastic rounding
/// draws for element `first + i`. The specification of [`crate::quant::encode_from`].
///
/// # Panics
/// When `block == 0` or `scales` or `codes` is shorter than [`crate::quant::scales_len`] or
/// [`crate::quant::codes_len`].
pub fn quant_encode_from(
    x: &[f32],
    first: u64,
    bits: u8,
    block: usize,
    stochastic_key: Option<u64>,
    scales: &mut [u8],
    codes: &mut [u8],
) {
    let l = quant_levels(bits);
    let mut bw = crate::bits::BitWriter::new(codes);
    for (b, chunk) in x.chunks(block).enumerate() {
        let m = abs_max(chunk);
        scales[4 * b..4 * b + 4].copy_from_slice(&m.to_le_bytes());
        let inv = quant_inv(m, l);
        for (j, &v) in chunk.iter().enumerate() {
            let i = first.wrapping_add((b * block + j) as u64);
            let u = stochastic_key.map(|key| rng::uniform_f32(key, i));
            let q = quant_code_inv(v, m, inv, l, u);
            bw.write((q + l as i32) as u64, u32::from(bits));
        }
    }
    bw.finish();
}

/// Packs signs and per-block mean |x| scales (when `block` is `Some`), the specification of
/// [`crate::sign::encode`].
pub fn sign_encode(x: &[f32], block: Option<usize>, scales: &mut [u8], signs: &mut [u8]) {
    if let Some(block) = block {
        for (b, chunk) in x.chunks(block).enumerate() {
            let s = sign_block_scale(chunk);
            scales[4 * b..4 * b + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
    signs[..x.len().div_ceil(8)].fill(0);
    for (i, &v) in x.iter().enumerate() {
        signs[i / 8] |= sign_bit(v) << (i % 8);
    }
}

/// PowerSGD's striped dot product ([`crate::powersgd`]): `a[t] * b[t]` into eight lane sums
/// (lane `t % 8`, in order of `t`, from `+0.0`), combined as the sign scale's lanes.
pub fn powersgd_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for (t, (&x, &y)) in a.iter().zip(b).enumerate() {
        lanes[t % 8] += x * y;
    }
    combine_lanes(&lanes)
}

/// [`crate::powersgd::project`]: `p[j * rows + i] = powersgd_dot(row i of m, column j of q)`.
pub fn powersgd_project(m: &[f32], rows: usize, cols: usize, q: &[f32], p: &mut [f32]) {
    let r = q.len() / cols.max(1);
    for i in 0..rows {
        for j in 0..r {
            p[j * rows + i] =
                powersgd_dot(&m[i * cols..(i + 1) * cols], &q[j * cols..(j + 1) * cols]);
        }
    }
}

/// [`crate::powersgd::back_project`]: `q[j * cols + k] = Σ_i m[i * cols + k] * p[j * rows + i]`
/// in order of `i` from `+0.0`.
pub fn powersgd_back_project(m: &[f32], rows: usize, cols: usize, p: &[f32], q: &mut [f32]) {
    let r = q.len() / cols.max(1);
    for j in 0..r {
        for k in 0..cols {
            let mut s = 0.0f32;
            for i in 0..rows {
                s += m[i * cols + k] * p[j * rows + i];
            }
            q[j * cols + k] = s;
        }
    }
}

/// [`crate::powersgd::orthogonalize`] of finite columns: modified Gram-Schmidt in column
/// order, each column divided by its norm (by its largest magnitude first when the sum of
/// squares is not a normal f32), a column of zeros left zero.
pub fn powersgd_orthogonalize(p: &mut [f32], rows: usize) {
    let r = p.len() / rows.max(1);
    for j in 0..r {
        for l in 0..j {
            let d = powersgd_dot(&p[j * rows..(j + 1) * rows], &p[l * rows..(l + 1) * rows]);
            for i in 0..rows {
                p[j * rows + i] += p[l * rows + i] * -d;
            }
        }
        let col = &mut p[j * rows..(j + 1) * rows];
        let sq = powersgd_dot(col, col);
        if sq.is_normal() {
            let root = libm::sqrtf(sq);
            col.iter_mut().for_each(|x| *x /= root);
            continue;
        }
        let s = col.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if s == 0.0 {
            col.fill(0.0);
            continue;
        }
        let mut lanes = [0.0f32; 8];
        for (t, &x) in col.iter().enumerate() {
            let y = x / s;
            lanes[t % 8] += y * y;
        }
        let root = libm::sqrtf(combine_lanes(&lanes));
        col.iter_mut().for_each(|x| *x = (*x / s) / root);
    }
}

/// [`crate::powersgd::reconstruct`]: `P Qᵀ` summed over the columns in order from `+0.0`,
/// written (`weight = None`) or added as `out + weight * sum`.
pub fn powersgd_reconstruct(
    p: &[f32],
    q: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    weight: Option<f32>,
) {
    let r = q.len() / cols.max(1);
    for i in 0..rows {
        for k in 0..cols {
            let mut s = 0.0f32;
            for j in 0..r {
                s += p[j * rows + i] * q[j * cols + k];
            }
            let o = &mut out[i * cols + k];
            *o = match weight {
                None => s,
                Some(w) => *o + w * s,
            };
        }
    }
}

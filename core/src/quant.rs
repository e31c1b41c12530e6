//! b-bit symmetric quantization with per-block absmax scales (QSGD, Alistarh et al. 2017).
//!
//! Codes `q` lie in `[-l, l]` with `l = 2^(b-1) - 1` and travel as `q + l` in `b` bits,
//! least-significant-bit first. A block's scale is its absmax `m` (f32); with the block's
//! reciprocal `inv = l / m`, `q = round(x * inv)` (or `round((x / m) * l)` when `inv` overflows,
//! see [`crate::scalar::quant_scaled`]) and the value decoded is `(q / l) * m`, so that the
//! extremes and constant blocks are exact.

use crate::lanes::{LANES, One, Source, load, load_padded};
use crate::method::Rounding;
use crate::rng;
use crate::scalar::{dequant, quant_inv, quant_levels};
use crate::select::OutOfLimit;
use wide::bytemuck::cast;
use wide::{f32x8, i8x16, i16x8, i32x8, u8x16};

/// Bytes of the scales section: 4 per block.
pub const fn scales_len(n: usize, block: usize) -> usize {
    n.div_ceil(if block == 0 { 1 } else { block })
        .saturating_mul(4)
}

/// Bytes of the codes section: `ceil(n * bits / 8)`.
pub const fn codes_len(n: usize, bits: u8) -> usize {
    n.saturating_mul(bits as usize).div_ceil(8)
}

/// Whether the SIMD kernel encodes this configuration (nearest rounding, 8 or 4 bits, blocks a
/// multiple of 8 elements); others run the [`crate::scalar`] specification.
pub const fn is_fast(bits: u8, block: usize, rounding: Rounding) -> bool {
    matches!(rounding, Rounding::NearestEven)
        && (bits == 8 || bits == 4)
        && block > 0
        && block.is_multiple_of(LANES)
}

/// Quantizes `x` into `scales` ([`scales_len`] bytes) and `codes` ([`codes_len`] bytes).
/// `stochastic` is `Some((seed, step, tensor_id))` for stochastic rounding. `x` must be finite
/// (see [`try_encode`], which checks it on the way).
///
/// # Panics
/// When `block == 0` or `scales` or `codes` is shorter than its length above (a caller's
/// sizing error; no value of `x` panics).
pub fn encode(
    x: &[f32],
    bits: u8,
    block: usize,
    stochastic: Option<(u64, u64, u64)>,
    scales: &mut [u8],
    codes: &mut [u8],
) {
    encode_from(x, 0, bits, block, stochastic, scales, codes)
}

/// [`encode`] of the elements `first..first + x.len()` of a tensor, for a tensor quantized in
/// pieces (on several threads, say): stochastic rounding draws for element `first + i` of the
/// tensor, so a piece that starts on a whole block and a whole byte of codes writes exactly
/// its part of the whole tensor's sections (`scales` from byte `4 * first / block`, `codes`
/// from byte `first * bits / 8`). With nearest rounding `first` changes nothing.
///
/// # Panics
/// As [`encode`].
pub fn encode_from(
    x: &[f32],
    first: u64,
    bits: u8,
    block: usize,
    stochastic: Option<(u64, u64, u64)>,
    scales: &mut [u8],
    codes: &mut [u8],
) {
    let key = stochastic.map(|(s, t, id)| rng::key(s, t, id));
    if key.is_none() && is_fast(bits, block, Rounding::NearestEven) {
        // Finite input cannot fail the check.
        let _ = encode_fast(&One(x), bits, block, scales, codes, |_| {});
    } else {
        crate::scalar::quant_encode_from(x, first, bits, block, key, scales, codes)
    }
}

/// As [`encode`], checking on the way that every element is finite.
///
/// The SIMD kernel writes block by block and detects a NaN or infinity through the block's
/// absmax, so on error `scales` and `codes` hold a prefix of the sections (their contents are
/// unspecified); other configurations check the whole input before writing.
///
/// # Errors
/// [`OutOfLimit`] when some element is NaN or infinite.
pub fn try_encode(
    x: &[f32],
    bits: u8,
    block: usize,
    stochastic: Option<(u64, u64, u64)>,
    scales: &mut [u8],
    codes: &mut [u8],
) -> Result<(), OutOfLimit> {
    if stochastic.is_none() && is_fast(bits, block, Rounding::NearestEven) {
        encode_fast(&One(x), bits, block, scales, codes, |_| {})
    } else if crate::values::first_non_finite(x).is_some() {
        Err(OutOfLimit)
    } else {
        encode(x, bits, block, stochastic, scales, codes);
        Ok(())
    }
}

/// The SIMD kernel over any element source (one slice, or the sum `g + r` of an
/// error-feedback step), for configurations where [`is_fast`] holds. Per block: the absmax
/// (SIMD max of |x|, which also checks that the block is finite), one division `inv = l / m`,
/// then `x * inv` (or `(x / m) * l` when `inv` overflows) rounded to nearest even as
/// [`crate::scalar::round_ties_even`] (see `Coder::code_scaled`), narrowed to bytes by
/// saturating packs with `l` added (8 bits) or then packed two codes per byte (4 bits).
///
/// The two passes are software-pipelined: while block `b` is coded (from the L1 cache), the
/// absmax of block `b + 1` is taken (from memory), so the arithmetic overlaps the loads. On a
/// NaN or infinity the blocks before the bad one may already be written.
///
/// `written` is called with the code bytes, in order and in runs of whole blocks (about 1 KiB),
/// right after they are written (the frame encoder folds them into its checksum while they are
/// in cache).
pub(crate) fn encode_fast<S: Source>(
    src: &S,
    bits: u8,
    block: usize,
    scales: &mut [u8],
    codes: &mut [u8],
    mut written: impl FnMut(&[u8]),
) -> Result<(), OutOfLimit> {
    let n = src.len();
    let l = quant_levels(bits);
    let per_byte = 8 / bits as usize;
    let mut m = block_absmax_src(src, 0, block.min(n)).ok_or(OutOfLimit)?;
    let mut start = 0usize;
    let mut b = 0usize;
    // Codes are handed to `written` in runs of at least this many bytes, still in L1 when the
    // checksum reads them. Shorter runs leave shorter gaps in the stream of loads while the
    // checksum runs; the length is a tuning choice, not part of the format.
    const RUN: usize = 1024;
    let mut flushed = 0usize;
    while start < n {
        let len = block.min(n - start);
        scales[4 * b..4 * b + 4].copy_from_slice(&m.to_le_bytes());
        let out = &mut codes[start / per_byte..(start + len).div_ceil(per_byte)];
        let next = start + len;
        let next_len = block.min(n - next);
        let coder = Coder::new(m, l);
        m = match coder {
            // A block whose reciprocal overflows (absmax below about 1e-36) takes the loop
            // below: the pipelined loop has no branch on it.
            Some(c) if !c.exact && next_len == block && block.is_multiple_of(2 * LANES) => {
                if bits == 8 {
                    code_pipelined::<S, 16>(src, start, block, &c, out)
                } else {
                    code_pipelined::<S, 8>(src, start, block, &c, out)
                }
                .ok_or(OutOfLimit)?
            }
            _ => {
                match coder {
                    Some(c) if bits == 8 => codes8(src, start, len, &c, out),
                    Some(c) => codes4(src, start, len, &c, out),
                    None => zero_block(bits, l, len, out),
                }
                block_absmax_src(src, next, next_len).ok_or(OutOfLimit)?
            }
        };
        let end = next.div_ceil(per_byte);
        if end - flushed >= RUN || next == n {
            written(&codes[flushed..end]);
            flushed = end;
        }
        start = next;
        b += 1;
    }
    Ok(())
}

/// The codes of a block whose absmax is 0: every code is `l` (q = 0).
fn zero_block(bits: u8, l: u32, len: usize, out: &mut [u8]) {
    if bits == 8 {
        out.fill(l as u8);
    } else {
        out.fill((l | (l << 4)) as u8);
        if len % 2 == 1
            && let Some(last) = out.last_mut()
        {
            *last &= 0x0f;
        }
    }
}

/// Codes the full block at `start` (`block` a multiple of 16, `coder` not exact) into `out`
/// while taking the absmax of the full block that follows it; `None` when that block is not
/// finite. `STEP` is the bytes of 16 codes: 16 for 8 bits, 8 for 4 bits.
///
/// Written for few instructions per element (the default x86-64 build splits every `f32x8`
/// operation in two and retires about 4 instructions per element at memory speed): one max
/// accumulator, no branch in the loop, codes by [`Coder::code_scaled`].
#[inline]
fn code_pipelined<S: Source, const STEP: usize>(
    src: &S,
    start: usize,
    block: usize,
    coder: &Coder,
    out: &mut [u8],
) -> Option<f32> {
    let mut acc = f32x8::splat(0.0);
    // A NaN or an infinity makes this sum non-finite (one addition per vector, where a compare
    // and a mask would take two, and unlike a max the same on every target); so may finite
    // values that overflow it, which the exact check below then clears. Both vectors go
    // straight into the accumulators: `u + v` first would cost a register copy per vector in
    // the default build's two-operand instructions.
    let mut sum = f32x8::splat(0.0);
    let inv = f32x8::splat(coder.inv);
    let mut now = src.pairs(start, block).zip(out.chunks_exact_mut(STEP));
    // With the line AHEAD elements past the one the absmax reads. (One zip deeper, and the
    // compiler no longer inlines the loop's `next`.)
    for q in src.pairs_ahead(start + block, block) {
        let Some((p, o)) = now.next() else { break };
        let (u, v) = (q[0].abs(), q[1].abs());
        sum = (sum + u) + v;
        acc = acc.fast_max(u).fast_max(v);
        let c = coder.bytes16_scaled(p[0] * inv, p[1] * inv);
        if STEP == 16 {
            o.copy_from_slice(&c[..STEP]);
        } else {
            o.copy_from_slice(&nibbles(c)[..STEP]);
        }
    }
    if !sum.is_finite().all() {
        return block_absmax_src(src, start + block, block);
    }
    Some(lane_max(acc))
}

/// The largest lane of a vector of finite, non-negative lanes.
#[inline]
fn lane_max(m: f32x8) -> f32 {
    m.to_array().iter().fold(0.0f32, |a, &b| a.max(b))
}

/// Code lanes of one block: `c = clamp(round(y), -l, l) + l` with `y` the scaled position.
struct Coder {
    m: f32,
    /// `l / m`.
    inv: f32,
    l: u32,
    /// `inv` overflowed: divide by `m`, then multiply by `l`.
    exact: bool,
}

/// `1.5 * 2^23`, the rounding constant of [`crate::scalar::round_ties_even`].
#[cfg(not(target_feature = "sse2"))]
const MAGIC: f32 = 12_582_912.0;

impl Coder {
    /// The coder of a block with absmax `m`; `None` when `m == 0` (every code is `l`).
    #[inline]
    fn new(m: f32, l: u32) -> Option<Self> {
        if m == 0.0 {
            return None;
        }
        let inv = quant_inv(m, l);
        Some(Coder {
            m,
            inv,
            l,
            exact: !inv.is_finite(),
        })
    }

    /// The rounded positions `q` (codes minus `l`) of eight elements of the block.
    #[inline]
    fn code(&self, v: f32x8) -> i32x8 {
        let y = if self.exact {
            (v / f32x8::splat(self.m)) * f32x8::splat(self.l as f32)
        } else {
            v * f32x8::splat(self.inv)
        };
        self.code_scaled(y)
    }

    /// The rounded positions `q = round(y)` (ties to even, as
    /// [`crate::scalar::round_ties_even`]) of eight scaled positions `y` (`x * inv`, or
    /// `(x / m) * l`); the code is `q + l`, added by [`code_bytes`] after narrowing.
    ///
    /// On x86 one conversion per vector (`cvtps2dq`, which rounds to nearest even in the
    /// default floating-point environment that Rust guarantees). Elsewhere `t = y + 1.5 * 2^23`
    /// is the rounding step of [`crate::scalar::round_ties_even`]: it holds `1.5 * 2^23 +
    /// round(y)` exactly, a float in `[2^23, 2^24)` whose unit in the last place is 1, so one
    /// integer subtraction of its bits gives `round(y)`. The specification's clamp to `[-l, l]`
    /// never binds: every element has `|x| <= m`, so `|x * fl(l / m)| <= l * (1 + 2^-24)`
    /// rounded, and `|fl(x / m)| <= 1`, both far below `l + 1/2`.
    #[inline]
    fn code_scaled(&self, y: f32x8) -> i32x8 {
        #[cfg(target_feature = "sse2")]
        {
            // |y| <= l + 1/2 is far inside i32, and y is never NaN: no fix-up is needed.
            y.fast_round_int()
        }
        #[cfg(not(target_feature = "sse2"))]
        {
            let t: i32x8 = cast(y + f32x8::splat(MAGIC));
            t - i32x8::splat(MAGIC.to_bits() as i32)
        }
    }

    /// The codes of elements `i..end` (`end - i < 16`), zero-padded, as bytes.
    #[inline]
    fn bytes16_tail<S: Source>(&self, src: &S, i: usize, end: usize) -> [u8; 16] {
        let a = chunk_or_tail(src, i, end);
        let b = if i + LANES < end {
            chunk_or_tail(src, i + LANES, end)
        } else {
            f32x8::splat(0.0)
        };
        self.bytes16(a, b)
    }

    /// Sixteen codes (each 0..=254) as bytes.
    #[inline]
    fn bytes16(&self, a: f32x8, b: f32x8) -> [u8; 16] {
        code_bytes(self.code(a), self.code(b), self.l)
    }

    /// [`Coder::bytes16`] of sixteen scaled positions.
    #[inline]
    fn bytes16_scaled(&self, a: f32x8, b: f32x8) -> [u8; 16] {
        code_bytes(self.code_scaled(a), self.code_scaled(b), self.l)
    }
}

/// Sixteen rounded positions `q` in `[-l, l]` (`l <= 127`) as the code bytes `q + l`: two
/// saturating packs (which leave every `q` as it is), then one byte addition of `l` for all
/// sixteen (where adding `l` to each 32-bit lane would take four).
#[inline]
fn code_bytes(lo: i32x8, hi: i32x8, l: u32) -> [u8; 16] {
    let q = i8x16::from_i16x16_saturate(cast([
        i16x8::from_i32x8_saturate(lo),
        i16x8::from_i32x8_saturate(hi),
    ]));
    cast(q + i8x16::splat(l as u8 as i8))
}

/// 8-bit codes of elements `start..start + len` into `out` (`len` bytes).
fn codes8<S: Source>(src: &S, start: usize, len: usize, coder: &Coder, out: &mut [u8]) {
    let full = len / (2 * LANES) * (2 * LANES);
    let (head, tail) = out.split_at_mut(full);
    for (p, o) in src.pairs(start, full).zip(head.chunks_exact_mut(2 * LANES)) {
        o.copy_from_slice(&coder.bytes16(p[0], p[1]));
    }
    if !tail.is_empty() {
        let c = coder.bytes16_tail(src, start + full, start + len);
        let k = tail.len();
        tail.copy_from_slice(&c[..k]);
    }
}

/// 4-bit codes of elements `start..start + len` into `out` (`ceil(len / 2)` bytes; the high
/// nibble of a last odd byte is 0).
fn codes4<S: Source>(src: &S, start: usize, len: usize, coder: &Coder, out: &mut [u8]) {
    let full = len / (2 * LANES) * (2 * LANES);
    let (head, tail) = out.split_at_mut(full / 2);
    for (p, o) in src.pairs(start, full).zip(head.chunks_exact_mut(LANES)) {
        o.copy_from_slice(&nibbles(coder.bytes16(p[0], p[1])));
    }
    if !tail.is_empty() {
        let mut c = coder.bytes16_tail(src, start + full, start + len);
        // Codes past the block are not written (a last odd code gets a zero high nibble).
        c[len - full..].fill(0);
        let p = nibbles(c);
        let k = tail.len();
        tail.copy_from_slice(&p[..k]);
    }
}

/// Sixteen 4-bit codes (one per byte, each `< 16`) packed two per byte, the even-indexed code
/// in the low nibble.
#[inline]
fn nibbles(c: [u8; 16]) -> [u8; 8] {
    let squeeze = |w: u64| {
        // Byte k becomes c[k] | c[k + 1] << 4; keep the even bytes, then close the gaps.
        let t = (w | (w >> 4)) & 0x00ff_00ff_00ff_00ff;
        let t = (t | (t >> 8)) & 0x0000_ffff_0000_ffff;
        (t | (t >> 16)) & 0xffff_ffff
    };
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&c[..8]);
    hi.copy_from_slice(&c[8..]);
    (squeeze(u64::from_le_bytes(lo)) | (squeeze(u64::from_le_bytes(hi)) << 32)).to_le_bytes()
}

/// Elements `i..i + 8` of `src`, zero-padded past `end`.
#[inline]
fn chunk_or_tail<S: Source>(src: &S, i: usize, end: usize) -> f32x8 {
    if i + LANES <= end {
        src.chunk(i)
    } else if end == src.len() {
        src.tail(i)
    } else {
        // A block that ends inside the source: mask the lanes past its end.
        let live = end - i;
        let v = src.chunk(i).to_array();
        let mut a = [0.0f32; LANES];
        a[..live].copy_from_slice(&v[..live]);
        f32x8::new(a)
    }
}

/// Largest |x| of elements `start..start + len` of `src` (0 for none), bit-equal to
/// [`crate::scalar::abs_max`]; `None` when one of them is NaN or infinite.
#[inline]
fn block_absmax_src<S: Source>(src: &S, start: usize, len: usize) -> Option<f32> {
    let inf = f32x8::splat(f32::INFINITY);
    let mut acc = [f32x8::splat(0.0); 2];
    let mut ok = inf.simd_eq(inf);
    let full = len / (2 * LANES) * (2 * LANES);
    for p in src.pairs(start, full) {
        let (u, v) = (p[0].abs(), p[1].abs());
        ok = ok & u.simd_lt(inf) & v.simd_lt(inf);
        acc[0] = acc[0].fast_max(u);
        acc[1] = acc[1].fast_max(v);
    }
    let end = start + len;
    let mut i = start + full;
    while i < end {
        let a = chunk_or_tail(src, i, end).abs();
        ok &= a.simd_lt(inf);
        acc[0] = acc[0].fast_max(a);
        i += LANES;
    }
    if !ok.all() {
        return None;
    }
    Some(lane_max(acc[0].fast_max(acc[1])))
}

/// Largest |x| of a block (0 for an empty one), bit-equal to [`crate::scalar::abs_max`] for
/// finite input.
pub fn block_absmax(x: &[f32]) -> f32 {
    let mut acc = [f32x8::splat(0.0); 4];
    let mut chunks = x.chunks_exact(4 * LANES);
    for c in &mut chunks {
        for (t, a) in acc.iter_mut().enumerate() {
            *a = a.fast_max(load(&c[t * LANES..]).abs());
        }
    }
    for c in chunks.remainder().chunks(LANES) {
        acc[0] = acc[0].fast_max(load_padded(c).abs());
    }
    let m = acc[0].fast_max(acc[1]).fast_max(acc[2].fast_max(acc[3]));
    m.to_array().iter().fold(0.0f32, |a, &b| a.max(b))
}

/// Checks codes of 8 or 4 bits (no code above `2l`, zero padding) faster than [`validate`]
/// for those widths; other widths go to [`validate`]. Same result and offsets.
pub fn validate_fast(n: usize, bits: u8, scales: &[u8], codes: &[u8]) -> Result<(), usize> {
    let bad = match bits {
        8 => codes.iter().fold(false, |a, &c| a | (c == 0xff)),
        4 => codes
            .iter()
            .fold(false, |a, &c| a | (c & 0x0f == 0x0f) | (c >> 4 == 0x0f)),
        _ => true,
    };
    if bad || codes.len() != codes_len(n, bits) {
        return validate(n, bits, scales, codes);
    }
    if bits == 4 && n % 2 == 1 && codes.last().is_some_and(|&c| c >> 4 != 0) {
        return validate(n, bits, scales, codes);
    }
    for (j, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        if !(m.is_finite() && m >= 0.0) {
            return Err(4 * j);
        }
    }
    Ok(())
}

/// Decodes validated sections into `out` (`out.len() == n`): overwriting (`weight = None`) or
/// adding `weight * value`; the same values as [`decode`] (`(q / l) * m`).
pub fn decode_slice(
    bits: u8,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
    weight: Option<f32>,
) {
    let n = out.len();
    if !((bits == 8 || bits == 4) && block > 0 && block.is_multiple_of(LANES)) {
        match weight {
            None => decode(n, bits, block, scales, codes, |i, v| out[i] = v),
            Some(w) => decode(n, bits, block, scales, codes, |i, v| out[i] += w * v),
        }
        return;
    }
    let l = quant_levels(bits);
    let lf = f32x8::splat(l as f32);
    let li = i32x8::splat(l as i32);
    let w8 = f32x8::splat(weight.unwrap_or(1.0));
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = &scales[4 * b..4 * b + 4];
        let m8 = f32x8::splat(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
        let per_byte = 8 / bits as usize;
        let cb = &codes[b * block / per_byte..(b * block + ob.len()).div_ceil(per_byte)];
        let conv = |o: &mut [f32], c: i32x8| {
            let q = f32x8::from_i32x8(c - li);
            let v = (q / lf) * m8;
            let len = o.len();
            let r = match weight {
                None => v,
                Some(_) if len == LANES => load(o) + w8 * v,
                Some(_) => load_padded(o) + w8 * v,
            };
            o.copy_from_slice(&r.as_array()[..len]);
        };
        // Groups of 32 codes (16 or 32 bytes), widened in registers: building the codes in a
        // stack array and loading it as a vector stalls on store forwarding.
        let g32 = ob.len() / GROUP * GROUP;
        let (head, ob) = ob.split_at_mut(g32);
        let (cg, cb) = cb.split_at(g32 / per_byte);
        for (o, c) in head
            .chunks_exact_mut(GROUP)
            .zip(cg.chunks_exact(GROUP / per_byte))
        {
            for (o, q) in o.chunks_exact_mut(LANES).zip(codes32(bits, c)) {
                conv(o, q);
            }
        }
        let full = ob.len() / LANES * LANES;
        let mut os = ob.chunks_exact_mut(LANES);
        let step = LANES / per_byte;
        let mut cs = cb.chunks_exact(step);
        for (o, c) in (&mut os).zip(&mut cs) {
            let mut q = [0i32; 8];
            if bits == 8 {
                for (v, &b) in q.iter_mut().zip(c) {
                    *v = i32::from(b);
                }
            } else {
                for (t, &b) in c.iter().enumerate() {
                    q[2 * t] = i32::from(b & 0x0f);
                    q[2 * t + 1] = i32::from(b >> 4);
                }
            }
            conv(o, i32x8::new(q));
        }
        let o = os.into_remainder();
        if !o.is_empty() {
            let c = &cb[full / per_byte..];
            let mut q = [0i32; 8];
            for (t, &b) in c.iter().enumerate() {
                if bits == 8 {
                    q[t] = i32::from(b);
                } else {
                    q[2 * t] = i32::from(b & 0x0f);
                    q[2 * t + 1] = i32::from(b >> 4);
                }
            }
            conv(o, i32x8::new(q));
        }
    }
}

/// Codes per group of [`codes32`].
const GROUP: usize = 32;

/// The 32 codes of `c` (32 bytes of 8-bit codes, or 16 bytes of 4-bit codes, low nibble
/// first), zero-extended to four vectors of eight.
#[inline]
fn codes32(bits: u8, c: &[u8]) -> [i32x8; 4] {
    let bytes = |c: &[u8]| {
        let mut a = [0u8; 16];
        a.copy_from_slice(&c[..16]);
        u8x16::new(a)
    };
    let widen = |v: u8x16| {
        [
            i32x8::from_i16x8(i16x8::from_u8x16_low(v)),
            i32x8::from_i16x8(i16x8::from_u8x16_high(v)),
        ]
    };
    let (a, b) = if bits == 8 {
        (bytes(c), bytes(&c[16..]))
    } else {
        let v = bytes(c);
        let lo = v & u8x16::splat(0x0f);
        let hi = v.unbounded_shr_scalar(4);
        (u8x16::unpack_low(lo, hi), u8x16::unpack_high(lo, hi))
    };
    let [q0, q1] = widen(a);
    let [q2, q3] = widen(b);
    [q0, q1, q2, q3]
}

/// Checks scales (finite, `>= 0`) and codes (`<= 2l`; padding zero).
/// `Err(offset)` gives the byte offset within `scales` + `codes` (scales first).
pub fn validate(n: usize, bits: u8, scales: &[u8], codes: &[u8]) -> Result<(), usize> {
    for (j, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        if !(m.is_finite() && m >= 0.0) {
            return Err(4 * j);
        }
    }
    let max = 2 * quant_levels(bits) as u64;
    let mut br = crate::bits::BitReader::new(codes);
    for i in 0..n {
        match br.read(u32::from(bits)) {
            Some(c) if c <= max => {}
            _ => return Err(scales.len() + i * bits as usize / 8),
        }
    }
    if !br.padding_is_zero() || br.bytes_consumed() != codes.len() {
        return Err(scales.len() + codes.len().saturating_sub(1));
    }
    Ok(())
}

/// Decodes validated sections, calling `f(i, value)` for every element in order.
pub fn decode(
    n: usize,
    bits: u8,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    mut f: impl FnMut(usize, f32),
) {
    let l = quant_levels(bits);
    let mut br = crate::bits::BitReader::new(codes);
    for (b, s) in scales.chunks_exact(4).enumerate() {
        let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let start = b * block;
        let end = (start + block).min(n);
        for i in start..end {
            let c = br.read(u32::from(bits)).unwrap_or(0) as i32;
            f(i, dequant(c - l as i32, m, l));
        }
    }
}

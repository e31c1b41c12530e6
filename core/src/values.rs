//! Value codecs: f32, f16, bf16 (crate `half`, round to nearest even) and int8 with a per-block
//! absmax scale.

use crate::lanes::{LANES, One, Range, Source, load, load_padded};
use crate::method::Values;
use crate::scalar::{dequant, quant_code};
use crate::select::OutOfLimit;
use half::{bf16, f16};
use wide::{f32x8, u16x16, u32x8};

/// Wire id of a value codec.
pub const fn id(values: Values) -> u8 {
    match values {
        Values::F32 => 0,
        Values::F16 => 1,
        Values::Bf16 => 2,
        Values::Int8 { .. } => 3,
    }
}

/// True when `x` (finite) has a finite representation in `values` (f16 overflows beyond
/// 65504 after rounding; bf16 only next to f32::MAX; f32 and int8 always fit).
#[inline]
pub fn fits(values: Values, x: f32) -> bool {
    match values {
        Values::F16 => f16::from_f32(x).is_finite(),
        Values::Bf16 => bf16::from_f32(x).is_finite(),
        _ => true,
    }
}

/// `x` saturated to the range of `values`: a finite `x` beyond the largest finite f16 or bf16
/// becomes that value of its sign, which it rounds to the same bits as the saturating writers
/// ([`write_plain`], [`encode_plain`]); any other `x` (in range, NaN, f32 and int8 values) is
/// returned as it is. For error-feedback steps that select in f32 and encode a list of kept
/// values whose encoders refuse values out of range.
#[inline]
pub fn saturate(values: Values, x: f32) -> f32 {
    match values {
        Values::F16 => x.clamp(-f16::MAX.to_f32(), f16::MAX.to_f32()),
        Values::Bf16 => x.clamp(-bf16::MAX.to_f32(), bf16::MAX.to_f32()),
        _ => x,
    }
}

/// [`saturate`] of every value in `bits` (`f32::to_bits` of kept values, as the selection
/// writes them), in place; whether any changed. Only f16 and bf16 values change anything.
pub fn saturate_bits(values: Values, bits: &mut [u32]) -> bool {
    if !matches!(values, Values::F16 | Values::Bf16) {
        return false;
    }
    let mut changed = false;
    for b in bits {
        let s = saturate(values, f32::from_bits(*b)).to_bits();
        changed |= s != *b;
        *b = s;
    }
    changed
}

/// Index of the first element of `x` that does not fit `values`.
pub fn first_out_of_range(values: Values, x: &[f32]) -> Option<usize> {
    match values {
        Values::F16 | Values::Bf16 => x.iter().position(|&v| !fits(values, v)),
        _ => None,
    }
}

/// Writes `x` as an f32, f16 or bf16 (little-endian) at the start of `out`. A finite `x`
/// beyond the range of f16 or bf16 saturates: it is written as the type's largest finite
/// value of its sign (an error-feedback step keeps the excess in its residual; steps without
/// error feedback refuse such a value before they encode).
#[inline]
pub fn write_plain(values: Values, x: f32, out: &mut [u8]) {
    match values {
        Values::F16 => {
            let h = f16::from_f32(saturate(values, x));
            out[..2].copy_from_slice(&h.to_bits().to_le_bytes())
        }
        Values::Bf16 => {
            let h = bf16::from_f32(saturate(values, x));
            out[..2].copy_from_slice(&h.to_bits().to_le_bytes())
        }
        _ => out[..4].copy_from_slice(&x.to_le_bytes()),
    }
}

/// Reads an f32, f16 or bf16 from the start of `bytes`; `None` if short or not finite.
#[inline]
pub fn read_plain(values: Values, bytes: &[u8]) -> Option<f32> {
    let v = match values {
        Values::F16 => {
            f16::from_bits(u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?])).to_f32()
        }
        Values::Bf16 => {
            bf16::from_bits(u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?])).to_f32()
        }
        _ => f32::from_le_bytes([
            *bytes.first()?,
            *bytes.get(1)?,
            *bytes.get(2)?,
            *bytes.get(3)?,
        ]),
    };
    if v.is_finite() { Some(v) } else { None }
}

/// The int8 code of `x` in a block with absmax `m`: [`crate::scalar::quant_code`] with 127
/// levels (round to nearest even of `x * (127 / m)`, or of `(x / m) * 127` when `127 / m`
/// overflows).
#[inline]
pub fn int8_code(x: f32, m: f32) -> i8 {
    quant_code(x, m, 127, None) as i8
}

/// The value of an int8 code in a block with absmax `m`: `(code / 127) * m`.
#[inline]
pub fn int8_value(code: i8, m: f32) -> f32 {
    dequant(i32::from(code), m, 127)
}

/// The magnitude bound of a value type: a finite `x` fits iff `|x| < limit`, and NaN never
/// does (`f32::INFINITY` for f32 and int8, 65520 for f16, the first bf16 rounding to infinity
/// for bf16). `None` (no value type) is f32.
pub fn magnitude_limit(values: Option<Values>) -> f32 {
    match values {
        Some(Values::F16) => 65_520.0,
        Some(Values::Bf16) => f32::from_bits(0x7f7f_8000),
        _ => f32::INFINITY,
    }
}

/// Whether every element of the source is below `limit` in magnitude (NaN never is).
///
/// One addition per vector instead of a compare and a mask: the lanes add |x| over runs of
/// [`SUM_RUN`] elements, and a run whose every lane sum is below `limit` has every element
/// below it (a rounded sum of non-negative floats is never below one of its terms; a NaN makes
/// its lane NaN, which is not below). A run that fails this, holding a large element or merely
/// large sums, is decided element by element.
pub(crate) fn all_below<S: Source>(src: &S, limit: f32) -> bool {
    let n = src.len();
    let lim8 = f32x8::splat(limit);
    let mut start = 0usize;
    while start < n {
        let len = SUM_RUN.min(n - start);
        if !run_sums_below(src, start, len, lim8) && !run_below(src, start, len, lim8) {
            return false;
        }
        start += len;
    }
    true
}

/// Elements per run of [`all_below`]'s sums.
const SUM_RUN: usize = 1024;

/// Whether every lane sum of |x| over elements `start..start + len` is below `lim8`.
#[inline]
fn run_sums_below<S: Source>(src: &S, start: usize, len: usize, lim8: f32x8) -> bool {
    let mut acc = [f32x8::splat(0.0); 4];
    let full = len / (4 * LANES) * (4 * LANES);
    for q in src.quads_ahead(start, full) {
        for (a, x) in acc.iter_mut().zip(q) {
            *a += x.abs();
        }
    }
    let mut i = start + full;
    while i < start + len {
        let x = if start + len - i >= LANES {
            src.chunk(i)
        } else {
            src.tail(i)
        };
        acc[0] += x.abs();
        i += LANES;
    }
    acc.iter().all(|a| a.simd_lt(lim8).all())
}

/// Whether every element `start..start + len` is below `lim8` in magnitude, element by element.
fn run_below<S: Source>(src: &S, start: usize, len: usize, lim8: f32x8) -> bool {
    let mut ok = f32x8::splat(0.0).simd_eq(f32x8::splat(0.0));
    let mut i = start;
    while i < start + len {
        let x = if start + len - i >= LANES {
            src.chunk(i)
        } else {
            src.tail(i)
        };
        ok &= x.abs().simd_lt(lim8);
        i += LANES;
    }
    ok.all()
}

/// Index of the first element of `x` with `!(|x| < limit)` (NaN included), by a SIMD pass.
pub fn first_at_or_above(x: &[f32], limit: f32) -> Option<usize> {
    const BLOCK: usize = 4096;
    for (b, chunk) in x.chunks(BLOCK).enumerate() {
        // A range of the whole slice, so that the pass prefetches past the block.
        if !all_below(&Range(&One(x), b * BLOCK, chunk.len()), limit) {
            let j = chunk
                .iter()
                .position(|v| v.abs().partial_cmp(&limit) != Some(core::cmp::Ordering::Less))?;
            return Some(b * BLOCK + j);
        }
    }
    None
}

/// Index of the first NaN or infinite element (SIMD; equals [`crate::scalar::first_non_finite`]).
pub fn first_non_finite(x: &[f32]) -> Option<usize> {
    first_at_or_above(x, f32::INFINITY)
}

/// f16 bits (round to nearest even, as `half`) of eight finite lanes; a lane that rounds
/// beyond f16's range (`|x| >= 65520`) saturates to 65504 of its sign, as [`write_plain`].
#[inline]
pub fn f16_bits_x8(x: f32x8) -> u32x8 {
    // Clamped to 65504 first (two instructions; a finite lane only, NaN is the caller's to
    // refuse): 65504 rounds to 0x7bff, and every lane in (65504, 65520) rounds to it too.
    // The lane as the second operand: x86's max/min give the second when either is NaN, so a
    // NaN lane is not made a finite one here (what a NaN lane becomes is unspecified: callers
    // refuse NaN before they encode).
    let top = f32x8::splat(65504.0);
    let b = top.fast_min((-top).fast_max(x)).to_bits();
    let sign = (b >> 16) & u32x8::splat(0x8000);
    let a = b & u32x8::splat(0x7fff_ffff);
    // Normal f16: rebias the exponent, round the mantissa from 23 to 10 bits to nearest even.
    let t = a - u32x8::splat(0x3800_0000);
    let normal = (t + u32x8::splat(0x0fff) + ((t >> 13) & u32x8::splat(1))) >> 13;
    // Subnormal f16 (|x| < 2^-14): adding 0.5 rounds to the 2^-24 grid, to nearest even.
    let sub = (f32x8::from_bits(a) + f32x8::splat(0.5)).to_bits() - u32x8::splat(0x3f00_0000);
    let is_normal = a.simd_ge(u32x8::splat(0x3880_0000));
    is_normal.select(normal, sub) | sign
}

/// bf16 bits (round to nearest even, as `half`) of eight finite lanes; a lane that rounds
/// beyond bf16's range saturates to bf16's largest finite value of its sign, as
/// [`write_plain`].
#[inline]
pub fn bf16_bits_x8(x: f32x8) -> u32x8 {
    // Clamped to bf16's largest finite value first (a finite lane only; NaN is the caller's to
    // refuse): it rounds to 0x7f7f, and so does every lane below 0x7f7f8000 above it.
    let top = f32x8::from_bits(u32x8::splat(0x7f7f_0000));
    let b = top.fast_min((-top).fast_max(x)).to_bits();
    (b + u32x8::splat(0x7fff) + ((b >> 16) & u32x8::splat(1))) >> 16
}

/// f32 lanes of eight finite f16 bit patterns (exact).
#[inline]
pub fn f16_to_f32_x8(h: u32x8) -> f32x8 {
    let sign = (h & u32x8::splat(0x8000)) << 16;
    let exp = h & u32x8::splat(0x7c00);
    let normal = ((h & u32x8::splat(0x7fff)) << 13) + u32x8::splat(0x3800_0000);
    let mant = h & u32x8::splat(0x03ff);
    let sub = (f32x8::from_bits(u32x8::splat(0x3f00_0000) | mant) - f32x8::splat(0.5)).to_bits();
    let is_sub = exp.simd_eq(u32x8::splat(0));
    f32x8::from_bits(is_sub.select(sub, normal) | sign)
}

/// f32 lanes of eight bf16 bit patterns (exact).
#[inline]
pub fn bf16_to_f32_x8(h: u32x8) -> f32x8 {
    f32x8::from_bits(h << 16)
}

#[inline]
fn load_u16x8(bytes: &[u8]) -> u32x8 {
    let mut a = [0u32; LANES];
    for (j, v) in a.iter_mut().enumerate() {
        *v = u32::from(u16::from_le_bytes([bytes[2 * j], bytes[2 * j + 1]]));
    }
    u32x8::new(a)
}

#[inline]
fn store_u16x8(h: u32x8, out: &mut [u8]) {
    for (j, &v) in h.as_array().iter().enumerate() {
        out[2 * j..2 * j + 2].copy_from_slice(&(v as u16).to_le_bytes());
    }
}

/// Writes every element of `x` as an f32, f16 or bf16 (little-endian) into
/// `out[..x.len() * value_bytes]`, the same bytes as [`write_plain`] per element (a finite
/// value beyond f16 or bf16 saturated). `x` must be finite (what a NaN or an infinity becomes is
/// unspecified); int8 is not a plain type.
///
/// # Panics
/// When `out` is too short or `values` is int8.
pub fn encode_plain(values: Values, x: &[f32], out: &mut [u8]) {
    let vb = values.value_bytes();
    let out = &mut out[..x.len() * vb];
    match values {
        Values::F32 => {
            for (c, &v) in out.chunks_exact_mut(4).zip(x) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        Values::F16 | Values::Bf16 => {
            let conv = |v: f32x8| {
                if values == Values::F16 {
                    f16_bits_x8(v)
                } else {
                    bf16_bits_x8(v)
                }
            };
            let mut chunks = x.chunks_exact(LANES);
            let mut outs = out.chunks_exact_mut(2 * LANES);
            for (c, o) in (&mut chunks).zip(&mut outs) {
                store_u16x8(conv(load(c)), o);
            }
            let rest = chunks.remainder();
            if !rest.is_empty() {
                let mut tmp = [0u8; 2 * LANES];
                store_u16x8(conv(load_padded(rest)), &mut tmp);
                let o = outs.into_remainder();
                o.copy_from_slice(&tmp[..o.len()]);
            }
        }
        Values::Int8 { .. } => panic!("int8 is not a plain value type"),
    }
}

/// As [`encode_plain`], checking on the way that every element is below
/// [`magnitude_limit`]`(Some(values))` (finite, and within f16 or bf16 range). The input is
/// checked and written in runs that stay in the L1 cache; on error `out` holds a prefix of the
/// section (its contents are unspecified).
///
/// # Errors
/// [`OutOfLimit`] when some element is NaN, infinite or beyond the range of `values`.
///
/// # Panics
/// When `out` is too short or `values` is int8.
pub fn try_encode_plain(values: Values, x: &[f32], out: &mut [u8]) -> Result<(), OutOfLimit> {
    const RUN: usize = 2048;
    let limit = magnitude_limit(Some(values));
    let vb = values.value_bytes();
    for (j, run) in x.chunks(RUN).enumerate() {
        if !all_below(&One(run), limit) {
            return Err(OutOfLimit);
        }
        encode_plain(values, run, &mut out[j * RUN * vb..]);
    }
    Ok(())
}

/// Writes the values section of sparse entries given as f32 bits (finite; a value beyond f16 or
/// bf16 saturates as in [`write_plain`]), in order: the bytes of [`write_plain`] per value, or for int8 the scales (each
/// block's absmax) then the codes of [`int8_code`].
///
/// # Panics
/// When `out` is shorter than `values.section_len(bits.len())`.
pub fn encode_bits(values: Values, bits: &[u32], out: &mut [u8]) {
    match values {
        Values::F32 => {
            for (o, &b) in out.chunks_exact_mut(4).zip(bits) {
                o.copy_from_slice(&b.to_le_bytes());
            }
        }
        Values::F16 | Values::Bf16 => {
            let conv = |b: &[u32]| {
                let mut a = [0u32; LANES];
                a[..b.len()].copy_from_slice(b);
                let x = f32x8::from_bits(u32x8::new(a));
                if values == Values::F16 {
                    f16_bits_x8(x)
                } else {
                    bf16_bits_x8(x)
                }
            };
            let mut chunks = bits.chunks_exact(LANES);
            let mut outs = out[..2 * bits.len()].chunks_exact_mut(2 * LANES);
            for (c, o) in (&mut chunks).zip(&mut outs) {
                store_u16x8(conv(c), o);
            }
            let rest = chunks.remainder();
            if !rest.is_empty() {
                let mut tmp = [0u8; 2 * LANES];
                store_u16x8(conv(rest), &mut tmp);
                let o = outs.into_remainder();
                o.copy_from_slice(&tmp[..o.len()]);
            }
        }
        Values::Int8 { block } => {
            let block = block as usize;
            let s_len = bits.len().div_ceil(block) * 4;
            let (scales, codes) = out.split_at_mut(s_len);
            for ((s, c), b) in scales
                .chunks_exact_mut(4)
                .zip(codes.chunks_mut(block))
                .zip(bits.chunks(block))
            {
                let m = f32::from_bits(b.iter().fold(0, |a, &v| a.max(v & 0x7fff_ffff)));
                s.copy_from_slice(&m.to_le_bytes());
                let inv = crate::scalar::quant_inv(m, 127);
                for (o, &v) in c.iter_mut().zip(b) {
                    let q = crate::scalar::quant_code_inv(f32::from_bits(v), m, inv, 127, None);
                    *o = q as i8 as u8;
                }
            }
        }
    }
}

/// Index of the first value in a plain (f32, f16, bf16) section that is not finite.
pub fn first_bad_plain(values: Values, bytes: &[u8]) -> Option<usize> {
    let vb = values.value_bytes();
    const BLOCK: usize = 1024;
    for (b, block) in bytes.chunks(BLOCK * vb).enumerate() {
        let bad = match values {
            Values::F16 => any_all_ones_u16(block, 0x7c00),
            Values::Bf16 => any_all_ones_u16(block, 0x7f80),
            _ => any_all_ones_u32(block, 0x7f80_0000),
        };
        if bad {
            let j = block
                .chunks_exact(vb)
                .position(|c| read_plain(values, c).is_none())?;
            return Some(b * BLOCK + j);
        }
    }
    None
}

/// Whether some little-endian u16 of `bytes` has every bit of `mask` set.
fn any_all_ones_u16(bytes: &[u8], mask: u16) -> bool {
    // As `any_all_ones_u32`, sixteen lanes at a time.
    let m = u16x16::splat(mask);
    let mut hits = u16x16::splat(0);
    let mut chunks = bytes.chunks_exact(32);
    for c in &mut chunks {
        let mut a = [0u16; 16];
        for (x, b) in a.iter_mut().zip(c.chunks_exact(2)) {
            *x = u16::from_le_bytes([b[0], b[1]]);
        }
        hits |= (u16x16::new(a) & m).simd_eq(m);
    }
    let mut bad = hits.any();
    for c in chunks.remainder().chunks_exact(2) {
        bad |= u16::from_le_bytes([c[0], c[1]]) & mask == mask;
    }
    bad
}

/// Whether some little-endian u32 of `bytes` has every bit of `mask` set.
fn any_all_ones_u32(bytes: &[u8], mask: u32) -> bool {
    // Eight lanes at a time, the lane masks or-ed: one load, `and`, compare and `or` per four
    // values (the compiler's own vectorization of the scalar form shuffles bytes into lanes).
    let m = u32x8::splat(mask);
    let mut hits = u32x8::splat(0);
    let mut chunks = bytes.chunks_exact(32);
    for c in &mut chunks {
        let mut a = [0u32; LANES];
        for (x, b) in a.iter_mut().zip(c.chunks_exact(4)) {
            *x = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        hits |= (u32x8::new(a) & m).simd_eq(m);
    }
    let mut bad = hits.any();
    for c in chunks.remainder().chunks_exact(4) {
        bad |= u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & mask == mask;
    }
    bad
}

/// Decodes a validated plain section into `out` (one value per element; `out.len()` values):
/// overwriting (`weight = None`) or adding `weight * value`.
///
/// # Panics
/// When `bytes` holds fewer than `out.len()` values (a section that was not validated).
pub fn decode_plain(values: Values, bytes: &[u8], out: &mut [f32], weight: Option<f32>) {
    let vb = values.value_bytes();
    let bytes = &bytes[..out.len() * vb];
    match values {
        Values::F32 => match weight {
            None => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Some(w) => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o += w * f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        },
        Values::F16 | Values::Bf16 => {
            let conv = |h: u32x8| {
                if values == Values::F16 {
                    f16_to_f32_x8(h)
                } else {
                    bf16_to_f32_x8(h)
                }
            };
            let w8 = f32x8::splat(weight.unwrap_or(1.0));
            let mut outs = out.chunks_exact_mut(LANES);
            let mut ins = bytes.chunks_exact(2 * LANES);
            for (o, c) in (&mut outs).zip(&mut ins) {
                let v = conv(load_u16x8(c));
                let r = match weight {
                    None => v,
                    Some(_) => load(o) + w8 * v,
                };
                o.copy_from_slice(r.as_array());
            }
            let o = outs.into_remainder();
            if !o.is_empty() {
                let mut tmp = [0u8; 2 * LANES];
                let c = ins.remainder();
                tmp[..c.len()].copy_from_slice(c);
                let v = conv(load_u16x8(&tmp));
                let r = match weight {
                    None => v,
                    Some(_) => load_padded(o) + w8 * v,
                };
                let len = o.len();
                o.copy_from_slice(&r.as_array()[..len]);
            }
        }
        Values::Int8 { .. } => panic!("int8 is not a plain value type"),
    }
}

/// Reads a validated LEB128 varint from the start of `b`: its value and its length in bytes.
/// The frame parser checked every varint of a segment table, so this never runs past `b`.
pub fn read_varint(b: &[u8]) -> (u64, usize) {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return (v, i + 1);
        }
    }
    (v, b.len().min(10))
}

/// Sequential reader of a validated sparse values section of `count` values: plain values,
/// or int8 codes with their block scales, where a segmented top-k frame (FORMAT.md 3.2.1)
/// restarts the scale blocks at every segment. Reads in ascending order cost one pass over
/// the segment table in all; a read before the previous one starts the table again.
#[derive(Clone, Copy, Debug)]
pub struct ValueRuns<'a> {
    values: Values,
    section: &'a [u8],
    count: usize,
    table: &'a [u8],
    /// The rest of the table after the current segment.
    rest: &'a [u8],
    seg_start: usize,
    seg_end: usize,
    /// Scale index of the current segment's first block.
    seg_scale: usize,
    /// Scale blocks in the whole section (`section.len() - count` over 4).
    scales: usize,
}

impl<'a> ValueRuns<'a> {
    /// A reader of `section` (`count` values of codec `values`) with the segment table
    /// `table` (LEB128 kept counts; empty for a frame without segments).
    pub fn new(values: Values, section: &'a [u8], count: usize, table: &'a [u8]) -> Self {
        // Without a table the blocks follow from the count alone; with one, the parser sized
        // the section as the table's blocks and the codes.
        let scales = match values {
            Values::Int8 { block } if table.is_empty() => count.div_ceil(block.max(1) as usize),
            Values::Int8 { .. } => section.len().saturating_sub(count) / 4,
            _ => 0,
        };
        let mut r = ValueRuns {
            values,
            section,
            count,
            table,
            rest: table,
            seg_start: 0,
            seg_end: 0,
            seg_scale: 0,
            scales,
        };
        r.rewind();
        r
    }

    fn rewind(&mut self) {
        self.rest = self.table;
        self.seg_start = 0;
        self.seg_scale = 0;
        self.seg_end = if self.table.is_empty() { self.count } else { 0 };
        if !self.table.is_empty() {
            self.next_segment();
        }
    }

    fn next_segment(&mut self) {
        if let Values::Int8 { block } = self.values {
            let len = self.seg_end - self.seg_start;
            self.seg_scale += len.div_ceil(block as usize);
        }
        self.seg_start = self.seg_end;
        if self.rest.is_empty() {
            self.seg_end = self.count;
            return;
        }
        let (len, used) = read_varint(self.rest);
        self.rest = &self.rest[used..];
        self.seg_end = self.seg_start.saturating_add(len as usize).min(self.count);
    }

    /// Decodes values `first..first + out.len()` into `out` (`first + out.len() <= count`).
    pub fn read(&mut self, first: usize, out: &mut [f32]) {
        let Values::Int8 { block } = self.values else {
            let vb = self.values.value_bytes();
            decode_plain(self.values, &self.section[first * vb..], out, None);
            return;
        };
        let block = block as usize;
        if first < self.seg_start {
            self.rewind();
        }
        let s_len = 4 * self.scales;
        let codes = &self.section[s_len + first..s_len + first + out.len()];
        let mut j = first;
        let mut o = 0usize;
        while o < out.len() {
            while j >= self.seg_end && self.seg_end < self.count {
                self.next_segment();
            }
            let in_seg = j - self.seg_start;
            let b = self.seg_scale + in_seg / block;
            let block_end = self.seg_start + (in_seg / block + 1) * block;
            let end = block_end.min(self.seg_end).min(first + out.len()) - j;
            let s = &self.section[4 * b..4 * b + 4];
            let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            for (v, &c) in out[o..o + end].iter_mut().zip(&codes[o..o + end]) {
                *v = int8_value(c as i8, m);
            }
            o += end;
            j += end;
        }
    }
}

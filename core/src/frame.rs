//! The wire frame: header, sections and CRC-32 trailer (normative spec: `FORMAT.md`).
//!
//! Encoders write into a caller-supplied `&mut [u8]` of [`max_frame_len`] bytes with a scratch
//! slice of [`scratch_len`] words and return the bytes written. Decoders read and check the
//! whole frame (checksum, header, every length, every index and value) before writing any
//! output, then overwrite ([`decode_into`]) or add into ([`accumulate_into`]) a dense f32 slice
//! whose length must equal the frame's element count.

use crate::error::{Error, Param};
use crate::index::{self, IndexSizer, IndexWriter};
use crate::lanes::{One, Source, prefetch};
use crate::method::{K, Method, Params, Rounding, SignScale, Values};
use crate::scalar::{self, Selection, magnitude_key};
use crate::select::{Kept, OutOfLimit};
use crate::{quant, randomk, rng, select, sign, values};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GWRF";
/// The frame format version this crate writes and reads.
pub const FORMAT_VERSION: u8 = 1;

const FIXED_LEN: usize = 16;
const CRC_LEN: usize = 4;

const M_DENSE: u8 = 0;
const M_TOPK: u8 = 1;
const M_THRESHOLD: u8 = 2;
const M_RANDOMK: u8 = 3;
const M_QUANT: u8 = 4;
const M_SIGN: u8 = 5;

const FLAG_UNBIASED: u8 = 1;

const fn values_spec_len(v: Values) -> usize {
    match v {
        Values::Int8 { .. } => 5,
        _ => 1,
    }
}

const fn params_len(method: &Method) -> usize {
    match *method {
        Method::Dense { values } => values_spec_len(values),
        Method::TopK { values, .. } => values_spec_len(values) + 8 + 1,
        Method::Threshold { values, .. } => values_spec_len(values) + 4 + 8 + 1,
        Method::RandomK { values, .. } => values_spec_len(values) + 8 + 8 + 8 + 8,
        Method::Quant { .. } => 1 + 1 + 4,
        Method::Sign { scale } => match scale {
            SignScale::MeanAbs { .. } => 5,
            SignScale::None => 1,
        },
    }
}

const fn int8_blocks(count: usize, v: Values) -> usize {
    match v {
        Values::Int8 { block } => count.div_ceil(block_or_one(block)),
        _ => 0,
    }
}

const fn block_or_one(b: u32) -> usize {
    if b == 0 { 1 } else { b as usize }
}

/// The largest frame [`encode_into`] can write for `n` elements with `method`, in bytes.
/// Saturates at `usize::MAX` instead of overflowing.
pub const fn max_frame_len(n: usize, method: &Method) -> usize {
    let body = match *method {
        Method::Dense { values } => n.saturating_mul(values.value_bytes()),
        Method::TopK { k, values } => {
            let k = k.resolve(n as u64) as usize;
            let raw = k.saturating_mul(index::raw_width(n as u64));
            let bitmap = n.div_ceil(8);
            let idx = if raw < bitmap { raw } else { bitmap };
            idx.saturating_add(values.section_len(k))
        }
        Method::Threshold { values, .. } => n.div_ceil(8).saturating_add(values.section_len(n)),
        Method::RandomK { k, values, .. } => values.section_len(k.resolve(n as u64) as usize),
        Method::Quant { bits, block, .. } => {
            quant::scales_len(n, block_or_one(block)).saturating_add(quant::codes_len(n, bits))
        }
        Method::Sign { scale } => {
            let s = match scale {
                SignScale::MeanAbs { block } => sign::scales_len(n, Some(block_or_one(block))),
                SignScale::None => 0,
            };
            s.saturating_add(sign::bits_len(n))
        }
    };
    body.saturating_add(FIXED_LEN + params_len(method) + CRC_LEN)
}

/// Scratch `u32` words that [`encode_into`] needs for `n` elements with `method`.
///
/// Top-k holds its candidates ([`select::kept_scratch_len`]), threshold the entries that pass
/// ([`select::threshold_scratch_len`]; more go a slower two-pass way), random-k its drawn
/// indices; int8 values add one word per block of kept values. Top-k's part starts with a
/// fixed radix histogram of 2,048 words (8 KiB), whatever `n` and `k`: even `n = 1` needs
/// 2,050 words. On a small stack, size a `static` or a `const` array with this function (it
/// is a `const fn`), as the crate docs' example does.
///
/// `out` must be [`max_frame_len`] bytes even when the frame written is shorter: the encoders
/// check the worst case before they start.
pub const fn scratch_len(n: usize, method: &Method) -> usize {
    match *method {
        Method::TopK { k, values } => {
            let k = k.resolve(n as u64) as usize;
            select::kept_scratch_len(n, k).saturating_add(int8_blocks(k, values))
        }
        Method::Threshold { values, .. } => {
            select::threshold_scratch_len(n).saturating_add(int8_blocks(n, values))
        }
        Method::RandomK { k, values, .. } => {
            let k = k.resolve(n as u64) as usize;
            k.saturating_add(int8_blocks(k, values))
        }
        _ => 0,
    }
}

/// Checks everything about an encode that does not depend on the gradient's values.
pub(crate) fn check_encode(
    n: usize,
    params: &Params,
    scratch: usize,
    out: usize,
) -> Result<(), Error> {
    params.method.validate()?;
    let need = scratch_len(n, &params.method);
    if scratch < need {
        return Err(Error::ScratchTooSmall {
            needed: need,
            got: scratch,
        });
    }
    let need = max_frame_len(n, &params.method);
    if out < need {
        return Err(Error::BufferTooSmall {
            needed: need,
            got: out,
        });
    }
    Ok(())
}

/// Checks the values an encode will read: finite, and within the value type's range.
pub(crate) fn check_input(x: &[f32], method: &Method) -> Result<(), Error> {
    if values::first_at_or_above(x, values::magnitude_limit(method.values())).is_none() {
        return Ok(());
    }
    if let Some(index) = scalar::first_non_finite(x) {
        return Err(Error::NonFinite { index });
    }
    if let Some(v) = method.values()
        && let Some(index) = values::first_out_of_range(v, x)
    {
        return Err(Error::ValueOutOfRange { index });
    }
    Ok(())
}

/// Runs an encoder and, when it fails, clears the magic of `out` (its first four bytes, or as
/// many as it has), so that `out` holds no valid frame: neither the part of one that the
/// kernels wrote before they met a bad element, nor a frame of an earlier call that a caller
/// might send by mistake.
pub(crate) fn no_frame_on_error(
    out: &mut [u8],
    encode: impl FnOnce(&mut [u8]) -> Result<usize, Error>,
) -> Result<usize, Error> {
    let result = encode(out);
    if result.is_err() {
        let m = out.len().min(MAGIC.len());
        out[..m].fill(0);
    }
    result
}

/// Encodes `grad` (n elements) with `params` into `out` and returns the frame length in bytes.
///
/// `scratch` must hold [`scratch_len`]`(n, &params.method)` words and `out`
/// [`max_frame_len`]`(n, &params.method)` bytes. The input checks run inside the kernels (one
/// pass over the input). On error `out` holds no valid frame: its first four bytes (the magic)
/// are cleared, so neither part of this frame nor one left there by an earlier call decodes;
/// the rest is unspecified.
///
/// # Errors
/// [`Error::InvalidParams`], [`Error::ScratchTooSmall`], [`Error::BufferTooSmall`];
/// [`Error::NonFinite`] naming the first NaN/Inf element; [`Error::ValueOutOfRange`] when, with
/// f16 or bf16 values, an element is beyond the type's range, or when, with unbiased random-k, a
/// kept value times n/k would decode to ±inf (FORMAT.md 3.4).
///
/// # Panics
/// Never.
pub fn encode_into(
    grad: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    crate::frame::no_frame_on_error(out, |out| encode_frame(grad, params, scratch, out))
}

fn encode_frame(
    grad: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    check_encode(grad.len(), params, scratch.len(), out.len())?;
    let limit = values::magnitude_limit(params.method.values());
    let fused = if is_fused(grad.len(), &params.method) {
        encode_src(&One(grad), params, limit, scratch, out)
    } else if let Method::Dense { values } = params.method {
        encode_dense(grad, values, out)
    } else {
        // Random-k and the scalar quantization and sign paths: check, then encode.
        check_input(grad, &params.method)?;
        let len = encode_checked(grad, params, scratch, out);
        return check_unbiased_written(out, len, None);
    };
    match fused {
        Ok(len) => Ok(len),
        Err(OutOfLimit) => {
            // The kernel met a bad element: name the first one in the specified order.
            check_input(grad, &params.method)?;
            Ok(encode_checked(grad, params, scratch, out))
        }
    }
}

/// Unbiased random-k: the decoder multiplies every value by n/k, so a frame whose product
/// overflows would decode to ±inf. Refuses it with [`Error::ValueOutOfRange`] naming the
/// element (`index_of(j)`: the tensor index of kept entry `j`, `None` to draw it again), and
/// breaks the frame's checksum so that `out` holds no valid frame.
fn check_unbiased_written(
    out: &mut [u8],
    len: usize,
    index_of: Option<&[u32]>,
) -> Result<usize, Error> {
    let Ok((h, body)) = parse_trusted(&out[..len]) else {
        return Ok(len);
    };
    let Some(j) = first_unbiased_overflow(&h, &body) else {
        return Ok(len);
    };
    let index = match index_of.and_then(|idx| idx.get(j)) {
        Some(&i) => u64::from(i),
        None => {
            let p = &h.params;
            let (mut c, mut index) = (0usize, 0u64);
            randomk::for_each(h.n, h.kept, rng::key(p.seed, p.step, p.tensor_id), |i| {
                if c == j {
                    index = i;
                }
                c += 1;
            });
            index
        }
    };
    for b in &mut out[len - 4..len] {
        *b = !*b;
    }
    Err(Error::ValueOutOfRange {
        index: usize::try_from(index).unwrap_or(usize::MAX),
    })
}

/// The scale unbiased random-k applies to every decoded value: n/k (`None` for every other
/// method and for k = 0).
fn unbiased_scale(h: &Header, count: u64) -> Option<f32> {
    match h.params.method {
        Method::RandomK { unbiased: true, .. } if count > 0 => {
            Some((h.n as f64 / count as f64) as f32)
        }
        _ => None,
    }
}

/// The first entry of an unbiased random-k body whose decoded value times n/k is not finite.
fn first_unbiased_overflow(h: &Header, body: &Body<'_>) -> Option<usize> {
    let Body::Sparse { v, count, vals, .. } = *body else {
        return None;
    };
    let scale = unbiased_scale(h, count)?;
    let total = count as usize;
    let mut buf = [0.0f32; index::BATCH];
    let mut j = 0usize;
    while j < total {
        let m = (total - j).min(index::BATCH);
        values::decode_run(v, vals, total, j, &mut buf[..m]);
        if let Some(p) = buf[..m].iter().position(|&x| !(x * scale).is_finite()) {
            return Some(j + p);
        }
        j += m;
    }
    None
}

/// Whether [`encode_src`] encodes this method, checking the input in the same pass: top-k and
/// threshold (lengths that fit a `u32`), and the SIMD quantization and sign kernels.
pub(crate) fn is_fused(n: usize, method: &Method) -> bool {
    match *method {
        Method::TopK { .. } | Method::Threshold { .. } => u32::try_from(n).is_ok(),
        Method::Quant {
            bits,
            block,
            rounding,
        } => quant::is_fast(bits, block as usize, rounding),
        Method::Sign { scale } => sign::is_fast(sign_block(scale)),
        _ => false,
    }
}

/// Whether [`encode_sparse_src`] encodes this method (top-k and threshold, `u32` lengths).
fn is_sparse_fused(n: usize, method: &Method) -> bool {
    matches!(method, Method::TopK { .. } | Method::Threshold { .. }) && u32::try_from(n).is_ok()
}

const fn sign_block(scale: SignScale) -> Option<usize> {
    match scale {
        SignScale::MeanAbs { block } => Some(block as usize),
        SignScale::None => None,
    }
}

/// A frame of `src` for a method where [`is_fused`] holds (after [`check_encode`]), checking
/// on the way that every `|x| < limit`. On error `out` holds no valid frame.
pub(crate) fn encode_src<S: Source>(
    src: &S,
    params: &Params,
    limit: f32,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, OutOfLimit> {
    let n = src.len();
    let mut p = Put { buf: out, pos: 0 };
    match params.method {
        Method::TopK { .. } | Method::Threshold { .. } => {
            encode_sparse_src(src, params, limit, scratch, p.buf)
        }
        Method::Quant {
            bits,
            block,
            rounding,
        } => {
            write_fixed(&mut p, M_QUANT, 0, n);
            quant_params(&mut p, bits, rounding, block);
            let block = block as usize;
            let s_len = quant::scales_len(n, block);
            let c_len = quant::codes_len(n, bits);
            let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
            let mut body = crc32fast::Hasher::new();
            quant::encode_fast(src, bits, block, scales, &mut rest[..c_len], |c| {
                body.update(c)
            })?;
            p.pos += s_len;
            Ok(finish_with(p, body, c_len))
        }
        Method::Sign { scale } => {
            write_fixed(&mut p, M_SIGN, 0, n);
            let block = sign_params(&mut p, scale);
            let s_len = sign::scales_len(n, block);
            let b_len = sign::bits_len(n);
            let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
            let mut body = crc32fast::Hasher::new();
            sign::encode_fast(src, block, scales, &mut rest[..b_len], |c| body.update(c))?;
            p.pos += s_len;
            Ok(finish_with(p, body, b_len))
        }
        _ => unreachable!("only fused methods"),
    }
}

/// Ends a frame whose last `tail` bytes (after `p.pos`) are already folded into `body`: the
/// CRC-32 of everything before `p.pos`, combined with `body`, as the trailer. Returns the frame
/// length.
fn finish_with(mut p: Put<'_>, body: crc32fast::Hasher, tail: usize) -> usize {
    let mut crc = crc32fast::Hasher::new();
    crc.update(&p.buf[..p.pos]);
    crc.combine(&body);
    p.pos += tail;
    p.u32(crc.finalize());
    p.pos
}

/// A dense frame, checking each run of the input before writing it.
fn encode_dense(g: &[f32], values: Values, out: &mut [u8]) -> Result<usize, OutOfLimit> {
    let n = g.len();
    let mut p = Put { buf: out, pos: 0 };
    write_fixed(&mut p, M_DENSE, 0, n);
    p.values(values);
    values::try_encode_plain(values, g, &mut p.buf[p.pos..])?;
    p.pos += n * values.value_bytes();
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    Ok(p.pos)
}

fn quant_params(p: &mut Put<'_>, bits: u8, rounding: Rounding, block: u32) {
    p.u8(bits);
    p.u8(match rounding {
        Rounding::NearestEven => 0,
        Rounding::Stochastic => 1,
    });
    p.u32(block);
}

fn sign_params(p: &mut Put<'_>, scale: SignScale) -> Option<usize> {
    match scale {
        SignScale::MeanAbs { block } => {
            p.u8(1);
            p.u32(block);
        }
        SignScale::None => p.u8(0),
    }
    sign_block(scale)
}

/// Encodes the entries of `grad` at the strictly ascending indices `kept` as a top-k frame with
/// `k = kept.len()` and value codec `values` (for example per-tensor top-k over a bucket of
/// fused tensors). Decode it with `Method::TopK { k: K::Count(kept.len() as u64), values }`.
///
/// `scratch` and `out` are sized by [`scratch_len`] and [`max_frame_len`] for that method. As
/// for [`encode_into`], on error `out` holds no valid frame (its magic is cleared).
///
/// # Errors
/// [`Error::UnsortedIndices`] when `kept` is not strictly ascending or holds an index `>= n`;
/// otherwise as [`encode_into`].
///
/// # Panics
/// Never.
pub fn encode_selected_into(
    grad: &[f32],
    kept: &[u32],
    values: Values,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    crate::frame::no_frame_on_error(out, |out| encode_selected(grad, kept, values, scratch, out))
}

fn encode_selected(
    grad: &[f32],
    kept: &[u32],
    values: Values,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    let params = Params::new(Method::TopK {
        k: K::Count(kept.len() as u64),
        values,
    });
    check_encode(grad.len(), &params, scratch.len(), out.len())?;
    check_input(grad, &params.method)?;
    let mut next_min = 0usize;
    for (position, &i) in kept.iter().enumerate() {
        let i = i as usize;
        if i < next_min || i >= grad.len() {
            return Err(Error::UnsortedIndices { position });
        }
        next_min = i + 1;
    }
    let n = grad.len();
    let mut p = Put { buf: out, pos: 0 };
    write_fixed(&mut p, M_TOPK, 0, n);
    p.values(values);
    let sel = select::kept_scratch_len(n, kept.len());
    let int8_scratch = &mut scratch[sel..];
    let e = Picked { g: grad, idx: kept };
    let (count, codec, idx_len) = measure(n, &e, values, int8_scratch);
    p.u64(count);
    p.u8(codec);
    write_sparse_body(
        n,
        &e,
        values,
        count as usize,
        codec,
        idx_len,
        &mut p,
        int8_scratch,
    );
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    Ok(p.pos)
}

/// Encodes a top-k, threshold or random-k frame of an `n`-element tensor from its kept entries
/// alone: `kept.idx` (strictly ascending, `< n`) and the f32 bits of their values `kept.bits`,
/// as the chunked selection of [`crate::select`] produces them ([`crate::select::candidates`],
/// [`crate::select::topk_of_candidates`]) or, for random-k, the indices [`crate::randomk`]
/// draws for the frame's (seed, step, tensor id). The bytes are those [`encode_into`] writes
/// for a tensor whose selection keeps exactly these entries; `out` holds at least
/// [`max_frame_len`]`(n, &params.method)` bytes. Returns the frame length.
///
/// The tensor itself is not read, so whether these are its top-k, all its entries above the
/// threshold, or random-k's draw (whose indices the frame does not carry: the receiver draws
/// them again) is the caller's to ensure; checked here is everything the frame's own validity
/// needs: the count (`k` resolved for `n`, for top-k and random-k), the indices, each value
/// above the threshold (threshold), finite and within the value type's range, and for unbiased
/// random-k each value times n/k finite once decoded.
///
/// # Errors
/// [`Error::InvalidParams`] for another method or invalid parameters, and with
/// [`Param::K`] when a top-k or random-k list does not hold `k` entries, with
/// [`Param::Threshold`] when a threshold entry is not above the threshold;
/// [`Error::BufferTooSmall`]; [`Error::TooLarge`] when `n` exceeds `u32::MAX`;
/// [`Error::LengthMismatch`] when `idx` and `bits` differ in length;
/// [`Error::UnsortedIndices`]; [`Error::NonFinite`] and [`Error::ValueOutOfRange`] naming the
/// tensor index of a bad value (unbiased random-k: also of a value whose n/k multiple
/// overflows). On error `out` holds no valid frame (its magic is cleared, as for
/// [`encode_into`]).
///
/// # Panics
/// Never.
pub fn encode_kept_into(
    n: usize,
    params: &Params,
    kept: Kept<'_>,
    out: &mut [u8],
) -> Result<usize, Error> {
    crate::frame::no_frame_on_error(out, |out| encode_kept(n, params, kept, out))
}

fn encode_kept(n: usize, params: &Params, kept: Kept<'_>, out: &mut [u8]) -> Result<usize, Error> {
    params.method.validate()?;
    let need = max_frame_len(n, &params.method);
    if out.len() < need {
        return Err(Error::BufferTooSmall {
            needed: need,
            got: out.len(),
        });
    }
    if u32::try_from(n).is_err() {
        return Err(Error::TooLarge { n: n as u64 });
    }
    if kept.idx.len() != kept.bits.len() {
        return Err(Error::LengthMismatch {
            expected: kept.idx.len(),
            got: kept.bits.len(),
        });
    }
    let (values, above) = match params.method {
        Method::TopK { k, values } => {
            if k.resolve(n as u64) != kept.idx.len() as u64 {
                return Err(Error::InvalidParams { param: Param::K });
            }
            (values, None)
        }
        Method::Threshold { threshold, values } => (values, Some(threshold)),
        Method::RandomK { k, values, .. } => {
            if k.resolve(n as u64) != kept.idx.len() as u64 {
                return Err(Error::InvalidParams { param: Param::K });
            }
            (values, None)
        }
        _ => {
            return Err(Error::InvalidParams {
                param: Param::Method,
            });
        }
    };
    let limit = values::magnitude_limit(Some(values));
    let mut next_min = 0usize;
    for (position, (&i, &b)) in kept.idx.iter().zip(kept.bits).enumerate() {
        let index = i as usize;
        if index < next_min || index >= n {
            return Err(Error::UnsortedIndices { position });
        }
        next_min = index + 1;
        let x = f32::from_bits(b);
        if !x.is_finite() {
            return Err(Error::NonFinite { index });
        }
        if x.abs() >= limit {
            return Err(Error::ValueOutOfRange { index });
        }
        if above.is_some_and(|t| magnitude_key(x) <= magnitude_key(t)) {
            return Err(Error::InvalidParams {
                param: Param::Threshold,
            });
        }
    }
    let mut p = Put { buf: out, pos: 0 };
    write_method(&mut p, &params.method, n);
    let unbiased = match params.method {
        Method::RandomK { unbiased, .. } => {
            p.randomk_params(values, kept.idx.len() as u64, params);
            let v_len = values.section_len(kept.bits.len());
            values::encode_bits(values, kept.bits, &mut p.buf[p.pos..p.pos + v_len]);
            p.pos += v_len;
            unbiased
        }
        _ => {
            p.values(values);
            if let Some(t) = above {
                p.bytes(&t.to_le_bytes());
            }
            kept_body(n, &kept, values, &mut p);
            false
        }
    };
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    let len = p.pos;
    if unbiased {
        return check_unbiased_written(out, len, Some(kept.idx));
    }
    Ok(len)
}

/// The fixed header with the method id and flags of `method`.
fn write_method(p: &mut Put<'_>, method: &Method, n: usize) {
    let (id, flags) = match *method {
        Method::Dense { .. } => (M_DENSE, 0),
        Method::TopK { .. } => (M_TOPK, 0),
        Method::Threshold { .. } => (M_THRESHOLD, 0),
        Method::RandomK { unbiased, .. } => (M_RANDOMK, if unbiased { FLAG_UNBIASED } else { 0 }),
        Method::Quant { .. } => (M_QUANT, 0),
        Method::Sign { .. } => (M_SIGN, 0),
    };
    write_fixed(p, id, flags, n);
}

fn write_fixed(p: &mut Put<'_>, id: u8, flags: u8, n: usize) {
    p.bytes(&MAGIC);
    p.u8(FORMAT_VERSION);
    p.u8(id);
    p.u8(flags);
    p.u8(0);
    p.u64(n as u64);
}

/// Little-endian cursor over the output.
struct Put<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Put<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }
    fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn values(&mut self, v: Values) {
        self.u8(values::id(v));
        if let Values::Int8 { block } = v {
            self.u32(block);
        }
    }
    /// Random-k's parameters (FORMAT.md 3.4): value codec, k, seed, step and tensor id.
    fn randomk_params(&mut self, v: Values, k: u64, params: &Params) {
        self.values(v);
        self.u64(k);
        self.u64(params.seed);
        self.u64(params.step);
        self.u64(params.tensor_id);
    }
}

/// Encodes after [`check_encode`] and [`check_input`] succeeded; cannot fail.
pub(crate) fn encode_checked(
    g: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    let n = g.len();
    let mut p = Put { buf: out, pos: 0 };
    write_method(&mut p, &params.method, n);
    match params.method {
        Method::Dense { values } => {
            p.values(values);
            let vb = values.value_bytes();
            values::encode_plain(values, g, &mut p.buf[p.pos..]);
            p.pos += n * vb;
        }
        Method::TopK { .. } | Method::Threshold { .. } => {
            if is_sparse_fused(n, &params.method) {
                // The input is checked: the limit cannot be met.
                if let Ok(len) = encode_sparse_src(&One(g), params, f32::INFINITY, scratch, out) {
                    return len;
                }
            }
            return encode_sparse_streamed(g, params, scratch, out);
        }
        Method::RandomK { k, values, .. } => {
            let k = k.resolve(n as u64);
            p.randomk_params(values, k, params);
            let key = rng::key(params.seed, params.step, params.tensor_id);
            let (idx_s, int8_s) = scratch.split_at_mut(k as usize);
            if u32::try_from(n).is_ok() {
                let mut c = 0usize;
                randomk::for_each(n as u64, k, key, |i| {
                    idx_s[c] = i as u32;
                    c += 1;
                });
                let e = Picked { g, idx: idx_s };
                write_values(&e, values, k as usize, &mut p, int8_s);
            } else {
                let e = Streamed {
                    g,
                    sel: Selection::RandomK { key, k },
                };
                write_values(&e, values, k as usize, &mut p, int8_s);
            }
        }
        Method::Quant {
            bits,
            block,
            rounding,
        } => {
            quant_params(&mut p, bits, rounding, block);
            let block = block as usize;
            let s_len = quant::scales_len(n, block);
            let c_len = quant::codes_len(n, bits);
            let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
            let stochastic = match rounding {
                Rounding::Stochastic => Some((params.seed, params.step, params.tensor_id)),
                Rounding::NearestEven => None,
            };
            quant::encode(g, bits, block, stochastic, scales, &mut rest[..c_len]);
            p.pos += s_len + c_len;
        }
        Method::Sign { scale } => {
            let block = sign_params(&mut p, scale);
            let s_len = sign::scales_len(n, block);
            let b_len = sign::bits_len(n);
            let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
            sign::encode(g, block, scales, &mut rest[..b_len]);
            p.pos += s_len + b_len;
        }
    }
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    p.pos
}

/// The entries a sparse body carries, in ascending index order.
trait Entries {
    /// Calls `f(index, value)` for every entry.
    fn each(&self, f: impl FnMut(usize, f32));
}

impl Entries for Kept<'_> {
    #[inline]
    fn each(&self, mut f: impl FnMut(usize, f32)) {
        for (&i, &b) in self.idx.iter().zip(self.bits) {
            f(i as usize, f32::from_bits(b));
        }
    }
}

/// Entries at caller-chosen indices.
struct Picked<'a> {
    g: &'a [f32],
    idx: &'a [u32],
}

impl Entries for Picked<'_> {
    #[inline]
    fn each(&self, mut f: impl FnMut(usize, f32)) {
        for &i in self.idx {
            f(i as usize, self.g[i as usize]);
        }
    }
}

/// Entries of a selection, found again on every call (the slow path).
struct Streamed<'a> {
    g: &'a [f32],
    sel: Selection,
}

impl Entries for Streamed<'_> {
    fn each(&self, mut f: impl FnMut(usize, f32)) {
        select::for_each_kept(self.g, self.sel, |i| f(i, self.g[i]));
    }
}

/// Threshold entries of any source, found again on every call (when too many pass).
struct ThresholdOf<'a, S> {
    src: &'a S,
    t: f32,
}

impl<S: Source> Entries for ThresholdOf<'_, S> {
    fn each(&self, mut f: impl FnMut(usize, f32)) {
        for i in 0..self.src.len() {
            let x = self.src.at(i);
            if x.abs() > self.t {
                f(i, x);
            }
        }
    }
}

/// Top-k or threshold frame of `src` (length fits a `u32`; after [`check_encode`]), checking
/// on the way that every `|x| < limit`: one pass over the input for the selection and the
/// check, then work proportional to the entries kept.
pub(crate) fn encode_sparse_src<S: Source>(
    src: &S,
    params: &Params,
    limit: f32,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, OutOfLimit> {
    let n = src.len();
    // Select (and check) before writing: on error nothing is written.
    let mut p;
    match params.method {
        Method::TopK { k, values } => {
            let k = k.resolve(n as u64) as usize;
            // `feedback_step` reads the kept indices back from here (`select::topk_kept_idx`).
            let sel = &mut scratch[..select::kept_scratch_len(n, k)];
            let kept = select::topk_kept_src(src, k, limit, select::sample_len(n), sel)?;
            return Ok(topk_frame(n, &kept, values, out));
        }
        Method::Threshold { threshold, values } => {
            let (sel, int8_scratch) = scratch.split_at_mut(select::threshold_scratch_len(n));
            let kept = select::threshold_kept_src(src, threshold, limit, sel)?;
            p = Put { buf: out, pos: 0 };
            write_fixed(&mut p, M_THRESHOLD, 0, n);
            p.values(values);
            p.bytes(&threshold.to_le_bytes());
            match kept {
                Some(kept) => kept_body(n, &kept, values, &mut p),
                None => {
                    let e = ThresholdOf { src, t: threshold };
                    sparse_body(n, &e, values, &mut p, int8_scratch)
                }
            }
        }
        _ => unreachable!("only top-k and threshold are fused"),
    }
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    Ok(p.pos)
}

/// The top-k frame of a tensor of `n` elements whose kept entries are `kept` (`out` sized by
/// [`check_encode`]). Returns the frame length.
pub(crate) fn topk_frame(n: usize, kept: &Kept<'_>, values: Values, out: &mut [u8]) -> usize {
    let mut p = Put { buf: out, pos: 0 };
    write_fixed(&mut p, M_TOPK, 0, n);
    p.values(values);
    kept_body(n, kept, values, &mut p);
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    p.pos
}

/// Top-k or threshold frame by the streaming specification (tensors beyond `u32` indices).
fn encode_sparse_streamed(
    g: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    let n = g.len();
    let mut p = Put { buf: out, pos: 0 };
    match params.method {
        Method::TopK { k, values } => {
            write_fixed(&mut p, M_TOPK, 0, n);
            p.values(values);
            let k = k.resolve(n as u64) as usize;
            let (sel, int8_scratch) = scratch.split_at_mut(select::kept_scratch_len(n, k));
            let e = Streamed {
                g,
                sel: select::topk(g, k, sel),
            };
            sparse_body(n, &e, values, &mut p, int8_scratch);
        }
        Method::Threshold { threshold, values } => {
            write_fixed(&mut p, M_THRESHOLD, 0, n);
            p.values(values);
            p.bytes(&threshold.to_le_bytes());
            let int8_scratch = &mut scratch[select::threshold_scratch_len(n)..];
            let e = Streamed {
                g,
                sel: Selection::Threshold(threshold),
            };
            sparse_body(n, &e, values, &mut p, int8_scratch);
        }
        _ => unreachable!("only top-k and threshold are streamed"),
    }
    let crc = crc32fast::hash(&p.buf[..p.pos]);
    p.u32(crc);
    p.pos
}

/// Count and codec, then index and values sections, of a list of kept entries: the bytes of
/// [`sparse_body`], written section by section from the slices (no per-entry dispatch).
fn kept_body(n: usize, kept: &Kept<'_>, v: Values, p: &mut Put<'_>) {
    let count = kept.idx.len();
    let (codec, idx_len) = index::choose_for(n as u64, kept.idx);
    p.u64(count as u64);
    p.u8(codec);
    let v_len = v.section_len(count);
    let (idx, rest) = p.buf[p.pos..].split_at_mut(idx_len);
    index::write_u32(codec, n as u64, kept.idx, idx);
    values::encode_bits(v, kept.bits, &mut rest[..v_len]);
    p.pos += idx_len + v_len;
}

/// Count and codec, then index and values sections.
fn sparse_body<E: Entries>(n: usize, e: &E, v: Values, p: &mut Put<'_>, int8_scratch: &mut [u32]) {
    let (count, codec, idx_len) = measure(n, e, v, int8_scratch);
    p.u64(count);
    p.u8(codec);
    write_sparse_body(n, e, v, count as usize, codec, idx_len, p, int8_scratch);
}

/// First pass: the kept count, the smallest index codec and, for int8, each block's absmax
/// magnitude key (into `int8_scratch`).
fn measure<E: Entries>(n: usize, e: &E, v: Values, int8_scratch: &mut [u32]) -> (u64, u8, usize) {
    let mut sizer = IndexSizer::new(n as u64);
    e.each(|i, _| sizer.push(i as u64));
    if let Values::Int8 { block } = v {
        int8_absmax(e, block as usize, int8_scratch);
    }
    let count = sizer.count();
    let (codec, len) = sizer.choose();
    (count, codec, len)
}

/// Each int8 block's absmax magnitude key, for blocks of `block` consecutive entries.
fn int8_absmax<E: Entries>(e: &E, block: usize, scratch: &mut [u32]) {
    let mut c = 0usize;
    let mut b = 0usize;
    let mut m = 0u32;
    e.each(|_, x| {
        m = m.max(magnitude_key(x));
        c += 1;
        if c == block {
            scratch[b] = m;
            b += 1;
            c = 0;
            m = 0;
        }
    });
    if c > 0 {
        scratch[b] = m;
    }
}

#[allow(clippy::too_many_arguments)]
fn write_sparse_body<E: Entries>(
    n: usize,
    e: &E,
    v: Values,
    count: usize,
    codec: u8,
    idx_len: usize,
    p: &mut Put<'_>,
    int8_scratch: &[u32],
) {
    let v_len = v.section_len(count);
    let (idx, rest) = p.buf[p.pos..].split_at_mut(idx_len);
    let vals = &mut rest[..v_len];
    let mut iw = IndexWriter::new(codec, n as u64, idx);
    let mut vw = ValueWriter::new(v, count, vals, int8_scratch);
    e.each(|i, x| {
        iw.push(i as u64);
        vw.push(x);
    });
    iw.finish();
    p.pos += idx_len + v_len;
}

/// Random-k body: values only.
fn write_values<E: Entries>(e: &E, v: Values, k: usize, p: &mut Put<'_>, scratch: &mut [u32]) {
    if let Values::Int8 { block } = v {
        int8_absmax(e, block as usize, scratch);
    }
    let v_len = v.section_len(k);
    let mut vw = ValueWriter::new(v, k, &mut p.buf[p.pos..p.pos + v_len], scratch);
    e.each(|_, x| vw.push(x));
    p.pos += v_len;
}

/// Writes kept values in order; int8 scales come first, from the absmax keys of the first pass.
struct ValueWriter<'a> {
    v: Values,
    out: &'a mut [u8],
    codes_at: usize,
    absmax: &'a [u32],
    j: usize,
    /// The int8 block of value `j`, and the values left in it (0: `j` opens the next block,
    /// whose absmax and reciprocal are then cached in `m` and `inv`).
    block_at: usize,
    left: usize,
    m: f32,
    inv: f32,
}

impl<'a> ValueWriter<'a> {
    fn new(v: Values, count: usize, out: &'a mut [u8], absmax: &'a [u32]) -> Self {
        let codes_at = match v {
            Values::Int8 { block } => {
                let blocks = count.div_ceil(block as usize);
                for b in 0..blocks {
                    out[4 * b..4 * b + 4].copy_from_slice(&absmax[b].to_le_bytes());
                }
                4 * blocks
            }
            _ => 0,
        };
        ValueWriter {
            v,
            out,
            codes_at,
            absmax,
            j: 0,
            block_at: 0,
            left: 0,
            m: 0.0,
            inv: 0.0,
        }
    }

    #[inline]
    fn push(&mut self, x: f32) {
        match self.v {
            Values::Int8 { block } => {
                if self.left == 0 {
                    // No division per value: blocks are counted down.
                    self.m = f32::from_bits(self.absmax[self.block_at]);
                    self.inv = scalar::quant_inv(self.m, 127);
                    self.block_at += 1;
                    self.left = block as usize;
                }
                self.left -= 1;
                let q = scalar::quant_code_inv(x, self.m, self.inv, 127, None);
                self.out[self.codes_at + self.j] = q as i8 as u8;
            }
            v => values::write_plain(v, x, &mut self.out[self.j * v.value_bytes()..]),
        }
        self.j += 1;
    }
}

/// What a frame declares, read by [`peek`] without decoding the body.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Header {
    /// Format version.
    pub version: u8,
    /// Element count of the tensor.
    pub n: u64,
    /// Method and parameters; `k` is always a [`K::Count`]; seed, step and tensor id are those
    /// of the frame for random-k and 0 otherwise.
    pub params: Params,
    /// Entries carried: the kept count for sparse methods, `n` for dense ones.
    pub kept: u64,
    /// Total frame length in bytes, trailer included.
    pub frame_len: usize,
}

/// What a successful decode wrote.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FrameInfo {
    /// Element count.
    pub n: u64,
    /// Entries carried (kept count for sparse methods, `n` for dense ones).
    pub kept: u64,
    /// The frame's method, `k` as a count.
    pub method: Method,
}

/// Sections of a parsed frame, each with its byte offset.
pub(crate) enum Body<'a> {
    Dense {
        v: Values,
        vals: &'a [u8],
        off: usize,
    },
    Sparse {
        v: Values,
        count: u64,
        codec: Option<u8>,
        idx: &'a [u8],
        idx_off: usize,
        vals: &'a [u8],
        vals_off: usize,
    },
    Quant {
        bits: u8,
        block: usize,
        scales: &'a [u8],
        codes: &'a [u8],
        off: usize,
    },
    Sign {
        block: Option<usize>,
        scales: &'a [u8],
        signs: &'a [u8],
        off: usize,
    },
}

/// Checked little-endian reader over the header.
struct Get<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Get<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(len).ok_or(Error::Truncated {
            needed: usize::MAX,
            got: self.buf.len(),
        })?;
        let s = self.buf.get(self.pos..end).ok_or(Error::Truncated {
            needed: end + CRC_LEN,
            got: self.buf.len() + CRC_LEN,
        })?;
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, Error> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, Error> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn values(&mut self) -> Result<Values, Error> {
        let at = self.pos;
        Ok(match self.u8()? {
            0 => Values::F32,
            1 => Values::F16,
            2 => Values::Bf16,
            3 => {
                let block = self.u32()?;
                if block == 0 {
                    return Err(Error::Malformed { offset: at + 1 });
                }
                Values::Int8 { block }
            }
            _ => return Err(Error::Malformed { offset: at }),
        })
    }
    /// The next `len` bytes as a section, or a `Truncated` error.
    fn section(&mut self, len: usize) -> Result<(&'a [u8], usize), Error> {
        let off = self.pos;
        Ok((self.take(len)?, off))
    }
}

fn parse(frame: &[u8]) -> Result<(Header, Body<'_>), Error> {
    parse_with(frame, true)
}

/// [`parse`] without the checksum, for a frame this crate has just written.
pub(crate) fn parse_trusted(frame: &[u8]) -> Result<(Header, Body<'_>), Error> {
    parse_with(frame, false)
}

fn parse_with(frame: &[u8], verify: bool) -> Result<(Header, Body<'_>), Error> {
    if frame.len() < FIXED_LEN + CRC_LEN {
        return Err(Error::Truncated {
            needed: FIXED_LEN + CRC_LEN,
            got: frame.len(),
        });
    }
    if frame[..4] != MAGIC {
        return Err(Error::BadMagic);
    }
    if frame[4] != FORMAT_VERSION {
        return Err(Error::UnsupportedVersion { version: frame[4] });
    }
    let body_end = frame.len() - CRC_LEN;
    let t = &frame[body_end..];
    let stored = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
    let computed = if verify {
        crc32fast::hash(&frame[..body_end])
    } else {
        stored
    };
    if stored != computed {
        // A frame cut short (a partial transfer) fails its checksum too; when its own header
        // says it needs more bytes than it has, that is the clearer error.
        if let Err(Error::Truncated { needed, got }) = parse_with(frame, false) {
            return Err(Error::Incomplete {
                declared: needed,
                got,
            });
        }
        return Err(Error::Checksum { stored, computed });
    }
    let mut r = Get {
        buf: &frame[..body_end],
        pos: 5,
    };
    let id = r.u8()?;
    let flags = r.u8()?;
    if r.u8()? != 0 {
        return Err(Error::Malformed { offset: 7 });
    }
    if flags != 0 && !(id == M_RANDOMK && flags == FLAG_UNBIASED) {
        return Err(Error::Malformed { offset: 6 });
    }
    let n = r.u64()?;
    let nu = usize::try_from(n).map_err(|_| Error::TooLarge { n })?;
    let mut params = Params::new(Method::Dense {
        values: Values::F32,
    });
    let too_large = Error::TooLarge { n };
    let (kept, body) = match id {
        M_DENSE => {
            let v = r.values()?;
            if matches!(v, Values::Int8 { .. }) {
                return Err(Error::Malformed { offset: 16 });
            }
            params.method = Method::Dense { values: v };
            let len = nu.checked_mul(v.value_bytes()).ok_or(too_large)?;
            let (vals, off) = r.section(len)?;
            (n, Body::Dense { v, vals, off })
        }
        M_TOPK | M_THRESHOLD => {
            let v = r.values()?;
            let threshold = if id == M_THRESHOLD {
                let at = r.pos;
                let t = f32::from_le_bytes(
                    r.take(4)?
                        .try_into()
                        .map_err(|_| Error::Malformed { offset: at })?,
                );
                if !(t.is_finite() && t >= 0.0) {
                    return Err(Error::Malformed { offset: at });
                }
                Some(t)
            } else {
                None
            };
            let at = r.pos;
            let count = r.u64()?;
            if count > n {
                return Err(Error::Malformed { offset: at });
            }
            let at = r.pos;
            let codec = r.u8()?;
            if codec > index::RAW {
                return Err(Error::Malformed { offset: at });
            }
            params.method = match threshold {
                Some(threshold) => Method::Threshold {
                    threshold,
                    values: v,
                },
                None => Method::TopK {
                    k: K::Count(count),
                    values: v,
                },
            };
            let idx_off = r.pos;
            // A section that runs past the frame is reported by `section` as truncated.
            let idx_len = index::section_extent(codec, n, count, &r.buf[idx_off..])
                .map_err(|_| Error::BadIndex { offset: idx_off })?;
            let (idx, _) = r.section(idx_len)?;
            let count_usize = usize::try_from(count).map_err(|_| too_large)?;
            let (vals, vals_off) = r.section(v.section_len(count_usize))?;
            (
                count,
                Body::Sparse {
                    v,
                    count,
                    codec: Some(codec),
                    idx,
                    idx_off,
                    vals,
                    vals_off,
                },
            )
        }
        M_RANDOMK => {
            let v = r.values()?;
            let at = r.pos;
            let k = r.u64()?;
            if k > n {
                return Err(Error::Malformed { offset: at });
            }
            params.seed = r.u64()?;
            params.step = r.u64()?;
            params.tensor_id = r.u64()?;
            params.method = Method::RandomK {
                k: K::Count(k),
                values: v,
                unbiased: flags == FLAG_UNBIASED,
            };
            let ku = usize::try_from(k).map_err(|_| too_large)?;
            let (vals, vals_off) = r.section(v.section_len(ku))?;
            (
                k,
                Body::Sparse {
                    v,
                    count: k,
                    codec: None,
                    idx: &[],
                    idx_off: vals_off,
                    vals,
                    vals_off,
                },
            )
        }
        M_QUANT => {
            let at = r.pos;
            let bits = r.u8()?;
            if !(2..=8).contains(&bits) {
                return Err(Error::Malformed { offset: at });
            }
            let rounding = match r.u8()? {
                0 => Rounding::NearestEven,
                1 => Rounding::Stochastic,
                _ => return Err(Error::Malformed { offset: at + 1 }),
            };
            let block = r.u32()?;
            if block == 0 {
                return Err(Error::Malformed { offset: at + 2 });
            }
            params.method = Method::Quant {
                bits,
                block,
                rounding,
            };
            let s_len = nu
                .div_ceil(block as usize)
                .checked_mul(4)
                .ok_or(too_large)?;
            let c_len = nu.checked_mul(bits as usize).ok_or(too_large)?.div_ceil(8);
            let (scales, off) = r.section(s_len)?;
            let (codes, _) = r.section(c_len)?;
            (
                n,
                Body::Quant {
                    bits,
                    block: block as usize,
                    scales,
                    codes,
                    off,
                },
            )
        }
        M_SIGN => {
            let at = r.pos;
            let block = match r.u8()? {
                0 => None,
                1 => {
                    let b = r.u32()?;
                    if b == 0 {
                        return Err(Error::Malformed { offset: at + 1 });
                    }
                    Some(b)
                }
                _ => return Err(Error::Malformed { offset: at }),
            };
            params.method = Method::Sign {
                scale: match block {
                    Some(block) => SignScale::MeanAbs { block },
                    None => SignScale::None,
                },
            };
            let block = block.map(|b| b as usize);
            let s_len = match block {
                Some(b) => nu.div_ceil(b).checked_mul(4).ok_or(too_large)?,
                None => 0,
            };
            let (scales, off) = r.section(s_len)?;
            let (signs, _) = r.section(nu.div_ceil(8))?;
            (
                n,
                Body::Sign {
                    block,
                    scales,
                    signs,
                    off,
                },
            )
        }
        _ => return Err(Error::Malformed { offset: 5 }),
    };
    if r.pos != body_end {
        return Err(Error::TrailingBytes { offset: r.pos });
    }
    let header = Header {
        version: FORMAT_VERSION,
        n,
        params,
        kept,
        frame_len: frame.len(),
    };
    Ok((header, body))
}

/// Reads and checks a frame's header (magic, version, checksum, parameters and section
/// lengths) without decoding its body.
///
/// # Errors
/// [`Error::Truncated`], [`Error::BadMagic`], [`Error::UnsupportedVersion`],
/// [`Error::Checksum`], [`Error::Incomplete`], [`Error::Malformed`], [`Error::BadIndex`],
/// [`Error::TrailingBytes`], [`Error::TooLarge`].
pub fn peek(frame: &[u8]) -> Result<Header, Error> {
    parse(frame).map(|(h, _)| h)
}

impl Header {
    /// Checks this header against what the receiver expects for `n` elements: the element
    /// count and every parameter (for random-k also seed, step and tensor id). These are the
    /// checks of [`decode_into`] that do not read the body.
    ///
    /// # Errors
    /// [`Error::ElementCount`]; [`Error::InvalidParams`] for an invalid `expected`;
    /// [`Error::ParamMismatch`] naming the first parameter that differs.
    pub fn check(&self, expected: &Params, n: usize) -> Result<(), Error> {
        check_expected(self, expected, n)
    }
}

/// Checks a parsed header against what the receiver expects for `n` elements.
fn check_expected(h: &Header, expected: &Params, n: usize) -> Result<(), Error> {
    if h.n != n as u64 {
        return Err(Error::ElementCount {
            expected: n as u64,
            got: h.n,
        });
    }
    expected.method.validate()?;
    let mismatch = |param| Err(Error::ParamMismatch { param });
    match (h.params.method, expected.method) {
        (Method::Dense { values: a }, Method::Dense { values: b }) => {
            if a != b {
                return mismatch(Param::Values);
            }
        }
        (Method::TopK { k: a, values: va }, Method::TopK { k: b, values: vb }) => {
            if va != vb {
                return mismatch(Param::Values);
            }
            if a.resolve(h.n) != b.resolve(h.n) {
                return mismatch(Param::K);
            }
        }
        (
            Method::Threshold {
                threshold: a,
                values: va,
            },
            Method::Threshold {
                threshold: b,
                values: vb,
            },
        ) => {
            if va != vb {
                return mismatch(Param::Values);
            }
            if a.to_bits() != b.to_bits() {
                return mismatch(Param::Threshold);
            }
        }
        (
            Method::RandomK {
                k: a,
                values: va,
                unbiased: ua,
            },
            Method::RandomK {
                k: b,
                values: vb,
                unbiased: ub,
            },
        ) => {
            if va != vb {
                return mismatch(Param::Values);
            }
            if a.resolve(h.n) != b.resolve(h.n) {
                return mismatch(Param::K);
            }
            if ua != ub {
                return mismatch(Param::Unbiased);
            }
            if h.params.seed != expected.seed {
                return mismatch(Param::Seed);
            }
            if h.params.step != expected.step {
                return mismatch(Param::Step);
            }
            if h.params.tensor_id != expected.tensor_id {
                return mismatch(Param::TensorId);
            }
        }
        (
            Method::Quant {
                bits: a,
                block: ba,
                rounding: ra,
            },
            Method::Quant {
                bits: b,
                block: bb,
                rounding: rb,
            },
        ) => {
            if a != b {
                return mismatch(Param::Bits);
            }
            if ba != bb {
                return mismatch(Param::Block);
            }
            if ra != rb {
                return mismatch(Param::Rounding);
            }
        }
        (Method::Sign { scale: a }, Method::Sign { scale: b }) => {
            if a != b {
                return mismatch(Param::SignScale);
            }
        }
        _ => return mismatch(Param::Method),
    }
    Ok(())
}

/// Validates every index and value of a parsed body.
fn validate_body(n: u64, body: &Body<'_>) -> Result<(), Error> {
    match *body {
        Body::Dense { v, vals, off } => {
            if let Some(j) = values::first_bad_plain(v, vals) {
                return Err(Error::BadValue {
                    offset: off + j * v.value_bytes(),
                });
            }
        }
        Body::Sparse {
            v,
            count,
            codec,
            idx,
            idx_off,
            vals,
            vals_off,
        } => {
            if let Some(codec) = codec {
                index::validate(codec, n, count, idx)
                    .map_err(|_| Error::BadIndex { offset: idx_off })?;
            }
            validate_values(v, count as usize, vals, vals_off)?;
        }
        Body::Quant {
            bits,
            scales,
            codes,
            off,
            ..
        } => {
            quant::validate_fast(n as usize, bits, scales, codes)
                .map_err(|o| Error::BadValue { offset: off + o })?;
        }
        Body::Sign {
            scales, signs, off, ..
        } => {
            sign::validate(n as usize, scales, signs)
                .map_err(|o| Error::BadValue { offset: off + o })?;
        }
    }
    Ok(())
}

fn validate_values(v: Values, count: usize, vals: &[u8], off: usize) -> Result<(), Error> {
    match v {
        Values::Int8 { block } => {
            let s_len = count.div_ceil(block as usize) * 4;
            for (j, s) in vals[..s_len].chunks_exact(4).enumerate() {
                let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                if !(m.is_finite() && m >= 0.0) {
                    return Err(Error::BadValue {
                        offset: off + 4 * j,
                    });
                }
            }
            if let Some(j) = vals[s_len..].iter().position(|&c| c == 0x80) {
                return Err(Error::BadValue {
                    offset: off + s_len + j,
                });
            }
        }
        _ => {
            if let Some(j) = values::first_bad_plain(v, vals) {
                return Err(Error::BadValue {
                    offset: off + j * v.value_bytes(),
                });
            }
        }
    }
    Ok(())
}

/// Calls `f` with runs of entries of a validated sparse body: ascending indices and their
/// decoded values (random-k values already multiplied by the unbiased scale). Index sections
/// are decoded in batches ([`index::for_each_batch`]), values a batch at a time.
pub(crate) fn sparse_batches(h: &Header, body: &Body<'_>, mut f: impl FnMut(&[usize], &[f32])) {
    let Body::Sparse {
        v,
        count,
        codec,
        idx,
        vals,
        ..
    } = *body
    else {
        return;
    };
    let total = count as usize;
    let mut vb = [0.0f32; index::BATCH];
    let mut j = 0usize;
    match codec {
        Some(codec) => index::for_each_batch(codec, h.n, count, idx, |ib| {
            let m = ib.len().min(total - j);
            values::decode_run(v, vals, total, j, &mut vb[..m]);
            f(&ib[..m], &vb[..m]);
            j += m;
        }),
        None => {
            let p = &h.params;
            let key = rng::key(p.seed, p.step, p.tensor_id);
            let scale = unbiased_scale(h, count).unwrap_or(1.0);
            let mut ib = [0usize; index::BATCH];
            let mut fill = 0usize;
            let mut flush = |ib: &[usize], j: &mut usize| {
                let m = ib.len();
                values::decode_run(v, vals, total, *j, &mut vb[..m]);
                for x in &mut vb[..m] {
                    *x *= scale;
                }
                f(ib, &vb[..m]);
                *j += m;
            };
            randomk::for_each(h.n, count, key, |i| {
                ib[fill] = i as usize;
                fill += 1;
                if fill == index::BATCH {
                    flush(&ib, &mut j);
                    fill = 0;
                }
            });
            if fill > 0 {
                flush(&ib[..fill], &mut j);
            }
        }
    }
}

/// Writes (`weight = None`, over an output the caller zeroed for sparse bodies) or adds
/// `weight * value` of every entry of a validated body into `out`.
pub(crate) fn apply(h: &Header, body: &Body<'_>, out: &mut [f32], weight: Option<f32>) {
    match *body {
        Body::Dense { v, vals, .. } => values::decode_plain(v, vals, out, weight),
        Body::Quant {
            bits,
            block,
            scales,
            codes,
            ..
        } => quant::decode_slice(bits, block, scales, codes, out, weight),
        Body::Sign {
            block,
            scales,
            signs,
            ..
        } => sign::decode_slice(block, scales, signs, out, weight),
        Body::Sparse { .. } => match weight {
            None => sparse_batches(h, body, |ib, vb| {
                for (&i, &x) in ib.iter().zip(vb) {
                    out[i] = x;
                }
            }),
            Some(w) => {
                // Software pipeline: a batch's lines are asked for when it is decoded, and it is
                // added one batch later, so that its misses overlap the decoding of the next
                // batch. The asks of one batch alternate with the adds of the one before (asked
                // all at once, they wait for free miss buffers; BENCHMARKS.md, round 7).
                let mut held_i = [0usize; index::BATCH];
                let mut held_x = [0.0f32; index::BATCH];
                let mut held = 0usize;
                // Validated indices are < out.len(): `get_mut` skips nothing, it only spares
                // the panic path (fewer instructions per entry than indexing).
                let add_one = |out: &mut [f32], i: usize, x: f32| {
                    if let Some(o) = out.get_mut(i) {
                        *o += w * x;
                    }
                };
                let add = |out: &mut [f32], i: &[usize], x: &[f32]| {
                    for (&i, &x) in i.iter().zip(x) {
                        add_one(out, i, x);
                    }
                };
                sparse_batches(h, body, |ib, vb| {
                    let both = ib.len().min(held);
                    for ((&next, &i), &x) in ib[..both].iter().zip(&held_i[..both]).zip(&held_x) {
                        prefetch(out, next);
                        add_one(out, i, x);
                    }
                    for &next in &ib[both..] {
                        prefetch(out, next);
                    }
                    add(out, &held_i[both..held], &held_x[both..held]);
                    held = ib.len();
                    held_i[..held].copy_from_slice(ib);
                    held_x[..held].copy_from_slice(vb);
                });
                add(out, &held_i[..held], &held_x[..held]);
            }
        },
    }
}

fn decode_checked<'a>(
    frame: &'a [u8],
    expected: &Params,
    n: usize,
) -> Result<(Header, Body<'a>), Error> {
    let (h, body) = parse(frame)?;
    check_expected(&h, expected, n)?;
    validate_body(h.n, &body)?;
    if let (
        Some(j),
        Body::Sparse {
            v, count, vals_off, ..
        },
    ) = (first_unbiased_overflow(&h, &body), &body)
    {
        let at = match *v {
            Values::Int8 { .. } => v.section_len(*count as usize) - *count as usize + j,
            _ => j * v.value_bytes(),
        };
        return Err(Error::BadValue {
            offset: vals_off + at,
        });
    }
    Ok((h, body))
}

fn info(h: &Header) -> FrameInfo {
    FrameInfo {
        n: h.n,
        kept: h.kept,
        method: h.params.method,
    }
}

/// Decodes `frame` into `out`, overwriting every element (entries a sparse frame does not carry
/// become 0). `out.len()` must equal the frame's element count, and the frame must have been
/// made with `expected` (method and parameters; for random-k also seed, step and tensor id).
/// The whole frame is checked before anything is written.
///
/// # Errors
/// Any error of [`peek`]; [`Error::ElementCount`] when `out.len()` differs from the frame's
/// n; [`Error::ParamMismatch`] when the frame was made with other parameters;
/// [`Error::InvalidParams`] when `expected` is invalid; [`Error::BadIndex`] and
/// [`Error::BadValue`] for invalid sections. On error `out` is untouched.
///
/// # Panics
/// Never.
pub fn decode_into(frame: &[u8], expected: &Params, out: &mut [f32]) -> Result<FrameInfo, Error> {
    let (h, body) = decode_checked(frame, expected, out.len())?;
    if matches!(body, Body::Sparse { .. }) {
        out.fill(0.0);
    }
    apply(&h, &body, out, None);
    Ok(info(&h))
}

/// Adds `weight * value` of every entry of `frame` into `acc` (never overwrites; entries a
/// sparse frame does not carry are left as they are). Same checks as [`decode_into`]; on error
/// `acc` is untouched.
///
/// Every value of a valid frame is finite, but the sums are not checked: adding frames into
/// an accumulator can overflow to ±inf (the std crate's aggregation checks its result).
///
/// Speed: a sparse frame reads and writes up to one cache line of `acc` per entry (one each at
/// 1%, where entries fall about 400 bytes apart). For a top-k 1% frame into an accumulator past
/// the caches, that costs about half a read pass over `acc` on the project's 2-vCPU EPYC VM
/// (BENCHMARKS.md, rounds 13 and 14). About 0.06 of a read pass is the validation, which ends
/// before the first write. On 4 KiB pages, page walks add a few hundredths; an accumulator on
/// huge pages took 0.02-0.04 off.
///
/// # Errors
/// [`Error::InvalidParams`] with [`Param::Weight`] when `weight` is NaN or infinite; otherwise
/// as [`decode_into`].
///
/// # Panics
/// Never.
pub fn accumulate_into(
    frame: &[u8],
    expected: &Params,
    acc: &mut [f32],
    weight: f32,
) -> Result<FrameInfo, Error> {
    if !weight.is_finite() {
        return Err(Error::InvalidParams {
            param: Param::Weight,
        });
    }
    let (h, body) = decode_checked(frame, expected, acc.len())?;
    apply(&h, &body, acc, Some(weight));
    Ok(info(&h))
}

/// Checks `frame` as [`decode_into`] does for an output of `n` elements, writing nothing: the
/// header, the parameters against `expected`, and every index and value of the body. A frame
/// that passes decodes with [`decode_into`], and with [`accumulate_into`] at a finite weight,
/// without error.
///
/// # Errors
/// As [`decode_into`] (with `n` in place of `out.len()`): the same error for the same frame.
///
/// # Panics
/// Never.
pub fn validate(frame: &[u8], expected: &Params, n: usize) -> Result<FrameInfo, Error> {
    let (h, _) = decode_checked(frame, expected, n)?;
    Ok(info(&h))
}

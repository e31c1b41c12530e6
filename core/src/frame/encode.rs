//! [`encode_into`]: the dispatch of an encode, and the frames whose sections follow the
//! tensor's elements in order (dense, quantization, sign). Top-k, threshold and random-k are
//! written by `sparse`.

use super::shape::Shape;
use super::wire::{
    FIXED_LEN, FLAG_ZERO_MASK, M_SIGN, Put, params_len, write_fixed, write_shaped_header,
};
use super::{check_encode, check_input, no_frame_on_error, sparse};
use crate::error::Error;
use crate::lanes::{One, Source};
use crate::method::{Method, Params, SignScale, Values};
use crate::select::OutOfLimit;
use crate::{quant, sign, values, zero_mask};

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
///
/// [`scratch_len`]: super::scratch_len
/// [`max_frame_len`]: super::max_frame_len
pub fn encode_into(
    grad: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    no_frame_on_error(out, |out| encode_frame(grad, params, scratch, out))
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
        return sparse::check_unbiased_written(out, len, None);
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
        Method::Sign {
            scale,
            zero_mask: false,
        } => sign::is_fast(super::wire::sign_block(scale)),
        _ => false,
    }
}

/// A frame of `src` for a method where [`is_fused`] holds (after `check_encode`), checking
/// on the way that every `|x| < limit`. On error `out` holds no valid frame.
pub(crate) fn encode_src<S: Source>(
    src: &S,
    params: &Params,
    limit: f32,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, OutOfLimit> {
    let n = src.len();
    if let Method::TopK { .. } | Method::Threshold { .. } = params.method {
        return sparse::encode_sparse_src(src, params, limit, scratch, out);
    }
    let mut p = Put::new(out);
    write_shaped_header(&mut p, &params.method, n);
    let mut body = crc32fast::Hasher::new();
    let tail = match params.method {
        Method::Quant { bits, block, .. } => {
            let block = block as usize;
            let s_len = quant::scales_len(n, block);
            let c_len = quant::codes_len(n, bits);
            let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
            quant::encode_fast(src, bits, block, scales, &mut rest[..c_len], |c| {
                body.update(c)
            })?;
            p.pos += s_len;
            c_len
        }
        Method::Sign { scale, .. } => {
            let block = super::wire::sign_block(scale);
            let s_len = sign::scales_len(n, block);
            let b_len = sign::bits_len(n);
            let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
            sign::encode_fast(src, block, scales, &mut rest[..b_len], |c| body.update(c))?;
            p.pos += s_len;
            b_len
        }
        _ => unreachable!("only fused methods"),
    };
    Ok(p.finish_with(body, tail))
}

/// A dense frame, checking each run of the input before writing it.
fn encode_dense(g: &[f32], values: Values, out: &mut [u8]) -> Result<usize, OutOfLimit> {
    let n = g.len();
    let mut p = Put::new(out);
    write_shaped_header(&mut p, &Method::Dense { values }, n);
    values::try_encode_plain(values, g, &mut p.buf[p.pos..])?;
    p.pos += n * values.value_bytes();
    Ok(p.finish())
}

/// Encodes after `check_encode` and `check_input` succeeded; cannot fail.
pub(crate) fn encode_checked(
    g: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    match params.method {
        Method::TopK { .. } | Method::Threshold { .. } => {
            sparse::encode_sparse_checked(g, params, scratch, out)
        }
        Method::RandomK { .. } => sparse::encode_randomk(g, params, scratch, out),
        Method::Sign {
            scale,
            zero_mask: true,
        } => encode_masked_sign(g, scale, out),
        _ => encode_shaped(g, params, out),
    }
}

/// A dense, quantization or sign frame of checked input.
fn encode_shaped(g: &[f32], params: &Params, out: &mut [u8]) -> usize {
    let n = g.len();
    let Some(shape) = Shape::of(&params.method) else {
        unreachable!("only dense, quantization and sign")
    };
    let mut p = Put::new(out);
    write_shaped_header(&mut p, &params.method, n);
    let (s_len, b_len) = (shape.scales_len(n), shape.body_len(n));
    let (scales, rest) = p.buf[p.pos..].split_at_mut(s_len);
    let stream = (params.seed, params.step, params.tensor_id);
    shape.encode(g, 0, stream, scales, &mut rest[..b_len]);
    p.pos += s_len + b_len;
    p.finish()
}

/// A sign frame with a zero mask of checked input: the mask is written first, at its place
/// after the signs (the header's length does not depend on it), then the header with the
/// count of mixed blocks, the scales and the signs.
fn encode_masked_sign(g: &[f32], scale: SignScale, out: &mut [u8]) -> usize {
    let n = g.len();
    let method = Method::Sign {
        scale,
        zero_mask: true,
    };
    let block = super::wire::sign_block(scale);
    let header = FIXED_LEN + params_len(&method);
    let (s_len, b_len) = (sign::scales_len(n, block), sign::bits_len(n));
    let (head, rest) = out.split_at_mut(header);
    let (scales, rest) = rest.split_at_mut(s_len);
    let (signs, mask) = rest.split_at_mut(b_len);
    let (m_len, mixed) = zero_mask::encode(g, method.sign_mask_block(), mask);
    sign::encode(g, block, scales, signs);
    let mut p = Put::new(head);
    write_fixed(&mut p, M_SIGN, FLAG_ZERO_MASK, n);
    p.sign_params(scale);
    p.u64(mixed as u64);
    let mut p = Put::new(out);
    p.pos = header + s_len + b_len + m_len;
    p.finish()
}

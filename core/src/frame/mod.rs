//! The wire frame: header, sections and CRC-32 trailer (normative spec: `FORMAT.md`).
//!
//! Encoders write into a caller-supplied `&mut [u8]` of [`max_frame_len`] bytes with a scratch
//! slice of [`scratch_len`] words and return the bytes written. Decoders read and check the
//! whole frame (checksum, header, every length, every index and value) before writing any
//! output, then overwrite ([`decode_into`]) or add into ([`accumulate_into`]) a dense f32 slice
//! whose length must equal the frame's element count. [`chunk`] cuts a frame into chunks for
//! callers that encode or decode it on several threads.
//!
//! Inside: `wire` writes and reads the bytes around the sections (header, parameters,
//! trailer); `encode` writes dense, quantization and sign frames and dispatches the others to
//! `sparse` (top-k, threshold, random-k), with `shape` holding how dense, quantization and
//! sign sections hold the elements; `parse` reads and checks a frame into its sections;
//! `apply` decodes them.

mod apply;
pub mod chunk;
mod encode;
mod parse;
mod shape;
mod sparse;
mod wire;

use crate::error::Error;
use crate::index;
use crate::method::{Method, Params, SignScale, Values};
use crate::{quant, scalar, select, sign, values, zero_mask};

pub use apply::{accumulate_into, decode_into, validate};
pub use encode::encode_into;
pub use sparse::{
    encode_kept_into, encode_kept_segmented_into, encode_segmented_into, encode_selected_into,
    kept_segmented_scratch_len, segmented_frame_len, segmented_scratch_len,
};

pub(crate) use apply::{apply, sparse_batches};
pub(crate) use encode::{encode_checked, encode_src, is_fused};
pub(crate) use parse::{Body, parse_trusted};
pub(crate) use shape::Shape;
pub(crate) use sparse::topk_frame;

use wire::{CRC_LEN, FIXED_LEN, params_len};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GWRF";
/// The frame format version this crate writes and reads.
pub const FORMAT_VERSION: u8 = 1;

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
        Method::Sign { scale, zero_mask } => {
            let s = match scale {
                SignScale::MeanAbs { block } => sign::scales_len(n, Some(block_or_one(block))),
                SignScale::None => 0,
            };
            let mask = if zero_mask {
                zero_mask::max_len(n, method.sign_mask_block())
            } else {
                0
            };
            s.saturating_add(sign::bits_len(n)).saturating_add(mask)
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

/// What a frame declares, read by [`peek`] without decoding the body.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Header {
    /// Format version.
    pub version: u8,
    /// Element count of the tensor.
    pub n: u64,
    /// Method and parameters; `k` is always a [`K::Count`](crate::K::Count); seed, step and
    /// tensor id are those of the frame for random-k and 0 otherwise.
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

/// Reads and checks a frame's header (magic, version, checksum, parameters and section
/// lengths) without decoding its body.
///
/// # Errors
/// [`Error::Truncated`], [`Error::BadMagic`], [`Error::UnsupportedVersion`],
/// [`Error::Checksum`], [`Error::Incomplete`], [`Error::Malformed`], [`Error::BadIndex`],
/// [`Error::TrailingBytes`], [`Error::TooLarge`].
pub fn peek(frame: &[u8]) -> Result<Header, Error> {
    parse::parse(frame).map(|(h, _)| h)
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
        parse::check_expected(self, expected, n)
    }
}

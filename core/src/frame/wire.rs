//! The bytes of a frame around its sections (FORMAT.md sections 2 and 3): method ids, flags,
//! the fixed header, the value spec and every method's parameters, the CRC-32 trailer, and the
//! little-endian cursors that write ([`Put`]) and read ([`Get`]) them. The only part of the
//! frame code that knows byte offsets; the sections themselves are the kernels' (`quant`,
//! `sign`, `values`, `index`).

use super::{FORMAT_VERSION, MAGIC};
use crate::error::Error;
use crate::index;
use crate::method::{Method, Params, Rounding, SignScale, Values};
use crate::values;

/// Bytes of the fixed header: magic, version, method id, flags, reserved byte, n.
pub(crate) const FIXED_LEN: usize = 16;
/// Bytes of the CRC-32 trailer.
pub(crate) const CRC_LEN: usize = 4;

/// Offset of the version byte.
const VERSION_AT: usize = 4;
/// Offset of the method id; the fixed header is read from here on by [`Get::fixed`].
const METHOD_AT: usize = 5;
/// Offset of the flags byte.
const FLAGS_AT: usize = 6;
/// Offset of the reserved byte.
const RESERVED_AT: usize = 7;

pub(crate) const M_DENSE: u8 = 0;
pub(crate) const M_TOPK: u8 = 1;
pub(crate) const M_THRESHOLD: u8 = 2;
pub(crate) const M_RANDOMK: u8 = 3;
pub(crate) const M_QUANT: u8 = 4;
pub(crate) const M_SIGN: u8 = 5;

pub(crate) const FLAG_UNBIASED: u8 = 1;
/// Flag of a sign frame with a zero mask (FORMAT.md 2.3).
pub(crate) const FLAG_ZERO_MASK: u8 = 2;
/// Flag of a top-k frame whose int8 scale blocks restart at every segment (FORMAT.md 3.2.1).
pub(crate) const FLAG_SEGMENTED: u8 = 4;

const fn values_spec_len(v: Values) -> usize {
    match v {
        Values::Int8 { .. } => 5,
        _ => 1,
    }
}

/// Bytes of `method`'s parameters, between the fixed header and the sections.
pub(crate) const fn params_len(method: &Method) -> usize {
    match *method {
        Method::Dense { values } => values_spec_len(values),
        Method::TopK { values, .. } => values_spec_len(values) + 8 + 1,
        Method::Threshold { values, .. } => values_spec_len(values) + 4 + 8 + 1,
        Method::RandomK { values, .. } => values_spec_len(values) + 8 + 8 + 8 + 8,
        Method::Quant { .. } => 1 + 1 + 4,
        Method::Sign { scale, zero_mask } => {
            let mode = match scale {
                SignScale::MeanAbs { .. } => 5,
                SignScale::None => 1,
            };
            // With a zero mask, the count of mixed mask blocks (`u64`).
            if zero_mask { mode + 8 } else { mode }
        }
    }
}

/// The block of per-block sign scales (`None`: unscaled).
pub(crate) const fn sign_block(scale: SignScale) -> Option<usize> {
    match scale {
        SignScale::MeanAbs { block } => Some(block as usize),
        SignScale::None => None,
    }
}

/// Little-endian cursor over the output.
pub(crate) struct Put<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) pos: usize,
}

impl<'a> Put<'a> {
    /// A cursor at the start of `buf`.
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        Put { buf, pos: 0 }
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }
    pub(crate) fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    /// The value spec (FORMAT.md 2.4).
    /// An unsigned LEB128 varint (7 bits per byte, low first; the shortest form).
    pub(crate) fn varint(&mut self, mut v: u64) {
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.u8(byte);
                return;
            }
            self.u8(byte | 0x80);
        }
    }
    pub(crate) fn values(&mut self, v: Values) {
        self.u8(values::id(v));
        if let Values::Int8 { block } = v {
            self.u32(block);
        }
    }
    /// Random-k's parameters (FORMAT.md 3.4): value codec, k, seed, step and tensor id.
    pub(crate) fn randomk_params(&mut self, v: Values, k: u64, params: &Params) {
        self.values(v);
        self.u64(k);
        self.u64(params.seed);
        self.u64(params.step);
        self.u64(params.tensor_id);
    }
    /// Quantization's parameters (FORMAT.md 3.5): bits, rounding, block.
    pub(crate) fn quant_params(&mut self, bits: u8, rounding: Rounding, block: u32) {
        self.u8(bits);
        self.u8(match rounding {
            Rounding::NearestEven => 0,
            Rounding::Stochastic => 1,
        });
        self.u32(block);
    }
    /// Sign's parameters (FORMAT.md 3.6): the scale mode and its block. Returns the block.
    pub(crate) fn sign_params(&mut self, scale: SignScale) -> Option<usize> {
        match scale {
            SignScale::MeanAbs { block } => {
                self.u8(1);
                self.u32(block);
            }
            SignScale::None => self.u8(0),
        }
        sign_block(scale)
    }
    /// Ends the frame: the CRC-32 of everything before the cursor as the trailer. Returns the
    /// frame length.
    pub(crate) fn finish(mut self) -> usize {
        let crc = crc32fast::hash(&self.buf[..self.pos]);
        self.u32(crc);
        self.pos
    }
    /// Ends a frame whose last `tail` bytes (after the cursor) are already folded into `body`:
    /// the CRC-32 of everything before the cursor, combined with `body`, as the trailer.
    /// Returns the frame length.
    pub(crate) fn finish_with(mut self, body: crc32fast::Hasher, tail: usize) -> usize {
        let mut crc = crc32fast::Hasher::new();
        crc.update(&self.buf[..self.pos]);
        crc.combine(&body);
        self.pos += tail;
        self.u32(crc.finalize());
        self.pos
    }
}

/// The fixed header with the method id and flags of `method`.
pub(crate) fn write_method(p: &mut Put<'_>, method: &Method, n: usize) {
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

pub(crate) fn write_fixed(p: &mut Put<'_>, id: u8, flags: u8, n: usize) {
    p.bytes(&MAGIC);
    p.u8(FORMAT_VERSION);
    p.u8(id);
    p.u8(flags);
    p.u8(0);
    p.u64(n as u64);
}

/// The whole header of a dense, quantization or sign frame of `n` elements (their parameters
/// are all in `method`; the sections follow). Returns `false`, with nothing written, for the
/// other methods.
pub(crate) fn write_shaped_header(p: &mut Put<'_>, method: &Method, n: usize) -> bool {
    match *method {
        Method::Dense { values } => {
            write_fixed(p, M_DENSE, 0, n);
            p.values(values);
        }
        Method::Quant {
            bits,
            block,
            rounding,
        } => {
            write_fixed(p, M_QUANT, 0, n);
            p.quant_params(bits, rounding, block);
        }
        Method::Sign {
            scale,
            zero_mask: false,
        } => {
            write_fixed(p, M_SIGN, 0, n);
            p.sign_params(scale);
        }
        _ => return false,
    }
    true
}

/// Makes the trailer of the `len`-byte frame at the start of `out` wrong (every bit flipped),
/// so that `out` holds no valid frame.
pub(crate) fn break_trailer(out: &mut [u8], len: usize) {
    for b in &mut out[len - CRC_LEN..len] {
        *b = !*b;
    }
}

/// The fields of the fixed header after the version.
#[derive(Clone, Copy)]
pub(crate) struct Fixed {
    pub(crate) id: u8,
    pub(crate) flags: u8,
    pub(crate) n: u64,
    /// `n` as a `usize`.
    pub(crate) nu: usize,
}

/// Steps 1 and 2 of FORMAT.md section 8: the frame holds a fixed header and a trailer, starts
/// with the magic and has version 1. Returns a reader over the frame less its trailer, at the
/// method id.
pub(crate) fn open(frame: &[u8]) -> Result<Get<'_>, Error> {
    if frame.len() < FIXED_LEN + CRC_LEN {
        return Err(Error::Truncated {
            needed: FIXED_LEN + CRC_LEN,
            got: frame.len(),
        });
    }
    if frame[..VERSION_AT] != MAGIC {
        return Err(Error::BadMagic);
    }
    if frame[VERSION_AT] != FORMAT_VERSION {
        return Err(Error::UnsupportedVersion {
            version: frame[VERSION_AT],
        });
    }
    Ok(Get {
        buf: &frame[..frame.len() - CRC_LEN],
        pos: METHOD_AT,
    })
}

/// The CRC-32 stored in the trailer of `frame` and the one computed over the bytes before it
/// (`frame` holds at least a trailer).
pub(crate) fn crc_pair(frame: &[u8]) -> (u32, u32) {
    let body_end = frame.len() - CRC_LEN;
    let t = &frame[body_end..];
    let stored = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
    (stored, crc32fast::hash(&frame[..body_end]))
}

/// The error for an unknown method id.
pub(crate) const fn unknown_method() -> Error {
    Error::Malformed { offset: METHOD_AT }
}

/// The error of a flags byte the method or its parameters do not allow.
pub(crate) fn flags_malformed() -> Error {
    Error::Malformed { offset: FLAGS_AT }
}

/// Checked little-endian reader over the header.
pub(crate) struct Get<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Get<'a> {
    pub(crate) fn take(&mut self, len: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(len).ok_or(Error::Truncated {
            needed: usize::MAX,
            got: self.buf.len(),
        })?;
        // `end` comes from lengths a hostile header declares: it may lie within `CRC_LEN` of
        // `usize::MAX`, so the error's arithmetic saturates too.
        let s = self.buf.get(self.pos..end).ok_or(Error::Truncated {
            needed: end.saturating_add(CRC_LEN),
            got: self.buf.len() + CRC_LEN,
        })?;
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, Error> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, Error> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// The fixed header from the method id on (step 4 of FORMAT.md section 8 for its fields):
    /// the reserved byte 0, the flags allowed for the method, `n` a `usize`.
    pub(crate) fn fixed(&mut self) -> Result<Fixed, Error> {
        let id = self.u8()?;
        let flags = self.u8()?;
        if self.u8()? != 0 {
            return Err(Error::Malformed {
                offset: RESERVED_AT,
            });
        }
        let allowed = (id == M_RANDOMK && flags == FLAG_UNBIASED)
            || (id == M_SIGN && flags == FLAG_ZERO_MASK)
            || (id == M_TOPK && flags == FLAG_SEGMENTED);
        if flags != 0 && !allowed {
            return Err(Error::Malformed { offset: FLAGS_AT });
        }
        let n = self.u64()?;
        let nu = usize::try_from(n).map_err(|_| Error::TooLarge { n })?;
        Ok(Fixed { id, flags, n, nu })
    }

    /// A value spec (FORMAT.md 2.4).
    pub(crate) fn values(&mut self) -> Result<Values, Error> {
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

    /// A value spec that a dense frame allows (not int8).
    pub(crate) fn plain_values(&mut self) -> Result<Values, Error> {
        let at = self.pos;
        let v = self.values()?;
        if matches!(v, Values::Int8 { .. }) {
            return Err(Error::Malformed { offset: at });
        }
        Ok(v)
    }

    /// A threshold: finite and `>= 0`.
    pub(crate) fn threshold(&mut self) -> Result<f32, Error> {
        let at = self.pos;
        let t = f32::from_le_bytes(
            self.take(4)?
                .try_into()
                .map_err(|_| Error::Malformed { offset: at })?,
        );
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::Malformed { offset: at });
        }
        Ok(t)
    }

    /// A count of kept entries (top-k, threshold) or random-k's k: at most `n`.
    pub(crate) fn count(&mut self, n: u64) -> Result<u64, Error> {
        let at = self.pos;
        let count = self.u64()?;
        if count > n {
            return Err(Error::Malformed { offset: at });
        }
        Ok(count)
    }

    /// A segmented frame's segment count and table (FORMAT.md 3.2.1): `2 <= S <= count`
    /// LEB128 kept counts, each `>= 1`, in their shortest form, summing to `count`. Returns the
    /// table and the number of int8 scale blocks of `block` values it gives.
    pub(crate) fn segments(&mut self, count: u64, block: u32) -> Result<(&'a [u8], u64), Error> {
        let at = self.pos;
        let s = u64::from(self.u32()?);
        if s < 2 || s > count {
            return Err(Error::Malformed { offset: at });
        }
        let start = self.pos;
        let (mut sum, mut blocks) = (0u64, 0u64);
        for _ in 0..s {
            let at = self.pos;
            let mut v = 0u64;
            let mut i = 0u32;
            loop {
                let byte = self.u8()?;
                // At most 10 bytes, the last one of a longer form not zero (shortest form),
                // and no bits above 64.
                if i == 9 && byte > 1 {
                    return Err(Error::Malformed { offset: at });
                }
                v |= u64::from(byte & 0x7f) << (7 * i);
                if byte & 0x80 == 0 {
                    if byte == 0 && i > 0 {
                        return Err(Error::Malformed { offset: at });
                    }
                    break;
                }
                i += 1;
            }
            sum = sum.saturating_add(v);
            if v == 0 || sum > count {
                return Err(Error::Malformed { offset: at });
            }
            blocks += v.div_ceil(u64::from(block));
        }
        if sum != count {
            return Err(Error::Malformed { offset: at });
        }
        Ok((&self.buf[start..self.pos], blocks))
    }

    /// An index codec id.
    pub(crate) fn index_codec(&mut self) -> Result<u8, Error> {
        let at = self.pos;
        let codec = self.u8()?;
        if codec > index::RAW {
            return Err(Error::Malformed { offset: at });
        }
        Ok(codec)
    }

    /// Random-k's seed, step and tensor id, into `params`.
    pub(crate) fn randomk_stream(&mut self, params: &mut Params) -> Result<(), Error> {
        params.seed = self.u64()?;
        params.step = self.u64()?;
        params.tensor_id = self.u64()?;
        Ok(())
    }

    /// Quantization's bits (2..=8), rounding and block (`>= 1`).
    pub(crate) fn quant_params(&mut self) -> Result<(u8, Rounding, u32), Error> {
        let at = self.pos;
        let bits = self.u8()?;
        if !(2..=8).contains(&bits) {
            return Err(Error::Malformed { offset: at });
        }
        let rounding = match self.u8()? {
            0 => Rounding::NearestEven,
            1 => Rounding::Stochastic,
            _ => return Err(Error::Malformed { offset: at + 1 }),
        };
        let block = self.u32()?;
        if block == 0 {
            return Err(Error::Malformed { offset: at + 2 });
        }
        Ok((bits, rounding, block))
    }

    /// Sign's scale mode and block (`>= 1`).
    pub(crate) fn sign_scale(&mut self) -> Result<SignScale, Error> {
        let at = self.pos;
        Ok(match self.u8()? {
            0 => SignScale::None,
            1 => {
                let block = self.u32()?;
                if block == 0 {
                    return Err(Error::Malformed { offset: at + 1 });
                }
                SignScale::MeanAbs { block }
            }
            _ => return Err(Error::Malformed { offset: at }),
        })
    }

    /// The count of mixed blocks of a zero mask of `blocks` blocks: at most `blocks`.
    pub(crate) fn mixed_count(&mut self, blocks: usize) -> Result<usize, Error> {
        let at = self.pos;
        let m = self.u64()?;
        match usize::try_from(m) {
            Ok(m) if m <= blocks => Ok(m),
            _ => Err(Error::Malformed { offset: at }),
        }
    }

    /// The next `len` bytes as a section, with its offset, or a `Truncated` error.
    pub(crate) fn section(&mut self, len: usize) -> Result<(&'a [u8], usize), Error> {
        let off = self.pos;
        Ok((self.take(len)?, off))
    }

    /// Step 5's last check: the sections end exactly at the trailer.
    pub(crate) fn end(&self) -> Result<(), Error> {
        if self.pos != self.buf.len() {
            return Err(Error::TrailingBytes { offset: self.pos });
        }
        Ok(())
    }
}

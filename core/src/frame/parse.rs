//! Reading a frame: [`parse`] checks the fixed header, the checksum, every parameter and every
//! section length (FORMAT.md section 8, steps 1-5) and returns the [`Header`] and the sections
//! ([`Body`]); [`check_expected`] compares the header with the receiver's parameters (step 6);
//! [`validate_body`] checks every index and value (steps 7-8).

use super::shape::Shape;
use super::wire::{
    self, FLAG_SEGMENTED, FLAG_UNBIASED, FLAG_ZERO_MASK, Fixed, Get, M_DENSE, M_QUANT, M_RANDOMK,
    M_SIGN, M_THRESHOLD, M_TOPK,
};
use super::{FORMAT_VERSION, Header};
use crate::error::{Error, Param};
use crate::method::{K, Method, Params, Values};
use crate::zero_mask::{self, Mask};
use crate::{index, values};

/// Sections of a parsed frame, each with its byte offset.
pub(crate) enum Body<'a> {
    /// Dense, quantization or sign: the scales section (empty for dense and unscaled sign)
    /// at offset `off`, and right after it the values, codes or signs.
    Shaped {
        shape: Shape,
        scales: &'a [u8],
        body: &'a [u8],
        off: usize,
    },
    /// Sign with a zero mask: the scales section (empty when unscaled) at offset `off`, the
    /// signs right after it, and the checked mask right after them.
    MaskedSign {
        block: Option<usize>,
        scales: &'a [u8],
        signs: &'a [u8],
        mask: &'a [u8],
        mask_block: usize,
        mixed: usize,
        off: usize,
    },
    /// Top-k, threshold (with an index section of codec `codec`) and random-k (none); `segs`
    /// is the segment table of a segmented top-k frame (empty otherwise).
    Sparse {
        v: Values,
        count: u64,
        segs: &'a [u8],
        codec: Option<u8>,
        idx: &'a [u8],
        idx_off: usize,
        vals: &'a [u8],
        vals_off: usize,
    },
}

/// Parses and checks `frame` (FORMAT.md section 8, steps 1-5).
pub(crate) fn parse(frame: &[u8]) -> Result<(Header, Body<'_>), Error> {
    parse_with(frame, true)
}

/// [`parse`] without the checksum, for a frame this crate has just written.
pub(crate) fn parse_trusted(frame: &[u8]) -> Result<(Header, Body<'_>), Error> {
    parse_with(frame, false)
}

/// What a method's parser returns: the parameters read, the entries carried, the sections.
type Parsed<'a> = (Params, u64, Body<'a>);

fn parse_with(frame: &[u8], verify: bool) -> Result<(Header, Body<'_>), Error> {
    let mut r = wire::open(frame)?;
    if verify {
        check_crc(frame)?;
    }
    let f = r.fixed()?;
    let (params, kept, body) = match f.id {
        M_DENSE => parse_dense(&mut r, f)?,
        M_TOPK | M_THRESHOLD => parse_selected(&mut r, f)?,
        M_RANDOMK => parse_randomk(&mut r, f)?,
        M_QUANT => parse_quant(&mut r, f)?,
        M_SIGN => parse_sign(&mut r, f)?,
        _ => return Err(wire::unknown_method()),
    };
    r.end()?;
    let header = Header {
        version: FORMAT_VERSION,
        n: f.n,
        params,
        kept,
        frame_len: frame.len(),
    };
    Ok((header, body))
}

/// Step 3: the trailer holds the CRC-32 of the bytes before it.
fn check_crc(frame: &[u8]) -> Result<(), Error> {
    let (stored, computed) = wire::crc_pair(frame);
    if stored == computed {
        return Ok(());
    }
    // A frame cut short (a partial transfer) fails its checksum too; when its own header says
    // it needs more bytes than it has, that is the clearer error.
    if let Err(Error::Truncated { needed, got }) = parse_with(frame, false) {
        return Err(Error::Incomplete {
            declared: needed,
            got,
        });
    }
    Err(Error::Checksum { stored, computed })
}

fn parse_dense<'a>(r: &mut Get<'a>, f: Fixed) -> Result<Parsed<'a>, Error> {
    let v = r.plain_values()?;
    let body = shaped_sections(r, f, Shape::Dense(v))?;
    Ok((Params::new(Method::Dense { values: v }), f.n, body))
}

/// Top-k and threshold: the value spec, the threshold (threshold only), the count and the
/// index codec, then the index and values sections.
fn parse_selected<'a>(r: &mut Get<'a>, f: Fixed) -> Result<Parsed<'a>, Error> {
    let v = r.values()?;
    let threshold = match f.id {
        M_THRESHOLD => Some(r.threshold()?),
        _ => None,
    };
    let count = r.count(f.n)?;
    // A segmented top-k frame (int8 values only): the segment count and table.
    let (segs, scale_blocks) = match (f.flags == FLAG_SEGMENTED, v) {
        (false, _) => (&[][..], None),
        (true, Values::Int8 { block }) => {
            let (table, blocks) = r.segments(count, block)?;
            (table, Some(blocks))
        }
        (true, _) => return Err(wire::flags_malformed()),
    };
    let codec = r.index_codec()?;
    let method = match threshold {
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
    let idx_len = index::section_extent(codec, f.n, count, &r.buf[idx_off..])
        .map_err(|_| Error::BadIndex { offset: idx_off })?;
    let (idx, _) = r.section(idx_len)?;
    let count_usize = usize::try_from(count).map_err(|_| Error::TooLarge { n: f.n })?;
    let vals_len = match scale_blocks {
        Some(blocks) => usize::try_from(blocks)
            .ok()
            .and_then(|b| b.checked_mul(4))
            .and_then(|b| b.checked_add(count_usize))
            .ok_or(Error::TooLarge { n: f.n })?,
        None => v.section_len(count_usize),
    };
    let (vals, vals_off) = r.section(vals_len)?;
    let body = Body::Sparse {
        v,
        count,
        segs,
        codec: Some(codec),
        idx,
        idx_off,
        vals,
        vals_off,
    };
    Ok((Params::new(method), count, body))
}

/// Random-k: the value spec, k, seed, step and tensor id, then the values section.
fn parse_randomk<'a>(r: &mut Get<'a>, f: Fixed) -> Result<Parsed<'a>, Error> {
    let v = r.values()?;
    let k = r.count(f.n)?;
    let mut params = Params::new(Method::RandomK {
        k: K::Count(k),
        values: v,
        unbiased: f.flags == FLAG_UNBIASED,
    });
    r.randomk_stream(&mut params)?;
    let ku = usize::try_from(k).map_err(|_| Error::TooLarge { n: f.n })?;
    let (vals, vals_off) = r.section(v.section_len(ku))?;
    let body = Body::Sparse {
        v,
        count: k,
        segs: &[],
        codec: None,
        idx: &[],
        idx_off: vals_off,
        vals,
        vals_off,
    };
    Ok((params, k, body))
}

fn parse_quant<'a>(r: &mut Get<'a>, f: Fixed) -> Result<Parsed<'a>, Error> {
    let (bits, rounding, block) = r.quant_params()?;
    let shape = Shape::Quant {
        bits,
        block: block as usize,
        rounding,
    };
    let body = shaped_sections(r, f, shape)?;
    let method = Method::Quant {
        bits,
        block,
        rounding,
    };
    Ok((Params::new(method), f.n, body))
}

fn parse_sign<'a>(r: &mut Get<'a>, f: Fixed) -> Result<Parsed<'a>, Error> {
    let scale = r.sign_scale()?;
    let block = wire::sign_block(scale);
    let zero_mask = f.flags == FLAG_ZERO_MASK;
    let method = Method::Sign { scale, zero_mask };
    if !zero_mask {
        let body = shaped_sections(r, f, Shape::Sign { block })?;
        return Ok((Params::new(method), f.n, body));
    }
    let at = r.pos;
    let mask_block = method.sign_mask_block();
    if !mask_block.is_multiple_of(8) {
        // A mask needs whole bytes of signs per block: the block field is wrong.
        return Err(Error::Malformed { offset: at - 4 });
    }
    let mixed = r.mixed_count(zero_mask::blocks(f.nu, mask_block))?;
    let (s_len, b_len) = Shape::Sign { block }
        .section_lens(f.nu)
        .ok_or(Error::TooLarge { n: f.n })?;
    let m_len =
        zero_mask::section_len(f.nu, mask_block, mixed).ok_or(Error::TooLarge { n: f.n })?;
    let (scales, off) = r.section(s_len)?;
    let (signs, _) = r.section(b_len)?;
    let (mask, _) = r.section(m_len)?;
    let body = Body::MaskedSign {
        block,
        scales,
        signs,
        mask,
        mask_block,
        mixed,
        off,
    };
    Ok((Params::new(method), f.n, body))
}

/// The scales and body sections of a dense, quantization or sign frame of `f.n` elements.
fn shaped_sections<'a>(r: &mut Get<'a>, f: Fixed, shape: Shape) -> Result<Body<'a>, Error> {
    let (s_len, b_len) = shape.section_lens(f.nu).ok_or(Error::TooLarge { n: f.n })?;
    let (scales, off) = r.section(s_len)?;
    let (body, _) = r.section(b_len)?;
    Ok(Body::Shaped {
        shape,
        scales,
        body,
        off,
    })
}

/// Checks a parsed header against what the receiver expects for `n` elements.
pub(crate) fn check_expected(h: &Header, expected: &Params, n: usize) -> Result<(), Error> {
    if h.n != n as u64 {
        return Err(Error::ElementCount {
            expected: n as u64,
            got: h.n,
        });
    }
    expected.method.validate()?;
    match first_difference(h, expected) {
        Some(param) => Err(Error::ParamMismatch { param }),
        None => Ok(()),
    }
}

/// The first parameter of the frame that differs from `expected` (FORMAT.md 7.2), in the order
/// the frame carries them.
fn first_difference(h: &Header, expected: &Params) -> Option<Param> {
    use Method as M;
    let (got, n) = (&h.params, h.n);
    let first = |checks: &[(bool, Param)]| checks.iter().find(|c| c.0).map(|c| c.1);
    match (got.method, expected.method) {
        (M::Dense { values: va }, M::Dense { values: vb }) => first(&[(va != vb, Param::Values)]),
        (M::TopK { k: ka, values: va }, M::TopK { k: kb, values: vb }) => first(&[
            (va != vb, Param::Values),
            (ka.resolve(n) != kb.resolve(n), Param::K),
        ]),
        (
            M::Threshold {
                threshold: ta,
                values: va,
            },
            M::Threshold {
                threshold: tb,
                values: vb,
            },
        ) => first(&[
            (va != vb, Param::Values),
            (ta.to_bits() != tb.to_bits(), Param::Threshold),
        ]),
        (
            M::RandomK {
                k: ka,
                values: va,
                unbiased: ua,
            },
            M::RandomK {
                k: kb,
                values: vb,
                unbiased: ub,
            },
        ) => first(&[
            (va != vb, Param::Values),
            (ka.resolve(n) != kb.resolve(n), Param::K),
            (ua != ub, Param::Unbiased),
            (got.seed != expected.seed, Param::Seed),
            (got.step != expected.step, Param::Step),
            (got.tensor_id != expected.tensor_id, Param::TensorId),
        ]),
        (
            M::Quant {
                bits: ba,
                block: la,
                rounding: ra,
            },
            M::Quant {
                bits: bb,
                block: lb,
                rounding: rb,
            },
        ) => first(&[
            (ba != bb, Param::Bits),
            (la != lb, Param::Block),
            (ra != rb, Param::Rounding),
        ]),
        (
            M::Sign {
                scale: sa,
                zero_mask: za,
            },
            M::Sign {
                scale: sb,
                zero_mask: zb,
            },
        ) => first(&[(sa != sb, Param::SignScale), (za != zb, Param::ZeroMask)]),
        _ => Some(Param::Method),
    }
}

/// Validates every index and value of a parsed body.
pub(crate) fn validate_body(n: u64, body: &Body<'_>) -> Result<(), Error> {
    match *body {
        Body::Shaped {
            shape,
            scales,
            body,
            off,
        } => shape
            .validate(n as usize, scales, body)
            .map_err(|o| Error::BadValue { offset: off + o }),
        Body::MaskedSign {
            scales,
            signs,
            mask,
            mask_block,
            mixed,
            off,
            ..
        } => {
            let n = n as usize;
            crate::sign::validate(n, scales, signs)
                .and_then(|()| Mask::check(n, mask_block, mixed, scales, signs, mask).map(|_| ()))
                .map_err(|o| Error::BadValue { offset: off + o })
        }
        Body::Sparse {
            v,
            count,
            codec,
            idx,
            idx_off,
            vals,
            vals_off,
            ..
        } => {
            if let Some(codec) = codec {
                index::validate(codec, n, count, idx)
                    .map_err(|_| Error::BadIndex { offset: idx_off })?;
            }
            validate_values(v, count as usize, vals, vals_off)
        }
    }
}

fn validate_values(v: Values, count: usize, vals: &[u8], off: usize) -> Result<(), Error> {
    match v {
        Values::Int8 { .. } => {
            // Scales, then one code per value (segmented frames have more scale blocks).
            let s_len = vals.len() - count;
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

/// The scale unbiased random-k applies to every decoded value: n/k (`None` for every other
/// method and for k = 0).
pub(crate) fn unbiased_scale(h: &Header, count: u64) -> Option<f32> {
    match h.params.method {
        Method::RandomK { unbiased: true, .. } if count > 0 => {
            Some((h.n as f64 / count as f64) as f32)
        }
        _ => None,
    }
}

/// The first entry of an unbiased random-k body whose decoded value times n/k is not finite.
pub(crate) fn first_unbiased_overflow(h: &Header, body: &Body<'_>) -> Option<usize> {
    let Body::Sparse {
        v,
        count,
        segs,
        vals,
        ..
    } = *body
    else {
        return None;
    };
    let scale = unbiased_scale(h, count)?;
    let total = count as usize;
    let mut runs = values::ValueRuns::new(v, vals, total, segs);
    let mut buf = [0.0f32; index::BATCH];
    let mut j = 0usize;
    while j < total {
        let m = (total - j).min(index::BATCH);
        runs.read(j, &mut buf[..m]);
        if let Some(p) = buf[..m].iter().position(|&x| !(x * scale).is_finite()) {
            return Some(j + p);
        }
        j += m;
    }
    None
}

/// Parses `frame` and runs every check of [`crate::decode_into`] for an output of `n`
/// elements against `expected`.
pub(crate) fn decode_checked<'a>(
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
            v,
            count,
            vals,
            vals_off,
            ..
        },
    ) = (first_unbiased_overflow(&h, &body), &body)
    {
        let at = match *v {
            Values::Int8 { .. } => vals.len() - *count as usize + j,
            _ => j * v.value_bytes(),
        };
        return Err(Error::BadValue {
            offset: vals_off + at,
        });
    }
    Ok((h, body))
}

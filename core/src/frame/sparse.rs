//! Top-k, threshold and random-k frames: their kept entries (from a selection over the input,
//! a caller's index list, or a kept list of the chunked selection), the index section and the
//! values section.

use super::parse::{first_unbiased_overflow, parse_trusted};
use super::wire::{
    FLAG_SEGMENTED, M_THRESHOLD, M_TOPK, Put, break_trailer, write_fixed, write_method,
};
use super::{check_encode, check_input, max_frame_len, no_frame_on_error};
use crate::error::{Error, Param};
use crate::index::{self, IndexSizer, IndexWriter};
use crate::lanes::{One, Source};
use crate::method::{K, Method, Params, Values};
use crate::scalar::{self, Selection, magnitude_key};
use crate::select::{Kept, OutOfLimit};
use crate::{randomk, rng, select, values};

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
///
/// [`scratch_len`]: super::scratch_len
/// [`encode_into`]: super::encode_into
pub fn encode_selected_into(
    grad: &[f32],
    kept: &[u32],
    values: Values,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    no_frame_on_error(out, |out| {
        encode_selected(grad, kept, &[], values, scratch, out)
    })
}

/// [`encode_selected_into`] with int8 scale blocks that never span two segments: `segments`
/// holds the kept count of each consecutive run of `kept` (for example one per tensor of a
/// fused shard; zeros are skipped), summing to `kept.len()`, and every segment starts a new
/// scale block (FORMAT.md 3.2.1). With other values than int8, or fewer than two non-empty
/// segments, the frame is the one [`encode_selected_into`] writes. Decoders need nothing new:
/// the frame decodes with the same `Method::TopK { k: K::Count(kept.len() as u64), values }`.
///
/// `scratch` and `out` are sized by [`segmented_scratch_len`] and [`segmented_frame_len`]
/// with `segments.len()` (zeros included).
///
/// # Errors
/// [`Error::LengthMismatch`] when `segments` does not sum to `kept.len()`;
/// [`Error::TooLarge`] for more than `u32::MAX` non-empty segments; otherwise as
/// [`encode_selected_into`].
///
/// # Panics
/// Never.
pub fn encode_segmented_into(
    grad: &[f32],
    kept: &[u32],
    segments: &[u32],
    values: Values,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    no_frame_on_error(out, |out| {
        let (segs, _) = segments_on_wire(segments, kept.len(), grad.len(), values)?;
        encode_selected(grad, kept, segs, values, scratch, out)
    })
}

/// The segments a frame of `count` kept entries of `n` carries (`segments` when int8 values
/// and at least two non-empty ones, none otherwise) and how many are non-empty.
///
/// # Errors
/// [`Error::LengthMismatch`] when `segments` does not sum to `count`; [`Error::TooLarge`] for
/// more non-empty segments than a `u32` counts (the wire's field).
fn segments_on_wire(
    segments: &[u32],
    count: usize,
    n: usize,
    values: Values,
) -> Result<(&[u32], usize), Error> {
    let sum: u64 = segments.iter().map(|&l| u64::from(l)).sum();
    if sum != count as u64 {
        return Err(Error::LengthMismatch {
            expected: count,
            got: usize::try_from(sum).unwrap_or(usize::MAX),
        });
    }
    let non_empty = segments.iter().filter(|&&l| l > 0).count();
    if u32::try_from(non_empty).is_err() {
        return Err(Error::TooLarge { n: n as u64 });
    }
    let segs = match values {
        Values::Int8 { .. } if non_empty >= 2 => segments,
        _ => &[],
    };
    Ok((segs, non_empty))
}

/// Writes a top-k frame of `n` elements carrying the entries `e` (checked by the caller) with
/// `values` and the int8 segments `segs` (none: an unsegmented frame), from the header on;
/// `int8_scratch` holds a word per int8 scale block. Returns the frame length.
fn write_selected<E: Entries>(
    n: usize,
    e: &E,
    values: Values,
    segs: &[u32],
    int8_scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    let mut p = Put::new(out);
    let flags = if segs.is_empty() { 0 } else { FLAG_SEGMENTED };
    write_fixed(&mut p, M_TOPK, flags, n);
    p.values(values);
    let (count, codec, idx_len) = measure(n, e, values, segs, int8_scratch);
    p.u64(count);
    if !segs.is_empty() {
        let non_empty = segs.iter().filter(|&&l| l > 0);
        p.u32(non_empty.clone().count() as u32);
        for &len in non_empty {
            p.varint(u64::from(len));
        }
    }
    p.u8(codec);
    write_sparse_body(
        n,
        e,
        values,
        count as usize,
        codec,
        idx_len,
        &mut p,
        segs,
        int8_scratch,
    );
    p.finish()
}

/// [`encode_segmented_into`] from the kept entries alone: `kept.idx` (strictly ascending,
/// `< n`) and the f32 bits of their values `kept.bits`, so that a caller whose values live in
/// several buffers (the parts of a shard, each selected in place) needs no copy of the
/// `n`-element input. The bytes are those [`encode_segmented_into`] writes for an input whose
/// entry at `kept.idx[j]` is `f32::from_bits(kept.bits[j])`.
///
/// `scratch` holds at least [`kept_segmented_scratch_len`] words and `out` at least
/// [`segmented_frame_len`]`(n, kept.idx.len(), values, s)` bytes, where `s` counts the
/// non-empty segments (empty ones take no room). On error `out` holds no valid frame (its
/// magic is cleared).
///
/// # Errors
/// [`Error::LengthMismatch`] when `kept.idx` and `kept.bits` differ in length or `segments`
/// does not sum to the kept count; [`Error::TooLarge`] when `n` exceeds `u32::MAX`;
/// [`Error::UnsortedIndices`]; [`Error::NonFinite`] and [`Error::ValueOutOfRange`] naming the
/// index of a bad value; [`Error::ScratchTooSmall`], [`Error::BufferTooSmall`].
///
/// # Panics
/// Never.
pub fn encode_kept_segmented_into(
    n: usize,
    kept: Kept<'_>,
    segments: &[u32],
    values: Values,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    no_frame_on_error(out, |out| {
        if kept.idx.len() != kept.bits.len() {
            return Err(Error::LengthMismatch {
                expected: kept.idx.len(),
                got: kept.bits.len(),
            });
        }
        let count = kept.idx.len();
        let (segs, non_empty) = segments_on_wire(segments, count, n, values)?;
        if u32::try_from(n).is_err() {
            return Err(Error::TooLarge { n: n as u64 });
        }
        let method = Method::TopK {
            k: K::Count(count as u64),
            values,
        };
        method.validate()?;
        let need_out = if segs.is_empty() {
            max_frame_len(n, &method)
        } else {
            segmented_frame_len(n, count, values, non_empty)
        };
        if out.len() < need_out {
            return Err(Error::BufferTooSmall {
                needed: need_out,
                got: out.len(),
            });
        }
        let need_scratch = kept_segmented_scratch_len(count, values, non_empty);
        if scratch.len() < need_scratch {
            return Err(Error::ScratchTooSmall {
                needed: need_scratch,
                got: scratch.len(),
            });
        }
        check_kept_entries(n, &kept, values, None)?;
        Ok(write_selected(n, &kept, values, segs, scratch, out))
    })
}

/// Words of scratch [`encode_kept_segmented_into`] needs for `kept` entries in `segments`
/// segments (saturating): one per int8 scale block, none for other values.
pub const fn kept_segmented_scratch_len(kept: usize, values: Values, segments: usize) -> usize {
    match values {
        Values::Int8 { block } => kept
            .div_ceil(if block == 0 { 1 } else { block as usize })
            .saturating_add(segments)
            .saturating_add(1),
        _ => 0,
    }
}

/// Words of scratch [`encode_segmented_into`] needs for `kept` of `n` entries in `segments`
/// segments (saturating).
pub const fn segmented_scratch_len(
    n: usize,
    kept: usize,
    values: Values,
    segments: usize,
) -> usize {
    let method = Method::TopK {
        k: K::Count(kept as u64),
        values,
    };
    super::scratch_len(n, &method).saturating_add(segments)
}

/// The largest frame [`encode_segmented_into`] writes for `kept` of `n` entries in `segments`
/// segments, in bytes (saturating): the unsegmented frame's, the segment count (4 bytes), and
/// per segment a table entry (at most 10 bytes) and one more scale block (4 bytes).
pub const fn segmented_frame_len(n: usize, kept: usize, values: Values, segments: usize) -> usize {
    let method = Method::TopK {
        k: K::Count(kept as u64),
        values,
    };
    max_frame_len(n, &method)
        .saturating_add(4)
        .saturating_add(segments.saturating_mul(14))
}

fn encode_selected(
    grad: &[f32],
    kept: &[u32],
    segs: &[u32],
    values: Values,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    let params = Params::new(Method::TopK {
        k: K::Count(kept.len() as u64),
        values,
    });
    let n = grad.len();
    let (need_scratch, need_out) = if segs.is_empty() {
        (
            super::scratch_len(n, &params.method),
            max_frame_len(n, &params.method),
        )
    } else {
        (
            segmented_scratch_len(n, kept.len(), values, segs.len()),
            segmented_frame_len(n, kept.len(), values, segs.len()),
        )
    };
    check_encode(n, &params, scratch.len(), out.len())?;
    if scratch.len() < need_scratch {
        return Err(Error::ScratchTooSmall {
            needed: need_scratch,
            got: scratch.len(),
        });
    }
    if out.len() < need_out {
        return Err(Error::BufferTooSmall {
            needed: need_out,
            got: out.len(),
        });
    }
    check_input(grad, &params.method)?;
    let mut next_min = 0usize;
    for (position, &i) in kept.iter().enumerate() {
        let i = i as usize;
        if i < next_min || i >= grad.len() {
            return Err(Error::UnsortedIndices { position });
        }
        next_min = i + 1;
    }
    let sel = select::kept_scratch_len(n, kept.len());
    let e = Picked { g: grad, idx: kept };
    Ok(write_selected(
        n,
        &e,
        values,
        segs,
        &mut scratch[sel..],
        out,
    ))
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
///
/// [`encode_into`]: super::encode_into
pub fn encode_kept_into(
    n: usize,
    params: &Params,
    kept: Kept<'_>,
    out: &mut [u8],
) -> Result<usize, Error> {
    no_frame_on_error(out, |out| encode_kept(n, params, kept, out))
}

fn encode_kept(n: usize, params: &Params, kept: Kept<'_>, out: &mut [u8]) -> Result<usize, Error> {
    let (values, above) = check_kept(n, params, &kept, out.len())?;
    let mut p = Put::new(out);
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
    let len = p.finish();
    if unbiased {
        return check_unbiased_written(out, len, Some(kept.idx));
    }
    Ok(len)
}

/// The checks of [`encode_kept_into`] before anything is written: the method and its count,
/// the buffer, and every kept entry. Returns the value codec and, for threshold, the threshold.
fn check_kept(
    n: usize,
    params: &Params,
    kept: &Kept<'_>,
    out: usize,
) -> Result<(Values, Option<f32>), Error> {
    params.method.validate()?;
    let need = max_frame_len(n, &params.method);
    if out < need {
        return Err(Error::BufferTooSmall {
            needed: need,
            got: out,
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
        Method::TopK { k, values } | Method::RandomK { k, values, .. } => {
            if k.resolve(n as u64) != kept.idx.len() as u64 {
                return Err(Error::InvalidParams { param: Param::K });
            }
            (values, None)
        }
        Method::Threshold { threshold, values } => (values, Some(threshold)),
        _ => {
            return Err(Error::InvalidParams {
                param: Param::Method,
            });
        }
    };
    check_kept_entries(n, kept, values, above)?;
    Ok((values, above))
}

/// Every kept entry: indices strictly ascending and `< n`, values finite, within the value
/// type's range and, for threshold, above the threshold.
fn check_kept_entries(
    n: usize,
    kept: &Kept<'_>,
    values: Values,
    above: Option<f32>,
) -> Result<(), Error> {
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
    Ok(())
}

/// Unbiased random-k: the decoder multiplies every value by n/k, so a frame whose product
/// overflows would decode to ±inf. Refuses it with [`Error::ValueOutOfRange`] naming the
/// element (`index_of(j)`: the tensor index of kept entry `j`, `None` to draw it again), and
/// breaks the frame's checksum so that `out` holds no valid frame.
pub(crate) fn check_unbiased_written(
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
    break_trailer(out, len);
    Err(Error::ValueOutOfRange {
        index: usize::try_from(index).unwrap_or(usize::MAX),
    })
}

/// Whether [`encode_sparse_src`] encodes this method (top-k and threshold, `u32` lengths).
fn is_sparse_fused(n: usize, method: &Method) -> bool {
    matches!(method, Method::TopK { .. } | Method::Threshold { .. }) && u32::try_from(n).is_ok()
}

/// A top-k or threshold frame of checked input (after `check_encode` and `check_input`).
pub(crate) fn encode_sparse_checked(
    g: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    if is_sparse_fused(g.len(), &params.method) {
        // The input is checked: the limit cannot be met.
        if let Ok(len) = encode_sparse_src(&One(g), params, f32::INFINITY, scratch, out) {
            return len;
        }
    }
    encode_sparse_streamed(g, params, scratch, out)
}

/// A random-k frame of checked input: the values at the indices drawn for the frame's seed,
/// step and tensor id (held in `scratch` when `n` fits a `u32`, drawn again per pass otherwise).
pub(crate) fn encode_randomk(
    g: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    let Method::RandomK { k, values, .. } = params.method else {
        unreachable!("only random-k")
    };
    let n = g.len();
    let mut p = Put::new(out);
    write_method(&mut p, &params.method, n);
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
    p.finish()
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

/// Top-k or threshold frame of `src` (length fits a `u32`; after `check_encode`), checking
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
            p = Put::new(out);
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
    Ok(p.finish())
}

/// The top-k frame of a tensor of `n` elements whose kept entries are `kept` (`out` sized by
/// `check_encode`). Returns the frame length.
pub(crate) fn topk_frame(n: usize, kept: &Kept<'_>, values: Values, out: &mut [u8]) -> usize {
    let mut p = Put::new(out);
    write_fixed(&mut p, M_TOPK, 0, n);
    p.values(values);
    kept_body(n, kept, values, &mut p);
    p.finish()
}

/// Top-k or threshold frame by the streaming specification (tensors beyond `u32` indices).
fn encode_sparse_streamed(
    g: &[f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> usize {
    let n = g.len();
    let mut p = Put::new(out);
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
    p.finish()
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
    let (count, codec, idx_len) = measure(n, e, v, &[], int8_scratch);
    p.u64(count);
    p.u8(codec);
    write_sparse_body(
        n,
        e,
        v,
        count as usize,
        codec,
        idx_len,
        p,
        &[],
        int8_scratch,
    );
}

/// First pass: the kept count, the smallest index codec and, for int8, each block's absmax
/// magnitude key (into `int8_scratch`).
fn measure<E: Entries>(
    n: usize,
    e: &E,
    v: Values,
    segs: &[u32],
    int8_scratch: &mut [u32],
) -> (u64, u8, usize) {
    let mut sizer = IndexSizer::new(n as u64);
    e.each(|i, _| sizer.push(i as u64));
    if let Values::Int8 { block } = v {
        int8_absmax(e, block as usize, segs, int8_scratch);
    }
    let count = sizer.count();
    let (codec, len) = sizer.choose();
    (count, codec, len)
}

/// Each int8 block's absmax magnitude key, for blocks of `block` consecutive entries that
/// restart at every segment of `segs` (kept counts; empty: one segment).
fn int8_absmax<E: Entries>(e: &E, block: usize, segs: &[u32], scratch: &mut [u32]) {
    let mut c = 0usize;
    let mut b = 0usize;
    let mut m = 0u32;
    let mut segs = Segments::new(segs);
    e.each(|_, x| {
        if segs.starts_one() && c > 0 {
            scratch[b] = m;
            b += 1;
            c = 0;
            m = 0;
        }
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
    segs: &[u32],
    int8_scratch: &[u32],
) {
    let v_len = match v {
        Values::Int8 { block } if !segs.is_empty() => {
            let blocks: usize = segs
                .iter()
                .map(|&l| (l as usize).div_ceil(block as usize))
                .sum();
            4 * blocks + count
        }
        _ => v.section_len(count),
    };
    let (idx, rest) = p.buf[p.pos..].split_at_mut(idx_len);
    let vals = &mut rest[..v_len];
    let mut iw = IndexWriter::new(codec, n as u64, idx);
    let mut vw = ValueWriter::new(v, count, vals, segs, int8_scratch);
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
        int8_absmax(e, block as usize, &[], scratch);
    }
    let v_len = v.section_len(k);
    let mut vw = ValueWriter::new(v, k, &mut p.buf[p.pos..p.pos + v_len], &[], scratch);
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
    segs: Segments<'a>,
}

impl<'a> ValueWriter<'a> {
    fn new(v: Values, count: usize, out: &'a mut [u8], segs: &'a [u32], absmax: &'a [u32]) -> Self {
        let codes_at = match v {
            Values::Int8 { block } => {
                let blocks = if segs.is_empty() {
                    count.div_ceil(block as usize)
                } else {
                    segs.iter()
                        .map(|&l| (l as usize).div_ceil(block as usize))
                        .sum()
                };
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
            segs: Segments::new(segs),
        }
    }

    #[inline]
    fn push(&mut self, x: f32) {
        match self.v {
            Values::Int8 { block } => {
                if self.segs.starts_one() {
                    self.left = 0;
                }
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

/// Counts kept entries down through a segment table (kept counts; zeros skipped; empty: one
/// segment of every entry).
struct Segments<'a> {
    rest: &'a [u32],
    left: u64,
}

impl<'a> Segments<'a> {
    fn new(segs: &'a [u32]) -> Self {
        Segments {
            rest: segs,
            left: if segs.is_empty() { u64::MAX } else { 0 },
        }
    }

    /// Called once per entry, in order: true when this entry opens a segment.
    #[inline]
    fn starts_one(&mut self) -> bool {
        let opens = self.left == 0;
        while self.left == 0 {
            match self.rest.split_first() {
                Some((&len, rest)) => {
                    self.left = u64::from(len);
                    self.rest = rest;
                }
                None => self.left = u64::MAX,
            }
        }
        self.left -= 1;
        opens
    }
}

//! Slice-level error feedback (Seide et al. 2014; Karimireddy et al. 2019).
//!
//! One step encodes `x = gradient + residual` and leaves in the residual exactly what the frame
//! does not deliver: `residual_new = x - decoded(frame)`, computed by adding the decoded frame
//! with weight -1. So for every coordinate `sent + residual_new == gradient + residual_old`
//! (bit-exact where values travel as f32; otherwise up to one f32 rounding), and rounding and
//! quantization error are kept, not lost.
//!
//! Any finite `x` can be sent: a value beyond the range of f16 or bf16 values saturates (it is
//! sent as the type's largest finite value of its sign) and the residual keeps the excess, so
//! a residual that grows past the value type delays its coordinate instead of failing every
//! later step. For f16, `x - 65504` is exact while `|x| < 2^29`, so the identity above holds to
//! the bit there (for f16's own rounding of the value sent, as everywhere).
//!
//! [`feedback_step`] and [`feedback_step_bounded`] run a whole step on the calling thread.
//! [`step_chunk`], [`sparse_update`] and [`sparse_fix_up`] run one chunk of a step on a frame
//! cut into chunks ([`crate::frame::chunk`]), for callers that run the chunks on several
//! threads: per element the same operations, so the same residual bits.

use crate::error::{Error, Param};
use crate::frame::chunk::{Sections, at_tensor_index};
use crate::frame::{
    Body, Header, Shape, accumulate_into, check_encode, encode_checked, encode_src, is_fused,
    parse_trusted, sparse_batches, topk_frame,
};
use crate::lanes::{LANES, One, Sum};
use crate::method::{Method, Params, SignScale};
use crate::values::all_below;
use crate::{index, select, values};
use wide::f32x8;

/// One error-feedback step on one tensor: `residual += grad`, encode `residual` into `out`,
/// then `residual -= decoded(out)`. Returns the frame length in bytes.
///
/// `residual` has the same length as `grad` (all zeros before the first step); `scratch` and
/// `out` are sized as for [`crate::encode_into`]. The residual changes only after the frame is
/// complete, so on error the residual is untouched (and, as for [`crate::encode_into`], `out`
/// holds no valid frame: its magic is cleared).
///
/// Traffic: top-k, threshold and the SIMD quantization and sign kernels read `grad` and
/// `residual` once to encode their sum (checking it on the way), then once more to write
/// `residual = grad + residual - decoded` in one streaming pass.
///
/// # Errors
/// [`Error::LengthMismatch`] when the lengths differ; [`Error::InvalidParams`] for unbiased
/// random-k or unscaled sign (their residual would grow without bound); [`Error::NonFinite`]
/// naming the first index where the gradient or `gradient + residual` is NaN or infinite (a
/// finite sum beyond f16 or bf16 values is sent saturated, see the module's documentation);
/// every error of [`crate::encode_into`] but [`Error::ValueOutOfRange`].
///
/// # Panics
/// Never.
pub fn feedback_step(
    grad: &[f32],
    residual: &mut [f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    crate::frame::no_frame_on_error(out, |out| step(grad, residual, params, scratch, out))
}

/// An upper bound on the magnitudes of a residual, `|residual[i]| <= max_abs()` for every
/// element, kept by the caller next to the residual between steps of
/// [`feedback_step_bounded`].
///
/// Why: a step may change the residual only once every `gradient + residual` is known to be
/// finite, and [`feedback_step`] reads both buffers once to check that and once more to update
/// (20 bytes per element). With a bound below 2^127, a gradient below 2^127 too proves every
/// sum finite (see [`feedback_step_bounded`]), so the step reads the gradient once to check it
/// and then reads both and writes the residual in one pass (16 bytes per element).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResidualBound {
    max_abs: f32,
}

impl ResidualBound {
    /// No bound known: the next step takes [`feedback_step`]'s path (for top-k it then
    /// measures a bound).
    pub const UNKNOWN: Self = Self {
        max_abs: f32::INFINITY,
    };

    /// The bound of a residual of zeros (a new one).
    pub const ZERO: Self = Self { max_abs: 0.0 };

    /// A bound of `max_abs` that the caller vouches for (every `|residual[i]| <= max_abs`, as a
    /// step computed it); NaN or a negative value gives [`ResidualBound::UNKNOWN`].
    pub fn at_most(max_abs: f32) -> Self {
        if max_abs >= 0.0 {
            Self { max_abs }
        } else {
            Self::UNKNOWN
        }
    }

    /// The bound of `residual` (any length), by one read pass: its largest magnitude, or
    /// [`ResidualBound::UNKNOWN`] when an element is NaN or infinite.
    pub fn of(residual: &[f32]) -> Self {
        // Four independent lanes of maxima (a chain of scalar maxima runs at one element a
        // cycle); the largest magnitude is the same in any order.
        let inf = f32x8::splat(f32::INFINITY);
        let mut acc = [f32x8::splat(0.0); 4];
        let mut finite_lanes = inf.simd_eq(inf);
        let mut blocks = residual.chunks_exact(4 * LANES);
        for b in &mut blocks {
            for (t, a) in acc.iter_mut().enumerate() {
                let v = crate::lanes::load(&b[t * LANES..]).abs();
                finite_lanes &= v.simd_lt(inf);
                *a = a.fast_max(v);
            }
        }
        let mut max = 0.0f32;
        let mut finite = finite_lanes.all();
        for &x in blocks.remainder() {
            finite &= x.is_finite();
            max = larger(max, x.abs());
        }
        let m = acc[0].fast_max(acc[1]).fast_max(acc[2].fast_max(acc[3]));
        for &x in m.to_array().iter() {
            max = larger(max, x);
        }
        if finite {
            Self { max_abs: max }
        } else {
            Self::UNKNOWN
        }
    }

    /// The bound in the residual's units: every `|residual[i]|` is at most this (infinite when
    /// unknown).
    pub fn max_abs(self) -> f32 {
        self.max_abs
    }

    /// Whether this bound and `grad` prove every `grad[i] + residual[i]` (f32 addition) of the
    /// residual it holds for finite, which is all an error-feedback step needs of them (a sum
    /// beyond the value type saturates): the bound and every `|grad[i]|` are below 2^127. One
    /// read of `grad`; `false` says nothing (the sums may still be finite).
    pub fn proves_sums_finite(self, grad: &[f32]) -> bool {
        let half = half_limit(f32::INFINITY);
        let residual_below_half = self.max_abs < half;
        residual_below_half && all_below(&One(grad), half)
    }
}

/// Half of a magnitude limit: two f32 values below it in magnitude sum (in f32) to a value
/// below the limit. For a finite limit `L`, `L / 2` (exact); two floats below it sum to at most
/// the float before `L`. For no limit (infinity), 2^127: two floats below it sum to at most
/// `f32::MAX`, so the sum is finite.
fn half_limit(limit: f32) -> f32 {
    if limit.is_finite() {
        limit * 0.5
    } else {
        f32::from_bits(0x7f00_0000) // 2^127
    }
}

/// [`feedback_step`] with a [`ResidualBound`] kept between steps: same frame, same residual,
/// same errors; on success `bound` holds for the new residual.
///
/// For top-k (tensors of at least [`crate::select::SAMPLED_MIN`] elements, `0 < k < n`) with
/// `bound` below 2^127, the step checks that every `|grad[i]|` is below 2^127 too (one read of
/// `grad`: every sum is then finite), then one pass reads `grad` and `residual`,
/// stores their sum in `residual` and collects the top-k candidates; the kept entries are fixed
/// up afterwards (`residual[i] += -decoded[i]`), and the new bound is the larger of the smallest
/// kept magnitude (no element left unsent is larger) and the largest fixed-up residual. In every
/// other case (another method, a small tensor, an unknown bound, a gradient at or above 2^127)
/// the step is [`feedback_step`]'s; for top-k it then measures the bound with
/// [`ResidualBound::of`] (one more read of the residual), for other methods it leaves
/// [`ResidualBound::UNKNOWN`].
///
/// `bound` must hold for `residual` as passed: [`ResidualBound::ZERO`] for a new residual of
/// zeros, [`ResidualBound::of`], or what the last successful step on this residual left, with the
/// residual unchanged since. Use [`ResidualBound::UNKNOWN`] when unsure.
///
/// # Errors
/// As [`feedback_step`]; on error the residual and `bound` are untouched. If `bound` did not
/// hold, a sum that is not finite is still reported ([`Error::NonFinite`] with its index) but
/// only after the residual took the sums.
///
/// # Panics
/// Never.
pub fn feedback_step_bounded(
    grad: &[f32],
    residual: &mut [f32],
    bound: &mut ResidualBound,
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    crate::frame::no_frame_on_error(out, |out| {
        if let Some(len) = topk_one_pass(grad, residual, bound, params, scratch, out)? {
            return Ok(len);
        }
        let len = step(grad, residual, params, scratch, out)?;
        *bound = match params.method {
            Method::TopK { .. } => ResidualBound::of(residual),
            _ => ResidualBound::UNKNOWN,
        };
        Ok(len)
    })
}

/// One chunk of an error-feedback step on a dense, quantization or sign frame cut into chunks
/// by [`Sections`]: `residual += grad`, encode `residual` into the chunk's pieces of the frame,
/// then `residual += -1 * decoded(pieces)`, tile by tile while each tile is in cache.
///
/// `grad` and `residual` are the elements `start..start + grad.len()` of the tensor (`start`
/// and the end chunk boundaries, see [`Sections::align`]); `scales` and `body` are the chunk's
/// pieces of the frame's sections ([`Sections::pieces_mut`]; bytes past them are not written).
/// Per element these are the operations of [`feedback_step`]: once every chunk is written (and
/// the header and trailer, [`Sections::write_header`], [`Sections::finish`]), the frame holds
/// the bytes and the residual the f32 bits that [`feedback_step`] gives for the whole tensor.
///
/// Every `grad[i] + residual[i]` is checked before anything changes (one read of both; the
/// update's reads then come from the cache when the chunk fits in it): on error the residual
/// and the pieces are untouched.
///
/// # Errors
/// [`Error::LengthMismatch`] when `grad` and `residual` differ in length;
/// [`Error::InvalidParams`] with [`Param::Method`] when `params.method` is not the method of
/// `sections`, with [`Param::SignScale`] for unscaled sign (as [`feedback_step`]);
/// [`Error::BadChunk`] when the chunk is not on chunk boundaries; [`Error::BufferTooSmall`] for
/// a short piece; [`Error::NonFinite`] naming the tensor index of the chunk's first element
/// whose gradient or `gradient + residual` is NaN or infinite (a sum beyond the range of f16 or
/// bf16 values saturates, as in [`feedback_step`]).
///
/// # Panics
/// Never.
pub fn step_chunk(
    sections: &Sections,
    params: &Params,
    start: usize,
    grad: &[f32],
    residual: &mut [f32],
    scales: &mut [u8],
    body: &mut [u8],
) -> Result<(), Error> {
    if grad.len() != residual.len() {
        return Err(Error::LengthMismatch {
            expected: grad.len(),
            got: residual.len(),
        });
    }
    if params.method != *sections.method() {
        return Err(Error::InvalidParams {
            param: Param::Method,
        });
    }
    if let Method::Sign {
        scale: SignScale::None,
        ..
    } = params.method
    {
        return Err(Error::InvalidParams {
            param: Param::SignScale,
        });
    }
    let (scales, body) = sections.pieces_of(start, grad.len(), scales, body)?;
    if !all_below(&Sum(grad, residual), FEEDBACK_LIMIT)
        && let Some(e) = first_bad_sum(grad, residual)
    {
        return Err(at_tensor_index(e, start));
    }
    let (s0, b0) = sections.ranges(start, start + grad.len())?;
    let shape = sections.shape();
    let stream = (params.seed, params.step, params.tensor_id);
    let tile = chunk_tile(sections.align());
    for a in (0..grad.len()).step_by(tile) {
        let e = (a + tile).min(grad.len());
        let (s, b) = sections.ranges(start + a, start + e)?;
        let s = &mut scales[s.start - s0.start..s.end - s0.start];
        let b = &mut body[b.start - b0.start..b.end - b0.start];
        add_range(residual, grad, a, e);
        let r = &mut residual[a..e];
        shape.encode(r, start + a, stream, s, b);
        shape.decode(s, b, r, Some(-1.0));
    }
    Ok(())
}

/// Elements per tile of [`step_chunk`]: about [`FEEDBACK_TILE`], a multiple of `align`.
fn chunk_tile(align: usize) -> usize {
    if align >= FEEDBACK_TILE {
        align
    } else {
        FEEDBACK_TILE / align * align
    }
}

/// The fix-up of one chunk of a sparse error-feedback step whose residual already holds
/// `gradient + residual` (the one-pass step of [`feedback_step_bounded`], run in chunks):
/// `residual[i - start] += -value` for the sent entries whose index `i` falls in
/// `start..start + residual.len()`. Returns the largest `|residual[i - start]|` it leaves at
/// those entries (0 for none), as [`feedback_step_bounded`] measures it.
///
/// The sent entries are the frame's kept indices `idx` (ascending, as
/// [`SparseFrame::indices`] writes them) and their decoded values `val` (as
/// [`SparseFrame::values`] writes them); per element these are the operations of
/// [`feedback_step_bounded`].
///
/// # Errors
/// [`Error::LengthMismatch`] when `idx` and `val` differ in length (nothing changes then).
///
/// # Panics
/// Never (with indices out of order the result is unspecified, but no element outside the
/// chunk is touched).
///
/// [`SparseFrame::indices`]: crate::frame::chunk::SparseFrame::indices
/// [`SparseFrame::values`]: crate::frame::chunk::SparseFrame::values
pub fn sparse_fix_up(
    idx: &[u32],
    val: &[f32],
    start: usize,
    residual: &mut [f32],
) -> Result<f32, Error> {
    let (idx, val) = entries_in(idx, val, start, residual.len())?;
    Ok(subtract_entries(idx, val, start, residual))
}

/// One chunk of the residual update of a sparse error-feedback step (top-k, threshold,
/// random-k) whose frame is written: `residual += grad`, then `residual[i - start] += -value`
/// for the sent entries whose index `i` falls in `start..start + grad.len()`. Returns the
/// chunk's largest `|residual|` afterwards (infinite when an element is NaN or infinite, as
/// [`ResidualBound::of`]), so that chunks' results combine with `f32::max` into the new
/// residual's bound.
///
/// `grad` and `residual` are elements `start..start + grad.len()` of the tensor; `idx` and
/// `val` the sent entries as for [`sparse_fix_up`]. Per element these are the operations of
/// [`feedback_step`]: `(residual + grad) + (-value)`.
///
/// # Errors
/// [`Error::LengthMismatch`] when `grad` and `residual`, or `idx` and `val`, differ in length
/// (nothing changes then).
///
/// # Panics
/// Never.
pub fn sparse_update(
    idx: &[u32],
    val: &[f32],
    start: usize,
    grad: &[f32],
    residual: &mut [f32],
) -> Result<f32, Error> {
    if grad.len() != residual.len() {
        return Err(Error::LengthMismatch {
            expected: grad.len(),
            got: residual.len(),
        });
    }
    let (idx, val) = entries_in(idx, val, start, residual.len())?;
    add_into(residual, grad);
    subtract_entries(idx, val, start, residual);
    Ok(ResidualBound::of(residual).max_abs())
}

/// The sent entries (`idx` ascending, `val` their values) whose index falls in
/// `start..start + len`.
fn entries_in<'e>(
    idx: &'e [u32],
    val: &'e [f32],
    start: usize,
    len: usize,
) -> Result<(&'e [u32], &'e [f32]), Error> {
    if idx.len() != val.len() {
        return Err(Error::LengthMismatch {
            expected: idx.len(),
            got: val.len(),
        });
    }
    let end = start.saturating_add(len);
    let lo = idx.partition_point(|&i| (i as usize) < start);
    let hi = idx.partition_point(|&i| (i as usize) < end).max(lo);
    Ok((&idx[lo..hi], &val[lo..hi]))
}

/// The larger of a running maximum `max` (never NaN) and `a`, which a NaN `a` leaves as it is:
/// what `f32::max` gives for such a `max`, in one `maxss` instead of its NaN handling.
#[inline(always)]
fn larger(max: f32, a: f32) -> f32 {
    if a > max { a } else { max }
}

/// `r[i - start] += -v` for the entries of a chunk starting at `start`; the largest `|r|` left
/// there (0 for none).
fn subtract_entries(idx: &[u32], val: &[f32], start: usize, r: &mut [f32]) -> f32 {
    let mut max = 0.0f32;
    for (&i, &v) in idx.iter().zip(val) {
        if let Some(r) = (i as usize).checked_sub(start).and_then(|j| r.get_mut(j)) {
            *r += -v; // -1 * v, exactly
            max = larger(max, r.abs());
        }
    }
    max
}

/// The one-pass top-k step of [`feedback_step_bounded`]; `Ok(None)` (nothing read or written
/// but `grad`) where it does not apply.
fn topk_one_pass(
    grad: &[f32],
    residual: &mut [f32],
    bound: &mut ResidualBound,
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<Option<usize>, Error> {
    let Method::TopK { k, values } = params.method else {
        return Ok(None);
    };
    let n = grad.len();
    if n != residual.len() || n < select::SAMPLED_MIN || u32::try_from(n).is_err() {
        return Ok(None);
    }
    let k = k.resolve(n as u64) as usize;
    if k == 0 || k >= n {
        return Ok(None);
    }
    check_encode(n, params, scratch.len(), out.len())?;
    if !bound.proves_sums_finite(grad) {
        return Ok(None);
    }
    let sel = &mut scratch[..select::kept_scratch_len(n, k)];
    let Ok(kept) = select::topk_kept_update(grad, residual, k, FEEDBACK_LIMIT, sel) else {
        // Only when `bound` did not hold; the residual holds the sums now.
        let index = crate::values::first_non_finite(residual).unwrap_or(0);
        return Err(Error::NonFinite { index });
    };
    let len = topk_frame(n, &kept, values, out);
    // Every element left unsent is at most the smallest kept magnitude.
    let smallest_kept = kept
        .bits
        .iter()
        .map(|&b| f32::from_bits(b & 0x7fff_ffff))
        .fold(f32::INFINITY, f32::min);
    // Parses the frame just written from `kept`: it cannot fail (an error here would be a bug,
    // and would leave the residual holding the sums).
    let largest_fixed = subtract_kept(&out[..len], kept.idx, residual)?;
    *bound = ResidualBound {
        max_abs: smallest_kept.max(largest_fixed),
    };
    Ok(Some(len))
}

fn step(
    grad: &[f32],
    residual: &mut [f32],
    params: &Params,
    scratch: &mut [u32],
    out: &mut [u8],
) -> Result<usize, Error> {
    if grad.len() != residual.len() {
        return Err(Error::LengthMismatch {
            expected: grad.len(),
            got: residual.len(),
        });
    }
    match params.method {
        Method::RandomK { unbiased: true, .. } => {
            return Err(Error::InvalidParams {
                param: Param::Unbiased,
            });
        }
        Method::Sign {
            scale: SignScale::None,
            ..
        } => {
            return Err(Error::InvalidParams {
                param: Param::SignScale,
            });
        }
        _ => {}
    }
    check_encode(grad.len(), params, scratch.len(), out.len())?;
    let limit = FEEDBACK_LIMIT;
    if is_fused(grad.len(), &params.method) {
        // One pass over grad and residual encodes their sum and checks it; the residual
        // changes only after the frame is written.
        if let Ok(len) = encode_src(&Sum(grad, residual), params, limit, scratch, out) {
            let kept = match params.method {
                Method::TopK { k, .. } => {
                    let k = k.resolve(grad.len() as u64) as usize;
                    select::topk_kept_idx(grad.len(), k, scratch)
                }
                _ => None,
            };
            feedback_update(&out[..len], kept, grad, residual)?;
            return Ok(len);
        }
    } else if all_below(&Sum(grad, residual), limit) {
        add_into(residual, grad);
        let len = encode_checked(residual, params, scratch, out);
        subtract_sent(&out[..len], params, scratch, residual)?;
        return Ok(len);
    }
    if let Some(e) = first_bad_sum(grad, residual) {
        return Err(e);
    }
    add_into(residual, grad);
    debug_assert!(crate::values::first_non_finite(residual).is_none());
    let len = encode_checked(residual, params, scratch, out);
    subtract_sent(&out[..len], params, scratch, residual)?;
    Ok(len)
}

/// The magnitude limit of an error-feedback step's sums: finiteness only (a sum beyond the
/// range of f16 or bf16 values saturates when it is encoded, and the residual keeps the rest).
const FEEDBACK_LIMIT: f32 = f32::INFINITY;

/// The first element whose `grad[i] + residual[i]` an error-feedback step cannot encode:
/// [`Error::NonFinite`] for the first NaN or infinite sum (a NaN or an infinity in `grad` makes
/// its sum non-finite too, so one walk names the first index of either kind). `None` when every
/// sum is finite: any finite sum can be sent, a value beyond the range of f16 or bf16
/// saturating with the excess kept in the residual (see the module's documentation). One
/// vectorised read of both slices when they are fine; a scalar scan names the element
/// otherwise. A step that checks first changes nothing on a bad sum. Slices of other lengths:
/// [`Error::LengthMismatch`] (nothing is checked).
///
/// # Panics
/// Never.
pub fn first_bad_sum(grad: &[f32], residual: &[f32]) -> Option<Error> {
    if grad.len() != residual.len() {
        return Some(Error::LengthMismatch {
            expected: grad.len(),
            got: residual.len(),
        });
    }
    if all_below(&Sum(grad, residual), FEEDBACK_LIMIT) {
        return None;
    }
    let index = crate::scalar::first_non_finite_sum(grad, residual)?;
    Some(Error::NonFinite { index })
}

/// `residual += -1 * decoded(frame)` for a frame [`encode_checked`] just wrote from `residual`
/// with `scratch`: [`accumulate_into`]`(frame, residual, -1.0)`, except for random-k, whose
/// indices the encoder left in `scratch` (`u32`, n within `u32`): the values section is decoded
/// and subtracted at them, without drawing the indices a second time (the draw is most of a
/// random-k step).
fn subtract_sent(
    frame: &[u8],
    params: &Params,
    scratch: &[u32],
    residual: &mut [f32],
) -> Result<(), Error> {
    let n = residual.len();
    if let Method::RandomK { .. } = params.method
        && u32::try_from(n).is_ok()
        && let Ok((_, Body::Sparse { v, count, vals, .. })) = parse_trusted(frame)
        && let Some(idx) = scratch.get(..count as usize)
    {
        // Random-k frames have no segments.
        let mut runs = values::ValueRuns::new(v, vals, count as usize, &[]);
        let mut buf = [0.0f32; 64];
        for (j, idx) in idx.chunks(buf.len()).enumerate() {
            let x = &mut buf[..idx.len()];
            runs.read(j * 64, x);
            for (&i, &x) in idx.iter().zip(x.iter()) {
                residual[i as usize] += -x; // -1 * x: accumulate_into with weight -1
            }
        }
        return Ok(());
    }
    accumulate_into(frame, params, residual, -1.0).map(|_| ())
}

/// For a frame this crate just wrote from `g + r` (an error-feedback step whose checks all
/// passed): `r = (g + r) - decoded(frame)`, bit for bit what `r += g` followed by
/// [`accumulate_into`]`(frame, r, -1.0)` gives, in one streaming pass over `g` and `r` (sparse
/// frames: the subtractions are applied while the stretch they fall in is still in cache;
/// quantization and sign: tile by tile). `r` is untouched when the frame does not parse.
///
/// `kept`, when given, is the frame's index list as the encoder left it in its scratch
/// (ascending `u32`): a sparse frame with that many entries then takes its indices from there
/// instead of decoding its own index section (the values are still decoded from the frame).
fn feedback_update(
    frame: &[u8],
    kept: Option<&[u32]>,
    g: &[f32],
    r: &mut [f32],
) -> Result<(), Error> {
    let (h, body) = parse_trusted(frame)?;
    if h.n != g.len() as u64 || g.len() != r.len() {
        return Err(Error::ElementCount {
            expected: g.len() as u64,
            got: h.n,
        });
    }
    match body {
        Body::Sparse { .. } => update_sparse(&h, &body, kept, g, r),
        Body::MaskedSign { .. } => {
            add_into(r, g);
            crate::frame::apply(&h, &body, r, Some(-1.0));
        }
        Body::Shaped {
            shape,
            scales,
            body,
            ..
        } => match feedback_tile(shape) {
            Some(tile) => {
                for start in (0..r.len()).step_by(tile) {
                    let end = (start + tile).min(r.len());
                    add_range(r, g, start, end);
                    let s = &scales[shape.scales_len(start)..];
                    let b = &body[shape.body_len(start)..];
                    shape.decode(s, b, &mut r[start..end], Some(-1.0));
                }
            }
            None => {
                add_into(r, g);
                shape.decode(scales, body, r, Some(-1.0));
            }
        },
    }
    Ok(())
}

/// The sparse part of [`feedback_update`]: `r += g` up to each run of entries, then
/// `r[i] += -decoded[i]` for the run, while the stretch is in cache.
fn update_sparse(h: &Header, body: &Body<'_>, kept: Option<&[u32]>, g: &[f32], r: &mut [f32]) {
    let Body::Sparse {
        v,
        count,
        segs,
        vals,
        ..
    } = *body
    else {
        return;
    };
    let mut done = 0usize;
    match kept.filter(|kept| kept.len() as u64 == count) {
        Some(kept) => {
            let mut runs = values::ValueRuns::new(v, vals, kept.len(), segs);
            let mut vb = [0.0f32; index::BATCH];
            for (j, ib) in kept.chunks(index::BATCH).enumerate() {
                let vb = &mut vb[..ib.len()];
                runs.read(j * index::BATCH, vb);
                update_run(r, g, &mut done, ib.iter().map(|&i| i as usize), vb);
            }
        }
        None => sparse_batches(h, body, |ib, vb| {
            update_run(r, g, &mut done, ib.iter().copied(), vb);
        }),
    }
    add_range(r, g, done, r.len());
}

/// Elements per tile of [`feedback_update`] for a frame of `shape` that the SIMD decoders
/// take tile by tile (whole blocks of 8-bit or 4-bit quantization or of sign, multiples of 8
/// elements); `None` for the others, updated in two passes.
fn feedback_tile(shape: Shape) -> Option<usize> {
    let per = match shape {
        Shape::Quant { bits, block, .. }
            if (bits == 8 || bits == 4) && block.is_multiple_of(LANES) =>
        {
            block
        }
        Shape::Sign { block } if block.is_none_or(|b| b.is_multiple_of(LANES)) => {
            block.unwrap_or(LANES)
        }
        _ => return None,
    };
    Some(per * (FEEDBACK_TILE / per).max(1))
}

/// `r[i] += -decoded` at the kept indices `kept` of a sparse frame just written (trusted, with
/// `kept.len()` entries): the fix-up of an error-feedback step whose residual already holds
/// `g + r` everywhere. Returns the largest `|r[i]|` it leaves at those indices (0 for none).
fn subtract_kept(frame: &[u8], kept: &[u32], r: &mut [f32]) -> Result<f32, Error> {
    let (h, body) = parse_trusted(frame)?;
    // The frame was just written from these lists: a mismatch here is a bug, reported as the
    // frame's element count.
    let (
        Body::Sparse {
            v,
            count,
            segs,
            vals,
            ..
        },
        true,
    ) = (body, h.n == r.len() as u64)
    else {
        return Err(Error::ElementCount {
            expected: r.len() as u64,
            got: h.n,
        });
    };
    if count != kept.len() as u64 {
        return Err(Error::ElementCount {
            expected: r.len() as u64,
            got: h.n,
        });
    }
    // The kept entries are about 1% of the tensor, far apart and no longer in cache: ask for
    // the line of the entry 32 places ahead, so that the misses overlap.
    const AHEAD_KEPT: usize = 32;
    let mut max = 0.0f32;
    let mut runs = values::ValueRuns::new(v, vals, kept.len(), segs);
    let mut vb = [0.0f32; index::BATCH];
    for (j, ib) in kept.chunks(index::BATCH).enumerate() {
        let vb = &mut vb[..ib.len()];
        runs.read(j * index::BATCH, vb);
        let ahead = kept.get(j * index::BATCH + AHEAD_KEPT..).unwrap_or(&[]);
        for (t, (&i, &x)) in ib.iter().zip(vb.iter()).enumerate() {
            if let Some(&a) = ahead.get(t) {
                crate::lanes::prefetch(r, a as usize);
            }
            if let Some(r) = r.get_mut(i as usize) {
                *r += -x;
                max = larger(max, r.abs());
            }
        }
    }
    Ok(max)
}

/// One run of sparse entries of [`feedback_update`]: `r += g` from `done` through the run's last
/// index, then `r[i] -= x` for each entry (ascending indices below `r.len()`).
fn update_run(
    r: &mut [f32],
    g: &[f32],
    done: &mut usize,
    idx: impl DoubleEndedIterator<Item = usize> + Clone,
    vals: &[f32],
) {
    let Some(last) = idx.clone().next_back() else {
        return;
    };
    let end = (last + 1).clamp(*done, r.len());
    add_range(r, g, *done, end);
    *done = end;
    for (i, &x) in idx.zip(vals) {
        r[i] += -x;
    }
}

/// Elements per tile of the dense error-feedback update (rounded to whole blocks).
const FEEDBACK_TILE: usize = 4096;

/// `r[i] += g[i]` (same lengths).
fn add_into(r: &mut [f32], g: &[f32]) {
    add_range(r, g, 0, r.len());
}

/// `r[i] += g[i]` for `i` in `start..end` (cut to both lengths). A plain loop that the
/// compiler vectorizes, without software prefetch, which did not pay for this two-buffer pass
/// that only adds.
fn add_range(r: &mut [f32], g: &[f32], start: usize, end: usize) {
    let end = end.min(r.len()).min(g.len());
    let start = start.min(end);
    for (a, &b) in r[start..end].iter_mut().zip(&g[start..end]) {
        *a += b;
    }
}

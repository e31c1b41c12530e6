//! Decoding a checked frame: [`apply`] writes or adds its values into a dense slice;
//! [`decode_into`], [`accumulate_into`] and [`validate`] check a frame first.

use super::parse::{Body, decode_checked, unbiased_scale};
use super::{FrameInfo, Header};
use crate::error::{Error, Param};
use crate::lanes::prefetch;
use crate::method::Params;
use crate::zero_mask::Mask;
use crate::{index, randomk, rng, values};

/// Calls `f` with runs of entries of a validated sparse body: ascending indices and their
/// decoded values (random-k values already multiplied by the unbiased scale). Index sections
/// are decoded in batches ([`index::for_each_batch`]), values a batch at a time.
pub(crate) fn sparse_batches(h: &Header, body: &Body<'_>, mut f: impl FnMut(&[usize], &[f32])) {
    let Body::Sparse {
        v,
        count,
        segs,
        codec,
        idx,
        vals,
        ..
    } = *body
    else {
        return;
    };
    let total = count as usize;
    let mut runs = values::ValueRuns::new(v, vals, total, segs);
    let mut vb = [0.0f32; index::BATCH];
    let mut j = 0usize;
    match codec {
        Some(codec) => index::for_each_batch(codec, h.n, count, idx, |ib| {
            let m = ib.len().min(total - j);
            runs.read(j, &mut vb[..m]);
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
                runs.read(*j, &mut vb[..m]);
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
        Body::Shaped {
            shape,
            scales,
            body,
            ..
        } => shape.decode(scales, body, out, weight),
        Body::MaskedSign {
            block,
            scales,
            signs,
            mask,
            mask_block,
            ..
        } => {
            Mask::of_checked(out.len(), mask_block, mask).decode(block, scales, signs, out, weight)
        }
        Body::Sparse { .. } => match weight {
            None => sparse_batches(h, body, |ib, vb| {
                for (&i, &x) in ib.iter().zip(vb) {
                    out[i] = x;
                }
            }),
            Some(w) => add_sparse(h, body, out, w),
        },
    }
}

/// Adds `w * value` of every entry of a validated sparse body into `out`.
///
/// Software pipeline: a batch's lines are asked for when it is decoded, and it is added one
/// batch later, so that its misses overlap the decoding of the next batch. The asks of one
/// batch alternate with the adds of the one before (asked all at once, they would wait for free
/// miss buffers).
fn add_sparse(h: &Header, body: &Body<'_>, out: &mut [f32], w: f32) {
    let mut held_i = [0usize; index::BATCH];
    let mut held_x = [0.0f32; index::BATCH];
    let mut held = 0usize;
    // Validated indices are < out.len(): `get_mut` skips nothing, it only spares the panic path
    // (fewer instructions per entry than indexing).
    // `move`: the weight in a register, not read through a reference per entry.
    let add_one = move |out: &mut [f32], i: usize, x: f32| {
        if let Some(o) = out.get_mut(i) {
            *o += w * x;
        }
    };
    let add = move |out: &mut [f32], i: &[usize], x: &[f32]| {
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
///
/// [`peek`]: super::peek
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
/// Cost: the frame is read once to validate it, before the first write. A dense-shaped frame
/// then reads and writes `acc` once; a sparse frame reads and writes up to one cache line of
/// `acc` per entry (one line each at 1% kept, where entries fall about 400 bytes apart), so
/// what it costs depends on where `acc` lives (caches, page size) more than on the frame.
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

//! Slice-level error feedback (Seide et al. 2014; Karimireddy et al. 2019).
//!
//! One step encodes `x = gradient + residual` and leaves in the residual exactly what the frame
//! does not deliver: `residual_new = x - decoded(frame)`, computed by adding the decoded frame
//! with weight -1. So for every coordinate `sent + residual_new == gradient + residual_old`
//! (bit-exact where values travel as f32; otherwise up to one f32 rounding), and rounding and
//! quantization error are kept, not lost.

use crate::error::{Error, Param};
use crate::frame::{
    accumulate_into, add_into, check_encode, check_input, encode_checked, encode_src,
    feedback_update, is_fused,
};
use crate::lanes::Sum;
use crate::method::{Method, Params, SignScale};
use crate::select;
use crate::values::all_below;

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
/// naming the first index where the gradient or `gradient + residual` is NaN or infinite;
/// every error of [`crate::encode_into`].
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
        } => {
            return Err(Error::InvalidParams {
                param: Param::SignScale,
            });
        }
        _ => {}
    }
    check_encode(grad.len(), params, scratch.len(), out.len())?;
    let limit = crate::values::magnitude_limit(params.method.values());
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
    // Something is out of limit: find the first offender in the specified order. A NaN or an
    // infinity in `grad` makes its sum non-finite too, so one walk over the sums names the
    // first index of either kind.
    if let Some(index) = crate::scalar::first_non_finite_sum(grad, residual) {
        return Err(Error::NonFinite { index });
    }
    // Range of the value type, checked on the sums before the residual changes.
    if let Some(v) = params.method.values()
        && let Some(index) = grad
            .iter()
            .zip(residual.iter())
            .position(|(&g, &r)| !crate::values::fits(v, g + r))
    {
        return Err(Error::ValueOutOfRange { index });
    }
    add_into(residual, grad);
    debug_assert!(check_input(residual, &params.method).is_ok());
    let len = encode_checked(residual, params, scratch, out);
    subtract_sent(&out[..len], params, scratch, residual)?;
    Ok(len)
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
    if let Method::RandomK { k, values, .. } = params.method
        && u32::try_from(n).is_ok()
    {
        let k = k.resolve(n as u64) as usize;
        let section = frame
            .len()
            .checked_sub(4 + values.section_len(k))
            .and_then(|at| frame.get(at..frame.len() - 4));
        if let (Some(section), Some(idx)) = (section, scratch.get(..k)) {
            let mut buf = [0.0f32; 64];
            for (j, idx) in idx.chunks(buf.len()).enumerate() {
                let vals = &mut buf[..idx.len()];
                crate::values::decode_run(values, section, k, j * 64, vals);
                for (&i, &x) in idx.iter().zip(vals.iter()) {
                    residual[i as usize] += -x; // -1 * x: accumulate_into with weight -1
                }
            }
            return Ok(());
        }
    }
    accumulate_into(frame, params, residual, -1.0).map(|_| ())
}

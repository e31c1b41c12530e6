//! The two-phase collective's shard frames (`crate::collective`, `FORMAT.md` section 15): one
//! owner's part of every tensor as one frame, written and its residual updated by the core, one
//! call per shard. Top-k keeps each tensor's budget of its own part, as one segment per tensor
//! (`FORMAT.md` 3.2.1), so that an int8 scale block never spans two tensors.

use gradwire_core::feedback::sparse_update;
use gradwire_core::frame::chunk::SparseFrame;
use gradwire_core::values::{first_non_finite, magnitude_limit};
use gradwire_core::{Method, Params, encode_into, encode_segmented_into, feedback_step, select};

use crate::error::{Error, Result};
use crate::layout::shards::ShardLayout;

/// Work buffers of [`encode_shard`].
pub(crate) struct Buffers<'b> {
    pub(crate) scratch: &'b mut Vec<u32>,
    pub(crate) select: &'b mut Vec<u32>,
    pub(crate) kept: &'b mut Vec<u32>,
    pub(crate) segments: &'b mut Vec<u32>,
    pub(crate) sum: &'b mut Vec<f32>,
    pub(crate) sent: &'b mut Vec<f32>,
    pub(crate) frame: &'b mut Vec<u8>,
}

/// Encodes owner `j`'s shard `input` into `bufs.frame` with `params` and returns the frame's
/// length; with a `residual` (the shard's, same length) through error feedback, so that
/// `sent + residual_new == input + residual_old` per element. Top-k keeps each tensor's budget
/// of its own part (the per-tensor top-k of a bucket); the other methods encode the shard
/// whole. Errors name the tensor and its element index.
pub(crate) fn encode_shard(
    layout: &ShardLayout,
    j: usize,
    input: &[f32],
    residual: Option<&mut Vec<f32>>,
    params: &Params,
    bufs: &mut Buffers<'_>,
) -> Result<usize> {
    let method = params.method;
    let n = input.len();
    // Buffers hold the layout's largest frame (top-k: one int8 segment per tensor).
    let scratch = &mut bufs.scratch[..];
    let frame = &mut bufs.frame[..];
    let at = |e: gradwire_core::Error| -> Error {
        let index = match e {
            gradwire_core::Error::NonFinite { index }
            | gradwire_core::Error::ValueOutOfRange { index } => Some(index),
            _ => None,
        };
        match index {
            Some(i) if i < n => {
                let (t, index) = layout.locate(j, i);
                let e = match e {
                    gradwire_core::Error::NonFinite { .. } => {
                        gradwire_core::Error::NonFinite { index }
                    }
                    _ => gradwire_core::Error::ValueOutOfRange { index },
                };
                Error::core(&layout.tensors[t].name, None, e)
            }
            _ => Error::core(&format!("two-phase shard {j}"), None, e),
        }
    };
    let Method::TopK { values, .. } = method else {
        return match residual {
            Some(r) => feedback_step(input, r, params, scratch, frame),
            None => encode_into(input, params, scratch, frame),
        }
        .map_err(at);
    };
    // Top-k: the sums `input + residual` (what error feedback encodes), each tensor's own
    // top-k of its part, one frame; then the core's sparse residual update.
    let x: &[f32] = match &residual {
        Some(r) => {
            bufs.sum.clear();
            bufs.sum
                .extend(input.iter().zip(r.iter()).map(|(g, r)| r + g));
            bufs.sum
        }
        None => input,
    };
    if let Some(index) = first_non_finite(x) {
        return Err(at(gradwire_core::Error::NonFinite { index }));
    }
    let limit = magnitude_limit(Some(values));
    bufs.kept.clear();
    bufs.segments.clear();
    for ts in &layout.tensors {
        let (start, len, k) = (ts.starts[j], ts.lens[j], ts.budgets[j] as usize);
        if len == 0 || k == 0 {
            continue;
        }
        let part = &x[start..start + len];
        let need = select::kept_scratch_len(len, k);
        if bufs.select.len() < need {
            bufs.select.resize(need, 0);
        }
        let kept = select::topk_kept(part, k, limit, &mut bufs.select[..need]).map_err(|_| {
            let i = part
                .iter()
                .position(|v| v.abs() >= limit || v.is_nan())
                .unwrap_or(0);
            at(gradwire_core::Error::ValueOutOfRange { index: start + i })
        })?;
        bufs.kept.extend(kept.idx.iter().map(|&i| i + start as u32));
        bufs.segments.push(kept.idx.len() as u32);
    }
    // One segment per tensor: int8 scale blocks never span two tensors (FORMAT.md 3.2.1).
    let written =
        encode_segmented_into(x, bufs.kept, bufs.segments, values, scratch, frame).map_err(at)?;
    if let Some(r) = residual {
        // What the frame delivers, then `residual = (residual + input) - sent` by the core.
        let sparse = SparseFrame::parse(&frame[..written], params, n).map_err(at)?;
        let kept = sparse.kept();
        bufs.kept.resize(kept, 0);
        bufs.sent.resize(kept, 0.0);
        sparse.indices(bufs.kept).map_err(at)?;
        sparse.values(0, bufs.sent).map_err(at)?;
        sparse_update(bufs.kept, bufs.sent, 0, input, r).map_err(at)?;
    }
    Ok(written)
}

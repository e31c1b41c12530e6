//! The entries the core encodes in one call: one tensor ([`encode_whole`]), or a bucket's
//! tensors gathered into one frame ([`encode_bucket`]).

use gradwire_core::{
    K, Method, Params, ResidualBound, Values, accumulate_into, encode_into, encode_selected_into,
    feedback_step, feedback_step_bounded, scratch_len, select,
};

use super::Gradients;
use crate::error::{Error, Result};
use crate::layout::{Entry, EntryKind, Manifest};

/// Reusable buffers of one encoding task: core scratch, a bucket's gradients and residuals, and
/// the kept indices of per-tensor top-k.
#[derive(Debug, Default)]
pub(crate) struct Bufs {
    pub(crate) scratch: Vec<u32>,
    x: Vec<f32>,
    r: Vec<f32>,
    kept: Vec<u32>,
}

impl Bufs {
    /// The buffers, grown to what `entry` of `manifest` needs: the core scratch of its frame,
    /// and for a bucket its gathered gradients (with residuals when `feedback`) and kept
    /// indices, sized for the manifest's largest bucket.
    pub(crate) fn fit(&mut self, manifest: &Manifest, entry: &Entry, feedback: bool) -> &mut Self {
        let sizes = manifest.sizes();
        // Exactly the entry's need: entries grow it one after another, and a doubling
        // capacity would hold up to twice the largest.
        let need = scratch_len(entry.len, &entry.method);
        if self.scratch.len() < need {
            self.scratch.reserve_exact(need - self.scratch.len());
            self.scratch.resize(need, 0);
        }
        if self.kept.capacity() < sizes.kept {
            self.kept.reserve(sizes.kept - self.kept.len());
        }
        if feedback {
            super::grow(&mut self.r, sizes.bucket);
        }
        super::grow(&mut self.x, sizes.bucket);
        self
    }
}

/// Encodes the one tensor `g` of an entry with `params` into `frame` and returns the frame
/// length: the core's `encode_into`, or with a residual its error-feedback step
/// (`feedback_step_bounded` with the residual's bound before the step, `bound`, which it
/// updates). The input was checked in the step's first pass.
pub(crate) fn encode_whole(
    scratch: &mut [u32],
    label: &str,
    g: &[f32],
    params: &Params,
    residual: Option<(&mut [f32], &mut ResidualBound)>,
    frame: &mut [u8],
) -> Result<usize> {
    let core = |err| Error::core(label, None, err);
    match residual {
        None => encode_into(g, params, scratch, frame).map_err(core),
        Some((r, bound)) => {
            feedback_step_bounded(g, r, bound, params, scratch, frame).map_err(core)
        }
    }
}

/// Encodes a bucket (entry `entry` of `manifest`, its tensors gathered in member order) with
/// `params` into `frame` and returns the frame length. With error feedback, `res` holds the
/// members' residuals in member order (an empty one is a new residual, zeros) and is updated:
/// the gathered residual takes the core's error-feedback step, or for per-tensor top-k
/// `r += x`, each member's own top-k, the frame of those entries and `r -= decoded`.
pub(crate) fn encode_bucket<G: Gradients + ?Sized>(
    bufs: &mut Bufs,
    manifest: &Manifest,
    entry: &Entry,
    grads: &G,
    params: &Params,
    res: Option<&mut [Vec<f32>]>,
    frame: &mut [u8],
) -> Result<usize> {
    let core = |err| Error::core(&entry.label, None, err);
    let per_tensor_topk = entry.kind
        == EntryKind::Bucket {
            per_tensor_topk: true,
        };
    let n = entry.len;
    let x = &mut bufs.x[..n];
    gather(manifest, entry, x, |i| {
        grads.grad(manifest, entry.members[i])
    });
    let k = match *manifest.method() {
        Method::TopK { k, .. } if per_tensor_topk => Some(k),
        _ => None,
    };
    let values = entry.method.values().unwrap_or(Values::F32);
    let Some(res) = res else {
        let Some(k) = k else {
            return encode_into(x, params, &mut bufs.scratch, frame).map_err(core);
        };
        select_per_tensor(manifest, entry, x, k, &mut bufs.scratch, &mut bufs.kept);
        return encode_selected_into(x, &bufs.kept, values, &mut bufs.scratch, frame).map_err(core);
    };
    let r = &mut bufs.r[..n];
    gather(manifest, entry, r, |i| res[i].as_slice());
    let len = match k {
        None => feedback_step(x, r, params, &mut bufs.scratch, frame).map_err(core)?,
        Some(k) => {
            for (r, x) in r.iter_mut().zip(x.iter()) {
                *r += *x;
            }
            select_per_tensor(manifest, entry, r, k, &mut bufs.scratch, &mut bufs.kept);
            // Any finite sum can be sent: the sums beyond the value type are saturated for the
            // encoder (which refuses them anywhere in the bucket), then put back after the
            // update, which left `s - s = 0` where one was sent and `s` where not: `x - (s -
            // r)` is `x - s` there, the bits of the core's step (`x - decoded`), and `x` here.
            // Empty, so not allocated, in every step without such a sum.
            let limit = gradwire_core::values::magnitude_limit(Some(values));
            let mut beyond = Vec::new();
            if matches!(values, Values::F16 | Values::Bf16)
                && gradwire_core::values::first_at_or_above(r, limit).is_some()
            {
                for (i, x) in r.iter_mut().enumerate() {
                    let s = gradwire_core::values::saturate(values, *x);
                    if s != *x {
                        beyond.push((i, *x));
                        *x = s;
                    }
                }
            }
            let len = encode_selected_into(r, &bufs.kept, values, &mut bufs.scratch, frame)
                .map_err(core)?;
            accumulate_into(&frame[..len], params, r, -1.0).map_err(core)?;
            for (i, x) in beyond {
                r[i] = x - (gradwire_core::values::saturate(values, x) - r[i]);
            }
            len
        }
    };
    let mut at = 0;
    for (&t, slot) in entry.members.iter().zip(res.iter_mut()) {
        let numel = manifest.tensors()[t].numel;
        slot.clear();
        slot.extend_from_slice(&r[at..at + numel]);
        at += numel;
    }
    Ok(len)
}

/// Copies the members of `entry` one after the other into `out`, member `i` from `part(i)`; a
/// part of another length than its member (a residual not made yet) gives zeros.
fn gather<'a>(
    manifest: &Manifest,
    entry: &Entry,
    out: &mut [f32],
    part: impl Fn(usize) -> &'a [f32],
) {
    let mut at = 0;
    for (i, &t) in entry.members.iter().enumerate() {
        let seg = &mut out[at..at + manifest.tensors()[t].numel];
        match part(i) {
            src if src.len() == seg.len() => seg.copy_from_slice(src),
            _ => seg.fill(0.0),
        }
        at += seg.len();
    }
}

/// Fills `kept` with each member's own top-k indices (bucket coordinates, ascending), `k`
/// resolved for each member's own element count.
fn select_per_tensor(
    manifest: &Manifest,
    entry: &Entry,
    x: &[f32],
    k: K,
    scratch: &mut [u32],
    kept: &mut Vec<u32>,
) {
    kept.clear();
    let hist = select::topk_scratch_len(x.len()).min(scratch.len());
    let scratch = &mut scratch[..hist];
    let mut at = 0usize;
    for &t in &entry.members {
        let n = manifest.tensors()[t].numel;
        let seg = &x[at..at + n];
        let kt = usize::try_from(k.resolve(n as u64)).unwrap_or(n);
        let sel = select::topk(seg, kt, scratch);
        select::for_each_kept(seg, sel, |i| kept.push((at + i) as u32));
        at += n;
    }
}

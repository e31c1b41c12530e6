//! Buckets: small tensors fused into one frame, and the encoder that runs a whole
//! [`Manifest`](crate::bundle::Manifest) (tensors and buckets, with or without error feedback).
//!
//! A frame costs a fixed 30-40 bytes of header and checksum plus 12 bytes of bundle entry, and
//! a 384-element bias at top-k 1% keeps 3 values: fusing small tensors saves most of those
//! bytes. [`BucketConfig`] says how:
//!
//! - tensors are walked in manifest order. A tensor whose dense f32 bytes (`4 * n`) reach
//!   [`BucketConfig::bucket_bytes`] gets its own entry; a smaller one joins the open bucket,
//!   which is closed (and a new one opened) when the tensor would push it past the budget.
//!   A bucket takes its place in the bundle when it is opened, so the order is deterministic.
//!   `bucket_bytes == 0` fuses nothing;
//! - tensors with fewer than [`BucketConfig::dense_below`] elements are sent dense (with
//!   [`BucketConfig::dense_values`]), fused in their own dense buckets by the same rule;
//! - a bucket is one frame over the concatenation of its tensors (in manifest order). With a
//!   top-k method, [`TopKScope::PerTensor`] keeps each tensor's own top-k (`k` resolved for the
//!   tensor's `n`) inside the bucket frame; [`TopKScope::PerBucket`] keeps the top-k of the
//!   whole bucket (`k` resolved for the bucket's `n`). Other methods compress the
//!   concatenation as one tensor (block scales may then span two tensors);
//! - a bucket that ends up with one tensor is an ordinary tensor entry.
//!
//! On the receiving side each tensor is a contiguous range of the bucket's frame, so every
//! tensor is recovered exactly as sent.
//!
//! With int8 values, a scale covers [`gradwire_core::Values::Int8`]'s `block` kept values in a
//! row, which may span two tensors of a bucket: a tensor whose gradients are far smaller than
//! its neighbours' (the MiniLM key bias, ~1e-9) then decodes to zeros. Error feedback keeps what
//! is lost, but prefer f16/bf16 values, or no buckets, for models with such tensors. Error feedback keeps residuals per tensor name, also
//! for tensors in buckets: the encoder gathers them around the bucket's frame and scatters them
//! back.

use std::collections::HashMap;

use gradwire_core::{
    Method, Values, accumulate_into, encode_into, encode_selected_into, feedback_step, select,
};

use crate::bundle::{EntryKind, Manifest};
use crate::error::{Error, Result};
use crate::feedback::{ErrorFeedback, check_step_input};
use crate::tensor::Tensor;

/// Which top-k a bucket keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TopKScope {
    /// Each tensor of the bucket keeps its own top-k (`k` resolved for its own `n`), so every
    /// tensor sends as much as it would alone.
    #[default]
    PerTensor,
    /// The bucket keeps the top-k of its concatenation (`k` resolved for the bucket's `n`):
    /// tensors with larger gradients take more of the budget.
    PerBucket,
}

/// How tensors are fused into buckets and which go dense. The default fuses nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketConfig {
    /// Byte budget of a bucket, counted in dense f32 bytes (`4 * n` per tensor). Tensors of at
    /// least this many bytes get their own entry; `0` fuses nothing.
    pub bucket_bytes: usize,
    /// Which top-k a bucket keeps (top-k methods only).
    pub scope: TopKScope,
    /// Tensors with fewer elements than this are sent dense; `0` sends none dense.
    pub dense_below: usize,
    /// Value type of dense tensors: F32 (default), F16 or Bf16.
    pub dense_values: Values,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            bucket_bytes: 0,
            scope: TopKScope::PerTensor,
            dense_below: 0,
            dense_values: Values::F32,
        }
    }
}

impl BucketConfig {
    /// No buckets, nothing dense: one entry per tensor.
    pub fn none() -> Self {
        Self::default()
    }

    /// Buckets of `bucket_bytes` dense f32 bytes, per-tensor top-k, nothing dense.
    pub fn fused(bucket_bytes: usize) -> Self {
        BucketConfig {
            bucket_bytes,
            ..Self::default()
        }
    }

    /// The same configuration with another top-k scope.
    pub fn with_scope(mut self, scope: TopKScope) -> Self {
        self.scope = scope;
        self
    }

    /// The same configuration sending tensors of fewer than `dense_below` elements dense with
    /// `values`.
    pub fn with_dense_below(mut self, dense_below: usize, values: Values) -> Self {
        self.dense_below = dense_below;
        self.dense_values = values;
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] when `dense_values` is int8 (dense frames carry f32, f16 or bf16).
    pub fn validate(&self) -> Result<()> {
        if matches!(self.dense_values, Values::Int8 { .. }) {
            return Err(Error::config(
                "dense tensors travel as f32, f16 or bf16, not int8",
            ));
        }
        Ok(())
    }
}

/// One planned entry: the tensors (indices in manifest order) and whether it is dense.
#[derive(Debug)]
pub(crate) struct Planned {
    pub(crate) members: Vec<usize>,
    pub(crate) dense: bool,
}

/// Plans the entries for tensors of `numels` (manifest order), as the module docs describe.
pub(crate) fn plan(numels: &[usize], config: &BucketConfig) -> Vec<Planned> {
    // A bucket's length must fit the u32 indices of a frame's selection.
    let budget = config
        .bucket_bytes
        .min((u32::MAX as usize).saturating_mul(4));
    let mut entries: Vec<Planned> = Vec::new();
    // Open bucket per class (sparse, dense): entry index and dense bytes so far.
    let mut open: [Option<(usize, usize)>; 2] = [None, None];
    for (t, &n) in numels.iter().enumerate() {
        let dense = n < config.dense_below;
        let bytes = n.saturating_mul(4);
        if budget == 0 || bytes >= budget {
            entries.push(Planned {
                members: vec![t],
                dense,
            });
            continue;
        }
        let class = usize::from(dense);
        match open[class] {
            Some((e, used)) if used.saturating_add(bytes) <= budget => {
                entries[e].members.push(t);
                open[class] = Some((e, used.saturating_add(bytes)));
            }
            _ => {
                entries.push(Planned {
                    members: vec![t],
                    dense,
                });
                open[class] = Some((entries.len() - 1, bytes));
            }
        }
    }
    entries
}

/// Reusable buffers of the encoder.
#[derive(Debug, Default)]
pub(crate) struct Engine {
    scratch: Vec<u32>,
    frame: Vec<u8>,
    x: Vec<f32>,
    r: Vec<f32>,
    kept: Vec<u32>,
}

fn grow<T: Clone + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

impl Engine {
    /// Encodes every entry of `manifest` at `step`, with error feedback when `feedback` is
    /// given (its step must be `step`), and calls `sink(entry index, frame)` for each entry in
    /// order. Everything is checked before the first residual changes or `sink` is called.
    pub(crate) fn encode(
        &mut self,
        manifest: &Manifest,
        grads: &HashMap<String, Tensor>,
        step: u64,
        mut feedback: Option<&mut ErrorFeedback>,
        mut sink: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        manifest.check_gradients(grads)?;
        let tensors = manifest.tensors();
        let grad = |t: usize| -> &[f32] {
            tensors
                .get(t)
                .and_then(|info| grads.get(&info.name))
                .map_or(&[], Tensor::data)
        };
        // Pass 1: every check, before anything changes.
        for entry in manifest.entries() {
            let values = entry.method.values();
            for &t in &entry.members {
                let name = &tensors[t].name;
                let residual = feedback.as_deref().and_then(|fb| fb.residual(name));
                check_step_input(name, grad(t), residual, values)?;
            }
        }
        let sizes = manifest.sizes();
        grow(&mut self.frame, sizes.frame);
        grow(&mut self.scratch, sizes.scratch);
        if self.kept.capacity() < sizes.kept {
            self.kept.reserve(sizes.kept - self.kept.len());
        }
        if feedback.is_some() {
            grow(&mut self.r, sizes.bucket);
        }
        grow(&mut self.x, sizes.bucket);
        // Pass 2: the checks above cover every error of the kernels.
        for (e, entry) in manifest.entries().iter().enumerate() {
            let params = manifest.params(e, step);
            let core = |err| Error::core(&entry.label, None, err);
            let len = match (&entry.kind, feedback.as_deref_mut()) {
                (EntryKind::Tensor, None) => {
                    let t = entry.members.first().copied().unwrap_or(0);
                    encode_into(grad(t), &params, &mut self.scratch, &mut self.frame)
                        .map_err(core)?
                }
                (EntryKind::Tensor, Some(fb)) => {
                    let t = entry.members.first().copied().unwrap_or(0);
                    let g = grad(t);
                    let residual = fb.residual_for(&tensors[t].name, g.len())?;
                    feedback_step(g, residual, &params, &mut self.scratch, &mut self.frame)
                        .map_err(core)?
                }
                (EntryKind::Bucket { per_tensor_topk }, fb) => {
                    let n = entry.len;
                    let x = &mut self.x[..n];
                    let mut at = 0;
                    for &t in &entry.members {
                        let g = grad(t);
                        x[at..at + g.len()].copy_from_slice(g);
                        at += g.len();
                    }
                    let k = match manifest.method() {
                        Method::TopK { k, .. } if *per_tensor_topk => Some(*k),
                        _ => None,
                    };
                    let values = entry.method.values().unwrap_or(Values::F32);
                    match fb {
                        None => match k {
                            Some(k) => {
                                select_per_tensor(
                                    manifest,
                                    &entry.members,
                                    x,
                                    k,
                                    &mut self.scratch,
                                    &mut self.kept,
                                );
                                encode_selected_into(
                                    x,
                                    &self.kept,
                                    values,
                                    &mut self.scratch,
                                    &mut self.frame,
                                )
                                .map_err(core)?
                            }
                            None => encode_into(x, &params, &mut self.scratch, &mut self.frame)
                                .map_err(core)?,
                        },
                        Some(fb) => {
                            let r = &mut self.r[..n];
                            let mut at = 0;
                            for &t in &entry.members {
                                let info = &tensors[t];
                                let seg = &mut r[at..at + info.numel];
                                match fb.residual(&info.name) {
                                    Some(old) if old.len() == seg.len() => {
                                        seg.copy_from_slice(old);
                                    }
                                    _ => seg.fill(0.0),
                                }
                                at += info.numel;
                            }
                            let len = match k {
                                Some(k) => {
                                    for (ri, xi) in r.iter_mut().zip(x.iter()) {
                                        *ri += *xi;
                                    }
                                    select_per_tensor(
                                        manifest,
                                        &entry.members,
                                        r,
                                        k,
                                        &mut self.scratch,
                                        &mut self.kept,
                                    );
                                    let len = encode_selected_into(
                                        r,
                                        &self.kept,
                                        values,
                                        &mut self.scratch,
                                        &mut self.frame,
                                    )
                                    .map_err(core)?;
                                    accumulate_into(&self.frame[..len], &params, r, -1.0)
                                        .map_err(core)?;
                                    len
                                }
                                None => {
                                    feedback_step(x, r, &params, &mut self.scratch, &mut self.frame)
                                        .map_err(core)?
                                }
                            };
                            let mut at = 0;
                            for &t in &entry.members {
                                let info = &tensors[t];
                                let slot = fb.residual_for(&info.name, info.numel)?;
                                slot.copy_from_slice(&r[at..at + info.numel]);
                                at += info.numel;
                            }
                            len
                        }
                    }
                }
            };
            sink(e, &self.frame[..len]);
        }
        if let Some(fb) = feedback {
            fb.advance();
        }
        Ok(())
    }
}

/// Fills `kept` with each member's own top-k indices (bucket coordinates, ascending).
fn select_per_tensor(
    manifest: &Manifest,
    members: &[usize],
    x: &[f32],
    k: gradwire_core::K,
    scratch: &mut [u32],
    kept: &mut Vec<u32>,
) {
    kept.clear();
    let hist = select::topk_scratch_len(x.len()).min(scratch.len());
    let scratch = &mut scratch[..hist];
    let mut at = 0usize;
    for &t in members {
        let n = manifest.tensors().get(t).map_or(0, |i| i.numel);
        let seg = &x[at..at + n];
        let kt = usize::try_from(k.resolve(n as u64)).unwrap_or(n);
        let sel = select::topk(seg, kt, scratch);
        select::for_each_kept(seg, sel, |i| kept.push((at + i) as u32));
        at += n;
    }
}

//! Buckets: small tensors fused into one frame ([`BucketConfig`], [`TopKScope`]), and the
//! grouping of a manifest's tensors into entries.
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
//! is lost, but prefer f16/bf16 values, or no buckets, for models with such tensors.
//!
//! Error feedback keeps residuals per tensor name, also for tensors in buckets: the encoder
//! gathers them around the bucket's frame and scatters them back.

use gradwire_core::Values;

use crate::error::{Error, Result};

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
    pub(crate) fn validate(&self) -> Result<()> {
        if matches!(self.dense_values, Values::Int8 { .. }) {
            return Err(Error::config(
                "dense tensors travel as f32, f16 or bf16, not int8",
            ));
        }
        Ok(())
    }
}

/// The tensors of one entry (indices in manifest order) and whether it is sent dense.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) members: Vec<usize>,
    pub(crate) dense: bool,
}

/// Groups tensors of `numels` elements (manifest order) into entries, as the module docs
/// describe.
pub(crate) fn group(numels: &[usize], config: &BucketConfig) -> Vec<Group> {
    // A bucket's length must fit the u32 indices of a frame's selection.
    let budget = config
        .bucket_bytes
        .min((u32::MAX as usize).saturating_mul(4));
    let mut entries: Vec<Group> = Vec::new();
    // Open bucket per class (sparse, dense): entry index and dense bytes so far.
    let mut open: [Option<(usize, usize)>; 2] = [None, None];
    for (t, &n) in numels.iter().enumerate() {
        let dense = n < config.dense_below;
        let bytes = n.saturating_mul(4);
        if budget == 0 || bytes >= budget {
            entries.push(Group {
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
                entries.push(Group {
                    members: vec![t],
                    dense,
                });
                open[class] = Some((entries.len() - 1, bytes));
            }
        }
    }
    entries
}

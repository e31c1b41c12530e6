//! The shard layout of the two-phase collective: every tensor of a manifest cut into blocks,
//! dealt round-robin to the `W` owners (block-cyclic), so that clustered entries (a gradient
//! whose non-zeros sit in a few rows) spread over every owner.
//!
//! Blocks: `B` elements, the smallest multiple of the method's own block (quantization scales,
//! sign scales, int8 scales of a sparse method) that is at least [`TARGET_BLOCK`]; so no scale
//! block of a shard frame spans two blocks of the tensor except at the tensor's end. The dealing
//! goes on from one tensor to the next (the first block of a tensor goes to the owner after the
//! one that got the last block of the tensor before), so that small tensors do not all land on
//! rank 0. A tensor of fewer than `W` blocks leaves some owners an empty shard: they get no
//! frame of it.
//!
//! Top-k: tensor `t` keeps `k_t` entries (the method's `k` resolved for the whole tensor), split
//! over its shards by largest-remainder rounding of `k_t * len_j / n_t` (ties to the lower
//! owner), so the budgets sum to `k_t` exactly; worker and owner keep the same budget.

use gradwire_core::{K, Method, SignScale, Values, max_frame_len, scratch_len, tensor_id};

use crate::error::{Error, Result};
use crate::layout::{EntryKind, Manifest};

/// Elements per block, before rounding up to the method's block.
pub(crate) const TARGET_BLOCK: usize = 1024;

/// One tensor's shards.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorShards {
    /// Parameter name (the worker's residual key).
    pub(crate) name: String,
    /// Shape (for the worker's residual shape check).
    pub(crate) shape: Vec<usize>,
    /// Start in the manifest's flat layout.
    pub(crate) offset: usize,
    /// Elements.
    pub(crate) n: usize,
    /// Owner of block 0.
    pub(crate) first_owner: usize,
    /// Elements of each owner's shard.
    pub(crate) lens: Vec<usize>,
    /// The method of each owner's shard frames (top-k with that shard's budget).
    pub(crate) methods: Vec<Method>,
    /// Tensor id of the workers' frames of each shard.
    pub(crate) worker_ids: Vec<u64>,
    /// Tensor id of each owner's frame (a key distinct from the workers').
    pub(crate) owner_ids: Vec<u64>,
}

/// The shards of every tensor of a manifest, for one world size.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ShardLayout {
    pub(crate) world: usize,
    pub(crate) block: usize,
    pub(crate) tensors: Vec<TensorShards>,
    /// Largest shard frame, largest scratch, longest shard.
    pub(crate) max_frame: usize,
    pub(crate) max_scratch: usize,
    pub(crate) max_shard: usize,
    /// The manifest's layout id (the cache key, with the world size).
    pub(crate) layout_id: u64,
}

/// The method's own block: a shard block must be a multiple of it.
fn method_block(method: &Method) -> usize {
    let values_block = |v: Values| match v {
        Values::Int8 { block } => block as usize,
        _ => 1,
    };
    match *method {
        Method::Quant { block, .. } => block as usize,
        Method::Sign {
            scale: SignScale::MeanAbs { block },
        } => block as usize,
        Method::Sign {
            scale: SignScale::None,
        } => 1,
        Method::Dense { values } | Method::TopK { values, .. } => values_block(values),
        Method::Threshold { values, .. } | Method::RandomK { values, .. } => values_block(values),
    }
    .max(1)
}

/// The block size for `method`: the smallest multiple of its own block at least
/// [`TARGET_BLOCK`].
pub(crate) fn block_for(method: &Method) -> usize {
    let b = method_block(method);
    TARGET_BLOCK.div_ceil(b).saturating_mul(b)
}

/// Top-k budgets: `k` split over shards of `lens` (summing to `n`) by largest remainder.
pub(crate) fn budgets(k: u64, lens: &[usize], n: usize) -> Vec<u64> {
    if n == 0 {
        return vec![0; lens.len()];
    }
    let n128 = n as u128;
    let mut out: Vec<u64> = lens
        .iter()
        .map(|&l| ((u128::from(k) * l as u128) / n128) as u64)
        .collect();
    let given: u64 = out.iter().sum();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    // Largest remainder first; ties to the lower owner (a stable sort keeps index order).
    order.sort_by_key(|&j| std::cmp::Reverse((u128::from(k) * lens[j] as u128) % n128));
    for &j in order.iter().take((k - given) as usize) {
        out[j] += 1;
    }
    out
}

impl ShardLayout {
    /// The shards of `manifest`'s tensors over `world` owners.
    ///
    /// # Errors
    /// [`Error::Config`] for a manifest with buckets (two-phase shards tensors; buckets fuse
    /// them for the all-gather), or a method the two-phase collective does not cover
    /// (threshold and random-k: all-gather only).
    pub(crate) fn new(manifest: &Manifest, world: usize) -> Result<Self> {
        if world == 0 {
            return Err(Error::config("world size 0: a group has at least one rank"));
        }
        if let Some(e) = manifest
            .entries()
            .iter()
            .find(|e| e.kind != EntryKind::Tensor)
        {
            return Err(Error::config(format!(
                "the two-phase collective shards tensors, but `{}` is a bucket: use \
                 BucketConfig::none() with Collective::TwoPhase",
                e.label
            )));
        }
        let block = manifest
            .entries()
            .iter()
            .map(|e| block_for(&e.method))
            .max()
            .unwrap_or(TARGET_BLOCK);
        let mut next_owner = 0usize;
        let mut tensors = Vec::with_capacity(manifest.entries().len());
        let (mut max_frame, mut max_scratch, mut max_shard) = (0, 0, 0);
        for entry in manifest.entries() {
            if matches!(
                entry.method,
                Method::Threshold { .. } | Method::RandomK { .. }
            ) {
                return Err(Error::config(format!(
                    "the two-phase collective covers dense casts, quantization, sign and top-k; \
                     `{}` is sent as {}: use Collective::AllGather",
                    entry.label,
                    crate::method::format(&entry.method)
                )));
            }
            let tensor = &manifest.tensors()[entry.members[0]];
            let n = entry.len;
            let blocks = n.div_ceil(block);
            let first_owner = next_owner;
            next_owner = (next_owner + blocks) % world;
            let mut lens = vec![0usize; world];
            for b in 0..blocks {
                let len = block.min(n - b * block);
                lens[(first_owner + b) % world] += len;
            }
            let methods: Vec<Method> = match entry.method {
                Method::TopK { k, values } => {
                    let k_t = k.resolve(n as u64);
                    budgets(k_t, &lens, n)
                        .into_iter()
                        .map(|k| Method::TopK {
                            k: K::Count(k),
                            values,
                        })
                        .collect()
                }
                m => vec![m; world],
            };
            for j in 0..world {
                max_frame = max_frame.max(max_frame_len(lens[j], &methods[j]));
                max_scratch = max_scratch.max(scratch_len(lens[j], &methods[j]));
                max_shard = max_shard.max(lens[j]);
            }
            tensors.push(TensorShards {
                name: tensor.name.clone(),
                shape: tensor.shape.clone(),
                offset: entry.offset,
                n,
                first_owner,
                worker_ids: (0..world)
                    .map(|j| tensor_id(&format!("{}\u{0}shard {j}", entry.label)))
                    .collect(),
                owner_ids: (0..world)
                    .map(|j| tensor_id(&format!("{}\u{0}owner {j}", entry.label)))
                    .collect(),
                lens,
                methods,
            });
        }
        Ok(ShardLayout {
            world,
            block,
            tensors,
            max_frame,
            max_scratch,
            max_shard,
            layout_id: manifest.layout_id(),
        })
    }

    /// The element ranges (of the tensor) of owner `j`'s shard of tensor `t`, in order.
    pub(crate) fn ranges(&self, t: usize, j: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let ts = &self.tensors[t];
        let (w, b) = (self.world, self.block);
        let blocks = ts.n.div_ceil(b);
        let first = (j + w - ts.first_owner % w) % w;
        (first..blocks)
            .step_by(w)
            .map(move |blk| (blk * b, ts.n.min((blk + 1) * b)))
    }

    /// Copies owner `j`'s shard of tensor `t` out of `tensor` (the whole tensor) into `dst`.
    pub(crate) fn gather(&self, t: usize, j: usize, tensor: &[f32], dst: &mut Vec<f32>) {
        dst.clear();
        for (a, b) in self.ranges(t, j) {
            dst.extend_from_slice(&tensor[a..b]);
        }
    }

    /// Copies `src` (owner `j`'s shard of tensor `t`) back into `tensor` (the whole tensor).
    pub(crate) fn scatter(&self, t: usize, j: usize, src: &[f32], tensor: &mut [f32]) {
        let mut at = 0;
        for (a, b) in self.ranges(t, j) {
            tensor[a..b].copy_from_slice(&src[at..at + (b - a)]);
            at += b - a;
        }
    }

    /// Bytes of the shard message for owner `j` at most (lean header, lengths and frames; no
    /// envelope).
    pub(crate) fn max_message_len(&self, j: usize) -> usize {
        super::shard_message::HEADER_LEN
            + self
                .tensors
                .iter()
                .filter(|t| t.lens[j] > 0)
                .map(|t| 4 + max_frame_len(t.lens[j], &t.methods[j]))
                .sum::<usize>()
    }

    /// Frames in owner `j`'s messages.
    pub(crate) fn frames_of(&self, j: usize) -> usize {
        self.tensors.iter().filter(|t| t.lens[j] > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_sum_to_k_by_largest_remainder() {
        assert_eq!(budgets(10, &[4, 3, 3], 10), vec![4, 3, 3]);
        assert_eq!(budgets(1, &[4, 3, 3], 10), vec![1, 0, 0]);
        assert_eq!(budgets(2, &[3, 3, 4], 10), vec![1, 0, 1]);
        // Equal remainders: the lower owner first.
        assert_eq!(budgets(5, &[5, 5], 10), vec![3, 2]);
        for k in 0..50u64 {
            let lens = [7usize, 0, 13, 5];
            let b = budgets(k.min(25), &lens, 25);
            assert_eq!(b.iter().sum::<u64>(), k.min(25));
            assert_eq!(b[1], 0);
        }
    }
}

//! The shard layout of the two-phase collective (`crate::collective`): every tensor of a manifest
//! cut into `W` contiguous runs of blocks, one per owner, the first run going to the owner that
//! the tensor's own id names (`tensor_id(name) mod W`), the next to the owner after it, and so
//! on. So an owner's part of a tensor is one contiguous range of it (an error-feedback step runs
//! on the tensor's residual in place), and where a tensor's parts lie depends on the tensor
//! alone (its name, length, the block and `W`), not on the tensors before it.
//!
//! Blocks: `B` elements, the smallest multiple of the method's own block (quantization scales,
//! sign scales, int8 scales of a sparse method) that is at least [`TARGET_BLOCK`]; a tensor of
//! `b` blocks gives each run `b / W` blocks, the first `b mod W` runs one more, so the runs
//! differ by at most one block and a run ends on a block boundary except at the tensor's end.
//! A tensor of fewer than `W` blocks leaves some owners an empty part: they get no segment of it.
//!
//! Top-k: tensor `t` keeps `k_t` entries (the method's `k` resolved for the whole tensor), split
//! over its parts by largest-remainder rounding of `k_t * len_j / n_t` (ties to the lower
//! owner), so the budgets sum to `k_t` exactly; worker and owner keep the same budget, each
//! tensor's own top-k inside the shard's one frame (as the per-tensor top-k of a bucket).

use gradwire_core::{
    K, Method, SignScale, Values, max_frame_len, scratch_len, segmented_frame_len,
    segmented_scratch_len, tensor_id,
};

use super::{EntryKind, Manifest};
use crate::error::{Error, Result};

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
    /// Owner of the first run (block 0): `tensor_id(name) mod W`.
    pub(crate) first_owner: usize,
    /// Where each owner's part starts in the tensor (its elements `begins[j]..begins[j] +
    /// lens[j]`).
    pub(crate) begins: Vec<usize>,
    /// Elements of each owner's part of this tensor.
    pub(crate) lens: Vec<usize>,
    /// Where this tensor's part starts in each owner's shard (the concatenation of every
    /// tensor's part, in manifest order).
    pub(crate) starts: Vec<usize>,
    /// Top-k: entries each owner keeps of this tensor (largest remainder); empty otherwise.
    pub(crate) budgets: Vec<u64>,
}

/// The shards of every tensor of a manifest, for one world size. Owner `j`'s shard is the
/// concatenation of its part of every tensor, in manifest order: one frame per message.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ShardLayout {
    pub(crate) world: usize,
    pub(crate) block: usize,
    pub(crate) tensors: Vec<TensorShards>,
    /// Elements of each owner's shard.
    pub(crate) shard_lens: Vec<usize>,
    /// The method of each owner's frames (top-k: the sum of its budgets).
    pub(crate) methods: Vec<Method>,
    /// Tensor id of the workers' frames of each shard.
    pub(crate) worker_ids: Vec<u64>,
    /// Tensor id of each owner's frame (a key distinct from the workers').
    pub(crate) owner_ids: Vec<u64>,
    /// Largest shard frame, largest scratch (encode plus top-k selection), longest shard.
    pub(crate) max_frame: usize,
    /// The largest frame of each owner's shard, in bytes.
    pub(crate) frame_bounds: Vec<usize>,
    /// The largest escaped frame of each owner's reduced shard ([`escaped`]: f32 values), in
    /// bytes; 0 where the method has no escape.
    pub(crate) escape_bounds: Vec<usize>,
    pub(crate) max_scratch: usize,
    pub(crate) max_select: usize,
    /// The manifest's layout id (the cache key, with the world size).
    pub(crate) layout_id: u64,
    /// The manifest's method.
    pub(crate) method: Method,
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
            ..
        } => block as usize,
        Method::Sign {
            scale: SignScale::None,
            zero_mask,
        } => {
            if zero_mask {
                method.sign_mask_block()
            } else {
                1
            }
        }
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
    /// [`Error::Config`] for a manifest with buckets or with tensors sent by different methods
    /// (two-phase shards tensors, one frame per shard), or a method the two-phase collective
    /// does not cover (threshold and random-k: all-gather only).
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
        let method = *manifest.method();
        if let Some(e) = manifest.entries().iter().find(|e| e.method != method) {
            return Err(Error::config(format!(
                "the two-phase collective sends every tensor of a shard in one frame, but `{}` \
                 is sent as {}, not {}",
                e.label,
                crate::method::format(&e.method),
                crate::method::format(&method)
            )));
        }
        if matches!(method, Method::Threshold { .. } | Method::RandomK { .. }) {
            return Err(Error::config(format!(
                "the two-phase collective covers dense casts, quantization, sign and top-k; the \
                 model is sent as {}: use Collective::AllGather",
                crate::method::format(&method)
            )));
        }
        let block = block_for(&method);
        let mut tensors = Vec::with_capacity(manifest.entries().len());
        let mut shard_lens = vec![0usize; world];
        let mut kept = vec![0u64; world];
        let mut max_select = 0;
        for entry in manifest.entries() {
            let tensor = &manifest.tensors()[entry.members[0]];
            let n = entry.len;
            let (first_owner, begins, lens) = runs(&tensor.name, n, block, world);
            let budgets = match method {
                Method::TopK { k, .. } => budgets(k.resolve(n as u64), &lens, n),
                _ => Vec::new(),
            };
            for (j, &b) in budgets.iter().enumerate() {
                kept[j] += b;
                max_select =
                    max_select.max(gradwire_core::select::kept_scratch_len(lens[j], b as usize));
            }
            let starts = shard_lens.clone();
            for (total, len) in shard_lens.iter_mut().zip(&lens) {
                *total += len;
            }
            tensors.push(TensorShards {
                name: tensor.name.clone(),
                shape: tensor.shape.clone(),
                offset: entry.offset,
                n,
                first_owner,
                begins,
                lens,
                starts,
                budgets,
            });
        }
        if let Some(j) = shard_lens.iter().position(|&l| l > u32::MAX as usize) {
            return Err(Error::config(format!(
                "owner {j}'s shard would hold {} elements, more than a frame's 2^32 - 1: use a \
                 larger world or the all-gather",
                shard_lens[j]
            )));
        }
        let methods: Vec<Method> = (0..world)
            .map(|j| match method {
                Method::TopK { values, .. } => Method::TopK {
                    k: K::Count(kept[j]),
                    values,
                },
                m => m,
            })
            .collect();
        let (mut max_frame, mut max_scratch) = (0, 0);
        let mut frame_bounds = Vec::with_capacity(world);
        let mut escape_bounds = Vec::with_capacity(world);
        for j in 0..world {
            let (frame, scratch) = frame_and_scratch(shard_lens[j], &methods[j], &tensors, j);
            frame_bounds.push(frame);
            max_frame = max_frame.max(frame);
            max_scratch = max_scratch.max(scratch);
            let (escape, scratch) = escaped(&methods[j]).map_or((0, 0), |m| {
                frame_and_scratch(shard_lens[j], &m, &tensors, j)
            });
            escape_bounds.push(escape);
            max_frame = max_frame.max(escape);
            max_scratch = max_scratch.max(scratch);
        }
        let salt = manifest.layout_id();
        Ok(ShardLayout {
            world,
            block,
            tensors,
            worker_ids: (0..world)
                .map(|j| tensor_id(&format!("two-phase {salt:016x}\u{0}shard {j}")))
                .collect(),
            owner_ids: (0..world)
                .map(|j| tensor_id(&format!("two-phase {salt:016x}\u{0}owner {j}")))
                .collect(),
            shard_lens,
            methods,
            max_frame,
            frame_bounds,
            escape_bounds,
            max_scratch,
            max_select,
            layout_id: salt,
            method,
        })
    }

    /// The element range (of the tensor) of owner `j`'s part of tensor `t` (empty when the
    /// owner has no part of it).
    pub(crate) fn range(&self, t: usize, j: usize) -> std::ops::Range<usize> {
        let ts = &self.tensors[t];
        ts.begins[j]..ts.begins[j] + ts.lens[j]
    }

    /// Bytes of owner `j`'s frame at most; 0 for an empty shard (no frame).
    pub(crate) fn max_frame_len(&self, j: usize) -> usize {
        if self.shard_lens[j] > 0 {
            self.frame_bounds[j]
        } else {
            0
        }
    }

    /// The largest escaped frame of owner `j`'s reduced shard ([`escaped`]), in bytes: 0 for an
    /// empty shard or a method without an escape.
    pub(crate) fn max_escaped_frame_len(&self, j: usize) -> usize {
        if self.shard_lens[j] > 0 {
            self.escape_bounds[j]
        } else {
            0
        }
    }

    /// Frames in owner `j`'s messages (one, or none for an empty shard).
    pub(crate) fn frames_of(&self, j: usize) -> usize {
        usize::from(self.shard_lens[j] > 0)
    }
}

/// The runs of a tensor `name` of `n` elements in blocks of `block` over `world` owners: the
/// owner of the first run, then each owner's start and length in the tensor (see the module
/// docs).
pub(crate) fn runs(
    name: &str,
    n: usize,
    block: usize,
    world: usize,
) -> (usize, Vec<usize>, Vec<usize>) {
    let first_owner = (tensor_id(name) % world as u64) as usize;
    let blocks = n.div_ceil(block);
    let (each, extra) = (blocks / world, blocks % world);
    let mut begins = vec![0usize; world];
    let mut lens = vec![0usize; world];
    let mut at = 0usize;
    for i in 0..world {
        let owner = (first_owner + i) % world;
        let run = (each + usize::from(i < extra)).saturating_mul(block);
        let len = run.min(n - at);
        begins[owner] = at;
        lens[owner] = len;
        at += len;
    }
    (first_owner, begins, lens)
}

/// The escape of an owner's frame (FORMAT.md 15): a dense or top-k method with f16 or bf16
/// values sends a reduced shard holding a value beyond its value type with f32 values instead
/// (the same method otherwise), so that the owner never clamps what the ranks summed. `None`
/// for every other method (f32 and int8 values, quantization, sign: nothing to escape).
pub(crate) fn escaped(method: &Method) -> Option<Method> {
    match *method {
        Method::Dense {
            values: Values::F16 | Values::Bf16,
        } => Some(Method::Dense {
            values: Values::F32,
        }),
        Method::TopK {
            k,
            values: Values::F16 | Values::Bf16,
        } => Some(Method::TopK {
            k,
            values: Values::F32,
        }),
        _ => None,
    }
}

/// The largest frame and the scratch words of owner `j`'s shard of `n` elements with
/// `method`: a top-k frame with int8 values has one segment per tensor part with a budget
/// (FORMAT.md 3.2.1), every other frame is the core's plain bound.
fn frame_and_scratch(
    n: usize,
    method: &Method,
    tensors: &[TensorShards],
    j: usize,
) -> (usize, usize) {
    match *method {
        Method::TopK {
            k: K::Count(kept),
            values: values @ Values::Int8 { .. },
        } => {
            let parts = tensors
                .iter()
                .filter(|ts| ts.lens[j] > 0 && ts.budgets[j] > 0)
                .count();
            (
                segmented_frame_len(n, kept as usize, values, parts),
                segmented_scratch_len(n, kept as usize, values, parts),
            )
        }
        ref m => (max_frame_len(n, m), scratch_len(n, m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tensor_is_cut_into_contiguous_runs_owned_from_its_own_id() {
        for &(n, block, world) in &[
            (0usize, 1024usize, 3usize),
            (1, 1024, 1),
            (1, 1024, 4),
            (5000, 1024, 4),
            (4096, 1024, 4),
            (10_000, 1024, 3),
            (1_000_000, 1024, 7),
        ] {
            let (first, begins, lens) = runs("h.3.mlp.c_fc.weight", n, block, world);
            assert_eq!(
                first as u64,
                tensor_id("h.3.mlp.c_fc.weight") % world as u64
            );
            assert_eq!(lens.iter().sum::<usize>(), n);
            // In run order from the first owner: contiguous, on block boundaries (but the
            // tensor's end), at most one block apart.
            let mut at = 0;
            let blocks = n.div_ceil(block);
            for i in 0..world {
                let j = (first + i) % world;
                assert_eq!(begins[j], at, "n {n} W {world} run {i}");
                assert!(at % block == 0 || at == n, "n {n} W {world} run {i}");
                let want = (blocks / world + usize::from(i < blocks % world)) * block;
                assert_eq!(lens[j], want.min(n - at), "n {n} W {world} run {i}");
                at += lens[j];
            }
        }
    }

    #[test]
    fn a_tensors_parts_do_not_depend_on_the_tensors_before_it() {
        let method = crate::method::CompressionMethod::top_k_int8(0.01);
        let layout = |specs: Vec<crate::layout::TensorSpec>| {
            let m = crate::layout::Manifest::new(
                specs,
                &method,
                1,
                crate::layout::BucketConfig::none(),
            )
            .unwrap();
            ShardLayout::new(&m, 4).unwrap()
        };
        use crate::layout::TensorSpec;
        let a = layout(vec![
            TensorSpec::new("a", [3000]),
            TensorSpec::new("z", [50_000]),
        ]);
        let b = layout(vec![
            TensorSpec::new("b", [70_000]),
            TensorSpec::new("c", [10]),
            TensorSpec::new("z", [50_000]),
        ]);
        let (za, zb) = (&a.tensors[1], &b.tensors[2]);
        assert_eq!(
            (za.first_owner, &za.begins, &za.lens),
            (zb.first_owner, &zb.begins, &zb.lens)
        );
        assert_eq!(za.budgets, zb.budgets);
    }

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

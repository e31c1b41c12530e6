//! Aggregation of W ranks' contributions: sum, mean and sign majority vote.
//!
//! Every contribution is validated before anything is accumulated: the same tensors, in the
//! same order, with the same element counts, made with the agreed method, seed and step;
//! anything else is an error naming the tensor (or bucket) and the rank. Then every frame is
//! added straight into the result with [`gradwire_core::accumulate_into`], in rank order, so
//! every rank that aggregates the same contributions gets bit-identical results; no rank's
//! contribution is ever decoded into a dense copy of its own. (A large random-k entry's indices,
//! the same in every rank's frame, are drawn once and each frame's values added at them: the
//! same additions.)
//!
//! - [`Reduction::Sum`]: the f32 sum, in rank order.
//! - [`Reduction::Mean`]: the sum, divided once by W (the mean of `[3]`, `[3]`, `[3]` is `[3]`).
//! - [`Reduction::MajorityVote`]: for unscaled sign frames ([`gradwire_core::SignScale::None`]):
//!   each element is `+1` when the sum of the ±1 votes is `>= 0` (ties go to +) and `-1`
//!   otherwise.
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::aggregate::{Reduction, aggregate};
//! use gradwire::bucket::BucketConfig;
//! use gradwire::bundle::Manifest;
//! use gradwire::compressor::{CompressionMethod, GradientCompressor};
//! use gradwire::tensor::Tensor;
//!
//! let method = CompressionMethod::Core(gradwire::core::Method::Dense {
//!     values: gradwire::core::Values::F32,
//! });
//! let grads = HashMap::from([("w".to_string(), Tensor::vector(vec![3.0, 1.0]))]);
//! let manifest = Manifest::for_gradients(&grads, &method, 0, BucketConfig::none())?;
//! let mut bundles = Vec::new();
//! for rank in 0..3 {
//!     let mut sender = GradientCompressor::new(method.clone());
//!     let mut bundle = Vec::new();
//!     sender.compress_bundle(&manifest, &grads, rank, &mut bundle)?;
//!     bundles.push(bundle);
//! }
//! let mean = aggregate(&manifest, &bundles, 0, Reduction::Mean)?;
//! assert_eq!(mean, vec![3.0, 1.0]);
//! # Ok::<(), gradwire::error::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use gradwire_core::values::first_non_finite;
use gradwire_core::{Method, SignScale, accumulate_into, sign};
use rayon::prelude::*;

use crate::bundle::{ENTRY_HEADER_LEN, Entry, EntryKind, HEADER_LEN, Manifest, check_frame_of};
use crate::compressor::CompressedGradient;
use crate::error::{Error, Result};
use crate::parallel::{CHUNK, Parallelism, SparseList, Split, splits_sparse};
use crate::parallel_randomk::RandomKDraw;

/// How contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// The f32 sum, in rank order.
    Sum,
    /// The sum divided once by the number of contributions.
    Mean,
    /// Sign majority vote over unscaled sign frames: `+1` where the votes sum to `>= 0`
    /// (ties go to +), `-1` elsewhere.
    MajorityVote,
}

fn check_reduction(manifest: &Manifest, reduction: Reduction, count: usize) -> Result<()> {
    if count == 0 {
        return Err(Error::config(
            "nothing to aggregate: no contributions were given (one per rank, at least one)",
        ));
    }
    if reduction == Reduction::MajorityVote
        && let Some(entry) = manifest.entries().iter().find(|e| {
            !matches!(
                e.method,
                Method::Sign {
                    scale: SignScale::None
                }
            )
        })
    {
        return Err(Error::config(format!(
            "majority vote needs unscaled sign frames (SignSGDMajority); `{}` is sent as {}",
            entry.label,
            crate::compressor::format_method(&entry.method)
        )));
    }
    Ok(())
}

fn check_no_buckets(manifest: &Manifest) -> Result<()> {
    if manifest
        .entries()
        .iter()
        .any(|e| e.kind != EntryKind::Tensor)
    {
        return Err(Error::config(
            "per-tensor contributions need a manifest without buckets",
        ));
    }
    Ok(())
}

/// Elements [`finish`] divides and checks at a time (16 KiB).
const FINISH_CHUNK: usize = 4096;

/// Applies the reduction to the sum in `out`; the index of the first element that is not
/// finite (finite contributions whose f32 sum overflows; a majority vote never has one).
fn finish(out: &mut [f32], reduction: Reduction, count: usize) -> Option<usize> {
    match reduction {
        Reduction::Sum => first_non_finite(out),
        Reduction::Mean => {
            let w = count as f32;
            // Chunk by chunk, so that the check reads each chunk while it is in the L1 cache:
            // one pass over a large result instead of two.
            out.chunks_mut(FINISH_CHUNK)
                .enumerate()
                .find_map(|(c, chunk)| {
                    for x in chunk.iter_mut() {
                        *x /= w;
                    }
                    first_non_finite(chunk).map(|i| c * FINISH_CHUNK + i)
                })
        }
        Reduction::MajorityVote => {
            sign::majority(out);
            None
        }
    }
}

/// [`finish`] on the whole flat result `out`: on overflow, `out` zeroed and
/// [`Error::Overflow`] naming the tensor holding the first non-finite element.
fn finish_flat(
    manifest: &Manifest,
    out: &mut [f32],
    reduction: Reduction,
    count: usize,
) -> Result<()> {
    let Some(at) = finish(out, reduction, count) else {
        return Ok(());
    };
    out.fill(0.0);
    // Bucket entries hold several tensors: the one whose range holds the element.
    let (tensor, index) = manifest
        .tensors()
        .iter()
        .find(|t| (t.offset..t.offset + t.numel).contains(&at))
        .map_or((String::new(), at), |t| (t.name.clone(), at - t.offset));
    Err(Error::Overflow { tensor, index })
}

/// Aggregates the bundles of W ranks (`bundles[r]` is rank `r`'s) made at `step` into `out`,
/// resized to [`Manifest::flat_len`] (no allocation when it has the capacity, except for a
/// large random-k entry, whose indices are drawn once for all ranks: 4 bytes per kept element,
/// and its decoded values, 8). See the module docs for the checks and the reductions.
///
/// This is the serial path, on the calling thread; [`Aggregator`] gives the same bits on every
/// core.
///
/// # Errors
/// [`Error::Config`] for no bundle, or a majority vote over frames that are not unscaled
/// sign; every error of [`Manifest::check_bundle`], naming the rank (and the
/// tensor or bucket where an entry is at fault). Checks run on every bundle before anything is
/// accumulated, so `out` is untouched on those errors; a frame whose body turns out invalid
/// while accumulating is an [`Error::Core`] naming tensor and rank, and leaves `out` zeroed.
/// [`Error::Overflow`] when the f32 sum of finite contributions overflows (under
/// [`Reduction::Mean`] too: the sum is divided by W once, at the end, so a mean that would fit
/// is still an error when its sum does not), naming the tensor and the element of the first
/// non-finite result; `out` is zeroed.
pub fn aggregate_into<B: AsRef<[u8]>>(
    manifest: &Manifest,
    bundles: &[B],
    step: u64,
    reduction: Reduction,
    out: &mut Vec<f32>,
) -> Result<()> {
    check_reduction(manifest, reduction, bundles.len())?;
    for (rank, bundle) in bundles.iter().enumerate() {
        manifest.check_bundle(bundle.as_ref(), Some(rank), Some(step))?;
    }
    out.clear();
    out.resize(manifest.flat_len(), 0.0);
    // A large random-k entry's indices are the same in every rank's frame (the frames carry the
    // manifest's seed, step and tensor id, checked above): drawn once, at its first frame.
    let mut drawn: Vec<Option<RandomKDraw>> = Vec::new();
    let mut list = SparseList::default();
    for (rank, bundle) in bundles.iter().enumerate() {
        let result = manifest.walk(bundle.as_ref(), Some(rank), |e, frame| {
            let entry = &manifest.entries()[e];
            let acc = &mut out[entry.offset..entry.offset + entry.len];
            let params = manifest.params(e, step);
            if matches!(entry.method, Method::RandomK { .. })
                && splits_sparse(entry.len, &entry.method)
            {
                if drawn.len() <= e {
                    drawn.resize_with(e + 1, || None);
                }
                let draw = drawn[e].get_or_insert_with(|| {
                    let mut draw = RandomKDraw::default();
                    draw.draw_for(&params, entry.len, false, |_, _| true);
                    draw
                });
                if list.decode_randomk(frame, entry.len, &params, draw.indices()) {
                    list.add_range(0, acc, 1.0);
                    return Ok(());
                }
                // Invalid: the core's decoder names the fault (and adds nothing).
            }
            accumulate_into(frame, &params, acc, 1.0)
                .map(|_| ())
                .map_err(|err| Error::core(&entry.label, Some(rank), err))
        });
        if let Err(e) = result {
            out.fill(0.0);
            return Err(e);
        }
    }
    finish_flat(manifest, out, reduction, bundles.len())
}

/// Aggregates bundles like [`aggregate_into`], on every core of rayon's pool, keeping its
/// buffers between calls.
///
/// The result is the same f32 bits as [`aggregate_into`]'s, and so is every error: each entry's
/// output range belongs to one task, which adds the ranks' frames in rank order; a large entry
/// is cut into chunks of its output, each adding every rank's part in rank order (dense,
/// quantization and sign frames at block boundaries; top-k and threshold frames through their
/// indices, decoded once per rank; random-k frames through the indices drawn once for all
/// ranks). Zeroing, adding and the final reduction run per chunk while it is in cache. When
/// anything fails (an invalid frame body, a result that overflows f32), the serial path runs
/// again to report the same error.
///
/// ```
/// use std::collections::HashMap;
/// use gradwire::aggregate::{Aggregator, Reduction, aggregate};
/// use gradwire::bucket::BucketConfig;
/// use gradwire::bundle::Manifest;
/// use gradwire::compressor::{CompressionMethod, GradientCompressor};
/// use gradwire::parallel::Parallelism;
/// use gradwire::tensor::Tensor;
///
/// let method = CompressionMethod::SignSGD;
/// let grads = HashMap::from([("w".to_string(), Tensor::vector(vec![0.5; 1 << 20]))]);
/// let manifest = Manifest::for_gradients(&grads, &method, 0, BucketConfig::none())?;
/// let mut bundles = Vec::new();
/// for rank in 0..2 {
///     let mut sender = GradientCompressor::new(method.clone());
///     let mut bundle = Vec::new();
///     sender.compress_bundle(&manifest, &grads, rank, &mut bundle)?;
///     bundles.push(bundle);
/// }
/// let mut aggregator = Aggregator::new().with_parallelism(Parallelism::Parallel);
/// let mut mean = Vec::new();
/// aggregator.aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut mean)?;
/// assert_eq!(mean, aggregate(&manifest, &bundles, 0, Reduction::Mean)?);
/// # Ok::<(), gradwire::error::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct Aggregator {
    parallelism: Parallelism,
    /// Byte range of every frame: `frames[rank * entries + entry]`.
    frames: Vec<(usize, usize)>,
    /// Decoded indices and values of large sparse entries: one list per rank (and random-k's
    /// draw of the indices, which all ranks share) for each entry being aggregated at the same
    /// time.
    lists: Mutex<Vec<Lists>>,
}

impl Aggregator {
    /// An aggregator with [`Parallelism::Auto`]: every core of rayon's pool when it has more
    /// than one thread.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same aggregator using `parallelism`.
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Sets how many cores the next calls use.
    pub fn set_parallelism(&mut self, parallelism: Parallelism) {
        self.parallelism = parallelism;
    }

    /// How many cores aggregation uses.
    pub fn parallelism(&self) -> Parallelism {
        self.parallelism
    }

    /// As [`aggregate_into`], with this aggregator's [`Parallelism`]. After the first call with
    /// a manifest and world size, the aggregator's own buffers need no allocation (rayon may
    /// still allocate for its job bookkeeping).
    ///
    /// # Errors
    /// As [`aggregate_into`]: the same error for the same input.
    pub fn aggregate_into<B: AsRef<[u8]> + Sync>(
        &mut self,
        manifest: &Manifest,
        bundles: &[B],
        step: u64,
        reduction: Reduction,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if !self.parallelism.is_parallel_for(manifest.flat_len()) {
            return aggregate_into(manifest, bundles, step, reduction, out);
        }
        check_reduction(manifest, reduction, bundles.len())?;
        // One entry into rayon's pool for the whole call (a call from outside the pool waits
        // for each job it injects).
        let done = rayon::scope(|_| {
            let first_bad = bundles
                .par_iter()
                .enumerate()
                .map(|(rank, b)| manifest.check_bundle(b.as_ref(), Some(rank), Some(step)))
                .find_first(Result::is_err);
            match first_bad {
                Some(Err(e)) => Err(e),
                _ => Ok(self.parallel(manifest, bundles, step, reduction, out)),
            }
        })?;
        if done {
            Ok(())
        } else {
            // Something the checks above do not cover (a frame body, or a sum that overflows):
            // the serial path finds the same error and leaves `out` as it does.
            aggregate_into(manifest, bundles, step, reduction, out)
        }
    }

    /// The parallel path after the bundles passed [`Manifest::check_bundle`]; `false` when a
    /// frame turns out invalid or the result is not finite (`out` then holds partial sums).
    fn parallel<B: AsRef<[u8]> + Sync>(
        &mut self,
        manifest: &Manifest,
        bundles: &[B],
        step: u64,
        reduction: Reduction,
        out: &mut Vec<f32>,
    ) -> bool {
        let entries = manifest.entries();
        let (ne, count) = (entries.len(), bundles.len());
        // Where every frame lies: entries follow each other after the bundle header.
        self.frames.resize(count * ne, (0, 0));
        if ne > 0 {
            for (row, bundle) in self.frames.chunks_mut(ne).zip(bundles) {
                let mut pos = HEADER_LEN;
                let walked = manifest.walk(bundle.as_ref(), None, |e, frame| {
                    let start = pos + ENTRY_HEADER_LEN;
                    pos = start + frame.len();
                    row[e] = (start, pos);
                    Ok(())
                });
                if walked.is_err() {
                    return false;
                }
            }
        }
        let frames = &self.frames;
        let frame = |rank: usize, e: usize| -> &[u8] {
            let (a, b) = frames[rank * ne + e];
            bundles[rank].as_ref().get(a..b).unwrap_or(&[])
        };
        let finish = |acc: &mut [f32]| finish(acc, reduction, count).is_none();
        let pool = &self.lists;
        out.resize(manifest.flat_len(), 0.0);
        // One task per entry, ranks in order; a large entry's task cuts its output into chunks
        // (nested tasks, so that all entries and chunks share one parallel phase).
        let failed = AtomicBool::new(false);
        for_each_entry(entries, 0, out, 0, &|e, acc| {
            let entry = &entries[e];
            let ok = if let Some(split) = Split::new(entry.len, &entry.method) {
                split.accumulate(|r| frame(r, e), count, acc, &finish)
            } else if splits_sparse(entry.len, &entry.method) {
                let mut lease = ListLease::take(pool, count);
                let (lists, draw) = lease.lists();
                let decoded = if matches!(entry.method, Method::RandomK { .. }) {
                    // Every rank's frame carries the manifest's seed, step and tensor id
                    // (checked above), so one draw of the indices serves them all.
                    let params = manifest.params(e, step);
                    let n = entry.len;
                    draw.draw_for(&params, n, true, |_, _| true);
                    let idx = draw.indices();
                    lists
                        .par_iter_mut()
                        .enumerate()
                        .all(|(r, list)| list.decode_randomk(frame(r, e), n, &params, idx))
                } else {
                    lists
                        .par_iter_mut()
                        .enumerate()
                        .all(|(r, list)| list.decode(frame(r, e), entry.len, &entry.method))
                };
                if decoded {
                    let lists = &*lists;
                    acc.par_chunks_mut(CHUNK).enumerate().all(|(j, acc)| {
                        acc.fill(0.0);
                        for list in lists {
                            list.add_range(j * CHUNK, acc, 1.0);
                        }
                        finish(acc)
                    })
                } else {
                    false
                }
            } else {
                acc.fill(0.0);
                let params = manifest.params(e, step);
                (0..count).all(|rank| accumulate_into(frame(rank, e), &params, acc, 1.0).is_ok())
                    && finish(acc)
            };
            if !ok {
                failed.store(true, Ordering::Relaxed);
            }
        });
        !failed.load(Ordering::Relaxed)
    }
}

/// The decoded entries of one large sparse entry: one [`SparseList`] per rank, and random-k's
/// draw of the indices that all ranks share.
#[derive(Debug, Default)]
struct Lists {
    ranks: Vec<SparseList>,
    draw: RandomKDraw,
}

/// [`Lists`] taken from the aggregator's pool for one large sparse entry (entries run at the
/// same time each take their own), given back when dropped.
struct ListLease<'p> {
    pool: &'p Mutex<Vec<Lists>>,
    lists: Lists,
    count: usize,
}

impl<'p> ListLease<'p> {
    fn take(pool: &'p Mutex<Vec<Lists>>, count: usize) -> Self {
        let mut lists = pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .unwrap_or_default();
        if lists.ranks.len() < count {
            lists.ranks.resize_with(count, SparseList::default);
        }
        ListLease { pool, lists, count }
    }

    /// One list per rank, and the draw.
    fn lists(&mut self) -> (&mut [SparseList], &mut RandomKDraw) {
        (&mut self.lists.ranks[..self.count], &mut self.lists.draw)
    }
}

impl Drop for ListLease<'_> {
    fn drop(&mut self) {
        let lists = std::mem::take(&mut self.lists);
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(lists);
    }
}

/// Calls `f(e, range of entry e)` for entries `first..first + entries.len()`, whose ranges
/// tile `out` from flat offset `base`, on rayon's pool (halving the entries recursively).
fn for_each_entry<F>(entries: &[Entry], first: usize, out: &mut [f32], base: usize, f: &F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    match entries.len() {
        0 => {}
        1 => f(first, out),
        len => {
            let mid = len / 2;
            let at = entries[mid].offset;
            let (a, b) = out.split_at_mut(at.saturating_sub(base).min(out.len()));
            rayon::join(
                || for_each_entry(&entries[..mid], first, a, base, f),
                || for_each_entry(&entries[mid..], first + mid, b, at, f),
            );
        }
    }
}

/// As [`aggregate_into`], returning a new flat buffer.
///
/// # Errors
/// As [`aggregate_into`].
pub fn aggregate<B: AsRef<[u8]>>(
    manifest: &Manifest,
    bundles: &[B],
    step: u64,
    reduction: Reduction,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    aggregate_into(manifest, bundles, step, reduction, &mut out)?;
    Ok(out)
}

/// Aggregates per-tensor compressed gradients of W ranks (`contributions[r]` is rank `r`'s) made
/// at `step`, against a manifest without buckets, into `out` (flat layout of the manifest).
///
/// # Errors
/// [`Error::Config`] for no contribution, a manifest with buckets or a majority vote over
/// frames that are not unscaled sign; naming the tensor and the rank:
/// [`Error::MissingTensor`], [`Error::UnexpectedTensor`], [`Error::ShapeMismatch`],
/// [`Error::Disagreement`] (another step), [`Error::ParamsDiffer`] (a frame made with another
/// method, k, seed, ...: both configurations), [`Error::Core`] (a frame that fails
/// [`crate::bundle::check_frame`] otherwise: element count, checksum...). All checks run before anything is
/// accumulated; a frame body found invalid while accumulating leaves `out` zeroed.
/// [`Error::Overflow`] when the result is not finite, as for [`aggregate_into`] (`out` zeroed).
pub fn aggregate_compressed_into(
    manifest: &Manifest,
    contributions: &[&HashMap<String, CompressedGradient>],
    step: u64,
    reduction: Reduction,
    out: &mut Vec<f32>,
) -> Result<()> {
    check_reduction(manifest, reduction, contributions.len())?;
    check_no_buckets(manifest)?;
    for (rank, map) in contributions.iter().enumerate() {
        check_contribution(manifest, map, rank, step)?;
    }
    out.clear();
    out.resize(manifest.flat_len(), 0.0);
    for (rank, map) in contributions.iter().enumerate() {
        for (e, entry) in manifest.entries().iter().enumerate() {
            let Some(cg) = map.get(&entry.label) else {
                continue;
            };
            let acc = &mut out[entry.offset..entry.offset + entry.len];
            if let Err(err) = accumulate_into(cg.frame(), &manifest.params(e, step), acc, 1.0) {
                out.fill(0.0);
                return Err(Error::core(&entry.label, Some(rank), err));
            }
        }
    }
    finish_flat(manifest, out, reduction, contributions.len())
}

/// Checks rank `rank`'s per-tensor compressed gradients made at `step` against a manifest
/// without buckets (see [`aggregate_compressed_into`]), without decoding any frame body.
///
/// # Errors
/// Naming the tensor and the rank: [`Error::MissingTensor`], [`Error::UnexpectedTensor`],
/// [`Error::ShapeMismatch`], [`Error::Disagreement`] (another step), [`Error::ParamsDiffer`]
/// (a frame made with other parameters), [`Error::Core`] (a frame that fails [`crate::bundle::check_frame`]
/// otherwise); [`Error::Config`] for a manifest with buckets.
pub fn check_contribution(
    manifest: &Manifest,
    map: &HashMap<String, CompressedGradient>,
    rank: usize,
    step: u64,
) -> Result<()> {
    check_no_buckets(manifest)?;
    let rank_ctx = Some(rank);
    for (e, entry) in manifest.entries().iter().enumerate() {
        let Some(info) = entry
            .members
            .first()
            .and_then(|&t| manifest.tensors().get(t))
        else {
            continue;
        };
        let cg = map.get(&info.name).ok_or_else(|| Error::MissingTensor {
            tensor: info.name.clone(),
            rank: rank_ctx,
        })?;
        if cg.shape() != info.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                tensor: info.name.clone(),
                rank: rank_ctx,
                expected: info.shape.clone(),
                got: cg.shape().to_vec(),
            });
        }
        if cg.step() != step {
            return Err(Error::Disagreement {
                tensor: info.name.clone(),
                rank: rank_ctx,
                reason: format!("made at step {}, expected step {step}", cg.step()),
            });
        }
        check_frame_of(
            &info.name,
            rank_ctx,
            cg.frame(),
            &manifest.params(e, step),
            info.numel,
        )?;
    }
    if map.len() != manifest.tensors().len() {
        let mut extra: Vec<&String> = map
            .keys()
            .filter(|n| manifest.tensor(n).is_none())
            .collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(Error::UnexpectedTensor {
                tensor: (*name).clone(),
                rank: rank_ctx,
            });
        }
    }
    Ok(())
}

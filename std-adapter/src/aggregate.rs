//! Aggregation of W ranks' contributions: sum, mean and sign majority vote, in one path
//! ([`Aggregator`]) on the calling thread or on rayon's pool.
//!
//! Every contribution is validated before anything is accumulated: the same tensors, in the
//! same order, with the same element counts, made with the agreed method, seed and step;
//! anything else is an error naming the tensor (or bucket) and the rank. Then each entry's
//! output range is built from zeros by adding every rank's frame in rank order, so every rank
//! that aggregates the same contributions gets bit-identical results, whatever the
//! [`Parallelism`]. How an entry's frames are added is the plan its manifest chose: whole, by
//! the core's `accumulate_into`; a large dense, quantization or sign entry in chunks of its
//! output, each adding every rank's piece; a large sparse entry through each rank's decoded
//! (index, value) list, the chunks of the output adding the entries that fall into them (a
//! large random-k entry's indices, the same in every rank's frame, are drawn once). No rank's
//! contribution is ever decoded into a dense copy of its own.
//!
//! - [`Reduction::Sum`]: the f32 sum, in rank order.
//! - [`Reduction::Mean`]: the sum, divided once by W (the mean of `[3]`, `[3]`, `[3]` is `[3]`).
//! - [`Reduction::MajorityVote`]: for unscaled sign frames ([`gradwire_core::SignScale::None`]):
//!   each element is `+1` when the sum of the ±1 votes is `>= 0` (ties go to +) and `-1`
//!   otherwise. With a zero mask (`Method::Sign { zero_mask: true, .. }`) a zero element
//!   votes 0 (abstains): `+1` for a positive sum, `-1` for a negative one, `0` on a tie,
//!   which includes every rank voting 0.
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::{
//!     Aggregator, BucketConfig, CompressionMethod, GradientCompressor, Manifest, Reduction,
//!     Tensor,
//! };
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
//! let mut mean = Vec::new();
//! Aggregator::new().aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut mean)?;
//! assert_eq!(mean, vec![3.0, 1.0]);
//! # Ok::<(), gradwire::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use gradwire_core::frame::chunk::Sections;
use gradwire_core::values::first_non_finite;
use gradwire_core::{Method, SignScale, accumulate_into, sign, zero_mask};

use crate::engine::dense_chunks::Split;
use crate::engine::randomk_draw::RandomKDraw;
use crate::engine::sparse_list::SparseList;
use crate::engine::{Exec, Parallelism, Pool};
use crate::error::{Error, Result};
use crate::layout::bundle::{ENTRY_HEADER_LEN, HEADER_LEN};
use crate::layout::plan::{CHUNK, ReducePlan, dense_geometry};
use crate::layout::{CompressedGradient, Entry, EntryKind, Manifest, check_frame_of};

/// How contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// The f32 sum, in rank order.
    Sum,
    /// The sum divided once by the number of contributions.
    Mean,
    /// Sign majority vote over unscaled sign frames: `+1` where the votes sum to `>= 0`
    /// (ties go to +), `-1` elsewhere; with a zero mask, zero votes abstain and a tie gives 0.
    MajorityVote,
}

/// [`Error::Config`] for no contributions, or a majority vote over frames other than unscaled
/// signs.
pub(crate) fn check_reduction(
    manifest: &Manifest,
    reduction: Reduction,
    count: usize,
) -> Result<()> {
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
                    scale: SignScale::None,
                    ..
                }
            )
        })
    {
        return Err(Error::config(format!(
            "majority vote needs unscaled sign frames (SignSGDMajority); `{}` is sent as {}",
            entry.label,
            crate::method::format(&entry.method)
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
/// finite (finite contributions whose f32 sum overflows; a majority vote never has one). A zero
/// of the sum is taken as 0.0, never -0.0 (a sum started from 0.0 has no -0.0; a chunked sum
/// that writes its first contribution may, [`Split::accumulate`]); a negative mean that rounds
/// to zero is -0.0, as the division gives it.
fn finish(out: &mut [f32], reduction: Reduction, count: usize, method: &Method) -> Option<usize> {
    // `+ 0.0` turns -0.0 into 0.0 and changes nothing else; it comes before the division, as
    // in a sum from zeros: a negative mean that rounds to zero stays -0.0.
    match reduction {
        Reduction::Sum => map_then_check(out, None, |x| x + 0.0),
        Reduction::Mean => {
            let w = count as f32;
            if count.is_power_of_two() {
                // The same bits as dividing, at a multiplication's cost (see `divide`).
                let inverse = 1.0 / w;
                map_then_check(out, None, |x| (x + 0.0) * inverse)
            } else {
                map_then_check(out, None, |x| (x + 0.0) / w)
            }
        }
        Reduction::MajorityVote => {
            majority(out, method);
            None
        }
    }
}

/// Writes `src[i] / w` into `dst[i]` (`dst` and `src` of one length; `src` `None`: `dst` in
/// place): the mean of sums of `w` contributions. For a power of two `w`, multiplying by its
/// inverse (exact) rounds the same real number as dividing, so it gives the same bits at a
/// multiplication's cost (a division costs several times as much: it bounded the mean of a
/// large model).
pub(crate) fn divide(dst: &mut [f32], src: Option<&[f32]>, w: usize) {
    let wf = w as f32;
    match (src, w.is_power_of_two()) {
        (None, true) => {
            let inverse = 1.0 / wf;
            dst.iter_mut().for_each(|x| *x *= inverse);
        }
        (None, false) => dst.iter_mut().for_each(|x| *x /= wf),
        (Some(src), true) => {
            let inverse = 1.0 / wf;
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = s * inverse);
        }
        (Some(src), false) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s / wf),
    }
}

/// Writes `op` of every element of `src` (of `out`'s length; `None`: `out` itself) into
/// `out`, then returns the index of the first that is not finite; chunk by chunk, so that the
/// check reads each chunk while it is in the L1 cache (one pass over a large result instead of
/// two).
///
/// # Panics
/// When `src` is shorter than `out` (a caller's bug, never input data).
pub(crate) fn map_then_check(
    out: &mut [f32],
    src: Option<&[f32]>,
    op: impl Fn(f32) -> f32,
) -> Option<usize> {
    out.chunks_mut(FINISH_CHUNK)
        .enumerate()
        .find_map(|(c, chunk)| {
            match src {
                Some(s) => {
                    let from = &s[c * FINISH_CHUNK..c * FINISH_CHUNK + chunk.len()];
                    chunk.iter_mut().zip(from).for_each(|(x, &v)| *x = op(v));
                }
                None => chunk.iter_mut().for_each(|x| *x = op(*x)),
            }
            first_non_finite(chunk).map(|i| c * FINISH_CHUNK + i)
        })
}

/// The majority vote over summed votes made with `method`: ties go to + for plain signs and
/// to 0 for signs with a zero mask, whose zero votes abstain
/// ([`gradwire_core::zero_mask::majority`]).
pub(crate) fn majority(votes: &mut [f32], method: &Method) {
    match method {
        Method::Sign {
            zero_mask: true, ..
        } => zero_mask::majority(votes),
        _ => sign::majority(votes),
    }
}

/// [`Error::Overflow`] for the non-finite result at element `at` of the flat layout, naming the
/// tensor holding it (a bucket entry holds several).
fn overflow(manifest: &Manifest, at: usize) -> Error {
    let (tensor, index) = manifest
        .tensors()
        .iter()
        .find(|t| (t.offset..t.offset + t.numel).contains(&at))
        .map_or((String::new(), at), |t| (t.name.clone(), at - t.offset));
    Error::Overflow { tensor, index }
}

/// Aggregates contributions on the calling thread or on every core of rayon's pool, keeping its
/// buffers between calls (see the module docs). The result is the same f32 bits, and every
/// error the same, with every [`Parallelism`].
///
/// Memory: the byte range of every frame (16 bytes per rank and entry) and, for large sparse
/// entries being aggregated at the same time, each rank's decoded indices and values (8 bytes
/// per kept entry per rank); after the first call with a manifest and world size, the
/// aggregator's own buffers need no allocation (rayon may still allocate for its job
/// bookkeeping).
///
/// ```
/// use std::collections::HashMap;
/// use gradwire::{
///     Aggregator, BucketConfig, CompressionMethod, GradientCompressor, Manifest, Parallelism,
///     Reduction, Tensor,
/// };
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
/// let mut pooled = Aggregator::new().with_parallelism(Parallelism::Parallel);
/// let (mut a, mut b) = (Vec::new(), Vec::new());
/// pooled.aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut a)?;
/// Aggregator::serial().aggregate_into(&manifest, &bundles, 0, Reduction::Mean, &mut b)?;
/// assert_eq!(a, b);
/// # Ok::<(), gradwire::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct Aggregator {
    parallelism: Parallelism,
    /// Byte range of every frame: `frames[rank * entries + entry]`.
    frames: Vec<(usize, usize)>,
    /// Decoded lists of large sparse entries, one set per entry aggregated at the same time.
    lists: Pool<Lists>,
}

/// The decoded entries of one large sparse entry: one [`SparseList`] per rank, and random-k's
/// draw of the indices that all ranks share.
#[derive(Debug, Default)]
struct Lists {
    ranks: Vec<SparseList>,
    draw: RandomKDraw,
}

impl Aggregator {
    /// An aggregator with [`Parallelism::Auto`]: every core of rayon's pool when it has more
    /// than one thread.
    pub fn new() -> Self {
        Self::default()
    }

    /// An aggregator on the calling thread only ([`Parallelism::Serial`]).
    pub fn serial() -> Self {
        Self::new().with_parallelism(Parallelism::Serial)
    }

    /// The same aggregator using `parallelism`.
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Aggregates the bundles of W ranks (`bundles[r]` is rank `r`'s) made at `step` into
    /// `out`, resized to [`Manifest::flat_len`]. See the module docs for the checks and the
    /// reductions.
    ///
    /// # Errors
    /// [`Error::Config`] for no bundle, or a majority vote over frames that are not unscaled
    /// sign; [`Error::OutOfMemory`] when the model's elements cannot be allocated (a manifest
    /// may describe more than the machine holds; `out` untouched); every error of [`Manifest::check_bundle`], naming the rank (and the tensor or
    /// bucket where an entry is at fault): the first failing rank. Those checks run on every
    /// bundle before anything is accumulated, so `out` is untouched on those errors. A frame
    /// whose body turns out invalid while accumulating is an [`Error::Core`] naming tensor and
    /// rank (the first failing entry in manifest order, its first failing rank), and leaves
    /// `out` zeroed. [`Error::Overflow`] when the f32 sum of finite contributions overflows
    /// (under [`Reduction::Mean`] too: the sum is divided by W once, at the end, so a mean that
    /// would fit is still an error when its sum does not), naming the tensor and the element of
    /// the first non-finite result; `out` is zeroed.
    pub fn aggregate_into<B: AsRef<[u8]> + Sync>(
        &mut self,
        manifest: &Manifest,
        bundles: &[B],
        step: u64,
        reduction: Reduction,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        check_reduction(manifest, reduction, bundles.len())?;
        self.aggregate(manifest, bundles, step, reduction, Dest::Flat(out))
    }

    /// As [`Aggregator::aggregate_into`], writing entry `e`'s result into `outs[e]` (one slice
    /// of the entry's length per entry of `manifest`, in manifest order: for a manifest without
    /// buckets, the output tensors themselves), with no buffer of the model's size of its own.
    ///
    /// # Errors
    /// As [`Aggregator::aggregate_into`] (the slices zeroed where it zeroes `out`);
    /// [`Error::Internal`] when `outs` does not match the manifest's entries.
    pub(crate) fn aggregate_into_each<B: AsRef<[u8]> + Sync>(
        &mut self,
        manifest: &Manifest,
        bundles: &[B],
        step: u64,
        reduction: Reduction,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        check_reduction(manifest, reduction, bundles.len())?;
        let entries = manifest.entries();
        if outs.len() != entries.len() || outs.iter().zip(entries).any(|(o, e)| o.len() != e.len) {
            return Err(Error::internal(
                "output slices that do not match the entries",
            ));
        }
        self.aggregate(manifest, bundles, step, reduction, Dest::Each(outs))
    }

    /// The checks of every bundle, then the job (see [`Aggregator::aggregate_into`]).
    fn aggregate<B: AsRef<[u8]> + Sync>(
        &mut self,
        manifest: &Manifest,
        bundles: &[B],
        step: u64,
        reduction: Reduction,
        dest: Dest<'_, '_>,
    ) -> Result<()> {
        let exec = self.parallelism.exec_for(manifest.flat_len());
        exec.install(|| {
            exec.first_err(bundles, |rank, b| {
                manifest
                    .check_bundle(b.as_ref(), Some(rank), Some(step))
                    .map(|_| ())
            })?;
            self.locate_frames(manifest, bundles)?;
            let (frames, ne) = (&self.frames, manifest.entries().len());
            let frame = |rank: usize, e: usize| -> &[u8] {
                let (a, b) = frames[rank * ne + e];
                bundles[rank].as_ref().get(a..b).unwrap_or(&[])
            };
            let job = Job {
                manifest,
                count: bundles.len(),
                step,
                reduction,
                exec,
                lists: &self.lists,
            };
            let out = match dest {
                Dest::Flat(out) => {
                    // Every entry writes all of its range (from zeros), so a reused buffer is
                    // not zeroed first: for a large model that would be one more pass.
                    crate::tensor::resize_or_refuse(out, manifest.flat_len(), crate::error::MODEL)?;
                    Out::Flat { out, base: 0 }
                }
                Dest::Each(outs) => Out::Each(outs),
            };
            job.run(&frame, out)
        })
    }

    /// Aggregates entries `first..first + outs.len()` of `manifest` from `count` ranks'
    /// frames (`frame(rank, entry)`, already checked against the manifest as
    /// [`Manifest::check_bundle`] checks them) made at `step`, entry `first + i`'s result into
    /// `outs[i]`: the part of [`Aggregator::aggregate_into_each`] after the checks, for a
    /// caller that reads bundles as they arrive. [`check_reduction`] is the caller's.
    ///
    /// # Errors
    /// As [`Aggregator::aggregate_into`] for a frame body found invalid or a result that is not
    /// finite (those entries' slices zeroed); [`Error::Internal`] when `outs` does not match
    /// the entries.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn aggregate_entries<'f>(
        &mut self,
        manifest: &Manifest,
        count: usize,
        step: u64,
        reduction: Reduction,
        first: usize,
        frame: &(impl Fn(usize, usize) -> &'f [u8] + Sync),
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        let entries = manifest
            .entries()
            .get(first..first + outs.len())
            .filter(|es| outs.iter().zip(*es).all(|(o, e)| o.len() == e.len))
            .ok_or_else(|| Error::internal("output slices that do not match the entries"))?;
        let exec = self.parallelism.exec_for(manifest.flat_len());
        let job = Job {
            manifest,
            count,
            step,
            reduction,
            exec,
            lists: &self.lists,
        };
        exec.install(|| job.run_entries(first, entries, frame, Out::Each(outs)))
    }

    /// Aggregates elements `start..start + acc.len()` (chunk boundaries of the entry's
    /// `sections`) of entry `e` of `manifest` from `count` ranks' frames held in pieces, as
    /// their bytes arrive: `scales(rank)` the rank's whole scales section, `body(rank)` the
    /// piece of its body section that holds those elements; the frames' headers were checked
    /// and their checksums are the caller's. Each chunk of `acc` takes rank 0's values, adds the
    /// others' in rank order and applies the reduction, as [`Aggregator::aggregate_entries`]
    /// does the whole frames; pieces are checked as the core's decoder checks them. `faults`
    /// carries the faults met so far in the entry's earlier pieces: once a rank's piece
    /// failed, only the ranks before it are read (and nothing is reduced), so that over the
    /// whole entry the fault kept is the one the whole frames name: the first rank with one,
    /// its first in byte order (its scales section checked first, see
    /// [`Sections::check_scales`]). After a fault `acc` holds unspecified values.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn aggregate_pieces<'p>(
        &self,
        manifest: &Manifest,
        e: usize,
        sections: &Sections,
        count: usize,
        reduction: Reduction,
        scales: &(impl Fn(usize) -> &'p [u8] + Sync),
        body: &(impl Fn(usize) -> &'p [u8] + Sync),
        start: usize,
        acc: &mut [f32],
        faults: &mut PieceFaults,
    ) {
        let end = start + acc.len();
        let entry = manifest.entries().get(e);
        let geometry = entry.and_then(|entry| dense_geometry(entry.len, &entry.method));
        let (Some(entry), Some((_, chunk)), Ok((_, whole))) =
            (entry, geometry, sections.ranges(start, end))
        else {
            // Not a chunk of an entry read in pieces: a fault, so that the entry never ends
            // `Ok`.
            faults.note(0, start, gradwire_core::Error::BadChunk { start, end });
            return;
        };
        let ranks = faults.bad.as_ref().map_or(count, |(rank, _, _)| *rank);
        let bad: Mutex<Option<(usize, usize, gradwire_core::Error)>> = Mutex::new(None);
        let over = AtomicUsize::new(usize::MAX);
        let exec = self.parallelism.exec_for(acc.len());
        exec.chunks_mut_all(acc, chunk, |j, acc| {
            let at = start + j * chunk;
            let Ok((_, b)) = sections.ranges(at, at + acc.len()) else {
                return true;
            };
            let piece = b.start - whole.start..b.end - whole.start;
            for rank in 0..ranks {
                let weight = (rank > 0).then_some(1.0);
                let read = body(rank)
                    .get(piece.clone())
                    .ok_or(gradwire_core::Error::BadChunk {
                        start: at,
                        end: at + acc.len(),
                    })
                    .and_then(|body| sections.decode_pieces(scales(rank), at, body, acc, weight));
                if let Err(err) = read {
                    let mut bad = bad.lock().unwrap_or_else(PoisonError::into_inner);
                    if bad.as_ref().is_none_or(|(r, s, _)| (rank, at) < (*r, *s)) {
                        *bad = Some((rank, at, err));
                    }
                    return true;
                }
            }
            if ranks == count
                && let Some(i) = finish(acc, reduction, count, &entry.method)
            {
                over.fetch_min(at + i, Ordering::Relaxed);
            }
            true
        });
        if let Some((rank, at, err)) = bad.into_inner().unwrap_or_else(PoisonError::into_inner) {
            faults.note(rank, at, err);
        }
        let over = over.into_inner();
        if over != usize::MAX {
            faults.overflow = Some(faults.overflow.map_or(over, |o| o.min(over)));
        }
    }

    /// Records where every frame of `bundles` (checked against `manifest`) lies.
    fn locate_frames<B: AsRef<[u8]>>(&mut self, manifest: &Manifest, bundles: &[B]) -> Result<()> {
        let ne = manifest.entries().len();
        self.frames.clear();
        self.frames.resize(bundles.len() * ne, (0, 0));
        if ne == 0 {
            return Ok(());
        }
        for (row, bundle) in self.frames.chunks_mut(ne).zip(bundles) {
            // Entries follow each other after the bundle header.
            let mut pos = HEADER_LEN;
            manifest.walk(bundle.as_ref(), None, |e, frame| {
                let start = pos + ENTRY_HEADER_LEN;
                pos = start + frame.len();
                row[e] = (start, pos);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Aggregates per-tensor compressed gradients of W ranks (`contributions[r]` is rank
    /// `r`'s) made at `step`, against a manifest without buckets, into `out` (flat layout of
    /// the manifest), as [`Aggregator::aggregate_into`] does bundles.
    ///
    /// # Errors
    /// [`Error::Config`] for no contribution, a manifest with buckets or a majority vote over
    /// frames that are not unscaled sign; the errors of [`check_contribution`] for the first
    /// failing rank. All checks run before anything is accumulated; a frame body found invalid
    /// while accumulating leaves `out` zeroed. [`Error::Overflow`] when the result is not
    /// finite, as for [`Aggregator::aggregate_into`] (`out` zeroed); [`Error::OutOfMemory`].
    pub(crate) fn aggregate_compressed_into(
        &mut self,
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
        let entries = manifest.entries();
        let frame = |rank: usize, e: usize| -> &[u8] {
            contributions[rank]
                .get(&entries[e].label)
                .map_or(&[], |cg| cg.frame())
        };
        let exec = self.parallelism.exec_for(manifest.flat_len());
        let job = Job {
            manifest,
            count: contributions.len(),
            step,
            reduction,
            exec,
            lists: &self.lists,
        };
        crate::tensor::resize_or_refuse(out, manifest.flat_len(), crate::error::MODEL)?;
        exec.install(|| job.run(&frame, Out::Flat { out, base: 0 }))
    }
}

/// The faults of an entry aggregated piece by piece ([`Aggregator::aggregate_pieces`]).
#[derive(Debug, Default)]
pub(crate) struct PieceFaults {
    /// The first rank whose pieces failed their checks, the element where its piece starts,
    /// and the fault.
    bad: Option<(usize, usize, gradwire_core::Error)>,
    /// The first element of the entry whose result is not finite.
    overflow: Option<usize>,
}

impl PieceFaults {
    /// Keeps `err` of `rank`'s piece from element `start` when it comes before the one kept.
    pub(crate) fn note(&mut self, rank: usize, start: usize, err: gradwire_core::Error) {
        if self
            .bad
            .as_ref()
            .is_none_or(|(r, s, _)| (rank, start) < (*r, *s))
        {
            self.bad = Some((rank, start, err));
        }
    }

    /// The error of entry `e` of `manifest` once all its pieces were aggregated, as the whole
    /// frames give it: a rank's fault first, then the first element that is not finite.
    pub(crate) fn into_error(self, manifest: &Manifest, e: usize) -> Option<Error> {
        let entry = manifest.entries().get(e)?;
        match (self.bad, self.overflow) {
            (Some((rank, _, err)), _) => Some(Error::core(&entry.label, Some(rank), err)),
            (None, Some(at)) => Some(overflow(manifest, entry.offset + at)),
            (None, None) => None,
        }
    }
}

/// Where an aggregation writes: the flat layout (resized once the checks pass), or one slice
/// per entry.
enum Dest<'a, 'b> {
    Flat(&'a mut Vec<f32>),
    Each(&'a mut [&'b mut [f32]]),
}

/// Where a job writes its entries' results.
enum Out<'a, 'b> {
    /// The manifest's flat layout from element `base` on (entries tile it from there).
    Flat { out: &'a mut [f32], base: usize },
    /// One slice per entry, in order.
    Each(&'a mut [&'b mut [f32]]),
}

impl<'a> Out<'a, '_> {
    /// The outputs of `entries[..mid]` and of `entries[mid..]` (`entries`: the ones `self`
    /// holds).
    fn split(self, entries: &[Entry], mid: usize) -> (Self, Self) {
        match self {
            Out::Flat { out, base } => {
                let at = entries[mid].offset;
                let (a, b) = out.split_at_mut(at.saturating_sub(base).min(out.len()));
                (Out::Flat { out: a, base }, Out::Flat { out: b, base: at })
            }
            Out::Each(outs) => {
                let (a, b) = outs.split_at_mut(mid.min(outs.len()));
                (Out::Each(a), Out::Each(b))
            }
        }
    }

    /// The output of the one entry `self` holds.
    fn one(self) -> &'a mut [f32] {
        match self {
            Out::Flat { out, .. } => out,
            Out::Each(outs) => match outs {
                [one] => one,
                _ => &mut [],
            },
        }
    }

    /// Zeros every output.
    fn zero(&mut self) {
        match self {
            Out::Flat { out, .. } => out.fill(0.0),
            Out::Each(outs) => outs.iter_mut().for_each(|o| o.fill(0.0)),
        }
    }
}

/// One aggregation after the checks of every contribution.
struct Job<'a> {
    manifest: &'a Manifest,
    count: usize,
    step: u64,
    reduction: Reduction,
    exec: Exec,
    lists: &'a Pool<Lists>,
}

impl Job<'_> {
    /// Every entry's output range, from zeros, with `frame(rank, entry)` added in rank order and
    /// the reduction applied; on error `out` is zeroed and the first failing entry's error is
    /// returned.
    fn run<'f>(
        &self,
        frame: &(impl Fn(usize, usize) -> &'f [u8] + Sync),
        out: Out<'_, '_>,
    ) -> Result<()> {
        self.run_entries(0, self.manifest.entries(), frame, out)
    }

    /// As [`Job::run`] for `entries`, the manifest's entries from index `from` on, whose
    /// outputs `out` holds.
    fn run_entries<'f>(
        &self,
        from: usize,
        entries: &[Entry],
        frame: &(impl Fn(usize, usize) -> &'f [u8] + Sync),
        mut out: Out<'_, '_>,
    ) -> Result<()> {
        let first: Mutex<Option<(usize, Error)>> = Mutex::new(None);
        let whole = match &mut out {
            Out::Flat { out, base } => Out::Flat { out, base: *base },
            Out::Each(outs) => Out::Each(outs),
        };
        self.for_each_entry(entries, from, whole, &|e, acc| {
            if let Err(err) = self.entry(e, acc, frame) {
                let mut first = first.lock().unwrap_or_else(PoisonError::into_inner);
                if first.as_ref().is_none_or(|(f, _)| e < *f) {
                    *first = Some((e, err));
                }
            }
        });
        match first.into_inner().unwrap_or_else(PoisonError::into_inner) {
            None => Ok(()),
            Some((_, err)) => {
                out.zero();
                Err(err)
            }
        }
    }

    /// Calls `f(e, output of entry e)` for entries `first..first + entries.len()`, whose
    /// outputs `out` holds (halving the entries recursively, each half a task on the pool).
    fn for_each_entry<F>(&self, entries: &[Entry], first: usize, out: Out<'_, '_>, f: &F)
    where
        F: Fn(usize, &mut [f32]) + Sync,
    {
        match entries.len() {
            0 => {}
            1 => f(first, out.one()),
            len => {
                let mid = len / 2;
                let (a, b) = out.split(entries, mid);
                self.exec.join(
                    || self.for_each_entry(&entries[..mid], first, a, f),
                    || self.for_each_entry(&entries[mid..], first + mid, b, f),
                );
            }
        }
    }

    /// Entry `e`'s output range `acc`, by its plan. A chunked plan that fails (an invalid frame
    /// body, a result that is not finite) is run again whole, which names the error.
    fn entry<'f>(
        &self,
        e: usize,
        acc: &mut [f32],
        frame: &(impl Fn(usize, usize) -> &'f [u8] + Sync),
    ) -> Result<()> {
        let entry = &self.manifest.entries()[e];
        let finished =
            |acc: &mut [f32]| finish(acc, self.reduction, self.count, &entry.method).is_none();
        let done = match entry.reduce {
            ReducePlan::DenseChunks => Split::new(entry.len, &entry.method).is_some_and(|split| {
                split.accumulate(|r| frame(r, e), self.count, acc, &finished, self.exec)
            }),
            ReducePlan::SparseLists => self.sparse_lists(entry, e, acc, frame, &finished),
            ReducePlan::Whole => false,
        };
        if done {
            return Ok(());
        }
        // Whole: every rank's frame added by the core, ranks in order.
        acc.fill(0.0);
        let params = self.manifest.params(entry, self.step);
        for rank in 0..self.count {
            accumulate_into(frame(rank, e), &params, acc, 1.0)
                .map_err(|err| Error::core(&entry.label, Some(rank), err))?;
        }
        match finish(acc, self.reduction, self.count, &entry.method) {
            Some(at) => Err(overflow(self.manifest, entry.offset + at)),
            None => Ok(()),
        }
    }

    /// A large sparse entry through each rank's decoded list, chunks of the output adding the
    /// entries that fall into them; `false` when a frame does not decode or the result is not
    /// finite. On one thread too for top-k (each chunk zeroed, added into and finished while it
    /// is in cache, where the core's whole-frame additions leave the reduction a pass of its own
    /// over the output), not for threshold (`false` without work: its lists could hold every
    /// element of every rank).
    fn sparse_lists<'f>(
        &self,
        entry: &Entry,
        e: usize,
        acc: &mut [f32],
        frame: &(impl Fn(usize, usize) -> &'f [u8] + Sync),
        finish: &(impl Fn(&mut [f32]) -> bool + Sync),
    ) -> bool {
        let randomk = matches!(entry.method, Method::RandomK { .. });
        // One thread lists top-k entries (k each, a fixed count: the lists keep their size) but
        // adds threshold entries whole, whose kept count changes by step and may reach `n`.
        if self.exec == Exec::Serial && matches!(entry.method, Method::Threshold { .. }) {
            return false;
        }
        let mut lease = self.lists.lease();
        let lists = lease.get();
        if lists.ranks.len() < self.count {
            lists.ranks.resize_with(self.count, SparseList::default);
        }
        let (ranks, draw) = (&mut lists.ranks[..self.count], &mut lists.draw);
        let n = entry.len;
        let decoded = if randomk {
            // Every rank's frame carries the manifest's seed, step and tensor id (checked), so
            // one draw of the indices serves them all.
            let params = self.manifest.params(entry, self.step);
            draw.draw_for(&params, n, self.exec, |_, _| true);
            let idx = draw.indices();
            self.exec.all_mut(ranks, |r, list| {
                list.decode_randomk(frame(r, e), n, &params, idx)
            })
        } else {
            let params = self.manifest.params(entry, self.step);
            self.exec
                .all_mut(ranks, |r, list| list.decode(frame(r, e), n, &params))
        };
        let ranks = &*ranks;
        decoded
            && self.exec.chunks_mut_all(acc, CHUNK, |j, acc| {
                acc.fill(0.0);
                for list in ranks {
                    list.add_range(j * CHUNK, acc, 1.0);
                }
                finish(acc)
            })
    }
}

/// Checks rank `rank`'s per-tensor compressed gradients made at `step` against a manifest
/// without buckets (see `Aggregator::aggregate_compressed_into`), without decoding any frame
/// body.
///
/// # Errors
/// Naming the tensor and the rank: [`Error::MissingTensor`], [`Error::UnexpectedTensor`],
/// [`Error::ShapeMismatch`] (in sorted name order), then per tensor [`Error::Disagreement`]
/// (another step), [`Error::ParamsDiffer`] (a frame made with other parameters) or
/// [`Error::Core`] (a frame whose header fails its checks otherwise); [`Error::Config`] for a
/// manifest with buckets.
pub(crate) fn check_contribution(
    manifest: &Manifest,
    map: &HashMap<String, CompressedGradient>,
    rank: usize,
    step: u64,
) -> Result<()> {
    check_no_buckets(manifest)?;
    manifest.check_names(map, Some(rank), CompressedGradient::shape)?;
    for entry in manifest.entries() {
        let info = &manifest.tensors()[entry.members[0]];
        let Some(cg) = map.get(&info.name) else {
            continue;
        };
        if cg.step() != step {
            return Err(Error::Disagreement {
                tensor: info.name.clone(),
                rank: Some(rank),
                reason: format!("made at step {}, expected step {step}", cg.step()),
            });
        }
        let params = manifest.params(entry, step);
        check_frame_of(&info.name, Some(rank), cg.frame(), &params, info.numel)?;
    }
    Ok(())
}

/// A model larger than memory, declared by a manifest (a receiver's `shapes`) and a tiny bundle
/// of empty top-k frames: decoding and aggregating it is [`Error::OutOfMemory`], not an abort
/// (issue 48 class 7: the Python bindings raise `MemoryError` for it).
#[cfg(test)]
mod larger_than_memory {
    use gradwire_core::select::Kept;
    use gradwire_core::{K, Method, Values, encode_kept_into, max_frame_len};

    use super::{Aggregator, Reduction};
    use crate::error::Error;
    use crate::layout::bundle::BundleWriter;
    use crate::layout::{BucketConfig, Manifest, TensorSpec};
    use crate::method::CompressionMethod;

    #[test]
    fn decoding_a_model_larger_than_memory_is_an_error() {
        // 32 tensors of 2^32 - 1 elements: 550 GB of f32, more than any machine here holds
        // (a heuristic overcommit refuses it), in 32 frames of a few bytes.
        let n = u32::MAX as usize;
        let specs: Vec<TensorSpec> = (0..32)
            .map(|i| TensorSpec::new(format!("t{i:02}"), vec![n]))
            .collect();
        let method = CompressionMethod::Core(Method::TopK {
            k: K::Count(0),
            values: Values::F32,
        });
        let manifest = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
        let mut bundle = Vec::new();
        let mut writer = BundleWriter::begin(&mut bundle, 0, manifest.entries().len() as u32, 0);
        let mut frame = vec![0u8; max_frame_len(n, &method.core_method().unwrap())];
        for entry in manifest.entries() {
            let params = manifest.params(entry, 0);
            let kept = Kept {
                idx: &[],
                bits: &[],
            };
            let len = encode_kept_into(entry.len, &params, kept, &mut frame).unwrap();
            writer.push(entry.id, &frame[..len]);
        }
        writer.finish();
        let mut out = Vec::new();
        let err = manifest
            .decode_bundle(&bundle, None, None, &mut out)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
        assert!(out.is_empty());
        let err = Aggregator::new()
            .aggregate_into(&manifest, &[&bundle], 0, Reduction::Mean, &mut out)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    }
}

#[cfg(test)]
mod sparse_lists {
    //! Large top-k entries are added through each rank's decoded list, chunk by chunk of the
    //! output, on one thread as on the pool (threshold entries on the pool only): the bits of
    //! the core's whole-frame additions (ranks in order, from zeros) followed by the reduction.
    use gradwire_core::{K, Method, Values, accumulate_into, encode_into, max_frame_len};

    use super::{Aggregator, Reduction};
    use crate::engine::Parallelism;
    use crate::layout::{BucketConfig, Manifest, TensorSpec};
    use crate::method::CompressionMethod;

    #[test]
    fn lists_on_one_thread_and_on_the_pool_give_the_cores_sums() {
        const W: usize = 3;
        let n = 300_001;
        // Each rank's values: a xorshift stream, a run of zeros and of negative zeros (kept
        // when k exceeds the nonzeros of a part), ranks that pick some of the same elements.
        let values = |rank: u64| -> Vec<f32> {
            let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (rank + 1);
            (0..n)
                .map(|i| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    match i % 97 {
                        0..=3 => -0.0,
                        4..=7 => 0.0,
                        _ if i % 5 == 0 => (i as f32).sin() * 3.0,
                        _ => ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0,
                    }
                })
                .collect()
        };
        for method in [
            Method::TopK {
                k: K::Ratio(0.02),
                values: Values::Int8 { block: 64 },
            },
            Method::TopK {
                k: K::Count(50_000),
                values: Values::F32,
            },
            Method::Threshold {
                threshold: 1.0,
                values: Values::F16,
            },
        ] {
            let specs = vec![TensorSpec::new("w".to_owned(), vec![n])];
            let manifest = Manifest::new(
                specs,
                &CompressionMethod::Core(method),
                9,
                BucketConfig::none(),
            )
            .unwrap();
            let entry = &manifest.entries()[0];
            let params = manifest.params(entry, 4);
            let encode = |x: &[f32]| {
                let mut frame = vec![0u8; max_frame_len(n, &method)];
                let mut scratch = vec![0u32; gradwire_core::scratch_len(n, &method)];
                let len = encode_into(x, &params, &mut scratch, &mut frame).unwrap();
                frame.truncate(len);
                frame
            };
            let frames: Vec<Vec<u8>> = (0..W as u64).map(|rank| encode(&values(rank))).collect();
            for reduction in [Reduction::Mean, Reduction::Sum] {
                let mut want = vec![0.0f32; n];
                for frame in &frames {
                    accumulate_into(frame, &params, &mut want, 1.0).unwrap();
                }
                for x in &mut want {
                    *x += 0.0;
                    if reduction == Reduction::Mean {
                        *x /= W as f32;
                    }
                }
                for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
                    let mut agg = Aggregator::new().with_parallelism(parallelism);
                    let mut got = vec![f32::NAN; n];
                    let frame = |rank: usize, _: usize| frames[rank].as_slice();
                    agg.aggregate_entries(&manifest, W, 4, reduction, 0, &frame, &mut [&mut got])
                        .unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{method:?} {reduction:?} {parallelism:?}");
                }
            }
            // Sums beyond f32 (every rank's largest values at the same elements) and a damaged
            // frame: the errors of the core's whole-frame additions, on one thread as on the
            // pool.
            // (Beyond f16's range a threshold f16 frame cannot carry them: damage alone.)
            let huge: Vec<Vec<u8>> = (0..W as u64)
                .filter(|_| !matches!(method, Method::Threshold { .. }))
                .map(|rank| {
                    let mut x = values(rank);
                    x[1000] = 3e38;
                    x[2000] = -3e38;
                    encode(&x)
                })
                .collect();
            let mut damaged = frames.clone();
            let mid = damaged[1].len() / 2;
            damaged[1][mid] ^= 0x10;
            for (set, what) in [(&huge, "beyond f32"), (&damaged, "damaged")] {
                if set.is_empty() {
                    continue;
                }
                let errors: Vec<String> = [Parallelism::Serial, Parallelism::Parallel]
                    .into_iter()
                    .map(|parallelism| {
                        let mut agg = Aggregator::new().with_parallelism(parallelism);
                        let mut got = vec![0.0f32; n];
                        let frame = |rank: usize, _: usize| set[rank].as_slice();
                        agg.aggregate_entries(
                            &manifest,
                            W,
                            4,
                            Reduction::Sum,
                            0,
                            &frame,
                            &mut [&mut got],
                        )
                        .unwrap_err()
                        .to_string()
                    })
                    .collect();
                assert_eq!(errors[0], errors[1], "{method:?} {what}");
                let named = match what {
                    "damaged" => errors[0].contains("from rank 1: checksum mismatch"),
                    _ => errors[0].contains("overflows f32 at element 1000"),
                };
                assert!(named, "{method:?} {what}: {}", errors[0]);
            }
        }
    }
}

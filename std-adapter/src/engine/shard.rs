//! The two-phase collective's shard frames (`crate::collective`, `FORMAT.md` section 15), run
//! in place on the tensors: owner `j`'s shard is its part of every tensor (a contiguous range
//! of each, [`crate::layout::shards`]), and one frame carries them all, in manifest order.
//!
//! - [`encode_parts`] writes the frame from the parts where they are (the worker's gradients
//!   and residuals, the owner's reduced values in the output tensors and its server residual),
//!   with error feedback in place: top-k keeps each tensor's budget of its own part, selected
//!   on the part's residual as it takes the sums (one segment per tensor part, `FORMAT.md`
//!   3.2.1, so that an int8 scale block never spans two tensors), then the kept entries are
//!   fixed up; dense, quantization and sign frames are written chunk by chunk
//!   ([`gradwire_core::frame::chunk::Sections`]), each chunk on the part's own slices, or on a
//!   chunk-sized copy where it spans two parts. Sign with the zero mask has no chunked
//!   sections: its shard is encoded whole from copies (its shard's size in memory).
//! - [`apply_frame`] adds a frame's decoded values into the parts (the owner's sum of the
//!   workers' frames, the worker's give-back of what it sent after a failed step) or writes
//!   them (every rank's decode of the owners' frames into the outputs), the same way.
//!
//! Both run the parts (top-k) or the chunks (the others) on the caller's [`Exec`]: on the pool
//! the same bytes as on one thread, since each piece's result depends on the piece alone.
//!
//! Nothing here is sized by the model but the zero-mask sign copies: the buffers are the kept
//! entries of one frame, a selection scratch and two chunks per task running at once, and the
//! list of a call's chunks (about n / 2^16 entries).

use gradwire_core::feedback::{sparse_fix_up, step_chunk};
use gradwire_core::frame::chunk::{Sections, SparseFrame};
use gradwire_core::select::{Kept, topk_kept, topk_kept_sum_from, topk_kept_sum_into};
use gradwire_core::values::{first_at_or_above, magnitude_limit, saturate_bits};
use gradwire_core::{Method, Params, encode_kept_segmented_into, peek};

use super::{Exec, Pool, grow};
use crate::error::{Error, Result};
use crate::layout::shards::ShardLayout;

/// Elements per chunk of a dense, quantization or sign frame's walk (rounded up to the
/// frame's alignment): 256 KiB of f32, in cache while a chunk is encoded and its residual
/// updated.
const CHUNK: usize = 1 << 16;

/// One tensor's part of a shard, where it lies: elements `at..at + x.len()` of the shard.
pub(crate) struct Part<'a> {
    /// The tensor (index in the layout).
    pub(crate) tensor: usize,
    /// Where the part starts in the shard.
    pub(crate) at: usize,
    /// The values the frame encodes (without error feedback) or adds to the residual.
    pub(crate) x: &'a [f32],
    /// The part's residual (worker or server), when the step uses error feedback: overwritten
    /// with the new residual (read first, unless `old` holds the residual before the step).
    pub(crate) residual: Option<&'a mut [f32]>,
    /// The residual before the step, when it is kept apart from `residual` (the owner's
    /// server residual in two buffers: a step that fails later keeps it, with no copy made
    /// for that), of the part's length.
    pub(crate) old: Option<&'a [f32]>,
}

impl Part<'_> {
    /// The residual before the step: `old` when it is kept apart, else `residual`.
    pub(crate) fn residual_before(&self) -> Option<&[f32]> {
        self.old.or(self.residual.as_deref())
    }
}

/// A part of a shard that a decoded frame is added into: elements `at..at + data.len()`.
pub(crate) struct Target<'a> {
    pub(crate) at: usize,
    pub(crate) data: &'a mut [f32],
}

/// Owner `j`'s parts of the gradients (and of the worker's residuals, when `taken` holds one
/// per tensor of the layout; none when it is empty), in shard order.
pub(crate) fn parts_of<'a>(
    layout: &ShardLayout,
    j: usize,
    grads: &[&'a [f32]],
    taken: &'a mut [Vec<f32>],
) -> Vec<Part<'a>> {
    let with_residual = taken.len() == layout.tensors.len();
    let mut residuals = taken.iter_mut();
    let mut parts = Vec::new();
    for (t, ts) in layout.tensors.iter().enumerate() {
        let r = if with_residual {
            residuals.next()
        } else {
            None
        };
        if ts.lens[j] == 0 {
            continue;
        }
        let range = layout.range(t, j);
        parts.push(Part {
            tensor: t,
            at: ts.starts[j],
            x: &grads[t][range.clone()],
            residual: r.map(|r| &mut r[range]),
            old: None,
        });
    }
    parts
}

/// Owner `j`'s parts of the tensors `tensors` (one per tensor of the layout, whole: outputs,
/// residuals), as targets in shard order.
pub(crate) fn targets_of<'o, T: AsMut<[f32]>>(
    layout: &ShardLayout,
    j: usize,
    tensors: &'o mut [T],
) -> Vec<Target<'o>> {
    layout
        .tensors
        .iter()
        .zip(tensors.iter_mut())
        .enumerate()
        .filter(|(_, (ts, _))| ts.lens[j] > 0)
        .map(|(t, (ts, o))| Target {
            at: ts.starts[j],
            data: &mut o.as_mut()[layout.range(t, j)],
        })
        .collect()
}

/// Work buffers of [`encode_parts`] and [`apply_frame`], kept between steps.
#[derive(Debug, Default)]
pub(crate) struct Buffers {
    scratch: Vec<u32>,
    /// Selection scratch, one per task running at once (taken and given back by each task;
    /// on one thread, one in all), kept between steps.
    select: Pool<Vec<u32>>,
    /// Copies of chunks that span two parts (values, residual), one pair per task, likewise.
    chunk_pool: Pool<(Vec<f32>, Vec<f32>)>,
    /// Each part's selection: whether it succeeded, and how many entries it kept.
    part_kept: Vec<PartKept>,
    kept: Vec<u32>,
    bits: Vec<u32>,
    segments: Vec<u32>,
    values: Vec<f32>,
    chunk_x: Vec<f32>,
    chunk_r: Vec<f32>,
    bounds: Vec<f32>,
    /// Each target's range of a sparse frame's kept entries ([`apply_frame`]).
    spans: Vec<(usize, usize)>,
    /// The header a frame [`apply_frame`] reads is expected to begin with.
    header: Vec<u8>,
}

impl Buffers {
    /// After [`encode_parts`] with residuals: each part's bound on its new residual's
    /// magnitudes, in the order of the parts (top-k: no unsent element is larger than the
    /// smallest kept one, and the kept entries keep their fix-up; dense, quantization and sign:
    /// the largest magnitude of each chunk's residual; infinite, unknown, for sign with the
    /// zero mask).
    pub(crate) fn part_bounds(&self) -> &[f32] {
        &self.bounds
    }
}

/// One part's top-k selection in [`encode_parts`]: whether it succeeded, and how many entries
/// it kept (written at the part's place in the kept entries, then moved up).
#[derive(Clone, Copy, Debug, Default)]
struct PartKept {
    ok: bool,
    count: usize,
    /// The smallest kept magnitude of the sums, before they were saturated to the value type
    /// (no element left unsent is larger: the residual's bound).
    smallest: f32,
}

/// The error of element `i` of `part` (a core error naming an index in the part) as the
/// tensor's error at its own index.
fn at_part(layout: &ShardLayout, j: usize, part: &Part<'_>, e: gradwire_core::Error) -> Error {
    at_tensor(layout, j, part.tensor, e)
}

fn at_tensor(layout: &ShardLayout, j: usize, t: usize, e: gradwire_core::Error) -> Error {
    let ts = &layout.tensors[t];
    let e = match e {
        gradwire_core::Error::NonFinite { index } => gradwire_core::Error::NonFinite {
            index: ts.begins[j] + index,
        },
        gradwire_core::Error::ValueOutOfRange { index } => gradwire_core::Error::ValueOutOfRange {
            index: ts.begins[j] + index,
        },
        e => e,
    };
    Error::core(&ts.name, None, e)
}

/// Whether some `x[i] + r[i]` (`x[i]` without `r`) is NaN, infinite or beyond the range of
/// `values`: an owner's reduced shard that travels escaped (FORMAT.md 15).
pub(crate) fn beyond(values: gradwire_core::Values, x: &[f32], r: Option<&[f32]>) -> bool {
    super::check::check_step_input("", x, r, Some(values)).is_err()
}

/// The first element of `x` that is NaN or infinite (named first, over the whole slice), else
/// the first beyond the range of `values` (`None`: finiteness only).
pub(crate) fn first_bad(
    x: &[f32],
    values: Option<gradwire_core::Values>,
) -> Option<gradwire_core::Error> {
    let index = first_at_or_above(x, magnitude_limit(values))?;
    // NaN and infinity first, over the whole slice; else the first at or above the limit.
    Some(match gradwire_core::values::first_non_finite(x) {
        Some(index) => gradwire_core::Error::NonFinite { index },
        None => gradwire_core::Error::ValueOutOfRange { index },
    })
}

/// Encodes owner `j`'s shard from `parts` (every tensor part of the shard with elements, in
/// shard order) into `frame` (at least the layout's frame bound for `j`) with `params`, and
/// returns the frame's length. With residuals, through error feedback: `sent + residual_new
/// == x + residual_old` per element, bit-exact for f32 values. Top-k keeps each tensor's
/// budget of its own part.
///
/// # Errors
/// Core errors named by tensor and index: a NaN or infinite `x + residual`, or without a
/// residual a value beyond the value type's range (with one it is sent saturated; the worker
/// checks its sums first, so only the owner meets these, and sends such a shard escaped); the
/// first in shard order is returned, and the residuals of every other part or chunk may have
/// changed then (the owner's server residual is written apart from the one it reads, which a
/// failed step keeps).
pub(crate) fn encode_parts(
    layout: &ShardLayout,
    j: usize,
    parts: &mut [Part<'_>],
    params: &Params,
    bufs: &mut Buffers,
    frame: &mut [u8],
    exec: Exec,
) -> Result<usize> {
    let n = layout.shard_lens[j];
    let shard_err = |e: gradwire_core::Error| Error::core(&format!("two-phase shard {j}"), None, e);
    let Method::TopK { values, .. } = params.method else {
        // Each part's bound: the largest of its chunks' (a chunk spanning two parts counts
        // for both), measured as each chunk's residual is updated.
        bufs.bounds.clear();
        bufs.bounds.resize(parts.len(), 0.0);
        let Some(sections) = Sections::of(n, &params.method) else {
            bufs.bounds.fill(f32::INFINITY);
            return encode_gathered(layout, j, parts, params, bufs, frame);
        };
        sections.write_header(frame).map_err(shard_err)?;
        let step = walk_chunks(
            &sections,
            parts,
            bufs,
            &|start, x, residual, frame_pieces: &mut (&mut [u8], &mut [u8])| {
                let (scales, body) = frame_pieces;
                match residual {
                    Some(r) => step_chunk(&sections, params, start, x, r, scales, body),
                    None => sections.encode(params, start, x, scales, body),
                }
            },
            frame,
            exec,
        );
        let crc = step.map_err(|(t, e)| match t {
            Some(t) => at_tensor(layout, j, t, e),
            None => shard_err(e),
        })?;
        return sections.finish(frame, Some(crc)).map_err(shard_err);
    };
    // Top-k: each part's own top-k of its sums, selected on its residual in place; the parts
    // at once on the pool, each writing its kept entries at its own place, then moved up in
    // part order (the same bytes either way: a part's selection depends on the part alone).
    // Without a residual the sums must fit the value type; with one (error feedback) any finite
    // sum can be sent, saturating, and the residual keeps the excess.
    let limit_of = |part: &Part<'_>| match part.residual {
        Some(_) => magnitude_limit(None),
        None => magnitude_limit(Some(values)),
    };
    bufs.bounds.clear();
    bufs.bounds.resize(parts.len(), f32::INFINITY);
    // Room for each part's budget at its place in the kept entries, filled by its selection.
    let room =
        |part: &Part<'_>| (layout.tensors[part.tensor].budgets[j] as usize).min(part.x.len());
    let total: usize = parts.iter().map(room).sum();
    bufs.kept.clear();
    bufs.kept.resize(total, 0);
    bufs.bits.clear();
    bufs.bits.resize(total, 0);
    bufs.part_kept.clear();
    bufs.part_kept.resize(parts.len(), PartKept::default());
    {
        let pool = &bufs.select;
        let (mut idx_rest, mut bits_rest) = (&mut bufs.kept[..], &mut bufs.bits[..]);
        let mut jobs = Vec::with_capacity(parts.len());
        for (part, out) in parts.iter_mut().zip(bufs.part_kept.iter_mut()) {
            let (idx, rest) = std::mem::take(&mut idx_rest).split_at_mut(room(part));
            idx_rest = rest;
            let (bits, rest) = std::mem::take(&mut bits_rest).split_at_mut(idx.len());
            bits_rest = rest;
            jobs.push((part, idx, bits, out));
        }
        // Largest first on the pool (each job writes its own entries: the order changes no
        // byte), so that a large part does not run alone at the end.
        exec.for_each_with_largest_first(
            &mut jobs,
            |(part, ..)| part.x.len(),
            || pool.lease(),
            |lease, _, (part, idx, bits, out)| {
                let k = layout.tensors[part.tensor].budgets[j] as usize;
                let need = gradwire_core::select::kept_scratch_len(part.x.len(), k);
                let scratch = lease.get();
                grow(scratch, need);
                let sel = &mut scratch[..need];
                let limit = limit_of(part);
                let saturate = part.residual.is_some();
                let kept = match (part.old, part.residual.as_deref_mut()) {
                    (Some(old), Some(r)) => topk_kept_sum_from(part.x, old, r, k, limit, sel),
                    (None, Some(r)) => topk_kept_sum_into(part.x, r, k, limit, sel),
                    (_, None) => topk_kept(part.x, k, limit, sel),
                };
                // A selection keeps at most its budget; more would be a defect, refused below.
                **out = match kept {
                    Ok(kept) if kept.idx.len() <= idx.len() => {
                        let at = part.at as u32;
                        for (to, &i) in idx.iter_mut().zip(kept.idx) {
                            *to = i + at;
                        }
                        bits[..kept.bits.len()].copy_from_slice(kept.bits);
                        let smallest = kept
                            .bits
                            .iter()
                            .map(|&b| f32::from_bits(b & 0x7fff_ffff))
                            .fold(f32::INFINITY, f32::min);
                        if saturate {
                            saturate_bits(values, &mut bits[..kept.bits.len()]);
                        }
                        PartKept {
                            ok: true,
                            count: kept.idx.len(),
                            smallest,
                        }
                    }
                    _ => PartKept::default(),
                };
            },
        );
    }
    // The kept entries moved up over the room each part left unused, in part order.
    bufs.segments.clear();
    let (mut from, mut to) = (0usize, 0usize);
    for (part, out) in parts.iter().zip(&bufs.part_kept) {
        if !out.ok {
            // Only when the check did not run: name the element.
            let (x, range) = match part.residual.as_deref() {
                Some(r) => (r, None),
                None => (part.x, Some(values)),
            };
            let e = first_bad(x, range).unwrap_or(gradwire_core::Error::NonFinite { index: 0 });
            return Err(at_part(layout, j, part, e));
        }
        bufs.kept.copy_within(from..from + out.count, to);
        bufs.bits.copy_within(from..from + out.count, to);
        bufs.segments.push(out.count as u32);
        from += room(part);
        to += out.count;
    }
    bufs.kept.truncate(to);
    bufs.bits.truncate(to);
    let need =
        gradwire_core::kept_segmented_scratch_len(bufs.kept.len(), values, bufs.segments.len());
    if bufs.scratch.len() < need {
        bufs.scratch.resize(need, 0);
    }
    let entries = Kept {
        idx: &bufs.kept,
        bits: &bufs.bits,
    };
    let written = encode_kept_segmented_into(
        n,
        entries,
        &bufs.segments,
        values,
        &mut bufs.scratch[..need],
        frame,
    )
    .map_err(shard_err)?;
    if parts.iter().any(|p| p.residual.is_some()) {
        // What the frame delivers, taken from each part's residual (which holds the sums).
        let sparse = SparseFrame::parse(&frame[..written], params, n).map_err(shard_err)?;
        bufs.values.resize(sparse.kept(), 0.0);
        sparse.values(0, &mut bufs.values).map_err(shard_err)?;
        // Each part's kept entries fixed up in its residual, the parts at once on the pool
        // (largest first); the first error in part order.
        let mut jobs = Vec::with_capacity(parts.len());
        let mut from = 0usize;
        for (((part, &count), bound), kept) in parts
            .iter_mut()
            .zip(&bufs.segments)
            .zip(bufs.bounds.iter_mut())
            .zip(&bufs.part_kept)
        {
            let to = from + count as usize;
            jobs.push((part, bound, kept.smallest, from..to, Ok(())));
            from = to;
        }
        let (idx, vals) = (&bufs.kept, &bufs.values);
        exec.for_each_largest_first(
            &mut jobs,
            |(part, ..)| part.x.len(),
            |_, (part, bound, smallest, range, result)| {
                let Some(r) = part.residual.as_deref_mut() else {
                    return;
                };
                match sparse_fix_up(&idx[range.clone()], &vals[range.clone()], part.at, r) {
                    Ok(fixed) => {
                        // No element left unsent is larger than the smallest kept sum.
                        let unsent = if range.start == range.end {
                            gradwire_core::ResidualBound::of(r).max_abs()
                        } else if range.len() < r.len() {
                            *smallest
                        } else {
                            0.0
                        };
                        **bound = unsent.max(fixed);
                    }
                    Err(e) => *result = Err(e),
                }
            },
        );
        for (.., result) in jobs {
            result.map_err(shard_err)?;
        }
    }
    Ok(written)
}

/// [`encode_parts`] for a frame without chunked sections (sign with the zero mask): the shard
/// gathered into copies (the parts' values and residuals), encoded whole by the core, the
/// residual copied back.
fn encode_gathered(
    layout: &ShardLayout,
    j: usize,
    parts: &mut [Part<'_>],
    params: &Params,
    bufs: &mut Buffers,
    frame: &mut [u8],
) -> Result<usize> {
    let n = layout.shard_lens[j];
    bufs.chunk_x.clear();
    bufs.chunk_r.clear();
    for p in parts.iter() {
        bufs.chunk_x.extend_from_slice(p.x);
        if let Some(r) = p.residual_before() {
            bufs.chunk_r.extend_from_slice(r);
        }
    }
    let need = gradwire_core::scratch_len(n, &params.method);
    if bufs.scratch.len() < need {
        bufs.scratch.resize(need, 0);
    }
    let with_residual = parts.iter().any(|p| p.residual.is_some());
    let written = if with_residual {
        gradwire_core::feedback_step(
            &bufs.chunk_x,
            &mut bufs.chunk_r,
            params,
            &mut bufs.scratch,
            frame,
        )
    } else {
        gradwire_core::encode_into(&bufs.chunk_x, params, &mut bufs.scratch, frame)
    }
    .map_err(|e| match e {
        gradwire_core::Error::NonFinite { index }
        | gradwire_core::Error::ValueOutOfRange { index } => {
            match parts.iter().find(|p| index < p.at + p.x.len()) {
                Some(p) => {
                    let local = index - p.at;
                    let e = match e {
                        gradwire_core::Error::NonFinite { .. } => {
                            gradwire_core::Error::NonFinite { index: local }
                        }
                        _ => gradwire_core::Error::ValueOutOfRange { index: local },
                    };
                    at_part(layout, j, p, e)
                }
                None => Error::core(&format!("two-phase shard {j}"), None, e),
            }
        }
        e => Error::core(&format!("two-phase shard {j}"), None, e),
    })?;
    let mut from = 0usize;
    for p in parts.iter_mut() {
        if let Some(r) = p.residual.as_deref_mut() {
            r.copy_from_slice(&bufs.chunk_r[from..from + r.len()]);
            from += r.len();
        }
    }
    Ok(written)
}

/// The targets' values, one after the other, into `into`.
fn gather_targets(targets: &[Target<'_>], into: &mut Vec<f32>) {
    into.clear();
    for t in targets {
        into.extend_from_slice(t.data);
    }
}

/// The inverse of [`gather_targets`].
fn scatter_targets(from: &[f32], targets: &mut [Target<'_>]) {
    let mut at = 0usize;
    for t in targets {
        let len = t.data.len();
        t.data.copy_from_slice(&from[at..at + len]);
        at += len;
    }
}

/// Runs `f(start, x, residual, (scales, body))` over the shard's chunks of [`CHUNK`]
/// elements (whole sections' blocks), on `exec` (each chunk a job of its own: a chunk's bytes
/// and residual depend on the chunk alone), with the chunk's values and residual where they lie
/// in one part, or gathered into a task's copy where the chunk spans parts (the residual copied
/// back). Updates each part's bound with the largest magnitude of its chunks' residuals, and
/// returns the frame's CRC-32 (of its bytes before the trailer: the header `frame` holds, then
/// what the chunks wrote), each chunk's pieces hashed right after they were written.
///
/// # Errors
/// The first failing chunk's error (in shard order), with the tensor of the element it names.
fn walk_chunks(
    sections: &Sections,
    parts: &mut [Part<'_>],
    bufs: &mut Buffers,
    f: &ChunkStep<'_>,
    frame: &mut [u8],
    exec: Exec,
) -> std::result::Result<u32, (Option<usize>, gradwire_core::Error)> {
    let n = sections.n();
    let chunk = CHUNK.div_ceil(sections.align()).max(1) * sections.align();
    let mut crc = crc32fast::Hasher::new();
    crc.update(frame.get(..sections.header_len()).unwrap_or(&[]));
    let (scales, body) = sections.pieces_mut(frame, 0, n).map_err(|e| (None, e))?;
    let (s_all, b_all) = sections.ranges(0, n).map_err(|e| (None, e))?;
    // The jobs: each chunk's pieces of the sections, and its pieces of the parts, cut in shard
    // order (lists of about n / 2^16 entries, made each call: a few allocations, not one a
    // chunk).
    let spans: Vec<(usize, usize, usize)> =
        parts.iter().map(|p| (p.at, p.x.len(), p.tensor)).collect();
    let (mut scales, mut body) = (scales, body);
    // The chunks' pieces of the parts, in one list (a chunk's are consecutive), then one job
    // per chunk holding its run of them.
    let mut rest: Vec<Piece<'_>> = parts
        .iter_mut()
        .enumerate()
        .map(|(i, p)| (i, p.x, p.old, p.residual.as_deref_mut()))
        .collect();
    let chunks = n.div_ceil(chunk);
    let mut pieces: Vec<Piece<'_>> = Vec::with_capacity(chunks + rest.len());
    let mut counts: Vec<usize> = Vec::with_capacity(chunks);
    let mut next = 0usize;
    for c in 0..chunks {
        let (start, end) = (c * chunk, ((c + 1) * chunk).min(n));
        let before = pieces.len();
        let mut covered = start;
        while covered < end {
            let Some((i, x, old, r)) = rest.get_mut(next) else {
                return Err((
                    None,
                    gradwire_core::Error::LengthMismatch {
                        expected: n,
                        got: covered,
                    },
                ));
            };
            let take = (end - covered).min(x.len());
            let (xa, xb) = x.split_at(take);
            *x = xb;
            let oa = old.map(|whole| {
                let (oa, ob) = whole.split_at(take);
                *old = Some(ob);
                oa
            });
            let ra = match r.take() {
                Some(whole) => {
                    let (ra, rb) = whole.split_at_mut(take);
                    *r = Some(rb);
                    Some(ra)
                }
                None => None,
            };
            pieces.push((*i, xa, oa, ra));
            covered += take;
            if x.is_empty() {
                next += 1;
            }
        }
        counts.push(pieces.len() - before);
    }
    let mut jobs: Vec<ChunkJob<'_, '_>> = Vec::with_capacity(chunks);
    let mut pieces_rest = &mut pieces[..];
    for (c, &count) in counts.iter().enumerate() {
        let start = c * chunk;
        let end = (start + chunk).min(n);
        let (sr, br) = sections.ranges(start, end).map_err(|e| (None, e))?;
        debug_assert!(sr.start - s_all.start == s_all.len() - scales.len());
        debug_assert!(br.start - b_all.start == b_all.len() - body.len());
        let (s_piece, s_rest) = std::mem::take(&mut scales).split_at_mut(sr.len());
        let (b_piece, b_rest) = std::mem::take(&mut body).split_at_mut(br.len());
        scales = s_rest;
        body = b_rest;
        let (mine, later) = std::mem::take(&mut pieces_rest).split_at_mut(count);
        pieces_rest = later;
        jobs.push(ChunkJob {
            start,
            scales: s_piece,
            body: b_piece,
            pieces: mine,
            result: Ok(0.0),
            crcs: (0, 0),
        });
    }
    exec.for_each_with(
        &mut jobs,
        || bufs.chunk_pool.lease(),
        |lease, _, job| {
            job.result = run_chunk(f, job, lease.get());
            // The chunk's pieces were just written: hashed while they are in cache, where a
            // pass over the whole frame after the chunks would read it again.
            if job.result.is_ok() {
                job.crcs = (crc32fast::hash(job.scales), crc32fast::hash(job.body));
            }
        },
    );
    for job in &jobs {
        let m = match &job.result {
            Ok(m) => *m,
            Err(e) => {
                return Err(match (locate(&spans, *e), &*job.pieces) {
                    // An error without an element (a defect): the tensor of a one-part chunk.
                    ((None, e), [(i, ..)]) => (Some(spans[*i].2), e),
                    (located, _) => located,
                });
            }
        };
        for &(i, _, _, ref r) in job.pieces.iter() {
            if r.is_some() {
                bufs.bounds[i] = bufs.bounds[i].max(m);
            }
        }
    }
    // The frame's CRC: its header's (hashed above), then every chunk's scales piece and body
    // piece combined in byte order (the sections follow the header and each other; each chunk
    // owns one contiguous piece of each).
    let piece = |crc: u32, len: usize| crc32fast::Hasher::new_with_initial_len(crc, len as u64);
    for job in &jobs {
        crc.combine(&piece(job.crcs.0, job.scales.len()));
    }
    for job in &jobs {
        crc.combine(&piece(job.crcs.1, job.body.len()));
    }
    debug_assert!(
        s_all.start == sections.header_len()
            && s_all.end == b_all.start
            && b_all.end == sections.checksummed_len()
    );
    Ok(crc.finalize())
}

/// What [`walk_chunks`] runs on each chunk: `(start in the shard, values, residual, (scales
/// piece, body piece))`.
type ChunkStep<'a> = dyn Fn(
        usize,
        &[f32],
        Option<&mut [f32]>,
        &mut (&mut [u8], &mut [u8]),
    ) -> std::result::Result<(), gradwire_core::Error>
    + Sync
    + 'a;

/// A chunk's piece of a part in [`walk_chunks`]: the part's index, its values, its residual
/// before the step when kept apart ([`Part::old`]), its residual.
type Piece<'p> = (usize, &'p [f32], Option<&'p [f32]>, Option<&'p mut [f32]>);

/// One chunk of [`walk_chunks`]: where it starts in the shard, its pieces of the frame's
/// sections, its pieces of the parts ([`Piece`]), its result (the
/// largest magnitude of its new residual) and its pieces' checksums.
struct ChunkJob<'f, 'p> {
    start: usize,
    scales: &'f mut [u8],
    body: &'f mut [u8],
    pieces: &'f mut [Piece<'p>],
    result: std::result::Result<f32, gradwire_core::Error>,
    /// The CRC-32 of its scales piece and of its body piece, once written.
    crcs: (u32, u32),
}

/// Runs one chunk: on the part's own slices when the chunk lies in one part, else on copies in
/// `spare` (values, then residual), the residual copied back.
fn run_chunk(
    f: &ChunkStep<'_>,
    job: &mut ChunkJob<'_, '_>,
    spare: &mut (Vec<f32>, Vec<f32>),
) -> std::result::Result<f32, gradwire_core::Error> {
    let mut frame_pieces = (&mut *job.scales, &mut *job.body);
    if let [(_, x, old, r)] = &mut job.pieces[..] {
        // A residual kept apart is copied into the new one here, while the chunk is in cache:
        // the step then runs in place on it, and the old one is read once.
        if let (Some(old), Some(r)) = (old, r.as_deref_mut()) {
            r.copy_from_slice(old);
        }
        f(job.start, x, r.as_deref_mut(), &mut frame_pieces)?;
        // The chunk's residual is in cache: its bound costs little.
        return Ok(r
            .as_deref()
            .map_or(0.0, |r| gradwire_core::ResidualBound::of(r).max_abs()));
    }
    let (cx, cr) = spare;
    cx.clear();
    cr.clear();
    let with_residual = job.pieces.first().is_some_and(|p| p.3.is_some());
    for (_, x, old, r) in job.pieces.iter() {
        cx.extend_from_slice(x);
        if let Some(r) = old.or(r.as_deref()) {
            cr.extend_from_slice(r);
        }
    }
    let r = with_residual.then_some(&mut cr[..]);
    f(job.start, cx, r, &mut frame_pieces)?;
    if !with_residual {
        return Ok(0.0);
    }
    let m = gradwire_core::ResidualBound::of(cr).max_abs();
    let mut from = 0usize;
    for (.., r) in job.pieces.iter_mut() {
        if let Some(r) = r {
            r.copy_from_slice(&cr[from..from + r.len()]);
            from += r.len();
        }
    }
    Ok(m)
}

/// The error `e` of a chunk (a core error naming a shard index) as the error of the tensor whose
/// part holds that element, naming its index in the part; `spans` holds each part's `(at, len,
/// tensor)`.
fn locate(
    spans: &[(usize, usize, usize)],
    e: gradwire_core::Error,
) -> (Option<usize>, gradwire_core::Error) {
    match e {
        gradwire_core::Error::NonFinite { index }
        | gradwire_core::Error::ValueOutOfRange { index } => spans
            .iter()
            .find(|&&(at, len, _)| at <= index && index < at + len)
            .map_or((None, e), |&(at, _, tensor)| (Some(tensor), to_part(e, at))),
        _ => (None, e),
    }
}

/// A core error naming shard index `index` as the error naming `index - at` (the index in the
/// part that starts at `at`).
fn to_part(e: gradwire_core::Error, at: usize) -> gradwire_core::Error {
    match e {
        gradwire_core::Error::NonFinite { index } => gradwire_core::Error::NonFinite {
            index: index.saturating_sub(at),
        },
        gradwire_core::Error::ValueOutOfRange { index } => gradwire_core::Error::ValueOutOfRange {
            index: index.saturating_sub(at),
        },
        e => e,
    }
}

/// How [`apply_frame`] puts a frame's values into its targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Apply {
    /// Adds them, per element what [`gradwire_core::accumulate_into`] with weight 1 adds.
    Add,
    /// Writes them, per element what [`gradwire_core::decode_into`] writes (zeros where a
    /// sparse frame carries no entry).
    Write,
    /// Writes them as the first term of a sum: per element what [`Apply::Add`] gives on
    /// targets of zeros (`0.0 + value`: the values, with a zero always 0.0, never -0.0),
    /// without a pass of zeros first.
    Start,
}

/// `0.0 + x` for every element: -0.0 becomes 0.0, nothing else changes.
fn positive_zeros(values: &mut [f32]) {
    for x in values {
        *x += 0.0;
    }
}

/// Puts `frame`'s decoded values (a frame of owner `j`'s shard, checked here against `params`
/// as the core's decoder checks it) into `targets` (the shard's parts with elements, in shard
/// order, covering the shard), as `how` says; a sparse frame's zeros written on `exec`.
///
/// # Errors
/// The core's error for a frame that does not decode as expected, as the core's decoder names
/// it for the whole frame (its checksum first); with a dense-shaped frame the targets hold
/// unspecified values then (those of the chunks decoded before the fault was found, which for
/// a damaged frame may be all of them: its checksum is summed on the way).
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_frame(
    layout: &ShardLayout,
    j: usize,
    frame: &[u8],
    params: &Params,
    targets: &mut [Target<'_>],
    how: Apply,
    bufs: &mut Buffers,
    exec: Exec,
) -> std::result::Result<(), gradwire_core::Error> {
    let n = layout.shard_lens[j];
    if matches!(params.method, Method::TopK { .. }) {
        let sparse = SparseFrame::parse(frame, params, n)?;
        let kept = sparse.kept();
        bufs.kept.resize(kept, 0);
        bufs.values.resize(kept, 0.0);
        sparse.indices(&mut bufs.kept)?;
        sparse.values(0, &mut bufs.values)?;
        // Each target's entries (the indices ascend, the targets cover the shard in order), so
        // that the targets run at once, each its zeros then its entries: the writes of one pass
        // over the entries in order, since every element is written by one entry at most.
        let (idx, vals) = (&bufs.kept, &bufs.values);
        bufs.spans.clear();
        bufs.spans.extend(targets.iter().map(|target| {
            let end = target.at + target.data.len();
            (
                idx.partition_point(|&i| (i as usize) < target.at),
                idx.partition_point(|&i| (i as usize) < end),
            )
        }));
        let spans = &bufs.spans;
        exec.for_each_largest_first(
            targets,
            |target| target.data.len(),
            |t, target| {
                if how != Apply::Add {
                    target.data.fill(0.0);
                }
                let (from, to) = spans.get(t).copied().unwrap_or_default();
                let entries = idx.get(from..to).zip(vals.get(from..to));
                for (&i, &v) in entries.into_iter().flat_map(|(i, v)| i.iter().zip(v)) {
                    if let Some(x) = target.data.get_mut((i as usize).wrapping_sub(target.at)) {
                        match how {
                            Apply::Add | Apply::Start => *x += v,
                            Apply::Write => *x = v,
                        }
                    }
                }
            },
        );
        return Ok(());
    }
    let Some(sections) = Sections::of(n, &params.method) else {
        // A frame without chunked sections (sign with the zero mask): decoded whole, through
        // a copy of the shard.
        match how {
            Apply::Add => {
                gather_targets(targets, &mut bufs.chunk_x);
                gradwire_core::accumulate_into(frame, params, &mut bufs.chunk_x, 1.0)?;
            }
            Apply::Write | Apply::Start => {
                bufs.chunk_x.clear();
                bufs.chunk_x.resize(n, 0.0);
                gradwire_core::decode_into(frame, params, &mut bufs.chunk_x)?;
                if how == Apply::Start {
                    positive_zeros(&mut bufs.chunk_x);
                }
            }
        };
        scatter_targets(&bufs.chunk_x, targets);
        return Ok(());
    };
    // A frame whose length and header bytes are the ones expected is checked on the way: each
    // chunk's pieces hashed right before they are decoded (in cache then), the sum compared
    // with the trailer after the last chunk. The errors are those of a check first: a fault in
    // a chunk is named after the whole frame's checksum passed, and any other frame is checked
    // whole first. (The targets hold decoded values after a failed checksum; every caller
    // fails its step then.)
    bufs.header.clear();
    bufs.header.resize(sections.header_len(), 0);
    sections.write_header(&mut bufs.header)?;
    let on_the_way =
        frame.len() == sections.frame_len() && frame.get(..bufs.header.len()) == Some(&bufs.header);
    if !on_the_way {
        peek(frame)?.check(params, n)?;
    }
    let checked_first = |e: gradwire_core::Error| match on_the_way {
        true => peek(frame).err().unwrap_or(e),
        false => e,
    };
    let (mut scales_crc, mut body_crc) = (crc32fast::Hasher::new(), crc32fast::Hasher::new());
    let chunk = CHUNK.div_ceil(sections.align()).max(1) * sections.align();
    let mut first = 0usize;
    let mut start = 0usize;
    while start < n {
        let end = (start + chunk).min(n);
        if on_the_way {
            let (sr, br) = sections.ranges(start, end)?;
            scales_crc.update(frame.get(sr).unwrap_or(&[]));
            body_crc.update(frame.get(br).unwrap_or(&[]));
        }
        while first < targets.len() && targets[first].at + targets[first].data.len() <= start {
            first += 1;
        }
        let Some(target) = targets.get_mut(first) else {
            break;
        };
        if target.at <= start && end <= target.at + target.data.len() {
            let out = &mut target.data[start - target.at..end - target.at];
            match how {
                Apply::Add => sections
                    .accumulate(frame, start, out, 1.0)
                    .map_err(checked_first)?,
                Apply::Write => sections.decode(frame, start, out).map_err(checked_first)?,
                // The chunk is in cache after its decode.
                Apply::Start => {
                    sections.decode(frame, start, out).map_err(checked_first)?;
                    positive_zeros(out);
                }
            }
        } else {
            bufs.chunk_x.clear();
            match how {
                Apply::Add => {
                    for t in targets[first..].iter() {
                        if t.at >= end {
                            break;
                        }
                        let (a, b) = (start.max(t.at) - t.at, end.min(t.at + t.data.len()) - t.at);
                        bufs.chunk_x.extend_from_slice(&t.data[a..b]);
                    }
                    sections
                        .accumulate(frame, start, &mut bufs.chunk_x, 1.0)
                        .map_err(checked_first)?;
                }
                Apply::Write | Apply::Start => {
                    bufs.chunk_x.resize(end - start, 0.0);
                    sections
                        .decode(frame, start, &mut bufs.chunk_x)
                        .map_err(checked_first)?;
                    if how == Apply::Start {
                        positive_zeros(&mut bufs.chunk_x);
                    }
                }
            }
            let mut from = 0usize;
            for t in targets[first..].iter_mut() {
                if t.at >= end {
                    break;
                }
                let (a, b) = (start.max(t.at) - t.at, end.min(t.at + t.data.len()) - t.at);
                t.data[a..b].copy_from_slice(&bufs.chunk_x[from..from + (b - a)]);
                from += b - a;
            }
        }
        start = end;
    }
    if on_the_way && start < n {
        // Targets that stop short of the shard (a defect): the frame checked whole, as before.
        peek(frame)?;
    } else if on_the_way {
        let mut crc = crc32fast::Hasher::new();
        crc.update(&bufs.header);
        crc.combine(&scales_crc);
        crc.combine(&body_crc);
        let computed = crc.finalize();
        let t = &frame[sections.checksummed_len()..];
        let stored = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
        if stored != computed {
            return Err(gradwire_core::Error::Checksum { stored, computed });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The in-place shard step against the straightforward one: each shard gathered into a
    //! copy (gradient and residual), encoded whole by the core (`feedback_step`, or for top-k
    //! each part's top-k of the sums, `encode_segmented_into`, `sparse_update`), the residual
    //! scattered back. Same frame bytes, same residual bits, same decode, at shard sizes that
    //! span several chunks and parts that start and end inside chunks.
    use gradwire_core::feedback::{feedback_step, sparse_update};
    use gradwire_core::select::kept_scratch_len;
    use gradwire_core::{
        K, Rounding, SignScale, Values, decode_into, encode_into, encode_segmented_into,
        max_frame_len, scratch_len, segmented_frame_len, segmented_scratch_len,
    };

    use super::*;
    use crate::layout::{BucketConfig, Manifest, TensorSpec};
    use crate::method::CompressionMethod;

    /// Seeded heavy-tailed values (xorshift), drawn here: the engine looks down only, so it
    /// does not reach the tests' shared helpers through `allreduce`.
    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                scale * u * u * u * 8.0
            })
            .collect()
    }

    /// The shard of `j` gathered from whole tensors.
    fn gather(layout: &ShardLayout, j: usize, tensors: &[Vec<f32>]) -> Vec<f32> {
        let mut out = Vec::new();
        for (t, x) in tensors.iter().enumerate() {
            out.extend_from_slice(&x[layout.range(t, j)]);
        }
        out
    }

    /// The straightforward step on a gathered shard: the frame, and the residual after it.
    fn reference(
        layout: &ShardLayout,
        j: usize,
        x: &[f32],
        residual: Option<&mut [f32]>,
        params: &Params,
    ) -> Vec<u8> {
        let n = x.len();
        let Method::TopK { values, .. } = params.method else {
            let mut scratch = vec![0u32; scratch_len(n, &params.method)];
            let mut frame = vec![0u8; max_frame_len(n, &params.method)];
            let len = match residual {
                Some(r) => feedback_step(x, r, params, &mut scratch, &mut frame),
                None => encode_into(x, params, &mut scratch, &mut frame),
            }
            .unwrap();
            frame.truncate(len);
            return frame;
        };
        let sums: Vec<f32> = match &residual {
            Some(r) => x.iter().zip(r.iter()).map(|(g, r)| r + g).collect(),
            None => x.to_vec(),
        };
        let (mut kept, mut segments) = (Vec::new(), Vec::new());
        for ts in &layout.tensors {
            if ts.lens[j] == 0 {
                continue;
            }
            let k = ts.budgets[j] as usize;
            let part = &sums[ts.starts[j]..ts.starts[j] + ts.lens[j]];
            let mut sel = vec![0u32; kept_scratch_len(part.len(), k)];
            let got = topk_kept(part, k, f32::INFINITY, &mut sel).unwrap();
            kept.extend(got.idx.iter().map(|&i| i + ts.starts[j] as u32));
            segments.push(got.idx.len() as u32);
        }
        let k = kept.len();
        let mut scratch = vec![0u32; segmented_scratch_len(n, k, values, segments.len())];
        let mut frame = vec![0u8; segmented_frame_len(n, k, values, segments.len())];
        let len = encode_segmented_into(&sums, &kept, &segments, values, &mut scratch, &mut frame)
            .unwrap();
        frame.truncate(len);
        if let Some(r) = residual {
            let sparse = SparseFrame::parse(&frame, params, n).unwrap();
            let mut idx = vec![0u32; sparse.kept()];
            let mut val = vec![0.0f32; sparse.kept()];
            sparse.indices(&mut idx).unwrap();
            sparse.values(0, &mut val).unwrap();
            sparse_update(&idx, &val, 0, x, r).unwrap();
        }
        frame
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn in_place_parts_match_the_gathered_shard() {
        // Parts that start and end inside the walk's chunks, a part longer than two chunks,
        // tensors smaller than a block, one of one element.
        let sizes = [150_000usize, 3_000, 1, 70_001, 900, 131_072];
        let methods = [
            Method::TopK {
                k: K::Ratio(0.01),
                values: Values::Int8 { block: 256 },
            },
            Method::TopK {
                k: K::Ratio(0.02),
                values: Values::F16,
            },
            Method::Quant {
                bits: 4,
                block: 64,
                rounding: Rounding::Stochastic,
            },
            Method::Sign {
                scale: SignScale::MeanAbs { block: 128 },
                zero_mask: false,
            },
            Method::Sign {
                scale: SignScale::MeanAbs { block: 64 },
                zero_mask: true,
            },
            Method::Dense {
                values: Values::Bf16,
            },
        ];
        for method in methods {
            for world in [1usize, 3] {
                for with_residual in [true, false] {
                    let specs: Vec<TensorSpec> = sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| TensorSpec::new(format!("t{i}"), [n]))
                        .collect();
                    let manifest = Manifest::new(
                        specs,
                        &CompressionMethod::Core(method),
                        5,
                        BucketConfig::none(),
                    )
                    .unwrap();
                    let layout = ShardLayout::new(&manifest, world).unwrap();
                    let grads: Vec<Vec<f32>> = sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| values(i as u64 + 1, n, 1.0))
                        .collect();
                    let mut residuals: Vec<Vec<f32>> = sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| values(i as u64 + 100, n, 0.3))
                        .collect();
                    let what = format!("{method:?} W {world} residual {with_residual}");
                    let mut bufs = Buffers::default();
                    for j in 0..world {
                        let n = layout.shard_lens[j];
                        if n == 0 {
                            continue;
                        }
                        let params = Params {
                            method: layout.methods[j],
                            seed: 5,
                            step: 3,
                            tensor_id: layout.worker_ids[j],
                        };
                        let x = gather(&layout, j, &grads);
                        let mut r_ref = gather(&layout, j, &residuals);
                        let want = reference(
                            &layout,
                            j,
                            &x,
                            with_residual.then_some(&mut r_ref[..]),
                            &params,
                        );
                        let mut frame = vec![0u8; layout.max_frame_len(j)];
                        let slices: Vec<&[f32]> = grads.iter().map(|g| &g[..]).collect();
                        let taken = if with_residual {
                            &mut residuals[..]
                        } else {
                            &mut []
                        };
                        let mut parts = parts_of(&layout, j, &slices, taken);
                        // On the pool and on one thread by turns: the same bytes either way.
                        let exec = match (j + usize::from(with_residual)) % 2 {
                            0 => Exec::Pool,
                            _ => Exec::Serial,
                        };
                        let len = encode_parts(
                            &layout, j, &mut parts, &params, &mut bufs, &mut frame, exec,
                        )
                        .unwrap();
                        // Each part's bound holds for its new residual (zero-mask sign keeps
                        // none: infinite).
                        if with_residual {
                            for (part, &bound) in parts.iter().zip(bufs.part_bounds()) {
                                let r = part.residual.as_deref().unwrap();
                                let largest = r.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                                assert!(largest <= bound, "{what}: owner {j}'s bound");
                                let zero_mask = matches!(
                                    method,
                                    Method::Sign {
                                        zero_mask: true,
                                        ..
                                    }
                                );
                                assert!(bound.is_finite() || zero_mask, "{what}: a bound");
                            }
                        }
                        drop(parts);
                        assert_eq!(&frame[..len], &want[..], "{what}: owner {j}'s frame");
                        if with_residual {
                            assert_eq!(
                                bits(&gather(&layout, j, &residuals)),
                                bits(&r_ref),
                                "{what}: owner {j}'s residual"
                            );
                        }
                        // The decode into the parts (over a non-zero start: an add) against
                        // the core's decode of the whole shard.
                        let mut whole = vec![0.0f32; n];
                        decode_into(&frame[..len], &params, &mut whole).unwrap();
                        let mut outs: Vec<Vec<f32>> =
                            sizes.iter().map(|&n| vec![0.5f32; n]).collect();
                        let mut targets = targets_of(&layout, j, &mut outs);
                        apply_frame(
                            &layout,
                            j,
                            &frame[..len],
                            &params,
                            &mut targets,
                            Apply::Add,
                            &mut bufs,
                            exec,
                        )
                        .unwrap();
                        drop(targets);
                        let added: Vec<f32> = whole.iter().map(|v| 0.5 + v).collect();
                        assert_eq!(
                            bits(&gather(&layout, j, &outs)),
                            bits(&added),
                            "{what}: owner {j}'s frame added"
                        );
                        let mut targets = targets_of(&layout, j, &mut outs);
                        apply_frame(
                            &layout,
                            j,
                            &frame[..len],
                            &params,
                            &mut targets,
                            Apply::Write,
                            &mut bufs,
                            exec,
                        )
                        .unwrap();
                        drop(targets);
                        assert_eq!(
                            bits(&gather(&layout, j, &outs)),
                            bits(&whole),
                            "{what}: owner {j}'s frame decoded"
                        );
                        // A damaged frame (a byte of its header, of its sections or of its
                        // trailer): the error of the core's decoder of the whole frame, which
                        // checks the checksum first, though the sections are hashed as they are
                        // decoded. Four bytes of 0x7f or 0xff in the sections make an f32 scale
                        // or a bf16 value NaN, which a chunk's check meets before the end: the
                        // checksum is still named. Then a fault under a checksum made again
                        // (the chunk's own error, or none where the bytes are valid codes), and
                        // a frame one byte longer (checked whole first): the core decoder's
                        // result for the whole frame.
                        let spoil = |at: usize, bad: &mut [u8]| {
                            for b in &mut bad[at..(at + 4).min(len)] {
                                *b = !*b | 0x7f;
                            }
                        };
                        let mut cases: Vec<(Vec<u8>, String, bool)> =
                            [5, len / 3, len / 2, len - 9, len - 1]
                                .into_iter()
                                .map(|at| {
                                    let mut bad = frame[..len].to_vec();
                                    spoil(at, &mut bad);
                                    (bad, format!("byte {at} flipped"), true)
                                })
                                .collect();
                        let mut resealed = frame[..len].to_vec();
                        spoil(len / 2, &mut resealed);
                        let sealed = crc32fast::hash(&resealed[..len - 4]);
                        resealed[len - 4..].copy_from_slice(&sealed.to_le_bytes());
                        cases.push((resealed, "resealed".into(), false));
                        let mut longer = frame[..len].to_vec();
                        longer.push(0);
                        cases.push((longer, "longer".into(), true));
                        for (bad, how, fails) in cases {
                            let want = decode_into(&bad, &params, &mut whole).err();
                            assert!(want.is_some() || !fails, "{what}: owner {j}'s frame {how}");
                            let mut targets = targets_of(&layout, j, &mut outs);
                            let got = apply_frame(
                                &layout,
                                j,
                                &bad,
                                &params,
                                &mut targets,
                                Apply::Write,
                                &mut bufs,
                                exec,
                            )
                            .err();
                            assert_eq!(got, want, "{what}: owner {j}'s frame {how}");
                        }
                    }
                }
            }
        }
    }
}

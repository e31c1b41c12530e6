//! Multi-core compression and aggregation: [`Parallelism`], and the kernels that cut one large
//! frame into chunks at block boundaries.
//!
//! Every parallel path writes the same bytes (bundles, frames) and the same f32 bits
//! (aggregates, residuals) as the serial path, by construction:
//!
//! - **across entries**: each entry of a manifest (a tensor or a bucket) is encoded into its own
//!   frame buffer, with its own residuals, and the frames are concatenated in manifest order;
//!   aggregation gives each entry's output range to one task, which adds the ranks' frames in
//!   rank order. Entries never share output, so no sum changes order.
//! - **across chunks of one large entry**: dense, quantization and sign frames keep their
//!   sections (scales, then codes, signs or values) in element order, one scale per block, so a
//!   chunk of whole blocks that starts on a byte boundary owns a contiguous piece of each section.
//!   Each chunk is encoded (error feedback included: `residual += g`, encode, `residual -=
//!   decoded`) or accumulated (every rank in rank order) on its own; every element sees the same
//!   operations in the same order as in the serial path. Sparse frames (top-k, threshold) are
//!   aggregated in chunks of the output: each rank's indices and values are decoded once (ranks in
//!   parallel), then each chunk adds, rank by rank, the entries that fall into it.
//!
//! - **top-k and threshold of one large tensor**: selected in chunks (each chunk collects its
//!   candidates above a global floor, an exact select among them finishes), then one frame is
//!   written from the kept list; see `parallel_select.rs`.
//! - **random-k of one large tensor**: the indices of the sequential selection sampling are
//!   drawn in chunks (each chunk lists the draws below a bound on the count still needed, one
//!   thread walks the lists with the exact count; see `parallel_randomk.rs`), then one frame is
//!   written from them. Aggregation draws the indices once for all ranks (their frames carry
//!   the same seed, step and tensor id) and decodes each rank's values.
//!
//! Stochastic rounding splits too: its draws are keyed by the element's index in the tensor,
//! which the core's `quant::encode_from` takes for a piece.
//!
//! `Parallelism::Serial` runs the same code on the calling thread, chunks one after the other
//! (the compressor's passes and tiles help there too: see `docs/multicore.md`).
//!
//! Errors are those of the serial path: compression checks every tensor (entries, and chunks
//! of a large tensor, in parallel) before any residual changes and reports the first failing
//! tensor in manifest order, found again by the serial check; aggregation checks the bundles in
//! parallel and reports the first failing rank, and when a frame body turns out invalid it runs
//! the serial path, which reports the same error and leaves the output as it does.
//!
//! [`Parallelism::Auto`] (the default) runs in parallel when rayon's pool (the global one, or
//! the pool the call runs in) has more than one thread. Memory: compression (serial or
//! parallel) keeps one frame buffer per entry ([`crate::bundle::Manifest::max_bundle_len`] in
//! all), one set of scratch buffers per task running at the same time and, per large top-k,
//! threshold or random-k tensor, the lists of its chunked selection (random-k: 16 bytes per
//! candidate, lists of twice the expected count, about 2k); parallel aggregation of a large
//! sparse entry keeps every rank's decoded indices and values (8 bytes per kept entry per rank).
//! These buffers are kept between calls; rayon itself may allocate for its job bookkeeping (see
//! `docs/multicore.md`).

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use gradwire_core::{
    Method, Params, Rounding, SignScale, Values, encode_into, index, max_frame_len, quant, sign,
    values,
};

/// How many frames of large top-k, threshold or random-k tensors this process has selected in
/// chunks (rather than by the core's serial selection, when the sample missed or overshot or a
/// residual did not exist yet). For tests and diagnostics; the bytes are the same either way.
#[doc(hidden)]
pub fn frames_selected_in_chunks() -> u64 {
    crate::parallel_select::frames_selected_in_chunks()
}

/// How many error-feedback frames of large top-k tensors this process has written in one pass
/// over the gradient and the residual (the residual's bound proved every sum in range; see
/// [`gradwire_core::feedback_step_bounded`]). For tests and diagnostics; the bytes are the same
/// either way.
#[doc(hidden)]
pub fn frames_in_one_pass() -> u64 {
    crate::parallel_select::frames_in_one_pass()
}

/// How many cores compression and aggregation use.
///
/// The parallel path runs on rayon's pool: the global one, or the pool of
/// [`rayon::ThreadPool::install`] when called inside it. Ranks simulated in one process
/// ([`crate::comm::LocalGroup`]) should run on their own threads, as they do there: a rank run
/// as a rayon task that blocks in an all-gather could be picked up by a worker waiting inside
/// another rank's parallel call, and the two would wait for each other. Use
/// [`Parallelism::Serial`] inside such tasks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Parallelism {
    /// In parallel when rayon's pool has more than one thread, else serial; also serial for a
    /// model of fewer than [`AUTO_MIN_ELEMENTS`] elements, where handing work to other threads
    /// costs more than it saves.
    #[default]
    Auto,
    /// On the calling thread only.
    Serial,
    /// On rayon's pool, even with one thread.
    Parallel,
}

/// Elements below which [`Parallelism::Auto`] runs a model serially.
pub const AUTO_MIN_ELEMENTS: usize = 1 << 16;

impl Parallelism {
    /// Whether a call made now on a large model runs the parallel path.
    pub fn is_parallel(self) -> bool {
        match self {
            Parallelism::Auto => rayon::current_num_threads() > 1,
            Parallelism::Serial => false,
            Parallelism::Parallel => true,
        }
    }

    /// Whether a call made now on a model of `elements` elements runs the parallel path.
    pub fn is_parallel_for(self, elements: usize) -> bool {
        match self {
            Parallelism::Auto => elements >= AUTO_MIN_ELEMENTS && self.is_parallel(),
            other => other.is_parallel(),
        }
    }

    /// Threads a call made now on a large model uses: 1 for the serial path, else the size of
    /// rayon's pool.
    pub fn threads(self) -> usize {
        if self.is_parallel() {
            rayon::current_num_threads()
        } else {
            1
        }
    }
}

/// Elements per chunk of a split frame (rounded up to whole blocks and bytes): 256 KiB of f32,
/// small enough that a chunk of the output stays in the L2 cache while W ranks add into it.
pub(crate) const CHUNK: usize = 1 << 16;

/// Entries of fewer elements are never split (two chunks at least).
pub(crate) const SPLIT_MIN: usize = 2 * CHUNK;

/// What a split frame carries.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Dense(Values),
    Quant { bits: u8, block: usize },
    Sign { block: Option<usize> },
}

/// Where the sections of a dense, quantization or sign frame of `n` elements lie, and how they
/// cut into chunks of `chunk` elements (whole blocks, starting on byte boundaries); encoding
/// runs each chunk in tiles of `tile` elements (cut the same way) that stay in the L1/L2 cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Split {
    kind: Kind,
    n: usize,
    header: usize,
    scales: usize,
    body: usize,
    chunk: usize,
    tile: usize,
}

/// Elements per encoding tile (rounded up to whole blocks and bytes).
const TILE: usize = 8192;

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Split {
    /// The split of a frame of `n` elements made with `method`, or `None` when it does not
    /// split (another method, too few elements, a block too large).
    pub(crate) fn new(n: usize, method: &Method) -> Option<Split> {
        let (kind, block) = match *method {
            Method::Dense { values } if !matches!(values, Values::Int8 { .. }) => {
                (Kind::Dense(values), 1)
            }
            Method::Quant { bits, block, .. } => {
                let block = block as usize;
                (Kind::Quant { bits, block }, block)
            }
            Method::Sign { scale } => match scale {
                SignScale::MeanAbs { block } => (
                    Kind::Sign {
                        block: Some(block as usize),
                    },
                    block as usize,
                ),
                SignScale::None => (Kind::Sign { block: None }, 1),
            },
            _ => return None,
        };
        if block == 0 || n < SPLIT_MIN {
            return None;
        }
        // Whole blocks and whole bytes of codes, signs or values.
        let align = (block / gcd(block, 8)).checked_mul(8)?;
        let chunk = CHUNK.div_ceil(align).checked_mul(align)?;
        if n < chunk.checked_mul(2)? {
            return None;
        }
        let tile = TILE.div_ceil(align).checked_mul(align)?.min(chunk);
        let (scales, body) = match kind {
            Kind::Dense(v) => (0, n.checked_mul(v.value_bytes())?),
            Kind::Quant { bits, block } => (quant::scales_len(n, block), quant::codes_len(n, bits)),
            Kind::Sign { block } => (sign::scales_len(n, block), sign::bits_len(n)),
        };
        // The parameters sit between the fixed header and the sections; an empty frame has
        // no sections, so its length less the CRC is the header.
        let header = max_frame_len(0, method).checked_sub(4)?;
        let total = header
            .checked_add(scales)?
            .checked_add(body)?
            .checked_add(4)?;
        if total != max_frame_len(n, method) {
            return None;
        }
        Some(Split {
            kind,
            n,
            header,
            scales,
            body,
            chunk,
            tile,
        })
    }

    /// Bytes of the whole frame.
    pub(crate) fn frame_len(&self) -> usize {
        self.header + self.scales + self.body + 4
    }

    /// Bytes of scales of the first `elems` elements: one scale per started block.
    fn scale_bytes(&self, elems: usize) -> usize {
        match self.kind {
            Kind::Dense(_) | Kind::Sign { block: None } => 0,
            Kind::Quant { block, .. } | Kind::Sign { block: Some(block) } => {
                elems.div_ceil(block) * 4
            }
        }
    }

    /// Bytes of codes, signs or values of the first `elems` elements.
    fn body_bytes(&self, elems: usize) -> usize {
        match self.kind {
            Kind::Dense(v) => elems * v.value_bytes(),
            Kind::Quant { bits, .. } => quant::codes_len(elems, bits),
            Kind::Sign { .. } => sign::bits_len(elems),
        }
    }

    /// The bytes of elements `start..start + len` of sections `s` and `b` (`start` aligned: a
    /// whole number of blocks and of bytes).
    fn cut<'f>(&self, s: &'f [u8], b: &'f [u8], start: usize, len: usize) -> (&'f [u8], &'f [u8]) {
        let (sa, se) = (self.scale_bytes(start), self.scale_bytes(start + len));
        let (ba, be) = (self.body_bytes(start), self.body_bytes(start + len));
        (
            s.get(sa..se).unwrap_or_default(),
            b.get(ba..be).unwrap_or_default(),
        )
    }

    /// The scales and body sections of `frame` (a frame of this split).
    fn sections<'f>(&self, frame: &'f [u8]) -> Option<(&'f [u8], &'f [u8])> {
        let b0 = self.header + self.scales;
        Some((frame.get(self.header..b0)?, frame.get(b0..b0 + self.body)?))
    }

    /// Encodes `x` (one tile, elements `first..` of the tensor) into its sections;
    /// `stochastic` is the (seed, step, tensor id) of stochastic rounding.
    fn encode_tile(
        &self,
        x: &[f32],
        first: usize,
        stochastic: Option<(u64, u64, u64)>,
        scales: &mut [u8],
        body: &mut [u8],
    ) {
        match self.kind {
            Kind::Dense(v) => values::encode_plain(v, x, body),
            Kind::Quant { bits, block } => {
                quant::encode_from(x, first as u64, bits, block, stochastic, scales, body);
            }
            Kind::Sign { block } => sign::encode(x, block, scales, body),
        }
    }

    /// Adds `weight * decoded` of a piece's sections into `acc`, as the core's
    /// `accumulate_into` does for the whole frame.
    fn add(&self, scales: &[u8], body: &[u8], acc: &mut [f32], weight: f32) {
        match self.kind {
            Kind::Dense(v) => values::decode_plain(v, body, acc, Some(weight)),
            Kind::Quant { bits, block } => {
                quant::decode_slice(bits, block, scales, body, acc, Some(weight));
            }
            Kind::Sign { block } => sign::decode_slice(block, scales, body, acc, Some(weight)),
        }
    }

    /// The core decoder's checks of the sections of `len` elements (a piece starting at a chunk
    /// boundary): every piece passes exactly when the whole frame does.
    fn valid(&self, scales: &[u8], body: &[u8], len: usize) -> bool {
        match self.kind {
            Kind::Dense(v) => {
                body.len() == len * v.value_bytes() && values::first_bad_plain(v, body).is_none()
            }
            Kind::Quant { bits, .. } => quant::validate_fast(len, bits, scales, body).is_ok(),
            Kind::Sign { .. } => sign::validate(len, scales, body).is_ok(),
        }
    }

    /// Encodes `grad` into `frame` (at least [`Split::frame_len`] bytes), chunks in parallel,
    /// and returns the frame length: the bytes of the core's `encode_into` with `params`, or with
    /// `residual`, of its `feedback_step` (the residual updated the same way: `r += g`, then
    /// `r += -1 * decoded`). The input must have been checked (finite, within the value type's
    /// range, also `grad + residual`).
    pub(crate) fn encode(
        &self,
        params: &Params,
        grad: &[f32],
        residual: Option<&mut [f32]>,
        frame: &mut [u8],
        parallel: bool,
    ) -> Option<usize> {
        if grad.len() != self.n
            || residual.as_ref().is_some_and(|r| r.len() != self.n)
            || frame.len() < self.frame_len()
        {
            return None;
        }
        // The header is the core's: that of a one-element frame with the same parameters, with
        // the element count (offset 8, u64) set to n.
        let mut tiny = [0u8; 64];
        encode_into(&[0.0], params, &mut [], &mut tiny).ok()?;
        let (head, rest) = frame.split_at_mut(self.header);
        head.copy_from_slice(tiny.get(..self.header)?);
        head[8..16].copy_from_slice(&(self.n as u64).to_le_bytes());
        let (scales, rest) = rest.split_at_mut(self.scales);
        let (body, _) = rest.split_at_mut(self.body);
        let chunks = self.n.div_ceil(self.chunk);
        let failed = AtomicBool::new(false);
        // Stochastic rounding draws by the element's index in the tensor.
        let stochastic = match params.method {
            Method::Quant {
                rounding: Rounding::Stochastic,
                ..
            } => Some((params.seed, params.step, params.tensor_id)),
            _ => None,
        };
        let work = |j: usize, s: &mut [u8], b: &mut [u8], r: Option<&mut [f32]>| {
            let start = j * self.chunk;
            let g = &grad[start..(start + self.chunk).min(self.n)];
            let mut r = r;
            for (t, g) in g.chunks(self.tile).enumerate() {
                // Tiles start on whole blocks and bytes: the sections cut exactly.
                let a = t * self.tile;
                let (sa, se) = (self.scale_bytes(a), self.scale_bytes(a + g.len()));
                let (ba, be) = (self.body_bytes(a), self.body_bytes(a + g.len()));
                let (Some(s), Some(b)) = (s.get_mut(sa..se), b.get_mut(ba..be)) else {
                    failed.store(true, Ordering::Relaxed);
                    return;
                };
                let first = start + a;
                match r.as_deref_mut() {
                    None => self.encode_tile(g, first, stochastic, s, b),
                    Some(r) => {
                        let Some(r) = r.get_mut(a..a + g.len()) else {
                            failed.store(true, Ordering::Relaxed);
                            return;
                        };
                        for (r, g) in r.iter_mut().zip(g) {
                            *r += *g;
                        }
                        self.encode_tile(r, first, stochastic, s, b);
                        self.add(s, b, r, -1.0);
                    }
                }
            }
        };
        if parallel {
            split_chunks(self, 0, chunks, scales, body, residual, &work);
        } else {
            let mut residual = residual;
            for j in 0..chunks {
                let (a, e) = (j * self.chunk, ((j + 1) * self.chunk).min(self.n));
                let s = &mut scales[self.scale_bytes(a)..self.scale_bytes(e)];
                let b = &mut body[self.body_bytes(a)..self.body_bytes(e)];
                work(j, s, b, residual.as_deref_mut().map(|r| &mut r[a..e]));
            }
        }
        if failed.load(Ordering::Relaxed) {
            return None;
        }
        let end = self.header + self.scales + self.body;
        let crc = if parallel {
            crc32(&frame[..end])
        } else {
            crc32fast::hash(&frame[..end])
        };
        frame[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        Some(end + 4)
    }

    /// Overwrites `acc` (`n` elements) with the sum of `count` frames of this split (in the
    /// order `frames(0)`, `frames(1)`, ...), chunks in parallel, then applies `finish` to each
    /// chunk of the sum. Each chunk starts from zeros, checks each frame's piece as the core's
    /// decoder does and adds it. `false` when a frame is invalid or `finish` returns `false` for
    /// a chunk (`acc` then holds partial sums).
    pub(crate) fn accumulate<'f>(
        &self,
        frames: impl Fn(usize) -> &'f [u8] + Sync,
        count: usize,
        acc: &mut [f32],
        finish: &(impl Fn(&mut [f32]) -> bool + Sync),
    ) -> bool {
        if acc.len() != self.n || (0..count).any(|r| frames(r).len() != self.frame_len()) {
            return false;
        }
        let failed = AtomicBool::new(false);
        acc.par_chunks_mut(self.chunk)
            .enumerate()
            .for_each(|(j, acc)| {
                acc.fill(0.0);
                for r in 0..count {
                    let Some((s, b)) = self.sections(frames(r)) else {
                        failed.store(true, Ordering::Relaxed);
                        return;
                    };
                    let (s, b) = self.cut(s, b, j * self.chunk, acc.len());
                    if !self.valid(s, b, acc.len()) {
                        failed.store(true, Ordering::Relaxed);
                        return;
                    }
                    self.add(s, b, acc, 1.0);
                }
                if !finish(acc) {
                    failed.store(true, Ordering::Relaxed);
                }
            });
        !failed.load(Ordering::Relaxed)
    }
}

/// Runs `work(j, scales, body, residual)` for chunks `first..first + count`, in parallel: the
/// slices are cut at chunk boundaries and halved recursively.
fn split_chunks<W>(
    split: &Split,
    first: usize,
    count: usize,
    scales: &mut [u8],
    body: &mut [u8],
    residual: Option<&mut [f32]>,
    work: &W,
) where
    W: Fn(usize, &mut [u8], &mut [u8], Option<&mut [f32]>) + Sync,
{
    if count <= 1 {
        if count == 1 {
            work(first, scales, body, residual);
        }
        return;
    }
    let half = count / 2;
    let elems = half * split.chunk;
    let (s0, s1) = scales.split_at_mut(split.scale_bytes(elems).min(scales.len()));
    let (b0, b1) = body.split_at_mut(split.body_bytes(elems).min(body.len()));
    let (r0, r1) = match residual {
        Some(r) => {
            let (a, b) = r.split_at_mut((half * split.chunk).min(r.len()));
            (Some(a), Some(b))
        }
        None => (None, None),
    };
    rayon::join(
        || split_chunks(split, first, half, s0, b0, r0, work),
        || split_chunks(split, first + half, count - half, s1, b1, r1, work),
    );
}

/// CRC-32 of `bytes` (as `crc32fast::hash`), pieces of 1 MiB in parallel.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    const PIECE: usize = 1 << 20;
    if bytes.len() < 2 * PIECE {
        return crc32fast::hash(bytes);
    }
    bytes
        .par_chunks(PIECE)
        .map(|c| {
            let mut h = crc32fast::Hasher::new();
            h.update(c);
            h
        })
        .reduce(crc32fast::Hasher::new, |mut a, b| {
            a.combine(&b);
            a
        })
        .finalize()
}

/// The indices and values of one sparse frame (top-k, threshold or random-k), decoded once so
/// that chunks of the output can each add the entries that fall into them.
#[derive(Debug, Default)]
pub(crate) struct SparseList {
    idx: Vec<u32>,
    val: Vec<f32>,
}

/// Whether a frame of `n` elements made with `method` is aggregated through a [`SparseList`].
pub(crate) fn splits_sparse(n: usize, method: &Method) -> bool {
    matches!(
        method,
        Method::TopK { .. } | Method::Threshold { .. } | Method::RandomK { .. }
    ) && n >= SPLIT_MIN
        && u32::try_from(n).is_ok()
}

impl SparseList {
    /// Decodes a top-k or threshold frame of `n` elements whose header was checked against
    /// `method` (the manifest's). `false`, with the list in any state, for anything the core's
    /// decoder would reject.
    pub(crate) fn decode(&mut self, frame: &[u8], n: usize, method: &Method) -> bool {
        self.idx.clear();
        self.val.clear();
        let Some(v) = method.values() else {
            return false;
        };
        // The header ends with the count (u64) and the index codec (u8); the index section
        // follows, then the values section, then the CRC.
        let Some((fixed, body)) = header_tail_and_body(frame, method, 9) else {
            return false;
        };
        let count = le_u64(&fixed[..8]);
        let codec = fixed[8];
        let Ok(count_usize) = usize::try_from(count) else {
            return false;
        };
        if count_usize > n {
            return false;
        }
        let Ok(idx_len) = index::section_len(codec, n as u64, count, body) else {
            return false;
        };
        let (idx, vals) = body.split_at(idx_len);
        if vals.len() != v.section_len(count_usize) || !values_valid(v, count_usize, vals) {
            return false;
        }
        if self.idx.capacity() < count_usize {
            self.idx.reserve(count_usize);
        }
        let list = &mut self.idx;
        let ok = index::for_each_index(codec, n as u64, count, idx, |i| list.push(i as u32));
        if ok.is_err() || self.idx.len() != count_usize {
            return false;
        }
        self.val.resize(count_usize, 0.0);
        values::decode_run(v, vals, count_usize, 0, &mut self.val);
        true
    }

    /// Decodes a random-k frame of `n` elements whose header was checked against `expected`
    /// (the manifest's parameters), given the indices random-k draws for them (`idx`, drawn
    /// for `expected`'s seed, step and tensor id): the values, times n/k when unbiased.
    /// `false`, with the list in any state, for anything the core's decoder would reject.
    pub(crate) fn decode_randomk(
        &mut self,
        frame: &[u8],
        n: usize,
        expected: &Params,
        idx: &[u32],
    ) -> bool {
        self.idx.clear();
        self.val.clear();
        let method = &expected.method;
        let (Method::RandomK { unbiased, .. }, Some(v)) = (*method, method.values()) else {
            return false;
        };
        // The parameters end with k, seed, step and tensor id (u64 each); the values section
        // follows, then the CRC.
        let Some((fixed, vals)) = header_tail_and_body(frame, method, 32) else {
            return false;
        };
        let word = |j: usize| le_u64(&fixed[8 * j..8 * j + 8]);
        let count = idx.len();
        if word(0) != count as u64
            || [word(1), word(2), word(3)] != [expected.seed, expected.step, expected.tensor_id]
            || count > n
            || vals.len() != v.section_len(count)
            || !values_valid(v, count, vals)
        {
            return false;
        }
        self.idx.extend_from_slice(idx);
        self.val.resize(count, 0.0);
        values::decode_run(v, vals, count, 0, &mut self.val);
        if unbiased && count > 0 {
            // The core's decoder: `value = fl(v * s)`, s = n/k in binary64 rounded once; a frame
            // where that is not finite is invalid.
            let s = (n as f64 / count as f64) as f32;
            for x in &mut self.val {
                *x *= s;
                if !x.is_finite() {
                    return false;
                }
            }
        }
        true
    }

    /// Makes room for `count` entries, so that decoding a frame of that many allocates nothing.
    pub(crate) fn reserve(&mut self, count: usize) {
        self.idx.reserve(count.saturating_sub(self.idx.len()));
        self.val.reserve(count.saturating_sub(self.val.len()));
    }

    /// `acc[i - start] += -1 * value` for the entries with index in `start..start + acc.len()`
    /// (an error-feedback step's fix-up of its kept entries, as [`SparseList::add_range`] with
    /// weight -1); returns the largest `|acc[i - start]|` it leaves (0 for none).
    pub(crate) fn subtract_range(&self, start: usize, acc: &mut [f32]) -> f32 {
        let end = start + acc.len();
        let lo = self.idx.partition_point(|&i| (i as usize) < start);
        let hi = self.idx.partition_point(|&i| (i as usize) < end);
        let mut max = 0.0f32;
        for (&i, &v) in self.idx[lo..hi].iter().zip(&self.val[lo..hi]) {
            let a = &mut acc[i as usize - start];
            *a += -v; // -1 * v, exactly
            max = max.max(a.abs());
        }
        max
    }

    /// Adds `weight * value` of the entries with index in `start..start + acc.len()` into
    /// `acc`, as the core's `accumulate_into` does (`acc[i] += weight * value`).
    pub(crate) fn add_range(&self, start: usize, acc: &mut [f32], weight: f32) {
        let end = start + acc.len();
        let lo = self.idx.partition_point(|&i| (i as usize) < start);
        let hi = self.idx.partition_point(|&i| (i as usize) < end);
        for (&i, &v) in self.idx[lo..hi].iter().zip(&self.val[lo..hi]) {
            acc[i as usize - start] += weight * v;
        }
    }
}

/// The last `tail` bytes of the fixed header of a frame made with `method` (its length is the
/// core's `max_frame_len(0, method) - 4`, at least 16 + `tail`) and the body between the header
/// and the CRC; `None` when the frame is too short.
fn header_tail_and_body<'f>(
    frame: &'f [u8],
    method: &Method,
    tail: usize,
) -> Option<(&'f [u8], &'f [u8])> {
    let header = max_frame_len(0, method).checked_sub(4)?;
    if header < 16 + tail {
        return None;
    }
    Some((
        frame.get(header - tail..header)?,
        frame.get(header..frame.len().checked_sub(4)?)?,
    ))
}

/// A little-endian `u64` from 8 bytes.
fn le_u64(b: &[u8]) -> u64 {
    let mut c = [0u8; 8];
    c.copy_from_slice(b);
    u64::from_le_bytes(c)
}

/// The core's checks of a values section of `count` values: int8 scales finite and `>= 0` and
/// no code -128; plain values finite.
fn values_valid(v: Values, count: usize, vals: &[u8]) -> bool {
    match v {
        Values::Int8 { block } => {
            let s_len = count.div_ceil(block.max(1) as usize) * 4;
            let (scales, codes) = vals.split_at(s_len.min(vals.len()));
            scales.chunks_exact(4).all(|s| {
                let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                m.is_finite() && m >= 0.0
            }) && !codes.contains(&0x80)
        }
        _ => vals
            .chunks_exact(v.value_bytes())
            .all(|c| values::read_plain(v, c).is_some()),
    }
}

//! One large dense, quantization or sign frame written and aggregated in chunks of whole blocks,
//! through the core's chunk API ([`Sections`]): each chunk is encoded (with error feedback, the
//! core's [`step_chunk`]: `residual += g`, encode, `residual -= decoded`, tile by tile while the
//! tile is in cache) or accumulated (every rank in rank order) on its own, with the bytes and
//! bits of the core's whole-frame `encode_into`, `feedback_step` and `accumulate_into`.

use gradwire_core::feedback::step_chunk;
use gradwire_core::frame::chunk::Sections;
use gradwire_core::{Method, Params, ResidualBound};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::exec::Exec;
use crate::layout::plan::dense_geometry;

/// Elements per error-feedback tile (rounded up to chunk boundaries): its gradient and residual
/// (64 KiB) stay in the L2 cache between the core's check of the tile and its update.
const TILE: usize = 8192;

/// The checksum of a frame's sections, hashed chunk by chunk in order as [`Split::encode`]
/// writes them on one thread: where the next chunk must start, and the running CRC-32 of each
/// section.
struct Running {
    next: usize,
    scales: crc32fast::Hasher,
    body: crc32fast::Hasher,
}

/// A dense, quantization or sign frame of `n` elements cut into chunks of `chunk` elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Split {
    sections: Sections,
    chunk: usize,
}

impl Split {
    /// The split of a frame of `n` elements made with `method` (`None` when the plan does not
    /// cut it: another method, too few elements).
    pub(crate) fn new(n: usize, method: &Method) -> Option<Split> {
        let (_, chunk) = dense_geometry(n, method)?;
        Some(Split {
            sections: Sections::of(n, method)?,
            chunk,
        })
    }

    /// Encodes `grad` into `frame` (at least [`Split::frame_len`] bytes), chunks run by `exec`,
    /// and returns the frame length and the new residual's bound: the bytes of the core's
    /// `encode_into` with `params`, or with `residual`, of its `feedback_step` (the residual
    /// updated the same way), and the largest magnitude of the updated residual, measured tile
    /// by tile while each tile is in cache ([`ResidualBound::ZERO`] without a residual). `None`
    /// when a chunk fails (the input was checked before, so only for a length that does not
    /// match).
    pub(crate) fn encode(
        &self,
        params: &Params,
        grad: &[f32],
        residual: Option<&mut [f32]>,
        frame: &mut [u8],
        exec: Exec,
    ) -> Option<(usize, ResidualBound)> {
        let s = &self.sections;
        let n = s.n();
        if grad.len() != n || residual.as_ref().is_some_and(|r| r.len() != n) {
            return None;
        }
        s.write_header(frame).ok()?;
        let (scales, body) = s.pieces_mut(frame, 0, n).ok()?;
        let failed = AtomicBool::new(false);
        // The largest magnitude of the new residual, as f32 bits: for magnitudes (never
        // negative, infinity for an unknown bound) the order of the bits is the order of the
        // values, so the chunks on the pool combine theirs with `fetch_max`.
        let largest = AtomicU32::new(0);
        // On one thread the chunks run in order: each chunk's pieces are hashed right after
        // they are written (in cache then), into one running checksum per section. On the
        // pool (or should the order differ) the frame is hashed after the chunks.
        let running = Mutex::new(Running {
            next: 0,
            scales: crc32fast::Hasher::new(),
            body: crc32fast::Hasher::new(),
        });
        let work = |start: usize, scales: &mut [u8], body: &mut [u8], r: Option<&mut [f32]>| {
            let g = &grad[start..start + self.chunk.min(n - start)];
            let done = match r {
                None => s.encode(params, start, g, scales, body),
                // Tile by tile: the core's step checks a piece before it updates it, and a
                // tile's g and r stay in the L2 cache between the two.
                Some(r) => self
                    .feedback_tiles(params, start, g, r, scales, body)
                    .map(|m| {
                        largest.fetch_max(m.to_bits(), Ordering::Relaxed);
                    }),
            };
            if done.is_err() {
                failed.store(true, Ordering::Relaxed);
            } else if exec == Exec::Serial
                && let Ok(mut running) = running.lock()
                && running.next == start
            {
                running.scales.update(scales);
                running.body.update(body);
                running.next = start + g.len();
            }
        };
        let chunks = n.div_ceil(self.chunk);
        self.split_chunks(exec, 0, chunks, scales, body, residual, &work);
        if failed.load(Ordering::Relaxed) {
            return None;
        }
        let running = running.into_inner().ok()?;
        let crc = if running.next == n {
            let mut crc = crc32fast::Hasher::new();
            crc.update(frame.get(..s.header_len())?);
            crc.combine(&running.scales);
            crc.combine(&running.body);
            crc.finalize()
        } else {
            exec.crc32(frame.get(..s.checksummed_len())?)
        };
        let len = s.finish(frame, Some(crc)).ok()?;
        let bound = ResidualBound::at_most(f32::from_bits(largest.load(Ordering::Relaxed)));
        Some((len, bound))
    }

    /// The core's error-feedback step over one chunk (elements `start..` of the tensor: `g`,
    /// `r` and the chunk's pieces), in tiles of about [`TILE`] elements on chunk boundaries;
    /// returns the largest magnitude of the chunk's new residual (infinity when one is not
    /// finite), each tile measured while it is in cache.
    fn feedback_tiles(
        &self,
        params: &Params,
        start: usize,
        g: &[f32],
        r: &mut [f32],
        scales: &mut [u8],
        body: &mut [u8],
    ) -> Result<f32, gradwire_core::Error> {
        let s = &self.sections;
        let tile = TILE.div_ceil(s.align()) * s.align();
        let (s0, b0) = s.ranges(start, start)?;
        let mut largest = 0.0f32;
        let mut at = 0;
        while at < g.len() {
            let end = (at + tile).min(g.len());
            let (ts, tb) = s.ranges(start + at, start + end)?;
            let piece = |x: std::ops::Range<usize>, from: usize| x.start - from..x.end - from;
            step_chunk(
                s,
                params,
                start + at,
                &g[at..end],
                &mut r[at..end],
                &mut scales[piece(ts, s0.start)],
                &mut body[piece(tb, b0.start)],
            )?;
            largest = largest.max(ResidualBound::of(&r[at..end]).max_abs());
            at = end;
        }
        Ok(largest)
    }

    /// Runs `work(start, scales, body, residual)` for chunks `first..first + count` (their
    /// pieces of the sections and of the residual): the slices are cut at chunk boundaries and
    /// halved recursively, each half a task on the pool.
    #[allow(clippy::too_many_arguments)]
    fn split_chunks<W>(
        &self,
        exec: Exec,
        first: usize,
        count: usize,
        scales: &mut [u8],
        body: &mut [u8],
        residual: Option<&mut [f32]>,
        work: &W,
    ) where
        W: Fn(usize, &mut [u8], &mut [u8], Option<&mut [f32]>) + Sync,
    {
        let start = first * self.chunk;
        if count <= 1 {
            if count == 1 {
                work(start, scales, body, residual);
            }
            return;
        }
        let half = count / 2;
        let mid = start + half * self.chunk;
        // Chunk boundaries: `ranges` cannot fail for them.
        let Ok((s0, b0)) = self.sections.ranges(start, mid) else {
            return;
        };
        let (sa, sb) = scales.split_at_mut(s0.len());
        let (ba, bb) = body.split_at_mut(b0.len());
        let (ra, rb) = match residual {
            Some(r) => {
                let (a, b) = r.split_at_mut(mid - start);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        exec.join(
            || self.split_chunks(exec, first, half, sa, ba, ra, work),
            || self.split_chunks(exec, first + half, count - half, sb, bb, rb, work),
        );
    }

    /// Overwrites `acc` (`n` elements) with the sum of `count` frames of this split (in the
    /// order `frames(0)`, `frames(1)`, ...; their headers and checksums checked before), chunks
    /// run by `exec`, then applies `finish` to each chunk of the sum. Each chunk takes the
    /// first frame's piece as it is, then adds each other frame's, every piece checked as the
    /// core's decoder checks it: the sums from zeros, `((0 + x0) + x1) + ...`, except that a
    /// zero may be -0.0 where the sum from zeros has 0.0, so `finish` must map -0.0 to 0.0
    /// (adding 0.0 does), as the aggregator's does. `false` when a frame is invalid or `finish`
    /// returns `false` for a chunk (`acc` then holds partial sums).
    pub(crate) fn accumulate<'f>(
        &self,
        frames: impl Fn(usize) -> &'f [u8] + Sync,
        count: usize,
        acc: &mut [f32],
        finish: &(impl Fn(&mut [f32]) -> bool + Sync),
        exec: Exec,
    ) -> bool {
        if acc.len() != self.sections.n() {
            return false;
        }
        exec.chunks_mut_all(acc, self.chunk, |j, acc| {
            let start = j * self.chunk;
            // Written, not added to zeros: one write of the chunk instead of a fill and an
            // addition (`0.0 + 1.0 * x` is `x` but for the sign of a zero, see above).
            let first = match count {
                0 => {
                    acc.fill(0.0);
                    true
                }
                _ => self.sections.decode(frames(0), start, acc).is_ok(),
            };
            first
                && (1..count).all(|r| self.sections.accumulate(frames(r), start, acc, 1.0).is_ok())
                && finish(acc)
        })
    }
}

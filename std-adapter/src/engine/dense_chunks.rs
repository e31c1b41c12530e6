//! One large dense, quantization or sign frame written and aggregated in chunks of whole blocks.
//!
//! These frames keep their sections (scales, then codes, signs or values) in element order, one
//! scale per block, so a chunk of whole blocks that starts on a byte boundary owns a contiguous
//! piece of each section. Each chunk is encoded (with error feedback: `residual += g`, encode,
//! `residual -= decoded`, tile by tile while the tile is in cache) or accumulated (every rank in
//! rank order) on its own; every element sees the same operations in the same order as in the
//! core's whole-frame `encode_into`, `feedback_step` and `accumulate_into`. Stochastic rounding
//! splits too: its draws are keyed by the element's index in the tensor, which the core's
//! `quant::encode_from` takes for a piece.

use std::sync::atomic::{AtomicBool, Ordering};

use gradwire_core::{
    Method, Params, Rounding, SignScale, Values, encode_into, max_frame_len, quant, sign, values,
};

use super::exec::Exec;
use crate::layout::plan::dense_geometry;

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

impl Split {
    /// The split of a frame of `n` elements made with `method`, or `None` when it does not
    /// split (another method, too few elements, a block too large).
    pub(crate) fn new(n: usize, method: &Method) -> Option<Split> {
        let kind = match *method {
            Method::Dense { values } if !matches!(values, Values::Int8 { .. }) => {
                Kind::Dense(values)
            }
            Method::Quant { bits, block, .. } => Kind::Quant {
                bits,
                block: block as usize,
            },
            Method::Sign { scale } => Kind::Sign {
                block: match scale {
                    SignScale::MeanAbs { block } => Some(block as usize),
                    SignScale::None => None,
                },
            },
            _ => return None,
        };
        let (align, chunk) = dense_geometry(n, method)?;
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
        exec: Exec,
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
        split_chunks(self, exec, 0, chunks, scales, body, residual, &work);
        if failed.load(Ordering::Relaxed) {
            return None;
        }
        let end = self.header + self.scales + self.body;
        let crc = exec.crc32(&frame[..end]);
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
        exec: Exec,
    ) -> bool {
        if acc.len() != self.n || (0..count).any(|r| frames(r).len() != self.frame_len()) {
            return false;
        }
        exec.chunks_mut_all(acc, self.chunk, |j, acc| {
            acc.fill(0.0);
            for r in 0..count {
                let Some((s, b)) = self.sections(frames(r)) else {
                    return false;
                };
                let (s, b) = self.cut(s, b, j * self.chunk, acc.len());
                if !self.valid(s, b, acc.len()) {
                    return false;
                }
                self.add(s, b, acc, 1.0);
            }
            finish(acc)
        })
    }
}

/// Runs `work(j, scales, body, residual)` for chunks `first..first + count`: the slices are
/// cut at chunk boundaries and halved recursively (each half a task on the pool).
#[allow(clippy::too_many_arguments)]
fn split_chunks<W>(
    split: &Split,
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
    exec.join(
        || split_chunks(split, exec, first, half, s0, b0, r0, work),
        || split_chunks(split, exec, first + half, count - half, s1, b1, r1, work),
    );
}

//! Frames in chunks: the building blocks of multi-threaded encoders and decoders on top of this
//! `no_std` core, so that they never read or write frame bytes themselves.
//!
//! - [`Sections`]: a dense, quantization or sign frame keeps its sections (the scales, then the
//!   values, codes or sign bits) in element order, so a chunk of the tensor that starts and
//!   ends on [`Sections::align`] boundaries owns one contiguous piece of each section. Each
//!   chunk is encoded ([`Sections::encode`], or with error feedback
//!   [`crate::feedback::step_chunk`]), checked ([`Sections::check`]) or accumulated
//!   ([`Sections::accumulate`]) on its own, on any thread, with exactly the bytes and results of
//!   the whole frame's: a frame written chunk by chunk, its header written with
//!   [`Sections::write_header`] and closed by [`Sections::finish`], is the frame
//!   [`crate::encode_into`] writes.
//! - [`SparseFrame`]: a checked top-k, threshold or random-k frame whose indices and decoded
//!   values are read into caller buffers, for a decoder that adds them chunk by chunk of its
//!   output ([`crate::feedback::sparse_update`] and [`crate::feedback::sparse_fix_up`] do the
//!   same for an error-feedback residual).
//!
//! A serial loop over the chunks gives the same bytes and the same f32 bits as any parallel
//! schedule: every element sees the same operations in the same order.
//!
//! ```
//! use gradwire_core::frame::chunk::Sections;
//! use gradwire_core::{Method, Params, Rounding, encode_into, max_frame_len};
//!
//! let method = Method::Quant { bits: 4, block: 64, rounding: Rounding::Stochastic };
//! let params = Params::new(method).with_seed(7).at_step(3).for_tensor(11);
//! let grad: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.1).sin()).collect();
//!
//! let sections = Sections::of(grad.len(), &method).unwrap();
//! let chunk = 4 * sections.align(); // any multiple of the alignment
//! let mut frame = vec![0u8; sections.frame_len()];
//! sections.write_header(&mut frame)?;
//! for start in (0..grad.len()).step_by(chunk) {
//!     // Each chunk could run on its own thread, its pieces split off the frame buffer.
//!     let end = (start + chunk).min(grad.len());
//!     let (scales, body) = sections.pieces_mut(&mut frame, start, end)?;
//!     sections.encode(&params, start, &grad[start..end], scales, body)?;
//! }
//! let len = sections.finish(&mut frame, None)?;
//!
//! let mut whole = vec![0u8; max_frame_len(grad.len(), &method)];
//! assert_eq!(encode_into(&grad, &params, &mut [], &mut whole)?, len);
//! assert_eq!(whole, frame);
//! # Ok::<(), gradwire_core::Error>(())
//! ```

use core::ops::Range;

use super::parse::{Body, decode_checked, unbiased_scale};
use super::shape::Shape;
use super::wire::{CRC_LEN, FIXED_LEN, Put, params_len, write_shaped_header};
use super::{FrameInfo, Header, check_input};
use crate::error::{Error, Param};
use crate::method::{Method, Params, Values};
use crate::{index, randomk, rng, values};

/// Where the sections of a dense, quantization or sign frame of `n` elements lie, and where
/// chunks of the tensor may start and end.
///
/// Layout of such a frame: the header ([`Sections::write_header`]), the scales section (empty
/// for dense and unscaled sign), the body section (values, codes or sign bits), and the CRC-32
/// trailer of every byte before it ([`Sections::finish`]). A chunk `start..end` of the tensor
/// owns the bytes [`Sections::ranges`] gives in each section when `start` and `end` are chunk
/// boundaries: multiples of [`Sections::align`], or `n`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sections {
    method: Method,
    shape: Shape,
    n: usize,
    header: usize,
    scales: usize,
    body: usize,
    align: usize,
}

impl Sections {
    /// The sections of a frame of `n` elements made with `method`: `None` for top-k,
    /// threshold and random-k, for invalid parameters ([`Method::validate`]), and when the
    /// frame's length does not fit a `usize`.
    pub fn of(n: usize, method: &Method) -> Option<Sections> {
        method.validate().ok()?;
        let shape = Shape::of(method)?;
        let header = FIXED_LEN + params_len(method);
        let (scales, body) = shape.section_lens(n)?;
        header
            .checked_add(scales)?
            .checked_add(body)?
            .checked_add(CRC_LEN)?;
        // Past `n`, only 0 and `n` are boundaries.
        let align = shape.align().map_or(n, |a| a.min(n)).max(1);
        Some(Sections {
            method: *method,
            shape,
            n,
            header,
            scales,
            body,
            align,
        })
    }

    /// Elements of the tensor.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Bytes of the whole frame, header and trailer included: what [`crate::encode_into`]
    /// writes (and [`crate::max_frame_len`] gives) for `n` elements.
    pub fn frame_len(&self) -> usize {
        self.header + self.scales + self.body + CRC_LEN
    }

    /// Bytes the CRC-32 trailer covers: the frame's first `checksummed_len()` bytes (all but
    /// the trailer).
    pub fn checksummed_len(&self) -> usize {
        self.header + self.scales + self.body
    }

    /// Elements that a chunk boundary is a multiple of (at least 1): whole blocks of scales and
    /// whole bytes of values, codes or sign bits. `n` itself is a boundary too. Dense: 1;
    /// quantization: the least multiple of the block that holds whole bytes of codes; sign:
    /// the least multiple of 8 and of the block; `n` when that is smaller (the frame then has
    /// one chunk).
    pub fn align(&self) -> usize {
        self.align
    }

    /// The byte ranges, in the frame, of the pieces of the scales section and of the body
    /// section that hold elements `start..end`.
    ///
    /// # Errors
    /// [`Error::BadChunk`] unless `start <= end <= n` and both are chunk boundaries.
    pub fn ranges(&self, start: usize, end: usize) -> Result<(Range<usize>, Range<usize>), Error> {
        self.check_bounds(start, end)?;
        let s0 = self.header;
        let b0 = self.header + self.scales;
        let sh = self.shape;
        Ok((
            s0 + sh.scales_len(start)..s0 + sh.scales_len(end),
            b0 + sh.body_len(start)..b0 + sh.body_len(end),
        ))
    }

    /// The pieces of the scales and body sections of elements `start..end` in a frame buffer,
    /// as [`Sections::ranges`] gives them, for [`Sections::encode`] or
    /// [`crate::feedback::step_chunk`]. A buffer cut into chunks for several threads is cut by
    /// the lengths of these ranges: the pieces of `0..n` are the whole sections, and the pieces
    /// of consecutive chunks follow each other in each.
    ///
    /// # Errors
    /// [`Error::BadChunk`] as for [`Sections::ranges`]; [`Error::BufferTooSmall`] when `frame`
    /// is shorter than [`Sections::frame_len`].
    pub fn pieces_mut<'f>(
        &self,
        frame: &'f mut [u8],
        start: usize,
        end: usize,
    ) -> Result<(&'f mut [u8], &'f mut [u8]), Error> {
        let (s, b) = self.ranges(start, end)?;
        self.check_buffer(frame.len())?;
        let (head, rest) = frame.split_at_mut(b.start);
        Ok((&mut head[s], &mut rest[..b.len()]))
    }

    /// Bytes of the frame's header: where its scales section starts.
    pub fn header_len(&self) -> usize {
        self.header
    }

    /// Writes the frame's header (magic, version, method, flags, `n` and the method's
    /// parameters: the bytes [`crate::encode_into`] writes, [`Sections::header_len`] of them)
    /// at the start of `frame`. A receiver may compare a frame's first bytes with them.
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] when `frame` is shorter than [`Sections::header_len`].
    pub fn write_header(&self, frame: &mut [u8]) -> Result<(), Error> {
        if frame.len() < self.header {
            return Err(Error::BufferTooSmall {
                needed: self.header,
                got: frame.len(),
            });
        }
        let mut p = Put::new(frame);
        write_shaped_header(&mut p, &self.method, self.n);
        debug_assert_eq!(p.pos, self.header);
        Ok(())
    }

    /// Encodes the chunk `x`, elements `start..start + x.len()` of the tensor, into its pieces
    /// of the sections (`scales` and `body` hold at least the lengths of
    /// [`Sections::ranges`]; bytes past them are not written): the bytes of the whole frame's
    /// sections there. Stochastic rounding draws for each element's index in the tensor (from
    /// `params`' seed, step and tensor id), as [`crate::quant::encode_from`] does. The input
    /// is checked on the way, as [`crate::encode_into`] checks it.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] with [`Param::Method`] when `params.method` is not the method
    /// of these sections; [`Error::BadChunk`] as for [`Sections::ranges`];
    /// [`Error::BufferTooSmall`] for a short piece; [`Error::NonFinite`] or
    /// [`Error::ValueOutOfRange`] (f16 and bf16 values) naming the tensor index of the chunk's
    /// first bad element, NaN or infinity first as for [`crate::encode_into`]. The pieces then
    /// hold unspecified bytes: a frame with a failed chunk is not to be finished and sent.
    pub fn encode(
        &self,
        params: &Params,
        start: usize,
        x: &[f32],
        scales: &mut [u8],
        body: &mut [u8],
    ) -> Result<(), Error> {
        if params.method != self.method {
            return Err(Error::InvalidParams {
                param: Param::Method,
            });
        }
        let (scales, body) = self.pieces_of(start, x.len(), scales, body)?;
        let stream = (params.seed, params.step, params.tensor_id);
        if self
            .shape
            .try_encode(x, start, stream, scales, body)
            .is_err()
        {
            // Name the chunk's first bad element in the specified order.
            check_input(x, &self.method).map_err(|e| at_tensor_index(e, start))?;
            self.shape.encode(x, start, stream, scales, body);
        }
        Ok(())
    }

    /// Checks the pieces of elements `start..end` of a received `frame` as the decoder does
    /// (values finite; scales finite and `>= 0`; codes in range; padding bits zero). With the
    /// header and checksum checked by [`crate::peek`] and [`Header::check`], every chunk of a
    /// frame passes exactly when [`crate::validate`] passes; the error of a failing chunk may
    /// differ from the one [`crate::validate`] names for the whole frame (which reports the
    /// first fault in its own order).
    ///
    /// # Errors
    /// [`Error::BadChunk`] as for [`Sections::ranges`]; [`Error::Truncated`] or
    /// [`Error::TrailingBytes`] when `frame` is not [`Sections::frame_len`] bytes;
    /// [`Error::BadValue`] with the offset in `frame` of the section piece holding the fault.
    pub fn check(&self, frame: &[u8], start: usize, end: usize) -> Result<(), Error> {
        let (s, b) = self.ranges(start, end)?;
        self.check_frame_len(frame.len())?;
        self.check_pieces(start, end, &frame[s], &frame[b])
    }

    /// Checks the whole scales section of a received frame (`scales`: its bytes, the first
    /// range [`Sections::ranges`] gives for `0..n`; empty for dense and unscaled sign frames):
    /// every scale finite and `>= 0`. [`crate::validate`] checks the scales before the body, so
    /// a receiver that checks this section first, then the body's pieces in element order
    /// ([`Sections::decode_pieces`]), finds the fault [`crate::validate`] names first.
    ///
    /// # Errors
    /// [`Error::Truncated`] or [`Error::TrailingBytes`] when `scales` is not the section's
    /// length; [`Error::BadValue`] with the offset in the frame of the first bad scale.
    pub fn check_scales(&self, scales: &[u8]) -> Result<(), Error> {
        self.check_scales_len(scales.len())?;
        self.shape
            .validate(0, scales, &[])
            .map_err(|o| Error::BadValue {
                offset: self.header + o,
            })
    }

    /// Adds `weight * value` (for `weight` `None`: writes the value) of elements
    /// `start..start + out.len()` of a received frame held in pieces: `scales`, the frame's
    /// whole scales section (as for [`Sections::check_scales`]), and `body`, the piece of its
    /// body section that holds those elements (the second range of [`Sections::ranges`]).
    /// The elements' pieces are checked as [`Sections::check`] checks them; per element, what
    /// [`crate::accumulate_into`] adds (or [`crate::decode_into`] writes) for the whole frame.
    /// For a receiver that decodes a frame as its bytes arrive, the frame's header and checksum
    /// checked on their own.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] with [`Param::Weight`] when `weight` is NaN or infinite;
    /// [`Error::BadChunk`] as for [`Sections::ranges`]; [`Error::Truncated`] or
    /// [`Error::TrailingBytes`] when `scales` is not the section's length or `body` not the
    /// piece's; [`Error::BadValue`] as for [`Sections::check`]. On error `out` is untouched.
    pub fn decode_pieces(
        &self,
        scales: &[u8],
        start: usize,
        body: &[u8],
        out: &mut [f32],
        weight: Option<f32>,
    ) -> Result<(), Error> {
        if weight.is_some_and(|w| !w.is_finite()) {
            return Err(Error::InvalidParams {
                param: Param::Weight,
            });
        }
        let end = chunk_end(start, out.len())?;
        let (s, b) = self.ranges(start, end)?;
        self.check_scales_len(scales.len())?;
        let piece = |at: usize| at - self.header;
        let scales = &scales[piece(s.start)..piece(s.end)];
        if body.len() < b.len() {
            return Err(Error::Truncated {
                needed: b.len(),
                got: body.len(),
            });
        }
        if body.len() > b.len() {
            return Err(Error::TrailingBytes { offset: b.end });
        }
        self.check_pieces(start, end, scales, body)?;
        self.shape.decode(scales, body, out, weight);
        Ok(())
    }

    /// Adds `weight * value` of elements `start..start + acc.len()` of a received `frame` into
    /// `acc`, after checking their pieces as [`Sections::check`] does: per element what
    /// [`crate::accumulate_into`] adds for the whole frame.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] with [`Param::Weight`] when `weight` is NaN or infinite;
    /// otherwise as [`Sections::check`]. On error `acc` is untouched.
    pub fn accumulate(
        &self,
        frame: &[u8],
        start: usize,
        acc: &mut [f32],
        weight: f32,
    ) -> Result<(), Error> {
        self.decode_in_frame(frame, start, acc, Some(weight))
    }

    /// Writes the values of elements `start..start + out.len()` of a received `frame` into
    /// `out`, after checking their pieces as [`Sections::check`] does: per element what
    /// [`crate::decode_into`] writes for the whole frame.
    ///
    /// # Errors
    /// As [`Sections::check`]. On error `out` is untouched.
    pub fn decode(&self, frame: &[u8], start: usize, out: &mut [f32]) -> Result<(), Error> {
        self.decode_in_frame(frame, start, out, None)
    }

    /// Ends a frame whose header and every chunk are written: stores `crc` (the CRC-32 of the
    /// first [`Sections::checksummed_len`] bytes, computed by the caller, for example in
    /// pieces combined with `crc32fast::Hasher::combine`) or, for `None`, the CRC computed here
    /// as the trailer. Returns the frame length, [`Sections::frame_len`].
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] when `frame` is shorter than [`Sections::frame_len`].
    pub fn finish(&self, frame: &mut [u8], crc: Option<u32>) -> Result<usize, Error> {
        self.check_buffer(frame.len())?;
        let end = self.checksummed_len();
        let crc = crc.unwrap_or_else(|| crc32fast::hash(&frame[..end]));
        frame[end..end + CRC_LEN].copy_from_slice(&crc.to_le_bytes());
        Ok(end + CRC_LEN)
    }

    /// The method of these sections.
    pub(crate) fn method(&self) -> &Method {
        &self.method
    }

    /// How the sections hold the elements.
    pub(crate) fn shape(&self) -> Shape {
        self.shape
    }

    /// The pieces of `scales` and `body` (each at least its length) that hold the `len`
    /// elements from `start`.
    pub(crate) fn pieces_of<'p>(
        &self,
        start: usize,
        len: usize,
        scales: &'p mut [u8],
        body: &'p mut [u8],
    ) -> Result<(&'p mut [u8], &'p mut [u8]), Error> {
        let (s, b) = self.ranges(start, chunk_end(start, len)?)?;
        let piece = |buf: &'p mut [u8], need: usize| {
            let got = buf.len();
            buf.get_mut(..need)
                .ok_or(Error::BufferTooSmall { needed: need, got })
        };
        Ok((piece(scales, s.len())?, piece(body, b.len())?))
    }

    /// [`Sections::decode_pieces`] on the pieces of a whole received `frame`.
    fn decode_in_frame(
        &self,
        frame: &[u8],
        start: usize,
        out: &mut [f32],
        weight: Option<f32>,
    ) -> Result<(), Error> {
        if weight.is_some_and(|w| !w.is_finite()) {
            return Err(Error::InvalidParams {
                param: Param::Weight,
            });
        }
        let end = chunk_end(start, out.len())?;
        let (_, b) = self.ranges(start, end)?;
        self.check_frame_len(frame.len())?;
        let (all_scales, _) = self.ranges(0, self.n)?;
        self.decode_pieces(&frame[all_scales], start, &frame[b], out, weight)
    }

    /// Checks the pieces (`scales`, `body`: exactly their [`Sections::ranges`] lengths) of
    /// elements `start..end` as [`Sections::check`] does, naming a fault by its offset in the
    /// frame.
    fn check_pieces(
        &self,
        start: usize,
        end: usize,
        scales: &[u8],
        body: &[u8],
    ) -> Result<(), Error> {
        let (s, b) = self.ranges(start, end)?;
        self.shape.validate(end - start, scales, body).map_err(|o| {
            match o.checked_sub(scales.len()) {
                None => Error::BadValue {
                    offset: s.start + o,
                },
                Some(o) => Error::BadValue {
                    offset: b.start + o,
                },
            }
        })
    }

    /// [`Error::Truncated`] or [`Error::TrailingBytes`] unless `len` is the scales section's.
    fn check_scales_len(&self, len: usize) -> Result<(), Error> {
        if len < self.scales {
            return Err(Error::Truncated {
                needed: self.scales,
                got: len,
            });
        }
        if len > self.scales {
            return Err(Error::TrailingBytes {
                offset: self.header + self.scales,
            });
        }
        Ok(())
    }

    fn check_bounds(&self, start: usize, end: usize) -> Result<(), Error> {
        let boundary = |at: usize| at == self.n || at.is_multiple_of(self.align);
        if start <= end && end <= self.n && boundary(start) && boundary(end) {
            Ok(())
        } else {
            Err(Error::BadChunk { start, end })
        }
    }

    fn check_buffer(&self, len: usize) -> Result<(), Error> {
        let needed = self.frame_len();
        if len < needed {
            return Err(Error::BufferTooSmall { needed, got: len });
        }
        Ok(())
    }

    fn check_frame_len(&self, len: usize) -> Result<(), Error> {
        let needed = self.frame_len();
        if len < needed {
            return Err(Error::Truncated { needed, got: len });
        }
        if len > needed {
            return Err(Error::TrailingBytes {
                offset: self.checksummed_len(),
            });
        }
        Ok(())
    }
}

/// `start + len`, or [`Error::BadChunk`] when it overflows.
fn chunk_end(start: usize, len: usize) -> Result<usize, Error> {
    start.checked_add(len).ok_or(Error::BadChunk {
        start,
        end: usize::MAX,
    })
}

/// `e` with the index it names moved by `start` (from a chunk's index to the tensor's).
pub(crate) fn at_tensor_index(e: Error, start: usize) -> Error {
    match e {
        Error::NonFinite { index } => Error::NonFinite {
            index: index.saturating_add(start),
        },
        Error::ValueOutOfRange { index } => Error::ValueOutOfRange {
            index: index.saturating_add(start),
        },
        e => e,
    }
}

/// A checked top-k, threshold or random-k frame: its kept indices and decoded values, read
/// into caller buffers.
///
/// Adding `weight * values[j]` at `indices[j]` into an accumulator, for `j` in order, gives
/// the f32 bits of [`crate::accumulate_into`] of the frame; writing them over zeros gives
/// [`crate::decode_into`]'s.
#[derive(Clone, Copy, Debug)]
pub struct SparseFrame<'f> {
    header: Header,
    v: Values,
    /// The segment table of a segmented top-k frame (empty otherwise).
    segs: &'f [u8],
    codec: Option<u8>,
    idx: &'f [u8],
    vals: &'f [u8],
}

impl<'f> SparseFrame<'f> {
    /// Checks `frame` exactly as [`crate::validate`] does for `n` elements against `expected`
    /// (header, checksum, parameters, index section, values) and returns the view of it.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] with [`Param::Method`] when `expected` is not top-k, threshold
    /// or random-k; otherwise the error [`crate::validate`] returns for the same frame.
    pub fn parse(frame: &'f [u8], expected: &Params, n: usize) -> Result<Self, Error> {
        if !matches!(
            expected.method,
            Method::TopK { .. } | Method::Threshold { .. } | Method::RandomK { .. }
        ) {
            return Err(Error::InvalidParams {
                param: Param::Method,
            });
        }
        let (header, body) = decode_checked(frame, expected, n)?;
        let Body::Sparse {
            v,
            segs,
            codec,
            idx,
            vals,
            ..
        } = body
        else {
            // A frame that passed the expected sparse method is sparse.
            return Err(Error::ParamMismatch {
                param: Param::Method,
            });
        };
        Ok(SparseFrame {
            header,
            v,
            segs,
            codec,
            idx,
            vals,
        })
    }

    /// What the frame carries: `n`, the kept count and the method (`k` as a count), as
    /// [`crate::decode_into`] returns it.
    pub fn info(&self) -> FrameInfo {
        FrameInfo {
            n: self.header.n,
            kept: self.header.kept,
            method: self.header.params.method,
        }
    }

    /// Entries the frame carries (the kept count; random-k's k).
    pub fn kept(&self) -> usize {
        // The parse checked that the values section of this many entries fits in memory.
        self.header.kept as usize
    }

    /// Writes the kept indices, ascending, into `out` (exactly [`SparseFrame::kept`] long).
    /// Top-k and threshold decode the frame's index section; random-k draws them again from
    /// the frame's seed, step and tensor id (serially: a multi-threaded caller may draw them
    /// in chunks with [`crate::randomk`] and use [`SparseFrame::values`] alone).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `out.len()` differs from the kept count;
    /// [`Error::TooLarge`] when an index could exceed `u32::MAX` (`n > 2^32`).
    pub fn indices(&self, out: &mut [u32]) -> Result<(), Error> {
        let (n, count) = (self.header.n, self.header.kept);
        if out.len() as u64 != count {
            return Err(Error::LengthMismatch {
                expected: self.kept(),
                got: out.len(),
            });
        }
        if n > u64::from(u32::MAX) + 1 {
            return Err(Error::TooLarge { n });
        }
        let mut j = 0usize;
        let mut put = |i: usize| {
            if let Some(o) = out.get_mut(j) {
                *o = i as u32;
            }
            j += 1;
        };
        match self.codec {
            Some(codec) => index::for_each_batch(codec, n, count, self.idx, |ib| {
                ib.iter().for_each(|&i| put(i));
            }),
            None => {
                let p = &self.header.params;
                let key = rng::key(p.seed, p.step, p.tensor_id);
                randomk::for_each(n, count, key, |i| put(i as usize));
            }
        }
        Ok(())
    }

    /// Writes the decoded values of entries `first..first + out.len()` into `out`, as the
    /// decoder does: plain values converted to f32, int8 codes times their block's scale, and
    /// for unbiased random-k each value times `s = n / k` (computed in f64, rounded once to
    /// f32): `fl(v * s)`. Any range of entries decodes on its own (for decoding in chunks); in
    /// a segmented frame (FORMAT.md 3.2.1) each call reads the segment table up to `first`,
    /// so decode one in a few large chunks, not entry by entry.
    ///
    /// # Errors
    /// [`Error::BadChunk`] when the range runs past [`SparseFrame::kept`].
    pub fn values(&self, first: usize, out: &mut [f32]) -> Result<(), Error> {
        let count = self.kept();
        let end = chunk_end(first, out.len())?;
        if end > count {
            return Err(Error::BadChunk { start: first, end });
        }
        values::ValueRuns::new(self.v, self.vals, count, self.segs).read(first, out);
        if let Some(s) = unbiased_scale(&self.header, self.header.kept) {
            for x in out.iter_mut() {
                *x *= s;
            }
        }
        Ok(())
    }
}

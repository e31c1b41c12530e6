//! Per-tensor frames ([`CompressedGradient`], the original module's type) and the checks and
//! messages of a frame against what the receiver expects.

use gradwire_core::{Header, K, Method, Params, peek};

use crate::error::{Error, Result};

/// Checks a frame's header against what the receiver expects, without decoding its body
/// (checksum, element count and every parameter: [`gradwire_core::Header::check`]), the error
/// naming `tensor` (and `rank`, for another rank's frame): a parameter mismatch is
/// [`Error::ParamsDiffer`] with both configurations, any other error [`Error::Core`].
pub(crate) fn check_frame_of(
    tensor: &str,
    rank: Option<usize>,
    frame: &[u8],
    expected: &Params,
    n: usize,
) -> Result<Header> {
    peek(frame)
        .and_then(|h| h.check(expected, n).map(|()| h))
        .map_err(|err| frame_error(tensor, rank, frame, expected, n, err))
}

/// Adds to `crc` the bytes of `frame`, whose last 4 bytes hold the CRC-32 of the bytes before
/// them (a frame's trailer, `FORMAT.md` 2.5), without reading its body: the CRC of the body is
/// combined from the trailer (a few hundred operations, whatever the frame's length). For a
/// frame this crate wrote, or one whose trailer a check ([`gradwire_core::peek`]) verified,
/// the result is the CRC of the bytes themselves.
pub(crate) fn update_with_frame(crc: &mut crc32fast::Hasher, frame: &[u8]) {
    let Some(body_len) = frame.len().checked_sub(4) else {
        crc.update(frame);
        return;
    };
    let trailer = &frame[body_len..];
    let body_crc = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    crc.combine(&crc32fast::Hasher::new_with_initial_len(
        body_crc,
        body_len as u64,
    ));
    crc.update(trailer);
}

/// The error `err` of a check or decode of `frame` (of tensor `tensor`, `n` elements, expected
/// with `expected`): [`Error::ParamsDiffer`] with both configurations for a parameter
/// mismatch, [`Error::Core`] otherwise.
pub(crate) fn frame_error(
    tensor: &str,
    rank: Option<usize>,
    frame: &[u8],
    expected: &Params,
    n: usize,
    err: gradwire_core::Error,
) -> Error {
    // Only a parameter mismatch reads the frame's header again (it parsed, or the check
    // would have failed earlier).
    let gradwire_core::Error::ParamMismatch { param } = err else {
        return Error::core(tensor, rank, err);
    };
    match peek(frame) {
        Ok(h) => Error::ParamsDiffer {
            tensor: tensor.to_owned(),
            rank,
            param,
            frame: describe_params(&h.params, n),
            expected: describe_params(expected, n),
        },
        Err(_) => Error::core(tensor, rank, err),
    }
}

/// A frame's parameters for messages: the method (a ratio's `k` followed by the count it
/// gives for `n` elements) and, for random-k, the seed, step and tensor id its indices come
/// from.
pub(crate) fn describe_params(p: &Params, n: usize) -> String {
    let mut s = crate::method::format(&p.method);
    if let Method::TopK { k, .. } | Method::RandomK { k, .. } = p.method
        && let K::Ratio(_) = k
    {
        s.push_str(&format!(" (k = {} of {n})", k.resolve(n as u64)));
    }
    if let Method::RandomK { .. } = p.method {
        s.push_str(&format!(
            " seed={} step={} tensor_id={:#x}",
            p.seed, p.step, p.tensor_id
        ));
    }
    s
}

/// One gradient after compression: the frame bytes that go on the wire, and the shape and
/// step the receiver needs to decode them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompressedGradient {
    frame: Vec<u8>,
    shape: Vec<usize>,
    step: u64,
}

impl CompressedGradient {
    /// A compressed gradient of frame bytes this crate just wrote.
    pub(crate) fn new(frame: Vec<u8>, shape: Vec<usize>, step: u64) -> Self {
        CompressedGradient { frame, shape, step }
    }

    /// Overwrites this compressed gradient with a new frame, reusing its buffers.
    pub(crate) fn assign(&mut self, frame: &[u8], shape: &[usize], step: u64) {
        self.frame.clear();
        self.frame.extend_from_slice(frame);
        if self.shape != shape {
            self.shape.clear();
            self.shape.extend_from_slice(shape);
        }
        self.step = step;
    }

    /// A compressed gradient from received frame bytes, for a tensor of `shape` made at `step`.
    /// The frame's header and checksum are checked here; its parameters are checked against the
    /// receiver's method when it is decoded.
    ///
    /// # Errors
    /// [`Error::Core`] for a frame that fails [`gradwire_core::peek`] or whose element count
    /// differs from the shape's; [`Error::ShapeOverflow`].
    pub fn from_frame(frame: Vec<u8>, shape: Vec<usize>, step: u64) -> Result<Self> {
        let n = crate::tensor::checked_numel("", &shape)?;
        let h = gradwire_core::peek(&frame).map_err(|e| Error::core("", None, e))?;
        if h.n != n as u64 {
            return Err(Error::core(
                "",
                None,
                gradwire_core::Error::ElementCount {
                    expected: n as u64,
                    got: h.n,
                },
            ));
        }
        Ok(CompressedGradient { frame, shape, step })
    }

    /// The frame bytes, as they go on the wire.
    pub fn frame(&self) -> &[u8] {
        &self.frame
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The step the frame was made at.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Number of elements in the uncompressed gradient.
    pub fn original_size(&self) -> usize {
        crate::tensor::numel(&self.shape).unwrap_or(0)
    }

    /// Bytes this gradient puts on the wire: the whole frame, header and checksum included.
    pub fn payload_bytes(&self) -> usize {
        self.frame.len()
    }

    /// Bytes of the uncompressed f32 gradient.
    pub fn dense_bytes(&self) -> usize {
        self.original_size().saturating_mul(4)
    }

    /// Fraction of the dense bytes that goes on the wire: `payload_bytes / dense_bytes`
    /// (1.0 for an empty tensor), as the original module defines it. This is the inverse of
    /// the "Nx" ratio that the README, the `gradwire` tool and the demo print (dense /
    /// compressed): 0.0066 here is 150x there.
    pub fn compression_ratio(&self) -> f32 {
        let dense = self.dense_bytes();
        if dense == 0 {
            1.0
        } else {
            (self.payload_bytes() as f64 / dense as f64) as f32
        }
    }
}

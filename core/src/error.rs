//! The one error type of the core.

use core::fmt;

/// Which parameter of a frame disagreed with what the receiver expected, or was invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Param {
    /// The method (top-k, quantization, ...).
    Method,
    /// The value codec (f32, f16, bf16, int8) or its block size.
    Values,
    /// k (top-k, random-k).
    K,
    /// The threshold of threshold selection.
    Threshold,
    /// Quantization bit width.
    Bits,
    /// Block size of per-block scales.
    Block,
    /// Rounding mode of quantization.
    Rounding,
    /// Sign scale mode.
    SignScale,
    /// The zero mask of sign.
    ZeroMask,
    /// Random-k seed.
    Seed,
    /// Random-k step.
    Step,
    /// Random-k tensor id.
    TensorId,
    /// Unbiased (n/k) scaling of random-k.
    Unbiased,
    /// Flags byte.
    Flags,
    /// Index codec id.
    IndexCodec,
    /// The weight of [`crate::accumulate_into`].
    Weight,
}

/// The parameter's name in messages: lower case, as a user would write it ("k", "value type",
/// "tensor id").
impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Param::Method => "method",
            Param::Values => "value type",
            Param::K => "k",
            Param::Threshold => "threshold",
            Param::Bits => "bits",
            Param::Block => "block",
            Param::Rounding => "rounding",
            Param::SignScale => "sign scale",
            Param::ZeroMask => "zero mask",
            Param::Seed => "seed",
            Param::Step => "step",
            Param::TensorId => "tensor id",
            Param::Unbiased => "unbiased",
            Param::Flags => "flags",
            Param::IndexCodec => "index codec",
            Param::Weight => "weight",
        })
    }
}

/// Everything that can go wrong in the core. Integer fields only, so the type is `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The output byte buffer is smaller than the frame needs.
    BufferTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The scratch slice is shorter than [`crate::scratch_len`] requires.
    ScratchTooSmall {
        /// `u32` words needed.
        needed: usize,
        /// `u32` words available.
        got: usize,
    },
    /// Two slices that must have the same length do not (e.g. gradient and residual).
    LengthMismatch {
        /// Expected length in elements.
        expected: usize,
        /// Actual length in elements.
        got: usize,
    },
    /// A gradient element is NaN or infinite (in an error-feedback step: or gradient + residual,
    /// which overflows to infinity when both are large).
    NonFinite {
        /// Index of the first bad element.
        index: usize,
    },
    /// A value does not fit the chosen value type (e.g. beyond f16's range), or, with unbiased
    /// random-k, its decoded product with n/k would not be finite.
    ValueOutOfRange {
        /// Index of the first element that does not fit.
        index: usize,
    },
    /// A method parameter is invalid (bits outside 2..=8, block 0, ratio not finite, ...).
    InvalidParams {
        /// The offending parameter.
        param: Param,
    },
    /// The frame is shorter than its header or sections require.
    Truncated {
        /// Bytes needed (at least: parsing stops at the first field or section that runs past
        /// the end, so later sections are not counted).
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The checksum does not match, and the frame's own header declares more bytes than the
    /// frame has: most likely it was cut short (a partial transfer or copy); a corrupted header
    /// field (a length, a count, the method) reads the same. Reported instead of
    /// [`Error::Checksum`] so that a truncated frame is named as such.
    Incomplete {
        /// Bytes the header declares (at least, as for [`Error::Truncated`]).
        declared: usize,
        /// Bytes the frame has.
        got: usize,
    },
    /// The frame does not start with the magic bytes.
    BadMagic,
    /// The frame's format version is not supported by this decoder.
    UnsupportedVersion {
        /// The version byte found.
        version: u8,
    },
    /// The CRC-32 trailer does not match the frame's bytes.
    Checksum {
        /// CRC stored in the frame.
        stored: u32,
        /// CRC computed over the frame.
        computed: u32,
    },
    /// An unknown id or reserved value in the header.
    Malformed {
        /// Byte offset in the frame.
        offset: usize,
    },
    /// The frame was made with other parameters than the receiver expects.
    ParamMismatch {
        /// The parameter that differs.
        param: Param,
    },
    /// The frame's element count differs from the receiver's output length.
    ElementCount {
        /// Elements the receiver expects (its output length).
        expected: u64,
        /// Elements the frame declares.
        got: u64,
    },
    /// The element count cannot be represented on this platform.
    TooLarge {
        /// The element count.
        n: u64,
    },
    /// An index section is invalid: index out of range, not strictly increasing, wrong count,
    /// or non-zero padding.
    BadIndex {
        /// Byte offset of the index section in the frame.
        offset: usize,
    },
    /// A stored value is invalid: a NaN/Inf value or scale, a negative scale, an out-of-range code.
    BadValue {
        /// Byte offset of the section holding the value.
        offset: usize,
    },
    /// A caller's index list is not strictly ascending or holds an index out of range.
    UnsortedIndices {
        /// Position in the list of the first bad index.
        position: usize,
    },
    /// Bytes remain after the last section.
    TrailingBytes {
        /// Byte offset where the unexpected bytes start.
        offset: usize,
    },
    /// A range of elements (a chunk of a frame's sections, [`crate::frame::chunk::Sections`])
    /// or of kept entries ([`crate::frame::chunk::SparseFrame`]) that runs past the end, ends
    /// before it starts, or (elements) does not start and end on chunk boundaries.
    BadChunk {
        /// First element or entry of the range.
        start: usize,
        /// One past its last element or entry.
        end: usize,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::BufferTooSmall { needed, got } => {
                write!(f, "output buffer too small: need {needed} bytes, got {got}")
            }
            Error::ScratchTooSmall { needed, got } => {
                write!(f, "scratch too small: need {needed} words, got {got}")
            }
            Error::LengthMismatch { expected, got } => {
                write!(
                    f,
                    "length mismatch: expected {expected} elements, got {got}"
                )
            }
            Error::NonFinite { index } => write!(
                f,
                "NaN or infinity at index {index} (of the gradient; under error feedback, of \
                 gradient + residual, which can overflow)"
            ),
            Error::ValueOutOfRange { index } => {
                write!(
                    f,
                    "value at index {index} is out of range for the value type (f16 holds \
                     |x| < 65520, bf16 |x| < 3.3961776e38; with unbiased random-k, the value \
                     times n/k must be finite)"
                )
            }
            Error::InvalidParams { param } => {
                write!(f, "invalid parameter: {param}")?;
                match param {
                    Param::Bits => write!(f, " (quantization takes 2..=8 bits)"),
                    Param::Block => write!(f, " (a block holds at least 1 element)"),
                    Param::K => write!(
                        f,
                        " (a ratio is finite and >= 0; a given kept list holds exactly k entries)"
                    ),
                    Param::Threshold => {
                        write!(f, " (finite and >= 0; every given kept entry is above it)")
                    }
                    Param::Weight => write!(f, " (a finite number)"),
                    Param::Values => write!(
                        f,
                        " (int8 values need a block of at least 1 and a sparse method)"
                    ),
                    Param::Unbiased => write!(
                        f,
                        " (unbiased random-k cannot run with error feedback: the residual would \
                         grow without bound)"
                    ),
                    Param::SignScale => {
                        write!(f, " (error feedback needs sign with per-block scales)")
                    }
                    Param::ZeroMask => write!(
                        f,
                        " (a zero mask needs a sign block that is a multiple of 8 elements)"
                    ),
                    _ => Ok(()),
                }
            }
            Error::Truncated { needed, got } => {
                write!(f, "truncated frame: need {needed} bytes, got {got}")
            }
            Error::Incomplete { declared, got } => write!(
                f,
                "frame cut short or corrupted: its header declares at least {declared} bytes, it \
                 has {got} (checksum mismatch)"
            ),
            Error::BadMagic => write!(f, "not a gradwire frame (bad magic)"),
            Error::UnsupportedVersion { version } => {
                write!(f, "unsupported frame format version {version}")
            }
            Error::Checksum { stored, computed } => {
                write!(
                    f,
                    "checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
                )
            }
            Error::Malformed { offset } => write!(f, "malformed frame header at byte {offset}"),
            Error::ParamMismatch { param } => {
                write!(
                    f,
                    "frame parameter `{param}` differs from what the receiver expects"
                )
            }
            Error::ElementCount { expected, got } => {
                write!(f, "frame has {got} elements, receiver expects {expected}")
            }
            Error::TooLarge { n } => write!(f, "element count {n} is too large for this platform"),
            Error::BadIndex { offset } => write!(f, "invalid index section at byte {offset}"),
            Error::BadValue { offset } => write!(f, "invalid value section at byte {offset}"),
            Error::UnsortedIndices { position } => {
                write!(
                    f,
                    "index list not strictly ascending and in range at position {position}"
                )
            }
            Error::TrailingBytes { offset } => write!(f, "unexpected bytes after byte {offset}"),
            Error::BadChunk { start, end } => write!(
                f,
                "chunk {start}..{end} is out of range or not on chunk boundaries"
            ),
        }
    }
}

impl core::error::Error for Error {}

//! The one error type of the std crate: [`Error`].
//!
//! Every variant names what is wrong: the tensor (or bucket) and, where a contribution came from
//! another rank, that rank. Core errors ([`gradwire_core::Error`]) are wrapped with that context
//! in [`Error::Core`].

use std::fmt;
use std::path::PathBuf;

use crate::comm::CommError;

/// Which rank a contribution came from, for error messages: empty when unknown or local.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RankCtx(Option<usize>);

impl fmt::Display for RankCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(rank) => write!(f, " from rank {rank}"),
            None => Ok(()),
        }
    }
}

/// "tensor `name`" for error messages; "tensor" when the tensor has no name (yet), and the
/// label itself for a bucket (`bucket[a, b]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Named<'a>(&'a str);

/// What [`Error::OutOfMemory`] names for a whole model's buffer (printed as it is, not as a
/// tensor's name).
pub(crate) const MODEL: &str = "the model";

/// What [`Error::OutOfMemory`] names for a rank's server residuals (either of their two buffers).
pub(crate) const SERVER_RESIDUALS: &str = "the server residuals";

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            write!(f, "tensor")
        } else if self.0.starts_with("bucket[") || self.0 == MODEL || self.0 == SERVER_RESIDUALS {
            write!(f, "{}", self.0)
        } else {
            write!(f, "tensor `{}`", self.0)
        }
    }
}

/// What is wrong with the framing of a bundle (`FORMAT.md` section 10 gives the layout).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BundleFault {
    /// The bundle is empty: on a communicator, what a rank sends when its own compression
    /// failed in this step (that rank reports the cause).
    Empty,
    /// The bundle is shorter than its header, an entry or its trailer needs.
    Truncated {
        /// Bytes needed (at least: the entries after the first one that runs past the end are
        /// not counted).
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The bundle does not start with the bundle magic bytes.
    BadMagic,
    /// The bundle's format version is not supported.
    UnsupportedVersion {
        /// The version byte found.
        version: u8,
    },
    /// A reserved header field is not zero.
    Reserved {
        /// Byte offset of the field.
        offset: usize,
    },
    /// The checksum does not match, and the bundle's own headers (entry count and lengths)
    /// declare more bytes than it has: most likely it was cut short (a partial transfer or
    /// copy); a corrupted count or length reads the same. Reported instead of
    /// [`BundleFault::Checksum`] so that a truncated bundle is named as such.
    Incomplete {
        /// Bytes the headers declare (at least: entries after the first one that runs past the
        /// end are not counted).
        declared: usize,
        /// Bytes the bundle has.
        got: usize,
    },
    /// The CRC-32 trailer does not match the bundle's bytes.
    Checksum {
        /// CRC stored in the bundle.
        stored: u32,
        /// CRC computed over the bundle.
        computed: u32,
    },
    /// The bundle says it comes from another rank than its position in the group.
    Rank {
        /// The rank the receiver expected.
        expected: usize,
        /// The rank the bundle declares.
        got: u64,
    },
    /// The bundle was made at another step than the receiver expects.
    Step {
        /// The step the receiver expected.
        expected: u64,
        /// The step the bundle declares.
        got: u64,
    },
    /// The bundle holds another number of entries than the manifest.
    EntryCount {
        /// Entries of the manifest.
        expected: usize,
        /// Entries the bundle declares.
        got: u64,
        /// Where the two first differ, naming the manifest's tensor (or bucket) there, when the
        /// bundle's entries can be read that far.
        first_difference: Option<String>,
    },
    /// Bytes remain after the last entry.
    TrailingBytes {
        /// Byte offset where the unexpected bytes start.
        offset: usize,
    },
    /// The bundle is larger than the manifest allows.
    TooLarge {
        /// Largest bundle the manifest allows, in bytes.
        limit: usize,
        /// The bundle's length in bytes.
        got: usize,
    },
}

impl fmt::Display for BundleFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BundleFault::Empty => write!(
                f,
                "is empty (from a peer: its compression failed in this step, and its own error \
                 says why)"
            ),
            BundleFault::Truncated { needed, got } => {
                write!(f, "truncated: needs {needed} bytes, got {got}")
            }
            BundleFault::BadMagic => write!(f, "not a gradwire bundle (bad magic)"),
            BundleFault::UnsupportedVersion { version } => {
                write!(f, "unsupported bundle format version {version}")
            }
            BundleFault::Reserved { offset } => {
                write!(f, "reserved header field at byte {offset} is not zero")
            }
            BundleFault::Incomplete { declared, got } => write!(
                f,
                "cut short or corrupted: its headers declare at least {declared} bytes, it has \
                 {got} (checksum mismatch)"
            ),
            BundleFault::Checksum { stored, computed } => write!(
                f,
                "checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
            ),
            BundleFault::Rank { expected, got } => {
                write!(f, "declares rank {got}, expected rank {expected}")
            }
            BundleFault::Step { expected, got } => {
                write!(f, "made at step {got}, expected step {expected}")
            }
            BundleFault::EntryCount {
                expected,
                got,
                first_difference,
            } => {
                write!(f, "holds {got} entries, the manifest has {expected}")?;
                match first_difference {
                    Some(d) => write!(f, " ({d})"),
                    None => Ok(()),
                }
            }
            BundleFault::TrailingBytes { offset } => {
                write!(f, "unexpected bytes after byte {offset}")
            }
            BundleFault::TooLarge { limit, got } => {
                write!(
                    f,
                    "is {got} bytes, more than the manifest's limit of {limit}"
                )
            }
        }
    }
}

/// Everything that can go wrong in the std crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A core kernel or frame decoder failed on one tensor (or bucket).
    #[error("{}{}: {source}", Named(.tensor), RankCtx(*.rank))]
    Core {
        /// The tensor, or the bucket (`bucket[a, b, ...]`), the frame belongs to.
        tensor: String,
        /// The rank whose contribution failed, when it came from another rank.
        rank: Option<usize>,
        /// The core error.
        #[source]
        source: gradwire_core::Error,
    },
    /// A tensor's data length is not the product of its shape.
    #[error("{}: shape {shape:?} holds {expected} elements, data has {got}", Named(.tensor))]
    Shape {
        /// The tensor (empty when the tensor has no name yet).
        tensor: String,
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        expected: usize,
        /// Elements the data has.
        got: usize,
    },
    /// The product of a shape overflows `usize`.
    #[error("{}: the element count of shape {shape:?} overflows", Named(.tensor))]
    ShapeOverflow {
        /// The tensor (empty when the tensor has no name yet).
        tensor: String,
        /// The shape.
        shape: Vec<usize>,
    },
    /// A tensor has another element count or shape than expected (a residual, a manifest, a
    /// peer's contribution). Never truncated or padded.
    #[error("tensor `{tensor}`{rank}: expected shape {expected:?}, got {got:?}", rank = RankCtx(*.rank))]
    ShapeMismatch {
        /// The tensor.
        tensor: String,
        /// The rank whose contribution differs, when it came from another rank.
        rank: Option<usize>,
        /// The shape the receiver expected.
        expected: Vec<usize>,
        /// The shape it got.
        got: Vec<usize>,
    },
    /// A tensor came back in another shape of the same element count as the one its
    /// error-feedback residual was kept in (a transposed or reshaped weight): adding the old
    /// residual would put it on the wrong coordinates. To go on, drop or re-set that residual:
    /// [`crate::feedback::ErrorFeedback::set_residual_with_shape`] (the residual laid out in the new
    /// shape) or, through a compressor, [`crate::GradientCompressor::reset_error_buffer`]
    /// (every residual) or [`crate::GradientCompressor::restore_feedback`].
    #[error(
        "tensor `{tensor}`: its residual is kept in shape {expected:?}, the gradient has shape \
         {got:?} (drop or re-set that residual to go on)"
    )]
    ShapeChanged {
        /// The tensor.
        tensor: String,
        /// The shape the residual remembers.
        expected: Vec<usize>,
        /// The gradient's shape.
        got: Vec<usize>,
    },
    /// A tensor changed its element count between steps of error feedback.
    #[error("tensor `{tensor}`: residual has {expected} elements, gradient has {got}")]
    LengthChanged {
        /// The tensor.
        tensor: String,
        /// Elements of the stored residual.
        expected: usize,
        /// Elements of the gradient.
        got: usize,
    },
    /// A tensor the receiver expects is missing from a contribution.
    #[error("tensor `{tensor}` is missing{rank}", rank = RankCtx(*.rank))]
    MissingTensor {
        /// The tensor.
        tensor: String,
        /// The rank whose contribution lacks it, when it came from another rank.
        rank: Option<usize>,
    },
    /// A contribution holds a tensor the receiver does not expect.
    #[error("unexpected tensor `{tensor}`{rank}", rank = RankCtx(*.rank))]
    UnexpectedTensor {
        /// The tensor.
        tensor: String,
        /// The rank whose contribution holds it, when it came from another rank.
        rank: Option<usize>,
    },
    /// A name appears twice where names must be unique.
    #[error("tensor `{tensor}` appears more than once")]
    DuplicateTensor {
        /// The tensor.
        tensor: String,
    },
    /// A bundle entry belongs to another tensor or bucket than the manifest says, or to the
    /// same one in another shape (entry ids hash the shapes).
    #[error("bundle{rank}: entry {index} is not `{expected}` as the manifest has it (another tensor or bucket, or another shape{counts}; id {expected_id:#018x}, got id {got_id:#018x})", rank = RankCtx(*.rank), counts = ElementCounts(*.got_elements, *.expected_elements))]
    UnexpectedEntry {
        /// The rank whose bundle it is.
        rank: Option<usize>,
        /// Position of the entry in the bundle.
        index: usize,
        /// The tensor or bucket the manifest has at that position.
        expected: String,
        /// Its element count in the manifest.
        expected_elements: u64,
        /// The element count of the entry's frame, when its header reads.
        got_elements: Option<u64>,
        /// The id the manifest has there.
        expected_id: u64,
        /// The id in the bundle.
        got_id: u64,
    },
    /// A bundle's framing is invalid.
    #[error("bundle{rank} {fault}", rank = RankCtx(*.rank))]
    Bundle {
        /// The rank whose bundle it is, when it came from another rank.
        rank: Option<usize>,
        /// What is wrong.
        fault: BundleFault,
    },
    /// A method or configuration is invalid.
    #[error("invalid configuration: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// A frame was made with other parameters than the receiver expects (another method, k,
    /// value type, seed, step, ...): both configurations, in the text of
    /// [`crate::method::format`].
    #[error(
        "{}{}: the frame was made with `{frame}`, this side expects `{expected}` ({param} differs)",
        Named(.tensor),
        RankCtx(*.rank)
    )]
    ParamsDiffer {
        /// The tensor, or the bucket (`bucket[a, b, ...]`), the frame belongs to.
        tensor: String,
        /// The rank the frame came from, when it came from another rank.
        rank: Option<usize>,
        /// The first parameter that differs.
        param: gradwire_core::Param,
        /// The frame's configuration (with `k` as the count it carries).
        frame: String,
        /// The expected configuration, with `k` resolved for the tensor when it is a ratio.
        expected: String,
    },
    /// Contributions disagree on how they were made (method, seed, step, number of ranks).
    #[error("tensor `{tensor}`{rank}: {reason}", rank = RankCtx(*.rank))]
    Disagreement {
        /// The tensor (or bucket).
        tensor: String,
        /// The rank that disagrees.
        rank: Option<usize>,
        /// What differs.
        reason: String,
    },
    /// The f32 sum of finite contributions overflows (also under the mean, which divides the
    /// sum once at the end): the result would be infinite.
    #[error("the aggregate of tensor {tensor:?} overflows f32 at element {index}")]
    Overflow {
        /// The tensor holding the first element that overflows.
        tensor: String,
        /// That element's flat (row-major) index within the tensor.
        index: usize,
    },
    /// The number of contributions does not match the world size.
    #[error("expected {expected} contributions (world size), got {got}")]
    WorldSize {
        /// Contributions expected.
        expected: usize,
        /// Contributions received.
        got: usize,
    },
    /// `all_reduce` across more than one rank without a communicator.
    #[error(
        "no communicator: cannot aggregate across {world_size} ranks; give one to \
         CompressedAllReduce::with_communicator or use all_reduce_with_peers"
    )]
    NoCommunicator {
        /// The configured world size.
        world_size: usize,
    },
    /// A saved checkpoint is invalid or does not fit.
    #[error("checkpoint: {reason}")]
    Checkpoint {
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A tensor of a safetensors file is not float32.
    #[error("tensor `{tensor}` has dtype {dtype}; gradwire reads float32 tensors")]
    Dtype {
        /// The tensor.
        tensor: String,
        /// Its dtype, as safetensors names it.
        dtype: String,
    },
    /// A safetensors file could not be written or read.
    #[error("safetensors: {}", describe_safetensors(.source))]
    Safetensors {
        /// The safetensors error.
        #[from]
        source: safetensors::SafeTensorError,
    },
    /// The memory for a tensor the receiver expects (a valid frame may declare more elements
    /// than the machine holds), or for state a step keeps the size of the model (a new
    /// residual, the server residuals and the buffer of their next values, the outputs of
    /// `all_reduce`), could not be allocated. `tensor` is the tensor's name, or "the model" or
    /// "the server residuals", printed as they are.
    #[error("{}: cannot allocate {elements} elements", Named(.tensor))]
    OutOfMemory {
        /// The tensor.
        tensor: String,
        /// Elements asked for.
        elements: usize,
    },
    /// A container file is invalid or describes another model (FORMAT.md section 13).
    #[error("{reason}")]
    Container {
        /// What is wrong.
        reason: String,
    },
    /// A peer's step failed before the collective: it took part with its reason instead of its
    /// bundle, so that no rank waits for it.
    #[error("rank {rank} could not take part in this step: {reason}")]
    PeerFailed {
        /// The first rank (in rank order) whose step failed.
        rank: usize,
        /// Its error, as it reported it.
        reason: String,
    },
    /// Ranks are configured differently: the first rank whose configuration differs from rank
    /// 0's, and the first field that differs.
    #[error(
        "rank {rank} is configured differently from rank 0: {field} is `{got}` there, `{expected}` on rank 0"
    )]
    ConfigDiffers {
        /// The first rank configured otherwise than rank 0.
        rank: usize,
        /// The first field that differs (`method`, `seed`, `reduction`, `layout`, `step`, ...).
        field: String,
        /// Rank 0's value.
        expected: String,
        /// That rank's value.
        got: String,
    },
    /// A rank's collective message is not what the collective expects.
    #[error("rank {rank}: {reason}")]
    Collective {
        /// The rank whose message it is.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// A state gradwire's own checks rule out was reached: a bug in gradwire, not in the input.
    #[error("internal error in gradwire (please report it): {what}")]
    Internal {
        /// What went wrong.
        what: String,
    },
    /// The collective transport failed.
    #[error("communication: {source}")]
    Comm {
        /// The transport error.
        #[from]
        source: CommError,
    },
}

impl Error {
    /// Wraps a core error with the tensor (or bucket) it happened on and the rank it came from.
    pub(crate) fn core(tensor: &str, rank: Option<usize>, source: gradwire_core::Error) -> Self {
        Error::Core {
            tensor: tensor.to_owned(),
            rank,
            source,
        }
    }

    /// A configuration error with its reason.
    pub(crate) fn config(reason: impl Into<String>) -> Self {
        Error::Config {
            reason: reason.into(),
        }
    }

    /// A container error with its reason.
    pub(crate) fn container(reason: impl Into<String>) -> Self {
        Error::Container {
            reason: reason.into(),
        }
    }

    /// An internal error (a bug in gradwire) saying what went wrong.
    pub(crate) fn internal(what: impl Into<String>) -> Self {
        Error::Internal { what: what.into() }
    }

    /// A checkpoint error with its reason.
    pub(crate) fn checkpoint(reason: impl Into<String>) -> Self {
        Error::Checkpoint {
            reason: reason.into(),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `: the frame has G elements, the manifest E` when both are known and differ.
struct ElementCounts(Option<u64>, u64);

impl fmt::Display for ElementCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(got) if got != self.1 => {
                write!(f, ": the frame has {got} elements, the manifest {}", self.1)
            }
            _ => Ok(()),
        }
    }
}

/// `e`'s message, with a hint for the errors of the first bytes (the 8-byte header length and
/// the UTF-8 header it frames), which are what a file of another kind gives: "header too
/// large" alone reads as if a real safetensors file were damaged.
pub(crate) fn describe_safetensors(e: &safetensors::SafeTensorError) -> String {
    const FRAMING: &str = "a safetensors file starts with the 8-byte little-endian length of \
                           the JSON header that follows";
    match e {
        safetensors::SafeTensorError::HeaderTooSmall
        | safetensors::SafeTensorError::HeaderTooLarge
        | safetensors::SafeTensorError::InvalidHeader(_) => {
            format!("{e} (not a safetensors file? {FRAMING})")
        }
        safetensors::SafeTensorError::InvalidHeaderLength => {
            format!("{e} (not a safetensors file, or one cut short? {FRAMING})")
        }
        _ => e.to_string(),
    }
}

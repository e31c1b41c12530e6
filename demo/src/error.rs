//! The demo's error type.

use crate::codec::Method;

/// Everything that can stop a training run or the report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// candle failed (shape mismatch, ...).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The transport failed.
    #[error("communication: {0}")]
    Comm(#[from] gradwire::comm::CommError),
    /// The method cannot run in this build (`dense-f32-allreduce` without the `mpi` feature).
    #[error(
        "method `{0}` is not available in this build: `dense-f32-allreduce` needs the `mpi` \
         feature and `--transport mpi`"
    )]
    NotWired(Method),
    /// A codec rejected a gradient or a message.
    #[error("codec `{method}`: {message}")]
    Codec {
        /// The method whose codec failed.
        method: Method,
        /// What went wrong.
        message: String,
    },
    /// The requested transport is not available in this build.
    #[error("transport unavailable: {0}")]
    Transport(String),
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Writing an output file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Serialising the JSON report failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// Drawing the plot failed.
    #[error("plot: {0}")]
    Plot(String),
    /// A worker thread panicked.
    #[error("worker thread {rank} panicked")]
    WorkerPanicked {
        /// The rank of the thread.
        rank: usize,
    },
}

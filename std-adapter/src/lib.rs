//! # gradwire
//!
//! Gradient compression for data-parallel training, on top of the `no_std` kernels of
//! [`gradwire_core`]: error feedback keyed by parameter name, buckets, one bundle per rank per
//! step, validated aggregation (sum, mean, sign majority vote), residual checkpoints, the
//! reference Python safetensors layout, collective transports ([`comm`]) and the `gradwire`
//! command-line tool.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod aggregate;
pub mod allreduce;
pub mod bucket;
pub mod bundle;
pub mod comm;
pub mod compressor;
pub mod error;
pub mod feedback;
pub mod reference;
pub mod tensor;

pub use gradwire_core as core;

pub use aggregate::Reduction;
pub use allreduce::CompressedAllReduce;
pub use bucket::{BucketConfig, TopKScope};
pub use bundle::{Manifest, TensorSpec};
pub use compressor::{CompressedGradient, CompressionMethod, GradientCompressor};
pub use error::Error;
pub use feedback::ErrorFeedback;
pub use tensor::Tensor;

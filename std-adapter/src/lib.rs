//! # gradwire
//!
//! Gradient compression for data-parallel training, on top of the `no_std` kernels of
//! [`gradwire_core`]: error feedback keyed by parameter name, buckets, one bundle per rank per
//! step, validated aggregation (sum, mean, sign majority vote), residual checkpoints, the
//! reference Python safetensors layout, collective transports ([`comm`]) and the `gradwire`
//! command-line tool.
//!
//! Where to start: [`tensor::read_safetensors`] for a model's gradients,
//! [`GradientCompressor`] (one rank: compress with error feedback, bundles, checkpoints),
//! [`Manifest`] and [`aggregate`] (decode and reduce the ranks' bundles over any transport),
//! [`CompressedAllReduce`] (all of it over a [`comm::Communicator`]). Methods are named by
//! [`CompressionMethod`] (the original module's names, plus `Core` for every option of
//! [`gradwire_core::Method`]).
//!
//! Compression and aggregation of a bundle use every core of rayon's pool by default
//! ([`parallel::Parallelism`]), across tensors and across chunks of a large tensor, with the
//! same bytes and bits as the serial path.
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
pub mod parallel;
mod parallel_randomk;
mod parallel_select;
pub mod reference;
pub mod safetensors_checked;
pub mod tensor;

pub use gradwire_core as core;

pub use aggregate::{Aggregator, Reduction};
pub use allreduce::CompressedAllReduce;
pub use bucket::{BucketConfig, TopKScope};
pub use bundle::{Manifest, TensorSpec};
pub use compressor::{CompressedGradient, CompressionMethod, GradientCompressor};
pub use error::Error;
pub use feedback::ErrorFeedback;
pub use parallel::Parallelism;
pub use tensor::Tensor;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

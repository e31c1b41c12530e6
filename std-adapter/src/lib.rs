//! # gradwire
//!
//! Gradient compression for data-parallel training, on top of the `no_std` kernels of
//! [`gradwire_core`]: error feedback keyed by parameter name, buckets, one bundle per rank per
//! step, validated aggregation (sum, mean, sign majority vote), residual checkpoints, the
//! reference Python safetensors layout, collectives over a [`comm::Communicator`] and the
//! `gradwire` command-line tool.
//!
//! Where to start: [`tensor::read_safetensors`] for a model's gradients,
//! [`GradientCompressor`] (one rank: compress with error feedback, bundles, checkpoints),
//! [`Manifest`] and [`Aggregator`] (decode and reduce the ranks' bundles over any transport),
//! [`CompressedAllReduce`] (all of it over a [`comm::Communicator`]). Methods are named by
//! [`CompressionMethod`] (the original module's names, plus `Core` for every option of
//! [`gradwire_core::Method`]).
//!
//! Compression and aggregation use every core of rayon's pool by default ([`Parallelism`]),
//! across tensors and across chunks of a large tensor, with the same bytes and bits as on one
//! thread.
//!
//! The modules are layers, each using only those listed before it: [`comm`], `error`,
//! `safetensors_reader`, [`tensor`], [`method`], [`layout`], [`feedback`], `engine` (the one
//! encoder), `aggregate`, `collective`, [`powersgd`], [`reference`](mod@reference),
//! [`compressor`], [`dgc`], `allreduce`, `container` (the tool's file format), [`cli`] (the
//! `gradwire` tool) (`docs/architecture.md`; a test checks the order).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

// The integration tests' helpers (`tests/common`) name the crate `gradwire`; unit tests that
// moved out of `tests/` include them.
#[cfg(test)]
extern crate self as gradwire;

pub mod comm;
mod error;
mod safetensors_reader;
pub mod tensor;

pub mod method;

pub mod layout;

pub mod feedback;

mod engine;

mod aggregate;

mod collective;

pub mod powersgd;

pub mod reference;

pub mod compressor;

pub mod dgc;

mod allreduce;

mod container;

pub mod cli;

pub use gradwire_core as core;

// The root: the types a user of the README starts from (everything else lives in its module).
pub use aggregate::{Aggregator, Reduction};
pub use allreduce::{CompressedAllReduce, NonBlockingAllReduce, PendingAllReduce};
pub use collective::Collective;
pub use compressor::GradientCompressor;
pub use engine::Parallelism;
pub use error::{BundleFault, Error, Result};
pub use layout::{BucketConfig, CompressedGradient, Manifest, TensorSpec};
pub use method::CompressionMethod;
pub use tensor::{Tensor, TensorMut};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

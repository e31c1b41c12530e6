//! A data-parallel training demo for gradwire.
//!
//! W workers train one MLP (64-256-256-10, built with candle on the CPU) on the digits data set
//! that ships inside `smartcore` (1797 images of 8x8 pixels, 10 classes). Every step each worker
//! computes the gradient of its own shard, compresses it into one message
//! ([`codec::GradientCodec::encode`]), the messages are all-gathered through a
//! [`gradwire::comm::Communicator`], and every worker decodes the mean gradient
//! ([`codec::GradientCodec::decode_mean`]) and applies the same SGD update, so the replicas stay
//! bit-identical.
//!
//! The example `data_parallel` (`cargo run --release --example data_parallel`) runs every
//! method with several seeds and prints a table of test accuracy, training loss, bytes per
//! worker per step and the share of step time spent in the codec, and writes a PNG plot and
//! a JSON report.
//!
//! Module map:
//! - [`data`]: the digits data set, the seeded train/test split and the shards;
//! - [`model`]: the MLP, its seeded initialisation, forward and backward with candle;
//! - [`codec`]: the compression methods behind one trait, [`codec::GradientCodec`]
//!   (the seam where gradwire plugs in);
//! - [`train`]: one rank's training loop, [`train::run_rank`];
//! - [`launch`]: running the ranks as threads or as MPI processes;
//! - [`report`]: the summary over seeds, the table and the JSON report;
//! - [`plot`]: the PNG plot;
//! - `mpi_dense` (feature `mpi`): `dense-f32-allreduce`, a plain `MPI_Allreduce` outside
//!   gradwire, the dense step a user would run.
//!
//! Features: `mpi` enables `--transport mpi` (`gradwire/mpi`, Open MPI) and the
//! `dense-f32-allreduce` method.
#![forbid(unsafe_code)]

pub mod codec;
pub mod data;
pub mod error;
pub mod launch;
pub mod model;
#[cfg(feature = "mpi")]
pub mod mpi_dense;
pub mod plot;
pub mod replay;
pub mod report;
pub mod train;

pub use error::DemoError;

//! The bodies of gradwire's fuzz targets as plain functions `fn(&[u8])`.
//!
//! `fuzz/fuzz_targets/*.rs` call them under libFuzzer (nightly, `cargo fuzz`); the stable
//! replay tests `core/tests/fuzz_replay.rs` and `std-adapter/tests/fuzz_replay.rs` include the
//! same source files with `#[path]` and run every file of `fuzz/corpus/<target>/` through
//! them, so CI covers the corpora without nightly and without a dependency on this crate.
//! Each module refers to its siblings as `crate::input`, which resolves the same way in both.

#[cfg(feature = "std")]
pub mod collective_targets;
pub mod core_targets;
pub mod gens;
pub mod input;
pub mod seeds;
#[cfg(feature = "std")]
pub mod state_targets;
#[cfg(feature = "std")]
pub mod std_targets;
#[cfg(feature = "std")]
pub mod window_targets;

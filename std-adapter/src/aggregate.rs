//! Aggregation of W ranks' contributions: sum, mean and sign majority vote.
//!
//! Every contribution is validated before anything is accumulated: the same tensors, in the
//! same order, with the same element counts, made with the agreed method, seed and step;
//! anything else is an error naming the tensor (or bucket) and the rank. Then every frame is
//! added straight into the result with [`gradwire_core::accumulate_into`], in rank order, so
//! every rank that aggregates the same contributions gets bit-identical results; no rank's
//! contribution is ever decoded into a dense copy of its own.
//!
//! - [`Reduction::Sum`]: the f32 sum, in rank order.
//! - [`Reduction::Mean`]: the sum, divided once by W (the mean of `[3]`, `[3]`, `[3]` is `[3]`).
//! - [`Reduction::MajorityVote`]: for unscaled sign frames ([`gradwire_core::SignScale::None`]):
//!   each element is `+1` when the sum of the ±1 votes is `>= 0` (ties go to +) and `-1`
//!   otherwise.
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::aggregate::{Reduction, aggregate};
//! use gradwire::bucket::BucketConfig;
//! use gradwire::bundle::Manifest;
//! use gradwire::compressor::{CompressionMethod, GradientCompressor};
//! use gradwire::tensor::Tensor;
//!
//! let method = CompressionMethod::Core(gradwire::core::Method::Dense {
//!     values: gradwire::core::Values::F32,
//! });
//! let grads = HashMap::from([("w".to_string(), Tensor::vector(vec![3.0, 1.0]))]);
//! let manifest = Manifest::for_gradients(&grads, &method, 0, BucketConfig::none())?;
//! let mut bundles = Vec::new();
//! for rank in 0..3 {
//!     let mut sender = GradientCompressor::new(method.clone());
//!     let mut bundle = Vec::new();
//!     sender.compress_bundle(&manifest, &grads, rank, &mut bundle)?;
//!     bundles.push(bundle);
//! }
//! let mean = aggregate(&manifest, &bundles, 0, Reduction::Mean)?;
//! assert_eq!(mean, vec![3.0, 1.0]);
//! # Ok::<(), gradwire::error::Error>(())
//! ```

use std::collections::HashMap;

use gradwire_core::{Method, SignScale, accumulate_into, sign};

use crate::bundle::{EntryKind, Manifest, check_frame};
use crate::compressor::CompressedGradient;
use crate::error::{Error, Result};

/// How contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// The f32 sum, in rank order.
    Sum,
    /// The sum divided once by the number of contributions.
    Mean,
    /// Sign majority vote over unscaled sign frames: `+1` where the votes sum to `>= 0`
    /// (ties go to +), `-1` elsewhere.
    MajorityVote,
}

fn check_reduction(manifest: &Manifest, reduction: Reduction, count: usize) -> Result<()> {
    if count == 0 {
        return Err(Error::WorldSize {
            expected: 1,
            got: 0,
        });
    }
    if reduction == Reduction::MajorityVote
        && let Some(entry) = manifest.entries().iter().find(|e| {
            !matches!(
                e.method,
                Method::Sign {
                    scale: SignScale::None
                }
            )
        })
    {
        return Err(Error::config(format!(
            "majority vote needs unscaled sign frames (SignSGDMajority); `{}` is sent as {}",
            entry.label,
            crate::compressor::format_method(&entry.method)
        )));
    }
    Ok(())
}

fn check_no_buckets(manifest: &Manifest) -> Result<()> {
    if manifest
        .entries()
        .iter()
        .any(|e| e.kind != EntryKind::Tensor)
    {
        return Err(Error::config(
            "per-tensor contributions need a manifest without buckets",
        ));
    }
    Ok(())
}

fn finish(out: &mut [f32], reduction: Reduction, count: usize) {
    match reduction {
        Reduction::Sum => {}
        Reduction::Mean => {
            let w = count as f32;
            for x in out.iter_mut() {
                *x /= w;
            }
        }
        Reduction::MajorityVote => sign::majority(out),
    }
}

/// Aggregates the bundles of W ranks (`bundles[r]` is rank `r`'s) made at `step` into `out`,
/// resized to [`Manifest::flat_len`] (no allocation when it has the capacity). See the module
/// docs for the checks and the reductions.
///
/// # Errors
/// [`Error::WorldSize`] for no bundle; [`Error::Config`] for a majority vote over frames that
/// are not unscaled sign; every error of [`Manifest::check_bundle`], naming the rank (and the
/// tensor or bucket where an entry is at fault). Checks run on every bundle before anything is
/// accumulated, so `out` is untouched on those errors; a frame whose body turns out invalid
/// while accumulating is an [`Error::Core`] naming tensor and rank, and leaves `out` zeroed.
pub fn aggregate_into<B: AsRef<[u8]>>(
    manifest: &Manifest,
    bundles: &[B],
    step: u64,
    reduction: Reduction,
    out: &mut Vec<f32>,
) -> Result<()> {
    check_reduction(manifest, reduction, bundles.len())?;
    for (rank, bundle) in bundles.iter().enumerate() {
        manifest.check_bundle(bundle.as_ref(), Some(rank), Some(step))?;
    }
    out.clear();
    out.resize(manifest.flat_len(), 0.0);
    for (rank, bundle) in bundles.iter().enumerate() {
        let result = manifest.walk(bundle.as_ref(), Some(rank), |e, frame| {
            let entry = &manifest.entries()[e];
            let acc = &mut out[entry.offset..entry.offset + entry.len];
            accumulate_into(frame, &manifest.params(e, step), acc, 1.0)
                .map(|_| ())
                .map_err(|err| Error::core(&entry.label, Some(rank), err))
        });
        if let Err(e) = result {
            out.fill(0.0);
            return Err(e);
        }
    }
    finish(out, reduction, bundles.len());
    Ok(())
}

/// As [`aggregate_into`], returning a new flat buffer.
///
/// # Errors
/// As [`aggregate_into`].
pub fn aggregate<B: AsRef<[u8]>>(
    manifest: &Manifest,
    bundles: &[B],
    step: u64,
    reduction: Reduction,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    aggregate_into(manifest, bundles, step, reduction, &mut out)?;
    Ok(out)
}

/// Aggregates per-tensor compressed gradients of W ranks (`contributions[r]` is rank `r`'s) made
/// at `step`, against a manifest without buckets, into `out` (flat layout of the manifest).
///
/// # Errors
/// [`Error::WorldSize`] for no contribution; [`Error::Config`] for a manifest with buckets or a
/// majority vote over frames that are not unscaled sign; naming the tensor and the rank:
/// [`Error::MissingTensor`], [`Error::UnexpectedTensor`], [`Error::ShapeMismatch`],
/// [`Error::Disagreement`] (another step), [`Error::Core`] (a frame that fails
/// [`check_frame`]: another method, seed, element count...). All checks run before anything is
/// accumulated; a frame body found invalid while accumulating leaves `out` zeroed.
pub fn aggregate_compressed_into(
    manifest: &Manifest,
    contributions: &[&HashMap<String, CompressedGradient>],
    step: u64,
    reduction: Reduction,
    out: &mut Vec<f32>,
) -> Result<()> {
    check_reduction(manifest, reduction, contributions.len())?;
    check_no_buckets(manifest)?;
    for (rank, map) in contributions.iter().enumerate() {
        check_contribution(manifest, map, rank, step)?;
    }
    out.clear();
    out.resize(manifest.flat_len(), 0.0);
    for (rank, map) in contributions.iter().enumerate() {
        for (e, entry) in manifest.entries().iter().enumerate() {
            let Some(cg) = map.get(&entry.label) else {
                continue;
            };
            let acc = &mut out[entry.offset..entry.offset + entry.len];
            if let Err(err) = accumulate_into(cg.frame(), &manifest.params(e, step), acc, 1.0) {
                out.fill(0.0);
                return Err(Error::core(&entry.label, Some(rank), err));
            }
        }
    }
    finish(out, reduction, contributions.len());
    Ok(())
}

/// Checks rank `rank`'s per-tensor compressed gradients made at `step` against a manifest
/// without buckets (see [`aggregate_compressed_into`]), without decoding any frame body.
///
/// # Errors
/// Naming the tensor and the rank: [`Error::MissingTensor`], [`Error::UnexpectedTensor`],
/// [`Error::ShapeMismatch`], [`Error::Disagreement`] (another step), [`Error::Core`] (a frame
/// that fails [`check_frame`]); [`Error::Config`] for a manifest with buckets.
pub fn check_contribution(
    manifest: &Manifest,
    map: &HashMap<String, CompressedGradient>,
    rank: usize,
    step: u64,
) -> Result<()> {
    check_no_buckets(manifest)?;
    let rank_ctx = Some(rank);
    for (e, entry) in manifest.entries().iter().enumerate() {
        let Some(info) = entry
            .members
            .first()
            .and_then(|&t| manifest.tensors().get(t))
        else {
            continue;
        };
        let cg = map.get(&info.name).ok_or_else(|| Error::MissingTensor {
            tensor: info.name.clone(),
            rank: rank_ctx,
        })?;
        if cg.shape() != info.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                tensor: info.name.clone(),
                rank: rank_ctx,
                expected: info.shape.clone(),
                got: cg.shape().to_vec(),
            });
        }
        if cg.step() != step {
            return Err(Error::Disagreement {
                tensor: info.name.clone(),
                rank: rank_ctx,
                reason: format!("made at step {}, expected step {step}", cg.step()),
            });
        }
        check_frame(cg.frame(), &manifest.params(e, step), info.numel)
            .map_err(|err| Error::core(&info.name, rank_ctx, err))?;
    }
    if map.len() != manifest.tensors().len() {
        let mut extra: Vec<&String> = map
            .keys()
            .filter(|n| manifest.tensor(n).is_none())
            .collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(Error::UnexpectedTensor {
                tensor: (*name).clone(),
                rank: rank_ctx,
            });
        }
    }
    Ok(())
}

//! The compression methods, behind one trait: [`GradientCodec`].
//!
//! **This module is the seam where gradwire plugs in.** A training step calls exactly two
//! functions of a codec: [`GradientCodec::encode`] turns this rank's gradients (name order)
//! into one message, and, after the all-gather, [`GradientCodec::decode_mean`] turns every
//! rank's message (rank order) into the mean gradient. [`new_codec`] builds the codec of a
//! [`Method`] for one rank.
//!
//! Every method runs through gradwire ([`GradwireCodec`]): the message is the rank's bundle
//! (every byte counted: header, per-tensor frames, checksums), and the mean is gradwire's
//! validated aggregation. [`DenseF32`] (raw f32 bytes, no header) remains as the reference
//! that a test compares gradwire's dense f32 path against.

use std::collections::HashMap;
use std::fmt;

use gradwire::BucketConfig;
use gradwire::CompressedAllReduce;
use gradwire::CompressionMethod;
use gradwire::Parallelism;
use gradwire::comm::{Communicator, Traffic};
use gradwire::dgc::{DensitySchedule, Dgc, DgcConfig, DgcSelection};
use gradwire::powersgd::{PowerSgd, PowerSgdConfig};
use gradwire::tensor::{Tensor, TensorMut};
use gradwire::{Aggregator, Reduction};
use gradwire::{Manifest, TensorSpec};

use crate::DemoError;
use crate::model::ParamSpec;

/// A compression method of the demo (the rows of its table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Method {
    /// Dense f32 values: the uncompressed baseline.
    #[value(name = "dense-f32")]
    DenseF32,
    /// Dense f16 values.
    #[value(name = "dense-f16")]
    DenseF16,
    /// Top-k, k = 1 % of each tensor, int8 values with a scale, error feedback.
    #[value(name = "topk-1%-ef-int8")]
    TopK1EfInt8,
    /// Top-k, k = 1 %, f32 values, no error feedback.
    #[value(name = "topk-1%")]
    TopK1,
    /// Top-k, k = 0.1 %, error feedback.
    #[value(name = "topk-0.1%-ef")]
    TopK01Ef,
    /// Random-k, k = 1 %, indices regenerated from the seed, error feedback.
    #[value(name = "randk-1%-ef")]
    RandK1Ef,
    /// Sign (1 bit per element) with a per-block scale, error feedback.
    #[value(name = "sign-ef")]
    SignEf,
    /// 4-bit quantization with a per-block scale, error feedback.
    #[value(name = "quant4-ef")]
    Quant4Ef,
    /// Top-k 1 % with DGC's recipe (`gradwire::dgc`): momentum correction and factor masking
    /// (the optimizer's momentum is then 0), local clipping, density warm-up 25 %, 6.25 %,
    /// 1.5625 % over the first steps; int8 values, error feedback.
    #[value(name = "topk-1%-dgc-int8")]
    TopK1DgcInt8,
    /// Random-k 1 % with DGC's recipe, f32 values, error feedback.
    #[value(name = "randk-1%-dgc")]
    RandK1Dgc,
    /// Random-k 3 % with DGC's recipe: the density at which random-k with the recipe comes
    /// within 3 points of dense f32 in 300 steps.
    #[value(name = "randk-3%-dgc")]
    RandK3Dgc,
    /// PowerSGD rank 1 with error feedback and warm start (its own two f32 all-reduces).
    #[value(name = "powersgd-r1-ef")]
    PowerSgd1Ef,
    /// PowerSGD rank 4 with error feedback and warm start.
    #[value(name = "powersgd-r4-ef")]
    PowerSgd4Ef,
    /// Dense f32 through a plain `MPI_Allreduce` (sum) of the `mpi` crate, outside gradwire:
    /// the step a user without gradwire would run. Only with `--transport mpi` (feature `mpi`);
    /// not in [`Method::ALL`]: its sums are not rank-order bit-identical (see
    /// `crate::mpi_dense`), so it is left out of the threads-vs-MPI comparison.
    #[value(name = "dense-f32-allreduce")]
    DenseF32Allreduce,
    /// [`Method::TopK1EfInt8`] with a one-step delay: each step's exchange runs behind the next
    /// step's forward and backward pass, and step t applies the mean of step t - 1 (zeros at
    /// the first step; Psyche's overlapped pipeline).
    #[value(name = "topk-1%-ef-int8-delayed")]
    TopK1EfInt8Delayed,
    /// [`Method::SignEf`] with a one-step delay, as [`Method::TopK1EfInt8Delayed`].
    #[value(name = "sign-ef-delayed")]
    SignEfDelayed,
}

impl Method {
    /// Every method that runs on every transport, in table order (the default `--methods`;
    /// [`Method::DenseF32Allreduce`] is not one of them).
    pub const ALL: [Method; 15] = [
        Method::DenseF32,
        Method::DenseF16,
        Method::TopK1EfInt8,
        Method::TopK1,
        Method::TopK01Ef,
        Method::RandK1Ef,
        Method::SignEf,
        Method::Quant4Ef,
        Method::TopK1DgcInt8,
        Method::RandK1Dgc,
        Method::RandK3Dgc,
        Method::PowerSgd1Ef,
        Method::PowerSgd4Ef,
        Method::TopK1EfInt8Delayed,
        Method::SignEfDelayed,
    ];

    /// The method's name on the command line and in the reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Method::DenseF32 => "dense-f32",
            Method::DenseF16 => "dense-f16",
            Method::TopK1EfInt8 => "topk-1%-ef-int8",
            Method::TopK1 => "topk-1%",
            Method::TopK01Ef => "topk-0.1%-ef",
            Method::RandK1Ef => "randk-1%-ef",
            Method::SignEf => "sign-ef",
            Method::Quant4Ef => "quant4-ef",
            Method::TopK1DgcInt8 => "topk-1%-dgc-int8",
            Method::RandK1Dgc => "randk-1%-dgc",
            Method::RandK3Dgc => "randk-3%-dgc",
            Method::PowerSgd1Ef => "powersgd-r1-ef",
            Method::PowerSgd4Ef => "powersgd-r4-ef",
            Method::DenseF32Allreduce => "dense-f32-allreduce",
            Method::TopK1EfInt8Delayed => "topk-1%-ef-int8-delayed",
            Method::SignEfDelayed => "sign-ef-delayed",
        }
    }

    /// Whether the training loop runs the method with a one-step delay: the exchange of step
    /// t overlaps the forward and backward pass of step t + 1, which applies its mean.
    #[must_use]
    pub fn delayed(self) -> bool {
        matches!(self, Method::TopK1EfInt8Delayed | Method::SignEfDelayed)
    }

    /// Whether this build can run the method: all of them, but
    /// [`Method::DenseF32Allreduce`] only with the `mpi` feature (and then only under
    /// `--transport mpi`, where the MPI launcher builds its codec: [`new_codec`] refuses it).
    #[must_use]
    pub fn is_wired(self) -> bool {
        self != Method::DenseF32Allreduce || cfg!(feature = "mpi")
    }

    /// PowerSGD's rank, for the PowerSGD methods.
    #[must_use]
    pub fn powersgd_rank(self) -> Option<usize> {
        match self {
            Method::PowerSgd1Ef => Some(1),
            Method::PowerSgd4Ef => Some(4),
            _ => None,
        }
    }

    /// DGC's recipe of the DGC methods: selection, value codec and target density, reached
    /// after a warm-up of [`DGC_STAGE_STEPS`] steps per stage.
    #[must_use]
    pub fn dgc(self) -> Option<(DgcSelection, gradwire::core::Values, f64)> {
        let int8 = gradwire::core::Values::Int8 {
            block: gradwire::method::DEFAULT_INT8_BLOCK,
        };
        let f32 = gradwire::core::Values::F32;
        match self {
            Method::TopK1DgcInt8 => Some((DgcSelection::TopK, int8, 0.01)),
            Method::RandK1Dgc => Some((DgcSelection::RandomK, f32, 0.01)),
            Method::RandK3Dgc => Some((DgcSelection::RandomK, f32, 0.03)),
            _ => None,
        }
    }

    /// Whether the method runs outside gradwire's collectives, on MPI only
    /// ([`Method::DenseF32Allreduce`]).
    #[must_use]
    pub fn needs_mpi(self) -> bool {
        self == Method::DenseF32Allreduce
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl serde::Serialize for Method {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// The collective a run's gradients travel by (`--collective`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Collective {
    /// Every rank's bundle to every rank (`W - 1` bundles received per rank); dense f32 goes
    /// through gradwire's f32 all-reduce instead.
    #[default]
    #[value(name = "allgather")]
    AllGather,
    /// gradwire's two-phase shard-owner all-reduce (about 2 bundles received per rank at any
    /// W); random-k, which it does not cover, stays on the all-gather.
    #[value(name = "two-phase")]
    TwoPhase,
    /// Whichever moves fewer bytes per rank (gradwire's `Collective::Auto`).
    #[value(name = "auto")]
    Auto,
}

impl Collective {
    /// The name on the command line and in the reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllGather => "allgather",
            Collective::TwoPhase => "two-phase",
            Collective::Auto => "auto",
        }
    }
}

impl serde::Serialize for Collective {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// What a codec needs to know about the run, identical on every rank.
#[derive(Debug, Clone)]
pub struct CodecContext<'a> {
    /// The model's parameters, name order: every message carries exactly these tensors.
    pub specs: &'a [ParamSpec],
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The run's seed (random-k and stochastic rounding draw from it).
    pub seed: u64,
    /// The collective.
    pub collective: Collective,
    /// The training's momentum, which a codec that owns the momentum (DGC) applies itself.
    pub momentum: f32,
}

/// One rank's compressor and decompressor for one run (it owns the rank's error-feedback
/// residuals, if any).
///
/// Contract: every rank holds a codec built from the same [`Method`] and an equal
/// [`CodecContext`] (except `rank`); [`GradientCodec::decode_mean`] must give bit-identical
/// output on every rank for the same messages, so that the replicas stay identical.
pub trait GradientCodec: Send {
    /// The method this codec implements.
    fn method(&self) -> Method;

    /// The largest message [`GradientCodec::encode`] can produce: the all-gather refuses
    /// anything longer.
    fn max_message_len(&self) -> usize;

    /// Compresses this rank's gradient for `step`: one flat slice per parameter, in the name
    /// order of [`CodecContext::specs`]; `out` is cleared and receives the message (every byte
    /// that goes on the wire).
    ///
    /// # Errors
    /// If a gradient does not match its tensor or cannot be encoded (e.g. NaN).
    fn encode(&mut self, step: u64, grads: &[&[f32]], out: &mut Vec<u8>) -> Result<(), DemoError>;

    /// Decodes every rank's message for `step` (rank order) and writes the mean gradient into
    /// `out`, one vector per parameter in name order (each already of the tensor's length;
    /// every element is overwritten).
    ///
    /// # Errors
    /// If a message is malformed or does not match the model.
    fn decode_mean(
        &mut self,
        step: u64,
        messages: &[Vec<u8>],
        out: &mut [Vec<f32>],
    ) -> Result<(), DemoError>;

    /// Whether the codec runs a collective of its own ([`GradientCodec::all_reduce`]) instead
    /// of the training loop's all-gather of [`GradientCodec::encode`]'s messages.
    fn runs_own_collective(&self) -> bool {
        false
    }

    /// One step over `comm`, for codecs that run their own collective: this rank's gradients
    /// (as for [`GradientCodec::encode`]) in, the mean gradient (as for
    /// [`GradientCodec::decode_mean`]) out. Returns the bytes of this rank's compressed
    /// gradient.
    ///
    /// # Errors
    /// As [`GradientCodec::encode`] and [`GradientCodec::decode_mean`], and communication
    /// errors; the default is an error (the codec has no collective of its own).
    fn all_reduce(
        &mut self,
        comm: &mut dyn Communicator,
        step: u64,
        grads: &[&[f32]],
        out: &mut [Vec<f32>],
    ) -> Result<usize, DemoError> {
        let _ = (comm, step, grads, out);
        Err(DemoError::Config(format!(
            "the {} codec has no collective of its own",
            self.method()
        )))
    }

    /// For a codec that reduces in place: copies this rank's gradients `grads` into `out`, the
    /// buffers that the next [`GradientCodec::all_reduce`] then reduces where they lie (the
    /// loop's gradients belong to their source, which keeps them). The loop times it as
    /// encoding. The default copies nothing.
    ///
    /// # Errors
    /// [`DemoError::Codec`] when `grads` or `out` do not match the model.
    fn stage(&mut self, grads: &[&[f32]], out: &mut [Vec<f32>]) -> Result<(), DemoError> {
        let _ = (grads, out);
        Ok(())
    }

    /// Whether the codec applies the momentum itself (DGC's momentum correction): the
    /// training loop then applies the mean as a plain SGD step, without its own momentum.
    fn owns_momentum(&self) -> bool {
        false
    }

    /// The bytes this codec moved itself, outside `comm`, so far (cumulative; counted as
    /// `comm`'s [`Communicator::traffic`] counts them). Zero for every codec that talks only
    /// through `comm`, which counts its own bytes.
    fn own_traffic(&self) -> Traffic {
        Traffic::default()
    }
}

/// The gradwire configuration of a demo method: the compressor's method (with error feedback
/// where the method name says so); `None` for PowerSGD, which is not a frame method
/// ([`PowerSgdCodec`]).
#[must_use]
pub fn gradwire_method(method: Method) -> Option<CompressionMethod> {
    use gradwire::core::{K, Method as Core, Values};
    Some(match method {
        Method::PowerSgd1Ef | Method::PowerSgd4Ef => return None,
        Method::TopK1DgcInt8 | Method::RandK1Dgc | Method::RandK3Dgc => return None,
        // gradwire does not run `dense-f32-allreduce` (MPI_Allreduce does): its message is
        // dense f32 all the same.
        Method::DenseF32 | Method::DenseF32Allreduce => CompressionMethod::Core(Core::Dense {
            values: Values::F32,
        }),
        Method::DenseF16 => CompressionMethod::Float16,
        Method::TopK1EfInt8 | Method::TopK1EfInt8Delayed => {
            CompressionMethod::top_k_int8(0.01).with_error_feedback()
        }
        Method::TopK1 => CompressionMethod::TopKRatio {
            ratio: 0.01,
            values: Values::F32,
        },
        Method::TopK01Ef => CompressionMethod::TopKRatio {
            ratio: 0.001,
            values: Values::F32,
        }
        .with_error_feedback(),
        Method::RandK1Ef => CompressionMethod::Core(Core::RandomK {
            k: K::Ratio(0.01),
            values: Values::F32,
            unbiased: false,
        })
        .with_error_feedback(),
        Method::SignEf | Method::SignEfDelayed => CompressionMethod::SignSGD.with_error_feedback(),
        Method::Quant4Ef => CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
    })
}

/// Builds the codec of `method` for one rank: gradwire's bundle (one message per rank per
/// step) and its validated mean aggregation.
///
/// # Errors
/// [`DemoError::Codec`] when gradwire refuses the configuration; [`DemoError::Config`] for
/// [`Method::DenseF32Allreduce`], which only the MPI launcher builds (it calls MPI directly).
pub fn new_codec(
    method: Method,
    ctx: &CodecContext<'_>,
) -> Result<Box<dyn GradientCodec>, DemoError> {
    if method.needs_mpi() {
        return Err(DemoError::Config(format!(
            "`{method}` calls MPI_Allreduce itself: it runs only with `--transport mpi` (a build \
             with the `mpi` feature, started by mpirun)"
        )));
    }
    if let Some(rank) = method.powersgd_rank() {
        return Ok(Box::new(PowerSgdCodec::new(method, rank, ctx)?));
    }
    if method.dgc().is_some() {
        return Ok(Box::new(DgcCodec::new(method, ctx)?));
    }
    Ok(Box::new(GradwireCodec::new(method, ctx)?))
}

/// Copies the loop's gradients (one slice per parameter, name order) into the codec's tensors
/// of those names.
fn fill_named(
    names: &[String],
    tensors: &mut HashMap<String, Tensor>,
    grads: &[&[f32]],
) -> Result<(), String> {
    if grads.len() != names.len() {
        return Err(format!(
            "expected {} tensors, got {}",
            names.len(),
            grads.len()
        ));
    }
    for (name, g) in names.iter().zip(grads) {
        let t = tensors
            .get_mut(name)
            .ok_or_else(|| format!("unknown tensor {name}"))?;
        let shape = t.shape().to_vec();
        t.assign(&shape, g).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The rank-order mean of every rank's bundle for `manifest` into `mean` (flat).
fn mean_of_bundles(
    aggregator: &mut Aggregator,
    manifest: &Manifest,
    messages: &[Vec<u8>],
    step: u64,
    mean: &mut Vec<f32>,
) -> Result<(), String> {
    aggregator
        .aggregate_into(manifest, messages, step, Reduction::Mean, mean)
        .map_err(|e| e.to_string())
}

/// Copies each tensor's part of the flat `mean` into `out` (name order).
fn copy_out(
    manifest: &Manifest,
    mean: &[f32],
    names: &[String],
    out: &mut [Vec<f32>],
) -> Result<(), String> {
    for (name, o) in names.iter().zip(out.iter_mut()) {
        match manifest.slice(mean, name) {
            Some(m) if m.len() == o.len() => o.copy_from_slice(m),
            _ => {
                return Err(format!(
                    "tensor {name} is missing from the mean or has another length"
                ));
            }
        }
    }
    Ok(())
}

/// A zero tensor of every parameter's shape, by name.
fn zero_tensors(specs: &[ParamSpec]) -> Result<HashMap<String, Tensor>, gradwire::Error> {
    specs
        .iter()
        .map(|p| Ok((p.name.clone(), Tensor::zeros(&p.shape)?)))
        .collect()
}

/// PowerSGD through [`gradwire::powersgd::PowerSgd`]: its own two rank-order f32 all-reduces
/// per step over the run's communicator, whatever `--collective` says.
#[derive(Debug)]
pub struct PowerSgdCodec {
    method: Method,
    psgd: PowerSgd,
    names: Vec<String>,
    grads: HashMap<String, Tensor>,
}

impl PowerSgdCodec {
    /// The codec of `method` (rank `rank`) for one rank.
    ///
    /// # Errors
    /// [`DemoError::Codec`] when gradwire refuses the configuration or a shape.
    pub fn new(method: Method, rank: usize, ctx: &CodecContext<'_>) -> Result<Self, DemoError> {
        let err = |e: gradwire::Error| DemoError::Codec {
            method,
            message: e.to_string(),
        };
        let config = PowerSgdConfig {
            seed: ctx.seed,
            ..PowerSgdConfig::with_rank(rank)
        };
        let grads = zero_tensors(ctx.specs).map_err(err)?;
        Ok(PowerSgdCodec {
            method,
            psgd: PowerSgd::new(config).map_err(err)?,
            names: ctx.specs.iter().map(|p| p.name.clone()).collect(),
            grads,
        })
    }

    fn error(&self, e: impl fmt::Display) -> DemoError {
        DemoError::Codec {
            method: self.method,
            message: e.to_string(),
        }
    }

    /// Checks the loop's step and gradients against the model and copies them in.
    fn load(&mut self, step: u64, grads: &[&[f32]], outputs: usize) -> Result<(), String> {
        if step != self.psgd.step() {
            return Err(format!(
                "PowerSGD is at step {}, the loop at {step}",
                self.psgd.step()
            ));
        }
        if outputs != self.names.len() {
            return Err("the outputs do not match the model".into());
        }
        fill_named(&self.names, &mut self.grads, grads)
    }
}

impl GradientCodec for PowerSgdCodec {
    fn method(&self) -> Method {
        self.method
    }

    fn max_message_len(&self) -> usize {
        0
    }

    fn encode(&mut self, _: u64, _: &[&[f32]], _: &mut Vec<u8>) -> Result<(), DemoError> {
        Err(self.error("PowerSGD runs its own all-reduces, not the all-gather"))
    }

    fn decode_mean(&mut self, _: u64, _: &[Vec<u8>], _: &mut [Vec<f32>]) -> Result<(), DemoError> {
        Err(self.error("PowerSGD runs its own all-reduces, not the all-gather"))
    }

    fn runs_own_collective(&self) -> bool {
        true
    }

    fn all_reduce(
        &mut self,
        comm: &mut dyn Communicator,
        step: u64,
        grads: &[&[f32]],
        out: &mut [Vec<f32>],
    ) -> Result<usize, DemoError> {
        // A rank that finds its inputs wrong still takes part in the step, so that its peers
        // fail at this call instead of waiting for it.
        if let Err(reason) = self.load(step, grads, out.len()) {
            let error = gradwire::Error::Config { reason };
            let e = self.psgd.all_reduce_failed(comm, &self.grads, error);
            return Err(self.error(e));
        }
        let mean = self
            .psgd
            .all_reduce_mean(comm, &self.grads)
            .map_err(|e| self.error(e))?;
        for (name, o) in self.names.iter().zip(out.iter_mut()) {
            match mean.get(name) {
                Some(t) if t.data().len() == o.len() => o.copy_from_slice(t.data()),
                _ => return Err(self.error(format!("tensor {name} missing from the result"))),
            }
        }
        Ok(self.psgd.last_message_bytes())
    }
}

/// Steps per stage of the DGC methods' density warm-up (25 %, 6.25 %, then the 3 % target, or
/// 1.5625 % then the 1 % target).
pub const DGC_STAGE_STEPS: u64 = 10;

/// The global gradient-norm threshold of the DGC methods' local clipping: each rank clips its
/// own gradient at `DGC_CLIP_NORM / sqrt(W)`, as the paper does.
pub const DGC_CLIP_NORM: f32 = 5.0;

/// DGC's recipe through [`gradwire::dgc::Dgc`]: the velocity and residuals live in the codec,
/// the bundles are all-gathered and averaged as every other frame method's, with the manifest
/// of the step's density. The training loop applies the mean without momentum.
#[derive(Debug)]
pub struct DgcCodec {
    method: Method,
    rank: usize,
    dgc: Dgc,
    tensors: Vec<TensorSpec>,
    /// The manifest of the current stage, and its method.
    manifest: Manifest,
    manifest_method: CompressionMethod,
    largest: usize,
    aggregator: Aggregator,
    names: Vec<String>,
    grads: HashMap<String, Tensor>,
    mean: Vec<f32>,
}

impl DgcCodec {
    /// The codec of `method` (one of [`Method::dgc`]'s) for rank `ctx.rank`.
    ///
    /// # Errors
    /// [`DemoError::Codec`] when gradwire refuses the configuration or the model;
    /// [`DemoError::Config`] for a method without DGC's recipe.
    pub fn new(method: Method, ctx: &CodecContext<'_>) -> Result<Self, DemoError> {
        let err = |e: gradwire::Error| DemoError::Codec {
            method,
            message: e.to_string(),
        };
        let Some((selection, values, density)) = method.dgc() else {
            return Err(DemoError::Config(format!("`{method}` is not a DGC method")));
        };
        #[allow(clippy::cast_precision_loss)]
        let clip = DGC_CLIP_NORM / (ctx.world_size.max(1) as f32).sqrt();
        let config = DgcConfig {
            values,
            momentum: ctx.momentum,
            clip_norm: Some(clip),
            ..DgcConfig::new(
                selection,
                DensitySchedule::warm_up(density, DGC_STAGE_STEPS),
            )
        };
        let dgc = Dgc::new(config, ctx.seed)
            .map_err(err)?
            .with_parallelism(Parallelism::Serial);
        let tensors: Vec<TensorSpec> = ctx
            .specs
            .iter()
            .map(|p| TensorSpec::new(p.name.clone(), p.shape.clone()))
            .collect();
        // The first stage sends the most.
        let manifest = dgc.manifest_at(tensors.clone(), 0).map_err(err)?;
        Ok(DgcCodec {
            method,
            rank: ctx.rank,
            largest: manifest.max_bundle_len(),
            manifest,
            manifest_method: dgc.method_at(0),
            dgc,
            tensors,
            aggregator: Aggregator::new().with_parallelism(Parallelism::Serial),
            names: ctx.specs.iter().map(|p| p.name.clone()).collect(),
            grads: zero_tensors(ctx.specs).map_err(err)?,
            mean: Vec::new(),
        })
    }

    fn error(&self, e: impl fmt::Display) -> DemoError {
        DemoError::Codec {
            method: self.method,
            message: e.to_string(),
        }
    }

    /// Makes the manifest the one of `step`'s density (a new one only when the stage changes).
    fn manifest_for(&mut self, step: u64) -> Result<(), DemoError> {
        let want = self.dgc.method_at(step);
        if want != self.manifest_method {
            self.manifest = self
                .dgc
                .manifest_at(self.tensors.clone(), step)
                .map_err(|e| self.error(e))?;
            self.manifest_method = want;
        }
        Ok(())
    }
}

impl GradientCodec for DgcCodec {
    fn method(&self) -> Method {
        self.method
    }

    fn max_message_len(&self) -> usize {
        self.largest
    }

    fn owns_momentum(&self) -> bool {
        true
    }

    fn encode(&mut self, step: u64, grads: &[&[f32]], out: &mut Vec<u8>) -> Result<(), DemoError> {
        fill_named(&self.names, &mut self.grads, grads).map_err(|m| self.error(m))?;
        if step != self.dgc.step() {
            return Err(self.error(format!(
                "DGC is at step {}, the loop at {step}",
                self.dgc.step()
            )));
        }
        self.manifest_for(step)?;
        self.dgc
            .compress_bundle(&self.manifest, &self.grads, self.rank, out)
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    fn decode_mean(
        &mut self,
        step: u64,
        messages: &[Vec<u8>],
        out: &mut [Vec<f32>],
    ) -> Result<(), DemoError> {
        if out.len() != self.names.len() {
            return Err(self.error("output does not match the model"));
        }
        self.manifest_for(step)?;
        let (manifest, names) = (&self.manifest, &self.names);
        mean_of_bundles(
            &mut self.aggregator,
            manifest,
            messages,
            step,
            &mut self.mean,
        )
        .and_then(|()| copy_out(manifest, &self.mean, names, out))
        .map_err(|m| self.error(m))
    }
}

/// A demo method through gradwire: its all-reduce ([`CompressedAllReduce`] on the loop's
/// communicator, in place on the loop's mean buffers, which [`GradientCodec::stage`] fills with
/// the rank's gradients), on the all-gather, the two-phase collective or `auto` as the demo's
/// `--collective` says.
#[derive(Debug)]
pub struct GradwireCodec {
    method: Method,
    /// The model's bundle layout (its largest bundle bounds a message).
    manifest: Manifest,
    specs: Vec<ParamSpec>,
    all_reduce: CompressedAllReduce,
    /// Whether the loop's buffers hold this step's gradients ([`GradientCodec::stage`]).
    staged: bool,
}

impl GradwireCodec {
    /// The codec of `method` for rank `ctx.rank`.
    ///
    /// # Errors
    /// [`DemoError::Codec`] when gradwire refuses the method or the model.
    pub fn new(method: Method, ctx: &CodecContext<'_>) -> Result<GradwireCodec, DemoError> {
        let err = |e: gradwire::Error| DemoError::Codec {
            method,
            message: e.to_string(),
        };
        let Some(cm) = gradwire_method(method) else {
            return Err(DemoError::Config(format!(
                "`{method}` runs through PowerSgdCodec, not a bundle"
            )));
        };
        let specs: Vec<TensorSpec> = ctx
            .specs
            .iter()
            .map(|p| TensorSpec::new(p.name.clone(), p.shape.clone()))
            .collect();
        let manifest = Manifest::new(specs, &cm, ctx.seed, BucketConfig::none()).map_err(err)?;
        let collective = match (method, ctx.collective) {
            // Uncompressed f32 gradients go through gradwire's f32 all-reduce (a ring
            // all-reduce's bytes) whatever the collective; random-k is all-gather only.
            (Method::DenseF32, _)
            | (_, Collective::AllGather)
            | (Method::RandK1Ef, Collective::TwoPhase) => gradwire::Collective::AllGather,
            (_, Collective::TwoPhase) => gradwire::Collective::TwoPhase,
            (_, Collective::Auto) => gradwire::Collective::Auto,
        };
        // The ranks already occupy every core: keep gradwire's own work on the rank's thread.
        let all_reduce = CompressedAllReduce::new(cm, ctx.world_size)
            .with_seed(ctx.seed)
            .with_collective(collective)
            .with_parallelism(Parallelism::Serial);
        Ok(GradwireCodec {
            method,
            manifest,
            specs: ctx.specs.to_vec(),
            all_reduce,
            staged: false,
        })
    }

    fn error(&self, e: impl fmt::Display) -> DemoError {
        DemoError::Codec {
            method: self.method,
            message: e.to_string(),
        }
    }

    /// Copies `grads` into `out` (name order, the model's lengths).
    fn copy_in(&self, grads: &[&[f32]], out: &mut [Vec<f32>]) -> Result<(), DemoError> {
        let fits = |lens: &mut dyn ExactSizeIterator<Item = usize>| {
            lens.len() == self.specs.len() && lens.zip(&self.specs).all(|(n, p)| n == p.len())
        };
        if !fits(&mut grads.iter().map(|g| g.len())) || !fits(&mut out.iter().map(Vec::len)) {
            return Err(self.error("gradients or output do not match the model"));
        }
        for (o, g) in out.iter_mut().zip(grads) {
            o.copy_from_slice(g);
        }
        Ok(())
    }
}

impl GradientCodec for GradwireCodec {
    fn method(&self) -> Method {
        self.method
    }

    fn max_message_len(&self) -> usize {
        self.manifest.max_bundle_len()
    }

    fn encode(&mut self, _: u64, _: &[&[f32]], _: &mut Vec<u8>) -> Result<(), DemoError> {
        Err(self.error("gradwire runs its own collective, not the loop's all-gather"))
    }

    fn decode_mean(&mut self, _: u64, _: &[Vec<u8>], _: &mut [Vec<f32>]) -> Result<(), DemoError> {
        Err(self.error("gradwire runs its own collective, not the loop's all-gather"))
    }

    fn runs_own_collective(&self) -> bool {
        true
    }

    fn stage(&mut self, grads: &[&[f32]], out: &mut [Vec<f32>]) -> Result<(), DemoError> {
        self.copy_in(grads, out)?;
        self.staged = true;
        Ok(())
    }

    fn all_reduce(
        &mut self,
        comm: &mut dyn Communicator,
        step: u64,
        grads: &[&[f32]],
        out: &mut [Vec<f32>],
    ) -> Result<usize, DemoError> {
        // The loop stages the gradients first; a caller that did not, gets them copied here.
        if !std::mem::take(&mut self.staged) {
            self.copy_in(grads, out)?;
        }
        let method = self.method;
        let err = |e: gradwire::Error| DemoError::Codec {
            method,
            message: e.to_string(),
        };
        let ar = &mut self.all_reduce;
        ar.compressor_mut().set_step(step);
        // In place on the loop's buffers, which hold this rank's gradients.
        let mut tensors: Vec<TensorMut<'_>> = self
            .specs
            .iter()
            .zip(out.iter_mut())
            .map(|(p, o)| TensorMut {
                name: &p.name,
                shape: &p.shape,
                data: o,
            })
            .collect();
        ar.all_reduce_in_place_on(comm, &mut tensors).map_err(err)?;
        Ok(ar.last_message_bytes())
    }
}

/// Dense f32 without gradwire: plain little-endian f32 bytes, no header; the denominator of the
/// table's ratio and a cross-check of gradwire's dense path.
#[derive(Debug, Clone)]
pub struct DenseF32 {
    lens: Vec<usize>,
}

impl DenseF32 {
    /// A codec for tensors of `specs` (name order).
    #[must_use]
    pub fn new(specs: &[ParamSpec]) -> DenseF32 {
        DenseF32 {
            lens: specs.iter().map(ParamSpec::len).collect(),
        }
    }

    fn codec_error(message: String) -> DemoError {
        DemoError::Codec {
            method: Method::DenseF32,
            message,
        }
    }
}

impl GradientCodec for DenseF32 {
    fn method(&self) -> Method {
        Method::DenseF32
    }

    fn max_message_len(&self) -> usize {
        self.lens.iter().sum::<usize>() * 4
    }

    fn encode(&mut self, _step: u64, grads: &[&[f32]], out: &mut Vec<u8>) -> Result<(), DemoError> {
        if grads.len() != self.lens.len() {
            return Err(Self::codec_error(format!(
                "expected {} tensors, got {}",
                self.lens.len(),
                grads.len()
            )));
        }
        out.clear();
        out.reserve(self.max_message_len());
        for (i, (g, &len)) in grads.iter().zip(&self.lens).enumerate() {
            if g.len() != len {
                return Err(Self::codec_error(format!(
                    "tensor {i} has {} elements, expected {len}",
                    g.len()
                )));
            }
            for v in *g {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(())
    }

    fn decode_mean(
        &mut self,
        _step: u64,
        messages: &[Vec<u8>],
        out: &mut [Vec<f32>],
    ) -> Result<(), DemoError> {
        if messages.is_empty() {
            return Err(Self::codec_error("no messages".into()));
        }
        if out.len() != self.lens.len() || out.iter().zip(&self.lens).any(|(o, &n)| o.len() != n) {
            return Err(Self::codec_error("output does not match the model".into()));
        }
        let expected = self.max_message_len();
        for (rank, m) in messages.iter().enumerate() {
            if m.len() != expected {
                return Err(Self::codec_error(format!(
                    "rank {rank} sent {} bytes, expected {expected}",
                    m.len()
                )));
            }
        }
        #[allow(clippy::cast_precision_loss)]
        let w = messages.len() as f32;
        let mut offset = 0;
        for o in out.iter_mut() {
            let bytes = o.len() * 4;
            o.fill(0.0);
            for m in messages {
                let chunk = &m[offset..offset + bytes];
                for (acc, b) in o.iter_mut().zip(chunk.chunks_exact(4)) {
                    *acc += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            for acc in o.iter_mut() {
                *acc /= w;
            }
            offset += bytes;
        }
        Ok(())
    }
}

/// The bytes one dense f32 message takes for `specs`: the denominator of the table's ratio.
#[must_use]
pub fn dense_f32_bytes(specs: &[ParamSpec]) -> usize {
    DenseF32::new(specs).max_message_len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::param_specs;

    #[test]
    fn dense_f32_mean_is_exact() {
        let specs = vec![
            ParamSpec {
                name: "a".into(),
                shape: vec![2],
            },
            ParamSpec {
                name: "b".into(),
                shape: vec![1],
            },
        ];
        let mut codec = DenseF32::new(&specs);
        let mut msgs = vec![Vec::new(); 3];
        for m in &mut msgs {
            codec
                .encode(0, &[&[3.0, -1.5], &[0.25]], m)
                .expect("encode");
        }
        assert_eq!(msgs[0].len(), 12);
        let mut out = vec![vec![0.0; 2], vec![0.0; 1]];
        codec.decode_mean(0, &msgs, &mut out).expect("decode");
        assert_eq!(out, vec![vec![3.0, -1.5], vec![0.25]]);
        msgs[1].pop();
        assert!(codec.decode_mean(0, &msgs, &mut out).is_err());
    }

    #[test]
    fn every_method_builds() {
        let specs = param_specs();
        let ctx = CodecContext {
            specs: &specs,
            rank: 0,
            world_size: 2,
            seed: 1,
            collective: Collective::AllGather,
            momentum: 0.9,
        };
        for m in Method::ALL {
            assert!(new_codec(m, &ctx).is_ok(), "{m}");
        }
        assert!(matches!(
            new_codec(Method::DenseF32Allreduce, &ctx),
            Err(DemoError::Config(_))
        ));
        assert!(!Method::ALL.contains(&Method::DenseF32Allreduce));
        assert_eq!(dense_f32_bytes(&specs), 85_002 * 4);
    }
}

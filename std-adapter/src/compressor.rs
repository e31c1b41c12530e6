//! The API of the original `compression` module: [`CompressionMethod`], [`GradientCompressor`]
//! and [`CompressedGradient`], now backed by real wire frames of `gradwire-core`. (The original
//! module is the Rust `compression` module gradwire grew from; code written against it keeps
//! compiling. New code can name any method of the core directly:
//! `CompressionMethod::Core(gradwire::core::Method::...)`, the same type the frames, manifests
//! and checkpoints use.)
//!
//! What changed for users of the original module:
//! - a [`CompressedGradient`] holds the frame bytes that go on the wire (and the shape), so
//!   [`CompressedGradient::payload_bytes`] is the real frame length, headers and checksum
//!   included, and [`CompressedGradient::compression_ratio`] (the fraction of the dense bytes
//!   that goes on the wire) is computed from real bytes;
//! - tensors are processed in sorted name order, so every run is deterministic;
//! - [`CompressionMethod::SignSGD`] sends one bit per element plus one f32 scale (mean |g|) per
//!   1024 elements (EF-signSGD); [`CompressionMethod::SignSGDMajority`] is the unscaled ±1
//!   variant for majority vote;
//! - [`CompressionMethod::Core`] reaches every method and option of `gradwire-core` (ratio-based
//!   top-k, value codecs f32/f16/bf16/int8, 2..=8 bits, block sizes, stochastic rounding);
//! - [`GradientCompressor::compress_into`] reuses the caller's buffers: a second call with the
//!   same model allocates nothing;
//! - errors are [`crate::error::Error`], naming the tensor.
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::compressor::{CompressionMethod, GradientCompressor};
//! use gradwire::tensor::Tensor;
//!
//! let mut compressor = GradientCompressor::new(CompressionMethod::TopK { k: 2 });
//! let mut grads = HashMap::new();
//! grads.insert("w".to_string(), Tensor::from_vec(vec![0.1, 0.8, 0.2, -0.9], &[2, 2])?);
//! let compressed = compressor.compress(&grads)?;
//! let restored = compressor.decompress(&compressed)?;
//! assert_eq!(restored["w"].data(), &[0.0, 0.8, 0.0, -0.9]);
//! assert_eq!(restored["w"].shape(), &[2, 2]);
//! # Ok::<(), gradwire::error::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use gradwire_core::{K, Method, Params, Rounding, SignScale, Values, max_frame_len, tensor_id};

use crate::bucket::{BucketConfig, Engine};
use crate::bundle::{Manifest, begin_bundle, finish_bundle, push_entry};
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::parallel::Parallelism;
use crate::tensor::Tensor;

/// Elements per f32 scale of [`CompressionMethod::SignSGD`] (DESIGN: sign <= 1.05 bits per
/// element: 1 + 32 / 1024 = 1.031).
pub const DEFAULT_SIGN_BLOCK: u32 = 1024;
/// Elements per f32 scale of [`CompressionMethod::Quantization`] (DESIGN: 4-bit <= 4.1 bits per
/// element: 4 + 32 / 512 = 4.0625).
pub const DEFAULT_QUANT_BLOCK: u32 = 512;
/// Kept values per f32 scale of int8 values of sparse methods (DESIGN: top-k 1% int8 <= 2.3
/// bytes per kept element; a scale costs 4 / 256 = 0.016 bytes per kept element).
pub const DEFAULT_INT8_BLOCK: u32 = 256;

/// Gradient compression methods, with the names of the original module plus variants that
/// reach every method of `gradwire-core`.
///
/// Defaults: sparse methods of the original module send f32 values; `Quantization` uses one
/// scale per [`DEFAULT_QUANT_BLOCK`] elements and rounds to nearest even; `SignSGD` one scale
/// per [`DEFAULT_SIGN_BLOCK`] elements.
#[derive(Clone, Debug, PartialEq)]
pub enum CompressionMethod {
    /// Top-k sparsification: the `k` entries of largest magnitude (ties to the lower index),
    /// f32 values.
    TopK {
        /// Entries kept per tensor (all of them when `k >= n`).
        k: usize,
    },
    /// Top-k with `k = floor(n * ratio)` clamped to `[1, n]` per tensor (as the reference
    /// Python layout computes it) and a value codec (f32, f16, bf16 or int8).
    TopKRatio {
        /// Fraction of the entries kept, in `[0, 1]` (>= 1 keeps everything; 0 still keeps
        /// one entry per tensor, by the clamp: for none, use `TopK { k: 0 }`).
        ratio: f64,
        /// Value codec of the kept entries.
        values: Values,
    },
    /// Random-k sparsification: `k` entries at indices drawn from (seed, step, tensor id); the
    /// indices do not travel, the receiver regenerates them. f32 values, no n/k scaling. `k` is
    /// the same count for every tensor (all of a tensor of at most `k` elements is sent); for a
    /// fraction of each tensor use [`CompressionMethod::RandomKRatio`].
    RandomK {
        /// Entries kept per tensor.
        k: usize,
    },
    /// Random-k with `k = floor(n * ratio)` clamped to `[1, n]` per tensor (as for
    /// [`CompressionMethod::TopKRatio`]) and a value codec; no n/k scaling (for the unbiased
    /// estimate use [`CompressionMethod::Core`] with `unbiased: true`, without error feedback).
    RandomKRatio {
        /// Fraction of the entries kept, in `[0, 1]` (>= 1 keeps everything; 0 still keeps
        /// one entry per tensor, by the clamp: a count of 0 (`K::Count(0)`) keeps none).
        ratio: f64,
        /// Value codec of the kept entries.
        values: Values,
    },
    /// Threshold sparsification: the entries with `|g| > threshold`, f32 values.
    Threshold {
        /// Threshold (finite, `>= 0`).
        threshold: f32,
    },
    /// `bits`-bit symmetric quantization (2..=8) with one f32 absmax scale per
    /// [`DEFAULT_QUANT_BLOCK`] elements, rounding to nearest even.
    Quantization {
        /// Bits per element, 2..=8.
        bits: u8,
    },
    /// EF-signSGD: one sign bit per element and one f32 scale (the block's mean |g|) per
    /// [`DEFAULT_SIGN_BLOCK`] elements; decodes to ±scale.
    SignSGD,
    /// signSGD for majority vote: one sign bit per element, no scale; decodes to ±1 (0 counts
    /// as +). Cannot be combined with error feedback (the residual would grow without bound).
    SignSGDMajority,
    /// Every element as IEEE binary16 (an element beyond f16's range is an error).
    Float16,
    /// Every element as bfloat16.
    BFloat16,
    /// Error feedback around `base_method`: what a step does not send (dropped entries,
    /// rounding and quantization error) is kept per parameter name and added to the next step.
    ErrorFeedback {
        /// The method that compresses `gradient + residual`.
        base_method: Box<CompressionMethod>,
    },
    /// Any method of `gradwire-core`, with all its parameters.
    Core(Method),
}

impl CompressionMethod {
    /// Top-k by ratio with int8 values in blocks of [`DEFAULT_INT8_BLOCK`]: `k = floor(n *
    /// ratio)` clamped to `[1, n]` per tensor, as for [`CompressionMethod::TopKRatio`].
    pub fn top_k_int8(ratio: f64) -> Self {
        CompressionMethod::TopKRatio {
            ratio,
            values: Values::Int8 {
                block: DEFAULT_INT8_BLOCK,
            },
        }
    }

    /// `self` wrapped in error feedback (unchanged when it already is).
    pub fn with_error_feedback(self) -> Self {
        match self {
            CompressionMethod::ErrorFeedback { .. } => self,
            other => CompressionMethod::ErrorFeedback {
                base_method: Box::new(other),
            },
        }
    }

    /// Whether this method keeps residuals (error feedback).
    pub fn uses_error_feedback(&self) -> bool {
        matches!(self, CompressionMethod::ErrorFeedback { .. })
    }

    /// The method of `gradwire-core` that makes the frames (error feedback does not change
    /// what goes on the wire).
    ///
    /// # Errors
    /// [`Error::Config`] naming the invalid parameter (bits outside 2..=8, a block of 0, a
    /// negative or NaN threshold or ratio, ...), for error feedback around error feedback, and
    /// for error feedback around a method whose residual would grow without bound (unscaled
    /// sign, unbiased random-k).
    pub fn core_method(&self) -> Result<Method> {
        let method = match self {
            CompressionMethod::ErrorFeedback { base_method } => {
                if base_method.uses_error_feedback() {
                    return Err(Error::config(
                        "error feedback around error feedback: wrap the base method once",
                    ));
                }
                let m = base_method.core_method()?;
                match m {
                    Method::Sign {
                        scale: SignScale::None,
                    } => {
                        return Err(Error::config(
                            "error feedback needs a scaled sign (SignSGD), not unscaled sign \
                             (SignSGDMajority): the residual would grow without bound",
                        ));
                    }
                    Method::RandomK { unbiased: true, .. } => {
                        return Err(Error::config(
                            "error feedback with unbiased (n/k-scaled) random-k: the residual \
                             would grow without bound",
                        ));
                    }
                    _ => {}
                }
                return Ok(m);
            }
            CompressionMethod::TopK { k } => Method::TopK {
                k: K::Count(u64::try_from(*k).unwrap_or(u64::MAX)),
                values: Values::F32,
            },
            CompressionMethod::TopKRatio { ratio, values } => Method::TopK {
                k: K::Ratio(*ratio),
                values: *values,
            },
            CompressionMethod::RandomK { k } => Method::RandomK {
                k: K::Count(u64::try_from(*k).unwrap_or(u64::MAX)),
                values: Values::F32,
                unbiased: false,
            },
            CompressionMethod::RandomKRatio { ratio, values } => Method::RandomK {
                k: K::Ratio(*ratio),
                values: *values,
                unbiased: false,
            },
            CompressionMethod::Threshold { threshold } => Method::Threshold {
                threshold: *threshold,
                values: Values::F32,
            },
            CompressionMethod::Quantization { bits } => Method::Quant {
                bits: *bits,
                block: DEFAULT_QUANT_BLOCK,
                rounding: Rounding::NearestEven,
            },
            CompressionMethod::SignSGD => Method::Sign {
                scale: SignScale::MeanAbs {
                    block: DEFAULT_SIGN_BLOCK,
                },
            },
            CompressionMethod::SignSGDMajority => Method::Sign {
                scale: SignScale::None,
            },
            CompressionMethod::Float16 => Method::Dense {
                values: Values::F16,
            },
            CompressionMethod::BFloat16 => Method::Dense {
                values: Values::Bf16,
            },
            CompressionMethod::Core(m) => *m,
        };
        method
            .validate()
            .map_err(|e| Error::config(format!("{} ({e})", format_method(&method))))?;
        Ok(method)
    }
}

/// The canonical text of a core method, as stored in checkpoints: the method name followed by
/// `key=value` parameters, separated by spaces, for example `topk k=ratio:0.01 values=int8:256`,
/// `quant bits=4 block=512 rounding=nearest-even` or `sign scale=mean-abs:1024`. Floats are
/// written in their shortest exact form, so [`parse_method`] gives back the same method.
pub fn format_method(method: &Method) -> String {
    fn k(k: &K) -> String {
        match k {
            K::Count(c) => format!("count:{c}"),
            K::Ratio(r) => format!("ratio:{r}"),
        }
    }
    fn v(v: &Values) -> String {
        match v {
            Values::F32 => "f32".to_owned(),
            Values::F16 => "f16".to_owned(),
            Values::Bf16 => "bf16".to_owned(),
            Values::Int8 { block } => format!("int8:{block}"),
        }
    }
    let mut s = String::new();
    // Writing into a String cannot fail.
    let _ = match method {
        Method::Dense { values } => write!(s, "dense values={}", v(values)),
        Method::TopK { k: kk, values } => write!(s, "topk k={} values={}", k(kk), v(values)),
        Method::Threshold { threshold, values } => {
            write!(s, "threshold t={threshold} values={}", v(values))
        }
        Method::RandomK {
            k: kk,
            values,
            unbiased,
        } => write!(
            s,
            "randomk k={} values={} unbiased={unbiased}",
            k(kk),
            v(values)
        ),
        Method::Quant {
            bits,
            block,
            rounding,
        } => write!(
            s,
            "quant bits={bits} block={block} rounding={}",
            match rounding {
                Rounding::NearestEven => "nearest-even",
                Rounding::Stochastic => "stochastic",
            }
        ),
        Method::Sign { scale } => match scale {
            SignScale::MeanAbs { block } => write!(s, "sign scale=mean-abs:{block}"),
            SignScale::None => write!(s, "sign scale=none"),
        },
    };
    s
}

/// Parses the text [`format_method`] writes.
///
/// # Errors
/// [`Error::Config`] naming the part that is not understood, or the invalid parameter.
pub fn parse_method(text: &str) -> Result<Method> {
    let bad = |what: &str| Error::config(format!("method `{text}`: {what}"));
    let mut words = text.split_whitespace();
    let kind = words.next().ok_or_else(|| bad("empty"))?;
    let mut params: Vec<(&str, &str)> = Vec::new();
    for w in words {
        let (key, value) = w
            .split_once('=')
            .ok_or_else(|| bad(&format!("`{w}` is not key=value")))?;
        if params.iter().any(|(k, _)| *k == key) {
            return Err(bad(&format!("`{key}` given twice")));
        }
        params.push((key, value));
    }
    let mut used = 0usize;
    let mut get = |key: &str| -> Result<&str> {
        used += 1;
        params
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .ok_or_else(|| bad(&format!("missing `{key}`")))
    };
    let num = |s: &str, what: &str| -> Result<u64> {
        s.parse::<u64>()
            .map_err(|_| bad(&format!("`{s}` is not a valid {what}")))
    };
    let u32_of = |s: &str, what: &str| -> Result<u32> {
        u32::try_from(num(s, what)?).map_err(|_| bad(&format!("{what} `{s}` is too large")))
    };
    let k_of = |s: &str| -> Result<K> {
        match s.split_once(':') {
            Some(("count", c)) => Ok(K::Count(num(c, "count")?)),
            Some(("ratio", r)) => r
                .parse::<f64>()
                .map(K::Ratio)
                .map_err(|_| bad(&format!("`{r}` is not a valid ratio"))),
            _ => Err(bad(&format!("`{s}` is not count:N or ratio:R"))),
        }
    };
    let values_of = |s: &str| -> Result<Values> {
        match s {
            "f32" => Ok(Values::F32),
            "f16" => Ok(Values::F16),
            "bf16" => Ok(Values::Bf16),
            _ => match s.split_once(':') {
                Some(("int8", b)) => Ok(Values::Int8 {
                    block: u32_of(b, "block")?,
                }),
                _ => Err(bad(&format!("`{s}` is not f32, f16, bf16 or int8:BLOCK"))),
            },
        }
    };
    let method = match kind {
        "dense" => Method::Dense {
            values: values_of(get("values")?)?,
        },
        "topk" => Method::TopK {
            k: k_of(get("k")?)?,
            values: values_of(get("values")?)?,
        },
        "threshold" => {
            let t = get("t")?;
            Method::Threshold {
                threshold: t
                    .parse::<f32>()
                    .map_err(|_| bad(&format!("`{t}` is not a valid threshold")))?,
                values: values_of(get("values")?)?,
            }
        }
        "randomk" => Method::RandomK {
            k: k_of(get("k")?)?,
            values: values_of(get("values")?)?,
            unbiased: match get("unbiased")? {
                "true" => true,
                "false" => false,
                other => return Err(bad(&format!("`{other}` is not true or false"))),
            },
        },
        "quant" => {
            let bits = get("bits")?;
            Method::Quant {
                bits: bits
                    .parse::<u8>()
                    .map_err(|_| bad(&format!("`{bits}` is not a valid bit width")))?,
                block: u32_of(get("block")?, "block")?,
                rounding: match get("rounding")? {
                    "nearest-even" => Rounding::NearestEven,
                    "stochastic" => Rounding::Stochastic,
                    other => return Err(bad(&format!("unknown rounding `{other}`"))),
                },
            }
        }
        "sign" => Method::Sign {
            scale: match get("scale")? {
                "none" => SignScale::None,
                s => match s.split_once(':') {
                    Some(("mean-abs", b)) => SignScale::MeanAbs {
                        block: u32_of(b, "block")?,
                    },
                    _ => return Err(bad(&format!("unknown sign scale `{s}`"))),
                },
            },
        },
        other => return Err(bad(&format!("unknown method `{other}`"))),
    };
    if used != params.len() {
        return Err(bad("unknown parameter"));
    }
    method
        .validate()
        .map_err(|e| bad(&format!("invalid parameter ({e})")))?;
    Ok(method)
}

/// One gradient after compression: the frame bytes that go on the wire, and the shape and
/// step the receiver needs to decode them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompressedGradient {
    frame: Vec<u8>,
    shape: Vec<usize>,
    step: u64,
}

impl CompressedGradient {
    /// A compressed gradient from received frame bytes, for a tensor of `shape` made at `step`.
    /// The frame's header and checksum are checked here; its parameters are checked against the
    /// receiver's method when it is decoded.
    ///
    /// # Errors
    /// [`Error::Core`] for a frame that fails [`gradwire_core::peek`] or whose element count
    /// differs from the shape's; [`Error::ShapeOverflow`].
    pub fn from_frame(frame: Vec<u8>, shape: Vec<usize>, step: u64) -> Result<Self> {
        let n = crate::tensor::checked_numel("", &shape)?;
        let h = gradwire_core::peek(&frame).map_err(|e| Error::core("", None, e))?;
        if h.n != n as u64 {
            return Err(Error::core(
                "",
                None,
                gradwire_core::Error::ElementCount {
                    expected: n as u64,
                    got: h.n,
                },
            ));
        }
        Ok(CompressedGradient { frame, shape, step })
    }

    /// The frame bytes, as they go on the wire.
    pub fn frame(&self) -> &[u8] {
        &self.frame
    }

    /// Takes the frame bytes.
    pub fn into_frame(self) -> Vec<u8> {
        self.frame
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The step the frame was made at.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Number of elements in the uncompressed gradient.
    pub fn original_size(&self) -> usize {
        crate::tensor::numel(&self.shape).unwrap_or(0)
    }

    /// What the frame declares (method, element count, entries kept).
    ///
    /// # Errors
    /// [`Error::Core`] when the frame is invalid.
    pub fn header(&self) -> Result<gradwire_core::Header> {
        gradwire_core::peek(&self.frame).map_err(|e| Error::core("", None, e))
    }

    /// Bytes this gradient puts on the wire: the whole frame, header and checksum included.
    pub fn payload_bytes(&self) -> usize {
        self.frame.len()
    }

    /// Bytes of the uncompressed f32 gradient.
    pub fn dense_bytes(&self) -> usize {
        self.original_size().saturating_mul(4)
    }

    /// Fraction of the dense bytes that goes on the wire: `payload_bytes / dense_bytes`
    /// (1.0 for an empty tensor), as the original module defines it. This is the inverse of
    /// the "Nx" ratio that the README, the `gradwire` tool and the demo print (dense /
    /// compressed): 0.0066 here is 150x there.
    pub fn compression_ratio(&self) -> f32 {
        let dense = self.dense_bytes();
        if dense == 0 {
            1.0
        } else {
            (self.payload_bytes() as f64 / dense as f64) as f32
        }
    }
}

/// Compresses named gradients with one [`CompressionMethod`], keeping the residuals of error
/// feedback, the seed and the step counter.
///
/// Frames of step `s` for tensor `name` are made with
/// `Params { method, seed, step: s, tensor_id: tensor_id(name) }`; the step advances after each
/// successful [`GradientCompressor::compress`], [`GradientCompressor::compress_into`] or
/// [`GradientCompressor::compress_bundle`].
#[derive(Debug)]
pub struct GradientCompressor {
    method: CompressionMethod,
    seed: u64,
    step: u64,
    feedback: Option<ErrorFeedback>,
    layout: Option<Manifest>,
    engine: Engine,
    parallelism: Parallelism,
    compression_ratio: f32,
}

impl GradientCompressor {
    /// A compressor for `method` with seed 0 at step 0. An invalid method is reported by the
    /// first call that compresses.
    pub fn new(method: CompressionMethod) -> Self {
        GradientCompressor {
            method,
            seed: 0,
            step: 0,
            feedback: None,
            layout: None,
            engine: Engine::default(),
            parallelism: Parallelism::Auto,
            compression_ratio: 0.0,
        }
    }

    /// The same compressor with another seed (random-k and stochastic rounding draw from
    /// (seed, step, tensor id)); set it before the first step.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.feedback = None;
        self
    }

    /// The same compressor starting at `step` (see [`GradientCompressor::set_step`]).
    pub fn with_step(mut self, step: u64) -> Self {
        self.set_step(step);
        self
    }

    /// Sets the next step to run, for example to resume a run without error feedback whose
    /// random draws (random-k, stochastic rounding) depend on the step. With error feedback,
    /// restore a checkpoint instead ([`GradientCompressor::load_feedback`]): it holds the step
    /// with the residuals. The error-feedback state, if any, moves to `step` too.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
        if let Some(fb) = &mut self.feedback {
            fb.set_step(step);
        }
    }

    /// The same compressor using `parallelism` (default [`Parallelism::Auto`]: every core of
    /// rayon's pool when it has more than one thread). Every setting writes the same bytes and
    /// leaves the same residuals.
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Sets how many cores the next calls use (see [`GradientCompressor::with_parallelism`]).
    pub fn set_parallelism(&mut self, parallelism: Parallelism) {
        self.parallelism = parallelism;
    }

    /// How many cores compression uses.
    pub fn parallelism(&self) -> Parallelism {
        self.parallelism
    }

    /// The method.
    pub fn method(&self) -> &CompressionMethod {
        &self.method
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next step to run.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The error-feedback state (residuals, seed, step), once a step with error feedback ran
    /// or a checkpoint was loaded.
    pub fn feedback(&self) -> Option<&ErrorFeedback> {
        self.feedback.as_ref()
    }

    /// Takes the error-feedback state out (for example to keep it elsewhere between steps);
    /// the next step with error feedback starts from empty residuals at the current step.
    pub fn take_feedback(&mut self) -> Option<ErrorFeedback> {
        self.feedback.take()
    }

    /// Fraction of the dense bytes the last compression put on the wire, over all tensors
    /// (0 before the first), as the original module defines it: the inverse of the "Nx" ratio
    /// (dense / compressed) that the README, the `gradwire` tool and the demo print.
    pub fn get_compression_ratio(&self) -> f32 {
        self.compression_ratio
    }

    /// Drops every residual of error feedback (the step counter stays).
    pub fn reset_error_buffer(&mut self) {
        if let Some(fb) = &mut self.feedback {
            fb.clear();
        }
    }

    /// The core method, and the error-feedback state when the method uses it.
    fn prepare(&mut self) -> Result<(Method, Option<&mut ErrorFeedback>)> {
        let method = self.method.core_method()?;
        if !self.method.uses_error_feedback() {
            return Ok((method, None));
        }
        if self.feedback.as_ref().map(|f| *f.method()) != Some(method) {
            let mut fb = ErrorFeedback::new(method, self.seed)?;
            fb.set_step(self.step);
            self.feedback = Some(fb);
        }
        Ok((method, self.feedback.as_mut()))
    }

    /// Compresses every tensor of `gradients` (sorted name order) into its own frame.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method; [`Error::Core`] naming the tensor for NaN/Inf
    /// (with the first bad index) or a value beyond the range of f16/bf16;
    /// [`Error::LengthChanged`] when a tensor with a residual changed its element count,
    /// [`Error::ShapeChanged`] when it kept the count in another shape (a transposed weight:
    /// each residual remembers its tensor's shape, see [`crate::feedback`]). On error nothing
    /// changes (residuals, step).
    pub fn compress(
        &mut self,
        gradients: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, CompressedGradient>> {
        let mut out = HashMap::with_capacity(gradients.len());
        self.compress_into(gradients, &mut out)?;
        Ok(out)
    }

    /// As [`GradientCompressor::compress`], writing into `out` and reusing its buffers: the
    /// entries of `out` are overwritten, entries for tensors not in `gradients` removed. A
    /// second call with the same model allocates nothing on the serial path
    /// ([`Parallelism::Serial`]); the parallel path keeps its own buffers too, and only rayon's
    /// job bookkeeping may allocate.
    ///
    /// # Errors
    /// As [`GradientCompressor::compress`]; on error `out` is unchanged.
    pub fn compress_into(
        &mut self,
        gradients: &HashMap<String, Tensor>,
        out: &mut HashMap<String, CompressedGradient>,
    ) -> Result<()> {
        let (method, _) = self.prepare()?;
        let fits = self.layout.as_ref().is_some_and(|m| {
            *m.method() == method && m.seed() == self.seed && m.check_gradients(gradients).is_ok()
        });
        if !fits {
            self.layout = Some(Manifest::for_gradients(
                gradients,
                &CompressionMethod::Core(method),
                self.seed,
                BucketConfig::none(),
            )?);
        }
        let Some(layout) = self.layout.take() else {
            return Err(Error::config("no layout"));
        };
        let step = self.step;
        let (mut payload, mut dense) = (0usize, 0usize);
        let feedback = if self.method.uses_error_feedback() {
            self.feedback.as_mut()
        } else {
            None
        };
        let result = self.engine.encode(
            &layout,
            gradients,
            step,
            feedback,
            self.parallelism,
            |e, frame| {
                let entry = &layout.entries()[e];
                let Some(info) = entry.members.first().and_then(|&t| layout.tensors().get(t))
                else {
                    return;
                };
                payload = payload.saturating_add(frame.len());
                dense = dense.saturating_add(info.numel.saturating_mul(4));
                match out.get_mut(&info.name) {
                    Some(cg) => {
                        cg.frame.clear();
                        cg.frame.extend_from_slice(frame);
                        cg.shape.clone_from(&info.shape);
                        cg.step = step;
                    }
                    None => {
                        let mut bytes =
                            Vec::with_capacity(max_frame_len(info.numel, &entry.method));
                        bytes.extend_from_slice(frame);
                        out.insert(
                            info.name.clone(),
                            CompressedGradient {
                                frame: bytes,
                                shape: info.shape.clone(),
                                step,
                            },
                        );
                    }
                }
            },
        );
        self.layout = Some(layout);
        result?;
        out.retain(|name, _| gradients.contains_key(name));
        self.step = self.step.wrapping_add(1);
        self.compression_ratio = if dense == 0 {
            1.0
        } else {
            (payload as f64 / dense as f64) as f32
        };
        Ok(())
    }

    /// Compresses `gradients` into one bundle for `manifest` (see [`crate::bundle`]), written
    /// into `out` (cleared; its capacity is reused). Returns the step the bundle was made at.
    ///
    /// Entries (and chunks of large dense, quantization and sign tensors) are compressed on
    /// every core unless [`GradientCompressor::with_parallelism`] says otherwise; the bundle and
    /// the residuals are the same bytes and bits either way (see [`crate::parallel`]).
    ///
    /// # Errors
    /// [`Error::Config`] when the manifest was made for another method or seed, or `rank` does
    /// not fit a u32; [`Error::MissingTensor`], [`Error::UnexpectedTensor`] or
    /// [`Error::ShapeMismatch`] when `gradients` does not match the manifest; otherwise as
    /// [`GradientCompressor::compress`]. On error nothing changes and `out` is cleared.
    pub fn compress_bundle(
        &mut self,
        manifest: &Manifest,
        gradients: &HashMap<String, Tensor>,
        rank: usize,
        out: &mut Vec<u8>,
    ) -> Result<u64> {
        out.clear();
        let seed = self.seed;
        let step = self.step;
        let method = self.prepare()?.0;
        if *manifest.method() != method {
            return Err(Error::config(format!(
                "the manifest is for method `{}`, the compressor uses `{}`",
                format_method(manifest.method()),
                format_method(&method)
            )));
        }
        if manifest.seed() != seed {
            return Err(Error::config(format!(
                "the manifest is for seed {}, the compressor uses seed {seed}",
                manifest.seed()
            )));
        }
        let rank32 = u32::try_from(rank)
            .map_err(|_| Error::config(format!("rank {rank} does not fit a u32")))?;
        let entries = u32::try_from(manifest.entries().len())
            .map_err(|_| Error::config("too many entries for one bundle"))?;
        if out.capacity() < manifest.max_bundle_len() {
            out.reserve(manifest.max_bundle_len());
        }
        begin_bundle(out, rank32, entries, step);
        let feedback = if self.method.uses_error_feedback() {
            self.feedback.as_mut()
        } else {
            None
        };
        let result = self.engine.encode(
            manifest,
            gradients,
            step,
            feedback,
            self.parallelism,
            |e, frame| {
                let id = manifest.entries().get(e).map_or(0, |entry| entry.id);
                push_entry(out, id, frame);
            },
        );
        if let Err(e) = result {
            out.clear();
            return Err(e);
        }
        finish_bundle(out);
        self.step = self.step.wrapping_add(1);
        Ok(step)
    }

    /// The parameters this compressor expects for `name`'s frame at `step`.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method.
    pub fn params(&self, name: &str, step: u64) -> Result<Params> {
        Ok(Params {
            method: self.method.core_method()?,
            seed: self.seed,
            step,
            tensor_id: tensor_id(name),
        })
    }

    /// Decodes one compressed gradient of tensor `name`, checking the frame against this
    /// compressor's method and seed and the gradient's step and shape.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method; [`Error::ParamsDiffer`] naming the tensor and
    /// both configurations when the frame was made with other parameters; [`Error::Core`]
    /// naming the tensor when the frame is invalid.
    pub fn decompress_one(&self, name: &str, compressed: &CompressedGradient) -> Result<Tensor> {
        let mut t = Tensor::zeros(&compressed.shape).map_err(|e| match e {
            Error::ShapeOverflow { shape, .. } => Error::ShapeOverflow {
                tensor: name.to_owned(),
                shape,
            },
            other => other,
        })?;
        let params = self.params(name, compressed.step)?;
        let n = t.data().len();
        gradwire_core::decode_into(&compressed.frame, &params, t.data_mut()).map_err(|e| {
            crate::bundle::frame_error(name, None, &compressed.frame, &params, n, e)
        })?;
        Ok(t)
    }

    /// Decodes compressed gradients (from this compressor or a peer with the same method and
    /// seed) into dense tensors with their shapes.
    ///
    /// # Errors
    /// As [`GradientCompressor::decompress_one`], for the first failing tensor in name order.
    pub fn decompress(
        &self,
        compressed: &HashMap<String, CompressedGradient>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut names: Vec<&String> = compressed.keys().collect();
        names.sort();
        let mut out = HashMap::with_capacity(names.len());
        for name in names {
            out.insert(name.clone(), self.decompress_one(name, &compressed[name])?);
        }
        Ok(out)
    }

    /// Puts what this compressor's own `bundle` of `step` (made by
    /// [`GradientCompressor::compress_bundle`] with `manifest`) sent back into the residuals,
    /// after a collective that failed once the residuals had given those values up: the step's
    /// gradient is then delayed, not lost (`residual + sent` is `gradient + old residual`, up
    /// to the f32 rounding of the error-feedback identity). Nothing to do without error
    /// feedback; `flat` is scratch.
    pub(crate) fn give_back_bundle(
        &mut self,
        manifest: &Manifest,
        bundle: &[u8],
        step: u64,
        flat: &mut Vec<f32>,
    ) -> Result<()> {
        if !self.method.uses_error_feedback() {
            return Ok(());
        }
        let Some(fb) = self.feedback.as_mut() else {
            return Ok(());
        };
        manifest.decode_bundle(bundle, None, Some(step), flat)?;
        for t in manifest.tensors() {
            let sent = &flat[t.offset..t.offset + t.numel];
            add_into(fb.residual_for(&t.name, t.numel)?, sent);
        }
        Ok(())
    }

    /// [`GradientCompressor::give_back_bundle`] for the frames of one
    /// [`GradientCompressor::compress`] call.
    pub(crate) fn give_back_frames(
        &mut self,
        sent: &HashMap<String, CompressedGradient>,
    ) -> Result<()> {
        if !self.method.uses_error_feedback() {
            return Ok(());
        }
        for (name, cg) in sent {
            let decoded = self.decompress_one(name, cg)?;
            if let Some(fb) = self.feedback.as_mut() {
                add_into(fb.residual_for(name, decoded.data().len())?, decoded.data());
            }
        }
        Ok(())
    }

    /// Writes the error-feedback checkpoint (residuals, step, seed, method) to `path`.
    ///
    /// # Errors
    /// [`Error::Config`] when the method does not use error feedback; as
    /// [`ErrorFeedback::save`].
    pub fn save_feedback(&mut self, path: impl AsRef<Path>) -> Result<()> {
        match self.prepare()? {
            (_, Some(fb)) => fb.save(path),
            (_, None) => Err(Error::config("the method does not use error feedback")),
        }
    }

    /// Restores an error-feedback checkpoint: residuals, step and seed. The run continues
    /// bit-identically to one that was never interrupted; for that the checkpoint's seed
    /// replaces the compressor's own (one set with [`GradientCompressor::with_seed`]).
    ///
    /// Residuals are matched to gradients by name when the next compression meets them: one
    /// whose length differs from its gradient's is [`Error::LengthChanged`] then, one kept in
    /// another shape of the same length [`Error::ShapeChanged`] (a version 3 checkpoint
    /// stores shapes; the residuals of an older one take the shapes of the next step). The model is
    /// not known here, so a residual whose name never comes (a checkpoint of another model) is
    /// kept and saved again; to check a checkpoint against a model first, load it with
    /// [`ErrorFeedback::load`] and compare [`ErrorFeedback::residuals`] with the model's
    /// parameter names, as the `gradwire` tool does.
    ///
    /// # Errors
    /// As [`ErrorFeedback::load`]; [`Error::Checkpoint`] when the checkpoint was made with
    /// another method or the compressor does not use error feedback.
    pub fn load_feedback(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let fb = ErrorFeedback::load(path)?;
        self.restore_feedback(fb)
    }

    /// Takes over an error-feedback state (see [`GradientCompressor::load_feedback`]).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when it was made with another method or the compressor does not
    /// use error feedback; [`Error::Config`] for an invalid method.
    pub fn restore_feedback(&mut self, feedback: ErrorFeedback) -> Result<()> {
        let method = self.method.core_method()?;
        if !self.method.uses_error_feedback() {
            return Err(Error::checkpoint(
                "the compressor's method does not use error feedback",
            ));
        }
        if *feedback.method() != method {
            return Err(Error::checkpoint(format!(
                "made with method `{}`, the compressor uses `{}`",
                format_method(feedback.method()),
                format_method(&method)
            )));
        }
        self.seed = feedback.seed();
        self.step = feedback.step();
        self.feedback = Some(feedback);
        Ok(())
    }
}

/// `r[i] += x[i]` (same lengths).
fn add_into(r: &mut [f32], x: &[f32]) {
    for (r, &x) in r.iter_mut().zip(x) {
        *r += x;
    }
}

//! Compression methods: [`CompressionMethod`] (the names of the original module, and every
//! method of `gradwire-core`), its lowering to the core's [`Method`], the one check of which
//! methods error feedback may wrap (`check_for_feedback`), and the canonical text form of a
//! core method ([`format()`], [`parse()`]) that checkpoints, containers and error messages use.

use std::fmt::Write as _;

use gradwire_core::{K, Method, Rounding, SignScale, Values};

use crate::error::{Error, Result};

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
    pub(crate) fn uses_error_feedback(&self) -> bool {
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
                check_for_feedback(&m)?;
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
                zero_mask: false,
            },
            CompressionMethod::SignSGDMajority => Method::Sign {
                scale: SignScale::None,
                zero_mask: false,
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
            .map_err(|e| Error::config(format!("{} ({e})", format(&method))))?;
        Ok(method)
    }
}

/// The canonical text of a core method, as stored in checkpoints: the method name followed by
/// `key=value` parameters, separated by spaces, for example `topk k=ratio:0.01 values=int8:256`,
/// `quant bits=4 block=512 rounding=nearest-even` or `sign scale=mean-abs:1024` (with a zero
/// mask: `sign scale=mean-abs:1024 mask=zeros`). Floats are
/// written in their shortest exact form, so [`parse`] gives back the same method.
pub fn format(method: &Method) -> String {
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
        Method::Sign { scale, zero_mask } => {
            let mask = if *zero_mask { " mask=zeros" } else { "" };
            match scale {
                SignScale::MeanAbs { block } => write!(s, "sign scale=mean-abs:{block}{mask}"),
                SignScale::None => write!(s, "sign scale=none{mask}"),
            }
        }
    };
    s
}

/// Parses the text [`format()`] writes.
///
/// # Errors
/// [`Error::Config`] naming the part that is not understood, or the invalid parameter.
pub fn parse(text: &str) -> Result<Method> {
    let words = Words::of(text)?;
    let method = match words.kind {
        "dense" => Method::Dense {
            values: words.values("values")?,
        },
        "topk" => Method::TopK {
            k: words.k("k")?,
            values: words.values("values")?,
        },
        "threshold" => Method::Threshold {
            threshold: words.parsed("t", "threshold")?,
            values: words.values("values")?,
        },
        "randomk" => Method::RandomK {
            k: words.k("k")?,
            values: words.values("values")?,
            unbiased: match words.get("unbiased")? {
                "true" => true,
                "false" => false,
                other => return Err(words.bad(&format!("`{other}` is not true or false"))),
            },
        },
        "quant" => Method::Quant {
            bits: words.parsed("bits", "bit width")?,
            block: words.u32_of(words.get("block")?, "block")?,
            rounding: match words.get("rounding")? {
                "nearest-even" => Rounding::NearestEven,
                "stochastic" => Rounding::Stochastic,
                other => return Err(words.bad(&format!("unknown rounding `{other}`"))),
            },
        },
        "sign" => Method::Sign {
            scale: match words.get("scale")? {
                "none" => SignScale::None,
                s => match s.split_once(':') {
                    Some(("mean-abs", b)) => SignScale::MeanAbs {
                        block: words.u32_of(b, "block")?,
                    },
                    _ => return Err(words.bad(&format!("unknown sign scale `{s}`"))),
                },
            },
            // Optional, so that the texts written before the mask existed still read.
            zero_mask: match words.optional("mask") {
                None => false,
                Some("zeros") => true,
                Some(other) => {
                    return Err(words.bad(&format!("unknown sign mask `{other}` (zeros)")));
                }
            },
        },
        other => return Err(words.bad(&format!("unknown method `{other}`"))),
    };
    if words.used.get() != words.params.len() {
        return Err(words.bad("unknown parameter"));
    }
    method
        .validate()
        .map_err(|e| words.bad(&format!("invalid parameter ({e})")))?;
    Ok(method)
}

/// A method text cut into its kind and `key=value` words, for [`parse`].
struct Words<'t> {
    text: &'t str,
    kind: &'t str,
    params: Vec<(&'t str, &'t str)>,
    /// How many parameters the parser asked for (each key once).
    used: std::cell::Cell<usize>,
}

impl<'t> Words<'t> {
    fn of(text: &'t str) -> Result<Self> {
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
        Ok(Words {
            text,
            kind,
            params,
            used: std::cell::Cell::new(0),
        })
    }

    fn bad(&self, what: &str) -> Error {
        Error::config(format!("method `{}`: {what}", self.text))
    }

    /// The value of `key` (counted as used).
    fn get(&self, key: &str) -> Result<&'t str> {
        self.used.set(self.used.get() + 1);
        self.params
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .ok_or_else(|| self.bad(&format!("missing `{key}`")))
    }

    /// The value of `key`, if given (counted as used when it is).
    fn optional(&self, key: &str) -> Option<&'t str> {
        let v = self.params.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
        if v.is_some() {
            self.used.set(self.used.get() + 1);
        }
        v
    }

    /// The value of `key` parsed as a `T` (named `what` in the error).
    fn parsed<T: std::str::FromStr>(&self, key: &str, what: &str) -> Result<T> {
        let s = self.get(key)?;
        s.parse::<T>()
            .map_err(|_| self.bad(&format!("`{s}` is not a valid {what}")))
    }

    fn u64_of(&self, s: &str, what: &str) -> Result<u64> {
        s.parse::<u64>()
            .map_err(|_| self.bad(&format!("`{s}` is not a valid {what}")))
    }

    fn u32_of(&self, s: &str, what: &str) -> Result<u32> {
        u32::try_from(self.u64_of(s, what)?)
            .map_err(|_| self.bad(&format!("{what} `{s}` is too large")))
    }

    /// `count:N` or `ratio:R`.
    fn k(&self, key: &str) -> Result<K> {
        let s = self.get(key)?;
        match s.split_once(':') {
            Some(("count", c)) => Ok(K::Count(self.u64_of(c, "count")?)),
            Some(("ratio", r)) => r
                .parse::<f64>()
                .map(K::Ratio)
                .map_err(|_| self.bad(&format!("`{r}` is not a valid ratio"))),
            _ => Err(self.bad(&format!("`{s}` is not count:N or ratio:R"))),
        }
    }

    /// `f32`, `f16`, `bf16` or `int8:BLOCK`.
    fn values(&self, key: &str) -> Result<Values> {
        let s = self.get(key)?;
        match s {
            "f32" => Ok(Values::F32),
            "f16" => Ok(Values::F16),
            "bf16" => Ok(Values::Bf16),
            _ => match s.split_once(':') {
                Some(("int8", b)) => Ok(Values::Int8 {
                    block: self.u32_of(b, "block")?,
                }),
                _ => Err(self.bad(&format!("`{s}` is not f32, f16, bf16 or int8:BLOCK"))),
            },
        }
    }
}

/// Checks that error feedback may wrap `method`: a valid method whose residual stays bounded.
///
/// # Errors
/// [`Error::Config`] for an invalid method, unscaled sign (majority-vote signs: the residual
/// would grow without bound) and unbiased (n/k-scaled) random-k (likewise).
pub(crate) fn check_for_feedback(method: &Method) -> Result<()> {
    method
        .validate()
        .map_err(|e| Error::config(format!("{} ({e})", format(method))))?;
    match method {
        Method::Sign {
            scale: SignScale::None,
            ..
        } => Err(Error::config(
            "error feedback needs a scaled sign (SignSGD), not unscaled sign (SignSGDMajority): \
             the residual would grow without bound",
        )),
        Method::RandomK { unbiased: true, .. } => Err(Error::config(
            "error feedback with unbiased (n/k-scaled) random-k: the residual would grow \
             without bound",
        )),
        _ => Ok(()),
    }
}

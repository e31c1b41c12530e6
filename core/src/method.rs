//! What to send: the compression [`Method`] and the [`Params`] that make a frame reproducible.

use crate::error::{Error, Param};

/// How many entries a sparse method keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum K {
    /// An absolute count; `0` keeps nothing, a count `>= n` keeps everything.
    Count(u64),
    /// A fraction of the element count: `k = floor(n * ratio)` in f64, clamped to `[1, n]` for
    /// `n > 0` (`n` when `ratio >= 1`), as the reference Python layout computes it.
    Ratio(f64),
}

impl K {
    /// The number of kept entries for a tensor of `n` elements.
    pub const fn resolve(self, n: u64) -> u64 {
        match self {
            K::Count(k) => {
                if k < n {
                    k
                } else {
                    n
                }
            }
            K::Ratio(r) => k_from_ratio(n, r),
        }
    }
}

/// `k` for a ratio, as the reference layout computes it: `floor(n * ratio)` in f64, clamped to
/// `[1, n]` for `n > 0`; `n` when `ratio >= 1`; `0` when `n == 0`. A ratio that is NaN or
/// negative gives 1 here; [`Method::validate`] rejects it before it reaches an encoder.
pub const fn k_from_ratio(n: u64, ratio: f64) -> u64 {
    if n == 0 {
        return 0;
    }
    if ratio >= 1.0 {
        return n;
    }
    let k = (n as f64 * ratio) as u64; // `as` truncates toward zero: floor for non-negative values
    if k < 1 {
        1
    } else if k > n {
        n
    } else {
        k
    }
}

/// How kept values are stored on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Values {
    /// IEEE binary32, 4 bytes, lossless.
    F32,
    /// IEEE binary16, 2 bytes, round to nearest even. A value beyond f16's range is an error;
    /// a value below its smallest subnormal becomes 0.
    F16,
    /// bfloat16, 2 bytes, round to nearest even.
    Bf16,
    /// Symmetric int8 codes in `[-127, 127]` with one f32 absmax per `block` kept values:
    /// `value = code / 127 * absmax`. Only for sparse methods.
    Int8 {
        /// Kept values per scale (at least 1).
        block: u32,
    },
}

impl Values {
    /// Bytes per value on the wire, not counting int8 scales.
    pub const fn value_bytes(self) -> usize {
        match self {
            Values::F32 => 4,
            Values::F16 | Values::Bf16 => 2,
            Values::Int8 { .. } => 1,
        }
    }

    /// Bytes that `count` values take in a values section, scales included.
    pub const fn section_len(self, count: usize) -> usize {
        match self {
            Values::Int8 { block } => {
                let b = if block == 0 { 1 } else { block as usize };
                count.div_ceil(b).saturating_mul(4).saturating_add(count)
            }
            _ => count.saturating_mul(self.value_bytes()),
        }
    }
}

/// Rounding of quantization codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Round to nearest, ties to even: deterministic, error at most half a step.
    NearestEven,
    /// Stochastic (unbiased) rounding as in QSGD, from the counter-based generator keyed by
    /// (seed, step, tensor id, index).
    Stochastic,
}

/// Scale of sign compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignScale {
    /// One f32 per `block` elements: the block's mean |g| (EF-signSGD, Karimireddy et al. 2019).
    /// Decodes to `±mean`.
    MeanAbs {
        /// Elements per scale (at least 1).
        block: u32,
    },
    /// No scale: decodes to ±1 (signSGD with majority vote, Bernstein et al. 2018).
    None,
}

/// Elements per block of the zero mask of unscaled sign (FORMAT.md 3.6).
pub const UNSCALED_MASK_BLOCK: u32 = 1024;

/// A compression method and its parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// Every element, cast to `values` (F32, F16 or Bf16; Int8 is invalid here, use `Quant`).
    Dense {
        /// Value type.
        values: Values,
    },
    /// Exact top-k by magnitude; ties at the k-th magnitude go to the lower index.
    TopK {
        /// Entries kept.
        k: K,
        /// Value type of the kept entries.
        values: Values,
    },
    /// Every entry with `|g| > threshold`.
    Threshold {
        /// Threshold (finite, `>= 0`).
        threshold: f32,
        /// Value type of the kept entries.
        values: Values,
    },
    /// k entries at indices drawn uniformly without replacement from (seed, step, tensor id);
    /// indices do not travel, the receiver regenerates them.
    RandomK {
        /// Entries kept.
        k: K,
        /// Value type of the kept entries.
        values: Values,
        /// Scale decoded values by n/k (an unbiased estimate). Refused with error feedback.
        unbiased: bool,
    },
    /// b-bit symmetric quantization, codes in `±(2^(b-1) - 1)`, one f32 absmax per block.
    Quant {
        /// Bits per element, 2..=8.
        bits: u8,
        /// Elements per scale (at least 1).
        block: u32,
        /// Rounding mode.
        rounding: Rounding,
    },
    /// One bit per element (`1` = negative; 0 counts as + unless `zero_mask`).
    Sign {
        /// Scale mode.
        scale: SignScale,
        /// With a zero mask, elements that are exactly zero (`0.0` or `-0.0`) decode to zero
        /// instead of `±scale`, inside mixed blocks too (FORMAT.md 3.6, flag `0x02`): the mask
        /// costs 2 bits per mask block ([`Method::sign_mask_block`] elements) plus one bit per
        /// element of the blocks that mix zeros and non-zeros.
        zero_mask: bool,
    },
}

impl Method {
    /// Default sparse top-k: ratio with f32 values.
    pub const fn top_k_ratio(ratio: f64) -> Self {
        Method::TopK {
            k: K::Ratio(ratio),
            values: Values::F32,
        }
    }

    /// Checks the parameters.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] naming the first invalid parameter.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |param| Err(Error::InvalidParams { param });
        let check_k = |k: K| match k {
            K::Ratio(r) if !(r.is_finite() && r >= 0.0) => bad(Param::K),
            _ => Ok(()),
        };
        let check_values = |v: Values| match v {
            Values::Int8 { block: 0 } => bad(Param::Values),
            _ => Ok(()),
        };
        match *self {
            Method::Dense { values } => match values {
                Values::Int8 { .. } => bad(Param::Values),
                _ => Ok(()),
            },
            Method::TopK { k, values } => {
                check_k(k)?;
                check_values(values)
            }
            Method::Threshold { threshold, values } => {
                if !(threshold.is_finite() && threshold >= 0.0) {
                    return bad(Param::Threshold);
                }
                check_values(values)
            }
            Method::RandomK { k, values, .. } => {
                check_k(k)?;
                check_values(values)
            }
            Method::Quant { bits, block, .. } => {
                if !(2..=8).contains(&bits) {
                    bad(Param::Bits)
                } else if block == 0 {
                    bad(Param::Block)
                } else {
                    Ok(())
                }
            }
            Method::Sign { scale, zero_mask } => match scale {
                SignScale::MeanAbs { block: 0 } => bad(Param::Block),
                _ if zero_mask && !self.sign_mask_block().is_multiple_of(8) => bad(Param::ZeroMask),
                _ => Ok(()),
            },
        }
    }

    /// Elements per block of a sign zero mask: the scale block (mean-abs), or
    /// [`UNSCALED_MASK_BLOCK`] for unscaled sign; 0 for every other method. A zero mask needs a
    /// multiple of 8.
    pub const fn sign_mask_block(&self) -> usize {
        match *self {
            Method::Sign {
                scale: SignScale::MeanAbs { block },
                ..
            } => block as usize,
            Method::Sign {
                scale: SignScale::None,
                ..
            } => UNSCALED_MASK_BLOCK as usize,
            _ => 0,
        }
    }

    /// The value codec of a sparse or dense method, if it has one.
    pub const fn values(&self) -> Option<Values> {
        match *self {
            Method::Dense { values }
            | Method::TopK { values, .. }
            | Method::Threshold { values, .. }
            | Method::RandomK { values, .. } => Some(values),
            _ => None,
        }
    }
}

/// A method plus the context that makes random draws reproducible on every rank.
///
/// `seed`, `step` and `tensor_id` key the counter-based generator used by random-k and
/// stochastic rounding; other methods ignore them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// The method.
    pub method: Method,
    /// Run-wide seed.
    pub seed: u64,
    /// Training step.
    pub step: u64,
    /// Stable id of the tensor, usually [`tensor_id`] of its name.
    pub tensor_id: u64,
}

impl Params {
    /// Parameters with seed, step and tensor id 0.
    pub const fn new(method: Method) -> Self {
        Params {
            method,
            seed: 0,
            step: 0,
            tensor_id: 0,
        }
    }

    /// The same parameters with another seed.
    pub const fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The same parameters at another step.
    pub const fn at_step(mut self, step: u64) -> Self {
        self.step = step;
        self
    }

    /// The same parameters for another tensor id.
    pub const fn for_tensor(mut self, tensor_id: u64) -> Self {
        self.tensor_id = tensor_id;
        self
    }
}

/// Stable 64-bit id of a tensor name: FNV-1a over its UTF-8 bytes. Never Rust's randomly seeded
/// hasher, so every rank and every run agrees.
pub const fn tensor_id(name: &str) -> u64 {
    let bytes = name.as_bytes();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
}

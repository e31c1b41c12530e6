//! How each entry of a manifest is encoded and aggregated, decided once, when the manifest is
//! built, from the entry's kind, length and method: in one core call, as a bucket, in chunks of
//! whole blocks (dense, quantization and sign frames) or selected in chunks (top-k, threshold
//! and random-k frames). The engine and the aggregator run the plan; on one thread the chunks
//! run one after the other, with the same bytes and bits.

use gradwire_core::frame::chunk::Sections;
use gradwire_core::{Method, select};

use super::EntryKind;

/// Elements per chunk of a large entry (rounded up to whole blocks and bytes): 256 KiB of f32,
/// small enough that a chunk of the output stays in the L2 cache while W ranks add into it.
pub(crate) const CHUNK: usize = 1 << 16;

/// Entries of fewer elements are never cut into chunks (two chunks at least).
pub(crate) const SPLIT_MIN: usize = 2 * CHUNK;

/// What the chunked selection of one large sparse tensor keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Rule {
    /// The k largest magnitudes (`0 < k < n`).
    TopK(usize),
    /// Magnitudes above the threshold.
    Threshold(f32),
    /// Random-k's draw of k indices (`0 < k < n`).
    RandomK(usize),
}

impl Rule {
    /// The rule of `method` for a tensor of `n` elements when it is selected in chunks: top-k
    /// or random-k with `0 < k < n`, or threshold, on at least [`SPLIT_MIN`] elements (past the
    /// core's sampling minimum) with `u32` indices.
    fn of(n: usize, method: &Method) -> Option<Rule> {
        if n < SPLIT_MIN.max(select::SAMPLED_MIN) || u32::try_from(n).is_err() {
            return None;
        }
        match *method {
            Method::TopK { k, .. } => {
                let k = k.resolve(n as u64) as usize;
                (k > 0 && k < n).then_some(Rule::TopK(k))
            }
            Method::Threshold { threshold, .. } => Some(Rule::Threshold(threshold)),
            Method::RandomK { k, .. } => {
                let k = k.resolve(n as u64) as usize;
                (k > 0 && k < n).then_some(Rule::RandomK(k))
            }
            _ => None,
        }
    }
}

/// How the engine writes an entry's frame.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum EncodePlan {
    /// One tensor in one core call (`encode_into`, or `feedback_step` with error feedback).
    Whole,
    /// Several tensors gathered into one frame (with per-tensor top-k, each keeps its own
    /// top-k: [`EntryKind::Bucket`]).
    Bucket,
    /// One large dense, quantization or sign tensor, in chunks of whole blocks
    /// ([`dense_geometry`]).
    DenseChunks,
    /// One large top-k, threshold or random-k tensor, selected in chunks of [`CHUNK`].
    SparseChunks(Rule),
}

/// How aggregation adds the ranks' frames of an entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum ReducePlan {
    /// Each frame added whole by the core (`accumulate_into`), ranks in order.
    Whole,
    /// Chunks of the output (whole blocks, [`dense_geometry`]), each adding every rank's piece
    /// in rank order.
    DenseChunks,
    /// Each rank's (index, value) list decoded once, then chunks of [`CHUNK`] elements of the
    /// output, each adding the entries that fall into it, rank by rank.
    SparseLists,
}

/// How a dense, quantization or sign frame of `n` elements made with `method` cuts into chunks:
/// the alignment of a cut (whole blocks and whole bytes of codes, signs or values: the core's
/// [`Sections::align`]) and the chunk length ([`CHUNK`] rounded up to it), if `n` holds two
/// chunks at least.
pub(crate) fn dense_geometry(n: usize, method: &Method) -> Option<(usize, usize)> {
    if n < SPLIT_MIN {
        return None;
    }
    let align = Sections::of(n, method)?.align();
    let chunk = CHUNK.div_ceil(align).checked_mul(align)?;
    (n >= chunk.checked_mul(2)?).then_some((align, chunk))
}

/// The encode plan of an entry.
pub(crate) fn encode_plan(kind: &EntryKind, len: usize, method: &Method) -> EncodePlan {
    if let EntryKind::Bucket { .. } = kind {
        return EncodePlan::Bucket;
    }
    if dense_geometry(len, method).is_some() {
        return EncodePlan::DenseChunks;
    }
    match Rule::of(len, method) {
        Some(rule) => EncodePlan::SparseChunks(rule),
        None => EncodePlan::Whole,
    }
}

/// The aggregation plan of an entry (buckets too: a bucket's frame is one frame).
pub(crate) fn reduce_plan(len: usize, method: &Method) -> ReducePlan {
    if dense_geometry(len, method).is_some() {
        return ReducePlan::DenseChunks;
    }
    let sparse = matches!(
        method,
        Method::TopK { .. } | Method::Threshold { .. } | Method::RandomK { .. }
    );
    if sparse && len >= SPLIT_MIN && u32::try_from(len).is_ok() {
        ReducePlan::SparseLists
    } else {
        ReducePlan::Whole
    }
}

//! The kept (index, value) list of one sparse frame (top-k, threshold or random-k), decoded once
//! through the core's [`SparseFrame`], so that chunks of an output (an aggregate, a residual)
//! can each add the entries that fall into them.

use gradwire_core::Params;
use gradwire_core::frame::chunk::SparseFrame;

/// The indices (ascending) and decoded values of one sparse frame.
#[derive(Debug, Default)]
pub(crate) struct SparseList {
    idx: Vec<u32>,
    val: Vec<f32>,
}

impl SparseList {
    /// Decodes a top-k or threshold frame of `n` elements made with `expected`, with every check
    /// of the core's decoder; `false` (the list in any state) for a frame it would reject.
    pub(crate) fn decode(&mut self, frame: &[u8], n: usize, expected: &Params) -> bool {
        let Ok(sparse) = SparseFrame::parse(frame, expected, n) else {
            return false;
        };
        let count = sparse.kept();
        self.idx.resize(count, 0);
        self.val.resize(count, 0.0);
        sparse.indices(&mut self.idx).is_ok() && sparse.values(0, &mut self.val).is_ok()
    }

    /// Decodes a random-k frame of `n` elements made with `expected` whose indices `idx` were
    /// drawn for `expected`'s seed, step and tensor id (once for all ranks): the values, times
    /// n/k when unbiased, with every check of the core's decoder; `false` for a frame it would
    /// reject.
    pub(crate) fn decode_randomk(
        &mut self,
        frame: &[u8],
        n: usize,
        expected: &Params,
        idx: &[u32],
    ) -> bool {
        let Ok(sparse) = SparseFrame::parse(frame, expected, n) else {
            return false;
        };
        if sparse.kept() != idx.len() {
            return false;
        }
        self.idx.clear();
        self.idx.extend_from_slice(idx);
        self.val.resize(idx.len(), 0.0);
        sparse.values(0, &mut self.val).is_ok()
    }

    /// Makes room for `count` entries, so that decoding a frame of that many allocates nothing.
    pub(crate) fn reserve(&mut self, count: usize) {
        self.idx.reserve(count.saturating_sub(self.idx.len()));
        self.val.reserve(count.saturating_sub(self.val.len()));
    }

    /// Whether it holds room for any entry.
    #[cfg(test)]
    pub(crate) fn holds_any(&self) -> bool {
        self.idx.capacity() > 0 || self.val.capacity() > 0
    }

    /// The indices and values.
    pub(crate) fn entries(&self) -> (&[u32], &[f32]) {
        (&self.idx, &self.val)
    }

    /// Adds `weight * value` of the entries with index in `start..start + acc.len()` into
    /// `acc`, as the core's `accumulate_into` does (`acc[i] += weight * value`).
    pub(crate) fn add_range(&self, start: usize, acc: &mut [f32], weight: f32) {
        let end = start + acc.len();
        let lo = self.idx.partition_point(|&i| (i as usize) < start);
        let hi = self.idx.partition_point(|&i| (i as usize) < end);
        for (&i, &v) in self.idx[lo..hi].iter().zip(&self.val[lo..hi]) {
            acc[i as usize - start] += weight * v;
        }
    }
}

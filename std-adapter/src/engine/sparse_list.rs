//! The kept (index, value) list of one sparse frame (top-k, threshold or random-k), decoded once
//! so that chunks of an output (an aggregate, a residual) can each add the entries that fall
//! into them.

use gradwire_core::{Method, Params, Values, index, max_frame_len, values};

/// The indices and values of one sparse frame (top-k, threshold or random-k), decoded once so
/// that chunks of the output can each add the entries that fall into them.
#[derive(Debug, Default)]
pub(crate) struct SparseList {
    idx: Vec<u32>,
    val: Vec<f32>,
}

impl SparseList {
    /// Decodes a top-k or threshold frame of `n` elements whose header was checked against
    /// `method` (the manifest's). `false`, with the list in any state, for anything the core's
    /// decoder would reject.
    pub(crate) fn decode(&mut self, frame: &[u8], n: usize, method: &Method) -> bool {
        self.idx.clear();
        self.val.clear();
        let Some(v) = method.values() else {
            return false;
        };
        // The header ends with the count (u64) and the index codec (u8); the index section
        // follows, then the values section, then the CRC.
        let Some((fixed, body)) = header_tail_and_body(frame, method, 9) else {
            return false;
        };
        let count = le_u64(&fixed[..8]);
        let codec = fixed[8];
        let Ok(count_usize) = usize::try_from(count) else {
            return false;
        };
        if count_usize > n {
            return false;
        }
        let Ok(idx_len) = index::section_len(codec, n as u64, count, body) else {
            return false;
        };
        let (idx, vals) = body.split_at(idx_len);
        if vals.len() != v.section_len(count_usize) || !values_valid(v, count_usize, vals) {
            return false;
        }
        if self.idx.capacity() < count_usize {
            self.idx.reserve(count_usize);
        }
        let list = &mut self.idx;
        let ok = index::for_each_index(codec, n as u64, count, idx, |i| list.push(i as u32));
        if ok.is_err() || self.idx.len() != count_usize {
            return false;
        }
        self.val.resize(count_usize, 0.0);
        values::decode_run(v, vals, count_usize, 0, &mut self.val);
        true
    }

    /// Decodes a random-k frame of `n` elements whose header was checked against `expected`
    /// (the manifest's parameters), given the indices random-k draws for them (`idx`, drawn
    /// for `expected`'s seed, step and tensor id): the values, times n/k when unbiased.
    /// `false`, with the list in any state, for anything the core's decoder would reject.
    pub(crate) fn decode_randomk(
        &mut self,
        frame: &[u8],
        n: usize,
        expected: &Params,
        idx: &[u32],
    ) -> bool {
        self.idx.clear();
        self.val.clear();
        let method = &expected.method;
        let (Method::RandomK { unbiased, .. }, Some(v)) = (*method, method.values()) else {
            return false;
        };
        // The parameters end with k, seed, step and tensor id (u64 each); the values section
        // follows, then the CRC.
        let Some((fixed, vals)) = header_tail_and_body(frame, method, 32) else {
            return false;
        };
        let word = |j: usize| le_u64(&fixed[8 * j..8 * j + 8]);
        let count = idx.len();
        if word(0) != count as u64
            || [word(1), word(2), word(3)] != [expected.seed, expected.step, expected.tensor_id]
            || count > n
            || vals.len() != v.section_len(count)
            || !values_valid(v, count, vals)
        {
            return false;
        }
        self.idx.extend_from_slice(idx);
        self.val.resize(count, 0.0);
        values::decode_run(v, vals, count, 0, &mut self.val);
        if unbiased && count > 0 {
            // The core's decoder: `value = fl(v * s)`, s = n/k in binary64 rounded once; a frame
            // where that is not finite is invalid.
            let s = (n as f64 / count as f64) as f32;
            for x in &mut self.val {
                *x *= s;
                if !x.is_finite() {
                    return false;
                }
            }
        }
        true
    }

    /// Makes room for `count` entries, so that decoding a frame of that many allocates nothing.
    pub(crate) fn reserve(&mut self, count: usize) {
        self.idx.reserve(count.saturating_sub(self.idx.len()));
        self.val.reserve(count.saturating_sub(self.val.len()));
    }

    /// `acc[i - start] += -1 * value` for the entries with index in `start..start + acc.len()`
    /// (an error-feedback step's fix-up of its kept entries, as [`SparseList::add_range`] with
    /// weight -1); returns the largest `|acc[i - start]|` it leaves (0 for none).
    pub(crate) fn subtract_range(&self, start: usize, acc: &mut [f32]) -> f32 {
        let end = start + acc.len();
        let lo = self.idx.partition_point(|&i| (i as usize) < start);
        let hi = self.idx.partition_point(|&i| (i as usize) < end);
        let mut max = 0.0f32;
        for (&i, &v) in self.idx[lo..hi].iter().zip(&self.val[lo..hi]) {
            let a = &mut acc[i as usize - start];
            *a += -v; // -1 * v, exactly
            max = max.max(a.abs());
        }
        max
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

/// The last `tail` bytes of the fixed header of a frame made with `method` (its length is the
/// core's `max_frame_len(0, method) - 4`, at least 16 + `tail`) and the body between the header
/// and the CRC; `None` when the frame is too short.
fn header_tail_and_body<'f>(
    frame: &'f [u8],
    method: &Method,
    tail: usize,
) -> Option<(&'f [u8], &'f [u8])> {
    let header = max_frame_len(0, method).checked_sub(4)?;
    if header < 16 + tail {
        return None;
    }
    Some((
        frame.get(header - tail..header)?,
        frame.get(header..frame.len().checked_sub(4)?)?,
    ))
}

/// A little-endian `u64` from 8 bytes.
fn le_u64(b: &[u8]) -> u64 {
    let mut c = [0u8; 8];
    c.copy_from_slice(b);
    u64::from_le_bytes(c)
}

/// The core's checks of a values section of `count` values: int8 scales finite and `>= 0` and
/// no code -128; plain values finite.
fn values_valid(v: Values, count: usize, vals: &[u8]) -> bool {
    match v {
        Values::Int8 { block } => {
            let s_len = count.div_ceil(block.max(1) as usize) * 4;
            let (scales, codes) = vals.split_at(s_len.min(vals.len()));
            scales.chunks_exact(4).all(|s| {
                let m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                m.is_finite() && m >= 0.0
            }) && !codes.contains(&0x80)
        }
        _ => vals
            .chunks_exact(v.value_bytes())
            .all(|c| values::read_plain(v, c).is_some()),
    }
}

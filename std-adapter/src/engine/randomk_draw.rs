//! Random-k's indices of one large tensor, drawn in chunks (on rayon's pool, or the core's serial
//! draw on one thread).
//!
//! Random-k keeps the indices of Knuth's selection sampling (Algorithm S, FORMAT.md 6.2): index
//! `i` is kept when its scaled draw `h_i` is below the count still needed, which depends on
//! every earlier decision. The draws themselves do not, and they are the work (4-5
//! multiplications per element, 7-14 read passes of the tensor on one core). So, as in the core's
//! [`gradwire_core::randomk`]:
//!
//! 1. every chunk of [`CHUNK`] elements lists its candidates, `h_i` below a bound on the count
//!    needed at the chunk's start, in parallel. The count kept before position `s` is
//!    hypergeometric (`k` of `n` drawn, `s` of them in `0..s`), so the bound is its mean plus 8
//!    standard deviations plus 16: a chunk's list holds about `k * CHUNK / n` candidates, a few
//!    more than it keeps;
//! 2. one thread walks the lists in order with the exact count ([`randomk::resolve`]). A chunk
//!    whose bound turns out below the count (never seen; it would take a deviation of 8 sigma)
//!    is scanned again there with the exact count. The indices are those of the serial draw, by
//!    construction, whatever the bounds.

use gradwire_core::randomk::{self, Candidate};
use gradwire_core::{Method, Params, rng};

use super::buffers::grow;
use super::exec::Exec;
use crate::layout::plan::CHUNK;

/// One chunk's candidates: `buf[..count]`, scanned with `bound`.
#[derive(Debug, Default)]
struct DrawList {
    buf: Vec<Candidate>,
    count: usize,
    bound: u64,
}

/// The buffers of the chunked draw of one tensor, kept between steps.
#[derive(Debug, Default)]
pub(crate) struct RandomKDraw {
    lists: Vec<DrawList>,
    /// The kept indices of the last draw, ascending.
    idx: Vec<u32>,
}

/// A bound on the count Algorithm S still needs at index `start` when it keeps `k` of `n`
/// (`k <= n`): `k` less the count kept before `start`, whose mean is `k * start / n` and
/// variance `k (start/n) (1 - start/n) (n - k) / (n - 1)`; mean plus 8 standard deviations plus
/// 16, at most `k`.
fn bound_at(n: u64, k: u64, start: u64) -> u64 {
    if n < 2 {
        return k;
    }
    let (nf, kf) = (n as f64, k as f64);
    let p = start as f64 / nf;
    let mean = kf * (1.0 - p);
    let var = kf * p * (1.0 - p) * (nf - kf) / (nf - 1.0);
    let b = (mean + 8.0 * var.max(0.0).sqrt() + 16.0).ceil();
    if b >= kf { k } else { b as u64 }
}

/// The first length of the list of chunk `start..end` scanned with `bound`: twice the expected
/// candidates plus 64, at most the chunk's length. Index `i` is a candidate with probability
/// `min(1, bound / (n - i))`; summed over the chunk (`n - i` from `a = n - end + 1` to
/// `b = n - start`) that is about `bound * ln(b / a)`, and all of `n - i <= bound`.
fn first_capacity(n: usize, bound: u64, start: usize, end: usize) -> usize {
    let len = end - start;
    let (a, b, u) = ((n - end + 1) as f64, (n - start) as f64, bound as f64);
    let expect = if u <= a {
        u * ((b / a).ln() + 1.0 / a)
    } else {
        (u - a) + u * ((b / u).max(1.0).ln() + 1.0 / u)
    };
    (2.0 * expect.min(len as f64) + 64.0).min(len as f64) as usize
}

impl RandomKDraw {
    /// Sizes the buffers for drawing `k` of `n` (so that a later draw allocates nothing, unless
    /// a chunk's candidates exceed twice their expected count).
    pub(crate) fn reserve(&mut self, n: usize, k: u64, exec: Exec) {
        let k = k.min(n as u64);
        self.idx
            .reserve((k as usize).saturating_sub(self.idx.len()));
        if exec == Exec::Serial {
            return;
        }
        let chunks = n.div_ceil(CHUNK);
        if self.lists.len() < chunks {
            self.lists.resize_with(chunks, DrawList::default);
        }
        for (j, list) in self.lists[..chunks].iter_mut().enumerate() {
            let (start, end) = (j * CHUNK, ((j + 1) * CHUNK).min(n));
            let bound = bound_at(n as u64, k, start as u64);
            grow(&mut list.buf, first_capacity(n, bound, start, end));
        }
    }

    /// The indices of the last [`RandomKDraw::draw`], ascending.
    pub(crate) fn indices(&self) -> &[u32] {
        &self.idx
    }

    /// [`RandomKDraw::draw`] for the random-k method of `params` on `n` elements: its `k`
    /// resolved for `n`, the stream of its seed, step and tensor id. `false` for another method.
    pub(crate) fn draw_for(
        &mut self,
        params: &Params,
        n: usize,
        exec: Exec,
        check: impl Fn(usize, usize) -> bool + Sync,
    ) -> bool {
        let Method::RandomK { k, .. } = params.method else {
            return false;
        };
        let key = rng::key(params.seed, params.step, params.tensor_id);
        self.draw(n, k.resolve(n as u64), key, exec, check)
    }

    /// Draws the `min(k, n)` indices random-k keeps of `n` elements (`n <= u32::MAX + 1`) in
    /// stream `key` ([`gradwire_core::rng::key`]) into [`RandomKDraw::indices`]: chunks on
    /// rayon's pool, else the core's serial draw. `check(start, end)` runs for
    /// every chunk of the tensor first (in the chunk's task): when one returns `false`, so does
    /// this, and the indices are not drawn.
    pub(crate) fn draw(
        &mut self,
        n: usize,
        k: u64,
        key: u64,
        exec: Exec,
        check: impl Fn(usize, usize) -> bool + Sync,
    ) -> bool {
        let (n64, k) = (n as u64, k.min(n as u64));
        self.idx.clear();
        let chunks = n.div_ceil(CHUNK);
        if exec == Exec::Serial {
            if !(0..chunks).all(|j| check(j * CHUNK, ((j + 1) * CHUNK).min(n))) {
                return false;
            }
            self.idx.reserve(k as usize);
            let idx = &mut self.idx;
            randomk::for_each(n64, k, key, |i| idx.push(i as u32));
            return true;
        }
        if self.lists.len() < chunks {
            self.lists.resize_with(chunks, DrawList::default);
        }
        // Step 1: every chunk's check and candidates.
        let ok = exec.all_mut(&mut self.lists[..chunks], |j, list| {
            let (start, end) = (j * CHUNK, ((j + 1) * CHUNK).min(n));
            list.count = 0;
            if !check(start, end) {
                return false;
            }
            list.bound = bound_at(n64, k, start as u64);
            let len = end - start;
            grow(&mut list.buf, first_capacity(n, list.bound, start, end));
            let mut at = start as u64;
            loop {
                let (c, next) = randomk::candidates(
                    key,
                    n64,
                    at,
                    end as u64,
                    list.bound,
                    &mut list.buf[list.count..],
                );
                list.count += c;
                at = next;
                if at >= end as u64 {
                    return true;
                }
                let more = (2 * list.buf.len()).min(len);
                grow(&mut list.buf, more);
            }
        });
        if !ok {
            return false;
        }
        self.resolve_lists(n, k, key);
        true
    }

    /// Step 2: the lists of the `n.div_ceil(CHUNK)` chunks in order with the exact count, into
    /// `self.idx`; a chunk whose bound is below the count is scanned again with the count.
    fn resolve_lists(&mut self, n: usize, k: u64, key: u64) {
        let mut needed = k;
        let idx = &mut self.idx;
        idx.clear();
        idx.reserve(k as usize);
        for (j, list) in self.lists[..n.div_ceil(CHUNK)].iter_mut().enumerate() {
            if needed == 0 {
                break;
            }
            if needed > list.bound {
                let (start, end) = (j * CHUNK, ((j + 1) * CHUNK).min(n));
                grow(&mut list.buf, end - start);
                let (c, _) = randomk::candidates(
                    key,
                    n as u64,
                    start as u64,
                    end as u64,
                    needed,
                    &mut list.buf,
                );
                list.count = c;
                list.bound = needed;
            }
            randomk::resolve(&list.buf[..list.count], &mut needed, |i| idx.push(i as u32));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_core::{rng, scalar};

    fn spec(n: usize, k: u64, key: u64) -> Vec<u32> {
        let mut v = Vec::new();
        scalar::randomk_for_each(n as u64, k, key, |i| v.push(i as u32));
        v
    }

    #[test]
    fn chunked_draw_is_the_serial_draw() {
        let mut draw = RandomKDraw::default();
        for (n, k) in [
            (2 * CHUNK + 17, 1u64),
            (3 * CHUNK, 3 * CHUNK as u64 / 100),
            (5 * CHUNK + 1, 5 * CHUNK as u64 / 2),
            (4 * CHUNK, 4 * CHUNK as u64 - 3),
            (CHUNK / 2, 100),
            (0, 0),
        ] {
            for seed in 0..3 {
                let key = rng::key(seed, n as u64, k);
                for exec in [Exec::Pool, Exec::Serial] {
                    assert!(draw.draw(n, k, key, exec, |_, _| true));
                    assert_eq!(draw.indices(), spec(n, k, key), "n {n} k {k} {exec:?}");
                }
            }
        }
    }

    #[test]
    fn a_missed_bound_is_drawn_again_exactly() {
        // Every list scanned with a bound of 1, below the count needed in every chunk but the
        // last ones: step 2 must scan those chunks again with the exact count.
        let (n, k) = (6 * CHUNK, 6 * CHUNK as u64 / 10);
        let key = rng::key(1, 2, 3);
        let mut draw = RandomKDraw::default();
        assert!(draw.draw(n, k, key, Exec::Pool, |_, _| true));
        for (j, list) in draw.lists.iter_mut().enumerate() {
            let (start, end) = (j * CHUNK, ((j + 1) * CHUNK).min(n));
            grow(&mut list.buf, end - start);
            let (c, next) =
                randomk::candidates(key, n as u64, start as u64, end as u64, 1, &mut list.buf);
            assert_eq!(next, end as u64);
            (list.count, list.bound) = (c, 1);
        }
        draw.resolve_lists(n, k, key);
        assert_eq!(draw.indices(), spec(n, k, key));
    }

    #[test]
    fn a_failed_check_stops_the_draw() {
        let mut draw = RandomKDraw::default();
        for exec in [Exec::Pool, Exec::Serial] {
            let fails = |start: usize, _| start != CHUNK;
            assert!(!draw.draw(3 * CHUNK, 10, 5, exec, fails));
        }
    }

    #[test]
    fn bounds_hold_for_the_mean_and_never_exceed_k() {
        let (n, k) = (1_000_000u64, 10_000u64);
        assert_eq!(bound_at(n, k, 0), k);
        let mid = bound_at(n, k, n / 2);
        assert!(mid > k / 2 + 8 * 49 && mid < k / 2 + 8 * 51 + 17, "{mid}");
        assert!(bound_at(n, k, n - 1) >= 16);
        assert_eq!(bound_at(1, 1, 0), 1);
    }
}

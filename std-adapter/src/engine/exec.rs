//! Where work runs: [`Parallelism`], the user's setting, resolves once per call into an
//! [`Exec`], the one value every encode and aggregation path takes. `Exec` is the only user of
//! rayon in the crate: each of its methods runs the same closure over the same pieces either one
//! after the other on the calling thread (`Serial`) or on rayon's pool (`Pool`), so the two give
//! the same bytes and bits by construction (no piece's result depends on another's timing).

use rayon::prelude::*;

/// How many cores compression and aggregation use.
///
/// The pooled path runs on rayon's pool: the global one, or the pool of
/// [`rayon::ThreadPool::install`] when called inside it. Ranks simulated in one process
/// ([`crate::comm::LocalGroup`]) should run on their own threads, as they do there: a rank run
/// as a rayon task that blocks in an all-gather could be picked up by a worker waiting inside
/// another rank's pooled call, and the two would wait for each other. Use
/// [`Parallelism::Serial`] inside such tasks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Parallelism {
    /// On rayon's pool when it has more than one thread, else serial; also serial for a model of
    /// fewer than 2^16 (65,536) elements, where handing work to other threads costs more than it
    /// saves.
    #[default]
    Auto,
    /// On the calling thread only.
    Serial,
    /// On rayon's pool, even with one thread.
    Parallel,
}

impl Parallelism {
    /// Elements below which [`Parallelism::Auto`] runs a model serially.
    pub(crate) const AUTO_MIN_ELEMENTS: usize = 1 << 16;

    /// Threads a call made now on a large model uses: 1 for the serial path, else the size of
    /// rayon's pool.
    pub fn threads(self) -> usize {
        match self.exec_for(usize::MAX) {
            Exec::Serial => 1,
            Exec::Pool => rayon::current_num_threads(),
        }
    }

    /// Where a call made now on a model of `elements` elements runs.
    pub(crate) fn exec_for(self, elements: usize) -> Exec {
        let pooled = match self {
            Parallelism::Auto => {
                elements >= Self::AUTO_MIN_ELEMENTS && rayon::current_num_threads() > 1
            }
            Parallelism::Serial => false,
            Parallelism::Parallel => true,
        };
        if pooled { Exec::Pool } else { Exec::Serial }
    }
}

/// Where one call's work runs (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exec {
    /// On the calling thread, pieces in order.
    Serial,
    /// On rayon's pool.
    Pool,
}

impl Exec {
    /// Runs `f`: on the pool inside one `rayon::scope` (a call from outside the pool then waits
    /// once for the whole call, not for each job it hands over), else directly.
    pub(crate) fn install<R: Send>(self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Exec::Serial => f(),
            Exec::Pool => rayon::scope(|_| f()),
        }
    }

    /// `f(i, item)` for every item.
    pub(crate) fn for_each<T: Send>(self, items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
        match self {
            Exec::Serial => items.iter_mut().enumerate().for_each(|(i, t)| f(i, t)),
            Exec::Pool => items.par_iter_mut().enumerate().for_each(|(i, t)| f(i, t)),
        }
    }

    /// As [`Exec::for_each`], but on the pool each item is its own task, queued largest first
    /// (by `size`): a model's tensors differ in size by up to 10^5 (GPT-2-small's `wte` holds
    /// 31% of its elements), and a large one started last, or several in one task, run alone
    /// after the others are done.
    pub(crate) fn for_each_largest_first<T: Send>(
        self,
        items: &mut [T],
        size: impl Fn(&T) -> usize,
        f: impl Fn(usize, &mut T) + Sync + Send,
    ) {
        self.for_each_with_largest_first(items, size, || (), |(), i, t| f(i, t));
    }

    /// `f(i, item i, chunk i)` for every item and chunk of `chunk` elements of `x`, in pairs
    /// (as many as the shorter of the two).
    pub(crate) fn for_each_zip<T: Send>(
        self,
        items: &mut [T],
        x: &mut [f32],
        chunk: usize,
        f: impl Fn(usize, &mut T, &mut [f32]) + Sync,
    ) {
        match self {
            Exec::Serial => items
                .iter_mut()
                .zip(x.chunks_mut(chunk))
                .enumerate()
                .for_each(|(i, (t, c))| f(i, t, c)),
            Exec::Pool => items
                .par_iter_mut()
                .zip(x.par_chunks_mut(chunk))
                .enumerate()
                .for_each(|(i, (t, c))| f(i, t, c)),
        }
    }

    /// `f(state, i, item)` for every item, with one `state` from `init` per task (one in all on
    /// one thread).
    pub(crate) fn for_each_with<T: Send, S>(
        self,
        items: &mut [T],
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize, &mut T) + Sync + Send,
    ) {
        match self {
            Exec::Serial => {
                let mut state = init();
                for (i, t) in items.iter_mut().enumerate() {
                    f(&mut state, i, t);
                }
            }
            Exec::Pool => items
                .par_iter_mut()
                .enumerate()
                .for_each_init(init, |s, (i, t)| f(s, i, t)),
        }
    }

    /// [`Exec::for_each_with`] with the items queued as [`Exec::for_each_largest_first`] queues
    /// them (one `state` per task then: per item).
    pub(crate) fn for_each_with_largest_first<T: Send, S>(
        self,
        items: &mut [T],
        size: impl Fn(&T) -> usize,
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize, &mut T) + Sync + Send,
    ) {
        match self {
            Exec::Serial => self.for_each_with(items, init, f),
            Exec::Pool => {
                let mut order: Vec<(usize, &mut T)> = items.iter_mut().enumerate().collect();
                order.sort_by_key(|(_, t)| std::cmp::Reverse(size(t)));
                order
                    .par_iter_mut()
                    .with_max_len(1)
                    .for_each_init(init, |s, (i, t)| f(s, *i, t));
            }
        }
    }

    /// Whether `f(i, item)` holds for every item (stops early on the first `false` in order on
    /// one thread; on the pool, at some `false`).
    pub(crate) fn all_mut<T: Send>(
        self,
        items: &mut [T],
        f: impl Fn(usize, &mut T) -> bool + Sync,
    ) -> bool {
        match self {
            Exec::Serial => items.iter_mut().enumerate().all(|(i, t)| f(i, t)),
            Exec::Pool => items.par_iter_mut().enumerate().all(|(i, t)| f(i, t)),
        }
    }

    /// The first error of `f(i, item)` in item order, else `Ok`.
    pub(crate) fn first_err<T: Sync, E: Send>(
        self,
        items: &[T],
        f: impl Fn(usize, &T) -> Result<(), E> + Sync,
    ) -> Result<(), E> {
        match self {
            Exec::Serial => items.iter().enumerate().try_for_each(|(i, t)| f(i, t)),
            Exec::Pool => match items
                .par_iter()
                .enumerate()
                .map(|(i, t)| f(i, t))
                .find_first(Result::is_err)
            {
                Some(err) => err,
                None => Ok(()),
            },
        }
    }

    /// As [`Exec::first_err`], but on the pool the items start largest first (by `size`, as in
    /// [`Exec::for_each_largest_first`]); the error returned is still the first in item order.
    pub(crate) fn first_err_largest_first<T: Sync, E: Send>(
        self,
        items: &[T],
        size: impl Fn(&T) -> usize,
        f: impl Fn(usize, &T) -> Result<(), E> + Sync,
    ) -> Result<(), E> {
        match self {
            Exec::Serial => items.iter().enumerate().try_for_each(|(i, t)| f(i, t)),
            Exec::Pool => {
                let mut order: Vec<usize> = (0..items.len()).collect();
                order.sort_by_key(|&i| std::cmp::Reverse(size(&items[i])));
                let first = order
                    .par_iter()
                    .with_max_len(1)
                    .filter_map(|&i| f(i, &items[i]).err().map(|e| (i, e)))
                    .min_by_key(|(i, _)| *i);
                match first {
                    Some((_, e)) => Err(e),
                    None => Ok(()),
                }
            }
        }
    }

    /// Whether `f(chunk)` holds for every chunk of `chunk` elements of `x`.
    pub(crate) fn chunks_all(
        self,
        x: &[f32],
        chunk: usize,
        f: impl Fn(&[f32]) -> bool + Sync + Send,
    ) -> bool {
        match self {
            Exec::Serial => x.chunks(chunk).all(f),
            Exec::Pool => x.par_chunks(chunk).all(f),
        }
    }

    /// Whether `f(g_chunk, r_chunk)` holds for every pair of chunks of `chunk` elements.
    pub(crate) fn chunk_pairs_all(
        self,
        g: &[f32],
        r: &[f32],
        chunk: usize,
        f: impl Fn(&[f32], &[f32]) -> bool + Sync,
    ) -> bool {
        match self {
            Exec::Serial => g.chunks(chunk).zip(r.chunks(chunk)).all(|(g, r)| f(g, r)),
            Exec::Pool => g
                .par_chunks(chunk)
                .zip(r.par_chunks(chunk))
                .all(|(g, r)| f(g, r)),
        }
    }

    /// The largest `f(j, chunk j)` over the chunks of `chunk` elements of `x` (0 for none).
    pub(crate) fn chunks_mut_max(
        self,
        x: &mut [f32],
        chunk: usize,
        f: impl Fn(usize, &mut [f32]) -> f32 + Sync,
    ) -> f32 {
        match self {
            Exec::Serial => x
                .chunks_mut(chunk)
                .enumerate()
                .map(|(j, c)| f(j, c))
                .fold(0.0, f32::max),
            Exec::Pool => x
                .par_chunks_mut(chunk)
                .enumerate()
                .map(|(j, c)| f(j, c))
                .reduce(|| 0.0, f32::max),
        }
    }

    /// The largest `f(j, r chunk j, g chunk j)` over the chunks of `chunk` elements (0 for
    /// none).
    pub(crate) fn chunk_pairs_mut_max(
        self,
        r: &mut [f32],
        g: &[f32],
        chunk: usize,
        f: impl Fn(usize, &mut [f32], &[f32]) -> f32 + Sync,
    ) -> f32 {
        match self {
            Exec::Serial => r
                .chunks_mut(chunk)
                .zip(g.chunks(chunk))
                .enumerate()
                .map(|(j, (r, g))| f(j, r, g))
                .fold(0.0, f32::max),
            Exec::Pool => r
                .par_chunks_mut(chunk)
                .zip(g.par_chunks(chunk))
                .enumerate()
                .map(|(j, (r, g))| f(j, r, g))
                .reduce(|| 0.0, f32::max),
        }
    }

    /// Whether `f(j, chunk j)` holds for every chunk of `chunk` elements of `x` (every chunk
    /// runs on the pool; on one thread the first `false` stops).
    pub(crate) fn chunks_mut_all(
        self,
        x: &mut [f32],
        chunk: usize,
        f: impl Fn(usize, &mut [f32]) -> bool + Sync,
    ) -> bool {
        match self {
            Exec::Serial => x.chunks_mut(chunk).enumerate().all(|(j, c)| f(j, c)),
            Exec::Pool => x.par_chunks_mut(chunk).enumerate().all(|(j, c)| f(j, c)),
        }
    }

    /// `f(i, item i, region i)` for every item, region `i` being `buf[regions[i]]` (the
    /// regions in order, disjoint, within `buf`; one per item): the items and the buffer are
    /// halved recursively at a region's start, each half a task on the pool, so that every task
    /// owns its regions without a list of slices.
    pub(crate) fn for_each_region<T: Send>(
        self,
        items: &mut [T],
        buf: &mut [u8],
        regions: &[std::ops::Range<usize>],
        f: &(impl Fn(usize, &mut T, &mut [u8]) + Sync),
    ) {
        self.regions_from(0, items, buf, 0, regions, f);
    }

    /// [`Exec::for_each_region`] over items `first..` whose regions lie in `buf`, which starts
    /// at offset `base` of the whole buffer.
    fn regions_from<T: Send>(
        self,
        first: usize,
        items: &mut [T],
        buf: &mut [u8],
        base: usize,
        regions: &[std::ops::Range<usize>],
        f: &(impl Fn(usize, &mut T, &mut [u8]) + Sync),
    ) {
        let n = items.len().min(regions.len());
        if n == 1 {
            let region = &regions[0];
            let piece = region
                .start
                .checked_sub(base)
                .zip(region.end.checked_sub(base));
            if let Some(r) = piece.and_then(|(a, b)| buf.get_mut(a..b)) {
                f(first, &mut items[0], r);
            }
        } else if n > 1 {
            let mid = n / 2;
            let cut = regions[mid].start.saturating_sub(base).min(buf.len());
            let (ia, ib) = items[..n].split_at_mut(mid);
            let (ba, bb) = buf.split_at_mut(cut);
            let (ra, rb) = regions[..n].split_at(mid);
            self.join(
                || self.regions_from(first, ia, ba, base, ra, f),
                || self.regions_from(first + mid, ib, bb, base + cut, rb, f),
            );
        }
    }

    /// `a()` and `b()`, both done when this returns.
    pub(crate) fn join(self, a: impl FnOnce() + Send, b: impl FnOnce() + Send) {
        match self {
            Exec::Serial => {
                a();
                b();
            }
            Exec::Pool => {
                rayon::join(a, b);
            }
        }
    }

    /// CRC-32 of `bytes` (as `crc32fast::hash`); on the pool, pieces of 1 MiB combined.
    pub(crate) fn crc32(self, bytes: &[u8]) -> u32 {
        const PIECE: usize = 1 << 20;
        if self == Exec::Serial || bytes.len() < 2 * PIECE {
            return crc32fast::hash(bytes);
        }
        bytes
            .par_chunks(PIECE)
            .map(|c| {
                let mut h = crc32fast::Hasher::new();
                h.update(c);
                h
            })
            .reduce(crc32fast::Hasher::new, |mut a, b| {
                a.combine(&b);
                a
            })
            .finalize()
    }
}

#[cfg(test)]
mod tests {
    use super::{Exec, Parallelism};

    /// Whether a call made now on a model of `elements` elements runs on rayon's pool.
    fn is_parallel_for(p: Parallelism, elements: usize) -> bool {
        p.exec_for(elements) == Exec::Pool
    }

    #[test]
    fn largest_first_visits_every_item_once_and_names_the_first_error_in_item_order() {
        // Sizes in no order; items 2, 5 and 6 fail. Item 6 is the largest (it starts first on
        // the pool), item 2 the first in order.
        let sizes = [3usize, 9, 1, 7, 4, 2, 50, 8];
        for exec in [Exec::Serial, Exec::Pool] {
            let mut seen = vec![0u32; sizes.len()];
            exec.for_each_largest_first(&mut seen, |_| 0, |i, s| *s += 1 + i as u32);
            let want: Vec<u32> = (1..=sizes.len() as u32).collect();
            assert_eq!(seen, want, "{exec:?}");
            let mut items: Vec<(usize, u32)> = sizes.iter().map(|&n| (n, 0)).collect();
            exec.for_each_largest_first(&mut items, |(n, _)| *n, |i, (_, v)| *v = i as u32);
            assert!(items.iter().enumerate().all(|(i, (_, v))| *v == i as u32));
            let first = exec.first_err_largest_first(
                &sizes,
                |&n| n,
                |i, _| {
                    if [2, 5, 6].contains(&i) {
                        Err(i)
                    } else {
                        Ok(())
                    }
                },
            );
            assert_eq!(first, Err(2), "{exec:?}");
            let mut with: Vec<(usize, u32)> = sizes.iter().map(|&n| (n, 0)).collect();
            exec.for_each_with_largest_first(
                &mut with,
                |(n, _)| *n,
                || 7u32,
                |s, i, (_, v)| *v = *s + i as u32,
            );
            assert!(
                with.iter()
                    .enumerate()
                    .all(|(i, (_, v))| *v == 7 + i as u32)
            );
            assert_eq!(
                exec.first_err_largest_first(&sizes, |&n| n, |_, _| Ok::<(), usize>(())),
                Ok(())
            );
        }
    }

    #[test]
    fn auto_is_pooled_from_its_threshold_on_a_pool_of_several_threads() {
        const AUTO_MIN_ELEMENTS: usize = Parallelism::AUTO_MIN_ELEMENTS;
        assert_eq!(AUTO_MIN_ELEMENTS, 1 << 16);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(5)
            .build()
            .unwrap();
        pool.install(|| {
            assert!(is_parallel_for(Parallelism::Auto, usize::MAX));
            assert!(is_parallel_for(Parallelism::Auto, AUTO_MIN_ELEMENTS));
            assert!(!is_parallel_for(Parallelism::Auto, AUTO_MIN_ELEMENTS - 1));
            assert!(is_parallel_for(Parallelism::Parallel, 1));
            assert!(!is_parallel_for(Parallelism::Serial, usize::MAX));
        });
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        one.install(|| {
            assert!(!is_parallel_for(Parallelism::Auto, usize::MAX));
            assert!(is_parallel_for(Parallelism::Parallel, usize::MAX));
        });
    }
}

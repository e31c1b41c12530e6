//! The fast random-k draw (`randomk`) against the specification's Algorithm S loop
//! (`scalar::randomk_for_each`): the same indices for every length, k and key, and the same
//! again when the scan is cut into runs of any length with any bound at or above the count still
//! needed, with candidate buffers of any size.

use gradwire_core::randomk::{self, Candidate};
use gradwire_core::{rng, scalar};

fn spec(n: u64, k: u64, key: u64) -> Vec<u64> {
    let mut v = Vec::new();
    scalar::randomk_for_each(n, k, key, |i| v.push(i));
    v
}

fn fast(n: u64, k: u64, key: u64) -> Vec<u64> {
    let mut v = Vec::new();
    randomk::for_each(n, k, key, |i| v.push(i));
    v
}

/// A small deterministic generator for the test's choices.
struct Pick(u64);

impl Pick {
    fn below(&mut self, m: u64) -> u64 {
        self.0 += 1;
        if m == 0 { 0 } else { rng::mix64(self.0) % m }
    }
}

#[test]
fn every_k_of_short_tensors() {
    for n in 0..=300u64 {
        for k in [
            0,
            1,
            2,
            3,
            7,
            n / 3,
            n / 2,
            n.saturating_sub(1),
            n,
            n + 1,
            u64::MAX,
        ] {
            let key = rng::key(n, k, 9);
            assert_eq!(fast(n, k, key), spec(n, k, key), "n {n} k {k}");
        }
    }
}

#[test]
fn large_tensors_at_every_density() {
    for (n, k) in [
        (1_000_003u64, 10_000u64),
        (1_000_003, 1_000),
        (1_000_003, 1),
        (200_001, 100_000),
        (200_001, 199_990),
        (65_536, 65_535),
        (100_000, 100_000),
    ] {
        for seed in 0..2 {
            let key = rng::key(seed, 3, n);
            let want = spec(n, k, key);
            assert_eq!(want.len() as u64, k.min(n));
            assert_eq!(fast(n, k, key), want, "n {n} k {k} seed {seed}");
        }
    }
}

/// Cuts `0..n` into runs of random length, scans each with a bound of at least the count needed
/// at its start (known from the specification), through a buffer of `cap` candidates, and
/// resolves the lists in order.
fn in_runs(n: u64, k: u64, key: u64, pick: &mut Pick, cap: usize) -> Vec<u64> {
    let want = spec(n, k, key);
    let mut needed = k.min(n);
    let mut got = Vec::new();
    let mut start = 0u64;
    let mut buf = vec![Candidate::default(); cap];
    while start < n && needed > 0 {
        let end = (start + 1 + pick.below(3000)).min(n);
        // The count Algorithm S needs at `start`, from the specification's list.
        let at_start = k.min(n) - want.iter().filter(|&&i| i < start).count() as u64;
        assert_eq!(at_start, needed);
        let bound = match pick.below(3) {
            0 => needed,
            1 => needed + pick.below(50),
            _ => u64::MAX,
        };
        let mut i = start;
        let mut list = Vec::new();
        while i < end {
            let (count, next) = randomk::candidates(key, n, i, end, bound, &mut buf);
            assert!(next > i || count > 0, "no progress at {i}");
            assert!(buf[..count].iter().all(|c| c.index >= i && c.index < next));
            list.extend_from_slice(&buf[..count]);
            i = next;
        }
        randomk::resolve(&list, &mut needed, |i| got.push(i));
        start = end;
    }
    got
}

#[test]
fn runs_with_any_bound_and_buffer_give_the_same_indices() {
    let mut pick = Pick(1);
    for case in 0..300u64 {
        let n = pick.below(20_000);
        let k = match case % 4 {
            0 => pick.below(n + 2),
            1 => n / 100,
            2 => n.saturating_sub(pick.below(10)),
            _ => pick.below(5),
        };
        let cap = [8usize, 9, 15, 64, 4096][pick.below(5) as usize];
        let key = rng::key(case, 1, 2);
        assert_eq!(
            in_runs(n, k, key, &mut pick, cap),
            spec(n, k, key),
            "case {case}: n {n} k {k} cap {cap}"
        );
    }
}

#[test]
fn candidates_are_exactly_the_scaled_draws_below_the_bound() {
    let (n, key) = (5_000u64, rng::key(4, 4, 4));
    for bound in [0u64, 1, 10, 100, 5_000, u64::MAX] {
        let mut buf = vec![Candidate::default(); 5_000];
        let (count, next) = randomk::candidates(key, n, 17, 4_321, bound, &mut buf);
        assert_eq!(next, 4_321);
        let want: Vec<Candidate> = (17..4_321)
            .map(|i| Candidate {
                index: i,
                h: ((rng::draw(key, i) as u128 * (n - i) as u128) >> 64) as u64,
            })
            .filter(|c| c.h < bound)
            .collect();
        assert_eq!(&buf[..count], &want[..], "bound {bound}");
    }
    // A run past the end of the tensor stops at n; an empty buffer scans nothing.
    let mut buf = vec![Candidate::default(); 16];
    assert_eq!(
        randomk::candidates(key, n, n - 3, n + 100, u64::MAX, &mut buf),
        (3, n)
    );
    assert_eq!(
        randomk::candidates(key, n, 10, 20, u64::MAX, &mut []),
        (0, 10)
    );
}

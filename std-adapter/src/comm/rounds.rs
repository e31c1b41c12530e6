//! Splitting a variable-size all-gather into rounds whose total fits a byte budget.
//!
//! MPI counts and displacements are `i32`, so one `MPI_Allgatherv` moves at most `i32::MAX`
//! bytes in all. Every rank knows every length (they are exchanged first) and the budget, and
//! runs this same deterministic plan, so all ranks agree on every round without talking.
//!
//! A round fills the budget greedily in rank order: each rank contributes the next window of its
//! buffer, as much as the remaining budget allows. Every round but the last is therefore full,
//! and the number of rounds is `ceil(total / budget)` (none when every buffer is empty).

/// Cursor over the rounds of one all-gather.
#[derive(Debug, Default)]
pub(crate) struct Rounds {
    /// Bytes of each rank already gathered.
    done: Vec<usize>,
}

impl Rounds {
    /// Starts a plan for `world_size` ranks.
    pub(crate) fn start(&mut self, world_size: usize) {
        self.done.clear();
        self.done.resize(world_size, 0);
    }

    /// Plans the next round: writes each rank's window length into `counts` and returns
    /// the round's total (0 when everything has been gathered). `budget` must be at least 1.
    /// `lens` and `counts` have one entry per rank, like the plan.
    pub(crate) fn next(&mut self, lens: &[usize], budget: usize, counts: &mut [usize]) -> usize {
        let mut left = budget.max(1);
        for ((&len, done), count) in lens.iter().zip(&mut self.done).zip(counts.iter_mut()) {
            let take = len.saturating_sub(*done).min(left);
            *count = take;
            *done += take;
            left -= take;
        }
        budget.max(1) - left
    }

    /// Where this round's window of `rank` starts in its buffer, given the counts that
    /// [`Rounds::next`] just wrote.
    pub(crate) fn window_start(&self, rank: usize, counts: &[usize]) -> Option<usize> {
        let done = *self.done.get(rank)?;
        done.checked_sub(*counts.get(rank)?)
    }
}

#[cfg(test)]
mod tests {
    use super::Rounds;

    /// Runs a whole plan and reassembles the buffers from the windows.
    fn reassemble(lens: &[usize], budget: usize) -> (Vec<Vec<usize>>, usize) {
        let mut rounds = Rounds::default();
        rounds.start(lens.len());
        let mut counts = vec![0; lens.len()];
        let mut got: Vec<Vec<usize>> = vec![Vec::new(); lens.len()];
        let mut n = 0;
        loop {
            let total = rounds.next(lens, budget, &mut counts);
            if total == 0 {
                break;
            }
            n += 1;
            assert!(total <= budget.max(1));
            assert_eq!(total, counts.iter().sum::<usize>());
            for (rank, &count) in counts.iter().enumerate() {
                let start = rounds.window_start(rank, &counts).unwrap();
                assert_eq!(start, got[rank].len(), "windows are contiguous");
                got[rank].extend(start..start + count);
            }
        }
        (got, n)
    }

    #[test]
    fn every_byte_exactly_once_in_order() {
        let cases: &[&[usize]] = &[
            &[],
            &[0],
            &[0, 0, 0],
            &[5],
            &[3, 0, 7, 1],
            &[10, 10, 10, 10],
            &[0, 23, 0, 1, 64, 2],
        ];
        for lens in cases {
            let total: usize = lens.iter().sum();
            for budget in [1, 2, 3, 5, 7, 16, 64, 1000] {
                let (got, n) = reassemble(lens, budget);
                for (rank, &len) in lens.iter().enumerate() {
                    assert_eq!(got[rank], (0..len).collect::<Vec<_>>(), "{lens:?} {budget}");
                }
                assert_eq!(n, total.div_ceil(budget), "{lens:?} {budget}");
            }
        }
    }

    #[test]
    fn zero_budget_is_treated_as_one() {
        let (got, n) = reassemble(&[2, 1], 0);
        assert_eq!(n, 3);
        assert_eq!(got, vec![vec![0, 1], vec![0]]);
    }

    #[test]
    fn huge_lengths_do_not_overflow() {
        let lens = [usize::MAX, usize::MAX];
        let mut rounds = Rounds::default();
        rounds.start(2);
        let mut counts = [0; 2];
        let budget = i32::MAX as usize;
        assert_eq!(rounds.next(&lens, budget, &mut counts), budget);
        assert_eq!(counts, [budget, 0]);
        assert_eq!(rounds.window_start(0, &counts), Some(0));
    }
}

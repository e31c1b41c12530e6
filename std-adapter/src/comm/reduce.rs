//! The rank-order dense f32 sum of [`Communicator::all_reduce_sum_f32`]: a reduce-scatter
//! through the all-to-all (shard `j` of every rank to rank `j`, summed there in rank order),
//! then an all-gather of the sums. A transport may move the shards on another schedule (MPI
//! exchanges them pairwise), but every one cuts them with [`shard`], sums them with
//! [`add_in_rank_order`] and counts them with [`logical_traffic`], so every rank and every
//! transport gets the same bits and the same byte counts.

use super::{CommError, Communicator};

/// Shard `j` of `n` elements over `w` ranks: `j * n / w .. (j + 1) * n / w`.
pub(crate) fn shard(n: usize, w: usize, j: usize) -> std::ops::Range<usize> {
    let at = |j: usize| ((j as u128 * n as u128) / w.max(1) as u128) as usize;
    at(j)..at(j + 1)
}

/// Adds rank `r`'s values of a shard to `sum`, which holds the sum of ranks `0..r` (anything
/// when `r == 0`: rank 0's values replace it, so that one rank's sum is its values, -0.0
/// included). Called for `r = 0, 1, ..` in turn, it gives `((x_0 + x_1) + x_2) + ...` in f32.
pub(crate) fn add_in_rank_order(sum: &mut [f32], r: usize, vals: impl Iterator<Item = f32>) {
    for (s, v) in sum.iter_mut().zip(vals) {
        *s = if r == 0 { v } else { *s + v };
    }
}

/// The bytes one [`Communicator::all_reduce_sum_f32`] of `n` elements counts on rank `me` of
/// `w`, each way (sent and received are equal): the all-to-all's shards and the all-gather's
/// sums, each with its 8-byte length or verdict word, and both calls' length exchanges.
pub(crate) fn logical_traffic(n: usize, w: usize, me: usize) -> super::Traffic {
    let message = |j: usize| 8 + 4 * shard(n, w, j).len() as u64;
    let peers = w.saturating_sub(1) as u64;
    let others: u64 = (0..w).filter(|&j| j != me).map(message).sum();
    let each_way = others + peers * message(me) + 2 * super::Traffic::LENGTHS * peers;
    super::Traffic {
        sent: each_way,
        received: each_way,
    }
}

/// Appends `x` to `out` as little-endian bytes: one copy on a little-endian target.
fn append_bytes(x: &[f32], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(x));
    } else {
        out.reserve(4 * x.len());
        for v in x {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// Little-endian f32 `bytes` (a multiple of 4 long) as a slice of f32, where they can be read
/// as one without a copy: on a little-endian target, when the bytes are aligned for f32 (a
/// message's values follow its 8-byte word, and allocators align buffers at least that far).
fn as_values(bytes: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "little") {
        bytemuck::try_cast_slice(bytes).ok()
    } else {
        None
    }
}

/// The f32 values of little-endian `bytes` (a multiple of 4 long), decoded one by one.
fn le_values(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// The default [`Communicator::all_reduce_sum_f32`].
pub(crate) fn sum_f32<C: Communicator + ?Sized>(
    comm: &mut C,
    x: &mut [f32],
) -> Result<(), CommError> {
    let (w, me, n) = (comm.world_size(), comm.rank(), x.len());
    // Phase 1: shard j to rank j, with this rank's length in front, so that a rank whose
    // length differs is named on every rank.
    let mut send = vec![Vec::new(); w];
    for (j, buf) in send.iter_mut().enumerate() {
        let range = shard(n, w, j);
        buf.reserve_exact(8 + 4 * range.len());
        buf.extend_from_slice(&(n as u64).to_le_bytes());
        append_bytes(&x[range], buf);
    }
    // A shard holds at most n / W + 1 elements of the largest length any rank may have; the
    // receivers check the lengths below, so the limit only bounds memory.
    let limit = 8 + 4 * (n / w.max(1) + 1);
    let mut got = Vec::new();
    comm.all_to_all(&send, limit, &mut got)?;
    let declared = |b: &[u8]| {
        b.get(..8)
            .and_then(|h| h.try_into().ok())
            .map(u64::from_le_bytes)
    };
    // Shard `me` of every rank, summed in rank order (rank 0's values first, so that one
    // rank's sum is its values, -0.0 included). A message of another count, or with more or
    // fewer values than the shard, is refused: summing what is there would be a wrong answer.
    let mine = shard(n, w, me);
    let first_bad = (0..w).find(|&r| {
        got.get(r)
            .is_none_or(|b| declared(b) != Some(n as u64) || b.len() != 8 + 4 * mine.len())
    });
    let mut sum = vec![0.0f32; mine.len()];
    if first_bad.is_none() {
        for (r, b) in got.iter().enumerate() {
            match as_values(&b[8..]) {
                Some(vals) => add_in_rank_order(&mut sum, r, vals.iter().copied()),
                None => add_in_rank_order(&mut sum, r, le_values(&b[8..])),
            }
        }
    }
    // Phase 2: the sums, behind a verdict word: 0 when every length matched, else 1 + the
    // first rank whose length differs from this one's.
    let verdict: u64 = first_bad.map_or(0, |r| 1 + r as u64);
    let mut msg = Vec::with_capacity(8 + 4 * sum.len());
    msg.extend_from_slice(&verdict.to_le_bytes());
    append_bytes(&sum, &mut msg);
    let mut all = Vec::new();
    comm.all_gather(&msg, limit, &mut all)?;
    if let Some((r, v)) = all.iter().enumerate().find_map(|(r, b)| {
        let v = declared(b).unwrap_or(u64::MAX);
        (v != 0).then_some((r, v))
    }) {
        return Err(CommError::Mismatch {
            round: 0,
            detail: format!(
                "all_reduce_sum_f32: rank {r} got another element count, or a shard of \
                 another length, from rank {}",
                v.saturating_sub(1)
            ),
        });
    }
    // Every sum checked before any is written, so that a failed call leaves `x` as it was.
    if let Some(j) = (0..w).find(|&j| {
        all.get(j)
            .is_none_or(|b| b.len() != 8 + 4 * shard(n, w, j).len())
    }) {
        return Err(CommError::Mismatch {
            round: 0,
            detail: format!("all_reduce_sum_f32: rank {j} sent a sum of another length"),
        });
    }
    for (j, b) in all.iter().enumerate() {
        let dst = &mut x[shard(n, w, j)];
        match as_values(&b[8..]) {
            Some(vals) => dst.copy_from_slice(vals),
            None => dst
                .iter_mut()
                .zip(le_values(&b[8..]))
                .for_each(|(d, v)| *d = v),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{logical_traffic, shard};
    use crate::comm::{Communicator, LocalGroup};

    /// A communicator with only the byte collectives of `LocalCommunicator`: its
    /// `all_reduce_sum_f32` is the trait's default path.
    struct Plain(crate::comm::LocalCommunicator);

    impl Communicator for Plain {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn all_gather(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), crate::comm::CommError> {
            self.0.all_gather(local, max_len, out)
        }
        fn all_to_all(
            &mut self,
            send: &[Vec<u8>],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), crate::comm::CommError> {
            self.0.all_to_all(send, max_len, out)
        }
        fn traffic(&self) -> crate::comm::Traffic {
            self.0.traffic()
        }
    }

    /// Rank `r`'s values: magnitudes far apart, so that the order of additions shows.
    fn values(r: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let e = ((i * 7 + r * 13) % 40) as i32 - 20;
                let sign = if (i + r).is_multiple_of(3) { -1.0 } else { 1.0 };
                sign * (1.0 + (i % 17) as f32 / 17.0) * 2f32.powi(e)
            })
            .collect()
    }

    /// What a transport that moves the shards on its own schedule (`LocalGroup`'s typed sum,
    /// MPI's pairwise exchange) counts is what the all-to-all and all-gather of the default
    /// path count, and both give the same bits.
    #[test]
    fn logical_traffic_is_the_default_paths_count() {
        for (n, w) in [(0, 1), (1, 3), (10, 4), (1001, 5)] {
            let run = |plain: bool| {
                let handles: Vec<_> = LocalGroup::new(w)
                    .into_communicators()
                    .into_iter()
                    .map(|comm| {
                        std::thread::spawn(move || {
                            let me = comm.rank();
                            let mut x = values(me, n);
                            let traffic = if plain {
                                let mut comm = Plain(comm);
                                comm.all_reduce_sum_f32(&mut x).unwrap();
                                comm.traffic()
                            } else {
                                let mut comm = comm;
                                comm.all_reduce_sum_f32(&mut x).unwrap();
                                comm.traffic()
                            };
                            (me, traffic, x)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            };
            let (default, typed) = (run(true), run(false));
            for ((me, traffic, x), (_, typed_traffic, typed_x)) in default.iter().zip(&typed) {
                let what = format!("n {n}, w {w}, rank {me}");
                assert_eq!(*traffic, logical_traffic(n, w, *me), "{what}");
                assert_eq!(*typed_traffic, *traffic, "{what}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(typed_x), bits(x), "{what}");
                let expected: Vec<f32> = (0..n)
                    .map(|i| (1..w).fold(values(0, n)[i], |acc, r| acc + values(r, n)[i]))
                    .collect();
                assert_eq!(bits(x), bits(&expected), "{what}");
            }
        }
    }

    #[test]
    fn shards_tile_the_elements() {
        for (n, w) in [(0, 1), (1, 4), (10, 3), (1000, 7), (5, 8)] {
            let mut at = 0;
            for j in 0..w {
                let r = shard(n, w, j);
                assert_eq!(r.start, at);
                at = r.end;
            }
            assert_eq!(at, n);
        }
    }
}

//! The rank-order dense f32 sum of [`Communicator::all_reduce_sum_f32`]: a reduce-scatter
//! through the all-to-all (shard `j` of every rank to rank `j`, summed there in rank order),
//! then an all-gather of the sums. Every transport runs this same code, so every rank and every
//! transport gets the same bits.

use super::{CommError, Communicator};

/// Shard `j` of `n` elements over `w` ranks: `j * n / w .. (j + 1) * n / w`.
pub(crate) fn shard(n: usize, w: usize, j: usize) -> std::ops::Range<usize> {
    let at = |j: usize| ((j as u128 * n as u128) / w.max(1) as u128) as usize;
    at(j)..at(j + 1)
}

/// Appends `x` to `out` as little-endian bytes.
fn append_bytes(x: &[f32], out: &mut Vec<u8>) {
    out.reserve(4 * x.len());
    for v in x {
        out.extend_from_slice(&v.to_le_bytes());
    }
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
    let first_bad = got.iter().position(|b| declared(b) != Some(n as u64));
    // Shard `me` of every rank, summed in rank order (rank 0's values first, so that one
    // rank's sum is its values, -0.0 included).
    let mine = shard(n, w, me);
    let mut sum = vec![0.0f32; mine.len()];
    if first_bad.is_none() {
        for (r, b) in got.iter().enumerate() {
            let vals = b[8..]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            for (s, v) in sum.iter_mut().zip(vals) {
                *s = if r == 0 { v } else { *s + v };
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
                "all_reduce_sum_f32: rank {r} got another element count from rank {} than its own",
                v.saturating_sub(1)
            ),
        });
    }
    for (j, b) in all.iter().enumerate() {
        let range = shard(n, w, j);
        let vals = b.get(8..).unwrap_or(&[]);
        if vals.len() != 4 * range.len() {
            return Err(CommError::Mismatch {
                round: 0,
                detail: format!("all_reduce_sum_f32: rank {j} sent a sum of another length"),
            });
        }
        for (d, c) in x[range].iter_mut().zip(vals.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::shard;

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

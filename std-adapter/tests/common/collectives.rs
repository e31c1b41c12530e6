//! Checks of the all-to-all, the rank-order f32 sum and the traffic counters that every
//! transport must pass: run on threads by `tests/comm_local.rs` and under `mpirun` by
//! `examples/mpi_selftest.rs`, the same code on both, so that both transports are held to the
//! same results.

use gradwire::comm::{CommError, Communicator, Traffic};

/// The bytes `src` sends to `dst` in `case`, `len` of them.
fn message(case: usize, src: usize, dst: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (case.wrapping_mul(131) ^ src.wrapping_mul(29) ^ dst.wrapping_mul(7) ^ i) as u8)
        .collect()
}

/// The f32 values rank `r` contributes to the sum of `case`: magnitudes far apart, so that the
/// order of the additions shows in the bits.
pub fn contribution(case: usize, r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let e = ((i * 7 + r * 13 + case) % 40) as i32 - 20;
            let sign = if (i + r).is_multiple_of(3) { -1.0 } else { 1.0 };
            sign * (1.0 + (i % 17) as f32 / 17.0) * 2f32.powi(e)
        })
        .collect()
}

/// The rank-order sum every transport must give: `((x_0 + x_1) + x_2) + ...`.
pub fn rank_order_sum(case: usize, w: usize, n: usize) -> Vec<f32> {
    let mut sum = contribution(case, 0, n);
    for r in 1..w {
        for (s, v) in sum.iter_mut().zip(contribution(case, r, n)) {
            *s += v;
        }
    }
    sum
}

/// What rank `me` of `w` sends each rank in all-to-all case `case`.
fn messages_of(
    case: usize,
    w: usize,
    me: usize,
    len: &impl Fn(usize, usize) -> usize,
) -> Vec<Vec<u8>> {
    (0..w)
        .map(|dst| message(case, me, dst, len(me, dst)))
        .collect()
}

/// One all-to-all of `len(src, dst)` bytes from every `src` to every `dst`, checked.
fn all_to_all_case<C: Communicator>(
    comm: &mut C,
    case: usize,
    len: impl Fn(usize, usize) -> usize,
) -> Result<(), String> {
    let (w, me) = (comm.world_size(), comm.rank());
    let send = messages_of(case, w, me, &len);
    let mut out = Vec::new();
    comm.all_to_all(&send, 1 << 20, &mut out)
        .map_err(|e| format!("all_to_all case {case}: {e}"))?;
    if out.len() != w {
        return Err(format!("all_to_all case {case}: {} buffers", out.len()));
    }
    for (src, got) in out.iter().enumerate() {
        if *got != message(case, src, me, len(src, me)) {
            return Err(format!(
                "all_to_all case {case}: wrong bytes from rank {src}"
            ));
        }
    }
    Ok(())
}

/// As [`all_to_all_case`] through `all_to_all_append`: borrowed buffers sent, each one received
/// appended after the bytes already in its output buffer, and the traffic of an `all_to_all`.
fn all_to_all_append_case<C: Communicator>(
    comm: &mut C,
    case: usize,
    len: impl Fn(usize, usize) -> usize,
) -> Result<(), String> {
    let (w, me) = (comm.world_size(), comm.rank());
    let send = messages_of(case, w, me, &len);
    let slices: Vec<&[u8]> = send.iter().map(Vec::as_slice).collect();
    let prefix = |src: usize| vec![0xa5u8; src + 1];
    let mut out: Vec<Vec<u8>> = (0..w).map(prefix).collect();
    let before = comm.traffic();
    comm.all_to_all_append(&slices, 1 << 20, &mut out)
        .map_err(|e| format!("all_to_all_append case {case}: {e}"))?;
    let appended = comm.traffic().since(before);
    if out.len() != w {
        return Err(format!(
            "all_to_all_append case {case}: {} buffers",
            out.len()
        ));
    }
    for (src, got) in out.iter().enumerate() {
        let mut want = prefix(src);
        want.extend(message(case, src, me, len(src, me)));
        if *got != want {
            return Err(format!(
                "all_to_all_append case {case}: wrong bytes from rank {src}"
            ));
        }
    }
    let before = comm.traffic();
    all_to_all_case(comm, case, len)?;
    if comm.traffic().since(before) != appended {
        return Err(format!(
            "all_to_all_append case {case}: traffic {appended:?}, all_to_all's {:?}",
            comm.traffic().since(before)
        ));
    }
    Ok(())
}

/// Every check; `Err` names the first that failed.
pub fn run_all<C: Communicator>(comm: &mut C) -> Result<(), String> {
    let (w, me) = (comm.world_size(), comm.rank());
    let before = comm.traffic();
    // All-to-all of rank-dependent sizes, empty ones, and one sender sending nothing.
    all_to_all_case(comm, 1, |s, d| 10 * s + d)?;
    all_to_all_case(comm, 2, |_, _| 0)?;
    all_to_all_case(comm, 3, |s, d| if s == 1 % w { 0 } else { 300 + s * d })?;
    // Traffic of those three calls: what this rank addressed to peers and received from them,
    // plus 16 bytes each way per peer per call.
    let sent: usize = (0..w)
        .filter(|&d| d != me)
        .map(|d| 10 * me + d + if me == 1 % w { 0 } else { 300 + me * d })
        .sum();
    let received: usize = (0..w)
        .filter(|&s| s != me)
        .map(|s| 10 * s + me + if s == 1 % w { 0 } else { 300 + s * me })
        .sum();
    let header = 3 * 16 * (w as u64 - 1);
    let want = Traffic {
        sent: sent as u64 + header,
        received: received as u64 + header,
    };
    if comm.traffic().since(before) != want {
        return Err(format!(
            "traffic: {:?}, expected {want:?}",
            comm.traffic().since(before)
        ));
    }
    // One rank sends one byte too many to the last rank: every rank fails alike.
    let last = w - 1;
    let send: Vec<Vec<u8>> = (0..w)
        .map(|d| vec![0u8; if me == 0 && d == last { 11 } else { 3 }])
        .collect();
    let mut out = Vec::new();
    match comm.all_to_all(&send, 10, &mut out) {
        Err(CommError::TooLarge {
            rank: 0,
            len: 11,
            limit: 10,
        }) => {}
        other => return Err(format!("all_to_all too large: {other:?}")),
    }
    all_to_all_case(comm, 4, |s, d| s + d + 1)?;
    all_to_all_append_case(comm, 10, |s, d| 7 * s + 3 * d + 1)?;
    all_to_all_append_case(comm, 11, |s, _| if s == 0 { 0 } else { 40 })?;
    // The last rank passes one element more: every rank fails alike, and the group stays
    // usable for the sums below.
    let mut x = vec![1.0f32; 10 + usize::from(me == w - 1)];
    match comm.all_reduce_sum_f32(&mut x) {
        Err(CommError::Mismatch { .. }) if w > 1 => {}
        Ok(()) if w == 1 => {}
        other => return Err(format!("all_reduce_sum_f32 of other lengths: {other:?}")),
    }
    // The rank-order sum, bit for bit, for lengths below, at and above the world size, and
    // its traffic: every rank's shard `j` (`j n / W .. (j + 1) n / W`) to rank `j` and the sums
    // back, each message with an 8-byte word in front, and two length exchanges.
    for (case, n) in [(5, 0), (6, 1), (7, w), (8, 1000), (9, 3 * w + 1)] {
        let before = comm.traffic();
        let mut x = contribution(case, me, n);
        comm.all_reduce_sum_f32(&mut x)
            .map_err(|e| format!("all_reduce_sum_f32 n {n}: {e}"))?;
        let want = rank_order_sum(case, w, n);
        if x.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()) || x.len() != n {
            return Err(format!("all_reduce_sum_f32 n {n}: not the rank-order sum"));
        }
        let message = |j: usize| (8 + 4 * ((j + 1) * n / w - j * n / w)) as u64;
        let each_way = (0..w).filter(|&j| j != me).map(message).sum::<u64>()
            + (w as u64 - 1) * (message(me) + 32);
        let want = Traffic {
            sent: each_way,
            received: each_way,
        };
        if comm.traffic().since(before) != want {
            return Err(format!(
                "all_reduce_sum_f32 n {n} traffic: {:?}, expected {want:?}",
                comm.traffic().since(before)
            ));
        }
    }
    Ok(())
}

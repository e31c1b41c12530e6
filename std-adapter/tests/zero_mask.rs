//! Sign with a zero mask across ranks: coordinates that are zero on every rank come out zero,
//! step after step, inside mixed blocks, for EF-sign (mean) and majority vote, through the
//! all-gather and the two-phase collective on threads; zeros on some ranks only abstain.

#[path = "common/ranks.rs"]
mod ranks;

use std::collections::HashMap;

use gradwire::comm::{Communicator, LocalGroup};
use gradwire::core::{Method, SignScale};
use gradwire::{Collective, CompressedAllReduce, CompressionMethod, Reduction, Tensor, method};
use ranks::run_ranks;

const W: usize = 4;
const N: usize = 3000;

/// Zero on every rank at every step: a stretch across two mask blocks of 1024 (both mixed)
/// and every 97th coordinate.
fn dead(i: usize) -> bool {
    (1000..1900).contains(&i) || i.is_multiple_of(97)
}

/// Rank `rank`'s gradient at `step`: dead coordinates zero; coordinates `i % 13 == 5` zero on
/// rank 0 only (it abstains there); the rest a deterministic mix of signs.
fn gradient(rank: usize, step: u64, i: usize) -> f32 {
    if dead(i) || (rank == 0 && i % 13 == 5) {
        return 0.0;
    }
    let h = (i as u64 + 1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((rank as u64 + 1) * 0xD1B5_4A32_D192_ED03)
        .wrapping_add(step * 0x94D0_49BB_1331_11EB);
    let h = h ^ (h >> 29);
    ((h % 2001) as f32 - 1000.5) / 512.0
}

fn grads(rank: usize, step: u64) -> HashMap<String, Tensor> {
    let g: Vec<f32> = (0..N).map(|i| gradient(rank, step, i)).collect();
    HashMap::from([("emb.weight".to_owned(), Tensor::vector(g))])
}

fn masked(scale: SignScale) -> Method {
    Method::Sign {
        scale,
        zero_mask: true,
    }
}

/// Runs `steps` steps on W threads; returns each rank's results, step by step.
fn run(
    method: CompressionMethod,
    reduction: Reduction,
    collective: Collective,
    steps: u64,
) -> Vec<Vec<Vec<f32>>> {
    run_ranks(LocalGroup::new(W).into_communicators(), move |comm| {
        let rank = comm.rank();
        let mut ar = CompressedAllReduce::with_communicator(method.clone(), Box::new(comm))
            .with_reduction(reduction)
            .with_collective(collective);
        (0..steps)
            .map(|s| {
                let out = ar.all_reduce(&grads(rank, s)).unwrap();
                assert_eq!(ar.collective_in_use(), Some(collective));
                out["emb.weight"].data().to_vec()
            })
            .collect()
    })
}

#[test]
fn majority_vote_with_the_mask_keeps_dead_coordinates_at_zero() {
    let method = CompressionMethod::Core(masked(SignScale::None));
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let results = run(method.clone(), Reduction::MajorityVote, collective, 5);
        for (s, out) in results[0].iter().enumerate() {
            for rank in &results[1..] {
                assert_eq!(&rank[s], out, "{collective:?}: ranks differ at step {s}");
            }
            for (i, &x) in out.iter().enumerate() {
                // The vote of the ranks whose coordinate is not zero; a tie gives 0.
                let sum: i32 = (0..W)
                    .map(|r| match gradient(r, s as u64, i) {
                        v if v > 0.0 => 1,
                        v if v < 0.0 => -1,
                        _ => 0,
                    })
                    .sum();
                let want = f32::from(i8::try_from(sum.signum()).unwrap());
                assert_eq!(x, want, "{collective:?} step {s}: coordinate {i}");
                if dead(i) {
                    assert_eq!(x.to_bits(), 0, "{collective:?} step {s}: {i}");
                }
            }
        }
    }
}

#[test]
fn ef_sign_with_the_mask_keeps_dead_coordinates_at_zero() {
    let method =
        CompressionMethod::Core(masked(SignScale::MeanAbs { block: 1024 })).with_error_feedback();
    let unmasked = CompressionMethod::SignSGD.with_error_feedback();
    for collective in [Collective::AllGather, Collective::TwoPhase] {
        let results = run(method.clone(), Reduction::Mean, collective, 6);
        let plain = run(unmasked.clone(), Reduction::Mean, collective, 6);
        for (s, out) in results[0].iter().enumerate() {
            for rank in &results[1..] {
                assert_eq!(&rank[s], out, "{collective:?}: ranks differ at step {s}");
            }
            for (i, &x) in out.iter().enumerate() {
                if dead(i) {
                    assert_eq!(x, 0.0, "{collective:?} step {s}: coordinate {i}");
                } else if i % 13 != 5 {
                    assert_ne!(x, 0.0, "{collective:?} step {s}: coordinate {i}");
                }
            }
            // Without the mask the dead coordinates move (the fault this mode fixes).
            let moved = plain[0][s]
                .iter()
                .enumerate()
                .filter(|&(i, &x)| dead(i) && x != 0.0);
            assert!(moved.count() > 100, "{collective:?} step {s}");
        }
    }
}

#[test]
fn the_method_text_carries_the_mask() {
    for m in [
        masked(SignScale::None),
        masked(SignScale::MeanAbs { block: 1024 }),
    ] {
        let text = method::format(&m);
        assert!(text.ends_with(" mask=zeros"), "{text}");
        assert_eq!(method::parse(&text).unwrap(), m);
    }
    // Texts written before the mask existed read as before.
    assert_eq!(
        method::parse("sign scale=none").unwrap(),
        Method::Sign {
            scale: SignScale::None,
            zero_mask: false
        }
    );
    assert!(method::parse("sign scale=none mask=ones").is_err());
    let err = method::parse("sign scale=mean-abs:12 mask=zeros").unwrap_err();
    assert!(err.to_string().contains("multiple of 8"), "{err}");
}

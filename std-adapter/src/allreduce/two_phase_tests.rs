//! The two-phase shard-owner collective and the dense f32 all-reduce, over LocalGroup threads:
//! bit-identity with the all-gather where the method allows it, both invariants of nothing
//! lost, the T-step conservation, resume, bytes per link, and faults (every rank errors, none
//! hangs). (Moved from `tests/two_phase.rs`: it reads the server residuals through the
//! crate-private `server_residual` and sets them with `set_server_residuals`.)

use std::collections::HashMap;

use super::test_collectives::contribution;
use super::test_common::{self as common, Rng, grads, minilm, same_bits};
use gradwire::comm::{CommError, Communicator, LocalGroup, Traffic};
use gradwire::core::{K, Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{
    Aggregator, BucketConfig, Collective, CompressedAllReduce, CompressionMethod, Error,
    GradientCompressor, Manifest, Parallelism, Reduction,
};

/// Rank `r`'s gradients at step `s`: a few tensors of several sizes (one smaller than a
/// block, one not a multiple of a block), clustered non-zeros in one of them.
fn gradients(r: usize, s: u64) -> HashMap<String, Tensor> {
    let mut rng = Rng(1000 * r as u64 + s + 1);
    let mut clustered = vec![0.0f32; 5000];
    for x in &mut clustered[..700] {
        *x = rng.unit();
    }
    grads(&[
        ("a.weight", &[40, 130], rng.vec(5200, 1.0)),
        ("b.bias", &[100], rng.vec(100, 0.5)),
        ("c.embed", &[50, 100], clustered),
        ("d.weight", &[3000], rng.vec(3000, 2.0)),
    ])
}

/// Whether `ar`'s worker residuals hold `g` (they were zeros before a step that failed in the
/// collective and gave back what it sent: the gradient is delayed, not lost, up to the f32
/// rounding of `(g - sent) + sent`).
fn residuals_hold(ar: &CompressedAllReduce, g: &HashMap<String, Tensor>) -> bool {
    let Some(fb) = ar.compressor().feedback() else {
        return false;
    };
    g.iter().all(|(name, t)| {
        fb.residual(name).is_some_and(|r| {
            r.len() == t.data().len()
                && r.iter()
                    .zip(t.data())
                    .all(|(a, b)| (a - b).abs() <= 1e-6 * (1.0 + b.abs()))
        })
    })
}

/// Runs `steps` steps on `w` threads; each thread builds its all-reduce with `make`, and
/// `grads_of(rank, step)` gives its gradients. Returns, per rank, per step, the result (or the
/// error's text) and the traffic of the step.
#[allow(clippy::type_complexity)]
fn run_group(
    w: usize,
    steps: u64,
    make: impl Fn(Box<dyn Communicator>) -> CompressedAllReduce + Send + Sync + Clone + 'static,
    grads_of: impl Fn(usize, u64) -> HashMap<String, Tensor> + Send + Sync + Copy + 'static,
) -> Vec<Vec<(Result<HashMap<String, Tensor>, String>, Traffic)>> {
    let comms = LocalGroup::new(w).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let make = make.clone();
            std::thread::spawn(move || {
                let mut ar = make(Box::new(comm));
                let mut out = Vec::new();
                for s in 0..steps {
                    let before = ar.traffic();
                    let r = ar.all_reduce(&grads_of(rank, s)).map_err(|e| e.to_string());
                    out.push((r, ar.traffic().since(before)));
                }
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn flat(m: &HashMap<String, Tensor>) -> Vec<f32> {
    let mut names: Vec<&String> = m.keys().collect();
    names.sort();
    names
        .into_iter()
        .flat_map(|n| m[n].data().to_vec())
        .collect()
}

/// The all-gather's rank-order mean of the ranks' bundles of `method` at step 0.
fn all_gather_mean(method: &CompressionMethod, w: usize, reduction: Reduction) -> Vec<f32> {
    let g0 = gradients(0, 0);
    let manifest = Manifest::for_gradients(&g0, method, 0, BucketConfig::none()).unwrap();
    let bundles: Vec<Vec<u8>> = (0..w)
        .map(|r| {
            let mut c = GradientCompressor::new(method.clone());
            let mut b = Vec::new();
            c.compress_bundle(&manifest, &gradients(r, 0), r, &mut b)
                .unwrap();
            b
        })
        .collect();
    let mut out = Vec::new();
    Aggregator::serial()
        .aggregate_into(&manifest, &bundles, 0, reduction, &mut out)
        .unwrap();
    flat(&manifest.to_tensors(&out).unwrap())
}

#[test]
fn dense_f32_is_the_all_gathers_rank_order_mean_bit_for_bit_on_every_collective() {
    let dense = CompressionMethod::Core(Method::Dense {
        values: Values::F32,
    });
    let expected = all_gather_mean(&dense, 4, Reduction::Mean);
    for collective in [
        Collective::AllGather,
        Collective::TwoPhase,
        Collective::Auto,
    ] {
        let runs = run_group(
            4,
            1,
            move |c| {
                CompressedAllReduce::with_communicator(
                    CompressionMethod::Core(Method::Dense {
                        values: Values::F32,
                    }),
                    c,
                )
                .with_collective(collective)
            },
            gradients,
        );
        for (rank, steps) in runs.iter().enumerate() {
            let (result, traffic) = &steps[0];
            let got = flat(result.as_ref().unwrap());
            assert!(same_bits(&got, &expected), "{collective:?} rank {rank}");
            // A ring all-reduce's bytes: 2 (W - 1) / W x 4n, plus the 20-byte envelopes.
            let n = got.len() as u64;
            let ring = 2 * 3 * 4 * n / 4;
            assert!(
                // (the length exchanges of the protocol: a few hundred bytes)
                traffic.received <= ring + 1024 && traffic.received >= ring,
                "{collective:?} rank {rank}: {traffic:?}, ring {ring}"
            );
        }
    }
    // Top-k keeping everything in f32 through the two-phase shards: the same bits too.
    let all = CompressionMethod::Core(Method::TopK {
        k: K::Ratio(1.0),
        values: Values::F32,
    });
    let runs = run_group(
        4,
        1,
        |c| {
            CompressedAllReduce::with_communicator(
                CompressionMethod::Core(Method::TopK {
                    k: K::Ratio(1.0),
                    values: Values::F32,
                }),
                c,
            )
            .with_collective(Collective::TwoPhase)
        },
        gradients,
    );
    let expected_topk = all_gather_mean(&all, 4, Reduction::Mean);
    assert!(same_bits(&expected_topk, &expected));
    for steps in &runs {
        assert!(same_bits(&flat(steps[0].0.as_ref().unwrap()), &expected));
    }
}

#[test]
fn majority_vote_at_the_owner_is_the_all_gathers_bit_for_bit() {
    for w in [3, 5] {
        let expected = all_gather_mean(
            &CompressionMethod::SignSGDMajority,
            w,
            Reduction::MajorityVote,
        );
        let runs = run_group(
            w,
            1,
            |c| {
                CompressedAllReduce::with_communicator(CompressionMethod::SignSGDMajority, c)
                    .with_reduction(Reduction::MajorityVote)
                    .with_collective(Collective::TwoPhase)
            },
            gradients,
        );
        for steps in &runs {
            assert!(same_bits(&flat(steps[0].0.as_ref().unwrap()), &expected));
        }
    }
}

/// Top-k with f32 values and error feedback on both sides: per coordinate, the worker's
/// `sent + r_new == g + r_old` and the owner's `out + s_new == mean + s_old`, bit for bit, at
/// every step; over T steps `sum out + server residuals + (1/W) sum worker residuals ==
/// (1/W) sum gradients` to f32 rounding.
#[test]
fn nothing_is_lost_on_the_worker_or_at_the_owner() {
    const W: usize = 4;
    const T: u64 = 5;
    let method = || {
        CompressionMethod::Core(Method::TopK {
            k: K::Ratio(0.05),
            values: Values::F32,
        })
        .with_error_feedback()
    };
    let comms = LocalGroup::new(W).into_communicators();
    type Record = Vec<(
        HashMap<String, Vec<f32>>,                         // sent by the worker
        HashMap<String, Vec<f32>>,                         // result
        HashMap<String, (Vec<usize>, Vec<f32>, Vec<f32>)>, // server residual before, after
        HashMap<String, Vec<f32>>,                         // worker residual after
    )>;
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || -> Record {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                let mut record = Vec::new();
                for s in 0..T {
                    let g = gradients(rank, s);
                    let residual = |ar: &CompressedAllReduce, name: &str, n: usize| {
                        ar.compressor()
                            .feedback()
                            .and_then(|f| f.residual(name))
                            .map_or(vec![0.0; n], <[f32]>::to_vec)
                    };
                    let server = |ar: &CompressedAllReduce, name: &str| {
                        ar.server_residual(name)
                            .map(|(i, v)| (i, v.to_vec()))
                            .unwrap_or_default()
                    };
                    let before: HashMap<_, _> = g
                        .iter()
                        .map(|(n, t)| {
                            (
                                n.clone(),
                                (residual(&ar, n, t.data().len()), server(&ar, n)),
                            )
                        })
                        .collect();
                    let out = ar.all_reduce(&g).unwrap();
                    let mut sent = HashMap::new();
                    let mut servers = HashMap::new();
                    let mut residuals = HashMap::new();
                    for (name, t) in &g {
                        let r_new = residual(&ar, name, t.data().len());
                        let (r_old, (idx, s_old)) = &before[name];
                        // sent = g + r_old - r_new: exact for f32 values (x - 0 or x - x).
                        let s: Vec<f32> = t
                            .data()
                            .iter()
                            .zip(r_old)
                            .zip(&r_new)
                            .map(|((g, r), rn)| (g + r) - rn)
                            .collect();
                        for i in 0..s.len() {
                            assert_eq!(
                                (s[i] + r_new[i]).to_bits(),
                                (t.data()[i] + r_old[i]).to_bits(),
                                "worker {rank} {name}[{i}]"
                            );
                        }
                        sent.insert(name.clone(), s);
                        let (idx_new, s_new) = server(&ar, name);
                        let s_old = if s_old.is_empty() {
                            vec![0.0; idx_new.len()]
                        } else {
                            assert_eq!(idx, &idx_new);
                            s_old.clone()
                        };
                        servers.insert(name.clone(), (idx_new, s_old, s_new));
                        residuals.insert(name.clone(), r_new);
                    }
                    let result = out
                        .iter()
                        .map(|(n, t)| (n.clone(), t.data().to_vec()))
                        .collect();
                    record.push((sent, result, servers, residuals));
                }
                record
            })
        })
        .collect();
    let records: Vec<Record> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let names: Vec<String> = gradients(0, 0).keys().cloned().collect();
    for s in 0..T as usize {
        for name in &names {
            let n = records[0][s].0[name].len();
            // The owner reduced the workers' sent values: rank-order sum, divided once by W.
            let mut mean = vec![0.0f32; n];
            for rec in &records {
                for (m, x) in mean.iter_mut().zip(&rec[s].0[name]) {
                    *m += x;
                }
            }
            for m in &mut mean {
                *m /= W as f32;
            }
            let out = &records[0][s].1[name];
            for rec in &records {
                assert!(
                    same_bits(&rec[s].1[name], out),
                    "every rank the same result"
                );
            }
            let mut covered = 0;
            for (owner, rec) in records.iter().enumerate() {
                let (idx, s_old, s_new) = &rec[s].2[name];
                covered += idx.len();
                for (j, &i) in idx.iter().enumerate() {
                    assert_eq!(
                        (out[i] + s_new[j]).to_bits(),
                        (s_old[j] + mean[i]).to_bits(),
                        "owner {owner} step {s} {name}[{i}]"
                    );
                }
            }
            assert_eq!(covered, n, "the shards cover {name}");
        }
    }
    // Conservation over T steps.
    for name in &names {
        let n = records[0][0].0[name].len();
        for i in 0..n {
            let grads: f64 = (0..W)
                .flat_map(|r| (0..T).map(move |s| (r, s)))
                .map(|(r, s)| f64::from(gradients(r, s)[name].data()[i]))
                .sum::<f64>()
                / W as f64;
            let outs: f64 = (0..T as usize)
                .map(|s| f64::from(records[0][s].1[name][i]))
                .sum();
            let server: f64 = records
                .iter()
                .filter_map(|rec| {
                    let (idx, _, s_new) = &rec[T as usize - 1].2[name];
                    idx.iter()
                        .position(|&j| j == i)
                        .map(|j| f64::from(s_new[j]))
                })
                .sum();
            let workers: f64 = records
                .iter()
                .map(|rec| f64::from(rec[T as usize - 1].3[name][i]))
                .sum::<f64>()
                / W as f64;
            let lhs = outs + server + workers;
            assert!(
                (lhs - grads).abs() <= 1e-5 * (1.0 + grads.abs()),
                "{name}[{i}]: {lhs} vs {grads}"
            );
        }
    }
}

#[test]
fn top_k_budgets_sum_to_k_and_the_result_keeps_about_k_per_tensor() {
    let runs = run_group(
        4,
        1,
        |c| {
            CompressedAllReduce::with_communicator(
                CompressionMethod::Core(Method::TopK {
                    k: K::Ratio(0.01),
                    values: Values::F32,
                })
                .with_error_feedback(),
                c,
            )
            .with_collective(Collective::TwoPhase)
        },
        gradients,
    );
    let out = runs[0][0].0.as_ref().unwrap();
    for (name, t) in out {
        let k = gradwire::core::k_from_ratio(t.data().len() as u64, 0.01) as usize;
        let nonzero = t.data().iter().filter(|x| **x != 0.0).count();
        if name == "c.embed" {
            // Its non-zeros sit in the first 700 elements, 2 of its 5 blocks: the owners of
            // the other blocks send zeros (their budgets keep the residual's mass for later).
            assert!(nonzero < k, "{name}: {nonzero} of {k}");
        } else {
            assert_eq!(nonzero, k, "{name}: the owners' budgets sum to k");
        }
    }
}

/// A tensor of large entries beside one of small entries, both dealt over the same owners:
/// with int8 values, a scale block shared across the two would round the small tensor's
/// entries to zero (127 x 0.001 / 1000 < 0.5). Each tensor's kept values decode to within half
/// an int8 step of its own block's absmax, on the worker's frames and on the owners'.
#[test]
fn int8_scale_blocks_never_span_two_tensors() {
    let grads_of = |r: usize, _s: u64| {
        let mut rng = Rng(7 + r as u64);
        let big: Vec<f32> = rng.vec(4096, 1.0).iter().map(|x| 1000.0 + x).collect();
        let small: Vec<f32> = rng
            .vec(4096, 1.0)
            .iter()
            .map(|x| 0.001 * (1.5 + x))
            .collect();
        grads(&[("a.big", &[4096], big), ("b.small", &[4096], small)])
    };
    let runs = run_group(
        2,
        1,
        |c| {
            CompressedAllReduce::with_communicator(
                CompressionMethod::Core(Method::TopK {
                    k: K::Ratio(0.05),
                    values: Values::Int8 { block: 256 },
                }),
                c,
            )
            .with_collective(Collective::TwoPhase)
        },
        grads_of,
    );
    let out = runs[0][0].0.as_ref().unwrap();
    let small = out["b.small"].data();
    let k = gradwire::core::k_from_ratio(4096, 0.05) as usize;
    let kept = small.iter().filter(|x| **x != 0.0).count();
    assert_eq!(kept, k, "every kept small entry decodes to a non-zero");
    // Each owner holds one half of the tensor (a run of two 1024-element blocks): its kept
    // values (fewer than 256) are one int8 block whose scale is their own absmax, so each is
    // an integer code times absmax / 127.
    for j in 0..2 {
        let part: Vec<f32> = small[j * 2048..(j + 1) * 2048]
            .iter()
            .copied()
            .filter(|x| *x != 0.0)
            .collect();
        let m = part.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for x in part {
            let code = x * 127.0 / m;
            assert!(
                (code - code.round()).abs() < 1e-3,
                "owner {j}: {x} over {m}"
            );
        }
    }
}

/// Phase 2 gathers the owners' reduced shards into the buffers phase 1 received the shard
/// messages into, so a rank holds one set of W messages between (and during) steps, not two:
/// the agreement round's buffers keep only envelopes. With windows (every shard message is
/// longer than the 4 KiB bound) and without; after a step that failed in phase 2 too (rank 2's
/// gradient holds a NaN at step 1: its peers relay its failure in their phase-2 messages).
#[test]
fn phase_two_gathers_into_the_phase_one_buffers() {
    // 48,000 values: each 4-bit shard message of a third of them holds about 8 KB.
    let grads_of = |rank: usize, step: u64| {
        let mut rng = Rng(100 * rank as u64 + step + 7);
        let mut big = rng.vec(40_000, 1.0);
        if rank == 2 && step == 1 {
            big[123] = f32::NAN;
        }
        grads(&[
            ("a.weight", &[8000], rng.vec(8000, 0.5)),
            ("b.weight", &[200, 200], big),
        ])
    };
    for chunk in [4096, 8 << 20] {
        let comms = LocalGroup::new(3).into_communicators();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::spawn(move || {
                    let method = CompressionMethod::Core(Method::Quant {
                        bits: 4,
                        block: 512,
                        rounding: gradwire::core::Rounding::NearestEven,
                    })
                    .with_error_feedback();
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                        .with_collective(Collective::TwoPhase)
                        .with_chunk_bytes(chunk);
                    let mut held = Vec::new();
                    for s in 0..3 {
                        let result = ar.all_reduce(&grads_of(rank, s));
                        assert_eq!(result.is_err(), s == 1, "rank {rank}, step {s}");
                        held.push(ar.two_phase_received_capacity());
                    }
                    held
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            for (step, (received, agreement)) in h.join().unwrap().into_iter().enumerate() {
                assert!(
                    received.iter().all(|&r| r > 4096) && agreement < 1024,
                    "chunk {chunk}, rank {rank}, step {step}: {received:?} bytes for phase-1 \
                     messages, {agreement} for the agreement round"
                );
            }
        }
    }
}

/// Segmented int8 frames are larger than the plain top-k bound when the index section is as
/// large as it can be (a dense ratio, where the bitmap wins; budgets of one entry per tensor
/// part): the shard messages' size limit counts the segment table, so such steps succeed.
#[test]
fn segmented_int8_shards_fit_their_message_limit_at_any_density() {
    let grads_of = |r: usize, _s: u64| {
        let mut rng = Rng(11 + r as u64);
        grads(&[
            ("a", &[4096], rng.vec(4096, 1.0)),
            ("b", &[4096], rng.vec(4096, 0.01)),
            ("c", &[2048], rng.vec(2048, 3.0)),
        ])
    };
    for ratio in [0.5, 0.9, 0.0005] {
        let runs = run_group(
            2,
            2,
            move |c| {
                CompressedAllReduce::with_communicator(
                    CompressionMethod::Core(Method::TopK {
                        k: K::Ratio(ratio),
                        values: Values::Int8 { block: 64 },
                    })
                    .with_error_feedback(),
                    c,
                )
                .with_collective(Collective::TwoPhase)
            },
            grads_of,
        );
        for (rank, steps) in runs.iter().enumerate() {
            for (s, (result, _)) in steps.iter().enumerate() {
                let out = result
                    .as_ref()
                    .unwrap_or_else(|e| panic!("ratio {ratio}, rank {rank}, step {s}: {e}"));
                assert_eq!(flat(out), flat(runs[0][s].0.as_ref().unwrap()));
            }
        }
    }
}

#[test]
fn resume_with_server_residuals_is_bit_identical() {
    const W: usize = 3;
    let method = || CompressionMethod::Quantization { bits: 4 }.with_error_feedback();
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                for s in 0..3 {
                    ar.all_reduce(&gradients(rank, s)).unwrap();
                }
                let path = std::env::temp_dir().join(format!(
                    "gradwire-two-phase-resume-{}-{rank}",
                    std::process::id()
                ));
                ar.compressor_mut().save_feedback(&path).unwrap();
                let server: HashMap<String, Vec<f32>> = gradients(rank, 0)
                    .keys()
                    .filter_map(|n| ar.server_residual(n).map(|(_, v)| (n.clone(), v.to_vec())))
                    .collect();
                let rest: Vec<Vec<f32>> = (3..5)
                    .map(|s| flat(&ar.all_reduce(&gradients(rank, s)).unwrap()))
                    .collect();
                (path, server, rest)
            })
        })
        .collect();
    let first: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        first[0].1.values().flatten().any(|&x| x != 0.0),
        "the server residuals are not all zero"
    );
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .zip(first.clone())
        .enumerate()
        .map(|(rank, (comm, (path, server, _)))| {
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                ar.compressor_mut().load_feedback(&path).unwrap();
                let _ = std::fs::remove_file(&path);
                // Saved by another rank or world size: refused.
                assert!(
                    ar.set_server_residuals((W + 1, rank), server.clone())
                        .is_err()
                );
                ar.set_server_residuals((W, rank), server).unwrap();
                (3..5)
                    .map(|s| flat(&ar.all_reduce(&gradients(rank, s)).unwrap()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (h, (_, _, rest)) in handles.into_iter().zip(&first) {
        let resumed = h.join().unwrap();
        for (a, b) in resumed.iter().zip(rest) {
            assert!(same_bits(a, b), "resumed steps are bit-identical");
        }
    }
}

/// A communicator that corrupts or enlarges what `rank` sends to `to` in the all-to-all.
struct Tamper<C> {
    inner: C,
    rank: usize,
    to: usize,
    enlarge: bool,
    /// Enlarge `rank`'s phase-2 message (its second all-gather of a step) instead.
    phase2: bool,
    gathers: usize,
}

impl<C: Communicator> Communicator for Tamper<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.gathers += 1;
        if self.phase2 && self.gathers.is_multiple_of(2) && self.inner.rank() == self.rank {
            let mut big = local.to_vec();
            big.resize(local.len() + 1_000_000, 7);
            return self.inner.all_gather(&big, max_len, out);
        }
        self.inner.all_gather(local, max_len, out)
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let mut send = send.to_vec();
        if self.inner.rank() == self.rank && !self.phase2 {
            let msg = &mut send[self.to];
            if self.enlarge {
                msg.resize(msg.len() + 10_000_000, 7);
            } else {
                let last = msg.len() - 1;
                msg[last] ^= 0x40;
            }
        }
        self.inner.all_to_all(&send, max_len, out)
    }
    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
}

#[test]
fn a_bad_or_oversized_shard_fails_every_rank_alike_and_the_sent_values_come_back() {
    for enlarge in [false, true] {
        const W: usize = 4;
        let comms = LocalGroup::new(W).into_communicators();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::spawn(move || {
                    let tamper = Tamper {
                        inner: comm,
                        rank: 1,
                        to: 2,
                        enlarge,
                        phase2: false,
                        gathers: 0,
                    };
                    let mut ar = CompressedAllReduce::with_communicator(
                        CompressionMethod::SignSGD.with_error_feedback(),
                        Box::new(tamper),
                    )
                    .with_collective(Collective::TwoPhase);
                    ar.all_reduce(&gradients(rank, 0)).unwrap_err();
                    let delayed = residuals_hold(&ar, &gradients(rank, 0));
                    let err = ar.all_reduce(&gradients(rank, 0)).unwrap_err();
                    (err.to_string(), delayed)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (rank, (err, delayed)) in results.iter().enumerate() {
            assert_eq!(err, &results[0].0, "rank {rank}: every rank the same error");
            assert!(
                delayed,
                "rank {rank}: a failed step gives back what it sent: the residuals hold the \
                 gradient"
            );
        }
        if enlarge {
            assert!(results[0].0.contains("rank 1"), "{}", results[0].0);
        } else {
            assert!(
                results[0].0.contains("rank 1") && results[0].0.contains("owner 2"),
                "{}",
                results[0].0
            );
        }
    }
}

#[test]
fn a_failed_or_misconfigured_rank_fails_every_rank_and_none_waits() {
    // Rank 2's gradient has a NaN: it returns its own error, every peer names it.
    let runs = run_group(
        4,
        2,
        |c| {
            CompressedAllReduce::with_communicator(
                CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
                c,
            )
            .with_collective(Collective::TwoPhase)
        },
        |rank, s| {
            let mut g = gradients(rank, s);
            if rank == 2 && s == 0 {
                let mut d = g["d.weight"].data().to_vec();
                d[17] = f32::NAN;
                g.insert("d.weight".into(), Tensor::new(vec![3000], d).unwrap());
            }
            g
        },
    );
    for (rank, steps) in runs.iter().enumerate() {
        let err = steps[0].0.as_ref().unwrap_err();
        if rank == 2 {
            assert!(err.contains("d.weight") && err.contains("17"), "{err}");
        } else {
            assert!(err.contains("rank 2"), "rank {rank}: {err}");
        }
        assert!(steps[1].0.is_ok(), "rank {rank}: the group goes on");
    }
    // Rank 3 runs another ratio: every rank fails naming rank 3 and the method.
    let runs = run_group(
        4,
        1,
        |c| {
            let ratio = if c.rank() == 3 { 0.02 } else { 0.01 };
            CompressedAllReduce::with_communicator(
                CompressionMethod::Core(Method::TopK {
                    k: K::Ratio(ratio),
                    values: Values::F32,
                }),
                c,
            )
            .with_collective(Collective::TwoPhase)
        },
        gradients,
    );
    for steps in &runs {
        let err = steps[0].0.as_ref().unwrap_err();
        assert!(err.contains("rank 3") && err.contains("method"), "{err}");
    }
}

/// Without error feedback the worker's encoders check the gradient as they write it (no
/// check pass first): a bad value is still named as the check names it, the first in tensor
/// order (here a value beyond f16 in `d.weight` before a NaN early in the large `e.big`, which
/// an owner's chunked encoder meets first), every peer names the rank, and the next step runs.
#[test]
fn without_error_feedback_a_bad_gradient_is_named_as_the_check_names_it() {
    let methods = [
        Method::Dense {
            values: Values::F16,
        },
        Method::Quant {
            bits: 4,
            block: 512,
            rounding: gradwire::core::Rounding::NearestEven,
        },
        Method::Sign {
            scale: gradwire::core::SignScale::MeanAbs { block: 32 },
            zero_mask: false,
        },
    ];
    for method in methods {
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            let runs = run_group(
                3,
                2,
                move |c| {
                    CompressedAllReduce::with_communicator(CompressionMethod::Core(method), c)
                        .with_collective(Collective::TwoPhase)
                        .with_parallelism(parallelism)
                },
                |rank, s| {
                    let mut g = gradients(rank, s);
                    let mut big = vec![0.5f32; 140_000];
                    if rank == 1 && s == 0 {
                        big[100] = f32::NAN;
                        let mut d = g["d.weight"].data().to_vec();
                        d[2900] = 70_000.0;
                        g.insert("d.weight".into(), Tensor::new(vec![3000], d).unwrap());
                    }
                    g.insert("e.big".into(), Tensor::new(vec![140_000], big).unwrap());
                    g
                },
            );
            let (tensor, index) = match method {
                Method::Dense { .. } => ("d.weight", "2900"),
                _ => ("e.big", "100"),
            };
            for (rank, steps) in runs.iter().enumerate() {
                let what = format!("{method:?}, {parallelism:?}, rank {rank}");
                let err = steps[0].0.as_ref().unwrap_err();
                if rank == 1 {
                    assert!(err.contains(tensor) && err.contains(index), "{what}: {err}");
                } else {
                    assert!(err.contains("rank 1"), "{what}: {err}");
                }
                assert!(steps[1].0.is_ok(), "{what}: the group goes on");
            }
        }
    }
}

#[test]
fn two_phase_bytes_per_link_stay_flat_as_the_world_grows() {
    let base = minilm();
    for method in [
        CompressionMethod::SignSGD.with_error_feedback(),
        CompressionMethod::top_k_int8(0.01).with_error_feedback(),
    ] {
        let manifest = Manifest::for_gradients(&base, &method, 0, BucketConfig::none()).unwrap();
        let bundle = manifest.max_bundle_len() as f64;
        for w in [2, 8, 16] {
            let m = method.clone();
            let runs = run_group(
                w,
                1,
                move |c| {
                    CompressedAllReduce::with_communicator(m.clone(), c)
                        .with_collective(Collective::TwoPhase)
                },
                |rank, _| {
                    let mut rng = Rng(rank as u64 + 7);
                    common::noisy(&minilm(), &mut rng, 0.3)
                },
            );
            let max = runs.iter().map(|s| s[0].1.received).max().unwrap() as f64;
            let bound = if matches!(method, CompressionMethod::ErrorFeedback { .. })
                && format!("{method:?}").contains("TopK")
            {
                3.5
            } else {
                2.3
            };
            assert!(
                max <= bound * bundle,
                "{method:?} W={w}: {max} bytes received, bundle {bundle}"
            );
        }
    }
}

/// Server residuals saved to a file beside the worker's checkpoint resume bit for bit; a file
/// from another world size, a damaged one, or one for another model layout is refused.
#[test]
fn server_residual_checkpoints_resume_bit_for_bit_and_refuse_another_layout() {
    const W: usize = 3;
    let method = || CompressionMethod::SignSGD.with_error_feedback();
    let dir = std::env::temp_dir().join(format!("gradwire-server-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                for s in 0..3 {
                    ar.all_reduce(&gradients(rank, s)).unwrap();
                }
                ar.compressor_mut()
                    .save_feedback(dir.join(format!("worker-{rank}")))
                    .unwrap();
                ar.save_server_residuals(dir.join(format!("server-{rank}")))
                    .unwrap();
                (3..5)
                    .map(|s| flat(&ar.all_reduce(&gradients(rank, s)).unwrap()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let first: Vec<Vec<Vec<f32>>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // Resume from the files.
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                ar.compressor_mut()
                    .load_feedback(dir.join(format!("worker-{rank}")))
                    .unwrap();
                // Another rank's file: refused.
                let other = dir.join(format!("server-{}", (rank + 1) % W));
                assert!(ar.load_server_residuals(&other).is_err());
                ar.load_server_residuals(dir.join(format!("server-{rank}")))
                    .unwrap();
                (3..5)
                    .map(|s| flat(&ar.all_reduce(&gradients(rank, s)).unwrap()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (h, expected) in handles.into_iter().zip(&first) {
        let resumed = h.join().unwrap();
        for (a, b) in resumed.iter().zip(expected) {
            assert!(same_bits(a, b), "resumed from the files: bit-identical");
        }
    }
    // Issue 48 class 4: the workers resumed without the server residuals. Their first step
    // fails on every rank (the owners would have started from zeros, silently dropping what
    // they kept), step after step, until the caller discards them (zeros by choice) or loads
    // them.
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                ar.compressor_mut()
                    .load_feedback(dir.join(format!("worker-{rank}")))
                    .unwrap();
                let residuals = |ar: &CompressedAllReduce| -> Vec<f32> {
                    let g = gradients(rank, 0);
                    let mut names: Vec<&String> = g.keys().collect();
                    names.sort();
                    let fb = ar.compressor().feedback().unwrap();
                    names
                        .iter()
                        .flat_map(|n| fb.residual(n).unwrap().to_vec())
                        .collect()
                };
                let loaded = residuals(&ar);
                let errors: Vec<String> = (3..5)
                    .map(|s| ar.all_reduce(&gradients(rank, s)).unwrap_err().to_string())
                    .collect();
                let kept = same_bits(&residuals(&ar), &loaded);
                ar.discard_server_residuals();
                ar.all_reduce(&gradients(rank, 5)).unwrap();
                (errors, kept)
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (errors, kept) = h.join().unwrap();
        for e in &errors {
            // Rank 0 names its own failure; its peers name rank 0's.
            assert!(e.contains("server residuals"), "rank {rank}: {e}");
            assert!(e.contains("discard_server_residuals"), "rank {rank}: {e}");
        }
        assert!(
            kept,
            "rank {rank}: nothing was sent, the worker's residuals are as loaded"
        );
    }
    // Not a resume: a run whose step 0 failed in the agreement round (a rank's NaN, found
    // before the collective) goes on at step 1 with its server residuals at zero.
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(method(), Box::new(comm))
                    .with_collective(Collective::TwoPhase);
                let mut bad = gradients(rank, 0);
                if rank == 1 {
                    bad.get_mut("d.weight").unwrap().data_mut()[7] = f32::NAN;
                }
                assert!(ar.all_reduce(&bad).is_err());
                ar.all_reduce(&gradients(rank, 1)).map(|_| ())
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let step1 = h.join().unwrap();
        assert!(step1.is_ok(), "rank {rank}: {step1:?}");
    }
    // Another world size: refused on load.
    let comms = LocalGroup::new(W + 1).into_communicators();
    let mut ar = CompressedAllReduce::with_communicator(
        method(),
        Box::new(comms.into_iter().next().unwrap()),
    );
    let err = ar.load_server_residuals(dir.join("server-0")).unwrap_err();
    assert!(err.to_string().contains("discard"), "{err}");
    // A damaged file: refused.
    let mut bytes = std::fs::read(dir.join("server-0")).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x20;
    std::fs::write(dir.join("damaged"), &bytes).unwrap();
    let comms = LocalGroup::new(W).into_communicators();
    let mut ar = CompressedAllReduce::with_communicator(
        method(),
        Box::new(comms.into_iter().next().unwrap()),
    );
    assert!(ar.load_server_residuals(dir.join("damaged")).is_err());
    // The worker's own checkpoint is not a server-residual checkpoint.
    let err = ar.load_server_residuals(dir.join("worker-0")).unwrap_err();
    assert!(err.to_string().contains("server-residual"), "{err}");
    // A file of shard layout version 1 (block-cyclic parts: other elements under the same
    // names and lengths), its checksums right: refused with the reason.
    let bytes = std::fs::read(dir.join("server-0")).unwrap();
    let (header, _) = crate::safetensors_reader::read_header(&bytes).unwrap();
    let text = header.metadata().as_ref().unwrap()["server_shards"].clone();
    let old = text.strip_prefix("version=2;").expect("a version 2 text");
    let crc = format!("{:08x}", crc32fast::hash(old.as_bytes()));
    let fb = crate::feedback::ErrorFeedback::from_bytes(&bytes).unwrap();
    let v1 = fb
        .to_bytes_with_metadata(&[("server_shards", old), ("server_shards_crc32", &crc)])
        .unwrap();
    std::fs::write(dir.join("version-1"), v1).unwrap();
    let err = ar.load_server_residuals(dir.join("version-1")).unwrap_err();
    assert!(err.to_string().contains("version 1"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Review findings: a phase-2 message over the limit (every rank's verdict) leaves the server
/// residuals as they were and gives the worker's sent values back to its residuals.
#[test]
fn an_oversized_phase_2_message_restores_the_residuals() {
    const W: usize = 3;
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let tamper = Tamper {
                    inner: comm,
                    rank: 1,
                    to: 0,
                    enlarge: true,
                    phase2: true,
                    gathers: 0,
                };
                let mut ar = CompressedAllReduce::with_communicator(
                    CompressionMethod::SignSGD.with_error_feedback(),
                    Box::new(tamper),
                )
                .with_collective(Collective::TwoPhase);
                let err = ar.all_reduce(&gradients(rank, 0)).unwrap_err().to_string();
                let worker = residuals_hold(&ar, &gradients(rank, 0));
                let server: Vec<f32> = gradients(0, 0)
                    .keys()
                    .filter_map(|n| ar.server_residual(n).map(|(_, v)| v.to_vec()))
                    .flatten()
                    .collect();
                (err, worker, server)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, (err, worker, server)) in results.iter().enumerate() {
        assert_eq!(err, &results[0].0, "rank {rank}");
        assert!(err.contains("rank 1"), "{err}");
        assert!(
            *worker,
            "rank {rank}: worker residuals hold the gradient (given back)"
        );
        assert!(
            server.iter().all(|&x| x == 0.0),
            "rank {rank}: server residuals"
        );
    }
}

/// Rank `r`'s gradients for the chunked dense tests: the tensors of [`gradients`] and one of
/// 70,000 elements (280 KB), so that a 64 KiB chunk bound cuts it and the chunks straddle
/// tensor boundaries; magnitudes spread over 40 binades, so that the order of additions shows.
fn chunked_gradients(r: usize, s: u64) -> HashMap<String, Tensor> {
    let mut g = gradients(r, s);
    g.insert(
        "e.big".into(),
        Tensor::new(vec![70, 1000], contribution(0, r, 70_000)).unwrap(),
    );
    g
}

/// The uncompressed f32 all-reduce over `comm`, passing buffers of at most `chunk_bytes`.
fn dense_f32(comm: Box<dyn Communicator>, chunk_bytes: usize) -> CompressedAllReduce {
    let dense = Method::Dense {
        values: Values::F32,
    };
    CompressedAllReduce::with_communicator(CompressionMethod::Core(dense), comm)
        .with_chunk_bytes(chunk_bytes)
}

/// Issue 46: the dense f32 route moves the model in chunks of at most the chunk bound (every
/// buffer passed to the communicator within it), and the chunks' sums are the rank-order sums
/// of the whole model: the same bits on every rank, for every bound, as one unchunked call.
/// With one rank the mean is the gradient, and no f32 sum is called.
#[test]
fn dense_f32_in_chunks_is_the_same_bits_with_every_message_within_the_bound() {
    const W: usize = 3;
    let run = |w: usize, chunk: usize, reduction: Reduction| {
        let comms = LocalGroup::new(w).into_communicators();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::spawn(move || {
                    let (comm, largest) = common::Recording::new(comm);
                    let mut ar = dense_f32(Box::new(comm), chunk).with_reduction(reduction);
                    let mut out = HashMap::new();
                    let mut steps = Vec::new();
                    for s in 0..2 {
                        ar.all_reduce_into(&chunked_gradients(rank, s), &mut out)
                            .unwrap();
                        steps.push(flat(&out));
                    }
                    (steps, largest.load(std::sync::atomic::Ordering::Relaxed))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    for reduction in [Reduction::Mean, Reduction::Sum] {
        // The rank-order sum (then the mean, divided once), element by element.
        let expected: Vec<Vec<f32>> = (0..2)
            .map(|s| {
                let ranks: Vec<Vec<f32>> = (0..W).map(|r| flat(&chunked_gradients(r, s))).collect();
                (0..ranks[0].len())
                    .map(|i| {
                        let sum = (1..W).fold(ranks[0][i], |acc, r| acc + ranks[r][i]);
                        match reduction {
                            Reduction::Mean => sum / W as f32,
                            _ => sum,
                        }
                    })
                    .collect()
            })
            .collect();
        for chunk in [usize::MAX, 64 << 10, 4 << 10, 1000] {
            for (rank, (steps, largest)) in run(W, chunk, reduction).into_iter().enumerate() {
                let what = format!("{reduction:?}, chunk {chunk}, rank {rank}");
                for (s, got) in steps.iter().enumerate() {
                    assert!(same_bits(got, &expected[s]), "{what}, step {s}");
                }
                if chunk != usize::MAX {
                    assert!(largest <= chunk, "{what}: a buffer of {largest} bytes");
                }
            }
        }
    }
    // One rank: the gradient itself; only the 20-byte envelope crosses the communicator.
    for (steps, largest) in run(1, 64 << 10, Reduction::Mean) {
        for (s, got) in steps.iter().enumerate() {
            assert!(same_bits(got, &flat(&chunked_gradients(0, s as u64))));
        }
        assert!(largest < 64, "a buffer of {largest} bytes at W = 1");
    }
}

/// Review finding: ranks with other chunk bounds fail on every rank naming the configuration,
/// not with a transport's length mismatch (dense route, all-gather, two-phase).
#[test]
fn ranks_with_other_chunk_bounds_are_told_their_configurations_differ() {
    let make = |c: Box<dyn Communicator>| {
        let bound = if c.rank() == 0 { 4096 } else { 8192 };
        dense_f32(c, bound)
    };
    for (rank, steps) in run_group(2, 1, make, chunked_gradients).iter().enumerate() {
        let err = steps[0].0.as_ref().unwrap_err();
        assert!(err.contains("chunk_bytes is `8192`"), "rank {rank}: {err}");
    }
    // The compressed collectives, with messages of one window and of several.
    for method in windowed_methods() {
        for collective in [Collective::AllGather, Collective::TwoPhase] {
            for bounds in [(1 << 20, 2 << 20), (1024, 2048), (MIN_WINDOW, 1 << 20)] {
                let method = method.clone();
                let make = move |c: Box<dyn Communicator>| {
                    let bound = if c.rank() == 0 { bounds.0 } else { bounds.1 };
                    CompressedAllReduce::with_communicator(method.clone(), c)
                        .with_collective(collective)
                        .with_chunk_bytes(bound)
                };
                // Named by the configurations' round (the first windows carry the envelopes
                // with their fingerprints), or, when one rank's first window is over the
                // other's limit, by the limits: the same error on every rank, every step.
                let runs = run_group(2, 2, make, windowed_gradients);
                for steps in &runs {
                    for (step, (result, _)) in steps.iter().enumerate() {
                        let err = result.as_ref().unwrap_err();
                        assert_eq!(err, runs[0][step].0.as_ref().unwrap_err());
                        assert!(
                            err.contains("chunk_bytes is")
                                || err.contains("so their configurations differ"),
                            "{collective:?} {bounds:?}: {err}"
                        );
                    }
                }
            }
            // Review finding: with other bounds and a failed rank, the rank whose first
            // window was full went on to a call its peer never made (until the deadline).
            // Now the failure in the first windows ends the step on every rank at once.
            let method = method.clone();
            let make = move |c: Box<dyn Communicator>| {
                let bound = if c.rank() == 0 { MIN_WINDOW } else { 1 << 20 };
                CompressedAllReduce::with_communicator(method.clone(), c)
                    .with_collective(collective)
                    .with_chunk_bytes(bound)
            };
            let nan_on_rank_1 = |r: usize, s: u64| {
                let mut g = windowed_gradients(r, s);
                if r == 1 {
                    let mut d = g["d.weight"].data().to_vec();
                    d[3] = f32::NAN;
                    g.insert("d.weight".into(), Tensor::new(vec![3000], d).unwrap());
                }
                g
            };
            let started = std::time::Instant::now();
            let runs = run_group(2, 2, make, nan_on_rank_1);
            assert!(started.elapsed() < std::time::Duration::from_secs(30));
            // (The two-phase collective's agreement round finds the other bound first: the
            // same `ConfigDiffers` on both ranks.)
            for (rank, steps) in runs.iter().enumerate() {
                for (result, _) in steps {
                    let err = result.as_ref().unwrap_err();
                    let named = if rank == 1 {
                        err.contains("d.weight") || err.contains("chunk_bytes is")
                    } else {
                        err.contains("rank 1")
                    };
                    assert!(named, "{collective:?}, rank {rank}: {err}");
                }
            }
        }
    }
}

/// `chunked_gradients` and a tensor of 240,000 values: every method's messages, a two-phase
/// shard's too, span several windows of 4 KiB.
fn windowed_gradients(r: usize, s: u64) -> HashMap<String, Tensor> {
    let mut g = chunked_gradients(r, s);
    g.insert(
        "f.huge".into(),
        Tensor::new(vec![240_000], contribution(1, r, 240_000)).unwrap(),
    );
    g
}

/// The smallest window of the compressed collectives (`comm::windows::MIN_WINDOW`).
const MIN_WINDOW: usize = 4096;

/// Compressed methods the windowed messages are tested with: top-k int8 and sign, 4-bit
/// quantization with error feedback, dense bf16 without.
fn windowed_methods() -> Vec<CompressionMethod> {
    vec![
        CompressionMethod::Core(Method::TopK {
            k: K::Ratio(0.2),
            values: Values::Int8 { block: 64 },
        })
        .with_error_feedback(),
        CompressionMethod::SignSGD.with_error_feedback(),
        CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
        CompressionMethod::Core(Method::Dense {
            values: Values::Bf16,
        }),
    ]
}

/// Issue 46: on the all-gather and the two-phase collective, messages longer than the chunk
/// bound cross the communicator in windows (every buffer passed within the bound, at least
/// 4 KiB), and the results and worker residuals are bit for bit those of whole messages, on
/// every rank, step after step.
#[test]
fn compressed_messages_cross_in_windows_with_the_same_bits() {
    const W: usize = 3;
    const STEPS: usize = 3;
    type Run = Vec<(Vec<Vec<f32>>, Vec<Vec<f32>>, usize)>;
    let run = |method: CompressionMethod, collective: Collective, chunk: usize| -> Run {
        let handles: Vec<_> = LocalGroup::new(W)
            .into_communicators()
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let method = method.clone();
                std::thread::spawn(move || {
                    let (comm, largest) = common::Recording::new(comm);
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                        .with_collective(collective)
                        .with_chunk_bytes(chunk);
                    let mut out = HashMap::new();
                    let (mut means, mut residuals) = (Vec::new(), Vec::new());
                    for s in 0..STEPS {
                        let g = windowed_gradients(rank, s as u64);
                        ar.all_reduce_into(&g, &mut out).unwrap();
                        means.push(flat(&out));
                        let mut names: Vec<&String> = g.keys().collect();
                        names.sort();
                        let fb = ar.compressor().feedback();
                        residuals.push(
                            names
                                .iter()
                                .flat_map(|n| fb.and_then(|f| f.residual(n)).unwrap_or(&[]))
                                .copied()
                                .collect(),
                        );
                    }
                    let largest = largest.load(std::sync::atomic::Ordering::Relaxed);
                    (means, residuals, largest)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    for method in windowed_methods() {
        for collective in [Collective::AllGather, Collective::TwoPhase] {
            let whole = run(method.clone(), collective, usize::MAX);
            let (means, residuals, largest) = &whole[0];
            assert!(
                *largest > 3 * MIN_WINDOW,
                "{method:?}: messages span windows"
            );
            // A bound below the smallest window is raised to it.
            for chunk in [16 << 10, MIN_WINDOW, 1000] {
                let what = format!("{method:?}, {collective:?}, chunk {chunk}");
                for (rank, (m, r, most)) in
                    run(method.clone(), collective, chunk).iter().enumerate()
                {
                    assert!(*most <= chunk.max(MIN_WINDOW), "{what}: {most} bytes");
                    for s in 0..STEPS {
                        assert!(same_bits(&m[s], &means[s]), "{what}, rank {rank}, step {s}");
                        if rank == 0 {
                            assert!(same_bits(&r[s], &residuals[s]), "{what}, step {s}");
                        }
                    }
                }
            }
        }
    }
}

/// Issue 46: the all-gather reads each rank's bundle as its windows arrive and adds each
/// entry as soon as every rank's frame of it is whole. A bundle damaged in a later window (a
/// frame's byte: found when that entry is whole, after the entries before it were added; the
/// trailer's: found after every entry was added) fails the step on every rank with the same
/// error, the bundle's checksum fault naming the sender (as for a whole bundle), every rank's
/// residuals take back what it sent, and the next step runs on every rank alike.
#[test]
fn a_bundle_damaged_in_a_later_window_fails_every_rank_alike_and_the_step_after_runs() {
    const W: usize = 3;
    const CHUNK: usize = 4096;
    /// Flips one byte of what rank 1 sends in its `window`-th window call (the middle byte,
    /// or with `trailer` the last byte of its last window), once.
    struct Damage<C> {
        inner: C,
        window: usize,
        trailer: bool,
        appends: usize,
        done: bool,
    }
    impl<C: Communicator> Communicator for Damage<C> {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn all_gather(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.inner.all_gather(local, max_len, out)
        }
        fn all_gather_append(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.appends += 1;
            let hit = if self.trailer {
                !local.is_empty() && local.len() < CHUNK
            } else {
                self.appends == self.window
            };
            if self.inner.rank() == 1 && hit && !self.done {
                self.done = true;
                let mut bad = local.to_vec();
                let at = if self.trailer {
                    bad.len() - 1
                } else {
                    bad.len() / 2
                };
                bad[at] ^= 0x10;
                return self.inner.all_gather_append(&bad, max_len, out);
            }
            self.inner.all_gather_append(local, max_len, out)
        }
        fn all_to_all(
            &mut self,
            send: &[Vec<u8>],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.inner.all_to_all(send, max_len, out)
        }
        fn traffic(&self) -> Traffic {
            self.inner.traffic()
        }
    }
    let method = CompressionMethod::Quantization { bits: 4 }.with_error_feedback();
    let run = |window: usize, trailer: bool| {
        let handles: Vec<_> = LocalGroup::new(W)
            .into_communicators()
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let method = method.clone();
                std::thread::spawn(move || {
                    let damage = Damage {
                        inner: comm,
                        window,
                        trailer,
                        appends: 0,
                        done: window == 0 && !trailer,
                    };
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(damage))
                        .with_collective(Collective::AllGather)
                        .with_chunk_bytes(CHUNK);
                    let g = windowed_gradients(rank, 0);
                    let mut out = HashMap::new();
                    let first = ar
                        .all_reduce_into(&g, &mut out)
                        .err()
                        .map(|e| e.to_string());
                    let delayed = residuals_hold(&ar, &g);
                    ar.all_reduce_into(&windowed_gradients(rank, 1), &mut out)
                        .unwrap();
                    (first, delayed, flat(&out))
                })
            })
            .collect::<Vec<_>>();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    // The reference: no damage; its second step after a first that succeeded.
    let clean = run(0, false);
    assert!(clean.iter().all(|(e, _, _)| e.is_none()));
    for (window, trailer) in [(2, false), (9, false), (0, true)] {
        let results = run(window, trailer);
        let (err, _, _) = &results[0];
        let err = err.as_deref().expect("the damaged step fails");
        assert!(err.contains("rank 1"), "window {window}: {err}");
        for (rank, (e, delayed, second)) in results.iter().enumerate() {
            assert_eq!(e.as_deref(), Some(err), "rank {rank}: the same error");
            assert!(delayed, "rank {rank}: the sent values came back");
            // After a failed first step the residuals hold its gradient, so the second step
            // is not the clean run's second step: it is the same on every rank.
            assert!(same_bits(second, &results[0].2), "rank {rank}");
        }
        // Damage on the way is named as `check_bundle` names it: the bundle's checksum, even
        // when a frame's own checksum found it first.
        assert!(
            err.contains("bundle from rank 1 checksum mismatch"),
            "window {window}: {err}"
        );
    }
}

/// The streamed all-gather names a fault the sender made (a frame whose own checksum fails
/// under a bundle checksum that matches) by the entry's own error, as `check_bundle` does for
/// a whole bundle, on every rank; damage on the way is the bundle's checksum fault (the test
/// above).
#[test]
fn a_frame_made_bad_under_a_matching_bundle_checksum_is_named_by_its_own_error() {
    const W: usize = 3;
    /// Rank 1's first all-gather of a bundle: one byte of a frame's body flipped and the
    /// bundle's trailer made to match (the envelope's 20 bytes come first).
    struct Forged<C> {
        inner: C,
        done: bool,
    }
    impl<C: Communicator> Communicator for Forged<C> {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn all_gather(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            if self.inner.rank() == 1 && !self.done && local.len() > 1000 {
                self.done = true;
                let mut bad = local.to_vec();
                // Past the envelope (20), the bundle header (24), the first entry's id and
                // length (12) and its frame's header: inside the first frame's body.
                let at = 20 + 24 + 12 + 40;
                bad[at] ^= 0x10;
                let end = bad.len() - 4;
                let crc = crc32fast::hash(&bad[20..end]);
                bad[end..].copy_from_slice(&crc.to_le_bytes());
                return self.inner.all_gather(&bad, max_len, out);
            }
            self.inner.all_gather(local, max_len, out)
        }
        fn all_to_all(
            &mut self,
            send: &[Vec<u8>],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.inner.all_to_all(send, max_len, out)
        }
        fn traffic(&self) -> Traffic {
            self.inner.traffic()
        }
    }
    let handles: Vec<_> = LocalGroup::new(W)
        .into_communicators()
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let forged = Forged {
                    inner: comm,
                    done: false,
                };
                let mut ar = CompressedAllReduce::with_communicator(
                    CompressionMethod::Core(Method::Dense {
                        values: Values::Bf16,
                    }),
                    Box::new(forged),
                )
                .with_collective(Collective::AllGather);
                let err = ar.all_reduce(&gradients(rank, 0)).unwrap_err().to_string();
                ar.all_reduce(&gradients(rank, 1)).unwrap();
                err
            })
        })
        .collect();
    let errors: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, e) in errors.iter().enumerate() {
        assert_eq!(e, &errors[0], "rank {rank}: the same error");
    }
    assert!(
        errors[0].contains("from rank 1") && errors[0].contains("checksum mismatch"),
        "{}",
        errors[0]
    );
    assert!(
        !errors[0].starts_with("bundle"),
        "the frame's own error: {}",
        errors[0]
    );
}

/// Issue 46: a rank that stops after the first window of its message (its thread returns,
/// dropping its communicator) makes every other rank fail, naming it, within the deadline.
#[test]
fn a_rank_gone_after_its_first_window_is_named_by_every_peer() {
    const W: usize = 3;
    /// Passes the first `calls` calls through, then fails without entering the collective
    /// (after `stall`: alive and silent that long).
    struct Stops<C> {
        inner: C,
        calls: usize,
        stall: std::time::Duration,
    }
    impl<C: Communicator> Stops<C> {
        fn gone(&mut self) -> Result<(), CommError> {
            if self.calls == 0 {
                std::thread::sleep(self.stall);
                return Err(CommError::Transport("this rank stopped".into()));
            }
            self.calls -= 1;
            Ok(())
        }
    }
    impl<C: Communicator> Communicator for Stops<C> {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn all_gather(
            &mut self,
            local: &[u8],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.gone()?;
            self.inner.all_gather(local, max_len, out)
        }
        fn all_to_all(
            &mut self,
            send: &[Vec<u8>],
            max_len: usize,
            out: &mut Vec<Vec<u8>>,
        ) -> Result<(), CommError> {
            self.gone()?;
            self.inner.all_to_all(send, max_len, out)
        }
        fn traffic(&self) -> Traffic {
            self.inner.traffic()
        }
    }
    let method = CompressionMethod::Core(Method::Dense {
        values: Values::Bf16,
    });
    // All-gather: round 0's windows, then the header call; two-phase: the agreement round,
    // the all-to-all's header, its first window. Gone at once (its communicator dropped:
    // named at once), or alive and silent for 4 s (named by the peers' deadline of 2 s).
    let cases = [(Collective::AllGather, 2), (Collective::TwoPhase, 3)];
    let stalls = [std::time::Duration::ZERO, std::time::Duration::from_secs(4)];
    for ((collective, calls), stall) in cases
        .into_iter()
        .flat_map(|c| stalls.into_iter().map(move |s| (c, s)))
    {
        let handles: Vec<_> = LocalGroup::new(W)
            .with_timeout(Some(std::time::Duration::from_secs(2)))
            .into_communicators()
            .into_iter()
            .enumerate()
            .map(|(rank, inner)| {
                let method = method.clone();
                std::thread::spawn(move || {
                    let calls = if rank == 1 { calls } else { usize::MAX };
                    let comm = Stops {
                        inner,
                        calls,
                        stall,
                    };
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                        .with_collective(collective)
                        .with_chunk_bytes(MIN_WINDOW);
                    let started = std::time::Instant::now();
                    let err = ar
                        .all_reduce(&windowed_gradients(rank, 0))
                        .unwrap_err()
                        .to_string();
                    (err, started.elapsed())
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let (err, took) = h.join().unwrap();
            if rank == 1 {
                assert!(err.contains("this rank stopped"), "{err}");
            } else {
                // "rank 1 of 3 left the group", or the deadline's "waited ... for ranks [1]".
                assert!(
                    err.contains("rank 1") || err.contains("ranks [1]"),
                    "{collective:?}, rank {rank}: {err}"
                );
                assert!(took < std::time::Duration::from_secs(30), "{took:?}");
            }
        }
    }
}

/// Issue 46: a sum that overflows in a later chunk of the dense route is the same
/// `Error::Overflow` on every rank, naming the tensor and the element within it; the group
/// stays in step (the next step succeeds).
#[test]
fn a_dense_overflow_in_a_later_chunk_names_the_element_on_every_rank() {
    const W: usize = 3;
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let mut ar = dense_f32(Box::new(comm), 64 << 10);
                let mut g = chunked_gradients(rank, 0);
                let mut d = g["e.big"].data().to_vec();
                d[50_001] = 3e38;
                g.insert("e.big".into(), Tensor::new(vec![70, 1000], d).unwrap());
                let mut out = HashMap::new();
                let first = match ar.all_reduce_into(&g, &mut out) {
                    Err(Error::Overflow { tensor, index }) => Ok((tensor, index)),
                    other => Err(format!("{:?}", other.map(|_| ()))),
                };
                let next = ar.all_reduce_into(&chunked_gradients(rank, 1), &mut out);
                (first, next.map_err(|e| e.to_string()))
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (first, next) = h.join().unwrap();
        assert_eq!(first, Ok(("e.big".to_string(), 50_001)), "rank {rank}");
        assert_eq!(next, Ok(()), "rank {rank}");
    }
}

/// Review findings: the reduced values overflow at one owner: every rank returns
/// `Error::Overflow` naming the tensor and index (as the all-gather does), not one rank an
/// overflow and the others a peer's failure.
#[test]
fn an_overflow_at_one_owner_is_the_same_overflow_on_every_rank() {
    const W: usize = 4;
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let mut ar = CompressedAllReduce::with_communicator(
                    CompressionMethod::BFloat16,
                    Box::new(comm),
                )
                .with_reduction(Reduction::Sum)
                .with_collective(Collective::TwoPhase);
                let mut g = gradients(rank, 0);
                let mut d = g["a.weight"].data().to_vec();
                d[2500] = 3e38;
                g.insert("a.weight".into(), Tensor::new(vec![40, 130], d).unwrap());
                match ar.all_reduce(&g) {
                    Err(Error::Overflow { tensor, index }) => Ok((tensor, index)),
                    other => Err(format!("{:?}", other.map(|_| ()))),
                }
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap();
        assert_eq!(got, Ok(("a.weight".to_string(), 2500)), "rank {rank}");
    }
}

/// Review findings: under `Auto`, a rank that fails before the collective at the first step
/// (no manifest, so no pick of its own), ranks on other collectives, and a rank with another
/// world size given to `all_reduce_on`: every rank errors at the same call, none waits.
#[test]
fn ranks_that_cannot_agree_on_the_route_fail_alike_and_none_waits() {
    // Auto on MiniLM-size sign gradients picks the two-phase collective; rank 1's method is
    // invalid (no manifest).
    let base = minilm();
    let comms = LocalGroup::new(4).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let g = base.clone();
            std::thread::spawn(move || {
                let method = if rank == 1 {
                    CompressionMethod::Quantization { bits: 1 }
                } else {
                    CompressionMethod::SignSGD.with_error_feedback()
                };
                let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                    .with_collective(Collective::Auto);
                ar.all_reduce(&g).unwrap_err().to_string()
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let err = h.join().unwrap();
        if rank == 1 {
            assert!(err.contains("bits"), "{err}");
        } else {
            assert!(err.contains("rank 1"), "rank {rank}: {err}");
        }
    }
    // Rank 0 on the two-phase collective, rank 1 on the all-gather.
    let comms = LocalGroup::new(2).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let c = if rank == 0 {
                    Collective::TwoPhase
                } else {
                    Collective::AllGather
                };
                CompressedAllReduce::with_communicator(CompressionMethod::SignSGD, Box::new(comm))
                    .with_collective(c)
                    .all_reduce(&gradients(rank, 0))
                    .unwrap_err()
                    .to_string()
            })
        })
        .collect();
    let errs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(errs[0], errs[1]);
    assert!(errs[0].contains("differ"), "{}", errs[0]);
    // Rank 0 made for 3 ranks, given a 2-rank communicator.
    let comms = LocalGroup::new(2).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            std::thread::spawn(move || {
                let method = CompressionMethod::SignSGD.with_error_feedback();
                let mut out = HashMap::new();
                if rank == 0 {
                    CompressedAllReduce::new(method, 3)
                        .with_collective(Collective::TwoPhase)
                        .all_reduce_on(&mut comm, &gradients(rank, 0), &mut out)
                        .unwrap_err()
                        .to_string()
                } else {
                    CompressedAllReduce::new(method, 2)
                        .with_collective(Collective::TwoPhase)
                        .all_reduce_on(&mut comm, &gradients(rank, 0), &mut out)
                        .unwrap_err()
                        .to_string()
                }
            })
        })
        .collect();
    let errs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(errs[1].contains("rank 0"), "{}", errs[1]);
}

/// The bounds the two-phase step keeps on the worker's residuals hold: no residual element is
/// larger, step after step, so that a later step's one-read proof of its sums is sound.
/// Checked at W = 3 with top-k, sign and 4-bit quantization, whose steps keep them, and with
/// top-k of f16 values on gradients beyond 65504 (the kept sums are sent saturated: the bound
/// counts the sums, not what was sent).
#[test]
fn the_residual_bounds_a_two_phase_step_keeps_hold() {
    const W: usize = 3;
    let f16_topk = CompressionMethod::Core(gradwire_core::Method::TopK {
        k: gradwire_core::K::Ratio(0.05),
        values: gradwire_core::Values::F16,
    });
    for (method, scale) in [
        (
            CompressionMethod::top_k_int8(0.05).with_error_feedback(),
            1.0f32,
        ),
        (CompressionMethod::SignSGD.with_error_feedback(), 1.0),
        (
            CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
            1.0,
        ),
        (f16_topk.with_error_feedback(), 1.0e5),
    ] {
        let comms = LocalGroup::new(W).into_communicators();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let method = method.clone();
                std::thread::spawn(move || {
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                        .with_collective(Collective::TwoPhase);
                    for s in 0..4 {
                        let mut g = gradients(rank, s);
                        for t in g.values_mut() {
                            t.data_mut().iter_mut().for_each(|x| *x *= scale);
                        }
                        ar.all_reduce(&g).unwrap();
                        let fb = ar.compressor().feedback().unwrap();
                        for (name, r) in fb.residuals() {
                            let largest = r.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                            let bound = fb.residual_bound(name).max_abs();
                            assert!(bound.is_finite(), "rank {rank} step {s} {name}: a bound");
                            assert!(largest <= bound, "rank {rank} step {s} {name}");
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}

/// An owner whose reduced values do not fit the frame's value type (f16 sums beyond 65504,
/// no error feedback) sends its shard escaped, with f32 values (FORMAT.md 15; before, it
/// failed the step on every rank, naming the element): every rank returns the exact sum,
/// wherever the element sits in the owner's chunks (here in a chunk of one part, and in one
/// spanning two parts), the other values as f16 sends them, on one thread and on the pool.
#[test]
fn an_owner_sum_out_of_range_goes_escaped_wherever_it_sits() {
    const W: usize = 2;
    // `c.big2[140_000]` sits in a chunk inside the second part of its owner's shard.
    for (tensor, at) in [("a.big", 40_000usize), ("b.small", 70), ("c.big2", 140_000)] {
        let grads_of = move |_r: usize, _s: u64| {
            let mut big = vec![0.001f32; 150_000];
            let mut small = vec![0.001f32; 3_000];
            let mut big2 = vec![0.001f32; 150_000];
            match tensor {
                "a.big" => big[at] = 40_000.0,
                "b.small" => small[at] = 40_000.0,
                _ => big2[at] = 40_000.0,
            }
            grads(&[
                ("a.big", &[150_000], big),
                ("b.small", &[3_000], small),
                ("c.big2", &[150_000], big2),
            ])
        };
        let mut outputs = Vec::new();
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            let runs = run_group(
                W,
                1,
                move |c| {
                    CompressedAllReduce::with_communicator(CompressionMethod::Float16, c)
                        .with_reduction(Reduction::Sum)
                        .with_collective(Collective::TwoPhase)
                        .with_parallelism(parallelism)
                },
                grads_of,
            );
            for (rank, steps) in runs.iter().enumerate() {
                let out = steps[0].0.as_ref().unwrap_or_else(|e| {
                    panic!("rank {rank}, {tensor}[{at}], {parallelism:?}: {e}")
                });
                assert_eq!(out[tensor].data()[at], 80_000.0, "{tensor}[{at}]");
                // 0.002 as f16 sends it (the escaped shard: exactly 0.001 + 0.001 in f32).
                assert!((out["b.small"].data()[71] - 0.002).abs() < 1e-6);
                outputs.push(flat(out));
            }
        }
        assert!(
            outputs.iter().all(|o| same_bits(o, &outputs[0])),
            "{tensor}: ranks, serial and pooled"
        );
    }
}

/// An envelope (FORMAT.md 14) of `kind` with `fingerprint` and `body`, as a hostile peer
/// would write it: valid framing, any content.
fn forged_envelope(kind: u8, fingerprint: u64, body: &[u8]) -> Vec<u8> {
    let mut msg = b"GWCM".to_vec();
    msg.extend_from_slice(&[1, kind, 0, 0]);
    msg.extend_from_slice(&fingerprint.to_le_bytes());
    let crc = crc32fast::hash(&msg);
    msg.extend_from_slice(&crc.to_le_bytes());
    msg.extend_from_slice(body);
    msg
}

/// A relay envelope's body: the rank at fault, the kind, the reason.
fn relay_body(rank: u32, kind: u8, reason: &[u8]) -> Vec<u8> {
    let mut body = rank.to_le_bytes().to_vec();
    body.push(kind);
    body.extend_from_slice(reason);
    body
}

/// What rank 1 sends instead of its message of an all-gather call: `forge(its real message)`.
type Forgery = fn(&[u8]) -> Vec<u8>;

/// A communicator whose rank `forger` replaces its message of each all-gather call number
/// `call` (1-based, counted from its first call) of `forges` by `forge(its real message)`.
struct Forge<C> {
    inner: C,
    forger: usize,
    forges: Vec<(usize, Forgery)>,
    calls: usize,
}

impl<C: Communicator> Communicator for Forge<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.calls += 1;
        let forge = self.forges.iter().find(|(call, _)| *call == self.calls);
        if let (true, Some((_, forge))) = (self.inner.rank() == self.forger, forge) {
            let forged = forge(local);
            return self.inner.all_gather(&forged, max_len, out);
        }
        self.inner.all_gather(local, max_len, out)
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.inner.all_to_all(send, max_len, out)
    }
    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
}

/// Every rank's error of the first step of `method` on `collective` over 3 threads where rank
/// 1 forges its all-gather calls as `forges` says, and whether the second step then succeeds.
fn forged_step(
    method: CompressionMethod,
    collective: Collective,
    forges: &[(usize, Forgery)],
) -> Vec<(String, bool)> {
    const W: usize = 3;
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let method = method.clone();
            let forges = forges.to_vec();
            std::thread::spawn(move || {
                let forged = Forge {
                    inner: comm,
                    forger: 1,
                    forges,
                    calls: 0,
                };
                let mut ar = CompressedAllReduce::with_communicator(method, Box::new(forged))
                    .with_collective(collective);
                let first = ar.all_reduce(&gradients(rank, 0)).map(|_| ());
                let err = match first {
                    Err(e) => e.to_string(),
                    Ok(()) => "the step succeeded".to_owned(),
                };
                let next = ar.all_reduce(&gradients(rank, 1)).is_ok();
                (err, next)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Issue 48 class 6: what a peer sends reaches every rank's errors escaped and capped, and a
/// phase-2 relay or payload the protocol cannot produce is a bad message from its sender, the
/// same error on every rank.
#[test]
fn peer_text_is_escaped_and_impossible_relays_name_their_sender() {
    let sign = || CompressionMethod::SignSGD.with_error_feedback();
    // The two-phase step's all-gathers: the agreement round, then phase 2.
    let phase2 = |forge| forged_step(sign(), Collective::TwoPhase, &[(2, forge)]);
    let same_everywhere = |runs: &[(String, bool)], must: &[&str]| {
        for (rank, (err, next)) in runs.iter().enumerate() {
            assert_eq!(err, &runs[0].0, "rank {rank}: every rank the same error");
            for m in must {
                assert!(err.contains(m), "rank {rank}: `{m}` not in {err:?}");
            }
            assert!(
                !err.chars().any(char::is_control),
                "rank {rank}: a control character reached the error: {err:?}"
            );
            assert!(*next, "rank {rank}: the next step runs");
        }
    };
    // A failure whose reason clears the screen and forges a line.
    let runs = phase2(|_| forged_envelope(1, 0, b"\x1b[2Jforged\nreason"));
    same_everywhere(&runs, &["rank 1", "\\u{1b}[2Jforged\\nreason"]);
    // A reason longer than any failure's (dense bf16's bundle leaves room for it within the
    // all-gather's limit): capped.
    let runs = forged_step(
        CompressionMethod::BFloat16,
        Collective::AllGather,
        &[(1, |_| forged_envelope(1, 0, &[b'x'; 3000]))],
    );
    same_everywhere(&runs, &["rank 1", "xxx..."]);
    assert!(runs[0].0.len() < 1200, "{}", runs[0].0.len());
    // A relay of a failure of rank 7, in a group of 3.
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(7, 0, b"gone")));
    same_everywhere(&runs, &["rank 1", "rank 7, outside the group of 3"]);
    // A relay blaming rank 0, which did not fail.
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(0, 0, b"blame")));
    same_everywhere(
        &runs,
        &["rank 1", "failure of rank 0, whose own message shows none"],
    );
    // Overflow relays: another rank's shard; an index that is not one.
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(2, 2, b"5\nw")));
    same_everywhere(&runs, &["rank 1", "overflow of rank 2's shard"]);
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(1, 2, b"five\nw")));
    same_everywhere(&runs, &["rank 1", "does not name an index"]);
    // ... a tensor the model lacks, an element past the tensor's end.
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(1, 2, b"5\nno.such\x1b")));
    same_everywhere(
        &runs,
        &[
            "rank 1",
            "names `no.such\\u{1b}`, not a tensor of the model",
        ],
    );
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(1, 2, b"5200\na.weight")));
    same_everywhere(
        &runs,
        &["rank 1", "element 5200 of `a.weight`, which has 5200"],
    );
    // A well-formed one is the group's overflow, the same on every rank.
    let runs = phase2(|_| forged_envelope(2, 0, &relay_body(1, 2, b"5199\na.weight")));
    same_everywhere(&runs, &["a.weight", "5199"]);
    // A reduced shard sealed for another configuration or step.
    fn other_fingerprint(real: &[u8]) -> Vec<u8> {
        let mut msg = real.to_vec();
        msg[8] ^= 1;
        let crc = crc32fast::hash(&msg[..16]);
        msg[16..20].copy_from_slice(&crc.to_le_bytes());
        msg
    }
    let runs = phase2(other_fingerprint);
    same_everywhere(&runs, &["rank 1", "another configuration or step"]);
    // The all-gather collective's naming round: rank 1's first message shows another
    // fingerprint, then its configuration text has control characters and a long value.
    let hostile_text: Forgery = |_| {
        let mut text = b"\x1b]0;title\x07method=x\x1b[2J".to_vec();
        text.extend_from_slice(&[b'A'; 100_000]);
        text.extend_from_slice(b"\x1b[31m\n");
        text
    };
    let runs = forged_step(
        sign(),
        Collective::AllGather,
        &[(1, other_fingerprint), (2, hostile_text)],
    );
    for (rank, (err, _)) in runs.iter().enumerate() {
        assert!(
            err.contains("rank 1 is configured differently")
                && err.contains("x\\u{1b}[2JAAA")
                && err.contains("AAA..."),
            "rank {rank}: {err}"
        );
        assert!(!err.chars().any(char::is_control), "rank {rank}: {err:?}");
        assert!(err.len() < 4000, "rank {rank}: {} bytes", err.len());
    }
}

/// Review finding: a rank whose phase 1 failed (a NaN found after the agreement round) checks
/// the phase-2 fingerprints as its peers do, so a forged reduced shard from a lower rank is the
/// same error on every rank, the failed one included.
#[test]
fn a_failed_rank_checks_phase_2_fingerprints_as_its_peers_do() {
    const W: usize = 3;
    let comms = LocalGroup::new(W).into_communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let forged = Forge {
                    inner: comm,
                    forger: 0,
                    forges: vec![(2, |_| forged_envelope(0, 12345, b"not a shard"))],
                    calls: 0,
                };
                let mut ar = CompressedAllReduce::with_communicator(
                    CompressionMethod::SignSGD.with_error_feedback(),
                    Box::new(forged),
                )
                .with_collective(Collective::TwoPhase);
                let mut g = gradients(rank, 0);
                if rank == 2 {
                    let mut d = g["d.weight"].data().to_vec();
                    d[17] = f32::NAN;
                    g.insert("d.weight".into(), Tensor::new(vec![3000], d).unwrap());
                }
                ar.all_reduce(&g).map(|_| ()).unwrap_err().to_string()
            })
        })
        .collect();
    let errors: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, err) in errors.iter().enumerate() {
        assert!(
            err.contains("rank 0") && err.contains("another configuration or step"),
            "rank {rank}: {err}"
        );
    }
}

/// Review finding: a method without server residuals (no error feedback, or a majority vote)
/// has none to save: `save_server_residuals` refuses, as documented, where it wrote a file
/// without residuals.
#[test]
fn a_method_without_server_residuals_has_none_to_save() {
    let dir = std::env::temp_dir().join(format!("gw-no-server-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (method, reduction) in [
        (CompressionMethod::BFloat16, Reduction::Mean),
        (CompressionMethod::SignSGDMajority, Reduction::MajorityVote),
        (
            CompressionMethod::SignSGD.with_error_feedback(),
            Reduction::Mean,
        ),
    ] {
        let comm = LocalGroup::new(1).into_communicators().remove(0);
        let mut ar = CompressedAllReduce::with_communicator(method.clone(), Box::new(comm))
            .with_reduction(reduction)
            .with_collective(Collective::TwoPhase);
        ar.all_reduce(&gradients(0, 0)).unwrap();
        let path = dir.join("server.safetensors");
        let saved = ar.save_server_residuals(&path);
        let keeps = reduction == Reduction::Mean && method.uses_error_feedback();
        match saved {
            Ok(()) => assert!(keeps, "{method:?} {reduction:?} saved"),
            Err(Error::Config { reason }) => {
                assert!(
                    !keeps && reason.contains("keeps no server residuals"),
                    "{reason}"
                )
            }
            Err(e) => panic!("{e}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 48 class 4: server residuals saved with one method are refused by a run of another
/// (top-k 5% f32 into top-k 5% f16, where every step then failed on every rank, and into
/// 4-bit quantization, where they were added silently): the first step fails on every rank,
/// naming both methods; so does a run at another step (the worker's checkpoint not loaded);
/// the same method with the worker's checkpoint resumes.
#[test]
fn server_residuals_of_another_method_are_refused() {
    const W: usize = 2;
    let topk = |values| {
        CompressionMethod::Core(Method::TopK {
            k: K::Ratio(0.05),
            values,
        })
        .with_error_feedback()
    };
    let dir = std::env::temp_dir().join(format!("gw-server-method-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |method: CompressionMethod, save: Option<bool>| {
        let comms = LocalGroup::new(W).into_communicators();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (dir, method) = (dir.clone(), method.clone());
                std::thread::spawn(move || {
                    let mut ar = CompressedAllReduce::with_communicator(method, Box::new(comm))
                        .with_collective(Collective::TwoPhase);
                    let path = dir.join(format!("server-{rank}"));
                    let worker = dir.join(format!("worker-{rank}"));
                    if save == Some(true) {
                        for s in 0..2 {
                            ar.all_reduce(&gradients(rank, s)).unwrap();
                        }
                        ar.save_server_residuals(&path).unwrap();
                        ar.compressor_mut().save_feedback(&worker).unwrap();
                        return Ok(());
                    }
                    // `Some(false)`: with the worker's checkpoint of the same moment.
                    if save == Some(false) {
                        ar.compressor_mut().load_feedback(&worker).unwrap();
                    }
                    ar.load_server_residuals(&path).unwrap();
                    ar.all_reduce(&gradients(rank, 2))
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    run(topk(Values::F32), Some(true));
    for other in [
        topk(Values::F16),
        CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
    ] {
        for (rank, result) in run(other.clone(), None).into_iter().enumerate() {
            let err = result.unwrap_err();
            assert!(
                err.contains("saved with method `topk k=ratio:0.05 values=f32`"),
                "{other:?}, rank {rank}: {err}"
            );
        }
    }
    // The same method without the worker's checkpoint: the run is at step 0, the server
    // residuals were saved before step 2.
    for (rank, result) in run(topk(Values::F32), None).into_iter().enumerate() {
        let err = result.unwrap_err();
        assert!(
            err.contains("saved before step 2; this run is at step 0"),
            "rank {rank}: {err}"
        );
    }
    for result in run(topk(Values::F32), Some(false)) {
        result.unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

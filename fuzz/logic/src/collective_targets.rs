//! Target `two_phase`: the two-phase collective of `CompressedAllReduce` as rank 0 of a group
//! of two, whose peer's messages (its phase-1 shard for owner 0, its phase-2 reduced shard, its
//! configuration text) are fuzzer bytes, delivered by a communicator that plays the peer.
//!
//! Input: a byte of flags (method, repair of the envelope and the shard header so that the
//! frames behind them are reached, mirroring rank 0's own shard as the peer's, an agreement
//! round from fuzzer bytes instead of an echo), the model's sizes and gradient, then the
//! peer's messages.
//!
//! Properties: no panic and no allocation sized by the peer's bytes (its messages are bounded
//! by the collective's limit, as a transport bounds them); a step that fails leaves rank 0's
//! worker residuals exactly as they were (bit for bit); a step that succeeds gives finite
//! values of the model's shapes.

use std::collections::HashMap;

use gradwire::comm::{CommError, Communicator, Traffic};
use gradwire::core::{K, Method, Values};
use gradwire::tensor::Tensor;
use gradwire::{Collective, CompressedAllReduce, CompressionMethod, Reduction};

use crate::input::{Input, crc32};

/// The peer, rank 1: its messages come from the fuzzer.
struct Peer {
    phase1: Vec<u8>,
    phase2: Vec<u8>,
    names: Vec<u8>,
    repair: bool,
    mirror: bool,
    disagree: bool,
    gathers: usize,
    step: u64,
}

/// Writes a valid envelope head (payload, `fingerprint`) and, behind it, a valid shard-message
/// head for `phase`, `step`, `shard` and one frame, with both CRCs, over `msg`'s own bytes.
fn repair(msg: &mut Vec<u8>, fingerprint: &[u8], phase: u8, step: u64, shard: u32) {
    if msg.len() < 48 {
        msg.resize(48, 0);
    }
    msg[..4].copy_from_slice(b"GWCM");
    msg[4..8].copy_from_slice(&[1, 0, 0, 0]);
    msg[8..16].copy_from_slice(fingerprint);
    let crc = crc32(&msg[..16]);
    msg[16..20].copy_from_slice(&crc.to_le_bytes());
    let body = &mut msg[20..];
    body[..4].copy_from_slice(b"GWSH");
    body[4..8].copy_from_slice(&[1, phase, 0, 0]);
    body[8..16].copy_from_slice(&step.to_le_bytes());
    body[16..20].copy_from_slice(&shard.to_le_bytes());
    body[20..24].copy_from_slice(&1u32.to_le_bytes());
    let mut covered = body[..24].to_vec();
    covered.extend_from_slice(&body[28..]);
    let crc = crc32(&covered);
    body[24..28].copy_from_slice(&crc.to_le_bytes());
}

fn bounded(msg: &[u8], max_len: usize, rank: usize) -> Result<Vec<u8>, CommError> {
    if msg.len() > max_len {
        return Err(CommError::TooLarge {
            rank,
            len: msg.len(),
            limit: max_len,
        });
    }
    Ok(msg.to_vec())
}

impl Communicator for Peer {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        2
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.gathers += 1;
        // Call 1: the agreement round (the peer agrees: it echoes rank 0's envelope, unless
        // the flags give it the configuration bytes instead); call 2: phase 2; then the naming
        // round.
        let mut theirs = match self.gathers {
            1 if !self.disagree => local.to_vec(),
            1 => self.names.clone(),
            2 => self.phase2.clone(),
            _ => self.names.clone(),
        };
        if self.gathers == 2 && self.repair && local.len() >= 20 {
            let fingerprint = local[8..16].to_vec();
            repair(&mut theirs, &fingerprint, 2, self.step, 1);
        }
        let theirs = bounded(&theirs, max_len, 1)?;
        let ours = bounded(local, max_len, 0)?;
        *out = vec![ours, theirs];
        Ok(())
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        if send.len() != 2 {
            return Err(CommError::Mismatch {
                round: 0,
                detail: "two buffers expected".into(),
            });
        }
        let mut theirs = if self.mirror {
            // Rank 0's own shard for itself, damaged where the fuzzer says.
            let mut m = send[0].clone();
            for (i, b) in self.phase1.iter().enumerate() {
                if let Some(x) = m.get_mut(i) {
                    *x ^= b;
                }
            }
            m
        } else {
            self.phase1.clone()
        };
        if self.repair && send[1].len() >= 20 {
            let fingerprint = send[1][8..16].to_vec();
            repair(&mut theirs, &fingerprint, 1, self.step, 0);
        }
        let theirs = bounded(&theirs, max_len, 1)?;
        let ours = bounded(&send[0], max_len, 0)?;
        *out = vec![ours, theirs];
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
}

/// The method of flag bits 0..3.
fn method(flags: u8) -> (CompressionMethod, Reduction) {
    let ef = |m: CompressionMethod| m.with_error_feedback();
    match flags % 7 {
        0 => (ef(CompressionMethod::SignSGD), Reduction::Mean),
        1 => (
            ef(CompressionMethod::Quantization { bits: 4 }),
            Reduction::Mean,
        ),
        2 => (
            ef(CompressionMethod::Core(Method::TopK {
                k: K::Ratio(0.05),
                values: Values::F32,
            })),
            Reduction::Mean,
        ),
        3 => (ef(CompressionMethod::top_k_int8(0.05)), Reduction::Mean),
        4 => (CompressionMethod::Float16, Reduction::Sum),
        5 => (CompressionMethod::SignSGDMajority, Reduction::MajorityVote),
        _ => (
            CompressionMethod::Core(Method::Dense {
                values: Values::F32,
            }),
            Reduction::Mean,
        ),
    }
}

/// The target body.
pub fn two_phase(data: &[u8]) {
    let mut inp = Input::new(data);
    let flags = inp.u8();
    let (method, reduction) = method(flags & 7);
    let repair = flags & 8 != 0;
    let mirror = flags & 16 != 0;
    let disagree = flags & 32 != 0;
    let sizes = [inp.range(1, 3000) as usize, inp.range(1, 1500) as usize];
    let seed = u64::from(inp.u8());
    let mut grads = HashMap::new();
    for (t, &n) in sizes.iter().enumerate() {
        let data: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + t * 104_729) % 1000) as f32 - 500.0) / 100.0)
            .collect();
        grads.insert(format!("t{t}"), Tensor::new(vec![n], data).expect("shape"));
    }
    let len1 = inp.range(0, 4096) as usize;
    let phase1 = inp.bytes(len1).to_vec();
    let len2 = inp.range(0, 4096) as usize;
    let phase2 = inp.bytes(len2).to_vec();
    let names = inp.rest().to_vec();
    let mut ar = CompressedAllReduce::new(method, 2)
        .with_seed(seed)
        .with_reduction(reduction)
        .with_collective(Collective::TwoPhase);
    let mut peer = Peer {
        phase1,
        phase2,
        names,
        repair,
        mirror,
        disagree,
        gathers: 0,
        step: 0,
    };
    let residuals = |ar: &CompressedAllReduce| -> Vec<(String, Vec<u32>)> {
        ar.compressor()
            .feedback()
            .map(|f| {
                f.residuals()
                    .map(|(n, r)| (n.to_owned(), r.iter().map(|x| x.to_bits()).collect()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = HashMap::new();
    // Two steps, so that the second starts from residuals the first left.
    for step in 0..2u64 {
        peer.step = step;
        peer.gathers = 0;
        let before = residuals(&ar);
        match ar.all_reduce_on(&mut peer, &grads, &mut out) {
            Ok(()) => {
                for (name, g) in &grads {
                    let t = &out[name];
                    assert_eq!(t.shape(), g.shape(), "{name}");
                    assert!(t.data().iter().all(|x| x.is_finite()), "{name}");
                }
            }
            Err(_) => {
                let after = residuals(&ar);
                // A residual created by this step starts as zeros and is restored to zeros.
                for (name, r) in &after {
                    match before.iter().find(|(n, _)| n == name) {
                        Some((_, old)) => assert_eq!(old, r, "{name} changed on a failed step"),
                        None => assert!(r.iter().all(|&b| b == 0), "{name} changed"),
                    }
                }
            }
        }
    }
}

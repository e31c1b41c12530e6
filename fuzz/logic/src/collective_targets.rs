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
//! worker residuals exactly as they were (bit for bit: a local error, found before anything
//! changes) or gives back what it sent (each residual then holds the gradient plus its old
//! value, up to f32 rounding); a step that succeeds gives finite values of the model's shapes.

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
/// head (version 4) for `phase`, `step`, `shard` and one frame, over `msg`'s own bytes, and
/// both CRCs: the envelope's, and the message's trailer as gradwire computes it (FORMAT.md 15:
/// each frame's body CRC taken from its trailer), so that the frame behind it is reached.
fn repair(msg: &mut Vec<u8>, fingerprint: &[u8], phase: u8, step: u64, shard: u32) {
    if msg.len() < 52 {
        msg.resize(52, 0);
    }
    msg[..4].copy_from_slice(b"GWCM");
    msg[4..8].copy_from_slice(&[1, 0, 0, 0]);
    msg[8..16].copy_from_slice(fingerprint);
    let crc = crc32(&msg[..16]);
    msg[16..20].copy_from_slice(&crc.to_le_bytes());
    let body = &mut msg[20..];
    body[..4].copy_from_slice(b"GWSH");
    body[4..8].copy_from_slice(&[4, phase, 0, 0]);
    body[8..16].copy_from_slice(&step.to_le_bytes());
    body[16..20].copy_from_slice(&shard.to_le_bytes());
    body[20..24].copy_from_slice(&1u32.to_le_bytes());
    body[24..28].copy_from_slice(&[0; 4]);
    let end = body.len() - 4;
    let crc = shard_message_crc(&body[..end]);
    body[end..].copy_from_slice(&crc.to_le_bytes());
}

/// The CRC of a shard message's bytes before its trailer as FORMAT.md 15 defines it: the
/// 28-byte header, then each frame's length and the frame, the frame's body CRC taken from the
/// frame's own trailer (its last 4 bytes), then any bytes after the last whole frame.
fn shard_message_crc(msg: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&msg[..28]);
    let mut rest = &msg[28..];
    while let Some(len) = rest.get(..4) {
        h.update(len);
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let Some(frame) = rest.get(4..4usize.saturating_add(len)) else {
            rest = &rest[4..];
            break;
        };
        match frame.len().checked_sub(4) {
            Some(body_len) => {
                let t = &frame[body_len..];
                let body_crc = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
                h.combine(&crc32fast::Hasher::new_with_initial_len(
                    body_crc,
                    body_len as u64,
                ));
                h.update(t);
            }
            None => h.update(frame),
        }
        rest = &rest[4 + len..];
    }
    h.update(rest);
    h.finalize()
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
    // Values up to 40,000: with f16 values a mirrored sum leaves the type, and the owner sends
    // its shard escaped (FORMAT.md 15).
    let scale = if flags & 64 != 0 { 8000.0 } else { 1.0 };
    let sizes = [inp.range(1, 3000) as usize, inp.range(1, 1500) as usize];
    let seed = u64::from(inp.u8());
    let mut grads = HashMap::new();
    for (t, &n) in sizes.iter().enumerate() {
        let data: Vec<f32> = (0..n)
            .map(|i| scale * (((i * 7919 + t * 104_729) % 1000) as f32 - 500.0) / 100.0)
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
                // A failed step leaves each residual as it was (a local error, found before
                // anything changes; a residual created by this step is zeros), or gives back
                // what the rank sent: the residual then holds the gradient plus the old
                // residual, up to the f32 rounding of `(x - sent) + sent`.
                for (name, r) in &after {
                    let old = match before.iter().find(|(n, _)| n == name) {
                        Some((_, old)) => old.clone(),
                        None => vec![0; r.len()],
                    };
                    if &old == r {
                        continue;
                    }
                    let g = grads[name].data();
                    let x: Vec<f32> = old
                        .iter()
                        .zip(g)
                        .map(|(&o, &g)| f32::from_bits(o) + g)
                        .collect();
                    let scale = 1.0 + x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    for (i, (&b, &want)) in r.iter().zip(&x).enumerate() {
                        let got = f32::from_bits(b);
                        assert!(
                            (got - want).abs() <= 1e-5 * scale,
                            "{name}[{i}]: {got} after a failed step, neither the old residual \
                             nor the gradient given back ({want})"
                        );
                    }
                }
            }
        }
    }
}

/// The metadata value of `key` in a safetensors file's JSON header (`"key":"value"`), if any.
fn metadata_value(file: &[u8], key: &str) -> Option<String> {
    let len = u64::from_le_bytes(file.get(..8)?.try_into().ok()?) as usize;
    let header = std::str::from_utf8(file.get(8..8usize.checked_add(len)?)?).ok()?;
    let tag = format!("\"{key}\":\"");
    let start = header.find(&tag)? + tag.len();
    let end = start + header[start..].find('"')?;
    Some(header[start..end].to_owned())
}

/// The shard-layout text of a server checkpoint with fields edited as the fuzzer says: each
/// field kept, replaced by a fuzzer number (decimal; the layout id in hex) or left out.
fn edit_shard_text(text: &str, inp: &mut Input<'_>) -> String {
    let fields: Vec<String> = text
        .split(';')
        .filter_map(|kv| {
            let (key, value) = kv.split_once('=')?;
            match inp.u8() % 4 {
                0 | 1 => Some(kv.to_owned()),
                2 if key == "layout" => Some(format!("{key}={:x}", inp.u64())),
                2 => Some(format!("{key}={}", inp.range(0, 4))),
                _ if value.is_empty() => Some(kv.to_owned()),
                _ => None,
            }
        })
        .collect();
    fields.join(";")
}

/// The references of [`server_checkpoint`] by (method, sizes, seed): the rank's own checkpoint
/// after its first step and the bits of its second step's result.
type References = HashMap<(u8, [usize; 2], u64), (Vec<u8>, Vec<u32>)>;

/// At most this many references are kept (a few MB); past it they are dropped and made again.
const REFERENCES_KEPT: usize = 4096;

thread_local! {
    static REFERENCES: std::cell::RefCell<References> = std::cell::RefCell::new(HashMap::new());
}

/// Target `server_checkpoint`: a two-phase server-residual checkpoint
/// (`CompressedAllReduce::load_server_residuals`) from hostile bytes, in a group of one rank.
///
/// Input: a byte selecting the method (EF-sign, 4-bit EF, top-k f32 EF, top-k int8 EF) and how
/// the file is made (fuzzer bytes; the rank's own checkpoint XOR-damaged; a checkpoint written
/// by the library with fuzzer residuals, names and shard-layout text, its checksums right or
/// the layout's CRC from the fuzzer; the own checkpoint unchanged), two tensor sizes, a seed,
/// then the bytes of that choice.
///
/// Properties: no panic; a refused load changes nothing (the next step is bit for bit that of
/// a rank that never loaded); an accepted load gives a next step that either succeeds with
/// finite values of the model's shapes (bit for bit the reference's for the rank's own file)
/// or fails with a message, after which discarding the server residuals lets the step run.
pub fn server_checkpoint(data: &[u8]) {
    use gradwire::comm::LocalGroup;
    use gradwire::feedback::ErrorFeedback;

    let mut inp = Input::new(data);
    let flags = inp.u8();
    let (method, reduction) = method(flags % 4);
    // Small tensors, so that the four steps of an input run fast; one spans two shard blocks.
    let sizes = [inp.range(1, 2100) as usize, inp.range(1, 300) as usize];
    let seed = u64::from(inp.u8());
    let mut grads = HashMap::new();
    for (t, &n) in sizes.iter().enumerate() {
        let data: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + t * 104_729) % 1000) as f32 - 500.0) / 100.0)
            .collect();
        grads.insert(format!("t{t}"), Tensor::new(vec![n], data).expect("shape"));
    }
    let make = || {
        CompressedAllReduce::new(method.clone(), 1)
            .with_seed(seed)
            .with_reduction(reduction)
            .with_collective(Collective::TwoPhase)
    };
    let mut comm = LocalGroup::new(1)
        .into_communicators()
        .pop()
        .expect("a group of one");
    let step = |ar: &mut CompressedAllReduce, comm: &mut dyn Communicator| {
        let mut out = HashMap::new();
        ar.all_reduce_on(comm, &grads, &mut out).map(|()| out)
    };
    let flat = |out: &HashMap<String, Tensor>| -> Vec<u32> {
        (0..2)
            .flat_map(|t| out[&format!("t{t}")].data().iter().map(|x| x.to_bits()))
            .collect()
    };
    // The reference: two steps, its server residuals saved after the first. It depends on the
    // method, the sizes and the seed alone, so it is kept for the inputs that share them (the
    // fuzzer's mutations keep these leading bytes more often than not): half of an input's
    // steps, and the save, are skipped then.
    let path = std::env::temp_dir().join(format!("gradwire-fuzz-server-{}", std::process::id()));
    let key = (flags % 4, sizes, seed);
    let cached = REFERENCES.with(|r| r.borrow().get(&key).cloned());
    let (own, expected) = match cached {
        Some(reference) => reference,
        None => {
            let mut reference = make();
            step(&mut reference, &mut comm).expect("the reference's first step");
            reference
                .save_server_residuals(&path)
                .expect("saving server residuals");
            let own = std::fs::read(&path).expect("reading them back");
            let expected =
                flat(&step(&mut reference, &mut comm).expect("the reference's second step"));
            REFERENCES.with(|r| {
                let mut r = r.borrow_mut();
                if r.len() >= REFERENCES_KEPT {
                    r.clear();
                }
                r.insert(key, (own.clone(), expected.clone()));
            });
            (own, expected)
        }
    };

    let file = match (flags >> 2) % 4 {
        0 => inp.rest().to_vec(),
        1 => {
            let mut b = own.clone();
            while !inp.is_empty() {
                let at = inp.range(0, b.len() as u64 - 1) as usize;
                b[at] ^= inp.u8() | 1;
            }
            b
        }
        2 => {
            let Ok(mut fb) = ErrorFeedback::from_bytes(&own) else {
                panic!("the rank's own server checkpoint does not load as a checkpoint");
            };
            let names: Vec<String> = fb.residuals().map(|(n, _)| n.to_owned()).collect();
            for name in &names {
                if inp.bool() {
                    let len = inp.range(0, 2200) as usize;
                    let values = (0..len).map(|_| inp.f32_bits()).collect();
                    // A value the checkpoint refuses is refused here too: the file keeps the old.
                    let _ = fb.set_residual(name, values);
                }
            }
            if inp.bool() {
                let _ = fb.set_residual(&format!("t{}", inp.u8() % 4), vec![0.0; 3]);
            }
            let text = metadata_value(&own, "server_shards").expect("a shard layout");
            let text = edit_shard_text(&text, &mut inp);
            let crc = if inp.bool() {
                format!("{:08x}", inp.u32())
            } else {
                format!("{:08x}", crc32(text.as_bytes()))
            };
            fb.to_bytes_with_metadata(&[("server_shards", &text), ("server_shards_crc32", &crc)])
                .expect("writing a checkpoint")
        }
        _ => own.clone(),
    };
    std::fs::write(&path, &file).expect("writing the candidate");

    let mut rank = make();
    step(&mut rank, &mut comm).expect("the first step");
    let loaded = rank.load_server_residuals(&path);
    let _ = std::fs::remove_file(&path);
    let next = step(&mut rank, &mut comm);
    match loaded {
        Err(e) => {
            assert!(!e.to_string().is_empty(), "an error without a message");
            let next = next.expect("a refused load changed the next step");
            assert_eq!(flat(&next), expected, "a refused load changed the result");
        }
        Ok(()) => match next {
            Ok(out) => {
                for (name, g) in &grads {
                    let t = &out[name];
                    assert_eq!(t.shape(), g.shape(), "{name}");
                    assert!(t.data().iter().all(|x| x.is_finite()), "{name}");
                }
                if file == own {
                    assert_eq!(flat(&out), expected, "resume from the own checkpoint");
                }
            }
            Err(e) => {
                assert!(!e.to_string().is_empty(), "an error without a message");
                assert!(
                    file != own,
                    "the rank's own checkpoint failed the step: {e}"
                );
                rank.discard_server_residuals();
                step(&mut rank, &mut comm).expect("a step after discarding the residuals");
            }
        },
    }
}

/// Target `dense_sum`: the default [`Communicator::all_reduce_sum_f32`] (the rank-order f32
/// sum every transport without its own schedule runs) as rank `me` of a group of up to 6,
/// whose peers' messages (each one's shard for `me`, each one's shard sum) are fuzzer bytes or
/// valid messages damaged as the fuzzer says, delivered by a communicator that plays the peers
/// and bounds every message by the call's limit, as a transport does.
///
/// Input: the world size, `me`, the element count, `me`'s values, then per peer and phase a
/// mode byte (valid; fuzzer bytes; valid then cut; valid then lengthened; valid with another
/// length or verdict word) and its bytes.
///
/// Properties: no panic; `me` sends each peer its count and exactly its shard; the call
/// succeeds exactly when every message is valid (the length word equal to `me`'s count, a zero
/// verdict, exactly the shard's bytes), and then gives the rank-order sum of `me`'s shard and
/// the peers' sums elsewhere, bit for bit; a call that fails leaves the values as they were.
pub fn dense_sum(data: &[u8]) {
    let mut inp = Input::new(data);
    let w = inp.range(1, 6) as usize;
    let me = inp.range(0, w as u64 - 1) as usize;
    let n = inp.range(0, 48) as usize;
    let x: Vec<f32> = (0..n).map(|_| inp.f32_bits()).collect();
    let shard = |j: usize| j * n / w..(j + 1) * n / w;
    let mut valid = true;
    // A message: its 8-byte word and the values behind it, then damaged by its mode.
    let mut message = |inp: &mut Input<'_>, word: u64, values: usize| -> Vec<u8> {
        let mode = inp.u8() % 5;
        let mut m = word.to_le_bytes().to_vec();
        for _ in 0..values {
            m.extend_from_slice(&inp.f32_bits().to_le_bytes());
        }
        match mode {
            0 => {}
            1 => {
                let len = inp.range(0, 8 + 4 * 48 + 16) as usize;
                m = inp.bytes(len).to_vec();
            }
            2 => {
                let cut = inp.range(1, m.len() as u64) as usize;
                m.truncate(m.len() - cut);
            }
            3 => {
                let more = inp.range(1, 16) as usize;
                m.extend_from_slice(inp.bytes(more));
                m.resize(m.len().max(8 + 4 * values + more), 0);
            }
            _ => {
                let other = inp.u64();
                m[..8].copy_from_slice(&other.to_le_bytes());
            }
        }
        let ok = m.len() == 8 + 4 * values && m[..8] == word.to_le_bytes();
        valid &= ok;
        m
    };
    let phase1: Vec<Vec<u8>> = (0..w)
        .map(|r| {
            if r == me {
                Vec::new()
            } else {
                message(&mut inp, n as u64, shard(me).len())
            }
        })
        .collect();
    let phase2: Vec<Vec<u8>> = (0..w)
        .map(|r| {
            if r == me {
                Vec::new()
            } else {
                message(&mut inp, 0, shard(r).len())
            }
        })
        .collect();
    // What `me` must send: its count and shard `j` to rank `j`.
    let sends: Vec<Vec<u8>> = (0..w)
        .map(|j| {
            let mut m = (n as u64).to_le_bytes().to_vec();
            for v in &x[shard(j)] {
                m.extend_from_slice(&v.to_le_bytes());
            }
            m
        })
        .collect();
    let mut peers = Peers {
        me,
        w,
        phase1: phase1.clone(),
        phase2: phase2.clone(),
        sends,
    };
    let mut got = x.clone();
    let result = peers.all_reduce_sum_f32(&mut got);
    // Bit for bit; only a NaN that an addition made may differ in its payload (Rust leaves
    // the payload of an arithmetic NaN unspecified, and this oracle is compiled apart from the
    // library's sum). Copied values and the values of a failed call compare exactly.
    let same_bits = |a: &[f32], b: &[f32]| {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    };
    let same_sum = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
    };
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    match result {
        Ok(()) => {
            assert!(valid, "an invalid message was accepted");
            let mut want = vec![0.0f32; n];
            for j in 0..w {
                if j == me {
                    let mut sum = Vec::new();
                    for (r, msg) in phase1.iter().enumerate() {
                        let vals = if r == me {
                            x[shard(me)].to_vec()
                        } else {
                            f32s(&msg[8..])
                        };
                        if r == 0 {
                            sum = vals;
                        } else {
                            for (s, v) in sum.iter_mut().zip(vals) {
                                *s += v;
                            }
                        }
                    }
                    want[shard(me)].copy_from_slice(&sum);
                } else {
                    want[shard(j)].copy_from_slice(&f32s(&phase2[j][8..]));
                }
            }
            let own = shard(me);
            assert!(
                same_sum(&got[own.clone()], &want[own.clone()]),
                "not the rank-order sum"
            );
            assert!(
                same_bits(&got[..own.start], &want[..own.start])
                    && same_bits(&got[own.end..], &want[own.end..]),
                "the peers' sums not copied bit for bit"
            );
        }
        Err(_) => {
            assert!(!valid, "valid messages were refused");
            assert!(same_bits(&got, &x), "a failed call changed the values");
        }
    }
}

/// The peers of [`dense_sum`]: their messages come from the fuzzer; `sends` is what `me` must
/// send them in the all-to-all (checked: a wrong shard would be a wrong sum on the peers).
struct Peers {
    me: usize,
    w: usize,
    phase1: Vec<Vec<u8>>,
    phase2: Vec<Vec<u8>>,
    sends: Vec<Vec<u8>>,
}

impl Peers {
    /// `out[me]` is `own`, `out[r]` peer `r`'s message, each bounded by `max_len` (the first
    /// one over it fails the call, as a transport fails it).
    fn deliver(
        &self,
        own: &[u8],
        theirs: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        out.clear();
        for (r, msg) in theirs.iter().enumerate().take(self.w) {
            let m = if r == self.me { own } else { &msg[..] };
            if m.len() > max_len {
                return Err(CommError::TooLarge {
                    rank: r,
                    len: m.len(),
                    limit: max_len,
                });
            }
            out.push(m.to_vec());
        }
        Ok(())
    }
}

impl Communicator for Peers {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.w
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.deliver(local, &self.phase2, max_len, out)
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        assert_eq!(send, &self.sends[..], "the shards this rank sends");
        let own = send.get(self.me).map_or(&[][..], |b| &b[..]);
        self.deliver(own, &self.phase1, max_len, out)
    }

    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
}

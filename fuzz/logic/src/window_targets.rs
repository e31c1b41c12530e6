//! Target `windows`: the messages of `CompressedAllReduce` crossing the communicator in windows
//! (FORMAT.md 14.1), all-gather or two-phase, as rank 0 of a group of two whose peer replays
//! what a real rank 1 passed to its communicator in a valid run (its first windows, headers,
//! later windows, agreement and naming rounds), each call's bytes damaged or not as the
//! fuzzer says.
//!
//! Input: a byte of flags (mod 8: the method, EF-sign, dense bf16, top-k int8 EF or 4-bit
//! quantization with EF on a tensor large enough to be read in pieces, times the collective), the chunk bound (4,096 or 4,608 bytes, the smallest windows), then per call of
//! the peer a mode (keep, four times in eight; cut; lengthen; flip a byte; raw bytes) and its
//! operands. The model is two tensors whose size depends on the method ([`sizes`]): the
//! smallest that makes every message span several windows on both collectives (a two-phase
//! shard message too), since the step's cost, and so the executions per second, grows with
//! it. The valid run's transcript and each rank's gradients are made once per configuration
//! and kept; the step runs on one thread (`Parallelism::Serial`: the windows do not depend on
//! it, and the pool's bytes equal one thread's in `tests/parallel.rs`).
//!
//! Properties: no panic and no allocation sized by the peer's bytes (each delivered buffer is
//! bounded by the call's limits, as a transport bounds it); with every message kept, the step
//! succeeds with the valid run's result, bit for bit; whatever was damaged, a step that
//! succeeds gives that same result (never a silent wrong answer).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use gradwire::comm::{CommError, Communicator, LocalGroup, Traffic, check_lengths};
use gradwire::tensor::Tensor;
use gradwire::{Collective, CompressedAllReduce, CompressionMethod, Parallelism};

use crate::input::Input;

/// One call the peer made in the valid run.
#[derive(Clone, Debug)]
struct Call {
    /// An all-to-all (else an all-gather).
    to_all: bool,
    /// What it passed for rank 0: its all-gather buffer, or its all-to-all buffer for rank 0.
    bytes: Vec<u8>,
    /// Its all-to-all buffer for itself (empty for an all-gather).
    own: usize,
    /// The limit it passed.
    max_len: usize,
}

/// The valid run of a configuration: the peer's calls and rank 0's result (flattened in name
/// order).
#[derive(Clone, Debug)]
struct Transcript {
    calls: Vec<Call>,
    result: Vec<f32>,
}

/// The method of `flags` (mod 4): EF-sign with a scale per 32 elements (two bits a value, so
/// that fewer values fill the windows), dense bf16, top-k int8 EF keeping half the values,
/// 4-bit quantization with EF (its large tensor aggregated in chunks, so that the all-gather
/// reads it in pieces as the windows arrive).
fn method(flags: u8) -> CompressionMethod {
    match flags % 4 {
        0 => CompressionMethod::Core(gradwire::core::Method::Sign {
            scale: gradwire::core::SignScale::MeanAbs { block: 32 },
            zero_mask: false,
        })
        .with_error_feedback(),
        1 => CompressionMethod::Core(gradwire::core::Method::Dense {
            values: gradwire::core::Values::Bf16,
        }),
        2 => CompressionMethod::top_k_int8(0.5).with_error_feedback(),
        _ => CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
    }
}

/// The model of `flags`' method: a small tensor and a large one, the large one about the
/// smallest whose messages span several windows of 4,608 bytes on both collectives, a
/// two-phase shard message of half the model included (checked in [`transcript`]); for 4-bit
/// quantization, the smallest tensor aggregated in chunks (`2 x 2^16` elements), so that it is
/// read in pieces.
fn sizes(flags: u8) -> [(&'static str, Vec<usize>); 2] {
    let large = match flags % 4 {
        0 => 40_000,
        1 => 12_000,
        2 => 16_000,
        _ => 131_072,
    };
    [("a.weight", vec![35, 20]), ("b.weight", vec![large])]
}

/// Gradients by name.
type Gradients = HashMap<String, Tensor>;

/// Rank `r`'s gradients of `flags`' model, made once and kept.
fn gradients(flags: u8, r: usize) -> Gradients {
    static MADE: OnceLock<Mutex<HashMap<(u8, usize), Gradients>>> = OnceLock::new();
    let made = MADE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (flags % 4, r);
    if let Some(g) = made.lock().expect("gradients").get(&key) {
        return g.clone();
    }
    let value = |t: usize, i: usize| {
        let x = (i * 37 + t * 11 + r * 5) % 101;
        (x as f32 - 50.0) * 0.01 * if i.is_multiple_of(3) { 4.0 } else { 1.0 }
    };
    let g: Gradients = sizes(flags)
        .into_iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|i| value(t, i)).collect();
            (name.to_owned(), Tensor::new(shape, data).expect("shape"))
        })
        .collect();
    made.lock().expect("gradients").insert(key, g.clone());
    g
}

fn flat(out: &HashMap<String, Tensor>) -> Vec<f32> {
    let mut names: Vec<&String> = out.keys().collect();
    names.sort();
    names.iter().flat_map(|n| out[*n].data()).copied().collect()
}

/// The all-reduce of `flags` over two ranks with the chunk bound `chunk`.
fn all_reduce(flags: u8, chunk: usize) -> CompressedAllReduce {
    let collective = if (flags / 4).is_multiple_of(2) {
        Collective::AllGather
    } else {
        Collective::TwoPhase
    };
    CompressedAllReduce::new(method(flags), 2)
        .with_collective(collective)
        .with_chunk_bytes(chunk)
        .with_parallelism(Parallelism::Serial)
}

/// Records what rank 1 passes.
struct Recorder<C> {
    inner: C,
    calls: Vec<Call>,
}

impl<C: Communicator> Communicator for Recorder<C> {
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
        self.calls.push(Call {
            to_all: false,
            bytes: local.to_vec(),
            own: 0,
            max_len,
        });
        self.inner.all_gather(local, max_len, out)
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.calls.push(Call {
            to_all: true,
            bytes: send.first().cloned().unwrap_or_default(),
            own: send.get(1).map_or(0, Vec::len),
            max_len,
        });
        self.inner.all_to_all(send, max_len, out)
    }
    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
}

/// The valid run of `(flags, chunk)`, made once and kept.
fn transcript(flags: u8, chunk: usize) -> Transcript {
    static MADE: OnceLock<Mutex<HashMap<(u8, usize), Transcript>>> = OnceLock::new();
    let made = MADE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(t) = made.lock().expect("transcripts").get(&(flags, chunk)) {
        return t.clone();
    }
    let mut comms = LocalGroup::new(2).into_communicators();
    let second = comms.pop().expect("rank 1");
    let mut first = comms.pop().expect("rank 0");
    let peer = std::thread::spawn(move || {
        let mut recorder = Recorder {
            inner: second,
            calls: Vec::new(),
        };
        let mut out = HashMap::new();
        all_reduce(flags, chunk)
            .all_reduce_on(&mut recorder, &gradients(flags, 1), &mut out)
            .expect("the valid run, rank 1");
        recorder.calls
    });
    let mut out = HashMap::new();
    all_reduce(flags, chunk)
        .all_reduce_on(&mut first, &gradients(flags, 0), &mut out)
        .expect("the valid run, rank 0");
    let result = flat(&out);
    let calls = peer.join().expect("rank 1's thread");
    // Every message spans several windows: a full window in the first all-gather (the
    // all-gather collective's bundle), in an all-to-all (a two-phase shard message) and in an
    // all-gather after the last all-to-all (a two-phase reduced shard).
    let full = |c: &Call| c.bytes.len() == chunk;
    let last_to_all = calls.iter().rposition(|c| c.to_all);
    let spans = match last_to_all {
        None => calls.first().is_some_and(full),
        Some(last) => {
            calls.iter().any(|c| c.to_all && full(c))
                && calls[last..].iter().any(|c| !c.to_all && full(c))
        }
    };
    assert!(
        spans,
        "a message of flags {flags} fits one window of {chunk} bytes: {:?}",
        calls
            .iter()
            .map(|c| (c.to_all, c.bytes.len()))
            .collect::<Vec<_>>()
    );
    let t = Transcript { calls, result };
    made.lock()
        .expect("transcripts")
        .insert((flags, chunk), t.clone());
    t
}

/// The peer, rank 1: the valid run's calls, damaged as the fuzzer says.
struct Replay<'i, 'd> {
    calls: Vec<Call>,
    at: usize,
    inp: &'i mut Input<'d>,
    /// Whether a delivered buffer differed from the valid run's.
    damaged: bool,
}

impl Replay<'_, '_> {
    /// The peer's next buffer for rank 0, of a call of kind `to_all`.
    fn next(&mut self, to_all: bool) -> Result<Call, CommError> {
        let Some(mut call) = self.calls.get(self.at).cloned() else {
            return Err(CommError::Transport("the peer left the group".into()));
        };
        self.at += 1;
        if call.to_all != to_all {
            // Rank 0 deviates from the valid run only after damage it was shown.
            assert!(
                self.damaged,
                "rank 0 made another call than in the valid run"
            );
            return Err(CommError::Mismatch {
                round: self.at as u64,
                detail: "the peer made another call".into(),
            });
        }
        let before = call.bytes.clone();
        let m = &mut call.bytes;
        match self.inp.u8() % 8 {
            // Kept (most often, so that later calls are reached).
            0..=3 => {}
            4 => {
                let cut = self.inp.range(0, m.len() as u64) as usize;
                m.truncate(m.len() - cut);
            }
            5 => {
                let more = self.inp.range(1, 64) as usize;
                m.extend_from_slice(self.inp.bytes(more));
            }
            6 => {
                if !m.is_empty() {
                    let i = self.inp.range(0, m.len() as u64 - 1) as usize;
                    m[i] ^= self.inp.u8().max(1);
                }
            }
            _ => {
                let len = self.inp.range(0, 64) as usize;
                *m = self.inp.bytes(len).to_vec();
            }
        }
        self.damaged |= *m != before;
        Ok(call)
    }
}

impl Communicator for Replay<'_, '_> {
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
        let peer = self.next(false)?;
        // A transport bounds every buffer by the group's smallest limit.
        check_lengths(
            [(local.len(), max_len), (peer.bytes.len(), peer.max_len)]
                .iter()
                .copied(),
        )?;
        *out = vec![local.to_vec(), peer.bytes];
        Ok(())
    }
    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let peer = self.next(true)?;
        let [mine, theirs] = send else {
            return Err(CommError::Mismatch {
                round: self.at as u64,
                detail: "two buffers expected".into(),
            });
        };
        check_lengths(
            [(mine.len(), max_len), (peer.bytes.len(), peer.max_len)]
                .iter()
                .copied(),
        )?;
        check_lengths(
            [(theirs.len(), max_len), (peer.own, peer.max_len)]
                .iter()
                .copied(),
        )?;
        *out = vec![mine.clone(), peer.bytes];
        Ok(())
    }
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
}

/// The target body.
pub fn windows(data: &[u8]) {
    let mut inp = Input::new(data);
    let flags = inp.u8() % 8;
    let chunk = 4096 + 512 * usize::from(inp.u8() & 1);
    let valid = transcript(flags, chunk);
    let mut replay = Replay {
        calls: valid.calls.clone(),
        at: 0,
        inp: &mut inp,
        damaged: false,
    };
    let mut out = HashMap::new();
    let result =
        all_reduce(flags, chunk).all_reduce_on(&mut replay, &gradients(flags, 0), &mut out);
    match result {
        Ok(()) => {
            let got = flat(&out);
            let same = got.len() == valid.result.len()
                && got
                    .iter()
                    .zip(&valid.result)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "a step with the peer's damaged messages succeeded otherwise"
            );
        }
        Err(e) => assert!(replay.damaged, "the valid run's messages failed: {e}"),
    }
}

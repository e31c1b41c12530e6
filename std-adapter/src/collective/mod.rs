//! Collectives over a [`Communicator`] for compressed gradients:
//! - the all-gather: every rank's bundle to every rank, each aggregating all of them in rank
//!   order; per-link bytes grow as `(W - 1) x` bundle: right for small W or tiny bundles;
//! - the two-phase shard-owner collective ([`two_phase`]): each rank sends shard `j` of its
//!   compressed gradient to rank `j` (all-to-all), the owner reduces its shard, compresses the
//!   result with its server residual and all-gathers it: about `2 (W - 1) / W x` bundle per link
//!   at every W;
//! - uncompressed f32 gradients go through [`Communicator::all_reduce_sum_f32`] ([`dense`]),
//!   never an all-gather.
//!
//! Every message of a collective travels in an envelope (`FORMAT.md` section 14): the
//! fingerprint of the sender's configuration for this call (method, seed, reduction, bucketing,
//! layout, world size, step), and either the payload or, when the sender's own step failed
//! before the collective, the reason. So the ranks decide together, from the same messages:
//! a rank whose step failed still takes part and every peer fails naming it and its reason; a
//! rank configured differently is named with the first field that differs (after one more
//! exchange of the configurations, which every rank makes, since every rank sees the
//! fingerprints differ); no rank waits for a message that never comes.

use crate::aggregate::{Aggregator, Reduction};
use crate::comm::{Communicator, MIN_WINDOW, Outgoing, Stream, Windows};
use crate::engine::dense_stream::DenseStream;
use crate::error::{Error, Result};
use crate::layout::Manifest;

pub(crate) mod buffers;
pub(crate) mod dense;
pub(crate) mod non_finite;
pub(crate) mod shard_message;
mod stream;
pub(crate) mod two_phase;

use self::buffers::StepBuffers;
use self::stream::{PieceBuffers, Received};

/// Which collective [`crate::CompressedAllReduce`] runs on its communicator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Collective {
    /// Every rank's bundle to every rank: `(W - 1) x` bundle received per rank.
    #[default]
    AllGather,
    /// Shard-owner all-to-all, then an all-gather of the owners' reduced shards, with server
    /// residuals at the owners (`FORMAT.md` section 15): about `2 (W - 1) / W x` bundle per
    /// rank. Covers dense casts, quantization, sign (EF-sign, majority vote) and top-k; not
    /// threshold or random-k, nor bucketed manifests.
    TwoPhase,
    /// Whichever of the two moves fewer bytes per link, picked from sizes every rank knows,
    /// once per model layout and world size (so it never switches within a run of one model).
    Auto,
}

/// The first four bytes of an envelope.
const MAGIC: [u8; 4] = *b"GWCM";
/// The envelope version.
const VERSION: u8 = 1;
/// Bytes of an envelope before its payload.
pub(crate) const ENVELOPE_LEN: usize = 20;
/// The longest reason a failure envelope carries (longer ones are cut at a character boundary).
pub(crate) const MAX_REASON_LEN: usize = 1024;
/// Kinds of envelope.
const PAYLOAD: u8 = 0;
const FAILURE: u8 = 1;
/// Another rank's failure or bad message, or an overflow, seen by this rank only (two-phase):
/// the rank (u32 LE), the kind ([`RELAY_FAILED`], [`RELAY_BAD`], [`RELAY_OVERFLOW`]), the
/// reason (for an overflow: the index, a newline, the tensor).
const RELAY: u8 = 2;
/// Kinds of relay: the rank failed; its message was bad; the reduced values overflow.
pub(crate) const RELAY_FAILED: u8 = 0;
pub(crate) const RELAY_BAD: u8 = 1;
pub(crate) const RELAY_OVERFLOW: u8 = 2;

/// A rank's configuration for one call, as `key=value` lines: the fingerprint is FNV-1a of the
/// text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Config {
    text: String,
    /// The tensors (`name:shape` each), sent only when the fingerprints differ, so that a
    /// difference in the layout names the tensor.
    tensors: Vec<String>,
}

impl Config {
    /// A configuration of `fields` (`(key, value)`, in a fixed order) for a model of
    /// `tensors` (`name:shape` each; their hash is one of the fields).
    pub(crate) fn new<'a>(
        fields: impl IntoIterator<Item = (&'a str, String)>,
        tensors: Vec<String>,
    ) -> Self {
        let mut text = String::new();
        for (k, v) in fields {
            text.push_str(k);
            text.push('=');
            text.push_str(&v);
            text.push('\n');
        }
        Config { text, tensors }
    }

    /// The text of the naming round: the fields, the step, and the tensors.
    fn full_text(&self, step: u64) -> String {
        let mut t = format!("{}step={step}\n", self.text);
        for name in &self.tensors {
            t.push_str("tensor=");
            t.push_str(name);
            t.push('\n');
        }
        t
    }

    /// FNV-1a (64 bits) of the text.
    fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for &b in self.text.as_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    /// The first field where the text `other` differs from `ours`: (key, our value, their
    /// value); a difference in the layout is named by the first tensor that differs.
    fn first_difference<'a>(ours: &'a str, other: &'a str) -> Option<(String, &'a str, &'a str)> {
        let found = Self::first_line_difference(ours, other, |k| k != "tensor")?;
        if found.0 == "layout"
            && let Some((_, a, b)) = Self::first_line_difference(ours, other, |k| k == "tensor")
        {
            let name = |v: &'a str| v.rsplit_once(':').map_or(v, |(n, _)| n);
            let tensor = if name(a).is_empty() { name(b) } else { name(a) };
            return Some((format!("tensor `{tensor}`"), a, b));
        }
        Some((found.0.to_owned(), found.1, found.2))
    }

    /// The first line, among those whose key `keep` keeps, where the texts differ.
    fn first_line_difference<'a>(
        ours: &'a str,
        other: &'a str,
        keep: impl Fn(&str) -> bool,
    ) -> Option<(&'a str, &'a str, &'a str)> {
        let pairs = |t: &'a str| {
            t.lines()
                .map(|l| l.split_once('=').unwrap_or((l, "")))
                .filter(|(k, _)| keep(k))
                .collect::<Vec<_>>()
        };
        let mut ours = pairs(ours).into_iter();
        let mut theirs = pairs(other).into_iter();
        loop {
            match (ours.next(), theirs.next()) {
                (None, None) => return None,
                (Some((k, a)), Some((k2, b))) if k == k2 && a == b => {}
                (Some((k, a)), Some((_, b))) => return Some((k, a, b)),
                (Some((k, a)), None) => return Some((k, a, "")),
                (None, Some((k, b))) => return Some((k, "", b)),
            }
        }
    }
}

/// Writes the envelope of `payload` (`kind` PAYLOAD) or of a failure `reason` into `out`.
fn seal(kind: u8, fingerprint: u64, payload: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.resize(ENVELOPE_LEN, 0);
    out.extend_from_slice(payload);
    let sealed = seal_in_place(kind, fingerprint, out);
    debug_assert!(sealed.is_ok());
}

/// Writes the envelope header of a payload into the first [`ENVELOPE_LEN`] bytes of `message`,
/// which holds the payload after them: the bytes of [`seal`] with that payload.
///
/// # Errors
/// [`Error::internal`] when `message` has no room for the header.
fn seal_in_place(kind: u8, fingerprint: u64, message: &mut [u8]) -> Result<()> {
    let head = message
        .get_mut(..ENVELOPE_LEN)
        .ok_or_else(|| Error::internal("a message without room for its envelope"))?;
    head[..4].copy_from_slice(&MAGIC);
    head[4..8].copy_from_slice(&[VERSION, kind, 0, 0]);
    head[8..16].copy_from_slice(&fingerprint.to_le_bytes());
    let crc = crc32fast::hash(&head[..16]);
    head[16..20].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// The failure envelope of `err`: its message, cut to [`MAX_REASON_LEN`] bytes.
fn seal_failure(err: &Error, out: &mut Vec<u8>) {
    let text = err.to_string();
    let mut end = text.len().min(MAX_REASON_LEN);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    seal(FAILURE, 0, &text.as_bytes()[..end], out);
}

/// The relay envelope of `kind` about `rank`, with `reason`.
fn seal_relay(rank: usize, kind: u8, reason: &str, out: &mut Vec<u8>) {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut body = (rank as u32).to_le_bytes().to_vec();
    body.push(kind);
    body.extend_from_slice(&reason.as_bytes()[..end]);
    seal(RELAY, 0, &body, out);
}

/// What an envelope holds.
enum Opened {
    Payload {
        fingerprint: u64,
    },
    Failure(String),
    Relay {
        rank: usize,
        kind: u8,
        /// As sent: the reason, or for an overflow its index and tensor (see [`RELAY`]).
        reason: Vec<u8>,
    },
    Invalid,
}

/// Text a peer sent, as this rank shows it in an error: at most [`MAX_REASON_LEN`] bytes of it
/// (cut before a character that would cross that length, the cut marked with `...`), bytes
/// that are not UTF-8 replaced, and control characters escaped (`\n`, `\u{1b}`: at most six
/// characters each), so that a peer can neither fill a log nor forge lines or terminal
/// sequences in it.
pub(crate) fn peer_text(bytes: &[u8]) -> String {
    let cut = bytes.len() > MAX_REASON_LEN;
    let mut end = bytes.len().min(MAX_REASON_LEN);
    // Not inside a UTF-8 sequence (a continuation byte starts with the bits 10).
    while cut && end > 0 && bytes[end] & 0xc0 == 0x80 {
        end -= 1;
    }
    let text = String::from_utf8_lossy(&bytes[..end]);
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if cut {
        out.push_str("...");
    }
    out
}

fn open(msg: &[u8]) -> Opened {
    let Some(head) = msg.get(..ENVELOPE_LEN) else {
        return Opened::Invalid;
    };
    let crc = u32::from_le_bytes([head[16], head[17], head[18], head[19]]);
    if head[..4] != MAGIC
        || head[4] != VERSION
        || head[6..8] != [0, 0]
        || crc32fast::hash(&head[..16]) != crc
    {
        return Opened::Invalid;
    }
    let mut fp = [0u8; 8];
    fp.copy_from_slice(&head[8..16]);
    let body = &msg[ENVELOPE_LEN..];
    match head[5] {
        PAYLOAD => Opened::Payload {
            fingerprint: u64::from_le_bytes(fp),
        },
        FAILURE => Opened::Failure(peer_text(body)),
        RELAY if body.len() >= 5 && body[4] <= RELAY_OVERFLOW => Opened::Relay {
            rank: u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize,
            kind: body[4],
            reason: body[5..].to_vec(),
        },
        _ => Opened::Invalid,
    }
}

/// The bytes a collective message may have for `manifest`: an envelope and a bundle, or a
/// failure's reason.
fn limit_for(manifest: Option<&Manifest>) -> usize {
    match manifest {
        Some(m) => ENVELOPE_LEN + m.max_bundle_len().max(MAX_REASON_LEN),
        // A rank without a manifest takes part with a failure: the group's smallest limit, a
        // healthy peer's, applies.
        None => usize::MAX,
    }
}

/// One rank's part of an all-gather step: its message, [`ENVELOPE_LEN`] bytes of room for the
/// envelope then the bundle (made with `manifest` at `step`, with configuration `config`), or
/// the error that stopped it before the collective.
pub(crate) enum Local<'b> {
    Bundle {
        manifest: &'b Manifest,
        message: &'b mut [u8],
        step: u64,
        config: &'b Config,
    },
    /// A bundle written as it is sent ([`crate::engine::dense_stream`]), after the envelope
    /// of [`payload_envelope`] for `config` and `step`.
    Streamed {
        manifest: &'b Manifest,
        message: &'b mut dyn Written,
        step: u64,
        config: &'b Config,
    },
    Failed {
        manifest: Option<&'b Manifest>,
        error: Error,
    },
}

/// The envelope of a payload for `config` at `step`: a streamed message's first bytes.
pub(crate) fn payload_envelope(config: &Config, step: u64) -> [u8; ENVELOPE_LEN] {
    let mut head = [0u8; ENVELOPE_LEN];
    let sealed = seal_in_place(PAYLOAD, fingerprint_at(config, step), &mut head);
    debug_assert!(sealed.is_ok());
    head
}

/// A message written as it is sent, from the gradients of a step's buffers.
pub(crate) trait Written {
    /// Bytes of the whole message.
    fn len(&self) -> usize;

    /// The message's bytes from where the last call ended up to `end`, written from the
    /// gradients of `bufs`.
    fn next(&mut self, end: usize, bufs: &StepBuffers<'_>) -> &[u8];

    /// As [`Written::next`], the bytes appended to `out` (at least up to `end`); returns the
    /// bytes of the message appended so far.
    fn append(&mut self, end: usize, bufs: &StepBuffers<'_>, out: &mut Vec<u8>) -> usize;

    /// The error that stopped the message before its length, when it was written without a
    /// check of its gradients first (then [`Written::append`] returns fewer bytes).
    fn take_error(&mut self) -> Option<Error>;
}

impl Written for DenseStream<'_> {
    fn len(&self) -> usize {
        DenseStream::len(self)
    }

    fn next(&mut self, end: usize, bufs: &StepBuffers<'_>) -> &[u8] {
        DenseStream::next(self, end, bufs)
    }

    fn append(&mut self, end: usize, bufs: &StepBuffers<'_>, out: &mut Vec<u8>) -> usize {
        DenseStream::append(self, end, bufs, out)
    }

    fn take_error(&mut self) -> Option<Error> {
        DenseStream::take_error(self)
    }
}

/// This rank's message of an all-gather step: held whole, or written as it is sent.
enum Sending<'s> {
    Whole(&'s [u8]),
    Streamed(&'s mut dyn Written),
}

/// One rank's ends of an all-gather step whose messages are read as they arrive
/// ([`Stream`]): its message, written from the step's gradients when it is streamed, and the
/// messages into the step's outputs (the same buffers in place: a window of this rank's
/// message is written before the outputs of its elements are, since they are aggregated only
/// once every rank's bytes of them arrived, this rank's included).
struct Exchange<'x, 'b, 'a> {
    message: Sending<'x>,
    bufs: &'x mut StepBuffers<'b>,
    received: Received<'a>,
}

impl Outgoing for Exchange<'_, '_, '_> {
    fn len(&self) -> usize {
        match &self.message {
            Sending::Whole(bytes) => bytes.len(),
            Sending::Streamed(stream) => stream.len(),
        }
    }

    fn bytes(&mut self, from: usize, to: usize) -> &[u8] {
        match &mut self.message {
            Sending::Whole(bytes) => bytes.get(from..to).unwrap_or(&[]),
            Sending::Streamed(stream) => {
                debug_assert!(from <= to);
                stream.next(to, &*self.bufs)
            }
        }
    }
}

impl Exchange<'_, '_, '_> {
    /// This rank's message from byte `from` up to at least `end` appended to `out` (written
    /// there when it is streamed); returns where the bytes appended end.
    fn append(&mut self, from: usize, end: usize, out: &mut Vec<u8>) -> usize {
        match &mut self.message {
            Sending::Whole(bytes) => {
                out.extend_from_slice(bytes.get(from..end).unwrap_or(&[]));
                end
            }
            Sending::Streamed(stream) => stream.append(end, &*self.bufs, out),
        }
    }

    /// The error that stopped this rank's message before its length (one written without a
    /// check first: [`Written::take_error`]).
    fn take_error(&mut self) -> Option<Error> {
        match &mut self.message {
            Sending::Whole(_) => None,
            Sending::Streamed(stream) => stream.take_error(),
        }
    }
}

impl Stream for Exchange<'_, '_, '_> {
    fn consume(&mut self, bufs: &mut [Vec<u8>], last: bool) {
        self.received.consume(bufs, last, self.bufs.outs());
    }
}

/// Buffers of the all-gather collective, kept between calls.
#[derive(Debug, Default)]
pub(crate) struct AllGather {
    send: Vec<u8>,
    gathered: Vec<Vec<u8>>,
    /// The flat layout of a bucketed manifest's result (an entry spanning several tensors).
    flat: Vec<f32>,
    /// The windows the messages cross the communicator in.
    windows: Windows,
    /// Buffers of the entries read in pieces as the windows arrive.
    pieces: PieceBuffers,
}

impl AllGather {
    /// Exchanges this rank's part with every rank of `comm` and, when every rank sent a
    /// bundle made with the same configuration, aggregates them into the outputs of `bufs`
    /// (each tensor's elements in the manifest's tensor order), through a flat buffer of the
    /// manifest's layout only when the manifest has buckets. After an error the outputs'
    /// values are unspecified. The messages cross `comm` in windows of at most `chunk` bytes
    /// ([`Windows`]; every rank passes the same `chunk`); without buckets, the bundles are read
    /// and added entry by entry (a large dense, quantization or sign entry in pieces) as the
    /// windows arrive ([`Received`]), so a rank holds no peer's whole bundle, and a streamed
    /// message ([`Local::Streamed`]) is written from the gradients of `bufs` window by window.
    /// A group of one reads its own message where it is, or as it is written when streamed.
    ///
    /// # Errors
    /// This rank's own error when its step failed; [`Error::PeerFailed`] naming the first
    /// rank whose step failed, with its reason; [`Error::ConfigDiffers`] naming the first rank
    /// configured otherwise than rank 0 and the field; [`Error::Comm`] when the transport
    /// fails; [`Error::WorldSize`]; any error of [`Aggregator::aggregate_into`] (read as the
    /// bundles arrive, a fault in a later entry is found after the entries before it were
    /// added, and a bundle's checksum last). Every rank returns the same error, except a failed
    /// rank, which returns its own.
    pub(crate) fn run(
        &mut self,
        comm: &mut dyn Communicator,
        local: Local<'_>,
        reduction: Reduction,
        chunk: usize,
        aggregator: &mut Aggregator,
        bufs: &mut StepBuffers<'_>,
    ) -> Result<()> {
        let (limit, own_error, ours, send) = match local {
            Local::Bundle {
                manifest,
                message,
                step,
                config,
            } => {
                // The envelope goes in the room before the bundle: the message is sent as the
                // compressor wrote it. (Without that room, this rank takes part with the
                // error, so that no peer waits.)
                match seal_in_place(PAYLOAD, fingerprint_at(config, step), message) {
                    Ok(()) => (
                        limit_for(Some(manifest)),
                        None,
                        Some((manifest, step, config)),
                        Sending::Whole(&*message),
                    ),
                    Err(error) => {
                        seal_failure(&error, &mut self.send);
                        (
                            limit_for(Some(manifest)),
                            Some(error),
                            None,
                            Sending::Whole(self.send.as_slice()),
                        )
                    }
                }
            }
            Local::Streamed {
                manifest,
                message,
                step,
                config,
            } => (
                limit_for(Some(manifest)),
                None,
                Some((manifest, step, config)),
                Sending::Streamed(message),
            ),
            Local::Failed { manifest, error } => {
                seal_failure(&error, &mut self.send);
                (
                    limit_for(manifest),
                    Some(error),
                    None,
                    Sending::Whole(self.send.as_slice()),
                )
            }
        };
        // The first windows already hold every envelope: when one is not a payload, or its
        // fingerprint is not the first's, the step ends on every rank after one call (the
        // verdict below), whatever the ranks' chunk bounds (another bound is another
        // fingerprint).
        let stop = |first: &[Vec<u8>]| {
            let mut fingerprints = first.iter().map(|w| match open(w) {
                Opened::Payload { fingerprint } => Some(fingerprint),
                _ => None,
            });
            let lead = fingerprints.next().flatten();
            lead.is_none() || fingerprints.any(|f| f != lead)
        };
        let world_size = comm.world_size();
        // A group of one gathers its own message: it is read where it is, not copied to itself.
        let alone = world_size == 1;
        let streamed = matches!(send, Sending::Streamed(_));
        if (!alone || streamed)
            && let Some((manifest, step, _)) = ours
        {
            // Straight into the output tensors, one entry each, as the windows arrive. The
            // stream indexes the outputs by entry, so entry `e` must be tensor `e` (a bucket
            // spans several tensors: a bucketed manifest is gathered whole, below).
            let per_entry =
                manifest.one_entry_per_tensor() && manifest.entry_slices(bufs.outs()).is_some();
            if per_entry {
                let mut io = Exchange {
                    message: send,
                    bufs,
                    received: Received::new(
                        manifest,
                        step,
                        reduction,
                        aggregator,
                        world_size,
                        &mut self.pieces,
                    ),
                };
                if alone {
                    // A group of one reads its own message as it is written, window by
                    // window, without the communicator.
                    let (len, chunk) = (io.len(), chunk.max(MIN_WINDOW));
                    self.gathered.resize_with(1, Vec::new);
                    self.gathered[0].clear();
                    let mut done = 0;
                    loop {
                        let next = len.min(done + chunk);
                        let appended = io.append(done, next, &mut self.gathered[0]).min(len);
                        if appended < next {
                            // A message written without a check first stops at the piece
                            // whose encode failed: the check's error.
                            return Err(io.take_error().unwrap_or_else(|| {
                                Error::internal("a group of one's message ended before its length")
                            }));
                        }
                        done = appended;
                        io.consume(&mut self.gathered, done == len);
                        if done == len {
                            break;
                        }
                    }
                    return io.received.result().unwrap_or_else(|| {
                        Err(Error::internal(
                            "a group of one's own message stopped its step",
                        ))
                    });
                }
                self.windows.all_gather_streamed(
                    comm,
                    &mut io,
                    limit,
                    chunk,
                    &mut self.gathered,
                    stop,
                )?;
                if let Some(result) = io.received.result() {
                    return result;
                }
                // The first windows hold the step's verdict: read from them, it is an error.
                let messages: Vec<&[u8]> = self.gathered.iter().map(Vec::as_slice).collect();
                verdict(comm, &messages, own_error, ours, world_size)?;
                return Err(Error::internal(
                    "the first windows stopped the stream without a verdict",
                ));
            }
        }
        let send = match send {
            Sending::Whole(bytes) => bytes,
            Sending::Streamed(_) => {
                return Err(Error::internal(
                    "a streamed message for outputs that are not one per entry",
                ));
            }
        };
        let whole = alone
            || self
                .windows
                .all_gather(comm, send, limit, chunk, &mut self.gathered, stop)?;
        let messages: Vec<&[u8]> = if alone {
            vec![send]
        } else {
            self.gathered.iter().map(Vec::as_slice).collect()
        };
        let (manifest, step, _) = verdict(comm, &messages, own_error, ours, world_size)?;
        if !whole {
            // Unreachable: the windows stopped only on a verdict, found above.
            return Err(Error::internal(
                "the first windows stopped without a verdict",
            ));
        }
        let bundles: Vec<&[u8]> = messages.iter().map(|m| &m[ENVELOPE_LEN..]).collect();
        // Straight into the output tensors, one entry each; a bucket spans several tensors,
        // so a bucketed manifest goes through the flat layout.
        let outs = bufs.outs();
        match manifest.entry_slices(outs) {
            Some(mut each) => {
                aggregator.aggregate_into_each(manifest, &bundles, step, reduction, &mut each)
            }
            None => {
                let flat = &mut self.flat;
                aggregator.aggregate_into(manifest, &bundles, step, reduction, flat)?;
                manifest.write_flat(flat, outs)
            }
        }
    }
}

/// The verdict of an all-gather round, from the `messages` every rank holds (this rank's
/// `own_error` when it failed, `ours` its step otherwise): a failed rank first, then an
/// envelope that is not one, then fingerprints that differ (named after one more round).
/// Returns this rank's step when the step goes on.
///
/// # Errors
/// As [`gathered_fingerprints`] and [`check_fingerprints`]; [`Error::WorldSize`] when the
/// round did not gather one message per rank.
fn verdict<'s>(
    comm: &mut dyn Communicator,
    messages: &[&[u8]],
    mut own_error: Option<Error>,
    ours: Option<(&'s Manifest, u64, &'s Config)>,
    world_size: usize,
) -> Result<(&'s Manifest, u64, &'s Config)> {
    if messages.len() != world_size {
        return Err(Error::WorldSize {
            expected: world_size,
            got: messages.len(),
        });
    }
    let fingerprints = gathered_fingerprints(messages, comm.rank(), &mut own_error)?;
    let Some((manifest, step, config)) = ours else {
        // Unreachable: this rank's own message is a failure, found above.
        return Err(Error::internal("a failed rank's own message was not found"));
    };
    // (The naming round, made only when the fingerprints differ, gathers into its own
    // buffers: the messages are borrowed.)
    check_fingerprints(comm, &fingerprints, config, step, &mut Vec::new())?;
    Ok((manifest, step, config))
}

/// The fingerprints of a round of envelopes every rank holds (the all-gather's, the dense f32
/// all-reduce's), when every message is a payload; otherwise the error every rank returns for
/// the first one that is not: `own_error` (taken) when it is this rank's own failure,
/// [`Error::PeerFailed`] for another rank's, [`Error::Collective`] for a message that is not a
/// payload envelope.
fn gathered_fingerprints<M: AsRef<[u8]>>(
    gathered: &[M],
    me: usize,
    own_error: &mut Option<Error>,
) -> Result<Vec<u64>> {
    let mut fingerprints = Vec::with_capacity(gathered.len());
    for (rank, msg) in gathered.iter().enumerate() {
        match open(msg.as_ref()) {
            Opened::Payload { fingerprint } => fingerprints.push(fingerprint),
            Opened::Failure(reason) => {
                return Err(match own_error.take() {
                    Some(error) if rank == me => error,
                    _ => Error::PeerFailed { rank, reason },
                });
            }
            Opened::Relay { .. } => {
                return Err(Error::Collective {
                    rank,
                    reason: "it sent a two-phase envelope to another collective".into(),
                });
            }
            Opened::Invalid => {
                return Err(Error::Collective {
                    rank,
                    reason: "its message is not a gradwire collective envelope (version 1)".into(),
                });
            }
        }
    }
    Ok(fingerprints)
}

/// The agreement round of a step: this rank's fingerprint (`local` is `Ok`) or its failure
/// all-gathered in an envelope of at most [`ENVELOPE_LEN`] + [`MAX_REASON_LEN`] bytes. Returns
/// `local` when every rank sent a payload with the same fingerprint.
///
/// # Errors
/// As [`gathered_fingerprints`] and [`check_fingerprints`]; [`Error::Comm`].
pub(crate) fn agree<'s>(
    comm: &mut dyn Communicator,
    local: Result<two_phase::Step<'s>>,
    send: &mut Vec<u8>,
    gathered: &mut Vec<Vec<u8>>,
) -> Result<two_phase::Step<'s>> {
    let (mut own_error, step) = match local {
        Ok(step) => {
            seal(PAYLOAD, fingerprint_at(step.config, step.step), &[], send);
            (None, Some(step))
        }
        Err(e) => {
            seal_failure(&e, send);
            (Some(e), None)
        }
    };
    comm.all_gather(send, ENVELOPE_LEN + MAX_REASON_LEN, gathered)?;
    let fingerprints = gathered_fingerprints(gathered, comm.rank(), &mut own_error)?;
    let Some(step) = step else {
        return Err(Error::internal("a failed rank's own message was not found"));
    };
    check_fingerprints(comm, &fingerprints, step.config, step.step, gathered)?;
    Ok(step)
}

/// Takes part in a step's first collective (an all-gather, on every route) with the failure
/// `error`, for a rank that cannot run the step at all (another world size): its peers fail
/// naming it instead of waiting. Returns `error`.
pub(crate) fn take_part_failed(comm: &mut dyn Communicator, error: Error) -> Error {
    let mut send = Vec::new();
    seal_failure(&error, &mut send);
    let mut gathered = Vec::new();
    match comm.all_gather(&send, ENVELOPE_LEN + MAX_REASON_LEN, &mut gathered) {
        Ok(()) => error,
        Err(e) => e.into(),
    }
}

/// The most bytes a configuration text of the naming round may have.
const MAX_CONFIG_TEXT: usize = 16 << 20;

/// [`name_difference`] when a rank's fingerprint differs from rank 0's (every rank sees the
/// same fingerprints, so every rank makes that extra round or none does).
fn check_fingerprints(
    comm: &mut dyn Communicator,
    fingerprints: &[u64],
    config: &Config,
    step: u64,
    gathered: &mut Vec<Vec<u8>>,
) -> Result<()> {
    match fingerprints.iter().position(|&f| f != fingerprints[0]) {
        Some(rank) => Err(name_difference(comm, Some(config), step, rank, gathered)),
        None => Ok(()),
    }
}

/// Every rank saw `rank`'s fingerprint differ from rank 0's: one more all-gather of the
/// configurations (an empty one from a rank without a configuration) names the first field
/// that differs.
fn name_difference(
    comm: &mut dyn Communicator,
    config: Option<&Config>,
    step: u64,
    rank: usize,
    gathered: &mut Vec<Vec<u8>>,
) -> Error {
    let text = config.map_or_else(String::new, |c| c.full_text(step));
    if let Err(e) = comm.all_gather(text.as_bytes(), MAX_CONFIG_TEXT, gathered) {
        return e.into();
    }
    let texts: Vec<String> = gathered
        .iter()
        .map(|t| String::from_utf8_lossy(t).into_owned())
        .collect();
    // The texts are peers': what an error shows of them is escaped and capped.
    let shown = |t: &str| peer_text(t.as_bytes());
    let rank0 = texts.first().map_or("", String::as_str);
    match texts
        .get(rank)
        .and_then(|t| Config::first_difference(rank0, t))
    {
        Some((field, expected, got)) => Error::ConfigDiffers {
            rank,
            field: shown(&field),
            expected: shown(expected),
            got: shown(got),
        },
        None => Error::ConfigDiffers {
            rank,
            field: "fingerprint".to_owned(),
            expected: String::new(),
            got: String::new(),
        },
    }
}

/// The fingerprint of `config` at `step`.
fn fingerprint_at(config: &Config, step: u64) -> u64 {
    Config {
        text: format!("{}step={step}\n", config.text),
        tensors: Vec::new(),
    }
    .fingerprint()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_refuse_damage() {
        let mut msg = Vec::new();
        seal(PAYLOAD, 0x1234, b"bundle", &mut msg);
        assert!(matches!(
            open(&msg),
            Opened::Payload {
                fingerprint: 0x1234
            }
        ));
        assert_eq!(&msg[ENVELOPE_LEN..], b"bundle");
        for i in 0..ENVELOPE_LEN {
            let mut bad = msg.clone();
            bad[i] ^= 1;
            assert!(matches!(open(&bad), Opened::Invalid), "byte {i}");
        }
        seal_failure(&Error::config("x".repeat(5000)), &mut msg);
        match open(&msg) {
            Opened::Failure(r) => assert_eq!(r.len(), MAX_REASON_LEN),
            _ => panic!("not a failure"),
        }
    }

    #[test]
    fn peer_text_is_escaped_cut_at_a_character_and_marked() {
        assert_eq!(peer_text(b"a\x1b[2Jb\nc\xff"), "a\\u{1b}[2Jb\\nc\u{fffd}");
        // Two-byte characters across the cut: cut before the one that would cross it.
        let mut long = vec![b'a'; MAX_REASON_LEN - 1];
        long.extend_from_slice("éé".as_bytes());
        let shown = peer_text(&long);
        assert!(shown.ends_with("a..."), "{shown}");
        assert!(!shown.contains('\u{fffd}'));
        assert_eq!(shown.len(), MAX_REASON_LEN - 1 + 3);
        let exact = vec![b'x'; MAX_REASON_LEN];
        assert_eq!(peer_text(&exact).len(), MAX_REASON_LEN);
    }

    #[test]
    fn configurations_name_their_first_difference() {
        let a = Config::new([("method", "topk".into()), ("seed", "1".into())], vec![]);
        let b = Config::new([("method", "topk".into()), ("seed", "2".into())], vec![]);
        let diff = Config::first_difference(&a.text, &b.text);
        assert_eq!(diff, Some(("seed".to_owned(), "1", "2")));
        assert_eq!(Config::first_difference(&a.text, &a.text), None);
        assert_ne!(a.fingerprint(), b.fingerprint());
        let c = Config::new(
            [("layout", "1".into())],
            vec!["a:[2]".into(), "w:[4]".into()],
        );
        let d = Config::new(
            [("layout", "2".into())],
            vec!["a:[2]".into(), "w:[5]".into()],
        );
        let (ct, dt) = (c.full_text(3), d.full_text(3));
        let diff = Config::first_difference(&ct, &dt);
        assert_eq!(diff, Some(("tensor `w`".to_owned(), "w:[4]", "w:[5]")));
    }
}

//! The shard message of the two-phase collective (`FORMAT.md` section 15): a lean header (no
//! per-entry ids: the receiver's shard layout says what the frame holds), then, unless the
//! owner's shard is empty, one frame's length (u32 LE) and the frame: every tensor's part of
//! the shard, in manifest order; then the message's CRC-32, last, so that a message can be
//! sent before its last byte is known.
//!
//! ```text
//! offset size field
//!  0     4   magic "GWSH"
//!  4     1   version (4: the CRC-32 in a trailer)
//!  5     1   phase: 1 = a worker's shard for its owner, 2 = an owner's reduced shard
//!  6     2   reserved, 0
//!  8     8   step (u64 LE)
//! 16     4   shard: the owner's rank (u32 LE)
//! 20     4   frames (u32 LE)
//! 24     4   reserved, 0
//! 28     ..  frames: length (u32 LE), then the frame (FORMAT.md sections 1-9)
//! end-4  4   CRC-32 (IEEE) of every byte before it
//! ```

use crate::error::{Error, Result};
use crate::layout::shards::ShardLayout;
use crate::layout::update_with_frame;

/// The first four bytes.
const MAGIC: [u8; 4] = *b"GWSH";
/// The version (4: the CRC-32 in a trailer; 3 had it in the header, FORMAT.md 15).
const VERSION: u8 = 4;
/// Bytes of the header.
pub(crate) const HEADER_LEN: usize = 28;
/// Bytes of the trailer (the message's CRC-32).
const TRAILER_LEN: usize = 4;

/// Bytes of the shard message for owner `j` of `layout` at most (header, then the frame's
/// length and the frame when the shard is not empty, then the trailer; no envelope), without
/// the escape: what
/// a step sends unless an owner's reduced values leave the value type.
pub(crate) fn max_len(layout: &ShardLayout, j: usize) -> usize {
    with_frame(layout.max_frame_len(j))
}

/// As [`max_len`], counting an owner's escaped frame too (FORMAT.md 15): the limit a receiver
/// enforces.
pub(crate) fn limit_len(layout: &ShardLayout, j: usize) -> usize {
    with_frame(layout.max_frame_len(j).max(layout.max_escaped_frame_len(j)))
}

fn with_frame(frame: usize) -> usize {
    match frame {
        0 => HEADER_LEN + TRAILER_LEN,
        frame => HEADER_LEN + 4 + frame + TRAILER_LEN,
    }
}

/// Phase of a shard message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A worker's shard, for its owner.
    Contribution = 1,
    /// An owner's reduced shard, for every rank.
    Reduced = 2,
}

/// Lays out a message in `out` after its first `prefix` bytes (room for the envelope, left as
/// they are): the header, and when `bound` is not 0 one frame's length field and `bound` bytes
/// for the frame. Returns where the frame starts: the caller writes it there, then
/// [`commit_frame`] (when `bound` is not 0) and [`finish`], which appends the trailer. `out`
/// keeps the bytes it held up to that length (only new bytes are zeroed; every byte the
/// message keeps is written), so that a step does not write its messages twice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lay_out(
    out: &mut Vec<u8>,
    prefix: usize,
    phase: Phase,
    step: u64,
    shard: usize,
    frames: usize,
    bound: usize,
) -> usize {
    let at = prefix + HEADER_LEN + if bound > 0 { 4 } else { 0 };
    let total = at + bound;
    if out.len() < total {
        out.resize(total, 0);
    } else {
        out.truncate(total);
    }
    let header = &mut out[prefix..prefix + HEADER_LEN];
    header[..4].copy_from_slice(&MAGIC);
    header[4..8].copy_from_slice(&[VERSION, phase as u8, 0, 0]);
    header[8..16].copy_from_slice(&step.to_le_bytes());
    header[16..20].copy_from_slice(&(shard as u32).to_le_bytes());
    header[20..24].copy_from_slice(&(frames as u32).to_le_bytes());
    header[24..28].copy_from_slice(&[0; 4]);
    at
}

/// Starts a message at the end of `out`: the header; frames follow by
/// [`reserve_frame`] and [`commit_frame`], then [`finish`].
#[cfg(test)]
pub(crate) fn start(out: &mut Vec<u8>, phase: Phase, step: u64, shard: usize, frames: usize) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, phase as u8, 0, 0]);
    out.extend_from_slice(&step.to_le_bytes());
    out.extend_from_slice(&(shard as u32).to_le_bytes());
    out.extend_from_slice(&(frames as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
}

/// Appends a frame's length field and `bound` bytes for the frame, and returns where the frame
/// starts: the caller writes the frame there, then [`commit_frame`] its length.
#[cfg(test)]
pub(crate) fn reserve_frame(out: &mut Vec<u8>, bound: usize) -> usize {
    out.extend_from_slice(&[0; 4]);
    let at = out.len();
    out.resize(at + bound, 0);
    at
}

/// Ends a frame that [`reserve_frame`] made room for at `at`: its length, and the message
/// cut after it.
pub(crate) fn commit_frame(out: &mut Vec<u8>, at: usize, written: usize) {
    out[at - 4..at].copy_from_slice(&(written as u32).to_le_bytes());
    out.truncate(at + written);
}

/// Ends a message that [`start`] or [`lay_out`] began at `at` in `out` (its last frame
/// committed): appends its trailer, the CRC of its bytes.
pub(crate) fn finish(out: &mut Vec<u8>, at: usize) {
    let crc = crc_of(&out[at..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// The CRC of a message's bytes before its trailer (`msg`: the header, then the frames, each
/// frame's body taken from its trailer ([`update_with_frame`])): the frames are not read
/// again, and for frames whose trailers hold their bodies' CRCs (every frame an encoder writes)
/// this is the CRC of the bytes. A receiver's frames are decoded only after their own checksums
/// pass, so every byte of an accepted message is still checked once.
fn crc_of(msg: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&msg[..HEADER_LEN]);
    let mut rest = &msg[HEADER_LEN..];
    while let Some(len) = rest.get(..4) {
        h.update(len);
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let Some(frame) = rest.get(4..4usize.saturating_add(len)) else {
            rest = &rest[4..];
            break;
        };
        update_with_frame(&mut h, frame);
        rest = &rest[4 + len..];
    }
    h.update(rest);
    h.finalize()
}

/// The frames of a message checked against what the receiver expects (`phase`, `step`,
/// `shard`, `frames`), in order.
///
/// # Errors
/// [`Error::Collective`] naming `from` (the sender) and the first fault.
pub(crate) fn open(
    msg: &[u8],
    from: usize,
    phase: Phase,
    step: u64,
    shard: usize,
    frames: usize,
) -> Result<Frames<'_>> {
    let bad = |reason: String| Error::Collective {
        rank: from,
        reason: format!("its shard message for owner {shard}: {reason}"),
    };
    let least = HEADER_LEN + TRAILER_LEN;
    let Some(body_len) = msg
        .len()
        .checked_sub(TRAILER_LEN)
        .filter(|&b| b >= HEADER_LEN)
    else {
        return Err(bad(format!(
            "{} bytes, shorter than the {least}-byte header and trailer",
            msg.len()
        )));
    };
    let head = &msg[..HEADER_LEN];
    let u32_at = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    if head[..4] != MAGIC || head[4] != VERSION || head[6..8] != [0, 0] || head[24..28] != [0; 4] {
        return Err(bad(format!(
            "not a gradwire shard message (version {VERSION})"
        )));
    }
    let (body, trailer) = msg.split_at(body_len);
    let crc = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    if crc_of(body) != crc {
        return Err(bad("checksum mismatch".into()));
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&head[8..16]);
    let got_step = u64::from_le_bytes(s);
    if head[5] != phase as u8 {
        return Err(bad(format!("phase {}, expected {}", head[5], phase as u8)));
    }
    if got_step != step {
        return Err(bad(format!("step {got_step}, expected {step}")));
    }
    if u32_at(16) as usize != shard {
        return Err(bad(format!("shard {}, expected {shard}", u32_at(16))));
    }
    if u32_at(20) as usize != frames {
        return Err(bad(format!("{} frames, expected {frames}", u32_at(20))));
    }
    if frames == 0 && body.len() > HEADER_LEN {
        return Err(bad("bytes after its header, which declares no frame".into()));
    }
    Ok(Frames {
        rest: &body[HEADER_LEN..],
        left: frames,
        from,
        shard,
    })
}

/// The frames of an opened message.
pub(crate) struct Frames<'m> {
    rest: &'m [u8],
    left: usize,
    from: usize,
    shard: usize,
}

impl<'m> Frames<'m> {
    /// The next frame.
    ///
    /// # Errors
    /// [`Error::Collective`] when the message ends early, or has bytes after its last frame.
    pub(crate) fn next_frame(&mut self) -> Result<&'m [u8]> {
        let bad = |reason: &str| Error::Collective {
            rank: self.from,
            reason: format!("its shard message for owner {}: {reason}", self.shard),
        };
        if self.left == 0 {
            return Err(bad("more frames read than it declares"));
        }
        let Some(len) = self.rest.get(..4) else {
            return Err(bad("ends inside a frame length"));
        };
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let Some(frame) = self.rest.get(4..4usize.saturating_add(len)) else {
            return Err(bad("ends inside a frame"));
        };
        self.rest = &self.rest[4 + len..];
        self.left -= 1;
        if self.left == 0 && !self.rest.is_empty() {
            return Err(bad("bytes after its last frame"));
        }
        Ok(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_refuse_damage() {
        let mut msg = Vec::new();
        start(&mut msg, Phase::Contribution, 7, 2, 2);
        let at = reserve_frame(&mut msg, 8);
        msg[at..at + 3].copy_from_slice(b"abc");
        commit_frame(&mut msg, at, 3);
        let at = reserve_frame(&mut msg, 5);
        commit_frame(&mut msg, at, 0);
        finish(&mut msg, 0);
        let mut f = open(&msg, 1, Phase::Contribution, 7, 2, 2).unwrap();
        assert_eq!(f.next_frame().unwrap(), b"abc");
        assert_eq!(f.next_frame().unwrap(), b"");
        assert!(f.next_frame().is_err());
        for i in 0..msg.len() {
            let mut bad = msg.clone();
            bad[i] ^= 0x10;
            assert!(
                open(&bad, 1, Phase::Contribution, 7, 2, 2).is_err(),
                "byte {i}"
            );
        }
        for cut in 0..msg.len() {
            let ok = open(&msg[..cut], 1, Phase::Contribution, 7, 2, 2)
                .and_then(|mut f| f.next_frame().and_then(|_| f.next_frame()));
            assert!(ok.is_err(), "cut at {cut}");
        }
        assert!(open(&msg, 1, Phase::Reduced, 7, 2, 2).is_err());
        assert!(open(&msg, 1, Phase::Contribution, 8, 2, 2).is_err());
        assert!(open(&msg, 1, Phase::Contribution, 7, 3, 2).is_err());
        assert!(open(&msg, 1, Phase::Contribution, 7, 2, 3).is_err());
    }

    /// A real frame (its trailer the CRC of its body): the message's checksum, combined from
    /// the frame's trailer, is the CRC of the bytes (`FORMAT.md` 15); a frame whose body is
    /// damaged under a matching message checksum passes `open` and is refused by its own.
    #[test]
    fn the_checksum_combined_from_a_real_frame_is_the_checksum_of_the_bytes() {
        use gradwire_core::{Method, Params, Values, decode_into, encode_into, max_frame_len};
        let method = Method::Dense {
            values: Values::Bf16,
        };
        let params = Params::new(method);
        let g: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut frame = vec![0u8; max_frame_len(g.len(), &method)];
        let len = encode_into(&g, &params, &mut [], &mut frame).unwrap();
        frame.truncate(len);
        let mut msg = Vec::new();
        start(&mut msg, Phase::Reduced, 4, 0, 1);
        let at = reserve_frame(&mut msg, frame.len());
        msg[at..at + frame.len()].copy_from_slice(&frame);
        commit_frame(&mut msg, at, frame.len());
        finish(&mut msg, 0);
        let end = msg.len() - TRAILER_LEN;
        assert_eq!(msg[end..], crc32fast::hash(&msg[..end]).to_le_bytes());
        let mut f = open(&msg, 0, Phase::Reduced, 4, 0, 1).unwrap();
        assert_eq!(f.next_frame().unwrap(), &frame[..]);
        // A byte of the frame flipped (body or trailer): the message's checksum still matches
        // (it takes the body's CRC from the trailer, and a CRC followed by itself leaves the same
        // state whatever its value), the frame's own checksum does not.
        for i in [at + 100, at + frame.len() - 1] {
            let mut bad = msg.clone();
            bad[i] ^= 1;
            let mut f = open(&bad, 0, Phase::Reduced, 4, 0, 1).unwrap();
            let mut out = vec![0.0f32; g.len()];
            let err = decode_into(f.next_frame().unwrap(), &params, &mut out).unwrap_err();
            assert!(
                matches!(err, gradwire_core::Error::Checksum { .. }),
                "byte {i}: {err:?}"
            );
        }
        // A length or a header byte flipped: the message's checksum does not match.
        for i in [at - 2, 10] {
            let mut bad = msg.clone();
            bad[i] ^= 1;
            assert!(open(&bad, 0, Phase::Reduced, 4, 0, 1).is_err(), "byte {i}");
        }
    }

    #[test]
    fn a_message_laid_out_in_place_is_the_message_built_in_order() {
        let built = |frame: &[u8], bound: usize| {
            let mut msg = vec![9u8; 3];
            start(&mut msg, Phase::Reduced, 5, 1, usize::from(bound > 0));
            if bound > 0 {
                let at = reserve_frame(&mut msg, bound);
                msg[at..at + frame.len()].copy_from_slice(frame);
                commit_frame(&mut msg, at, frame.len());
            }
            finish(&mut msg, 3);
            msg
        };
        // Reused buffers longer and shorter than the message, holding other bytes.
        for old in [vec![0xeeu8; 100], vec![0xeeu8; 5]] {
            for (frame, bound) in [(&b"abcd"[..], 4), (&b"ab"[..], 6), (&b""[..], 0)] {
                let mut msg = old.clone();
                let at = lay_out(
                    &mut msg,
                    3,
                    Phase::Reduced,
                    5,
                    1,
                    usize::from(bound > 0),
                    bound,
                );
                msg[at..at + frame.len()].copy_from_slice(frame);
                if bound > 0 {
                    commit_frame(&mut msg, at, frame.len());
                }
                finish(&mut msg, 3);
                msg[..3].copy_from_slice(&[9; 3]);
                assert_eq!(msg, built(frame, bound), "{frame:?} {bound}");
            }
        }
    }
}

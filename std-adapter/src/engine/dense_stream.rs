//! A bundle of dense frames written window by window as it is sent, never whole: the message
//! of an all-gather step without error feedback whose every entry is one dense tensor. Every
//! gradient is checked before the first byte is written (so nothing can fail once a window
//! has left), or, for a message that never leaves (a group of one's), each value as it is
//! encoded (a failed piece ends the message, and the check names why); then each call writes the next bytes of the message (the envelope, the bundle's
//! header, each entry's id, length and frame, the bundle's checksum), encoding the elements
//! they hold with the core's chunk API ([`Sections::encode`]) into a buffer of about a window
//! that lives across steps. The bytes are those of the engine's whole bundle
//! ([`super::Engine::encode_bundle`]): the core's chunks write the bytes of `encode_into`, and
//! the bundle's checksum is combined from each frame's, as the whole bundle's is.

use gradwire_core::frame::chunk::Sections;
use gradwire_core::values::{first_at_or_above, magnitude_limit};
use gradwire_core::{Method, Params};

use super::shard::first_bad;
use super::{Exec, Gradients};
use crate::error::{Error, Result};
use crate::layout::Manifest;
use crate::layout::bundle::{BUNDLE_MAGIC, BUNDLE_VERSION, ENTRY_HEADER_LEN, TRAILER_LEN};

/// Elements encoded at a time on one thread (256 KiB of f32 read; at most 256 KiB written).
const PIECE: usize = 1 << 16;

/// Elements encoded at a time on the pool, in tasks of [`PIECE`].
const POOL_PIECE: usize = 16 * PIECE;

/// Where the writer is in the message.
#[derive(Clone, Copy, Debug, PartialEq)]
enum At {
    /// Before entry `e`'s id and length.
    Entry(usize),
    /// In entry `e`'s frame, before element `i`.
    Values(usize, usize),
    /// Done: every byte written.
    End,
}

/// A message of an envelope and a bundle of dense frames, written as it is read
/// ([`DenseStream::next`]) from gradients lent to each call (the buffers a step's outputs may
/// share: a window is written before the outputs of its elements are).
pub(crate) struct DenseStream<'a> {
    writer: Writer<'a>,
    /// The bytes written: from `head` on, the message's from `taken` on.
    pending: &'a mut Vec<u8>,
    /// Where the bytes not yet taken start in `pending`.
    head: usize,
    /// Bytes of the message taken (handed out by the calls before the last one).
    taken: usize,
    /// Bytes handed out by the last call, from `head` on.
    lent: usize,
    total: usize,
}

/// What writes a [`DenseStream`]'s bytes, piece by piece.
struct Writer<'a> {
    manifest: &'a Manifest,
    step: u64,
    exec: Exec,
    /// Set when an encode failed after a check first (never expected): the frame's
    /// trailer is then written wrong, so that every receiver fails the step naming this rank
    /// instead of reading unspecified bytes.
    failed: bool,
    /// Whether the gradients were not checked before the first piece: a piece whose encode
    /// fails then stops the message, and the check names why ([`DenseStream::take_error`]).
    deferred: bool,
    /// The error of a deferred check.
    error: Option<Error>,
    at: At,
    sections: Option<Sections>,
    bundle_crc: crc32fast::Hasher,
    frame_crc: crc32fast::Hasher,
}

/// Whether `manifest`'s bundles can be written as they are sent: every entry one dense
/// tensor, entry `e` tensor `e` (no buckets).
pub(crate) fn streams(manifest: &Manifest) -> bool {
    matches!(manifest.method(), Method::Dense { .. })
        && manifest.one_entry_per_tensor()
        && manifest
            .entries()
            .iter()
            .all(|e| matches!(e.method, Method::Dense { .. }))
}

impl<'a> DenseStream<'a> {
    /// The message of rank `rank`'s bundle of `grads` at `step` for `manifest` (one for which
    /// [`streams`] holds), after `envelope` (its first bytes), written into `pending` as it is
    /// read ([`DenseStream::next`], given the same gradients). With `check_first`, every
    /// gradient is checked first, as the engine checks a step without error feedback, so that
    /// nothing fails once a window has left; without (a group of one, whose message never
    /// leaves), each value is checked as it is encoded, the gradients read once.
    ///
    /// # Errors
    /// [`Error::Core`] naming the first tensor (in manifest order) holding a NaN or infinity,
    /// or a value beyond the value type's range, and its first such element, NaN or infinity
    /// first; [`Error::Config`] for a manifest whose bundles do not stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new<G: Gradients + ?Sized>(
        manifest: &'a Manifest,
        grads: &G,
        step: u64,
        rank: u32,
        envelope: &[u8],
        pending: &'a mut Vec<u8>,
        exec: Exec,
        check_first: bool,
    ) -> Result<Self> {
        if !streams(manifest) {
            return Err(Error::internal("a bundle streamed that has other entries"));
        }
        if check_first {
            check(manifest, grads, exec)?;
        }
        pending.clear();
        pending.extend_from_slice(envelope);
        let head = pending.len();
        pending.extend_from_slice(&BUNDLE_MAGIC);
        pending.extend_from_slice(&[BUNDLE_VERSION, 0, 0, 0]);
        pending.extend_from_slice(&rank.to_le_bytes());
        let entries = u32::try_from(manifest.entries().len()).unwrap_or(u32::MAX);
        pending.extend_from_slice(&entries.to_le_bytes());
        pending.extend_from_slice(&step.to_le_bytes());
        let mut bundle_crc = crc32fast::Hasher::new();
        bundle_crc.update(&pending[head..]);
        // The header, each entry's id, length and frame, the checksum.
        let mut total = pending.len() + TRAILER_LEN;
        for entry in manifest.entries() {
            let frame = Sections::of(entry.len, &entry.method)
                .map(|s| s.frame_len())
                .ok_or_else(|| Error::internal("a streamed entry without sections"))?;
            total += ENTRY_HEADER_LEN + frame;
        }
        Ok(DenseStream {
            writer: Writer {
                manifest,
                step,
                exec,
                failed: false,
                deferred: !check_first,
                error: None,
                at: At::Entry(0),
                sections: None,
                bundle_crc,
                frame_crc: crc32fast::Hasher::new(),
            },
            pending,
            head: 0,
            taken: 0,
            lent: 0,
            total,
        })
    }

    /// Bytes of the whole message.
    pub(crate) fn len(&self) -> usize {
        self.total
    }

    /// The error that ended a message written without a check first (`check_first` false in
    /// [`DenseStream::new`]): its bytes then stop short of [`DenseStream::len`].
    pub(crate) fn take_error(&mut self) -> Option<Error> {
        self.writer.error.take()
    }

    /// The message's bytes from where the last call ended up to `end` (at most
    /// [`DenseStream::len`]), written from `grads` (the gradients of [`DenseStream::new`]);
    /// the bytes the last call gave are dropped.
    pub(crate) fn next<G: Gradients + ?Sized>(&mut self, end: usize, grads: &G) -> &[u8] {
        self.head += self.lent;
        self.taken += self.lent;
        // The bytes taken are dropped once they are at least half of the buffer, so that what
        // stays is moved at most once for every byte dropped.
        if 2 * self.head >= self.pending.len() {
            self.pending.drain(..self.head);
            self.head = 0;
        }
        let end = end.clamp(self.taken, self.total);
        while self.taken + self.pending.len() - self.head < end && self.writer.at != At::End {
            self.writer.write_piece(grads, self.pending);
        }
        self.lent = (end - self.taken).min(self.pending.len() - self.head);
        &self.pending[self.head..self.head + self.lent]
    }

    /// As [`DenseStream::next`], the bytes appended to `out` instead (written there, not
    /// copied, for a reader of this rank's own message), at least up to `end` (a piece may run
    /// past it: its bytes are the ones that follow). Returns the bytes of the message appended
    /// to `out` by this and the earlier calls.
    pub(crate) fn append<G: Gradients + ?Sized>(
        &mut self,
        end: usize,
        grads: &G,
        out: &mut Vec<u8>,
    ) -> usize {
        self.head += self.lent;
        self.taken += self.lent;
        self.lent = 0;
        let end = end.clamp(self.taken, self.total);
        let held = (end - self.taken).min(self.pending.len() - self.head);
        out.extend_from_slice(&self.pending[self.head..self.head + held]);
        self.head += held;
        self.taken += held;
        if self.head == self.pending.len() {
            self.pending.clear();
            self.head = 0;
            while self.taken < end && self.writer.at != At::End {
                let before = out.len();
                self.writer.write_piece(grads, out);
                self.taken += out.len() - before;
            }
        }
        self.taken
    }
}

impl Writer<'_> {
    /// Writes the next piece into `out`: an entry's id, length and frame header; up to
    /// [`PIECE`] elements of its values; or, after its last values, its trailer (and after the
    /// last entry, the bundle's).
    fn write_piece<G: Gradients + ?Sized>(&mut self, grads: &G, out: &mut Vec<u8>) {
        let manifest = self.manifest;
        match self.at {
            At::Entry(e) => {
                let Some(entry) = manifest.entries().get(e) else {
                    let crc = self.bundle_crc.clone().finalize();
                    out.extend_from_slice(&crc.to_le_bytes());
                    self.at = At::End;
                    return;
                };
                let Some(sections) = Sections::of(entry.len, &entry.method) else {
                    self.at = At::End;
                    return;
                };
                let start = out.len();
                out.extend_from_slice(&entry.id.to_le_bytes());
                let len = u32::try_from(sections.frame_len()).unwrap_or(u32::MAX);
                out.extend_from_slice(&len.to_le_bytes());
                self.bundle_crc.update(&out[start..]);
                let head = out.len();
                out.resize(head + sections.header_len(), 0);
                let written = sections.write_header(&mut out[head..]);
                debug_assert!(written.is_ok());
                self.frame_crc = crc32fast::Hasher::new();
                self.frame_crc.update(&out[head..]);
                self.sections = Some(sections);
                self.at = At::Values(e, 0);
            }
            At::Values(e, i) => {
                let (Some(entry), Some(sections)) = (manifest.entries().get(e), self.sections)
                else {
                    self.at = At::End;
                    return;
                };
                let n = sections.n();
                if i == n {
                    self.bundle_crc.combine(&self.frame_crc);
                    let mut crc = self.frame_crc.clone().finalize();
                    if self.failed {
                        crc = !crc;
                    }
                    let crc = crc.to_le_bytes();
                    self.bundle_crc.update(&crc);
                    out.extend_from_slice(&crc);
                    self.at = At::Entry(e + 1);
                    return;
                }
                let piece = match self.exec {
                    Exec::Serial => PIECE,
                    Exec::Pool => POOL_PIECE,
                };
                let end = (i + piece).min(n);
                let params: Params = manifest.params(entry, self.step);
                let x = &grads.grad(manifest, entry.members[0])[i..end];
                let Ok((_, body)) = sections.ranges(i, end) else {
                    self.failed = true;
                    self.at = At::End;
                    return;
                };
                let start = out.len();
                out.resize(start + body.len(), 0);
                // Checked in `new`, the encode cannot fail (if it did, the frame's trailer
                // says so, see `failed`); checked as it is written, it may (`deferred`).
                let body = &mut out[start..];
                if !encode_split(self.exec, &sections, &params, i, x, body) {
                    if self.deferred {
                        // Nothing was checked first: the message ends here, before the
                        // piece, and the check (over gradients that the pieces before this one
                        // may have been decoded into, in place: finite values, in range) names
                        // the first bad element, as a check first would have.
                        out.truncate(start);
                        self.error = Some(match check(manifest, grads, self.exec) {
                            Err(e) => e,
                            Ok(()) => Error::internal("a streamed piece failed a passed check"),
                        });
                        self.at = At::End;
                        return;
                    }
                    self.failed = true;
                }
                let crc = self.exec.crc32(body);
                let len = body.len() as u64;
                self.frame_crc
                    .combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
                self.at = At::Values(e, end);
            }
            At::End => {}
        }
    }
}

/// Checks every gradient of `manifest` against its dense value type: the tensors at once on
/// the pool, each in chunks; a bad one named by its first bad element (NaN or infinity first),
/// the first tensor in manifest order.
///
/// # Errors
/// [`Error::Core`] naming that tensor and element.
fn check<G: Gradients + ?Sized>(manifest: &Manifest, grads: &G, exec: Exec) -> Result<()> {
    exec.first_err(manifest.tensors(), |t, info| {
        let Method::Dense { values } = manifest.entries()[t].method else {
            return Err(Error::internal("a streamed entry that is not dense"));
        };
        let x = grads.grad(manifest, t);
        let limit = magnitude_limit(Some(values));
        if exec.chunks_all(x, PIECE, |c| first_at_or_above(c, limit).is_none()) {
            return Ok(());
        }
        match first_bad(x, Some(values)) {
            Some(e) => Err(Error::core(&info.name, None, e)),
            None => Ok(()),
        }
    })
}

/// Encodes `x`, elements `start..` of a dense frame's tensor, into its body piece `body`:
/// halves of at least [`PIECE`] elements as tasks on the pool. `false` when a piece failed.
fn encode_split(
    exec: Exec,
    sections: &Sections,
    params: &Params,
    start: usize,
    x: &[f32],
    body: &mut [u8],
) -> bool {
    if exec == Exec::Serial || x.len() < 2 * PIECE {
        return sections.encode(params, start, x, &mut [], body).is_ok();
    }
    let mid = x.len() / 2;
    let Ok((_, front)) = sections.ranges(start, start + mid) else {
        return false;
    };
    let Some((ba, bb)) = (front.len() <= body.len()).then(|| body.split_at_mut(front.len())) else {
        return false;
    };
    let (xa, xb) = x.split_at(mid);
    let (mut a, mut b) = (false, false);
    exec.join(
        || a = encode_split(exec, sections, params, start, xa, ba),
        || b = encode_split(exec, sections, params, start + mid, xb, bb),
    );
    a && b
}

#[cfg(test)]
mod tests {
    use gradwire_core::{Values, encode_into, max_frame_len};

    use super::*;
    use crate::layout::bundle::BundleWriter;
    use crate::layout::{BucketConfig, TensorSpec};
    use crate::method::CompressionMethod;

    /// Tensors of every size class: empty, 0-d, one value, under and over a piece, several
    /// pieces and a remainder.
    fn model() -> (Vec<TensorSpec>, Vec<Vec<f32>>) {
        let sizes = [0usize, 1, 7, 1000, PIECE + 3, 3 * PIECE + 11];
        let specs = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| match n {
                1 if i == 1 => TensorSpec::new(format!("t{i}"), Vec::<usize>::new()),
                _ => TensorSpec::new(format!("t{i}"), vec![n]),
            })
            .collect();
        let grads = sizes
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|j| ((j * 37 % 101) as f32 - 50.0) * 0.37)
                    .collect()
            })
            .collect();
        (specs, grads)
    }

    #[test]
    fn a_streamed_message_is_the_envelope_and_the_bundle_written_whole() {
        let (specs, grads) = model();
        let grads: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        let envelope: Vec<u8> = (0..20).collect();
        for values in [Values::F32, Values::F16, Values::Bf16] {
            let method = CompressionMethod::Core(Method::Dense { values });
            let manifest = Manifest::new(specs.clone(), &method, 3, BucketConfig::none()).unwrap();
            assert!(streams(&manifest));
            let step = 9;
            let mut bundle = Vec::new();
            let count = manifest.entries().len() as u32;
            let mut writer = BundleWriter::begin(&mut bundle, 2, count, step);
            for (entry, g) in manifest.entries().iter().zip(&grads) {
                let mut frame = vec![0u8; max_frame_len(entry.len, &entry.method)];
                let params = manifest.params(entry, step);
                let len = encode_into(g, &params, &mut [], &mut frame).unwrap();
                writer.push(entry.id, &frame[..len]);
            }
            writer.finish();
            let want = [envelope.as_slice(), &bundle].concat();
            for (window, exec) in [
                (1, Exec::Serial),
                (5, Exec::Pool),
                (4096, Exec::Serial),
                (100_003, Exec::Pool),
                (usize::MAX, Exec::Serial),
                (usize::MAX, Exec::Pool),
            ] {
                // Checked first or as it is written: the same bytes.
                let check_first = window % 2 == 1;
                let make = |pending| {
                    DenseStream::new(
                        &manifest,
                        grads.as_slice(),
                        step,
                        2,
                        &envelope,
                        pending,
                        exec,
                        check_first,
                    )
                    .unwrap()
                };
                let mut pending = Vec::new();
                let mut stream = make(&mut pending);
                assert_eq!(stream.len(), want.len(), "{values:?}");
                let mut got = Vec::new();
                while got.len() < want.len() {
                    let end = got.len().saturating_add(window).min(want.len());
                    let bytes = stream.next(end, grads.as_slice());
                    assert_eq!(bytes.len(), end - got.len(), "{values:?} window {window}");
                    got.extend_from_slice(bytes);
                }
                assert!(got == want, "{values:?} window {window}");
                assert!(stream.next(want.len(), grads.as_slice()).is_empty());
                // Appended to a reader's buffer instead, after a first window taken.
                let mut pending = Vec::new();
                let mut stream = make(&mut pending);
                let first = stream.next(window.min(30), grads.as_slice()).to_vec();
                let mut got = first.clone();
                let mut done = first.len();
                while done < want.len() {
                    let end = done.saturating_add(window).min(want.len());
                    done = stream.append(end, grads.as_slice(), &mut got);
                    assert!(
                        done >= end && done == got.len(),
                        "{values:?} window {window}"
                    );
                }
                assert!(got == want, "{values:?} window {window}: appended");
                // Never more than a window and a piece held, and as much taken (twice that
                // grown into).
                let held = 2 * (window.min(want.len()) + 4 * POOL_PIECE + 64);
                assert!(pending.capacity() <= 2 * held, "{}", pending.capacity());
            }
        }
    }

    #[test]
    fn a_bad_gradient_is_named_before_anything_is_written_or_where_the_message_stops() {
        let (specs, grads) = model();
        let method = CompressionMethod::Core(Method::Dense {
            values: Values::F16,
        });
        let manifest = Manifest::new(specs, &method, 0, BucketConfig::none()).unwrap();
        for (t, at, x, want) in [
            (
                4,
                70,
                70_000.0,
                gradwire_core::Error::ValueOutOfRange { index: 70 },
            ),
            (
                4,
                90,
                f32::NAN,
                gradwire_core::Error::NonFinite { index: 90 },
            ),
            (
                5,
                5,
                f32::INFINITY,
                gradwire_core::Error::NonFinite { index: 5 },
            ),
            // Past the tensor's first pieces: a message written without a check first stops
            // there, after bytes of this tensor.
            (
                5,
                2 * PIECE + 5,
                f32::NAN,
                gradwire_core::Error::NonFinite {
                    index: 2 * PIECE + 5,
                },
            ),
        ] {
            let mut bad = grads.clone();
            bad[t][at] = x;
            // A NaN after a value out of range is named first, as the engine names it.
            bad[t][at / 2] = 1e9;
            let slices: Vec<&[f32]> = bad.iter().map(Vec::as_slice).collect();
            let want = match x.is_finite() {
                true => gradwire_core::Error::ValueOutOfRange { index: at / 2 },
                false => want,
            };
            let want = Error::core(&format!("t{t}"), None, want).to_string();
            for exec in [Exec::Serial, Exec::Pool] {
                let mut pending = vec![7u8; 3];
                let made =
                    DenseStream::new(&manifest, &slices[..], 0, 0, &[], &mut pending, exec, true);
                let err = made.err().unwrap();
                assert_eq!(err.to_string(), want);
                assert_eq!(pending, [7, 7, 7], "nothing written");
                // Without a check first (a group of one's message, read as it is written):
                // the message stops before the piece that holds the first bad value, and the
                // same error names it.
                let mut pending = Vec::new();
                let mut stream =
                    DenseStream::new(&manifest, &slices[..], 0, 0, &[], &mut pending, exec, false)
                        .unwrap();
                let mut got = Vec::new();
                let done = stream.append(stream.len(), &slices[..], &mut got);
                assert!(done < stream.len() && done == got.len());
                assert_eq!(stream.take_error().unwrap().to_string(), want);
            }
        }
    }
}

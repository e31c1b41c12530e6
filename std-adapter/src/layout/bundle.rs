//! Bundles: everything one rank sends in one step, in one message, checked and decoded against
//! the receiver's [`Manifest`]. `FORMAT.md` is the normative specification.
//!
//! # Bundle layout (version 2)
//! All integers little-endian.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `GWBN` (`47 57 42 4E`) |
//! | 4 | 1 | version, `2` |
//! | 5 | 1 | flags, `0` (reserved) |
//! | 6 | 2 | reserved, `0` |
//! | 8 | 4 | rank of the sender (u32) |
//! | 12 | 4 | entry count `E` (u32) |
//! | 16 | 8 | step (u64) |
//! | 24 | ... | `E` entries, in manifest order |
//! | end - 4 | 4 | CRC-32 (IEEE, as in frames) of every byte before it |
//!
//! Each entry:
//!
//! | size | field |
//! |---|---|
//! | 8 | id (u64): FNV-1a over the label (a name, or a bucket's label) and a 0 byte, then each tensor's name, a 0 byte, its dimension count and dimensions (u64 each) |
//! | 4 | frame length `L` (u32) |
//! | `L` | a gradwire frame (`FORMAT.md`) |
//!
//! A bundle costs 28 bytes plus 12 per entry on top of its frames. Names, shapes, the method
//! and the bucketing are not in a bundle: the receiver's [`Manifest`] holds them, and decoding checks
//! the bundle against it: the header (magic, version, reserved fields, checksum, rank, step),
//! the entry count, every entry's id (same tensors in the same shapes, same order) and every
//! frame's element count and parameters (same method). Anything else is an error naming the
//! tensor (or bucket) and the rank. Version 1 ids hashed the name alone, so a tensor with the
//! same name and element count in another shape (a transposed weight) was averaged element by
//! element with the receiver's. Nothing is allocated from lengths read off the wire: the
//! output is sized by the manifest, and a valid bundle is never longer than
//! [`Manifest::max_bundle_len`] (the limit to give [`crate::comm::Communicator::all_gather`]
//! for bundles alone).
//!

use gradwire_core::{Params, decode_into, peek};

use super::{Entry, Manifest, ManifestTensor, check_frame_of, update_with_frame};
use crate::error::{BundleFault, Error, Result};

/// The first four bytes of every bundle.
pub(crate) const BUNDLE_MAGIC: [u8; 4] = *b"GWBN";
/// The bundle format version this crate writes and reads.
pub(crate) const BUNDLE_VERSION: u8 = 2;
/// Bytes of the bundle header.
pub(crate) const HEADER_LEN: usize = 24;
/// Bytes of an entry's id and length.
pub(crate) const ENTRY_HEADER_LEN: usize = 12;
/// Bytes of the CRC-32 trailer.
pub(crate) const TRAILER_LEN: usize = 4;

/// What a bundle's header declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BundleHeader {
    /// Format version.
    pub version: u8,
    /// The sender's rank.
    pub rank: u32,
    /// Number of entries.
    pub entries: u32,
    /// The step the frames were made at.
    pub step: u64,
}

impl BundleHeader {
    /// Reads and checks a bundle's header and, with `checksum`, its checksum (not its
    /// entries): without, the caller combines the checksum from the entries' frames
    /// ([`update_with_frame`]).
    ///
    /// # Errors
    /// [`Error::Bundle`] with [`BundleFault::Empty`], [`BundleFault::Truncated`],
    /// [`BundleFault::BadMagic`], [`BundleFault::UnsupportedVersion`],
    /// [`BundleFault::Reserved`], and with `checksum` [`BundleFault::Incomplete`] or
    /// [`BundleFault::Checksum`].
    fn read(bundle: &[u8], checksum: bool) -> Result<Self> {
        let fault = |fault| Error::Bundle { rank: None, fault };
        if bundle.is_empty() {
            return Err(fault(BundleFault::Empty));
        }
        if bundle.len() < HEADER_LEN + TRAILER_LEN {
            return Err(fault(BundleFault::Truncated {
                needed: HEADER_LEN + TRAILER_LEN,
                got: bundle.len(),
            }));
        }
        if bundle[..4] != BUNDLE_MAGIC {
            return Err(fault(BundleFault::BadMagic));
        }
        if bundle[4] != BUNDLE_VERSION {
            return Err(fault(BundleFault::UnsupportedVersion {
                version: bundle[4],
            }));
        }
        if bundle[5] != 0 {
            return Err(fault(BundleFault::Reserved { offset: 5 }));
        }
        if bundle[6] != 0 || bundle[7] != 0 {
            return Err(fault(BundleFault::Reserved { offset: 6 }));
        }
        let body = bundle.len() - TRAILER_LEN;
        let stored = u32::from_le_bytes(le(&bundle[body..]));
        let computed = if checksum {
            crc32fast::hash(&bundle[..body])
        } else {
            stored
        };
        if stored != computed {
            // A bundle cut short (a partial transfer or copy) fails its checksum too; when its
            // own entry headers say it needs more bytes than it has, that is the clearer error.
            if let Some(declared) = declared_len(bundle).filter(|&l| l > bundle.len()) {
                return Err(fault(BundleFault::Incomplete {
                    declared,
                    got: bundle.len(),
                }));
            }
            return Err(fault(BundleFault::Checksum { stored, computed }));
        }
        Ok(BundleHeader {
            version: bundle[4],
            rank: u32::from_le_bytes(le(&bundle[8..12])),
            entries: u32::from_le_bytes(le(&bundle[12..16])),
            step: u64::from_le_bytes(le(&bundle[16..24])),
        })
    }
}

/// The length in bytes that a bundle's own headers declare (header, entries as their lengths
/// say, trailer), walking the entries only until one reaches past the bytes present (so at
/// most `bundle.len() / 12` steps); `None` when a length overflows.
fn declared_len(bundle: &[u8]) -> Option<usize> {
    let entries = u32::from_le_bytes(le(bundle.get(12..16)?));
    let mut pos = HEADER_LEN;
    for _ in 0..entries {
        let Some(head) = bundle.get(pos..pos + ENTRY_HEADER_LEN) else {
            return Some(pos + ENTRY_HEADER_LEN + TRAILER_LEN);
        };
        let len = u32::from_le_bytes(le(&head[8..])) as usize;
        pos = pos.checked_add(ENTRY_HEADER_LEN)?.checked_add(len)?;
        if pos.checked_add(TRAILER_LEN)? > bundle.len() {
            break;
        }
    }
    pos.checked_add(TRAILER_LEN)
}

/// The first `N` bytes of `b` as an array (zeros where `b` is shorter; callers check lengths).
fn le<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    for (d, s) in a.iter_mut().zip(b) {
        *d = *s;
    }
    a
}

/// Writes a bundle into a caller's buffer: [`BundleWriter::begin`], one
/// [`BundleWriter::push`] per entry in manifest order, then [`BundleWriter::finish`].
pub(crate) struct BundleWriter<'o> {
    out: &'o mut Vec<u8>,
}

impl<'o> BundleWriter<'o> {
    /// Starts a bundle in `out` (cleared, capacity kept).
    pub(crate) fn begin(out: &'o mut Vec<u8>, rank: u32, entries: u32, step: u64) -> Self {
        out.clear();
        out.extend_from_slice(&BUNDLE_MAGIC);
        out.extend_from_slice(&[BUNDLE_VERSION, 0, 0, 0]);
        out.extend_from_slice(&rank.to_le_bytes());
        out.extend_from_slice(&entries.to_le_bytes());
        out.extend_from_slice(&step.to_le_bytes());
        BundleWriter { out }
    }

    /// Appends an entry: its id and its frame (at most `u32::MAX` bytes: a manifest refuses
    /// larger frames).
    pub(crate) fn push(&mut self, id: u64, frame: &[u8]) {
        let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        self.out.extend_from_slice(&id.to_le_bytes());
        self.out.extend_from_slice(&len.to_le_bytes());
        self.out.extend_from_slice(frame);
    }

    /// Appends the checksum.
    pub(crate) fn finish(self) {
        let crc = crc32fast::hash(self.out);
        self.out.extend_from_slice(&crc.to_le_bytes());
    }
}

/// Lays out a bundle of `manifest`'s entries in `out` after its first `prefix` bytes (left as
/// they are, for an envelope), for frames written in place: writes the header and sets
/// `regions[e]` to the range of `out` where entry `e`'s frame goes, its largest length
/// ([`gradwire_core::max_frame_len`]) after room for its id and length. `out` is resized to
/// that layout without clearing what it held (only new bytes are zeroed; every byte of the
/// bundle is written before [`close_in_place`] keeps it). Then [`close_in_place`].
pub(crate) fn lay_out_in_place(
    out: &mut Vec<u8>,
    prefix: usize,
    manifest: &Manifest,
    rank: u32,
    step: u64,
    regions: &mut Vec<std::ops::Range<usize>>,
) {
    regions.clear();
    let mut at = prefix + HEADER_LEN;
    for entry in manifest.entries() {
        let start = at + ENTRY_HEADER_LEN;
        let end = start + gradwire_core::max_frame_len(entry.len, &entry.method);
        regions.push(start..end);
        at = end;
    }
    let total = at + TRAILER_LEN;
    if out.len() < total {
        out.resize(total, 0);
    } else {
        out.truncate(total);
    }
    // A manifest holds at most u32::MAX entries.
    let entries = manifest.entries().len() as u32;
    let header = &mut out[prefix..prefix + HEADER_LEN];
    header[..4].copy_from_slice(&BUNDLE_MAGIC);
    header[4..8].copy_from_slice(&[BUNDLE_VERSION, 0, 0, 0]);
    header[8..12].copy_from_slice(&rank.to_le_bytes());
    header[12..16].copy_from_slice(&entries.to_le_bytes());
    header[16..24].copy_from_slice(&step.to_le_bytes());
}

/// Completes a bundle of [`lay_out_in_place`] whose frames are written, entry `e`'s of
/// `len_of(e)` bytes at the start of `regions[e]`: writes each entry's id and length, moves each
/// frame forward over the room shorter frames before it left, and appends the checksum. The
/// bytes are those of [`BundleWriter`] with the same frames.
pub(crate) fn close_in_place(
    out: &mut Vec<u8>,
    prefix: usize,
    manifest: &Manifest,
    regions: &[std::ops::Range<usize>],
    len_of: impl Fn(usize) -> usize,
) {
    let mut at = prefix + HEADER_LEN;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out[prefix..at]);
    for (e, (entry, region)) in manifest.entries().iter().zip(regions).enumerate() {
        let len = len_of(e).min(region.len());
        // Every frame is shorter than u32::MAX: a manifest refuses larger ones.
        let len32 = u32::try_from(len).unwrap_or(u32::MAX);
        out[at..at + 8].copy_from_slice(&entry.id.to_le_bytes());
        out[at + 8..at + ENTRY_HEADER_LEN].copy_from_slice(&len32.to_le_bytes());
        let start = at + ENTRY_HEADER_LEN;
        if start != region.start {
            out.copy_within(region.start..region.start + len, start);
        }
        // The frames were just written by the encoder, each with its own CRC: the bundle's is
        // combined from theirs instead of read again.
        crc.update(&out[at..start]);
        update_with_frame(&mut crc, &out[start..start + len]);
        at = start + len;
    }
    out.truncate(at);
    out.extend_from_slice(&crc.finalize().to_le_bytes());
}

/// One rank's bundle read as its bytes arrive, with the checks of
/// [`Manifest::check_bundle`] in the order the bytes come: the header (magic, version,
/// reserved fields, rank, step, entry count) once its 24 bytes are there, each entry (id,
/// frame checksum, element count, parameters) once it is whole, and the bundle's checksum,
/// combined from the frames' ([`update_with_frame`]), and its end after the last entry. The
/// faults are [`Manifest::check_bundle`]'s, except that a bundle's checksum is checked last
/// (a damaged frame is named by its own checksum first) and that a wrong entry count does not
/// name where the entries differ.
#[derive(Debug, Default)]
pub(crate) struct BundleStream {
    crc: Option<crc32fast::Hasher>,
    /// Bytes of the bundle read so far.
    read: usize,
    /// Entries read so far.
    entries: usize,
}

impl BundleStream {
    /// Reads the header from `bytes` (the bundle's first bytes): `Ok(None)` when fewer than
    /// its 24 bytes are there, else the bytes read.
    ///
    /// # Errors
    /// [`Error::Bundle`] naming `rank`: [`BundleFault::BadMagic`],
    /// [`BundleFault::UnsupportedVersion`], [`BundleFault::Reserved`], [`BundleFault::Rank`],
    /// [`BundleFault::Step`], [`BundleFault::EntryCount`].
    pub(crate) fn read_header(
        &mut self,
        manifest: &Manifest,
        bytes: &[u8],
        rank: usize,
        step: u64,
    ) -> Result<Option<usize>> {
        let Some(head) = bytes.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let fault = |fault| Error::Bundle {
            rank: Some(rank),
            fault,
        };
        if head[..4] != BUNDLE_MAGIC {
            return Err(fault(BundleFault::BadMagic));
        }
        if head[4] != BUNDLE_VERSION {
            return Err(fault(BundleFault::UnsupportedVersion { version: head[4] }));
        }
        if head[5] != 0 {
            return Err(fault(BundleFault::Reserved { offset: 5 }));
        }
        if head[6] != 0 || head[7] != 0 {
            return Err(fault(BundleFault::Reserved { offset: 6 }));
        }
        // The checks below come after the bundle's checksum in `check_bundle`'s order: the
        // hash starts here, so that a fault among them can still be named as that checksum
        // ([`BundleStream::damaged`]).
        let mut crc = crc32fast::Hasher::new();
        crc.update(head);
        self.crc = Some(crc);
        self.read = HEADER_LEN;
        let declared = u32::from_le_bytes(le(&head[8..12]));
        if usize::try_from(declared).ok() != Some(rank) {
            return Err(fault(BundleFault::Rank {
                expected: rank,
                got: u64::from(declared),
            }));
        }
        let got_step = u64::from_le_bytes(le(&head[16..24]));
        if got_step != step {
            return Err(fault(BundleFault::Step {
                expected: step,
                got: got_step,
            }));
        }
        let entries = u32::from_le_bytes(le(&head[12..16]));
        if entries as usize != manifest.entries.len() {
            return Err(fault(BundleFault::EntryCount {
                expected: manifest.entries.len(),
                got: u64::from(entries),
                first_difference: None,
            }));
        }
        Ok(Some(HEADER_LEN))
    }

    /// Whether the header was read.
    pub(crate) fn has_header(&self) -> bool {
        self.crc.is_some()
    }

    /// Whether the next entry is whole in `bytes` (which start at it).
    pub(crate) fn entry_ready(bytes: &[u8]) -> bool {
        bytes.get(8..ENTRY_HEADER_LEN).is_some_and(|len| {
            let len = u32::from_le_bytes(le(len)) as usize;
            bytes.len() - ENTRY_HEADER_LEN >= len
        })
    }

    /// Reads the next entry from `bytes` (which start at it, whole: [`BundleStream::entry_ready`])
    /// and checks it against `manifest`'s entry at `step`: its frame and the bytes read.
    ///
    /// # Errors
    /// As [`Manifest::check_bundle`] for an entry ([`Error::UnexpectedEntry`],
    /// [`Error::ParamsDiffer`], [`Error::Core`]), naming `rank`; [`Error::Bundle`] with
    /// [`BundleFault::Truncated`] when the entry is not whole, or with
    /// [`BundleFault::TrailingBytes`] when the manifest has no more entries.
    pub(crate) fn read_entry<'b>(
        &mut self,
        manifest: &Manifest,
        bytes: &'b [u8],
        rank: usize,
        step: u64,
    ) -> Result<(&'b [u8], usize)> {
        let Some(entry) = manifest.entries.get(self.entries) else {
            return Err(Error::Bundle {
                rank: Some(rank),
                fault: BundleFault::TrailingBytes { offset: self.read },
            });
        };
        let mut pos = 0;
        let (id, frame) = manifest.entry_at(bytes, bytes.len(), &mut pos, Some(rank))?;
        check_id(self.entries, entry, id, frame, Some(rank))?;
        let params = manifest.params(entry, step);
        check_frame_of(&entry.label, Some(rank), frame, &params, entry.len)?;
        if let Some(crc) = self.crc.as_mut() {
            crc.update(&bytes[..ENTRY_HEADER_LEN]);
            update_with_frame(crc, frame);
        }
        self.entries += 1;
        self.read += pos;
        Ok((frame, pos))
    }

    /// Starts an entry read in pieces as its bytes arrive (its frame's header checked by the
    /// caller): `entry_header`, its id and length, are the bundle's next bytes.
    pub(crate) fn begin_entry_in_pieces(&mut self, entry_header: &[u8]) {
        if let Some(crc) = self.crc.as_mut() {
            crc.update(entry_header);
        }
    }

    /// Ends the entry begun by [`BundleStream::begin_entry_in_pieces`]: `frame` is the hash of
    /// its frame's bytes before the trailer, `trailer` the frame's last 4 bytes (whether they
    /// match is the caller's check), `frame_len` the frame's length.
    pub(crate) fn end_entry_in_pieces(
        &mut self,
        frame: &crc32fast::Hasher,
        trailer: &[u8],
        frame_len: usize,
    ) {
        if let Some(crc) = self.crc.as_mut() {
            crc.combine(frame);
            crc.update(trailer);
        }
        self.entries += 1;
        self.read += ENTRY_HEADER_LEN + frame_len;
    }

    /// The fault [`BundleStream::finish`] names for a bundle that ends inside the entry begun
    /// by [`BundleStream::begin_entry_in_pieces`] (a frame of `frame_len` bytes, of whose entry
    /// `got` bytes arrived, its id and length included).
    pub(crate) fn truncated_in_entry(&self, frame_len: usize, got: usize, rank: usize) -> Error {
        Error::Bundle {
            rank: Some(rank),
            fault: BundleFault::Truncated {
                needed: (self.read + ENTRY_HEADER_LEN + TRAILER_LEN).saturating_add(frame_len),
                got: self.read + got,
            },
        }
    }

    /// Adds `bytes`, the bundle's next bytes after a fault (from the failing entry's start, or
    /// after the header), to its hash as they are (a frame that failed its checks cannot lend
    /// its trailer).
    pub(crate) fn hash_damaged(&mut self, bytes: &[u8]) {
        if let Some(crc) = self.crc.as_mut() {
            crc.update(bytes);
            self.read += bytes.len();
        }
    }

    /// After a fault that `check_bundle` checks after the bundle's checksum (the header's rank,
    /// step and entry count; an entry), with every byte of the bundle since hashed
    /// ([`BundleStream::hash_damaged`]) up to `trailer`, its last 4 bytes: the checksum fault
    /// `check_bundle` names first when the trailer does not match (bytes damaged on the way),
    /// `None` when it does (the sender made the fault; its own error stands).
    pub(crate) fn damaged(&self, trailer: &[u8], rank: usize) -> Option<Error> {
        let crc = self.crc.as_ref()?;
        let stored = u32::from_le_bytes(le(trailer.get(..TRAILER_LEN)?));
        let computed = crc.clone().finalize();
        (stored != computed).then_some(Error::Bundle {
            rank: Some(rank),
            fault: BundleFault::Checksum { stored, computed },
        })
    }

    /// Ends the bundle: `rest` is every byte after the last entry (all of them arrived).
    ///
    /// # Errors
    /// [`Error::Bundle`] naming `rank`: [`BundleFault::Truncated`] when the header or an entry
    /// never became whole, [`BundleFault::TrailingBytes`] when more than the trailer follows
    /// the last entry, [`BundleFault::TooLarge`] for a bundle beyond
    /// [`Manifest::max_bundle_len`], [`BundleFault::Checksum`] when the trailer does not
    /// match.
    pub(crate) fn finish(&self, manifest: &Manifest, rest: &[u8], rank: usize) -> Result<()> {
        let fault = |fault| Error::Bundle {
            rank: Some(rank),
            fault,
        };
        let got = self.read + rest.len();
        let Some(crc) = self.crc.as_ref() else {
            return Err(fault(BundleFault::Truncated {
                needed: HEADER_LEN + TRAILER_LEN,
                got,
            }));
        };
        if self.entries < manifest.entries.len() {
            // The next entry never became whole: at least its header and the frame its length
            // declares were due.
            let frame = rest
                .get(8..ENTRY_HEADER_LEN)
                .map_or(0, |len| u32::from_le_bytes(le(len)) as usize);
            return Err(fault(BundleFault::Truncated {
                needed: (self.read + ENTRY_HEADER_LEN + TRAILER_LEN).saturating_add(frame),
                got,
            }));
        }
        if rest.len() < TRAILER_LEN {
            return Err(fault(BundleFault::Truncated {
                needed: self.read + TRAILER_LEN,
                got,
            }));
        }
        if rest.len() > TRAILER_LEN {
            return Err(fault(BundleFault::TrailingBytes { offset: self.read }));
        }
        // As `check_bundle`: valid frames never exceed their bound (a frame may be valid alone
        // with an index codec larger than the one the bound counts).
        if got > manifest.max_bundle_len {
            return Err(fault(BundleFault::TooLarge {
                limit: manifest.max_bundle_len,
                got,
            }));
        }
        let stored = u32::from_le_bytes(le(rest));
        let computed = crc.clone().finalize();
        if stored != computed {
            return Err(fault(BundleFault::Checksum { stored, computed }));
        }
        Ok(())
    }
}

impl Manifest {
    /// Checks a bundle against the manifest without decoding its frames' bodies: the header
    /// (magic, version, reserved fields, checksum), the rank and step when given, the entry
    /// count, every entry's id and length, and every frame's checksum, element count and
    /// parameters. Calls `f(entry index, frame, expected parameters)` for every entry, in
    /// order, once all checks passed. Returns the header.
    ///
    /// # Errors
    /// [`Error::Bundle`] for the framing; [`Error::UnexpectedEntry`] when an entry belongs to
    /// another tensor; naming the tensor (or bucket) and the rank for a frame whose header
    /// fails the checks of [`gradwire_core::Header::check`]: [`Error::ParamsDiffer`] (made with
    /// other parameters, both configurations given) or [`Error::Core`]; any error `f` returns.
    pub fn check_bundle_with(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
        mut f: impl FnMut(usize, &[u8], &Params) -> Result<()>,
    ) -> Result<BundleHeader> {
        // The bundle's checksum is combined from its frames' once each frame's own checksum is
        // verified (the frames read once, not twice). On any fault the checks run again in
        // their order, the whole bundle's checksum first, so that the error is the one the
        // format's order names.
        let header = match self.check_framing(bundle, rank, step, false) {
            Ok(header) => header,
            Err(_) => self.check_framing(bundle, rank, step, true)?,
        };
        // Pass 2: hand out the frames.
        self.walk(bundle, rank, |e, frame| {
            f(e, frame, &self.params(&self.entries[e], header.step))
        })?;
        Ok(header)
    }

    /// The checks of [`Manifest::check_bundle_with`] before any frame is handed out: with
    /// `whole_checksum`, the bundle's checksum over its bytes first; without, combined from the
    /// frames' verified checksums after every other check ([`BundleFault::Checksum`] when it
    /// differs).
    fn check_framing(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
        whole_checksum: bool,
    ) -> Result<BundleHeader> {
        let fault = |rank: Option<usize>, fault| Error::Bundle { rank, fault };
        let header = BundleHeader::read(bundle, whole_checksum).map_err(|e| match e {
            Error::Bundle { fault: f, .. } => fault(rank, f),
            other => other,
        })?;
        let declared = usize::try_from(header.rank).ok();
        if let Some(r) = rank
            && declared != Some(r)
        {
            return Err(fault(
                rank,
                BundleFault::Rank {
                    expected: r,
                    got: u64::from(header.rank),
                },
            ));
        }
        let rank = rank.or(declared);
        if let Some(s) = step
            && header.step != s
        {
            return Err(fault(
                rank,
                BundleFault::Step {
                    expected: s,
                    got: header.step,
                },
            ));
        }
        if header.entries as usize != self.entries.len() {
            return Err(fault(
                rank,
                BundleFault::EntryCount {
                    expected: self.entries.len(),
                    got: u64::from(header.entries),
                    first_difference: self.first_difference(bundle, header.entries as usize),
                },
            ));
        }
        let body_end = bundle.len() - TRAILER_LEN;
        let mut crc = (!whole_checksum).then(|| {
            let mut crc = crc32fast::Hasher::new();
            crc.update(&bundle[..HEADER_LEN]);
            crc
        });
        // Pass 1: framing and frame headers (their checksums included) of every entry.
        let mut pos = HEADER_LEN;
        for (e, entry) in self.entries.iter().enumerate() {
            let at = pos;
            let (id, frame) = self.entry_at(bundle, body_end, &mut pos, rank)?;
            check_id(e, entry, id, frame, rank)?;
            let params = self.params(entry, header.step);
            check_frame_of(&entry.label, rank, frame, &params, entry.len)?;
            if let Some(crc) = crc.as_mut() {
                crc.update(&bundle[at..at + ENTRY_HEADER_LEN]);
                update_with_frame(crc, frame);
            }
        }
        if pos != body_end {
            return Err(fault(rank, BundleFault::TrailingBytes { offset: pos }));
        }
        if let Some(crc) = crc {
            let stored = u32::from_le_bytes(le(&bundle[body_end..]));
            let computed = crc.finalize();
            if stored != computed {
                return Err(fault(rank, BundleFault::Checksum { stored, computed }));
            }
        }
        // Valid frames never exceed their bound; kept as a last line of defence.
        if bundle.len() > self.max_bundle_len {
            return Err(fault(
                rank,
                BundleFault::TooLarge {
                    limit: self.max_bundle_len,
                    got: bundle.len(),
                },
            ));
        }
        Ok(header)
    }

    /// Calls `f(entry index, frame)` for every entry of a bundle that
    /// [`Manifest::check_bundle`] accepted.
    pub(crate) fn walk(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        mut f: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let body_end = bundle.len().saturating_sub(TRAILER_LEN);
        let mut pos = HEADER_LEN;
        for (e, entry) in self.entries.iter().enumerate() {
            let (id, frame) = self.entry_at(bundle, body_end, &mut pos, rank)?;
            check_id(e, entry, id, frame, rank)?;
            f(e, frame)?;
        }
        Ok(())
    }

    /// For a bundle of `declared` entries where the manifest has another number: the first
    /// entry where the two differ, named by the manifest's label there (a tensor missing on one
    /// side shows there). `None` when the bundle's entries cannot be read that far.
    fn first_difference(&self, bundle: &[u8], declared: usize) -> Option<String> {
        let body_end = bundle.len().checked_sub(TRAILER_LEN)?;
        let mut pos = HEADER_LEN;
        let common = declared.min(self.entries.len());
        for (e, entry) in self.entries[..common].iter().enumerate() {
            let (id, _) = self.entry_at(bundle, body_end, &mut pos, None).ok()?;
            if id != entry.id {
                return Some(format!(
                    "the first that differs is entry {e}, where the manifest has `{}`",
                    entry.label
                ));
            }
        }
        Some(match (self.entries.get(common), common) {
            (Some(entry), _) => format!(
                "the bundle ends before entry {common}, where the manifest has `{}`",
                entry.label
            ),
            (None, 0) => "the manifest has no entries".to_owned(),
            (None, _) => format!("the bundle has more entries after entry {}", common - 1),
        })
    }

    /// Reads the entry at `pos` (its id and frame) and advances `pos`.
    fn entry_at<'b>(
        &self,
        bundle: &'b [u8],
        body_end: usize,
        pos: &mut usize,
        rank: Option<usize>,
    ) -> Result<(u64, &'b [u8])> {
        let truncated = |needed: usize| Error::Bundle {
            rank,
            fault: BundleFault::Truncated {
                needed: needed.saturating_add(TRAILER_LEN),
                got: bundle.len(),
            },
        };
        let head_end = pos.saturating_add(ENTRY_HEADER_LEN);
        let head = bundle
            .get(*pos..head_end)
            .filter(|_| head_end <= body_end)
            .ok_or_else(|| truncated(head_end))?;
        let id = u64::from_le_bytes(le(&head[..8]));
        let len = u32::from_le_bytes(le(&head[8..12])) as usize;
        let end = head_end.saturating_add(len);
        let frame = bundle
            .get(head_end..end)
            .filter(|_| end <= body_end)
            .ok_or_else(|| truncated(end))?;
        *pos = end;
        Ok((id, frame))
    }

    /// Checks a bundle against the manifest (see [`Manifest::check_bundle_with`]).
    ///
    /// # Errors
    /// As [`Manifest::check_bundle_with`].
    pub fn check_bundle(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
    ) -> Result<BundleHeader> {
        self.check_bundle_with(bundle, rank, step, |_, _, _| Ok(()))
    }

    /// Decodes a bundle into `out`, resized to [`Manifest::flat_len`] (no allocation when it
    /// already has the capacity). `rank` and `step`, when given, must match the bundle's.
    /// Returns the bundle's header.
    ///
    /// # Errors
    /// As [`Manifest::check_bundle_with`], and [`Error::Core`] naming the tensor (or bucket)
    /// for a frame whose body is invalid (then `out` is zeroed); [`Error::OutOfMemory`] when
    /// the model's elements cannot be allocated. On any other error `out` is untouched.
    pub fn decode_bundle(
        &self,
        bundle: &[u8],
        rank: Option<usize>,
        step: Option<u64>,
        out: &mut Vec<f32>,
    ) -> Result<BundleHeader> {
        let mut sized = false;
        let result = self.check_bundle_with(bundle, rank, step, |e, frame, params| {
            if !sized {
                crate::tensor::resize_or_refuse(out, self.flat_len, crate::error::MODEL)?;
                sized = true;
            }
            let entry = &self.entries[e];
            let dst = &mut out[entry.offset..entry.offset + entry.len];
            decode_into(frame, params, dst)
                .map(|_| ())
                .map_err(|err| Error::core(&entry.label, rank, err))
        });
        match result {
            Ok(header) => {
                out.resize(self.flat_len, 0.0);
                Ok(header)
            }
            Err(e) => {
                if sized {
                    out.fill(0.0);
                }
                Err(e)
            }
        }
    }
}

/// [`Error::UnexpectedEntry`] unless `id` is entry `e`'s (with the element count of `frame`,
/// when its header reads: for the same tensor in another shape, that is what differs).
fn check_id(e: usize, entry: &Entry, id: u64, frame: &[u8], rank: Option<usize>) -> Result<()> {
    if id == entry.id {
        return Ok(());
    }
    Err(Error::UnexpectedEntry {
        rank,
        index: e,
        expected: entry.label.clone(),
        expected_elements: entry.len as u64,
        got_elements: peek(frame).ok().map(|h| h.n),
        expected_id: entry.id,
        got_id: id,
    })
}

/// An entry's id on the wire: FNV-1a (as [`gradwire_core::tensor_id`]) over its label, then
/// the name and shape of each of its tensors (names end with a 0 byte; a shape is its
/// dimension count, then each dimension, u64 little-endian). So a peer
/// whose tensor has the same name and element count but another shape (a transposed weight)
/// sends another id, and its bundle is an error naming the tensor, not an element-wise mean of
/// two layouts. (The names are hashed one by one, not only through the bucket's label, which
/// joins them with `", "`: tensors named `a, b` and `c` would otherwise bucket like `a` and
/// `b, c`.)
pub(crate) fn entry_id<'a>(label: &str, members: impl Iterator<Item = &'a ManifestTensor>) -> u64 {
    let mut h = Fnv::new();
    h.name(label);
    for t in members {
        h.name(&t.name);
        h.shape(&t.shape);
    }
    h.0
}

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn eat(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// A name and a 0 byte.
    fn name(&mut self, name: &str) {
        self.eat(name.as_bytes());
        self.eat(&[0]);
    }

    /// The dimension count, then each dimension (u64 little-endian).
    fn shape(&mut self, shape: &[usize]) {
        self.eat(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            self.eat(&(d as u64).to_le_bytes());
        }
    }
}

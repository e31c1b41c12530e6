//! The receiving side of the all-gather collective, as the messages arrive: each rank's
//! bundle is read window by window ([`BundleStream`]), every entry is aggregated into its
//! output as soon as all `W` ranks' frames of it are whole (ranks in order, as
//! [`Aggregator::aggregate_into`] adds them), and the bytes used are dropped. A large dense,
//! quantization or sign entry (aggregated in chunks) is read in pieces instead: its elements
//! are aggregated as soon as every rank's bytes of them arrived
//! ([`Aggregator::aggregate_pieces`]), its frames' checksums hashed on the way and compared at
//! their trailers. A receiver then holds, per rank, what arrived of the entry being read and
//! not yet used (with frames of the same length on every rank, as dense, quantization and sign
//! send: about a window, and a quantization or sign frame's scales section), not every rank's
//! whole bundle (`W` x the bundle: 4 x 249 MB for dense bf16 on GPT-2-small at W = 4) nor
//! every rank's whole frame of an entry (4 x 77 MB for its `wte`). A rank whose frames are
//! shorter (a sparse method) runs ahead of the others by up to their difference.
//!
//! The checks are [`Manifest::check_bundle`]'s, in the order the bytes come (entry by entry,
//! ranks in order within an entry), so a fault is found after the entries before it were
//! added: the step then fails on every rank alike (every rank reads the same bytes), with the
//! outputs unspecified, as after any failed step of the collective. Entries are judged in
//! order, whatever arrived with them: an entry's fault (a check, a value, a result that is not
//! finite) is named only once the entries before it were added without one, and an entry read
//! in pieces gets the error its whole frames give (`FORMAT.md` 14.1), so the error does not
//! depend on the windows. A fault that
//! `check_bundle` checks after the bundle's checksum (the header's rank, step and entry count,
//! an entry) is named as that checksum's fault when the bundle's bytes were damaged on the way
//! (its bytes are hashed to its trailer), as `check_bundle` names it; otherwise it stands.

use gradwire_core::frame::chunk::Sections;

use crate::aggregate::{Aggregator, PieceFaults, Reduction, check_reduction};
use crate::error::{Error, Result};
use crate::layout::Manifest;
use crate::layout::bundle::{BundleStream, ENTRY_HEADER_LEN, HEADER_LEN, TRAILER_LEN};
use crate::layout::plan::ReducePlan;

use super::{ENVELOPE_LEN, Opened, open};

/// The stream of one step's bundles into the outputs (see the module docs).
pub(crate) struct Received<'a> {
    manifest: &'a Manifest,
    step: u64,
    reduction: Reduction,
    aggregator: &'a mut Aggregator,
    world: usize,
    readers: Vec<BundleStream>,
    /// Where each rank's unread bytes start in its buffer.
    at: Vec<usize>,
    /// The frames of the entries aggregated in one call: `spans[i * W + r]`, rank `r`'s frame
    /// of the call's `i`-th entry, as a range of its buffer.
    spans: Vec<(usize, usize)>,
    /// Entries aggregated so far.
    next: usize,
    /// Every rank's header read.
    headers: bool,
    /// Decided on the first windows: whether every message is a payload of the same
    /// configuration (the step goes on, and this stream reads it); `None` before.
    go: Option<bool>,
    error: Option<Error>,
    /// The rank whose bundle holds the fault in `error`, when `check_bundle` checks that
    /// fault after the bundle's checksum: its bytes are hashed to the end, so that damage on
    /// the way is named as the checksum fault, as `check_bundle` names it.
    damaged: Option<usize>,
    /// The entry being read in pieces, if any.
    in_pieces: Option<InPieces>,
    pieces: &'a mut PieceBuffers,
}

/// Buffers of the entries read in pieces, kept between steps: each rank's scales section and
/// the frame header every rank's frame of the entry begins with.
#[derive(Debug, Default)]
pub(crate) struct PieceBuffers {
    scales: Vec<Vec<u8>>,
    header: Vec<u8>,
}

/// An entry read in pieces as its bytes arrive.
struct InPieces {
    sections: Sections,
    /// Bytes of each rank's frame read: the same on every rank (a piece is read once it
    /// arrived on every rank).
    pos: usize,
    /// Elements aggregated.
    done: usize,
    /// Each rank's hash of its frame's bytes read.
    crcs: Vec<crc32fast::Hasher>,
    faults: PieceFaults,
}

impl<'a> Received<'a> {
    /// A stream of `world` ranks' bundles made with `manifest` at `step`, aggregated with
    /// `reduction` into the outputs [`Received::consume`] is given.
    pub(crate) fn new(
        manifest: &'a Manifest,
        step: u64,
        reduction: Reduction,
        aggregator: &'a mut Aggregator,
        world: usize,
        pieces: &'a mut PieceBuffers,
    ) -> Self {
        Received {
            manifest,
            step,
            reduction,
            aggregator,
            world,
            readers: Vec::new(),
            at: Vec::new(),
            spans: Vec::new(),
            next: 0,
            headers: false,
            go: None,
            error: None,
            damaged: None,
            in_pieces: None,
            pieces,
        }
    }

    /// The step's result when the first windows let it go on (this stream read the
    /// messages); `None` when they hold its verdict (a failure, another configuration, a
    /// message that is not an envelope), which the caller reads from them: they are left as
    /// they came.
    pub(crate) fn result(self) -> Option<Result<()>> {
        match self.go {
            Some(true) => Some(self.error.map_or(Ok(()), Err)),
            _ => None,
        }
    }

    /// Takes what arrived in `bufs` (one buffer per rank, each its message's bytes from where
    /// this stream last cut it), `last` once every message arrived whole: aggregates into
    /// `outs` (one slice per entry, in entry order) the entries whole on every rank and what
    /// arrived on every rank of an entry read in pieces, and removes the bytes read (see
    /// below). After an error the
    /// bytes are dropped as they come, so that the windows still run to their end on every
    /// rank.
    pub(crate) fn consume(&mut self, bufs: &mut [Vec<u8>], last: bool, outs: &mut [&mut [f32]]) {
        if self.go.is_none() {
            let go = bufs.len() == self.world && every_payload_alike(bufs);
            self.go = Some(go);
            if !go {
                return;
            }
            self.readers.clear();
            self.readers.resize_with(self.world, BundleStream::default);
            self.at.clear();
            self.at.resize(self.world, ENVELOPE_LEN);
            if let Err(e) = check_reduction(self.manifest, self.reduction, self.world) {
                self.error = Some(e);
            }
        }
        if self.go != Some(true) {
            return;
        }
        if self.error.is_none()
            && let Err(e) = self.read(bufs, last, outs)
        {
            self.error = Some(e);
        }
        if self.error.is_some() {
            for (r, buf) in bufs.iter_mut().enumerate() {
                if self.damaged == Some(r) {
                    self.hash_damaged(r, buf, last);
                } else {
                    buf.clear();
                    self.at[r] = 0;
                }
            }
            return;
        }
        // The bytes read are dropped once they are at least half of a buffer (or all of it), so
        // that what stays is moved at most once for every byte dropped, however far one rank's
        // bundle runs ahead of the others'.
        for (buf, at) in bufs.iter_mut().zip(&mut self.at) {
            if *at == buf.len() {
                buf.clear();
                *at = 0;
            } else if 2 * *at >= buf.len() {
                buf.drain(..*at);
                *at = 0;
            }
        }
    }

    /// After a fault in rank `r`'s bundle: hashes what arrived of it (the last 4 bytes held
    /// back until `last`, when they are its trailer) and, once `last`, names the checksum fault
    /// when its trailer does not match.
    fn hash_damaged(&mut self, r: usize, buf: &mut Vec<u8>, last: bool) {
        let at = self.at[r].min(buf.len());
        let end = buf.len().saturating_sub(TRAILER_LEN).max(at);
        self.readers[r].hash_damaged(&buf[at..end]);
        if last {
            if let Some(e) = self.readers[r].damaged(&buf[end..], r) {
                self.error = Some(e);
            }
            self.damaged = None;
            buf.clear();
            self.at[r] = 0;
        } else {
            // The held-back bytes stay at the buffer's start for the next round.
            buf.drain(..end);
            self.at[r] = 0;
        }
    }

    /// Reads the headers, then the entries in order (each whole on every rank, or a large
    /// dense, quantization or sign entry in pieces as its bytes arrive), then, once `last`,
    /// each bundle's end.
    fn read(&mut self, bufs: &[Vec<u8>], last: bool, outs: &mut [&mut [f32]]) -> Result<()> {
        let (manifest, step, world) = (self.manifest, self.step, self.world);
        if !self.headers {
            for (r, (reader, buf)) in self.readers.iter_mut().zip(bufs).enumerate() {
                if reader.has_header() {
                    continue;
                }
                match reader.read_header(manifest, &buf[self.at[r]..], r, step) {
                    Ok(Some(n)) => self.at[r] += n,
                    Ok(None) if last => return reader.finish(manifest, &buf[self.at[r]..], r),
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        // Rank, step or entry count: checked after the bundle's checksum in
                        // `check_bundle`'s order (magic, version and reserved bytes before).
                        if reader.has_header() {
                            self.at[r] += HEADER_LEN;
                            self.damaged = Some(r);
                        }
                        return Err(e);
                    }
                }
            }
            self.headers = true;
        }
        let entries = manifest.entries().len();
        loop {
            if self.in_pieces.is_none() {
                self.read_whole_entries(bufs, outs)?;
                if self.next == entries || !self.begin_in_pieces(bufs) {
                    break;
                }
            }
            if !self.read_pieces(bufs, outs)? {
                break;
            }
        }
        if last {
            if let Some(p) = &self.in_pieces {
                // A bundle ends inside the entry: the first rank whose frame never became
                // whole, named as for an entry read whole.
                let frame_len = p.sections.frame_len();
                let rest = |r: usize| bufs[r].len() - self.at[r];
                let r = (0..world)
                    .find(|&r| p.pos + rest(r) < frame_len)
                    .unwrap_or(0);
                let got = ENTRY_HEADER_LEN + p.pos + rest(r);
                return Err(self.readers[r].truncated_in_entry(frame_len, got, r));
            }
            // Each bundle's end: the first rank whose next entry never became whole, or each
            // trailer after the last entry.
            if self.next < entries
                && let Some(r) =
                    (0..world).find(|&r| !BundleStream::entry_ready(&bufs[r][self.at[r]..]))
            {
                return self.readers[r].finish(manifest, &bufs[r][self.at[r]..], r);
            }
            for (r, (reader, buf)) in self.readers.iter().zip(bufs).enumerate() {
                reader.finish(manifest, &buf[self.at[r]..], r)?;
                self.at[r] = buf.len();
            }
        }
        Ok(())
    }

    /// Reads and aggregates the next entries that are whole on every rank. A fault is named
    /// in entry order whatever arrived with it: an entry that fails its checks after entries
    /// that passed theirs is named only once those are aggregated without an error.
    fn read_whole_entries(&mut self, bufs: &[Vec<u8>], outs: &mut [&mut [f32]]) -> Result<()> {
        let (manifest, step) = (self.manifest, self.step);
        let first = self.next;
        let entries = manifest.entries().len();
        self.spans.clear();
        let mut fault = None;
        'entries: while self.next < entries
            && bufs
                .iter()
                .zip(&self.at)
                .all(|(buf, &at)| BundleStream::entry_ready(&buf[at..]))
        {
            for (r, (reader, buf)) in self.readers.iter_mut().zip(bufs).enumerate() {
                let at = self.at[r];
                let (frame, read) = match reader.read_entry(manifest, &buf[at..], r, step) {
                    Ok(entry) => entry,
                    Err(e) => {
                        fault = Some((r, e));
                        break 'entries;
                    }
                };
                let start = at + (read - frame.len());
                self.spans.push((start, start + frame.len()));
                self.at[r] += read;
            }
            self.next += 1;
        }
        self.aggregate_whole(bufs, first, outs)?;
        match fault {
            Some((r, e)) => {
                self.damaged = Some(r);
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Aggregates entries `first..self.next`, read whole (their frames in `self.spans`).
    fn aggregate_whole(
        &mut self,
        bufs: &[Vec<u8>],
        first: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        let (manifest, step, world) = (self.manifest, self.step, self.world);
        if self.next > first {
            let spans = &self.spans;
            let frame = |r: usize, e: usize| -> &[u8] {
                let (a, b) = spans[(e - first) * world + r];
                &bufs[r][a..b]
            };
            self.aggregator.aggregate_entries(
                manifest,
                world,
                step,
                self.reduction,
                first,
                &frame,
                outs.get_mut(first..self.next)
                    .ok_or_else(|| Error::internal("fewer outputs than the manifest's entries"))?,
            )?;
        }
        Ok(())
    }

    /// Starts reading the next entry in pieces when it is a large dense, quantization or sign
    /// entry (aggregated in chunks) and every rank's entry has arrived up to its frame's
    /// header, with the entry's id, the frame length its method and element count give, and
    /// exactly the header they give: every check of the entry but its checksum passed, and
    /// every rank's frame has the same layout. Otherwise (another entry, a check that fails)
    /// the entry is read whole, which names the fault. Returns whether it started.
    fn begin_in_pieces(&mut self, bufs: &[Vec<u8>]) -> bool {
        let Some(entry) = self.manifest.entries().get(self.next) else {
            return false;
        };
        if entry.reduce != ReducePlan::DenseChunks {
            return false;
        }
        let Some(sections) = Sections::of(entry.len, &entry.method) else {
            return false;
        };
        let (head, frame_len) = (sections.header_len(), sections.frame_len());
        let header = &mut self.pieces.header;
        header.resize(head, 0);
        if sections.write_header(header).is_err() {
            return false;
        }
        let id = entry.id.to_le_bytes();
        let len = u64::try_from(frame_len)
            .ok()
            .and_then(|l| u32::try_from(l).ok());
        let starts = bufs.iter().zip(&self.at).all(|(buf, &at)| {
            buf.get(at..at + ENTRY_HEADER_LEN + head).is_some_and(|b| {
                b[..8] == id
                    && len.is_some_and(|l| b[8..ENTRY_HEADER_LEN] == l.to_le_bytes())
                    && b[ENTRY_HEADER_LEN..] == header[..]
            })
        });
        if !starts {
            return false;
        }
        let mut crcs = Vec::with_capacity(self.world);
        for (r, buf) in bufs.iter().enumerate() {
            let at = self.at[r];
            self.readers[r].begin_entry_in_pieces(&buf[at..at + ENTRY_HEADER_LEN]);
            let mut crc = crc32fast::Hasher::new();
            crc.update(&buf[at + ENTRY_HEADER_LEN..at + ENTRY_HEADER_LEN + head]);
            crcs.push(crc);
            self.at[r] += ENTRY_HEADER_LEN + head;
        }
        self.pieces.scales.resize_with(self.world, Vec::new);
        self.pieces.scales.iter_mut().for_each(Vec::clear);
        self.in_pieces = Some(InPieces {
            sections,
            pos: head,
            done: 0,
            crcs,
            faults: PieceFaults::default(),
        });
        true
    }

    /// Reads what arrived of the entry begun in pieces on every rank: its scales section once
    /// whole on every rank (kept, and checked), then the elements whose body bytes every rank
    /// holds (aggregated, chunk boundaries), then the trailers, which end the entry with its
    /// error, if any, named as for the entry read whole: a rank's checksum first (the bundle
    /// then hashed to its end, as for any entry that fails its checks), then a rank's fault
    /// in its sections, then a result that is not finite. Returns whether the entry ended.
    fn read_pieces(&mut self, bufs: &[Vec<u8>], outs: &mut [&mut [f32]]) -> Result<bool> {
        let (manifest, world) = (self.manifest, self.world);
        let e = self.next;
        let Some(p) = self.in_pieces.as_mut() else {
            return Ok(false);
        };
        let s = p.sections;
        let internal = |_| Error::internal("the sections of an entry read in pieces");
        let Some(out) = outs.get_mut(e).filter(|o| o.len() == s.n()) else {
            return Err(Error::internal("an output that is not the entry's"));
        };
        let (scales, body) = s.ranges(0, s.n()).map_err(internal)?;
        let mut ready = (0..world)
            .map(|r| bufs[r].len() - self.at[r])
            .min()
            .unwrap_or(0);
        if p.pos < scales.end {
            let need = scales.end - p.pos;
            if ready < need {
                return Ok(false);
            }
            for (r, kept) in self.pieces.scales.iter_mut().enumerate() {
                let bytes = &bufs[r][self.at[r]..self.at[r] + need];
                p.crcs[r].update(bytes);
                kept.extend_from_slice(bytes);
                self.at[r] += need;
            }
            p.pos = scales.end;
            ready -= need;
            if let Some((r, err)) = self
                .pieces
                .scales
                .iter()
                .enumerate()
                .find_map(|(r, kept)| s.check_scales(kept).err().map(|err| (r, err)))
            {
                p.faults.note(r, 0, err);
            }
        }
        // The last chunk boundary whose body bytes arrived on every rank.
        let reach = (p.pos + ready).min(body.end);
        let body_end = |b: usize| s.ranges(0, b).map_or(usize::MAX, |(_, body)| body.end);
        let end = if body_end(s.n()) <= reach {
            s.n()
        } else {
            let align = s.align();
            let (mut lo, mut hi) = (p.done / align, s.n() / align);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if body_end(mid * align) <= reach {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            lo * align
        };
        if end > p.done {
            let len = s.ranges(p.done, end).map_err(internal)?.1.len();
            for (r, crc) in p.crcs.iter_mut().enumerate() {
                crc.update(&bufs[r][self.at[r]..self.at[r] + len]);
            }
            let (at, kept) = (&self.at, &self.pieces.scales);
            self.aggregator.aggregate_pieces(
                manifest,
                e,
                &s,
                world,
                self.reduction,
                &|r| kept[r].as_slice(),
                &|r| &bufs[r][at[r]..at[r] + len],
                p.done,
                &mut out[p.done..end],
                &mut p.faults,
            );
            self.at.iter_mut().for_each(|at| *at += len);
            p.pos += len;
            p.done = end;
        }
        if p.done < s.n() || (0..world).any(|r| bufs[r].len() - self.at[r] < TRAILER_LEN) {
            return Ok(false);
        }
        let Some(p) = self.in_pieces.take() else {
            return Ok(false);
        };
        let mut bad_checksum = None;
        for (r, (reader, crc)) in self.readers.iter_mut().zip(&p.crcs).enumerate() {
            let trailer = &bufs[r][self.at[r]..self.at[r] + TRAILER_LEN];
            let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
            let computed = crc.clone().finalize();
            if stored != computed && bad_checksum.is_none() {
                bad_checksum = Some((r, stored, computed));
            }
            reader.end_entry_in_pieces(crc, trailer, s.frame_len());
            self.at[r] += TRAILER_LEN;
        }
        self.next += 1;
        let error = match bad_checksum {
            Some((r, stored, computed)) => {
                self.damaged = Some(r);
                let label = &manifest.entries()[e].label;
                let fault = gradwire_core::Error::Checksum { stored, computed };
                Some(Error::core(label, Some(r), fault))
            }
            None => p.faults.into_error(manifest, e),
        };
        match error {
            Some(err) => {
                out.fill(0.0);
                Err(err)
            }
            None => Ok(true),
        }
    }
}

/// Whether every message of the first windows is a payload envelope with the first one's
/// fingerprint: the verdict of [`super::gathered_fingerprints`] and the fingerprint check
/// that lets the step go on.
fn every_payload_alike(bufs: &[Vec<u8>]) -> bool {
    let mut fingerprints = bufs.iter().map(|m| match open(m) {
        Opened::Payload { fingerprint } => Some(fingerprint),
        _ => None,
    });
    let lead = fingerprints.next().flatten();
    lead.is_some() && fingerprints.all(|f| f == lead)
}

/// Entries read in pieces against the same bundles read whole: the same bits, and for damaged,
/// forged and cut bundles the same error, whatever the windows.
#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use gradwire_core::{encode_into, max_frame_len};

    use super::*;
    use crate::layout::BucketConfig;
    use crate::layout::bundle::BundleWriter;
    use crate::method::CompressionMethod;
    use crate::tensor::Tensor;

    const W: usize = 3;

    /// A small generator (SplitMix64).
    struct Draw(u64);
    impl Draw {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Two large tensors (read in pieces) between small ones (read whole).
    const SIZES: [(&str, usize); 4] = [("a", 100), ("big", 200_000), ("c", 7), ("huge", 300_001)];

    /// Each of `w` ranks' message (envelope and bundle) for `method` at step 0, for tensors
    /// of `sizes`; `scale` multiplies every value (large values make sums that overflow).
    fn messages(
        method: &CompressionMethod,
        w: usize,
        sizes: &[(&str, usize)],
        scale: f32,
    ) -> (Manifest, Vec<Vec<u8>>) {
        let gradients = |rank: usize| {
            let mut g = HashMap::new();
            for &(name, n) in sizes {
                let v = (0..n)
                    .map(|i| scale * ((((i * 7 + rank) % 29) as f32 - 14.0) / 9.0))
                    .collect();
                g.insert(name.to_string(), Tensor::new(vec![n], v).unwrap());
            }
            g
        };
        let manifest =
            Manifest::for_gradients(&gradients(0), method, 0, BucketConfig::none()).unwrap();
        let core = method.core_method().unwrap();
        let msgs = (0..w)
            .map(|r| {
                let g = gradients(r);
                let mut bundle = Vec::new();
                let count = manifest.entries().len() as u32;
                let mut writer = BundleWriter::begin(&mut bundle, r as u32, count, 0);
                for (entry, info) in manifest.entries().iter().zip(manifest.tensors()) {
                    let mut frame = vec![0u8; max_frame_len(entry.len, &core)];
                    let params = manifest.params(entry, 0);
                    let len =
                        encode_into(g[&info.name].data(), &params, &mut [], &mut frame).unwrap();
                    writer.push(entry.id, &frame[..len]);
                }
                writer.finish();
                let mut msg = Vec::new();
                super::super::seal(super::super::PAYLOAD, 7, &bundle, &mut msg);
                msg
            })
            .collect();
        (manifest, msgs)
    }

    /// The stream's result over `msgs` (one per rank), each call bringing each rank up to
    /// `window()` more bytes (`None`: every message whole in one call), the first at least
    /// 4 KiB (the smallest first window, which holds every envelope).
    fn receive(
        manifest: &Manifest,
        msgs: &[Vec<u8>],
        reduction: Reduction,
        mut window: Option<&mut dyn FnMut() -> usize>,
    ) -> (std::result::Result<(), String>, Vec<f32>) {
        let w = msgs.len();
        let mut outs: Vec<Vec<f32>> = manifest
            .entries()
            .iter()
            .map(|e| vec![f32::NAN; e.len])
            .collect();
        let mut aggregator = Aggregator::new();
        let mut pieces = PieceBuffers::default();
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
        let mut stream = Received::new(manifest, 0, reduction, &mut aggregator, w, &mut pieces);
        let mut sent = vec![0usize; w];
        let mut bufs = vec![Vec::new(); w];
        loop {
            for (r, buf) in bufs.iter_mut().enumerate() {
                let more = match window.as_mut() {
                    Some(f) if sent[r] == 0 => f().max(4096),
                    Some(f) => f(),
                    None => usize::MAX,
                };
                let end = sent[r].saturating_add(more).min(msgs[r].len());
                buf.extend_from_slice(&msgs[r][sent[r]..end]);
                sent[r] = end;
            }
            let last = (0..w).all(|r| sent[r] == msgs[r].len());
            stream.consume(&mut bufs, last, &mut slices);
            if last {
                break;
            }
        }
        let result = stream
            .result()
            .expect("payloads")
            .map_err(|e| e.to_string());
        (result, outs.concat())
    }

    /// Where each frame of a bundle in a message lies.
    fn frames(msg: &[u8]) -> Vec<std::ops::Range<usize>> {
        let mut at = ENVELOPE_LEN + HEADER_LEN;
        let mut out = Vec::new();
        while at + ENTRY_HEADER_LEN + TRAILER_LEN <= msg.len() {
            let len = u32::from_le_bytes(msg[at + 8..at + 12].try_into().unwrap()) as usize;
            let start = at + ENTRY_HEADER_LEN;
            out.push(start..start + len);
            at = start + len;
        }
        out
    }

    /// Where [`forge`] puts a bad byte in a frame.
    enum Spot {
        /// Among its first bytes after the header (a scale, or the first values).
        Early,
        /// Among its last bytes before the trailer.
        Late,
        /// Its last scale (a frame without scales: as `Late`).
        LastScale,
        /// The first byte of its body (values, codes or signs).
        FirstBody,
    }

    /// Makes entry `e`'s frame of a message bad as its sender would (a byte of 0xff at
    /// `spot`: a NaN, a bad scale or code), its checksums made to match.
    fn forge(msg: &mut [u8], manifest: &Manifest, e: usize, spot: Spot, d: &mut Draw) {
        let f = frames(msg)[e].clone();
        let entry = &manifest.entries()[e];
        let sections = Sections::of(entry.len, &entry.method).unwrap();
        let (scales, body) = sections.ranges(0, entry.len).unwrap();
        let at = match spot {
            Spot::Early => scales.start + d.below(16),
            Spot::LastScale if !scales.is_empty() => scales.end - 1,
            Spot::Late | Spot::LastScale => body.end - 1 - d.below(16),
            Spot::FirstBody => body.start,
        };
        msg[f.start + at] = 0xff;
        fix_crc(&mut msg[f]);
        fix_crc(&mut msg[ENVELOPE_LEN..]);
    }

    fn fix_crc(bytes: &mut [u8]) {
        let end = bytes.len() - TRAILER_LEN;
        let crc = crc32fast::hash(&bytes[..end]);
        bytes[end..].copy_from_slice(&crc.to_le_bytes());
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn entries_read_in_pieces_give_the_bits_and_errors_of_entries_read_whole() {
        let methods = [
            CompressionMethod::Core(gradwire_core::Method::Dense {
                values: gradwire_core::Values::Bf16,
            }),
            CompressionMethod::Quantization { bits: 4 },
            CompressionMethod::SignSGD,
        ];
        let mut d = Draw(46);
        for method in &methods {
            for (reduction, scale) in [(Reduction::Mean, 1.0), (Reduction::Sum, 2e38)] {
                let (manifest, clean) = messages(method, W, &SIZES, scale);
                let whole = receive(&manifest, &clean, reduction, None);
                match (scale == 1.0, &whole.0) {
                    (true, Ok(())) => {}
                    // A sum past f32's range, where every method sends values near 1e38 and more.
                    (false, Err(e)) if e.contains("overflow") => {}
                    (_, other) => panic!("{method:?} {reduction:?}: {other:?}"),
                }
                for trial in 0..120 {
                    let mut msgs = clean.clone();
                    let r = d.below(W);
                    let spans = frames(&msgs[r]);
                    let e = if d.below(2) == 0 { 1 } else { 3 };
                    let what = match trial % 7 {
                        // A byte of a large frame changed on the way (or, with its
                        // checksums made to match, by its sender).
                        0..=2 => {
                            let f = spans[e].clone();
                            let at = f.start + d.below(f.len());
                            msgs[r][at] ^= 1 << d.below(8);
                            if trial % 7 >= 1 {
                                fix_crc(&mut msgs[r][f]);
                            }
                            if trial % 7 == 2 {
                                fix_crc(&mut msgs[r][ENVELOPE_LEN..]);
                            }
                            format!("byte {at}")
                        }
                        // Two ranks' frames of one entry made bad by their senders, the
                        // later rank early in its frame, the earlier rank late in its body,
                        // or at its body's first byte and its last scale (named first).
                        3 | 4 => {
                            let (lo, hi) = (r.min((r + 1) % W), r.max((r + 1) % W));
                            forge(&mut msgs[hi], &manifest, e, Spot::Early, &mut d);
                            if trial % 7 == 3 {
                                forge(&mut msgs[lo], &manifest, e, Spot::Late, &mut d);
                            } else {
                                forge(&mut msgs[lo], &manifest, e, Spot::FirstBody, &mut d);
                                forge(&mut msgs[lo], &manifest, e, Spot::LastScale, &mut d);
                            }
                            format!("ranks {lo} and {hi}")
                        }
                        // One rank's frame made bad by its sender, another's damaged on the
                        // way: the damage is named.
                        5 => {
                            let other = (r + 1 + d.below(W - 1)) % W;
                            forge(&mut msgs[r], &manifest, e, Spot::Early, &mut d);
                            let f = frames(&msgs[other])[e].clone();
                            msgs[other][f.end - 8] ^= 1;
                            format!("forged, rank {other} damaged")
                        }
                        _ => {
                            let cut = ENVELOPE_LEN + d.below(msgs[r].len() - ENVELOPE_LEN);
                            msgs[r].truncate(cut);
                            format!("cut at {cut}")
                        }
                    };
                    let want = receive(&manifest, &msgs, reduction, None);
                    let size = [97, 4096, 1 << 16][trial % 3];
                    let mut windows = || 1 + d.below(2 * size);
                    let got = receive(&manifest, &msgs, reduction, Some(&mut windows));
                    let case = format!("{method:?} {reduction:?} rank {r} {what}");
                    assert_eq!(got.0, want.0, "{case}");
                    if want.0.is_ok() {
                        assert!(same(&got.1, &want.1), "{case}");
                    }
                }
                let mut windows = || 4096;
                let got = receive(&manifest, &clean, reduction, Some(&mut windows));
                assert_eq!(got.0, whole.0, "{method:?} {reduction:?}");
                assert!(
                    whole.0.is_err() || same(&got.1, &whole.1),
                    "{method:?} {reduction:?}"
                );
            }
        }
    }

    /// More methods and reductions (unscaled sign with a majority vote and a sum, 8-, 3- and
    /// 2-bit quantization, dense f32) at W = 1, 2 and 4, against damage to an entry's id and
    /// length (a length one lower or higher, the bundle's checksum made to match), to a frame's
    /// header, to its body (checksums made to match) and bytes after the bundle.
    #[test]
    fn entries_read_in_pieces_agree_for_every_method_world_size_and_entry_header() {
        use gradwire_core::{Method, Rounding, SignScale, Values};
        let sizes = [("a", 50usize), ("big", 140_001), ("c", 3)];
        let unscaled = CompressionMethod::Core(Method::Sign {
            scale: SignScale::None,
            zero_mask: false,
        });
        let cases = [
            (unscaled.clone(), Reduction::MajorityVote),
            (unscaled, Reduction::Sum),
            (CompressionMethod::Quantization { bits: 8 }, Reduction::Mean),
            (CompressionMethod::Quantization { bits: 3 }, Reduction::Mean),
            (
                CompressionMethod::Core(Method::Quant {
                    bits: 2,
                    block: 48,
                    rounding: Rounding::Stochastic,
                }),
                Reduction::Sum,
            ),
            (
                CompressionMethod::Core(Method::Dense {
                    values: Values::F32,
                }),
                Reduction::Mean,
            ),
        ];
        let mut d = Draw(99);
        for (method, reduction) in &cases {
            for w in [1usize, 2, 4] {
                let (manifest, clean) = messages(method, w, &sizes, 1.0);
                let pieces = |e: &crate::layout::Entry| e.reduce == ReducePlan::DenseChunks;
                assert!(manifest.entries().iter().any(pieces));
                let whole = receive(&manifest, &clean, *reduction, None);
                assert!(whole.0.is_ok(), "{method:?} {w}: {:?}", whole.0);
                for trial in 0..18 {
                    let mut msgs = clean.clone();
                    let r = d.below(w);
                    let f = frames(&msgs[r])[1].clone();
                    match trial % 6 {
                        0 => {}
                        1 => {
                            let at = f.start - ENTRY_HEADER_LEN + d.below(ENTRY_HEADER_LEN);
                            msgs[r][at] ^= 1 << d.below(8);
                        }
                        2 | 3 => {
                            let at = f.start - 4;
                            let len = u32::from_le_bytes(msgs[r][at..at + 4].try_into().unwrap());
                            let len = if trial % 6 == 2 { len - 1 } else { len + 1 };
                            msgs[r][at..at + 4].copy_from_slice(&len.to_le_bytes());
                            fix_crc(&mut msgs[r][ENVELOPE_LEN..]);
                        }
                        4 => {
                            let at = f.start + d.below(12);
                            msgs[r][at] ^= 1 << d.below(8);
                        }
                        _ => {
                            let at = f.start + d.below(f.len());
                            msgs[r][at] ^= 1 << d.below(8);
                            fix_crc(&mut msgs[r][f]);
                            fix_crc(&mut msgs[r][ENVELOPE_LEN..]);
                            if d.below(2) == 0 {
                                msgs[r].push(0);
                            }
                        }
                    }
                    let want = receive(&manifest, &msgs, *reduction, None);
                    for size in [300usize, 20_000] {
                        let mut windows = || 1 + d.below(2 * size);
                        let got = receive(&manifest, &msgs, *reduction, Some(&mut windows));
                        let case = format!("{method:?} {reduction:?} W {w} trial {trial}");
                        assert_eq!(got.0, want.0, "{case} windows {size}");
                        if want.0.is_ok() {
                            assert!(same(&got.1, &want.1), "{case} windows {size}");
                        }
                    }
                }
            }
        }
    }
}

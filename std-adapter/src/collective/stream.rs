//! The receiving side of the all-gather collective, as the messages arrive: each rank's
//! bundle is read window by window ([`BundleStream`]), every entry is aggregated into its
//! output as soon as all `W` ranks' frames of it are whole (ranks in order, as
//! [`Aggregator::aggregate_into`] adds them), and the bytes used are dropped. A receiver then
//! holds, per rank, what arrived of the entries not yet whole on every rank (with frames of
//! the same length on every rank, as dense, quantization and sign send: the entry being
//! received and at most a window more), where it held every rank's whole bundle (`W` x the
//! bundle: 4 x 249 MB for dense bf16 on GPT-2-small at W = 4). A rank whose frames are shorter
//! (a sparse method) runs ahead of the others by up to their difference.
//!
//! The checks are [`Manifest::check_bundle`]'s, in the order the bytes come (entry by entry,
//! ranks in order within an entry), so a fault is found after the entries before it were
//! added: the step then fails on every rank alike (every rank reads the same bytes), with the
//! outputs unspecified, as after any failed step of the collective. A fault that
//! `check_bundle` checks after the bundle's checksum (the header's rank, step and entry count,
//! an entry) is named as that checksum's fault when the bundle's bytes were damaged on the way
//! (its bytes are hashed to its trailer), as `check_bundle` names it; otherwise it stands.

use crate::aggregate::{Aggregator, Reduction, check_reduction};
use crate::error::{Error, Result};
use crate::layout::Manifest;
use crate::layout::bundle::{BundleStream, HEADER_LEN, TRAILER_LEN};

use super::{ENVELOPE_LEN, Opened, open};

/// The stream of one step's bundles into the outputs (see the module docs).
pub(crate) struct Received<'a, 'o> {
    manifest: &'a Manifest,
    step: u64,
    reduction: Reduction,
    aggregator: &'a mut Aggregator,
    /// Each entry's output, in entry order.
    outs: Vec<&'o mut [f32]>,
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
}

impl<'a, 'o> Received<'a, 'o> {
    /// A stream of `world` ranks' bundles made with `manifest` at `step`, aggregated with
    /// `reduction` into `outs` (one slice per entry, in entry order).
    pub(crate) fn new(
        manifest: &'a Manifest,
        step: u64,
        reduction: Reduction,
        aggregator: &'a mut Aggregator,
        outs: Vec<&'o mut [f32]>,
        world: usize,
    ) -> Self {
        Received {
            manifest,
            step,
            reduction,
            aggregator,
            outs,
            world,
            readers: Vec::new(),
            at: Vec::new(),
            spans: Vec::new(),
            next: 0,
            headers: false,
            go: None,
            error: None,
            damaged: None,
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
    /// this stream last cut it), `last` once every message arrived whole: aggregates the
    /// entries whole on every rank and removes the bytes read (see below). After an error the
    /// bytes are dropped as they come, so that the windows still run to their end on every
    /// rank.
    pub(crate) fn consume(&mut self, bufs: &mut [Vec<u8>], last: bool) {
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
            && let Err(e) = self.read(bufs, last)
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

    /// Reads the headers, then every entry whole on every rank, then, once `last`, each
    /// bundle's end.
    fn read(&mut self, bufs: &[Vec<u8>], last: bool) -> Result<()> {
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
        let first = self.next;
        let entries = manifest.entries().len();
        self.spans.clear();
        while self.next < entries
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
                        self.damaged = Some(r);
                        return Err(e);
                    }
                };
                let start = at + (read - frame.len());
                self.spans.push((start, start + frame.len()));
                self.at[r] += read;
            }
            self.next += 1;
        }
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
                &mut self.outs[first..self.next],
            )?;
        }
        if last {
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

//! The gradwire container: what `gradwire compress --layout gradwire` writes.
//!
//! A bundle ([`gradwire::bundle`]) carries frames only: names, shapes and the method never
//! travel, the receiver's [`Manifest`] holds them. A file on disk has no receiver, so the
//! container puts a small manifest section in front of the bundle. The receiver builds a
//! [`Manifest`] from that section (and, with `--shapes`, checks it against its own model) and
//! then decodes the bundle against it, with every check of [`Manifest::decode_bundle`].
//!
//! # Layout (version 1)
//! All integers little-endian.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `GWCT` (`47 57 43 54`) |
//! | 4 | 1 | container version, `1` |
//! | 5 | 3 | reserved, `0` |
//! | 8 | 4 | manifest section length `M` (u32) |
//! | 12 | `M` | manifest section (below) |
//! | 12 + `M` | 4 | CRC-32 (IEEE) of bytes `0 .. 12 + M` |
//! | 16 + `M` | rest | the bundle (its own header, entries and CRC-32) |
//!
//! Manifest section:
//!
//! | size | field |
//! |---|---|
//! | 2 | method text length `L` (u16) |
//! | `L` | method text, UTF-8 ([`gradwire::compressor::format_method`]) |
//! | 8 | seed (u64) |
//! | 4 | tensor count `T` (u32) |
//! | per tensor: 2 | name length (u16) |
//! | per tensor: ... | name, UTF-8 |
//! | per tensor: 1 | rank `R` (u8) |
//! | per tensor: `8 R` | dimensions (u64 each) |
//!
//! Tensors are listed in bundle order (sorted by name); each is its own bundle entry (no
//! buckets). The step is the bundle's. A reader refuses: another magic or version, non-zero
//! reserved bytes, a wrong CRC, a section that does not end exactly at `12 + M`, invalid UTF-8,
//! a method it cannot parse, duplicate names, and a model larger than `--max-elements`
//! elements (so that a small hostile file cannot make it allocate without bound).

use std::collections::HashMap;
use std::path::Path;

use gradwire::bucket::BucketConfig;
use gradwire::bundle::{BundleHeader, Manifest, TensorSpec};
use gradwire::compressor::{CompressionMethod, GradientCompressor, format_method, parse_method};
use gradwire::core::{Method, encode_into, max_frame_len, peek, scratch_len};
use gradwire::feedback::ErrorFeedback;
use gradwire::tensor::Tensor;

use crate::CliError;
use crate::io::Model;
use crate::report::{Report, Row};

/// The first four bytes of a container.
pub const MAGIC: [u8; 4] = *b"GWCT";
/// The container version this tool writes and reads.
pub const VERSION: u8 = 1;
const PREFIX_LEN: usize = 12;
const CRC_LEN: usize = 4;

/// CRC-32 (IEEE, as zlib, frames and the bundle trailer compute it).
fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// True when `bytes` starts with the container magic.
pub fn is_container(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

/// What the manifest section declares.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// The method of every frame.
    pub method: Method,
    /// The run's seed.
    pub seed: u64,
    /// Tensors in bundle order.
    pub tensors: Vec<TensorSpec>,
    /// Byte offset of the bundle in the container.
    pub bundle_offset: usize,
}

fn specs_of(model: &Model) -> Vec<TensorSpec> {
    model
        .iter()
        .map(|(n, t)| TensorSpec::new(n.clone(), t.shape()))
        .collect()
}

fn manifest_of(specs: Vec<TensorSpec>, method: Method, seed: u64) -> Result<Manifest, CliError> {
    Ok(Manifest::new(
        specs,
        &CompressionMethod::Core(method),
        seed,
        BucketConfig::none(),
    )?)
}

/// The manifest section and prefix, followed by `bundle`.
fn assemble(
    specs: &[TensorSpec],
    method: &Method,
    seed: u64,
    bundle: &[u8],
) -> Result<Vec<u8>, CliError> {
    let too_long = |what: &str| CliError::new(format!("{what} is too long for the container"));
    let mut section = Vec::new();
    let text = format_method(method);
    let len = u16::try_from(text.len()).map_err(|_| too_long("the method text"))?;
    section.extend_from_slice(&len.to_le_bytes());
    section.extend_from_slice(text.as_bytes());
    section.extend_from_slice(&seed.to_le_bytes());
    let count = u32::try_from(specs.len()).map_err(|_| too_long("the tensor list"))?;
    section.extend_from_slice(&count.to_le_bytes());
    for s in specs {
        let len = u16::try_from(s.name.len())
            .map_err(|_| too_long(&format!("tensor name `{}`", s.name)))?;
        section.extend_from_slice(&len.to_le_bytes());
        section.extend_from_slice(s.name.as_bytes());
        let rank = u8::try_from(s.shape.len())
            .map_err(|_| too_long(&format!("the shape of tensor `{}`", s.name)))?;
        section.push(rank);
        for &d in &s.shape {
            section.extend_from_slice(&(d as u64).to_le_bytes());
        }
    }
    let m = u32::try_from(section.len()).map_err(|_| too_long("the manifest"))?;
    let mut out = Vec::with_capacity(PREFIX_LEN + section.len() + CRC_LEN + bundle.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, 0, 0, 0]);
    out.extend_from_slice(&m.to_le_bytes());
    out.extend_from_slice(&section);
    let crc = crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(bundle);
    Ok(out)
}

fn grads_of(model: &Model) -> HashMap<String, Tensor> {
    model.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
}

/// Compresses a model without error feedback at `step` into a container.
pub fn compress(model: &Model, method: Method, seed: u64, step: u64) -> Result<Vec<u8>, CliError> {
    let specs = specs_of(model);
    let manifest = manifest_of(specs.clone(), method, seed)?;
    let bundle = if step == 0 {
        let mut c = GradientCompressor::new(CompressionMethod::Core(method)).with_seed(seed);
        let mut out = Vec::new();
        c.compress_bundle(&manifest, &grads_of(model), 0, &mut out)?;
        out
    } else {
        bundle_at_step(&manifest, model, step)?
    };
    assemble(&specs, &method, seed, &bundle)
}

/// A bundle of `model` at `step` (rank 0), written by the bundle layout of
/// [`gradwire::bundle`]: the library's compressor always starts at step 0 without error
/// feedback, and random-k and stochastic rounding draw from the step.
fn bundle_at_step(manifest: &Manifest, model: &Model, step: u64) -> Result<Vec<u8>, CliError> {
    let mut out = Vec::with_capacity(manifest.max_bundle_len());
    let entries = u32::try_from(manifest.entries().len())
        .map_err(|_| CliError::new("too many tensors for one bundle"))?;
    out.extend_from_slice(&gradwire::bundle::BUNDLE_MAGIC);
    out.extend_from_slice(&[gradwire::bundle::BUNDLE_VERSION, 0, 0, 0]);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&entries.to_le_bytes());
    out.extend_from_slice(&step.to_le_bytes());
    let mut frame = Vec::new();
    let mut scratch = Vec::new();
    for (e, entry) in manifest.entries().iter().enumerate() {
        let (name, t) = entry
            .members
            .first()
            .and_then(|&i| model.get(i))
            .ok_or_else(|| CliError::new("internal error: manifest and model disagree"))?;
        let params = manifest.params(e, step);
        frame.resize(max_frame_len(t.numel(), &params.method), 0);
        scratch.resize(scratch_len(t.numel(), &params.method), 0);
        let len = encode_into(t.data(), &params, &mut scratch, &mut frame)
            .map_err(|err| gradwire::error::Error::core(name, None, err))?;
        out.extend_from_slice(&entry.id.to_le_bytes());
        let flen = u32::try_from(len)
            .map_err(|_| CliError::new(format!("tensor `{name}` is too large")))?;
        out.extend_from_slice(&flen.to_le_bytes());
        out.extend_from_slice(&frame[..len]);
    }
    let crc = crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// One error-feedback step of a model into a container; `feedback` is updated (residuals and
/// step) only when the step succeeds.
pub fn compress_with_feedback(
    model: &Model,
    feedback: &mut ErrorFeedback,
) -> Result<Vec<u8>, CliError> {
    let method = *feedback.method();
    let seed = feedback.seed();
    let specs = specs_of(model);
    let manifest = manifest_of(specs.clone(), method, seed)?;
    let mut c = GradientCompressor::new(CompressionMethod::Core(method).with_error_feedback());
    c.restore_feedback(feedback.clone())?;
    let mut bundle = Vec::new();
    c.compress_bundle(&manifest, &grads_of(model), 0, &mut bundle)?;
    let out = assemble(&specs, &method, seed, &bundle)?;
    match c.feedback() {
        Some(fb) => *feedback = fb.clone(),
        None => {
            return Err(CliError::new(
                "internal error: the compressor lost its residuals",
            ));
        }
    }
    Ok(out)
}

/// A little-endian reader over the manifest section.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CliError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                CliError::new(format!(
                    "container manifest is truncated at byte {}",
                    PREFIX_LEN + self.pos
                ))
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CliError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn text(&mut self, n: usize, what: &str) -> Result<&'a str, CliError> {
        let at = PREFIX_LEN + self.pos;
        std::str::from_utf8(self.take(n)?).map_err(|_| {
            CliError::new(format!(
                "container manifest: {what} at byte {at} is not UTF-8"
            ))
        })
    }
}

/// Reads and checks the container prefix and manifest section. `max_elements` bounds the
/// model's total element count.
pub fn read_header(bytes: &[u8], max_elements: u64) -> Result<Header, CliError> {
    let bad = |what: String| CliError::new(format!("not a valid gradwire container: {what}"));
    if bytes.len() < PREFIX_LEN + CRC_LEN {
        return Err(bad(format!("truncated ({} bytes)", bytes.len())));
    }
    if !is_container(bytes) {
        return Err(bad("bad magic".to_owned()));
    }
    if bytes[4] != VERSION {
        return Err(bad(format!("unsupported container version {}", bytes[4])));
    }
    if bytes[5..8] != [0, 0, 0] {
        return Err(bad("reserved bytes are not zero".to_owned()));
    }
    let m = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    let section_end = PREFIX_LEN
        .checked_add(m)
        .filter(|&e| e.checked_add(CRC_LEN).is_some_and(|c| c <= bytes.len()))
        .ok_or_else(|| {
            bad(format!(
                "truncated: manifest of {m} bytes, file of {}",
                bytes.len()
            ))
        })?;
    let stored = u32::from_le_bytes([
        bytes[section_end],
        bytes[section_end + 1],
        bytes[section_end + 2],
        bytes[section_end + 3],
    ]);
    let computed = crc32(&bytes[..section_end]);
    if stored != computed {
        return Err(bad(format!(
            "manifest checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
        )));
    }
    let mut r = Reader {
        bytes: &bytes[PREFIX_LEN..section_end],
        pos: 0,
    };
    let len = u16::from_le_bytes(r.array()?) as usize;
    let text = r.text(len, "method text")?;
    let method = parse_method(text).map_err(|e| bad(format!("manifest method: {e}")))?;
    let seed = u64::from_le_bytes(r.array()?);
    let count = u32::from_le_bytes(r.array()?) as usize;
    // Each tensor takes at least 3 bytes: the count is bounded by the section.
    if count > m / 3 {
        return Err(bad(format!(
            "manifest declares {count} tensors in {m} bytes"
        )));
    }
    let mut tensors = Vec::with_capacity(count);
    let mut total: u64 = 0;
    for _ in 0..count {
        let len = u16::from_le_bytes(r.array()?) as usize;
        let name = r.text(len, "tensor name")?.to_owned();
        let rank = r.array::<1>()?[0] as usize;
        let mut shape = Vec::with_capacity(rank);
        let mut numel: u64 = 1;
        for _ in 0..rank {
            let d = u64::from_le_bytes(r.array()?);
            numel = numel.saturating_mul(d);
            shape.push(usize::try_from(d).map_err(|_| {
                bad(format!(
                    "tensor `{name}`: dimension {d} is too large for this platform"
                ))
            })?);
        }
        total = total.saturating_add(numel);
        if total > max_elements {
            return Err(bad(format!(
                "the model has more than {max_elements} elements (see --max-elements)"
            )));
        }
        tensors.push(TensorSpec::new(name, shape));
    }
    if r.pos != r.bytes.len() {
        return Err(bad(format!(
            "{} unexpected bytes at the end of the manifest",
            r.bytes.len() - r.pos
        )));
    }
    Ok(Header {
        method,
        seed,
        tensors,
        bundle_offset: section_end + CRC_LEN,
    })
}

/// Checks the container's tensors against the receiver's model (names and shapes, in sorted
/// name order).
fn check_against(header: &Header, specs: &[TensorSpec]) -> Result<(), CliError> {
    let mut theirs: Vec<(&str, &[usize])> = header
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    theirs.sort();
    let mut ours: Vec<(&str, &[usize])> = specs
        .iter()
        .map(|s| (s.name.as_str(), s.shape.as_slice()))
        .collect();
    ours.sort();
    for &(name, shape) in &ours {
        match theirs.iter().find(|(n, _)| *n == name) {
            None => {
                return Err(CliError::new(format!(
                    "tensor `{name}` is missing from the container"
                )));
            }
            Some((_, s)) if *s != shape => {
                return Err(CliError::new(format!(
                    "tensor `{name}`: the model has shape {shape:?}, the container {s:?}"
                )));
            }
            Some(_) => {}
        }
    }
    if let Some((name, _)) = theirs
        .iter()
        .find(|(n, _)| !ours.iter().any(|(o, _)| o == n))
    {
        return Err(CliError::new(format!(
            "the container holds tensor `{name}`, which the model does not have"
        )));
    }
    Ok(())
}

/// Decodes a container into dense tensors (sorted by name). With `specs` (the receiver's
/// model), the container must describe exactly that model.
pub fn decompress(
    path: &Path,
    bytes: &[u8],
    specs: Option<&[TensorSpec]>,
    max_elements: u64,
) -> Result<Model, CliError> {
    let at = |e: CliError| CliError::new(format!("{}: {}", path.display(), e.message()));
    let header = read_header(bytes, max_elements).map_err(at)?;
    if let Some(specs) = specs {
        check_against(&header, specs).map_err(at)?;
    }
    let manifest = manifest_of(header.tensors.clone(), header.method, header.seed).map_err(at)?;
    let bundle = &bytes[header.bundle_offset..];
    // Check the whole bundle before allocating the output.
    manifest
        .check_bundle(bundle, None, None)
        .map_err(|e| at(e.into()))?;
    let mut flat = Vec::new();
    flat.try_reserve_exact(manifest.flat_len()).map_err(|_| {
        at(CliError::new(format!(
            "cannot allocate {} elements",
            manifest.flat_len()
        )))
    })?;
    manifest
        .decode_bundle(bundle, None, None, &mut flat)
        .map_err(|e| at(e.into()))?;
    let mut out = Vec::with_capacity(manifest.tensors().len());
    for t in manifest.tensors() {
        let data = flat
            .get(t.offset..t.offset + t.numel)
            .ok_or_else(|| at(CliError::new("internal error: flat buffer too short")))?;
        out.push((t.name.clone(), Tensor::new(t.shape.clone(), data.to_vec())?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The `inspect` report of a container: every frame is checked (headers, checksums, element
/// counts, parameters) but not decoded.
pub fn inspect(path: &Path, bytes: &[u8], max_elements: u64) -> Result<Report, CliError> {
    let at = |e: CliError| CliError::new(format!("{}: {}", path.display(), e.message()));
    let header = read_header(bytes, max_elements).map_err(at)?;
    let manifest = manifest_of(header.tensors.clone(), header.method, header.seed).map_err(at)?;
    let bundle = &bytes[header.bundle_offset..];
    let mut rows = Vec::with_capacity(manifest.entries().len());
    let bh: BundleHeader = manifest
        .check_bundle_with(bundle, None, None, |e, frame, _| {
            let entry = &manifest.entries()[e];
            let h =
                peek(frame).map_err(|err| gradwire::error::Error::core(&entry.label, None, err))?;
            for &m in &entry.members {
                let t = &manifest.tensors()[m];
                rows.push(Row {
                    name: t.name.clone(),
                    shape: Some(t.shape.clone()),
                    method: format_method(&h.params.method),
                    n: Some(t.numel as u64),
                    kept: h.kept,
                    bytes: (frame.len() + gradwire::bundle::ENTRY_HEADER_LEN) as u64,
                });
            }
            Ok(())
        })
        .map_err(|e| at(e.into()))?;
    Ok(Report {
        layout: "gradwire",
        facts: vec![
            ("method", format_method(&header.method)),
            ("seed", header.seed.to_string()),
            ("step", bh.step.to_string()),
            ("container_version", VERSION.to_string()),
            ("bundle_version", bh.version.to_string()),
            ("manifest_bytes", header.bundle_offset.to_string()),
            ("bundle_bytes", bundle.len().to_string()),
        ],
        rows,
        file_bytes: bytes.len() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire::core::{K, Rounding, Values};

    fn model() -> Model {
        vec![
            (
                "a".to_owned(),
                Tensor::new(vec![2, 3], vec![0.5, -3.0, 0.25, 2.0, 0.0, -1.0]).unwrap(),
            ),
            ("b".to_owned(), Tensor::scalar(4.0)),
            ("c".to_owned(), Tensor::new(vec![0], vec![]).unwrap()),
        ]
    }

    #[test]
    fn crc32_is_the_ieee_crc() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn own_bundle_writer_equals_the_library_at_step_zero() {
        let m = model();
        for method in [
            Method::TopK {
                k: K::Ratio(0.5),
                values: Values::F32,
            },
            Method::RandomK {
                k: K::Count(2),
                values: Values::F16,
                unbiased: false,
            },
            Method::Quant {
                bits: 4,
                block: 2,
                rounding: Rounding::Stochastic,
            },
        ] {
            let manifest = manifest_of(specs_of(&m), method, 7).unwrap();
            let mut c = GradientCompressor::new(CompressionMethod::Core(method)).with_seed(7);
            let mut lib = Vec::new();
            c.compress_bundle(&manifest, &grads_of(&m), 0, &mut lib)
                .unwrap();
            assert_eq!(bundle_at_step(&manifest, &m, 0).unwrap(), lib);
            // A later step decodes with that step.
            let b = bundle_at_step(&manifest, &m, 5).unwrap();
            let mut flat = Vec::new();
            assert_eq!(
                manifest
                    .decode_bundle(&b, Some(0), Some(5), &mut flat)
                    .unwrap()
                    .step,
                5
            );
        }
    }

    #[test]
    fn header_round_trips_and_every_prefix_is_refused() {
        let m = model();
        let method = Method::TopK {
            k: K::Count(1),
            values: Values::Int8 { block: 4 },
        };
        let bytes = compress(&m, method, 3, 0).unwrap();
        let h = read_header(&bytes, u64::MAX).unwrap();
        assert_eq!(h.method, method);
        assert_eq!(h.seed, 3);
        assert_eq!(h.tensors, specs_of(&m));
        for len in 0..bytes.len() {
            let r = decompress(Path::new("x"), &bytes[..len], None, u64::MAX);
            assert!(r.is_err(), "prefix {len}");
        }
        // Any flipped bit is refused (a checksum covers every byte), never a panic.
        for pos in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[pos] ^= bit;
                assert!(
                    decompress(Path::new("x"), &b, None, u64::MAX).is_err(),
                    "byte {pos}"
                );
                assert!(inspect(Path::new("x"), &b, u64::MAX).is_err(), "byte {pos}");
            }
        }
        let out = decompress(Path::new("x"), &bytes, None, u64::MAX).unwrap();
        assert_eq!(out[1].1, Tensor::scalar(4.0));
        assert!(read_header(&bytes, 6).is_err());
        assert!(read_header(&bytes, 7).is_ok());
    }
}

//! Error-feedback checkpoints: [`ErrorFeedback::to_bytes`], [`ErrorFeedback::from_bytes`],
//! [`ErrorFeedback::save`], [`ErrorFeedback::load`]. `FORMAT.md` is the normative
//! specification.
//!
//! # Layout
//! A safetensors file with one F32 tensor per residual, keyed by the parameter name, in the
//! shape the residual remembers (`[n]` for one without a shape), and these `__metadata__`
//! entries:
//!
//! | key | value |
//! |---|---|
//! | `format` | `gradwire-error-feedback` |
//! | `version` | `3` |
//! | `method` | [`crate::method::format`] of the method |
//! | `seed` | the seed, decimal |
//! | `step` | the next step to run, decimal |
//! | `unshaped` | a compact JSON array (no whitespace needed; at most 6 bytes per byte of each name, as JSON escapes) of the names whose residual has no shape (stored as `[n]`), in strictly increasing byte-wise (UTF-8, code point) order; usually `[]` |
//! | `crc32` | CRC-32 (IEEE, as in frames), decimal, of: for each residual in name order, its name, a 0 byte, its stored shape (the number of dimensions as u32, then each dimension as u64, little-endian) and its values (f32 little-endian); then the `method`, `seed`, `step` and `unshaped` texts, each followed by a 0 byte |
//!
//! A residual has at most [`crate::safetensors_reader::MAX_DIMS`] dimensions. The checksum makes
//! a flipped bit in a stored residual, shape or step an error, as it is in frames and bundles.
//! Version 2 files (the same without shapes: every residual `[n]`, no `unshaped`, and a checksum
//! without the shape and `unshaped` parts) still load; their residuals have no shape until a
//! shaped step gives one. Version 1 files (no `crc32`) are refused: nothing would tell a
//! corrupted residual from a good one.
//!
//! Every residual value must be finite and fit the method's value type (f16 values: at most
//! 65504 after rounding): a residual beyond it would make every later step that sends it fail.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::Dtype;

use super::ErrorFeedback;
use crate::error::{Error, Result};
use crate::method;

/// Value of the `format` metadata entry of a checkpoint.
pub(crate) const CHECKPOINT_FORMAT: &str = "gradwire-error-feedback";
/// Value of the `version` metadata entry of a checkpoint.
pub const CHECKPOINT_VERSION: &str = "3";

impl ErrorFeedback {
    /// The checkpoint as safetensors bytes (layout in the module docs).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a residual named `__metadata__` (reserved by safetensors) or one
    /// whose shape has more than 64 dimensions (the safetensors reader's limit);
    /// [`Error::Safetensors`] when serialization fails.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.to_bytes_with_metadata(&[])
    }

    /// [`ErrorFeedback::to_bytes`] with `extra` `__metadata__` entries of the caller's (the
    /// `gradwire` tool records the output a state belongs to). Readers ignore them, and the
    /// checksum does not cover them: a caller that relies on one must check it itself.
    ///
    /// # Errors
    /// As [`ErrorFeedback::to_bytes`]; [`Error::Checkpoint`] for an extra key that the
    /// checkpoint uses itself, or one given twice.
    pub fn to_bytes_with_metadata(&self, extra: &[(&str, &str)]) -> Result<Vec<u8>> {
        const OWN: [&str; 7] = [
            "crc32", "format", "method", "seed", "step", "unshaped", "version",
        ];
        if self.residuals.contains_key("__metadata__") {
            return Err(Error::checkpoint(
                "a tensor named `__metadata__` cannot be stored in safetensors",
            ));
        }
        if let Some((name, shape)) = self
            .shapes
            .iter()
            .find(|(_, s)| s.len() > crate::safetensors_reader::MAX_DIMS)
        {
            return Err(Error::checkpoint(format!(
                "residual `{name}` has {} dimensions; a checkpoint holds at most {}",
                shape.len(),
                crate::safetensors_reader::MAX_DIMS
            )));
        }
        let mut meta = HashMap::new();
        meta.insert("format".to_owned(), CHECKPOINT_FORMAT.to_owned());
        meta.insert("version".to_owned(), CHECKPOINT_VERSION.to_owned());
        let method = method::format(&self.method);
        let (seed, step) = (self.seed.to_string(), self.step.to_string());
        let unshaped: Vec<&str> = self
            .residuals
            .keys()
            .filter(|n| !self.shapes.contains_key(*n))
            .map(String::as_str)
            .collect();
        let unshaped = serde_json::to_string(&unshaped)
            .map_err(|e| Error::checkpoint(format!("cannot write `unshaped`: {e}")))?;
        let crc = checkpoint_crc(
            &self.residuals,
            Some(&self.shapes),
            &[&method, &seed, &step, &unshaped],
        );
        meta.insert("crc32".to_owned(), crc.to_string());
        meta.insert("method".to_owned(), method);
        meta.insert("seed".to_owned(), seed);
        meta.insert("step".to_owned(), step);
        meta.insert("unshaped".to_owned(), unshaped);
        for &(key, value) in extra {
            if OWN.contains(&key) || meta.insert(key.to_owned(), value.to_owned()).is_some() {
                return Err(Error::checkpoint(format!(
                    "metadata entry `{key}` is the checkpoint's own or given twice"
                )));
            }
        }
        // Each residual in the shape it remembers, else `[n]`.
        crate::tensor::serialize_f32(
            self.residuals.iter().map(|(n, r)| {
                let shape = self.shapes.get(n).cloned().unwrap_or_else(|| vec![r.len()]);
                (n.as_str(), shape, r.as_slice())
            }),
            Some(meta),
        )
    }

    /// Restores a checkpoint from the bytes [`ErrorFeedback::to_bytes`] wrote.
    ///
    /// # Errors
    /// [`Error::Safetensors`] for bytes that are not safetensors; [`Error::Checkpoint`] naming
    /// what is wrong: a missing or unknown `format`, `version`, `method`, `seed`, `step` or
    /// (version 3) `unshaped` (not a compact JSON array of the file's residual names in strictly
    /// increasing order, or naming one the file lacks), a version 1 file (no checksum), a
    /// `crc32` entry in a version 1 file or an `unshaped` entry in a version 1 or 2 file (a
    /// damaged version number), a tensor that is not F32 (or, in version 2, not 1-d), an
    /// `unshaped` residual that is not 1-d, a NaN or infinite residual value or one beyond the
    /// range of the method's value type, a checksum that does not match.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let (header, data) = crate::safetensors_reader::read_header(bytes)?;
        let empty = HashMap::new();
        let meta = header.metadata().as_ref().unwrap_or(&empty);
        let get = |key: &str| {
            meta.get(key)
                .map(String::as_str)
                .ok_or_else(|| Error::checkpoint(format!("metadata entry `{key}` is missing")))
        };
        let format = get("format")?;
        if format != CHECKPOINT_FORMAT {
            return Err(Error::checkpoint(format!(
                "format `{format}` is not `{CHECKPOINT_FORMAT}`"
            )));
        }
        let version = get("version")?;
        if version == "1" && !meta.contains_key("crc32") {
            return Err(Error::checkpoint(
                "version 1 checkpoints carry no checksum and are not read (a corrupted residual \
                 would load); resume from the gradients, or save the residuals again with the \
                 build that wrote them",
            ));
        }
        if !["1", "2", CHECKPOINT_VERSION].contains(&version) {
            return Err(Error::checkpoint(format!(
                "version `{version}` is not supported (this build reads `1`, `2` and \
                 `{CHECKPOINT_VERSION}`)"
            )));
        }
        // Sorted, so that the error for a checkpoint with several bad residuals is always the
        // same one (the header's map has no order).
        let mut tensors: Vec<_> = header.tensors().into_iter().collect();
        tensors.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        // Version 3: the names whose residual has no shape (stored as `[n]`), in name order.
        let unshaped: Option<(&str, Vec<String>)> = if version == CHECKPOINT_VERSION {
            let text = get("unshaped")?;
            // At most every name of the file, each escaped as JSON may (6 bytes a character),
            // so that a hostile list costs no more than the names it could hold.
            // Counted before parsing too: no more entries than the file has residuals.
            let most: usize = 2 + tensors.iter().map(|(n, _)| 6 * n.len() + 3).sum::<usize>();
            let entries = crate::safetensors_reader::longest_array(text.as_bytes());
            let names: Vec<String> = (text.len() <= most && entries <= tensors.len().max(1))
                .then(|| serde_json::from_str(text).ok())
                .flatten()
                .filter(|names: &Vec<String>| names.windows(2).all(|w| w[0] < w[1]))
                .ok_or_else(|| {
                    Error::checkpoint(format!(
                        "metadata `unshaped` = `{}` is not a JSON array of the file's residual \
                         names in name order",
                        text.chars().take(100).collect::<String>()
                    ))
                })?;
            if let Some(name) = names
                .iter()
                .find(|n| tensors.binary_search_by(|(t, _)| t.cmp(n)).is_err())
            {
                return Err(Error::checkpoint(format!(
                    "metadata `unshaped` names `{name}`, which the file holds no residual for"
                )));
            }
            Some((text, names))
        } else {
            None
        };
        // An entry of a later version in an earlier one is a damaged version number (one bit
        // turns `3` into `1` or `2`), not a file to read without its checksum or shapes.
        for (key, older) in [("crc32", &["1"][..]), ("unshaped", &["1", "2"][..])] {
            if older.contains(&version) && meta.contains_key(key) {
                return Err(Error::checkpoint(format!(
                    "metadata entry `{key}` in a version {version} checkpoint (a damaged version \
                     number?)"
                )));
            }
        }
        let stored_crc = {
            let text = meta.get("crc32").ok_or_else(|| {
                Error::checkpoint(format!(
                    "metadata entry `crc32` is missing (version {version} checkpoints carry one)"
                ))
            })?;
            text.parse::<u32>().map_err(|_| {
                Error::checkpoint(format!("metadata `crc32` = `{text}` is not a u32"))
            })?
        };
        let method = method::parse(get("method")?)
            .map_err(|e| Error::checkpoint(format!("metadata `method`: {e}")))?;
        let number = |key: &str| -> Result<u64> {
            let s = get(key)?;
            s.parse::<u64>()
                .map_err(|_| Error::checkpoint(format!("metadata `{key}` = `{s}` is not a u64")))
        };
        let mut fb = ErrorFeedback::new(method, number("seed")?)
            .map_err(|e| Error::checkpoint(format!("metadata `method`: {e}")))?;
        fb.step = number("step")?;
        for (name, info) in tensors {
            let flat = match &unshaped {
                None => true,
                Some((_, names)) => names.binary_search(&name).is_ok(),
            };
            if info.dtype != Dtype::F32 || (flat && info.shape.len() != 1) {
                let expected = if flat { " with shape [n]" } else { "" };
                return Err(Error::checkpoint(format!(
                    "residual `{name}` is {:?} with shape {:?}, expected F32{expected}",
                    info.dtype, info.shape
                )));
            }
            if !flat {
                fb.shapes.insert(name.clone(), info.shape.clone());
            }
            // In range: `read_header` checked every offset against the data section.
            let (start, end) = info.data_offsets;
            let raw = data.get(start..end).ok_or_else(|| {
                Error::checkpoint(format!("residual `{name}` lies outside the file"))
            })?;
            let r: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(index) = gradwire_core::scalar::first_non_finite(&r) {
                return Err(Error::checkpoint(format!(
                    "residual `{name}` is NaN or infinite at index {index}"
                )));
            }
            if let Some(values) = fb.method.values()
                && let Some(index) = gradwire_core::values::first_out_of_range(values, &r)
            {
                return Err(Error::checkpoint(format!(
                    "residual `{name}` is {} at index {index}, beyond the range of the method's \
                     {values:?} values (every step that sends it would fail)",
                    r[index]
                )));
            }
            fb.residuals.insert(name, r);
        }
        {
            let stored = stored_crc;
            let texts = [get("method")?, get("seed")?, get("step")?];
            let computed = match &unshaped {
                // Version 2: no shapes.
                None => checkpoint_crc(&fb.residuals, None, &texts),
                Some((text, _)) => {
                    let [method, seed, step] = texts;
                    let texts = [method, seed, step, text];
                    checkpoint_crc(&fb.residuals, Some(&fb.shapes), &texts)
                }
            };
            if stored != computed {
                return Err(Error::checkpoint(format!(
                    "checksum mismatch (stored {stored}, computed {computed}): the file is \
                     corrupted"
                )));
            }
        }
        Ok(fb)
    }

    /// Writes the checkpoint to `path` (layout in the module docs).
    ///
    /// # Errors
    /// As [`ErrorFeedback::to_bytes`]; [`Error::Io`] naming the file when writing fails.
    pub(crate) fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })
    }

    /// Reads a checkpoint that [`ErrorFeedback::save`] wrote.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when reading fails; otherwise as
    /// [`ErrorFeedback::from_bytes`].
    pub(crate) fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }
}

/// The `crc32` of a checkpoint (layout in the module docs): with `shapes` (the remembered ones;
/// `[n]` for the others) as version 3 computes it, without as version 2 did.
fn checkpoint_crc(
    residuals: &BTreeMap<String, Vec<f32>>,
    shapes: Option<&BTreeMap<String, Vec<usize>>>,
    texts: &[&str],
) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for (name, r) in residuals {
        h.update(name.as_bytes());
        h.update(&[0]);
        if let Some(shapes) = shapes {
            let flat = [r.len()];
            let shape = shapes.get(name).map_or(&flat[..], Vec::as_slice);
            // Ranks and dimensions are far below u32 / u64 (safetensors checked the shape).
            h.update(&(shape.len() as u32).to_le_bytes());
            for &d in shape {
                h.update(&(d as u64).to_le_bytes());
            }
        }
        super::state_file::update_f32(&mut h, r);
    }
    for t in texts {
        h.update(t.as_bytes());
        h.update(&[0]);
    }
    h.finalize()
}

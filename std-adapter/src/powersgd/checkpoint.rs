//! PowerSGD checkpoints: [`PowerSgd::to_bytes`] and [`PowerSgd::from_bytes`]. `FORMAT.md`
//! section 16 is the normative specification.
//!
//! # Layout
//! A safetensors file with, for each tensor PowerSGD has state for, its `Q` as the F32 tensor
//! `q:<name>` of shape `[r, cols]` (column by column) and its error-feedback residual as
//! `residual:<name>` in the tensor's shape (each only where there is one), and these
//! `__metadata__` entries:
//!
//! | key | value |
//! |---|---|
//! | `format` | `gradwire-powersgd` |
//! | `version` | `1` |
//! | `config` | the configuration's text, e.g. `powersgd rank=4 start=0 min_rate=2 ef=true warm=true seed=7` |
//! | `step` | the next step to run, decimal |
//! | `shapes` | a compact JSON object of every tensor's name and shape, in name order |
//! | `crc32` | CRC-32 (IEEE), decimal, of: for each tensor in name order, its name, a 0 byte, the numbers of its `Q` and residual values (u64 little-endian each), then those values (f32 little-endian); then the `config`, `step` and `shapes` texts, each followed by a 0 byte |
//!
//! A restored rank continues bit for bit where the saved one stopped: its `Q`s (which every
//! rank shares), residuals and step are the saved ones.

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::Dtype;

use super::{PowerSgd, TensorState};
use crate::error::{Error, Result};

/// Value of the `format` metadata entry.
const FORMAT: &str = "gradwire-powersgd";
/// Value of the `version` metadata entry.
const VERSION: &str = "1";

impl PowerSgd {
    /// This rank's state as a safetensors checkpoint (layout in `FORMAT.md` section 16):
    /// the step, every tensor's `Q` and residual, the configuration's text.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a tensor whose name, prefixed, would be `__metadata__`, or
    /// whose shape has more dimensions than the safetensors reader takes;
    /// [`Error::Safetensors`] when serialization fails.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        if let Some((name, s)) = self
            .tensors
            .iter()
            .find(|(_, s)| s.shape.len() > crate::safetensors_reader::MAX_DIMS)
        {
            return Err(Error::checkpoint(format!(
                "tensor `{name}` has {} dimensions; a checkpoint holds at most {}",
                s.shape.len(),
                crate::safetensors_reader::MAX_DIMS
            )));
        }
        let shapes: BTreeMap<&str, &[usize]> = self
            .tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.shape.as_slice()))
            .collect();
        let shapes = serde_json::to_string(&shapes)
            .map_err(|e| Error::checkpoint(format!("cannot write `shapes`: {e}")))?;
        let (config, step) = (self.config.text(), self.step.to_string());
        let crc = state_crc(&self.tensors, &[&config, &step, &shapes]);
        let meta = HashMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("version".to_owned(), VERSION.to_owned()),
            ("config".to_owned(), config),
            ("step".to_owned(), step),
            ("shapes".to_owned(), shapes),
            ("crc32".to_owned(), crc.to_string()),
        ]);
        let r = self.config.rank;
        let mut names: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for (name, s) in &self.tensors {
            if !s.q.is_empty() {
                names.push((format!("q:{name}"), vec![r, s.q.len() / r], &s.q));
            }
            if !s.residual.is_empty() {
                names.push((format!("residual:{name}"), s.shape.clone(), &s.residual));
            }
        }
        crate::tensor::serialize_f32(
            names
                .iter()
                .map(|(n, shape, x)| (n.as_str(), shape.clone(), *x)),
            Some(meta),
        )
    }

    /// The rank [`PowerSgd::to_bytes`] saved, for a run with `config`.
    ///
    /// # Errors
    /// [`Error::Config`] as [`PowerSgd::new`]; [`Error::Safetensors`] for bytes that are not
    /// safetensors; [`Error::Checkpoint`] naming what is wrong: a missing or unknown `format`
    /// or `version`, a checkpoint written with another configuration (its text and `config`'s
    /// are both in the message), a `step` that is not a u64, `shapes` that is not a JSON
    /// object of names and shapes (at most 64 dimensions, a product that fits a `usize`), a
    /// tensor that is not F32, not named `q:` or `residual:` and one of `shapes`' names, or of
    /// another shape than its tensor gives (`[rank, cols]` for `Q`, which exists only for a
    /// tensor of two or more dimensions), a NaN or infinite value, a checksum that does not
    /// match.
    pub fn from_bytes(config: super::PowerSgdConfig, bytes: &[u8]) -> Result<PowerSgd> {
        let mut psgd = PowerSgd::new(config)?;
        let (header, data) = crate::safetensors_reader::read_header(bytes)?;
        let empty = HashMap::new();
        let meta = header.metadata().as_ref().unwrap_or(&empty);
        let get = |key: &str| {
            meta.get(key)
                .map(String::as_str)
                .ok_or_else(|| Error::checkpoint(format!("metadata entry `{key}` is missing")))
        };
        let format = get("format")?;
        if format != FORMAT {
            return Err(Error::checkpoint(format!(
                "format `{format}` is not `{FORMAT}`"
            )));
        }
        let version = get("version")?;
        if version != VERSION {
            return Err(Error::checkpoint(format!(
                "version `{version}` is not supported (this build reads `{VERSION}`)"
            )));
        }
        let (config_text, ours) = (get("config")?, psgd.config.text());
        if config_text != ours {
            return Err(Error::checkpoint(format!(
                "the checkpoint is of `{config_text}`, this run is `{ours}`"
            )));
        }
        let step_text = get("step")?;
        psgd.step = step_text.parse().map_err(|_| {
            Error::checkpoint(format!("metadata `step` = `{step_text}` is not a u64"))
        })?;
        let shapes_text = get("shapes")?;
        let shapes: BTreeMap<String, Vec<usize>> =
            serde_json::from_str(shapes_text).map_err(|e| {
                Error::checkpoint(format!(
                    "metadata `shapes` is not a JSON object of shapes: {e}"
                ))
            })?;
        for (name, shape) in shapes {
            if shape.len() > crate::safetensors_reader::MAX_DIMS
                || crate::tensor::numel(&shape).is_none()
            {
                return Err(Error::checkpoint(format!(
                    "metadata `shapes`: `{name}` has shape {shape:?} (at most {} dimensions \
                     whose product fits a usize)",
                    crate::safetensors_reader::MAX_DIMS
                )));
            }
            let state = TensorState {
                shape,
                q: Vec::new(),
                residual: Vec::new(),
            };
            psgd.tensors.insert(name, state);
        }
        let r = psgd.config.rank;
        for (key, info) in header.tensors() {
            let (kind, name) = key
                .split_once(':')
                .filter(|(kind, _)| ["q", "residual"].contains(kind))
                .ok_or_else(|| {
                    Error::checkpoint(format!(
                        "tensor `{key}` is neither `q:<name>` nor `residual:<name>`"
                    ))
                })?;
            let state = psgd.tensors.get_mut(name).ok_or_else(|| {
                Error::checkpoint(format!("tensor `{key}`: `{name}` is not in `shapes`"))
            })?;
            let rows = state.shape.first().copied().unwrap_or(0);
            let n = crate::tensor::numel(&state.shape).unwrap_or(0);
            let expected = if kind == "q" {
                (state.shape.len() >= 2 && rows > 0).then(|| vec![r, n / rows])
            } else {
                Some(state.shape.clone())
            };
            if info.dtype != Dtype::F32 || expected.as_ref() != Some(&info.shape) {
                return Err(Error::checkpoint(format!(
                    "tensor `{key}` is {:?} with shape {:?}, expected F32 with shape {}",
                    info.dtype,
                    info.shape,
                    expected.map_or("none (no Q for this shape)".into(), |s| format!("{s:?}"))
                )));
            }
            // In range: `read_header` checked every offset against the data section.
            let (start, end) = info.data_offsets;
            let raw = data.get(start..end).ok_or_else(|| {
                Error::checkpoint(format!("tensor `{key}` lies outside the file"))
            })?;
            let values: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(index) = gradwire_core::values::first_non_finite(&values) {
                return Err(Error::checkpoint(format!(
                    "tensor `{key}` is NaN or infinite at index {index}"
                )));
            }
            if kind == "q" {
                state.q = values;
            } else {
                state.residual = values;
            }
        }
        let stored = get("crc32")?;
        let computed = state_crc(&psgd.tensors, &[config_text, step_text, shapes_text]);
        if stored.parse::<u32>().ok() != Some(computed) {
            return Err(Error::checkpoint(format!(
                "checksum mismatch (stored `{stored}`, computed {computed}): the file is \
                 corrupted"
            )));
        }
        Ok(psgd)
    }
}

/// The `crc32` entry (layout in the module docs).
fn state_crc(tensors: &BTreeMap<String, TensorState>, texts: &[&str]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut buf = [0u8; 4096];
    for (name, s) in tensors {
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(&(s.q.len() as u64).to_le_bytes());
        h.update(&(s.residual.len() as u64).to_le_bytes());
        for run in
            s.q.chunks(buf.len() / 4)
                .chain(s.residual.chunks(buf.len() / 4))
        {
            for (b, x) in buf.chunks_exact_mut(4).zip(run) {
                b.copy_from_slice(&x.to_le_bytes());
            }
            h.update(&buf[..4 * run.len()]);
        }
    }
    for t in texts {
        h.update(t.as_bytes());
        h.update(&[0]);
    }
    h.finalize()
}

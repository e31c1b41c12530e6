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
//! | `crc32` | the state file's checksum (`FORMAT.md` section 17) |
//!
//! A restored rank continues bit for bit where the saved one stopped: its `Q`s (which every
//! rank shares), residuals and step are the saved ones.

use std::collections::BTreeMap;

use super::{PowerSgd, TensorState};
use crate::error::{Error, Result};
use crate::feedback::state_file;

/// Value of the `format` metadata entry.
const FORMAT: &str = "gradwire-powersgd";
/// Value of the `version` metadata entry.
const VERSION: &str = "1";

impl PowerSgd {
    /// This rank's state as a safetensors checkpoint (layout in `FORMAT.md` section 16):
    /// the step, every tensor's `Q` and residual, the configuration's text.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a tensor whose shape has more dimensions than the safetensors
    /// reader takes; [`Error::Safetensors`] when serialization fails.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let shapes: BTreeMap<&str, &[usize]> = self
            .tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.shape.as_slice()))
            .collect();
        let shapes = serde_json::to_string(&shapes)
            .map_err(|e| Error::checkpoint(format!("cannot write `shapes`: {e}")))?;
        let entries = BTreeMap::from([
            ("config".to_owned(), self.config.text()),
            ("step".to_owned(), self.step.to_string()),
            ("shapes".to_owned(), shapes),
        ]);
        let r = self.config.rank;
        let mut tensors: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for (name, s) in &self.tensors {
            if !s.q.is_empty() {
                tensors.push((format!("q:{name}"), vec![r, s.q.len() / r], &s.q));
            }
            if !s.residual.is_empty() {
                tensors.push((format!("residual:{name}"), s.shape.clone(), &s.residual));
            }
        }
        state_file::write(FORMAT, VERSION, &entries, &tensors)
    }

    /// The rank [`PowerSgd::to_bytes`] saved, for a run with `config`.
    ///
    /// # Errors
    /// [`Error::Config`] as [`PowerSgd::new`]; [`Error::Safetensors`] for bytes that are not
    /// safetensors; [`Error::Checkpoint`] naming what is wrong: what `FORMAT.md` section 17
    /// refuses in any state file (format, version, checksum, dtype, NaN or infinity), a
    /// checkpoint written with another configuration (its text and `config`'s are both in
    /// the message), a `step` that is not a u64, `shapes` that is not a JSON object of names
    /// and shapes (at most 64 dimensions, a product that fits a `usize`), a tensor not named
    /// `q:` or `residual:` and one of `shapes`' names, or of another shape than its tensor
    /// gives (`[rank, cols]` for `Q`, which exists only for a tensor of two or more
    /// dimensions).
    pub fn from_bytes(config: super::PowerSgdConfig, bytes: &[u8]) -> Result<PowerSgd> {
        let mut psgd = PowerSgd::new(config)?;
        let file = state_file::read(bytes, FORMAT, VERSION)?;
        let (config_text, ours) = (file.entry("config")?, psgd.config.text());
        if config_text != ours {
            return Err(Error::checkpoint(format!(
                "the checkpoint is of `{config_text}`, this run is `{ours}`"
            )));
        }
        psgd.step = crate::feedback::state_file::checked_step(file.number("step")?)?;
        let shapes: BTreeMap<String, Vec<usize>> = serde_json::from_str(file.entry("shapes")?)
            .map_err(|e| {
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
        for (key, (shape, values)) in file.tensors {
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
            if expected.as_ref() != Some(&shape) {
                return Err(Error::checkpoint(format!(
                    "tensor `{key}` has shape {shape:?}, expected {}",
                    expected.map_or("none (no Q for this shape)".into(), |s| format!("{s:?}"))
                )));
            }
            if kind == "q" {
                state.q = values;
            } else {
                state.residual = values;
            }
        }
        Ok(psgd)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PowerSgd, PowerSgdConfig};
    use crate::feedback::state_file::tests::refused_as_the_last_step;

    /// Issue 48 class 4: a PowerSGD checkpoint of step `u64::MAX` (valid checksums) would wrap
    /// to step 0; it is refused, `u64::MAX - 1` is taken.
    #[test]
    fn a_checkpoint_with_no_step_after_its_own_is_refused() {
        for (step, ok) in [(u64::MAX, false), (u64::MAX - 1, true)] {
            let mut psgd = PowerSgd::new(PowerSgdConfig::default()).unwrap();
            psgd.step = step;
            let bytes = psgd.to_bytes().unwrap();
            let loaded = PowerSgd::from_bytes(PowerSgdConfig::default(), &bytes);
            if ok {
                loaded.unwrap();
            } else {
                refused_as_the_last_step(loaded);
            }
        }
    }
}

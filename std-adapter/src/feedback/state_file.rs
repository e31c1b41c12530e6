//! The checkpoint file of a stateful method (PowerSGD, DGC): named F32 tensors and text
//! entries in one safetensors file, with a CRC-32 over all of it (`FORMAT.md` section 17). The
//! methods decide what the names mean and check the shapes; this module checks the rest.

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::Dtype;

use crate::error::{Error, Result};

/// A state file's contents: its text entries (without `format`, `version` and `crc32`) and its
/// tensors, by name.
#[derive(Debug, Default)]
pub(crate) struct StateFile {
    pub(crate) entries: BTreeMap<String, String>,
    pub(crate) tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

/// Entries every state file has, which callers may not set.
const OWN: [&str; 3] = ["crc32", "format", "version"];

/// The bytes of a state file of `format` and `version` with `entries` and `tensors` (name,
/// shape, values; names unique).
///
/// # Errors
/// [`Error::Checkpoint`] for an entry of [`OWN`], a tensor named `__metadata__` or one with
/// more dimensions than the safetensors reader takes; [`Error::Safetensors`] when
/// serialization fails.
pub(crate) fn write(
    format: &str,
    version: &str,
    entries: &BTreeMap<String, String>,
    tensors: &[(String, Vec<usize>, &[f32])],
) -> Result<Vec<u8>> {
    if let Some(key) = entries.keys().find(|k| OWN.contains(&k.as_str())) {
        return Err(Error::checkpoint(format!("entry `{key}` is reserved")));
    }
    if let Some((name, shape, _)) = tensors
        .iter()
        .find(|(n, s, _)| n == "__metadata__" || s.len() > crate::safetensors_reader::MAX_DIMS)
    {
        return Err(Error::checkpoint(format!(
            "tensor `{name}` (shape {shape:?}) cannot be stored: the name is reserved or the \
             shape has more than {} dimensions",
            crate::safetensors_reader::MAX_DIMS
        )));
    }
    let mut meta: BTreeMap<String, String> = entries.clone();
    meta.insert("format".into(), format.into());
    meta.insert("version".into(), version.into());
    let sorted: BTreeMap<&str, (&[usize], &[f32])> = tensors
        .iter()
        .map(|(n, s, x)| (n.as_str(), (s.as_slice(), *x)))
        .collect();
    let crc = crc_of(&meta, sorted.iter().map(|(n, (s, x))| (*n, *s, *x)));
    meta.insert("crc32".into(), crc.to_string());
    crate::tensor::serialize_f32(
        tensors.iter().map(|(n, s, x)| (n.as_str(), s.clone(), *x)),
        Some(meta.into_iter().collect::<HashMap<_, _>>()),
    )
}

/// Reads a state file that [`write`] wrote with `format` and `version`.
///
/// # Errors
/// [`Error::Safetensors`] for bytes that are not safetensors; [`Error::Checkpoint`] for another
/// or a missing `format` or `version`, a missing or wrong `crc32`, a tensor that is not F32,
/// a NaN or infinite value (naming the tensor and index).
pub(crate) fn read(bytes: &[u8], format: &str, version: &str) -> Result<StateFile> {
    let (header, data) = crate::safetensors_reader::read_header(bytes)?;
    let empty = HashMap::new();
    let meta = header.metadata().as_ref().unwrap_or(&empty);
    let get = |key: &str| {
        meta.get(key)
            .map(String::as_str)
            .ok_or_else(|| Error::checkpoint(format!("metadata entry `{key}` is missing")))
    };
    for (key, want) in [("format", format), ("version", version)] {
        let got = get(key)?;
        if got != want {
            return Err(Error::checkpoint(format!(
                "{key} `{got}` is not `{want}` (this build reads `{format}` version `{version}`)"
            )));
        }
    }
    let stored = get("crc32")?;
    let mut file = StateFile::default();
    for (name, info) in header.tensors() {
        if info.dtype != Dtype::F32 {
            return Err(Error::checkpoint(format!(
                "tensor `{name}` is {:?}, expected F32",
                info.dtype
            )));
        }
        // In range: `read_header` checked every offset against the data section.
        let (start, end) = info.data_offsets;
        let raw = data
            .get(start..end)
            .ok_or_else(|| Error::checkpoint(format!("tensor `{name}` lies outside the file")))?;
        let values: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(index) = gradwire_core::values::first_non_finite(&values) {
            return Err(Error::checkpoint(format!(
                "tensor `{name}` is NaN or infinite at index {index}"
            )));
        }
        file.tensors.insert(name, (info.shape.clone(), values));
    }
    let covered: BTreeMap<String, String> = meta
        .iter()
        .filter(|(k, _)| k.as_str() != "crc32")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let computed = crc_of(
        &covered,
        file.tensors
            .iter()
            .map(|(n, (s, x))| (n.as_str(), s.as_slice(), x.as_slice())),
    );
    // The decimal text `write` gives, exactly: no sign, no leading zeros.
    if stored != computed.to_string() {
        return Err(Error::checkpoint(format!(
            "checksum mismatch (stored `{stored}`, computed {computed}): the file is corrupted"
        )));
    }
    file.entries = covered;
    file.entries.remove("format");
    file.entries.remove("version");
    Ok(file)
}

impl StateFile {
    /// The text entry `key`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when it is missing.
    pub(crate) fn entry(&self, key: &str) -> Result<&str> {
        self.entries
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| Error::checkpoint(format!("metadata entry `{key}` is missing")))
    }

    /// The entry `key` as a u64.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when it is missing or not a decimal u64.
    pub(crate) fn number(&self, key: &str) -> Result<u64> {
        let text = self.entry(key)?;
        text.parse()
            .map_err(|_| Error::checkpoint(format!("metadata `{key}` = `{text}` is not a u64")))
    }
}

/// A checkpoint's `step`, the step its run takes next: `u64::MAX` is refused, since the step
/// after it would wrap to 0 and repeat step 0's draws (random-k, stochastic rounding, `Q`).
///
/// # Errors
/// [`Error::Checkpoint`] for `u64::MAX`.
pub(crate) fn checked_step(step: u64) -> Result<u64> {
    if step == u64::MAX {
        return Err(Error::checkpoint(format!(
            "metadata `step` = `{step}`: no step can follow it (it would wrap to 0)"
        )));
    }
    Ok(step)
}

/// CRC-32 (IEEE) of: each entry in key order (key, 0, value, 0), then each tensor in name order
/// (name, 0, dimensions as u32 LE, each dimension as u64 LE, values as f32 LE).
fn crc_of<'a>(
    entries: &BTreeMap<String, String>,
    tensors: impl Iterator<Item = (&'a str, &'a [usize], &'a [f32])>,
) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for (k, v) in entries {
        for part in [k.as_bytes(), &[0], v.as_bytes(), &[0]] {
            h.update(part);
        }
    }
    for (name, shape, values) in tensors {
        h.update(name.as_bytes());
        h.update(&[0]);
        // Dimensions and their count are far below u32 / u64 (safetensors checked the shape).
        h.update(&(shape.len() as u32).to_le_bytes());
        for &d in shape {
            h.update(&(d as u64).to_le_bytes());
        }
        update_f32(&mut h, values);
    }
    h.finalize()
}

/// Adds `values` as f32 little-endian bytes to `h`, through a stack buffer.
pub(crate) fn update_f32(h: &mut crc32fast::Hasher, values: &[f32]) {
    let mut buf = [0u8; 4096];
    for run in values.chunks(buf.len() / 4) {
        for (b, x) in buf.chunks_exact_mut(4).zip(run) {
            b.copy_from_slice(&x.to_le_bytes());
        }
        h.update(&buf[..4 * run.len()]);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::error::Error;
    use crate::feedback::ErrorFeedback;

    /// The refusal of a step with no step after it, for the tests of every state file.
    pub(crate) fn refused_as_the_last_step<T: std::fmt::Debug>(r: Result<T, Error>) {
        match r {
            Err(Error::Checkpoint { reason }) => assert!(reason.contains("wrap to 0"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    /// Issue 48 class 4: a checkpoint whose step is `u64::MAX` (valid checksums) would wrap to
    /// step 0 after one step; an error-feedback checkpoint refuses it and takes `u64::MAX - 1`
    /// (DGC and PowerSGD checkpoints: their own tests).
    #[test]
    fn a_feedback_checkpoint_with_no_step_after_its_own_is_refused() {
        for (step, ok) in [(u64::MAX, false), (u64::MAX - 1, true)] {
            let dir = std::env::temp_dir().join(format!("gw-step-{}-{ok}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("fb.safetensors");
            let method = gradwire_core::Method::Dense {
                values: gradwire_core::Values::F16,
            };
            let mut fb = ErrorFeedback::new(method, 1).unwrap();
            fb.set_step(step);
            fb.save(&path).unwrap();
            let loaded = ErrorFeedback::load(&path);
            std::fs::remove_dir_all(&dir).unwrap();
            if ok {
                loaded.unwrap();
            } else {
                refused_as_the_last_step(loaded);
            }
        }
    }
}

//! Files: reading inputs, float32 safetensors models, and atomic writes (a temporary file in the
//! same directory, renamed over the target), so that a failure never leaves a half-written
//! output or state file.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use gradwire::tensor::Tensor;

use crate::CliError;

/// Reads a whole file, naming it in the error.
pub fn read(path: &Path) -> Result<Vec<u8>, CliError> {
    fs::read(path).map_err(|e| CliError::io("cannot read", path, &e))
}

/// A model's tensors: `(name, tensor)` sorted by name.
pub type Model = Vec<(String, Tensor)>;

/// `path: what: ` followed by the safetensors error with its hint
/// ([`gradwire::safetensors_reader::describe`]).
pub fn safetensors_error(path: &Path, what: &str, e: &safetensors::SafeTensorError) -> CliError {
    CliError::new(format!(
        "{}: {what}: {}",
        path.display(),
        gradwire::safetensors_reader::describe(e)
    ))
}

/// Parses a safetensors file of float32 tensors (a gradient or a model), sorted by name
/// ([`gradwire::tensor::read_safetensors`]).
pub fn parse_model(path: &Path, bytes: &[u8]) -> Result<Model, CliError> {
    if super::container::is_container(bytes) {
        return Err(CliError::new(format!(
            "{}: a gradwire container, not a safetensors file of float32 tensors (decompress it \
             first)",
            path.display()
        )));
    }
    gradwire::tensor::read_safetensors(bytes).map_err(|e| match e {
        gradwire::Error::Safetensors { source } => {
            safetensors_error(path, "not a valid safetensors file", &source)
        }
        other => CliError::new(format!("{}: {other}", path.display())),
    })
}

/// Names and shapes of every tensor of a safetensors file (any dtype), sorted by name: what a
/// receiver knows about its model.
pub fn parse_shapes(path: &Path, bytes: &[u8]) -> Result<Vec<(String, Vec<usize>)>, CliError> {
    let st = gradwire::safetensors_reader::deserialize(bytes)
        .map_err(|e| safetensors_error(path, "not a valid safetensors file", &e))?;
    let mut shapes: Vec<(String, Vec<usize>)> = st
        .iter()
        .map(|(name, view)| (name.to_owned(), view.shape().to_vec()))
        .collect();
    shapes.sort();
    Ok(shapes)
}

/// Serializes tensors as a float32 safetensors file
/// ([`gradwire::tensor::write_safetensors`]).
pub fn model_bytes(model: &[(String, Tensor)]) -> Result<Vec<u8>, CliError> {
    gradwire::tensor::write_safetensors(model)
        .map_err(|e| CliError::new(format!("cannot serialize safetensors: {e}")))
}

/// A file written next to its target, not yet renamed over it. Dropping it removes it.
pub struct Staged {
    temp: PathBuf,
    target: PathBuf,
    done: bool,
}

impl Staged {
    /// Renames the temporary file over the target.
    pub fn commit(mut self) -> Result<(), CliError> {
        fs::rename(&self.temp, &self.target)
            .map_err(|e| CliError::io("cannot write", &self.target, &e))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            // Best effort: the temporary file is ours and incomplete or unwanted.
            let _ = fs::remove_file(&self.temp);
        }
    }
}

/// Writes `bytes` to a new temporary file in the directory of `target` (flushed to disk), to be
/// renamed over `target` by [`Staged::commit`].
pub fn stage(target: &Path, bytes: &[u8]) -> Result<Staged, CliError> {
    stage_with(target, |file| {
        file.write_all(bytes)
            .map_err(|e| CliError::io("cannot write", target, &e))
    })
}

/// A new temporary file in the directory of `target`, filled by `fill` (which may write it in
/// pieces and seek over runs of zeros: the file is new, so a hole reads as zeros), flushed to
/// disk, to be renamed over `target` by [`Staged::commit`].
///
/// When `target` exists, the temporary file gets its permissions (a `0600` state stays `0600`):
/// on Unix it is created `0600` and widened to the target's mode only then, so the new contents
/// are never readable by more users than the old. A new target gets the default mode (umask).
/// Owner and group are not copied (a rename cannot keep them when another user runs the tool).
pub fn stage_with(
    target: &Path,
    fill: impl FnOnce(&mut File) -> Result<(), CliError>,
) -> Result<Staged, CliError> {
    let file_name = target
        .file_name()
        .ok_or_else(|| CliError::new(format!("{}: not a file name", target.display())))?;
    if target.is_dir() {
        return Err(CliError::new(format!(
            "cannot write {}: is a directory",
            target.display()
        )));
    }
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // The permissions to keep: those of the file being replaced.
    let keep = fs::metadata(target)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.permissions());
    let mut attempt = 0u32;
    let (temp, mut file) = loop {
        let mut name = std::ffi::OsString::from(".");
        name.push(file_name);
        name.push(format!(".gradwire-tmp-{}-{attempt}", std::process::id()));
        let temp = dir.join(name);
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        if keep.is_some() {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        match options.open(&temp) {
            Ok(f) => break (temp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => {
                attempt += 1;
            }
            Err(e) => return Err(CliError::io("cannot write", target, &e)),
        }
    };
    let staged = Staged {
        temp,
        target: target.to_path_buf(),
        done: false,
    };
    if let Some(perms) = keep {
        file.set_permissions(perms)
            .map_err(|e| CliError::io("cannot write", target, &e))?;
    }
    fill(&mut file)?;
    file.sync_all()
        .map_err(|e| CliError::io("cannot write", target, &e))?;
    Ok(staged)
}

/// Writes every `(target, bytes)` atomically: all temporary files first, then the renames, so
/// a failure while writing leaves every target as it was.
pub fn write_all_atomic(files: &[(&Path, &[u8])]) -> Result<(), CliError> {
    let staged = files
        .iter()
        .map(|(target, bytes)| stage(target, bytes))
        .collect::<Result<Vec<_>, _>>()?;
    for s in staged {
        s.commit()?;
    }
    Ok(())
}

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
//! Every residual value must be finite. One beyond the method's value type (f16 values: beyond
//! 65504) is read: a step sends that coordinate saturated and keeps the rest, as the step that
//! left it did.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

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
        let mut out = Vec::new();
        self.write_to(&mut out, extra, &|source| in_memory(source))?;
        Ok(out)
    }

    /// Writes the checkpoint with `extra` metadata entries to `out`: the header, then each
    /// residual converted 64 KiB at a time (nothing of the residuals' size is allocated).
    ///
    /// # Errors
    /// As [`ErrorFeedback::to_bytes_with_metadata`]; `on_io` of the writer's error.
    pub(crate) fn write_to(
        &self,
        out: &mut impl Write,
        extra: &[(&str, &str)],
        on_io: &dyn Fn(std::io::Error) -> Error,
    ) -> Result<()> {
        let residuals: Vec<Stored<'_>> = self
            .residuals
            .iter()
            .map(|(name, values)| Stored {
                name,
                shape: self.shapes.get(name).map(Vec::as_slice),
                values,
            })
            .collect();
        write_checkpoint(
            out,
            (&self.method, self.seed, self.step),
            &residuals,
            extra,
            on_io,
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
    /// `unshaped` residual that is not 1-d, a NaN or infinite residual value, a checksum that
    /// does not match.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Self::read_from(
            &mut std::io::Cursor::new(bytes),
            bytes.len() as u64,
            &|source| in_memory(source),
            |_| Ok(()),
        )
    }

    /// Reads a checkpoint of `len` bytes from the start of `input`: the header first (its
    /// length against `len`, its entries; `check` sees the metadata before any residual is
    /// read), then one residual at a time through a 64 KiB buffer, each checked as it comes.
    /// What it allocates is the residuals' size, bounded by `len`, and the header's.
    ///
    /// # Errors
    /// As [`ErrorFeedback::from_bytes`]; `check`'s error; `on_io` of the reader's error.
    pub(crate) fn read_from<R: Read + Seek>(
        input: &mut R,
        len: u64,
        on_io: &dyn Fn(std::io::Error) -> Error,
        check: impl FnOnce(&HashMap<String, String>) -> Result<()>,
    ) -> Result<Self> {
        let (header, data_start) = crate::safetensors_reader::read_header_from(input, len)
            .map_err(|e| match e {
                safetensors::SafeTensorError::IoError(source) => on_io(source),
                source => Error::Safetensors { source },
            })?;
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
        fb.step = super::state_file::checked_step(number("step")?)?;
        let texts = [get("method")?, get("seed")?, get("step")?];
        // Every entry is known good: the caller's check, then the bodies.
        check(meta)?;
        let mut crc = crc32fast::Hasher::new();
        // No larger than the data section: a small file costs little.
        let data_len = usize::try_from(len - data_start).unwrap_or(usize::MAX);
        let mut block = vec![0u8; (4 * READ_BLOCK).min(data_len)];
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
            crc.update(name.as_bytes());
            crc.update(&[0]);
            if unshaped.is_some() {
                // Version 3 hashes the stored shape (`[n]` for an unshaped residual).
                // Dimensions and their count are far below u32 / u64 (safetensors checked it).
                crc.update(&(info.shape.len() as u32).to_le_bytes());
                for &d in &info.shape {
                    crc.update(&(d as u64).to_le_bytes());
                }
            }
            if !flat {
                fb.shapes.insert(name.clone(), info.shape.clone());
            }
            // Within the file: `read_header_from` checked every offset against its length.
            let (start, end) = info.data_offsets;
            input
                .seek(SeekFrom::Start(data_start + start as u64))
                .map_err(on_io)?;
            let elements = (end - start) / 4;
            // Bounded by the file's length, and refused rather than aborting when it cannot be
            // had (a sparse file can claim far more than memory).
            let mut r: Vec<f32> = Vec::new();
            r.try_reserve_exact(elements)
                .map_err(|_| Error::OutOfMemory {
                    tensor: name.clone(),
                    elements,
                })?;
            // Any finite value loads (one beyond the value type is what a saturated step leaves).
            while r.len() < elements {
                let count = READ_BLOCK.min(elements - r.len());
                let bytes = &mut block[..4 * count];
                input.read_exact(bytes).map_err(on_io)?;
                crc.update(bytes);
                let at = r.len();
                r.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
                let got = &r[at..];
                if let Some(index) = gradwire_core::scalar::first_non_finite(got) {
                    return Err(Error::checkpoint(format!(
                        "residual `{name}` is NaN or infinite at index {}",
                        at + index
                    )));
                }
            }
            fb.residuals.insert(name, r);
        }
        let unshaped_text = unshaped.as_ref().map(|(text, _)| *text);
        for text in texts.iter().copied().chain(unshaped_text) {
            crc.update(text.as_bytes());
            crc.update(&[0]);
        }
        let computed = crc.finalize();
        if stored_crc != computed {
            return Err(Error::checkpoint(format!(
                "checksum mismatch (stored {stored_crc}, computed {computed}): the file is \
                 corrupted"
            )));
        }
        Ok(fb)
    }

    /// Writes the checkpoint to `path` (layout in the module docs) as [`write_replacing`]
    /// writes files.
    ///
    /// # Errors
    /// As [`ErrorFeedback::to_bytes`] and [`write_replacing`].
    pub(crate) fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        write_replacing(path.as_ref(), |out, on_io| self.write_to(out, &[], on_io))
    }

    /// Reads the checkpoint file at `path` (what [`ErrorFeedback::to_bytes`] writes, or
    /// [`crate::GradientCompressor::save_feedback`]) as [`ErrorFeedback::from_bytes`] reads
    /// bytes, without reading the file whole: the header is read and checked against the
    /// file's length first, then one residual at a time through a 64 KiB buffer. Memory: the
    /// residuals and the header.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when opening or reading fails; [`Error::Checkpoint`] for a
    /// path that is not a regular file (a FIFO or a device: its length is not known before
    /// reading); [`Error::OutOfMemory`] naming a residual whose memory cannot be had (a sparse
    /// file can claim more than the machine holds); otherwise as [`ErrorFeedback::from_bytes`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (mut file, len) = open_regular(path)?;
        Self::read_from(&mut file, len, &io_error(path), |_| Ok(()))
    }

    /// The residuals, by name, taking them out of the state.
    pub(crate) fn into_residuals(self) -> impl Iterator<Item = (String, Vec<f32>)> {
        self.residuals.into_iter()
    }
}

/// Elements read at a time by [`ErrorFeedback::read_from`] (64 KiB of bytes).
const READ_BLOCK: usize = 16 * 1024;

/// A residual as a checkpoint stores it: its name, the shape it remembers (`None`: stored as
/// `[n]` and listed in `unshaped`) and its values.
pub(crate) struct Stored<'a> {
    pub(crate) name: &'a str,
    pub(crate) shape: Option<&'a [usize]>,
    pub(crate) values: &'a [f32],
}

/// Writes a checkpoint (layout in the module docs) of `residuals` (in increasing byte-wise
/// order of names, each once) made with `(method, seed, step)`, with `extra` metadata entries,
/// to `out`: the checksum first (one read of the residuals), then the header, then the values
/// 64 KiB at a time.
///
/// # Errors
/// [`Error::Checkpoint`] for a residual named `__metadata__`, one whose shape has more than 64
/// dimensions, an extra key the checkpoint uses itself or one given twice; `on_io` of the
/// writer's error.
pub(crate) fn write_checkpoint(
    out: &mut impl Write,
    (method, seed, step): (&gradwire_core::Method, u64, u64),
    residuals: &[Stored<'_>],
    extra: &[(&str, &str)],
    on_io: &dyn Fn(std::io::Error) -> Error,
) -> Result<()> {
    const OWN: [&str; 7] = [
        "crc32", "format", "method", "seed", "step", "unshaped", "version",
    ];
    debug_assert!(residuals.windows(2).all(|w| w[0].name < w[1].name));
    if residuals.iter().any(|r| r.name == "__metadata__") {
        return Err(Error::checkpoint(
            "a tensor named `__metadata__` cannot be stored in safetensors",
        ));
    }
    if let Some(r) = residuals.iter().find(|r| {
        r.shape
            .is_some_and(|s| s.len() > crate::safetensors_reader::MAX_DIMS)
    }) {
        return Err(Error::checkpoint(format!(
            "residual `{}` has {} dimensions; a checkpoint holds at most {}",
            r.name,
            r.shape.map_or(1, <[usize]>::len),
            crate::safetensors_reader::MAX_DIMS
        )));
    }
    let lens: Vec<[usize; 1]> = residuals.iter().map(|r| [r.values.len()]).collect();
    let shapes: Vec<&[usize]> = residuals
        .iter()
        .zip(&lens)
        .map(|(r, n)| r.shape.unwrap_or(n))
        .collect();
    // The header's offsets come from the shapes, the data from the values: they must agree, or
    // the file would not load.
    if let Some((r, shape)) = residuals
        .iter()
        .zip(&shapes)
        .find(|(r, s)| crate::tensor::numel(s) != Some(r.values.len()))
    {
        return Err(Error::checkpoint(format!(
            "residual `{}` has {} values, its shape {shape:?} another count",
            r.name,
            r.values.len()
        )));
    }
    let method = method::format(method);
    let (seed, step) = (seed.to_string(), step.to_string());
    let unshaped: Vec<&str> = residuals
        .iter()
        .filter(|r| r.shape.is_none())
        .map(|r| r.name)
        .collect();
    let unshaped = serde_json::to_string(&unshaped)
        .map_err(|e| Error::checkpoint(format!("cannot write `unshaped`: {e}")))?;
    let mut crc = crc32fast::Hasher::new();
    for (r, shape) in residuals.iter().zip(&shapes) {
        crc.update(r.name.as_bytes());
        crc.update(&[0]);
        crc.update(&(shape.len() as u32).to_le_bytes());
        for &d in *shape {
            crc.update(&(d as u64).to_le_bytes());
        }
        super::state_file::update_f32(&mut crc, r.values);
    }
    for text in [&method, &seed, &step, &unshaped] {
        crc.update(text.as_bytes());
        crc.update(&[0]);
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_owned(), CHECKPOINT_FORMAT.to_owned());
    meta.insert("version".to_owned(), CHECKPOINT_VERSION.to_owned());
    meta.insert("crc32".to_owned(), crc.finalize().to_string());
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
    let header = crate::tensor::f32_safetensors_header(
        residuals.iter().zip(&shapes).map(|(r, s)| (r.name, *s)),
        Some(meta),
    )?;
    out.write_all(&header).map_err(on_io)?;
    for r in residuals {
        crate::tensor::write_f32_le(out, r.values).map_err(on_io)?;
    }
    Ok(())
}

/// The error of writing to or reading from memory, which cannot happen (lengths are checked
/// first); named rather than unwrapped.
fn in_memory(source: std::io::Error) -> Error {
    Error::checkpoint(format!("reading or writing in memory: {source}"))
}

/// [`Error::Io`] naming `path`.
pub(crate) fn io_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Opens `path` for reading a checkpoint and returns it with its length.
///
/// # Errors
/// [`Error::Io`] naming the file when it cannot be opened; [`Error::Checkpoint`] for a path that
/// is not a regular file (a FIFO, a device, a directory): a checkpoint's length is known before
/// anything of it is read.
pub(crate) fn open_regular(path: &Path) -> Result<(File, u64)> {
    // Looked at before opening, so that a device is never opened (opening some has effects);
    // then opened without blocking (opening a FIFO to read blocks until someone writes to it,
    // and the path may have become one since) and looked at again on the handle, which is
    // what is read: nothing is read from a file that is not regular.
    if !std::fs::metadata(path).map_err(io_error(path))?.is_file() {
        return Err(not_regular(path));
    }
    open_checked(path)
}

/// [`Error::Checkpoint`]: `path` is not a regular file.
fn not_regular(path: &Path) -> Error {
    Error::checkpoint(format!("{} is not a regular file", path.display()))
}

/// Opens `path` without blocking and returns it with its length if the handle is a regular
/// file (see [`open_regular`], which looks at the path first).
///
/// # Errors
/// As [`open_regular`].
fn open_checked(path: &Path) -> Result<(File, u64)> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Reads of a regular file do not block whatever the flag says (POSIX), so it stays (a
        // FUSE file system that honours it for regular files would answer `WouldBlock`,
        // which the readers report as an I/O error; clearing it would take an `fcntl` call).
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io_error(path))?;
    let meta = file.metadata().map_err(io_error(path))?;
    if !meta.is_file() {
        return Err(not_regular(path));
    }
    Ok((file, meta.len()))
}

/// Writes a file through `write` into a new file beside `path` (`path` with
/// `.partial-<pid>-<count>` appended, created new: never an existing file or a link), then
/// renames it over `path`: a failed save leaves the file that was there (a process killed
/// mid-save leaves its partial file too). Buffered 1 MiB at a time; not synced to disk (a caller
/// that needs the file to survive a power loss syncs it). `path` itself is replaced: a link
/// there becomes a regular file, and the old file's mode is not kept.
///
/// # Errors
/// [`Error::Checkpoint`] for a `path` that exists and is not a regular file (writing through a
/// rename would replace a FIFO or a device); [`Error::Io`] naming `path` when creating, writing
/// or renaming fails (the partial file is removed); `write`'s error.
pub(crate) fn write_replacing(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>, &dyn Fn(std::io::Error) -> Error) -> Result<()>,
) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(path)
        && !meta.is_file()
    {
        return Err(Error::checkpoint(format!(
            "{} exists and is not a regular file: not replaced",
            path.display()
        )));
    }
    // A name no other save of this process uses at the same time, made new (never an existing
    // file or a link planted there).
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let save = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut partial = path.as_os_str().to_owned();
    partial.push(format!(".partial-{}-{save}", std::process::id()));
    let partial = PathBuf::from(partial);
    let file = File::options()
        .write(true)
        .create_new(true)
        .open(&partial)
        .map_err(io_error(path))?;
    let result = (|| {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        write(&mut out, &io_error(path))?;
        out.flush().map_err(io_error(path))?;
        drop(out);
        std::fs::rename(&partial, path).map_err(io_error(path))
    })();
    if result.is_err() {
        // Best effort: the error that matters is the one returned.
        let _ = std::fs::remove_file(&partial);
    }
    result
}

#[cfg(all(test, target_os = "linux"))]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};

    /// Runs `f` on a thread of its own and returns its result with the bytes that thread read
    /// (`rchar` of `/proc/thread-self/io`: every `read` call's bytes, whatever the file; give or
    /// take a byte of the counter's own reads; `f` must read on this thread, not through other
    /// threads or a memory map). A
    /// hang guard only: the test fails if `f` takes 30 s (a FIFO waited on), no timing.
    pub(crate) fn counting_reads<T: Send + 'static>(
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> (T, u64) {
        fn rchar() -> u64 {
            let io = std::fs::read_to_string("/proc/thread-self/io").expect("/proc/thread-self/io");
            io.lines()
                .find_map(|l| l.strip_prefix("rchar: "))
                .and_then(|v| v.trim().parse().ok())
                .expect("an rchar line")
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // The counter counts this thread's reads (a kernel without I/O accounting would
            // show 0 whatever was read): 4 KiB read must show.
            let start = rchar();
            let mut zeros = [0u8; 4096];
            std::io::Read::read_exact(&mut std::fs::File::open("/dev/zero").unwrap(), &mut zeros)
                .unwrap();
            assert!(
                rchar() - start >= 4096,
                "/proc/thread-self/io does not count reads"
            );
            // The counter's own read of /proc counts too: measured once, taken off.
            let first = rchar();
            let before = rchar();
            let own = before - first;
            let out = f();
            let read = (rchar() - before).saturating_sub(own);
            let _ = tx.send((out, read));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(answer) => answer,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("{what}: no answer within 30 s (blocked)")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                panic!("{what}: the thread panicked")
            }
        }
    }

    /// A FIFO nobody writes to, in a fresh folder of the system's temporary directory.
    pub(crate) fn fifo(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gradwire-fifo-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(
            made.is_ok_and(|s| s.success()),
            "this test needs `mkfifo` (coreutils)"
        );
        path
    }

    /// Issue 48 class 5: inputs are opened without blocking and looked at on the handle, so a
    /// path that is a FIFO by the time it is opened (after the look at the path, which this
    /// test skips) is refused at once instead of waiting for a writer; a device such as
    /// /dev/zero is refused having read nothing.
    #[test]
    fn a_fifo_or_a_device_is_refused_on_its_handle_without_blocking_or_reading() {
        let fifo = fifo("handle");
        for path in [fifo.clone(), PathBuf::from("/dev/zero")] {
            let p = path.clone();
            let (result, read) = counting_reads("open_checked", move || {
                super::open_checked(&p)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            let e = result.unwrap_err();
            assert!(
                e.contains(&path.display().to_string()) && e.contains("not a regular file"),
                "{e}"
            );
            // Nothing read (a few bytes of slack: the counter's own figures may grow a digit).
            assert!(read <= 8, "{}: {read} bytes read", path.display());
            let p = path.clone();
            let (result, _) = counting_reads("open_regular", move || {
                super::open_regular(&p)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            assert!(result.unwrap_err().contains("not a regular file"));
        }
        let _ = std::fs::remove_dir_all(fifo.parent().unwrap_or(Path::new("")));
    }
}

//! Files: reading inputs (a gradients file one tensor at a time), writing float32 safetensors
//! models tensor by tensor, and atomic writes (a temporary file in the
//! same directory, renamed over the target), so that a failure never leaves a half-written
//! output or state file.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::TensorSpec;
use crate::tensor::Tensor;

use super::CliError;

/// Opens an input: a regular file only, looked at before it is opened (opening a FIFO blocks
/// until someone writes to it; a device such as /dev/zero never ends), with its length.
pub(super) fn open_input(path: &Path) -> Result<(File, u64), CliError> {
    match crate::feedback::checkpoint::open_regular(path) {
        Ok(opened) => Ok(opened),
        Err(crate::Error::Io { source, .. }) => Err(CliError::io("cannot read", path, &source)),
        Err(_) => Err(CliError::new(format!(
            "cannot read {}: not a regular file (a FIFO, a device, a directory); gradwire reads \
             its inputs from regular files",
            path.display()
        ))),
    }
}

/// The bytes of a manifest section (container, FORMAT.md 13) beyond its model's element
/// charge at most: a method text of up to 65,535 bytes and the fixed fields. Every tensor's
/// entry takes fewer bytes than the elements it is charged
/// ([`crate::container::charged_elements`]: 256 a tensor, 4 a name byte, 16 a dimension).
const SECTION_SLACK: u64 = 2 + 65_535 + 8 + 4;

/// Reads a whole regular file (its length known first, the buffer reserved once), naming it in
/// the error, header first: a gradwire container's manifest section must fit `max_elements`
/// (the model's charge, as the container reader counts it), is read and checked, and the file
/// may be no longer than the largest bundle of that model; any other file (read as a
/// reference payload unless `layout` says it must be a container) must have a valid
/// safetensors header that matches the file's length and stays within
/// [`check_reference_header`]'s bounds. Only then is the rest read, so a file however long (a
/// sparse file of gigabytes) costs at most what a container or a reference payload of a model
/// within `max_elements` may. A file that is not a container where `layout` asks for one is
/// returned as its first bytes only, for the caller to refuse.
pub fn read_bounded(
    path: &Path,
    max_elements: u64,
    layout: Option<super::Layout>,
) -> Result<Vec<u8>, CliError> {
    let (mut file, len) = open_input(path)?;
    let too_large = || {
        CliError::new(format!(
            "cannot read {}: {len} bytes do not fit in memory",
            path.display()
        ))
    };
    let mut bytes = Vec::new();
    let prefix = len.min(12) as usize;
    bytes.resize(prefix, 0);
    file.read_exact(&mut bytes)
        .map_err(|e| CliError::io("cannot read", path, &e))?;
    if prefix == 12 && crate::container::is_container(&bytes) {
        let m = u64::from(u32::from_le_bytes([
            bytes[8], bytes[9], bytes[10], bytes[11],
        ]));
        if m > max_elements.saturating_add(SECTION_SLACK) {
            return Err(CliError::new(format!(
                "{}: invalid container: a manifest section of {m} bytes describes a model of \
                 more than {max_elements} elements (see --max-elements)",
                path.display()
            )));
        }
        // The section and its CRC, or what the file has of them (a short file is the
        // header reader's to name).
        let head = (12 + m + 4).min(len);
        read_more(&mut file, &mut bytes, head, path).ok_or_else(too_large)??;
        let header = crate::container::ContainerHeader::read_for(&bytes, None, max_elements)
            .map_err(|e| CliError::from(e).in_file(path))?;
        let manifest = header
            .manifest()
            .map_err(|e| CliError::from(e).in_file(path))?;
        let bound = (header.bundle_offset as u64).saturating_add(manifest.max_bundle_len() as u64);
        if len > bound {
            return Err(CliError::new(format!(
                "{}: invalid container: {len} bytes, more than its model's largest bundle \
                 allows ({bound} bytes)",
                path.display()
            )));
        }
    } else if crate::container::is_container(&bytes) {
        // Fewer than 12 bytes that begin like a container: read whole below (at most 11
        // bytes), for the container reader to name what is missing.
    } else if layout == Some(super::Layout::Gradwire) {
        return Ok(bytes); // not a container: the caller names it so
    } else {
        check_reference_header(&mut file, len, max_elements, layout, path)?;
        file.seek(SeekFrom::Start(prefix as u64))
            .map_err(|e| CliError::io("cannot read", path, &e))?;
    }
    read_more(&mut file, &mut bytes, len, path).ok_or_else(too_large)??;
    Ok(bytes)
}

/// Reads the safetensors header of a reference payload from the start of `file` (`len` bytes
/// long) and checks it before any tensor data is read: valid, matching the file's length, and
/// within what a payload of a model of `max_elements` elements holds at most (every element
/// kept: an 8-byte index and a value of at most 4 bytes each, and a scale per tensor): at most
/// `2 x max_elements + T` elements and `12 x max_elements + 4 T` bytes of tensor data for its
/// `T` tensors.
fn check_reference_header(
    file: &mut File,
    len: u64,
    max_elements: u64,
    layout: Option<super::Layout>,
    path: &Path,
) -> Result<(), CliError> {
    file.seek(SeekFrom::Start(0))
        .map_err(|e| CliError::io("cannot read", path, &e))?;
    let (meta, _) =
        crate::safetensors_reader::read_header_from(file, len).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => CliError::io("cannot read", path, &e),
            e => {
                let what = if layout.is_some() {
                    "not a valid reference payload (safetensors)"
                } else {
                    "neither a gradwire container nor a valid safetensors file"
                };
                safetensors_error(path, what, &e)
            }
        })?;
    let tensors = meta.tensors();
    let count = tensors.len() as u64;
    let declared = tensors.values().fold(0u64, |sum, info| {
        let n = info
            .shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .unwrap_or(u64::MAX);
        sum.saturating_add(n)
    });
    let (elements, bytes) = (
        max_elements.saturating_mul(2).saturating_add(count),
        max_elements
            .saturating_mul(12)
            .saturating_add(count.saturating_mul(4)),
    );
    let data = meta.data_len() as u64;
    if declared > elements || data > bytes {
        return Err(CliError::new(format!(
            "{}: a reference payload of {declared} elements in {data} bytes, more than \
             {elements} elements or {bytes} bytes (an 8-byte index and a value of at most 4 \
             bytes for each of --max-elements {max_elements}, a scale per tensor; see \
             --max-elements)",
            path.display()
        )));
    }
    Ok(())
}

/// Reads from `file` until `bytes` holds `total` bytes (reserved once). `None` when they do
/// not fit in memory.
fn read_more(
    file: &mut File,
    bytes: &mut Vec<u8>,
    total: u64,
    path: &Path,
) -> Option<Result<(), CliError>> {
    let total = usize::try_from(total).ok()?;
    let more = total.saturating_sub(bytes.len());
    bytes.try_reserve_exact(more).ok()?;
    let at = bytes.len();
    bytes.resize(total, 0);
    Some(
        file.read_exact(&mut bytes[at..])
            .map_err(|e| CliError::io("cannot read", path, &e)),
    )
}

/// A model's tensors: `(name, tensor)` sorted by name.
pub type Model = Vec<(String, Tensor)>;

/// `path: what: ` followed by the safetensors error with its hint
/// ([`crate::safetensors_reader::describe`]).
pub fn safetensors_error(path: &Path, what: &str, e: &safetensors::SafeTensorError) -> CliError {
    CliError::new(format!(
        "{}: {what}: {}",
        path.display(),
        crate::safetensors_reader::describe(e)
    ))
}

/// A safetensors file of float32 tensors (a gradients file) open for reading one tensor at a
/// time: its header is read and checked, nothing of its data.
pub struct Input {
    path: PathBuf,
    file: File,
    data_start: u64,
    /// Names and shapes, sorted by name, with the byte range of each in the data section.
    tensors: Vec<(TensorSpec, (usize, usize))>,
}

impl Input {
    /// Opens `path` and reads its header: every tensor must be float32 (the first that is not,
    /// in file order, is named), and the model (elements, and the metadata charge of
    /// [`crate::container::charged_elements`]) at most `max_elements`, checked before any
    /// tensor data is read.
    pub fn open(path: &Path, max_elements: u64) -> Result<Input, CliError> {
        let (mut file, len) = open_input(path)?;
        let mut magic = [0u8; 4];
        if len >= 4 {
            file.read_exact(&mut magic)
                .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
                .map_err(|e| CliError::io("cannot read", path, &e))?;
        }
        if super::container::is_container(&magic) {
            return Err(CliError::new(format!(
                "{}: a gradwire container, not a safetensors file of float32 tensors \
                 (decompress it first)",
                path.display()
            )));
        }
        let (meta, data_start) = crate::safetensors_reader::read_header_from(&mut file, len)
            .map_err(|e| match e {
                safetensors::SafeTensorError::IoError(e) => CliError::io("cannot read", path, &e),
                e => safetensors_error(path, "not a valid safetensors file", &e),
            })?;
        let mut tensors = Vec::with_capacity(meta.tensors().len());
        for name in meta.offset_keys() {
            let Some(info) = meta.info(&name) else {
                continue;
            };
            if info.dtype != safetensors::Dtype::F32 {
                return Err(CliError::new(format!(
                    "{}: {}",
                    path.display(),
                    crate::Error::Dtype {
                        tensor: name,
                        dtype: format!("{:?}", info.dtype),
                    }
                )));
            }
            let range = info.data_offsets;
            tensors.push((TensorSpec::new(name, info.shape.clone()), range));
        }
        tensors.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        let specs: Vec<TensorSpec> = tensors.iter().map(|(s, _)| s.clone()).collect();
        let charge = crate::container::model_charge(&specs);
        if charge > max_elements {
            return Err(CliError::new(format!(
                "{}: the model has more than {max_elements} elements (counting {} per tensor, {} \
                 per byte of its name and {} per dimension for its metadata; see \
                 --max-elements)",
                path.display(),
                crate::container::TENSOR_CHARGE,
                crate::container::NAME_BYTE_CHARGE,
                crate::container::DIMENSION_CHARGE,
            )));
        }
        Ok(Input {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
        })
    }

    /// The tensors' names and shapes, sorted by name.
    pub fn specs(&self) -> Vec<TensorSpec> {
        self.tensors.iter().map(|(s, _)| s.clone()).collect()
    }

    /// Reads tensor `i` (of [`Input::specs`]) from the file: its bytes in blocks of 1 MiB
    /// straight into its f32 values (no copy of the bytes).
    pub fn read(&mut self, i: usize) -> Result<Tensor, CliError> {
        let (spec, (begin, end)) = &self.tensors[i];
        let path = &self.path;
        let at = |e: std::io::Error| {
            CliError::new(format!(
                "{}: cannot read tensor `{}`: {e}",
                path.display(),
                spec.name
            ))
        };
        let n = (end - begin) / 4;
        let mut values: Vec<f32> = Vec::new();
        values.try_reserve_exact(n).map_err(|_| {
            CliError::new(format!(
                "{}: cannot allocate {n} elements for tensor `{}`",
                path.display(),
                spec.name
            ))
        })?;
        self.file
            .seek(SeekFrom::Start(self.data_start + *begin as u64))
            .map_err(at)?;
        let mut block = vec![0u8; (1 << 20).min(end - begin)];
        let mut left = end - begin;
        while left > 0 {
            let take = left.min(block.len());
            self.file.read_exact(&mut block[..take]).map_err(at)?;
            values.extend(
                block[..take]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            left -= take;
        }
        Tensor::new(spec.shape.clone(), values)
            .map_err(|e| CliError::new(format!("{}: {e}", path.display())))
    }
}

/// Names and shapes of every tensor of the safetensors file at `path` (any dtype), sorted by
/// name: what a receiver knows about its model. Only the header is read.
pub fn read_shapes(path: &Path) -> Result<Vec<(String, Vec<usize>)>, CliError> {
    let (mut file, len) = open_input(path)?;
    let (meta, _) =
        crate::safetensors_reader::read_header_from(&mut file, len).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => CliError::io("cannot read", path, &e),
            e => safetensors_error(path, "not a valid safetensors file", &e),
        })?;
    let mut shapes: Vec<(String, Vec<usize>)> = meta
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.shape.clone()))
        .collect();
    shapes.sort();
    Ok(shapes)
}

/// The header of a float32 safetensors file of `tensors` (`(name, shape)`, in data order;
/// [`crate::tensor::f32_safetensors_header`]).
pub fn model_header<'a>(
    tensors: impl ExactSizeIterator<Item = (&'a str, &'a [usize])>,
) -> Result<Vec<u8>, CliError> {
    crate::tensor::f32_safetensors_header(tensors, None)
        .map_err(|e| CliError::new(format!("cannot serialize safetensors: {e}")))
}

/// Writes a new file front to back, with the values of float32 tensors converted in blocks of
/// 64 KiB (no second copy of a tensor), seeking over blocks that are all zero bits: the file is
/// new, so a hole reads as zeros, and a sparse model stays small on disk.
pub struct SparseWriter<'f> {
    file: &'f mut File,
    path: &'f Path,
    pos: u64,
    hole: bool,
    block: Vec<u8>,
}

/// Elements per block of [`SparseWriter::f32s`].
const BLOCK: usize = 1 << 14;

impl<'f> SparseWriter<'f> {
    /// A writer at the start of `file` (new and empty), which is `path` for messages.
    pub fn new(file: &'f mut File, path: &'f Path) -> Self {
        SparseWriter {
            file,
            path,
            pos: 0,
            hole: false,
            block: Vec::with_capacity(BLOCK * 4),
        }
    }

    fn err(&self, e: &std::io::Error) -> CliError {
        CliError::io("cannot write", self.path, e)
    }

    /// Writes `bytes` at the current position.
    pub fn bytes(&mut self, bytes: &[u8]) -> Result<(), CliError> {
        if self.hole {
            self.file
                .seek(SeekFrom::Start(self.pos))
                .map_err(|e| self.err(&e))?;
            self.hole = false;
        }
        self.file.write_all(bytes).map_err(|e| self.err(&e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Writes `values` as little-endian f32.
    pub fn f32s(&mut self, values: &[f32]) -> Result<(), CliError> {
        let mut block = std::mem::take(&mut self.block);
        for chunk in values.chunks(BLOCK) {
            if chunk.iter().all(|v| v.to_bits() == 0) {
                self.pos += chunk.len() as u64 * 4;
                self.hole = true;
                continue;
            }
            block.clear();
            block.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            self.bytes(&block)?;
        }
        self.block = block;
        Ok(())
    }

    /// Ends the file at the current position (a trailing hole included).
    pub fn finish(self) -> Result<(), CliError> {
        self.file.set_len(self.pos).map_err(|e| self.err(&e))
    }
}

/// A file written next to its target, not yet renamed over it. Dropping it removes it.
pub struct Staged {
    temp: PathBuf,
    target: PathBuf,
    done: bool,
}

impl Staged {
    /// Renames the temporary file over the target, then flushes the directory (on Unix), so
    /// that a rename is on disk before the next one: files committed one after the other reach
    /// the disk in that order.
    pub fn commit(mut self) -> Result<(), CliError> {
        fs::rename(&self.temp, &self.target)
            .map_err(|e| CliError::io("cannot write", &self.target, &e))?;
        self.done = true;
        #[cfg(unix)]
        {
            let dir = match self.target.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| CliError::io("cannot write", &self.target, &e))?;
        }
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

/// The file an output path names: `target` itself, or, for a symbolic link, the file at the
/// end of its chain (which may not exist yet), so that the file is replaced and the link stays
/// (a rename over the link would put a regular file in its place: `-o /dev/stdout` as root
/// replaced the link in /dev).
///
/// # Errors
/// A path that exists and is not a regular file (a pipe, a terminal, a device: `fs::metadata`
/// follows the links); a link through a process's file descriptors (`/proc/…/fd`, `/dev/fd`:
/// `-o /dev/stdout >> file` would replace `file` instead of appending to it); more than 40
/// links; a link that cannot be read.
fn resolve_output(target: &Path) -> Result<PathBuf, CliError> {
    let not_regular = |path: &Path| {
        CliError::new(format!(
            "cannot write {}: not a regular file (a FIFO, a device, a socket or a process's \
             file descriptor); gradwire writes its outputs to regular files, replaced whole",
            path.display()
        ))
    };
    if fs::metadata(target).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
        return Err(not_regular(target));
    }
    let mut path = target.to_path_buf();
    for _ in 0..40 {
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => {
                let next =
                    fs::read_link(&path).map_err(|e| CliError::io("cannot write", target, &e))?;
                path = match path.parent() {
                    Some(dir) if next.is_relative() => dir.join(next),
                    _ => next,
                };
                if path.starts_with("/proc") || path.starts_with("/dev/fd") {
                    return Err(not_regular(target));
                }
            }
            _ => return Ok(path),
        }
    }
    Err(CliError::new(format!(
        "cannot write {}: more than 40 symbolic links",
        target.display()
    )))
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
    let resolved = resolve_output(target)?;
    let target = resolved.as_path();
    let file_name = target
        .file_name()
        .ok_or_else(|| CliError::new(format!("{}: not a file name", target.display())))?;
    if target.is_dir() {
        return Err(CliError::new(format!(
            "cannot write {}: is a directory",
            target.display()
        )));
    }
    // An output is replaced whole by a rename: a FIFO, a device or a socket in its place would
    // become a regular file (as root, `-o /dev/null` replaced the machine's /dev/null).
    if fs::metadata(target).is_ok_and(|m| !m.is_file()) {
        return Err(CliError::new(format!(
            "cannot write {}: not a regular file (a FIFO, a device or a socket); gradwire \
             writes its outputs to regular files, replaced whole",
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

/// Writes every `(target, bytes)` atomically: all temporary files first, then the renames in
/// the order given, so a failure while writing leaves every target as it was. (A failure
/// between two renames leaves the first target new and the next old: `compress --residual`
/// writes its output first and then the state, which records the output's digest, and checks
/// the pair on its next run.)
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

//! The `gradwire` command-line tool: compress, decompress and inspect gradients stored as
//! safetensors files. The binary `gradwire` is [`main`]; this module holds the whole tool, so
//! that its file formats (the container, the streamed safetensors reader) stay private to the
//! crate.
//!
//! ```text
//! gradwire compress IN.safetensors -o OUT
//!          [--method topk|randomk|threshold|quant|sign|f16|bf16|f32]
//!          [--ratio R | --k K | --threshold T] [--bits B] [--block N]
//!          [--values f32|f16|bf16|int8]
//!          [--stochastic] [--zero-mask] [--seed S] [--step N] [--residual STATE.safetensors]
//!          [--layout gradwire|reference] [--max-elements N]
//! gradwire decompress IN -o OUT.safetensors [--layout gradwire|reference]
//!          [--shapes MODEL.safetensors] [--mode none|topk|topk-int8] [--max-elements N]
//! gradwire inspect IN [--json] [--layout gradwire|reference] [--shapes MODEL.safetensors]
//!          [--max-elements N]
//! ```
//!
//! Two layouts:
//! - `gradwire` (default): a gradwire container (FORMAT.md section 13: a checksummed
//!   manifest with names, shapes and method, followed by a gradwire bundle);
//! - `reference`: the reference Python safetensors payload ([`crate::reference`]); shapes do
//!   not travel, so `decompress` needs the receiver's model (`--shapes`).
//!
//! With `--residual STATE`, `compress` runs one error-feedback step: it reads the state when the
//! file exists (an [`crate::feedback::ErrorFeedback`] checkpoint of this model: its
//! residuals and the gradients file's tensors must match one to one by name and shape, with
//! the same method, seed and step; a state written before checkpoint version 3 holds no shapes
//! and is matched by length until this step stores them), compresses
//! `gradient + residual`, and rewrites the state. Outputs and state files are written to a
//! temporary file in the same directory and renamed (keeping the permissions of the file they
//! replace), so a failure never leaves a half-written file. Output and state are one pair: the
//! output is renamed first, then the state, which records the output's length and SHA-256
//! (FORMAT.md 12.2); a step whose `-o` exists and is not the state's output (a run interrupted
//! between the two renames) is refused, unless it is the rerun of that step with the same
//! gradients, which completes the pair. A failure prints one line, `gradwire: error: ...`, on
//! stderr (control characters escaped as `\u{..}`) and exits with status 1 (2 for invalid
//! command lines).
mod io;
mod report;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::TensorSpec;
use crate::container;
use crate::feedback::ErrorFeedback;
use crate::method::{DEFAULT_INT8_BLOCK, DEFAULT_QUANT_BLOCK, DEFAULT_SIGN_BLOCK};
use crate::reference::{self, Mode};
use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use gradwire_core::{K, Method, Rounding, SignScale, Values};

/// A failure: one line for stderr and the exit status.
#[derive(Debug)]
pub(crate) struct CliError {
    message: String,
    status: u8,
}

impl CliError {
    /// A runtime failure (exit status 1).
    pub fn new(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            status: 1,
        }
    }

    /// An invalid command line (exit status 2).
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            status: 2,
        }
    }

    /// The same error about the contents of `path`: the message starts with it (unless it
    /// already names that file first).
    pub fn in_file(mut self, path: &Path) -> Self {
        let prefix = format!("{}: ", path.display());
        if !self.message.starts_with(&prefix) {
            self.message.insert_str(0, &prefix);
        }
        self
    }

    /// An I/O failure on `path`.
    pub fn io(what: &str, path: &Path, e: &std::io::Error) -> Self {
        let reason = match e.kind() {
            std::io::ErrorKind::NotFound => "no such file or directory".to_owned(),
            std::io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
            _ => e.to_string(),
        };
        CliError::new(format!("{what} {}: {reason}", path.display()))
    }
}

impl From<crate::Error> for CliError {
    fn from(e: crate::Error) -> Self {
        CliError::new(e.to_string())
    }
}

impl From<reference::ReferenceError> for CliError {
    fn from(e: reference::ReferenceError) -> Self {
        CliError::new(e.to_string())
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "gradwire",
    version,
    about = "Compress, decompress and inspect gradients (safetensors) for data-parallel training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Compress a float32 safetensors file of gradients.
    Compress(CompressArgs),
    /// Rebuild dense float32 gradients from a compressed file.
    Decompress(DecompressArgs),
    /// Show what a compressed file holds: per tensor and in total.
    Inspect(InspectArgs),
}

/// Which file layout to write or read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Layout {
    /// A gradwire container: manifest (names, shapes, method) + gradwire bundle.
    Gradwire,
    /// The reference Python safetensors payload (`NAME::idx`, `NAME::val`, `NAME::scale`).
    Reference,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum MethodArg {
    /// Exact top-k by magnitude (ties to the lower index).
    Topk,
    /// k entries at seeded random indices (the indices do not travel).
    Randomk,
    /// Entries with |g| > T.
    Threshold,
    /// B-bit quantization with per-block absmax scales.
    Quant,
    /// One sign bit per element with a per-block mean |g| scale.
    Sign,
    /// Dense IEEE binary16.
    F16,
    /// Dense bfloat16.
    Bf16,
    /// Dense float32 (lossless; mode `none` in the reference layout).
    F32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ValuesArg {
    F32,
    F16,
    Bf16,
    Int8,
}

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("amount").args(["ratio", "k", "threshold"])))]
struct CompressArgs {
    /// Gradients: a safetensors file of float32 tensors.
    input: PathBuf,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
    /// Compression method.
    #[arg(long, value_enum, default_value_t = MethodArg::Topk)]
    method: MethodArg,
    /// Fraction of entries kept per tensor (topk, randomk), 0 < R <= 1: k = max(1, floor(n * R));
    /// default 0.01.
    #[arg(long, allow_negative_numbers = true, value_name = "R")]
    ratio: Option<f64>,
    /// Entries kept per tensor (topk, randomk; gradwire layout).
    #[arg(long, allow_negative_numbers = true, value_name = "K")]
    k: Option<u64>,
    /// Keep entries with |g| > T (threshold).
    #[arg(long, allow_negative_numbers = true, value_name = "T")]
    threshold: Option<f32>,
    /// Bits per element, 2..=8 (quant; default 8).
    #[arg(long, value_name = "B")]
    bits: Option<u8>,
    /// Elements per f32 scale (quant: 512, sign: 1024, int8 values: 256 kept values).
    #[arg(long, value_name = "N")]
    block: Option<u32>,
    /// Value type of kept entries (topk, randomk, threshold; default f32).
    #[arg(long, value_enum)]
    values: Option<ValuesArg>,
    /// Stochastic (unbiased) rounding for quant, from (seed, step, tensor).
    #[arg(long)]
    stochastic: bool,
    /// Sign: elements that are exactly zero decode to zero, not to +scale (a zero mask:
    /// 2 bits per block and a bitmap per block that mixes zeros and non-zeros).
    #[arg(long)]
    zero_mask: bool,
    /// Seed of random-k and stochastic rounding (default 0; with --residual, the state's).
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Training step (random-k and stochastic rounding draw from it); with --residual it must
    /// match the state's step.
    #[arg(long, value_name = "N")]
    step: Option<u64>,
    /// Error-feedback state: read when it exists, rewritten after the step (it records the
    /// output's SHA-256: an existing -o that is not its output is refused).
    #[arg(long, value_name = "STATE.safetensors")]
    residual: Option<PathBuf>,
    /// Output layout.
    #[arg(long, value_enum, default_value_t = Layout::Gradwire)]
    layout: Layout,
    /// Largest model the input may hold: its elements plus, per tensor, 256, 4 per name byte
    /// and 16 per dimension for its metadata; checked from the safetensors header before any
    /// tensor is read. Tensors are then read and compressed one at a time (gradwire layout):
    /// memory is about one tensor's f32 plus the output.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ELEMENTS)]
    max_elements: u64,
}

#[derive(Args, Debug)]
struct DecompressArgs {
    /// A gradwire container or a reference payload.
    input: PathBuf,
    /// Output: a safetensors file of float32 tensors.
    #[arg(short, long)]
    output: PathBuf,
    /// Layout of the input (default: detected from its first bytes).
    #[arg(long, value_enum)]
    layout: Option<Layout>,
    /// The receiver's model (any safetensors file with the same names and shapes): required for
    /// the reference layout; for a gradwire container, checked against its manifest.
    #[arg(long, value_name = "MODEL.safetensors")]
    shapes: Option<PathBuf>,
    /// Mode of a reference payload (the X-Compression header); default: detected from dtypes.
    #[arg(long, value_name = "MODE")]
    mode: Option<String>,
    /// Largest model a container may declare (with --shapes, at least that model): its
    /// elements plus, per tensor, 256 + 4 per name byte + 16 per dimension for its metadata;
    /// a reference payload at most what one of such a model holds with every element kept (an
    /// 8-byte index and a value each, a scale per tensor). Checked on the file's header before
    /// the rest is read. The output is written
    /// tensor by tensor: memory is about 4 bytes per element of the largest tensor, the file
    /// about 4 per element of the model.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ELEMENTS)]
    max_elements: u64,
}

/// Default of `--max-elements`: 2^30 elements (4 GiB of f32).
const DEFAULT_MAX_ELEMENTS: u64 = 1 << 30;

#[derive(Args, Debug)]
struct InspectArgs {
    /// A gradwire container or a reference payload.
    input: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Layout of the input (default: detected from its first bytes).
    #[arg(long, value_enum)]
    layout: Option<Layout>,
    /// The model, to report element counts of a reference payload (shapes do not travel).
    #[arg(long, value_name = "MODEL.safetensors")]
    shapes: Option<PathBuf>,
    /// Largest model a container may declare: its elements plus, per tensor, 256 + 4 per name
    /// byte + 16 per dimension for its metadata; a reference payload at most what one of such a
    /// model holds with every element kept (an 8-byte index and a value each, a scale per
    /// tensor). Checked on the file's header before the rest is read.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ELEMENTS)]
    max_elements: u64,
}

/// Runs the tool on the process's command line (see the module docs) and returns its exit
/// status: 0 on success, 1 for a failure (one line on stderr, `gradwire: error: ...`), 2 for an
/// invalid command line.
///
/// # Errors
/// None: every failure is the exit status and its line on stderr.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                // Help and version go to stdout with status 0.
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if matches!(
                e.kind(),
                ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                return fail(&CliError::usage(
                    "missing command: compress, decompress or inspect (see gradwire --help)",
                ));
            }
            // clap's message up to its usage block, on one line (with its tip, e.g. a similar
            // flag's name).
            let text = e.to_string();
            let parts: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .filter(|l| !l.is_empty())
                .collect();
            let mut message = String::new();
            for part in parts {
                if !message.is_empty() {
                    message.push_str(if message.ends_with(':') { " " } else { "; " });
                }
                message.push_str(part);
            }
            let message = message.strip_prefix("error: ").unwrap_or(&message);
            return fail(&CliError::usage(format!("{message} (see gradwire --help)")));
        }
    };
    let result = match cli.command {
        Command::Compress(a) => compress(&a),
        Command::Decompress(a) => decompress(&a),
        Command::Inspect(a) => inspect(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn fail(e: &CliError) -> ExitCode {
    // One line, and nothing in it that a terminal would act on (a tensor name or a path can
    // hold any character).
    eprintln!("gradwire: error: {}", report::escape(&e.message));
    ExitCode::from(e.status)
}

/// The method the flags describe, checked for flags that do not apply.
fn method_of(a: &CompressArgs) -> Result<Method, CliError> {
    let usage = CliError::usage;
    let sparse = matches!(
        a.method,
        MethodArg::Topk | MethodArg::Randomk | MethodArg::Threshold
    );
    if !sparse && a.values.is_some() {
        return Err(usage("--values applies to topk, randomk and threshold"));
    }
    if a.method != MethodArg::Quant && a.bits.is_some() {
        return Err(usage("--bits applies to --method quant"));
    }
    if a.method != MethodArg::Quant && a.stochastic {
        return Err(usage("--stochastic applies to --method quant"));
    }
    if a.method != MethodArg::Sign && a.zero_mask {
        return Err(usage("--zero-mask applies to --method sign"));
    }
    if a.method != MethodArg::Threshold && a.threshold.is_some() {
        return Err(usage("--threshold applies to --method threshold"));
    }
    if !matches!(a.method, MethodArg::Topk | MethodArg::Randomk)
        && (a.ratio.is_some() || a.k.is_some())
    {
        return Err(usage("--ratio and --k apply to topk and randomk"));
    }
    let values = match a.values.unwrap_or(ValuesArg::F32) {
        ValuesArg::F32 => Values::F32,
        ValuesArg::F16 => Values::F16,
        ValuesArg::Bf16 => Values::Bf16,
        ValuesArg::Int8 => Values::Int8 {
            block: a.block.unwrap_or(DEFAULT_INT8_BLOCK),
        },
    };
    let block_applies = matches!(a.method, MethodArg::Quant | MethodArg::Sign)
        || matches!(values, Values::Int8 { .. });
    if a.block.is_some() && !block_applies {
        return Err(usage("--block applies to quant, sign and --values int8"));
    }
    if a.block == Some(0) {
        return Err(usage("--block must be at least 1"));
    }
    if let Some(b) = a.bits
        && !(2..=8).contains(&b)
    {
        return Err(CliError::usage(format!(
            "invalid --bits {b}: quantization takes 2..=8 bits per element"
        )));
    }
    if let Some(t) = a.threshold
        && !(t.is_finite() && t >= 0.0)
    {
        return Err(CliError::usage(format!(
            "invalid --threshold {t}: entries with |g| > T are kept, T must be finite and >= 0"
        )));
    }
    if let Some(r) = a.ratio
        && !(r.is_finite() && r > 0.0 && r <= 1.0)
    {
        return Err(CliError::usage(format!(
            "invalid --ratio {r}: the fraction of entries kept must be > 0 and <= 1 \
             (0.01 keeps 1%)"
        )));
    }
    let k = match (a.ratio, a.k) {
        (_, Some(k)) => K::Count(k),
        (Some(r), None) => K::Ratio(r),
        (None, None) => K::Ratio(0.01),
    };
    let method = match a.method {
        MethodArg::Topk => Method::TopK { k, values },
        MethodArg::Randomk => Method::RandomK {
            k,
            values,
            unbiased: false,
        },
        MethodArg::Threshold => Method::Threshold {
            threshold: a
                .threshold
                .ok_or_else(|| usage("--method threshold needs --threshold T"))?,
            values,
        },
        MethodArg::Quant => Method::Quant {
            bits: a.bits.unwrap_or(8),
            block: a.block.unwrap_or(DEFAULT_QUANT_BLOCK),
            rounding: if a.stochastic {
                Rounding::Stochastic
            } else {
                Rounding::NearestEven
            },
        },
        MethodArg::Sign => Method::Sign {
            scale: SignScale::MeanAbs {
                block: a.block.unwrap_or(DEFAULT_SIGN_BLOCK),
            },
            zero_mask: a.zero_mask,
        },
        MethodArg::F16 => Method::Dense {
            values: Values::F16,
        },
        MethodArg::Bf16 => Method::Dense {
            values: Values::Bf16,
        },
        MethodArg::F32 => Method::Dense {
            values: Values::F32,
        },
    };
    method
        .validate()
        .map_err(|e| CliError::usage(e.to_string()))?;
    Ok(method)
}

/// The reference mode and ratio the flags describe.
fn reference_mode_of(a: &CompressArgs) -> Result<(Mode, f64), CliError> {
    let usage = CliError::usage;
    if a.k.is_some() {
        return Err(usage(
            "the reference layout sets k from --ratio; --k is not available",
        ));
    }
    if a.block.is_some() {
        return Err(usage(
            "the reference layout has one int8 scale per tensor; --block is not available",
        ));
    }
    if a.seed.is_some() {
        return Err(usage("--seed does not apply to the reference layout"));
    }
    if a.threshold.is_some() || a.bits.is_some() || a.stochastic {
        return Err(usage(
            "the reference layout sends top-k or dense f32: --threshold, --bits and \
             --stochastic are not available",
        ));
    }
    let ratio = a.ratio.unwrap_or(0.01);
    if !(ratio.is_finite() && ratio >= 0.0) {
        return Err(CliError::usage(format!(
            "invalid ratio {ratio} (must be finite and >= 0)"
        )));
    }
    let mode = match (a.method, a.values) {
        (MethodArg::F32, None) => Mode::None,
        (MethodArg::Topk, None | Some(ValuesArg::F32)) => Mode::TopK,
        (MethodArg::Topk, Some(ValuesArg::Int8)) => Mode::TopKInt8,
        (MethodArg::Topk, Some(_)) => {
            return Err(usage("the reference layout sends f32 or int8 values"));
        }
        _ => {
            return Err(usage(
                "the reference layout supports --method topk (f32 or int8 values) and \
                 --method f32 (mode none)",
            ));
        }
    };
    if mode == Mode::None && a.ratio.is_some() {
        return Err(usage("--ratio applies to topk"));
    }
    Ok((mode, ratio))
}

/// The `__metadata__` entry of a `--residual` state that holds the SHA-256 (64 lowercase hex
/// digits) of the output written with it. (Not a CRC-32: an output that ends with its own
/// CRC-32, as a container does, has the same CRC-32 as every other output of its length.)
const OUTPUT_SHA256: &str = "output_sha256";
/// The entry that holds the output's length in bytes (decimal).
const OUTPUT_LEN: &str = "output_len";

/// The output a state belongs to: the SHA-256 and length of the file written in the same run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OutputDigest {
    sha256: [u8; 32],
    len: u64,
}

impl OutputDigest {
    fn of(bytes: &[u8]) -> Self {
        use sha2::Digest;
        OutputDigest {
            sha256: sha2::Sha256::digest(bytes).into(),
            len: bytes.len() as u64,
        }
    }

    /// The digest of the file at `path`, read in blocks; `None` when it does not exist. Opened
    /// as inputs are (without blocking, looked at on the handle): an output path that became
    /// a FIFO since it was checked is refused, not waited on.
    fn of_file(path: &Path) -> Result<Option<Self>, CliError> {
        use sha2::Digest;
        use std::io::Read;
        // A dangling link reads as missing too, as opening it would.
        if !path.exists() {
            return Ok(None);
        }
        let (mut file, _) = io::open_input(path)?;
        let mut hasher = sha2::Sha256::new();
        let mut block = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            match file.read(&mut block) {
                Ok(0) => break,
                Ok(n) => {
                    hasher.update(&block[..n]);
                    len += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(CliError::io("cannot read", path, &e)),
            }
        }
        Ok(Some(OutputDigest {
            sha256: hasher.finalize().into(),
            len,
        }))
    }

    fn hex(&self) -> String {
        self.sha256.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn from_text(sha256: &str, len: &str) -> Option<Self> {
        let len = len.parse().ok()?;
        if sha256.len() != 64
            || !sha256
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return None;
        }
        let mut d = [0u8; 32];
        for (i, b) in d.iter_mut().enumerate() {
            *b = u8::from_str_radix(sha256.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(OutputDigest { sha256: d, len })
    }

    /// The digest a state's metadata records (`None` for a state written without one: by the
    /// library, or by an older build).
    fn recorded(
        path: &Path,
        meta: &std::collections::HashMap<String, String>,
    ) -> Result<Option<Self>, CliError> {
        let get = |key| meta.get(key);
        match (get(OUTPUT_SHA256), get(OUTPUT_LEN)) {
            (None, None) => Ok(None),
            (Some(d), Some(l)) => OutputDigest::from_text(d, l).map(Some).ok_or_else(|| {
                CliError::new(format!(
                    "{}: residual state: metadata `{OUTPUT_SHA256}` = `{d}`, `{OUTPUT_LEN}` = \
                     `{l}` are not a SHA-256 in hex and a u64",
                    path.display()
                ))
            }),
            _ => Err(CliError::new(format!(
                "{}: residual state has one of `{OUTPUT_SHA256}` and `{OUTPUT_LEN}` without \
                 the other",
                path.display()
            ))),
        }
    }
}

/// A state loaded for `--residual`: the residuals, and the output it was written with.
struct State {
    feedback: ErrorFeedback,
    output: Option<OutputDigest>,
}

/// Loads the error-feedback state at `path` if it exists (its seed must be `seed` when one is
/// given), or starts a new one (seed 0 unless given).
fn load_state(path: &Path, method: Method, seed: Option<u64>) -> Result<State, CliError> {
    use crate::feedback::checkpoint::{io_error, open_regular};
    let (mut file, len) = match open_regular(path) {
        Ok(opened) => opened,
        Err(crate::Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(State {
                feedback: ErrorFeedback::new(method, seed.unwrap_or(0))?,
                output: None,
            });
        }
        Err(crate::Error::Io { source, .. }) => {
            return Err(CliError::io("cannot read", path, &source));
        }
        Err(e) => return Err(CliError::new(format!("{}: {e}", path.display()))),
    };
    // Read one residual at a time; the output digest comes from the header, read first.
    let mut output = Ok(None);
    let fb = ErrorFeedback::read_from(&mut file, len, &io_error(path), |meta| {
        output = OutputDigest::recorded(path, meta);
        Ok(())
    })
    .map_err(|e| {
        CliError::new(format!(
            "{}: cannot load it as a residual state (`--residual` takes a file that an earlier \
             `gradwire compress --residual` wrote, or a new path): {e}",
            path.display()
        ))
    })?;
    if let Some(seed) = seed
        && fb.seed() != seed
    {
        return Err(CliError::new(format!(
            "{}: residual state has seed {}, this step uses seed {seed}",
            path.display(),
            fb.seed()
        )));
    }
    Ok(State {
        feedback: fb,
        output: output?,
    })
}

/// The state and the output are one pair: the output is renamed into place first, then the
/// state, which records the output's digest. A failure between the two renames leaves the new
/// output with the old state; its next step would send the residual that output already
/// carries a second time. So when `-o` exists and is not the output the state records, this
/// step is refused, unless the new output is that file byte for byte (SHA-256 and length): the
/// rerun, with the same gradients, of the step that was interrupted, which then completes the
/// pair.
fn check_pair(
    state: &Path,
    recorded: Option<OutputDigest>,
    output: &Path,
    new: &[u8],
) -> Result<(), CliError> {
    let Some(recorded) = recorded else {
        return Ok(());
    };
    let Some(existing) = OutputDigest::of_file(output)? else {
        return Ok(());
    };
    if existing == recorded || existing == OutputDigest::of(new) {
        return Ok(());
    }
    Err(CliError::new(format!(
        "{}: residual state belongs to an output of {} bytes with SHA-256 {}, but {} ({} \
         bytes, SHA-256 {}) is another file: a run was interrupted after writing the output \
         and before the state (rerun that step with the same gradients to complete it), or -o \
         names another file (remove it, or choose another path)",
        state.display(),
        recorded.len,
        &recorded.hex()[..16],
        output.display(),
        existing.len,
        &existing.hex()[..16]
    )))
}

/// The bytes of the state `feedback` after a step whose output is `out`: the checkpoint with
/// the output's digest.
fn state_bytes(feedback: &ErrorFeedback, out: &[u8]) -> Result<Vec<u8>, CliError> {
    let d = OutputDigest::of(out);
    let (sha, len) = (d.hex(), d.len.to_string());
    Ok(feedback.to_bytes_with_metadata(&[(OUTPUT_LEN, &len), (OUTPUT_SHA256, &sha)])?)
}

fn check_state_method(path: &Path, fb: &ErrorFeedback, method: &Method) -> Result<(), CliError> {
    if fb.method() != method {
        return Err(CliError::new(format!(
            "{}: residual state was made with method `{}`, this step uses `{}`",
            path.display(),
            crate::method::format(fb.method()),
            crate::method::format(method)
        )));
    }
    Ok(())
}

fn check_state_step(path: &Path, fb: &ErrorFeedback, step: Option<u64>) -> Result<(), CliError> {
    match step {
        Some(s) if s != fb.step() => Err(CliError::new(format!(
            "{}: residual state is at step {}, --step says {s}",
            path.display(),
            fb.step()
        ))),
        _ => Ok(()),
    }
}

/// The state must be one of this model's: a residual whose tensor the gradients file lacks is
/// a state of another model (its residuals would be carried along and saved again unseen), one
/// whose length differs from its tensor's is stale (named here, before the compression would
/// report it against the gradients file), and a state that holds residuals but none for one of
/// the file's tensors is another model's too. A residual that remembers its tensor's shape must
/// have it still (a transposed weight has the same length; its residual would be added to the
/// wrong coordinates).
fn check_state_names(
    path: &Path,
    fb: &ErrorFeedback,
    model: &[TensorSpec],
) -> Result<(), CliError> {
    if fb.residuals().next().is_some()
        && let Some(TensorSpec { name, .. }) = model.iter().find(|t| fb.residual(&t.name).is_none())
    {
        return Err(CliError::new(format!(
            "{}: residual state holds no residual for tensor `{name}` of the gradients file (a \
             state of another model?)",
            path.display()
        )));
    }
    for (name, residual) in fb.residuals() {
        let Ok(at) = model.binary_search_by(|t| t.name.as_str().cmp(name)) else {
            return Err(CliError::new(format!(
                "{}: residual state holds tensor `{name}`, which the gradients file does not \
                 have (a state of another model?)",
                path.display()
            )));
        };
        let numel = model[at].shape.iter().product::<usize>();
        if residual.len() != numel {
            return Err(CliError::new(format!(
                "{}: residual state holds {} elements for tensor `{name}`, the gradients file \
                 {numel} (a state of another model, or the tensor changed shape?)",
                path.display(),
                residual.len()
            )));
        }
        let shape = model[at].shape.as_slice();
        if let Some(known) = fb.residual_shape(name)
            && known != shape
        {
            return Err(CliError::new(format!(
                "{}: residual state keeps tensor `{name}` in shape {known:?}, the gradients \
                 file has shape {shape:?} (a state of another model, or the tensor changed \
                 shape?)",
                path.display()
            )));
        }
    }
    Ok(())
}

fn compress(a: &CompressArgs) -> Result<(), CliError> {
    // Everything about the command line is checked before any file is read.
    let plan = match a.layout {
        Layout::Gradwire => Plan::Gradwire(method_of(a)?),
        Layout::Reference => {
            let (mode, ratio) = reference_mode_of(a)?;
            Plan::Reference(mode, ratio)
        }
    };
    // A missing input is for the read below to report; the state may not exist yet.
    let mut inputs: Vec<(&str, &Path)> = Vec::new();
    inputs.extend(Some(("input", a.input.as_path())).filter(|(_, p)| p.exists()));
    inputs.extend(a.residual.as_deref().map(|r| ("--residual state", r)));
    check_output(&a.output, &inputs)?;
    // The header first: every tensor float32, the model within --max-elements; then the
    // tensors one at a time.
    let mut input = io::Input::open(&a.input, a.max_elements)?;
    let specs = input.specs();
    // Errors of the compression itself (a NaN, a value out of range) are about the input file.
    let in_input = |e: CliError| e.in_file(&a.input);
    let (out, state) = match plan {
        Plan::Reference(mode, ratio) => {
            // The reference layout's functions take the whole model: one copy of it (the
            // file's bytes are not held).
            let model = (0..specs.len())
                .map(|i| Ok((specs[i].name.clone(), input.read(i)?)))
                .collect::<Result<io::Model, CliError>>()?;
            let inputs: Vec<reference::Input<'_>> = model
                .iter()
                .map(|(n, t)| (n.as_str(), t.shape(), t.data()))
                .collect();
            match &a.residual {
                None => (
                    reference::compress(&inputs, mode, ratio)
                        .map_err(CliError::from)
                        .map_err(in_input)?,
                    None,
                ),
                Some(path) => {
                    let method = reference::feedback_method(mode, ratio);
                    let State {
                        feedback: mut fb,
                        output,
                    } = load_state(path, method, a.seed)?;
                    check_state_method(path, &fb, &method)?;
                    check_state_step(path, &fb, a.step)?;
                    check_state_names(path, &fb, &specs)?;
                    let payload =
                        reference::compress_with_error_feedback(&inputs, &mut fb, mode, ratio)
                            .map_err(CliError::from)
                            .map_err(in_input)?;
                    check_pair(path, output, &a.output, &payload)?;
                    let state = state_bytes(&fb, &payload)?;
                    (payload, Some(state))
                }
            }
        }
        // Tensor by tensor: one tensor's values in memory at a time, and the output.
        Plan::Gradwire(method) => match &a.residual {
            None => {
                let (seed, step) = (a.seed.unwrap_or(0), a.step.unwrap_or(0));
                let (out, _) =
                    container::compress_each(&specs, method, seed, step, None, |i, _| {
                        input.read(i)
                    })
                    .map_err(in_input)?;
                (out, None)
            }
            Some(path) => {
                let State {
                    feedback: fb,
                    output,
                } = load_state(path, method, a.seed)?;
                check_state_method(path, &fb, &method)?;
                check_state_step(path, &fb, a.step)?;
                check_state_names(path, &fb, &specs)?;
                let (seed, step) = (fb.seed(), fb.step());
                let (out, fb) =
                    container::compress_each(&specs, method, seed, step, Some(fb), |i, _| {
                        input.read(i)
                    })
                    .map_err(in_input)?;
                let Some(fb) = fb else {
                    return Err(CliError::new("the error-feedback state was lost"));
                };
                check_pair(path, output, &a.output, &out)?;
                let state = state_bytes(&fb, &out)?;
                (out, Some(state))
            }
        },
    };
    match (&a.residual, &state) {
        // The output first, then the state that records it (see `check_pair`).
        (Some(path), Some(state)) => {
            io::write_all_atomic(&[(a.output.as_path(), &out), (path.as_path(), state)])
        }
        _ => io::write_all_atomic(&[(a.output.as_path(), &out)]),
    }
}

enum Plan {
    Gradwire(Method),
    Reference(Mode, f64),
}

/// The layout of `bytes`: given, or detected from the container magic. A reference payload
/// must at least be a safetensors file: anything else is named as neither (before a missing
/// `--shapes` or the payload's own checks would speak for it).
fn layout_of(path: &Path, bytes: &[u8], given: Option<Layout>) -> Result<Layout, CliError> {
    let detected = if container::is_container(bytes) {
        Layout::Gradwire
    } else {
        Layout::Reference
    };
    match (given, detected) {
        (Some(Layout::Gradwire), Layout::Reference) => {
            return Err(CliError::new(format!(
                "{}: not a gradwire container (bad magic)",
                path.display()
            )));
        }
        (Some(Layout::Reference), Layout::Gradwire) => {
            return Err(CliError::usage(format!(
                "{} is a gradwire container: --layout reference does not apply",
                path.display()
            )));
        }
        _ => {}
    }
    if detected == Layout::Reference
        && let Err(e) = crate::safetensors_reader::read_header(bytes)
    {
        let what = if given.is_some() {
            "not a valid reference payload (safetensors)"
        } else {
            "neither a gradwire container nor a valid safetensors file"
        };
        return Err(io::safetensors_error(path, what, &e));
    }
    Ok(detected)
}

/// Whether `a` and `b` name the same file (links and `..` resolved; a file that does not exist
/// yet by its resolved directory and name).
fn same_file(a: &Path, b: &Path) -> bool {
    fn resolved(p: &Path) -> Option<PathBuf> {
        if let Ok(c) = std::fs::canonicalize(p) {
            return Some(c);
        }
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        Some(std::fs::canonicalize(dir).ok()?.join(p.file_name()?))
    }
    a == b || matches!((resolved(a), resolved(b)), (Some(x), Some(y)) if x == y)
}

/// Refuses an output path that names one of the command's input files: writing it would
/// replace that input.
fn check_output(output: &Path, inputs: &[(&str, &Path)]) -> Result<(), CliError> {
    match inputs.iter().find(|(_, p)| same_file(output, p)) {
        Some((what, _)) => Err(CliError::usage(format!(
            "-o {} is the {what}: writing it would replace that file",
            output.display()
        ))),
        None => Ok(()),
    }
}

/// The receiver's model of `--shapes`: names and shapes from its safetensors header alone (its
/// data, possibly gigabytes of weights, is not read).
fn specs_from(path: &Path) -> Result<Vec<TensorSpec>, CliError> {
    Ok(io::read_shapes(path)?
        .into_iter()
        .map(|(n, s)| TensorSpec::new(n, s))
        .collect())
}

fn decompress(a: &DecompressArgs) -> Result<(), CliError> {
    // A missing input or model is for the reads below to report.
    let inputs: Vec<(&str, &Path)> = [("input", a.input.as_path())]
        .into_iter()
        .chain(a.shapes.as_deref().map(|s| ("--shapes model", s)))
        .filter(|(_, p)| p.exists())
        .collect();
    check_output(&a.output, &inputs)?;
    // With the receiver's model, a container must describe exactly that model (checked before
    // anything is allocated), so the model bounds the output; without one, the container's
    // own declaration is capped. Either way the bound counts the metadata too, and is checked
    // on the container's header before the rest of the file is read.
    let specs = a.shapes.as_deref().map(specs_from).transpose()?;
    let max = match &specs {
        Some(specs) => container::model_charge(specs).max(a.max_elements),
        None => a.max_elements,
    };
    let bytes = io::read_bounded(&a.input, max, a.layout)?;
    let layout = layout_of(&a.input, &bytes, a.layout)?;
    if layout == Layout::Gradwire && a.mode.is_some() {
        return Err(CliError::usage("--mode applies to the reference layout"));
    }
    match layout {
        Layout::Gradwire => {
            let in_input = |e: crate::Error| CliError::from(e).in_file(&a.input);
            let header = container::ContainerHeader::read_for(&bytes, specs.as_deref(), max)
                .map_err(in_input)?;
            let head = io::model_header(
                header
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.shape.as_slice())),
            )?;
            // Tensor by tensor: the memory held is the largest tensor's, the file written the
            // model's; a failure part way removes the temporary file.
            let staged = io::stage_with(&a.output, |file| {
                let mut w = io::SparseWriter::new(file, &a.output);
                w.bytes(&head)?;
                header
                    .decode_each(&bytes, |_, values| w.f32s(values))
                    .map_err(|e: CliError| e.in_file(&a.input))?;
                w.finish()
            })?;
            staged.commit()
        }
        Layout::Reference => {
            let Some(shapes) = &a.shapes else {
                return Err(CliError::usage(
                    "the reference layout does not carry shapes: give the model with \
                     --shapes MODEL.safetensors",
                ));
            };
            let specs = match specs {
                Some(specs) => specs,
                None => specs_from(shapes)?,
            };
            let mode = match &a.mode {
                Some(m) => m.parse::<Mode>()?,
                None => {
                    reference::summarize(&bytes)
                        .map_err(|e| CliError::new(format!("{}: {e}", a.input.display())))?
                        .0
                }
            };
            let dense = reference::decode(&bytes, mode, &specs)
                .map_err(|e| CliError::new(format!("{}: {e}", a.input.display())))?;
            let head =
                io::model_header(specs.iter().map(|s| (s.name.as_str(), s.shape.as_slice())))?;
            let staged = io::stage_with(&a.output, |file| {
                let mut w = io::SparseWriter::new(file, &a.output);
                w.bytes(&head)?;
                for d in &dense {
                    w.f32s(d)?;
                }
                w.finish()
            })?;
            staged.commit()
        }
    }
}

fn inspect(a: &InspectArgs) -> Result<(), CliError> {
    let bytes = io::read_bounded(&a.input, a.max_elements, a.layout)?;
    let layout = layout_of(&a.input, &bytes, a.layout)?;
    let rep = match layout {
        Layout::Gradwire => {
            if a.shapes.is_some() {
                return Err(CliError::usage(
                    "--shapes applies to reference payloads (a container carries its shapes)",
                ));
            }
            report::container(&a.input, &bytes, a.max_elements)?
        }
        Layout::Reference => {
            let specs = a.shapes.as_deref().map(specs_from).transpose()?;
            report::reference(&a.input, &bytes, specs.as_deref())?
        }
    };
    let text = if a.json { rep.to_json() } else { rep.to_text() };
    print!("{text}");
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::{Cli, Command, compress, decompress, inspect};
    use crate::feedback::checkpoint::tests::{counting_reads, fifo};
    use clap::Parser;
    use std::path::PathBuf;

    /// Issue 48 class 5: `inspect /dev/zero` (read until memory ran out) and `inspect FIFO`
    /// with no writer (blocked forever) fail at once naming the file, having read at most 64
    /// KiB (`/proc/thread-self/io`: in fact nothing); the same for `decompress` and `compress`
    /// of them (the command lines parsed as the tool parses its own).
    #[test]
    fn inputs_that_are_devices_or_fifos_fail_naming_the_file_having_read_at_most_64_kib() {
        let fifo = fifo("cli");
        for input in [PathBuf::from("/dev/zero"), fifo.clone()] {
            let shown = input.display().to_string();
            let out = std::env::temp_dir().join(format!("gradwire-cli-out-{}", std::process::id()));
            for line in [
                vec!["gradwire", "inspect", &shown],
                vec![
                    "gradwire",
                    "decompress",
                    &shown,
                    "-o",
                    out.to_str().unwrap(),
                ],
                vec!["gradwire", "compress", &shown, "-o", out.to_str().unwrap()],
            ] {
                let cli = Cli::try_parse_from(&line).unwrap();
                let (result, read) = counting_reads("a command", move || {
                    match cli.command {
                        Command::Compress(a) => compress(&a),
                        Command::Decompress(a) => decompress(&a),
                        Command::Inspect(a) => inspect(&a),
                    }
                    .map_err(|e| e.message)
                });
                let e = result.unwrap_err();
                assert!(
                    e.contains(&shown) && e.contains("not a regular file"),
                    "{line:?}: {e}"
                );
                assert!(read <= 64 << 10, "{line:?}: {read} bytes read");
                assert!(!out.exists());
            }
        }
        let _ = std::fs::remove_dir_all(fifo.parent().unwrap());
    }
}

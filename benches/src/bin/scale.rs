//! One whole `CompressedAllReduce` step at real model sizes: GPT-2-small (124M values) and
//! OPT-1.3B's shapes, over `gradwire::comm::LocalGroup` threads (W ranks = W threads of one
//! process), next to the read pass and to the kernel floor (gradwire-core's kernels alone on
//! the step's own tensors).
//!
//! `cargo run --release -p gradwire-benches --bin scale -- [--shapes gpt2|opt1.3b|small]
//! [--small] [--workers 1,2,4] [--methods LIST] [--collectives all-gather,two-phase,auto]
//! [--parallelism serial,auto] [--steps 4] [--chunk-bytes 4194304] [--in-place] [--json PATH]`
//!
//! Defaults: `--shapes gpt2 --workers 1,2,4 --collectives all-gather,two-phase,auto
//! --parallelism serial,auto --steps 4 --chunk-bytes 4194304` (the library's default chunk
//! bound, `CompressedAllReduce::with_chunk_bytes`) and every method. `--small` runs the `small`
//! shapes at W = 1 and 3 for 3 steps, every method and collective, serial only, with a chunk
//! bound of 64 KiB (flags given beside it override those). `--methods` is a comma-separated list of names (`topk-1%-int8-ef`,
//! `sign-ef`, `quant4-ef`, `dense-f32`, `dense-bf16`) or method texts as
//! `gradwire::method::parse` reads them, with ` +ef` at the end for error feedback (for example
//! `topk k=ratio:0.001 values=f32 +ef`). `--in-place` runs every step with
//! `all_reduce_in_place` on buffers the gradient is copied into before each step (outside the
//! timing, as a backward pass writes its gradients), the result written over them.
//!
//! # Shapes
//! - `gpt2`: GPT-2-small's 148 tensors, 124,439,808 values (`wte` [50257, 768], `wpe`
//!   [1024, 768], 12 blocks of `ln_1`, `attn.c_attn` [768, 2304], `attn.c_proj`, `ln_2`,
//!   `mlp.c_fc` [768, 3072], `mlp.c_proj` [3072, 768] with their biases, then `ln_f`).
//! - `opt1.3b`: OPT-1.3B's 388 tensors, 1,315,758,080 values (`embed_tokens` [50272, 2048],
//!   `embed_positions` [2050, 2048], 24 layers of q/k/v/out projections [2048, 2048] with
//!   biases, two layer norms, `fc1` [8192, 2048], `fc2` [2048, 8192] with biases, then the
//!   final layer norm; the LM head is tied to `embed_tokens`, so it is not a tensor of its
//!   own). Run at W = 1 only: one copy is 5.26 GB.
//! - `small`: 10 tensors, 1,975,163 values (four above 256k elements, a 0-d tensor, a
//!   1-element one, odd lengths), for a run of every row in well under 2 minutes.
//!
//! Both counts are checked at startup.
//!
//! # Gradients
//! Each rank thread generates its own gradients in place, once, before any timing; every step
//! reuses them. Tensor `t` of rank `r` is a SplitMix64 stream seeded from `(r, t)`; each 32
//! bits of it make one f32: a random sign, a random 23-bit mantissa and a binary exponent
//! `-16 + e`, where `e` is the sum of four uniform draws from {0, 1, 2, 3} (a bell over 13
//! binades, mean 6: magnitudes in [2^-16, 2^-3), most near 2^-10, standard deviation 2.2
//! binades), so that magnitudes span several binades like real gradients.
//!
//! # Rows
//! A row is (shapes, method, collective, W, parallelism), run in a child process of its own
//! (this binary with a hidden `--row` argument, printing one JSON line), so that the peak RSS
//! and the allocator's state are the row's. Dense f32 takes the dense all-reduce route
//! whatever the collective, so it runs once per W with the collective `all-reduce`. A
//! combination the library refuses (its own `Err`) is a row with the error's text and
//! `refused: true`.
//!
//! In the child: every rank thread generates its gradients and an output map of the same
//! shapes, written with zeros (its pages mapped, as a training loop's outputs of an earlier
//! step would be; `all_reduce_into` reuses them); every rank writes and frees a block of
//! `2n + 2n / W` f32 (the worker's and the owner's residuals, twice; within 80% of
//! `MemAvailable`), untimed, so that the pages step 1 maps are ones the machine has used
//! before (on a virtual machine a never-used page costs the host's fault as well:
//! docs/scale.md, round 12); then at a barrier rank 0 writes `5` to
//! `/proc/self/clear_refs` (resets the peak RSS) and reads the RSS baseline. Each step starts at
//! a barrier where rank 0 reads the wall clock and the process's CPU time
//! (`CLOCK_PROCESS_CPUTIME_ID`); every rank calls `all_reduce_into` (or, `--in-place`,
//! `all_reduce_in_place` on the buffers that stand for the outputs); at the next barrier rank 0
//! reads both clocks again. Step 1 includes the construction of the `CompressedAllReduce`
//! (made after the step's first barrier) and so the first-step set-up (manifest, buffers,
//! rayon's pool). Each rank's communicator is the `LocalCommunicator` wrapped in a recording
//! one that notes the largest buffer passed to any call.
//!
//! # Columns and JSON fields
//! Every row of the table and every JSON row (one per line from a child; in `rows` of the
//! `--json` document `{"schema": "gradwire-scale/1", "build": .., "rows": [..]}`) has:
//! - `shapes`, `parameters` (values of the shape set), `tensors`;
//! - `method` (the core method's text form, ` +ef` appended with error feedback), `label`
//!   (the name given on the command line), `error_feedback`;
//! - `collective` (asked: `all-gather`, `two-phase`, `auto`, or `all-reduce` for dense f32),
//!   `collective_in_use` (`collective_in_use()` after the last step; null on the dense route),
//!   `workers` (W), `parallelism`, `in_place` (`--in-place`), `steps` (S);
//! - `step_wall_s`: each step's wall time (the table's "wall s" lists them);
//! - `step_cpu_per_rank_s`: each step's process CPU time divided by W;
//! - `median_cpu_s` / `median_wall_s`: medians over steps 2..=S (table: "cpu/rank");
//! - `first_step_over_later`: step 1's wall time over `median_wall_s`;
//! - `state_bytes_per_rank`: the state the method keeps per rank (the worker's f32 residual
//!   with error feedback, plus on the two-phase collective the owner's n / W server residual
//!   and the n / W copy of it that a failed step is restored from; 0 without);
//!   `fresh_write_s`: after the steps, all W ranks at once allocate that much and write it once
//!   (fresh pages: the first touch of a new state), wall time, median of 3;
//!   `first_step_over_allowance`: step 1's wall time over `median_wall_s + fresh_write_s`
//!   (the first-step target: at most a later step plus one write pass over the fresh state;
//!   table: "1st/allow");
//! - `read_pass_s`: after the steps, all W ranks at once run `read_pass` over every tensor of
//!   their gradient, timed as a step (process CPU time / W between barriers), the median of 3;
//!   `read_passes` = `median_cpu_s` / `read_pass_s` (table: "reads");
//! - `kernel_floor_s`, `floor` (`kernel` or `dense`), `floor_of` (whose floor: `all-gather`,
//!   `two-phase` or `dense`), `floor_ratio` = `median_cpu_s` / `kernel_floor_s` (table:
//!   "floor x"); `kernel_floor_wall_s`: the floor's wall time, the W ranks at once (what a
//!   step of W ranks sharing this machine's cores could take at best: netsim's codec floor).
//!   The floor is gradwire-core's kernels alone on the step's own tensors, run after
//!   the timed steps by the W rank threads at once (so that it shares the cores as the ranks
//!   do), timed as the read pass, median of 3. Its buffers are allocated after the RSS
//!   measurement. Per rank, per tensor:
//!   - all-gather: the worker's error-feedback step (`feedback_step_bounded` on a residual of
//!     the tensor's size; `encode_into` without error feedback), then that frame decoded into an
//!     output buffer of the tensor's size (`decode_into`, which writes every element as a zeroed
//!     output would need) and accumulated W - 1 more times (`accumulate_into`: the decodes of
//!     the W ranks' frames), then one pass multiplying the output by 1/W;
//!   - two-phase (and `auto` where it picked two-phase; where it picked the all-gather, the
//!     all-gather's floor): the worker's error-feedback step on each of its W contiguous shards
//!     (shard j = `j n / W .. (j + 1) n / W`; top-k keeps the tensor's k split over the shards
//!     by largest remainder), then the owner's part on its own shard: the shard frame decoded
//!     into a shard-size sum and accumulated W - 1 more times, an error-feedback step of the sum
//!     on a server residual (which adds the residual in) or an encode, that owner frame decoded
//!     into W shard-size ranges of the output (the W owners' frames), and the 1/W pass;
//!   - dense f32 (`floor: "dense"`): the rank reads the W contributions of its shard (here W
//!     shard-size ranges of its own gradient) and writes their rank-order sum, then copies the
//!     other W - 1 shards into its output; at W = 1, one read pass plus one memcpy.
//!
//!   The floor writes its own output buffer (one of the largest tensor's size), not the output
//!   map: `Tensor` has no public mutable access to its elements.
//! - `max_message_bytes`: the largest buffer any rank passed to its communicator
//!   (`all_gather`: the local buffer; `all_to_all`: the largest per-peer buffer;
//!   `all_reduce_sum_f32`: 4 x the element count), over all steps (table: "max msg"); at most
//!   `chunk_bytes` (the row's chunk bound; the compressed collectives' windows are at least
//!   4 KiB);
//! - `sent_bytes` / `received_bytes`: the communicator's logical counters
//!   (`CompressedAllReduce::traffic`) over the last step, the maximum over ranks (table:
//!   "sent/recv");
//! - `rss_baseline_bytes`: the RSS right after the reset (gradients and outputs written, nothing
//!   of the all-reduce made yet); `peak_rss_bytes`: `VmHWM` after the steps; `peak_over_baseline_mb`: their
//!   difference in MB (10^6 bytes); `bytes_per_param_beyond` = (`VmHWM` - W x (gradient bytes +
//!   output bytes)) / W / parameters (table: "B/param"; null on a failed row, whose outputs
//!   were never written); `rss_note`: why they are null, when they are (the reset failed);
//! - `identical`: whether the W ranks' outputs are bit-identical after the last step (a hash of
//!   every tensor's f32 bits, by name); `output_hash`: rank 0's, hex;
//! - checkpoints, on rows with error feedback (null on the others and on failed rows), after the
//!   steps and before the read pass: `checkpoint_bytes` (rank 0's files: worker residuals, plus
//!   server residuals on the two-phase collective); `checkpoint_save_s`: the W ranks at once
//!   save them (`save_feedback`, `save_server_residuals`) into a temporary directory, wall
//!   time; `checkpoint_load_s`: after the all-reduce is dropped (its residuals freed), the W
//!   ranks at once load them into a new compressor and a new all-reduce, as a resuming job
//!   would (`load_feedback`, `load_server_residuals`); `checkpoint_save_over_step_mb` and
//!   `checkpoint_load_over_step_mb`: the peak RSS of each (reset before it) minus the step
//!   phase's `peak_rss_bytes`, MB (the target: at most 64);
//! - `generate_s`: rank 0's wall time to generate its gradients; `row_wall_s`: the child's
//!   whole run;
//! - `error` (null or the text), `refused` (whether the error is the library's own).
//!
//! Fields that a failed row did not measure are null. Exit status 1 when a row is not
//! bit-identical, lacks a field, or failed other than by a refusal of the library (a child that
//! died, printed no JSON, or whose kernel floor failed); 2 for bad arguments.

use std::collections::HashMap;
use std::hint::black_box;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use gradwire::comm::{CommError, Communicator, LocalCommunicator, LocalGroup, Traffic};
use gradwire::core::{
    K, Method, Params, ResidualBound, Values, accumulate_into, decode_into, encode_into,
    feedback_step_bounded, max_frame_len, scratch_len,
};
use gradwire::tensor::Tensor;
use gradwire::{Collective, CompressedAllReduce, CompressionMethod, Parallelism, TensorMut};
use gradwire_benches::{build_name, read_pass};
use serde_json::{Map, Value, json};

/// The JSON document's schema.
const SCHEMA: &str = "gradwire-scale/1";

/// Every field of a row (see the module docs; `serde_json` writes them sorted by name).
const FIELDS: &[&str] = &[
    "shapes",
    "parameters",
    "tensors",
    "method",
    "label",
    "error_feedback",
    "collective",
    "collective_in_use",
    "workers",
    "parallelism",
    "chunk_bytes",
    "in_place",
    "steps",
    "step_wall_s",
    "step_cpu_per_rank_s",
    "median_cpu_s",
    "median_wall_s",
    "first_step_over_later",
    "state_bytes_per_rank",
    "fresh_write_s",
    "first_step_over_allowance",
    "read_pass_s",
    "read_passes",
    "kernel_floor_s",
    "kernel_floor_wall_s",
    "floor",
    "floor_of",
    "floor_ratio",
    "max_message_bytes",
    "sent_bytes",
    "received_bytes",
    "rss_baseline_bytes",
    "peak_rss_bytes",
    "peak_over_baseline_mb",
    "bytes_per_param_beyond",
    "rss_note",
    "identical",
    "output_hash",
    "checkpoint_bytes",
    "checkpoint_save_s",
    "checkpoint_load_s",
    "checkpoint_save_over_step_mb",
    "checkpoint_load_over_step_mb",
    "generate_s",
    "row_wall_s",
    "error",
    "refused",
];

/// Repetitions of the read pass and of the kernel floor (the median is reported).
const REPS: usize = 3;

/// The usage line (`--help` prints it; a bad argument prints it to stderr).
const USAGE: &str = "usage: scale [--shapes gpt2|opt1.3b|small] [--small] [--workers 1,2,4] \
     [--methods LIST] [--collectives all-gather,two-phase,auto] [--parallelism serial,auto] \
     [--steps 4] [--chunk-bytes 4194304] [--in-place] [--json PATH]\n\
     methods: topk-1%-int8-ef, sign-ef, quant4-ef, dense-f32, dense-bf16, or a method text \
     (`topk k=ratio:0.01 values=int8:256`) with ` +ef` for error feedback";

// ---------------------------------------------------------------------------------------------
// Shapes

/// The tensors of shape set `set`: (name, shape), in model order.
///
/// # Errors
/// An unknown set.
fn shape_set(set: &str) -> Result<Vec<(String, Vec<usize>)>, String> {
    let mut t: Vec<(String, Vec<usize>)> = Vec::new();
    let mut add = |name: String, shape: &[usize]| t.push((name, shape.to_vec()));
    match set {
        "gpt2" => {
            // GPT-2 small's shapes, shared with the demo's replay (testdata/README.md).
            const GPT2: &str = include_str!("../../../testdata/shapes/gpt2-small.txt");
            for line in GPT2
                .lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
            {
                let mut words = line.split_whitespace();
                let name = words.next().unwrap_or_default();
                let shape: Result<Vec<usize>, _> = words.map(str::parse).collect();
                let shape = shape.map_err(|e| format!("gpt2 shapes, `{line}`: {e}"))?;
                add(name.to_owned(), &shape);
            }
        }
        "opt1.3b" => {
            let (d, ffn) = (2048, 8192);
            let p = "model.decoder";
            add(format!("{p}.embed_tokens.weight"), &[50272, d]);
            // OPT's learned positions have 2 more rows than the 2048 positions (an offset).
            add(format!("{p}.embed_positions.weight"), &[2050, d]);
            for i in 0..24 {
                let l = |s: &str| format!("{p}.layers.{i}.{s}");
                for proj in ["k_proj", "v_proj", "q_proj", "out_proj"] {
                    add(l(&format!("self_attn.{proj}.weight")), &[d, d]);
                    add(l(&format!("self_attn.{proj}.bias")), &[d]);
                }
                add(l("self_attn_layer_norm.weight"), &[d]);
                add(l("self_attn_layer_norm.bias"), &[d]);
                add(l("fc1.weight"), &[ffn, d]);
                add(l("fc1.bias"), &[ffn]);
                add(l("fc2.weight"), &[d, ffn]);
                add(l("fc2.bias"), &[d]);
                add(l("final_layer_norm.weight"), &[d]);
                add(l("final_layer_norm.bias"), &[d]);
            }
            add(format!("{p}.final_layer_norm.weight"), &[d]);
            add(format!("{p}.final_layer_norm.bias"), &[d]);
        }
        "small" => {
            add("embed.weight".into(), &[1000, 640]);
            add("block.0.fc.weight".into(), &[512, 1024]);
            add("block.0.fc.bias".into(), &[1024]);
            add("block.0.proj.weight".into(), &[1024, 300]);
            add("block.0.ln.weight".into(), &[640]);
            add("block.1.fc.weight".into(), &[400, 1000]);
            add("block.1.ln.bias".into(), &[999]);
            add("head.weight".into(), &[130, 777]);
            add("scale".into(), &[]);
            add("one".into(), &[1]);
        }
        other => return Err(format!("unknown shapes `{other}` (gpt2, opt1.3b, small)")),
    }
    Ok(t)
}

/// Elements of `shape` (1 for a 0-d tensor).
fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Checks the tensor and value counts of the named shape sets.
///
/// # Errors
/// The first set whose counts are not the model's.
fn check_shape_sets() -> Result<(), String> {
    for (set, tensors, values) in [
        ("gpt2", 148, 124_439_808usize),
        ("opt1.3b", 388, 1_315_758_080),
        ("small", 10, 1_975_163),
    ] {
        let s = shape_set(set)?;
        let n: usize = s.iter().map(|(_, sh)| numel(sh)).sum();
        if s.len() != tensors || n != values {
            return Err(format!(
                "shape set {set}: {} tensors, {n} values; expected {tensors}, {values}",
                s.len()
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Gradients

/// One SplitMix64 output, advancing `state`.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One heavy-tailed value from 32 random bits (see the module docs, "Gradients"): bit 31 the
/// sign, bits 0..23 the mantissa, bits 23..31 four 2-bit draws whose sum is the exponent above
/// 2^-16.
fn value_of(b: u32) -> f32 {
    let e = ((b >> 23) & 3) + ((b >> 25) & 3) + ((b >> 27) & 3) + ((b >> 29) & 3);
    f32::from_bits((b & 0x8000_0000) | ((127 - 16 + e) << 23) | (b & 0x007f_ffff))
}

/// Fills `x` with the stream of `seed`, two values per draw.
fn fill_gradient(x: &mut [f32], seed: u64) {
    let mut s = seed;
    let mut pairs = x.chunks_exact_mut(2);
    for p in &mut pairs {
        let r = splitmix(&mut s);
        p[0] = value_of(r as u32);
        p[1] = value_of((r >> 32) as u32);
    }
    for v in pairs.into_remainder() {
        *v = value_of(splitmix(&mut s) as u32);
    }
}

/// Rank `rank`'s gradients of `shapes`, each tensor seeded from (rank, tensor index).
fn generate(shapes: &[(String, Vec<usize>)], rank: usize) -> HashMap<String, Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let mut data = vec![0.0f32; numel(shape)];
            let mut seed = ((rank as u64) << 32) ^ t as u64 ^ 0x5ca1_e000_0000_0000;
            fill_gradient(&mut data, splitmix(&mut seed));
            let tensor = Tensor::new(shape.clone(), data).expect("shape and data agree");
            (name.clone(), tensor)
        })
        .collect()
}

/// A 64-bit hash of every tensor of `out`, by name: the names, shapes and f32 bits.
fn hash_outputs(out: &HashMap<String, Tensor>) -> u64 {
    hash_tensors(out.iter().map(|(n, t)| (n.as_str(), t.shape(), t.data())))
}

/// As [`hash_outputs`], for tensors given as (name, shape, elements), in any order.
fn hash_tensors<'t>(tensors: impl Iterator<Item = (&'t str, &'t [usize], &'t [f32])>) -> u64 {
    const M: u64 = 0x0000_0100_0000_01b3;
    let mut tensors: Vec<_> = tensors.collect();
    tensors.sort_by(|a, b| a.0.cmp(b.0));
    let mut lanes = [0xcbf2_9ce4_8422_2325u64; 4];
    let mut mix = |lane: usize, w: u64| lanes[lane] = (lanes[lane] ^ w).wrapping_mul(M);
    for (name, shape, data) in tensors {
        for b in name.bytes() {
            mix(0, u64::from(b));
        }
        for &d in shape {
            mix(1, d as u64);
        }
        let mut chunks = data.chunks_exact(4);
        for c in &mut chunks {
            for (lane, v) in c.iter().enumerate() {
                mix(lane, u64::from(v.to_bits()));
            }
        }
        for v in chunks.remainder() {
            mix(2, u64::from(v.to_bits()));
        }
    }
    lanes
        .iter()
        .fold(0u64, |h, &l| (h ^ l).wrapping_mul(M).rotate_left(29))
}

// ---------------------------------------------------------------------------------------------
// Methods and rows

/// A method of a row: the library's method and the core method it lowers to.
#[derive(Clone)]
struct MethodSpec {
    /// The library's method.
    method: CompressionMethod,
    /// The core method (what makes the frames).
    core: Method,
    /// Whether error feedback wraps it.
    ef: bool,
}

impl MethodSpec {
    /// The text form: the core method's, with ` +ef` for error feedback.
    fn text(&self) -> String {
        let t = gradwire::method::format(&self.core);
        if self.ef { format!("{t} +ef") } else { t }
    }

    /// Whether the step takes the dense f32 all-reduce route.
    fn dense_f32(&self) -> bool {
        self.core
            == Method::Dense {
                values: Values::F32,
            }
    }
}

/// The default methods, by name.
const METHOD_NAMES: [&str; 5] = [
    "topk-1%-int8-ef",
    "sign-ef",
    "quant4-ef",
    "dense-f32",
    "dense-bf16",
];

/// The method named or written `item` (see the module docs).
///
/// # Errors
/// A text the library does not parse, or a method it does not accept.
fn parse_method(item: &str) -> Result<MethodSpec, String> {
    let item = item.trim();
    let method = match item {
        "topk-1%-int8-ef" => CompressionMethod::top_k_int8(0.01).with_error_feedback(),
        "sign-ef" => CompressionMethod::SignSGD.with_error_feedback(),
        "quant4-ef" => CompressionMethod::Quantization { bits: 4 }.with_error_feedback(),
        "dense-f32" => CompressionMethod::Core(Method::Dense {
            values: Values::F32,
        }),
        "dense-bf16" => CompressionMethod::BFloat16,
        text => {
            let (text, ef) = match text.strip_suffix("+ef") {
                Some(t) => (t.trim_end(), true),
                None => (text, false),
            };
            let m = CompressionMethod::Core(
                gradwire::method::parse(text).map_err(|e| format!("--methods: {e}"))?,
            );
            if ef { m.with_error_feedback() } else { m }
        }
    };
    let core = method
        .core_method()
        .map_err(|e| format!("--methods {item}: {e}"))?;
    let ef = matches!(method, CompressionMethod::ErrorFeedback { .. });
    Ok(MethodSpec { method, core, ef })
}

/// The text of a collective (`all-reduce` for the dense route).
fn collective_name(c: Option<Collective>) -> &'static str {
    match c {
        Some(Collective::AllGather) => "all-gather",
        Some(Collective::TwoPhase) => "two-phase",
        Some(Collective::Auto) => "auto",
        None => "all-reduce",
    }
}

/// The collective named `s` (`all-reduce`: none, the dense route).
fn parse_collective(s: &str) -> Result<Option<Collective>, String> {
    match s {
        "all-gather" => Ok(Some(Collective::AllGather)),
        "two-phase" => Ok(Some(Collective::TwoPhase)),
        "auto" => Ok(Some(Collective::Auto)),
        "all-reduce" => Ok(None),
        other => Err(format!(
            "unknown collective `{other}` (all-gather, two-phase, auto)"
        )),
    }
}

/// The parallelism named `s`.
fn parse_parallelism(s: &str) -> Result<Parallelism, String> {
    match s {
        "serial" => Ok(Parallelism::Serial),
        "auto" => Ok(Parallelism::Auto),
        "parallel" => Ok(Parallelism::Parallel),
        other => Err(format!(
            "unknown parallelism `{other}` (serial, auto, parallel)"
        )),
    }
}

/// One row: what the child process runs.
#[derive(Clone)]
struct RowSpec {
    /// Shape set name.
    shapes: String,
    /// Method item as given (re-parsed by the child).
    method: String,
    /// Collective text (`all-reduce` for dense f32).
    collective: String,
    /// W.
    workers: usize,
    /// Parallelism text.
    parallelism: String,
    /// The chunk bound (`CompressedAllReduce::with_chunk_bytes`).
    chunk_bytes: usize,
    /// Whether the steps run in place (`all_reduce_in_place`).
    in_place: bool,
    /// S.
    steps: usize,
}

impl RowSpec {
    /// The child's arguments after `--row`.
    fn args(&self) -> Vec<String> {
        vec![
            self.shapes.clone(),
            self.method.clone(),
            self.collective.clone(),
            self.workers.to_string(),
            self.parallelism.clone(),
            self.chunk_bytes.to_string(),
            self.in_place.to_string(),
            self.steps.to_string(),
        ]
    }

    /// The row from the child's arguments.
    fn from_args(a: &[String]) -> Result<Self, String> {
        let [
            shapes,
            method,
            collective,
            workers,
            parallelism,
            chunk,
            in_place,
            steps,
        ] = a
        else {
            return Err(
                "--row SHAPES METHOD COLLECTIVE W PARALLELISM CHUNK_BYTES IN_PLACE STEPS".into(),
            );
        };
        Ok(RowSpec {
            shapes: shapes.clone(),
            method: method.clone(),
            collective: collective.clone(),
            workers: workers.parse().map_err(|e| format!("W {workers}: {e}"))?,
            parallelism: parallelism.clone(),
            chunk_bytes: chunk.parse().map_err(|e| format!("chunk {chunk}: {e}"))?,
            in_place: in_place
                .parse()
                .map_err(|e| format!("in place {in_place}: {e}"))?,
            steps: steps.parse().map_err(|e| format!("steps {steps}: {e}"))?,
        })
    }

    /// A row with every field null but those that name it.
    fn skeleton(&self) -> Map<String, Value> {
        let mut row: Map<String, Value> = FIELDS
            .iter()
            .map(|f| ((*f).to_owned(), Value::Null))
            .collect();
        row.insert("shapes".into(), json!(self.shapes));
        row.insert("chunk_bytes".into(), json!(self.chunk_bytes));
        row.insert("in_place".into(), json!(self.in_place));
        if let Ok(s) = shape_set(&self.shapes) {
            let n: usize = s.iter().map(|(_, sh)| numel(sh)).sum();
            row.insert("parameters".into(), json!(n));
            row.insert("tensors".into(), json!(s.len()));
        }
        match parse_method(&self.method) {
            Ok(m) => {
                row.insert("method".into(), json!(m.text()));
                row.insert("error_feedback".into(), json!(m.ef));
            }
            Err(_) => {
                row.insert("method".into(), json!(self.method));
            }
        }
        row.insert("label".into(), json!(self.method));
        row.insert("collective".into(), json!(self.collective));
        row.insert("workers".into(), json!(self.workers));
        row.insert("parallelism".into(), json!(self.parallelism));
        row.insert("steps".into(), json!(self.steps));
        row.insert("refused".into(), json!(false));
        row
    }
}

// ---------------------------------------------------------------------------------------------
// The recording communicator

/// A communicator that delegates every call to `inner` and notes the largest buffer passed to
/// any call, in bytes, in `max`.
struct Recording {
    /// The rank's `LocalGroup` communicator.
    inner: LocalCommunicator,
    /// The largest buffer so far (shared with the rank thread).
    max: Arc<AtomicUsize>,
}

impl Recording {
    /// Notes a buffer of `bytes`.
    fn note(&self, bytes: usize) {
        self.max.fetch_max(bytes, Ordering::Relaxed);
    }
}

impl Communicator for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.note(local.len());
        self.inner.all_gather(local, max_len, out)
    }

    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.note(local.len());
        self.inner.all_gather_append(local, max_len, out)
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.note(send.iter().map(Vec::len).max().unwrap_or(0));
        self.inner.all_to_all(send, max_len, out)
    }

    fn all_to_all_append(
        &mut self,
        send: &[&[u8]],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        self.note(send.iter().map(|b| b.len()).max().unwrap_or(0));
        self.inner.all_to_all_append(send, max_len, out)
    }

    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }

    fn close(&mut self, reason: &str) -> Option<String> {
        self.inner.close(reason)
    }

    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), CommError> {
        self.note(4 * x.len());
        self.inner.all_reduce_sum_f32(x)
    }
}

// ---------------------------------------------------------------------------------------------
// Clocks and memory

/// The process's CPU time (every thread), in seconds.
fn cpu_now() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Field `key` (`VmRSS`, `VmHWM`) of `/proc/self/status`, in bytes.
fn proc_status(key: &str) -> Result<u64, String> {
    let s = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let line = s
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .ok_or_else(|| format!("no {key} in /proc/self/status"))?;
    let kb: u64 = line
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .map_err(|e| format!("{key}: {e}"))?;
    Ok(kb * 1024)
}

/// The memory the system can give without swapping (`MemAvailable` of `/proc/meminfo`), in
/// bytes; `None` where it cannot be read.
fn available_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Resets the peak RSS (`5` to `/proc/self/clear_refs`) and reads the RSS after it.
fn reset_peak() -> Result<u64, String> {
    std::fs::write("/proc/self/clear_refs", "5")
        .map_err(|e| format!("writing 5 to /proc/self/clear_refs: {e}"))?;
    proc_status("VmRSS")
}

/// The median of `v` (the upper one of an even count); `None` when empty.
fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied()
}

// ---------------------------------------------------------------------------------------------
// The kernel floor

/// Whose floor a row is compared with.
#[derive(Clone, Copy, PartialEq)]
enum FloorKind {
    /// The all-gather's: encode, W decodes, the mean.
    AllGather,
    /// The two-phase collective's: W shard encodes, the owner's sum and encode, W decodes.
    TwoPhase,
    /// The dense f32 all-reduce's: the shard's sum and the copies.
    Dense,
}

impl FloorKind {
    /// Its text in the row.
    fn name(self) -> &'static str {
        match self {
            FloorKind::AllGather => "all-gather",
            FloorKind::TwoPhase => "two-phase",
            FloorKind::Dense => "dense",
        }
    }
}

/// Shard `j` of `n` elements over `w`: `j n / w .. (j + 1) n / w`.
fn shard(n: usize, w: usize, j: usize) -> (usize, usize) {
    (j * n / w, (j + 1) * n / w)
}

/// `k` entries split over shards of `lens` (summing to `n`) by largest remainder of
/// `k len_j / n`, ties to the lower shard.
fn budgets(k: u64, n: usize, lens: &[usize]) -> Vec<u64> {
    if n == 0 {
        return vec![0; lens.len()];
    }
    let (k, n) = (u128::from(k), n as u128);
    let mut b: Vec<u64> = lens.iter().map(|&l| (k * l as u128 / n) as u64).collect();
    let left = (k as u64).saturating_sub(b.iter().sum());
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&j| (std::cmp::Reverse(k * lens[j] as u128 % n), j));
    for &j in order.iter().take(left as usize) {
        b[j] += 1;
    }
    b
}

/// The method of a shard of a tensor of `n` elements: top-k keeps `budget` entries, the
/// others are the tensor's method.
fn shard_method(method: Method, budget: u64) -> Method {
    match method {
        Method::TopK { values, .. } => Method::TopK {
            k: K::Count(budget),
            values,
        },
        m => m,
    }
}

/// The entries top-k keeps of a tensor of `n` elements (0 for other methods).
fn tensor_k(method: Method, n: usize) -> u64 {
    match method {
        Method::TopK { k, .. } => k.resolve(n as u64),
        _ => 0,
    }
}

/// The kernel floor of one rank: its buffers (allocated after the RSS measurement).
struct Floor<'g> {
    /// The rank's gradients, in model order.
    grads: Vec<&'g [f32]>,
    /// Whose floor.
    kind: FloorKind,
    /// The core method.
    method: Method,
    /// Whether the worker (and the owner) run error-feedback steps.
    ef: bool,
    /// W.
    w: usize,
    /// This rank.
    rank: usize,
    /// Per tensor: the worker's residual (tensor size), with error feedback.
    residuals: Vec<Vec<f32>>,
    /// Per tensor, per shard (one for the all-gather): the bound of the worker's residual.
    bounds: Vec<Vec<ResidualBound>>,
    /// Per tensor: the owner's server residual (its shard's size), two-phase with error
    /// feedback.
    server: Vec<Vec<f32>>,
    /// Per tensor: the bound of the server residual.
    server_bounds: Vec<ResidualBound>,
    /// Per tensor: the top-k budget of each shard (two-phase).
    budgets: Vec<Vec<u64>>,
    /// The owner's shard-size sum (largest own shard).
    sum: Vec<f32>,
    /// The output (largest tensor).
    out: Vec<f32>,
    /// Encoder scratch (the largest any call needs).
    scratch: Vec<u32>,
    /// A frame buffer (the largest frame any call makes).
    frame: Vec<u8>,
    /// The frame of the rank's own shard (two-phase).
    own: Vec<u8>,
}

impl<'g> Floor<'g> {
    /// The buffers for `grads` (in model order) and `kind`.
    fn new(
        grads: Vec<&'g [f32]>,
        kind: FloorKind,
        method: Method,
        ef: bool,
        w: usize,
        rank: usize,
    ) -> Self {
        let mut f = Floor {
            kind,
            method,
            ef,
            w,
            rank,
            residuals: Vec::new(),
            bounds: Vec::new(),
            server: Vec::new(),
            server_bounds: Vec::new(),
            budgets: Vec::new(),
            sum: Vec::new(),
            out: vec![0.0; grads.iter().map(|g| g.len()).max().unwrap_or(0)],
            scratch: Vec::new(),
            frame: Vec::new(),
            own: Vec::new(),
            grads,
        };
        let (mut scratch, mut frame, mut sum) = (0usize, 0usize, 0usize);
        let mut need = |n: usize, m: &Method| {
            scratch = scratch.max(scratch_len(n, m));
            frame = frame.max(max_frame_len(n, m));
        };
        for g in &f.grads {
            let n = g.len();
            match kind {
                FloorKind::Dense => {}
                FloorKind::AllGather => {
                    need(n, &method);
                    if ef {
                        f.residuals.push(vec![0.0; n]);
                    }
                    f.bounds.push(vec![ResidualBound::ZERO]);
                }
                FloorKind::TwoPhase => {
                    let lens: Vec<usize> = (0..w)
                        .map(|j| {
                            let (a, b) = shard(n, w, j);
                            b - a
                        })
                        .collect();
                    let b = budgets(tensor_k(method, n), n, &lens);
                    for (j, &len) in lens.iter().enumerate() {
                        need(len, &shard_method(method, b[j]));
                    }
                    sum = sum.max(lens[rank]);
                    if ef {
                        f.residuals.push(vec![0.0; n]);
                        f.server.push(vec![0.0; lens[rank]]);
                    }
                    f.bounds.push(vec![ResidualBound::ZERO; w]);
                    f.server_bounds.push(ResidualBound::ZERO);
                    f.budgets.push(b);
                }
            }
        }
        f.scratch = vec![0; scratch];
        f.frame = vec![0; frame];
        f.own = vec![0; frame];
        f.sum = vec![0.0; sum];
        f
    }

    /// One repetition over every tensor (`rep` is the frames' step).
    ///
    /// # Errors
    /// A kernel's error, naming the tensor.
    fn run(&mut self, rep: u64) -> Result<(), String> {
        for t in 0..self.grads.len() {
            match self.kind {
                FloorKind::AllGather => self.all_gather(t, rep),
                FloorKind::TwoPhase => self.two_phase(t, rep),
                FloorKind::Dense => {
                    self.dense(t);
                    Ok(())
                }
            }
            .map_err(|e| format!("kernel floor, tensor {t}: {e}"))?;
        }
        black_box(&self.out);
        Ok(())
    }

    /// The all-gather's floor of tensor `t`.
    fn all_gather(&mut self, t: usize, rep: u64) -> Result<(), gradwire::core::Error> {
        let g = self.grads[t];
        let n = g.len();
        let p = Params::new(self.method).at_step(rep).for_tensor(t as u64);
        let len = if self.ef {
            feedback_step_bounded(
                g,
                &mut self.residuals[t],
                &mut self.bounds[t][0],
                &p,
                &mut self.scratch,
                &mut self.frame,
            )?
        } else {
            encode_into(g, &p, &mut self.scratch, &mut self.frame)?
        };
        let frame = &self.frame[..len];
        let out = &mut self.out[..n];
        decode_into(frame, &p, out)?;
        for _ in 1..self.w {
            accumulate_into(frame, &p, out, 1.0)?;
        }
        mean_pass(out, self.w);
        Ok(())
    }

    /// The two-phase collective's floor of tensor `t`.
    fn two_phase(&mut self, t: usize, rep: u64) -> Result<(), gradwire::core::Error> {
        let g = self.grads[t];
        let (n, w, rank) = (g.len(), self.w, self.rank);
        let id = |j: usize| (t * (w + 1) + j) as u64;
        // The worker: one frame per shard; the rank's own shard's frame is kept.
        let mut own_len = 0;
        for j in 0..w {
            let (a, b) = shard(n, w, j);
            if a == b {
                continue;
            }
            let p = Params::new(shard_method(self.method, self.budgets[t][j]))
                .at_step(rep)
                .for_tensor(id(j));
            let frame = if j == rank {
                &mut self.own
            } else {
                &mut self.frame
            };
            let len = if self.ef {
                feedback_step_bounded(
                    &g[a..b],
                    &mut self.residuals[t][a..b],
                    &mut self.bounds[t][j],
                    &p,
                    &mut self.scratch,
                    frame,
                )?
            } else {
                encode_into(&g[a..b], &p, &mut self.scratch, frame)?
            };
            if j == rank {
                own_len = len;
            }
        }
        let (a, b) = shard(n, w, rank);
        let len = b - a;
        if len > 0 {
            // The owner: the W workers' frames of its shard summed, its own error-feedback step.
            let m = shard_method(self.method, self.budgets[t][rank]);
            let p = Params::new(m).at_step(rep).for_tensor(id(rank));
            let sum = &mut self.sum[..len];
            decode_into(&self.own[..own_len], &p, sum)?;
            for _ in 1..w {
                accumulate_into(&self.own[..own_len], &p, sum, 1.0)?;
            }
            let po = Params::new(m).at_step(rep).for_tensor(id(w));
            let owner_len = if self.ef {
                feedback_step_bounded(
                    sum,
                    &mut self.server[t],
                    &mut self.server_bounds[t],
                    &po,
                    &mut self.scratch,
                    &mut self.frame,
                )?
            } else {
                encode_into(sum, &po, &mut self.scratch, &mut self.frame)?
            };
            // The W owners' frames decoded into their shards of the output.
            for j in 0..w {
                let start = shard(n, w, j).0.min(n - len);
                decode_into(
                    &self.frame[..owner_len],
                    &po,
                    &mut self.out[start..start + len],
                )?;
            }
        }
        mean_pass(&mut self.out[..n], w);
        Ok(())
    }

    /// The dense f32 all-reduce's floor of tensor `t`.
    fn dense(&mut self, t: usize) {
        let g = self.grads[t];
        let (n, w) = (g.len(), self.w);
        let out = &mut self.out[..n];
        if w == 1 {
            black_box(read_pass(g));
            out.copy_from_slice(g);
            return;
        }
        let (a, b) = shard(n, w, self.rank);
        let len = b - a;
        // Contribution c: the shard-size range of `g` at shard c's start, summed in rank order,
        // 2048 elements at a time (the partial sum stays in L1, as in a fused loop over the W
        // contributions).
        let starts: Vec<usize> = (0..w).map(|c| shard(n, w, c).0.min(n - len)).collect();
        const CHUNK: usize = 2048;
        let mut i = 0;
        while i < len {
            let m = CHUNK.min(len - i);
            let o = &mut out[a + i..a + i + m];
            o.copy_from_slice(&g[starts[0] + i..starts[0] + i + m]);
            for &s in &starts[1..] {
                for (x, &y) in o.iter_mut().zip(&g[s + i..s + i + m]) {
                    *x += y;
                }
            }
            i += m;
        }
        // The other shards' sums (here: the gradient's) copied into the output.
        out[..a].copy_from_slice(&g[..a]);
        out[b..].copy_from_slice(&g[b..]);
    }
}

/// Multiplies `x` by `1 / w` (the mean).
fn mean_pass(x: &mut [f32], w: usize) {
    let inv = 1.0 / w as f32;
    for v in x {
        *v *= inv;
    }
}

// ---------------------------------------------------------------------------------------------
// The child: one row

/// What the rank threads share.
struct Shared {
    /// Where the ranks meet.
    barrier: Barrier,
    /// Set by a rank whose step failed (read by all after the step's last barrier).
    failed: AtomicBool,
    /// The first error (the library's).
    error: Mutex<Option<String>>,
    /// The first error of the kernel floor.
    floor_error: Mutex<Option<String>>,
}

/// What rank 0 measures.
#[derive(Default)]
struct Timing {
    /// Each step's wall time.
    step_wall: Vec<f64>,
    /// Each step's process CPU time.
    step_cpu: Vec<f64>,
    /// The RSS after the reset, or why not.
    baseline: Option<Result<u64, String>>,
    /// `VmHWM` after the steps.
    hwm: Option<u64>,
    /// The read passes' process CPU time.
    read: Vec<f64>,
    /// The fresh-memory write passes' wall time.
    fresh_write: Vec<f64>,
    /// Elements of the state a rank keeps (the fresh write pass's length).
    state: Option<usize>,
    /// The floor's process CPU time.
    floor: Vec<f64>,
    /// The floor's wall time (the W ranks at once).
    floor_wall: Vec<f64>,
    /// Rank 0's generation time.
    generate_s: f64,
    /// The checkpoint phase, on rows with error feedback.
    checkpoint: Option<CheckpointTiming>,
}

/// What the checkpoint phase measured (rank 0).
#[derive(Default)]
struct CheckpointTiming {
    /// Rank 0's files, bytes.
    bytes: u64,
    /// The W ranks' saves, wall time.
    save_s: f64,
    /// `VmHWM` of the saves (reset before them).
    save_hwm: Option<u64>,
    /// The W ranks' loads, wall time.
    load_s: f64,
    /// `VmHWM` of the loads (reset before them).
    load_hwm: Option<u64>,
}

/// What each rank returns.
struct RankOut {
    /// Traffic of the last step.
    traffic: Traffic,
    /// The largest buffer passed to the communicator.
    max_message: usize,
    /// The hash of the outputs after the last step (none after a failure).
    hash: Option<u64>,
    /// The collective of the last step.
    in_use: Option<Collective>,
    /// Rank 0's measurements.
    timing: Option<Timing>,
}

/// Rank `rank`'s thread of row `spec`.
fn rank_main(
    spec: &RowSpec,
    m: &MethodSpec,
    (comm, resume_comm): (LocalCommunicator, LocalCommunicator),
    shared: &Shared,
) -> Result<RankOut, String> {
    let rank = comm.rank();
    let w = spec.workers;
    let collective = parse_collective(&spec.collective)?;
    let parallelism = parse_parallelism(&spec.parallelism)?;
    let shapes = shape_set(&spec.shapes)?;
    let lead = rank == 0;
    let mut timing = Timing::default();

    let t0 = Instant::now();
    let grads = generate(&shapes, rank);
    timing.generate_s = t0.elapsed().as_secs_f64();
    // The outputs exist as a training loop's would (written before: their pages are
    // mapped), so that step 1 pays only for the state the all-reduce keeps, not for first
    // touches of the caller's buffers.
    // In place, the outputs are the buffers each step's gradient is copied into before the
    // step (a backward pass writing its gradients), outside the timing.
    let mut out: HashMap<String, Tensor> = HashMap::new();
    let mut work: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (name, shape) in &shapes {
        let mut data = Vec::with_capacity(numel(shape));
        data.resize(numel(shape), 0.0f32);
        if spec.in_place {
            work.push((name.clone(), shape.clone(), data));
        } else {
            let tensor = Tensor::new(shape.clone(), data).expect("shape and data agree");
            out.insert(name.clone(), tensor);
        }
    }
    let max = Arc::new(AtomicUsize::new(0));
    let mut comm = Some(Recording {
        inner: comm,
        max: Arc::clone(&max),
    });

    // The machine's memory warmed, untimed: on a virtual machine a page the guest has never
    // used costs the host's fault too (about 40x a reused one on the machine of BENCHMARKS.md),
    // so step 1 would measure which pages the kernel hands out, not the library's first-step
    // work. Each rank writes and frees what the step phase may map beyond the gradients and
    // outputs (twice the worker's residual and the owner's server residual: room for the
    // state, its restore copy and the buffers), within 80% of the memory available.
    shared.barrier.wait();
    let available = available_bytes().unwrap_or(0);
    shared.barrier.wait();
    let n: usize = shapes.iter().map(|(_, shape)| numel(shape)).sum();
    let wanted = 2 * n + 2 * n.div_ceil(w.max(1));
    let within = available / 10 * 8 / std::mem::size_of::<f32>() / w.max(1);
    let warm = wanted.min(within);
    {
        let mut block = vec![0.0f32; warm];
        block.fill(1.0);
        black_box(&mut block);
    }
    shared.barrier.wait();
    if lead {
        timing.baseline = Some(reset_peak());
    }
    shared.barrier.wait();

    let mut ar: Option<CompressedAllReduce> = None;
    let mut traffic = Traffic::default();
    for _ in 0..spec.steps {
        for (name, _, data) in &mut work {
            data.copy_from_slice(grads[name].data());
        }
        shared.barrier.wait();
        let (wall0, cpu0) = (Instant::now(), cpu_now());
        let ar = ar.get_or_insert_with(|| {
            let comm = comm.take().expect("the communicator, at step 1");
            CompressedAllReduce::with_communicator(m.method.clone(), Box::new(comm))
                .with_collective(collective.unwrap_or(Collective::AllGather))
                .with_parallelism(parallelism)
                .with_chunk_bytes(spec.chunk_bytes)
        });
        let before = ar.traffic();
        let result = if spec.in_place {
            let mut tensors: Vec<TensorMut> = work
                .iter_mut()
                .map(|(name, shape, data)| TensorMut { name, shape, data })
                .collect();
            ar.all_reduce_in_place(&mut tensors)
        } else {
            ar.all_reduce_into(&grads, &mut out)
        };
        traffic = ar.traffic().since(before);
        if let Err(e) = result {
            shared.failed.store(true, Ordering::SeqCst);
            let mut first = shared.error.lock().expect("error lock");
            first.get_or_insert_with(|| format!("rank {rank}: {e}"));
        }
        shared.barrier.wait();
        if lead {
            timing.step_cpu.push(cpu_now() - cpu0);
            timing.step_wall.push(wall0.elapsed().as_secs_f64());
        }
        if shared.failed.load(Ordering::SeqCst) {
            break;
        }
    }
    let failed = shared.failed.load(Ordering::SeqCst);
    if lead {
        timing.hwm = proc_status("VmHWM").ok();
    }
    let in_use = ar.as_ref().and_then(CompressedAllReduce::collective_in_use);
    let hash = (!failed).then(|| {
        if spec.in_place {
            hash_tensors(
                work.iter()
                    .map(|(n, shape, data)| (n.as_str(), shape.as_slice(), data.as_slice())),
            )
        } else {
            hash_outputs(&out)
        }
    });
    let checkpoint = match ar {
        Some(ar) if m.ef && !failed => Some(checkpoint_phase(ar, m, resume_comm, shared)),
        // The all-reduce's own buffers (residuals, flat buffers) go before the floor's come.
        _ => None,
    };
    let checkpoint = match checkpoint.transpose() {
        Ok(c) => c,
        Err(e) => {
            let mut first = shared.floor_error.lock().expect("error lock");
            first.get_or_insert_with(|| format!("rank {rank}: checkpoint: {e}"));
            None
        }
    };
    if lead {
        timing.checkpoint = checkpoint;
    }
    let result = |timing: Timing| RankOut {
        traffic,
        max_message: max.load(Ordering::Relaxed),
        hash,
        in_use,
        timing: lead.then_some(timing),
    };
    if failed {
        return Ok(result(timing));
    }

    // The read pass, W ranks at once.
    let order: Vec<&[f32]> = shapes.iter().map(|(n, _)| grads[n].data()).collect();
    for _ in 0..REPS {
        shared.barrier.wait();
        let cpu0 = cpu_now();
        for g in &order {
            black_box(read_pass(black_box(g)));
        }
        shared.barrier.wait();
        if lead {
            timing.read.push(cpu_now() - cpu0);
        }
    }

    // One write pass over fresh memory the size of the state the method keeps (the worker's
    // residual; on the two-phase collective the owner's n / W and its copy), W ranks at once:
    // what the first step may cost beyond a later one. A new allocation each time (freed to
    // the system: it is far above the allocator's mapping threshold).
    let state = state_len(&order, m.ef, in_use == Some(Collective::TwoPhase), w);
    if lead {
        timing.state = Some(state);
    }
    for _ in 0..REPS {
        shared.barrier.wait();
        let t0 = Instant::now();
        let mut fresh = vec![0.0f32; state];
        fresh.fill(1.0);
        black_box(&mut fresh);
        shared.barrier.wait();
        if lead {
            timing.fresh_write.push(t0.elapsed().as_secs_f64());
        }
        drop(fresh);
    }

    // The kernel floor, W ranks at once.
    let kind = if m.dense_f32() {
        FloorKind::Dense
    } else if in_use == Some(Collective::TwoPhase) {
        FloorKind::TwoPhase
    } else {
        FloorKind::AllGather
    };
    let mut floor = Floor::new(order, kind, m.core, m.ef, w, rank);
    for rep in 0..REPS {
        shared.barrier.wait();
        let cpu0 = cpu_now();
        let wall0 = Instant::now();
        if let Err(e) = floor.run(rep as u64) {
            let mut first = shared.floor_error.lock().expect("error lock");
            first.get_or_insert_with(|| format!("rank {rank}: {e}"));
        }
        shared.barrier.wait();
        if lead {
            timing.floor.push(cpu_now() - cpu0);
            timing.floor_wall.push(wall0.elapsed().as_secs_f64());
        }
    }
    Ok(result(timing))
}

/// The checkpoint phase of a row with error feedback (fields `checkpoint_*`): every rank saves
/// its residuals (and server residuals on the two-phase collective), the all-reduce is dropped,
/// then every rank loads them into a new one, as a resuming job would. The files live in a
/// temporary directory and are removed after. Returns rank 0's figures (others: defaults).
fn checkpoint_phase(
    mut ar: CompressedAllReduce,
    m: &MethodSpec,
    resume_comm: LocalCommunicator,
    shared: &Shared,
) -> Result<CheckpointTiming, String> {
    let rank = resume_comm.rank();
    let lead = rank == 0;
    let dir = std::env::temp_dir().join(format!("gradwire-scale-{}", std::process::id()));
    // No early return before the barriers below (every rank must reach them): a directory
    // that cannot be made shows as the saves' error.
    let _ = std::fs::create_dir_all(&dir);
    let worker = dir.join(format!("worker-{rank}"));
    let server = dir.join(format!("server-{rank}"));
    let two_phase = ar.collective_in_use() == Some(Collective::TwoPhase);
    let mut timing = CheckpointTiming::default();

    // A failed reset leaves the peaks unknown (null), never a rank waiting at a barrier.
    let mut reset = true;
    shared.barrier.wait();
    if lead {
        reset = reset_peak().is_ok();
    }
    shared.barrier.wait();
    let t0 = Instant::now();
    let saved = ar
        .compressor_mut()
        .save_feedback(&worker)
        .and_then(|()| match two_phase {
            true => ar.save_server_residuals(&server),
            false => Ok(()),
        });
    shared.barrier.wait();
    if lead {
        timing.save_s = t0.elapsed().as_secs_f64();
        timing.save_hwm = proc_status("VmHWM").ok().filter(|_| reset);
    }
    drop(ar);

    shared.barrier.wait();
    if lead {
        reset = reset_peak().is_ok();
    }
    shared.barrier.wait();
    let t0 = Instant::now();
    let loaded = saved.and_then(|()| {
        let mut resumed =
            CompressedAllReduce::with_communicator(m.method.clone(), Box::new(resume_comm));
        resumed.compressor_mut().load_feedback(&worker)?;
        if two_phase {
            resumed.load_server_residuals(&server)?;
        }
        Ok(resumed)
    });
    shared.barrier.wait();
    if lead {
        timing.load_s = t0.elapsed().as_secs_f64();
        timing.load_hwm = proc_status("VmHWM").ok().filter(|_| reset);
    }
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    timing.bytes = size(&worker) + size(&server);
    // Removed whatever happened (the last rank out removes the directory).
    std::fs::remove_file(&worker).ok();
    std::fs::remove_file(&server).ok();
    std::fs::remove_dir(&dir).ok();
    drop(loaded.map_err(|e| e.to_string())?);
    Ok(timing)
}

/// Elements of the state a rank keeps: the worker's residual (`n`) with error feedback, and on
/// the two-phase collective the owner's server residual (`n / W`, rounded up) and the copy of
/// it that a failed step is restored from (as many).
fn state_len(tensors: &[&[f32]], ef: bool, two_phase: bool, w: usize) -> usize {
    let n: usize = tensors.iter().map(|t| t.len()).sum();
    match (ef, two_phase) {
        (false, _) => 0,
        (true, false) => n,
        // The owner's server residual and the copy of it a failed step is restored from
        // exactly (kept across steps: issue 46 scope 3's `4 + 8 / W`).
        (true, true) => n + 2 * n.div_ceil(w.max(1)),
    }
}

/// Runs row `spec` in this process and returns its JSON object.
fn run_row(spec: &RowSpec) -> Map<String, Value> {
    let started = Instant::now();
    let mut row = spec.skeleton();
    let m = match parse_method(&spec.method) {
        Ok(m) => m,
        Err(e) => {
            row.insert("error".into(), json!(e));
            return row;
        }
    };
    let shapes = match shape_set(&spec.shapes) {
        Ok(s) => s,
        Err(e) => {
            row.insert("error".into(), json!(e));
            return row;
        }
    };
    let w = spec.workers;
    let params: usize = shapes.iter().map(|(_, s)| numel(s)).sum();
    let shared = Shared {
        barrier: Barrier::new(w),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        floor_error: Mutex::new(None),
    };
    // A second group for the checkpoint phase's resumed all-reduce (a new job's communicator).
    let comms = LocalGroup::new(w)
        .into_communicators()
        .into_iter()
        .zip(LocalGroup::new(w).into_communicators());
    let outs: Vec<Result<RankOut, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (shared, m) = (&shared, &m);
                scope.spawn(move || rank_main(spec, m, comm, shared))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let outs: Vec<RankOut> = match outs.into_iter().collect() {
        Ok(o) => o,
        Err(e) => {
            row.insert("error".into(), json!(e));
            return row;
        }
    };
    let error = shared.error.lock().expect("error lock").take();
    let floor_error = shared.floor_error.lock().expect("error lock").take();
    let timing = outs
        .iter()
        .find_map(|o| o.timing.as_ref())
        .expect("rank 0's timing");

    let later = |v: &[f64]| median(v.get(1..).unwrap_or(&[]));
    let cpu: Vec<f64> = timing.step_cpu.iter().map(|c| c / w as f64).collect();
    let median_cpu = later(&cpu);
    let median_wall = later(&timing.step_wall);
    let read = median(&timing.read).map(|r| r / w as f64);
    let floor = median(&timing.floor).map(|f| f / w as f64);
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    row.insert("step_wall_s".into(), json!(timing.step_wall));
    row.insert("step_cpu_per_rank_s".into(), json!(cpu));
    row.insert("median_cpu_s".into(), json!(median_cpu));
    row.insert("median_wall_s".into(), json!(median_wall));
    row.insert(
        "first_step_over_later".into(),
        json!(ratio(timing.step_wall.first().copied(), median_wall)),
    );
    let fresh = median(&timing.fresh_write);
    row.insert(
        "state_bytes_per_rank".into(),
        json!(timing.state.map(|e| 4 * e)),
    );
    row.insert(
        "first_step_over_allowance".into(),
        json!(ratio(
            timing.step_wall.first().copied(),
            median_wall.zip(fresh).map(|(a, b)| a + b)
        )),
    );
    row.insert("fresh_write_s".into(), json!(fresh));
    row.insert("read_pass_s".into(), json!(read));
    row.insert("read_passes".into(), json!(ratio(median_cpu, read)));
    row.insert("kernel_floor_s".into(), json!(floor));
    row.insert(
        "kernel_floor_wall_s".into(),
        json!(median(&timing.floor_wall)),
    );
    let in_use = outs[0].in_use;
    let kind = if m.dense_f32() {
        FloorKind::Dense
    } else if in_use == Some(Collective::TwoPhase) {
        FloorKind::TwoPhase
    } else {
        FloorKind::AllGather
    };
    row.insert(
        "floor".into(),
        json!(if kind == FloorKind::Dense {
            "dense"
        } else {
            "kernel"
        }),
    );
    row.insert("floor_of".into(), json!(kind.name()));
    row.insert("floor_ratio".into(), json!(ratio(median_cpu, floor)));
    row.insert(
        "collective_in_use".into(),
        json!(in_use.map(|c| collective_name(Some(c)))),
    );
    row.insert(
        "max_message_bytes".into(),
        json!(outs.iter().map(|o| o.max_message).max()),
    );
    row.insert(
        "sent_bytes".into(),
        json!(outs.iter().map(|o| o.traffic.sent).max()),
    );
    row.insert(
        "received_bytes".into(),
        json!(outs.iter().map(|o| o.traffic.received).max()),
    );
    match &timing.baseline {
        Some(Ok(base)) => {
            row.insert("rss_baseline_bytes".into(), json!(base));
            if let Some(hwm) = timing.hwm {
                row.insert("peak_rss_bytes".into(), json!(hwm));
                row.insert(
                    "peak_over_baseline_mb".into(),
                    json!((hwm as f64 - *base as f64) / 1e6),
                );
                // Gradient and output: 4 bytes per parameter each, per rank (the outputs of a
                // failed step were never written: no figure).
                if error.is_none() {
                    let held = (w * 8 * params) as f64;
                    row.insert(
                        "bytes_per_param_beyond".into(),
                        json!((hwm as f64 - held) / w as f64 / params as f64),
                    );
                }
            }
        }
        Some(Err(why)) => {
            row.insert("rss_note".into(), json!(why));
        }
        None => {}
    }
    if error.is_none() {
        let hashes: Vec<u64> = outs.iter().filter_map(|o| o.hash).collect();
        row.insert(
            "identical".into(),
            json!(hashes.len() == w && hashes.iter().all(|&h| h == hashes[0])),
        );
        row.insert(
            "output_hash".into(),
            json!(outs[0].hash.map(|h| format!("{h:016x}"))),
        );
    }
    let checkpoint = timing.checkpoint.as_ref();
    let over_step = |hwm: Option<u64>| {
        hwm.zip(timing.hwm)
            .map(|(h, step)| (h as f64 - step as f64) / 1e6)
    };
    row.insert(
        "checkpoint_bytes".into(),
        json!(checkpoint.map(|c| c.bytes)),
    );
    row.insert(
        "checkpoint_save_s".into(),
        json!(checkpoint.map(|c| c.save_s)),
    );
    row.insert(
        "checkpoint_load_s".into(),
        json!(checkpoint.map(|c| c.load_s)),
    );
    row.insert(
        "checkpoint_save_over_step_mb".into(),
        json!(checkpoint.and_then(|c| over_step(c.save_hwm))),
    );
    row.insert(
        "checkpoint_load_over_step_mb".into(),
        json!(checkpoint.and_then(|c| over_step(c.load_hwm))),
    );
    row.insert("generate_s".into(), json!(timing.generate_s));
    match (error, floor_error) {
        (Some(e), _) => {
            row.insert("error".into(), json!(e));
            row.insert("refused".into(), json!(true));
        }
        (None, Some(e)) => {
            row.insert("error".into(), json!(e));
        }
        (None, None) => {}
    }
    row.insert("row_wall_s".into(), json!(started.elapsed().as_secs_f64()));
    row
}

/// The child's entry: `--row ..` prints one JSON line.
fn child_main(args: &[String]) -> ExitCode {
    // A panicking rank would leave its peers at a barrier: end the process instead, so that
    // the parent reports the row.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("scale row: {info}");
        std::process::exit(101);
    }));
    let spec = match RowSpec::from_args(args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let row = run_row(&spec);
    println!("{}", Value::Object(row));
    ExitCode::SUCCESS
}

// ---------------------------------------------------------------------------------------------
// The parent

/// Runs `spec`'s child and returns its row (a row with the error when the child failed).
fn spawn_row(exe: &std::path::Path, spec: &RowSpec) -> Map<String, Value> {
    let started = Instant::now();
    let output = Command::new(exe).arg("--row").args(spec.args()).output();
    let fail = |why: String| {
        let mut row = spec.skeleton();
        row.insert("error".into(), json!(why));
        row.insert("row_wall_s".into(), json!(started.elapsed().as_secs_f64()));
        row
    };
    let output = match output {
        Ok(o) => o,
        Err(e) => return fail(format!("starting {}: {e}", exe.display())),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: String = {
        let s = stderr.trim();
        let cut = s.char_indices().rev().nth(400).map_or(0, |(i, _)| i);
        s[cut..].to_owned()
    };
    if !output.status.success() {
        use std::os::unix::process::ExitStatusExt;
        let how = match output.status.signal() {
            Some(9) => "killed by signal 9 (out of memory?)".to_owned(),
            Some(s) => format!("killed by signal {s}"),
            None => format!("exit status {:?}", output.status.code()),
        };
        return fail(format!("the row's process {how}: {tail}"));
    }
    let line = stdout.lines().rev().find(|l| l.starts_with('{'));
    match line.map(serde_json::from_str::<Value>) {
        Some(Ok(Value::Object(row))) => row,
        Some(Ok(_)) | Some(Err(_)) | None => fail(format!(
            "the row's process printed no JSON object: {} {tail}",
            stdout.trim()
        )),
    }
}

/// A number of a row as text (`-` for null).
fn num(row: &Map<String, Value>, key: &str, digits: usize) -> String {
    row.get(key)
        .and_then(Value::as_f64)
        .map_or("-".into(), |v| format!("{v:.digits$}"))
}

/// Bytes of a row in MB (`-` for null).
fn mb(row: &Map<String, Value>, key: &str) -> String {
    row.get(key)
        .and_then(Value::as_f64)
        .map_or("-".into(), |v| format!("{:.3}", v / 1e6))
}

/// The table's header, the method column `width` wide.
fn print_header(width: usize) {
    println!(
        "{:<width$} {:<22} {:>2} {:<7} {:<28} {:>9} {:>7} {:>7} {:>9} {:>10} {:>21} {:>8} {:>9}",
        "method",
        "collective",
        "W",
        "par",
        "wall s (step 1, 2, ..)",
        "cpu/rank",
        "reads",
        "floor x",
        "1st/allow",
        "max msg MB",
        "sent/recv MB",
        "B/param",
        "identical"
    );
}

/// One line of the table for `row`, the method column `width` wide.
fn print_row(row: &Map<String, Value>, width: usize) {
    let s = |k: &str| row.get(k).and_then(Value::as_str).unwrap_or("-").to_owned();
    let collective = match row.get("collective_in_use").and_then(Value::as_str) {
        Some(c) if c != s("collective") => format!("{}->{c}", s("collective")),
        _ => s("collective"),
    };
    let walls = row
        .get("step_wall_s")
        .and_then(Value::as_array)
        .map_or("-".into(), |a| {
            a.iter()
                .filter_map(Value::as_f64)
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        });
    let identical = match row.get("identical").and_then(Value::as_bool) {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    println!(
        "{:<width$} {:<22} {:>2} {:<7} {:<28} {:>9} {:>7} {:>7} {:>9} {:>10} {:>21} {:>8} {:>9}",
        s("label"),
        collective,
        row.get("workers").and_then(Value::as_u64).unwrap_or(0),
        s("parallelism"),
        walls,
        num(row, "median_cpu_s", 4),
        num(row, "read_passes", 1),
        num(row, "floor_ratio", 2),
        num(row, "first_step_over_allowance", 2),
        mb(row, "max_message_bytes"),
        format!("{}/{}", mb(row, "sent_bytes"), mb(row, "received_bytes")),
        num(row, "bytes_per_param_beyond", 2),
        identical
    );
    if let Some(e) = row.get("error").and_then(Value::as_str) {
        let refused = row.get("refused").and_then(Value::as_bool) == Some(true);
        let what = if refused { "refused" } else { "ERROR" };
        println!("    {what}: {e}");
    }
}

/// A comma-separated list.
fn list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The parent's options.
#[derive(Default)]
struct Options {
    /// Shape sets.
    shapes: Option<Vec<String>>,
    /// `--small`.
    small: bool,
    /// W values.
    workers: Option<Vec<usize>>,
    /// Method items.
    methods: Option<Vec<String>>,
    /// Collectives.
    collectives: Option<Vec<String>>,
    /// Parallelism settings.
    parallelism: Option<Vec<String>>,
    /// S.
    steps: Option<usize>,
    /// `--chunk-bytes`.
    chunk_bytes: Option<usize>,
    /// `--in-place`.
    in_place: bool,
    /// `--json PATH`.
    json: Option<String>,
}

/// The options of the command line.
fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--small" {
            o.small = true;
            continue;
        }
        if a == "--in-place" {
            o.in_place = true;
            continue;
        }
        if a == "--help" || a == "-h" {
            return Err(String::new());
        }
        let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--shapes" => o.shapes = Some(list(v)),
            "--workers" => {
                o.workers = Some(
                    list(v)
                        .iter()
                        .map(|w| match w.parse::<usize>() {
                            Ok(w) if w >= 1 => Ok(w),
                            _ => Err(format!("--workers {v}: counts of at least 1")),
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
            "--methods" => o.methods = Some(list(v)),
            "--collectives" => o.collectives = Some(list(v)),
            "--parallelism" => o.parallelism = Some(list(v)),
            "--steps" => match v.parse::<usize>() {
                Ok(s) if s >= 2 => o.steps = Some(s),
                _ => {
                    return Err(format!(
                        "--steps {v}: at least 2 (step 1 is reported apart)"
                    ));
                }
            },
            "--chunk-bytes" => match v.parse::<usize>() {
                Ok(c) if c >= 64 => o.chunk_bytes = Some(c),
                _ => return Err(format!("--chunk-bytes {v}: at least 64")),
            },
            "--json" => o.json = Some(v.clone()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(o)
}

/// The rows of `o`, in the order run.
fn rows_of(o: &Options) -> Result<Vec<RowSpec>, String> {
    let (shapes, workers, parallelism, steps) = if o.small {
        (
            vec!["small".to_owned()],
            vec![1, 3],
            vec!["serial".to_owned()],
            3,
        )
    } else {
        (
            vec!["gpt2".to_owned()],
            vec![1, 2, 4],
            vec!["serial".to_owned(), "auto".to_owned()],
            4,
        )
    };
    let shapes = o.shapes.clone().unwrap_or(shapes);
    let workers = o.workers.clone().unwrap_or(workers);
    let parallelism = o.parallelism.clone().unwrap_or(parallelism);
    let steps = o.steps.unwrap_or(steps);
    // `--small` moves its messages in windows of 64 KiB, so that CI runs the windowed path.
    let chunk_bytes = o
        .chunk_bytes
        .unwrap_or(if o.small { 64 << 10 } else { 4 << 20 });
    let methods = o
        .methods
        .clone()
        .unwrap_or_else(|| METHOD_NAMES.iter().map(|s| (*s).to_owned()).collect());
    let collectives = o.collectives.clone().unwrap_or_else(|| {
        ["all-gather", "two-phase", "auto"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    });
    for s in &shapes {
        shape_set(s)?;
    }
    for c in &collectives {
        if parse_collective(c)?.is_none() {
            return Err("--collectives: all-reduce is dense f32's own route".into());
        }
    }
    for p in &parallelism {
        parse_parallelism(p)?;
    }
    let mut rows = Vec::new();
    for s in &shapes {
        let ws: Vec<usize> = if s == "opt1.3b" {
            if workers.iter().any(|&w| w != 1) {
                eprintln!("opt1.3b runs at W = 1 only (one copy is 5.26 GB)");
            }
            workers.iter().copied().filter(|&w| w == 1).collect()
        } else {
            workers.clone()
        };
        for item in &methods {
            let m = parse_method(item)?;
            let cs: Vec<String> = if m.dense_f32() {
                vec!["all-reduce".to_owned()]
            } else {
                collectives.clone()
            };
            for c in &cs {
                for &w in &ws {
                    for p in &parallelism {
                        rows.push(RowSpec {
                            shapes: s.clone(),
                            method: item.clone(),
                            collective: c.clone(),
                            workers: w,
                            parallelism: p.clone(),
                            chunk_bytes,
                            in_place: o.in_place,
                            steps,
                        });
                    }
                }
            }
        }
    }
    Ok(rows)
}

/// Why `row` fails the run, if it does: not bit-identical, a field missing, an error that is
/// not the library's refusal.
fn row_problem(row: &Map<String, Value>) -> Option<String> {
    if let Some(f) = FIELDS.iter().find(|f| !row.contains_key(**f)) {
        return Some(format!("no field {f}"));
    }
    if row.get("identical") == Some(&Value::Bool(false)) {
        return Some("outputs differ between ranks".into());
    }
    let refused = row.get("refused") == Some(&Value::Bool(true));
    match row.get("error").and_then(Value::as_str) {
        Some(e) if !refused => Some(e.to_owned()),
        _ => None,
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = check_shape_sets() {
        eprintln!("{e}");
        return ExitCode::from(2);
    }
    if args.first().map(String::as_str) == Some("--row") {
        return child_main(&args[1..]);
    }
    let options = match parse_args(&args) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rows = match rows_of(&options) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("current_exe: {e}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    let mut done: Vec<Value> = Vec::new();
    let mut problems = 0;
    let mut shapes_seen = String::new();
    let width = rows
        .iter()
        .map(|r| r.method.len())
        .max()
        .unwrap_or(0)
        .max(18);
    for spec in &rows {
        if spec.shapes != shapes_seen {
            shapes_seen.clone_from(&spec.shapes);
            let set = shape_set(&spec.shapes).unwrap_or_default();
            let n: usize = set.iter().map(|(_, s)| numel(s)).sum();
            println!(
                "\n{}: {} tensors, {n} values; {} steps; build {}",
                spec.shapes,
                set.len(),
                spec.steps,
                build_name()
            );
            print_header(width);
        }
        let row = spawn_row(&exe, spec);
        print_row(&row, width);
        if let Some(p) = row_problem(&row) {
            eprintln!(
                "row {} {} W={} {}: {p}",
                spec.method, spec.collective, spec.workers, spec.parallelism
            );
            problems += 1;
        }
        done.push(Value::Object(row));
    }
    println!(
        "\n{} rows in {:.1} s{}",
        done.len(),
        started.elapsed().as_secs_f64(),
        if problems == 0 {
            String::new()
        } else {
            format!("; {problems} failed")
        }
    );
    if let Some(path) = &options.json {
        let doc = json!({"schema": SCHEMA, "build": build_name(), "rows": done});
        let text = serde_json::to_string_pretty(&doc).expect("JSON");
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("{path}: {e}");
            return ExitCode::from(2);
        }
    }
    if problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

"""One rank's ``AllReduce`` step from Python on GPT-2-small's shapes (148 tensors, 124,439,808
float32 values): ``all_reduce`` (gradients copied into the library, the mean copied out into
new arrays) against ``all_reduce_`` (in place: the arrays read and overwritten where they are).

Run: ``python benches/gpt2_step.py [--method TEXT] [--collective allgather|two-phase]
[--steps 4] [--mode copying|"in place"|both|started]`` after installing the wheel (one mode per process
for the memory figures: memory freed by the first mode may be reused by the second). A group of one (world size 1; the library makes no
transport call for it), the gradients drawn once (normal times exp(normal), seed 0) and copied
into the step's buffers before each in-place step, outside the timing. Prints per mode the wall
time of each step, the median of steps 2..S, and the peak RSS over the RSS before the first
step (``VmHWM`` reset through ``/proc/self/clear_refs``), in bytes per parameter; and the
library's own step (``AllReduce.last_step_seconds``) with the call's ratio to it.

``started`` (not in ``both``): the model cut into DDP's default buckets of 25 MB, the last
parameters first as DDP hands them over, each bucket started with ``start_`` (the last one ends
the step) and every handle waited for after the last start, as the overlapped DDP hook does;
timed from the first start to the last wait. With ``--skip-non-finite`` the library copies the
residuals of each bucket but the last before its step (the give-back of a skipped step).
"""

import argparse
import os
import statistics
import time

import numpy as np

import gradwire

SHAPES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "testdata", "shapes", "gpt2-small.txt")


class Alone:
    """A group of one rank."""

    rank = 0
    world_size = 1

    def all_gather(self, data, lengths):
        return [bytes(data)]

    def all_to_all(self, send, recv_lengths):
        return [bytes(b) for b in send]


def shapes():
    out = []
    for line in open(SHAPES):
        if line.startswith("#") or not line.strip():
            continue
        name, *dims = line.split()
        out.append((name, tuple(int(d) for d in dims)))
    return out


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def run(mode, args, grads, n):
    ar = gradwire.AllReduce(
        args.method, Alone(), collective=args.collective, skip_non_finite=args.skip_non_finite
    )
    work = {k: v.copy() for k, v in grads.items()} if mode in ("in place", "started") else None
    base = reset_peak()
    times = []
    inner = []
    for _ in range(args.steps):
        if work is not None:
            for k, v in grads.items():
                np.copyto(work[k], v)
        t0 = time.perf_counter()
        if mode == "started":
            buckets = ddp_buckets(work)
            handles = [ar.start_(b, ends_step=i == len(buckets) - 1) for i, b in enumerate(buckets)]
            for h in handles:
                h.wait()
        elif work is not None:
            ar.all_reduce_(work)
        else:
            mean = ar.all_reduce(grads)
            del mean
        times.append(time.perf_counter() - t0)
        inner.append(ar.last_step_seconds)
    peak = status("VmHWM")
    median = statistics.median(times[1:])
    steps = " ".join(f"{t:.3f}" for t in times)
    if mode == "started":
        # (`last_step_seconds` is the blocking calls' only.)
        print(f"{mode:9} steps {steps} s, median of 2..{args.steps}: {median:.3f} s, peak over "
              f"start {(peak - base) / n:.2f} B/param")
        return median
    engine = statistics.median(inner[1:])
    print(f"{mode:9} steps {steps} s, median of 2..{args.steps}: {median:.3f} s (the library's "
          f"own step {engine:.3f} s, {median / engine:.3f}x), peak over start "
          f"{(peak - base) / n:.2f} B/param")
    return median


def ddp_buckets(tensors, cap_bytes=25 * 1024 * 1024):
    """The tensors in DDP's default buckets: the last parameters first, a bucket closed once
    it holds ``cap_bytes`` or more."""
    buckets, current, size = [], {}, 0
    for name in reversed(list(tensors)):
        current[name] = tensors[name]
        size += tensors[name].nbytes
        if size >= cap_bytes:
            buckets.append(current)
            current, size = {}, 0
    if current:
        buckets.append(current)
    return buckets


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="topk k=ratio:0.01 values=int8:256")
    p.add_argument("--collective", default="allgather")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=["copying", "in place", "both", "started"], default="both")
    p.add_argument("--skip-non-finite", action="store_true",
                   help="the mixed-precision mode of the DDP hook's default (a check of every "
                        "gradient and a round of verdicts before each step)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    grads = {}
    for name, shape in shapes():
        size = int(np.prod(shape)) if shape else 1
        g = rng.standard_normal(size, dtype=np.float32) * np.exp(rng.standard_normal(size, dtype=np.float32))
        grads[name] = (g * np.float32(1e-3)).reshape(shape)
    n = sum(v.size for v in grads.values())
    print(f"gpt2: {len(grads)} tensors, {n} values; {args.method} + EF, {args.collective}, W = 1")
    for mode in ("copying", "in place", "started"):
        if args.mode == mode or (args.mode == "both" and mode != "started"):
            run(mode, args, grads, n)


if __name__ == "__main__":
    main()

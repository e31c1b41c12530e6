"""Worker processes for test_distributed.py (gloo on CPU, one process per rank): each writes
what it saw to ``out/rank{R}.json`` for the parent to compare."""

import functools
import hashlib
import json
import math
import os
import sys
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import gradwire
from conftest import seeded_grads
import gradwire.torch as gwt
from gradwire.comm import TorchDistributed


def init(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # The deadline of every collective (gradwire's raw calls included).
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def digest(model):
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().to(torch.float32).numpy().tobytes())
    return h.hexdigest()


def data(rank, n=256, features=32, classes=4):
    """A fixed learnable task (the same weights on every rank), each rank its own samples."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(features, classes, generator=g)
    gr = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, features, generator=gr)
    y = (x @ w).argmax(dim=1)
    return x, y


def model_of(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)


def write(out, rank, result):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def worker(body):
    """A rank's process: ``body(rank, world_size, out, result, *args)`` between the process
    group's start and end; ``result`` (with any exception and its trace) goes to
    ``out/rank{R}.json`` for the parent, which fails the test on an error."""

    @functools.wraps(body)
    def run(rank, world_size, port, out, *args):
        result = {"rank": rank}
        try:
            init(rank, world_size, port)
            body(rank, world_size, out, result, *args)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
            result["trace"] = traceback.format_exc()
        finally:
            write(out, rank, result)
            if dist.is_initialized():
                dist.destroy_process_group()
        exit_now()

    return run


def exit_now():
    """Ends a worker without the interpreter's shutdown: gloo's worker thread may still be
    freeing the last collective's tensors, which needs the GIL, and a thread that asks for it
    while the interpreter shuts down aborts the process ("terminate called without an active
    exception"; docs/python.md, "Ending a process", has the measurements). The results are
    written and closed before this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def batch_loss(net, x, y, i, accumulate):
    """The loss of samples ``i .. i + 32``, for the caller's ``backward()``; with
    ``accumulate``, the first 16 go backward under ``no_sync()`` first (DDP accumulates them)
    and the loss is the last 16's."""
    if not accumulate:
        return nn.functional.cross_entropy(net(x[i : i + 32]).float(), y[i : i + 32])
    with net.no_sync():
        nn.functional.cross_entropy(net(x[i : i + 16]).float(), y[i : i + 16]).backward()
    return nn.functional.cross_entropy(net(x[i + 16 : i + 32]).float(), y[i + 16 : i + 32])


@worker
def train(rank, world_size, out, result, mode, method, steps, collective, dtype_name, bucket_view, accumulate):

    dtype = getattr(torch, dtype_name)
    model = model_of(dtype)
    # The overlapped hook's all-reduce calls its transport from the library's thread: a
    # process group of its own (every rank makes the same new_group calls).
    group = dist.new_group() if mode == "overlap" else None
    ar = gradwire.AllReduce(method, TorchDistributed(group), seed=5, collective=collective)
    if mode in ("hook", "overlap"):
        ddp = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.0005
        )
        state = gwt.HookState(ddp, ar, overlap=mode == "overlap")
        ddp.register_comm_hook(state, gwt.comm_hook)
        net = ddp
    elif mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    else:
        net = model
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    x, y = data(rank)
    x = x.to(dtype)
    losses, digests = [], []
    for step in range(steps):
        i = (step * 32) % x.shape[0]
        opt.zero_grad()
        batch_loss(net, x, y, i, accumulate and mode in ("hook", "overlap")).backward()
        if mode == "function":
            gwt.all_reduce_gradients(model, ar)
        opt.step()
        with torch.no_grad():
            full = nn.functional.cross_entropy(net(x).float(), y).item()
        losses.append(full)
        digests.append(digest(model))
    result.update(losses=losses, digests=digests, traffic=list(ar.traffic), step=ar.step,
                  bundle=ar.last_message_bytes, dense=sum(p.numel() * 4 for p in model.parameters()))


@worker
def faults(rank, world_size, out, result):
    """Steps where one rank is at fault; every rank must raise at the same call, none hang."""
    result["steps"] = []
    g = {"w": np.linspace(-1, 1, 400, dtype=np.float32).reshape(20, 20), "b": np.ones(20, np.float32)}
    ar = gradwire.AllReduce("topk k=ratio:0.1 values=int8:256", TorchDistributed(), seed=3)

    def attempt(label, grads, allreduce=ar):
        try:
            allreduce.all_reduce(grads)
            result["steps"].append([label, "ok", ""])
        except Exception as e:
            result["steps"].append([label, type(e).__name__, str(e)])

    attempt("clean", g)
    bad = {k: v.copy() for k, v in g.items()}
    if rank == 1:
        bad["w"][3, 4] = math.nan
    attempt("nan on rank 1", bad)
    attempt("after", g)
    other = {k: v for k, v in g.items()}
    if rank == 1:
        other = {"w": g["w"].reshape(-1), "b": g["b"]}
    attempt("shape on rank 1", other)
    attempt("after shape", g)
    # A rank with another ratio: its own all-reduce, the same call sequence.
    text = "topk k=ratio:0.2 values=int8:256" if rank == world_size - 1 else "topk k=ratio:0.1 values=int8:256"
    ar2 = gradwire.AllReduce(text, TorchDistributed(), seed=3)
    attempt("ratio on last rank", g, ar2)
    attempt("final", g)
    # A transport that damages rank 2's bundle once, on its way out.
    corrupt = Corrupting(TorchDistributed(), damage=(rank == 2))
    ar3 = gradwire.AllReduce("topk k=ratio:0.1 values=int8:256", corrupt, seed=3)
    attempt("damaged bundle from rank 2", g, ar3)
    attempt("after damage", g, ar3)


class Corrupting:
    """A transport that flips one bit of the first bundle-sized buffer this rank sends."""

    def __init__(self, inner, damage):
        self.inner, self.damage = inner, damage
        self.rank, self.world_size = inner.rank, inner.world_size

    def all_gather(self, data, lengths):
        if self.damage and len(data) > 64:
            self.damage = False
            b = bytearray(data)
            b[len(b) // 2] ^= 0x10
            data = bytes(b)
        return self.inner.all_gather(data, lengths)

    def all_to_all(self, send, recv_lengths):
        return self.inner.all_to_all(send, recv_lengths)


@worker
def dense_and_two_phase(rank, world_size, out, result):
    """The rank-order dense sum and the two-phase collective over torch.distributed."""
    g = seeded_grads(rank, (64, 48), 700)
    dense = gradwire.AllReduce("dense values=f32", TorchDistributed(), error_feedback=False)
    m = dense.all_reduce(g)
    result["dense"] = {k: v.tobytes().hex() for k, v in m.items()}
    two = gradwire.AllReduce("quant bits=4 block=512 rounding=nearest-even", TorchDistributed(), collective="two-phase")
    outs = [two.all_reduce(g) for _ in range(3)]
    result["two_phase"] = [{k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in o.items()} for o in outs]
    result["collective"] = two.collective_in_use
    result["traffic"] = list(two.traffic)


@worker
def resume(rank, world_size, out, result, delay=False):
    """20 steps straight, against 10 steps, a checkpoint (model, optimizer, the hook's
    residuals; with ``delay``, the delayed hook's mean of the step in flight too, and SGD with
    momentum), a new DDP model, all-reduce and hook state that load it, and 10 more steps.
    With ``delay``, then: a mean file of another model, or of another step than the
    residuals, is refused."""
    x, y = data(rank)
    method = "topk k=ratio:0.05 values=int8:256"

    def fresh():
        model = model_of()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
        group = dist.new_group() if delay else None
        ar = gradwire.AllReduce(method, TorchDistributed(group), seed=5)
        state = gwt.HookState(ddp, ar, delay=delay)
        ddp.register_comm_hook(state, gwt.comm_hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.3, momentum=0.9 if delay else 0)

    def steps(ddp, opt, start, count):
        for step in range(start, start + count):
            i = (step * 32) % x.shape[0]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x[i : i + 32]), y[i : i + 32]).backward()
            opt.step()

    model, ddp, state, opt = fresh()
    steps(ddp, opt, 0, 20)
    straight = digest(model)
    model, ddp, state, opt = fresh()
    steps(ddp, opt, 0, 10)
    path = os.path.join(out, f"state{rank}.safetensors")
    state.save(path)
    saved = (model.state_dict(), opt.state_dict())
    model, ddp, state, opt = fresh()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load(path)
    steps(ddp, opt, 10, 10)
    result.update(straight=straight, resumed=digest(model), step=state.allreduce.step)
    if not delay:
        return
    # A mean file of another model, or of another step than the residuals, is refused.
    other = os.path.join(out, f"other{rank}.safetensors")
    state.save(other)
    saved = torch.load(other + ".delayed", weights_only=True)
    name = next(iter(saved["means"]))
    saved["means"][name] = saved["means"][name].reshape(-1)
    torch.save(saved, other + ".delayed")
    try:
        state.load(other)
        result["other_model"] = None
    except ValueError as e:
        result["other_model"] = str(e)
    state.save(other)
    os.replace(path + ".delayed", other + ".delayed")
    try:
        state.load(other)
        result["mismatched_step"] = None
    except ValueError as e:
        result["mismatched_step"] = str(e)


def attempt_steps(ar, count):
    """``count`` all-reduces of a fixed 20 x 20 gradient: ``["ok", ""]`` or the error's class
    and message for each."""
    g = {"w": np.linspace(-1, 1, 400, dtype=np.float32).reshape(20, 20)}
    steps = []
    for _ in range(count):
        try:
            ar.all_reduce(g)
            steps.append(["ok", ""])
        except Exception as e:
            steps.append([type(e).__name__, str(e)])
    return steps


class FailingOnce:
    """A transport whose raw call number ``fail_at`` (from 0) raises instead of taking part, and
    that counts the raw calls it is asked for after that."""

    def __init__(self, inner, fail_at):
        self.inner, self.fail_at = inner, fail_at
        self.rank, self.world_size = inner.rank, inner.world_size
        self.calls, self.after = 0, 0

    def _call(self, fn, *args):
        n = self.calls
        self.calls += 1
        if self.fail_at is not None and n > self.fail_at:
            self.after += 1
        if n == self.fail_at:
            raise RuntimeError("the link went down")
        return fn(*args)

    def all_gather(self, data, lengths):
        return self._call(self.inner.all_gather, data, lengths)

    def all_to_all(self, send, recv_lengths):
        return self._call(self.inner.all_to_all, send, recv_lengths)


@worker
def broken_transport(rank, world_size, out, result):
    """Issue 48 class 3: rank 1's raw call of the bundles' all-gather raises (its opening went
    through): its peer waits in that call until the group's 20 s timeout. Every rank's later
    calls fail with "the group is broken" naming its first failure, rank 1's transport is not
    called again, and no process aborts."""
    group = dist.new_group(timeout=timedelta(seconds=20))
    transport = FailingOnce(TorchDistributed(group), fail_at=1 if rank == 1 else None)
    ar = gradwire.AllReduce("topk k=ratio:0.1 values=int8:256", transport, seed=3)
    result["steps"] = attempt_steps(ar, 3)
    result["after"] = transport.after
    # Both ranks end together (rank 0 leaves its failed call at the group's timeout).
    dist.barrier()


class Recording:
    """A transport that records each raw call it makes (the kind, and the byte lengths
    involved) before making it."""

    def __init__(self, inner):
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.calls = []

    def all_gather(self, data, lengths):
        self.calls.append(["all_gather", len(data), list(lengths)])
        return self.inner.all_gather(data, lengths)

    def all_to_all(self, send, recv_lengths):
        self.calls.append(["all_to_all", [len(b) for b in send], list(recv_lengths)])
        return self.inner.all_to_all(send, recv_lengths)


@worker
def different_calls(rank, world_size, out, result):
    """Issue 48 class 3: ranks whose calls of the Python transport would differ (rank 0's
    all-reduce on the all-gather collective, rank 1's on the two-phase one). Before, each call
    was the raw operation itself, of this rank's sizes, so ranks out of step paired raw calls of
    other kinds or sizes inside gloo (an abort). Now every call opens with the same fixed-size
    all-gather (kind, limit, lengths), so every size-dependent raw call is one all ranks agreed
    on; here the ranks fail alike at the configuration round, every step, and go on."""
    group = dist.new_group(timeout=timedelta(seconds=20))
    transport = Recording(TorchDistributed(group))
    collective = "allgather" if rank == 0 else "two-phase"
    ar = gradwire.AllReduce("topk k=ratio:0.1 values=int8:256", transport, seed=3, collective=collective)
    result["steps"] = attempt_steps(ar, 2)
    result["calls"] = transport.calls
    dist.barrier()


@worker
def grad_scaler(rank, world_size, out, result, mode, collective, steps, overflow_at, inf_in="loss"):
    """Issue 47 scope 5: the DDP hook under ``torch.amp.GradScaler`` (``mode`` "scaler", or
    "overlap-scaler" for the overlapped hook), and the same training at a loss scale of 1
    without one (``mode`` "plain", blocking), which leaves out the step that overflows in the
    scaler's run. At ``overflow_at`` rank 1's gradient is not finite (``inf_in``: its loss is
    infinite, or only the gradient of the first layer's weight, in DDP's last bucket, or of the
    last layer's, in its first): the hook's step comes back NaN on every rank, the scaler skips
    it and halves its scale; every other step, and the residuals (in the scale's units,
    rescaled when it changes), must be the plain run's bits (powers of two scale exactly)."""
    model = model_of()
    overlap = mode in ("overlap-strict", "overlap-scaler")
    poisoned = [False]
    if inf_in != "loss":
        layer = model[0] if inf_in == "first-layer" else model[2]
        layer.weight.register_hook(lambda g: g * float("inf") if poisoned[0] else g)
    ar = gradwire.AllReduce("topk k=ratio:0.05 values=int8:256",
                            TorchDistributed(dist.new_group() if overlap else None), seed=5,
                            collective=collective)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    scaler = None
    if mode in ("scaler", "overlap-scaler"):
        # A small first scale that grows after every 2 good steps: the run sees growths and,
        # at the overflow, a halving.
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    strict = mode in ("strict", "overlap-strict")
    state = gwt.HookState(ddp, ar, skip_non_finite=not strict, scaler=scaler, overlap=overlap)
    ddp.register_comm_hook(state, gwt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    x, y = data(rank)
    result.update(scales=[], skipped=[], digests=[], steps=[])
    if strict:
        # Without the mode the overflow fails every rank's backward pass: DDP re-raises a
        # RuntimeError that names the gradwire class; HookState.last_error is the original.
        loss = nn.functional.cross_entropy(ddp(x[:32]), y[:32])
        if rank == 1:
            loss = loss * float("inf")
        try:
            loss.backward()
            result["raised"] = None
        except RuntimeError as e:
            result["raised"] = str(e)
        result["last_error"] = type(state.last_error).__name__
        return
    for step in range(steps):
        if mode == "plain" and step == overflow_at:
            continue
        i = (step * 32) % x.shape[0]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[i : i + 32]), y[i : i + 32])
        if scaler is not None:
            if step == overflow_at and rank == 1:
                if inf_in == "loss":
                    loss = loss * float("inf")
                poisoned[0] = True
            before = digest(model)
            scaler.scale(loss).backward()
            result["scales"].append(float(scaler.get_scale()))
            poisoned[0] = False
            if step == overflow_at:
                # Every parameter's mean NaN on every rank, also those of buckets that went
                # out before the verdict.
                result["all_nan_at_overflow"] = all(bool(torch.isnan(p.grad).all()) for p in model.parameters())
            scaler.step(opt)
            scaler.update()
            if ar.last_step_skipped:
                assert digest(model) == before, "a skipped step moved the parameters"
        else:
            loss.backward()
            opt.step()
        result["skipped"].append(ar.last_step_skipped)
        result["steps"].append(ar.step)
        result["digests"].append(digest(model))
    if scaler is not None:
        # Back to the plain run's units, then saved: the same file, byte for byte.
        ar.scale_residuals(1.0 / float(scaler.get_scale()))
        result["final_scale"] = float(scaler.get_scale())
    path = os.path.join(out, f"residuals_{mode}_{rank}.gw")
    ar.save(path)
    with open(path, "rb") as f:
        result["residuals"] = hashlib.sha256(f.read()).hexdigest()


@worker
def non_blocking(rank, world_size, out, result):
    """Steps started with `start_` over a process group of their own, three buckets in flight
    per model step, against blocking `all_reduce_` calls on the same buckets (top-k: the
    results do not depend on the step number)."""
    g = seeded_grads(rank, (64, 48), 700)
    buckets = [{"a": g["a"]}, {"b": g["b"]}, {"c": (g["b"][:300] * 3).copy()}]
    method = "topk k=ratio:0.05 values=int8:64"
    blocking = gradwire.AllReduce(method, TorchDistributed(dist.new_group()), seed=3)
    want = []
    for step in range(4):
        for b in buckets:
            x = {k: v * (step + 1) for k, v in b.items()}
            blocking.all_reduce_(x)
            want.append({k: v.tobytes().hex() for k, v in x.items()})
    ar = gradwire.AllReduce(method, TorchDistributed(dist.new_group()), seed=3)
    got = []
    for step in range(4):
        xs = [{k: v * (step + 1) for k, v in b.items()} for b in buckets]
        handles = [ar.start_(x, ends_step=(i == len(xs) - 1)) for i, x in enumerate(xs)]
        # The caller computes while the steps run (the default group stays its own).
        dist.all_reduce(torch.ones(4))
        for h in handles:
            h.wait()
        got.extend({k: v.tobytes().hex() for k, v in x.items()} for x in xs)
    result["same"] = got == want
    result["steps"] = [blocking.step, ar.step]


@worker
def hook_faults(rank, world_size, out, result, mode):
    """The DDP hook (overlapped or blocking) when a rank cannot name a bucket's gradients
    (here: rank 1's HookState does not know a parameter at step 1): it still takes part, every
    rank's backward pass raises at that step (rank 1 its own ValueError, the others a
    GradwireError), and the next step runs on every rank alike. Then an AllReduce dropped with
    a step in flight: the step completes and its handle gives the result."""
    model = model_of()
    group = dist.new_group() if mode != "blocking" else None
    ar = gradwire.AllReduce("topk k=ratio:0.05 values=int8:256", TorchDistributed(group), seed=5)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    state = gwt.HookState(ddp, ar, overlap=mode == "overlap", delay=mode == "delay",
                          skip_non_finite=False)
    ddp.register_comm_hook(state, gwt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    x, y = data(rank)
    result.update(raised=[], errors=[], digests=[])
    for step in range(4 if mode == "delay" else 3):
        hidden = None
        if step == 1 and rank == 1:
            hidden = next(iter(state.names))
            name = state.names.pop(hidden)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[:32]), y[:32])
        try:
            loss.backward()
            opt.step()
            result["raised"].append(None)
        except RuntimeError as e:
            result["raised"].append(str(e))
        result["errors"].append(type(state.last_error).__name__ if state.last_error else None)
        if hidden is not None:
            state.names[hidden] = name
        result["digests"].append(digest(model))
    if mode == "delay":
        result["step"] = ar.step
        return
    result["step"] = ar.step
    # Dropped with a step in flight: the step still runs on every rank.
    g = seeded_grads(rank, (64, 48), 700)
    temp = gradwire.AllReduce("topk k=ratio:0.05 values=int8:64", TorchDistributed(dist.new_group()), seed=3)
    handle = temp.start_(g)
    del temp
    handle.wait()
    result["dropped"] = {k: v.tobytes().hex() for k, v in g.items()}


def tensor_hex(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()


@worker
def delayed(rank, world_size, out, result, dtype_name, accumulate, steps):
    """Issue 47 scope 3: the delayed hook. Every synchronized step records the bucket
    gradients DDP hands over (by name) and the gradients the hook hands back; afterwards a
    blocking all-reduce of the same method and seed (a group of its own) replays the recorded
    gradients step by step. The hook must hand out zeros at step 0 and, at step t, the
    replay's mean of step t - 1, bit for bit."""
    dtype = getattr(torch, dtype_name)
    model = model_of(dtype)
    method = "topk k=ratio:0.05 values=int8:256"
    ar = gradwire.AllReduce(method, TorchDistributed(dist.new_group()), seed=5)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    state = gwt.HookState(ddp, ar, delay=True)
    inputs, calls = [], []

    def recording_hook(state, bucket):
        calls[-1] += 1
        buf, at = bucket.buffer(), 0
        for p in bucket.parameters():
            n = p.numel()
            inputs[-1][state.names[p]] = buf[at : at + n].detach().clone().view(p.shape)
            at += n
        return gwt.comm_hook(state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    x, y = data(rank)
    x = x.to(dtype)
    handed, digests, losses = [], [], []
    for step in range(steps):
        i = (step * 32) % x.shape[0]
        inputs.append({})
        calls.append(0)
        opt.zero_grad()
        batch_loss(ddp, x, y, i, accumulate).backward()
        handed.append({n: p.grad.detach().clone() for n, p in ddp.named_parameters()})
        opt.step()
        with torch.no_grad():
            losses.append(nn.functional.cross_entropy(ddp(x).float(), y).item())
        digests.append(digest(model))
    state.flush()
    replay = gradwire.AllReduce(method, TorchDistributed(dist.new_group()), seed=5)
    mismatches = []
    for step in range(steps):
        if step == 0:
            if any(bool(g.any()) for g in handed[0].values()):
                mismatches.append("step 0 handed out a non-zero gradient")
        else:
            want = {n: t.clone() for n, t in inputs[step - 1].items()}
            replay.all_reduce_(want)
            for n, t in want.items():
                if tensor_hex(t.to(dtype)) != tensor_hex(handed[step][n]):
                    mismatches.append(f"step {step} {n}")
    result.update(mismatches=mismatches, digests=digests, losses=losses, step=ar.step,
                  buckets=calls)


@worker
def delayed_faults(rank, world_size, out, result):
    """Issue 47 scope 3: rank 1's gradient holds a NaN at step 2. Step 2's exchange fails (on
    every rank alike); every rank's backward pass raises at step 3, with the gradwire class
    named; step 4 goes on (handing out step 3's mean: the same, non-zero, on every rank)."""
    model = model_of()
    ar = gradwire.AllReduce("topk k=ratio:0.05 values=int8:256", TorchDistributed(dist.new_group()), seed=5)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    state = gwt.HookState(ddp, ar, delay=True)
    ddp.register_comm_hook(state, gwt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    x, y = data(rank)
    result.update(raised=[], digests=[], handed=[])
    for step in range(6):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[:32]), y[:32])
        if step == 2 and rank == 1:
            loss = loss * float("nan")
        try:
            loss.backward()
            # What the hook handed out: a digest, and whether any of it is non-zero.
            h = hashlib.sha256()
            for _, p in sorted(ddp.named_parameters()):
                h.update(p.grad.detach().numpy().tobytes())
            nonzero = any(bool(p.grad.any()) for p in ddp.parameters())
            result["handed"].append([h.hexdigest(), nonzero])
            opt.step()
            result["raised"].append(None)
        except RuntimeError as e:
            result["raised"].append(str(e))
            result["handed"].append(None)
        result["digests"].append(digest(model))
    result["step"] = ar.step


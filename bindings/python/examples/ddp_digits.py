"""DDP with gradwire's comm hook: 4 gloo processes on CPU train an MLP (64-256-256-10) on the
digits data set (1,797 real 8x8 images, from scikit-learn), with DDP's own all-reduce and with
top-k 1% + error feedback (int8 values) through gradwire's comm hook, blocking (the buckets
held, one all-reduce of the whole model after the last), overlapped (each bucket's step
started when DDP hands it over, on a process group of its own) and delayed (each step applies
the step before's mean, its own exchange left running behind the next step); prints test accuracy, bytes per
rank per step against DDP's dense ring all-reduce, and checks that every rank's parameters are
bit-identical after every step, and the overlapped hook's to the blocking hook's.

    pip install ./bindings/python scikit-learn torch
    python bindings/python/examples/ddp_digits.py [--steps 300] [--workers 4] [--seeds 1 2 3]
        [--modes ddp blocking overlapped delayed] [--momentum 0.9] [--delayed-momentum 0]

The delayed mode trains with SGD's momentum set to ``--delayed-momentum`` (0 by default) and
its learning rate scaled to keep the other modes' effective step ``lr / (1 - momentum)`` (0.05
at momentum 0.9 becomes 0.5 at momentum 0): a one-step delay acts as momentum of its own
(Mitliagkas et al., "Asynchrony begets momentum", 2016), and delay and momentum 0.9 together
overshoot (docs/python.md, "Measured", has the sweep).
"""

import argparse
import hashlib
import json
import math
import os
import socket
import sys
import tempfile
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import gradwire
import gradwire.torch as gwt
from gradwire.comm import TorchDistributed

METHOD = "topk k=ratio:0.01 values=int8:256"


def digits():
    """The fixed 80/20 split (seeded), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(7).permutation(len(d.target))
    n_test = round(0.2 * len(order))
    x = torch.tensor(d.data[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target[order], dtype=torch.long)
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


BASE_LR = 0.05


def lr_at(step, steps, base=BASE_LR, warmup=10):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.5 * base * (1 + math.cos(math.pi * t))


def digest(model):
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def worker(rank, world_size, port, out, mode, steps, seed, momentum, lr):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    (x, y), (xt, yt) = digits()
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    compressed = mode != "ddp"
    if mode == "blocking":  # the 3 lines gradwire adds to a DDP script
        allreduce = gradwire.AllReduce(METHOD, TorchDistributed(), seed=seed)
        ddp.register_comm_hook(gwt.HookState(ddp, allreduce), gwt.comm_hook)
    elif mode in ("overlapped", "delayed"):  # the transport's calls come from the library's
        # own thread: a process group of their own, apart from DDP's broadcasts on the default one
        allreduce = gradwire.AllReduce(METHOD, TorchDistributed(dist.new_group()), seed=seed)
        state = gwt.HookState(ddp, allreduce, overlap=True, delay=mode == "delayed")
        ddp.register_comm_hook(state, gwt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    shard = torch.arange(rank, len(y), world_size)  # each rank its own samples
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    digests = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, base=lr)
        batch = shard[torch.randint(len(shard), (32,), generator=g)]
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[batch]), y[batch]).backward()
        opt.step()
        digests.append(digest(model))
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item() * 100
    n = sum(p.numel() for p in model.parameters())
    result = {"acc": acc, "digests": digests, "params": n}
    if compressed:
        result["recv_per_step"] = allreduce.traffic[1] / steps
        result["bundle"] = allreduce.last_message_bytes
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    # Leave without the interpreter's shutdown: gloo's worker thread may still be freeing the
    # last collective's tensors, and a thread that asks for the GIL during shutdown aborts the
    # process (a PyTorch race at exit: docs/python.md, "Ending a process").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def delayed_settings(momentum, delayed_momentum, lr=BASE_LR):
    """The delayed mode's (momentum, lr): the same effective step lr / (1 - momentum)."""
    return delayed_momentum, lr * (1 - delayed_momentum) / (1 - momentum)


def run(world_size, mode, steps, seed, momentum=0.9, lr=BASE_LR):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(world_size, port, out, mode, steps, seed, momentum, lr),
                           nprocs=world_size, join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world_size)]
    identical = all(r["digests"] == ranks[0]["digests"] for r in ranks)
    return ranks[0], identical


LABELS = {"ddp": "DDP all-reduce", "blocking": "gradwire hook", "overlapped": "gradwire overlap",
          "delayed": "gradwire delayed"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--modes", nargs="+", choices=list(LABELS), default=list(LABELS))
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    ap.add_argument("--delayed-momentum", type=float, default=0.0,
                    help="the delayed mode's momentum (its lr keeps lr / (1 - momentum))")
    a = ap.parse_args(argv)
    if not (0 <= a.momentum < 1 and 0 <= a.delayed_momentum < 1):
        ap.error("momentum must be in [0, 1)")
    rows = {}
    for mode in a.modes:
        accs, same, runs = [], True, []
        for seed in a.seeds:
            momentum, lr = ((a.momentum, BASE_LR) if mode != "delayed"
                            else delayed_settings(a.momentum, a.delayed_momentum))
            r, identical = run(a.workers, mode, a.steps, seed, momentum, lr)
            accs.append(r["acc"])
            runs.append(r)
            same = same and identical
        rows[mode] = (accs, same, runs)
    w, n = a.workers, next(iter(rows.values()))[2][0]["params"]
    ring = 2 * (w - 1) / w * 4 * n  # DDP's dense ring all-reduce, bytes received per rank
    delayed_momentum, delayed_lr = delayed_settings(a.momentum, a.delayed_momentum)
    print(f"{w} gloo processes, {a.steps} steps, batch 32 per rank, {n} parameters, seeds {a.seeds}, "
          f"SGD momentum {a.momentum}, lr {BASE_LR} (delayed: momentum {delayed_momentum}, lr {delayed_lr:g})")
    print(f"gradwire method: {METHOD}, error feedback; DDP's bytes: a ring all-reduce of f32, 2(W-1)/W x 4n")
    print(f"{'run':<17} {'test acc % (mean)':>18} {'per seed':>24} {'bytes recv/rank/step':>21} {'vs DDP':>7} {'ranks bit-identical':>20}")
    for mode, (accs, same, runs) in rows.items():
        recv = runs[-1]["recv_per_step"] if mode != "ddp" else ring
        per_seed = " ".join(f"{v:.2f}" for v in accs)
        print(f"{LABELS[mode]:<17} {np.mean(accs):>18.2f} {per_seed:>24} {recv:>21,.0f} {ring / recv:>6.1f}x {str(same):>20}")
    result = {mode: rows[mode][0] for mode in rows}
    result["identical"] = all(same for _, same, _ in rows.values())
    if "ddp" in rows:
        for mode in ("blocking", "overlapped", "delayed"):
            if mode in rows:
                gap = np.mean(rows["ddp"][0]) - np.mean(rows[mode][0])
                print(f"accuracy gap, {LABELS[mode]}: {gap:+.2f} points (below DDP when positive)")
                result[f"gap_{mode}"] = gap
    if "blocking" in rows:
        result["ratio"] = ring / rows["blocking"][2][-1]["recv_per_step"]
    if "blocking" in rows and "overlapped" in rows:
        # Every step's parameters, every seed: the overlapped hook is the blocking hook's result.
        equal = all(b["digests"] == o["digests"] for b, o in zip(rows["blocking"][2], rows["overlapped"][2]))
        print(f"overlapped hook's parameters equal to the blocking hook's after every step: {equal}")
        result["overlap_equals_blocking"] = equal
    return result


if __name__ == "__main__":
    main()

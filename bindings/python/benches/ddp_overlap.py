"""DDP step time over emulated slow links (issue 47's speed comparison): W gloo processes, one
per netsim host (``netsim/netsim.sh``: network namespaces joined by a bridge, every link shaped
both ways with tc), train an MLP on CPU with

- ``ddp``: DDP's own all-reduce (a dense f32 ring all-reduce),
- ``blocking``: gradwire's DDP hook holding the buckets and running one all-reduce of the whole
  model after the last one,
- ``overlapped``: the hook starting each bucket's step when DDP hands it over, on the
  all-reduce's communication thread, while the backward pass goes on;
- ``delayed``: the hook handing out the step before's mean at once and leaving this step's
  exchange running behind the next forward and backward pass (one step late).

In the same run, on the same ranks sharing the same cores (``torch.set_num_threads(1)``), the
three floors of a step: ``compute`` (forward, backward and optimizer step under ``no_sync()``,
no communication), ``codec`` (gradwire's all-reduce of the same gradients over a group of one:
encode and decode, no transfer) and ``transfer`` (a raw ``all_gather`` over the hook's process
group of byte buffers as long as gradwire's message of the step), and ``round``: one 16-byte
``all_gather`` over the same links, the latency every collective call pays (a gradwire step of
the all-gather collective over this transport makes four: the skip verdict and the messages,
each after its length exchange).
``cpu/cores``: every rank's CPU seconds a timed step (the whole process, every thread) summed and
divided by the machine's cores: with the ranks sharing the cores, no step can be shorter.
The bound a fully overlapped
step can reach is ``max(compute + codec, transfer)``; DDP's own is ``max(compute, dense)``, with
``dense`` its all-reduce of every gradient as one f32 buffer over the same group.

Run as root (namespaces), after installing the wheel and torch in the Python that runs it::

    python bindings/python/benches/ddp_overlap.py [--rates 100mbit 1gbit] [--workers 4]
        [--steps 20] [--modes ddp blocking overlapped delayed] [--json out.json]

``--rates none`` runs on unshaped links; ``--loopback`` runs the ranks in this namespace over
127.0.0.1 (no root needed: a smoke run). Prints one row per rate and mode: the step time (the
timed steps run back to back after one barrier, their interval, up to the end of the last
step's exchange, divided by their number; the slowest rank's), the floors (medians over their
steps, a barrier before each), and the ratio to the bound.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
NETSIM = os.path.join(REPO, "netsim", "netsim.sh")
METHOD = "topk k=ratio:0.01 values=int8:256"
PORT = 29517


def build_model(width, depth, inputs, classes):
    import torch.nn as nn

    layers, n = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(n, width), nn.ReLU()]
        n = width
    layers.append(nn.Linear(n, classes))
    return nn.Sequential(*layers)


def worker(a):
    """One rank: a JSON line of its timings on stdout."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import gradwire
    import gradwire.torch as gwt
    from gradwire.comm import TorchDistributed

    torch.set_num_threads(1)
    rank, world = a.rank, a.workers
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    torch.manual_seed(1)  # the same initial weights on every rank
    model = build_model(a.width, a.depth, a.inputs, 10)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_cap_mb)
    hook_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    # The benchmark's own barriers and floors: a group apart from the hook's, whose transport
    # runs on the library's thread (the delayed hook's exchange outlives the step).
    bench_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    allreduce = state = None
    calls = [0]  # the hook's calls: DDP's buckets
    if a.mode != "ddp":
        allreduce = gradwire.AllReduce(METHOD, TorchDistributed(hook_group), seed=1)
        state = gwt.HookState(ddp, allreduce, overlap=a.mode != "blocking", delay=a.mode == "delayed")
        def counting_hook(state, bucket):
            calls[0] += 1
            return gwt.comm_hook(state, bucket)

        ddp.register_comm_hook(state, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(a.batch, a.inputs, generator=g)
    y = torch.randint(10, (a.batch,), generator=g)

    def one_step(sync=True):
        opt.zero_grad(set_to_none=False)
        if sync:
            nn.functional.cross_entropy(ddp(x), y).backward()
        else:
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    def barrier():
        dist.barrier(group=bench_group)

    # Warm-up: DDP builds its buckets at the first step, the hook its views.
    for _ in range(3):
        one_step()
    sent_before = allreduce.traffic[0] if allreduce else 0
    calls_before = calls[0]
    # The timed steps back to back, as training runs them, timed as one interval that ends
    # when the last step's exchange is done (the delayed hook's runs behind the next step:
    # a barrier between steps would give it time no other mode gets).
    barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(a.steps):
        one_step()
    if state is not None and state.delay:
        state.flush()
    steps = [(time.perf_counter() - t0) / a.steps]
    # CPU time of the whole process (every thread: the library's, gloo's) per step.
    cpu_per_step = (time.process_time() - cpu0) / a.steps
    sent_per_step = ((allreduce.traffic[0] - sent_before) / a.steps) if allreduce else 0.0
    # (DDP's own all-reduce runs no hook: its buckets are not counted.)
    buckets_per_step = (calls[0] - calls_before) / a.steps if state is not None else None

    # Floors, on the same ranks and cores.
    compute = []
    for _ in range(a.floor_steps):
        barrier()
        t0 = time.perf_counter()
        one_step(sync=False)
        compute.append(time.perf_counter() - t0)
    grads = {name: p.grad.detach().clone().numpy() for name, p in model.named_parameters()}

    from gpt2_step import Alone  # a group of one (this script's folder is on the path)

    alone = gradwire.AllReduce(METHOD, Alone(), seed=1)
    codec = []
    for _ in range(a.floor_steps):
        work = {k: v.copy() for k, v in grads.items()}
        barrier()
        t0 = time.perf_counter()
        alone.all_reduce_(work)
        codec.append(time.perf_counter() - t0)
    # The message a gradwire step puts on the wire (the whole model's, as the blocking hook
    # sends it): its length from a step of this rank's group of one.
    longest = torch.tensor([alone.last_message_bytes])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=bench_group)  # gloo wants even buffers
    message = int(longest.item())
    transfer = []
    mine = torch.zeros(message, dtype=torch.uint8)
    outs = [torch.empty(message, dtype=torch.uint8) for _ in range(world)]
    for _ in range(a.floor_steps):
        barrier()
        t0 = time.perf_counter()
        dist.all_gather(outs, mine, group=bench_group)
        transfer.append(time.perf_counter() - t0)
    rounds = []
    tiny = torch.zeros(16, dtype=torch.uint8)
    tinies = [torch.empty(16, dtype=torch.uint8) for _ in range(world)]
    for _ in range(a.floor_steps):
        barrier()
        t0 = time.perf_counter()
        dist.all_gather(tinies, tiny, group=bench_group)
        rounds.append(time.perf_counter() - t0)
    dense = []
    flat = torch.zeros(n_params, dtype=torch.float32)
    for _ in range(a.floor_steps):
        barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat, group=bench_group)
        dense.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "rank": rank,
                "params": n_params,
                "steps": steps,
                "compute": compute,
                "codec": codec,
                "transfer": transfer,
                "round": rounds,
                "buckets_per_step": buckets_per_step,
                "cpu_per_step": cpu_per_step,
                "dense_all_reduce": dense,
                "message_bytes": message,
                "gradwire_sent_per_step": sent_per_step,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()
    # Leave without the interpreter's shutdown (docs/python.md, "Ending a process").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def netsim(*args):
    subprocess.run(["bash", NETSIM, *args], check=True, stdout=subprocess.DEVNULL)


def counters():
    """Bytes each host sent on its link so far (the bridge's count)."""
    out = subprocess.run(["bash", NETSIM, "counters"], check=True, capture_output=True, text=True).stdout
    return {int(f[0]): int(f[1]) for f in (line.split() for line in out.splitlines()) if len(f) == 3}


def launch(a, mode, loopback, port):
    """Runs the W ranks of one mode; returns their JSON records (rank order)."""
    procs = []
    for r in range(a.workers):
        cmd = [
            sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r), "--mode", mode,
            "--master", "127.0.0.1" if loopback else "10.77.0.10", "--port", str(port),
        ] + [f"--{k.replace('_', '-')}={v}" for k, v in sorted(vars(a).items())
             if k in ("workers", "steps", "floor_steps", "width", "depth", "inputs", "batch", "bucket_cap_mb")]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo" if loopback else "eth0", OMP_NUM_THREADS="1")
        if not loopback:
            cmd = ["ip", "netns", "exec", f"gwns-h{r}"] + cmd
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True))
    records = []
    for p in procs:
        out, _ = p.communicate(timeout=a.timeout)
        if p.returncode != 0:
            raise SystemExit(f"ddp_overlap: a rank of mode {mode} exited with {p.returncode}")
        records.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(records, key=lambda r: r["rank"])


def slowest_median(records, key):
    """The median over steps of the slowest rank's time at each step."""
    return statistics.median(max(col) for col in zip(*(r[key] for r in records)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    ap.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--modes", nargs="+", default=["ddp", "blocking", "overlapped", "delayed"])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--floor-steps", type=int, default=5, help="timed steps per floor")
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size (its default 25)")
    ap.add_argument("--loopback", action="store_true", help="ranks here, over 127.0.0.1, no shaping")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    rows = []
    for rate in ["loopback"] if a.loopback else a.rates:
        if rate != "loopback":
            netsim("up", str(a.workers), rate)
        try:
            for i, mode in enumerate(a.modes):
                before = counters() if rate != "loopback" else {}
                t0 = time.perf_counter()
                recs = launch(a, mode, rate == "loopback", PORT + i)
                wall = time.perf_counter() - t0
                after = counters() if rate != "loopback" else {}
                row = {
                    "rate": rate,
                    "mode": mode,
                    "params": recs[0]["params"],
                    "step": slowest_median(recs, "steps"),
                    "compute": slowest_median(recs, "compute"),
                    "codec": slowest_median(recs, "codec"),
                    "transfer": slowest_median(recs, "transfer"),
                    "round": slowest_median(recs, "round"),
                    "buckets_per_step": recs[0]["buckets_per_step"],
                    # Every rank's CPU seconds a step over the machine's cores: the step's
                    # wall time when the ranks share the cores and none waits.
                    "cpu_bound": sum(r["cpu_per_step"] for r in recs) / len(os.sched_getaffinity(0)),
                    "dense_all_reduce": slowest_median(recs, "dense_all_reduce"),
                    "message_bytes": max(r["message_bytes"] for r in recs),
                    "gradwire_sent_per_step": max(r["gradwire_sent_per_step"] for r in recs),
                    "link_sent_per_run": max((after[h] - before.get(h, 0) for h in after), default=None),
                    "wall": wall,
                }
                # DDP's own floor: its compute beside its dense all-reduce (it overlaps too).
                row["bound"] = (max(row["compute"], row["dense_all_reduce"]) if mode == "ddp"
                                else max(row["compute"] + row["codec"], row["transfer"]))
                row["ratio"] = row["step"] / row["bound"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            if rate != "loopback":
                netsim("down")
    print(f"{a.workers} ranks, {rows[0]['params']:,} parameters (MLP {a.inputs}-{a.width}x{a.depth}-10), "
          f"batch {a.batch}, DDP buckets {a.bucket_cap_mb} MB, gradwire {METHOD} + EF, {a.steps} timed steps")
    print(f"{'link':<9} {'mode':<11} {'step s':>7} {'compute':>8} {'codec':>7} {'transfer':>9} "
          f"{'round':>7} {'buckets':>7} {'cpu/cores':>9} {'dense AR':>9} {'bound':>7} {'step/bound':>10} {'vs blocking':>11}")
    for row in rows:
        blocking = next((r for r in rows if r["rate"] == row["rate"] and r["mode"] == "blocking"), None)
        vs = f"{row['step'] / blocking['step']:.2f}" if blocking else "-"
        print(f"{row['rate']:<9} {row['mode']:<11} {row['step']:>7.3f} {row['compute']:>8.3f} {row['codec']:>7.3f} "
              f"{row['transfer']:>9.3f} {row['round']:>7.4f} {'-' if row['buckets_per_step'] is None else format(row['buckets_per_step'], '.1f'):>7} {row['cpu_bound']:>9.3f} {row['dense_all_reduce']:>9.3f} {row['bound']:>7.3f} {row['ratio']:>10.2f} {vs:>11}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

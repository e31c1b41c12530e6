#!/usr/bin/env python3
"""Renders netsim's report (run-report.sh) into docs/netsim.md, between its markers.

  report.py MANIFEST OUTDIR DOC COMMAND [SECTION]

SECTION names the block of DOC the report replaces (its own pair of markers), so that runs of
other links or world sizes keep their own tables beside it.

MANIFEST has one line per row: `rate method collective tag`; OUTDIR holds `tag.json` (the demo's
report) and `tag.before` / `tag.after` (netsim.sh counters around the launch).
"""
import json
import os
import platform
import subprocess
import sys
import time

def markers(section):
    name = f" {section}" if section else ""
    return (f"<!-- netsim-report:begin{name} (written by netsim/run-report.sh) -->",
            f"<!-- netsim-report:end{name} -->")


# (workload, rate, method) -> minimum speed-up per step against dense-f32-allreduce on the same
# link, W = 4.
SPEEDUP = {
    ("digits-mlp", "100mbit", "topk-1%-ef-int8"): 12,
    ("digits-mlp", "100mbit", "sign-ef"): 12,
    ("digits-mlp", "10mbit", "topk-1%-ef-int8"): 100,
    ("digits-mlp", "10mbit", "sign-ef"): 30,
    ("digits-mlp", "10mbit", "quant4-ef"): 9,
    ("minilm-replay", "100mbit", "topk-1%-ef-int8"): 40,
}
WORKLOAD = {
    "digits-mlp": "the MLP on the digits (85,002 parameters)",
    "minilm-replay": "the MiniLM replay (789,504 values, no model)",
    "gpt2-replay": "the GPT-2 replay (124,439,808 values: GPT-2 small's 148 shapes, MiniLM's "
    "gradients tiled; no model)",
}


# The dense rows run outside --collective: MPI's all-reduce, gradwire's rank-order f32 all-reduce.
COLLECTIVE = {
    ("dense-f32-allreduce", "allgather"): "MPI_Allreduce (Open MPI's choice)",
    ("dense-f32-allreduce", "ring"): "MPI_Allreduce, ring forced",
    ("dense-f32", "allgather"): "gradwire f32 all-reduce",
}

# W = 8 at 10 Mbit/s: minimum speed-up of the two-phase row over the all-gather row.
TWO_PHASE_GAIN_W8 = {"quant4-ef": 2.5, "sign-ef": 2.0}

PHASES = ("compute_s", "encode_s", "wait_s", "comm_s", "decode_s", "update_s")


def link_label(link):
    rate, _, delay = link.partition(":")
    rate = "unshaped" if rate == "none" else rate
    return f"{rate}, {delay} ms one-way delay" if delay else rate


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def counters(path):
    hosts = {}
    with open(path) as f:
        for line in f:
            h, tx, rx = line.split()
            hosts[int(h)] = (int(tx), int(rx))
    return hosts


def row_data(outdir, rate, method, collective, tag):
    rep = json.load(open(os.path.join(outdir, tag + ".json")))
    steps = rep["config"]["train"]["steps"]
    # The phases cover the steps after the untimed ones; bytes and counters every step.
    timed = max(1, steps - rep["config"]["train"].get("untimed_steps", 0))
    res, tim = rep["results"][0], rep["timing"][0]
    ph = tim["runs"][0]["phases"]
    before, after = counters(os.path.join(outdir, tag + ".before")), counters(os.path.join(outdir, tag + ".after"))
    port_tx = [(after[h][0] - before[h][0]) / steps for h in before]
    return {
        "rate": rate, "method": method, "collective": collective, "steps": steps,
        "workers": rep["config"]["workers"],
        "ms": tim["step_ms"],
        "phases": [1e3 * ph.get(k, 0.0) / timed for k in PHASES],
        "untimed": steps - timed,
        "barrier": rep["config"]["train"].get("wait_barrier", False),
        "workload": rep["config"]["train"].get("workload", "digits-mlp"),
        "prog_sent": res["runs"][0]["traffic"]["sent_mean"],
        # The busiest rank's bytes bound a step's transfer (issue 46's transfer floor).
        "prog_max": max(res["runs"][0]["traffic"].get("sent_max", 0.0),
                        res["runs"][0]["traffic"].get("received_max", 0.0)),
        "if_tx": ph["netdev_tx_bytes"] / steps,
        "port_tx": sum(port_tx) / len(port_tx),
        "acc": 100 * res["runs"][0]["test_accuracy"],
        "curve_acc": [100 * p["test_accuracy"] for p in res["runs"][0]["curve"]],
        "curve_s": tim["runs"][0].get("curve_s", []),
    }


def time_to(r, target):
    """Rank 0's training seconds at the first evaluation at or above `target` %, or None."""
    for acc, s in zip(r["curve_acc"], r["curve_s"]):
        if acc >= target:
            return s
    return None


def ms_text(r):
    if len(r["all_ms"]) == 1:
        return f"{r['ms']:.1f}"
    runs = ", ".join(f"{m:.1f}" for m in r["all_ms"])
    return f"{r['ms']:.1f} (median of {len(r['all_ms'])}: {runs})"


def fmt_bytes(b):
    return f"{b:,.0f}"


def rate_bits(rate):
    """Bits per second of a tc rate (`100mbit`, `1gbit`, `12mbps`: tc's `bps` is bytes); None
    when unshaped or not understood (the floors' table is then left out, and says so)."""
    units = (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0),
             ("gbps", 8e9), ("mbps", 8e6), ("kbps", 8e3), ("bps", 8.0))
    for unit, scale in units:
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale
            except ValueError:
                return None
    return None


def load_floors(path):
    """(method, collective) -> the `scale` row of its codec floor (run-report.sh, the GPT-2
    replay only); empty without the file."""
    floors = {}
    if path and os.path.exists(path):
        for line in open(path):
            if line.strip():
                f = json.loads(line)
                floors[(f["method"], f["collective"])] = f["row"]
    return floors


def collective_s(r):
    """A row's collective part in s a step: *comm*. Every row of the GPT-2 replay runs its own
    collective (gradwire's all-reduce in place, or `MPI_Allreduce`), whose encode and decode
    are inside that call; the loop's *encode* is then the copy of the replayed gradient into
    the buffers reduced in place, and its *decode* the digest of the mean (the demo's checks),
    so neither is counted, nor the noise, the update or, with `--wait-barrier`, the wait for
    the slowest rank."""
    return r["phases"][3] / 1e3


def floor_lines(rate, rr, floors):
    """Issue 46's netsim acceptance for one link: each gradwire row's collective part against
    max(codec floor, transfer floor)."""
    bits = rate_bits(rate.partition(":")[0])
    base = next((r for r in rr if r["method"] == "dense-f32-allreduce" and r["collective"] == "allgather"), None)
    if not floors:
        return []
    if bits is None:
        return [f"\nNo floors' table for {link_label(rate)}: its rate is not a tc rate this "
                "report reads.\n"]
    out = [f"\nAgainst the floors on {link_label(rate)} (issue 46): the collective part (*comm*, s a "
           "step: gradwire's all-reduce in place, its encode and decode inside; the demo's copy "
           "of the replayed gradient, digest, noise and update left out, and with a barrier the "
           "wait for the slowest rank) against max(codec "
           "floor, transfer floor). Codec floor: `scale`'s `kernel_floor_wall_s`, gradwire-core's "
           "kernels alone on GPT-2 small's shapes (seeded heavy-tailed values), the W ranks as "
           "threads at once on this machine; transfer floor: the busiest rank's program bytes sent "
           "or received / the rate. Target: at most 1.25x (dense f32: within 1.05x of `MPI_Allreduce`, "
           "the table above).\n",
           "| method | collective | collective part s | codec floor s | transfer floor s | part / max floor | met? | "
           "vs MPI_Allreduce, collective part | vs MPI_Allreduce, whole step |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rr:
        f = floors.get((r["method"], r["collective"]))
        if f is None or r["method"] == "dense-f32-allreduce":
            continue
        codec = f.get("kernel_floor_wall_s")
        transfer = 8 * r["prog_max"] / bits
        part = collective_s(r)
        top = max(codec or 0.0, transfer)
        ratio = part / top if top > 0 else float("nan")
        met = "met" if ratio <= 1.25 else ("**miss**" if ratio > 1.25 else "-")
        if r["method"] == "dense-f32":
            met = "(see above)"
        vs_part = f"{collective_s(base) / part:.1f}x" if base and part > 0 else "-"
        vs_step = f"{base['ms'] / r['ms']:.1f}x" if base and r["ms"] > 0 else "-"
        codec_text = f"{codec:.3f}" if codec is not None else "-"
        out.append(f"| {r['method']} | {COLLECTIVE.get((r['method'], r['collective']), r['collective'])} "
                   f"| {part:.3f} | {codec_text} | {transfer:.3f} | {ratio:.2f} | {met} | {vs_part} | {vs_step} |")
    return out


def main(manifest, outdir, doc, command, section=""):
    floors = load_floors(os.environ.get("NETSIM_FLOORS"))
    begin, end = markers(section)
    runs = {}
    for line in open(manifest):
        rate, method, collective, tag = line.split()
        runs.setdefault((rate, method, collective), []).append(row_data(outdir, rate, method, collective, tag))
    rows = []
    for group in runs.values():
        # Repeated rows (the dense ones): the run with the median ms/step stands for them.
        group.sort(key=lambda r: r["ms"])
        row = dict(group[len(group) // 2])
        row["all_ms"] = [r["ms"] for r in group]
        rows.append(row)
    lines = []
    rates = []
    for r in rows:
        if r["rate"] not in rates:
            rates.append(r["rate"])
    for rate in rates:
        rr = [r for r in rows if r["rate"] == rate]
        base = next((r for r in rr if r["method"] == "dense-f32-allreduce" and r["collective"] == "allgather"), None)
        ring = next((r for r in rr if r["method"] == "dense-f32-allreduce" and r["collective"] == "ring"), None)
        q_ag = next((r for r in rr if r["method"] == "quant4-ef" and r["collective"] == "allgather"), None)
        workers = rr[0]["workers"]
        barrier = ("; a barrier before each collective (`--wait-barrier`): *wait* is the time spent "
                   "waiting for the slowest rank, *comm* the transfer" if rr[0]["barrier"] else
                   "; no barrier: *comm* includes waiting for the slowest rank")
        workload = rr[0]["workload"]
        lines.append(f"\n**{link_label(rate)}**, {WORKLOAD.get(workload, workload)}, W = {workers}, "
                     f"{rr[0]['steps']} steps"
                     + (f" (the first {rr[0]['untimed']} untimed)" if rr[0]["untimed"] else "")
                     + ", seed 1 "
                     f"(phases and bytes: the median run's, mean over ranks{barrier})\n")
        lines.append("| method | collective | ms/step | compute / encode / wait / comm / decode / update ms | "
                     "program bytes sent/rank/step | interface tx/rank/step (loop) | interface / program | "
                     "bridge port tx/host/step (whole launch) | vs dense-f32-allreduce | vs the ring-forced one | target | met? |")
        lines.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|")
        for r in rr:
            speed = base["ms"] / r["ms"] if base else float("nan")
            speed_ring = ring["ms"] / r["ms"] if ring else float("nan")
            target, met = "", ""
            if r["method"] == "dense-f32-allreduce":
                target, met = ("(baseline)" if r["collective"] == "allgather" else "(not a target)"), ""
            elif r["method"] == "dense-f32" and rate.startswith("none"):
                pass
            elif r["method"] == "dense-f32":
                limit = 1.05 * base["ms"]
                target = f"<= {limit:.1f} ms (5% over the baseline)"
                met = "met" if r["ms"] <= limit else "**miss**"
            elif workers == 8 and rate == "10mbit" and r["collective"] == "two-phase" \
                    and r["method"] in TWO_PHASE_GAIN_W8:
                ag = next((x for x in rr if x["method"] == r["method"] and x["collective"] == "allgather"), None)
                need = TWO_PHASE_GAIN_W8[r["method"]]
                gain = ag["ms"] / r["ms"] if ag else float("nan")
                target = f">= {need}x over the all-gather row (is {gain:.2f}x)"
                met = "met" if gain >= need else "**miss**"
            elif workers == 4 and (workload, rate, r["method"]) in SPEEDUP:
                need = SPEEDUP[(workload, rate, r["method"])]
                target = f">= {need}x"
                met = "met" if speed >= need else "**miss**"
            if r["method"] == "quant4-ef" and r["collective"] == "two-phase" and rate == "100mbit" and workers == 4 \
                    and workload == "digits-mlp" and q_ag:
                gain = q_ag["ms"] / r["ms"]
                target = f">= 1.5x over the all-gather row (is {gain:.2f}x)"
                met = "met" if gain >= 1.5 else "**miss**"
            if r["method"] in ("dense-f32", "dense-f32-allreduce"):
                within = abs(r["if_tx"] / r["prog_sent"] - 1) <= 0.05
                met += ("; " if met else "") + ("bytes within 5%" if within else "**bytes off by more than 5%**")
            lines.append(
                f"| {r['method']} | {COLLECTIVE.get((r['method'], r['collective']), r['collective'])} "
                f"| {ms_text(r)} | {' / '.join(f'{p:.1f}' for p in r['phases'])} "
                f"| {fmt_bytes(r['prog_sent'])} | {fmt_bytes(r['if_tx'])} | {r['if_tx'] / r['prog_sent']:.3f} "
                f"| {fmt_bytes(r['port_tx'])} | {speed:.1f}x | {speed_ring:.1f}x | {target} | {met} |")
        lines.extend(floor_lines(rate, rr, floors))
        if base and len(base["curve_acc"]) > 2:
            goal = base["acc"] - 0.5
            base_t = time_to(base, goal)
            lines.append(f"\nTime to accuracy on {link_label(rate)}: seconds of training (rank 0, "
                         f"evaluation excluded) until the test accuracy first reaches {goal:.2f} % "
                         f"(the final accuracy of `dense-f32-allreduce`, {base['acc']:.2f} %, minus "
                         f"0.5 points), evaluated every {rr[0]['steps'] // max(1, len(base['curve_acc']) - 1)} steps\n")
            lines.append("| method | collective | final test accuracy % | seconds to the goal | "
                         "vs dense-f32-allreduce | whole run s |")
            lines.append("|---|---|---:|---:|---:|---:|")
            for r in rr:
                t = time_to(r, goal)
                total = r["curve_s"][-1] if r["curve_s"] else float("nan")
                vs = f"{base_t / t:.1f}x" if (t and base_t) else "-"
                lines.append(
                    f"| {r['method']} | {COLLECTIVE.get((r['method'], r['collective']), r['collective'])} "
                    f"| {r['acc']:.2f} | {f'{t:.1f}' if t is not None else 'not reached'} | {vs} | {total:.1f} |")
    skipped = manifest[:-4] + ".skipped" if manifest.endswith(".txt") else manifest + ".skipped"
    for link in (open(skipped).read().split() if os.path.exists(skipped) else []):
        up, check = (os.path.join(outdir, f"{what}-{link}.txt") for what in ("up", "check"))
        up_text = open(up).read() if os.path.exists(up) else ""
        if up_text and "hosts up" not in up_text:
            why = [l for l in up_text.splitlines() if l.strip()][-1:]
            lines.append(f"\n**{link_label(link)}**: not measured: the hosts could not be made"
                         + (f" (`{why[0].strip()}`)" if why else "") + "\n")
            continue
        why = [l for l in open(check).read().splitlines() if "FAIL" in l] if os.path.exists(check) else []
        lines.append(f"\n**{link_label(link)}**: not measured: the shaping check failed"
                     + (f" (`{why[0].removeprefix('netsim: ')}`)" if why else "") + "\n")
    model = sh("lscpu | sed -n 's/^Model name: *//p'")
    facts = [
        f"- measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, code {sh('git describe --always --dirty')}",
        f"- {sh('nproc')} cores ({model}), "
        f"kernel {platform.release()}, {sh('mpirun --version | head -1')}, "
        f"load average at the end {' '.join(open('/proc/loadavg').read().split()[:3])}",
        f"- command: `{command}`",
    ]
    body = "\n".join([begin, "", *facts, *lines, "", end])
    replace_block(doc, begin, end, body, "# netsim\n")
    print(body)


def replace_block(doc, begin, end, block, new_doc_head):
    """Writes `block` (markers included) into `doc` in place of the text from `begin` to `end`,
    or appends it where the markers are missing; a missing `doc` starts as `new_doc_head`."""
    text = open(doc).read() if os.path.exists(doc) else new_doc_head
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main(*sys.argv[1:6])

#!/usr/bin/env python3
"""A cost model of the collectives on netsim's shaped links (issue 26, scope 4).

    python3 netsim/model.py        # no arguments: the defaults below

reads every `OUT/manifest*.txt` that exists (one row a line: `rate method collective tag`,
`OUT/tag.json` the demo's JSON report; rows whose JSON is missing are listed and skipped),
fits the model per link, checks it on every measured row, projects the byte table of
`docs/wscaling.md` to milliseconds per step for W = 4..64, and writes the result into
`docs/netsim-model.md` between `<!-- netsim-model:begin -->` and `<!-- netsim-model:end -->`
(the rest of that file is left as it is; a missing file is created). Options, all optional:
`--out out/netsim`, `--wscaling docs/wscaling.md`, `--doc docs/netsim-model.md`, `--stdout`
(print the block instead of writing the doc). Python 3.11 standard library only.

The model, per link (a tbf rate, optionally a netem delay), for one collective step of a rank:

    t = lambda0 * R(collective, W, sizes) + c_cpu + beta * bytes_max

- R: the point-to-point message rounds of the MPI calls the collective makes (see CALLS and
  the rounds_* functions: the algorithm Open MPI's coll/tuned fixed decision picks for that
  call's W and message size, and that algorithm's rounds);
- bytes_max: the larger of the rank's sent and received program bytes per step (full-duplex
  links; `results[0].runs[0].traffic`, max over ranks);
- beta = 8 / (rho * rate): rho is the share of the tbf rate the transfers achieve (TCP/IP and
  Ethernet headers, ACKs, MPI's protocol, and whatever else slows the bytes down; the timed
  single TCP stream of `netsim.sh check` gets 0.95-0.96); for the unshaped link beta is fitted
  directly (seconds per byte) and reported as an effective rate;
- the tbf bucket: for a measured row the rate is charged only for the bytes beyond what
  netsim's tbf bucket (NETSIM_BURST, default max(16 KB, 1 ms of the rate)) refilled while the
  link sat idle in the rest of the step; the projection (real links) charges every byte;
- c_cpu: the codec's CPU time that runs inside the timed call (the two-phase collective
  compresses and decompresses inside it; estimated from the all-gather row of the same method
  on the same link, encode + 2/W x decode; 0 for every other collective). It is not fitted, and
  it is left out of the projections.

lambda0 and beta are fitted per link by least squares on relative residuals (every row
weighs the same whatever its size: the rows span 3 ms to 2 s), closed form for 2 parameters,
on the W = 4 rows measured with the barrier (`config.train.wait_barrier`: there `comm_s` is
the transfer alone), falling back to the W = 4 rows without it (where `comm_s` includes
waiting for the slowest rank) and saying so; where both exist, the fit on the rows without
the barrier is shown too, for comparison. A negative parameter is clamped to 0 and the other
refitted alone; with fewer than 4 rows lambda0 is 0. Left out of every fit (checked only): Open
MPI's own MPI_Allreduce choice (see FIT_KINDS) and runs that evaluate during training.
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import sys
import time

from report import replace_block, sh  # shared with the report (netsim/ is on the path)

BEGIN = "<!-- netsim-model:begin -->"
END = "<!-- netsim-model:end -->"

# ---------------------------------------------------------------------------------------------
# Rounds of the MPI calls (Open MPI coll/tuned fixed decision rules, as in its
# coll_tuned_decision_fixed.c since 4.1; not read from the installed library). W and message
# sizes in bytes. A "round" is one step of the algorithm in which a rank sends and/or receives
# one message per peer it talks to in that step; a linear algorithm (every message posted at
# once) is one round.


def clog2(w):
    return max(1, math.ceil(math.log2(w))) if w > 1 else 0


def neighbor(w):
    # Neighbour exchange: W / 2 rounds, on an even W only (a ring otherwise).
    return w // 2 if w % 2 == 0 else w - 1


def rounds_allgather(w, per_rank):
    """MPI_Allgather of `per_rank` bytes from every rank."""
    if w <= 1:
        return 0
    if w == 2:
        return 1  # two_proc
    if w < 32:
        return clog2(w)  # recursive doubling
    small = 1024 if w < 64 else 512
    if per_rank < small:
        return clog2(w)  # recursive doubling
    if per_rank < 65536:
        return neighbor(w)
    return w - 1  # ring


def rounds_allgatherv(w, per_rank):
    """MPI_Allgatherv, `per_rank` bytes from each rank on average."""
    if w <= 1:
        return 0
    default = 1 + clog2(w)  # gatherv to rank 0 (linear), then a bcast (a tree)
    bruck, ring = clog2(w), w - 1
    if w == 2:
        return 1
    if w < 8:
        for limit, r in ((256, default), (4096, neighbor(w)), (8192, ring), (16384, neighbor(w)),
                         (262144, bruck)):
            if per_rank < limit:
                return r
        return neighbor(w)
    if w < 16:
        return default if per_rank < 1024 else bruck
    if w < 32:
        return default if per_rank < 128 else (bruck if per_rank < 262144 else ring)
    if w < 64:
        return default if per_rank < 256 else (bruck if per_rank < 8192 else ring)
    return default if per_rank < 256 else (bruck if per_rank < 4096 else ring)


def rounds_alltoall(w, per_pair):
    """MPI_Alltoall of `per_pair` bytes to every rank."""
    if w <= 1:
        return 0
    if w == 2:
        return 1
    if w < 16:
        return 1  # linear / linear_sync: every message at once
    if w < 32:
        return clog2(w) if 4 <= per_pair < 512 else 1  # modified Bruck
    return clog2(w) if per_pair < (512 if w < 64 else 1024) else 1


def rounds_alltoallv(w):
    """MPI_Alltoallv: basic linear (one round) for 4 <= W < 64, pairwise (W - 1) otherwise."""
    if w <= 1:
        return 0
    if 4 <= w < 64:
        return 1
    return w - 1


def rounds_allreduce(w, total, ring=False):
    """MPI_Allreduce (commutative sum) of `total` bytes; `ring`: the ring algorithm forced."""
    if w <= 1:
        return 0
    if ring:
        return 2 * (w - 1)
    rab = 2 * clog2(w) + (0 if w & (w - 1) == 0 else 2)  # Rabenseifner (reduce-scatter + allgather)
    recdbl = clog2(w) + (0 if w & (w - 1) == 0 else 2)
    if w < 4:
        return recdbl if total < 262144 else rab
    if w < 16:
        return recdbl if total < 8192 else rab
    if w < 32:
        return recdbl if total < 4096 else rab
    if w < 64:
        return rab
    return recdbl if total < 262144 else rab


# The MPI calls of one step of each collective (std-adapter/src/comm/mpi.rs,
# std-adapter/src/collective/, demo/src/mpi_dense.rs): (MPI call, size key).
# Communicator::all_gather = MPI_Allgather of 12 u64 (96 B: call kind, length, limit, round
# budget, up to 64 inline bytes) per rank, + MPI_Allgatherv of the data when any buffer is
# longer than 64 B;
# Communicator::all_to_all = MPI_Alltoall of 2 u64 (16 B) per pair + MPI_Allgather of a 5-u64
# verdict (40 B) + MPI_Alltoallv of the data; all_reduce_sum_f32 = MPI_Allgather of the call
# kind and element count (in a 96 B header of the all-gather's shape), then W - 1 pairwise steps
# of the shards and W - 1 of the sums.
AG = [("allgather", 96), ("allgatherv", "data")]
ENVELOPES = [("allgather", 96)]  # 20-byte envelopes: inline
A2A = [("alltoall", 16), ("allgather", 40), ("alltoallv", "data")]
CALLS = {
    # the demo's all-gather route: one Communicator::all_gather of the bundle
    "allgather": AG,
    # agreement round (20-byte envelopes) + all_to_all of the shards + all_gather of the owners'
    # reduced shards (collective/two_phase.rs)
    "two-phase": ENVELOPES + A2A + AG,
    # gradwire's dense f32: an envelope all-gather, then all_reduce_sum_f32 (the counts, then
    # pairwise steps) (collective/dense.rs, comm/mpi.rs)
    "gradwire-dense": ENVELOPES + [("allgather", 96), ("pairwise", "data"), ("pairwise", "data")],
    # dense-f32-allreduce: one MPI_Allreduce, Open MPI's choice of algorithm or the ring forced
    "mpi-allreduce": [("allreduce", "total")],
    "mpi-allreduce-ring": [("allreduce-ring", "total")],
}
LABEL = {
    "allgather": "all-gather",
    "two-phase": "two-phase",
    "gradwire-dense": "gradwire dense f32 (pairwise reduce-scatter + all-gather)",
    "mpi-allreduce": "MPI_Allreduce (Open MPI's choice)",
    "mpi-allreduce-ring": "MPI_Allreduce, ring forced",
}


def rounds(kind, w, data, total):
    """R of one step: `data` = bytes per rank (all-gather) or per destination (all-to-all) of the
    data calls, `total` = the whole gradient's bytes (MPI_Allreduce)."""
    r = 0
    for call, size in CALLS[kind]:
        size = data if size == "data" else total if size == "total" else size
        if call == "allgather":
            r += rounds_allgather(w, size)
        elif call == "allgatherv":
            r += rounds_allgatherv(w, size)
        elif call == "alltoall":
            r += rounds_alltoall(w, size)
        elif call == "alltoallv":
            r += rounds_alltoallv(w)
        elif call == "pairwise":
            r += max(w - 1, 0)
        elif call == "allreduce":
            r += rounds_allreduce(w, size)
        elif call == "allreduce-ring":
            r += rounds_allreduce(w, size, ring=True)
    return r


def data_size(kind, w, sent_max):
    """Bytes per rank (all-gather) or per destination (all-to-all) of a step's data calls, from
    the bytes a rank sends per step."""
    if w <= 1:
        return 0
    if kind == "allgather":
        return sent_max / (w - 1)
    return sent_max / (2 * (w - 1))  # two rounds of (W - 1) messages of about the same size


# ---------------------------------------------------------------------------------------------
# Measured rows.


def parse_link(link):
    """`100mbit`, `10mbit`, `1gbit`, `none`, `100mbit:10` -> (bits per second or None, delay ms)."""
    rate, _, delay = link.partition(":")
    m = re.fullmatch(r"([0-9.]+)([kmg]?)(bit|bps)?", rate.lower())
    bps = None
    if m and rate != "none":
        bps = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
        if m.group(3) == "bps":
            bps *= 8
    return bps, float(delay) if delay else 0.0


def tbf_burst(link):
    """netsim.sh's tbf burst in bytes for the link: NETSIM_BURST, else the larger of 16 KB and
    what the rate carries in 1 ms; 0 unshaped."""
    bps, _ = parse_link(link)
    if not bps:
        return 0
    env = os.environ.get("NETSIM_BURST", "")
    m = re.fullmatch(r"([0-9.]+)(b|k|kb|m|mb)?", env.lower())
    if m:
        return float(m.group(1)) * {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 1 << 20,
                                    "mb": 1 << 20}[m.group(2)]
    return max(16384, bps / 8000)


def link_label(link):
    rate, _, delay = link.partition(":")
    rate = "unshaped" if rate == "none" else rate.replace("mbit", " Mbit/s").replace("gbit", " Gbit/s")
    return f"{rate}, {delay} ms delay" if delay else rate


def kind_of(method, collective):
    if method == "dense-f32-allreduce":
        return "mpi-allreduce-ring" if collective == "ring" else "mpi-allreduce"
    if method == "dense-f32":
        return "gradwire-dense"
    if collective == "two-phase" and not method.startswith("randk"):
        return "two-phase"
    if collective in ("allgather", "two-phase"):
        return "allgather"
    return None  # auto: which one it picked is not in the JSON


def load_rows(outdir):
    rows, missing, skipped = [], [], []
    manifests = sorted(glob.glob(os.path.join(outdir, "manifest*.txt")))
    for manifest in manifests:
        section = os.path.basename(manifest)[len("manifest"):-len(".txt")].lstrip("-") or "main"
        for line in open(manifest):
            parts = line.split()
            if len(parts) != 4:
                continue
            link, method, collective, tag = parts
            path = os.path.join(outdir, tag + ".json")
            if not os.path.exists(path):
                missing.append(tag)
                continue
            try:
                rep = json.load(open(path))
            except (OSError, ValueError):
                missing.append(tag)
                continue
            kind = kind_of(method, collective)
            if kind is None:
                skipped.append(f"{tag} (collective {collective})")
                continue
            cfg, train = rep["config"], rep["config"]["train"]
            steps = train["steps"]
            ph = rep["timing"][0]["runs"][0]["phases"]
            tr = rep["results"][0]["runs"][0]["traffic"]
            w = cfg["workers"]
            bps, delay = parse_link(link)
            ms = lambda k: 1e3 * ph.get(k, 0.0) / steps
            step_ms = rep["timing"][0]["step_ms"]
            idle_s = max(0.0, step_ms - ms("comm_s")) / 1e3
            nbytes = max(tr["sent_max"], tr["received_max"])
            # The tbf lets a full bucket through at once: after the link sat idle for the rest
            # of the step (compute, codec, update, the barrier), up to a bucket of each step's
            # bytes crosses without waiting for the rate. Real links have no such bucket: the
            # projection uses all the bytes.
            credit = min(tbf_burst(link), idle_s * bps / 8) if bps else 0.0
            rows.append({
                "section": section, "tag": tag, "link": link, "bps": bps, "delay": delay,
                "method": method, "collective": collective, "kind": kind, "w": w,
                "steps": steps, "barrier": bool(train.get("wait_barrier", False)),
                "workload": train.get("workload", "digits-mlp"),
                # rank 0 evaluating during the run (the time-to-accuracy runs): the other ranks
                # wait for it inside the next collective, so these rows stay out of every fit
                "evals": train.get("eval_every", steps) < steps,
                "comm": ms("comm_s"), "wait": ms("wait_s"), "encode": ms("encode_s"),
                "decode": ms("decode_s"), "step": rep["timing"][0]["step_ms"],
                "sent_max": tr["sent_max"], "recv_max": tr["received_max"],
                "bytes": nbytes, "credit": min(credit, nbytes),
                "bytes_eff": max(nbytes - credit, 0.0),
                "total": cfg.get("dense_f32_bytes", 4 * cfg.get("parameters", 0)),
            })
    return manifests, rows, missing, skipped


def group_rows(rows):
    """Repeats of one row (same section, link, method, collective): the run with the median comm
    time stands for them; `runs` keeps every run's comm ms."""
    groups = {}
    for r in rows:
        groups.setdefault((r["section"], r["link"], r["method"], r["collective"]), []).append(r)
    out = []
    for g in groups.values():
        g.sort(key=lambda r: r["comm"])
        row = dict(g[(len(g) - 1) // 2])
        row["runs"] = [r["comm"] for r in g]
        out.append(row)
    for r in out:
        r["R"] = rounds(r["kind"], r["w"], data_size(r["kind"], r["w"], r["sent_max"]), r["total"])
        r["cpu"] = 0.0
        r["cpu_note"] = ""
        if r["kind"] == "two-phase":
            ag = next((x for x in out if x["section"] == r["section"] and x["link"] == r["link"]
                       and x["method"] == r["method"] and x["kind"] == "allgather"), None)
            if ag:
                r["cpu"] = ag["encode"] + 2.0 / r["w"] * ag["decode"]
            else:
                r["cpu_note"] = "no all-gather row to estimate the codec's CPU from: 0"
    return out


# ---------------------------------------------------------------------------------------------
# The fit.


def x_byte(r_bps, nbytes):
    """The byte term's regressor: seconds at the nominal rate (so beta = 1 / rho), or bytes on an
    unshaped link (beta in seconds per byte)."""
    return nbytes * 8 / r_bps if r_bps else nbytes


# Fewer fit rows than this on a link: lambda0 is not identifiable (2 rows would be solved exactly),
# so rho is fitted alone with lambda0 = 0.
MIN_ROWS = 4


def fit(points):
    """Least squares on relative residuals of y = a * x1 + b * x2 (y, x1, x2 in seconds):
    minimises sum(((y - a x1 - b x2) / y)^2). Returns (a, b, note)."""
    pts = [(y, x1, x2) for y, x1, x2 in points if y > 0]
    if not pts:
        return None
    s11 = sum((x1 / y) ** 2 for y, x1, _ in pts)
    s22 = sum((x2 / y) ** 2 for y, _, x2 in pts)
    s12 = sum(x1 * x2 / y ** 2 for y, x1, x2 in pts)
    t1 = sum(x1 / y for y, x1, _ in pts)
    t2 = sum(x2 / y for y, _, x2 in pts)
    det = s11 * s22 - s12 * s12
    note = ""
    if len(pts) < MIN_ROWS:
        a, b, note = -1.0, 0.0, f"only {len(pts)} rows (fewer than {MIN_ROWS}): latency set to 0"
    elif det > 1e-12 * s11 * s22:
        a = (t1 * s22 - t2 * s12) / det
        b = (t2 * s11 - t1 * s12) / det
    else:
        a, b, note = -1.0, 0.0, "fewer than 2 independent rows: latency set to 0"
    if a < 0:
        a, b = 0.0, t2 / s22 if s22 else 0.0
        note = note or "latency came out negative: set to 0, rho refitted alone"
    if b < 0:
        a, b = (t1 / s11 if s11 else 0.0), 0.0
        note = "per-byte cost came out negative: set to 0, latency refitted alone"
    return a, b, note


# Open MPI's own choice of MPI_Allreduce algorithm is left out of the fit: on these links it runs
# 1.25-2.6x slower than the ring forced on the same bytes (balanced over the hosts,
# so not a root bottleneck), an inefficiency of that algorithm that no per-link byte cost shared
# with the other collectives can describe. Its rows are still checked in (b).
FIT_KINDS = ("allgather", "two-phase", "gradwire-dense", "mpi-allreduce-ring")


def fit_one(used, source):
    bps = used[0]["bps"]
    pts = [((r["comm"] - r["cpu"]) / 1e3, r["R"], x_byte(bps, r["bytes_eff"])) for r in used]
    res = fit(pts)
    if res is None:
        return None
    a, b, note = res
    # rho per collective, with the link's lambda0 (a diagnostic: how far each collective's own
    # per-byte cost is from the shared one).
    per_kind = {}
    for kind in FIT_KINDS:
        # the same relative weights as the fit: minimises sum(((y - a x1 - b_k x2) / y)^2)
        kp = [(y, x1, x2) for (y, x1, x2), r in zip(pts, used) if r["kind"] == kind and y > 0]
        den = sum((x2 / y) ** 2 for y, _, x2 in kp)
        if kp and den > 0:
            per_kind[kind] = sum((y - a * x1) * x2 / y ** 2 for y, x1, x2 in kp) / den
    return {"lambda0": a, "beta": b, "note": note, "source": source, "rows": used, "bps": bps,
            "per_kind": per_kind, "sections": sorted({r["section"] for r in used})}


SRC_BARRIER = "W = 4, barrier"
SRC_FALLBACK = "W = 4, **no barrier (fallback: comm includes waiting for the slowest rank)**"
SRC_ALT = "W = 4, no barrier (comparison only)"


def fit_links(rows):
    """Per link: the fit on the W = 4 rows with the barrier, or without it (fallback); and, where
    both kinds of row exist, the fit on the rows without the barrier for comparison."""
    fits, alts = {}, {}
    for link in sorted({r["link"] for r in rows}, key=link_order):
        cand = [r for r in rows if r["link"] == link and r["w"] == 4 and r["kind"] in FIT_KINDS
                and not r["evals"]]
        with_b = [r for r in cand if r["barrier"]]
        without = [r for r in cand if not r["barrier"]]
        f = fit_one(with_b, SRC_BARRIER) if with_b else None
        if f is None and without:
            f = fit_one(without, SRC_FALLBACK)
        elif f is not None and without:
            alt = fit_one(without, SRC_ALT)
            if alt:
                alts[link] = alt
        if f:
            fits[link] = f
    return fits, alts


def model_ms(f, kind, w, data, total, nbytes, cpu=0.0):
    """(total ms, latency ms, byte ms) of one step."""
    lat = f["lambda0"] * rounds(kind, w, data, total) * 1e3
    byt = f["beta"] * x_byte(f["bps"], nbytes) * 1e3
    return lat + byt + cpu, lat, byt


def link_order(link):
    bps, delay = parse_link(link)
    return (bps is None, -(bps or 0), delay)


# ---------------------------------------------------------------------------------------------
# The byte table of docs/wscaling.md.


def parse_wscaling(path):
    """{(method, W): {"bundle", "ag", "tp", "ring"}} with bytes = max(sent max, recv max)."""
    table = {}
    header = None
    for line in open(path):
        line = line.strip()
        if not line.startswith("|"):
            header = None if not line else header
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "method" in cells and "W" in cells:
                header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        row = dict(zip(header, cells))
        first = lambda key: float(row[key].split("/")[0].split("(")[0].strip())
        try:
            w = int(row["W"])
            ent = {
                "bundle": float(row["bundle"]),
                "ag_sent": first("all-gather sent max / mean"),
                "ag": max(first("all-gather sent max / mean"), first("all-gather recv max / mean")),
                "tp_sent": first("two-phase sent max / mean"),
                "tp": max(first("two-phase sent max / mean"), first("two-phase recv max / mean")),
                "ring_sent": first("dense f32 ring sent max / mean"),
                "ring": max(first("dense f32 ring sent max / mean"),
                            first("dense f32 ring recv max / mean")),
            }
        except (KeyError, ValueError):
            continue
        table[(row["method"], w)] = ent
    return table


# ---------------------------------------------------------------------------------------------
# Rendering.


def fmt_ms(x):
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def credit_text(r):
    return f" (-{r['credit']:,.0f})" if r["credit"] >= 1 else ""


def fmt_pct(x):
    return f"{100 * x:+.0f}%"


def rho_text(f):
    if f["bps"]:
        return f"{1 / f['beta']:.3f}" if f["beta"] > 0 else "inf"
    return "-"


def rate_text(f):
    if f["beta"] <= 0:
        return "inf"
    eff = 8 / f["beta"] if not f["bps"] else f["bps"] / f["beta"]
    return f"{eff / 1e9:.2f} Gbit/s" if eff >= 1e9 else f"{eff / 1e6:.1f} Mbit/s"


def project(fits, table):
    """{link: {(method, W): {kind: (ms, latency ms, byte ms)}}, plus (("(dense)", W): ...)}."""
    out = {}
    methods = []
    for (m, _w) in table:
        if m not in methods:
            methods.append(m)
    for link in PROJ_LINKS:
        f = fits.get(link)
        if not f:
            continue
        p = out[link] = {}
        for m in methods:
            for w in PROJ_W:
                e = table.get((m, w))
                if not e:
                    continue
                total = e["ring_sent"] * w / (2 * (w - 1))
                p[(m, w)] = {
                    "allgather": model_ms(f, "allgather", w, data_size("allgather", w, e["ag_sent"]),
                                          total, e["ag"]),
                    "two-phase": model_ms(f, "two-phase", w, data_size("two-phase", w, e["tp_sent"]),
                                          total, e["tp"]),
                    "mpi-allreduce-ring": model_ms(f, "mpi-allreduce-ring", w, 0, total, e["ring"]),
                }
        for w in PROJ_W:
            e = next((v for (m, ww), v in table.items() if ww == w), None)
            if not e:
                continue
            total = e["ring_sent"] * w / (2 * (w - 1))
            d = {"bytes": e["ring"]}
            for kind in ("mpi-allreduce-ring", "mpi-allreduce", "gradwire-dense"):
                d[kind] = model_ms(f, kind, w, data_size(kind, w, e["ring_sent"]), total, e["ring"])
            p[("(dense)", w)] = d
    return out


WORKLOAD = {"digits-mlp": "MLP", "minilm-replay": "MiniLM replay"}
PROJ_W = (4, 8, 16, 32, 64)
PROJ_LINKS = ("100mbit", "10mbit")


def render(manifests, rows, missing, skipped, fits, alts, table, wscaling_path):
    L = []
    add = L.append
    add(f"- computed {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
        f"`python3 netsim/model.py`, code {sh('git describe --always --dirty')}")
    add(f"- data: {', '.join('`' + os.path.relpath(m) + '`' for m in manifests) or 'no manifest'}"
        f" ({len(rows)} rows after merging repeats); byte table: `{os.path.relpath(wscaling_path)}`")
    if missing:
        add(f"- listed but without a JSON report (skipped): {len(missing)}: "
            + ", ".join(f"`{t}`" for t in missing[:12]) + (" ..." if len(missing) > 12 else ""))
    if skipped:
        add(f"- skipped: " + ", ".join(skipped))
    fallback = [l for l, f in fits.items() if "fallback" in f["source"]]
    if fallback:
        add(f"- **fits that fell back to rows without the barrier** (their latency absorbs the "
            f"waiting for the slowest rank): {', '.join(link_label(l) for l in fallback)}")
    add("")

    # headline
    proj = project(fits, table)
    proj_alt = project(alts, table)
    head = [l for l in PROJ_LINKS if l in fits]
    if head:
        add("**Headline, W = 64** (model, comm ms per step; speed-ups of two-phase over the "
            "all-gather and of each over the dense f32 ring MPI_Allreduce; details in (c)). "
            "In brackets, where the link has both kinds of W = 4 row: the same with the parameters "
            "fitted on the rows without the barrier (another lambda0, see (a)): the spread is "
            "how uncertain the latency part is.")
        add("")
        add("| link | method | all-gather ms | two-phase ms | ring ms | two-phase / all-gather | ring / two-phase | ring / all-gather |")
        add("|---|---|---:|---:|---:|---:|---:|---:|")
        for link in head:
            for (m, w), p in proj[link].items():
                if w != 64 or m == "(dense)":
                    continue
                q = proj_alt.get(link, {}).get((m, w))
                ag, tp, rg = p["allgather"][0], p["two-phase"][0], p["mpi-allreduce-ring"][0]
                cells = [fmt_ms(ag), fmt_ms(tp), fmt_ms(rg), f"{ag / tp:.1f}x", f"{rg / tp:.1f}x",
                         f"{rg / ag:.2f}x"]
                if q:
                    ag2, tp2, rg2 = q["allgather"][0], q["two-phase"][0], q["mpi-allreduce-ring"][0]
                    alt = [fmt_ms(ag2), fmt_ms(tp2), fmt_ms(rg2), f"{ag2 / tp2:.1f}x",
                           f"{rg2 / tp2:.1f}x", f"{rg2 / ag2:.2f}x"]
                    cells = [f"{c} ({d})" for c, d in zip(cells, alt)]
                add(f"| {link_label(link)} | {m} | " + " | ".join(cells) + " |")
        add("")

    # (a) parameters
    add("### (a) Fitted parameters per link")
    add("")
    add("`t = lambda0 x R + beta x bytes_max (+ the codec's CPU inside the call)`; rho = 8 / (beta x "
        "rate); the effective rate is rho x rate. Per-collective rho: each collective's own "
        "per-byte cost on the fit rows with the link's lambda0 (a diagnostic, not used below).")
    add("")
    add("| link | fit rows | lambda0 ms / round | rho | effective rate | rows | per-collective rho | note |")
    add("|---|---|---:|---:|---:|---:|---|---|")
    for link, f in [(l, x) for l in fits for x in (fits[l], alts.get(l)) if x]:
        pk = ", ".join(
            f"{LABEL[k].split(' (')[0]} {((f['bps'] and 1 / b) or 8 / b / 1e9):.2f}{'' if f['bps'] else ' Gbit/s'}"
            for k, b in f["per_kind"].items() if b > 0)
        add(f"| {link_label(link)} | {f['source']} ({', '.join(f['sections'])}) | "
            f"{1e3 * f['lambda0']:.3f} | {rho_text(f)} | {rate_text(f)} | {len(f['rows'])} | {pk} | "
            f"{f['note']} |")
    if not fits:
        add("| (no W = 4 rows yet) | | | | | | | |")
    add("")
    add("R per step for the collectives of the measured and projected rows (message sizes as in "
        "the MiniLM byte table, quant4-ef):")
    add("")
    add("| collective | MPI calls | " + " | ".join(f"R at W = {w}" for w in PROJ_W) + " |")
    add("|---|---:|" + "---:|" * len(PROJ_W))
    for kind in CALLS:
        rr = []
        for w in PROJ_W:
            e = table.get(("quant4-ef", w)) or {}
            ring = table.get(("dense-f16", w)) or {}
            if kind == "allgather":
                d = data_size(kind, w, e.get("ag_sent", 0))
            elif kind == "two-phase":
                d = data_size(kind, w, e.get("tp_sent", 0))
            else:
                d = data_size(kind, w, ring.get("ring_sent", 0))
            total = 4 * 789504
            rr.append(str(rounds(kind, w, d, total)))
        add(f"| {LABEL[kind]} | {len(CALLS[kind])} | " + " | ".join(rr) + " |")
    add("")

    # (b) measured vs model
    add("### (b) Measured comm ms per step against the model")
    add("")
    add("*comm*: the demo's `comm_s` per step (mean over ranks; the median run where a row was "
        "repeated); *wait*: the barrier's (rows with the barrier). *cpu*: the codec time inside "
        "the call, added to the model (not fitted). *tbf burst*: the bytes the link's token bucket lets through at once, refilled while the link sat idle in the rest of the step (min(burst, idle x rate)); the model charges the rate for the rest only (real links have no bucket: the projection charges every byte). *fit*: the row is one the link's parameters "
        "were fitted on (in-sample); the others are checks. Error = model / measured - 1.")
    add("")
    add("| section | link | W | workload | barrier | method | collective | bytes max (- tbf burst) | R | comm ms (runs) | wait ms | model ms (latency + bytes + cpu) | error | fit |")
    add("|---|---|---:|---|---|---|---|---:|---:|---|---:|---|---:|---|")
    errs = {}
    order = lambda r: (r["section"] != "main", r["section"], link_order(r["link"]), r["w"],
                       r["workload"], list(CALLS).index(r["kind"]), r["method"])
    for r in sorted(rows, key=order):
        f = fits.get(r["link"])
        runs = "" if len(r["runs"]) == 1 else " (" + ", ".join(fmt_ms(x) for x in r["runs"]) + ")"
        if f:
            tot, lat, byt = model_ms(f, r["kind"], r["w"], data_size(r["kind"], r["w"], r["sent_max"]),
                                     r["total"], r["bytes_eff"], r["cpu"])
            err = tot / r["comm"] - 1 if r["comm"] > 0 else float("nan")
            in_fit = any(x is r or x["tag"] == r["tag"] for x in f["rows"])
            grp = ("fit rows" if in_fit else
                   "checks: evaluating during the run (rank 0's evaluation lands in comm)"
                   if r["evals"] else
                   f"checks: W = {r['w']}" if r["w"] != 4 else
                   f"checks: {WORKLOAD.get(r['workload'], r['workload'])}, "
                   f"{'barrier' if r['barrier'] else 'no barrier'}")
            errs.setdefault(grp, []).append(err)
            errs.setdefault(f"by collective: {LABEL[r['kind']]}", []).append(err)
            cpu = f" + {fmt_ms(r['cpu'])}" if r["cpu"] else ""
            mtext = f"{fmt_ms(tot)} ({fmt_ms(lat)} + {fmt_ms(byt)}{cpu})"
            etext = fmt_pct(err)
        else:
            mtext, etext, in_fit = "(no fit for this link)", "", False
        add(f"| {r['section']} | {link_label(r['link'])} | {r['w']} | "
            f"{WORKLOAD.get(r['workload'], r['workload'])} | {'yes' if r['barrier'] else 'no'} | "
            f"{r['method']} | {LABEL[r['kind']]} | {r['bytes']:,.0f}"
            f"{credit_text(r)} | {r['R']} | "
            f"{fmt_ms(r['comm'])}{runs} | {fmt_ms(r['wait']) if r['barrier'] else ''} | {mtext} | "
            f"{etext} | {'fit' if in_fit else ''} |")
    add("")
    if errs:
        add("| rows | n | median \\|error\\| | largest \\|error\\| | mean error (bias) |")
        add("|---|---:|---:|---:|---:|")
        for grp in sorted(errs, key=lambda g: (g.startswith("by"), g != "fit rows", g)):
            e = [x for x in errs[grp] if not math.isnan(x)]
            if e:
                add(f"| {grp} | {len(e)} | {100 * statistics.median(abs(x) for x in e):.0f}% | "
                    f"{100 * max(abs(x) for x in e):.0f}% | {fmt_pct(statistics.fmean(e))} |")
        add("")

    # (c) projection
    proj = project(fits, table)
    add("### (c) Projection of the MiniLM byte table (docs/wscaling.md) to comm ms per step")
    add("")
    add("Comm only (the transfer as the model sees it: no codec CPU, no waiting for a slow rank, "
        "one host per rank with its own link). *ring*: a dense f32 MPI_Allreduce with the ring "
        "forced, the table's dense f32 ring bytes, `2 (W - 1)` rounds; the other dense "
        "variants are in the second table. Speed-ups are ratios of modelled ms. [measured ...]: "
        "the MiniLM replay's comm ms at that W and link (the same gradients, so the same bytes as "
        "the table; its two-phase comm includes the codec's CPU, the model's here does not).")
    for link in PROJ_LINKS:
        f = fits.get(link)
        add("")
        if not f:
            add(f"**{link_label(link)}**: no fit for this link yet.")
            continue
        add(f"**{link_label(link)}** (lambda0 {1e3 * f['lambda0']:.3f} ms / round, rho "
            f"{rho_text(f)}; fit on {f['source']})")
        add("")
        add("| method | W | all-gather ms (latency) | two-phase ms (latency) | ring ms | "
            "two-phase / all-gather speed-up | ring / all-gather | ring / two-phase |")
        add("|---|---:|---|---|---:|---:|---:|---:|")
        for (m, w), p in proj[link].items():
            if m == "(dense)":
                continue
            ag, tp, rg = p["allgather"], p["two-phase"], p["mpi-allreduce-ring"]

            def measured(kind):
                # the MiniLM replay measured at this W on this link: the same gradients and bytes
                hit = [r for r in rows if r["link"] == link and r["w"] == w and r["kind"] == kind
                       and r["workload"] == "minilm-replay"
                       and (r["method"] == m or kind == "mpi-allreduce-ring")]
                return f" [measured {fmt_ms(hit[0]['comm'])}]" if hit else ""
            add(f"| {m} | {w} | {fmt_ms(ag[0])} ({fmt_ms(ag[1])}){measured('allgather')} | "
                f"{fmt_ms(tp[0])} ({fmt_ms(tp[1])}){measured('two-phase')} | "
                f"{fmt_ms(rg[0])}{measured('mpi-allreduce-ring')} | {ag[0] / tp[0]:.2f}x | "
                f"{rg[0] / ag[0]:.2f}x | {rg[0] / tp[0]:.2f}x |")
        ring_beta = f["per_kind"].get("mpi-allreduce-ring")
        if ring_beta and f["bps"] and f["beta"] > 0:
            add("")
            add(f"The ring's own per-byte cost on the fit rows (rho {1 / ring_beta:.3f}, (a)) is "
                f"{ring_beta / f['beta']:.2f}x the shared one (rho {1 / f['beta']:.3f}): measured "
                f"against the ring alone, the *ring / ...* columns would be about that factor "
                f"{'smaller' if ring_beta < f['beta'] else 'larger'} where the bytes dominate.")
        add("")
        factor = [r["comm"] / model_ms(f, r["kind"], r["w"], 0, r["total"], r["bytes_eff"])[0]
                  for r in rows if r["link"] == link and r["kind"] == "mpi-allreduce"]
        ftext = (f" (measured at W = 4 on this link it ran {statistics.median(factor):.2f}x this "
                 f"model: (b))" if factor else "")
        add("Dense f32 (789,504 values), the three ways, ms per step (latency part in brackets); "
            f"Open MPI's choice is the model of its bytes and rounds{ftext}:")
        add("")
        add("| W | bytes max | MPI_Allreduce, ring forced | MPI_Allreduce, Open MPI's choice | gradwire dense f32 |")
        add("|---:|---:|---|---|---|")
        for (m, w), p in proj[link].items():
            if m != "(dense)":
                continue
            cells = [f"{fmt_ms(p[k][0])} ({fmt_ms(p[k][1])})"
                     for k in ("mpi-allreduce-ring", "mpi-allreduce", "gradwire-dense")]
            add(f"| {w} | {p['bytes']:,.0f} | " + " | ".join(cells) + " |")
    add("")
    return "\n".join(L)


def write_doc(doc, body):
    replace_block(doc, BEGIN, END, f"{BEGIN}\n\n{body}\n{END}",
                  "# A cost model of the collectives on shaped links (issue 26, scope 4)\n\n"
                  "Written by `python3 netsim/model.py` (see its docstring).\n\n")


def main(argv):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "out", "netsim"))
    ap.add_argument("--wscaling", default=os.path.join(root, "docs", "wscaling.md"))
    ap.add_argument("--doc", default=os.path.join(root, "docs", "netsim-model.md"))
    ap.add_argument("--stdout", action="store_true", help="print the block, leave the doc alone")
    args = ap.parse_args(argv)
    os.chdir(root)
    manifests, raw, missing, skipped = load_rows(args.out)
    rows = group_rows(raw)
    fits, alts = fit_links(rows)
    table = parse_wscaling(args.wscaling)
    body = render(manifests, rows, missing, skipped, fits, alts, table, args.wscaling)
    if args.stdout:
        print(body)
    else:
        write_doc(args.doc, body)
        print(body)
        print(f"model.py: {os.path.relpath(args.doc)} updated", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

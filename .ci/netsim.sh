#!/usr/bin/env bash
# Issue 26, point 6: the demo over a slow network. W = 4 emulated hosts (netsim/netsim.sh:
# network namespaces on a bridge, every link shaped to 100 Mbit/s both ways), one MPI rank per
# host over TCP only, a few steps of one sparse method (topk-1%-ef-int8) and one dense method
# (dense-f32). Checks:
#   1. the shaping applied: a tbf on every link direction, and a timed TCP transfer both ways
#      between two hosts lands within [0.85, 1.02] x 100 Mbit/s;
#   2. the traffic crossed the shaped links: every host's bridge port counted at least the
#      bytes the program says its rank sent, and the dense step took at least the time its
#      bytes need at 100 Mbit/s;
#   3. every rank agrees: each rank checks its digests against every other rank's at the end of
#      each run (the run fails otherwise), and the JSON report equals that of the same run on 4
#      threads, timings aside.
# Where network namespaces cannot be created (not root, no CAP_NET_ADMIN, no iproute2) the stage
# FAILS with a message: it never passes without having run.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ns=netsim/netsim.sh
command -v mpirun >/dev/null || { echo "netsim: mpirun not found (run .ci/install-mpi.sh)"; exit 1; }
[ "$(id -u)" = 0 ] || { echo "netsim: needs root to create network namespaces"; exit 1; }
mkdir -p out
# Built by the mpi-tests and mpi-demo stages already (same features): a no-op in CI.
cargo build --release --example data_parallel --features gradwire-demo/mpi
bin="${CARGO_TARGET_DIR:-target}/release/examples/data_parallel"
steps=8
methods=topk-1%-ef-int8,dense-f32
args=(--workers 4 --methods "$methods" --steps "$steps" --eval-every "$steps" --seeds 1 --quiet
    --no-plot)

trap 'bash $ns down' EXIT
trap 'exit 1' INT TERM
bash $ns up 4 100mbit
bash $ns qdiscs
bash $ns check
bash $ns counters >out/netsim-ci.before
NETSIM_MPI_TIMEOUT=120 bash $ns mpirun "$bin" --transport mpi "${args[@]}" \
    --json out/netsim-ci-mpi.json
bash $ns counters >out/netsim-ci.after
timeout 120 "$bin" --transport threads "${args[@]}" --json out/netsim-ci-threads.json >/dev/null

python3 - out/netsim-ci-threads.json out/netsim-ci-mpi.json out/netsim-ci.before \
    out/netsim-ci.after "$steps" <<'PY'
import json, sys
threads, mpi = (json.load(open(p)) for p in sys.argv[1:3])
steps = int(sys.argv[5])
def counters(p):
    return {int(h): (int(tx), int(rx)) for h, tx, rx in (l.split() for l in open(p))}
before, after = counters(sys.argv[3]), counters(sys.argv[4])
ok = True
# 2. Traffic on the shaped links: what each host's bridge port saw, against the program's count.
program = sum(m["runs"][0]["traffic"]["sent_mean"] for m in mpi["results"]) * steps
for h in sorted(before):
    sent = after[h][0] - before[h][0]
    print(f"netsim: host {h} sent {sent} bytes through its shaped link; the program counts {program:.0f} per rank")
    if sent < 0.95 * program:
        print(f"netsim: host {h}: fewer bytes crossed its link than the program sent: FAILED")
        ok = False
dense = next(t for t in mpi["timing"] if t["method"] == "dense-f32")
dense_bytes = next(m for m in mpi["results"] if m["method"] == "dense-f32")["runs"][0]["traffic"]["sent_mean"]
floor_ms = dense_bytes * 8 / 100e6 * 1e3
print(f"netsim: dense-f32 {dense['step_ms']:.1f} ms per step; its {dense_bytes:.0f} bytes need {floor_ms:.1f} ms at 100 Mbit/s")
if dense["step_ms"] < 0.9 * floor_ms:
    print("netsim: the dense step was faster than the shaped link allows: FAILED")
    ok = False
# 3. Every rank agrees (checked in the program), and with the threads transport.
for r in (threads, mpi):
    r.pop("timing", None)
if threads != mpi:
    for key in sorted(set(threads) | set(mpi)):
        if threads.get(key) != mpi.get(key):
            print(f"netsim: '{key}' differs between 4 threads and 4 hosts:\n  threads: {json.dumps(threads.get(key))[:400]}\n  hosts:   {json.dumps(mpi.get(key))[:400]}")
    ok = False
else:
    digests = ", ".join(f"{m['method']} {m['runs'][0]['mean_digest'][:8]}" for m in mpi["results"])
    print(f"netsim: 4 hosts == 4 threads, JSON identical apart from timing ({digests})")
sys.exit(0 if ok else 1)
PY

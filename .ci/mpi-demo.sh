#!/usr/bin/env bash
# Issue 4, point 3 (and issue 25 for the two-phase collective): the main job on MPI. A short run of every method with 4 ranks under
# `mpirun` on loopback must give the same JSON report, timings aside, as the same run with 4
# threads: same accuracies, losses, bytes, curves, final-parameter digests and digests of
# every step's aggregated gradient (each rank checks at the end of a run that its digests equal
# every other rank's, and fails the run otherwise). `dense-f32-allreduce` (a plain
# MPI_Allreduce, not rank-order bit-identical, MPI only) is not in the default method list and
# so not compared.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
command -v mpirun >/dev/null || { echo "mpi-demo: mpirun not found (run .ci/install-mpi.sh)"; exit 1; }
mkdir -p out
# As the README builds it. In CI the mpi-tests stage built it already, with the same features;
# on its own this compiles the mpi crates, gradwire and the demo (candle and the rest are the
# ones the tests built: demo/Cargo.toml asks for the `syn` feature that bindgen turns on).
cargo build --release --example data_parallel --features gradwire-demo/mpi
bin="${CARGO_TARGET_DIR:-target}/release/examples/data_parallel"
args=(--steps 60 --seeds 1 --quiet)
# The same comparison for each collective: the all-gather (every method), then gradwire's
# two-phase shard-owner all-reduce (the methods it covers; issue 25).
run_pair() {
    local tag="$1"
    shift
    timeout 900 "$bin" --transport threads --workers 4 "${args[@]}" "$@" \
        --json "out/mpi-demo-$tag-threads.json" --plot "out/mpi-demo-$tag-threads.png"
    # Open MPI flags: --oversubscribe (4 ranks on 2 cores), -x (pass the variable to every
    # rank); candle spins a thread pool per rank unless RAYON_NUM_THREADS=1. A hung rank fails
    # the stage.
    timeout 900 mpirun --oversubscribe -x RAYON_NUM_THREADS=1 -np 4 \
        "$bin" --transport mpi --workers 4 "${args[@]}" "$@" \
        --json "out/mpi-demo-$tag-mpi.json" --plot "out/mpi-demo-$tag-mpi.png"
    python3 - "out/mpi-demo-$tag-threads.json" "out/mpi-demo-$tag-mpi.json" "$tag" <<'PY'
import json, sys
threads, mpi = (json.load(open(p)) for p in sys.argv[1:3])
tag = sys.argv[3]
for r in (threads, mpi):
    r.pop("timing", None)
if threads != mpi:
    for key in sorted(set(threads) | set(mpi)):
        if threads.get(key) != mpi.get(key):
            print(f"mpi-demo ({tag}): '{key}' differs:\n  threads: {json.dumps(threads.get(key))[:600]}\n  mpi:     {json.dumps(mpi.get(key))[:600]}")
    sys.exit(1)
runs = [run for row in mpi["results"] for run in row["runs"]]
print(f"mpi-demo ({tag}): 4 MPI ranks == 4 threads: {len(mpi['results'])} methods, {len(runs)} runs, "
      f"JSON identical apart from timing, bytes per rank included (mean_digest of each run: "
      + ", ".join(run["mean_digest"][:8] for run in runs) + ")")
PY
}
run_pair allgather --collective allgather
run_pair two-phase --collective two-phase \
    --methods dense-f32,dense-f16,topk-1%-ef-int8,topk-0.1%-ef,sign-ef,quant4-ef

#!/usr/bin/env bash
# N consecutive launches of the whole harness (issue 26: "20 consecutive launches without a
# failure"): each one brings W = 4 hosts up at 100 Mbit/s, checks the qdiscs, runs 3 steps of
# sign-ef and dense-f32 with one MPI rank per host, and takes the hosts down. Stops at the first
# failure (no retries) and prints how many launches passed.
#
#   bash netsim/launches.sh [N]          # N defaults to 20; as root
set -uo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
n=${1:-20}
ns=netsim/netsim.sh
bin="${CARGO_TARGET_DIR:-target}/release/examples/data_parallel"
[ -x "$bin" ] || { echo "launches: build first: cargo build --release --example data_parallel --features gradwire-demo/mpi"; exit 1; }
mkdir -p out/netsim
trap 'bash $ns down >/dev/null 2>&1' EXIT
ok=0
for ((i = 1; i <= n; i++)); do
    t0=$SECONDS
    log=out/netsim/launch-$i.log
    if bash $ns up 4 100mbit >"$log" 2>&1 && bash $ns qdiscs >>"$log" 2>&1 &&
        NETSIM_MPI_TIMEOUT=120 bash $ns mpirun "$bin" --transport mpi --workers 4 \
            --methods sign-ef,dense-f32 --steps 3 --eval-every 3 --seeds 1 --quiet --no-plot \
            >>"$log" 2>&1 && bash $ns down >>"$log" 2>&1; then
        ok=$((ok + 1))
        echo "launch $i: ok ($((SECONDS - t0)) s)"
    else
        echo "launch $i: FAILED ($((SECONDS - t0)) s), log $log:"
        tail -20 "$log"
        break
    fi
done
echo "launches: $ok of $n consecutive launches passed"
[ "$ok" -eq "$n" ]

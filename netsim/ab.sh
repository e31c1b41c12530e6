#!/usr/bin/env bash
# An A/B run of two builds of the demo on the same emulated hosts: the rows alternate between
# binary A and binary B, ROUNDS times, so that both see the same machine; prints ms/step per
# row and build, and the median of each.
#
#   bash netsim/ab.sh BIN_A BIN_B [RATE] [ROUNDS] [W]   # as root; default 100mbit, 3, 4
#                                                       # NETSIM_STEPS (default 30),
#                                                       # NETSIM_AB_ROWS ("method collective;...")
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
a=$(realpath "${1:?BIN_A}") b=$(realpath "${2:?BIN_B}")
rate=${3:-100mbit} rounds=${4:-3} w=${5:-4}
steps=${NETSIM_STEPS:-30}
IFS=';' read -r -a rows <<<"${NETSIM_AB_ROWS:-topk-1%-ef-int8 allgather;topk-1%-ef-int8 two-phase;sign-ef allgather;sign-ef two-phase;quant4-ef allgather;quant4-ef two-phase}"
ns=netsim/netsim.sh
out=out/netsim/ab
mkdir -p "$out"
trap 'bash $ns down >/dev/null 2>&1 || true' EXIT
bash $ns up "$w" "$rate" 0 >/dev/null
bash $ns qdiscs >/dev/null
bash $ns check
: >"$out/results.txt"
for ((r = 1; r <= rounds; r++)); do
    for row in "${rows[@]}"; do
        read -r method collective <<<"$row"
        for build in A B; do
            bin=$a
            [ "$build" = B ] && bin=$b
            log="$out/${method//%/pct}-$collective-$build-$r.log"
            bash $ns mpirun "$bin" --transport mpi --workers "$w" --methods "$method" \
                --collective "$collective" --steps "$steps" --eval-every "$steps" --seeds 1 \
                --quiet --no-plot >"$log" 2>&1 || { cat "$log"; exit 1; }
            ms=$(grep -E "^$method " "$log" | awk '{print $NF}')
            echo "$method $collective $build $ms" | tee -a "$out/results.txt"
        done
    done
done
python3 - "$out/results.txt" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    m, c, b, ms = line.split()
    runs.setdefault((m, c), {}).setdefault(b, []).append(float(ms))
print("| method | collective | A ms/step (median) | B ms/step (median) | B / A |")
print("|---|---|---:|---:|---:|")
for (m, c), v in runs.items():
    a, b = statistics.median(v["A"]), statistics.median(v["B"])
    print(f"| {m} | {c} | {a:.1f} ({', '.join(f'{x:.1f}' for x in v['A'])}) "
          f"| {b:.1f} ({', '.join(f'{x:.1f}' for x in v['B'])}) | {b / a:.2f} |")
PY

#!/usr/bin/env bash
# The slow-network report (issue 26, first part): W = 4 emulated hosts (netsim.sh), links of
# 100 Mbit/s, 10 Mbit/s, 1 Gbit/s, unshaped and 100 Mbit/s with 10 ms delay, for the dense baseline `dense-f32-allreduce` (MPI_Allreduce),
# gradwire's dense-f32 and three compressed methods on the all-gather and the two-phase
# collective; writes the table into docs/netsim.md (between its report markers) and the raw
# JSON under out/netsim/. One mpirun per row; the interface counters of every host's link are
# sampled by the demo around its training loop (GRADWIRE_DEMO_NETDEV) and by this script around
# the whole launch (the bridge ports).
#
#   bash netsim/run-report.sh    # as root; NETSIM_STEPS (default 30), NETSIM_DENSE_REPEATS
#                                # (default 3), NETSIM_RATES (default
#                                # "100mbit 10mbit 1gbit none 100mbit:10": RATE[:DELAY_MS]),
#                                # NETSIM_W (hosts, default 4), NETSIM_WAIT_BARRIER=1 (the
#                                # demo's --wait-barrier: comm split into waiting and transfer),
#                                # NETSIM_SECTION (the block of docs/netsim.md to replace;
#                                # default: the main one), NETSIM_WORKLOAD (the demo's
#                                # --workload: digits-mlp, the default, minilm-replay or
#                                # gpt2-replay),
#                                # NETSIM_UNTIMED (the demo's --untimed-steps: steps at the
#                                # start left out of the timing; default 0),
#                                # NETSIM_EVAL_EVERY (test accuracy every this many steps;
#                                # default: once, after the last step; the time-to-accuracy
#                                # runs use 300 steps and 10)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${NETSIM_STEPS:-30}
eval_every=${NETSIM_EVAL_EVERY:-$steps}
rates=${NETSIM_RATES:-100mbit 10mbit 1gbit none 100mbit:10}
w=${NETSIM_W:-4}
section=${NETSIM_SECTION:-}
workload=${NETSIM_WORKLOAD:-digits-mlp}
extra=(--workload "$workload")
[ "${NETSIM_WAIT_BARRIER:-0}" = 1 ] && extra+=(--wait-barrier)
untimed=${NETSIM_UNTIMED:-0}
[ "$untimed" = 0 ] || extra+=(--untimed-steps "$untimed")
ns=netsim/netsim.sh
out=out/netsim
mkdir -p "$out"
trap 'bash $ns down >/dev/null 2>&1 || true' EXIT

cargo build --release --example data_parallel --features gradwire-demo/mpi
# A private copy: a later build into the same target directory (cargo test builds the example
# without `mpi`) must not swap the binary under a running report.
bin="$PWD/$out/data_parallel${section:+-$section}"
cp "${CARGO_TARGET_DIR:-target}/release/examples/data_parallel" "$bin"

# The two dense rows run NETSIM_DENSE_REPEATS times (default 3), interleaved; the table shows
# their median.
repeats=${NETSIM_DENSE_REPEATS:-3}
rows=()
# `ring`: the same MPI_Allreduce with Open MPI's ring algorithm forced
# (coll_tuned_allreduce_algorithm 4); its default choice for this size is about 2x slower on
# shaped links (measured, docs/netsim.md).
for ((r = 1; r <= repeats; r++)); do
    rows+=("dense-f32-allreduce allgather $r" "dense-f32-allreduce ring $r" "dense-f32 allgather $r")
done
rows+=(
    "topk-1%-ef-int8 allgather"
    "topk-1%-ef-int8 two-phase"
    "sign-ef allgather"
    "sign-ef two-phase"
    "quant4-ef allgather"
    "quant4-ef two-phase"
)
# The GPT-2 replay's codec floors (issue 46's netsim acceptance): `scale` runs each gradwire row's
# kernels alone on GPT-2 small's shapes, W ranks as threads at once on this machine (as the W
# emulated hosts share its cores), before any link is made; report.py reads the floors' wall
# time. Its gradients are seeded heavy-tailed values, not the replay's tiled MiniLM ones.
floors="$out/floors${section:+-$section}.jsonl"
: >"$floors"
if [ "$workload" = gpt2-replay ]; then
    cargo build --release -p gradwire-benches --bin scale
    scale="$PWD/$out/scale${section:+-$section}"
    cp "${CARGO_TARGET_DIR:-target}/release/scale" "$scale"
    for row in "dense-f32 all-gather dense-f32 allgather" \
        "topk-1%-int8-ef all-gather topk-1%-ef-int8 allgather" \
        "topk-1%-int8-ef two-phase topk-1%-ef-int8 two-phase" \
        "sign-ef all-gather sign-ef allgather" "sign-ef two-phase sign-ef two-phase" \
        "quant4-ef all-gather quant4-ef allgather" "quant4-ef two-phase quant4-ef two-phase"; do
        read -r smethod scoll method collective <<<"$row"
        "$scale" --shapes gpt2 --workers "$w" --methods "$smethod" --collectives "$scoll" \
            --parallelism serial --steps 2 --in-place --json "$out/floor.json" >/dev/null ||
            { echo "run-report: scale $smethod $scoll failed"; exit 1; }
        python3 -c 'import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print(json.dumps({"method": sys.argv[2], "collective": sys.argv[3], "row": rows[0]}))' \
            "$out/floor.json" "$method" "$collective" >>"$floors"
        echo "codec floor $method $collective: $(tail -1 "$floors" | python3 -c 'import json,sys; print(json.load(sys.stdin)["row"]["kernel_floor_wall_s"])') s"
    done
fi

manifest="$out/manifest${section:+-$section}.txt"
skipped="${manifest%.txt}.skipped"
: >"$manifest"
: >"$skipped"
# A link is RATE (tc syntax, or `none` for unshaped) or RATE:DELAY_MS.
for link in $rates; do
    rate=${link%%:*}
    delay=0
    [ "$link" = "$rate" ] || delay=${link#*:}
    # A link this kernel cannot make (netem missing), whose qdiscs are not in place or that does
    # not carry its rate (the timed transfer) is reported as not measured (report.py reads why
    # from these two files), and the report goes on with the next link.
    rm -f "$out/up-$link.txt" "$out/check-$link.txt"
    if ! { bash $ns up "$w" "$rate" "$delay" 2>&1 | tee "$out/up-$link.txt" &&
        { bash $ns qdiscs && bash $ns check; } 2>&1 | tee "$out/check-$link.txt"; }; then
        echo "$link" >>"$skipped"
        bash $ns down
        continue
    fi
    for row in "${rows[@]}"; do
        read -r method collective rep <<<"$row"
        rep=${rep:-1}
        tag="${section:+$section-}w$w-$link-${method//%/pct}-$collective-$rep"
        env=()
        flag=$collective
        if [ "$collective" = ring ]; then
            env=(OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=4)
            flag=allgather
        fi
        bash $ns counters >"$out/$tag.before"
        env "${env[@]}" bash $ns mpirun "$bin" --transport mpi --workers "$w" --methods "$method" \
            --collective "$flag" --steps "$steps" --eval-every "$eval_every" --seeds 1 \
            --quiet --no-plot "${extra[@]}" --json "$out/$tag.json" >"$out/$tag.log" 2>&1 ||
            { cat "$out/$tag.log"; echo "run-report: $tag failed"; exit 1; }
        bash $ns counters >"$out/$tag.after"
        echo "$link $method $collective $tag" >>"$manifest"
        echo "$link $method $collective (run $rep): $(grep -E "^$method " "$out/$tag.log" | awk '{print $NF}') ms/step"
    done
    bash $ns down
done

NETSIM_FLOORS="$floors" python3 netsim/report.py "$manifest" "$out" docs/netsim.md \
    "NETSIM_STEPS=$steps NETSIM_RATES=\"$rates\" NETSIM_DENSE_REPEATS=$repeats NETSIM_W=$w${NETSIM_EVAL_EVERY:+ NETSIM_EVAL_EVERY=$eval_every}${NETSIM_WORKLOAD:+ NETSIM_WORKLOAD=$workload}${NETSIM_WAIT_BARRIER:+ NETSIM_WAIT_BARRIER=$NETSIM_WAIT_BARRIER}${NETSIM_UNTIMED:+ NETSIM_UNTIMED=$untimed}${section:+ NETSIM_SECTION=$section} bash netsim/run-report.sh" \
    "$section"
echo "run-report: docs/netsim.md updated"

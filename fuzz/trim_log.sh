#!/usr/bin/env bash
# Writes fuzz/logs/<target>.log from the raw libFuzzer output of fuzz/run_long.sh: a header
# (date, command, build) and, for each session, the final status line, the crash report if
# any, and libFuzzer's final statistics.
# Usage: fuzz/trim_log.sh TARGET...   (LOGS as in run_long.sh)
set -euo pipefail
cd "$(dirname "$0")"
LOGS=${LOGS:-target/long/logs}
mkdir -p logs
for t in "$@"; do
    out=logs/$t.log
    {
        echo "# fuzz target: $t"
        echo "# written: $(date -u +%FT%TZ) by fuzz/trim_log.sh from fuzz/run_long.sh output"
        echo "# build: cargo +nightly fuzz build -O -a -s none (release, debug assertions and overflow checks, no sanitizer)"
        echo "# command: nice -n 19 fuzz/target/x86_64-unknown-linux-gnu/release/$t -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 -max_len=4096 -max_total_time=${MIN_TIME:-600} <corpus>"
        echo "#   then, if under ${MIN_EXECS:-5000000} executions: the same with -runs=<${MIN_EXECS:-5000000} - executions so far>"
        echo "# progress: $(grep " $t\b" "$LOGS/progress" | tr '\n' ' ')"
        for s in 1 2; do
            f=$LOGS/$t.$s.log
            [ -f "$f" ] || continue
            echo
            echo "## session $s"
            grep -m1 -E "^INFO: Seed:" "$f" || true
            grep -m1 -E "INITED" "$f" || true
            { grep -E "^#[0-9]+[[:space:]]+(pulse|NEW|REDUCE|DONE)" "$f" || true; } | tail -3
            grep -E "^Done [0-9]+ runs" "$f" || true
            grep -E -A12 "panicked at|ERROR: libFuzzer|SUMMARY:" "$f" | grep -v "^ *at /rustc\|^ *[0-9]*: " | head -30 || true
            grep -E "^stat::" "$f" || true
        done
    } > "$out"
    echo "wrote $out"
done

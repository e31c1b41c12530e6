#!/usr/bin/env bash
# Long fuzz runs, one target at a time, at the lowest priority (the machine is shared).
# Usage: fuzz/run_long.sh TARGET...   (binaries already built: cargo +nightly fuzz build -O -a -s none)
# Each target runs at least MIN_TIME seconds (default 600) and at least MIN_EXECS executions
# (default 5,000,000): a first session of MIN_TIME seconds, then, if it fell short, a second
# one for the remaining executions (capped at MAX_EXTRA seconds). Both sessions work on one
# corpus directory (WORK/<target>, seeded from fuzz/corpus/<target>), whose new inputs are
# minimized back into fuzz/corpus/<target> afterwards (merge). Raw libFuzzer output goes to
# LOGS/<target>.{1,2}.log; fuzz/logs/<target>.log is then written by fuzz/trim_log.sh.
# A lock file serializes concurrent invocations.
set -uo pipefail
cd "$(dirname "$0")"
BIN=${BIN:-target/x86_64-unknown-linux-gnu/release}
WORK=${WORK:-target/long/work}
LOGS=${LOGS:-target/long/logs}
MIN_TIME=${MIN_TIME:-600}
MIN_EXECS=${MIN_EXECS:-5000000}
MAX_EXTRA=${MAX_EXTRA:-2400}
mkdir -p "$WORK" "$LOGS"
exec 9>"$LOGS/lock"
flock 9
for t in "$@"; do
    mkdir -p "$WORK/$t" "$LOGS/artifacts"
    cp -n corpus/"$t"/* "$WORK/$t"/ 2>/dev/null || true
    bin="$LOGS/bin/$t"
    mkdir -p "$LOGS/bin"
    cp "$BIN/$t" "$bin"
    common=(-print_final_stats=1 -timeout=10 -rss_limit_mb=2048 -max_len=4096
        "-artifact_prefix=$LOGS/artifacts/$t-")
    echo "$(date -u +%FT%TZ) start $t" >> "$LOGS/progress"
    nice -n 19 "$bin" "${common[@]}" -max_total_time="$MIN_TIME" "$WORK/$t" > "$LOGS/$t.1.log" 2>&1
    rc=$?
    execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$LOGS/$t.1.log")
    execs=${execs:-0}
    rm -f "$LOGS/$t.2.log"
    if [ "$rc" -eq 0 ] && [ "$execs" -lt "$MIN_EXECS" ]; then
        nice -n 19 "$bin" "${common[@]}" -runs=$((MIN_EXECS - execs)) \
            -max_total_time="$MAX_EXTRA" "$WORK/$t" > "$LOGS/$t.2.log" 2>&1
        rc=$?
    fi
    echo "$(date -u +%FT%TZ) end $t rc=$rc" >> "$LOGS/progress"
done

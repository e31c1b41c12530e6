#!/usr/bin/env bash
# Fuzz smoke run for CI: when a nightly toolchain is present, installs cargo-fuzz if missing,
# builds every fuzz target and runs each for FUZZ_SECONDS (default 30) on a copy of its
# checked-in corpus (fuzz/corpus/<target>, which stays untouched). Without nightly it fails,
# saying why (the corpora are also replayed on stable by core/tests/fuzz_replay.rs and
# std-adapter/tests/fuzz_replay.rs). Any crash fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-30}

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz: FAILED: no nightly toolchain (cargo fuzz needs nightly: rustup toolchain install nightly)"
    exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi

cd fuzz
# Release with debug assertions and overflow checks (-a); no sanitizer: the crates forbid
# unsafe code, and address sanitizer doubles the build time for little gain here.
cargo +nightly fuzz build -O -a -s none
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=()
for t in $(cargo +nightly fuzz list); do
    mkdir -p "$work/$t"
    cp corpus/"$t"/* "$work/$t"/ 2>/dev/null || true
    echo "fuzz: $t for ${seconds}s"
    if ! cargo +nightly fuzz run -O -a -s none "$t" "$work/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
        -print_final_stats=1 -artifact_prefix="$work/$t-" >"$work/$t.log" 2>&1; then
        failed+=("$t")
        grep -E -A20 "panicked at|ERROR: libFuzzer" "$work/$t.log" | head -40 || true
    fi
    grep -E "^#[0-9]+ +DONE|^stat::number_of_executed_units" "$work/$t.log" || true
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: crashes in: ${failed[*]}"
    exit 1
fi
echo "fuzz: every target ran ${seconds}s without a crash"

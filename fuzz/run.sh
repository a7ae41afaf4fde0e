#!/usr/bin/env bash
# Runs the tiacc-core fuzz targets one after the other (not in parallel), each
# for a bounded time on top of the checked-in corpus fuzz/corpus/<target>/.
#
#   bash fuzz/run.sh [seconds]      # default: 600 seconds per target
#   bash fuzz/run.sh merge          # fold what runs found into fuzz/corpus/
#   bash fuzz/run.sh build          # only build the targets (CI builds them
#                                   # in the background while tests run)
#
# What it needs, it installs: cargo-fuzz with `cargo install` when missing.
# It runs on the stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its
# -Z flags (AddressSanitizer included), so no nightly toolchain is needed.
#
# New inputs go to fuzz/new-corpus/<target>/ (not tracked), never into the
# checked-in corpus; `merge` adds those that reach new code to fuzz/corpus/.
# Each target's libFuzzer log is fuzz/logs/<target>.log; fuzz/logs/summary.tsv
# has one line per target: seconds, executions, new inputs, crashes. A crash,
# a leak, an input that runs over 20 s or over 2 GB fails the run (exit 1)
# and leaves the input in fuzz/artifacts/<target>/: add it to
# fuzz/corpus/<target>/ once the bug is fixed, with a unit test.
set -euo pipefail

MODE="${1:-600}"
FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$FUZZ_DIR"

export RUSTC_BOOTSTRAP=1
CARGO_FUZZ_VERSION=0.13.2
SANITIZER="${SANITIZER:-address}"   # `none` also works, and runs faster
TARGETS=(record_reader example_decode image_decode)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION with cargo install"
    cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

mkdir -p logs
build_start=$SECONDS
cargo fuzz build -O -s "$SANITIZER" >logs/build.log 2>&1 || {
    tail -n 40 logs/build.log >&2
    exit 1
}
echo "fuzz targets built in $((SECONDS - build_start)) s (sanitizer: $SANITIZER)"
[ "$MODE" = build ] && exit 0

if [ "$MODE" = merge ]; then
    for t in "${TARGETS[@]}"; do
        mkdir -p "new-corpus/$t"
        before=$(find "corpus/$t" -type f | wc -l)
        cargo fuzz run -O -s "$SANITIZER" "$t" "corpus/$t" "new-corpus/$t" -- -merge=1 \
            >"logs/merge-$t.log" 2>&1 || { tail -n 20 "logs/merge-$t.log" >&2; exit 1; }
        echo "$t: corpus $before -> $(find "corpus/$t" -type f | wc -l) inputs"
    done
    exit 0
fi

SECONDS_PER_TARGET="$MODE"
printf 'target\tseconds\texecutions\tnew_inputs\tcrashes\n' >logs/summary.tsv
status=0
for t in "${TARGETS[@]}"; do
    mkdir -p "new-corpus/$t" "artifacts/$t"
    rc=0
    cargo fuzz run -O -s "$SANITIZER" "$t" "new-corpus/$t" "corpus/$t" -- \
        -max_total_time="$SECONDS_PER_TARGET" -timeout=20 -rss_limit_mb=2048 \
        -print_final_stats=1 >"logs/$t.log" 2>&1 || rc=$?
    final_stat() { sed -n "s/^stat::$1: *//p" "logs/$t.log" | tail -n 1; }
    crashes=0
    if [ "$rc" != 0 ]; then
        crashes=1
        status=1
        echo "!!! $t exited with $rc: the end of logs/$t.log, then the input in artifacts/$t/" >&2
        tail -n 60 "logs/$t.log" >&2
        ls -l "artifacts/$t" >&2
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$t" "$SECONDS_PER_TARGET" "$(final_stat number_of_executed_units)" \
        "$(final_stat new_units_added)" "$crashes" >>logs/summary.tsv
done
column -t -s $'\t' logs/summary.tsv 2>/dev/null || cat logs/summary.tsv
exit "$status"

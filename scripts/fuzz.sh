#!/usr/bin/env bash
# Coverage-guided fuzzing of the wire decoder, frame reader, handshake, netlink, topology
# XML and config parsers, and of a receive comm fed hostile frame sequences after a real
# handshake (receiver_session, through the engine's `fuzz-harness`) (fuzz/). Stable Rust only: libFuzzer (the libfuzzer-sys crate)
# with LLVM's SanitizerCoverage pass, which stable rustc runs under -C passes=sancov-module,
# so neither nightly nor RUSTC_BOOTSTRAP is needed.
#
#   scripts/fuzz.sh [seconds-per-target] [target...]     (default 60 s, every target)
#
# Prints per target the inputs run and whether it crashed. A crashing input is saved in
# fuzz/artifacts/<target>/ and the script exits 1; replay one with
#   fuzz/target/<host>/release/<target> fuzz/artifacts/<target>/crash-…
# The corpus grows in fuzz/corpus/<target>/ (not committed), started from fuzz/seeds/.
# The same targets run as bounded property tests in `cargo test --test fuzz_targets`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/prereqs.sh
need c++ g++ # libfuzzer-sys compiles libFuzzer's C++ sources

secs=${1:-60}
[ $# -gt 0 ] && shift
case $secs in
'' | *[!0-9]*)
    echo "railover: fuzz.sh: seconds-per-target must be a whole number of seconds, got '$secs'" >&2
    exit 2
    ;;
esac

host=$(rustc -vV | sed -n 's/^host: //p')
# --target keeps the instrumentation off build scripts and proc macros, which are not
# linked with libFuzzer's coverage callbacks.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
unset CARGO_TARGET_DIR
echo "railover: building fuzz targets (release, instrumented)"
(cd fuzz && cargo build --release --quiet --target "$host" --bins)
bin=fuzz/target/$host/release

if [ $# -gt 0 ]; then
    targets=("$@")
else
    targets=()
    for f in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi

failed=0
printf '%-14s %12s %10s  %s\n' target inputs exec/s result
for t in "${targets[@]}"; do
    if [ ! -x "$bin/$t" ]; then
        echo "railover: fuzz.sh: no target '$t' (targets: $(ls fuzz/fuzz_targets | sed 's/\.rs$//' | tr '\n' ' '))" >&2
        exit 2
    fi
    corpus=fuzz/corpus/$t
    art=fuzz/artifacts/$t
    log=fuzz/target/$t.log
    mkdir -p "$corpus" "$art"
    cp -n fuzz/seeds/"$t"/* "$corpus"/ 2>/dev/null || true
    before=$(find "$art" -maxdepth 1 -type f | wc -l)
    rc=0
    "$bin/$t" "$corpus" -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$art/" >"$log" 2>&1 || rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    after=$(find "$art" -maxdepth 1 -type f | wc -l)
    if [ "$rc" -eq 0 ] && [ "$after" -eq "$before" ]; then
        result="ok, no crash"
    else
        failed=1
        saved=$(ls -t "$art" | head -1)
        saved=${saved:+$art/$saved}
        result="CRASHED (exit $rc): ${saved:-no input saved}; log $log"
        grep -m3 -E "panicked at|ERROR: libFuzzer|deadly signal" "$log" | sed 's/^/    /' || true
    fi
    printf '%-14s %12s %10s  %s\n' "$t" "${runs:-?}" "${speed:-?}" "$result"
done
exit $failed

#!/usr/bin/env bash
# railover's full test suite: unit (sans-IO machines, parsers, topology), ABI (the
# built .so driven from C and Rust as NCCL drives it), loopback end to end, and the
# command-line tools. Prints one summary line at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/prereqs.sh

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
echo "== cargo test (all tiers)"
timeout 2400 cargo test --no-fail-fast 2>&1 | tee "$log" || status=$?

read -r passed failed ignored < <(awk '/^test result:/ {
    for (i = 1; i <= NF; i++) {
        if ($(i+1) ~ /^passed/) p += $i
        if ($(i+1) ~ /^failed/) f += $i
        if ($(i+1) ~ /^ignored/) g += $i
    }
} END { print p+0, f+0, g+0 }' "$log")
echo
echo "railover tests: $passed passed, $failed failed, $ignored skipped"
exit "$status"

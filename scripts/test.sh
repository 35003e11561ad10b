#!/usr/bin/env bash
# railover's full test suite: unit (sans-IO machines, parsers, topology), ABI (the
# built .so driven from C and Rust as NCCL drives it), loopback end to end, the
# command-line tools, observability (promtool, a real Prometheus), and, as root, the
# fault tier (namespaces + veth + tc: links cut, slowed, flapped under checksummed
# traffic), and the Soft-RoCE tier (two QEMU guests, rdma_rxe; skipped, and said so, where
# QEMU cannot run). Prints one summary line at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/prereqs.sh
need python3 python3

log=$(mktemp)
faultlog=$(mktemp)
pylog=$(mktemp)
verbslog=$(mktemp)
trap 'rm -f "$log" "$faultlog" "$pylog" "$verbslog"' EXIT
status=0
echo "== cargo test (unit, ABI, loopback, tools, observability)"
timeout 2400 cargo test --no-fail-fast 2>&1 | tee "$log" || status=$?
echo "== fault tier"
timeout 1200 bash scripts/fault-tier.sh 2>&1 | tee "$faultlog" || status=$?
echo "== verbs tier (Soft-RoCE in QEMU)"
timeout 900 bash scripts/verbs-tier.sh 2>&1 | tee "$verbslog" || status=$?
echo "== GPU check (preflight, NCCL log parsing, rank watcher, outputs; no GPU needed)"
timeout 120 python3 scripts/test_gpu_check.py 2>&1 | tee "$pylog" || status=$?

count() {
    awk '/^test result:/ {
        for (i = 1; i <= NF; i++) {
            if ($(i+1) ~ /^passed/) p += $i
            if ($(i+1) ~ /^failed/) f += $i
            if ($(i+1) ~ /^ignored/) g += $i
        }
    } END { print p+0, f+0, g+0 }' "$1"
}
read -r p1 f1 g1 < <(count "$log")
read -r p2 f2 g2 < <(count "$faultlog")
read -r p3 f3 g3 < <(count "$pylog")
# The verbs tier reports one line per check; a skip counts as one skipped test.
p4=$(grep -c '^verbs tier: ok ' "$verbslog" || true)
f4=$(grep -c '^verbs tier: FAIL' "$verbslog" || true)
g4=$(grep -c '^verbs tier: SKIP' "$verbslog" || true)
# The fault tests are #[ignore]d in the first run and run (as root) in the second: count
# as skipped only what ran in neither.
passed=$((p1 + p2 + p3 + p4))
failed=$((f1 + f2 + f3 + f4))
skipped=$((g1 - p2 - f2 + g3 + g4))
echo
echo "railover tests: $passed passed, $failed failed, $skipped skipped"
exit "$status"

#!/usr/bin/env bash
# What a collective keeps when one of N NICs fails (README, "Keeping (N-1)/N in
# lockstep"): `railover bench --failover` on the namespace testbed for N = 2, 4, 8 rails
# with C = N and C = 2N comms in lockstep (K = 8), plus free-running comms at N = 4.
# Prints the README's markdown table on stdout (progress on stderr) and draws the N = 4,
# C = 4 run into docs/failover-lockstep.svg. Needs root (namespaces, tc). About 3 minutes
# (171 s measured) after the release build.
#
# Link rates: 200 Mbit/s per rail for N <= 4, 100 Mbit/s for N = 8, so the links (800
# Mbit/s in all either way), not the CPU, set the pace on a 2-core machine where both
# endpoints checksum every byte (the plugin moves about 2.7 Gbit/s unshaped there).
#
# Shapers: the fault tier's 50 ms tail-drop queue (--queue-ms 50), not the bench's
# lossless default: behind a FIFO that drops, a moved comm gets its share of a survivor
# only through the plugin's fair-share pacing, which this table shows.
#
# usage: scripts/failover-bench.sh [extra railover bench options, e.g. --steady 8]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "failover bench: needs root (network namespaces and tc)" >&2
    exit 1
fi
. scripts/prereqs.sh
need tc iproute2
cargo build --release --quiet -p railover-cli
bin=./target/release/railover
plot=docs/failover-lockstep.svg

rate() { if [ "$1" -le 4 ]; then echo 200; else echo 100; fi; }

first=1
status=0
row() {
    # row <rails> <comms> [options...]: one run; the table's header only once.
    local n=$1 c=$2
    shift 2
    echo "failover bench: N=$n C=$c $*" >&2
    local out
    # A run whose data was not delivered exactly once exits 1 but still prints its row.
    out=$("$bin" bench --failover --markdown --rails "$n" --comms "$c" --rate "$(rate "$n")" --queue-ms 50 "$@") || status=1
    [ -n "$out" ] || return 0
    if [ "$first" -eq 1 ]; then
        printf '%s\n' "$out"
        first=0
    else
        printf '%s\n' "$out" | tail -n +3
    fi
}

start=$(date +%s)
for n in 2 4 8; do
    for c in $n $((2 * n)); do
        if [ "$n" -eq 4 ] && [ "$c" -eq 4 ]; then
            row "$n" "$c" --plot "$plot" "$@"
        else
            row "$n" "$c" "$@"
        fi
    done
done
row 4 4 --free "$@"
echo "failover bench: plot in $plot; $(( $(date +%s) - start )) s in all" >&2
exit "$status"

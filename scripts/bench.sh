#!/usr/bin/env bash
# The README's Performance table: builds the release binary, installs iperf3 for the
# reference line when run as root, and prints `railover bench --markdown`. Arguments go
# to `railover bench` (e.g. --comms 4, --testbed 4 as root, --quick for a short run).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/prereqs.sh
want iperf3 iperf3
cargo build --release --quiet
exec ./target/release/railover bench --markdown "$@"

#!/usr/bin/env bash
# The main job: a self-contained run of railover, two processes streaming checksummed
# data through the plugin on loopback, throughput shown live, summary at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/prereqs.sh
cargo build --release --quiet
exec ./target/release/railover demo "$@"

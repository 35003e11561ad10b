#!/usr/bin/env bash
# GPU validation of a railover build, on a machine with PyTorch (NCCL backend) and one
# GPU but no Rust: two ranks on that GPU with distinct NCCL_HOSTIDs, so NCCL must carry
# their traffic through the network plugin. Checks from NCCL's log that railover was
# loaded (through the table that NCCL asks for) and used, checks every collective's
# result, and compares bus bandwidth with NCCL's own Socket transport.
#
#   scripts/gpu-check.sh PLUGIN_SO OUT_DIR [--full] [more options: gpu_check.py --help]
#
# OUT_DIR gets at most three files, kept up to date while it runs: summary.json (every
# result as it is measured, and each item that did not run with the reason),
# log-tail.txt, and gpu-check.tar.gz (every log and event file). A preflight checks
# CUDA, the GPU's compute mode, NCCL's version and the plugin's tables first, in seconds.
# By default the sweep is 8 B .. 32 MiB in steps of 4x and the whole run ends within 4
# minutes; --full sweeps 8 B .. 256 MiB in doublings within 10 minutes.
#
# Build the .so beforehand (cargo build --release → target/release/librailover.so).
# Exit status: 0 passed, 1 railover failed, 2 usage, 3 only the Socket baseline failed,
# 4 preflight failed (nothing ran), 5 railover passed but teardown hung or failed,
# 6 railover passed what ran but not everything ran, 124 out of time.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$#" -lt 2 ]; then
    echo "usage: $0 PLUGIN_SO OUT_DIR [--full] [options]" >&2
    exit 2
fi
so=$1
out=$2
shift 2
if [ ! -f "$so" ]; then
    echo "gpu-check: $so is not a file: pass the built librailover.so" >&2
    exit 2
fi
py=${PYTHON:-python3}
if ! command -v "$py" >/dev/null; then
    echo "gpu-check: $py not found: set PYTHON to a Python with CUDA-enabled PyTorch" >&2
    exit 2
fi
# The driver keeps to its own budget (210 s, or 540 s with --full) and writes its files
# when told to stop; this outer bound (SIGTERM, then SIGKILL 10 s later) is the backstop.
limit=230
for arg in "$@"; do
    [ "$arg" = --full ] && limit=580
done
mkdir -p "$out"
exec timeout --kill-after=10 "$limit" "$py" "$here/gpu_check.py" --plugin "$so" --out "$out" "$@"

#!/usr/bin/env bash
# GPU validation of a railover build, on a machine with PyTorch (NCCL backend) and one
# GPU but no Rust: two ranks on that GPU with distinct NCCL_HOSTIDs, so NCCL must carry
# their traffic through the network plugin. Checks from NCCL's log that railover was
# loaded and used, checks every collective's result, and compares bus bandwidth with
# NCCL's own Socket transport. Writes summary.json and log-tail.txt into OUT_DIR.
#
#   scripts/gpu-check.sh PLUGIN_SO OUT_DIR [--min-bytes 8] [--max-bytes 256M]
#
# Build the .so beforehand (cargo build --release → target/release/librailover.so).
# Exit status: 0 passed, 1 railover failed, 2 usage, 3 only the Socket baseline failed,
# 124 out of time (the whole run is bounded to 7 min 50 s).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$#" -lt 2 ]; then
    echo "usage: $0 PLUGIN_SO OUT_DIR [--min-bytes N] [--max-bytes N]" >&2
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
if ! "$py" -c 'import torch, torch.distributed as d; assert torch.cuda.is_available() and d.is_nccl_available()' 2>/dev/null; then
    echo "gpu-check: $py has no CUDA-enabled PyTorch with NCCL: nothing to run here" >&2
    exit 2
fi
mkdir -p "$out"
# Each transport gets 200 s; the outer bound catches anything that hangs past that.
exec timeout --kill-after=10 470 "$py" "$here/gpu_check.py" --plugin "$so" --out "$out" "$@"

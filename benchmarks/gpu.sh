#!/usr/bin/env bash
# GPU readiness check: ResNet-50 training throughput and MFU in fp32 / bf16 AMP / fp16 AMP,
# channels_last off and on, on one GPU. Needs torch and torchvision only (no Ray).
# Prints one line and exits 0 on a machine without a CUDA GPU.
#
#   bash benchmarks/gpu.sh                      # writes benchmarks/results/gpu.md
#   bash benchmarks/gpu.sh --compile --out /tmp/gpu.md
#   PYTHON=/path/to/python bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null; then
        PYTHON=.venv/bin/python
    else
        PYTHON=$(command -v python3 || command -v python)
    fi
fi
exec "$PYTHON" benchmarks/gpu.py "$@"

#!/usr/bin/env bash
# make gpu-check: prove the package on this machine's CUDA or XPU device in one command (under 10 minutes).
# Uses the Python already installed here (no network): $PYTHON, else the first of .venv/bin/python,
# python3, python that imports torch. Everything lands in one folder (gpu_check_out/<date> unless --out
# is given); the steps and what they write are in fastmoe_xpu/tools/gpu_check.py. Without a device it
# says so and exits non-zero; --dry-run lists the steps with their time limits and exits 0 (it needs no torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
  PY="${PY:-python3}"
fi
# The file, not the module: the dry run must work where torch (which the package imports) is missing.
exec "$PY" fastmoe_xpu/tools/gpu_check.py "$@"

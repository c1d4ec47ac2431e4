#!/usr/bin/env bash
# Creates .venv with everything the package, its tests, benchmarks and trainer need.
# torch is pinned to the CPU wheel this machine kind carries; an open range would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.fastmoe-installed
# The other packages at the versions the suite last passed on (see the file; FASTMOE_CONSTRAINTS overrides).
constraints=${FASTMOE_CONSTRAINTS:-scripts/constraints.txt}
want="$(cat pyproject.toml setup.py scripts/setup_venv.sh "$constraints" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
  # wandb: the trainer's optional W&B logging, installed for its offline test (tests/trainer/test_wandb_logging.py)
  .venv/bin/pip install -q --disable-pip-version-check -c "$constraints" -e ".[test,trainer,bench,wandb]"
  # LoRA on the expert weights: the PEFT integration tests and the trainer's adapter export
  .venv/bin/pip install -q --disable-pip-version-check -c "$constraints" peft
  echo "$want" > "$stamp"
fi

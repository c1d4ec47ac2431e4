#!/usr/bin/env bash
# Fill kit_wheels/ with the pure-Python wheels that the GPU machine image lacks, so that
# scripts/gpu_check.sh can run there without a network: it unpacks each one whose modules the
# machine's Python cannot import into <out>/pylib (fastmoe_xpu/tools/gpu_check.py, provide_wheels).
#
# The image: Python 3.12, torch 2.11.0, triton 3.6.0, transformers 5.17.0 (with tokenizers,
# safetensors, huggingface-hub), numpy 2.5, pytest, pytest-benchmark, pytest-xdist, matplotlib, tqdm,
# pyarrow, tensorboard (with protobuf), peft. Of the project's imports it lacks tensorboardX (the
# trainer's TensorBoard event files), whose own requirements (numpy, packaging, protobuf) are there, and
# liger-kernel (Liger's fused MoE, the peer the kit's comparison times; it needs only torch and triton).
#
# kit_wheels/ is git-ignored: copy it to the machine with the checkout.
# Only *-none-any.whl files are kept; anything else would not run on every machine.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=("tensorboardX==2.6.5" "liger-kernel==0.8.5")
mkdir -p kit_wheels
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation py --abi none --platform any -d kit_wheels "${WHEELS[@]}" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
for whl in kit_wheels/*.whl; do
    case "$whl" in
        *-none-any.whl) echo "[prepare_kit_wheels] $whl ($(du -k "$whl" | cut -f1) KB)" ;;
        *) echo "[prepare_kit_wheels] error: $whl is not a pure-Python wheel" >&2; exit 1 ;;
    esac
done

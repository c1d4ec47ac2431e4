#!/usr/bin/env bash
# Build .venv-xpu: Intel's Triton build (triton-xpu) and the offline compiler for Intel GPUs, so
# that `python -m fastmoe_xpu.tools.compile_check --target xpu` can compile every kernel for
# Ponte Vecchio (PVC) on a machine without an Intel GPU.
#
# Idempotent: a second run installs nothing new and takes a few seconds.
#
# Why a venv of its own: triton-xpu installs a module named `triton` too, so it cannot live beside
# the upstream triton of the main environment.
#
# Environment:
#   PYTHON     interpreter the venv is made from (default: python3)
#   XPU_VENV   where the venv goes (default: <repo root>/.venv-xpu)
set -euo pipefail

# shellcheck source=scripts/venv_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh" XPU_VENV .venv-xpu

# Versions: triton-xpu 3.3.0b1 and intel-sycl-rt 2026.2.0 (headers and libsycl for the backend's
# small C helper) are what the compile gate was verified with; torch is the CPU wheel the main
# environment uses (only for importing the launchers: nothing runs on a device).
TRITON_XPU_VERSION="3.3.0b1"
TORCH_VERSION="2.13.0"
SYCL_RT_VERSION="2026.2.0"

# --- Debian packages: ocloc + IGC (intel-opencl-icd) and the Level Zero headers/loader (libze-dev),
# which the Intel backend links its small C helper against.
need_apt=()
command -v ocloc >/dev/null 2>&1 || need_apt+=(intel-opencl-icd)
dpkg -s libze-dev >/dev/null 2>&1 || need_apt+=(libze-dev)
if ((${#need_apt[@]})); then
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || { say "need root (or sudo) to install ${need_apt[*]}"; exit 1; }
        sudo="sudo"
    fi
    say "apt-get install ${need_apt[*]}"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
command -v ocloc >/dev/null 2>&1 || { say "ocloc still missing after installing intel-opencl-icd"; exit 1; }

# --- The virtual environment.
make_venv

# The pip work is skipped while setup.py and this script are unchanged since the last full run.
stamp="$venv/.fastmoe-xpu-installed"
want="$(files_stamp "$repo_root/setup.py" "${BASH_SOURCE[0]}")"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    # Upstream `triton` must never be in this venv: it and triton-xpu both own the `triton` module.
    if "$venv/bin/python" -m pip show --quiet triton >/dev/null 2>&1; then
        say "removing upstream triton from $venv (it shadows triton-xpu)"
        "$venv/bin/python" -m pip uninstall --quiet -y triton
    fi
    say "pip install triton-xpu==$TRITON_XPU_VERSION intel-sycl-rt==$SYCL_RT_VERSION torch==$TORCH_VERSION numpy"
    pip_install "triton-xpu==$TRITON_XPU_VERSION" "intel-sycl-rt==$SYCL_RT_VERSION" "torch==$TORCH_VERSION" numpy
    # --no-deps: the project's own requirements are already there, and its `triton` extra must not
    # pull upstream triton in over triton-xpu.
    pip_install --no-deps -e "$repo_root"
    echo "$want" > "$stamp"
fi

"$venv/bin/python" - <<'EOF'
import importlib.metadata as md
import triton
from triton.backends.compiler import GPUTarget  # noqa: F401
import triton.backends.intel.compiler  # noqa: F401  (fails if the Intel backend is missing)
print(f"[setup_xpu_venv] triton {triton.__version__} (triton-xpu {md.version('triton-xpu')}), "
      f"intel-sycl-rt {md.version('intel-sycl-rt')}, torch {md.version('torch')}")
EOF
say "ocloc: $(command -v ocloc); done in $((SECONDS - started)) s"

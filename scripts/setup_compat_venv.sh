#!/usr/bin/env bash
# Build .venv-compat: the oldest versions the package supports (torch 2.11.0, triton 3.6.0,
# transformers 5.17.0, the versions of the GPU machine image the kit in scripts/gpu_check.sh runs on),
# on this CPU, so that `make test-compat` can run the test suite there.
#
# torch 2.11.0 exists on PyPI for Linux only as the CUDA 13 build, whose declared dependencies are
# about 2.5 GB of nvidia-* wheels (cuDNN, cuBLAS, NCCL, cuSPARSELt, ...). torch is therefore installed
# with --no-deps and, beside it, only the nvidia wheels whose shared libraries torch's own libraries
# name as NEEDED (libtorch_cuda.so is linked into libtorch.so, so `import torch` loads them all even on
# a CPU), at the exact versions torch 2.11.0 declares. cuSOLVER, NVRTC and NVTX are opened lazily, on a
# GPU, and are left out. Nothing here runs on a GPU.
#
# numpy is left open (>= 2.4 today, as on the machine image, which has 2.5): triton 3.6's interpreter
# calls int() on one-element numpy arrays, which numpy 2.4 rejects, and the package's correction
# (fastmoe_xpu/kernels/triton/interpreter_compat.py, applied only where a probe kernel fails) is then
# exercised here too.
#
# Idempotent: a second run installs nothing and takes a second.
#
# Environment:
#   PYTHON       interpreter the venv is made from (default: python3)
#   COMPAT_VENV  where the venv goes (default: <repo root>/.venv-compat)
set -euo pipefail

# shellcheck source=scripts/venv_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh" COMPAT_VENV .venv-compat

TORCH_VERSION="2.11.0"
TRITON_VERSION="3.6.0"
TRANSFORMERS_VERSION="5.17.0"
# The nvidia wheels behind the NEEDED entries of torch 2.11.0's libtorch*.so, at the versions its
# metadata declares (cuda-toolkit[...]==13.0.2 and the direct pins).
NVIDIA_WHEELS=(
    "nvidia-cuda-runtime==13.0.96"      # libcudart.so.13
    "nvidia-cuda-cupti==13.0.85"        # libcupti.so.13 (libtorch_cpu.so)
    "nvidia-cublas==13.1.0.3"           # libcublas.so.13, libcublasLt.so.13
    "nvidia-cufft==12.0.0.61"           # libcufft.so.12
    "nvidia-cufile==1.15.1.6"           # libcufile.so.0
    "nvidia-curand==10.4.0.35"          # libcurand.so.10
    "nvidia-cusparse==12.6.3.3"         # libcusparse.so.12
    "nvidia-nvjitlink==13.0.88"         # libnvJitLink.so.13 (libcusparse.so.12)
    "nvidia-cudnn-cu13==9.19.0.56"      # libcudnn.so.9
    "nvidia-cusparselt-cu13==0.8.0"     # libcusparseLt.so.0
    "nvidia-nccl-cu13==2.28.9"          # libnccl.so.2
    "nvidia-nvshmem-cu13==3.4.5"        # libnvshmem_host.so.3 (libtorch_nvshmem.so)
)
# torch's pure-Python requirements, and what the tests need beside transformers' own requirements:
# the whole suite runs here (drills aside), so the trainer extra's packages too (matplotlib draws the
# run's charts, pyarrow reads Parquet, tensorboardX writes event files), and a setuptools that builds
# wheels by itself (bdist_wheel is built in from 70.1; tests/trainer/test_installed.py builds one
# without build isolation). peft, wandb and liger-kernel stay out: their tests skip saying so.
TORCH_PURE=("filelock" "typing-extensions>=4.10.0" "setuptools>=70.1,<82" "sympy>=1.13.3" "networkx>=2.5.1"
            "jinja2" "fsspec>=0.8.5")
TEST_DEPS=("numpy>=2.4" "pytest" "pytest-benchmark" "matplotlib" "pyarrow" "tensorboardX>=2.6")

make_venv

stamp="$venv/.fastmoe-compat-installed"
want="$(files_stamp "$repo_root/setup.py" "${BASH_SOURCE[0]}")"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    # torch last: installed before them, pip would list its CUDA requirements left out on purpose as conflicts.
    say "pip install triton==$TRITON_VERSION transformers==$TRANSFORMERS_VERSION and the test tools"
    pip_install "triton==$TRITON_VERSION" "transformers==$TRANSFORMERS_VERSION" "${TORCH_PURE[@]}" "${TEST_DEPS[@]}"
    say "pip install --no-deps torch==$TORCH_VERSION and ${#NVIDIA_WHEELS[@]} nvidia wheels"
    pip_install --no-deps "torch==$TORCH_VERSION" "${NVIDIA_WHEELS[@]}"
    # --no-deps: the package's own requirements are all there; its open torch range must not reach pip.
    pip_install --no-deps -e "$repo_root"
    echo "$want" > "$stamp"
fi

"$venv/bin/python" - <<'EOF'
import numpy, torch, transformers, triton
print(f"[setup_compat_venv] torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}, numpy {numpy.__version__}; "
      f"torch.ones(2).sum() = {torch.ones(2).sum().item()}")
EOF
say "done in $((SECONDS - started)) s"

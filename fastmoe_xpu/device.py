"""Device detection: the accelerator PyTorch sees and the CPU's model name.

Which kernels run on a device is decided by the implementation registry
(:mod:`fastmoe_xpu.kernels.registry`); the Triton launch tables by ``kernels/configs.py``.
"""
from __future__ import annotations

import functools
import platform

import torch


def accelerator_type() -> str:
    """The best accelerator PyTorch can see: ``"xpu"``, ``"cuda"`` or ``"cpu"``."""
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_device() -> torch.device:
    return torch.device(accelerator_type())


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what :mod:`platform` knows): benchmark reports
    and the engine cache key describe the machine with it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The CPU flags (as ``/proc/cpuinfo`` names them) of the vector and matrix extensions the CPU GEMMs
#: use: AVX-512, its bf16 dot products and VNNI int8 ones, AMX tiles for bf16, int8 and fp16.
MATRIX_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_fp16")


@functools.lru_cache(maxsize=1)
def cpu_matrix_extensions() -> tuple[str, ...]:
    """Which of :data:`MATRIX_FLAGS` this CPU has (``/proc/cpuinfo``'s flags; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in MATRIX_FLAGS if flag in have)
    except OSError:
        pass
    return ()

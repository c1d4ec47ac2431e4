"""Device and kernel-backend detection.

The backend decides who runs stages 2-5: ``"triton"`` (Triton kernels; the default on xpu and cuda
devices) or ``"torch"`` (plain PyTorch; the default on the CPU). ``FASTMOE_BACKEND=triton|torch``
overrides ``"auto"``.
"""
from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def accelerator_type() -> str:
    """The best accelerator PyTorch can see: ``"xpu"``, ``"cuda"`` or ``"cpu"``."""
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_device() -> torch.device:
    return torch.device(accelerator_type())


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn ``"auto"`` into ``"torch"`` or ``"triton"`` for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get("FASTMOE_BACKEND", "").strip().lower()
        if env:
            if env not in ("torch", "triton"):
                raise ValueError(f"FASTMOE_BACKEND must be 'torch' or 'triton', got {env!r}")
            backend = env
        else:
            dev_type = torch.device(device).type
            backend = "triton" if dev_type in ("xpu", "cuda") and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the 'triton' package (pip install triton)")
        if torch.device(device).type == "cpu" and not triton_interpreting():
            raise RuntimeError(
                "backend='triton' on CPU tensors runs only under the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing triton, or use backend='torch'"
            )
    return backend

"""Device detection and the one decision of which kernels run.

:func:`choose_kernels` decides, for tensors on a device, the kernel backend of stages 2-5
(``"triton"``: the default on xpu and cuda devices; ``"torch"``: the default on the CPU), the Triton
config table (``kernels/configs.py``) and whether ``tl.dot`` operands go through block pointers.
``fastmoe_xpu.settings`` overrides each (``FASTMOE_BACKEND``, ``FASTMOE_TRITON_CONFIGS``,
``FASTMOE_TRITON_BLOCK_PTR``); :func:`resolve_backend` (the block) and the Triton launchers ask it.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import platform
from typing import NamedTuple

import torch

from . import settings

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    # Triton's own switch, read where Triton reads it (not a FASTMOE_* setting).
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def block_ptr_available() -> bool:
    """Block pointers exist up to the Triton releases that still take ``boundary_check`` in
    ``tl.load`` (Intel's XPU builds keep them; upstream removed them in favour of descriptors)."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    return "boundary_check" in inspect.signature(tl.load).parameters


def accelerator_type() -> str:
    """The best accelerator PyTorch can see: ``"xpu"``, ``"cuda"`` or ``"cpu"``."""
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_device() -> torch.device:
    return torch.device(accelerator_type())


class KernelChoice(NamedTuple):
    """What runs stages 2-5 for tensors on one device."""

    backend: str
    """``"torch"`` or ``"triton"``."""
    config_table: str
    """The Triton config table: ``"cuda"``, ``"hip"``, ``"xpu"`` or ``"interpreter"``."""
    block_ptr: bool
    """Whether the Triton launchers pass ``BLOCK_PTR=True`` (always False for the torch backend)."""


def _device_table(device: torch.device) -> str:
    if device.type == "xpu":
        return "xpu"
    if device.type == "cuda":
        return "hip" if getattr(torch.version, "hip", None) else "cuda"
    return "interpreter"


def choose_kernels(
    device: torch.device | str, backend: str = "auto", *, config_table: str | None = None
) -> KernelChoice:
    """The one place that decides which kernels run on ``device``.

    ``backend="auto"``: ``settings.backend`` if set, else Triton on xpu/cuda (when triton is
    installed), else torch. The config table: ``config_table`` if given, else
    ``settings.triton_configs``, else the device's. Block pointers: ``settings.triton_block_ptr`` if
    set, else on for the xpu table only; never where this Triton has none. Nothing is validated
    here beyond the names (see :func:`resolve_backend`), so launchers can call it on every launch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cfg = settings.get()
    dev = torch.device(device)
    if backend == "auto":
        backend = cfg.backend or ("triton" if dev.type in ("xpu", "cuda") and triton_available() else "torch")
    table = config_table or cfg.triton_configs or _device_table(dev)
    if table not in settings.CONFIG_TABLES:
        raise ValueError(f"unknown Triton config table {table!r} (expected one of {settings.CONFIG_TABLES})")
    block_ptr = False
    if backend == "triton":
        wanted = cfg.triton_block_ptr if cfg.triton_block_ptr is not None else table == "xpu"
        block_ptr = wanted and block_ptr_available()
    return KernelChoice(backend, table, block_ptr)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn ``"auto"`` into ``"torch"`` or ``"triton"`` for tensors on ``device`` (by
    :func:`choose_kernels`) and check that the choice can run here."""
    backend = choose_kernels(device, backend).backend
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the 'triton' package (pip install triton)")
        if torch.device(device).type == "cpu" and not triton_interpreting():
            raise RuntimeError(
                "backend='triton' on CPU tensors runs only under the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing triton, or use backend='torch'"
            )
    return backend


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

"""Every ``FASTMOE_*`` environment switch, read once into one typed, frozen object.

Code asks :func:`get` instead of ``os.environ``, so a switch is parsed and validated in one place and
a bad value fails at import with a message naming the variable. docs/guide.md's "Environment
switches" table lists the same fields. Tests that change the environment re-read it with
:func:`reloaded` (restored on exit); :func:`override` replaces fields without touching the
environment (``kernels.configs.use`` is built on it).

``FASTMOE_TRITON33`` (a directory holding Triton 3.3, for one optional test) is a test switch read
by ``tests/test_triton_kernels.py`` alone; it is not part of the package's behaviour.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

#: Kernel backends ``FASTMOE_BACKEND`` may force.
KERNEL_BACKENDS = ("torch", "triton")
#: Triton config tables ``FASTMOE_TRITON_CONFIGS`` may force (see ``kernels/configs.py``).
CONFIG_TABLES = ("cuda", "sm100", "hip", "xpu", "interpreter")

#: How ``FASTMOE_INT8_WEIGHT_GRADS`` may have the int8 weight-gradient GEMMs multiply.
INT8_WEIGHT_GRADS = ("int8", "bf16")

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Settings:
    """The package's environment switches; ``None`` means "not set: decide from the device"."""

    backend: str | None = None
    """``FASTMOE_BACKEND`` (``torch`` | ``triton``): the kernel backend of blocks built with
    ``backend="auto"``; unset: Triton on xpu/cuda, torch on the CPU."""

    triton_configs: str | None = None
    """``FASTMOE_TRITON_CONFIGS`` (``cuda`` | ``sm100`` | ``hip`` | ``xpu`` | ``interpreter``): the Triton
    config table (tiles, warps, stages) every launcher uses; unset: the one of the tensors' device
    (``sm100`` on NVIDIA GPUs of compute capability 10.x, B200/GB200; ``cuda`` on other NVIDIA GPUs)."""

    triton_block_ptr: bool | None = None
    """``FASTMOE_TRITON_BLOCK_PTR`` (``0`` | ``1``): load ``tl.dot`` operands through block pointers;
    unset: on for xpu only. Has no effect on a Triton without block pointers."""

    cpu_cache: bool = True
    """``FASTMOE_CPU_CACHE`` (``0`` | ``1``, default 1): keep the torch backend's big CPU buffers mapped
    between calls (see ``kernels/torch/buffers.py``)."""

    cpu_cache_idle_mb: float = 4096.0
    """``FASTMOE_CPU_CACHE_IDLE_MB`` (default 4096): the most MiB of idle buffers that cache keeps;
    ``fastmoe_xpu.release_buffers()`` frees all of them."""

    cpu_csr: bool = True
    """``FASTMOE_CPU_CSR`` (``0`` | ``1``, default 1): fp32/fp64 weighted row sums on the CPU as one
    sparse-CSR product (needs MKL); 0 keeps every dtype on ``embedding_bag``."""

    cpu_piece_mb: int = 4
    """``FASTMOE_CPU_PIECE_MB`` (default 4): MiB of the widest operand of one piece of the torch
    backend's gather and elementwise passes (sized to stay in the last-level cache)."""

    dist_backend: str | None = None
    """``FASTMOE_DIST_BACKEND`` (e.g. ``gloo``, ``nccl``, ``xccl``, ``ccl``): the torch.distributed
    backend; unset: chosen from the device (``fastmoe_xpu.dist.env.choose_backend``)."""

    data_cache: str | None = None
    """``FASTMOE_DATA_CACHE``: where the trainer preprocesses its embedded corpus; unset:
    ``~/.cache/fastmoe_xpu/data``."""

    gemm_engine: str | None = None
    """``FASTMOE_GEMM_ENGINE`` (``auto`` | ``native`` | ``triton`` | ``grouped_mm`` | ``loop``): the
    stage-4 engine of blocks built with ``gemm_engine="auto"``; unset or ``auto``: the fastest,
    timed once per device, dtype and shape bucket (``kernels/registry.py``)."""

    gemm_cache: str | None = None
    """``FASTMOE_GEMM_CACHE``: the JSON file that remembers the timed engine choices; unset:
    ``$XDG_CACHE_HOME/fastmoe_xpu/gemm_engines.json`` (``~/.cache/...``)."""

    expert_precision: str | None = None
    """``FASTMOE_EXPERT_PRECISION`` (``int8`` | ``fp8``): quantized expert GEMMs for the transformers
    ``"fastmoe"`` experts function when neither the module nor its config names a precision; unset:
    full precision (docs/precision.md)."""

    kept_configs: bool = True
    """``FASTMOE_KEPT_CONFIGS`` (``0`` | ``1``, default 1): take the grouped GEMMs' Triton configs from
    the package's kept table for this device (``kernels/tuned/``, written by ``python -m
    fastmoe_xpu.tools.config_sweep``) before timing them; 0 times every new key in the process."""

    int8_weight_grads: str | None = None
    """``FASTMOE_INT8_WEIGHT_GRADS`` (``int8`` | ``bf16``): how the int8 precision's weight-gradient GEMMs
    multiply on the torch base on the CPU: quantized to int8 (``torch._int_mm``) or in bf16 (``torch.mm``
    on oneDNN); unset: bf16 where the CPU has AMX-BF16 (there bf16 ran these short-contraction GEMMs
    2-3x faster than int8, quantization and dequantization included), int8 elsewhere (docs/precision.md)."""


#: Field name -> environment variable.
ENV_NAMES: Mapping[str, str] = {
    "backend": "FASTMOE_BACKEND",
    "triton_configs": "FASTMOE_TRITON_CONFIGS",
    "triton_block_ptr": "FASTMOE_TRITON_BLOCK_PTR",
    "cpu_cache": "FASTMOE_CPU_CACHE",
    "cpu_cache_idle_mb": "FASTMOE_CPU_CACHE_IDLE_MB",
    "cpu_csr": "FASTMOE_CPU_CSR",
    "cpu_piece_mb": "FASTMOE_CPU_PIECE_MB",
    "dist_backend": "FASTMOE_DIST_BACKEND",
    "data_cache": "FASTMOE_DATA_CACHE",
    "gemm_engine": "FASTMOE_GEMM_ENGINE",
    "gemm_cache": "FASTMOE_GEMM_CACHE",
    "expert_precision": "FASTMOE_EXPERT_PRECISION",
    "kept_configs": "FASTMOE_KEPT_CONFIGS",
    "int8_weight_grads": "FASTMOE_INT8_WEIGHT_GRADS",
}


def _raw(environ: Mapping[str, str], field: str) -> str:
    return environ.get(ENV_NAMES[field], "").strip()


#: The stage-4 engine names, declared by the implementation registry (``kernels/registry.py``, which
#: owns them) when it is imported; ``FASTMOE_GEMM_ENGINE`` may name one of them, ``auto`` or ``native``.
_GEMM_ENGINES: tuple[str, ...] = ()


def declare_gemm_engines(names: tuple[str, ...]) -> None:
    """Called by the registry with its stage-4 implementations."""
    global _GEMM_ENGINES
    _GEMM_ENGINES = tuple(names)


def gemm_engines() -> tuple[str, ...]:
    """The stage-4 engine names the registry declared (empty before it is imported)."""
    return _GEMM_ENGINES


def _gemm_choices() -> tuple[str, ...] | None:
    """What ``FASTMOE_GEMM_ENGINE`` may name; None before the registry has declared its engines (the
    registry checks the value again where it uses it)."""
    return ("auto", "native", *_GEMM_ENGINES) if _GEMM_ENGINES else None


#: The expert-GEMM precisions, declared by the registry like the engines.
_EXPERT_PRECISIONS: tuple[str, ...] = ()


def declare_expert_precisions(names: tuple[str, ...]) -> None:
    """Called by the registry with the precisions of its quantized stage-4 implementations."""
    global _EXPERT_PRECISIONS
    _EXPERT_PRECISIONS = tuple(names)


def _precision_choices() -> tuple[str, ...] | None:
    """What ``FASTMOE_EXPERT_PRECISION`` may name; None before the registry has declared them (the
    experts op checks the value again where it uses it)."""
    return _EXPERT_PRECISIONS or None


def _choice(environ: Mapping[str, str], field: str,
            allowed: tuple[str, ...] | Callable[[], tuple[str, ...] | None]) -> str | None:
    value = _raw(environ, field).lower()
    if not value:
        return None
    if callable(allowed):
        allowed = allowed()
    if allowed is not None and value not in allowed:
        raise ValueError(f"{ENV_NAMES[field]} must be one of {allowed}, got {value!r}")
    return value


def _flag(environ: Mapping[str, str], field: str) -> bool | None:
    value = _raw(environ, field).lower()
    if not value:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_NAMES[field]} must be 0 or 1 (or true/false, on/off), got {value!r}")


def _number(environ: Mapping[str, str], field: str, kind: type, default: float) -> float:
    value = _raw(environ, field)
    if not value:
        return default
    try:
        number = kind(float(value)) if kind is float else kind(value)
    except ValueError:
        raise ValueError(f"{ENV_NAMES[field]} must be a {kind.__name__} number of MiB, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{ENV_NAMES[field]} must be >= 0, got {value!r}")
    return number


def read(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the switches from ``environ`` (default: ``os.environ``); raises ValueError on a bad value."""
    env = os.environ if environ is None else environ
    defaults = Settings()
    cpu_cache = _flag(env, "cpu_cache")
    cpu_csr = _flag(env, "cpu_csr")
    kept_configs = _flag(env, "kept_configs")
    return Settings(
        backend=_choice(env, "backend", KERNEL_BACKENDS),
        triton_configs=_choice(env, "triton_configs", CONFIG_TABLES),
        triton_block_ptr=_flag(env, "triton_block_ptr"),
        cpu_cache=defaults.cpu_cache if cpu_cache is None else cpu_cache,
        cpu_cache_idle_mb=_number(env, "cpu_cache_idle_mb", float, defaults.cpu_cache_idle_mb),
        cpu_csr=defaults.cpu_csr if cpu_csr is None else cpu_csr,
        cpu_piece_mb=int(_number(env, "cpu_piece_mb", int, defaults.cpu_piece_mb)),
        dist_backend=_raw(env, "dist_backend").lower() or None,
        data_cache=_raw(env, "data_cache") or None,
        gemm_engine=_choice(env, "gemm_engine", _gemm_choices),
        gemm_cache=_raw(env, "gemm_cache") or None,
        expert_precision=_choice(env, "expert_precision", _precision_choices),
        kept_configs=defaults.kept_configs if kept_configs is None else kept_configs,
        int8_weight_grads=_choice(env, "int8_weight_grads", INT8_WEIGHT_GRADS),
    )


_current: Settings | None = None


def get() -> Settings:
    """The switches in force (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = read()
    return _current


def reload() -> Settings:
    """Read the environment again and make the result the switches in force."""
    global _current
    _current = read()
    return _current


@contextlib.contextmanager
def _replaced(new: Settings) -> Iterator[Settings]:
    global _current
    previous, _current = _current, new
    try:
        yield new
    finally:
        _current = previous


def reloaded() -> contextlib.AbstractContextManager[Settings]:
    """Within the block, the switches as the environment now says (for tests that set variables);
    the previous switches come back on exit."""
    return _replaced(read())


def override(**changes: object) -> contextlib.AbstractContextManager[Settings]:
    """Within the block, the switches in force with ``changes`` applied (field names of :class:`Settings`)."""
    unknown = set(changes) - set(ENV_NAMES)
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(ENV_NAMES)}")
    return _replaced(dataclasses.replace(get(), **changes))

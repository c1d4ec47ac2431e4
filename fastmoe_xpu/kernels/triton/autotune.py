"""Measured Triton configs for the grouped GEMMs: a keyed choice over ``configs.py``'s lists.

``@triton.autotune`` would re-time on every new value of its key arguments and cannot see the rows
per expert without a host read; this keeps the same idea with a key the launchers know on the host:
``(kernel, config table, dtype, N, K, rows-per-expert bucket)``, where the bucket is the allocated
rows per local expert rounded up to a power of two (R / NR: no device value is read). The first
launch with a new key takes, in order:

1. the package's kept table for this device (:mod:`..kept_configs`, filled by ``python -m
   fastmoe_xpu.tools.config_sweep``), when it names this device exactly and its config is still in
   the kernel's list (``FASTMOE_KEPT_CONFIGS=0`` skips it);
2. else the fastest of the kernel's list (:func:`fastmoe_xpu.kernels.configs.configs`, the same lists
   the sm_90 / gfx942 / PVC compile gates build, so no config runs here untested), timed once; a
   config that fails to launch (out of shared memory on a smaller GPU) is skipped, and every
   candidate's seconds are kept (:func:`timings`, what the sweep writes to the kept table).

Either is remembered for the process. Only on GPUs: under the interpreter (``TRITON_INTERPRET=1``, CPU
tensors) and for the ``interpreter`` table, the list's first config is used as before, since timing an
interpreter says nothing about a GPU.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import kept_configs
from ..configs import KernelConfig, configs
from ..kept_configs import Key, dtype_name
from ..timing import best_seconds, pow2_bucket

#: (kernel, config table, dtype, N, K, rows bucket) -> the config chosen for it.
_CHOSEN: dict[Key, KernelConfig] = {}
#: The keys whose configs were timed in this process -> each candidate's seconds by config id (None:
#: it did not launch).
_TIMED: dict[Key, dict[str, float | None]] = {}


def rows_per_expert_bucket(rows: int, num_experts: int) -> int:
    """Allocated rows per local expert rounded up to a power of two (at least 1)."""
    return pow2_bucket(-(-max(0, int(rows)) // max(1, int(num_experts))))


def enabled(table: str, device: torch.device) -> bool:
    """Whether configs are timed: a GPU device and a GPU config table."""
    return device.type in ("cuda", "xpu") and table != "interpreter"


def wall_timer(device: torch.device, repeats: int = 5) -> Callable[[Callable[[], None]], float]:
    """Best-of-``repeats`` seconds of a launch after one warm-up (which compiles), synchronised."""
    return lambda run: best_seconds(run, device, repeats)


def select(
    candidates: Sequence[KernelConfig],
    launch: Callable[[KernelConfig], None],
    timer: Callable[[Callable[[], None]], float],
    measured: dict[str, float | None] | None = None,
) -> KernelConfig:
    """The candidate whose ``launch`` the ``timer`` finds fastest (the earliest on ties); candidates
    that raise are skipped; RuntimeError when none launches. ``measured`` (when given) receives each
    candidate's seconds by :func:`~fastmoe_xpu.kernels.kept_configs.config_id`, None for one that raised."""
    best, best_s, errors = None, float("inf"), []
    for cfg in candidates:
        try:
            seconds = timer(lambda cfg=cfg: launch(cfg))
        except Exception as exc:  # e.g. out of shared memory / registers on this GPU: try the next config
            errors.append(f"{cfg.name}: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}")
            if measured is not None:
                measured[kept_configs.config_id(cfg)] = None
            continue
        if measured is not None:
            measured[kept_configs.config_id(cfg)] = float(seconds)
        if seconds < best_s:
            best, best_s = cfg, seconds
    if best is None:
        raise RuntimeError("no Triton config launched: " + "; ".join(errors))
    return best


def choose(
    kernel: str,
    table: str,
    n: int,
    k: int,
    rows: int,
    num_experts: int,
    device: torch.device,
    launch: Callable[[KernelConfig], None],
    timer: Callable[[Callable[[], None]], float] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> KernelConfig:
    """The config of ``kernel`` for this key (``dtype``: the operands'); on a GPU at a new key the
    kept table's, else the list timed (``launch`` runs the kernel with a config: the launchers'
    outputs are plain writes, so the timing runs only overwrite them); the list's first elsewhere."""
    candidates = configs(table, kernel)
    if len(candidates) == 1 or not enabled(table, device):
        return candidates[0]
    key = (kernel, table, dtype_name(dtype), int(n), int(k), rows_per_expert_bucket(rows, num_experts))
    cfg = _CHOSEN.get(key)
    if cfg is None:
        cfg = kept_configs.lookup(key, candidates, device)
        if cfg is None:
            measured: dict[str, float | None] = {}
            cfg = select(candidates, launch, timer or wall_timer(device), measured)
            _TIMED[key] = measured
        _CHOSEN[key] = cfg
    return cfg


def chosen() -> dict[Key, str]:
    """The configs chosen so far in this process, by key (for logs and the GPU check's report)."""
    return {key: cfg.name for key, cfg in _CHOSEN.items()}


def timings() -> dict[Key, tuple[str, dict[str, float | None]]]:
    """The keys timed in this process: (the chosen config's id, each candidate's seconds by id)."""
    return {key: (kept_configs.config_id(_CHOSEN[key]), dict(seconds))
            for key, seconds in _TIMED.items() if key in _CHOSEN}


def forget() -> None:
    """Drop this process's choices and timings (the next launch of every key looks it up again)."""
    _CHOSEN.clear()
    _TIMED.clear()

"""Measured Triton configs for the grouped GEMMs: a keyed cache over ``configs.py``'s lists.

``@triton.autotune`` would re-time on every new value of its key arguments and cannot see the rows
per expert without a host read; this keeps the same idea with a key the launchers know on the host:
``(kernel, config table, N, K, rows-per-expert bucket)``, where the bucket is the allocated rows
per local expert rounded up to a power of two (R / NR: no device value is read). The first launch
with a new key times every config of the kernel's list (:func:`fastmoe_xpu.kernels.configs.configs`,
the same lists the sm_90 / gfx942 / PVC compile gates build, so no config runs here untested) and
keeps the fastest for the process; a config that fails to launch (out of shared memory on a
smaller GPU) is skipped.

Only on GPUs: under the interpreter (``TRITON_INTERPRET=1``, CPU tensors) and for the
``interpreter`` table, the list's first config is used as before, since timing an interpreter
says nothing about a GPU.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..configs import KernelConfig, configs
from ..timing import best_seconds, pow2_bucket

#: (kernel, config table, N, K, rows bucket) -> the config chosen for it.
_CHOSEN: dict[tuple[str, str, int, int, int], KernelConfig] = {}


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
) -> KernelConfig:
    """The candidate whose ``launch`` the ``timer`` finds fastest (the earliest on ties); candidates
    that raise are skipped; RuntimeError when none launches."""
    best, best_s, errors = None, float("inf"), []
    for cfg in candidates:
        try:
            seconds = timer(lambda cfg=cfg: launch(cfg))
        except Exception as exc:  # e.g. out of shared memory / registers on this GPU: try the next config
            errors.append(f"{cfg.name}: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}")
            continue
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
) -> KernelConfig:
    """The config of ``kernel`` for this key; times the list on a GPU at a new key (``launch`` runs
    the kernel with a config: the launchers' outputs are plain writes, so the timing runs only
    overwrite them), the list's first config elsewhere."""
    candidates = configs(table, kernel)
    if len(candidates) == 1 or not enabled(table, device):
        return candidates[0]
    key = (kernel, table, int(n), int(k), rows_per_expert_bucket(rows, num_experts))
    cfg = _CHOSEN.get(key)
    if cfg is None:
        cfg = select(candidates, launch, timer or wall_timer(device))
        _CHOSEN[key] = cfg
    return cfg


def chosen() -> dict[tuple[str, str, int, int, int], str]:
    """The configs chosen so far in this process, by key (for logs and the GPU check's report)."""
    return {key: cfg.name for key, cfg in _CHOSEN.items()}

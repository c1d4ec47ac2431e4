"""The one place every Triton launcher goes through to start a kernel (tests count launches here)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..configs import KernelConfig
from . import autotune


def _check_runnable(kernel: Any, device: torch.device) -> None:
    """CPU tensors need the interpreter, and ``@triton.jit`` decides between interpreter and
    compiler when a module is imported: Triton's own library functions (``tl.sum``, ``tl.cdiv``...)
    are fixed the moment ``triton`` is first imported. The first interpreted launch of a process
    also makes sure the interpreter runs our kernels with this numpy (:mod:`.interpreter_compat`)."""
    if device.type != "cpu":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels on CPU tensors run under the interpreter, but triton was imported before "
            "TRITON_INTERPRET=1 was set: export TRITON_INTERPRET=1 before Python starts (or before the "
            "first 'import triton'), or use backend='torch'"
        )
    from .interpreter_compat import ensure_scalar_index

    ensure_scalar_index()  # once per process: triton 3.6's interpreter against numpy >= 2.4


def launch(
    kernel: Any,
    grid: Sequence[int],
    args: Sequence[Any],
    config: KernelConfig,
    device: torch.device,
    **constexprs: Any,
) -> None:
    """``kernel[grid](*args, **config.meta, **constexprs)`` with the config's warps, stages and
    backend options (``constexprs`` win over the config's tile sizes). Pure host work: nothing here
    reads device memory."""
    _check_runnable(kernel, device)
    kernel[tuple(grid)](
        *args,
        **{**config.meta, **constexprs},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **config.extra_options,
    )


def timed_launch(
    kernel: Any,
    key: str,
    table: str,
    shape: tuple[int, int, int, int],
    grid: Callable[[dict[str, Any]], Sequence[int]],
    args: Sequence[Any] | Callable[[dict[str, Any]], Sequence[Any]],
    device: torch.device,
    *,
    dtype: torch.dtype,
    **constexprs: Any,
) -> None:
    """The launch preamble of the grouped GEMMs: :func:`launch` with the config of ``key`` that
    :func:`.autotune.choose` picks for ``shape`` (``(N, K, rows, NR)``) and ``dtype`` (the
    operands': bf16, fp16 and fp32 can prefer different tiles), its key, on ``table``, over
    ``grid(meta)`` of the config's tile sizes; ``args`` a sequence, or ``args(meta)`` where the
    arguments depend on the tile sizes (tensor descriptors)."""
    def go(cfg: KernelConfig) -> None:
        launch(kernel, grid(cfg.meta), args(cfg.meta) if callable(args) else args, cfg, device, **constexprs)

    go(autotune.choose(key, table, *shape, device, go, dtype=dtype))

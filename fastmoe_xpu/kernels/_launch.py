"""The one place every Triton launcher goes through to start a kernel.

On CPU tensors a kernel runs under Triton's interpreter. ``@triton.jit`` picks interpreter or
compiler when the kernel module is imported, so a module imported before ``TRITON_INTERPRET=1``
was set holds compiled-mode kernels; those are re-wrapped for the interpreter here, so that the
order of imports in a test session does not matter.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .configs import KernelConfig

_interpreted: dict[int, Any] = {}


def _for_device(kernel: Any, device: torch.device) -> Any:
    if device.type != "cpu":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    key = id(kernel)
    if key not in _interpreted:
        _interpreted[key] = InterpretedFunction(kernel.fn)
    return _interpreted[key]


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
    _for_device(kernel, device)[tuple(grid)](
        *args,
        **{**config.meta, **constexprs},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **config.extra_options,
    )

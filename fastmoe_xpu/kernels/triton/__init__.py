"""The Triton backend of stages 2-5: xpu and cuda devices (and the CPU under ``TRITON_INTERPRET=1``).

Implements :class:`fastmoe_xpu.kernels.contract.KernelBackend`, one file per stage
(``counting``, ``indices``, ``grouped_gemm``, ``combine``: the ``@triton.jit`` kernels and their
launchers); every launch goes through :func:`launch.launch`. Nothing here reads a device value on
the host, so row buffers are allocated for the worst case (R = T*K rows) and rows past RT =
``cum_token_counts[-1]`` are unspecified. Grids are upper bounds; programs with nothing to do exit
at once.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, R rows allocated.
"""
from __future__ import annotations

from ..contract import LAUNCHERS
from .combine import combine_bwd, combine_fwd, router_weights_bwd
from .counting import count_tokens
from .grouped_gemm import (down_bwd, down_fwd, down_fwd_lora, down_silu_bwd, down_weighted_bwd, gate_up_bwd, gate_up_fwd,
                           silu_mul_bwd)
from .indices import build_indices

NAME = "triton"

#: The fused launchers this backend has (``contract.FUSED_LAUNCHERS``; ``gate_up_down_fwd`` is fp8's).
FUSED = ("down_fwd_lora", "down_silu_bwd")

__all__ = ["NAME", *LAUNCHERS, *FUSED]

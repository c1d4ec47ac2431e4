"""The torch backend of stages 2-5: plain PyTorch, the CPU's kernel backend (fast there, not a toy).

Implements :class:`fastmoe_xpu.kernels.contract.KernelBackend`, one file per stage (``counting``,
``indices``, ``grouped_gemm``, ``combine``) plus ``buffers`` (the bounded CPU buffer pool). The CPU
pays nothing for a device-to-host read, so this backend sizes its outputs exactly (RT routed rows)
where the Triton backend allocates the worst case (T*K rows) and leaves rows past RT unspecified.

Written for the CPU's memory system: each pass over routed rows happens once, a piece of rows at a
time while it is in cache (gather + GEMM + SiLU*up together, the elementwise backward in pieces,
the reductions as one sparse-CSR product or ``embedding_bag``); big buffers come from a pool that
keeps them mapped between training steps (:mod:`.buffers`); weight gradients are never zero-filled.
"""
from __future__ import annotations

from ..contract import LAUNCHERS
from .buffers import release_buffers
from .combine import combine_bwd, combine_fwd, router_weights_bwd
from .counting import count_tokens
from .grouped_gemm import down_bwd, down_fwd, down_weighted_bwd, gate_up_bwd, gate_up_fwd, silu_mul_bwd
from .indices import build_indices

NAME = "torch"

__all__ = ["NAME", *LAUNCHERS, "release_buffers"]

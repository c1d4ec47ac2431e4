"""Stages 2-5 of the MoE layer on this rank's experts: the one entry point every caller uses.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops as moe_ops
from ..device import resolve_backend
from ..kernels import get_ops
from ..kernels.contract import TOKEN_BLOCK_SIZE
from ..kernels.engines import choose_engine, lazy_timer, with_engine
from .fused import DownCombineFunction, GateUpFunction

__all__ = ["TOKEN_BLOCK_SIZE", "kernel_backend", "moe_experts_forward"]


def moe_experts_forward(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
    *,
    backend: str = "torch",
    expert_start: int = 0,
    block_size: int = TOKEN_BLOCK_SIZE,
    gemm_engine: str = "native",
    ep_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Stages 2-5 on this rank's experts ``[expert_start, expert_start + NR)``; returns ``[T, H]``
    (partial sums when other ranks hold other experts). ``gemm_engine``: who runs stage 4
    (``kernels/engines.py``; ``"auto"`` times the candidates here on first use, agreed across
    ``ep_group``).

    Under ``torch.compile`` / ``torch.export`` it runs through the ``fastmoe`` custom ops
    (:mod:`fastmoe_xpu.ops`: no host read, no data-dependent shape in the graph), whose stage 4 is
    the backend's own engine (a timed choice cannot be taken inside a graph); eager, through
    the autograd Functions, which share the ops' forward and backward code but skip the custom-op
    dispatch (about 0.1-0.2 ms a call on the CPU, 6% of a mid-size layer's F+B)."""
    if torch.compiler.is_compiling():
        return moe_ops.moe_experts(
            x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI,
            backend=backend, expert_start=expert_start, block_size=block_size,
        )
    ops = get_ops(backend)
    num_local = w_gate_up_N2IH.shape[0]
    with torch.no_grad():
        counts = ops.count_tokens(topk_idx_TK, expert_start, num_local, block_size)
        rows = ops.build_indices(
            topk_idx_TK, counts.partial_cum_token_counts, counts.cum_expert_counts, expert_start, num_local, block_size
        )
        engine = choose_engine(
            gemm_engine, backend=backend, device=x_TH.device, dtype=x_TH.dtype,
            shape=(w_gate_up_N2IH.shape[2], w_down_NHI.shape[2], num_local, topk_idx_TK.numel()),
            measure=lazy_timer(ops, x_TH, rows.input_indices, counts.cum_token_counts, w_gate_up_N2IH, w_down_NHI),
            group=ep_group,
        )
        ops = with_engine(ops, engine)
    # h leaves GateUpFunction as a non-differentiable output: DownCombineFunction's backward
    # recomputes it from gate_up, so neither h nor the expert outputs are kept for backward.
    gate_up_R2I, h_RI = GateUpFunction.apply(
        x_TH, w_gate_up_N2IH, rows.input_indices, rows.output_indices, counts.cum_token_counts,
        counts.cum_expert_counts, ops,
    )
    return DownCombineFunction.apply(
        gate_up_R2I, h_RI, w_down_NHI, weights_TK, rows.output_indices, rows.selected_expert_indices,
        counts.cum_token_counts, counts.cum_expert_counts, ops,
    )


@torch.compiler.assume_constant_result
def _kernel_backend(backend: str, device_type: str, device_index: int) -> str:
    """:func:`resolve_backend` run outside any traced graph: the compiler calls it once while
    tracing and keeps its answer as a constant (it reads the settings and looks for triton, which
    tracing cannot do). A compiled graph therefore keeps the backend it was traced with; a change of
    ``FASTMOE_BACKEND`` after compiling needs a fresh ``torch.compile``."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    return resolve_backend(backend, device)


def kernel_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"``: the kernels stages 2-5 run on ``device`` for a block's ``backend``."""
    return _kernel_backend(backend, device.type, -1 if device.index is None else device.index)

"""Stage 4's first half as an autograd Function: the gathered gate/up GEMM and SiLU*up.

Legend: T tokens, H hidden, I intermediate, NR local experts, R routed rows.
"""
from __future__ import annotations

import torch

from ..kernels.contract import KernelBackend


def expert_mlp_backward(
    ops: KernelBackend, d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
    input_indices: torch.Tensor, output_indices: torch.Tensor, cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H])`` from the gate/up pre-activation's gradient.

    A plain function so that anything wrapping the stage (an autograd Function, a custom op's
    registered backward) runs the same math."""
    dx_rows_RH, dw_gate_up = ops.gate_up_bwd(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    # Each token's rows are summed back in slot order: deterministic, no atomics. Unweighted,
    # so the selected-expert indices are not read (output_indices stands in for them).
    dx_TH = ops.combine_fwd(dx_rows_RH, None, output_indices, output_indices, cum_expert_counts)
    return dx_TH, dw_gate_up


class ExpertMLPFunction(torch.autograd.Function):
    """``(gate_up [R, 2I], h [R, I])``: ``gate_up = x[rows] @ Wgu_e^T`` per local expert group and
    ``h = silu(gate) * up``.

    ``h`` is a non-differentiable output: :class:`~fastmoe_xpu.autograd.CombineFunction` consumes
    it in the forward and routes its gradient through ``gate_up`` (from which it recomputes ``h``),
    so ``h`` is never saved. Saves ``x`` and the routing metadata; the gathered input is never
    stored (backward gathers it again).
    """

    @staticmethod
    def forward(
        ctx,
        x_TH: torch.Tensor,
        w_gate_up_N2IH: torch.Tensor,
        input_indices: torch.Tensor,
        output_indices: torch.Tensor,
        cum_token_counts: torch.Tensor,
        cum_expert_counts: torch.Tensor,
        ops: KernelBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up_R2I, h_RI = ops.gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
        ctx.save_for_backward(x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts, cum_expert_counts)
        ctx.mark_non_differentiable(h_RI)
        ctx.ops = ops
        return gate_up_R2I, h_RI

    @staticmethod
    def backward(ctx, d_gate_up_R2I: torch.Tensor, _dh_RI: torch.Tensor | None):
        x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts, cum_expert_counts = ctx.saved_tensors
        dx_TH, dw_gate_up = expert_mlp_backward(
            ctx.ops, d_gate_up_R2I.contiguous(), x_TH, w_gate_up_N2IH, input_indices, output_indices,
            cum_token_counts, cum_expert_counts,
        )
        return (
            dx_TH,  # x_TH
            dw_gate_up,  # w_gate_up_N2IH
            None,  # input_indices
            None,  # output_indices
            None,  # cum_token_counts
            None,  # cum_expert_counts
            None,  # ops
        )

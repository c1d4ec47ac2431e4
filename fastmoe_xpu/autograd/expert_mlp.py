"""Stage 4 as an autograd Function: gathered gate/up GEMM, SiLU*up, down GEMM.

Forward and backward are the plain functions :func:`expert_mlp_forward` and
:func:`expert_mlp_backward`, shared with the ``fastmoe::expert_mlp`` custom op
(:mod:`fastmoe_xpu.ops`), so the eager Function and the compiled op compute alike.

Legend: T tokens, H hidden, I intermediate, NR local experts, R routed rows.
"""
from __future__ import annotations

import torch

from ..kernels.contract import KernelBackend


def expert_mlp_forward(
    ops: KernelBackend,
    x_TH: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y [R, H], gate_up [R, 2I], h [R, I])``: the output and the activations the backward reads."""
    gate_up_R2I, h_RI = ops.gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    y_RH = ops.down_fwd(h_RI, cum_token_counts, w_down_NHI)
    return y_RH, gate_up_R2I, h_RI


def expert_mlp_backward(
    ops: KernelBackend,
    dy_RH: torch.Tensor,
    x_TH: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
    input_indices: torch.Tensor,
    output_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor,
    gate_up_R2I: torch.Tensor,
    h_RI: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I])`` from the output gradient and the saved set."""
    dy_RH = dy_RH.contiguous()
    dh_RI, dw_down = ops.down_bwd(dy_RH, h_RI, cum_token_counts, w_down_NHI)
    d_gate_up_R2I = ops.silu_mul_bwd(gate_up_R2I, dh_RI, cum_token_counts)
    dx_rows_RH, dw_gate_up = ops.gate_up_bwd(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    # Each token's rows are summed back in slot order: deterministic, no atomics. Unweighted,
    # so the selected-expert indices are not read (output_indices stands in for them).
    dx_TH = ops.combine_fwd(dx_rows_RH, None, output_indices, output_indices, cum_expert_counts)
    return dx_TH, dw_gate_up, dw_down


class ExpertMLPFunction(torch.autograd.Function):
    """``y [R, H] = (silu(x[rows] @ Wg^T) * (x[rows] @ Wu^T)) @ Wd^T`` per local expert group.

    Saves ``x``, the gate/up output ``[R, 2I]`` and ``h [R, I]``; the gathered input is never
    stored (backward gathers it again), which keeps saved bytes under the per-expert-module block's.
    """

    @staticmethod
    def forward(
        ctx,
        x_TH: torch.Tensor,
        w_gate_up_N2IH: torch.Tensor,
        w_down_NHI: torch.Tensor,
        input_indices: torch.Tensor,
        output_indices: torch.Tensor,
        cum_token_counts: torch.Tensor,
        cum_expert_counts: torch.Tensor,
        ops: KernelBackend,
    ) -> torch.Tensor:
        y_RH, gate_up_R2I, h_RI = expert_mlp_forward(
            ops, x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, cum_token_counts
        )
        ctx.save_for_backward(
            x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, output_indices, cum_token_counts,
            cum_expert_counts, gate_up_R2I, h_RI,
        )
        ctx.ops = ops
        return y_RH

    @staticmethod
    def backward(ctx, dy_RH: torch.Tensor):
        dx_TH, dw_gate_up, dw_down = expert_mlp_backward(ctx.ops, dy_RH, *ctx.saved_tensors)
        return (
            dx_TH,  # x_TH
            dw_gate_up,  # w_gate_up_N2IH
            dw_down,  # w_down_NHI
            None,  # input_indices
            None,  # output_indices
            None,  # cum_token_counts
            None,  # cum_expert_counts
            None,  # ops
        )

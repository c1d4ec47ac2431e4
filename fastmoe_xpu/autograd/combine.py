"""Stage 5 as an autograd Function: the weighted reduction of expert rows back to tokens.

The backward is the plain function :func:`combine_backward`, shared with the ``fastmoe::combine``
custom op (:mod:`fastmoe_xpu.ops`), so the eager Function and the compiled op differentiate alike.

Legend: T tokens, H hidden, K experts per token, R routed rows.
"""
from __future__ import annotations

import torch

from ..kernels.contract import KernelBackend


def combine_backward(
    ops: KernelBackend,
    dout_TH: torch.Tensor,
    y_RH: torch.Tensor,
    weights_TK: torch.Tensor,
    output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy [R, H], dweights [T, K])`` from the output gradient and the tensors stage 5 saved."""
    return ops.combine_bwd(
        dout_TH.contiguous(), y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts
    )


class CombineFunction(torch.autograd.Function):
    """``out[t] = sum_i weights[t, sel[i]] * y[output_indices[i]]`` over token t's local slots."""

    @staticmethod
    def forward(
        ctx,
        y_RH: torch.Tensor,
        weights_TK: torch.Tensor,
        output_indices: torch.Tensor,
        selected_expert_indices: torch.Tensor,
        cum_expert_counts: torch.Tensor,
        ops: KernelBackend,
    ) -> torch.Tensor:
        out_TH = ops.combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
        ctx.save_for_backward(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
        ctx.ops = ops
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH: torch.Tensor):
        dy_RH, dweights_TK = combine_backward(ctx.ops, dout_TH, *ctx.saved_tensors)
        return (
            dy_RH,  # y_RH
            dweights_TK,  # weights_TK
            None,  # output_indices
            None,  # selected_expert_indices
            None,  # cum_expert_counts
            None,  # ops
        )

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
    """``(dy [R, H], dweights [T, K])`` of stage 5 alone, from the output gradient and the kept rows ``y``.

    ``combine_bwd`` gives each routed row its token's gradient unweighted and its weight; here the
    rows are weighted and the router-weight gradient is ``<dout_t, y_r>`` row by row (rows past RT
    hold unspecified values that ``router_weights_bwd`` never reads). ``dy`` has ``y``'s rows: where
    ``y`` is a worst-case buffer (the custom ops) and the backend sized its rows exactly, the rest
    are zero."""
    g_RH, row_weights_R = ops.combine_bwd(
        dout_TH.contiguous(), weights_TK, output_indices, selected_expert_indices, cum_expert_counts
    )
    R = g_RH.shape[0]
    d_row_weights_R = torch.linalg.vecdot(g_RH.float(), y_RH[:R].float())
    dy_RH = (g_RH.float() * row_weights_R[:, None]).to(y_RH.dtype)
    if R < y_RH.shape[0]:
        dy_RH = torch.cat([dy_RH, dy_RH.new_zeros(y_RH.shape[0] - R, y_RH.shape[1])])
    dweights_TK = ops.router_weights_bwd(d_row_weights_R, weights_TK, output_indices, selected_expert_indices,
                                         cum_expert_counts)
    return dy_RH, dweights_TK


class CombineFunction(torch.autograd.Function):
    """``out[t] = sum_i weights[t, sel[i]] * y[output_indices[i]]`` over token t's local slots.

    Stage 5 alone, for rows computed elsewhere (the transformers integration's unfused layouts):
    it keeps ``y`` for the router-weight gradient. The layer itself uses
    :class:`~fastmoe_xpu.autograd.fused.DownCombineFunction`, which does not."""

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


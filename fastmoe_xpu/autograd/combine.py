"""Stage 4's down GEMM and stage 5 as one autograd Function: ``out[t] = sum_k w[t, k] * y_r``,
``y = h @ Wd_e^T``, with a backward that needs neither ``y`` nor ``h``.

The router-weight gradient ``dweights[t, k] = <dout_t, y_r> = <dout_t @ Wd_e, h_r>`` falls out of
the down GEMM's backward, where ``dout_t @ Wd_e`` is formed anyway; ``h`` is recomputed there from
the gate/up pre-activation. So the saved set is the pre-activation, the router weights and the
routing metadata, as for a dense MLP of the same active size (docs/algorithm.md, "Saved tensors").

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, R routed rows.
"""
from __future__ import annotations

import torch

from ..kernels.contract import KernelBackend


def combine_backward(
    ops: KernelBackend, dout_TH: torch.Tensor, gate_up_R2I: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_gate_up [R, 2I], dw_down [NR, H, I], dweights [T, K])`` from the output gradient.

    A plain function so that anything wrapping the stage (an autograd Function, a custom op's
    registered backward) runs the same math."""
    # Stage 5 backward: each row gets its token's gradient, unweighted, and its weight.
    dy_RH, row_weights_R = ops.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                           cum_expert_counts)
    # The down GEMM's backward applies the weights and reduces dy @ Wd against the recomputed h.
    dh_RI, dw_down, d_row_weights_R = ops.down_bwd(dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI)
    dweights_TK = ops.router_weights_bwd(d_row_weights_R, weights_TK, output_indices, selected_expert_indices,
                                         cum_expert_counts)
    d_gate_up_R2I = ops.silu_mul_bwd(gate_up_R2I, dh_RI, cum_token_counts)
    return d_gate_up_R2I, dw_down, dweights_TK


class CombineFunction(torch.autograd.Function):
    """``out [T, H]``, ``out[t] = sum over t's local slots i of weights[t, sel[i]] * (h @ Wd_e^T)[row_i]``.

    Inputs: the gate/up pre-activation ``gate_up [R, 2I]`` (differentiable) and ``h [R, I]``, its
    SiLU*up, which :class:`~fastmoe_xpu.autograd.ExpertMLPFunction` computed in the same kernel;
    ``h`` gets no gradient of its own: its gradient is returned through ``gate_up``. Saves
    ``gate_up``, ``down_proj``, the router weights and the metadata; ``y [R, H]`` and ``h`` are freed
    after the forward.
    """

    @staticmethod
    def forward(
        ctx,
        gate_up_R2I: torch.Tensor,
        h_RI: torch.Tensor,
        w_down_NHI: torch.Tensor,
        weights_TK: torch.Tensor,
        output_indices: torch.Tensor,
        selected_expert_indices: torch.Tensor,
        cum_token_counts: torch.Tensor,
        cum_expert_counts: torch.Tensor,
        ops: KernelBackend,
    ) -> torch.Tensor:
        y_RH = ops.down_fwd(h_RI, cum_token_counts, w_down_NHI)
        out_TH = ops.combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
        ctx.save_for_backward(
            gate_up_R2I, w_down_NHI, weights_TK, output_indices, selected_expert_indices, cum_token_counts,
            cum_expert_counts,
        )
        ctx.ops = ops
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH: torch.Tensor):
        (gate_up_R2I, w_down_NHI, weights_TK, output_indices, selected_expert_indices, cum_token_counts,
         cum_expert_counts) = ctx.saved_tensors
        d_gate_up_R2I, dw_down, dweights_TK = combine_backward(
            ctx.ops, dout_TH.contiguous(), gate_up_R2I, w_down_NHI, weights_TK, output_indices,
            selected_expert_indices, cum_token_counts, cum_expert_counts,
        )
        return (
            d_gate_up_R2I,  # gate_up_R2I
            None,  # h_RI: its gradient is in d_gate_up
            dw_down,  # w_down_NHI
            dweights_TK,  # weights_TK
            None,  # output_indices
            None,  # selected_expert_indices
            None,  # cum_token_counts
            None,  # cum_expert_counts
            None,  # ops
        )

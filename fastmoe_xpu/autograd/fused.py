"""Stage 4 and 5 as the layer trains them: a backward that keeps neither ``h`` nor the expert outputs.

:class:`GateUpFunction` is the gathered gate/up GEMM with SiLU*up; :class:`DownCombineFunction`
is the down GEMM and the weighted combine. The router-weight gradient
``dweights[t, k] = <dout_t, y_r> = <dout_t @ Wd_e, h_r>`` falls out of the down GEMM's backward,
where ``dout_t @ Wd_e`` is formed anyway, and ``h`` is recomputed there from the gate/up
pre-activation. So the saved set is ``x``, the pre-activation ``[R, 2I]``, the router weights and
the routing metadata, as for a dense MLP of the same active size (docs/algorithm.md, "Saved
tensors"). The backward math lives in plain functions (:func:`gate_up_backward`,
:func:`down_combine_backward`) so that anything wrapping the stages runs the same code.

(:class:`~fastmoe_xpu.autograd.ExpertMLPFunction` and :class:`~fastmoe_xpu.autograd.CombineFunction`
remain the stage-alone Functions, for callers whose rows come from elsewhere; they keep ``h``
and ``y``.)

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, R routed rows.
"""
from __future__ import annotations

import torch

from ..kernels.contract import KernelBackend


def gate_up_backward(
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


class GateUpFunction(torch.autograd.Function):
    """``(gate_up [R, 2I], h [R, I])``: ``gate_up = x[rows] @ Wgu_e^T`` per local expert group and
    ``h = silu(gate) * up``.

    ``h`` is a non-differentiable output: :class:`DownCombineFunction` consumes
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
        dx_TH, dw_gate_up = gate_up_backward(
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


def down_combine_backward(
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
    dh_RI, dw_down, d_row_weights_R = ops.down_weighted_bwd(dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI)
    dweights_TK = ops.router_weights_bwd(d_row_weights_R, weights_TK, output_indices, selected_expert_indices,
                                         cum_expert_counts)
    d_gate_up_R2I = ops.silu_mul_bwd(gate_up_R2I, dh_RI, cum_token_counts)
    if d_gate_up_R2I.shape[0] < gate_up_R2I.shape[0]:
        # An exact-rows engine (the loop) behind a worst-case-rows backend (Triton): autograd wants
        # gate_up's shape; the rows past RT are never read.
        pad = d_gate_up_R2I.new_zeros(gate_up_R2I.shape[0] - d_gate_up_R2I.shape[0], gate_up_R2I.shape[1])
        d_gate_up_R2I = torch.cat([d_gate_up_R2I, pad])
    return d_gate_up_R2I, dw_down, dweights_TK


class DownCombineFunction(torch.autograd.Function):
    """``out [T, H]``, ``out[t] = sum over t's local slots i of weights[t, sel[i]] * (h @ Wd_e^T)[row_i]``.

    Inputs: the gate/up pre-activation ``gate_up [R, 2I]`` (differentiable) and ``h [R, I]``, its
    SiLU*up, which :class:`GateUpFunction` computed in the same kernel;
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
        d_gate_up_R2I, dw_down, dweights_TK = down_combine_backward(
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

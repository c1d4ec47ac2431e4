"""Stages 2-5 as ``torch.library`` custom ops in the ``fastmoe`` namespace, for ``torch.compile``
and ``torch.export``.

Each op is opaque to the compiler: its real implementation picks the kernel backend by name
(``backend`` is a string argument, fixed when the graph is traced) and calls the launchers of
:mod:`fastmoe_xpu.kernels`, host reads included (the torch backend reads the expert bounds on the
host, which costs nothing on the CPU). The compiler sees only the fake implementations, whose
shapes never depend on data: routed-row buffers are sized for the worst case, R = T*K rows (what
the Triton backend allocates anyway); rows past the routed count RT are zero on the torch backend
and unspecified on Triton, and nothing reads them.

========================================  ==============================================================
``fastmoe::count_tokens``                 stage 2 (no gradient)
``fastmoe::build_indices``                stage 3 (no gradient), ``[T*K]`` index buffers
``fastmoe::expert_mlp``                   stage 4: ``(y [R, H], gate_up [R, 2I], h [R, I])``; the last
                                          two are the saved activations, returned so that autograd
                                          can save them (their gradients are ignored)
``fastmoe::expert_mlp_backward``          stage 4 backward: ``(dx, dw_gate_up, dw_down)``
``fastmoe::combine``                      stage 5: ``[T, H]``
``fastmoe::combine_backward``             stage 5 backward: ``(dy [R, H], dweights [T, K])``
``fastmoe::gate_up``                      stage 4, first GEMM: ``(gate_up [R, 2I], h [R, I])``; ``h``
                                          is not differentiable and not saved
``fastmoe::gate_up_backward``             its backward: ``(dx [T, H], dw_gate_up [NR, 2I, H])``
``fastmoe::down_combine``                 stage 4's down GEMM and stage 5: ``out [T, H]``
``fastmoe::down_combine_backward``        its backward: ``(d_gate_up [R, 2I], dw_down, dweights [T, K])``
========================================  ==============================================================

:func:`moe_experts` (what the block and the experts integration trace) runs ``gate_up`` and
``down_combine``, the ops of :class:`~fastmoe_xpu.autograd.GateUpFunction` and
:class:`~fastmoe_xpu.autograd.DownCombineFunction`: a compiled layer saves what an eager one saves
(the input, the pre-activation, the router weights and the routing metadata; never ``h`` or the
expert outputs). ``expert_mlp`` and ``combine`` remain as the stage-alone ops (they keep ``h`` and
``y``), so that programs exported before keep loading.

The backward ops call the same plain functions as the autograd Functions
(:func:`fastmoe_xpu.autograd.gate_up_backward`, :func:`fastmoe_xpu.autograd.down_combine_backward`,
:func:`fastmoe_xpu.autograd.expert_mlp_backward`, :func:`fastmoe_xpu.autograd.combine_backward`),
registered with ``register_autograd``; they are ops themselves so that AOTAutograd traces the
backward without entering the launchers. Double backward is not supported.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
R = T*K routed-row buffer, RT routed rows on this rank.
"""
from __future__ import annotations

import torch

from .autograd import (
    combine_backward, down_combine_backward, expert_mlp_backward, expert_mlp_forward, gate_up_backward,
)
from .kernels import get_ops
from .kernels.contract import INDEX_DTYPE, num_blocks

__all__ = [
    "OP_NAMES", "build_indices", "combine", "count_tokens", "down_combine", "expert_mlp", "gate_up", "moe_experts",
]

#: Every op this module registers, as ``torch.ops.fastmoe.<name>``.
OP_NAMES = (
    "count_tokens", "build_indices", "expert_mlp", "expert_mlp_backward", "combine", "combine_backward",
    "gate_up", "gate_up_backward", "down_combine", "down_combine_backward",
)


# ---------------------------------------------------------------- stage 2
@torch.library.custom_op("fastmoe::count_tokens", mutates_args=())
def count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(partial_token_counts [NR*TH], partial_cum_token_counts [NR*TH+1], expert_counts [T],
    cum_expert_counts [T+1], cum_token_counts [NR+1])``, see :class:`~fastmoe_xpu.kernels.contract.TokenCounts`."""
    return tuple(get_ops(backend).count_tokens(topk_idx_TK, expert_start, num_local, block_size))


@count_tokens.register_fake
def _(topk_idx_TK, expert_start, num_local, block_size, backend):
    T = topk_idx_TK.shape[0]
    TH = num_blocks(T, block_size)
    new = lambda n: topk_idx_TK.new_empty((n,), dtype=INDEX_DTYPE)  # noqa: E731
    return new(num_local * TH), new(num_local * TH + 1), new(T), new(T + 1), new(num_local + 1)


# ---------------------------------------------------------------- stage 3
def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` grown to ``rows`` entries with zeros (a valid index for every reader, never read)."""
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


@torch.library.custom_op("fastmoe::build_indices", mutates_args=())
def build_indices(
    topk_idx_TK: torch.Tensor, partial_cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
    expert_start: int, num_local: int, block_size: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_indices, output_indices, selected_expert_indices)``, ``[T*K]`` each (entries past RT
    unspecified), see :class:`~fastmoe_xpu.kernels.contract.RowIndices`."""
    rows = get_ops(backend).build_indices(
        topk_idx_TK, partial_cum_token_counts, cum_expert_counts, expert_start, num_local, block_size
    )
    R = topk_idx_TK.numel()
    # The torch backend sizes them exactly (RT); the op's shape is the worst case on every backend.
    return tuple(_pad_rows(t, R) for t in rows)


@build_indices.register_fake
def _(topk_idx_TK, partial_cum_token_counts, cum_expert_counts, expert_start, num_local, block_size, backend):
    R = topk_idx_TK.shape[0] * topk_idx_TK.shape[1]
    return tuple(topk_idx_TK.new_empty((R,), dtype=INDEX_DTYPE) for _ in range(3))


# ---------------------------------------------------------------- stage 4
@torch.library.custom_op("fastmoe::expert_mlp", mutates_args=())
def expert_mlp(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, input_indices: torch.Tensor,
    output_indices: torch.Tensor, cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y [R, H], gate_up [R, 2I], h [R, I])`` with R = ``input_indices``' length."""
    return expert_mlp_forward(get_ops(backend), x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, cum_token_counts)


@expert_mlp.register_fake
def _(x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, output_indices, cum_token_counts, cum_expert_counts, backend):
    R = input_indices.shape[0]
    two_i = w_gate_up_N2IH.shape[1]
    return (
        x_TH.new_empty((R, w_down_NHI.shape[1])), x_TH.new_empty((R, two_i)), x_TH.new_empty((R, two_i // 2)),
    )


@torch.library.custom_op("fastmoe::expert_mlp_backward", mutates_args=())
def expert_mlp_backward_op(
    dy_RH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    input_indices: torch.Tensor, output_indices: torch.Tensor, cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor, gate_up_R2I: torch.Tensor, h_RI: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I])``."""
    return expert_mlp_backward(
        get_ops(backend), dy_RH, x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, output_indices,
        cum_token_counts, cum_expert_counts, gate_up_R2I, h_RI,
    )


@expert_mlp_backward_op.register_fake
def _(dy_RH, x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, output_indices, cum_token_counts,
      cum_expert_counts, gate_up_R2I, h_RI, backend):
    return torch.empty_like(x_TH), torch.empty_like(w_gate_up_N2IH), torch.empty_like(w_down_NHI)


def _expert_mlp_setup(ctx, inputs, output) -> None:
    x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, output_indices, cum_token_counts, cum_expert_counts, backend = inputs
    _, gate_up_R2I, h_RI = output
    ctx.save_for_backward(
        x_TH, w_gate_up_N2IH, w_down_NHI, input_indices, output_indices, cum_token_counts, cum_expert_counts,
        gate_up_R2I, h_RI,
    )
    ctx.backend = backend


def _expert_mlp_backward(ctx, dy_RH, _d_gate_up, _d_h):
    # gate_up and h are saved activations, not results: nothing downstream differentiates them.
    dx_TH, dw_gate_up, dw_down = expert_mlp_backward_op(dy_RH.contiguous(), *ctx.saved_tensors, ctx.backend)
    return dx_TH, dw_gate_up, dw_down, None, None, None, None, None


expert_mlp.register_autograd(_expert_mlp_backward, setup_context=_expert_mlp_setup)


# ---------------------------------------------------------------- stage 5
@torch.library.custom_op("fastmoe::combine", mutates_args=())
def combine(
    y_RH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor, backend: str,
) -> torch.Tensor:
    """``out [T, H]``: each token's rows weighted by its routing weights and summed."""
    return get_ops(backend).combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)


@combine.register_fake
def _(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts, backend):
    return y_RH.new_empty((weights_TK.shape[0], y_RH.shape[1]))


@torch.library.custom_op("fastmoe::combine_backward", mutates_args=())
def combine_backward_op(
    dout_TH: torch.Tensor, y_RH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy [R, H], dweights [T, K])``."""
    return combine_backward(
        get_ops(backend), dout_TH, y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts
    )


@combine_backward_op.register_fake
def _(dout_TH, y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts, backend):
    return torch.empty_like(y_RH), torch.empty_like(weights_TK)


def _combine_setup(ctx, inputs, output) -> None:
    y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts, backend = inputs
    ctx.save_for_backward(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
    ctx.backend = backend


def _combine_backward(ctx, dout_TH):
    dy_RH, dweights_TK = combine_backward_op(dout_TH.contiguous(), *ctx.saved_tensors, ctx.backend)
    return dy_RH, dweights_TK, None, None, None, None


combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---------------------------------------------------------------- stages 4-5, nothing but gate_up saved
@torch.library.custom_op("fastmoe::gate_up", mutates_args=())
def gate_up(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, input_indices: torch.Tensor, output_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [R, 2I], h [R, I])`` with R = ``input_indices``' length (rows past RT zero on the
    torch backend, unspecified on Triton). ``output_indices`` and ``cum_expert_counts`` are taken
    so that the backward (the rows' sum into ``dx``) finds them among the saved inputs."""
    return tuple(get_ops(backend).gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH))


@gate_up.register_fake
def _(x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts, cum_expert_counts, backend):
    R, two_i = input_indices.shape[0], w_gate_up_N2IH.shape[1]
    return x_TH.new_empty((R, two_i)), x_TH.new_empty((R, two_i // 2))


@torch.library.custom_op("fastmoe::gate_up_backward", mutates_args=())
def gate_up_backward_op(
    d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, input_indices: torch.Tensor,
    output_indices: torch.Tensor, cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H])``."""
    return gate_up_backward(
        get_ops(backend), d_gate_up_R2I, x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts,
        cum_expert_counts,
    )


@gate_up_backward_op.register_fake
def _(d_gate_up_R2I, x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts, cum_expert_counts,
      backend):
    return torch.empty_like(x_TH), torch.empty_like(w_gate_up_N2IH)


def _gate_up_setup(ctx, inputs, output) -> None:
    x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts, cum_expert_counts, backend = inputs
    # h feeds down_combine, whose backward routes h's gradient through gate_up (h is recomputed
    # there): autograd must neither save h nor ask for its gradient.
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token_counts, cum_expert_counts)
    ctx.backend = backend


def _gate_up_backward(ctx, d_gate_up_R2I, _d_h):
    dx_TH, dw_gate_up = gate_up_backward_op(d_gate_up_R2I.contiguous(), *ctx.saved_tensors, ctx.backend)
    return dx_TH, dw_gate_up, None, None, None, None, None


gate_up.register_autograd(_gate_up_backward, setup_context=_gate_up_setup)


@torch.library.custom_op("fastmoe::down_combine", mutates_args=())
def down_combine(
    gate_up_R2I: torch.Tensor, h_RI: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    output_indices: torch.Tensor, selected_expert_indices: torch.Tensor, cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor, backend: str,
) -> torch.Tensor:
    """``out [T, H]``: the down GEMM of ``h`` and the weighted sum of each token's rows. ``gate_up``
    is not read here: it is the input the backward differentiates (and recomputes ``h`` from)."""
    launchers = get_ops(backend)
    y_RH = launchers.down_fwd(h_RI, cum_token_counts, w_down_NHI)
    return launchers.combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)


@down_combine.register_fake
def _(gate_up_R2I, h_RI, w_down_NHI, weights_TK, output_indices, selected_expert_indices, cum_token_counts,
      cum_expert_counts, backend):
    return h_RI.new_empty((weights_TK.shape[0], w_down_NHI.shape[1]))


@torch.library.custom_op("fastmoe::down_combine_backward", mutates_args=())
def down_combine_backward_op(
    dout_TH: torch.Tensor, gate_up_R2I: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    output_indices: torch.Tensor, selected_expert_indices: torch.Tensor, cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_gate_up [R, 2I], dw_down [NR, H, I], dweights [T, K])``; ``d_gate_up`` has ``gate_up``'s
    rows (those past RT are never read)."""
    return down_combine_backward(
        get_ops(backend), dout_TH, gate_up_R2I, w_down_NHI, weights_TK, output_indices, selected_expert_indices,
        cum_token_counts, cum_expert_counts,
    )


@down_combine_backward_op.register_fake
def _(dout_TH, gate_up_R2I, w_down_NHI, weights_TK, output_indices, selected_expert_indices, cum_token_counts,
      cum_expert_counts, backend):
    return torch.empty_like(gate_up_R2I), torch.empty_like(w_down_NHI), torch.empty_like(weights_TK)


def _down_combine_setup(ctx, inputs, output) -> None:
    (gate_up_R2I, h_RI, w_down_NHI, weights_TK, output_indices, selected_expert_indices, cum_token_counts,
     cum_expert_counts, backend) = inputs
    # Not h: the backward recomputes it from gate_up. Not the expert outputs: they never leave the op.
    ctx.save_for_backward(
        gate_up_R2I, w_down_NHI, weights_TK, output_indices, selected_expert_indices, cum_token_counts,
        cum_expert_counts,
    )
    ctx.backend = backend


def _down_combine_backward(ctx, dout_TH):
    d_gate_up_R2I, dw_down, dweights_TK = down_combine_backward_op(
        dout_TH.contiguous(), *ctx.saved_tensors, ctx.backend
    )
    return d_gate_up_R2I, None, dw_down, dweights_TK, None, None, None, None, None


down_combine.register_autograd(_down_combine_backward, setup_context=_down_combine_setup)


# ---------------------------------------------------------------- stages 2-5
def moe_experts(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
    *,
    backend: str,
    expert_start: int,
    block_size: int,
) -> torch.Tensor:
    """Stages 2-5 through the ops; ``backend`` is ``"torch"`` or ``"triton"`` (already resolved).
    Traceable end to end: no host reads, no data-dependent shapes."""
    num_local = w_gate_up_N2IH.shape[0]
    _, partial_cum, _, cum_expert, cum_token = count_tokens(topk_idx_TK, expert_start, num_local, block_size, backend)
    input_indices, output_indices, selected = build_indices(
        topk_idx_TK, partial_cum, cum_expert, expert_start, num_local, block_size, backend
    )
    # The fused pair, as eager trains: autograd keeps x, gate_up, the weights and the metadata.
    gate_up_R2I, h_RI = gate_up(x_TH, w_gate_up_N2IH, input_indices, output_indices, cum_token, cum_expert, backend)
    return down_combine(
        gate_up_R2I, h_RI, w_down_NHI, weights_TK, output_indices, selected, cum_token, cum_expert, backend
    )

"""Stages 2-5 in one piece with batched GEMMs over zero-padded expert blocks: the path for layers so
small that the number of launches, not the arithmetic, sets their time.

Each local expert's rows go into a block of ``cap`` rows (``cap``: the largest expert's row count,
read on the host, which is free on the CPU), padded with zero rows, so that every projection is one
``bmm`` over the ``[NR, cap, .]`` blocks instead of a GEMM per expert (a grouped GEMM on the CPU is a
loop of them, 2-3 us of launch each). Rows are placed by a one-hot prefix sum over the (token, k)
slots, which are token-major, so the combine is one batched product of each token's K rows with its
K weights. About twenty ATen calls forward and thirty backward, against some sixty on the staged
chain; the padding costs arithmetic (at worst, every token on one expert, it is the dense layer's),
which is why the registry (:func:`fastmoe_xpu.kernels.registry.whole_layer`) takes this path only
below the ``padded`` entry's budget (docs/small_shapes.md).

What it keeps for backward is what the staged chain keeps: the input and the chosen pairs'
pre-activation ``[T*K, 2I]`` (slot order; the backward puts the rows back into their blocks).
``h = silu(gate) * up`` and the expert outputs are never kept; the router-weight gradient is
``<dout_t @ W_down[e], h_r>``, formed in the down GEMM's backward as on the staged chain.

Choices of experts outside ``[expert_start, expert_start + NR)`` (other ranks' experts) go to a
dump row that no GEMM reads and whose results are zero; a token may name an expert twice (two rows).
Elementwise work runs in fp32 for bf16/fp16 inputs, the GEMMs in the input dtype.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, S = T*K slots,
P = NR*cap padded rows (+1 dump row under expert parallelism).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Layout", "experts_backward", "experts_forward", "layout"]


class Layout(NamedTuple):
    """Where each slot's row lives in the padded blocks."""

    rows: torch.Tensor
    """``[S]`` int64: slot -> padded row ``e * cap + position`` (the dump row ``NR * cap`` for a choice
    of another rank's expert)."""
    cap: int
    """Rows per expert block."""
    padded: int
    """Rows of a padded buffer: ``NR * cap``, +1 when some choice goes to the dump row."""


def layout(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int) -> Layout:
    """The padded layout of the local choices in ``topk_idx [T, K]`` (host reads: CPU tensors)."""
    idx = topk_idx_TK.reshape(-1).long()
    if expert_start:
        idx = idx - expert_start
    S = idx.numel()
    if S == 0:
        return Layout(idx, 0, 0)
    lo, hi = torch.aminmax(idx)
    dump = int(lo) < 0 or int(hi) >= num_local
    if dump:
        idx = torch.where((idx >= 0) & (idx < num_local), idx, num_local)
    # Position of each slot among its expert's slots: a running count over the one-hot slots.
    running = torch.nn.functional.one_hot(idx, num_local + dump).cumsum_(0)
    cap = int(running[-1, :num_local].max())
    rows = idx * cap + running.gather(1, idx[:, None]).squeeze_(1).sub_(1)
    if dump:
        rows = torch.where(idx < num_local, rows, num_local * cap)
    return Layout(rows, cap, num_local * cap + dump)


def _check(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
           topk_idx_TK: torch.Tensor) -> None:
    if x_TH.dim() != 2 or w_gate_up_N2IH.dim() != 3 or w_down_NHI.dim() != 3:
        raise ValueError(f"padded experts: expected x [T, H], w_gate_up [NR, 2I, H], w_down [NR, H, I], got "
                         f"{tuple(x_TH.shape)}, {tuple(w_gate_up_N2IH.shape)}, {tuple(w_down_NHI.shape)}")
    NR, I2, H = w_gate_up_N2IH.shape
    if x_TH.shape[1] != H or I2 % 2 or tuple(w_down_NHI.shape) != (NR, H, I2 // 2):
        raise ValueError(f"padded experts: shapes do not match: x {tuple(x_TH.shape)}, w_gate_up "
                         f"{tuple(w_gate_up_N2IH.shape)}, w_down {tuple(w_down_NHI.shape)}")
    if weights_TK.dim() != 2 or weights_TK.shape != topk_idx_TK.shape or weights_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"padded experts: weights {tuple(weights_TK.shape)} and topk_idx "
                         f"{tuple(topk_idx_TK.shape)} must both be [T, K] with T = {x_TH.shape[0]}")
    if x_TH.dtype != w_gate_up_N2IH.dtype or x_TH.dtype != w_down_NHI.dtype:
        raise TypeError(f"padded experts: x, w_gate_up and w_down must share a dtype, got {x_TH.dtype}, "
                        f"{w_gate_up_N2IH.dtype}, {w_down_NHI.dtype}")


def _pad(src_TH: torch.Tensor, k: int, lay: Layout) -> torch.Tensor:
    """``[P, H]``: each token's row (repeated for its K slots) at its slots' padded rows, zero elsewhere."""
    T, H = src_TH.shape
    slots = src_TH[:, None, :].expand(T, k, H).reshape(T * k, H)
    return src_TH.new_zeros(lay.padded, H).index_copy_(0, lay.rows, slots)


def _blocks(t: torch.Tensor, num_local: int, cap: int) -> torch.Tensor:
    """The ``[NR, cap, .]`` expert blocks of a padded buffer (its dump row left out)."""
    return t[: num_local * cap].view(num_local, cap, t.shape[-1])


def _batched(a: torch.Tensor, b: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``[P, N]``: ``a @ b`` per expert block, the dump row (if any) zero."""
    NR = a.shape[0]
    out = a.new_empty(lay.padded, b.shape[-1])
    torch.bmm(a, b, out=out[: NR * lay.cap].view(NR, lay.cap, b.shape[-1]))
    if lay.padded > NR * lay.cap:
        out[NR * lay.cap:].zero_()
    return out


def experts_forward(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [T*K, 2I])``: the layer's output over the local experts and the chosen
    pairs' pre-activation in slot order (rows of other ranks' choices unspecified)."""
    _check(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
    T, H = x_TH.shape
    NR, I2, _ = w_gate_up_N2IH.shape
    I, K = I2 // 2, topk_idx_TK.shape[1]
    lay = layout(topk_idx_TK, expert_start, num_local)
    if lay.cap == 0:  # no choice of a local expert
        return x_TH.new_zeros(T, H), x_TH.new_zeros(T * K, I2)
    x_pad = _blocks(_pad(x_TH, K, lay), NR, lay.cap)
    gate_up = torch.bmm(x_pad, w_gate_up_N2IH.transpose(1, 2))  # [NR, cap, 2I]
    g = gate_up if gate_up.dtype == torch.float32 else gate_up.float()
    h = torch.nn.functional.silu(g[..., :I]).mul_(g[..., I:]).to(x_TH.dtype)
    y_PH = _batched(h, w_down_NHI.transpose(1, 2), lay)
    y_TKH = y_PH.index_select(0, lay.rows).view(T, K, H)
    out_TH = torch.bmm(weights_TK.to(y_TKH.dtype).view(T, 1, K), y_TKH).view(T, H)
    # Rows of the dump (other ranks' choices) read the last block row: never used.
    saved = gate_up.view(NR * lay.cap, I2).index_select(0, lay.rows.clamp(max=NR * lay.cap - 1))
    return out_TH, saved


def experts_backward(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_S2I: torch.Tensor, topk_idx_TK: torch.Tensor, expert_start: int,
    num_local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I], dweights [T, K])`` of
    :func:`experts_forward`, from the saved pre-activation of the chosen pairs."""
    T, H = x_TH.shape
    NR, I2, _ = w_gate_up_N2IH.shape
    I, K = I2 // 2, topk_idx_TK.shape[1]
    dtype = x_TH.dtype
    lay = layout(topk_idx_TK, expert_start, num_local)
    if lay.cap == 0:
        return (torch.zeros_like(x_TH), torch.zeros_like(w_gate_up_N2IH), torch.zeros_like(w_down_NHI),
                torch.zeros_like(weights_TK))
    f32 = torch.float32
    gu = _blocks(gate_up_S2I.new_zeros(lay.padded, I2).index_copy_(0, lay.rows, gate_up_S2I[: T * K]), NR, lay.cap)
    gu = gu if gu.dtype == f32 else gu.float()
    gate, up = gu[..., :I], gu[..., I:]
    silu = torch.nn.functional.silu(gate)
    h = silu * up  # [NR, cap, I] fp32
    dout_blocks = _blocks(_pad(dout_TH.to(dtype), K, lay), NR, lay.cap)
    w_rows = weights_TK.reshape(-1).float()
    w_blocks = _blocks(w_rows.new_zeros(lay.padded, 1).index_copy_(0, lay.rows, w_rows[:, None]), NR, lay.cap)
    # Unweighted dout @ W_down[e]: its dot with h is the router-weight gradient.
    g = torch.bmm(dout_blocks, w_down_NHI)
    g = g if g.dtype == f32 else g.float()
    dw_rows = g.new_zeros(lay.padded)
    torch.linalg.vecdot(g, h, out=dw_rows[: NR * lay.cap].view(NR, lay.cap))
    dweights_TK = dw_rows.index_select(0, lay.rows).view(T, K).to(weights_TK.dtype)
    dw_down = torch.bmm(dout_blocks.transpose(1, 2), h.mul_(w_blocks).to(dtype))  # [NR, H, I]
    g.mul_(w_blocks)
    d_gu = torch.empty(NR, lay.cap, I2, dtype=f32, device=x_TH.device)
    torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=d_gu[..., :I])
    torch.mul(g, silu, out=d_gu[..., I:])
    d_gu = d_gu.to(dtype)
    x_blocks = _blocks(_pad(x_TH, K, lay), NR, lay.cap)
    dw_gate_up = torch.bmm(d_gu.transpose(1, 2), x_blocks)  # [NR, 2I, H]
    dx_PH = _batched(d_gu, w_gate_up_N2IH, lay)
    dx_TH = dx_PH.index_select(0, lay.rows).view(T, K, H).sum(1)
    return dx_TH, dw_gate_up, dw_down, dweights_TK

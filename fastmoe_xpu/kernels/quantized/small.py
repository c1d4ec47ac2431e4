"""A small int8 layer that no backward follows, in one piece: decode steps and short prompts.

The staged chain (``fastmoe::route``, then ``fastmoe::mlp_combine`` on the int8 launchers) walks
every local expert and builds the route's index tensors for a backward that never comes; at a few
routed rows its fixed cost is several times the GEMMs' (a one-token step of a tiny layer: 1.3 ms
against 0.3 ms in fp32, one thread, Xeon with AMX). :func:`small_int8_forward` computes the same
numbers with a few dozen ops: the rows sorted by expert, one ``torch._int_mm`` per chosen expert and
projection on the weights' remembered codes, one dequantizing pass per projection, each token's
rows summed by one ``embedding_bag``.

The same bits as the staged path: quantization is per row (a routed row gets its token's codes and
scale) and per output channel, the int32 sums are exact, the dequantizing products are taken in
the same order (row scale, then the expert's column scales), SiLU*up in fp32 as ``_silu_mul``, and
the weighted sum over each token's K rows in slot order, as ``combine_fwd``'s ``embedding_bag``
(``tests/kernels/test_quantized_small.py`` holds the two to equality).

Legend: T tokens, H hidden, I intermediate, K experts per token, NR experts, R = T*K routed rows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..grouped_mm import _PLAIN, _bags
from ..torch.decode import _experts_of
from . import core
from .core import quantize_rows, quantized_weight

#: The most routed rows (T*K) the one-piece path takes. It ran faster than the staged chain at every
#: size measured up to here (one thread, Xeon with AMX, 2026-11-29, the other core busy; minimum over
#: five interleaved rounds, staged / one piece: 1.2 / 0.4-0.5 ms at one token of H=256 I=128 E=16 K=4,
#: 2.3 / 1.6 ms at 256 rows, 3.1 / 2.5 ms at 1024; at H=512 I=256 E=32 K=8, 5.0 / 3.8 ms at 256 rows,
#: 6.0 / 5.7 ms at 1024).
MAX_ROWS = 1024


def runs(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
         w_down_NHI: torch.Tensor) -> bool:
    """Whether :func:`small_int8_forward` takes this call: fp32 activations, router weights and expert
    weights on the CPU, plain tensors (no subclass, no dispatch mode), 1 to :data:`MAX_ROWS` routed rows,
    expert matrices too small to be packed for oneDNN (:data:`.core.PACK_MIN_ELEMENTS`: larger ones
    multiply on AMX int8 in the staged chain once used often enough). The caller checks the rest (no
    gradient, eager and untraced, every id local, no expert parallelism)."""
    # One expression, no generator and no per-expert view: asked on every call of a decode step.
    f32, plain = torch.float32, _PLAIN
    return (x_TH.is_cpu and 0 < topk_idx_TK.numel() <= MAX_ROWS and x_TH.dtype == f32 and weights_TK.dtype == f32
            and w_gate_up_N2IH.dtype == f32 and w_down_NHI.dtype == f32 and type(x_TH) in plain
            and type(weights_TK) in plain and type(w_gate_up_N2IH) in plain and type(w_down_NHI) in plain
            and not torch._C._len_torch_dispatch_stack()
            and not (max(w_gate_up_N2IH.shape[1] * w_gate_up_N2IH.shape[2], w_down_NHI.shape[1] * w_down_NHI.shape[2])
                     >= core.PACK_MIN_ELEMENTS and core.amx_int8_linear()))


def _expert_products(q_RK: torch.Tensor, s_R: torch.Tensor, codes_NOK: torch.Tensor, scales_NO: torch.Tensor,
                     experts: list[int], counts: list[int], expert_R: torch.Tensor) -> torch.Tensor:
    """``[R, O]`` fp32: row r's codes times its expert's codes transposed, exactly in int32, then times
    the row's scale and the expert's column scales (in that order, as the staged path's epilogue)."""
    codes_t = _experts_of(codes_NOK, True)
    acc = torch.cat([torch._int_mm(q, codes_t[e]) for q, e in zip(q_RK.split(counts), experts)])
    out = torch.mul(acc, s_R[:, None])
    return out.mul_(scales_NO.index_select(0, expert_R))


def _one_token(x_1H: torch.Tensor, weights_1K: torch.Tensor, idx_K: torch.Tensor, experts: list[int],  # noqa: ANN001
               qw_gu, qw_d, inter: int) -> torch.Tensor:
    """:func:`small_int8_forward` of one token (``experts``: its K ids, read to the host): its K rows in
    slot order (K distinct experts), no sorting, one ``torch._int_mm`` per expert and projection on
    views of the codes."""
    K = len(experts)
    qx_1H, sx_1 = quantize_rows(x_1H, torch.int8)
    gu_t = _experts_of(qw_gu.codes, True)
    acc = torch.cat([torch._int_mm(qx_1H, gu_t[e]) for e in experts])
    gate_up = torch.mul(acc, sx_1[:, None]).mul_(qw_gu.scales.index_select(0, idx_K))
    h_KI = torch.ops.aten.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    qh_KI, sh_K = quantize_rows(h_KI, torch.int8)
    d_t = _experts_of(qw_d.codes, True)
    acc_d = torch.cat([torch._int_mm(q, d_t[e]) for q, e in zip(qh_KI.split(1), experts)])
    y_KH = torch.mul(acc_d, sh_K[:, None]).mul_(qw_d.scales.index_select(0, idx_K))
    return torch.embedding_bag(y_KH, _SLOTS[K], _bags(K, K, x_1H.device), False, 0, False, weights_1K.reshape(-1),
                               True)[0]


class _Slots(dict):
    """``arange(K)`` per K (read only)."""

    def __missing__(self, k: int) -> torch.Tensor:
        self[k] = torch.arange(k)
        return self[k]


_SLOTS = _Slots()


class Plan(NamedTuple):
    """Where a call's rows go (:func:`plan`): one token's K ids in slot order; or, for several tokens,
    the distinct experts (sorted), their row counts, each row's expert and its slot."""

    experts: list[int]
    counts: list[int] | None = None
    expert_R: torch.Tensor | None = None
    order_R: torch.Tensor | None = None


def plan(topk_idx_TK: torch.Tensor, num_experts: int) -> Plan | None:
    """The call's :class:`Plan`, or None where an id does not name one of the ``num_experts`` experts:
    the ids read to the host for the walk over the chosen experts tell, with no check of their own
    (one token: its K ids; several: the sorted distinct ids, whose first and last tell)."""
    T = topk_idx_TK.shape[0]
    if T == 1:
        experts = topk_idx_TK[0].tolist()
        return Plan(experts) if experts and 0 <= min(experts) and max(experts) < num_experts else None
    expert_R, order_R = torch.sort(topk_idx_TK.reshape(-1), stable=True)  # row r holds slot order[r] = t*K + k
    experts, counts = torch.unique_consecutive(expert_R, return_counts=True)
    experts = experts.tolist()
    if not (experts and 0 <= experts[0] and experts[-1] < num_experts):
        return None
    return Plan(experts, counts.tolist(), expert_R, order_R)


def small_int8_forward(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor,
                       w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                       layout: Plan | None = None) -> torch.Tensor:
    """``[T, H]``: the fused layer in int8 (gate/up GEMM, SiLU*up, down GEMM, weighted sum of each
    token's rows) over ``w_gate_up [NR, 2I, H]`` and ``w_down [NR, H, I]``, every GEMM quantized as
    the int8 engine quantizes it (per token row, per output channel; the weights' codes remembered as
    :func:`.core.quantized_weight` remembers them, for good inside ``frozen_expert_weights()``). For
    :func:`runs` tensors, every id naming one of the NR experts, no gradient; ``layout``: the ids'
    :func:`plan`, if made already."""
    T, K = topk_idx_TK.shape
    inter = w_down_NHI.shape[2]
    if layout is None:
        layout = plan(topk_idx_TK, w_down_NHI.shape[0])
        if layout is None:
            raise ValueError(f"top_k_index holds ids outside [0, {w_down_NHI.shape[0]})")
    qw_gu = quantized_weight(w_gate_up_N2IH, torch.int8)
    qw_d = quantized_weight(w_down_NHI, torch.int8)
    if T == 1:
        return _one_token(x_TH, weights_TK, topk_idx_TK[0], layout.experts, qw_gu, qw_d, inter)
    experts, counts, expert_R, order_R = layout
    flat = topk_idx_TK.reshape(-1)
    qx_TH, sx_T = quantize_rows(x_TH, torch.int8)  # every token once: a routed row gets its token's codes
    token_R = order_R if K == 1 else order_R.div(K, rounding_mode="floor")
    gate_up = _expert_products(qx_TH.index_select(0, token_R), sx_T.index_select(0, token_R), qw_gu.codes,
                               qw_gu.scales, experts, counts, expert_R)
    h_RI = torch.ops.aten.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    qh_RI, sh_R = quantize_rows(h_RI, torch.int8)
    y_RH = _expert_products(qh_RI, sh_R, qw_d.codes, qw_d.scales, experts, counts, expert_R)
    row_of_slot = torch.argsort(order_R)
    offsets = _bags(flat.numel(), K, x_TH.device)
    # aten's embedding_bag, mode sum, the last offset included: each token's K rows in slot order,
    # times their router weights, as the staged path's combine sums them.
    return torch.embedding_bag(y_RH, row_of_slot, offsets, False, 0, False, weights_TK.reshape(-1), True)[0]

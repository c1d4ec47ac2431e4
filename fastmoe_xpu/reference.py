"""Plain-PyTorch references of every stage and of the whole block (tests import them).

These are written for clarity, not speed: stages 2 and 3 follow the algorithm statement line by
line with Python loops, stage 4 and 5 use autograd through ordinary ops.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, NR local experts,
TH token blocks, RT routed rows on this rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.contract import INDEX_DTYPE, RowIndices, TokenCounts
from .routing import topk_routing


# ---------------------------------------------------------------- stage 2
def reference_count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
) -> TokenCounts:
    """Stage 2 by the algorithm's definition, as the launchers' :class:`TokenCounts`."""
    idx = topk_idx_TK.tolist()
    T = len(idx)
    TH = (T + block_size - 1) // block_size
    partial = [0] * (num_local * TH)
    expert_counts = [0] * T
    for t, row in enumerate(idx):
        b = t // block_size
        for e in row:
            ln = e - expert_start
            if 0 <= ln < num_local:
                partial[ln * TH + b] += 1
                expert_counts[t] += 1
    partial_cum = [0]
    for c in partial:
        partial_cum.append(partial_cum[-1] + c)
    cum_expert = [0]
    for c in expert_counts:
        cum_expert.append(cum_expert[-1] + c)
    cum_token = [partial_cum[n * TH] for n in range(num_local + 1)]
    as_t = lambda v: torch.tensor(v, dtype=INDEX_DTYPE)
    return TokenCounts(as_t(partial), as_t(partial_cum), as_t(expert_counts), as_t(cum_expert), as_t(cum_token))


# ---------------------------------------------------------------- stage 3
def reference_build_indices(topk_idx_TK: torch.Tensor, partial_cum_token_counts: torch.Tensor,
                            cum_expert_counts: torch.Tensor, expert_start: int, num_local: int,
                            block_size: int = 8) -> RowIndices:
    """Stage 3 by the algorithm's definition: :class:`RowIndices` with RT entries each."""
    idx = topk_idx_TK.tolist()
    T = len(idx)
    TH = (T + block_size - 1) // block_size
    pcum = partial_cum_token_counts.tolist()
    cexp = cum_expert_counts.tolist()
    rt = pcum[-1] if pcum else 0
    input_indices = [0] * rt
    output_indices = [0] * rt
    selected = [0] * rt
    counter = [[0] * TH for _ in range(num_local)]
    for t, row in enumerate(idx):
        b = t // block_size
        o = cexp[t]
        for k, e in enumerate(row):
            ln = e - expert_start
            if not 0 <= ln < num_local:
                continue
            r = pcum[ln * TH + b] + counter[ln][b]
            input_indices[r] = t
            output_indices[o] = r
            selected[o] = k
            counter[ln][b] += 1
            o += 1
    as_t = lambda v: torch.tensor(v, dtype=INDEX_DTYPE)
    return RowIndices(as_t(input_indices), as_t(output_indices), as_t(selected))


# ---------------------------------------------------------------- stage 4
def reference_gate_up(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH):
    """``(gate_up [RT, 2I], h [RT, I])`` with autograd through plain ops."""
    bounds = cum_token_counts.tolist()
    mlp_in = x_TH[input_indices[: bounds[-1]].long()]
    parts = [mlp_in[bounds[e]:bounds[e + 1]] @ w_gate_up_N2IH[e].t() for e in range(len(bounds) - 1)]
    gate_up = torch.cat(parts) if parts else mlp_in.new_zeros(0, w_gate_up_N2IH.shape[1])
    gate, up = gate_up.chunk(2, dim=-1)
    return gate_up, F.silu(gate) * up


def reference_down(h_RI, cum_token_counts, w_down_NHI):
    bounds = cum_token_counts.tolist()
    parts = [h_RI[bounds[e]:bounds[e + 1]] @ w_down_NHI[e].t() for e in range(len(bounds) - 1)]
    return torch.cat(parts) if parts else h_RI.new_zeros(0, w_down_NHI.shape[1])


# ---------------------------------------------------------------- stage 5
def reference_combine(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts):
    """``out[t] = sum_i weights[t, sel[i]] * y[output_indices[i]]``; ``weights_TK=None``: unweighted."""
    cexp = cum_expert_counts.tolist()
    rows = []
    for t in range(len(cexp) - 1):
        acc = y_RH.new_zeros(y_RH.shape[1])
        for i in range(cexp[t], cexp[t + 1]):
            w = 1.0 if weights_TK is None else weights_TK[t, int(selected_expert_indices[i])]
            acc = acc + w * y_RH[int(output_indices[i])]
        rows.append(acc)
    return torch.stack(rows) if rows else y_RH.new_zeros(0, y_RH.shape[1])


# ---------------------------------------------------------------- whole layer
def reference_experts_forward(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI, expert_start: int = 0):
    """Experts ``[expert_start, expert_start + NR)`` applied by boolean masks (no index metadata):
    an independent check of stages 2-5 together. ``[T, H]``, partial under expert parallelism."""
    out = torch.zeros_like(x_TH)
    for ln in range(w_gate_up_N2IH.shape[0]):
        tok, k = torch.where(topk_idx_TK == expert_start + ln)
        if tok.numel() == 0:
            continue
        gate, up = (x_TH[tok] @ w_gate_up_N2IH[ln].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down_NHI[ln].t()
        out = out.index_add(0, tok, y * weights_TK[tok, k, None])
    return out


def reference_lora_experts_forward(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI, lora_gate_up=None,
                                   lora_down=None, expert_start: int = 0):
    """:func:`reference_experts_forward` with per-expert LoRA: each adapter ``(A [NR, r, in], B [NR, out, r],
    scaling)`` (or None) adds ``scaling * (x @ A_e^T) @ B_e^T`` to its expert's GEMM, by plain ops and
    autograd."""
    def linear(a, w, lora, e):
        y = a @ w[e].t()
        if lora is not None:
            A, B, s = lora
            y = y + s * (a @ A[e].t()) @ B[e].t()
        return y

    out = torch.zeros_like(x_TH)
    for ln in range(w_gate_up_N2IH.shape[0]):
        tok, k = torch.where(topk_idx_TK == expert_start + ln)
        if tok.numel() == 0:
            continue
        gate, up = linear(x_TH[tok], w_gate_up_N2IH, lora_gate_up, ln).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w_down_NHI, lora_down, ln)
        out = out.index_add(0, tok, y * weights_TK[tok, k, None])
    return out


def reference_moe_forward(x_TH, gate_weight_EH, w_gate_up_E2IH, w_down_EHI, top_k: int, norm_topk_prob: bool):
    """The whole block on ``[T, H]``: router then experts."""
    weights_TK, idx_TK = topk_routing(F.linear(x_TH, gate_weight_EH), top_k, norm_topk_prob)
    return reference_experts_forward(x_TH, weights_TK, idx_TK, w_gate_up_E2IH, w_down_EHI)

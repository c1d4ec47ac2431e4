"""Plain-PyTorch launchers of stages 2-5: the CPU backend.

Every function here has the same name and signature as its Triton counterpart in
``fastmoe_xpu.kernels`` (see ``kernels/__init__.py`` for the contract). The CPU pays nothing for a
device-to-host read, so this backend sizes its outputs exactly (RT routed rows) where the Triton
backend allocates the worst case (T*K rows) and leaves rows past RT unspecified.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._contract import check_count_inputs, check_gemm_inputs, num_blocks

NAME = "torch"
INDEX_DTYPE = torch.int32


# ---------------------------------------------------------------- stage 2: token counting
def count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(partial_token_counts [NR*TH], partial_cum_token_counts [NR*TH+1],
    expert_counts [T], cum_expert_counts [T+1], cum_token_counts [NR+1])``, all int32."""
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    TH = num_blocks(T, block_size)
    dev = topk_idx_TK.device
    local_TK = topk_idx_TK.to(torch.int64) - expert_start
    is_local_TK = (local_TK >= 0) & (local_TK < num_local)
    expert_counts_T = is_local_TK.sum(1, dtype=torch.int32)
    block_TK = (torch.arange(T, device=dev) // block_size)[:, None].expand(T, K)
    keys = (local_TK * TH + block_TK)[is_local_TK]
    partial = torch.bincount(keys, minlength=num_local * TH).to(INDEX_DTYPE)
    zero = torch.zeros(1, dtype=INDEX_DTYPE, device=dev)
    partial_cum = torch.cat([zero, partial.cumsum(0, dtype=INDEX_DTYPE)])
    cum_expert = torch.cat([zero, expert_counts_T.cumsum(0, dtype=INDEX_DTYPE)])
    cum_token = partial_cum[torch.arange(num_local + 1, device=dev) * TH]
    return partial, partial_cum, expert_counts_T, cum_expert, cum_token


# ---------------------------------------------------------------- stage 3: index generation
def build_indices(
    topk_idx_TK: torch.Tensor,
    partial_cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor,
    expert_start: int,
    num_local: int,
    block_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(input_indices [R], output_indices [R], selected_expert_indices [R])``, int32.

    Rows are grouped by local expert, tokens in order within an expert (a stable sort by expert
    gives exactly the block-wise layout of the counting stage, since blocks are contiguous runs
    of tokens). Slots are token-major, k order within a token.
    """
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    dev = topk_idx_TK.device
    local = topk_idx_TK.reshape(-1).to(torch.int64) - expert_start
    is_local = (local >= 0) & (local < num_local)
    # Non-local entries sort after every local expert.
    key = torch.where(is_local, local, torch.full_like(local, num_local))
    order = torch.sort(key, stable=True).indices
    rt = int(is_local.sum())
    input_indices = (order[:rt] // K).to(INDEX_DTYPE)
    row_of_entry = torch.empty_like(order)
    row_of_entry[order] = torch.arange(order.numel(), device=dev)
    output_indices = row_of_entry[is_local].to(INDEX_DTYPE)
    selected = (torch.arange(T * K, device=dev) % K)[is_local].to(INDEX_DTYPE)
    return input_indices, output_indices, selected


# ---------------------------------------------------------------- stage 4: grouped GEMMs
def _bounds(cum_token_counts: torch.Tensor) -> list[int]:
    return cum_token_counts.tolist()


def gate_up_fwd(
    x_TH: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = x[input_indices] @ w_gate_up[e]^T`` per expert group, and
    ``h [R, I] = silu(gate) * up``."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    bounds = _bounds(cum_token_counts)
    rt = bounds[-1]
    two_i = w_gate_up_N2IH.shape[1]
    mlp_in_RH = x_TH.index_select(0, input_indices[:rt])
    gate_up_R2I = x_TH.new_empty(rt, two_i)
    for e in range(len(bounds) - 1):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            torch.mm(mlp_in_RH[s:t], w_gate_up_N2IH[e].t(), out=gate_up_R2I[s:t])
    gate, up = gate_up_R2I.chunk(2, dim=-1)
    h_RI = F.silu(gate) * up
    return gate_up_R2I, h_RI


def down_fwd(h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor) -> torch.Tensor:
    """``y [R, H] = h @ w_down[e]^T`` per expert group."""
    check_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd")
    bounds = _bounds(cum_token_counts)
    y_RH = h_RI.new_empty(bounds[-1], w_down_NHI.shape[1])
    for e in range(len(bounds) - 1):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            torch.mm(h_RI[s:t], w_down_NHI[e].t(), out=y_RH[s:t])
    return y_RH


def down_bwd(
    dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh [R, I] = dy @ w_down[e]`` and ``dw_down [NR, H, I] = dy_e^T @ h_e`` (zero for empty experts)."""
    bounds = _bounds(cum_token_counts)
    dh_RI = dy_RH.new_empty(bounds[-1], w_down_NHI.shape[2])
    dw_NHI = torch.zeros_like(w_down_NHI)
    for e in range(len(bounds) - 1):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            torch.mm(dy_RH[s:t], w_down_NHI[e], out=dh_RI[s:t])
            torch.mm(dy_RH[s:t].t(), h_RI[s:t], out=dw_NHI[e])
    return dh_RI, dw_NHI


def silu_mul_bwd(gate_up_R2I: torch.Tensor, dh_RI: torch.Tensor) -> torch.Tensor:
    """Gradient of ``silu(gate) * up`` with respect to ``[gate, up]``: ``[R, 2I]``."""
    rt = dh_RI.shape[0]
    gate, up = gate_up_R2I[:rt].float().chunk(2, dim=-1)
    dh = dh_RI.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dh * silu
    return torch.cat([d_gate, d_up], dim=-1).to(dh_RI.dtype)


def gate_up_bwd(
    d_gate_up_R2I: torch.Tensor,
    x_TH: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = d_gate_up @ w_gate_up[e]`` and ``dw_gate_up [NR, 2I, H] = d_e^T @ x[rows_e]``."""
    bounds = _bounds(cum_token_counts)
    rt = bounds[-1]
    mlp_in_RH = x_TH.index_select(0, input_indices[:rt])
    dx_rows_RH = x_TH.new_empty(rt, x_TH.shape[1])
    dw_N2IH = torch.zeros_like(w_gate_up_N2IH)
    for e in range(len(bounds) - 1):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            torch.mm(d_gate_up_R2I[s:t], w_gate_up_N2IH[e], out=dx_rows_RH[s:t])
            torch.mm(d_gate_up_R2I[s:t].t(), mlp_in_RH[s:t], out=dw_N2IH[e])
    return dx_rows_RH, dw_N2IH


# ---------------------------------------------------------------- stage 5: output reduction
def _slot_tokens(cum_expert_counts: torch.Tensor) -> torch.Tensor:
    T = cum_expert_counts.numel() - 1
    counts = (cum_expert_counts[1:] - cum_expert_counts[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(T, device=cum_expert_counts.device), counts)


def combine_fwd(
    y_RH: torch.Tensor,
    weights_TK: torch.Tensor | None,
    output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum over slots i of t of weights[t, sel[i]] * y[output_indices[i]]`` (``[T, H]``);
    ``weights_TK=None`` sums unweighted (the input gradient's reduction)."""
    T = cum_expert_counts.numel() - 1
    H = y_RH.shape[1]
    n_slots = int(cum_expert_counts[-1])
    out_idx = output_indices[:n_slots]
    K = weights_TK.shape[1] if weights_TK is not None else None
    if weights_TK is not None and n_slots == T * K:
        # Every slot is local (no expert parallelism): a fixed [T, K] layout, one batched GEMV.
        y_TKH = y_RH.index_select(0, out_idx).view(T, K, H)
        return torch.bmm(weights_TK.to(y_RH.dtype).view(T, 1, K), y_TKH).view(T, H)
    slot_token = _slot_tokens(cum_expert_counts)
    rows = y_RH.index_select(0, out_idx)
    if weights_TK is not None:
        slot_w = weights_TK[slot_token, selected_expert_indices[:n_slots].to(torch.int64)]
        rows = rows * slot_w.to(y_RH.dtype)[:, None]
    out_TH = y_RH.new_zeros(T, H)
    out_TH.index_add_(0, slot_token, rows)
    return out_TH


def combine_bwd(
    dout_TH: torch.Tensor,
    y_RH: torch.Tensor,
    weights_TK: torch.Tensor,
    output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy[row] = weights[t, k] * dout[t]`` and ``dweights[t, k] = dot(y[row], dout[t])`` for each
    slot (t, k, row); weights of non-local slots get zero gradient here."""
    T, K = weights_TK.shape
    n_slots = int(cum_expert_counts[-1])
    out_idx = output_indices[:n_slots].to(torch.int64)
    sel = selected_expert_indices[:n_slots].to(torch.int64)
    slot_token = _slot_tokens(cum_expert_counts)
    dout_SH = dout_TH.index_select(0, slot_token)
    slot_w = weights_TK[slot_token, sel].to(dout_TH.dtype)
    dy_RH = dout_TH.new_empty(y_RH.shape[0], dout_TH.shape[1])
    dy_RH.index_copy_(0, out_idx, dout_SH * slot_w[:, None])
    y_SH = y_RH.index_select(0, out_idx)
    dw_slot = (y_SH.float() * dout_SH.float()).sum(-1)
    dweights_TK = torch.zeros(T, K, dtype=weights_TK.dtype, device=weights_TK.device)
    dweights_TK[slot_token, sel] = dw_slot.to(weights_TK.dtype)
    return dy_RH, dweights_TK

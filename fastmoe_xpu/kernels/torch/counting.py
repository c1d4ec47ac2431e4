"""Stage 2 in plain PyTorch: per-block token counts of the local experts and their prefix sums.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import torch

from ..contract import INDEX_DTYPE, TokenCounts, check_count_inputs, num_blocks


def all_local(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int) -> bool:
    """True when every id is one of the local experts ``[expert_start, expert_start + num_local)``
    (no expert parallelism, or a rank that holds every chosen expert): one ``aminmax`` and a host
    read, free on the CPU. Every launcher of stages 2, 3 and 5 then has a fixed ``[T, K]`` layout."""
    if topk_idx_TK.numel() == 0:
        return False
    lo, hi = torch.aminmax(topk_idx_TK)
    return int(lo) >= expert_start and int(hi) < expert_start + num_local


def count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
) -> TokenCounts:
    """Stage 2's :class:`~fastmoe_xpu.kernels.contract.TokenCounts`: one ``bincount`` over
    (local expert, token block) keys, then ``cumsum``s.

    When every id is local (:func:`all_local`) the per-token counts are ``K`` each and the keys need
    no mask: seven small ops instead of about twenty, whose fixed cost is what a small batch pays
    (33 -> 17 us at T=48, K=2 on two threads; the same work at any T, so no size threshold)."""
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    TH = num_blocks(T, block_size)
    dev = topk_idx_TK.device
    if all_local(topk_idx_TK, expert_start, num_local):
        return _count_all_local(topk_idx_TK, expert_start, num_local, block_size, TH)
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
    return TokenCounts(partial, partial_cum, expert_counts_T, cum_expert, cum_token)


def _count_all_local(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int, TH: int
) -> TokenCounts:
    """:func:`count_tokens` when every id is local. Entry i = t*K + k lies in block
    ``i // (K*block_size)``; its key, shifted by one, is ``local_expert*TH + block + 1``, so that
    the counts' inclusive ``cumsum`` is already the exclusive prefix sum with its leading zero."""
    T, K = topk_idx_TK.shape
    dev = topk_idx_TK.device
    n = T * K
    per_block = K * block_size
    # block + 1 - expert_start*TH for every entry, then + TH * id: the shifted key in one add.
    keys = torch.arange(per_block, n + per_block, device=dev).div_(per_block, rounding_mode="floor")
    if expert_start:
        keys.sub_(expert_start * TH)
    keys.add_(topk_idx_TK.reshape(-1), alpha=TH)
    shifted = torch.bincount(keys, minlength=num_local * TH + 1)
    partial_cum = shifted.cumsum(0, dtype=INDEX_DTYPE)
    partial = shifted[1:].to(INDEX_DTYPE)
    expert_counts = torch.full((T,), K, dtype=INDEX_DTYPE, device=dev)
    cum_expert = torch.arange(0, n + 1, K, dtype=INDEX_DTYPE, device=dev)
    cum_token = partial_cum[::TH].clone()
    return TokenCounts(partial, partial_cum, expert_counts, cum_expert, cum_token)

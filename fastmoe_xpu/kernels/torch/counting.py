"""Stage 2 in plain PyTorch: per-block token counts of the local experts and their prefix sums.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import torch

from ..contract import INDEX_DTYPE, TokenCounts, check_count_inputs, num_blocks


def count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
) -> TokenCounts:
    """Stage 2's :class:`~fastmoe_xpu.kernels.contract.TokenCounts`: one ``bincount`` over
    (local expert, token block) keys, then ``cumsum``s."""
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
    return TokenCounts(partial, partial_cum, expert_counts_T, cum_expert, cum_token)

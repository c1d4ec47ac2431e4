"""Stage 3 in plain PyTorch: index generation by a stable sort by expert.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import torch

from ..contract import INDEX_DTYPE, RowIndices, check_count_inputs


def build_indices(
    topk_idx_TK: torch.Tensor,
    partial_cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor,
    expert_start: int,
    num_local: int,
    block_size: int = 8,
) -> RowIndices:
    """Returns :class:`~fastmoe_xpu.kernels.contract.RowIndices` (``input_indices [R]``, ``output_indices [R]``,
    ``selected_expert_indices [R]``), int32, R = RT.

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
    return RowIndices(input_indices, output_indices, selected)

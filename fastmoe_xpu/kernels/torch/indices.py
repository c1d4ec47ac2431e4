"""Stage 3 in plain PyTorch: index generation by a stable sort by expert.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import torch

from ..contract import INDEX_DTYPE, RowIndices, check_count_inputs
from .counting import all_local


def build_indices(topk_idx_TK: torch.Tensor, partial_cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
                  expert_start: int, num_local: int, block_size: int = 8) -> RowIndices:
    """Returns :class:`~fastmoe_xpu.kernels.contract.RowIndices` (``input_indices [R]``, ``output_indices [R]``,
    ``selected_expert_indices [R]``), int32, R = RT.

    Rows are grouped by local expert, tokens in order within an expert (a stable sort by expert
    gives exactly the block-wise layout of the counting stage, since blocks are contiguous runs
    of tokens). Slots are token-major, k order within a token.
    """
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    dev = topk_idx_TK.device
    if all_local(topk_idx_TK, expert_start, num_local):
        return _indices_all_local(topk_idx_TK)
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


def _indices_all_local(topk_idx_TK: torch.Tensor) -> RowIndices:
    """:func:`build_indices` when every id is local (``counting.all_local``): no mask, no
    compaction, RT = T*K, and slot i is entry i of the flat ``[T, K]`` ids. Five small ops instead
    of about twelve (34 -> 16 us at T=48, K=2 on two threads; the same work at any T, so no size
    threshold): the stable sort gives the rows, its inverse permutation the slots' rows."""
    T, K = topk_idx_TK.shape
    dev = topk_idx_TK.device
    n = T * K
    order = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
    input_indices = (order if K == 1 else order.div(K, rounding_mode="floor")).to(INDEX_DTYPE)
    output_indices = torch.empty(n, dtype=INDEX_DTYPE, device=dev)
    output_indices.scatter_(0, order, _positions(n, dev))
    selected = torch.arange(n, dtype=INDEX_DTYPE, device=dev).remainder_(K)  # half the cost of a repeat
    return RowIndices(input_indices, output_indices, selected)


#: ``(n, device) -> arange(n)`` in the index dtype: the rows the inverse permutation scatters (read only).
_POSITIONS: dict[tuple, torch.Tensor] = {}


def _positions(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    pos = _POSITIONS.get(key)
    if pos is None:
        if len(_POSITIONS) >= 64:  # one per token count seen: bounded for long generations
            _POSITIONS.clear()
        pos = _POSITIONS[key] = torch.arange(n, dtype=INDEX_DTYPE, device=device)
    return pos

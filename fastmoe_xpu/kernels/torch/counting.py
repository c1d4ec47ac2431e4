"""Stage 2 in plain PyTorch: per-block token counts of the local experts and their prefix sums.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import weakref

import torch

from ..contract import INDEX_DTYPE, TokenCounts, check_count_inputs, num_blocks


#: :func:`all_local`'s last answer: (weak reference to the ids, their version counter, expert_start,
#: num_local, answer). Stage 3 asks about the very ids stage 2 just asked about (``build_indices``
#: right after ``count_tokens`` in one layer call): one ``aminmax`` and its host reads instead of two.
_LAST_ANSWER: list[tuple | None] = [None]


def all_local(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int) -> bool:
    """True when every id is one of the local experts ``[expert_start, expert_start + num_local)``
    (no expert parallelism, or a rank that holds every chosen expert): one ``aminmax`` and a host
    read, free on the CPU. Every launcher of stages 2, 3 and 5 then has a fixed ``[T, K]`` layout.
    Asked again about the same ids, unmodified (the same tensor object, the same version counter),
    it answers from the last call."""
    if topk_idx_TK.numel() == 0:
        return False
    last = _LAST_ANSWER[0]
    if (last is not None and last[0]() is topk_idx_TK and last[1] == topk_idx_TK._version
            and last[2] == expert_start and last[3] == num_local):
        return last[4]
    lo, hi = torch.aminmax(topk_idx_TK)
    answer = int(lo) >= expert_start and int(hi) < expert_start + num_local
    _LAST_ANSWER[0] = (weakref.ref(topk_idx_TK), topk_idx_TK._version, expert_start, num_local, answer)
    return answer


#: ``(n, per_block, device) -> [n]`` int64 ``(i + per_block) // per_block``: the block part of
#: :func:`_count_all_local`'s keys, the same for every call of a shape (read only).
_BLOCK_KEYS: dict[tuple, torch.Tensor] = {}


def _block_keys(n: int, per_block: int, device: torch.device) -> torch.Tensor:
    key = (n, per_block, device)
    keys = _BLOCK_KEYS.get(key)
    if keys is None:
        if len(_BLOCK_KEYS) >= 64:  # one per token count seen: bounded for long generations
            _BLOCK_KEYS.clear()
        keys = _BLOCK_KEYS[key] = torch.arange(per_block, n + per_block, device=device).div_(
            per_block, rounding_mode="floor")
    return keys


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
    # block + 1 (cached per shape) + TH * id, then - expert_start*TH: the shifted key.
    keys = torch.add(_block_keys(n, per_block, dev), topk_idx_TK.reshape(-1), alpha=TH)
    if expert_start:
        keys.sub_(expert_start * TH)
    shifted = torch.bincount(keys, minlength=num_local * TH + 1)
    partial_cum = shifted.cumsum(0, dtype=INDEX_DTYPE)
    partial = shifted[1:].to(INDEX_DTYPE)
    expert_counts = torch.full((T,), K, dtype=INDEX_DTYPE, device=dev)
    cum_expert = torch.arange(0, n + 1, K, dtype=INDEX_DTYPE, device=dev)
    cum_token = partial_cum[::TH].clone()
    return TokenCounts(partial, partial_cum, expert_counts, cum_expert, cum_token)

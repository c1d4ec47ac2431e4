"""Stage 2 in Triton: per-block token counts of the local experts and their prefix sums.

Two kernels, no device-to-host synchronisation:

1. ``_count_tokens_fwd_kernel`` (one program per token block): the block's count of each local
   expert, each token's number of local experts, the block's total, and per-expert totals
   (integer atomics: exact, so the result does not depend on their order).
2. ``_cumsum_counts_fwd_kernel``: the two prefix sums as independent segments. A program per
   local expert scans that expert's row of block counts starting from the sum of the earlier
   experts' totals; a program per chunk of tokens scans those tokens' counts starting from the sum
   of the earlier blocks' totals.

Legend: T tokens, K experts per token, NR local experts, TBS token block size, TH = ceil(T/TBS).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import table_for, get_config
from ..contract import INDEX_DTYPE, TokenCounts, check_count_inputs, num_blocks
from . import launch as _launch


@triton.jit
def _count_tokens_fwd_kernel(
    topk_idx_ptr,
    partial_ptr,
    expert_counts_ptr,
    block_totals_ptr,
    expert_totals_ptr,
    T,
    K,
    TH,
    expert_start,
    num_local,
    block_size,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Counts local experts per token block.

    Grid ``(TH,)``; program ``b`` owns tokens ``[b*TBS, min((b+1)*TBS, T))``, all K of their
    choices. Reads ``topk_idx [T, K]`` (int32 or int64). Writes ``partial [NR*TH]`` int32 at
    ``ln*TH + b``, ``expert_counts [T]`` int32 for its tokens, ``block_totals [TH]`` int32 at ``b``,
    and adds into ``expert_totals [NR]`` int32 (zero on entry). ``BLOCK_T >= TBS`` and
    ``BLOCK_K >= K`` are powers of two; experts are histogrammed ``BLOCK_E`` at a time.
    """
    b = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    tok = b.to(tl.int64) * block_size + offs_t  # int64 offsets: no product can wrap
    t_mask = (offs_t < block_size) & (tok < T)
    mask = t_mask[:, None] & (offs_k[None, :] < K)
    expert = tl.load(topk_idx_ptr + tok[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=-1)
    ln = expert.to(tl.int32) - expert_start
    local = mask & (ln >= 0) & (ln < num_local)
    ln = tl.where(local, ln, -1)
    count_t = tl.sum(local.to(tl.int32), axis=1)
    tl.store(expert_counts_ptr + tok, count_t, mask=t_mask)
    tl.store(block_totals_ptr + b, tl.sum(count_t, axis=0))
    for e0 in range(0, num_local, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        hit = (ln[:, :, None] == offs_e[None, None, :]).to(tl.int32)
        hist = tl.sum(tl.sum(hit, axis=1), axis=0)
        e_mask = offs_e < num_local
        tl.store(partial_ptr + offs_e.to(tl.int64) * TH + b, hist, mask=e_mask)
        tl.atomic_add(expert_totals_ptr + offs_e, hist, mask=e_mask & (hist > 0), sem="relaxed")


@triton.jit
def _cumsum_counts_fwd_kernel(
    partial_ptr,
    expert_totals_ptr,
    expert_counts_ptr,
    block_totals_ptr,
    partial_cum_ptr,
    cum_token_ptr,
    cum_expert_ptr,
    T,
    TH,
    num_local,
    block_size,
    tokens_per_chunk,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Exclusive prefix sums of the counts, as independent segments.

    Grid ``(NR + ceil(T / tokens_per_chunk),)``. Program ``p < NR`` owns local expert p: it writes
    ``partial_cum [NR*TH+1]`` int32 at ``p*TH+1 .. (p+1)*TH`` (and entry 0 when p = 0) and
    ``cum_token [NR+1]`` int32 at ``p`` (and ``NR`` when p = NR-1), reading ``partial [NR*TH]`` and
    ``expert_totals [NR]``. Program ``NR + c`` owns tokens ``[c*tpc, (c+1)*tpc)`` with
    ``tpc = tokens_per_chunk`` (a whole number of token blocks, at most ``BLOCK``): it writes
    ``cum_expert [T+1]`` int32 at those tokens' ``t+1`` (and entry 0 when c = 0), reading
    ``expert_counts [T]`` and ``block_totals [TH]``.
    """
    pid = tl.program_id(0)
    zero = pid * 0
    if pid < num_local:
        base = zero
        for e0 in range(0, pid, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            base += tl.sum(tl.load(expert_totals_ptr + offs_e, mask=offs_e < pid, other=0), axis=0)
        tl.store(cum_token_ptr + pid, base)
        if pid == 0:
            tl.store(partial_cum_ptr, zero)
        row = pid.to(tl.int64) * TH
        carry = base
        for c0 in range(0, TH, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m = offs < TH
            x = tl.load(partial_ptr + row + offs, mask=m, other=0)
            tl.store(partial_cum_ptr + row + offs + 1, tl.cumsum(x, axis=0) + carry, mask=m)
            carry += tl.sum(x, axis=0)
        if pid == num_local - 1:
            tl.store(cum_token_ptr + num_local, carry)
    else:
        tok0 = (pid - num_local).to(tl.int64) * tokens_per_chunk
        blk0 = (tok0 // block_size).to(tl.int32)
        base = zero
        for b0 in range(0, blk0, BLOCK):
            offs_b = b0 + tl.arange(0, BLOCK)
            base += tl.sum(tl.load(block_totals_ptr + offs_b, mask=offs_b < blk0, other=0), axis=0)
        if tok0 == 0:
            tl.store(cum_expert_ptr, zero)
        offs = tl.arange(0, BLOCK)
        m = (offs < tokens_per_chunk) & (tok0 + offs < T)
        x = tl.load(expert_counts_ptr + tok0 + offs, mask=m, other=0)
        tl.store(cum_expert_ptr + tok0 + offs + 1, tl.cumsum(x, axis=0) + base, mask=m)


def count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
) -> TokenCounts:
    """Stage 2's :class:`~fastmoe_xpu.kernels.contract.TokenCounts` (``partial_token_counts [NR*TH]``,
    ``partial_cum_token_counts [NR*TH+1]``, ``expert_counts [T]``, ``cum_expert_counts [T+1]``,
    ``cum_token_counts [NR+1]``), all int32."""
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    if not topk_idx_TK.is_contiguous():
        raise ValueError(f"count_tokens: topk_idx {tuple(topk_idx_TK.shape)} must be contiguous")
    T, K = topk_idx_TK.shape
    TH = num_blocks(T, block_size)
    dev = topk_idx_TK.device
    if T == 0:
        zeros = lambda n: torch.zeros(n, dtype=INDEX_DTYPE, device=dev)
        return TokenCounts(zeros(0), zeros(1), zeros(0), zeros(1), zeros(num_local + 1))
    table = table_for(dev)
    partial = torch.empty(num_local * TH, dtype=INDEX_DTYPE, device=dev)
    expert_counts = torch.empty(T, dtype=INDEX_DTYPE, device=dev)
    block_totals = torch.empty(TH, dtype=INDEX_DTYPE, device=dev)
    expert_totals = torch.zeros(num_local, dtype=INDEX_DTYPE, device=dev)
    _launch.launch(
        _count_tokens_fwd_kernel, (TH,),
        (topk_idx_TK, partial, expert_counts, block_totals, expert_totals, T, K, TH, expert_start, num_local,
         block_size),
        get_config(table, "count_tokens"), dev,
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_K=triton.next_power_of_2(K),
    )
    partial_cum = torch.empty(num_local * TH + 1, dtype=INDEX_DTYPE, device=dev)
    cum_expert = torch.empty(T + 1, dtype=INDEX_DTYPE, device=dev)
    cum_token = torch.empty(num_local + 1, dtype=INDEX_DTYPE, device=dev)
    cfg = get_config(table, "cumsum_counts")
    block = max(cfg.meta["BLOCK"], triton.next_power_of_2(block_size))
    tokens_per_chunk = (block // block_size) * block_size
    _launch.launch(
        _cumsum_counts_fwd_kernel, (num_local + triton.cdiv(T, tokens_per_chunk),),
        (partial, expert_totals, expert_counts, block_totals, partial_cum, cum_token, cum_expert, T, TH, num_local,
         block_size, tokens_per_chunk),
        cfg, dev, BLOCK=block,
    )
    return TokenCounts(partial, partial_cum, expert_counts, cum_expert, cum_token)

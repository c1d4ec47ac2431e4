"""Stage 3 in Triton: index generation from the counting stage's prefix sums.

One program per token block places every local (token, k) choice of its block: the row is the
block's offset inside the expert's group (``partial_cum_token_counts``) plus how many earlier
choices of the block went to the same expert; the slot is the token's first slot
(``cum_expert_counts``) plus how many earlier choices of the token are local. Both ranks come from
one all-pairs comparison inside the block (token-major, k-minor order), so tokens keep their order
within an expert (stable) with no sequential walk.

Legend: T tokens, K experts per token, NR local experts, TBS token block size, TH = ceil(T/TBS),
RT routed rows on this rank, R = T*K rows allocated.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import table_for, get_config
from ..contract import INDEX_DTYPE, RowIndices, check_count_inputs, check_index, num_blocks
from . import launch as _launch


@triton.jit
def _build_indices_fwd_kernel(
    topk_idx_ptr,
    partial_cum_ptr,
    cum_expert_ptr,
    input_idx_ptr,
    output_idx_ptr,
    selected_ptr,
    T,
    K,
    TH,
    expert_start,
    num_local,
    block_size,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Writes the rows and slots of one token block's local choices.

    Grid ``(TH,)``; program ``b`` owns the choices ``(t, k)`` of tokens ``[b*TBS, (b+1)*TBS)``,
    flattened as ``j = (t - b*TBS) * BLOCK_K + k`` over ``BLOCK_J = BLOCK_T * BLOCK_K`` lanes
    (``BLOCK_T >= TBS`` and ``BLOCK_K >= K`` powers of two). Reads ``topk_idx [T, K]`` (int32 or
    int64), ``partial_cum_token_counts [NR*TH+1]`` int32 and ``cum_expert_counts [T+1]`` int32.
    Writes ``input_indices[row] = t``, ``output_indices[slot] = row`` and
    ``selected_expert_indices[slot] = k`` (each ``[R]`` int32) for every local choice.
    """
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_J)
    jt = j // BLOCK_K
    jk = j % BLOCK_K
    tok = b.to(tl.int64) * block_size + jt  # int64 offsets: no product can wrap
    valid = (jt < block_size) & (tok < T) & (jk < K)
    expert = tl.load(topk_idx_ptr + tok * K + jk, mask=valid, other=-1)
    ln = expert.to(tl.int32) - expert_start
    local = valid & (ln >= 0) & (ln < num_local)
    ln = tl.where(local, ln, -1)
    # earlier[j, j'] : choice j' comes before choice j and is local.
    earlier = (j[None, :] < j[:, None]) & local[None, :]
    rank_in_expert = tl.sum((earlier & (ln[None, :] == ln[:, None])).to(tl.int32), axis=1)
    rank_in_token = tl.sum((earlier & (jt[None, :] == jt[:, None])).to(tl.int32), axis=1)
    row = tl.load(partial_cum_ptr + ln.to(tl.int64) * TH + b, mask=local, other=0) + rank_in_expert
    slot = tl.load(cum_expert_ptr + tok, mask=local, other=0) + rank_in_token
    tl.store(input_idx_ptr + row, tok.to(tl.int32), mask=local)
    tl.store(output_idx_ptr + slot, row, mask=local)
    tl.store(selected_ptr + slot, jk, mask=local)


def build_indices(topk_idx_TK: torch.Tensor, partial_cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
                  expert_start: int, num_local: int, block_size: int = 8) -> RowIndices:
    """Returns :class:`~fastmoe_xpu.kernels.contract.RowIndices` (``input_indices [R]``, ``output_indices [R]``,
    ``selected_expert_indices [R]``), int32, with
    R = T*K (the worst case); entries past RT = ``partial_cum_token_counts[-1]`` are unspecified."""
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    TH = num_blocks(T, block_size)
    dev = topk_idx_TK.device
    for name, t, n in (("partial_cum_token_counts", partial_cum_token_counts, num_local * TH + 1),
                       ("cum_expert_counts", cum_expert_counts, T + 1)):
        if t.dim() != 1 or t.numel() != n:
            raise ValueError(f"build_indices: {name} has shape {tuple(t.shape)}, expected ({n},) for "
                             f"topk_idx {tuple(topk_idx_TK.shape)}, {num_local} local experts, block size {block_size}")
    check_index("build_indices", dev, partial_cum_token_counts=partial_cum_token_counts,
                cum_expert_counts=cum_expert_counts)
    if not topk_idx_TK.is_contiguous():
        raise ValueError(f"build_indices: topk_idx {tuple(topk_idx_TK.shape)} must be contiguous")
    R = T * K
    input_indices = torch.empty(R, dtype=INDEX_DTYPE, device=dev)
    output_indices = torch.empty(R, dtype=INDEX_DTYPE, device=dev)
    selected = torch.empty(R, dtype=INDEX_DTYPE, device=dev)
    if T == 0:
        return RowIndices(input_indices, output_indices, selected)
    block_k = triton.next_power_of_2(K)
    _launch.launch(
        _build_indices_fwd_kernel, (TH,),
        (topk_idx_TK, partial_cum_token_counts, cum_expert_counts, input_indices, output_indices, selected,
         T, K, TH, expert_start, num_local, block_size),
        get_config(table_for(dev), "build_indices"), dev,
        BLOCK_K=block_k, BLOCK_J=triton.next_power_of_2(block_size) * block_k,
    )
    return RowIndices(input_indices, output_indices, selected)

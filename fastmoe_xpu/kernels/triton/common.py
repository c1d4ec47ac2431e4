"""The openings the Triton kernels share: which tokens, slots, experts' rows and columns a program owns.

``@triton.jit`` functions called from the kernels (the compiler inlines them). Kernels import them
by name, ``from .common import tile``, not through the module: the compile gates wrap each kernel
and the jit functions it names again for compiled mode (:func:`fastmoe_xpu.tools.kernel_specs._jit`).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile(index, BLOCK: tl.constexpr, n):
    """Offsets ``[index*BLOCK, (index+1)*BLOCK)`` of tile ``index`` along an axis of length ``n``, and
    their mask (the offsets below ``n``)."""
    offs = index * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def token_slots(cum_expert_ptr, T, BLOCK_T: tl.constexpr):
    """The tokens of this program's block on grid axis 0, their mask, and each token's first slot and
    slot count from ``cum_expert_counts [T+1]`` int32 (zero for masked tokens)."""
    offs_t, t_mask = tile(tl.program_id(0), BLOCK_T, T)
    first = tl.load(cum_expert_ptr + offs_t, mask=t_mask, other=0)
    count = tl.load(cum_expert_ptr + offs_t + 1, mask=t_mask, other=0) - first
    return offs_t, t_mask, first, count


@triton.jit
def slot_row(output_idx_ptr, first, count, j):
    """Whether each token has a slot ``j`` (``j < count``) and that slot's row ``output_indices[first + j]``
    (int64; 0 where it has none)."""
    has = j < count
    row = tl.load(output_idx_ptr + first + j, mask=has, other=0).to(tl.int64)
    return has, row


@triton.jit
def expert_rows(cum_token_ptr):
    """The expert e on grid axis 2, its first row and its row count from ``cum_token_counts [NR+1]``
    int32 (expert e owns rows ``cum_token_counts[e] .. cum_token_counts[e+1]``)."""
    e = tl.program_id(2)
    row_start = tl.load(cum_token_ptr + e)
    n_rows = tl.load(cum_token_ptr + e + 1) - row_start
    return e, row_start, n_rows


@triton.jit
def weight_tile_ptrs(w_e, offs_k, offs_n, N, K, BLOCK_K: tl.constexpr, TRANS_W: tl.constexpr):
    """Pointers to the ``[BLOCK_K, BLOCK_N]`` tile at rows ``offs_k``, columns ``offs_n`` of ``B_e``
    and the pointer step from one k-step to the next: ``TRANS_W``, ``B_e = W_e^T`` with ``W_e [N, K]``
    read along its contiguous K; else ``B_e = W_e`` with ``W_e [K, N]``."""
    if TRANS_W:
        b_ptrs = w_e + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        b_step = BLOCK_K
    else:
        b_ptrs = w_e + offs_k[:, None].to(tl.int64) * N + offs_n[None, :]
        b_step = BLOCK_K * N
    return b_ptrs, b_step


@triton.jit
def row_walk_start(cum_token_ptr, N, BLOCK_N: tl.constexpr):
    """The start of a persistent program's walk over (expert, row tile, column tile) work items, items
    ``pid, pid + P, ...`` for P programs on grid axis 0: its first item, the stride P, the column
    tiles of an ``N``-wide output, the first item of expert 0 and expert 0's first row."""
    item = tl.program_id(0)
    n_progs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first = 0
    row_end = tl.load(cum_token_ptr)
    return item, n_progs, tiles_n, first, row_end


@triton.jit
def next_expert(cum_token_ptr, e, row_end, BLOCK_M: tl.constexpr):
    """Expert e's rows on the walk over the experts in order (``row_end``: where expert e - 1's rows
    end): its first row, its end, its row count and its row tiles."""
    row_start = row_end
    row_end = tl.load(cum_token_ptr + e + 1)
    n_rows = row_end - row_start
    return row_start, row_end, n_rows, tl.cdiv(n_rows, BLOCK_M)


@triton.jit
def item_tile(local, tiles_m, BLOCK_N: tl.constexpr):
    """The row tile and first column of an expert's work item ``local`` (items row tile fastest)."""
    return local % tiles_m, (local // tiles_m) * BLOCK_N


@triton.jit
def block_ptr_dot(a_bp, b_bp, acc, length, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + A @ B`` over ``length`` of the shared axis, ``BLOCK_K`` at a time, with the operands'
    tiles read through block pointers (zero past their bounds): ``a_bp`` steps along A's columns,
    ``b_bp`` along B's rows."""
    for k0 in range(0, length, BLOCK_K):
        a = tl.load(a_bp, boundary_check=(0, 1), padding_option="zero")
        b = tl.load(b_bp, boundary_check=(0, 1), padding_option="zero")
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_bp = tl.advance(a_bp, (0, BLOCK_K))
        b_bp = tl.advance(b_bp, (BLOCK_K, 0))
    return acc

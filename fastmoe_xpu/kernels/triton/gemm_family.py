"""The grouped-GEMM family's shared parts: the k-loop, the scaled epilogues and the launch preamble.

The bf16/fp32 (:mod:`.grouped_gemm`), TMA (:mod:`.tma_gemm`), int8 (:mod:`.int8_gemm`) and fp8
(:mod:`.fp8_gemm`) grouped GEMMs differ in their operands' storage and accumulation, not in how a
program finds its expert's rows or walks the contracted axis. The ``@triton.jit`` helpers here are
inlined by the compiler, so each kernel compiles as if it were written out; the operand kind is a
constexpr (``OPERANDS``: ``"float"``, ``"int8"`` or ``"fp8"``) rather than a kernel of its own.
Kernels import the helpers by name (see :mod:`.common`).

Host side: the row-tile grid (expert on axis 2, ``ROW_SLACK`` times the fair share of row tiles on
axis 0), the weight-gradient tile grid, and :func:`quantized_grouped_mm`, the launch the int8 and
fp8 row GEMMs share.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ..configs import table_for
from .common import expert_rows, tile, weight_tile_ptrs
from .launch import timed_launch


@triton.jit
def dot_k_loop(acc, a_ptrs, a_step, b_ptrs, b_step, m_mask, n_mask, offs_k, length, BLOCK_K: tl.constexpr,
               OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr, OVERLAP: tl.constexpr):
    """``acc + A @ B`` over ``length`` of the contracted axis, ``BLOCK_K`` at a time: ``a_ptrs``
    (``[BLOCK_M, BLOCK_K]``, masked by ``m_mask``) and ``b_ptrs`` (``[BLOCK_K, BLOCK_N]``, masked by
    ``n_mask``) advance by ``a_step`` and ``b_step`` per k-step, zeros past ``length``.

    ``OPERANDS``: ``"float"``, ``tl.dot`` at ``DOT_PRECISION`` into the fp32 ``acc``; ``"int8"``, int8
    codes into the int32 ``acc`` (exact sums); ``"fp8"``, fp8 codes into the fp32 ``acc`` with each
    k-step's partial product promoted to fp32 (``max_num_imprecise_acc = BLOCK_K``), or with
    ``OVERLAP`` each k-step's dot into a second accumulator added after the next one is issued (the
    same partial sums in the same order)."""
    part = tl.zeros(acc.shape, dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        k_mask = offs_k < length - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if OPERANDS == "int8":
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # explicit: triton 3.6 takes fp32 as the default
        elif OPERANDS == "fp8":
            if OVERLAP:
                nxt = tl.dot(a, b, out_dtype=tl.float32)
                acc += part
                part = nxt
            else:
                acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    if OVERLAP:
        acc += part
    return acc


@triton.jit
def quantized_row_tiles(a_ptr, sa_ptr, idx_ptr, w_ptr, sw_ptr, cum_token_ptr, out_ptr, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TRANS_W: tl.constexpr,
                        GATHER: tl.constexpr, HAS_SW: tl.constexpr, OPERANDS: tl.constexpr, OVERLAP: tl.constexpr):
    """The body of the int8 and fp8 row GEMMs (:mod:`.int8_gemm`, :mod:`.fp8_gemm`): program
    ``(m, n, e)`` writes ``out[r] = (sa[src(r)] * sw_e) * (qa[src(r)] @ B_e)`` for its row tiles
    ``m, m + P, ...`` of expert e and columns ``[n*BLOCK_N, (n+1)*BLOCK_N)``, ``src(r) = idx[r]``
    with ``GATHER``; the fp32 sums times the row scale, then the column scale (``HAS_SW``), stored
    rounded to nearest even."""
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    row0 = row_start.to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * N * K
    offs_n, n_mask = tile(tl.program_id(1), BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    out_ty = out_ptr.dtype.element_ty
    if HAS_SW:
        sw = tl.load(sw_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    else:
        sw = tl.zeros((BLOCK_N,), dtype=tl.float32)  # not read
    for tile_m in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        offs_m, m_mask = tile(tile_m, BLOCK_M, n_rows)
        rows = row0 + offs_m
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=m_mask, other=0).to(tl.int64)
        else:
            src = rows
        sa = tl.load(sa_ptr + src, mask=m_mask, other=0.0)
        a_ptrs = a_ptr + src[:, None] * K + offs_k[None, :]
        b_ptrs, b_step = weight_tile_ptrs(w_e, offs_k, offs_n, N, K, BLOCK_K, TRANS_W)
        if OPERANDS == "int8":
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = dot_k_loop(acc, a_ptrs, BLOCK_K, b_ptrs, b_step, m_mask, n_mask, offs_k, K, BLOCK_K, OPERANDS, "ieee",
                         OVERLAP)
        res = acc.to(tl.float32) * sa[:, None]
        if HAS_SW:
            res = res * sw[None, :]
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], res.to(out_ty, fp_downcast_rounding="rtne"),
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def scaled_weight_grad_store(acc, out_ptr, sl_ptr, sr_ptr, e, M, N, offs_m, offs_n, m_mask, n_mask,
                             LEFT_SCALE_FIRST: tl.constexpr):
    """The quantized weight gradients' epilogue: the tile ``acc`` of ``out[e] [M, N]`` as fp32 times
    ``sl[e] [M]`` then ``sr[e] [N]`` (``LEFT_SCALE_FIRST``) or ``sr`` then ``sl`` (the gradient side's
    scales first, as the reference does), stored rounded to nearest even."""
    sl = tl.load(sl_ptr + e.to(tl.int64) * M + offs_m, mask=m_mask, other=0.0)
    sr = tl.load(sr_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    res = acc.to(tl.float32)
    if LEFT_SCALE_FIRST:
        res = res * sl[:, None]
        res = res * sr[None, :]
    else:
        res = res * sr[None, :]
        res = res * sl[:, None]
    out_ptrs = out_ptr + e.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=m_mask[:, None] & n_mask[None, :])


# ---------------------------------------------------------------- the launch preamble
#: Row-tile programs per expert, as a multiple of the fair share ``R / NR`` rows: routing up to this
#: imbalanced runs fully parallel; an expert with more rows loops (grid-stride) over its extra tiles.
ROW_SLACK = 2


def row_programs(R: int, num_experts: int, block_m: int) -> int:
    return max(1, triton.cdiv(ROW_SLACK * triton.cdiv(R, num_experts), block_m))


def row_grid(R: int, N: int, NR: int) -> Callable[[dict[str, Any]], tuple[int, int, int]]:
    """The row GEMMs' grid ``(row programs, ceil(N/BLOCK_N), NR)`` of a config's tile sizes."""
    return lambda meta: (row_programs(R, NR, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), NR)


def tile_grid(M: int, N: int, NR: int) -> Callable[[dict[str, Any]], tuple[int, int, int]]:
    """The weight gradients' grid ``(ceil(M/BLOCK_M), ceil(N/BLOCK_N), NR)``: one program per tile of
    each expert's ``dW_e [M, N]``."""
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), NR)


def quantized_grouped_mm(kernel, key: str, qa: torch.Tensor, sa: torch.Tensor, idx: torch.Tensor | None,  # noqa: ANN001
                         qw: torch.Tensor, sw: torch.Tensor | None, cum_token_counts: torch.Tensor, out: torch.Tensor,
                         trans_w: bool) -> torch.Tensor:
    """The launch the int8 and fp8 grouped GEMMs share (their codes checked by the caller): ``kernel``
    (``(qa, sa, idx, w, sw, cum, out, N, K)`` with ``TRANS_W``, ``GATHER``, ``HAS_SW``) over the grid
    ``(row programs, ceil(N/BLOCK_N), NR)`` with the config ``key``'s timed choice; nothing runs for an
    empty product."""
    NR = qw.shape[0]
    N, K = (qw.shape[1], qw.shape[2]) if trans_w else (qw.shape[2], qw.shape[1])
    R = out.shape[0]
    if R == 0 or N == 0 or qa.shape[0] == 0:
        return out
    qa, qw, sa = qa.contiguous(), qw.contiguous(), sa.float().contiguous()
    dev = out.device
    args = (qa, sa, idx if idx is not None else cum_token_counts, qw, sw if sw is not None else sa,
            cum_token_counts, out, N, K)
    timed_launch(kernel, key, table_for(dev), (N, K, R, NR), row_grid(R, N, NR), args, dev, dtype=qa.dtype,
                 TRANS_W=trans_w, GATHER=idx is not None, HAS_SW=sw is not None)
    return out


def quantized_wgrad(kernel, key: str, ql: torch.Tensor, sl: torch.Tensor, qr: torch.Tensor, sr: torch.Tensor,  # noqa: ANN001
                    bounds: torch.Tensor, out: torch.Tensor, rows: int, *extra: Any, **constexprs: Any) -> torch.Tensor:
    """The launch the int8 and fp8 weight gradients share (their operands checked by the caller):
    ``kernel`` (``(ql, sl, qr, sr, bounds, out, M, N, *extra)``) over one program per tile of each
    expert's ``out[e] [M, N]``, with the config ``key``'s timed choice keyed on the weight's
    ``(M, N)`` and the ``rows`` reduced over; nothing runs for an empty ``out``, zeros without rows."""
    NR, M, N = out.shape
    if out.numel() == 0:
        return out
    if rows == 0:
        return out.zero_()
    ql, qr = ql.contiguous(), qr.contiguous()
    sl, sr = sl.float().contiguous(), sr.float().contiguous()
    dev = out.device
    timed_launch(kernel, key, table_for(dev), (N, M, rows, NR), tile_grid(M, N, NR),
                 (ql, sl, qr, sr, bounds, out, M, N, *extra), dev, dtype=ql.dtype, **constexprs)
    return out

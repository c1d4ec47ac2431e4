"""The int8 grouped GEMMs in Triton: ``tl.dot`` on int8 codes accumulating in int32, dequantized in the epilogue.

Two kernels: :func:`int8_grouped_mm` (the forward and input-gradient GEMMs, rows of each expert
times its weight) and :func:`int8_grouped_wgrad` (the weight gradients, a contraction over each
expert's rows).

``out[r] = (sa[src(r)] * sw_e) * (qa[src(r)] @ B_e)`` for the rows r of each expert e (rows
``cum_token_counts[e] .. cum_token_counts[e+1]``), with ``src(r) = idx[r]`` when ``GATHER`` (the
gate/up forward reads the token rows ``x[input_indices]`` inside the A loads) else ``r``.
``TRANS_W``: ``B_e = W_e^T`` with ``W [NR, N, K]`` (the forward: the weight read in place along its
contiguous K); else ``B_e = W_e`` with ``W [NR, K, N]`` (the input gradient). ``HAS_SW``: one fp32
scale per output column and expert ``sw [NR, N]`` (the weight's per-output-channel scales); without
it only the row scales apply (the input gradient, whose column scales were folded into its rows).

The integer sums are exact (``|sum| <= K * 127^2`` fits int32 for K below 133,000); the epilogue
converts them to fp32 (round to nearest), multiplies by the row scale, then by the column scale,
and stores in the output's dtype: the order of :func:`..quantized.core.qmm` and of the reference
(:mod:`..quantized.reference`), so the results are the same bits. The grid and the row-tile loop
are those of :mod:`.grouped_gemm` (expert on axis 2, device-side row counts, no host read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import table_for, CONFIGS
from .common import expert_rows, tile
from .gemm_family import dot_k_loop, quantized_grouped_mm, quantized_row_tiles, quantized_wgrad, scaled_weight_grad_store

#: The config key of :func:`int8_grouped_mm` in ``configs.py``.
KERNEL = "int8_grouped_mm"
#: The config key of :func:`int8_grouped_wgrad` in ``configs.py``.
WGRAD_KERNEL = "int8_grouped_wgrad"


@triton.jit
def _int8_grouped_mm_kernel(a_ptr, sa_ptr, idx_ptr, w_ptr, sw_ptr, cum_token_ptr, out_ptr, N, K,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            TRANS_W: tl.constexpr, GATHER: tl.constexpr, HAS_SW: tl.constexpr):
    """Grid ``(P, ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns row tiles ``m, m + P, ...`` of
    expert e and output columns ``[n*BLOCK_N, (n+1)*BLOCK_N)``. Reads ``qa [rows, K]`` int8, ``sa
    [rows]`` fp32, ``idx [R]`` int32 (``GATHER``), ``W`` int8, ``sw [NR, N]`` fp32 (``HAS_SW``),
    ``cum_token_counts [NR+1]`` int32; writes ``out [R, N]`` (its dtype) for the experts' rows only.
    The body is the family's (:func:`.gemm_family.quantized_row_tiles`), on int8 codes summed in int32.
    """
    quantized_row_tiles(a_ptr, sa_ptr, idx_ptr, w_ptr, sw_ptr, cum_token_ptr, out_ptr, N, K, BLOCK_M, BLOCK_N,
                        BLOCK_K, TRANS_W, GATHER, HAS_SW, "int8", False)


@triton.jit
def _int8_grouped_wgrad_kernel(l_ptr, sl_ptr, r_ptr, sr_ptr, cum_token_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEFT_SCALE_FIRST: tl.constexpr):
    """The weight gradient ``out[e] = (ql_e^T @ qr_e) * sl[e][:, None] * sr[e][None, :]`` over the
    rows ``cum_token_counts[e] .. cum_token_counts[e+1]`` of expert e.

    Grid ``(ceil(M/BLOCK_M), ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns that tile of
    ``out[e]`` and reduces over all of expert e's rows, ``BLOCK_K`` at a time, in int32 (an empty
    expert's tile is written as zeros). Reads ``ql [rows, M]`` and ``qr [rows, N]`` int8 (each
    column's codes quantized over its expert's rows), ``sl [NR, M]`` and ``sr [NR, N]`` fp32,
    ``cum_token_counts [NR+1]`` int32; writes ``out [NR, M, N]`` (its dtype). The epilogue converts
    the sums to fp32 and multiplies by ``sl`` then ``sr`` (``LEFT_SCALE_FIRST``) or ``sr`` then
    ``sl``: the gradient side's scales first, as the reference does, in either weight layout.
    """
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    row0 = row_start.to(tl.int64)
    offs_m, m_mask = tile(tl.program_id(0), BLOCK_M, M)
    offs_n, n_mask = tile(tl.program_id(1), BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    lt_ptrs = l_ptr + (row0 + offs_k[None, :]) * M + offs_m[:, None]  # ql_e^T tile [BLOCK_M, BLOCK_K]
    r_ptrs = r_ptr + (row0 + offs_k[:, None]) * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    acc = dot_k_loop(acc, lt_ptrs, BLOCK_K * M, r_ptrs, BLOCK_K * N, m_mask, n_mask, offs_k, n_rows, BLOCK_K, "int8",
                     "ieee", False)
    scaled_weight_grad_store(acc, out_ptr, sl_ptr, sr_ptr, e, M, N, offs_m, offs_n, m_mask, n_mask, LEFT_SCALE_FIRST)


def available(device: torch.device) -> bool:
    """Whether the config table of ``device`` has these kernels (cuda, hip, xpu and the interpreter)."""
    table = CONFIGS[table_for(device)]
    return KERNEL in table and WGRAD_KERNEL in table


def int8_grouped_mm(qa: torch.Tensor, sa: torch.Tensor, idx: torch.Tensor | None, qw: torch.Tensor,
                    sw: torch.Tensor | None, cum_token_counts: torch.Tensor, out: torch.Tensor,
                    trans_w: bool) -> torch.Tensor:
    """Writes ``out[r] = sa[src(r)] * sw[e] * (qa[src(r)] @ B_e)`` for every expert row r (rows past
    ``cum_token_counts[-1]`` untouched) and returns ``out``. ``qa [rows, K]`` int8 contiguous, ``sa
    [rows]`` fp32, ``idx`` the gathered source rows (None: ``src(r) = r``), ``qw`` int8 ``[NR, N, K]``
    (``trans_w``) or ``[NR, K, N]``, ``sw [NR, N]`` fp32 or None, ``out [R, N]`` contiguous."""
    N, K = (qw.shape[1], qw.shape[2]) if trans_w else (qw.shape[2], qw.shape[1])
    if qa.dtype != torch.int8 or qw.dtype != torch.int8 or qa.shape[-1] != K or out.shape[1] != N:
        raise ValueError(f"int8_grouped_mm: codes {qa.dtype} {tuple(qa.shape)} and {qw.dtype} {tuple(qw.shape)} "
                         f"do not fit out {tuple(out.shape)} (trans_w={trans_w})")
    return quantized_grouped_mm(_int8_grouped_mm_kernel, KERNEL, qa, sa, idx, qw, sw, cum_token_counts, out, trans_w)


def int8_grouped_wgrad(ql: torch.Tensor, sl: torch.Tensor, qr: torch.Tensor, sr: torch.Tensor,
                       cum_token_counts: torch.Tensor, out: torch.Tensor, left_scale_first: bool = True) -> torch.Tensor:
    """Writes ``out[e] = (ql_e^T @ qr_e) * sl[e][:, None] * sr[e][None, :]`` for every expert e (its
    rows ``cum_token_counts[e] .. cum_token_counts[e+1]`` of ``ql [rows, M]`` and ``qr [rows, N]``,
    int8; zero for an empty expert) and returns ``out [NR, M, N]``. ``sl [NR, M]``, ``sr [NR, N]``
    fp32; ``left_scale_first``: the epilogue multiplies by ``sl`` before ``sr`` (else after). The
    expert bounds are read on the device."""
    NR, M, N = out.shape
    if (ql.dtype != torch.int8 or qr.dtype != torch.int8 or ql.dim() != 2 or qr.dim() != 2
            or ql.shape != (qr.shape[0], M) or qr.shape[1] != N or sl.shape != (NR, M) or sr.shape != (NR, N)
            or cum_token_counts.numel() != NR + 1):
        raise ValueError(f"int8_grouped_wgrad: codes {ql.dtype} {tuple(ql.shape)} and {qr.dtype} {tuple(qr.shape)}, "
                         f"scales {tuple(sl.shape)} and {tuple(sr.shape)} do not fit out {tuple(out.shape)} "
                         f"over {cum_token_counts.numel() - 1} experts")
    return quantized_wgrad(_int8_grouped_wgrad_kernel, WGRAD_KERNEL, ql, sl, qr, sr, cum_token_counts, out, ql.shape[0],
                           LEFT_SCALE_FIRST=left_scale_first)

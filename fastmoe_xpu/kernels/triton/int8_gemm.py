"""The int8 grouped GEMM in Triton: ``tl.dot`` on int8 codes accumulating in int32, dequantized in the epilogue.

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
from . import autotune
from . import launch as _launch
from .grouped_gemm import _row_programs

#: The config key of :func:`int8_grouped_mm` in ``configs.py``.
KERNEL = "int8_grouped_mm"


@triton.jit
def _int8_grouped_mm_kernel(
    a_ptr,
    sa_ptr,
    idx_ptr,
    w_ptr,
    sw_ptr,
    cum_token_ptr,
    out_ptr,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TRANS_W: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_SW: tl.constexpr,
):
    """Grid ``(P, ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns row tiles ``m, m + P, ...`` of
    expert e and output columns ``[n*BLOCK_N, (n+1)*BLOCK_N)``. Reads ``qa [rows, K]`` int8, ``sa
    [rows]`` fp32, ``idx [R]`` int32 (``GATHER``), ``W`` int8, ``sw [NR, N]`` fp32 (``HAS_SW``),
    ``cum_token_counts [NR+1]`` int32; writes ``out [R, N]`` (its dtype) for the experts' rows only.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2)
    row_start = tl.load(cum_token_ptr + e)
    n_rows = tl.load(cum_token_ptr + e + 1) - row_start
    row0 = row_start.to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * N * K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    out_ty = out_ptr.dtype.element_ty
    if HAS_SW:
        sw = tl.load(sw_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    for tile_m in range(pid_m, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < n_rows
        rows = row0 + offs_m
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=m_mask, other=0).to(tl.int64)
        else:
            src = rows
        sa = tl.load(sa_ptr + src, mask=m_mask, other=0.0)
        a_ptrs = a_ptr + src[:, None] * K + offs_k[None, :]
        if TRANS_W:
            b_ptrs = w_e + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
            b_step = BLOCK_K
        else:
            b_ptrs = w_e + offs_k[:, None].to(tl.int64) * N + offs_n[None, :]
            b_step = BLOCK_K * N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # explicit: triton 3.6 takes fp32 as the default
            a_ptrs += BLOCK_K
            b_ptrs += b_step
        res = acc.to(tl.float32) * sa[:, None]
        if HAS_SW:
            res = res * sw[None, :]
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], res.to(out_ty, fp_downcast_rounding="rtne"), mask=m_mask[:, None] & n_mask[None, :])


def available(device: torch.device) -> bool:
    """Whether the config table of ``device`` has this kernel (cuda, hip and the interpreter)."""
    return KERNEL in CONFIGS[table_for(device)]


def int8_grouped_mm(qa: torch.Tensor, sa: torch.Tensor, idx: torch.Tensor | None, qw: torch.Tensor,
                    sw: torch.Tensor | None, cum_token_counts: torch.Tensor, out: torch.Tensor,
                    trans_w: bool) -> torch.Tensor:
    """Writes ``out[r] = sa[src(r)] * sw[e] * (qa[src(r)] @ B_e)`` for every expert row r (rows past
    ``cum_token_counts[-1]`` untouched) and returns ``out``. ``qa [rows, K]`` int8 contiguous, ``sa
    [rows]`` fp32, ``idx`` the gathered source rows (None: ``src(r) = r``), ``qw`` int8 ``[NR, N, K]``
    (``trans_w``) or ``[NR, K, N]``, ``sw [NR, N]`` fp32 or None, ``out [R, N]`` contiguous."""
    NR = qw.shape[0]
    N, K = (qw.shape[1], qw.shape[2]) if trans_w else (qw.shape[2], qw.shape[1])
    R = out.shape[0]
    if qa.dtype != torch.int8 or qw.dtype != torch.int8 or qa.shape[-1] != K or out.shape[1] != N:
        raise ValueError(f"int8_grouped_mm: codes {qa.dtype} {tuple(qa.shape)} and {qw.dtype} {tuple(qw.shape)} "
                         f"do not fit out {tuple(out.shape)} (trans_w={trans_w})")
    if R == 0 or N == 0 or qa.shape[0] == 0:
        return out
    qa, qw, sa = qa.contiguous(), qw.contiguous(), sa.float().contiguous()
    dev = out.device
    table = table_for(dev)

    def go(cfg):
        grid = (_row_programs(R, NR, cfg.meta["BLOCK_M"]), triton.cdiv(N, cfg.meta["BLOCK_N"]), NR)
        _launch.launch(
            _int8_grouped_mm_kernel, grid,
            (qa, sa, idx if idx is not None else cum_token_counts, qw, sw if sw is not None else sa,
             cum_token_counts, out, N, K), cfg, dev,
            TRANS_W=trans_w, GATHER=idx is not None, HAS_SW=sw is not None,
        )

    go(autotune.choose(KERNEL, table, N, K, R, NR, dev, go))
    return out

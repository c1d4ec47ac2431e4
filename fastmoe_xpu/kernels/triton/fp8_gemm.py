"""The fp8 grouped GEMMs in Triton: ``tl.dot`` on fp8 codes accumulating in fp32, the scales applied in the epilogue.

The fp8 twin of :mod:`.int8_gemm`: the same two kernels, the same grid, the same device-side expert
bounds (no host read), only the operands' storage and the accumulation differ.

* :func:`fp8_grouped_mm` (the forward and input-gradient GEMMs): ``out[r] = (sa[src(r)] * sw_e) *
  (qa[src(r)] @ B_e)`` for the rows r of each expert e (rows ``cum_token_counts[e] ..
  cum_token_counts[e+1]``), ``src(r) = idx[r]`` when ``GATHER`` (the gate/up forward reads the
  token rows' codes ``qx[input_indices]`` inside the A loads) else ``r``. ``TRANS_W``: ``B_e =
  W_e^T`` with ``W [NR, N, K]`` (the forward: the weight codes read along their contiguous K); else
  ``B_e = W_e`` with ``W [NR, K, N]``. ``HAS_SW``: one fp32 scale per output column and expert
  (the weight's per-output-channel scales).
* :func:`fp8_grouped_wgrad` (the weight gradients): ``out[e] = (ql_e^T @ qr_e) * sl[e][:, None] *
  sr[e][None, :]``, a contraction over each expert's rows with per-column scales over those rows.
  Unlike int8's, its codes are stored by column (``[M, LD]`` and ``[N, LD]``), each expert's rows
  starting at a multiple of 16 with zero codes up to the next: both ``tl.dot`` tiles are then
  contiguous along the contracted rows and aligned, which Hopper's fp8 ``wgmma`` needs to take them
  from shared memory as they are (K-major), copied there asynchronously (``cp.async``, pipelined);
  row-major codes would be transposed through registers on every k-step instead.

Operands: the forward's activations and weights in ``float8_e4m3fn``, the gradients in
``float8_e5m2``; a dot may mix the two (the input gradient multiplies e5m2 gradient codes by the
e4m3 weight codes, the weight gradient e5m2 by e4m3), which Hopper's ``wgmma`` and Ada's ``mma``
take directly.

Accumulation: fp32. On sm_90 the fp8 ``wgmma`` adds its products with fewer than fp32's bits
(Triton's default there, ``max_num_imprecise_acc = 2**30``, never leaves the tensor core), so the
kernels pass ``max_num_imprecise_acc = BLOCK_K``: each k-step's partial product (at most
``BLOCK_K`` = 128 terms on the GPU tables, the interval DeepSeek-V3 promotes at) is added to the
fp32 accumulator by the CUDA cores. The epilogue multiplies the fp32 sums by the row scale, then
by the column scale, and stores in the output's dtype (rounding to nearest even): the order of
:func:`..quantized.core.qmm` and of :mod:`..quantized.reference`, whose float64 product of the same
codes the results match to fp32 summation order.

Every row index is widened to int64 before it multiplies a stride, so no offset wraps past 2**31
elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import table_for, CONFIGS
from ..quantized.core import ROW_ALIGN
from . import autotune
from . import launch as _launch
from .common import expert_rows, tile, weight_tile_ptrs
from .grouped_gemm import _row_programs

#: The config key of :func:`fp8_grouped_mm` in ``configs.py``.
KERNEL = "fp8_grouped_mm"
#: The config key of :func:`fp8_grouped_wgrad` in ``configs.py``.
WGRAD_KERNEL = "fp8_grouped_wgrad"
#: The storage dtypes the kernels take.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _fp8_grouped_mm_kernel(
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
    expert e and output columns ``[n*BLOCK_N, (n+1)*BLOCK_N)``. Reads ``qa [rows, K]`` fp8, ``sa
    [rows]`` fp32, ``idx [R]`` int32 (``GATHER``), ``W`` fp8, ``sw [NR, N]`` fp32 (``HAS_SW``),
    ``cum_token_counts [NR+1]`` int32; writes ``out [R, N]`` (its dtype) for the experts' rows only.
    """
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    row0 = row_start.to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * N * K
    offs_n, n_mask = tile(tl.program_id(1), BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    out_ty = out_ptr.dtype.element_ty
    if HAS_SW:
        sw = tl.load(sw_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
            a_ptrs += BLOCK_K
            b_ptrs += b_step
        res = acc * sa[:, None]
        if HAS_SW:
            res = res * sw[None, :]
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], res.to(out_ty, fp_downcast_rounding="rtne"),
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8_grouped_wgrad_kernel(
    l_ptr,
    sl_ptr,
    r_ptr,
    sr_ptr,
    pcum_ptr,
    out_ptr,
    M,
    N,
    LD,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    LEFT_SCALE_FIRST: tl.constexpr,
):
    """The weight gradient ``out[e] = (ql_e^T @ qr_e) * sl[e][:, None] * sr[e][None, :]`` over
    expert e's block of rows.

    The codes are stored transposed, ``ql [M, LD]`` and ``qr [N, LD]`` (column c's codes contiguous
    along the rows), expert e's block at columns ``pcum[e] .. pcum[e+1]`` (``pcum [NR+1]`` int32,
    every bound a multiple of ``ROW_ALIGN``; the codes past the expert's rows up to its block's end
    are zeros). So both ``tl.dot`` tiles are contiguous along the contracted rows and start at
    aligned addresses: Hopper's fp8 ``wgmma`` takes them from shared memory as they are, copied
    there asynchronously.

    Grid ``(ceil(M/BLOCK_M), ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns that tile of
    ``out[e]`` and reduces over expert e's block, ``BLOCK_K`` at a time, in fp32 (an empty block
    writes zeros). ``sl [NR, M]`` and ``sr [NR, N]`` fp32; writes ``out [NR, M, N]`` (its dtype).
    The epilogue multiplies the fp32 sums by ``sl`` then ``sr`` (``LEFT_SCALE_FIRST``) or ``sr``
    then ``sl``: the gradient side's scales first, as the reference does, in either weight layout.
    """
    e = tl.program_id(2)
    start = tl.multiple_of(tl.load(pcum_ptr + e), ROW_ALIGN)
    length = tl.multiple_of(tl.load(pcum_ptr + e + 1) - start, ROW_ALIGN)
    row0 = start.to(tl.int64)
    offs_m, m_mask = tile(tl.program_id(0), BLOCK_M, M)
    offs_n, n_mask = tile(tl.program_id(1), BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    lt_ptrs = l_ptr + offs_m[:, None].to(tl.int64) * LD + (row0 + offs_k[None, :])  # ql_e^T [BLOCK_M, BLOCK_K]
    r_ptrs = r_ptr + offs_n[None, :].to(tl.int64) * LD + (row0 + offs_k[:, None])  # qr_e [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        k_mask = offs_k < length - k0
        a = tl.load(lt_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(r_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        lt_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
    sl = tl.load(sl_ptr + e.to(tl.int64) * M + offs_m, mask=m_mask, other=0.0)
    sr = tl.load(sr_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    res = acc
    if LEFT_SCALE_FIRST:
        res = res * sl[:, None]
        res = res * sr[None, :]
    else:
        res = res * sr[None, :]
        res = res * sl[:, None]
    out_ptrs = out_ptr + e.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=m_mask[:, None] & n_mask[None, :])


def available(device: torch.device) -> bool:
    """Whether these kernels run on ``device``: its config table has them (cuda and the interpreter;
    gfx942's fp8 is another encoding and PVC has no fp8 dot) and, on NVIDIA, the GPU has fp8 tensor
    cores (sm_89 or newer)."""
    dev = torch.device(device)
    table = CONFIGS[table_for(dev)]
    if KERNEL not in table or WGRAD_KERNEL not in table:
        return False
    if dev.type == "cuda":
        return torch.cuda.get_device_capability(dev) >= (8, 9)
    return True


def _check_codes(what: str, *codes: torch.Tensor) -> None:
    for c in codes:
        if c.dtype not in FP8_DTYPES:
            raise ValueError(f"{what}: codes must be float8_e4m3fn or float8_e5m2, got {c.dtype}")


def fp8_grouped_mm(qa: torch.Tensor, sa: torch.Tensor, idx: torch.Tensor | None, qw: torch.Tensor,
                   sw: torch.Tensor | None, cum_token_counts: torch.Tensor, out: torch.Tensor,
                   trans_w: bool) -> torch.Tensor:
    """Writes ``out[r] = sa[src(r)] * sw[e] * (qa[src(r)] @ B_e)`` for every expert row r (rows past
    ``cum_token_counts[-1]`` untouched) and returns ``out``. ``qa [rows, K]`` fp8, ``sa [rows]``
    fp32, ``idx`` the gathered source rows (None: ``src(r) = r``), ``qw`` fp8 ``[NR, N, K]``
    (``trans_w``) or ``[NR, K, N]``, ``sw [NR, N]`` fp32 or None, ``out [R, N]`` contiguous."""
    NR = qw.shape[0]
    N, K = (qw.shape[1], qw.shape[2]) if trans_w else (qw.shape[2], qw.shape[1])
    R = out.shape[0]
    _check_codes("fp8_grouped_mm", qa, qw)
    if qa.dim() != 2 or qa.shape[-1] != K or out.shape[1] != N:
        raise ValueError(f"fp8_grouped_mm: codes {tuple(qa.shape)} and {tuple(qw.shape)} do not fit out "
                         f"{tuple(out.shape)} (trans_w={trans_w})")
    if R == 0 or N == 0 or qa.shape[0] == 0:
        return out
    qa, qw, sa = qa.contiguous(), qw.contiguous(), sa.float().contiguous()
    dev = out.device
    table = table_for(dev)

    def go(cfg):
        grid = (_row_programs(R, NR, cfg.meta["BLOCK_M"]), triton.cdiv(N, cfg.meta["BLOCK_N"]), NR)
        _launch.launch(
            _fp8_grouped_mm_kernel, grid,
            (qa, sa, idx if idx is not None else cum_token_counts, qw, sw if sw is not None else sa,
             cum_token_counts, out, N, K), cfg, dev,
            TRANS_W=trans_w, GATHER=idx is not None, HAS_SW=sw is not None,
        )

    go(autotune.choose(KERNEL, table, N, K, R, NR, dev, go))
    return out


def fp8_grouped_wgrad(ql: torch.Tensor, sl: torch.Tensor, qr: torch.Tensor, sr: torch.Tensor,
                      padded_cum: torch.Tensor, out: torch.Tensor, left_scale_first: bool = True) -> torch.Tensor:
    """Writes ``out[e] = (ql_e^T @ qr_e) * sl[e][:, None] * sr[e][None, :]`` for every expert e and
    returns ``out [NR, M, N]``. ``ql [M, LD]`` and ``qr [N, LD]`` fp8 contiguous: the codes by column,
    expert e's rows at ``padded_cum[e] ..`` and zeros up to ``padded_cum[e+1]``, every bound a
    multiple of :data:`..quantized.core.ROW_ALIGN` (what
    :func:`..quantized.core.quantize_cols_grouped_t` writes, with
    :func:`..quantized.core.padded_bounds`); zero for an empty expert. ``sl [NR, M]``, ``sr [NR, N]``
    fp32; ``left_scale_first``: the epilogue multiplies by ``sl`` before ``sr`` (else after). The
    expert bounds are read on the device."""
    NR, M, N = out.shape
    _check_codes("fp8_grouped_wgrad", ql, qr)
    if (ql.dim() != 2 or qr.dim() != 2 or ql.shape[0] != M or qr.shape != (N, ql.shape[1])
            or ql.shape[1] % ROW_ALIGN or sl.shape != (NR, M) or sr.shape != (NR, N)
            or padded_cum.numel() != NR + 1):
        raise ValueError(f"fp8_grouped_wgrad: codes {tuple(ql.shape)} and {tuple(qr.shape)} (by column, rows a "
                         f"multiple of {ROW_ALIGN}), scales {tuple(sl.shape)} and {tuple(sr.shape)} do not fit out "
                         f"{tuple(out.shape)} over {padded_cum.numel() - 1} experts")
    if out.numel() == 0:
        return out
    ld = ql.shape[1]
    if ld == 0:
        return out.zero_()
    ql, qr = ql.contiguous(), qr.contiguous()
    sl, sr = sl.float().contiguous(), sr.float().contiguous()
    dev = out.device
    table = table_for(dev)

    def go(cfg):
        grid = (triton.cdiv(M, cfg.meta["BLOCK_M"]), triton.cdiv(N, cfg.meta["BLOCK_N"]), NR)
        _launch.launch(_fp8_grouped_wgrad_kernel, grid, (ql, sl, qr, sr, padded_cum, out, M, N, ld), cfg, dev,
                       ROW_ALIGN=ROW_ALIGN, LEFT_SCALE_FIRST=left_scale_first)

    # Keyed on the weight's (M, N) and the rows reduced over per expert.
    go(autotune.choose(WGRAD_KERNEL, table, N, M, ld, NR, dev, go))
    return out

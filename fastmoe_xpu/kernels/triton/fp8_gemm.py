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

import math

import torch
import triton
import triton.language as tl

from ..configs import CONFIGS, QUANTIZED_ROW_ALIGN as ROW_ALIGN, table_for
from . import launch as _launch
from .common import gate_up_halves, grouped_rows, inverse_scale, line_values, silu, tile, to_float, to_fp8
from .gemm_family import dot_k_loop, quantized_grouped_mm, quantized_row_tiles, quantized_wgrad, scaled_weight_grad_store

#: The config key of :func:`fp8_grouped_mm` in ``configs.py``.
KERNEL = "fp8_grouped_mm"
#: The config key of :func:`fp8_grouped_wgrad` in ``configs.py``.
WGRAD_KERNEL = "fp8_grouped_wgrad"
#: The storage dtypes the kernels take.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _fp8_grouped_mm_kernel(a_ptr, sa_ptr, idx_ptr, w_ptr, sw_ptr, cum_token_ptr, out_ptr, N, K,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TRANS_W: tl.constexpr,
                           GATHER: tl.constexpr, HAS_SW: tl.constexpr, OVERLAP: tl.constexpr = False):
    """Grid ``(P, ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns row tiles ``m, m + P, ...`` of
    expert e and output columns ``[n*BLOCK_N, (n+1)*BLOCK_N)``. Reads ``qa [rows, K]`` fp8, ``sa
    [rows]`` fp32, ``idx [R]`` int32 (``GATHER``), ``W`` fp8, ``sw [NR, N]`` fp32 (``HAS_SW``),
    ``cum_token_counts [NR+1]`` int32; writes ``out [R, N]`` (its dtype) for the experts' rows only.
    ``OVERLAP``: each k-step's ``tl.dot`` starts from zero into a second accumulator and the previous
    k-step's partial is added to ``acc`` after it is issued, so the fp32 additions run beside the
    tensor cores instead of after them; the same partial sums added in the same order as
    ``max_num_imprecise_acc = BLOCK_K`` does, hence the same result. The body is the family's
    (:func:`.gemm_family.quantized_row_tiles`).
    """
    quantized_row_tiles(a_ptr, sa_ptr, idx_ptr, w_ptr, sw_ptr, cum_token_ptr, out_ptr, N, K, BLOCK_M, BLOCK_N,
                        BLOCK_K, TRANS_W, GATHER, HAS_SW, "fp8", OVERLAP)


@triton.jit
def _fp8_grouped_wgrad_kernel(l_ptr, sl_ptr, r_ptr, sr_ptr, pcum_ptr, out_ptr, M, N, LD, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_ALIGN: tl.constexpr,
                              LEFT_SCALE_FIRST: tl.constexpr, OVERLAP: tl.constexpr = False):
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
    ``OVERLAP``: as in :func:`_fp8_grouped_mm_kernel`.
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
    acc = dot_k_loop(acc, lt_ptrs, BLOCK_K, r_ptrs, BLOCK_K, m_mask, n_mask, offs_k, length, BLOCK_K, "fp8", "ieee",
                     OVERLAP)
    scaled_weight_grad_store(acc, out_ptr, sl_ptr, sr_ptr, e, M, N, offs_m, offs_n, m_mask, n_mask, LEFT_SCALE_FIRST)


# ---------------------------------------------------------------- the quantization and row passes
# (config keys ``fp8q_*``): the operands of the GEMMs above made from the layer's tensors in one
# Triton pass each, with no fp32 copy of a whole tensor and no host read.

@triton.jit
def _fp8q_rows_kernel(
    v_ptr,
    idx_ptr,
    cs_ptr,
    cum_token_ptr,
    q_ptr,
    s_ptr,
    C,
    L,
    NR,
    QMAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    COLS: tl.constexpr,
    HAS_CS: tl.constexpr,
    ROUTED_ONLY: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GATHER: tl.constexpr = False,
):
    """Per-line quantization: ``v`` holds B blocks of C lines of L values, one fp32 scale per line
    (``amax / qmax``, ``s [B, C]``) and codes ``round(v * qmax / amax)`` (``q``, v's layout). A line is
    a row of ``v [B, C, L]`` or (``COLS``) a column of ``v [B, L, C]``: the weights quantized per
    output channel in either stored layout, the activations per row. ``HAS_CS`` (rows): each row r
    is first multiplied by its expert's column scales ``cs [NR, L]`` (fp32), the expert found from
    ``cum_token_counts [NR+1]`` on the device (rows past RT: the last expert's), as the input
    gradients need (``dy * s(W)``). ``ROUTED_ONLY`` (rows): programs past RT exit (their rows'
    codes are unspecified). Two sweeps over each line: the amax, then the codes (the same fp32
    operations as :func:`..quantized.core.quantize_rows`, so the same codes and scales). ``GATHER``
    (rows, B = 1): line c is the row ``v[idx[c]]`` of ``v [T, L]`` (``idx [C]`` int32; the down
    backward's output-gradient rows read by token, no ``[R, L]`` copy), its codes at row c of ``q [C, L]``;
    else ``idx_ptr`` is not read.

    Grid ``(ceil(C/BLOCK_C), B)``."""
    b = tl.program_id(1).to(tl.int64)
    offs_c, c_mask = tile(tl.program_id(0), BLOCK_C, C)
    if ROUTED_ONLY:
        c_mask = c_mask & (offs_c < tl.load(cum_token_ptr + NR))
    if COLS:
        base = b * C * L + offs_c.to(tl.int64)[:, None]
        step = C
    elif GATHER:
        src = tl.load(idx_ptr + offs_c, mask=c_mask, other=0).to(tl.int64)
        base = src[:, None] * L
        step = 1
        dst = offs_c.to(tl.int64)[:, None] * L - base  # the codes' offset from the values'
    else:
        base = b * C * L + offs_c.to(tl.int64)[:, None] * L
        step = 1
    offs_l = tl.arange(0, BLOCK_L)
    if HAS_CS:
        below = tl.zeros((BLOCK_C,), dtype=tl.int32)
        for e0 in range(0, NR, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            bound = tl.load(cum_token_ptr + 1 + offs_e, mask=offs_e < NR, other=2147483647)
            below += tl.sum((bound[None, :] <= offs_c[:, None]).to(tl.int32), axis=1)
        cs_rows = cs_ptr + tl.minimum(below, NR - 1).to(tl.int64)[:, None] * L
    else:
        cs_rows = cs_ptr  # not read
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        v, at, mask = line_values(v_ptr, base, step, l0 + offs_l, c_mask, L, cs_rows, HAS_CS)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    inv, scale = inverse_scale(amax, QMAX)
    tl.store(s_ptr + b * C + offs_c, scale, mask=c_mask)
    code_ty = q_ptr.dtype.element_ty
    for l0 in range(0, L, BLOCK_L):
        v, at, mask = line_values(v_ptr, base, step, l0 + offs_l, c_mask, L, cs_rows, HAS_CS)
        if GATHER:
            at = at + dst
        tl.store(q_ptr + at, to_fp8(v * inv[:, None], code_ty, MANT, MIN_EXP, ROUND_FIRST), mask=mask)


@triton.jit
def _fp8q_cols_kernel(
    v_ptr,
    idx_ptr,
    rw_ptr,
    cum_token_ptr,
    pcum_ptr,
    q_ptr,
    s_ptr,
    N,
    LD,
    NR,
    stride_v,
    QMAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    GATHER: tl.constexpr,
    SILU: tl.constexpr,
    ROW_W: tl.constexpr,
    WRITE_PCUM: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The weight gradient's operand (:func:`fp8_grouped_wgrad`): the rows of each expert quantized
    per column over that expert's rows, the codes stored by column. Writes ``q [N, LD]`` (expert e's
    codes at ``pcum[e] ..``, zeros to ``pcum[e+1]`` and from ``pcum[NR]`` to ``LD``) and ``s [NR, N]``
    fp32 (zero for an empty expert): what :func:`..quantized.core.quantize_cols_grouped_t` computes
    with eight passes over fp32 copies and atomics, here two sweeps over each expert's rows (the
    amax, then the codes), the rows read as :func:`.common.grouped_rows` describes. The blocks'
    bounds ``pcum`` (:func:`..quantized.core.padded_bounds`: each expert's row count rounded up to
    ``ROW_ALIGN``, back to back) are summed here from ``cum_token_counts [NR+1]``, ``BLOCK_E``
    experts at a time; ``WRITE_PCUM``: stored to ``pcum [NR+1]`` int32 for the GEMM.

    Grid ``(ceil(N/BLOCK_N), NR + 1)``: program ``(n, e)`` owns columns ``[n*BLOCK_N, (n+1)*BLOCK_N)``
    of expert e; the programs ``e = NR`` write the zeros past the last block."""
    e = tl.program_id(1)
    is_expert = e < NR
    ec = tl.minimum(e, NR - 1)
    row0 = tl.load(cum_token_ptr + ec)
    n_rows = tl.where(is_expert, tl.load(cum_token_ptr + ec + 1) - row0, 0)
    p0 = 0
    for e0 in range(0, NR, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        before = offs_e < e  # (e <= NR)
        lo = tl.load(cum_token_ptr + offs_e, mask=before, other=0)
        hi = tl.load(cum_token_ptr + offs_e + 1, mask=before, other=0)
        p0 += tl.sum((hi - lo + (ROW_ALIGN - 1)) // ROW_ALIGN * ROW_ALIGN, axis=0)
    p0 = tl.multiple_of(p0, ROW_ALIGN)
    block = tl.where(is_expert, (n_rows + (ROW_ALIGN - 1)) // ROW_ALIGN * ROW_ALIGN, LD - p0)
    if WRITE_PCUM:
        if tl.program_id(0) == 0:
            tl.store(pcum_ptr + e, p0)
    offs_n, n_mask = tile(tl.program_id(0), BLOCK_N, N)
    offs_r = tl.arange(0, BLOCK_R)
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < n_rows
        v = grouped_rows(v_ptr, idx_ptr, rw_ptr, (row0 + r).to(tl.int64), r_mask, offs_n, n_mask, N, stride_v,
                          GATHER, SILU, ROW_W)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
    inv, scale = inverse_scale(amax, QMAX)
    tl.store(s_ptr + ec.to(tl.int64) * N + offs_n, scale, mask=offs_n < tl.where(is_expert, N, 0))
    code_ty = q_ptr.dtype.element_ty
    q_cols = q_ptr + offs_n.to(tl.int64)[None, :] * LD + p0
    for r0 in range(0, block, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < n_rows
        v = grouped_rows(v_ptr, idx_ptr, rw_ptr, (row0 + r).to(tl.int64), r_mask, offs_n, n_mask, N, stride_v,
                          GATHER, SILU, ROW_W)
        codes = to_fp8(v * inv[None, :], code_ty, MANT, MIN_EXP, ROUND_FIRST)
        tl.store(q_cols + r[:, None], codes, mask=(r[:, None] < block) & n_mask[None, :])


@triton.jit
def _fp8q_silu_mul_kernel(
    gate_up_ptr,
    h_ptr,
    cum_token_ptr,
    R,
    I,
    NR,
    ROUND_FIRST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """``h = silu(gate) * up`` in fp32 from ``gate_up [R, 2I]``, stored in h's dtype (``h [R, I]``),
    for the RT routed rows (read on the device; the rows past RT are left as they are).
    Grid ``(ceil(R/BLOCK_R),)``."""
    row_end = tl.minimum(tl.load(cum_token_ptr + NR), R)
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_mask = offs_r < row_end
    out_ty = h_ptr.dtype.element_ty
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask = r_mask[:, None] & (offs_i[None, :] < I)
        gate, up = gate_up_halves(gate_up_ptr, offs_r, offs_i, mask, I)
        h = silu(gate) * up
        tl.store(h_ptr + offs_r[:, None] * I + offs_i[None, :], to_float(h, out_ty, ROUND_FIRST), mask=mask)


@triton.jit
def _fp8q_silu_rows_kernel(
    gate_up_ptr,
    h_like_ptr,
    cum_token_ptr,
    q_ptr,
    s_ptr,
    C,
    L,
    NR,
    QMAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """``h = silu(gate) * up`` of the RT routed rows of ``gate_up [C, 2L]``, rounded to the activations'
    dtype (``h_like``'s, not read) as ``_fp8q_silu_mul_kernel`` stores it, quantized per row as
    ``_fp8q_rows_kernel`` quantizes the stored ``h``: the same codes ``q [C, L]`` and scales ``s [C]``
    with no ``h`` written or read. Two sweeps over each row's ``gate_up`` (the amax, then the codes),
    the second from L2. Grid ``(ceil(C/BLOCK_C),)``."""
    offs_c, c_mask = tile(tl.program_id(0), BLOCK_C, C)
    c_mask = c_mask & (offs_c < tl.load(cum_token_ptr + NR))
    rows = offs_c.to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    h_ty = h_like_ptr.dtype.element_ty
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        mask = c_mask[:, None] & ((l0 + offs_l)[None, :] < L)
        gate, up = gate_up_halves(gate_up_ptr, rows, l0 + offs_l, mask, L)
        h = to_float(silu(gate) * up, h_ty, ROUND_FIRST).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
    inv, scale = inverse_scale(amax, QMAX)
    tl.store(s_ptr + rows, scale, mask=c_mask)
    code_ty = q_ptr.dtype.element_ty
    for l0 in range(0, L, BLOCK_L):
        mask = c_mask[:, None] & ((l0 + offs_l)[None, :] < L)
        gate, up = gate_up_halves(gate_up_ptr, rows, l0 + offs_l, mask, L)
        h = to_float(silu(gate) * up, h_ty, ROUND_FIRST).to(tl.float32)
        tl.store(q_ptr + rows[:, None] * L + (l0 + offs_l)[None, :],
                 to_fp8(h * inv[:, None], code_ty, MANT, MIN_EXP, ROUND_FIRST), mask=mask)


@triton.jit
def _fp8q_row_dot_kernel(
    g_ptr,
    gate_up_ptr,
    rw_ptr,
    cum_token_ptr,
    dh_ptr,
    d_row_ptr,
    R,
    I,
    NR,
    ROUND_FIRST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    SILU_BWD: tl.constexpr = False,
):
    """After the down input gradient ``g [R, I]`` (fp32): ``d_row[r] = <g_r, h_r>`` (fp32, ``h =
    silu(gate) * up`` recomputed from ``gate_up [R, 2I]``) and ``dh_r = rw[r] * g_r`` in dh's dtype,
    for the RT routed rows. ``SILU_BWD``: ``dh`` is ``d_gate_up [R, 2I]`` instead, the gradient of
    SiLU*up at ``dh_r`` rounded to that dtype (what ``silu_mul_bwd`` computes from the stored ``dh``:
    its formulas, in fp32), so ``dh`` is neither written nor read back. Grid ``(ceil(R/BLOCK_R),)``."""
    out_ty = dh_ptr.dtype.element_ty
    row_end = tl.minimum(tl.load(cum_token_ptr + NR), R)
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_mask = offs_r < row_end
    rw = tl.load(rw_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask = r_mask[:, None] & (offs_i[None, :] < I)
        gate, up = gate_up_halves(gate_up_ptr, offs_r, offs_i, mask, I)
        at = offs_r[:, None] * I + offs_i[None, :]
        g = tl.load(g_ptr + at, mask=mask, other=0.0)
        dot += tl.sum(g * (silu(gate) * up), axis=1)
        dh = to_float(g * rw[:, None], out_ty, ROUND_FIRST)
        if SILU_BWD:
            dh = dh.to(tl.float32)
            sig = tl.sigmoid(gate)
            gu = offs_r[:, None] * 2 * I + offs_i[None, :]
            tl.store(dh_ptr + gu, to_float(dh * up * sig * (1.0 + gate * (1.0 - sig)), out_ty, ROUND_FIRST), mask=mask)
            tl.store(dh_ptr + gu + I, to_float(dh * gate * sig, out_ty, ROUND_FIRST), mask=mask)
        else:
            tl.store(dh_ptr + at, dh, mask=mask)
    tl.store(d_row_ptr + offs_r, dot, mask=r_mask)


def available(device: torch.device) -> bool:
    """Whether these kernels run on ``device``: its config table has them (cuda and the interpreter;
    gfx942's fp8 is another encoding and PVC has no fp8 dot) and, on NVIDIA, the GPU has fp8 tensor
    cores (sm_89 or newer)."""
    dev = torch.device(device)
    table = CONFIGS[table_for(dev)]
    if any(k not in table for k in (KERNEL, WGRAD_KERNEL, *QUANT_KERNELS)):
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
    N, K = (qw.shape[1], qw.shape[2]) if trans_w else (qw.shape[2], qw.shape[1])
    _check_codes("fp8_grouped_mm", qa, qw)
    if qa.dim() != 2 or qa.shape[-1] != K or out.shape[1] != N:
        raise ValueError(f"fp8_grouped_mm: codes {tuple(qa.shape)} and {tuple(qw.shape)} do not fit out "
                         f"{tuple(out.shape)} (trans_w={trans_w})")
    return quantized_grouped_mm(_fp8_grouped_mm_kernel, KERNEL, qa, sa, idx, qw, sw, cum_token_counts, out, trans_w)


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
    return quantized_wgrad(_fp8_grouped_wgrad_kernel, WGRAD_KERNEL, ql, sl, qr, sr, padded_cum, out, ql.shape[1],
                           ql.shape[1], ROW_ALIGN=ROW_ALIGN, LEFT_SCALE_FIRST=left_scale_first)


# ---------------------------------------------------------------- launchers of the quantization passes
#: Config keys of the quantization and row passes.
QUANT_KERNELS = ("fp8q_rows", "fp8q_wcols", "fp8q_cols", "fp8q_silu_mul", "fp8q_row_dot")
#: Each code dtype's mantissa bits, smallest normal exponent and largest code.
_FORMAT = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}


def _format(dtype: torch.dtype, dev: torch.device) -> dict:
    if dtype not in _FORMAT:
        raise ValueError(f"fp8 codes are float8_e4m3fn or float8_e5m2, got {dtype}")
    mant, min_exp, qmax = _FORMAT[dtype]
    # CPU tensors run under the interpreter, whose fp32 -> fp8 cast needs the values rounded first
    return dict(QMAX=qmax, MANT=mant, MIN_EXP=min_exp, ROUND_FIRST=dev.type == "cpu")


def _cfg(kernel: str, dev: torch.device):  # noqa: ANN202
    return CONFIGS[table_for(dev)][kernel][0]


def quantize_rows(v: torch.Tensor, dtype: torch.dtype, col_scales: torch.Tensor | None = None,
                  cum_token_counts: torch.Tensor | None = None, routed_only: bool = False,
                  idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., L], scales [...])`` of ``v [..., L]`` with one scale per row (the same codes and
    scales as :func:`..quantized.core.quantize_rows`) in one kernel. ``col_scales [NR, L]``: row r
    of the 2-D ``v`` is first multiplied by the column scales of its expert (from
    ``cum_token_counts [NR+1]``, on the device; rows past RT take the last expert's).
    ``routed_only``: only the RT rows (``cum_token_counts[-1]``) are quantized, the others' codes
    and scales are unspecified. ``idx [C]`` int32: the rows are ``v[idx[c]]`` of the 2-D ``v [T, L]``
    (read by index inside the kernel), codes ``[C, L]``."""
    dev = v.device
    v = v.contiguous()
    L = v.shape[-1]
    if idx is not None:
        if v.dim() != 2:
            raise ValueError("quantize_rows: gathered rows need a 2-D v")
        shape = (idx.shape[0], L)
    else:
        shape = tuple(v.shape)
    C = (math.prod(shape) // L) if L else 0
    codes = torch.empty(shape, dtype=dtype, device=dev)
    scales = torch.empty(shape[:-1], dtype=torch.float32, device=dev)
    if C == 0 or L == 0:
        return codes, scales.zero_()
    has_cs = col_scales is not None
    if (has_cs or routed_only) and (cum_token_counts is None or v.dim() != 2):
        raise ValueError("quantize_rows: column scales and routed_only need 2-D rows and cum_token_counts")
    nr = cum_token_counts.numel() - 1 if cum_token_counts is not None else 1
    cs = col_scales.float().contiguous() if has_cs else scales
    cum = cum_token_counts if cum_token_counts is not None else scales
    cfg = _cfg("fp8q_rows", dev)
    _launch.launch(_fp8q_rows_kernel, (triton.cdiv(C, cfg.meta["BLOCK_C"]), 1),
                   (v, idx if idx is not None else cum, cs, cum, codes, scales, C, L, nr),
                   cfg, dev, **_format(dtype, dev), COLS=False, HAS_CS=has_cs, ROUTED_ONLY=routed_only,
                   GATHER=idx is not None)
    return codes, scales


def quantize_weight(w: torch.Tensor, dtype: torch.dtype, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [NR, O, In]`` (``transposed``: stored ``[NR, In, O]``) quantized per output channel: codes
    in w's layout, scales ``[NR, O]``; the same as :func:`..quantized.core.quantized_weight`'s."""
    if not transposed:
        return quantize_rows(w, dtype)
    dev = w.device
    w = w.contiguous()
    B, L, C = w.shape
    codes = torch.empty(w.shape, dtype=dtype, device=dev)
    scales = torch.empty(B, C, dtype=torch.float32, device=dev)
    if w.numel() == 0:
        return codes, scales.zero_()
    cfg = _cfg("fp8q_wcols", dev)
    _launch.launch(_fp8q_rows_kernel, (triton.cdiv(C, cfg.meta["BLOCK_C"]), B),
                   (w, scales, scales, scales, codes, scales, C, L, 1),
                   cfg, dev, **_format(dtype, dev), COLS=True, HAS_CS=False, ROUTED_ONLY=False, GATHER=False)
    return codes, scales


def quantize_cols_grouped_t(v: torch.Tensor, dtype: torch.dtype, cum_token_counts: torch.Tensor, length: int,
                            idx: torch.Tensor | None = None, row_weights: torch.Tensor | None = None,
                            silu: bool = False, padded_cum_out: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`..quantized.core.quantize_cols_grouped_t` in one kernel (the same codes and scales):
    ``(codes [N, length], scales [NR, N])``, expert e's rows quantized per column over those rows,
    stored by column from ``padded_bounds(cum_token_counts)[e]`` (summed on the device;
    ``padded_cum_out [NR+1]`` int32: written there, for :func:`fp8_grouped_wgrad`). The rows are
    ``v[r]`` (``idx``: ``v[idx[r]]``); ``silu``: ``silu(gate) * up`` of ``gate_up = v [R, 2N]``
    computed in fp32 on the way; ``row_weights [R]``: times ``row_weights[r]``. ``length``: at least
    :func:`..quantized.core.padded_length` of the rows."""
    dev = v.device
    NR = cum_token_counts.numel() - 1
    N = v.shape[1] // 2 if silu else v.shape[1]
    if v.stride(-1) != 1:
        v = v.contiguous()
    codes = torch.empty(N, length, dtype=dtype, device=dev)
    scales = torch.empty(NR, N, dtype=torch.float32, device=dev)
    if N == 0 or NR == 0:
        return codes, scales
    cfg = _cfg("fp8q_cols", dev)
    stand_in = cum_token_counts
    _launch.launch(
        _fp8q_cols_kernel, (triton.cdiv(N, cfg.meta["BLOCK_N"]), NR + 1),
        (v, idx if idx is not None else stand_in, row_weights if row_weights is not None else stand_in,
         cum_token_counts, padded_cum_out if padded_cum_out is not None else stand_in, codes, scales, N, length, NR,
         v.stride(0)),
        cfg, dev, **_format(dtype, dev), GATHER=idx is not None, SILU=silu, ROW_W=row_weights is not None,
        WRITE_PCUM=padded_cum_out is not None, ROW_ALIGN=ROW_ALIGN)
    return codes, scales


def quantize_silu_rows(gate_up: torch.Tensor, dtype: torch.dtype, cum_token_counts: torch.Tensor,
                       act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(silu_mul(gate_up, ...), dtype, routed_only=True)`` for ``h`` in ``act_dtype`` without
    ``h``: ``(codes [R, I], scales [R])`` of the routed rows (the others' unspecified), the same bits."""
    dev = gate_up.device
    R, I = gate_up.shape[0], gate_up.shape[1] // 2
    codes = torch.empty(R, I, dtype=dtype, device=dev)
    scales = torch.empty(R, dtype=torch.float32, device=dev)
    if R == 0 or I == 0:
        return codes, scales.zero_()
    h_like = torch.empty(0, dtype=act_dtype, device=dev)  # its dtype only
    cfg = _cfg("fp8q_rows", dev)
    _launch.launch(_fp8q_silu_rows_kernel, (triton.cdiv(R, cfg.meta["BLOCK_C"]),),
                   (gate_up.contiguous(), h_like, cum_token_counts, codes, scales, R, I,
                    cum_token_counts.numel() - 1), cfg, dev, **_format(dtype, dev))
    return codes, scales


def silu_mul(gate_up: torch.Tensor, cum_token_counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[r] = silu(gate_r) * up_r`` (fp32, stored in out's dtype) for the routed rows of
    ``gate_up [R, 2I]`` (rows past ``cum_token_counts[-1]`` untouched); returns ``out [R, I]``."""
    R, I = out.shape
    if R == 0 or I == 0:
        return out
    dev = out.device
    cfg = _cfg("fp8q_silu_mul", dev)
    _launch.launch(_fp8q_silu_mul_kernel, (triton.cdiv(R, cfg.meta["BLOCK_R"]),),
                   (gate_up.contiguous(), out, cum_token_counts, R, I, cum_token_counts.numel() - 1), cfg, dev,
                   ROUND_FIRST=dev.type == "cpu")
    return out


def row_dot_scale(g: torch.Tensor, gate_up: torch.Tensor, row_weights: torch.Tensor, cum_token_counts: torch.Tensor,
                  dh: torch.Tensor, d_row: torch.Tensor, silu_bwd: bool = False) -> None:
    """For the routed rows: ``d_row[r] = <g_r, silu(gate_r) * up_r>`` and ``dh_r = row_weights[r] * g_r``
    (in dh's dtype); ``g [R, I]`` fp32, ``gate_up [R, 2I]``, ``dh [R, I]``, ``d_row [R]`` fp32.
    ``silu_bwd``: ``dh [R, 2I]`` receives the gradient of SiLU*up at that ``dh_r`` instead (what
    ``silu_mul_bwd`` gives from it)."""
    R, I = g.shape
    if R == 0:
        return
    dev = g.device
    cfg = _cfg("fp8q_row_dot", dev)
    _launch.launch(_fp8q_row_dot_kernel, (triton.cdiv(R, cfg.meta["BLOCK_R"]),),
                   (g, gate_up.contiguous(), row_weights.float().contiguous(), cum_token_counts, dh, d_row, R, I,
                    cum_token_counts.numel() - 1), cfg, dev, ROUND_FIRST=dev.type == "cpu", SILU_BWD=silu_bwd)

"""Block-scaled fp8 grouped GEMMs that quantize their activations and gradients inside their loads.

The ``fp8-block`` recipe (:mod:`..quantized.fp8_block`): every scale covers one block of ``QB``
values along the contracted axis, so that a GEMM can make its operand's codes from the tile it has
just loaded, with no pass before it and no codes written to memory:

* activations and output gradients: one scale per row and ``QB``-wide block of columns (``1 x QB``,
  the contracted axis of the forward and input-gradient GEMMs);
* the weights: one scale per ``QB x QB`` block (quantized once per forward by
  :func:`quantize_weight_blocks`, found again by the backward). The same codes and scales serve the
  forward ``x W^T`` and the input gradient ``dy W``: a square block is a block of ``W^T`` too, so the
  weights are never quantized a second time along the other axis;
* the weight gradients' operands (a contraction over each expert's rows): one scale per column and
  block of ``QB`` rows of that expert (``QB x 1``, the blocks start at the expert's first row).

Each k-step of ``QB`` is one scale block: its ``tl.dot`` of fp8 codes starts from zero (fp32 out),
then is multiplied by its row scales and its weight block's (or column) scales and added to the fp32
accumulator, the promotion DeepSeek-V3's recipe makes every 128 values. The operand codes are made
in registers by the same fp32 operations as :func:`.common.inverse_scale` and :func:`.common.to_fp8`
(``amax / qmax`` scales, codes ``round(v * qmax / amax)``); activations in ``float8_e4m3fn``,
gradients in ``float8_e5m2``.

* :func:`fp8b_grouped_mm` (forward and input-gradient GEMMs): ``out[r] = sum_kb (sa[r, kb] *
  sw_e[kb, n]) * (Q(a_r)[kb] @ qW_e[kb, n])`` over the rows of each expert, with ``a_r`` the row ``r``
  of a 2-D tensor, the row ``v[idx[r]]`` (``A_MODE="gather"``: the gate/up forward's token rows, the
  down backward's output-gradient rows) or ``silu(gate_r) * up_r`` of ``gate_up`` rounded to the
  output's dtype (``A_MODE="silu"``: the down forward's ``h``, never written).
* :func:`fp8b_grouped_wgrad` (weight gradients): ``out[e] = sum_b (Q(L_b)^T @ Q(R_b)) * sl_b * sr_b``
  over expert e's row blocks b, each side read as :func:`.common.grouped_rows` describes (gathered
  rows, SiLU*up times the router weights).

Expert bounds are read on the device (no host read); every row index is widened to int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import CONFIGS, table_for
from .common import (expert_rows, gate_up_halves, grouped_rows, inverse_scale, quantize_tile, silu, tile,
                     to_float, to_fp8)
from .gemm_family import row_grid, tile_grid
from . import launch as _launch
from .launch import timed_launch

#: The config key of :func:`fp8b_grouped_mm` in ``configs.py``.
KERNEL = "fp8b_grouped_mm"
#: The config key of :func:`fp8b_grouped_wgrad` in ``configs.py``.
WGRAD_KERNEL = "fp8b_grouped_wgrad"
#: The config key of :func:`quantize_weight_blocks`.
WEIGHT_KERNEL = "fp8b_weight"
#: The recipe's block: 128 values along the contracted axis (DeepSeek-V3's, Hopper's fp8 k-step).
BLOCK = 128


@triton.jit
def _fp8b_grouped_mm_kernel(a_ptr, idx_ptr, w_ptr, ws_ptr, cum_token_ptr, out_ptr, N, K, stride_a, SB0, SB1,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr, A_MODE: tl.constexpr,
                            TRANS_W: tl.constexpr, A_E5M2: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Grid ``(P, ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns row tiles ``m, m + P, ...`` of
    expert e and columns ``[n*BLOCK_N, (n+1)*BLOCK_N)`` of ``out [R, N]``.

    ``A_MODE``: ``"rows"``, row r of ``a [R, K]``; ``"gather"``, row ``idx[r]`` of ``a [T, K]``;
    ``"silu"``, ``silu(gate) * up`` of ``a = gate_up [R, 2K]`` rounded to out's dtype. Row strides
    ``stride_a``. The weight codes ``w [NR, D0, D1]`` (fp8 e4m3) with ``QB x QB`` block scales ``ws
    [NR, SB0, SB1]`` (``SB0 = ceil(D0/QB)``): ``TRANS_W``, ``D0 = N`` and ``D1 = K`` (``B_e = W_e^T``,
    the forward); else ``D0 = K`` and ``D1 = N`` (``B_e = W_e``, the input gradient through the forward's
    codes). ``A_E5M2``: the rows quantized to e5m2 (gradients), else e4m3."""
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    row0 = row_start.to(tl.int64)
    e64 = e.to(tl.int64)
    w_e = w_ptr + e64 * N * K
    ws_e = ws_ptr + e64 * SB0 * SB1
    offs_n, n_mask = tile(tl.program_id(1), BLOCK_N, N)
    offs_k = tl.arange(0, QB)
    out_ty = out_ptr.dtype.element_ty
    for tile_m in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        offs_m, m_mask = tile(tile_m, BLOCK_M, n_rows)
        rows = row0 + offs_m
        if A_MODE == "gather":
            src = tl.load(idx_ptr + rows, mask=m_mask, other=0).to(tl.int64)
        else:
            src = rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, QB):
            ks = k0 + offs_k
            k_mask = ks < K
            mask = m_mask[:, None] & k_mask[None, :]
            if A_MODE == "silu":
                gate, up = gate_up_halves(a_ptr, src, ks, mask, K)
                a = to_float(silu(gate) * up, out_ty, ROUND_FIRST).to(tl.float32)
            else:
                a = tl.load(a_ptr + src[:, None] * stride_a + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            qa, sa = quantize_tile(a, 1, A_E5M2, ROUND_FIRST)
            kb = tl.cast(k0 // QB, tl.int64)
            if TRANS_W:
                b = tl.load(w_e + offs_n[None, :].to(tl.int64) * K + ks[:, None],
                            mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                sw = tl.load(ws_e + (offs_n // QB).to(tl.int64) * SB1 + kb, mask=n_mask, other=0.0)
            else:
                b = tl.load(w_e + ks[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                sw = tl.load(ws_e + kb * SB1 + offs_n // QB, mask=n_mask, other=0.0)
            part = tl.dot(qa, b, out_dtype=tl.float32)
            acc += (part * sa[:, None]) * sw[None, :]
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc.to(out_ty, fp_downcast_rounding="rtne"),
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8b_grouped_wgrad_kernel(l_ptr, l_idx_ptr, r_ptr, r_idx_ptr, rw_ptr, cum_token_ptr, out_ptr, M, N,
                               stride_l, stride_r, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
                               L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, R_SILU: tl.constexpr,
                               L_E5M2: tl.constexpr, R_E5M2: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """``out[e] [M, N] = sum_b (Q(L_b)^T @ Q(R_b)) * sl_b[:, None] * sr_b[None, :]`` over expert e's
    blocks b of ``QB`` rows (from its first row), each side quantized per column over the block.
    ``L`` rows: ``l[r]`` or ``l[l_idx[r]]`` (``L_GATHER``) of width M; ``R`` rows: ``r[r]``,
    ``r[r_idx[r]]`` (``R_GATHER``) or ``rw[r] * silu(gate_r) * up_r`` of ``gate_up = r [R, 2N]``
    (``R_SILU``), width N. ``L_E5M2`` / ``R_E5M2``: that side's codes are e5m2, else e4m3. Grid
    ``(ceil(M/BLOCK_M), ceil(N/BLOCK_N), NR)``; an expert without rows writes zeros."""
    e = tl.program_id(2)
    row_start = tl.load(cum_token_ptr + e).to(tl.int64)
    n_rows = tl.load(cum_token_ptr + e + 1) - tl.load(cum_token_ptr + e)
    offs_m, m_mask = tile(tl.program_id(0), BLOCK_M, M)
    offs_n, n_mask = tile(tl.program_id(1), BLOCK_N, N)
    offs_r = tl.arange(0, QB)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, n_rows, QB):
        r_mask = offs_r < n_rows - r0
        rows = row_start + r0 + offs_r
        lv = grouped_rows(l_ptr, l_idx_ptr, rw_ptr, rows, r_mask, offs_m, m_mask, M, stride_l, L_GATHER, False, False)
        rv = grouped_rows(r_ptr, r_idx_ptr, rw_ptr, rows, r_mask, offs_n, n_mask, N, stride_r, R_GATHER, R_SILU,
                          R_SILU)
        ql, sl = quantize_tile(lv, 0, L_E5M2, ROUND_FIRST)
        qr, sr = quantize_tile(rv, 0, R_E5M2, ROUND_FIRST)
        part = tl.dot(tl.trans(ql), qr, out_dtype=tl.float32)
        acc += (part * sl[:, None]) * sr[None, :]
    out_ptrs = out_ptr + e.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8b_weight_kernel(w_ptr, q_ptr, s_ptr, D0, D1, SB0, SB1, QB: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """The weights ``w [NR, D0, D1]`` as e4m3 codes (w's layout) with one scale per ``QB x QB`` block
    (``s [NR, SB0, SB1]``). Grid ``(SB0, SB1, NR)``: program ``(i, j, e)`` owns block ``(i, j)``."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    offs_0, mask_0 = tile(i, QB, D0)
    offs_1, mask_1 = tile(j, QB, D1)
    mask = mask_0[:, None] & mask_1[None, :]
    at = e * D0 * D1 + offs_0[:, None].to(tl.int64) * D1 + offs_1[None, :]
    v = tl.load(w_ptr + at, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
    inv, scale = inverse_scale(amax, 448.0)
    tl.store(q_ptr + at, to_fp8(v * inv, tl.float8e4nv, 3, -6, ROUND_FIRST), mask=mask)
    tl.store(s_ptr + (e * SB0 + i) * SB1 + j, scale)


def available(device: torch.device) -> bool:
    """Whether these kernels run on ``device``: its config table has them (cuda and the interpreter)
    and, on NVIDIA, the GPU has fp8 tensor cores (sm_89 or newer)."""
    dev = torch.device(device)
    table = CONFIGS[table_for(dev)]
    if any(k not in table for k in (KERNEL, WGRAD_KERNEL, WEIGHT_KERNEL)):
        return False
    if dev.type == "cuda":
        return torch.cuda.get_device_capability(dev) >= (8, 9)
    return True


def blocks(n: int, qb: int = BLOCK) -> int:
    return -(-n // qb)


def quantize_weight_blocks(w: torch.Tensor, qb: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``w [NR, D0, D1]``: e4m3 codes in w's layout and one fp32 scale per
    ``qb x qb`` block, ``scales [NR, ceil(D0/qb), ceil(D1/qb)]`` (``amax / 448``, zero for a zero block)."""
    if w.dim() != 3:
        raise ValueError(f"quantize_weight_blocks: expected [NR, D0, D1] weights, got {tuple(w.shape)}")
    dev = w.device
    w = w.contiguous()
    NR, D0, D1 = w.shape
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.empty(NR, blocks(D0, qb), blocks(D1, qb), dtype=torch.float32, device=dev)
    if w.numel() == 0:
        return codes, scales.zero_()
    cfg = CONFIGS[table_for(dev)][WEIGHT_KERNEL][0]
    _launch.launch(_fp8b_weight_kernel, (scales.shape[1], scales.shape[2], NR), (w, codes, scales, D0, D1, *scales.shape[1:]),
           cfg, dev, QB=qb, ROUND_FIRST=dev.type == "cpu")
    return codes, scales


def _check_weight(what: str, codes: torch.Tensor, scales: torch.Tensor, qb: int) -> None:
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 3:
        raise ValueError(f"{what}: weight codes must be [NR, D0, D1] float8_e4m3fn, got {tuple(codes.shape)} "
                         f"{codes.dtype}")
    want = (codes.shape[0], blocks(codes.shape[1], qb), blocks(codes.shape[2], qb))
    if tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise ValueError(f"{what}: block scales {tuple(scales.shape)} {scales.dtype} do not fit codes "
                         f"{tuple(codes.shape)} in {qb}-blocks (want {want} float32)")


def fp8b_grouped_mm(a: torch.Tensor, idx: torch.Tensor | None, codes: torch.Tensor, scales: torch.Tensor,
                    cum_token_counts: torch.Tensor, out: torch.Tensor, trans_w: bool, a_mode: str = "rows",
                    grad: bool = False, qb: int = BLOCK) -> torch.Tensor:
    """Writes ``out[r] = Q(a_r) @ B_e`` (block-scaled, see the module) for every expert row r (rows past
    ``cum_token_counts[-1]`` untouched) and returns ``out [R, N]``. ``a_mode``: ``"rows"`` (``a [R,
    K]``), ``"gather"`` (rows ``a[idx[r]]`` of ``a [T, K]``) or ``"silu"`` (``a = gate_up [R, 2K]``).
    ``codes [NR, N, K]`` (``trans_w``) or ``[NR, K, N]`` e4m3 with their ``qb``-block ``scales``;
    ``grad``: the rows are gradients (e5m2 codes)."""
    _check_weight("fp8b_grouped_mm", codes, scales, qb)
    NR = codes.shape[0]
    N, K = (codes.shape[1], codes.shape[2]) if trans_w else (codes.shape[2], codes.shape[1])
    if a_mode not in ("rows", "gather", "silu"):
        raise ValueError(f"fp8b_grouped_mm: a_mode must be 'rows', 'gather' or 'silu', got {a_mode!r}")
    width = 2 * K if a_mode == "silu" else K
    if a.dim() != 2 or a.shape[1] != width or out.dim() != 2 or out.shape[1] != N or (a_mode == "gather") != (idx is not None):
        raise ValueError(f"fp8b_grouped_mm: rows {tuple(a.shape)} ({a_mode}) and codes {tuple(codes.shape)} do not "
                         f"fit out {tuple(out.shape)} (trans_w={trans_w}, idx given: {idx is not None})")
    R = out.shape[0]
    if R == 0 or N == 0 or a.shape[0] == 0:
        return out
    a = a if a.stride(-1) == 1 else a.contiguous()
    dev = out.device
    args = (a, idx if idx is not None else cum_token_counts, codes.contiguous(), scales.contiguous(), cum_token_counts,
            out, N, K, a.stride(0), scales.shape[1], scales.shape[2])
    timed_launch(_fp8b_grouped_mm_kernel, KERNEL, table_for(dev), (N, K, R, NR), row_grid(R, N, NR), args, dev,
                 dtype=a.dtype, QB=qb, A_MODE=a_mode, TRANS_W=trans_w, A_E5M2=grad, ROUND_FIRST=dev.type == "cpu")
    return out


def fp8b_grouped_wgrad(left: torch.Tensor, right: torch.Tensor, cum_token_counts: torch.Tensor, out: torch.Tensor,
                       left_idx: torch.Tensor | None = None, right_idx: torch.Tensor | None = None,
                       right_silu_weights: torch.Tensor | None = None, left_grad: bool = True,
                       qb: int = BLOCK) -> torch.Tensor:
    """Writes ``out[e] = sum_b Q(L_b)^T @ Q(R_b)`` (block-scaled over expert e's blocks of ``qb``
    rows, see the module) and returns ``out [NR, M, N]``. ``L`` rows: ``left[r]`` (``left_idx``:
    ``left[left_idx[r]]``), width M; ``R`` rows: ``right[r]`` (``right_idx``: ``right[right_idx[r]]``;
    ``right_silu_weights [R]``: ``right`` is ``gate_up [R, 2N]`` and the rows are
    ``right_silu_weights[r] * silu(gate_r) * up_r`` in fp32). ``left_grad``: the left side is the
    gradient (e5m2 codes, the right e4m3), else the right side is."""
    NR, M, N = out.shape
    silu_r = right_silu_weights is not None
    if (left.dim() != 2 or right.dim() != 2 or left.shape[1] != M or right.shape[1] != (2 * N if silu_r else N)
            or cum_token_counts.numel() != NR + 1):
        raise ValueError(f"fp8b_grouped_wgrad: rows {tuple(left.shape)} and {tuple(right.shape)} "
                         f"(silu: {silu_r}) do not fit out {tuple(out.shape)} over {cum_token_counts.numel() - 1} "
                         "experts")
    if out.numel() == 0:
        return out
    left = left if left.stride(-1) == 1 else left.contiguous()
    right = right if right.stride(-1) == 1 else right.contiguous()
    dev = out.device
    stand_in = cum_token_counts
    rw = right_silu_weights.float().contiguous() if silu_r else stand_in
    rows = max(left.shape[0] if left_idx is None else left_idx.shape[0], 1)
    timed_launch(_fp8b_grouped_wgrad_kernel, WGRAD_KERNEL, table_for(dev), (N, M, rows, NR), tile_grid(M, N, NR),
                 (left, left_idx if left_idx is not None else stand_in, right,
                  right_idx if right_idx is not None else stand_in, rw, cum_token_counts, out, M, N, left.stride(0),
                  right.stride(0)), dev, dtype=left.dtype, QB=qb, L_GATHER=left_idx is not None,
                 R_GATHER=right_idx is not None, R_SILU=silu_r, L_E5M2=left_grad, R_E5M2=not left_grad,
                 ROUND_FIRST=dev.type == "cpu")
    return out

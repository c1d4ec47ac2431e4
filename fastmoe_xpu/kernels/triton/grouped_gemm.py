"""Stage 4 in Triton: grouped GEMMs over merged expert weights in transformers v5's layouts.

``gate_up_proj [NR, 2I, H]`` and ``down_proj [NR, H, I]`` are read in place (no transposed copy):
the forward multiplies by ``W_e^T`` by walking ``W_e`` along its contiguous H (or I) axis, the input
gradient multiplies by ``W_e`` itself. Expert e owns rows ``cum_token_counts[e] ..
cum_token_counts[e+1]`` of every row buffer.

Kernels:

* ``_gate_up_fwd_kernel``: ``x[input_indices]`` gathered inside the A loads (never materialised),
  the gate and the up columns of the same output columns in two accumulators, SiLU*up in the
  epilogue, writing both ``gate_up`` (saved for backward) and ``h`` (used by the down GEMM, then
  freed: backward recomputes it).
* ``_grouped_mm_fwd_kernel``: ``out[rows_e] = A[rows_e] @ B_e`` with ``B_e = W_e^T`` (down
  forward) or ``W_e`` (input gradients of both GEMMs); ``LORA`` adds a LoRA adapter's
  ``t[rows_e] @ LB_e^T`` in the epilogue (:func:`down_fwd_lora`).
* ``_grouped_mm_bwd_kernel``: weight gradient ``dW_e = A[rows_e]^T @ B[rows_e]``, B optionally
  gathered (``x[input_indices]`` for gate/up); experts without rows get zeros.
* ``_silu_mul_bwd_kernel``: gradient of ``silu(gate) * up``.
* ``_row_dot_scale_kernel``: after the down input-gradient GEMM, ``h`` recomputed from
  ``gate_up``, the router-weight gradient ``<dh_r, h_r>`` per row, ``dh_r`` scaled by its
  routing weight and ``rw_r * h_r`` written for the down weight gradient, in one pass over the rows.

Every GEMM accumulates in fp32 whatever the operand dtype. Grids put the expert index on axis 2
(the highest) and give each expert ``ROW_SLACK`` times its fair share ``R / NR`` of row tiles on
axis 0; a grid-stride loop over row tiles keeps any larger group correct, and programs past their
expert's rows exit at once: the row counts stay on the device, no host synchronisation. Row, token and expert offsets are
int64. ``BLOCK_PTR`` (Intel) loads strided ``tl.dot`` operands and stores outputs through block
pointers for 2D block IO; gathered rows always use pointer loads.

Legend: T tokens, H hidden, I intermediate, NR local experts, R rows allocated (>= RT routed rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import table_for, dot_precision, get_config, uses_block_ptr
from ..contract import check_float, check_gemm_inputs, check_index, check_stored_gemm_inputs
from . import combine as _combine
from . import launch as _launch
from .common import block_ptr_dot, expert_rows, tile, weight_tile_ptrs
from .gemm_family import dot_k_loop, row_grid, tile_grid
from .launch import timed_launch


@triton.jit
def _gate_up_fwd_kernel(
    x_ptr,
    input_idx_ptr,
    cum_token_ptr,
    w_ptr,
    gate_up_ptr,
    h_ptr,
    H,
    I,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``gate_up[r] = x[input_indices[r]] @ W_e^T`` and ``h[r] = silu(gate) * up``.

    Grid ``(P, ceil(I/BLOCK_N), NR)`` with P row programs per expert (:func:`.gemm_family.row_programs`); program
    ``(m, n, e)`` owns row tiles ``m, m + P, ...`` of expert e's rows and output columns
    ``[n*BLOCK_N, (n+1)*BLOCK_N)`` of the gate half, the same columns of the up half, and of ``h``. Reads ``x [T, H]``,
    ``input_indices [R]`` int32, ``cum_token_counts [NR+1]`` int32, ``gate_up_proj [NR, 2I, H]``;
    writes ``gate_up [R, 2I]`` and ``h [R, I]`` in x's dtype.
    """
    pid_n = tl.program_id(1)
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    w_gate = w_ptr + e.to(tl.int64) * 2 * I * H
    w_up = w_gate + tl.cast(I, tl.int64) * H
    offs_n, n_mask = tile(pid_n, BLOCK_N, I)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_m in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        offs_m, m_mask = tile(tile_m, BLOCK_M, n_rows)
        tok = tl.load(input_idx_ptr + row_start + offs_m, mask=m_mask, other=0).to(tl.int64)
        a_ptrs = x_ptr + tok[:, None] * H + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_PTR:
            # W_e^T viewed as [H, I] with H contiguous.
            bg_ptr = tl.make_block_ptr(w_gate, shape=(H, I), strides=(1, H), offsets=(0, pid_n * BLOCK_N),
                                       block_shape=(BLOCK_K, BLOCK_N), order=(0, 1))
            bu_ptr = tl.make_block_ptr(w_up, shape=(H, I), strides=(1, H), offsets=(0, pid_n * BLOCK_N),
                                       block_shape=(BLOCK_K, BLOCK_N), order=(0, 1))
            for k0 in range(0, H, BLOCK_K):
                a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < H - k0), other=0.0)
                bg = tl.load(bg_ptr, boundary_check=(0, 1), padding_option="zero")
                bu = tl.load(bu_ptr, boundary_check=(0, 1), padding_option="zero")
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                bg_ptr = tl.advance(bg_ptr, (BLOCK_K, 0))
                bu_ptr = tl.advance(bu_ptr, (BLOCK_K, 0))
        else:
            bg_ptrs = w_gate + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
            bu_ptrs = w_up + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
            for k0 in range(0, H, BLOCK_K):
                k_mask = offs_k < H - k0
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                bg = tl.load(bg_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                bu = tl.load(bu_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                bg_ptrs += BLOCK_K
                bu_ptrs += BLOCK_K
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        out_ty = h_ptr.dtype.element_ty
        row0 = row_start.to(tl.int64)
        if BLOCK_PTR:
            g_out = tl.make_block_ptr(gate_up_ptr + row0 * 2 * I, shape=(n_rows, I), strides=(2 * I, 1),
                                      offsets=(tile_m * BLOCK_M, pid_n * BLOCK_N), block_shape=(BLOCK_M, BLOCK_N),
                                      order=(1, 0))
            u_out = tl.make_block_ptr(gate_up_ptr + row0 * 2 * I + I, shape=(n_rows, I), strides=(2 * I, 1),
                                      offsets=(tile_m * BLOCK_M, pid_n * BLOCK_N), block_shape=(BLOCK_M, BLOCK_N),
                                      order=(1, 0))
            h_out = tl.make_block_ptr(h_ptr + row0 * I, shape=(n_rows, I), strides=(I, 1),
                                      offsets=(tile_m * BLOCK_M, pid_n * BLOCK_N), block_shape=(BLOCK_M, BLOCK_N),
                                      order=(1, 0))
            tl.store(g_out, acc_g.to(out_ty), boundary_check=(0, 1))
            tl.store(u_out, acc_u.to(out_ty), boundary_check=(0, 1))
            tl.store(h_out, h.to(out_ty), boundary_check=(0, 1))
        else:
            rows = row0 + offs_m
            mask = m_mask[:, None] & n_mask[None, :]
            gu_ptrs = gate_up_ptr + rows[:, None] * 2 * I + offs_n[None, :]
            tl.store(gu_ptrs, acc_g.to(out_ty), mask=mask)
            tl.store(gu_ptrs + I, acc_u.to(out_ty), mask=mask)
            tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], h.to(out_ty), mask=mask)


@triton.jit
def _grouped_mm_fwd_kernel(
    a_ptr,
    idx_ptr,
    w_ptr,
    cum_token_ptr,
    out_ptr,
    t_ptr,
    lb_ptr,
    N,
    K,
    RANK,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TRANS_W: tl.constexpr,
    BLOCK_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GATHER_A: tl.constexpr,
):
    """``out[r] = a[src(r)] @ B_e`` for the rows r of each expert e, plus ``t[r] @ LB_e^T`` with ``LORA``;
    ``src(r) = idx[r]`` with ``GATHER_A`` (the down input gradient reading the output gradient's rows
    ``dout[token(r)]`` in its loads: no ``[R, H]`` copy of them), else ``r``.

    ``TRANS_W``: ``B_e = W_e^T`` with ``W [NR, N, K]`` (forward); else ``B_e = W_e`` with
    ``W [NR, K, N]`` (input gradient). Grid ``(P, ceil(N/BLOCK_N), NR)`` as above; program
    ``(m, n, e)`` owns row tiles ``m, m + P, ...`` of expert e and output columns
    ``[n*BLOCK_N, (n+1)*BLOCK_N)``. Reads ``a [R, K]`` and ``cum_token_counts [NR+1]`` int32;
    writes ``out [R, N]`` in a's dtype. ``LORA``: a LoRA adapter's up-projection in the epilogue,
    ``t [R, RANK]`` (the rows' ``s a A_e^T``) times ``LB [NR, N, RANK]`` (``B_e``) accumulated into the
    same fp32 tile before the one store, ``RANK`` in chunks of ``BLOCK_R``; else ``t_ptr``,
    ``lb_ptr`` and ``RANK`` are not read. ``GATHER_A``: ``a [T, K]`` and ``idx [R]`` int32 (pointer
    loads: the host passes ``BLOCK_PTR`` false), else ``idx_ptr`` is not read.
    """
    pid_n = tl.program_id(1)
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    row0 = row_start.to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * N * K
    offs_n, n_mask = tile(pid_n, BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    out_ty = out_ptr.dtype.element_ty
    for tile_m in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs_m, m_mask = tile(tile_m, BLOCK_M, n_rows)
        rows = row0 + offs_m
        if BLOCK_PTR:
            a_bp = tl.make_block_ptr(a_ptr + row0 * K, shape=(n_rows, K), strides=(K, 1),
                                     offsets=(tile_m * BLOCK_M, 0), block_shape=(BLOCK_M, BLOCK_K), order=(1, 0))
            if TRANS_W:
                b_bp = tl.make_block_ptr(w_e, shape=(K, N), strides=(1, K), offsets=(0, pid_n * BLOCK_N),
                                         block_shape=(BLOCK_K, BLOCK_N), order=(0, 1))
            else:
                b_bp = tl.make_block_ptr(w_e, shape=(K, N), strides=(N, 1), offsets=(0, pid_n * BLOCK_N),
                                         block_shape=(BLOCK_K, BLOCK_N), order=(1, 0))
            acc = block_ptr_dot(a_bp, b_bp, acc, K, BLOCK_K, DOT_PRECISION)
        else:
            if GATHER_A:
                src = tl.load(idx_ptr + rows, mask=m_mask, other=0).to(tl.int64)
                a_ptrs = a_ptr + src[:, None] * K + offs_k[None, :]
            else:
                a_ptrs = a_ptr + rows[:, None] * K + offs_k[None, :]
            b_ptrs, b_step = weight_tile_ptrs(w_e, offs_k, offs_n, N, K, BLOCK_K, TRANS_W)
            acc = dot_k_loop(acc, a_ptrs, BLOCK_K, b_ptrs, b_step, m_mask, n_mask, offs_k, K, BLOCK_K, "float",
                             DOT_PRECISION, False)
        if LORA:
            lb_e = lb_ptr + e.to(tl.int64) * N * RANK
            for r0 in range(0, RANK, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < RANK
                tt = tl.load(t_ptr + rows[:, None] * RANK + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                             other=0.0)
                lb = tl.load(lb_e + offs_n[None, :].to(tl.int64) * RANK + offs_r[:, None],
                             mask=r_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(tt, lb, acc, input_precision=DOT_PRECISION)
        if BLOCK_PTR:
            o_bp = tl.make_block_ptr(out_ptr + row0 * N, shape=(n_rows, N), strides=(N, 1),
                                     offsets=(tile_m * BLOCK_M, pid_n * BLOCK_N), block_shape=(BLOCK_M, BLOCK_N),
                                     order=(1, 0))
            tl.store(o_bp, acc.to(out_ty), boundary_check=(0, 1))
        else:
            tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc.to(out_ty),
                     mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_mm_bwd_kernel(
    a_ptr,
    b_ptr,
    idx_ptr,
    cum_token_ptr,
    dw_ptr,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATHER_A: tl.constexpr,
):
    """Weight gradient ``dW_e = a[src_a(rows_e)]^T @ b[src(rows_e)]`` with ``src(r) = idx[r]`` when
    ``GATHER`` else ``r``, and ``src_a(r) = idx[r]`` when ``GATHER_A`` (the down weight gradient
    reading ``dout[token(r)]``; pointer loads, the host passes ``BLOCK_PTR`` false) else ``r``.

    Grid ``(ceil(M/BLOCK_M), ceil(N/BLOCK_N), NR)``; program ``(m, n, e)`` owns the tile
    ``[m*BLOCK_M, (m+1)*BLOCK_M) x [n*BLOCK_N, (n+1)*BLOCK_N)`` of ``dW_e`` and reduces over all of
    expert e's rows, ``BLOCK_K`` at a time (zero rows give a zero tile). Reads ``a [R, M]``,
    ``b [R or T, N]``, ``idx [R]`` int32 (when ``GATHER``), ``cum_token_counts [NR+1]`` int32;
    writes ``dW [NR, M, N]`` in a's dtype.

    Both operands reach ``tl.dot`` as loaded, with no arithmetic between the load and the dot: the
    down GEMM's B (``rw * silu(gate) * up``) once recomputed here from ``gate_up`` ran at a third of
    this kernel's rate on an H200 (docs/triton.md), so ``row_dot_scale`` writes it beforehand.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, row_start, n_rows = expert_rows(cum_token_ptr)
    row0 = row_start.to(tl.int64)
    offs_m, m_mask = tile(pid_m, BLOCK_M, M)
    offs_n, n_mask = tile(pid_n, BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_PTR:
        # a[rows_e]^T viewed as [M, n_rows] with M contiguous.
        at_bp = tl.make_block_ptr(a_ptr + row0 * M, shape=(M, n_rows), strides=(1, M),
                                  offsets=(pid_m * BLOCK_M, 0), block_shape=(BLOCK_M, BLOCK_K), order=(0, 1))
        if GATHER:
            for k0 in range(0, n_rows, BLOCK_K):
                k_mask = offs_k < n_rows - k0
                src = tl.load(idx_ptr + row0 + k0 + offs_k, mask=k_mask, other=0).to(tl.int64)
                b = tl.load(b_ptr + src[:, None] * N + offs_n[None, :], mask=k_mask[:, None] & n_mask[None, :],
                            other=0.0)
                a = tl.load(at_bp, boundary_check=(0, 1), padding_option="zero")
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                at_bp = tl.advance(at_bp, (0, BLOCK_K))
        else:
            b_bp = tl.make_block_ptr(b_ptr + row0 * N, shape=(n_rows, N), strides=(N, 1),
                                     offsets=(0, pid_n * BLOCK_N), block_shape=(BLOCK_K, BLOCK_N), order=(1, 0))
            acc = block_ptr_dot(at_bp, b_bp, acc, n_rows, BLOCK_K, DOT_PRECISION)
        dw_bp = tl.make_block_ptr(dw_ptr + e.to(tl.int64) * M * N, shape=(M, N), strides=(N, 1),
                                  offsets=(pid_m * BLOCK_M, pid_n * BLOCK_N), block_shape=(BLOCK_M, BLOCK_N),
                                  order=(1, 0))
        tl.store(dw_bp, acc.to(dw_ptr.dtype.element_ty), boundary_check=(0, 1))
    else:
        for k0 in range(0, n_rows, BLOCK_K):
            k_mask = offs_k < n_rows - k0
            rows_k = row0 + k0 + offs_k
            if GATHER or GATHER_A:
                src = tl.load(idx_ptr + rows_k, mask=k_mask, other=0).to(tl.int64)
            else:
                src = rows_k
            if GATHER_A:
                a_rows = src
            else:
                a_rows = rows_k
            if GATHER:
                b_rows = src
            else:
                b_rows = rows_k
            a = tl.load(a_ptr + a_rows[None, :] * M + offs_m[:, None], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            b = tl.load(b_ptr + b_rows[:, None] * N + offs_n[None, :], mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        dw_ptrs = dw_ptr + e.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _silu_mul_bwd_kernel(
    gate_up_ptr,
    dh_ptr,
    d_gate_up_ptr,
    cum_token_ptr,
    R,
    I,
    NR,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    """``d_gate = dh * up * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)``, ``d_up = dh * silu(gate)``.

    Grid ``(ceil(R/BLOCK_R), ceil(I/BLOCK_I))``; program ``(r, c)`` owns rows
    ``[r*BLOCK_R, (r+1)*BLOCK_R)`` and columns ``[c*BLOCK_I, (c+1)*BLOCK_I)`` of both halves. Reads
    ``gate_up [R, 2I]`` and ``dh [R, I]``; writes ``d_gate_up [R, 2I]`` in dh's dtype; fp32 math.
    With ``HAS_COUNTS`` only the RT = ``cum_token_counts[NR]`` routed rows are computed (read on
    the device: the grid stays the worst case, programs past RT exit at once).
    """
    row_end = R
    if HAS_COUNTS:
        row_end = tl.minimum(tl.load(cum_token_ptr + NR), R)
        if tl.program_id(0) * BLOCK_R >= row_end:
            return
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_r[:, None] < row_end) & (offs_i[None, :] < I)
    gu = offs_r[:, None] * 2 * I + offs_i[None, :]
    gate = tl.load(gate_up_ptr + gu, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gu + I, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs_r[:, None] * I + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dh * gate * sig
    out_ty = d_gate_up_ptr.dtype.element_ty
    tl.store(d_gate_up_ptr + gu, d_gate.to(out_ty), mask=mask)
    tl.store(d_gate_up_ptr + gu + I, d_up.to(out_ty), mask=mask)


@triton.jit
def _row_dot_scale_kernel(
    dh_ptr,
    gate_up_ptr,
    rw_ptr,
    cum_token_ptr,
    d_row_ptr,
    hw_ptr,
    d_gate_up_ptr,
    R,
    I,
    NR,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    SILU_BWD: tl.constexpr,
):
    """The down input gradient's epilogue as its own pass: ``d_row[r] = <dh_r, h_r>`` (fp32) with
    ``h = silu(gate) * up`` recomputed from ``gate_up [R, 2I]``, then ``dh_r *= rw[r]`` in place, and
    ``hw_r = rw[r] * h_r`` written (``hw [R, I]`` in dh's dtype): the down weight gradient's B operand,
    computed once here instead of once per output tile inside that GEMM's reduction.

    ``SILU_BWD``: instead of writing ``rw * dh`` back, the gradient of ``silu(gate) * up`` at it goes
    to ``d_gate_up [R, 2I]`` (dh's dtype; ``_silu_mul_bwd_kernel``'s formulas on the fp32 ``rw * dh``,
    not on its rounded copy): the gate and up tiles are loaded here anyway, so ``silu_mul_bwd``'s pass
    (reading ``dh`` and ``gate_up`` again) and ``dh``'s write-back go away; else ``d_gate_up_ptr`` is
    not read.

    Grid ``(ceil(R/BLOCK_R),)``; program ``r`` owns rows ``[r*BLOCK_R, (r+1)*BLOCK_R)`` and walks
    their I columns in ``BLOCK_I`` steps, so a row's dot product is summed in one fixed order (no
    partial buffer, no atomics) and only a ``[BLOCK_R, BLOCK_I]`` piece is live: inside the GEMM's
    epilogue the gate/up tiles, their pointers and the layout conversions of the product sat beside
    the accumulator and spilled on PVC (docs/xpu.md). Only the RT = ``cum_token_counts[NR]`` routed
    rows are touched (read on the device; programs past RT exit at once).
    """
    row_end = tl.minimum(tl.load(cum_token_ptr + NR), R)
    if tl.program_id(0) * BLOCK_R >= row_end:
        return
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_mask = offs_r < row_end
    rw = tl.load(rw_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    out_ty = dh_ptr.dtype.element_ty
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask = r_mask[:, None] & (offs_i[None, :] < I)
        gu = offs_r[:, None] * 2 * I + offs_i[None, :]
        gate = tl.load(gate_up_ptr + gu, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + gu + I, mask=mask, other=0.0).to(tl.float32)
        d_ptrs = dh_ptr + offs_r[:, None] * I + offs_i[None, :]
        dh = tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        h = gate * sig * up
        dot += tl.sum(dh * h, axis=1)
        if SILU_BWD:
            dhw = dh * rw[:, None]
            tl.store(d_gate_up_ptr + gu, (dhw * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ty), mask=mask)
            tl.store(d_gate_up_ptr + gu + I, (dhw * gate * sig).to(out_ty), mask=mask)
        else:
            tl.store(d_ptrs, (dh * rw[:, None]).to(out_ty), mask=mask)
        tl.store(hw_ptr + offs_r[:, None] * I + offs_i[None, :], (h * rw[:, None]).to(out_ty), mask=mask)
    tl.store(d_row_ptr + offs_r, dot, mask=r_mask)


# ---------------------------------------------------------------- launchers
def check_gate_up_fwd_inputs(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                             w_gate_up_N2IH: torch.Tensor) -> None:
    """The input checks of a Triton ``gate_up_fwd`` (this engine's and the TMA engine's)."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    check_float("gate_up_fwd", None, x=x_TH, w_gate_up=w_gate_up_N2IH)
    check_index("gate_up_fwd", x_TH.device, input_indices=input_indices, cum_token_counts=cum_token_counts)


def check_down_fwd_inputs(h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
                          transposed: bool) -> None:
    """The input checks of a Triton ``down_fwd`` (this engine's and the TMA engine's)."""
    check_stored_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd", transposed)
    check_float("down_fwd", None, h=h_RI, w_down=w_down_NHI)
    check_index("down_fwd", h_RI.device, cum_token_counts=cum_token_counts)


def gate_up_fwd(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = x[input_indices] @ w_gate_up[e]^T`` per expert group and
    ``h [R, I] = silu(gate) * up``; R = ``len(input_indices)``, rows past RT unspecified."""
    check_gate_up_fwd_inputs(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    T, H = x_TH.shape
    NR, two_i, _ = w_gate_up_N2IH.shape
    if two_i % 2:
        raise ValueError(f"gate_up_fwd: gate_up_proj {tuple(w_gate_up_N2IH.shape)} must have an even dim 1 (2I)")
    I = two_i // 2
    R = input_indices.shape[0]
    dev = x_TH.device
    gate_up = x_TH.new_empty(R, two_i)
    h = x_TH.new_empty(R, I)
    if R == 0 or T == 0:
        return gate_up, h
    table = table_for(dev)
    timed_launch(_gate_up_fwd_kernel, "gate_up_fwd", table, (I, H, R, NR), row_grid(R, I, NR),
                 (x_TH, input_indices, cum_token_counts, w_gate_up_N2IH, gate_up, h, H, I), dev,
                 dtype=x_TH.dtype, BLOCK_PTR=uses_block_ptr(table), DOT_PRECISION=dot_precision(table, x_TH.dtype))
    return gate_up, h


#: Rank columns per ``tl.dot`` of the LoRA epilogue (16: the smallest dot depth on every target).
LORA_BLOCK_R = 16


def _grouped_mm(a_RK: torch.Tensor, w: torch.Tensor, cum_token_counts: torch.Tensor, trans_w: bool,
                lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out [R, N] = a[src(r)] @ B_e`` per expert group, ``src(r) = a_rows[r]`` (``R = len(a_rows)``,
    a gather inside the loads) when given, else ``r`` (``R = len(a)``)."""
    NR = w.shape[0]
    N, K = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    R = a_RK.shape[0] if a_rows is None else a_rows.shape[0]
    out = a_RK.new_empty(R, N)
    if R == 0:
        return out
    dev = a_RK.device
    table = table_for(dev)

    t, lb = lora if lora is not None else (a_RK, w)  # not read without LORA
    timed_launch(_grouped_mm_fwd_kernel, "grouped_mm_fwd", table, (N, K, R, NR), row_grid(R, N, NR),
                 (a_RK, a_rows if a_rows is not None else cum_token_counts, w, cum_token_counts, out, t, lb, N, K,
                  t.shape[1] if lora is not None else 0), dev,
                 dtype=a_RK.dtype, TRANS_W=trans_w, BLOCK_PTR=uses_block_ptr(table) and a_rows is None,
                 DOT_PRECISION=dot_precision(table, a_RK.dtype), LORA=lora is not None, BLOCK_R=LORA_BLOCK_R,
                 GATHER_A=a_rows is not None)
    return out


def _grouped_mm_wgrad(a_RM: torch.Tensor, b: torch.Tensor, idx: torch.Tensor | None, cum_token_counts: torch.Tensor,
                      w_like: torch.Tensor, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dW [NR, M, N] = a[rows_e]^T @ b[rows_e]`` (``b`` gathered by ``idx`` when given, ``a`` by
    ``a_rows``; not both)."""
    NR, M, N = w_like.shape
    dw = torch.empty_like(w_like)
    dev = a_RM.device
    table = table_for(dev)
    if idx is not None and a_rows is not None:
        raise ValueError("grouped_mm_bwd gathers one operand's rows, not both")
    rows = a_RM.shape[0] if a_rows is None else a_rows.shape[0]
    gather = idx if idx is not None else a_rows

    # Keyed on the weight's (M, N) and the rows reduced over per expert.
    timed_launch(_grouped_mm_bwd_kernel, "grouped_mm_bwd", table, (N, M, rows, NR), tile_grid(M, N, NR),
                 (a_RM, b, gather if gather is not None else cum_token_counts, cum_token_counts, dw, M, N), dev,
                 dtype=a_RM.dtype, GATHER=idx is not None, BLOCK_PTR=uses_block_ptr(table) and a_rows is None,
                 DOT_PRECISION=dot_precision(table, a_RM.dtype), GATHER_A=a_rows is not None)
    return dw


def down_fwd(
    h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, transposed: bool = False
) -> torch.Tensor:
    """``y [R, H] = h @ w_down[e]^T`` per expert group; rows past RT unspecified. ``transposed``
    (``w_down`` stored ``[NR, I, H]``): ``y = h @ w_down[e]``, the kernel's ``W_e`` variant (the one
    the input gradients use), reading the weight in place."""
    check_down_fwd_inputs(h_RI, cum_token_counts, w_down_NHI, transposed)
    return _grouped_mm(h_RI, w_down_NHI, cum_token_counts, not transposed)


def down_fwd_lora(
    h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, t_Rr: torch.Tensor,
    lora_b: torch.Tensor, transposed: bool = False,
) -> torch.Tensor:
    """:func:`down_fwd` plus a LoRA adapter's up-projection in the same kernel's epilogue:
    ``y = h @ w_down[e]^T + t @ lora_b[e]^T`` (``t [R, r]`` the rows' ``s h A_e^T``, ``lora_b
    [NR, out, r]``), accumulated in fp32 and stored once: no second pass over ``y``."""
    check_stored_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd_lora", transposed)
    check_gemm_inputs(t_Rr, lora_b, cum_token_counts, "down_fwd_lora")
    out_f = w_down_NHI.shape[2] if transposed else w_down_NHI.shape[1]
    if lora_b.shape[1] != out_f or t_Rr.shape[0] < h_RI.shape[0]:
        raise ValueError(f"down_fwd_lora: LoRA B {tuple(lora_b.shape)} and t {tuple(t_Rr.shape)} do not fit "
                         f"{out_f} outputs over {h_RI.shape[0]} rows")
    check_float("down_fwd_lora", None, h=h_RI, w_down=w_down_NHI, t=t_Rr, lora_b=lora_b)
    check_index("down_fwd_lora", h_RI.device, cum_token_counts=cum_token_counts)
    return _grouped_mm(h_RI, w_down_NHI, cum_token_counts, not transposed, (t_Rr, lora_b))


def down_bwd(
    dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
    transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh [R, I] = dy @ w_down[e]`` and ``dw_down [NR, H, I] = dy_e^T @ h_e`` (zero for empty experts).
    ``transposed`` (stored ``[NR, I, H]``): ``dh = dy @ w_down[e]^T`` (the ``W_e^T`` variant) and
    ``dw_down [NR, I, H] = h_e^T @ dy_e`` (the weight-gradient kernel with its operands swapped), so
    the gradient is written in the stored layout. No new kernel variant: both are compiled already."""
    if not isinstance(transposed, bool):
        raise TypeError(f"down_bwd: transposed must be a bool, got {transposed!r}")
    check_float("down_bwd", None, dy=dy_RH, h=h_RI, w_down=w_down_NHI)
    check_index("down_bwd", dy_RH.device, cum_token_counts=cum_token_counts)
    if w_down_NHI.dim() != 3:
        raise ValueError(f"down_bwd: down_proj must be 3-D, got {tuple(w_down_NHI.shape)}")
    NR = w_down_NHI.shape[0]
    I, H = (w_down_NHI.shape[1], w_down_NHI.shape[2]) if transposed else (w_down_NHI.shape[2], w_down_NHI.shape[1])
    if dy_RH.dim() != 2 or dy_RH.shape[1] != H or h_RI.dim() != 2 or h_RI.shape != (dy_RH.shape[0], I):
        raise ValueError(f"down_bwd: dy {tuple(dy_RH.shape)} and h {tuple(h_RI.shape)} do not fit "
                         f"down_proj {tuple(w_down_NHI.shape)} (transposed={transposed}; expected [R, {H}] and "
                         f"[R, {I}])")
    if cum_token_counts.numel() != NR + 1:
        raise ValueError(f"down_bwd: cum_token_counts has {cum_token_counts.numel()} entries, expected {NR + 1}")
    dh = _grouped_mm(dy_RH, w_down_NHI, cum_token_counts, transposed)
    if transposed:
        dw = _grouped_mm_wgrad(h_RI, dy_RH, None, cum_token_counts, w_down_NHI)
    else:
        dw = _grouped_mm_wgrad(dy_RH, h_RI, None, cum_token_counts, w_down_NHI)
    return dh, dw


def down_weighted_bwd(dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                      cum_token_counts: torch.Tensor,
                      w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the weighted down GEMM given the unweighted row gradients ``dy``:
    ``(dh [R, I] = w_r * dy_r @ w_down[e], dw_down [NR, H, I] = sum_r w_r dy_r^T h_r,
    d_row_weights [R] fp32 = <dy_r @ w_down[e], h_r>)`` with ``h = silu(gate) * up`` recomputed
    from ``gate_up`` (never saved). Rows past RT are unspecified."""
    check_down_weighted_bwd(dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI)
    # The plain input-gradient GEMM (unweighted dy @ W_e), then one pass over its rows for the
    # router-weight dots, the weights and ``w * h`` (fused into the GEMM's epilogue, that pass
    # spilled on PVC), then the weight gradient as a plain GEMM over ``w * h``, freed after it.
    dh = _grouped_mm(dy_RH, w_down_NHI, cum_token_counts, False)
    d_row_w, hw = row_dot_scale(dh, gate_up_R2I, row_weights_R, cum_token_counts)
    dw = _grouped_mm_wgrad(dy_RH, hw, None, cum_token_counts, w_down_NHI)
    return dh, dw, d_row_w


def row_dot_scale(dh_RI: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                  cum_token_counts: torch.Tensor, silu_bwd: bool = False) -> tuple[torch.Tensor, ...]:
    """``(d_row_weights [R] fp32 = <dh_r, h_r>, hw [R, I] = row_weights[r] * h_r)`` with ``h``
    recomputed from ``gate_up`` in fp32 (``hw`` rounded once to dh's dtype), and ``dh_r *=
    row_weights[r]`` in place (``_row_dot_scale_kernel``; rows past RT untouched in ``dh`` and
    unspecified in ``hw``). ``silu_bwd``: ``dh`` is left as it is and a third result, ``d_gate_up
    [R, 2I]``, the gradient of SiLU*up at ``row_weights[r] * dh_r`` (what :func:`silu_mul_bwd` gives
    from the scaled ``dh``), is written in the same pass."""
    R, I = dh_RI.shape
    d_row_w = torch.empty(R, dtype=torch.float32, device=dh_RI.device)
    hw = torch.empty_like(dh_RI)
    d_gate_up = _alloc_rows(dh_RI, R, 2 * I) if silu_bwd else None
    if R and I:
        dev = dh_RI.device
        cfg = get_config(table_for(dev), "row_dot_scale")
        _launch.launch(_row_dot_scale_kernel, (triton.cdiv(R, cfg.meta["BLOCK_R"]),),
                       (dh_RI, gate_up_R2I, row_weights_R, cum_token_counts, d_row_w, hw,
                        d_gate_up if silu_bwd else hw, R, I, cum_token_counts.numel() - 1), cfg, dev,
                       SILU_BWD=silu_bwd)
    return (d_row_w, hw, d_gate_up) if silu_bwd else (d_row_w, hw)


def down_silu_bwd(dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                  selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
                  input_indices: torch.Tensor, gate_up_R2I: torch.Tensor, cum_token_counts: torch.Tensor,
                  w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``combine_bwd``, ``down_weighted_bwd`` and ``silu_mul_bwd`` in three launches (and a small
    one for the rows' weights), with no ``[R, H]`` row gradients and no ``[R, I]`` round trip:
    ``(d_gate_up [R, 2I], dw_down [NR, H, I], d_row_weights [R] fp32)``, R = ``len(input_indices)``.

    The input-gradient GEMM reads each row's output gradient ``dout[input_indices[r]]`` inside its
    loads (``_grouped_mm_fwd_kernel``'s ``GATHER_A``), the row pass (``_row_dot_scale_kernel``'s
    ``SILU_BWD``) forms the router-weight dots, ``w * h`` and the SiLU*up gradient at ``w * dh``, and
    the weight gradient reads the same gathered rows of ``dout`` against ``w * h``. On the block-pointer
    (Intel) table the rows are gathered once by ``combine_bwd`` instead, as ``down_weighted_bwd`` has them."""
    check_float("down_silu_bwd", None, dout=dout_TH, gate_up=gate_up_R2I, w_down=w_down_NHI)
    check_index("down_silu_bwd", dout_TH.device, input_indices=input_indices, cum_token_counts=cum_token_counts)
    NR, H, I = w_down_NHI.shape
    R = input_indices.shape[0]
    if dout_TH.dim() != 2 or dout_TH.shape[1] != H or gate_up_R2I.shape != (R, 2 * I):
        raise ValueError(f"down_silu_bwd: dout {tuple(dout_TH.shape)} and gate_up {tuple(gate_up_R2I.shape)} do not "
                         f"fit down_proj {tuple(w_down_NHI.shape)} and {R} rows (expected [T, {H}] and [{R}, {2 * I}])")
    if cum_token_counts.numel() != NR + 1:
        raise ValueError(f"down_silu_bwd: cum_token_counts has {cum_token_counts.numel()} entries, expected {NR + 1}")
    if uses_block_ptr(table_for(dout_TH.device)):
        # Intel: the gathered rows would leave the 2D block loads for pointer loads, and the gathered
        # input-gradient GEMM spills at its default tile in the PVC compile gate (docs/xpu.md): the rows
        # are written once as [R, H] and both GEMMs read them through block pointers.
        dy, row_weights_R = _combine.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                                 cum_expert_counts)
        rows = None
    else:
        dy, rows = dout_TH, input_indices
        row_weights_R = _combine.row_weights(weights_TK, output_indices, selected_expert_indices, cum_expert_counts,
                                             R)
    dh = _grouped_mm(dy, w_down_NHI, cum_token_counts, False, a_rows=rows)
    d_row_w, hw, d_gate_up = row_dot_scale(dh, gate_up_R2I, row_weights_R, cum_token_counts, silu_bwd=True)
    del dh
    dw = _grouped_mm_wgrad(dy, hw, None, cum_token_counts, w_down_NHI, a_rows=rows)
    return d_gate_up, dw, d_row_w


def _alloc_rows(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Output rows of ``silu_mul_bwd`` (rows past RT stay as allocated; a test fills them to see that)."""
    return like.new_empty(rows, cols)


def silu_mul_bwd(
    gate_up_R2I: torch.Tensor, dh_RI: torch.Tensor, cum_token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of ``silu(gate) * up`` with respect to ``[gate, up]``: ``[R, 2I]`` in dh's dtype.

    With ``cum_token_counts`` only the first RT = ``cum_token_counts[-1]`` rows are computed (the
    rest are unspecified, as everywhere); without it, all R rows."""
    check_float("silu_mul_bwd", None, gate_up=gate_up_R2I, dh=dh_RI)
    R, I = dh_RI.shape
    if gate_up_R2I.dim() != 2 or gate_up_R2I.shape[1] != 2 * I or gate_up_R2I.shape[0] < R:
        raise ValueError(f"silu_mul_bwd: gate_up {tuple(gate_up_R2I.shape)} does not fit dh {tuple(dh_RI.shape)} "
                         f"(expected at least [{R}, {2 * I}])")
    dev = dh_RI.device
    if cum_token_counts is not None:
        check_index("silu_mul_bwd", dev, cum_token_counts=cum_token_counts)
    d_gate_up = _alloc_rows(dh_RI, R, 2 * I)
    if R == 0 or I == 0:
        return d_gate_up
    cfg = get_config(table_for(dev), "silu_mul_bwd")
    grid = (triton.cdiv(R, cfg.meta["BLOCK_R"]), triton.cdiv(I, cfg.meta["BLOCK_I"]))
    has_counts = cum_token_counts is not None
    counts = cum_token_counts if has_counts else dh_RI  # an unread stand-in pointer without counts
    nr = cum_token_counts.numel() - 1 if has_counts else 0
    _launch.launch(_silu_mul_bwd_kernel, grid, (gate_up_R2I, dh_RI, d_gate_up, counts, R, I, nr), cfg, dev,
                   HAS_COUNTS=has_counts)
    return d_gate_up


def gate_up_bwd(d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = d_gate_up @ w_gate_up[e]`` and ``dw_gate_up [NR, 2I, H] = d_e^T @ x[rows_e]``
    (the gather fused into the weight-gradient loads; zero for empty experts)."""
    check_gate_up_bwd(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    dx_rows = _grouped_mm(d_gate_up_R2I, w_gate_up_N2IH, cum_token_counts, False)
    dw = _grouped_mm_wgrad(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    return dx_rows, dw


def check_down_weighted_bwd(dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                            cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor) -> None:
    """The input checks of :func:`down_weighted_bwd` (shared with the TMA engine's)."""
    op = "down_weighted_bwd"
    check_float(op, None, dy=dy_RH, gate_up=gate_up_R2I, w_down=w_down_NHI)
    check_float(op, dy_RH.device, row_weights=row_weights_R)
    check_index(op, dy_RH.device, cum_token_counts=cum_token_counts)
    NR, H, I = w_down_NHI.shape
    R = dy_RH.shape[0] if dy_RH.dim() == 2 else -1
    if dy_RH.dim() != 2 or dy_RH.shape[1] != H or gate_up_R2I.dim() != 2 or gate_up_R2I.shape != (R, 2 * I):
        raise ValueError(f"{op}: dy {tuple(dy_RH.shape)} and gate_up {tuple(gate_up_R2I.shape)} do not fit "
                         f"down_proj {tuple(w_down_NHI.shape)} (expected [R, {H}] and [R, {2 * I}])")
    if row_weights_R.shape != (R,) or row_weights_R.dtype != torch.float32:
        raise ValueError(f"{op}: row_weights must be float32 [{R}], got {row_weights_R.dtype} "
                         f"{tuple(row_weights_R.shape)}")
    if cum_token_counts.numel() != NR + 1:
        raise ValueError(f"{op}: cum_token_counts has {cum_token_counts.numel()} entries, expected {NR + 1}")


def check_gate_up_bwd(d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                      cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor) -> None:
    """The input checks of :func:`gate_up_bwd` (shared with the TMA engine's)."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_bwd")
    check_float("gate_up_bwd", None, d_gate_up=d_gate_up_R2I, x=x_TH, w_gate_up=w_gate_up_N2IH)
    check_index("gate_up_bwd", x_TH.device, input_indices=input_indices, cum_token_counts=cum_token_counts)
    NR, two_i, H = w_gate_up_N2IH.shape
    if d_gate_up_R2I.dim() != 2 or d_gate_up_R2I.shape[1] != two_i or d_gate_up_R2I.shape[0] > input_indices.shape[0]:
        raise ValueError(f"gate_up_bwd: d_gate_up {tuple(d_gate_up_R2I.shape)} does not fit gate_up_proj "
                         f"{tuple(w_gate_up_N2IH.shape)} and {input_indices.shape[0]} input indices")

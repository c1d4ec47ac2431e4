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


@triton.jit
def round_to_grid(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``x`` rounded to nearest even onto the grid of a narrower float format with ``MANT``
    mantissa bits and smallest normal exponent ``MIN_EXP`` (its subnormals included; no overflow
    handling), in fp32 arithmetic: adding ``1.5 * 2**23`` quanta of x's binade rounds to a multiple
    of the quantum, subtracting them is exact; the sign bit is kept as it was (-0 stays -0)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    magic = (((e - MANT + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def to_fp8(x, code_ty: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """fp32 ``x`` (``|x|`` at most the format's largest code) as ``code_ty`` rounded to nearest even,
    as ``Tensor.to(float8)`` rounds. ``ROUND_FIRST`` (the interpreter): :func:`round_to_grid` first
    (``MANT``, ``MIN_EXP``: the format's), so that the cast only narrows an exact value: Triton's
    interpreter rounds fp32 to narrower floats wrongly (ties away from zero, and a mantissa that
    rounds up does not carry into the exponent: 31.73 becomes 16 in e4m3); the GPUs' ``cvt.rn``
    rounds right by itself."""
    if ROUND_FIRST:
        x = round_to_grid(x, MANT, MIN_EXP)
    return x.to(code_ty, fp_downcast_rounding="rtne")


@triton.jit
def to_float(x, out_ty: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """fp32 ``x`` as ``out_ty`` (fp32, bf16 or fp16) rounded to nearest even; ``ROUND_FIRST``: as in
    :func:`to_fp8`, for the interpreter."""
    if ROUND_FIRST:
        if out_ty == tl.bfloat16:
            x = round_to_grid(x, 7, -126)
        elif out_ty == tl.float16:
            x = round_to_grid(x, 10, -14)
    return x.to(out_ty, fp_downcast_rounding="rtne")


@triton.jit
def inverse_scale(amax, QMAX: tl.constexpr):
    """``qmax / amax`` (zero where ``amax`` is zero) and the scale ``amax / qmax``, both correctly
    rounded (Triton's ``/`` on fp32 is an approximate division on NVIDIA GPUs)."""
    qm = tl.full(amax.shape, QMAX, tl.float32)
    inv = tl.where(amax > 0, tl.math.div_rn(qm, tl.where(amax > 0, amax, 1.0)), 0.0)
    return inv, tl.math.div_rn(amax, qm)


@triton.jit
def silu(x):
    """``x / (1 + exp(-x))`` of fp32 ``x`` (torch's formula)."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def grouped_rows(v_ptr, idx_ptr, rw_ptr, rows, r_mask, offs_n, n_mask, N, stride_v,
                 GATHER: tl.constexpr, SILU: tl.constexpr, ROW_W: tl.constexpr):
    """fp32 ``[len(rows), BLOCK_N]`` values of rows ``rows`` (int64), columns ``offs_n``: ``v[src]``
    (``src = idx[rows]`` when ``GATHER``), or ``silu(gate) * up`` of ``gate_up = v`` (``SILU``: gate at
    column n, up at ``N + n``), times ``rw[rows]`` (``ROW_W``); zero where masked."""
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    else:
        src = rows
    mask = r_mask[:, None] & n_mask[None, :]
    ptrs = v_ptr + src[:, None] * stride_v + offs_n[None, :]
    if SILU:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + N, mask=mask, other=0.0).to(tl.float32)
        v = silu(gate) * up
    else:
        v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROW_W:
        v = v * tl.load(rw_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    return v


@triton.jit
def line_values(v_ptr, base, step, offs, c_mask, L, cs_rows, HAS_CS: tl.constexpr):
    """fp32 values at positions ``offs`` of the lines starting at ``base`` (``step`` apart), times their
    expert's column scales ``cs_rows`` (``HAS_CS``); their offsets and mask."""
    mask = c_mask[:, None] & (offs[None, :] < L)
    at = base + offs.to(tl.int64)[None, :] * step
    v = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_CS:
        v = v * tl.load(cs_rows + offs[None, :], mask=mask, other=0.0)
    return v, at, mask


@triton.jit
def gate_up_halves(gate_up_ptr, offs_r, offs_i, mask, I):
    """fp32 gate and up columns ``offs_i`` of rows ``offs_r`` (int64) of ``gate_up [R, 2I]``."""
    gu = gate_up_ptr + offs_r[:, None] * 2 * I + offs_i[None, :]
    gate = tl.load(gu, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu + I, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def quantize_tile(v, AXIS: tl.constexpr, E5M2: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """fp32 tile ``v`` as fp8 codes with one scale per slice along ``AXIS`` (reduced): ``e4m3``
    (``/448``) or ``E5M2`` (``/57344``); returns ``(codes, scales)``, zero codes for an all-zero slice."""
    amax = tl.max(tl.abs(v), axis=AXIS)
    if E5M2:
        inv, scale = inverse_scale(amax, 57344.0)
    else:
        inv, scale = inverse_scale(amax, 448.0)
    if AXIS == 1:
        scaled = v * inv[:, None]
    else:
        scaled = v * inv[None, :]
    if E5M2:
        q = to_fp8(scaled, tl.float8e5, 2, -14, ROUND_FIRST)
    else:
        q = to_fp8(scaled, tl.float8e4nv, 3, -6, ROUND_FIRST)
    return q, scale

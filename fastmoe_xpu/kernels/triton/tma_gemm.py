"""Stage 4 for Hopper-class NVIDIA GPUs (sm_90+): persistent grouped GEMMs fed by tensor descriptors (TMA).

The ``triton_tma`` engine of :mod:`fastmoe_xpu.kernels.registry`: the five GEMM launchers of the
contract (``gate_up_fwd``, ``down_fwd``, ``down_bwd``, ``down_weighted_bwd``, ``gate_up_bwd``) in the
same layouts as :mod:`.grouped_gemm` (``gate_up_proj [NR, 2I, H]``, ``down_proj [NR, H, I]``, read
in place); ``silu_mul_bwd`` and stages 2, 3 and 5 come from the kernel backend it is combined with.

What differs from :mod:`.grouped_gemm`:

* **Persistent grid.** One program per streaming multiprocessor (at most), each walking the work
  items ``pid, pid + P, pid + 2P, ...``. For the row GEMMs a work item is (expert, row tile, column
  tile) and the list is built on the device: every program reads ``cum_token_counts`` expert by
  expert and counts the row tiles of each (``cdiv(rows_e, BLOCK_M) * column tiles``), so no row
  count reaches the host and no program is launched for a tile that does not exist. Items of one
  expert are consecutive (row tile fastest), so programs running together share that expert's
  weight tiles in L2. For the weight gradients a work item is (expert, tile of ``dW_e``): their
  number is known on the host.
* **Tensor descriptors.** Host-side ``TensorDescriptor`` objects (the kernel argument is the TMA
  descriptor itself, so Hopper loads through ``cp.async.bulk.tensor`` = UTMALDG): the weights as
  ``[NR, N, K]`` / ``[NR, K, N]`` boxes (expert-exact bounds, zero fill past N and K); contiguous
  row operands (the down GEMM's ``h``, every input-gradient GEMM's rows, both weight gradients' row
  operands) as ``[R, width]``; whole output tiles stored through descriptors, an expert's last,
  partial row tile through masked pointer stores (a descriptor store would write the next
  expert's rows).
* **The gather stays in the A loads** where rows are gathered (``x[input_indices]`` in the gate/up
  forward and its weight gradient): pointer loads of the routed tokens, never materialised.
* Row tiles of a row operand that reach past the expert's last row read the next expert's rows:
  in the row GEMMs those output rows are never stored; in the weight gradients (which reduce over
  rows) the expert's last, partial k-step masks both operands, the whole steps before it run
  unmasked straight from shared memory into the tensor cores.

Descriptors need 16-byte aligned bases and row strides; shapes that do not give them (H=33 in
fp32, odd widths in 16-bit types) run :mod:`.grouped_gemm`'s kernels instead, call by call (model
widths always qualify). Configs: ``configs.py``'s ``tma_*`` lists, timed per shape bucket on the
GPU by :mod:`.autotune`. Written against the Triton API common to 3.6 and 3.9
(``triton.tools.tensor_descriptor.TensorDescriptor``, ``desc.load/store``).

Legend: T tokens, H hidden, I intermediate, NR local experts, R rows allocated (>= RT routed rows).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..configs import CONFIGS, dot_precision, table_for
from ..contract import check_float, check_index, check_stored_gemm_inputs
from . import combine as _combine
from . import grouped_gemm as _plain
from .launch import timed_launch
from .common import item_tile, next_expert, row_walk_start, tile


@triton.jit
def _tma_gate_up_fwd_kernel(
    x_ptr,
    input_idx_ptr,
    cum_token_ptr,
    w_desc,
    g_desc,
    u_desc,
    h_desc,
    gate_up_ptr,
    h_ptr,
    H,
    I,
    NR,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``gate_up[r] = x[input_indices[r]] @ W_e^T`` and ``h[r] = silu(gate) * up``, persistent.

    ``w_desc``: ``gate_up_proj`` as ``[NR, 2I, H]`` boxes ``[1, BLOCK_N, BLOCK_K]`` (gate rows at
    ``n``, up rows at ``I + n``); ``g_desc`` / ``u_desc``: the gate and up halves of ``gate_up [R, 2I]``
    as ``[R, I]`` views; ``h_desc``: ``h [R, I]``; all output boxes ``[BLOCK_M, BLOCK_N]``.
    """
    # item: this program's next work item; first: the first work item of expert e
    item, n_progs, tiles_n, first, row_end = row_walk_start(cum_token_ptr, I, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    out_ty = h_ptr.dtype.element_ty
    for e in range(NR):
        row_start, row_end, n_rows, tiles_m = next_expert(cum_token_ptr, e, row_end, BLOCK_M)
        while item < first + tiles_m * tiles_n:
            tile_m, n0 = item_tile(item - first, tiles_m, BLOCK_N)
            offs_m, m_mask = tile(tile_m, BLOCK_M, n_rows)
            tok = tl.load(input_idx_ptr + row_start + offs_m, mask=m_mask, other=0).to(tl.int64)
            a_ptrs = x_ptr + tok[:, None] * H + offs_k[None, :]
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < H - k0), other=0.0)
                bg = w_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
                bu = w_desc.load([e, I + n0, k0]).reshape(BLOCK_N, BLOCK_K)
                acc_g = tl.dot(a, bg.T, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu.T, acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            if (tile_m + 1) * BLOCK_M <= n_rows:
                row = row_start + tile_m * BLOCK_M
                g_desc.store([row, n0], acc_g.to(out_ty))
                u_desc.store([row, n0], acc_u.to(out_ty))
                h_desc.store([row, n0], h.to(out_ty))
            else:
                offs_n = n0 + tl.arange(0, BLOCK_N)
                rows = row_start.to(tl.int64) + offs_m
                mask = m_mask[:, None] & (offs_n[None, :] < I)
                gu_ptrs = gate_up_ptr + rows[:, None] * 2 * I + offs_n[None, :]
                tl.store(gu_ptrs, acc_g.to(out_ty), mask=mask)
                tl.store(gu_ptrs + I, acc_u.to(out_ty), mask=mask)
                tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], h.to(out_ty), mask=mask)
            item += n_progs
        first += tiles_m * tiles_n


@triton.jit
def _tma_grouped_mm_kernel(
    a_desc,
    w_desc,
    cum_token_ptr,
    out_desc,
    out_ptr,
    N,
    K,
    NR,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TRANS_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[r] = a[r] @ B_e`` for the rows r of each expert e, persistent.

    ``a_desc``: ``a [R, K]``, boxes ``[BLOCK_M, BLOCK_K]``; ``TRANS_W``: ``B_e = W_e^T`` with
    ``w_desc`` over ``W [NR, N, K]`` (boxes ``[1, BLOCK_N, BLOCK_K]``), else ``B_e = W_e`` over
    ``W [NR, K, N]`` (boxes ``[1, BLOCK_K, BLOCK_N]``); ``out_desc``: ``out [R, N]``.
    """
    item, n_progs, tiles_n, first, row_end = row_walk_start(cum_token_ptr, N, BLOCK_N)
    out_ty = out_ptr.dtype.element_ty
    for e in range(NR):
        row_start, row_end, n_rows, tiles_m = next_expert(cum_token_ptr, e, row_end, BLOCK_M)
        while item < first + tiles_m * tiles_n:
            tile_m, n0 = item_tile(item - first, tiles_m, BLOCK_N)
            row = row_start + tile_m * BLOCK_M
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row, k0])
                if TRANS_W:
                    b = w_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = w_desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if (tile_m + 1) * BLOCK_M <= n_rows:
                out_desc.store([row, n0], acc.to(out_ty))
            else:
                offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                rows = row_start.to(tl.int64) + offs_m
                tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc.to(out_ty),
                         mask=(offs_m[:, None] < n_rows) & (offs_n[None, :] < N))
            item += n_progs
        first += tiles_m * tiles_n


@triton.jit
def _tma_wgrad_kernel(
    a_desc,
    b_desc,
    b_ptr,
    idx_ptr,
    cum_token_ptr,
    dw_desc,
    M,
    N,
    NR,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Weight gradient ``dW_e = a[rows_e]^T @ B(rows_e)``, persistent over (expert, dW tile).

    ``a_desc``: ``a [R, M]``, boxes ``[BLOCK_K, BLOCK_M]``. B: ``GATHER``: ``b [T, N]`` rows
    ``idx[r]`` through pointer loads; else ``b_desc`` over ``b [R, N]``, boxes ``[BLOCK_K, BLOCK_N]``.
    ``dw_desc``: ``dW [NR, M, N]``, boxes ``[1, BLOCK_M, BLOCK_N]``; experts without rows get zero
    tiles. The down GEMM's B (``rw * silu(gate) * up``) comes written by ``row_dot_scale``, not
    recomputed between the loads and the dot (see the plain engine's ``_grouped_mm_bwd_kernel``).
    """
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_expert = tiles_m * tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for item in range(pid, NR * per_expert, n_progs):
        e = item // per_expert
        local = item % per_expert
        m0 = (local % tiles_m) * BLOCK_M
        n0 = (local // tiles_m) * BLOCK_N
        row_start = tl.load(cum_token_ptr + e)
        n_rows = tl.load(cum_token_ptr + e + 1) - row_start
        n_full = (n_rows // BLOCK_K) * BLOCK_K
        offs_n = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Whole k-steps: every row belongs to expert e.
        for k0 in range(0, n_full, BLOCK_K):
            row = row_start + k0
            a = a_desc.load([row, m0])
            if GATHER:
                src = tl.load(idx_ptr + row + offs_k).to(tl.int64)
                b = tl.load(b_ptr + src[:, None] * N + offs_n[None, :], mask=offs_n[None, :] < N, other=0.0)
            else:
                b = b_desc.load([row, n0])
            acc = tl.dot(a.T, b, acc, input_precision=DOT_PRECISION)
        # The partial last k-step: rows past the expert's end masked out of both operands.
        if n_full < n_rows:
            row = row_start + n_full
            k_mask = offs_k < n_rows - n_full
            a = tl.where(k_mask[:, None], a_desc.load([row, m0]), 0.0)
            if GATHER:
                src = tl.load(idx_ptr + row + offs_k, mask=k_mask, other=0).to(tl.int64)
                b = tl.load(b_ptr + src[:, None] * N + offs_n[None, :], mask=k_mask[:, None] & (offs_n[None, :] < N),
                            other=0.0)
            else:
                b = tl.where(k_mask[:, None], b_desc.load([row, n0]), 0.0)
            acc = tl.dot(a.T, b, acc, input_precision=DOT_PRECISION)
        dw_desc.store([e, m0, n0], acc.to(dw_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))


# ---------------------------------------------------------------- launchers
#: Programs of the persistent grid under the interpreter (a few, so the work-item loops run).
INTERPRETER_PROGRAMS = 3
_ALIGN = 16


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_type: str, index: int | None) -> int:
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    return int(props.multi_processor_count)


def num_programs(device: torch.device, work_items: int) -> int:
    """Programs of a persistent grid: the streaming multiprocessors (one resident program each), at
    most ``work_items``; :data:`INTERPRETER_PROGRAMS` on the CPU."""
    slots = INTERPRETER_PROGRAMS if device.type == "cpu" else _multiprocessors(device.type, device.index)
    return max(1, min(slots, work_items))


def descriptor_ready(*tensors: torch.Tensor) -> bool:
    """Whether every 2-D/3-D ``tensors`` view can back a TMA descriptor: unit last stride, 16-byte
    aligned start and other strides, no empty dimension."""
    for t in tensors:
        size = t.element_size()
        if t.numel() == 0 or t.stride(-1) != 1 or t.data_ptr() % _ALIGN:
            return False
        if any((s * size) % _ALIGN for s in t.stride()[:-1]):
            return False
    return True


def _table(device: torch.device) -> str | None:
    """The config table for these kernels on ``device``, or None where it has none (then the plain
    kernels run)."""
    table = table_for(device)
    return table if "tma_grouped_mm" in CONFIGS[table] else None


def _desc(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _routed_program_bound(R: int, NR: int, block_m: int, tiles_n: int) -> int:
    """Most work items of a row GEMM: every expert's row tiles (``sum_e cdiv(rows_e, BLOCK_M) <=
    cdiv(R, BLOCK_M) + NR``) times the column tiles."""
    return (triton.cdiv(R, block_m) + NR) * tiles_n


def _routed_grid(device: torch.device, R: int, N: int, NR: int):  # noqa: ANN202
    """The persistent grid of a row GEMM of an ``N``-wide output, for a config's tile sizes."""
    return lambda meta: (num_programs(device, _routed_program_bound(R, NR, meta["BLOCK_M"],
                                                                    triton.cdiv(N, meta["BLOCK_N"]))),)


def gate_up_fwd(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = x[input_indices] @ w_gate_up[e]^T`` per expert group and
    ``h [R, I] = silu(gate) * up``; R = ``len(input_indices)``, rows past RT unspecified."""
    _plain.check_gate_up_fwd_inputs(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    T, H = x_TH.shape
    NR, two_i, _ = w_gate_up_N2IH.shape
    I = two_i // 2
    R = input_indices.shape[0]
    dev = x_TH.device
    table = _table(dev)
    if two_i % 2 or R == 0 or T == 0 or I == 0 or table is None:
        return _plain.gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    gate_up = x_TH.new_empty(R, two_i)
    h = x_TH.new_empty(R, I)
    if not descriptor_ready(w_gate_up_N2IH, gate_up[:, :I], gate_up[:, I:], h):
        return _plain.gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)

    def args(meta):
        bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
        return (x_TH, input_indices, cum_token_counts, _desc(w_gate_up_N2IH, [1, bn, bk]), _desc(gate_up[:, :I], [bm, bn]),
                _desc(gate_up[:, I:], [bm, bn]), _desc(h, [bm, bn]), gate_up, h, H, I, NR)

    timed_launch(_tma_gate_up_fwd_kernel, "tma_gate_up_fwd", table, (I, H, R, NR), _routed_grid(dev, R, I, NR), args,
                 dev, dtype=x_TH.dtype, DOT_PRECISION=dot_precision(table, x_TH.dtype))
    return gate_up, h


def _grouped_mm(a_RK: torch.Tensor, w: torch.Tensor, cum_token_counts: torch.Tensor, trans_w: bool) -> torch.Tensor:
    """``out [R, N] = a @ W_e^T`` (``trans_w``, ``W [NR, N, K]``) or ``a @ W_e`` (``W [NR, K, N]``)."""
    NR = w.shape[0]
    N, K = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    R = a_RK.shape[0]
    dev = a_RK.device
    table = _table(dev)
    if R == 0 or N == 0 or K == 0 or table is None:
        return _plain._grouped_mm(a_RK, w, cum_token_counts, trans_w)
    out = a_RK.new_empty(R, N)
    if not descriptor_ready(a_RK, w, out):
        return _plain._grouped_mm(a_RK, w, cum_token_counts, trans_w)

    def args(meta):
        bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
        w_box = [1, bn, bk] if trans_w else [1, bk, bn]
        return _desc(a_RK, [bm, bk]), _desc(w, w_box), cum_token_counts, _desc(out, [bm, bn]), out, N, K, NR

    timed_launch(_tma_grouped_mm_kernel, "tma_grouped_mm", table, (N, K, R, NR), _routed_grid(dev, R, N, NR), args,
                 dev, dtype=a_RK.dtype, TRANS_W=trans_w, DOT_PRECISION=dot_precision(table, a_RK.dtype))
    return out


def _wgrad(a_RM: torch.Tensor, b: torch.Tensor, idx: torch.Tensor | None, cum_token_counts: torch.Tensor,
           w_like: torch.Tensor) -> torch.Tensor:
    """``dW [NR, M, N]``: ``a[rows_e]^T @ b[rows_e]`` (``b`` gathered by ``idx`` when given)."""
    NR, M, N = w_like.shape
    dev = a_RM.device
    table = _table(dev)
    R = a_RM.shape[0]
    b_views = (b,) if idx is None else ()
    if R == 0 or M == 0 or N == 0 or table is None or not descriptor_ready(a_RM, w_like, *b_views):
        return _plain._grouped_mm_wgrad(a_RM, b, idx, cum_token_counts, w_like)
    dw = torch.empty_like(w_like)

    def args(meta):
        bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
        a_desc = _desc(a_RM, [bk, bm])
        # gathered rows: pointer loads; the descriptor argument is an unread stand-in
        b_desc = _desc(b, [bk, bn]) if idx is None else a_desc
        return (a_desc, b_desc, b, idx if idx is not None else cum_token_counts, cum_token_counts,
                _desc(dw, [1, bm, bn]), M, N, NR)

    def grid(meta):
        return (num_programs(dev, NR * triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    timed_launch(_tma_wgrad_kernel, "tma_grouped_mm_bwd", table, (N, M, R, NR), grid, args, dev, dtype=a_RM.dtype,
                 GATHER=idx is not None, DOT_PRECISION=dot_precision(table, a_RM.dtype))
    return dw


def down_fwd(
    h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, transposed: bool = False
) -> torch.Tensor:
    """``y [R, H] = h @ w_down[e]^T`` per expert group; rows past RT unspecified. ``transposed``
    (``w_down`` stored ``[NR, I, H]``): ``y = h @ w_down[e]``."""
    _plain.check_down_fwd_inputs(h_RI, cum_token_counts, w_down_NHI, transposed)
    return _grouped_mm(h_RI, w_down_NHI, cum_token_counts, not transposed)


def down_bwd(
    dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
    transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh [R, I] = dy @ w_down[e]`` and ``dw_down [NR, H, I] = dy_e^T @ h_e`` (zero for empty
    experts); ``transposed`` (stored ``[NR, I, H]``): ``dh = dy @ w_down[e]^T`` and
    ``dw_down [NR, I, H] = h_e^T @ dy_e``."""
    check_stored_gemm_inputs(dy_RH, w_down_NHI, cum_token_counts, "down_bwd", not transposed)
    check_float("down_bwd", None, dy=dy_RH, h=h_RI, w_down=w_down_NHI)
    check_index("down_bwd", dy_RH.device, cum_token_counts=cum_token_counts)
    I = w_down_NHI.shape[1] if transposed else w_down_NHI.shape[2]
    if h_RI.dim() != 2 or h_RI.shape != (dy_RH.shape[0], I):
        raise ValueError(f"down_bwd: h {tuple(h_RI.shape)} does not fit dy {tuple(dy_RH.shape)} and down_proj "
                         f"{tuple(w_down_NHI.shape)} (transposed={transposed}; expected [R, {I}])")
    dh = _grouped_mm(dy_RH, w_down_NHI, cum_token_counts, transposed)
    if transposed:
        return dh, _wgrad(h_RI, dy_RH, None, cum_token_counts, w_down_NHI)
    return dh, _wgrad(dy_RH, h_RI, None, cum_token_counts, w_down_NHI)


def down_weighted_bwd(dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                      cum_token_counts: torch.Tensor,
                      w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the weighted down GEMM given the unweighted row gradients ``dy``:
    ``(dh [R, I] = w_r * dy_r @ w_down[e], dw_down [NR, H, I] = sum_r w_r dy_r^T h_r,
    d_row_weights [R] fp32 = <dy_r @ w_down[e], h_r>)`` with ``h = silu(gate) * up`` recomputed
    from ``gate_up`` (never saved; ``w * h`` written by ``row_dot_scale`` for the weight gradient and
    freed after it). Rows past RT are unspecified."""
    _plain.check_down_weighted_bwd(dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI)
    dh = _grouped_mm(dy_RH, w_down_NHI, cum_token_counts, False)
    d_row_w, hw = _plain.row_dot_scale(dh, gate_up_R2I, row_weights_R, cum_token_counts)
    dw = _wgrad(dy_RH, hw, None, cum_token_counts, w_down_NHI)
    return dh, dw, d_row_w


def down_silu_bwd(dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                  selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
                  input_indices: torch.Tensor, gate_up_R2I: torch.Tensor, cum_token_counts: torch.Tensor,
                  w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused down backward (``contract.FUSED_LAUNCHERS``) on this engine's GEMMs: ``(d_gate_up [R, 2I],
    dw_down, d_row_weights [R] fp32)``. The output gradient's rows are written once by ``combine_bwd``
    (TMA descriptors load boxes of consecutive rows, not gathered ones); the SiLU*up gradient is formed
    in the router-weight pass (``row_dot_scale`` with ``silu_bwd``), so ``dh`` makes no round trip
    through ``silu_mul_bwd``. ``input_indices`` is not read."""
    dy_RH, row_weights_R = _combine.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                                cum_expert_counts)
    _plain.check_down_weighted_bwd(dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI)
    dh = _grouped_mm(dy_RH, w_down_NHI, cum_token_counts, False)
    d_row_w, hw, d_gate_up = _plain.row_dot_scale(dh, gate_up_R2I, row_weights_R, cum_token_counts, silu_bwd=True)
    del dh
    dw = _wgrad(dy_RH, hw, None, cum_token_counts, w_down_NHI)
    return d_gate_up, dw, d_row_w


def gate_up_bwd(d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = d_gate_up @ w_gate_up[e]`` and ``dw_gate_up [NR, 2I, H] = d_e^T @ x[rows_e]``
    (the gather fused into the weight-gradient loads; zero for empty experts)."""
    _plain.check_gate_up_bwd(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    dx_rows = _grouped_mm(d_gate_up_R2I, w_gate_up_N2IH, cum_token_counts, False)
    dw = _wgrad(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
    return dx_rows, dw


#: The launchers this engine provides (``silu_mul_bwd`` comes from the kernel backend), and its fused one.
LAUNCHERS = ("gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "gate_up_bwd", "down_silu_bwd")

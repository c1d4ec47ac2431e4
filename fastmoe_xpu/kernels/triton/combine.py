"""Stage 5 in Triton: the (weighted) reduction of expert rows back to tokens, and its backward.

Forward is deterministic: a program owns a block of tokens and a block of columns and walks each
token's slots in k order, so every output element is summed by one program in a fixed order (no
atomics). Backward walks the same slots: each slot's row gradient is written by exactly one
program, and the router-weight gradients of a token are finished inside its program.

Legend: T tokens, H hidden, K experts per token, R rows allocated (>= routed rows RT).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import table_for, get_config
from ..contract import check_float, check_index
from . import launch as _launch
from .common import slot_row, tile, token_slots


@triton.jit
def _combine_fwd_kernel(
    y_ptr,
    weights_ptr,
    output_idx_ptr,
    selected_ptr,
    cum_expert_ptr,
    out_ptr,
    T,
    H,
    K,
    WEIGHTED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_i w_i * y[output_indices[i]]`` over the slots i of token t, in slot order.

    Grid ``(ceil(T/BLOCK_T), ceil(H/BLOCK_H))``; program ``(p, c)`` owns tokens
    ``[p*BLOCK_T, (p+1)*BLOCK_T)`` and columns ``[c*BLOCK_H, (c+1)*BLOCK_H)`` of ``out [T, H]``
    (y's dtype, fp32 accumulation). Reads ``y [R, H]``, ``cum_expert_counts [T+1]`` int32,
    ``output_indices [R]`` int32 and, when ``WEIGHTED``, ``selected_expert_indices [R]`` int32
    and ``weights [T, K]`` (``w_i = weights[t, selected_expert_indices[i]]``; else ``w_i = 1``).
    """
    offs_t, t_mask, first, count = token_slots(cum_expert_ptr, T, BLOCK_T)
    offs_h, h_mask = tile(tl.program_id(1), BLOCK_H, H)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(0, tl.max(count, axis=0)):
        has, row = slot_row(output_idx_ptr, first, count, j)
        y = tl.load(y_ptr + row[:, None] * H + offs_h[None, :], mask=has[:, None] & h_mask[None, :], other=0.0)
        y = y.to(tl.float32)
        if WEIGHTED:
            k = tl.load(selected_ptr + first + j, mask=has, other=0)
            w = tl.load(weights_ptr + offs_t.to(tl.int64) * K + k, mask=has, other=0.0).to(tl.float32)
            y = y * w[:, None]
        acc += y
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * H + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_bwd_kernel(
    dout_ptr,
    weights_ptr,
    output_idx_ptr,
    selected_ptr,
    cum_expert_ptr,
    dy_ptr,
    row_w_ptr,
    T,
    H,
    K,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_DY: tl.constexpr,
):
    """``dy[row_i] = dout[t]`` (unweighted) and ``row_w[row_i] = weights[t, k_i]`` per slot i of t;
    without ``WRITE_DY`` only ``row_w`` (grid ``(ceil(T/BLOCK_T), 1)``; ``dout`` and ``dy`` not read).

    Grid ``(ceil(T/BLOCK_T), ceil(H/BLOCK_H))``; program ``(p, c)`` owns tokens
    ``[p*BLOCK_T, (p+1)*BLOCK_T)`` and columns ``[c*BLOCK_H, (c+1)*BLOCK_H)`` of their rows of
    ``dy [R, H]`` (dout's dtype); column block 0 also writes their ``row_w [R]`` fp32. Reads
    ``dout [T, H]``, ``weights [T, K]``, ``cum_expert_counts [T+1]``, ``output_indices [R]`` and
    ``selected_expert_indices [R]`` int32. No expert outputs: the router-weight gradient is formed
    in the down GEMM's backward.
    """
    offs_t, t_mask, first, count = token_slots(cum_expert_ptr, T, BLOCK_T)
    offs_h, h_mask = tile(tl.program_id(1), BLOCK_H, H)
    tok = offs_t.to(tl.int64)
    if WRITE_DY:
        dout = tl.load(dout_ptr + tok[:, None] * H + offs_h[None, :], mask=t_mask[:, None] & h_mask[None, :],
                       other=0.0)
    for j in range(0, tl.max(count, axis=0)):
        has, row = slot_row(output_idx_ptr, first, count, j)
        if WRITE_DY:
            tl.store(dy_ptr + row[:, None] * H + offs_h[None, :], dout.to(dy_ptr.dtype.element_ty),
                     mask=has[:, None] & h_mask[None, :])
        if tl.program_id(1) == 0:
            k = tl.load(selected_ptr + first + j, mask=has, other=0)
            w = tl.load(weights_ptr + tok * K + k, mask=has, other=0.0).to(tl.float32)
            tl.store(row_w_ptr + row, w, mask=has)


@triton.jit
def _router_weights_bwd_kernel(
    d_row_w_ptr,
    output_idx_ptr,
    selected_ptr,
    cum_expert_ptr,
    dweights_ptr,
    T,
    K,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``dweights[t, k_i] = d_row_w[row_i]`` per slot i of t, zero for choices without a local slot.

    Grid ``(ceil(T/BLOCK_T),)``; program ``p`` owns the rows ``[p*BLOCK_T, (p+1)*BLOCK_T)`` of
    ``dweights [T, K]`` (its dtype) and writes each element once. Reads ``d_row_w [R]`` fp32,
    ``cum_expert_counts [T+1]``, ``output_indices [R]``, ``selected_expert_indices [R]`` int32;
    ``BLOCK_K >= K``.
    """
    offs_t, t_mask, first, count = token_slots(cum_expert_ptr, T, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    dw = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for j in range(0, tl.max(count, axis=0)):
        has, row = slot_row(output_idx_ptr, first, count, j)
        k = tl.load(selected_ptr + first + j, mask=has, other=0)
        g = tl.load(d_row_w_ptr + row, mask=has, other=0.0)
        dw += tl.where((offs_k[None, :] == k[:, None]) & has[:, None], g[:, None], 0.0)
    tl.store(dweights_ptr + offs_t[:, None].to(tl.int64) * K + offs_k[None, :], dw.to(dweights_ptr.dtype.element_ty),
             mask=t_mask[:, None] & (offs_k[None, :] < K))


# ---------------------------------------------------------------- launchers
def combine_fwd(y_RH: torch.Tensor, weights_TK: torch.Tensor | None, output_indices: torch.Tensor,
                selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum over slots i of t of weights[t, sel[i]] * y[output_indices[i]]`` (``[T, H]``);
    ``weights_TK=None`` sums unweighted (the input gradient's reduction)."""
    dev = y_RH.device
    if y_RH.dim() != 2:
        raise ValueError(f"combine_fwd: y must be [R, H], got {tuple(y_RH.shape)}")
    check_float("combine_fwd", dev, y=y_RH)
    check_index("combine_fwd", dev, output_indices=output_indices, selected_expert_indices=selected_expert_indices,
                cum_expert_counts=cum_expert_counts)
    T = cum_expert_counts.numel() - 1
    H = y_RH.shape[1]
    K = 1
    if weights_TK is not None:
        check_float("combine_fwd", dev, weights=weights_TK)
        if weights_TK.dim() != 2 or weights_TK.shape[0] != T:
            raise ValueError(f"combine_fwd: weights {tuple(weights_TK.shape)} do not match "
                             f"cum_expert_counts of {T} tokens (expected [{T}, K])")
        K = weights_TK.shape[1]
    out = y_RH.new_empty(T, H)
    if T <= 0 or H == 0:
        return out
    cfg = get_config(table_for(dev), "combine_fwd")
    grid = (triton.cdiv(T, cfg.meta["BLOCK_T"]), triton.cdiv(H, cfg.meta["BLOCK_H"]))
    _launch.launch(
        _combine_fwd_kernel, grid,
        (y_RH, weights_TK if weights_TK is not None else y_RH, output_indices, selected_expert_indices,
         cum_expert_counts, out, T, H, K),
        cfg, dev, WEIGHTED=weights_TK is not None,
    )
    return out


def _check_slots(op: str, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                 selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor) -> tuple[int, int]:
    dev = weights_TK.device
    check_float(op, dev, weights=weights_TK)
    if weights_TK.dim() != 2:
        raise ValueError(f"{op}: weights must be [T, K], got {tuple(weights_TK.shape)}")
    check_index(op, dev, output_indices=output_indices, selected_expert_indices=selected_expert_indices,
                cum_expert_counts=cum_expert_counts)
    T, K = weights_TK.shape
    if cum_expert_counts.numel() != T + 1:
        raise ValueError(f"{op}: weights {tuple(weights_TK.shape)} and cum_expert_counts "
                         f"({cum_expert_counts.numel()},) disagree (expected {T + 1} entries)")
    return T, K


def combine_bwd(dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                selected_expert_indices: torch.Tensor,
                cum_expert_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy[row] = dout[t]`` (unweighted) and ``row_weights[row] = weights[t, k]`` (fp32) for each
    slot (t, k, row), from the weights and the indices alone. ``R = len(output_indices)`` rows;
    rows no slot points at are unspecified."""
    dev = dout_TH.device
    check_float("combine_bwd", dev, dout=dout_TH)
    if dout_TH.dim() != 2:
        raise ValueError(f"combine_bwd: dout must be [T, H], got {tuple(dout_TH.shape)}")
    T, K = _check_slots("combine_bwd", weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
    H = dout_TH.shape[1]
    if dout_TH.shape[0] != T:
        raise ValueError(f"combine_bwd: dout {tuple(dout_TH.shape)} and weights {tuple(weights_TK.shape)} disagree")
    R = output_indices.shape[0]
    dy = dout_TH.new_empty(R, H)
    row_w = torch.empty(R, dtype=torch.float32, device=dev)
    if T == 0 or H == 0:
        return dy, row_w
    cfg = get_config(table_for(dev), "combine_bwd")
    grid = (triton.cdiv(T, cfg.meta["BLOCK_T"]), triton.cdiv(H, cfg.meta["BLOCK_H"]))
    _launch.launch(
        _combine_bwd_kernel, grid,
        (dout_TH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts, dy, row_w, T, H, K),
        cfg, dev, WRITE_DY=True,
    )
    return dy, row_w


def row_weights(weights_TK: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
                cum_expert_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``row_weights [rows] fp32``, ``row_weights[row] = weights[t, k]`` for each slot (t, k, row): the
    second half of :func:`combine_bwd` alone (``_combine_bwd_kernel`` without ``WRITE_DY``), for a
    backward that reads the output gradient's rows in its GEMM loads. Rows no slot points at are
    unspecified."""
    T, K = _check_slots("row_weights", weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
    dev = weights_TK.device
    row_w = torch.empty(rows, dtype=torch.float32, device=dev)
    if T == 0 or rows == 0:
        return row_w
    cfg = get_config(table_for(dev), "combine_bwd")
    _launch.launch(
        _combine_bwd_kernel, (triton.cdiv(T, cfg.meta["BLOCK_T"]), 1),
        (weights_TK, weights_TK, output_indices, selected_expert_indices, cum_expert_counts, row_w, row_w, T, 0, K),
        cfg, dev, WRITE_DY=False,
    )
    return row_w


def router_weights_bwd(d_row_weights_R: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                       selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor) -> torch.Tensor:
    """``dweights [T, K]`` (weights' dtype): ``dweights[t, k] = d_row_weights[row]`` for each local
    slot (t, k, row), zero for choices of experts elsewhere; each element written once."""
    T, K = _check_slots("router_weights_bwd", weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
    dev = weights_TK.device
    if d_row_weights_R.dtype != torch.float32 or d_row_weights_R.dim() != 1 or d_row_weights_R.device != dev:
        raise ValueError(f"router_weights_bwd: d_row_weights must be a float32 [R] tensor on {dev}, got "
                         f"{d_row_weights_R.dtype} {tuple(d_row_weights_R.shape)} on {d_row_weights_R.device}")
    dweights = torch.empty(T, K, dtype=weights_TK.dtype, device=dev)
    if T == 0:
        return dweights
    cfg = get_config(table_for(dev), "router_weights_bwd")
    _launch.launch(
        _router_weights_bwd_kernel, (triton.cdiv(T, cfg.meta["BLOCK_T"]),),
        (d_row_weights_R, output_indices, selected_expert_indices, cum_expert_counts, dweights, T, K),
        cfg, dev, BLOCK_K=triton.next_power_of_2(K),
    )
    return dweights

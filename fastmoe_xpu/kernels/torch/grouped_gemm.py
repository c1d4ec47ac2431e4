"""Stage 4 in plain PyTorch: grouped GEMMs over merged expert weights, a piece of rows at a time.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..contract import check_gemm_inputs, check_stored_gemm_inputs
from .buffers import cached_empty, piece_rows


def _bounds(cum_token_counts: torch.Tensor) -> list[int]:
    return cum_token_counts.tolist()


def _groups(bounds: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, first row, end row)`` of every local expert that has rows. The loops visit these
    alone: at decode (one token, K of NR experts) most experts are empty, and a visit costs
    Python and view ops (about 1 us each) next to a GEMM of a few rows."""
    return [(e, s, t) for e, (s, t) in enumerate(zip(bounds, bounds[1:])) if t > s]


def _empty_runs(bounds: list[int]) -> list[tuple[int, int]]:
    """``[a, b)`` for each maximal run of consecutive local experts without rows: one ``zero_`` per
    run fills their weight gradients."""
    runs: list[tuple[int, int]] = []
    for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
        if t > s:
            continue
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs


def _zero_empty(dw: torch.Tensor, bounds: list[int]) -> None:
    """Zero the weight gradient of every local expert without rows."""
    for a, b in _empty_runs(bounds):
        dw[a:b].zero_()


def _per_expert(
    w: torch.Tensor, groups: list[tuple[int, int, int]]
) -> Sequence[torch.Tensor] | dict[int, torch.Tensor]:
    """Expert ``e``'s matrix ``w[e]`` for every expert in ``groups``, indexable by ``e``: one ``unbind``
    (about 0.3 us a view, every expert's) when at least half the experts have rows, else ``w[e]``
    for those alone (about 0.7 us each): at one decode token, 8 views instead of 64."""
    if 2 * len(groups) >= w.shape[0]:
        return w.unbind(0)
    return {e: w[e] for e, _, _ in groups}


def _expert_pieces(groups: list[tuple[int, int, int]], min_rows: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive groups (non-empty experts, so a piece's rows are contiguous) in pieces of at
    least ``min_rows`` rows (the last may be short); none without groups."""
    pieces: list[list[tuple[int, int, int]]] = []
    rows = min_rows
    for g in groups:
        if rows >= min_rows:
            pieces.append([])
            rows = 0
        pieces[-1].append(g)
        rows += g[2] - g[1]
    return pieces


def _counts(groups: list[tuple[int, int, int]]) -> list[int]:
    """Rows of every group, for ``Tensor.split``: one call gives every expert's row block, where a
    slice per expert costs a dispatch each (about 1 us)."""
    return [t - s for _, s, t in groups]


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) with ``torch.mm``: the GEMM of this engine's
    launchers (:func:`launchers_on` builds them around a GEMM, so that another engine,
    ``kernels/torch/onednn.py``, runs the same loops on its own)."""
    if accumulate:
        torch.addmm(out, a, b, out=out)
    else:
        torch.mm(a, b, out=out)


MatMul = Callable[..., None]
_HALF = (torch.bfloat16, torch.float16)


def _silu_mul(gate_up_R2I: torch.Tensor, out_RI: torch.Tensor) -> None:
    inter = out_RI.shape[1]
    torch._C._nn.silu(gate_up_R2I[:, :inter], out=out_RI)
    out_RI.mul_(gate_up_R2I[:, inter:])


def _down_weighted_bwd_one_piece(
    dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor, bounds: list[int],
    w_down_NHI: torch.Tensor, dh_RI: torch.Tensor, dw_NHI: torch.Tensor, d_row_w: torch.Tensor, mm: MatMul,
) -> None:
    """:func:`down_weighted_bwd` (fp32) when all RT rows fit one piece: ``h``, the row dot products
    and the weight scaling run once over every row and only the two GEMMs go expert by expert,
    where the piece loop spends eight ops per expert (195 -> 88 us at T=48 H=64 I=32 E=8 K=2,
    two threads; the same ops over fewer rows for any RT up to one piece, so no other threshold)."""
    rt = bounds[-1]
    groups = _groups(bounds)
    counts = _counts(groups)
    h = torch.empty(rt, dh_RI.shape[1], dtype=dy_RH.dtype, device=dy_RH.device)
    _silu_mul(gate_up_R2I[:rt], h)
    dy = dy_RH[:rt]
    dy_e = dy.split(counts)
    w_e = _per_expert(w_down_NHI, groups)
    for (e, _, _), a, o in zip(groups, dy_e, dh_RI.split(counts)):
        mm(a, w_e[e], o)  # unweighted: its dot with h is the weight's gradient
    torch.linalg.vecdot(dh_RI, h, out=d_row_w)
    w = row_weights_R[:rt, None]
    dh_RI.mul_(w)
    h.mul_(w)
    _zero_empty(dw_NHI, bounds)
    dw_e = _per_expert(dw_NHI, groups)
    for (e, _, _), a, h_rows in zip(groups, dy_e, h.split(counts)):
        mm(a.t(), h_rows, dw_e[e])


#: Rows of fewer columns than this make an elementwise pass over a column slice (gate or up of
#: ``[R, 2I]``) several times slower than over a contiguous tensor: ATen's loop then runs row by row
#: (SiLU over ``[512, 24]`` of a ``[512, 48]`` tensor: 49 us, contiguous 8 us, on an AVX-512 CPU).
#: :func:`silu_mul_bwd` copies gate and up out first there (two copies of 5 us at that size):
#: 111 -> 37 us at I=24, 129 -> 58 at I=48, even at 64, slower from 128 (docs/small_shapes.md).
SHORT_ROWS = 64


def silu_mul_bwd(
    gate_up_R2I: torch.Tensor, dh_RI: torch.Tensor, cum_token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of ``silu(gate) * up`` with respect to ``[gate, up]``: ``[R, 2I]``. This backend's
    row buffers hold exactly the RT routed rows, so ``cum_token_counts`` changes nothing here.

    ``d_gate = silu'(gate) * (dh * up)`` (ATen's fused ``silu_backward``), ``d_up = dh * silu(gate)``:
    four passes, a piece of rows at a time so that they hit the cache; bf16 is computed in fp32.
    Below :data:`SHORT_ROWS` columns the passes run on contiguous copies of gate and up instead of
    their column slices (see there).
    """
    rt, inter = dh_RI.shape
    out_R2I = cached_empty((rt, 2 * inter), dh_RI)
    exact = dh_RI.dtype == torch.float32
    if inter < SHORT_ROWS:
        gate = gate_up_R2I[:rt, :inter].float().contiguous()
        up = gate_up_R2I[:rt, inter:].float().contiguous()
        dh = dh_RI.float().contiguous()
        d_gate = torch.ops.aten.silu_backward(torch.mul(dh, up), gate)
        d_up = torch._C._nn.silu(gate).mul_(dh)
        if not exact:
            d_gate, d_up = d_gate.to(dh_RI.dtype), d_up.to(dh_RI.dtype)
        return torch.cat([d_gate, d_up], 1, out=out_R2I)
    step = max(1, min(rt, piece_rows(inter)))
    tmp_buf = cached_empty((step, inter), dh_RI, torch.float32)
    low_buf = None if exact else cached_empty((step, 2 * inter), dh_RI, torch.float32)
    for s in range(0, rt, step):
        t = min(rt, s + step)
        gate = gate_up_R2I[s:t, :inter].float()
        up = gate_up_R2I[s:t, inter:].float()
        dh = dh_RI[s:t].float()
        tmp = tmp_buf[: t - s]
        res = out_R2I[s:t] if exact else low_buf[: t - s]
        torch.mul(dh, up, out=tmp)
        torch.ops.aten.silu_backward.grad_input(tmp, gate, grad_input=res[:, :inter])
        torch._C._nn.silu(gate, out=tmp)
        torch.mul(tmp, dh, out=res[:, inter:])
        if not exact:
            out_R2I[s:t].copy_(res)
    return out_R2I


def launchers_on(mm: MatMul) -> dict[str, Callable[..., Any]]:
    """This engine's stage-4 launchers with ``mm`` as their GEMM (:func:`mm_into` for ``loop``;
    ``kernels/torch/onednn.py`` passes oneDNN's), each with the contract's signature."""

    def wgrad(left_t: torch.Tensor, right: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """A weight gradient's GEMM, ``out (+)= left_t @ right``, ``left_t`` an expert's rows transposed
        (a view). In bf16/fp16 on the CPU ``left_t`` is copied by row into a buffer first: oneDNN ran
        these GEMMs 1.1-2.1x faster so, the copy included (one thread, Xeon with AMX, 2026-11-29, at
        the int8-layer and Mula-7B shapes; fp32 within 4% either way, so it is left as it is)."""
        if left_t.dtype in _HALF and left_t.device.type == "cpu" and not left_t.is_contiguous():
            left_t = cached_empty(tuple(left_t.shape), left_t).copy_(left_t)
        mm(left_t, right, out, accumulate=accumulate)

    def gate_up_fwd(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                    w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up [R, 2I] = x[input_indices] @ w_gate_up[e]^T`` per expert group, and
        ``h [R, I] = silu(gate) * up``. R is ``input_indices``' length (at least RT); rows past RT
        are zero, so a caller that sizes for the worst case (the custom ops, R = T*K) gets defined rows.

        A piece of consecutive experts at a time: their rows are gathered into a cached buffer, each
        expert's GEMM reads its part, and SiLU*up runs on the piece's fresh GEMM output, so the gathered
        ``[R, H]`` input never exists whole and ``gate_up`` is not read back from memory.
        """
        check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
        bounds = _bounds(cum_token_counts)
        rt = bounds[-1]
        rows_out = max(rt, input_indices.shape[0])
        two_i = w_gate_up_N2IH.shape[1]
        gate_up_R2I = cached_empty((rows_out, two_i), x_TH)
        h_RI = cached_empty((rows_out, two_i // 2), x_TH)
        if rows_out > rt:
            gate_up_R2I[rt:].zero_()
            h_RI[rt:].zero_()
        groups = _groups(bounds)
        if not groups:
            return gate_up_R2I, h_RI
        pieces = _expert_pieces(groups, piece_rows(x_TH.shape[1]))
        buf = cached_empty((max(p[-1][2] - p[0][1] for p in pieces), x_TH.shape[1]), x_TH)
        w_t = _per_expert(w_gate_up_N2IH.transpose(1, 2), groups)
        for piece in pieces:
            p0, p1 = piece[0][1], piece[-1][2]
            rows = torch.index_select(x_TH, 0, input_indices[p0:p1], out=buf[: p1 - p0])
            counts = _counts(piece)
            for (e, _, _), a, o in zip(piece, rows.split(counts), gate_up_R2I[p0:p1].split(counts)):
                mm(a, w_t[e], o)
            _silu_mul(gate_up_R2I[p0:p1], h_RI[p0:p1])
        return gate_up_R2I, h_RI

    def down_fwd(
        h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, transposed: bool = False
    ) -> torch.Tensor:
        """``y [R, H] = h @ w_down[e]^T`` per expert group; R is ``h``'s rows, those past RT are zero.
        ``transposed``: ``w_down`` is stored ``[NR, I, H]`` and ``y = h @ w_down[e]``, read in place."""
        check_stored_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd", transposed)
        bounds = _bounds(cum_token_counts)
        rt = bounds[-1]
        out = w_down_NHI.shape[2] if transposed else w_down_NHI.shape[1]
        y_RH = cached_empty((max(rt, h_RI.shape[0]), out), h_RI)
        if y_RH.shape[0] > rt:
            y_RH[rt:].zero_()
        groups = _groups(bounds)
        counts = _counts(groups)
        w_e = _per_expert(w_down_NHI if transposed else w_down_NHI.transpose(1, 2), groups)
        for (e, _, _), a, o in zip(groups, h_RI[:rt].split(counts), y_RH[:rt].split(counts)):
            mm(a, w_e[e], o)
        return y_RH

    def down_bwd(
        dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
        transposed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``dh [R, I] = dy @ w_down[e]`` and ``dw_down [NR, H, I] = dy_e^T @ h_e`` (zero for empty experts).
        ``transposed`` (``w_down`` stored ``[NR, I, H]``): ``dh = dy @ w_down[e]^T`` and the gradient in
        the stored layout, ``dw_down [NR, I, H] = h_e^T @ dy_e``."""
        bounds = _bounds(cum_token_counts)
        dh_RI = cached_empty((bounds[-1], w_down_NHI.shape[1] if transposed else w_down_NHI.shape[2]), dy_RH)
        dw_NHI = cached_empty(w_down_NHI.shape, w_down_NHI)
        _zero_empty(dw_NHI, bounds)
        for e, s, t in _groups(bounds):
            if transposed:
                mm(dy_RH[s:t], w_down_NHI[e].t(), dh_RI[s:t])
                wgrad(h_RI[s:t].t(), dy_RH[s:t], dw_NHI[e])
            else:
                mm(dy_RH[s:t], w_down_NHI[e], dh_RI[s:t])
                wgrad(dy_RH[s:t].t(), h_RI[s:t], dw_NHI[e])
        return dh_RI, dw_NHI

    def down_weighted_bwd(dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                          cum_token_counts: torch.Tensor,
                          w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Backward of the weighted down GEMM, ``y_r = w_r * h_r @ w_down[e]^T``, given the unweighted
        row gradients ``dy``: ``dh = w_r * dy_r @ w_down[e]``, ``dw_down [NR, H, I] = sum_r w_r dy_r^T h_r``
        (zero for empty experts) and the router-weight gradient per row ``<dy_r @ w_down[e], h_r>``
        (fp32 ``[R]``), which is ``<dout_t, y_r>`` without the expert outputs ever being kept.

        ``h = silu(gate) * up`` is recomputed from ``gate_up`` a piece of rows at a time into a small
        cached buffer, where the row dot products, the weight scaling and the weight-gradient GEMM read
        it while it is in cache; it is never stored whole.
        """
        bounds = _bounds(cum_token_counts)
        inter = w_down_NHI.shape[2]
        dh_RI = cached_empty((bounds[-1], inter), dy_RH)
        dw_NHI = cached_empty(w_down_NHI.shape, w_down_NHI)
        d_row_w = torch.empty(bounds[-1], dtype=torch.float32, device=dy_RH.device)
        exact = dy_RH.dtype == torch.float32
        step = piece_rows(inter)
        if exact and bounds[-1] <= step:
            _down_weighted_bwd_one_piece(dy_RH, gate_up_R2I, row_weights_R, bounds, w_down_NHI, dh_RI, dw_NHI, d_row_w,
                                         mm)
            return dh_RI, dw_NHI, d_row_w
        h_buf = cached_empty((max(1, min(step, bounds[-1])), inter), dy_RH)
        _zero_empty(dw_NHI, bounds)
        for e, s, t in _groups(bounds):
            for p0 in range(s, t, step):
                p1 = min(t, p0 + step)
                h = h_buf[: p1 - p0]
                _silu_mul(gate_up_R2I[p0:p1], h)
                dh = dh_RI[p0:p1]
                w = row_weights_R[p0:p1, None]
                mm(dy_RH[p0:p1], w_down_NHI[e], dh)  # unweighted: its dot with h is the weight's gradient
                if exact:
                    torch.linalg.vecdot(dh, h, out=d_row_w[p0:p1])
                    dh.mul_(w)
                    h.mul_(w)
                else:  # bf16/fp16: the dot products and the scaling in fp32
                    torch.linalg.vecdot(dh.float(), h.float(), out=d_row_w[p0:p1])
                    dh.copy_(dh.float() * w)
                    h.copy_(h.float() * w)
                # dw_down[e] = sum over the expert's pieces of dy^T (w * h)
                wgrad(dy_RH[p0:p1].t(), h, dw_NHI[e], accumulate=p0 != s)
        return dh_RI, dw_NHI, d_row_w

    def gate_up_bwd(d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                    cum_token_counts: torch.Tensor,
                    w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``dx_rows [R, H] = d_gate_up @ w_gate_up[e]`` and ``dw_gate_up [NR, 2I, H] = d_e^T @ x[rows_e]``;
        the expert's input rows are gathered again into a small cached buffer, never stored."""
        bounds = _bounds(cum_token_counts)
        dx_rows_RH = cached_empty((bounds[-1], x_TH.shape[1]), x_TH)
        dw_N2IH = cached_empty(w_gate_up_N2IH.shape, w_gate_up_N2IH)
        _zero_empty(dw_N2IH, bounds)
        groups = _groups(bounds)
        if not groups:
            return dx_rows_RH, dw_N2IH
        pieces = _expert_pieces(groups, piece_rows(x_TH.shape[1]))
        buf = cached_empty((max(p[-1][2] - p[0][1] for p in pieces), x_TH.shape[1]), x_TH)
        w_e, dw_e = _per_expert(w_gate_up_N2IH, groups), _per_expert(dw_N2IH, groups)
        for piece in pieces:
            p0, p1 = piece[0][1], piece[-1][2]
            counts = _counts(piece)
            rows = torch.index_select(x_TH, 0, input_indices[p0:p1], out=buf[: p1 - p0])
            d = d_gate_up_R2I[p0:p1]
            dx_rows = dx_rows_RH[p0:p1].split(counts)
            for (e, _, _), d_rows, a, dx in zip(piece, d.split(counts), rows.split(counts), dx_rows):
                mm(d_rows, w_e[e], dx)
                wgrad(d_rows.t(), a, dw_e[e])
        return dx_rows_RH, dw_N2IH

    return {"gate_up_fwd": gate_up_fwd, "down_fwd": down_fwd, "down_bwd": down_bwd,
            "down_weighted_bwd": down_weighted_bwd, "gate_up_bwd": gate_up_bwd}


_LOOP = launchers_on(mm_into)
gate_up_fwd = _LOOP["gate_up_fwd"]
down_fwd = _LOOP["down_fwd"]
down_bwd = _LOOP["down_bwd"]
down_weighted_bwd = _LOOP["down_weighted_bwd"]
gate_up_bwd = _LOOP["gate_up_bwd"]

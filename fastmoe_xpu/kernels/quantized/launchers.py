"""Stage 4 with quantized GEMMs: the contract's GEMM launchers for one :class:`.core.Format`.

Every GEMM of each projection is quantized: the forward (routed rows per row, the weight per
output channel), the input gradient (the output gradient times the weight's scales, per row,
against the forward's weight codes) and the weight gradient (per column of each expert's gradient
rows and input rows: scales along the dimensions that stay, over that expert's rows). Accumulation
is exact (int32) or fp32 (fp8), dequantized by the scales right after; SiLU*up, its backward and the
router-weight products stay in fp32. ``silu_mul_bwd`` and stages 2, 3 and 5 come from the kernel
backend this engine is combined with. On this per-expert path the expert bounds are read on the
host (as the ``loop`` engine does); scales are computed on the device. Row buffers: rows past RT are zero.

Next to the Triton base (``grouped=True``), where the device's Triton config table has the format's
kernels (int8: cuda, hip, xpu and the interpreter; fp8: cuda on sm_89+ and the interpreter), the
forward GEMMs and the input-gradient GEMMs run as one Triton grouped GEMM each
(:mod:`..triton.int8_gemm`: int32 ``tl.dot``; :mod:`..triton.fp8_gemm`: fp8 ``tl.dot`` into fp32;
both with the scales applied in the epilogue, the gate/up rows gathered in the loads, the expert
bounds read on the device), and the weight-gradient GEMMs as one Triton grouped weight-gradient
GEMM each (the contraction over each expert's rows, its column scales computed over those rows on
the device; fp8's codes stored by column, each expert's rows aligned): no host read in the whole
stage-4 path. int8's numbers are the same bits as the per-expert path: quantization is per row
(per token) and per output channel, so quantizing all rows at once gives every row the codes and
scale it gets alone, and the per-column scales of the weight gradients are the same maxima. fp8's
codes and scales are the same too; its fp32 sums may differ from ``torch._scaled_mm``'s by the
order of summation.

fp8 next to the Triton base also quantizes in Triton (:mod:`..triton.fp8_gemm`'s ``fp8q_*``
passes, one kernel per operand, each reading its tensor in its own dtype: no fp32 copy, no
per-row scale tensor, no atomics): the weights per output channel (still once per forward, found
again by the backward), x and h per row, each input gradient's rows times their expert's weight
scales (the expert found on the device), the weight gradients' operands per column over each
expert's rows straight into the column-major aligned layout (the down projection's ``w * h``
recomputed from ``gate_up`` on the way); SiLU*up and the router-weight dots are kernels too. The
codes and scales are those of :mod:`.core`'s quantizers (the tests check it bit for bit; SiLU's
exp may differ from torch's in the last bit). Row buffers past RT are left unwritten there (the
contract's "unspecified").

:mod:`.reference` states the same maths expert by expert in plain PyTorch; the tests hold these
launchers to it.

Legend: R rows allocated (>= RT routed rows), H hidden, I intermediate, NR local experts.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..contract import check_gemm_inputs, check_stored_gemm_inputs
from .core import (FORMATS, expert_of_rows, grouped_int8_mm, padded_length, qmm, quantize_cols, quantize_cols_grouped,
                   quantize_rows, quantized_weight, rows_of_experts, weight_grad_gemm)


def _groups(cum_token_counts: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]]:
    b = cum_token_counts.tolist()
    return b[-1], [(e, b[e], b[e + 1]) for e in range(len(b) - 1)]


def _pooled(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised buffer; on the CPU from the torch backend's pool (:mod:`..torch.buffers`), which
    keeps big buffers mapped between calls: a fresh one of hundreds of MB (a weight gradient) would be
    faulted in page by page at every step, which cost the int8 layer more than its GEMMs."""
    from ..torch.buffers import cached_empty

    return cached_empty(shape, like, dtype)


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` into a pooled buffer."""
    return torch.index_select(x, 0, idx, out=_pooled((idx.shape[0], x.shape[1]), x))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, into a pooled buffer."""
    h = _pooled(tuple(gate.shape), gate, torch.float32)
    torch.ops.aten.silu.out(gate.float(), out=h)
    return h.mul_(up)


def _rows_buffer(rows: int, rt: int, width: int, like: torch.Tensor) -> torch.Tensor:
    out = _pooled((max(rows, rt), width), like)
    out[rt:].zero_()
    return out


def _input_grad(g: torch.Tensor, w_scales: torch.Tensor, b: torch.Tensor, grad_dtype: torch.dtype,
                out: torch.Tensor) -> None:
    """``out = (g * sW) @ b`` with ``g * sW`` quantized per row: the input gradient through the
    forward's weight codes ``b`` (oriented ``[O, In]``)."""
    qg, sg = quantize_rows(g, grad_dtype, w_scales)
    qmm(qg, sg, b, None, out=out)


def _weight_grad(g: torch.Tensor, a: torch.Tensor, fmt_grad: torch.dtype, fmt_fwd: torch.dtype,
                 out: torch.Tensor, transposed: bool = False) -> None:
    """``out = g^T @ a`` (``transposed``: ``a^T @ g``) with both quantized per column over these rows."""
    qg, sg = quantize_cols(g, fmt_grad)
    qa, sa = quantize_cols(a, fmt_fwd)
    if transposed:  # the gradient's scales first, as in the stored layout
        qmm(qa.t(), sa, qg, sg, out=out, cols_first=True)
    else:
        qmm(qg.t(), sg, qa, sa, out=out)


def _expert_gemms(f, qa: torch.Tensor, sa: torch.Tensor, b_of: Callable[[int], torch.Tensor],  # noqa: ANN001
                  sb: torch.Tensor | None, groups: list[tuple[int, int, int]], out: torch.Tensor,
                  packs=None) -> None:  # noqa: ANN001
    """``out[s:t] = sa[s:t] * sb[e] * (qa[s:t] @ b_of(e))`` for each expert ``(e, s, t)`` (``sb`` None: no
    column scales): int8 in one dequantizing pass over every expert's rows
    (:func:`.core.grouped_int8_mm`; ``packs``: the forward weight's oneDNN-packed experts), other
    formats expert by expert (:func:`.core.qmm`)."""
    if f.name == "int8":
        grouped_int8_mm(qa, sa, b_of, sb, groups, out, packs)
        return
    for e, s, t in groups:
        if t > s:
            qmm(qa[s:t], sa[s:t], b_of(e), None if sb is None else sb[e], out=out[s:t])


def _grouped(grouped: bool, fmt: str, device: torch.device) -> bool:
    """Whether the Triton grouped GEMMs of format ``fmt`` run this call."""
    if not grouped:
        return False
    return _kernels(fmt).available(device)


def _kernels(fmt: str):  # noqa: ANN202
    """The Triton module of format ``fmt``'s grouped GEMMs."""
    if fmt == "int8":
        from ..triton import int8_gemm

        return int8_gemm
    from ..triton import fp8_gemm

    return fp8_gemm


def _grouped_mm(fmt: str, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
    """Format ``fmt``'s Triton grouped GEMM (:func:`..triton.int8_gemm.int8_grouped_mm` or
    :func:`..triton.fp8_gemm.fp8_grouped_mm`, the same arguments)."""
    k = _kernels(fmt)
    return (k.int8_grouped_mm if fmt == "int8" else k.fp8_grouped_mm)(*args, **kwargs)


def _fp8_triton(grouped: bool, fmt: str, device: torch.device):  # noqa: ANN202
    """The Triton fp8 module where format ``fmt`` is fp8 and its Triton kernels run this call, else None:
    there every operand is quantized by its one-pass kernels too (no fp32 copy, no host read)."""
    if fmt != "fp8" or not _grouped(grouped, fmt, device):
        return None
    return _kernels(fmt)


def _weight(w: torch.Tensor, f, transposed: bool, reuse: bool, k) -> "QWeight":  # noqa: ANN001, F821
    """The weight's codes (:func:`.core.quantized_weight`), quantized by the Triton kernel where ``k``."""
    return quantized_weight(w, f.forward, transposed, reuse=reuse,
                            quantize=k.quantize_weight if k is not None else None)


def _fp8_backward(k, g: torch.Tensor, a: torch.Tensor, qw, f, cum_token_counts: torch.Tensor, d_rows: torch.Tensor,
                  dw: torch.Tensor, transposed: bool = False, a_idx: torch.Tensor | None = None,
                  a_silu_weights: torch.Tensor | None = None, g_idx: torch.Tensor | None = None) -> None:  # noqa: ANN001
    """:func:`_grouped_backward` on the Triton fp8 kernels, every operand quantized in one pass: the
    input gradient's rows times their expert's weight scales (found on the device), and the weight
    gradient's column codes of ``g`` and of ``a`` (``a_idx``: the rows ``a[a_idx]``;
    ``a_silu_weights``: ``a`` is ``gate_up`` and the rows are ``a_silu_weights[r] * silu(gate_r) *
    up_r``, recomputed in fp32 on the way; ``g_idx``: the gradient's rows are ``g[g_idx]``, read by
    index in both quantization passes)."""
    R = d_rows.shape[0]
    if R == 0:
        dw.zero_()
        return
    if g_idx is not None:
        qg, sg = k.quantize_rows(g, f.grad, qw.scales, cum_token_counts, routed_only=True, idx=g_idx[:R])
    else:
        qg, sg = k.quantize_rows(g[:R], f.grad, qw.scales, cum_token_counts, routed_only=True)
    k.fp8_grouped_mm(qg, sg, None, qw.codes, None, cum_token_counts, d_rows, trans_w=transposed)
    NR = cum_token_counts.numel() - 1
    pcum = torch.empty(NR + 1, dtype=torch.int32, device=g.device)  # the blocks' bounds, summed by the kernel
    length = padded_length(R, NR)
    qgc, sgc = k.quantize_cols_grouped_t(g, f.grad, cum_token_counts, length, idx=g_idx, padded_cum_out=pcum)
    if a_silu_weights is not None:
        qa, sa = k.quantize_cols_grouped_t(a, f.forward, cum_token_counts, length, row_weights=a_silu_weights,
                                           silu=True)
    else:
        qa, sa = k.quantize_cols_grouped_t(a, f.forward, cum_token_counts, length, idx=a_idx)
    if transposed:  # dW_e^T = [a]^T [g], the gradient's scales applied first as in the stored layout
        k.fp8_grouped_wgrad(qa, sa, qgc, sgc, pcum, dw, left_scale_first=False)
    else:
        k.fp8_grouped_wgrad(qgc, sgc, qa, sa, pcum, dw, left_scale_first=True)


def _grouped_input_grad(g: torch.Tensor, qw, f, cum_token_counts: torch.Tensor, d_rows: torch.Tensor,
                        transposed: bool) -> None:  # noqa: ANN001
    """All experts' input gradients in one Triton grouped GEMM: each row of ``g`` times its
    expert's weight scales, quantized per row, against the weight codes (``[O, In]`` per expert:
    the stored ``[NR, O, In]`` as ``W_e``, the transposed ``[NR, In, O]`` as ``W_e^T``)."""
    R = d_rows.shape[0]
    eid = expert_of_rows(cum_token_counts, R).clamp_(max=qw.scales.shape[0] - 1)  # past RT: any expert
    qg, sg = quantize_rows(g[:R], f.grad, qw.scales.index_select(0, eid))  # [R, O] row scales
    _grouped_mm(f.name, qg, sg, None, qw.codes, None, cum_token_counts, d_rows, trans_w=transposed)


def _grouped_backward(g: torch.Tensor, a: torch.Tensor, qw, f, cum_token_counts: torch.Tensor,
                      d_rows: torch.Tensor, dw: torch.Tensor, transposed: bool = False,
                      a_idx: torch.Tensor | None = None) -> None:  # noqa: ANN001
    """The Triton int8 grouped backward of one projection, expert bounds on the device: the input
    gradients of rows ``g`` into ``d_rows`` (one grouped GEMM), and the weight gradients
    ``[g]_col^T [a]_col`` per expert into ``dw`` (``a_idx``: the input rows are ``a[a_idx]``), both
    operands quantized per column over each expert's rows, in one grouped weight-gradient GEMM (fp8:
    :func:`_fp8_backward`)."""
    if d_rows.shape[0] == 0:
        dw.zero_()
        return
    _grouped_input_grad(g, qw, f, cum_token_counts, d_rows, transposed)
    R = d_rows.shape[0]
    from ..triton.int8_gemm import int8_grouped_wgrad

    qg, sg = quantize_cols_grouped(g, f.grad, cum_token_counts, rows=R)
    qa, sa = quantize_cols_grouped(a, f.forward, cum_token_counts, idx=a_idx, rows=R)
    if transposed:  # dW_e^T = [a]^T [g], the gradient's scales applied first as in the stored layout
        int8_grouped_wgrad(qa, sa, qg, sg, cum_token_counts, dw, left_scale_first=False)
    else:
        int8_grouped_wgrad(qg, sg, qa, sa, cum_token_counts, dw, left_scale_first=True)


def _bf16_operands(g: torch.Tensor, a: torch.Tensor, rt: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 weight gradients' operands of rows ``[0, rt)``, each rounded once for every expert:
    ``(left [rt, O], right [rt, In])``, expert e's gradient ``left[s:t]^T @ right[s:t]``
    (``transposed``: the input rows on the left)."""
    left, right = (a, g) if transposed else (g, a)
    return left[:rt].to(torch.bfloat16), right[:rt].to(torch.bfloat16)


def _bf16_weight_grad(left: torch.Tensor, right: torch.Tensor, s: int, t: int, out: torch.Tensor) -> None:
    """``out = left[s:t]^T @ right[s:t]`` on bf16 ``torch.mm`` (oneDNN; AMX where the CPU has it),
    rounded to bf16, then into ``out``'s dtype. The left operand is transposed into a buffer of its own
    first, one expert's rows at a time (in cache): oneDNN ran these GEMMs 1.3x faster with A stored by
    row than on the transposed view, the copy included."""
    lt = _pooled((left.shape[1], t - s), left)
    lt.copy_(left[s:t].t())
    if out.dtype == torch.bfloat16:
        torch.mm(lt, right[s:t], out=out)
        return
    out.copy_(torch.mm(lt, right[s:t], out=_pooled(tuple(out.shape), out, torch.bfloat16)))


def _backward_gemms(groups: list[tuple[int, int, int]], g: torch.Tensor, a: torch.Tensor, qw, f, d_rows: torch.Tensor,
                    dw: torch.Tensor, transposed: bool = False) -> None:  # noqa: ANN001
    """Per expert: the input gradient of rows ``g`` through the weight codes ``qw`` into ``d_rows``
    and the weight gradient against the input rows ``a`` into ``dw`` (zero for empty experts), the
    latter in the format :func:`.core.weight_grad_gemm` names."""
    rt = groups[-1][2] if groups else 0
    bf16 = weight_grad_gemm(f.name, g.device) == "bf16"
    if bf16:
        left, right = _bf16_operands(g, a, rt, transposed)
    batched = f.name == "int8"
    if batched and rt:  # every expert's rows quantized in one pass, times their expert's weight scales
        qg, sg = quantize_rows(g[:rt], f.grad, qw.scales, rows_expert=rows_of_experts(groups, g.device))
        _expert_gemms(f, qg, sg, lambda e: qw.codes[e].t() if transposed else qw.codes[e], None, groups, d_rows)
    for e, s, t in groups:
        if t == s:
            dw[e].zero_()
            continue
        if not batched:
            b = qw.codes[e].t() if transposed else qw.codes[e]
            _input_grad(g[s:t], qw.scales[e], b, f.grad, d_rows[s:t])
        if bf16:
            _bf16_weight_grad(left, right, s, t, dw[e])
        else:
            _weight_grad(g[s:t], a[s:t], f.grad, f.forward, dw[e], transposed)


def gate_up_fwd(fmt: str, x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                w_gate_up_N2IH: torch.Tensor, grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = Q(x[input_indices]) @ Q(w_gate_up[e])^T`` per expert, ``h = silu(gate) * up``."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    f = FORMATS[fmt]
    two_i = w_gate_up_N2IH.shape[1]
    k = _fp8_triton(grouped, fmt, x_TH.device)
    qw = _weight(w_gate_up_N2IH, f, False, False, k)
    if k is not None:  # rows past RT: unspecified (the contract's), so not filled
        R = input_indices.shape[0]
        gate_up = x_TH.new_empty(R, two_i)
        h = x_TH.new_empty(R, two_i // 2)
        if x_TH.shape[0]:  # every token quantized once; the kernel gathers the routed rows' codes
            qx, sx = k.quantize_rows(x_TH, f.forward)
            k.fp8_grouped_mm(qx, sx, input_indices, qw.codes, qw.scales, cum_token_counts, gate_up, trans_w=True)
            k.silu_mul(gate_up, cum_token_counts, h)
        return gate_up, h
    if _grouped(grouped, fmt, x_TH.device):
        gate_up = x_TH.new_zeros(input_indices.shape[0], two_i)
        if x_TH.shape[0]:  # every token quantized once; the kernel gathers the routed rows' codes
            qx, sx = quantize_rows(x_TH, f.forward)
            _grouped_mm(fmt, qx, sx, input_indices, qw.codes, qw.scales, cum_token_counts, gate_up, trans_w=True)
        rt = None
    else:
        rt, groups = _groups(cum_token_counts)
        gate_up = _rows_buffer(input_indices.shape[0], rt, two_i, x_TH)
    if rt:
        idx = input_indices[:rt]
        if rt >= x_TH.shape[0]:
            # Every token quantized once (per row: a routed row gets its token's codes and scale), then
            # the routed rows' one-byte codes gathered: up to K times fewer rows to quantize than the
            # gathered fp32 rows, and a quarter of the gather's bytes.
            qx_T, sx_T = quantize_rows(x_TH, f.forward)
            qx = torch.index_select(qx_T, 0, idx, out=_pooled((rt, qx_T.shape[1]), qx_T))
            sx = sx_T.index_select(0, idx)
            del qx_T
        else:  # fewer routed rows than tokens (most of them go to other ranks' experts): the same codes
            qx, sx = quantize_rows(_gather_rows(x_TH, idx), f.forward)
        _expert_gemms(f, qx, sx, lambda e: qw.codes[e].t(), qw.scales, groups, gate_up, qw.packs)
    inter = two_i // 2
    h = _silu_mul(gate_up[:, :inter], gate_up[:, inter:]).to(x_TH.dtype)
    return gate_up, h


def down_fwd(fmt: str, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
             transposed: bool = False, grouped: bool = False) -> torch.Tensor:
    """``y [R, O] = Q(h) @ Q(w[e])^T`` per expert (``transposed``: ``w`` stored ``[NR, In, O]``)."""
    check_stored_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd", transposed)
    f = FORMATS[fmt]
    width = w_down_NHI.shape[2] if transposed else w_down_NHI.shape[1]
    k = _fp8_triton(grouped, fmt, h_RI.device)
    qw = _weight(w_down_NHI, f, transposed, False, k)
    if k is not None:
        y = h_RI.new_empty(h_RI.shape[0], width)
        qh, sh = k.quantize_rows(h_RI, f.forward, cum_token_counts=cum_token_counts, routed_only=True)
        return k.fp8_grouped_mm(qh, sh, None, qw.codes, qw.scales, cum_token_counts, y, trans_w=not transposed)
    if _grouped(grouped, fmt, h_RI.device):
        y = h_RI.new_zeros(h_RI.shape[0], width)
        qh, sh = quantize_rows(h_RI, f.forward)  # row-local: rows past RT change no expert row
        return _grouped_mm(fmt, qh, sh, None, qw.codes, qw.scales, cum_token_counts, y, trans_w=not transposed)
    rt, groups = _groups(cum_token_counts)
    y = _rows_buffer(h_RI.shape[0], rt, width, h_RI)
    if rt:
        qh, sh = quantize_rows(h_RI[:rt], f.forward)
        _expert_gemms(f, qh, sh, lambda e: qw.codes[e] if transposed else qw.codes[e].t(), qw.scales, groups, y,
                      qw.packs)
    return y


def gate_up_down_fwd(fmt: str, x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                     w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, grouped: bool = True,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused forward (``contract.FUSED_LAUNCHERS``) next to the Triton base: ``(gate_up [R, 2I], y [R, H])``,
    what :func:`gate_up_fwd` then :func:`down_fwd` give. On the Triton fp8 kernels ``h`` is never
    written: one pass makes its codes and scales from ``gate_up`` (SiLU*up rounded to the activations'
    dtype, as ``h`` was stored, then quantized per row: the same bits); elsewhere the two run as they are."""
    k = _fp8_triton(grouped, fmt, x_TH.device)
    if k is None:
        gate_up, h = gate_up_fwd(fmt, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH, grouped)
        return gate_up, down_fwd(fmt, h, cum_token_counts, w_down_NHI, False, grouped)
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    check_stored_gemm_inputs(x_TH.new_empty(0, w_down_NHI.shape[2]), w_down_NHI, cum_token_counts, "down_fwd", False)
    f = FORMATS[fmt]
    R, two_i = input_indices.shape[0], w_gate_up_N2IH.shape[1]
    if two_i != 2 * w_down_NHI.shape[2]:
        raise ValueError(f"gate_up_down_fwd: gate_up_proj {tuple(w_gate_up_N2IH.shape)} and down_proj "
                         f"{tuple(w_down_NHI.shape)} disagree on I")
    gate_up = x_TH.new_empty(R, two_i)
    y = x_TH.new_empty(R, w_down_NHI.shape[1])
    qw_gu = _weight(w_gate_up_N2IH, f, False, False, k)
    qw_d = _weight(w_down_NHI, f, False, False, k)
    if x_TH.shape[0] == 0 or R == 0:
        return gate_up, y
    qx, sx = k.quantize_rows(x_TH, f.forward)  # every token once; the GEMM gathers the routed rows' codes
    k.fp8_grouped_mm(qx, sx, input_indices, qw_gu.codes, qw_gu.scales, cum_token_counts, gate_up, trans_w=True)
    qh, sh = k.quantize_silu_rows(gate_up, f.forward, cum_token_counts, x_TH.dtype)
    return gate_up, k.fp8_grouped_mm(qh, sh, None, qw_d.codes, qw_d.scales, cum_token_counts, y, trans_w=True)


def down_bwd(fmt: str, dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor,
             w_down_NHI: torch.Tensor, transposed: bool = False, grouped: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh [R, In], dw)``: ``dh = Q(dy * sW) @ qW`` per expert and ``dw = Q(dy_e)^T @ Q(h_e)``
    (per column over the expert's rows; zero for empty experts), ``dw`` in ``w``'s stored layout."""
    check_stored_gemm_inputs(dy_RH, w_down_NHI, cum_token_counts, "down_bwd", not transposed)
    f = FORMATS[fmt]
    width = w_down_NHI.shape[1] if transposed else w_down_NHI.shape[2]
    dw = _pooled(tuple(w_down_NHI.shape), w_down_NHI)
    k = _fp8_triton(grouped, fmt, dy_RH.device)
    qw = _weight(w_down_NHI, f, transposed, True, k)
    if k is not None:
        dh = dy_RH.new_empty(dy_RH.shape[0], width)
        _fp8_backward(k, dy_RH, h_RI, qw, f, cum_token_counts, dh, dw, transposed)
        return dh, dw
    if _grouped(grouped, fmt, dy_RH.device):
        dh = dy_RH.new_zeros(dy_RH.shape[0], width)
        _grouped_backward(dy_RH, h_RI, qw, f, cum_token_counts, dh, dw, transposed)
        return dh, dw
    rt, groups = _groups(cum_token_counts)
    dh = _rows_buffer(dy_RH.shape[0], rt, width, dy_RH)
    _backward_gemms(groups, dy_RH, h_RI, qw, f, dh, dw, transposed)
    return dh, dw


def down_weighted_bwd(fmt: str, dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                      cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, grouped: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted down backward: ``g = Q(dy * sW) @ qW`` (unweighted), ``d_row_weights = <g, h>``,
    ``dh = w * g`` and ``dw_down = Q(dy_e)^T @ Q(w * h)_e``; ``h`` recomputed from ``gate_up`` in fp32."""
    f = FORMATS[fmt]
    inter = w_down_NHI.shape[2]
    dw = _pooled(tuple(w_down_NHI.shape), w_down_NHI)
    k = _fp8_triton(grouped, fmt, dy_RH.device)
    qw = _weight(w_down_NHI, f, False, True, k)
    if k is not None:  # h recomputed inside the kernels: the weight gradient's codes, the row dots
        R = dy_RH.shape[0]
        g = torch.empty(R, inter, dtype=torch.float32, device=dy_RH.device)
        _fp8_backward(k, dy_RH, gate_up_R2I, qw, f, cum_token_counts, g, dw, a_silu_weights=row_weights_R)
        dh = dy_RH.new_empty(R, inter)
        d_row_w = torch.empty(R, dtype=torch.float32, device=dy_RH.device)
        k.row_dot_scale(g, gate_up_R2I, row_weights_R, cum_token_counts, dh, d_row_w)
        return dh, dw, d_row_w
    if _grouped(grouped, fmt, dy_RH.device):
        # all R rows, those past RT zeroed (their contents are unspecified) without reading RT
        rt = dy_RH.shape[0]  # every row computed: RT is not read
        valid = (expert_of_rows(cum_token_counts, rt) < w_down_NHI.shape[0])[:, None]
        h = torch._C._nn.silu(gate_up_R2I[:, :inter].float()).mul_(gate_up_R2I[:, inter:].float())
        h = torch.where(valid, h, 0.0)
        w = torch.where(valid, row_weights_R[:, None].float(), 0.0)
        g = torch.zeros(rt, inter, dtype=torch.float32, device=dy_RH.device)
        _grouped_backward(dy_RH, h * w, qw, f, cum_token_counts, g, dw)
    else:
        rt, groups = _groups(cum_token_counts)
        h = _silu_mul(gate_up_R2I[:rt, :inter], gate_up_R2I[:rt, inter:])
        # every routed row of g is written by its expert's input gradient: pooled, not zeroed
        g = _pooled((rt, inter), dy_RH, torch.float32)
        w = row_weights_R[:rt, None].float()
        _backward_gemms(groups, dy_RH, torch.mul(h, w, out=_pooled((rt, inter), h)), qw, f, g, dw)
    d_row_w = torch.linalg.vecdot(g, h)
    dh = _rows_buffer(dy_RH.shape[0], rt, inter, dy_RH)
    if dh.dtype == torch.float32:  # straight into its rows, no [R, I] temporary
        torch.mul(g, w, out=dh[:rt])
    else:
        dh[:rt] = g.mul_(w)
    return dh, dw, d_row_w


def down_silu_bwd(fmt: str, dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                  selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor, input_indices: torch.Tensor,
                  gate_up_R2I: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
                  grouped: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused down backward (``contract.FUSED_LAUNCHERS``) next to the Triton base: ``(d_gate_up [R, 2I],
    dw_down, d_row_weights [R] fp32)`` with the same codes and scales as ``combine_bwd``,
    :func:`down_weighted_bwd` and ``silu_mul_bwd`` in turn. On the Triton fp8 kernels the output
    gradient's rows ``dout[input_indices[r]]`` are read by index in both of their quantization passes
    (no ``[R, H]`` copy), and the router-weight pass writes the SiLU*up gradient at ``w * g`` rounded as
    ``dh`` would have been (no ``dh`` round trip); elsewhere the three steps run as they are."""
    from ..triton import combine as tcombine
    from ..triton import grouped_gemm as tgemm

    k = _fp8_triton(grouped, fmt, dout_TH.device)
    if k is None:
        dy, row_w = tcombine.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                         cum_expert_counts)
        dh, dw, d_row_w = down_weighted_bwd(fmt, dy, gate_up_R2I, row_w, cum_token_counts, w_down_NHI, grouped)
        return tgemm.silu_mul_bwd(gate_up_R2I, dh, cum_token_counts), dw, d_row_w
    f = FORMATS[fmt]
    R, inter = input_indices.shape[0], w_down_NHI.shape[2]
    row_w = tcombine.row_weights(weights_TK, output_indices, selected_expert_indices, cum_expert_counts, R)
    dw = _pooled(tuple(w_down_NHI.shape), w_down_NHI)
    qw = _weight(w_down_NHI, f, False, True, k)
    g = torch.empty(R, inter, dtype=torch.float32, device=dout_TH.device)
    _fp8_backward(k, dout_TH, gate_up_R2I, qw, f, cum_token_counts, g, dw, a_silu_weights=row_w, g_idx=input_indices)
    d_gate_up = dout_TH.new_empty(R, 2 * inter)
    d_row_w = torch.empty(R, dtype=torch.float32, device=dout_TH.device)
    k.row_dot_scale(g, gate_up_R2I, row_w, cum_token_counts, d_gate_up, d_row_w, silu_bwd=True)
    return d_gate_up, dw, d_row_w


def gate_up_bwd(fmt: str, d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor, grouped: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = Q(d * sW) @ qW`` and ``dw_gate_up[e] = Q(d_e)^T @ Q(x[rows_e])`` (the rows
    gathered again)."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_bwd")
    f = FORMATS[fmt]
    dw = _pooled(tuple(w_gate_up_N2IH.shape), w_gate_up_N2IH)
    k = _fp8_triton(grouped, fmt, x_TH.device)
    qw = _weight(w_gate_up_N2IH, f, False, True, k)
    if k is not None:
        dx_rows = x_TH.new_empty(d_gate_up_R2I.shape[0], x_TH.shape[1])
        _fp8_backward(k, d_gate_up_R2I, x_TH, qw, f, cum_token_counts, dx_rows, dw, a_idx=input_indices)
        return dx_rows, dw
    if _grouped(grouped, fmt, x_TH.device):
        dx_rows = x_TH.new_zeros(d_gate_up_R2I.shape[0], x_TH.shape[1])
        _grouped_backward(d_gate_up_R2I, x_TH, qw, f, cum_token_counts, dx_rows, dw, a_idx=input_indices)
        return dx_rows, dw
    rt, groups = _groups(cum_token_counts)
    dx_rows = _rows_buffer(d_gate_up_R2I.shape[0], rt, x_TH.shape[1], x_TH)
    rows = _gather_rows(x_TH, input_indices[:rt])
    _backward_gemms(groups, d_gate_up_R2I, rows, qw, f, dx_rows, dw)
    return dx_rows, dw


#: The launchers a quantized engine provides (the rest of stage 4 comes from the kernel backend).
LAUNCHERS = ("gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "gate_up_bwd")


def bind(fmt: str, grouped: bool = False) -> dict[str, Callable[..., Any]]:
    """The launchers with format ``fmt`` bound: what a precision's launcher module exports;
    ``grouped``: next to the Triton base (the Triton int8 grouped GEMM where it applies)."""
    if grouped:
        return {name: functools.partial(globals()[name], fmt, grouped=True) for name in LAUNCHERS}
    return {name: functools.partial(globals()[name], fmt) for name in LAUNCHERS}


#: The fused launchers of the fp8 format next to the Triton base (``contract.FUSED_LAUNCHERS``).
FP8_TRITON_FUSED = ("gate_up_down_fwd", "down_silu_bwd")


def launchers_for(fmt: str, base: str) -> SimpleNamespace:
    """The launchers of format ``fmt`` next to kernel base ``base`` (fp8 next to the Triton base: and
    :func:`down_silu_bwd`)."""
    launchers = bind(fmt, grouped=base == "triton")
    if fmt == "fp8" and base == "triton":
        launchers.update({name: functools.partial(globals()[name], fmt, grouped=True) for name in FP8_TRITON_FUSED})
        return SimpleNamespace(LAUNCHERS=LAUNCHERS + FP8_TRITON_FUSED, **launchers)
    return SimpleNamespace(LAUNCHERS=LAUNCHERS, **launchers)

"""The block-scaled fp8 recipe (``expert_precision="fp8-block"``) in plain PyTorch, GEMM by GEMM.

What :mod:`..triton.fp8_block_gemm` computes, written for clarity (the tests hold the kernels and the
layer to it). Scales are ``amax / qmax`` of their block (e4m3: 448 for activations and weights, e5m2:
57344 for gradients), codes ``round(v * (qmax / amax))`` to the fp8 grid in fp32 (the cast's rounding),
zero codes for a zero block; the products of the codes are exact in float64, and each block's partial
product is scaled by its two scales before the blocks are summed:

* ``qlinear(a, W)`` (the forward, ``W [O, In]``): ``a`` per row and ``qb``-block of In, ``W`` per
  ``qb x qb`` block; ``out[r, o] = sum_kb sa[r, kb] * sW[o // qb, kb] * <qa[r, kb], qW[o, kb]>``.
* ``qlinear_input_grad(dy, W)``: ``dy`` per row and ``qb``-block of O (e5m2) against the forward's
  weight codes and scales, the same blocks read along the other axis.
* ``qweight_grad(g, a)`` (``g^T a`` over the rows of one expert): both per column and block of ``qb``
  rows (from the first row), ``g`` in e5m2, ``a`` in e4m3.
"""
from __future__ import annotations

import torch

from .core import qmax
from .reference import expert_slots

FWD, GRAD = torch.float8_e4m3fn, torch.float8_e5m2


def _pad(v: torch.Tensor, dim: int, qb: int) -> torch.Tensor:
    extra = -v.shape[dim] % qb
    if not extra:
        return v
    shape = list(v.shape)
    shape[dim] = extra
    return torch.cat([v, v.new_zeros(shape)], dim)


def _codes(v: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qm = torch.tensor(qmax(dtype), dtype=torch.float32)
    inv = torch.where(amax > 0, qm / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    return (v * inv).to(dtype).double(), amax / qm


def rows_blocks(v: torch.Tensor, dtype: torch.dtype, qb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [R, K]`` per row and ``qb``-block of columns: ``(codes [R, nb, qb] float64, scales [R, nb])``."""
    v = _pad(v.float(), 1, qb)
    blk = v.reshape(v.shape[0], -1, qb)
    amax = blk.abs().amax(-1, keepdim=True)
    q, s = _codes(blk, amax, dtype)
    return q, s.squeeze(-1)


def weight_blocks(w: torch.Tensor, qb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [D0, D1]`` per ``qb x qb`` block, e4m3: ``(codes [D0p, D1p] float64 padded with zeros,
    scales [nb0, nb1])``."""
    v = _pad(_pad(w.float(), 0, qb), 1, qb)
    n0, n1 = v.shape[0] // qb, v.shape[1] // qb
    blk = v.reshape(n0, qb, n1, qb).permute(0, 2, 1, 3)
    amax = blk.abs().amax((-1, -2), keepdim=True)
    q, s = _codes(blk, amax, FWD)
    return q.permute(0, 2, 1, 3).reshape(v.shape), s.reshape(n0, n1)


def qlinear(a: torch.Tensor, w: torch.Tensor, qb: int) -> torch.Tensor:
    """``Q(a) @ Q(w)^T`` in fp32 for ``w [O, In]`` (the forward GEMM of one expert)."""
    qa, sa = rows_blocks(a, FWD, qb)
    qw, sw = weight_blocks(w, qb)
    O = w.shape[0]
    out = torch.zeros(a.shape[0], O, dtype=torch.float64)
    for kb in range(qa.shape[1]):
        part = (qa[:, kb] @ qw[:O, kb * qb:(kb + 1) * qb].t()).float().double()
        out += part * sa[:, kb, None].double() * sw[torch.arange(O) // qb, kb][None, :].double()
    return out.float()


def qlinear_input_grad(dy: torch.Tensor, w: torch.Tensor, qb: int) -> torch.Tensor:
    """``Q(dy) @ Q(w)`` in fp32 for ``w [O, In]``: dy per row and block of O (e5m2), the weight's codes
    and block scales as the forward made them."""
    qg, sg = rows_blocks(dy, GRAD, qb)
    qw, sw = weight_blocks(w, qb)
    In = w.shape[1]
    out = torch.zeros(dy.shape[0], In, dtype=torch.float64)
    for ob in range(qg.shape[1]):
        part = (qg[:, ob] @ qw[ob * qb:(ob + 1) * qb, :In]).float().double()
        out += part * sg[:, ob, None].double() * sw[ob, torch.arange(In) // qb][None, :].double()
    return out.float()


def qweight_grad(g: torch.Tensor, a: torch.Tensor, qb: int, g_dtype: torch.dtype = GRAD,
                 a_dtype: torch.dtype = FWD) -> torch.Tensor:
    """``Q(g)^T @ Q(a)`` in fp32 over the rows of one expert: both sides per column and block of
    ``qb`` rows, ``g`` in ``g_dtype`` (e5m2, the gradient), ``a`` in ``a_dtype`` (e4m3); the formats
    swapped for a weight stored transposed (``h^T dy``)."""
    out = torch.zeros(g.shape[1], a.shape[1], dtype=torch.float64)
    for r0 in range(0, g.shape[0], qb):
        gb, ab = g[r0:r0 + qb].float(), a[r0:r0 + qb].float()
        qg, sg = _codes(gb, gb.abs().amax(0, keepdim=True), g_dtype)
        qa, sa = _codes(ab, ab.abs().amax(0, keepdim=True), a_dtype)
        part = (qg.t() @ qa).float().double()
        out += part * sg[0, :, None].double() * sa[0, None, :].double()
    return out.float()


def moe_forward_backward(
    x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor, dout_TH: torch.Tensor, qb: int = 128, expert_start: int = 0,
) -> tuple[torch.Tensor, ...]:
    """``(out [T, H], dx, dw_gate_up, dw_down, dweights)`` of the fused expert path on the local
    experts ``[expert_start, expert_start + NR)`` in the block-scaled fp8 recipe, all fp32.
    ``h`` is rounded to x's dtype before it is quantized (as the layer stores it); the down weight
    gradient's right side is ``w * h`` in fp32."""
    T, H = x_TH.shape
    NR, two_i, _ = w_gate_up_N2IH.shape
    inter = two_i // 2
    x, dout, wts = (t.detach().float() for t in (x_TH, dout_TH, weights_TK))
    out, dx = torch.zeros(T, H), torch.zeros(T, H)
    dw_gu, dw_d = torch.zeros(w_gate_up_N2IH.shape), torch.zeros(w_down_NHI.shape)
    dweights = torch.zeros(weights_TK.shape)
    for e in range(NR):
        slots, tok, w = expert_slots(topk_idx_TK, wts, expert_start + e)
        if not slots:
            continue
        X = x[tok]
        gate_up = qlinear(X, w_gate_up_N2IH[e], qb).to(x_TH.dtype).float()
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        h = torch._C._nn.silu(gate) * up
        y = qlinear(h.to(x_TH.dtype).float(), w_down_NHI[e], qb)
        dy = dout[tok]
        g = qlinear_input_grad(dy, w_down_NHI[e], qb)
        dw_d[e] = qweight_grad(dy, h * w, qb)
        d_row_w = (g * h).sum(1)
        dh = (g * w).to(x_TH.dtype).float()
        d_gate_up = torch.cat([torch.ops.aten.silu_backward(dh * up, gate), dh * torch._C._nn.silu(gate)], 1)
        d_gate_up = d_gate_up.to(x_TH.dtype).float()
        dX = qlinear_input_grad(d_gate_up, w_gate_up_N2IH[e], qb)
        dw_gu[e] = qweight_grad(d_gate_up, X, qb)
        for i, (t, k) in enumerate(slots):
            out[t] += w[i, 0] * y[i].to(x_TH.dtype).float()
            dx[t] += dX[i].to(x_TH.dtype).float()
            dweights[t, k] = d_row_w[i]
    return out, dx, dw_gu, dw_d, dweights

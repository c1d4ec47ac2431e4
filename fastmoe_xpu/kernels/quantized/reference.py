"""The quantized expert maths in plain PyTorch, expert by expert (what the tests hold the engines to).

Written for clarity: quantization with explicit ``amax``, ``round`` and ``clamp``; every quantized
GEMM as an exact float64 product of the integer (or fp8) codes, rounded to fp32 and scaled by the
row scales, then the column scales (the order the engines' epilogues use); every token's rows
found by a Python loop over its top-k. Forward and backward are written out by hand, since the
gradients are straight-through by definition (each backward GEMM quantizes its own operands):

forward, per expert ``e`` with routed rows ``X``::

    gate_up = X Q W_gu^T        h = silu(gate) * up       y = h Q W_d^T     out_t = sum_k w_tk y_tk

backward, ``dy_r = dout_t`` (unweighted) for the row of slot (t, k)::

    g    = [dy * s(W_d)]_row  qW_d           d_weights_tk = <g_r, h_r>        dh = w_r g
    dW_d = [dy]_col^T [w h]_col              d_gate_up = silu_mul_backward(gate_up, dh)
    dX   = [d_gate_up * s(W_gu)]_row qW_gu   dW_gu = [d_gate_up]_col^T [X]_col      dx_t = sum_k dX_tk

where ``[v]_row`` / ``[v]_col`` quantize with one scale per row / per column (over that expert's
rows; codes ``round(v * qmax / amax)``), ``qW`` are the weight codes (one scale ``s(W)`` per output channel), in the forward format
(int8, or fp8 e4m3) and the gradient format (int8, or fp8 e5m2) for the gradient operands.
"""
from __future__ import annotations

import torch

from .core import FORMATS, qmax


def _fake(v: torch.Tensor, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes as float64, fp32 scales)``, one scale per slice along ``dim`` (reduced)."""
    v = v.float()
    amax = v.abs().amax(dim=dim, keepdim=True)
    inv = torch.where(amax > 0, qmax(dtype) / amax, torch.zeros_like(amax))  # zero rows: zero codes
    q = v * inv
    if dtype == torch.int8:
        q = torch.round(q)
        if q.abs().max() > 127:
            raise AssertionError("an int8 code left [-127, 127]")
    else:
        q = q.to(dtype).float()
    return q.double(), (amax / qmax(dtype)).squeeze(dim)


def rows_q(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake(v, dtype, -1)


def cols_q(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake(v, dtype, -2)


def qgemm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor | None) -> torch.Tensor:
    """``sa[:, None] * sb[None, :] * (qa @ qb)``: the codes multiplied exactly, then scaled in fp32
    (``sb`` None: no column scales)."""
    out = (qa @ qb).float() * sa[:, None]
    return out if sb is None else out * sb[None, :]


def qlinear(a: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``Q(a) @ Q(w)^T`` for ``w [O, In]`` quantized per output channel."""
    f = FORMATS[fmt]
    qa, sa = rows_q(a, f.forward)
    qw, sw = rows_q(w, f.forward)
    return qgemm(qa, sa, qw.t(), sw)


def weight_grad(dy: torch.Tensor, a: torch.Tensor, fmt: str, gemm: str | None = None) -> torch.Tensor:
    """``dy^T a`` as format ``fmt``'s weight-gradient GEMM: ``[dy]_col^T [a]_col``; ``gemm="bf16"``
    (:func:`.core.weight_grad_gemm`): both operands rounded to bf16, multiplied exactly, the product
    rounded to bf16."""
    if gemm == "bf16":
        return (dy.to(torch.bfloat16).double().t() @ a.to(torch.bfloat16).double()).float().to(torch.bfloat16).float()
    f = FORMATS[fmt]
    qd, sd = cols_q(dy, f.grad)
    qa, sa = cols_q(a, f.forward)
    return qgemm(qd.t(), sd, qa, sa)


def qlinear_backward(dy: torch.Tensor, a: torch.Tensor, w: torch.Tensor, fmt: str,
                     weight_grads: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da, dw)`` of :func:`qlinear` (``w [O, In]``): ``da = [dy * s(w)]_row qw``, ``dw = [dy]_col^T [a]_col``
    (``weight_grads``: :func:`weight_grad`'s ``gemm``)."""
    f = FORMATS[fmt]
    qw, sw = rows_q(w, f.forward)
    qg, sg = rows_q(dy.float() * sw, f.grad)
    da = qgemm(qg, sg, qw, None)
    return da, weight_grad(dy, a, fmt, weight_grads)


def expert_slots(topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor, expert: int,
                 ) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """The slots (t, k) routed to ``expert`` in token order, their tokens and their router weights
    ``[n, 1]`` (fp32)."""
    T, K = topk_idx_TK.shape
    slots = [(t, k) for t in range(T) for k in range(K) if int(topk_idx_TK[t, k]) == expert]
    tok = torch.tensor([t for t, _ in slots], dtype=torch.long)
    w = torch.tensor([float(weights_TK[t, k]) for t, k in slots], dtype=torch.float32)[:, None]
    return slots, tok, w


def moe_forward_backward(
    x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor, dout_TH: torch.Tensor, fmt: str, expert_start: int = 0, weight_grads: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(out [T, H], dx, dw_gate_up, dw_down, dweights)`` of the fused expert path on the local
    experts ``[expert_start, expert_start + NR)`` in precision ``fmt``, all fp32; ``weight_grads``: how
    the weight-gradient GEMMs multiply (:func:`weight_grad`)."""
    T, H = x_TH.shape
    NR, two_i, _ = w_gate_up_N2IH.shape
    inter = two_i // 2
    x, dout, wts = x_TH.float(), dout_TH.float(), weights_TK.float()
    out = torch.zeros(T, H)
    dx = torch.zeros(T, H)
    dw_gu = torch.zeros(w_gate_up_N2IH.shape)
    dw_d = torch.zeros(w_down_NHI.shape)
    dweights = torch.zeros(weights_TK.shape)
    f = FORMATS[fmt]
    for e in range(NR):
        slots, tok, w = expert_slots(topk_idx_TK, wts, expert_start + e)
        if not slots:
            continue
        X = x[tok]
        gate_up = qlinear(X, w_gate_up_N2IH[e], fmt)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        h = torch._C._nn.silu(gate) * up
        y = qlinear(h, w_down_NHI[e], fmt)
        dy = dout[tok]
        # down GEMM backward: unweighted g, weight gradient against w * h
        qw_d, sw_d = rows_q(w_down_NHI[e], f.forward)
        qg, sg = rows_q(dy * sw_d, f.grad)
        g = qgemm(qg, sg, qw_d, None)
        dw_d[e] = weight_grad(dy, h * w, fmt, weight_grads)
        d_row_w = (g * h).sum(1)
        dh = g * w
        d_gate_up = torch.cat([torch.ops.aten.silu_backward(dh * up, gate), dh * torch._C._nn.silu(gate)], 1)
        dX, dw_gu[e] = qlinear_backward(d_gate_up, X, w_gate_up_N2IH[e], fmt, weight_grads)
        for i, (t, k) in enumerate(slots):
            out[t] += w[i, 0] * y[i]
            dx[t] += dX[i]
            dweights[t, k] = d_row_w[i]
    return out, dx, dw_gu, dw_d, dweights

"""Per-expert LoRA inside stages 4-5: custom ops whose weights are frozen and whose adapters train.

An adapter on a stacked expert weight ``W [NR, out, in]`` is ``A [NR, r, in]``, ``B [NR, out, r]`` and a
scale ``s``: expert e computes ``a @ (W_e + s B_e A_e)^T = a @ W_e^T + (s a @ A_e^T) @ B_e^T``. Both
low-rank products are grouped GEMMs over the same routed rows as the base GEMM (the same
``cum_token_counts``, the same launchers: ``down_fwd``/``down_bwd`` of the kernel set), so the gather
of a token's rows is done once and shared, and ``W + s B A`` is never formed.

The base weights are frozen: no launcher that forms a base-weight gradient is called, in forward or
backward. Their backward needs only ``dy @ W_e`` (``down_fwd`` on the stored weight read the other
way round); the adapters get ``dB_e = dy_e^T t_e`` and ``dA_e = (s dy_e B_e)^T a_e`` with
``t = s a A^T`` the ``[R, r]`` intermediate, which is the only extra activation kept.

==================================  ============================================================
``fastmoe::lora_mlp_combine``       stages 4-5 of the SiLU layout with optional adapters on
                                    gate/up and down: ``(out [T, H], gate_up [R, 2I], t_gate_up
                                    [R, r1], t_down [R, r2])`` (absent adapters: ``[R, 0]``)
``fastmoe::lora_mlp_combine_backward``  ``(dx, dweights, dA1, dB1, dA2, dB2)``
``fastmoe::lora_grouped_linear``    stage 4 for other layouts: ``(a @ W_e^T + t @ B_e^T, t)``
                                    (``transposed``: ``W`` stored ``[NR, in, out]``)
``fastmoe::lora_grouped_linear_backward``  ``(da, dA, dB)``
==================================  ============================================================

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, R routed-row
buffer (R >= RT), r adapter rank.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..kernels.contract import KernelBackend
from ..kernels.registry import kernels
from .ops import _pad_rows, resolve_kernels

__all__ = ["LORA_OP_NAMES", "ExpertsLora", "LoraWeights", "lora_grouped_linear", "lora_mlp_combine"]

#: Every op this module registers, as ``torch.ops.fastmoe.<name>``.
LORA_OP_NAMES = ("lora_mlp_combine", "lora_mlp_combine_backward", "lora_grouped_linear",
                 "lora_grouped_linear_backward")


class LoraWeights(NamedTuple):
    """One adapter on a stacked expert weight ``[NR, out, in]``: ``a [NR, r, in]``, ``b [NR, out, r]``
    and the scale (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA): ``W_e + scaling * b_e @ a_e``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


class ExpertsLora(NamedTuple):
    """The adapters of an experts module, each optional: on ``gate_up_proj`` (or ``up_proj``) and on
    ``down_proj``."""

    gate_up: Optional[LoraWeights] = None
    down: Optional[LoraWeights] = None

    def __bool__(self) -> bool:
        return self.gate_up is not None or self.down is not None


def check_lora(lora: LoraWeights, out_features: int, in_features: int, num_local: int, like: torch.Tensor,
               what: str) -> None:
    """ValueError/TypeError (``error: ...``) when ``lora`` does not fit a ``[num_local, out, in]`` weight."""
    a, b = lora.a, lora.b
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"error: {what} LoRA A and B must be 3-D [experts, r, in] and [experts, out, r], "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    r = a.shape[1]
    if tuple(a.shape) != (num_local, r, in_features) or tuple(b.shape) != (num_local, out_features, r) or r < 1:
        raise ValueError(f"error: {what} LoRA A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a "
                         f"[{num_local}, {out_features}, {in_features}] weight (A [E, r, in], B [E, out, r])")
    for name, t in (("A", a), ("B", b)):
        if t.dtype != like.dtype:
            raise TypeError(f"error: {what} LoRA {name} dtype {t.dtype} differs from the weights' {like.dtype}")
        if t.device != like.device:
            raise ValueError(f"error: {what} LoRA {name} on {t.device} but the weights on {like.device}")


def _silu_mul(gate_up_R2I: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_R2I.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gather(x_TH: torch.Tensor, input_indices: torch.Tensor) -> torch.Tensor:
    """``x[input_indices]``; entries past RT of a worst-case row buffer may hold anything, so they are
    clamped into range (their rows are never read by a grouped GEMM, which stops at RT)."""
    if x_TH.shape[0] == 0:
        return x_TH.new_zeros((input_indices.shape[0], x_TH.shape[1]))
    return x_TH.index_select(0, input_indices.clamp(0, x_TH.shape[0] - 1))


def _low_rank(launchers: KernelBackend, a_RK: torch.Tensor, cum: torch.Tensor, lora: tuple) -> torch.Tensor:
    """``t [R, r] = scaling * a @ A_e^T`` per expert group."""
    A, _, scaling = lora
    return launchers.down_fwd(a_RK, cum, A).mul_(scaling)


def _add_up(launchers: KernelBackend, y_RO: torch.Tensor, t_Rr: torch.Tensor, cum: torch.Tensor,
            B: torch.Tensor) -> torch.Tensor:
    """``y += t @ B_e^T`` per expert group (rows past RT of either buffer stay unspecified)."""
    up = launchers.down_fwd(t_Rr, cum, B)
    n = min(y_RO.shape[0], up.shape[0])
    y_RO[:n] += up[:n]
    return y_RO


def _lora_bwd(
    launchers: KernelBackend, dy_RO: torch.Tensor, a_RK: torch.Tensor, t_Rr: torch.Tensor, cum: torch.Tensor,
    A: torch.Tensor, B: torch.Tensor, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da_lora [RT, in], dA, dB)`` of ``y = t @ B^T``, ``t = scaling * a @ A^T``: two grouped GEMMs with
    their weight gradients, each over ``r``-wide operands on one side."""
    v_Rr, dB = launchers.down_bwd(dy_RO, t_Rr, cum, B)              # v = dy @ B_e, dB_e = dy_e^T t_e
    da_RK, dA = launchers.down_bwd(v_Rr.mul_(scaling), a_RK, cum, A)  # da = s v @ A_e, dA_e = (s v)^T a_e
    return da_RK, dA, dB


# ---------------------------------------------------------------- stages 4-5, SiLU layout
def lora_mlp_combine_forward(
    launchers: KernelBackend, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, rows: tuple[torch.Tensor, ...], lora_gate_up: tuple | None, lora_down: tuple | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts = rows
    R = input_indices.shape[0]
    x_RH = _gather(x_TH, input_indices)  # one gather, shared by the base and the low-rank GEMMs
    gate_up_R2I = launchers.down_fwd(x_RH, cum_token_counts, w_gate_up_N2IH)
    t1 = x_TH.new_zeros((R, 0))
    if lora_gate_up is not None:
        t1 = _low_rank(launchers, x_RH, cum_token_counts, lora_gate_up)
        _add_up(launchers, gate_up_R2I, t1, cum_token_counts, lora_gate_up[1])
    h_RI = _silu_mul(gate_up_R2I)
    y_RH = launchers.down_fwd(h_RI, cum_token_counts, w_down_NHI)
    t2 = x_TH.new_zeros((R, 0))
    if lora_down is not None:
        t2 = _low_rank(launchers, h_RI, cum_token_counts, lora_down)
        _add_up(launchers, y_RH, t2, cum_token_counts, lora_down[1])
    out_TH = launchers.combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
    return out_TH, gate_up_R2I, _pad_rows(t1, R), _pad_rows(t2, R)


def lora_mlp_combine_backward_math(
    launchers: KernelBackend, dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor, weights_TK: torch.Tensor, gate_up_R2I: torch.Tensor, t1: torch.Tensor,
    t2: torch.Tensor, rows: tuple[torch.Tensor, ...], lora_gate_up: tuple | None, lora_down: tuple | None,
) -> tuple[torch.Tensor, ...]:
    """``(dx [T, H], dweights [T, K], dA1, dB1, dA2, dB2)`` (absent adapters: empty tensors); no
    base-weight gradient is formed. The router-weight gradient ``<dout_t, y_r>`` is
    ``<dy_r @ Wd_e, h_r> + <dy_r @ B2_e, t2_r>``, from products the backward forms anyway."""
    input_indices, output_indices, selected_expert_indices, cum, cum_expert_counts = rows
    R = gate_up_R2I.shape[0]
    dy_RH, row_w_R = launchers.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                           cum_expert_counts)
    dy_RH = _pad_rows(dy_RH, R)[:R]
    row_w = _pad_rows(row_w_R, R)[:R].float()
    h_RI = _silu_mul(gate_up_R2I)
    g_RI = _pad_rows(launchers.down_fwd(dy_RH, cum, w_down_NHI, transposed=True), R)[:R]  # dy @ Wd_e
    d_row_w = torch.linalg.vecdot(g_RI.float(), h_RI.float())
    dh_RI = (g_RI.float() * row_w[:, None]).to(g_RI.dtype)
    dA1, dB1, dA2, dB2 = (x_TH.new_zeros(0) for _ in range(4))  # distinct: outputs may not alias
    if lora_down is not None:
        A2, B2, s2 = lora_down
        # dB2_e = sum_r w_r dy_r^T t2_r: the row weights scale the r-wide t2, not dy.
        u_Rr, dB2 = launchers.down_bwd(dy_RH, (t2.float() * row_w[:, None]).to(t2.dtype), cum, B2)
        u_Rr = _pad_rows(u_Rr, R)[:R]
        d_row_w = d_row_w + torch.linalg.vecdot(u_Rr.float(), t2.float())
        # u is dy @ B2 unweighted; the row weight and the scale go onto it before A2's GEMMs.
        dt2 = (u_Rr.float() * (row_w * s2)[:, None]).to(u_Rr.dtype)
        dh_lora, dA2 = launchers.down_bwd(dt2, h_RI, cum, A2)
        dh_lora = _pad_rows(dh_lora, R)
        dh_RI[: dh_lora.shape[0]] += dh_lora[:R]
    dweights_TK = launchers.router_weights_bwd(d_row_w, weights_TK, output_indices, selected_expert_indices,
                                               cum_expert_counts)
    d_gate_up = _pad_rows(launchers.silu_mul_bwd(gate_up_R2I, dh_RI, cum), R)[:R]
    dx_rows = _pad_rows(launchers.down_fwd(d_gate_up, cum, w_gate_up_N2IH, transposed=True), R)[:R]
    if lora_gate_up is not None:
        A1, B1, s1 = lora_gate_up
        dx_lora, dA1, dB1 = _lora_bwd(launchers, d_gate_up, _gather(x_TH, input_indices), t1, cum, A1, B1, s1)
        dx_lora = _pad_rows(dx_lora, R)
        dx_rows[: dx_lora.shape[0]] += dx_lora[:R]
    # Each token's rows summed back in slot order (unweighted: output_indices stands in for the slots' k).
    dx_TH = launchers.combine_fwd(dx_rows.contiguous(), None, output_indices, output_indices, cum_expert_counts)
    return dx_TH, dweights_TK, dA1, dB1, dA2, dB2


def _adapter(a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> tuple | None:
    return None if a is None else (a, b, scaling)


@torch.library.custom_op("fastmoe::lora_mlp_combine", mutates_args=())
def lora_mlp_combine_op(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    input_indices: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
    a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], s1: float,
    a2: Optional[torch.Tensor], b2: Optional[torch.Tensor], s2: float,
    kernels_name: str, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 4-5 with adapters: ``(out [T, H], gate_up [R, 2I], t1 [R, r1], t2 [R, r2])``."""
    rows = (input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts)
    launchers = resolve_kernels(kernels_name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name)
    return lora_mlp_combine_forward(launchers, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows,
                                    _adapter(a1, b1, s1), _adapter(a2, b2, s2))


@lora_mlp_combine_op.register_fake
def _(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, input_indices, output_indices, selected_expert_indices,
      cum_token_counts, cum_expert_counts, a1, b1, s1, a2, b2, s2, kernels_name, group_name):
    R = input_indices.shape[0]
    return (x_TH.new_empty((x_TH.shape[0], w_down_NHI.shape[1])), x_TH.new_empty((R, w_gate_up_N2IH.shape[1])),
            x_TH.new_empty((R, 0 if a1 is None else a1.shape[1])), x_TH.new_empty((R, 0 if a2 is None else a2.shape[1])))


@torch.library.custom_op("fastmoe::lora_mlp_combine_backward", mutates_args=())
def lora_mlp_combine_backward(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_R2I: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor,
    input_indices: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
    a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], s1: float,
    a2: Optional[torch.Tensor], b2: Optional[torch.Tensor], s2: float,
    kernels_name: str, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dweights [T, K], dA1, dB1, dA2, dB2)``; absent adapters give empty tensors."""
    rows = (input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts)
    launchers = resolve_kernels(kernels_name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name)
    return lora_mlp_combine_backward_math(launchers, dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
                                          gate_up_R2I, t1, t2, rows, _adapter(a1, b1, s1), _adapter(a2, b2, s2))


@lora_mlp_combine_backward.register_fake
def _(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, gate_up_R2I, t1, t2, input_indices, output_indices,
      selected_expert_indices, cum_token_counts, cum_expert_counts, a1, b1, s1, a2, b2, s2, kernels_name,
      group_name):
    like = lambda t: x_TH.new_empty(0) if t is None else torch.empty_like(t)  # noqa: E731
    return torch.empty_like(x_TH), torch.empty_like(weights_TK), like(a1), like(b1), like(a2), like(b2)


def _lora_mlp_combine_setup(ctx, inputs, output) -> None:
    (x_TH, w_gate_up, w_down, weights_TK, *rest) = inputs
    rows, (a1, b1, s1, a2, b2, s2, kernels_name, group_name) = rest[:5], rest[5:]
    _, gate_up_R2I, t1, t2 = output
    for saved in output[1:]:
        ctx.mark_non_differentiable(saved)
    ctx.save_for_backward(x_TH, w_gate_up, w_down, weights_TK, gate_up_R2I, t1, t2, *rows, a1, b1, a2, b2)
    ctx.consts = (s1, s2, kernels_name, group_name)


def _lora_mlp_combine_backward(ctx, dout_TH, *_saved_grads):
    x_TH, w_gate_up, w_down, weights_TK, gate_up_R2I, t1, t2, *rest = ctx.saved_tensors
    rows, (a1, b1, a2, b2) = rest[:5], rest[5:]
    s1, s2, kernels_name, group_name = ctx.consts
    dx, dweights, dA1, dB1, dA2, dB2 = lora_mlp_combine_backward(
        dout_TH.contiguous(), x_TH, w_gate_up, w_down, weights_TK, gate_up_R2I, t1, t2, *rows, a1, b1, s1, a2, b2,
        s2, kernels_name, group_name)
    if a1 is None:
        dA1 = dB1 = None
    if a2 is None:
        dA2 = dB2 = None
    # the frozen base weights get no gradient: none is computed
    return (dx, None, None, dweights, None, None, None, None, None, dA1, dB1, None, dA2, dB2, None, None, None)


lora_mlp_combine_op.register_autograd(_lora_mlp_combine_backward, setup_context=_lora_mlp_combine_setup)


def lora_mlp_combine(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    rows: tuple[torch.Tensor, ...], lora: ExpertsLora, kernels_name: str, group_name: str = "",
) -> torch.Tensor:
    """``out [T, H]``: stages 4-5 of the SiLU layout with ``lora``'s adapters, base weights frozen."""
    for w, what in ((w_gate_up_N2IH, "gate_up_proj"), (w_down_NHI, "down_proj")):
        if w.requires_grad:
            raise ValueError(f"error: {what} requires grad but LoRA trains the adapters only: freeze the base "
                             "weights (requires_grad_(False)) or train without adapters")
    NR = w_gate_up_N2IH.shape[0]
    g, d = lora.gate_up, lora.down
    if g is not None:
        check_lora(g, w_gate_up_N2IH.shape[1], w_gate_up_N2IH.shape[2], NR, w_gate_up_N2IH, "gate_up_proj")
    if d is not None:
        check_lora(d, w_down_NHI.shape[1], w_down_NHI.shape[2], NR, w_down_NHI, "down_proj")
    out_TH, *_ = lora_mlp_combine_op(
        x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, *rows,
        None if g is None else g.a.contiguous(), None if g is None else g.b.contiguous(),
        1.0 if g is None else float(g.scaling),
        None if d is None else d.a.contiguous(), None if d is None else d.b.contiguous(),
        1.0 if d is None else float(d.scaling), kernels_name, group_name)
    return out_TH


# ---------------------------------------------------------------- stage 4, other layouts
@torch.library.custom_op("fastmoe::lora_grouped_linear", mutates_args=())
def lora_grouped_linear_op(
    a_RK: torch.Tensor, w: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
    cum_token_counts: torch.Tensor, kernels_name: str, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [R, O] = a @ W_e^T + t @ B_e^T, t [R, r] = scaling * a @ A_e^T)`` per local expert group;
    ``transposed``: ``W`` stored ``[NR, in, out]`` and read in place (the adapters never are)."""
    launchers = kernels(kernels_name)
    y = launchers.down_fwd(a_RK, cum_token_counts, w, transposed=transposed)
    t = _low_rank(launchers, a_RK, cum_token_counts, (lora_a, lora_b, scaling))
    _add_up(launchers, y, t, cum_token_counts, lora_b)
    R = a_RK.shape[0]
    return _pad_rows(y, R), _pad_rows(t, R)


@lora_grouped_linear_op.register_fake
def _(a_RK, w, lora_a, lora_b, scaling, cum_token_counts, kernels_name, transposed):
    R = a_RK.shape[0]
    return a_RK.new_empty((R, w.shape[2] if transposed else w.shape[1])), a_RK.new_empty((R, lora_a.shape[1]))


@torch.library.custom_op("fastmoe::lora_grouped_linear_backward", mutates_args=())
def lora_grouped_linear_backward(
    dy_RO: torch.Tensor, a_RK: torch.Tensor, t_Rr: torch.Tensor, w: torch.Tensor, lora_a: torch.Tensor,
    lora_b: torch.Tensor, scaling: float, cum_token_counts: torch.Tensor, kernels_name: str, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da [R, in], dA, dB)``: ``da = dy @ W_e + s (dy @ B_e) @ A_e``; no gradient of ``W``."""
    launchers = kernels(kernels_name)
    R = a_RK.shape[0]
    da = _pad_rows(launchers.down_fwd(dy_RO, cum_token_counts, w, transposed=not transposed), R)[:R]
    da_lora, dA, dB = _lora_bwd(launchers, dy_RO, a_RK, t_Rr, cum_token_counts, lora_a, lora_b, scaling)
    da[: da_lora.shape[0]] += da_lora[:R]
    return da, dA, dB


@lora_grouped_linear_backward.register_fake
def _(dy_RO, a_RK, t_Rr, w, lora_a, lora_b, scaling, cum_token_counts, kernels_name, transposed):
    return torch.empty_like(a_RK), torch.empty_like(lora_a), torch.empty_like(lora_b)


def _lora_grouped_linear_setup(ctx, inputs, output) -> None:
    a_RK, w, lora_a, lora_b, scaling, cum_token_counts, kernels_name, transposed = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(a_RK, output[1], w, lora_a, lora_b, cum_token_counts)
    ctx.consts = (scaling, kernels_name, transposed)


def _lora_grouped_linear_backward(ctx, dy_RO, _dt):
    a_RK, t_Rr, w, lora_a, lora_b, cum_token_counts = ctx.saved_tensors
    scaling, kernels_name, transposed = ctx.consts
    da, dA, dB = lora_grouped_linear_backward(dy_RO.contiguous(), a_RK, t_Rr, w, lora_a, lora_b, scaling,
                                              cum_token_counts, kernels_name, transposed)
    return da, None, dA, dB, None, None, None, None


lora_grouped_linear_op.register_autograd(_lora_grouped_linear_backward, setup_context=_lora_grouped_linear_setup)


def lora_grouped_linear(
    a_RK: torch.Tensor, w: torch.Tensor, lora: LoraWeights, cum_token_counts: torch.Tensor, kernels_name: str,
    transposed: bool,
) -> torch.Tensor:
    """``y [R, out] = a @ (W_e + s B_e A_e)^T`` per local expert group, ``W`` frozen (stored ``[NR, out, in]``,
    or ``[NR, in, out]`` with ``transposed``)."""
    if w.requires_grad:
        raise ValueError("error: a LoRA-adapted expert weight requires grad: LoRA trains the adapters only; "
                         "freeze the base weight (requires_grad_(False))")
    out_f, in_f = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
    check_lora(lora, out_f, in_f, w.shape[0], w, "grouped linear")
    y, _ = lora_grouped_linear_op(a_RK, w, lora.a.contiguous(), lora.b.contiguous(), float(lora.scaling),
                                  cum_token_counts, kernels_name, transposed)
    return y

"""Per-expert LoRA inside stages 4-5: custom ops whose weights are frozen and whose adapters train.

An adapter on a stacked expert weight ``W [NR, out, in]`` is ``A [NR, r, in]``, ``B [NR, out, r]`` and a
scale ``s``: expert e computes ``a @ (W_e + s B_e A_e)^T = a @ W_e^T + (s a @ A_e^T) @ B_e^T``. Both
low-rank products are grouped GEMMs over the same routed rows as the base GEMM (the same
``cum_token_counts``; ``down_fwd``/``down_bwd`` of the engine the registry names for these thin
products, :func:`~fastmoe_xpu.kernels.registry.low_rank_kernels`), so the gather of a token's rows is
done once and shared, and ``W + s B A`` is never formed. Where the kernel set has ``down_fwd_lora``
(Triton), the up-projection ``t @ B_e^T`` runs in the base GEMM's epilogue.

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
from ..kernels.registry import kernels, low_rank_kernels, module_of
from .ops import _ROWS_SCHEMA, _below_autograd, _define, _differentiable, _pad_rows, call, resolve_kernels

__all__ = ["LORA_OP_NAMES", "ExpertsLora", "LoraWeights", "lora_experts", "lora_grouped_linear", "lora_mlp_combine"]

#: Every op this module registers, as ``torch.ops.fastmoe.<name>``.
LORA_OP_NAMES = ("lora_mlp_combine", "lora_mlp_combine_backward", "lora_grouped_linear",
                 "lora_grouped_linear_backward", "lora_experts", "lora_experts_backward")


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


def _thin(launchers: KernelBackend, like: torch.Tensor) -> KernelBackend:
    """The launchers of the ``r``-wide products next to ``launchers`` (the registry's ``low_rank_gemm``
    choice: one batched grouped GEMM where the base's own stage 4 would loop over the experts)."""
    return low_rank_kernels(launchers.NAME, like.device, like.dtype)


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


def _adapted(launchers: KernelBackend, thin: KernelBackend, a_RK: torch.Tensor, cum: torch.Tensor, w: torch.Tensor,
             lora: tuple, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y = a @ W_e^T + t @ B_e^T, t = s a @ A_e^T)`` per expert group: the up-projection in the base
    GEMM's epilogue where the kernel set fuses it (``down_fwd_lora``), else a grouped GEMM added after."""
    t = _low_rank(thin, a_RK, cum, lora)
    fused = getattr(launchers, "down_fwd_lora", None)
    if fused is not None:
        return fused(a_RK, cum, w, t, lora[1], transposed=transposed), t
    return _add_up(thin, launchers.down_fwd(a_RK, cum, w, transposed=transposed), t, cum, lora[1]), t


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
    thin = _thin(launchers, x_TH)
    t1 = t2 = x_TH.new_zeros((R, 0))
    if lora_gate_up is not None:
        gate_up_R2I, t1 = _adapted(launchers, thin, x_RH, cum_token_counts, w_gate_up_N2IH, lora_gate_up)
    else:
        gate_up_R2I = launchers.down_fwd(x_RH, cum_token_counts, w_gate_up_N2IH)
    h_RI = _silu_mul(gate_up_R2I)
    if lora_down is not None:
        y_RH, t2 = _adapted(launchers, thin, h_RI, cum_token_counts, w_down_NHI, lora_down)
    else:
        y_RH = launchers.down_fwd(h_RI, cum_token_counts, w_down_NHI)
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
    thin = _thin(launchers, x_TH)
    if lora_down is not None:
        A2, B2, s2 = lora_down
        # dB2_e = sum_r w_r dy_r^T t2_r: the row weights scale the r-wide t2, not dy.
        u_Rr, dB2 = thin.down_bwd(dy_RH, (t2.float() * row_w[:, None]).to(t2.dtype), cum, B2)
        u_Rr = _pad_rows(u_Rr, R)[:R]
        d_row_w = d_row_w + torch.linalg.vecdot(u_Rr.float(), t2.float())
        # u is dy @ B2 unweighted; the row weight and the scale go onto it before A2's GEMMs.
        dt2 = (u_Rr.float() * (row_w * s2)[:, None]).to(u_Rr.dtype)
        dh_lora, dA2 = thin.down_bwd(dt2, h_RI, cum, A2)
        dh_lora = _pad_rows(dh_lora, R)
        dh_RI[: dh_lora.shape[0]] += dh_lora[:R]
    dweights_TK = launchers.router_weights_bwd(d_row_w, weights_TK, output_indices, selected_expert_indices,
                                               cum_expert_counts)
    d_gate_up = _pad_rows(launchers.silu_mul_bwd(gate_up_R2I, dh_RI, cum), R)[:R]
    dx_rows = _pad_rows(launchers.down_fwd(d_gate_up, cum, w_gate_up_N2IH, transposed=True), R)[:R]
    if lora_gate_up is not None:
        A1, B1, s1 = lora_gate_up
        dx_lora, dA1, dB1 = _lora_bwd(thin, d_gate_up, _gather(x_TH, input_indices), t1, cum, A1, B1, s1)
        dx_lora = _pad_rows(dx_lora, R)
        dx_rows[: dx_lora.shape[0]] += dx_lora[:R]
    # Each token's rows summed back in slot order (unweighted: output_indices stands in for the slots' k).
    dx_TH = launchers.combine_fwd(dx_rows.contiguous(), None, output_indices, output_indices, cum_expert_counts)
    return dx_TH, dweights_TK, dA1, dB1, dA2, dB2


def _adapter(a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> tuple | None:
    return None if a is None else (a, b, scaling)


# ---------------------------------------------------------------- registration (as in ops.py)
# The differentiable tensors come first (base weights, router weights and both adapters), then the
# routed rows and the constants, so that ``_differentiable`` looks at the first eight arguments only.
_ADAPTERS_SCHEMA = "Tensor? a1, Tensor? b1, Tensor? a2, Tensor? b2"
_CONSTS_SCHEMA = "float s1, float s2, str kernels_name, str group_name"


def _lora_mlp_combine(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], a2: Optional[torch.Tensor], b2: Optional[torch.Tensor],
    input_indices: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor, s1: float, s2: float, kernels_name: str,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 4-5 with adapters: ``(out [T, H], gate_up [R, 2I], t1 [R, r1], t2 [R, r2])``."""
    rows = (input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts)
    launchers = resolve_kernels(kernels_name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name)
    return lora_mlp_combine_forward(launchers, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows,
                                    _adapter(a1, b1, s1), _adapter(a2, b2, s2))


def _lora_mlp_combine_fake(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, a1, b1, a2, b2, input_indices,  # noqa: ANN001, ANN202
                           *_rest):
    R = input_indices.shape[0]
    return (x_TH.new_empty((x_TH.shape[0], w_down_NHI.shape[1])), x_TH.new_empty((R, w_gate_up_N2IH.shape[1])),
            x_TH.new_empty((R, 0 if a1 is None else a1.shape[1])), x_TH.new_empty((R, 0 if a2 is None else a2.shape[1])))


def _lora_mlp_combine_backward_body(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], a2: Optional[torch.Tensor],
    b2: Optional[torch.Tensor], gate_up_R2I: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor,
    input_indices: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor, s1: float, s2: float, kernels_name: str,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dweights [T, K], dA1, dB1, dA2, dB2)``; absent adapters give empty tensors."""
    rows = (input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts)
    launchers = resolve_kernels(kernels_name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name)
    return lora_mlp_combine_backward_math(launchers, dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
                                          gate_up_R2I, t1, t2, rows, _adapter(a1, b1, s1), _adapter(a2, b2, s2))


def _lora_mlp_combine_backward_fake(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, a1, b1, a2, b2,  # noqa: ANN001, ANN202
                                    *_rest):
    like = lambda t: x_TH.new_empty(0) if t is None else torch.empty_like(t)  # noqa: E731
    return torch.empty_like(x_TH), torch.empty_like(weights_TK), like(a1), like(b1), like(a2), like(b2)


lora_mlp_combine_op = _define(
    f"lora_mlp_combine(Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, Tensor weights_TK, {_ADAPTERS_SCHEMA}, "
    f"{_ROWS_SCHEMA}, {_CONSTS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)", _lora_mlp_combine, _lora_mlp_combine_fake)
lora_mlp_combine_backward = _define(
    f"lora_mlp_combine_backward(Tensor dout_TH, Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, "
    f"Tensor weights_TK, {_ADAPTERS_SCHEMA}, Tensor gate_up_R2I, Tensor t1, Tensor t2, {_ROWS_SCHEMA}, "
    f"{_CONSTS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _lora_mlp_combine_backward_body, _lora_mlp_combine_backward_fake)


class _LoraMlpCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_gate_up, w_down, weights_TK, a1, b1, a2, b2, *rest):  # noqa: ANN001, ANN205
        out_TH, gate_up_R2I, t1, t2 = _below_autograd(lora_mlp_combine_op, x_TH, w_gate_up, w_down, weights_TK,
                                                      a1, b1, a2, b2, *rest)
        # gate_up and the low-rank intermediates are saved activations, not results.
        ctx.mark_non_differentiable(gate_up_R2I, t1, t2)
        ctx.save_for_backward(x_TH, w_gate_up, w_down, weights_TK, a1, b1, a2, b2, gate_up_R2I, t1, t2, *rest[:5])
        ctx.consts = rest[5:]
        return out_TH, gate_up_R2I, t1, t2

    @staticmethod
    def backward(ctx, dout_TH, *_saved_grads):  # noqa: ANN001, ANN205
        saved = ctx.saved_tensors
        dx, dweights, dA1, dB1, dA2, dB2 = _below_autograd(lora_mlp_combine_backward, dout_TH.contiguous(), *saved,
                                                            *ctx.consts)
        a1, a2 = saved[4], saved[6]
        if a1 is None:
            dA1 = dB1 = None
        if a2 is None:
            dA2 = dB2 = None
        # the frozen base weights get no gradient: none is computed
        return (dx, None, None, dweights, dA1, dB1, dA2, dB2, *(None,) * 9)


_differentiable(lora_mlp_combine_op, _LoraMlpCombine, 8)


def _check_frozen(w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor) -> None:
    for w, what in ((w_gate_up_N2IH, "gate_up_proj"), (w_down_NHI, "down_proj")):
        if w.requires_grad:
            raise ValueError(f"error: {what} requires grad but LoRA trains the adapters only: freeze the base "
                             "weights (requires_grad_(False)) or train without adapters")


def _checked(lora: ExpertsLora, w_gate_up_N2IH: torch.Tensor,
             w_down_NHI: torch.Tensor) -> tuple[LoraWeights | None, LoraWeights | None]:
    NR = w_gate_up_N2IH.shape[0]
    g, d = lora.gate_up, lora.down
    if g is not None:
        check_lora(g, w_gate_up_N2IH.shape[1], w_gate_up_N2IH.shape[2], NR, w_gate_up_N2IH, "gate_up_proj")
    if d is not None:
        check_lora(d, w_down_NHI.shape[1], w_down_NHI.shape[2], NR, w_down_NHI, "down_proj")
    return g, d


def lora_mlp_combine(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    rows: tuple[torch.Tensor, ...], lora: ExpertsLora, kernels_name: str, group_name: str = "",
) -> torch.Tensor:
    """``out [T, H]``: stages 4-5 of the SiLU layout with ``lora``'s adapters, base weights frozen."""
    _check_frozen(w_gate_up_N2IH, w_down_NHI)
    g, d = _checked(lora, w_gate_up_N2IH, w_down_NHI)
    out_TH, *_ = lora_mlp_combine_op(
        x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
        None if g is None else g.a.contiguous(), None if g is None else g.b.contiguous(),
        None if d is None else d.a.contiguous(), None if d is None else d.b.contiguous(), *rows,
        1.0 if g is None else float(g.scaling), 1.0 if d is None else float(d.scaling), kernels_name, group_name)
    return out_TH


# ---------------------------------------------------------------- stages 2-5 in one piece, small layers
def _lora_experts(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], a2: Optional[torch.Tensor], b2: Optional[torch.Tensor],
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, s1: float, s2: float, implementation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [T*K, 2I], plan [T*K+1])``: stages 2-5 with adapters by an ``experts``
    implementation of the registry that runs them (``padded``)."""
    return module_of(implementation).lora_experts_forward(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK,
                                                          expert_start, num_local, a1, b1, s1, a2, b2, s2)


def _lora_experts_fake(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, a1, b1, a2, b2, topk_idx_TK,  # noqa: ANN001, ANN202
                       *_rest):
    S = topk_idx_TK.numel()
    return (x_TH.new_empty((x_TH.shape[0], w_down_NHI.shape[1])), x_TH.new_empty((S, w_gate_up_N2IH.shape[1])),
            topk_idx_TK.new_empty((S + 1,), dtype=torch.int64))


def _lora_experts_backward_body(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], a2: Optional[torch.Tensor],
    b2: Optional[torch.Tensor], gate_up_S2I: torch.Tensor, plan: torch.Tensor, expert_start: int, num_local: int,
    s1: float, s2: float, implementation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dweights [T, K], dA1, dB1, dA2, dB2)``; absent adapters give empty tensors."""
    return module_of(implementation).lora_experts_backward(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
                                                           gate_up_S2I, plan, expert_start, num_local, a1, b1, s1,
                                                           a2, b2, s2)


def _lora_experts_backward_fake(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, a1, b1, a2, b2,  # noqa: ANN001, ANN202
                                *_rest):
    like = lambda t: x_TH.new_empty(0) if t is None else torch.empty_like(t)  # noqa: E731
    return torch.empty_like(x_TH), torch.empty_like(weights_TK), like(a1), like(b1), like(a2), like(b2)


lora_experts_op = _define(
    f"lora_experts(Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, Tensor weights_TK, {_ADAPTERS_SCHEMA}, "
    "Tensor topk_idx_TK, int expert_start, int num_local, float s1, float s2, str implementation)"
    " -> (Tensor, Tensor, Tensor)", _lora_experts, _lora_experts_fake)
lora_experts_backward = _define(
    f"lora_experts_backward(Tensor dout_TH, Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, "
    f"Tensor weights_TK, {_ADAPTERS_SCHEMA}, Tensor gate_up_S2I, Tensor plan, int expert_start, int num_local, "
    "float s1, float s2, str implementation) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _lora_experts_backward_body, _lora_experts_backward_fake)


def _dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` with each batch a row-major matrix (a copy only when it is not)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


class _LoraExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_gate_up, w_down, weights_TK, a1, b1, a2, b2, topk_idx_TK, *rest):  # noqa: ANN001, ANN205
        # PEFT's B is a permuted view of its weight ([E, out, r] with the experts fastest): a batched GEMM
        # over it copies every expert's matrix, in each of the three products that read it. One copy
        # here (no graph node: autograd is off inside a Function's forward) serves them all, and the
        # backward reads the saved copy; B's gradient keeps B's shape.
        b1, b2 = _dense(b1), _dense(b2)
        out_TH, gate_up_S2I, plan = _below_autograd(lora_experts_op, x_TH, w_gate_up, w_down, weights_TK, a1, b1, a2,
                                                    b2, topk_idx_TK, *rest)
        ctx.mark_non_differentiable(gate_up_S2I, plan)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_TH, w_gate_up, w_down, weights_TK, a1, b1, a2, b2, gate_up_S2I, plan)
        ctx.rest = rest
        return out_TH, gate_up_S2I, plan

    @staticmethod
    def backward(ctx, dout_TH, _d_gate_up, _d_plan):  # noqa: ANN001, ANN205
        saved = ctx.saved_tensors
        dx, dweights, dA1, dB1, dA2, dB2 = _below_autograd(lora_experts_backward, dout_TH.contiguous(), *saved,
                                                            *ctx.rest)
        if saved[4] is None:
            dA1 = dB1 = None
        if saved[6] is None:
            dA2 = dB2 = None
        return (dx, None, None, dweights, dA1, dB1, dA2, dB2, None, *(None,) * len(ctx.rest))


_differentiable(lora_experts_op, _LoraExperts, 8)


def lora_experts(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor, lora: ExpertsLora, expert_start: int, num_local: int, implementation: str,
    with_plan: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out [T, H]``: stages 2-5 of the SiLU layout with ``lora``'s adapters in one piece, by the
    registry's ``experts`` implementation ``implementation`` (small layers, eager), base weights frozen.
    ``with_plan``: ``(out, plan)``, the implementation's routing plan too."""
    _check_frozen(w_gate_up_N2IH, w_down_NHI)
    g, d = _checked(lora, w_gate_up_N2IH, w_down_NHI)
    # The adapters as they come (PEFT's are views of its weights): a copy here would be one more op
    # and one more backward node per adapter; the Function makes B dense where it has no graph.
    out_TH, _, plan = call(
        lora_experts_op, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
        None if g is None else g.a, None if g is None else g.b,
        None if d is None else d.a, None if d is None else d.b, topk_idx_TK,
        expert_start, num_local, 1.0 if g is None else float(g.scaling), 1.0 if d is None else float(d.scaling),
        implementation)
    return (out_TH, plan) if with_plan else out_TH


# ---------------------------------------------------------------- stage 4, other layouts
def _lora_grouped_linear(
    a_RK: torch.Tensor, w: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, cum_token_counts: torch.Tensor,
    scaling: float, kernels_name: str, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [R, O] = a @ W_e^T + t @ B_e^T, t [R, r] = scaling * a @ A_e^T)`` per local expert group;
    ``transposed``: ``W`` stored ``[NR, in, out]`` and read in place (the adapters never are)."""
    launchers = kernels(kernels_name)
    y, t = _adapted(launchers, _thin(launchers, a_RK), a_RK, cum_token_counts, w, (lora_a, lora_b, scaling),
                    transposed)
    R = a_RK.shape[0]
    return _pad_rows(y, R), _pad_rows(t, R)


def _lora_grouped_linear_fake(a_RK, w, lora_a, lora_b, cum_token_counts, scaling, kernels_name, transposed):  # noqa: ANN001, ANN202
    R = a_RK.shape[0]
    return a_RK.new_empty((R, w.shape[2] if transposed else w.shape[1])), a_RK.new_empty((R, lora_a.shape[1]))


def _lora_grouped_linear_backward_body(
    dy_RO: torch.Tensor, a_RK: torch.Tensor, t_Rr: torch.Tensor, w: torch.Tensor, lora_a: torch.Tensor,
    lora_b: torch.Tensor, cum_token_counts: torch.Tensor, scaling: float, kernels_name: str, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da [R, in], dA, dB)``: ``da = dy @ W_e + s (dy @ B_e) @ A_e``; no gradient of ``W``."""
    launchers = kernels(kernels_name)
    R = a_RK.shape[0]
    da = _pad_rows(launchers.down_fwd(dy_RO, cum_token_counts, w, transposed=not transposed), R)[:R]
    da_lora, dA, dB = _lora_bwd(_thin(launchers, a_RK), dy_RO, a_RK, t_Rr, cum_token_counts, lora_a, lora_b, scaling)
    da[: da_lora.shape[0]] += da_lora[:R]
    return da, dA, dB


def _lora_grouped_linear_backward_fake(dy_RO, a_RK, t_Rr, w, lora_a, lora_b, *_rest):  # noqa: ANN001, ANN202
    return torch.empty_like(a_RK), torch.empty_like(lora_a), torch.empty_like(lora_b)


lora_grouped_linear_op = _define(
    "lora_grouped_linear(Tensor a_RK, Tensor w, Tensor lora_a, Tensor lora_b, Tensor cum_token_counts, "
    "float scaling, str kernels_name, bool transposed) -> (Tensor, Tensor)",
    _lora_grouped_linear, _lora_grouped_linear_fake)
lora_grouped_linear_backward = _define(
    "lora_grouped_linear_backward(Tensor dy_RO, Tensor a_RK, Tensor t_Rr, Tensor w, Tensor lora_a, "
    "Tensor lora_b, Tensor cum_token_counts, float scaling, str kernels_name, bool transposed)"
    " -> (Tensor, Tensor, Tensor)", _lora_grouped_linear_backward_body, _lora_grouped_linear_backward_fake)


class _LoraGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_RK, w, lora_a, lora_b, cum_token_counts, scaling, kernels_name, transposed):  # noqa: ANN001, ANN205
        y, t = _below_autograd(lora_grouped_linear_op, a_RK, w, lora_a, lora_b, cum_token_counts, scaling,
                               kernels_name, transposed)
        ctx.mark_non_differentiable(t)
        ctx.save_for_backward(a_RK, t, w, lora_a, lora_b, cum_token_counts)
        ctx.consts = (scaling, kernels_name, transposed)
        return y, t

    @staticmethod
    def backward(ctx, dy_RO, _dt):  # noqa: ANN001, ANN205
        da, dA, dB = _below_autograd(lora_grouped_linear_backward, dy_RO.contiguous(), *ctx.saved_tensors, *ctx.consts)
        return da, None, dA, dB, None, None, None, None


_differentiable(lora_grouped_linear_op, _LoraGroupedLinear, 4)


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
    y, _ = lora_grouped_linear_op(a_RK, w, lora.a.contiguous(), lora.b.contiguous(), cum_token_counts,
                                  float(lora.scaling), kernels_name, transposed)
    return y

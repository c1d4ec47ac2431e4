"""Stages 2-5 in one piece with batched GEMMs over zero-padded expert blocks: the path for layers so
small that the number of launches, not the arithmetic, sets their time.

Each local expert's rows go into a block of ``cap`` rows (``cap``: the largest expert's row count,
read on the host, which is free on the CPU), padded with zero rows, so that every projection is one
``bmm`` over the ``[NR, cap, .]`` blocks instead of a GEMM per expert (a grouped GEMM on the CPU is a
loop of them, 2-3 us of launch each). Rows are placed by a one-hot prefix sum over the (token, k)
slots, which are token-major, so the combine is a product of each token's K rows with its K weights
and a sum over K. About twenty ATen calls forward and thirty backward, against some sixty on the staged
chain; the padding costs arithmetic (at worst, every token on one expert, it is the dense layer's),
which is why the registry (:func:`fastmoe_xpu.kernels.registry.whole_layer`) takes this path only
below the ``padded`` entry's budget (docs/small_shapes.md).

What it keeps for backward is what the staged chain keeps: the input and the chosen pairs'
pre-activation ``[T*K, 2I]`` (slot order; the backward puts the rows back into their blocks), and
the layout as a plan of ``T*K + 1`` integers (:attr:`Layout.plan`), so that it is built once.
``h = silu(gate) * up`` and the expert outputs are never kept; the router-weight gradient is
``<dout_t @ W_down[e], h_r>``, formed in the down GEMM's backward as on the staged chain.

Choices of experts outside ``[expert_start, expert_start + NR)`` (other ranks' experts) go to a
dump row that no GEMM reads and whose results are zero; a token may name an expert twice (two rows).
Elementwise work runs in fp32 for bf16/fp16 inputs, the GEMMs in the input dtype; a call no backward
follows rounds each step as transformers' experts do (:mod:`.rounding`).

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, S = T*K slots,
P = NR*cap padded rows (+1 dump row under expert parallelism).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .rounding import per_step, silu_mul, weighted_sum

__all__ = ["Layout", "experts_backward", "experts_forward", "layout", "lora_experts_backward", "lora_experts_forward"]


class Layout(NamedTuple):
    """Where each slot's row lives in the padded blocks."""

    rows: torch.Tensor
    """``[S]`` int64: slot -> padded row ``e * cap + position`` (the dump row ``NR * cap`` for a choice
    of another rank's expert); the first ``S`` entries of :attr:`plan`."""
    cap: int
    """Rows per expert block."""
    padded: int
    """Rows of a padded buffer: ``NR * cap``, +1 when some choice goes to the dump row."""
    dump: int
    """1 when a choice goes to the dump row (another rank's expert), else 0."""
    plan: torch.Tensor
    """``[S + 1]`` int64: the slot rows, then ``2 * cap + dump``; what the forward hands its backward
    (the ``fastmoe::experts`` op's third output), so that the layout is built once."""

    @staticmethod
    def of_plan(plan: torch.Tensor, num_local: int) -> "Layout":
        """The layout whose :attr:`plan` this is."""
        code = int(plan[-1])
        cap, dump = code >> 1, code & 1
        return Layout(plan[:-1], cap, num_local * cap + dump, dump, plan)


#: ``arange(n)`` per (n, device): the one-hot comparison's right side.
_ARANGE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    t = _ARANGE.get((n, device))
    if t is None:
        t = _ARANGE[(n, device)] = torch.arange(n, device=device)
    return t


def layout(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int) -> Layout:
    """The padded layout of the local choices in ``topk_idx [T, K]`` (host reads: CPU tensors)."""
    S = topk_idx_TK.numel()
    col = topk_idx_TK.reshape(S, 1)  # the slots as a column
    if col.dtype != torch.int64:
        col = col.long()
    if expert_start:
        col = col - expert_start
    plan = col.new_empty(S + 1)
    rows = plan[:S]
    if S == 0:
        plan.zero_()
        return Layout(rows, 0, 0, 0, plan)
    # Position of each slot among its expert's slots: a running count over the one-hot slots. Its
    # last row holds the experts' counts (one host read); they sum to S unless some choice names
    # another rank's expert, whose slots then count in a column of their own, the dump's.
    running = torch.eq(col, _arange(num_local, col.device)).cumsum(0)
    counts = running[-1].tolist()
    cap = max(counts)
    dump = int(sum(counts) != S)
    if dump:
        col = torch.where((col >= 0) & (col < num_local), col, num_local)
        running = torch.eq(col, _arange(num_local + 1, col.device)).cumsum(0)
    torch.add(running.gather(1, col), col, alpha=cap, out=rows.view(S, 1)).sub_(1)
    if dump:
        rows.masked_fill_(col.view(S) == num_local, num_local * cap)
    plan[S] = 2 * cap + dump
    return Layout(rows, cap, num_local * cap + dump, dump, plan)


#: Per (S, K, device): the token of each of S token-major slots, ``arange(S) // K``.
_SLOT_TOKENS: dict[tuple[int, int, torch.device], torch.Tensor] = {}
#: Per (N, dtype, device): a ``[1, N]`` zero row, read (never written) by :func:`_gather`.
_ZERO_ROWS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _inverse(lay: Layout, slots: int, k: int, device: torch.device, tokens: bool) -> torch.Tensor:
    """``[NR * cap]`` int64: for each row of the expert blocks, the slot whose row it holds (with
    ``tokens``, that slot's token), and for a padding row one past the last slot (token): a gather
    from a slot-order (token-order) source with a zero row appended fills the blocks
    (:func:`_gather`). A gather copies whole rows, where the indexed write of :func:`_pad_tokens`
    goes element by element: at a small layer's sizes it is about twice as fast, its index included."""
    if tokens:
        key = (slots, k, device)
        src = _SLOT_TOKENS.get(key)
        if src is None:
            src = _SLOT_TOKENS[key] = torch.arange(slots, device=device) // k
        fill = slots // k
    else:
        src, fill = _arange(slots, device), slots
    inv = torch.full((lay.padded,), fill, dtype=torch.int64, device=device).index_copy_(0, lay.rows, src)
    return inv if not lay.dump else inv[:-1]  # the dump row is never read


def _gather(src_RN: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``src``'s rows at ``inv``, a zero row where ``inv`` is ``len(src)``."""
    key = (src_RN.shape[1], src_RN.dtype, src_RN.device)
    zero = _ZERO_ROWS.get(key)
    if zero is None:
        zero = _ZERO_ROWS[key] = src_RN.new_zeros(1, src_RN.shape[1])
    return torch.cat((src_RN, zero)).index_select(0, inv)


def _check(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
           topk_idx_TK: torch.Tensor) -> None:
    if x_TH.dim() != 2 or w_gate_up_N2IH.dim() != 3 or w_down_NHI.dim() != 3:
        raise ValueError(f"padded experts: expected x [T, H], w_gate_up [NR, 2I, H], w_down [NR, H, I], got "
                         f"{tuple(x_TH.shape)}, {tuple(w_gate_up_N2IH.shape)}, {tuple(w_down_NHI.shape)}")
    NR, I2, H = w_gate_up_N2IH.shape
    if x_TH.shape[1] != H or I2 % 2 or tuple(w_down_NHI.shape) != (NR, H, I2 // 2):
        raise ValueError(f"padded experts: shapes do not match: x {tuple(x_TH.shape)}, w_gate_up "
                         f"{tuple(w_gate_up_N2IH.shape)}, w_down {tuple(w_down_NHI.shape)}")
    if weights_TK.dim() != 2 or weights_TK.shape != topk_idx_TK.shape or weights_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"padded experts: weights {tuple(weights_TK.shape)} and topk_idx "
                         f"{tuple(topk_idx_TK.shape)} must both be [T, K] with T = {x_TH.shape[0]}")
    if x_TH.dtype != w_gate_up_N2IH.dtype or x_TH.dtype != w_down_NHI.dtype:
        raise TypeError(f"padded experts: x, w_gate_up and w_down must share a dtype, got {x_TH.dtype}, "
                        f"{w_gate_up_N2IH.dtype}, {w_down_NHI.dtype}")


def _pad(src_SN: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``[P, N]``: slot ``s``'s row of ``src`` at padded row ``lay.rows[s]``, zero elsewhere."""
    return src_SN.new_zeros(lay.padded, src_SN.shape[1]).index_copy_(0, lay.rows, src_SN)


def _pad_tokens(src_TN: torch.Tensor, k: int, lay: Layout) -> torch.Tensor:
    """``[P, N]``: token ``t``'s row of ``src`` at the padded rows of its ``k`` slots, zero elsewhere
    (one indexed write of the broadcast rows: no ``[T*K, N]`` copy first)."""
    T, N = src_TN.shape
    return src_TN.new_zeros(lay.padded, N).index_put_((lay.rows.view(T, k),), src_TN.unsqueeze(1))


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]`` (``t`` itself when it has ``n`` rows: no view to make)."""
    return t if t.shape[0] == n else t[:n]


def _blocks(t: torch.Tensor, num_local: int, cap: int) -> torch.Tensor:
    """The ``[NR, cap, .]`` expert blocks of a padded buffer (its dump row left out)."""
    if t.shape[0] != num_local * cap:
        t = t[: num_local * cap]
    return t.view(num_local, cap, t.shape[-1])


def _batched(a: torch.Tensor, b: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``[P, N]``: ``a @ b`` per expert block, the dump row (if any) zero."""
    NR = a.shape[0]
    if lay.padded == NR * lay.cap:
        return torch.bmm(a, b).view(lay.padded, b.shape[-1])
    out = a.new_empty(lay.padded, b.shape[-1])
    torch.bmm(a, b, out=out[: NR * lay.cap].view(NR, lay.cap, b.shape[-1]))
    out[NR * lay.cap:].zero_()
    return out


def _sum_k(t_TKN: torch.Tensor) -> torch.Tensor:
    """``t [T, K, N]`` summed over K. For K <= 2 that is one add (or none), which is what the
    reduction computes for so few terms, without its setup (a reduction over a middle dimension of
    two costs several times the add at a small layer's sizes)."""
    k = t_TKN.shape[1]
    if k == 1:
        return t_TKN[:, 0]
    if k == 2:
        return torch.add(t_TKN[:, 0], t_TKN[:, 1])
    return t_TKN.sum(1)


def _combine_rows(y_PH: torch.Tensor, weights_TK: torch.Tensor, gate_up: torch.Tensor,
                  lay: Layout, steps: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's end: ``out [T, H]``, each token's rows of ``y_PH`` (one per block row) weighted and
    summed (``steps``: as transformers rounds them, :func:`.rounding.weighted_sum`), the routed rows
    of ``gate_up [NR, cap, 2I]`` saved for backward, and the plan."""
    T, K = weights_TK.shape
    NR, cap, I2 = gate_up.shape
    y_TKH = y_PH.index_select(0, lay.rows).view(T, K, y_PH.shape[-1])
    if steps:
        out_TH = weighted_sum(y_TKH, weights_TK)
    else:
        w = weights_TK if weights_TK.dtype == y_TKH.dtype else weights_TK.to(y_TKH.dtype)
        out_TH = _sum_k(y_TKH.mul_(w.unsqueeze(-1)))
    # Rows of the dump (other ranks' choices) read the last block row: never used.
    rows = lay.rows if not lay.dump else lay.rows.clamp(max=NR * cap - 1)
    saved = gate_up.view(NR * cap, I2).index_select(0, rows)
    return out_TH, saved, lay.plan


def experts_forward(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [T*K, 2I], plan [T*K + 1])``: the layer's output over the local experts,
    the chosen pairs' pre-activation in slot order (rows of other ranks' choices unspecified) and the
    layout (:attr:`Layout.plan`) for the backward."""
    _check(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
    T, H = x_TH.shape
    NR, I2, _ = w_gate_up_N2IH.shape
    K = topk_idx_TK.shape[1]
    lay = layout(topk_idx_TK, expert_start, num_local)
    if lay.cap == 0:  # no choice of a local expert
        return x_TH.new_zeros(T, H), x_TH.new_zeros(T * K, I2), lay.plan
    gate_up = torch.bmm(_blocks(_pad_tokens(x_TH, K, lay), NR, lay.cap), w_gate_up_N2IH.mT)  # [NR, cap, 2I]
    steps = per_step(x_TH)
    h = silu_mul(gate_up, steps)
    y_PH = _batched(h if h.dtype == x_TH.dtype else h.to(x_TH.dtype), w_down_NHI.mT, lay)
    return _combine_rows(y_PH, weights_TK, gate_up, lay, steps)


def experts_backward(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_S2I: torch.Tensor, plan: torch.Tensor, expert_start: int, num_local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I], dweights [T, K])`` of
    :func:`experts_forward`, from the saved pre-activation of the chosen pairs and the forward's plan."""
    T, H = x_TH.shape
    NR, I2, _ = w_gate_up_N2IH.shape
    I, K = I2 // 2, weights_TK.shape[1]
    dtype = x_TH.dtype
    lay = Layout.of_plan(plan, num_local)
    if lay.cap == 0:
        return (torch.zeros_like(x_TH), torch.zeros_like(w_gate_up_N2IH), torch.zeros_like(w_down_NHI),
                torch.zeros_like(weights_TK))
    f32 = torch.float32
    gu = _blocks(_pad(_first(gate_up_S2I, T * K), lay), NR, lay.cap)
    gu = gu if gu.dtype == f32 else gu.float()
    gate, up = gu.chunk(2, -1)
    silu = torch.nn.functional.silu(gate)
    h = silu * up  # [NR, cap, I] fp32
    dout_blocks = _blocks(_pad_tokens(dout_TH if dout_TH.dtype == dtype else dout_TH.to(dtype), K, lay), NR, lay.cap)
    w_blocks = _blocks(_pad(weights_TK.reshape(T * K, 1).to(f32), lay), NR, lay.cap)
    # Unweighted dout @ W_down[e]: its dot with h is the router-weight gradient.
    g = torch.bmm(dout_blocks, w_down_NHI)
    g = g if g.dtype == f32 else g.float()
    dw_rows = torch.linalg.vecdot(g, h).view(-1)
    if lay.dump:  # the dump row's gradient is zero
        dw_rows = torch.cat((dw_rows, dw_rows.new_zeros(1)))
    dweights_TK = dw_rows.index_select(0, lay.rows).view(T, K)
    if dweights_TK.dtype != weights_TK.dtype:
        dweights_TK = dweights_TK.to(weights_TK.dtype)
    h.mul_(w_blocks)
    dw_down = torch.bmm(dout_blocks.mT, h if h.dtype == dtype else h.to(dtype))  # [NR, H, I]
    g.mul_(w_blocks)
    d_gu = torch.empty(NR, lay.cap, I2, dtype=f32, device=x_TH.device)
    d_gate, d_up = d_gu.chunk(2, -1)
    torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=d_gate)
    torch.mul(g, silu, out=d_up)
    if dtype != f32:
        d_gu = d_gu.to(dtype)
    dw_gate_up = torch.bmm(d_gu.mT, _blocks(_pad_tokens(x_TH, K, lay), NR, lay.cap))  # [NR, 2I, H]
    dx_PH = _batched(d_gu, w_gate_up_N2IH, lay)
    dx_TH = _sum_k(dx_PH.index_select(0, lay.rows).view(T, K, H))
    return dx_TH, dw_gate_up, dw_down, dweights_TK


# ---------------------------------------------------------------- LoRA adapters on the frozen weights
# An adapter on the stacked weight ``W [NR, out, in]`` is ``A [NR, r, in]``, ``B [NR, out, r]`` and a
# scale ``s``: expert e computes ``a @ W_e^T + (s a @ A_e^T) @ B_e^T`` (fastmoe_xpu/autograd/lora_ops.py
# runs the same on the staged chain). On the padded blocks each product is one batched GEMM (the
# scale in its ``alpha``, an up-projection accumulated into the base GEMM's result with ``baddbmm_``),
# so a small layer with adapters costs about a dozen more ATen calls than without, where the staged
# chain adds grouped GEMMs. The base weights are frozen: no base-weight gradient is formed. The
# backward recomputes ``t1 = s x A1^T`` and ``t2 = s h A2^T`` from what it has anyway (the padded
# input, ``h``): nothing beyond the base path's saved set is kept.

#: The ignored ``input`` of ``baddbmm(..., beta=0, alpha=s)``: a scaled batched GEMM in one call.
_NONE = torch.zeros(())


def _scaled_bmm(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * a @ b`` per batch, one call."""
    if scaling == 1.0:
        return torch.bmm(a, b)
    return torch.baddbmm(_NONE if a.is_cpu and a.dtype is _NONE.dtype else _NONE.to(a.device, a.dtype),
                         a, b, beta=0, alpha=scaling)


#: ``silu_backward`` into a given tensor (looked up once: the ``torch.ops`` namespaces are Python).
_SILU_BACKWARD = torch.ops.aten.silu_backward.grad_input


def _expert_rows(y: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The ``[P, N]`` padded rows of the ``[NR, cap, N]`` blocks ``y``: a view, or with the dump row
    (zero) after them."""
    flat = y.view(-1, y.shape[-1])
    return flat if not lay.dump else torch.cat((flat, flat.new_zeros(1, y.shape[-1])))


def lora_experts_forward(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, a1: torch.Tensor | None, b1: torch.Tensor | None,
    s1: float, a2: torch.Tensor | None, b2: torch.Tensor | None, s2: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`experts_forward` with adapters ``(a1, b1, s1)`` on ``w_gate_up`` and ``(a2, b2, s2)`` on
    ``w_down`` (either pair may be None): ``(out [T, H], gate_up [T*K, 2I], plan [T*K + 1])``, the
    pre-activation with the gate/up adapter's part included."""
    _check(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
    T, H = x_TH.shape
    NR, I2, _ = w_gate_up_N2IH.shape
    K = topk_idx_TK.shape[1]
    lay = layout(topk_idx_TK, expert_start, num_local)
    if lay.cap == 0:
        return x_TH.new_zeros(T, H), x_TH.new_zeros(T * K, I2), lay.plan
    xp = _gather(x_TH, _inverse(lay, T * K, K, x_TH.device, tokens=True)).view(NR, lay.cap, H)
    gate_up = torch.bmm(xp, w_gate_up_N2IH.mT)  # [NR, cap, 2I]
    if a1 is not None:
        gate_up.baddbmm_(_scaled_bmm(xp, a1.mT, s1), b1.mT)
    g = gate_up if gate_up.dtype == torch.float32 else gate_up.float()
    gate, up = g.chunk(2, -1)
    h = torch._C._nn.silu(gate).mul_(up)
    h = h if h.dtype == x_TH.dtype else h.to(x_TH.dtype)
    y = torch.bmm(h, w_down_NHI.mT)  # [NR, cap, H]
    if a2 is not None:
        y.baddbmm_(_scaled_bmm(h, a2.mT, s2), b2.mT)
    return _combine_rows(_expert_rows(y, lay), weights_TK, gate_up, lay)


def lora_experts_backward(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_S2I: torch.Tensor, plan: torch.Tensor, expert_start: int, num_local: int,
    a1: torch.Tensor | None, b1: torch.Tensor | None, s1: float, a2: torch.Tensor | None, b2: torch.Tensor | None,
    s2: float,
) -> tuple[torch.Tensor, ...]:
    """``(dx [T, H], dweights [T, K], dA1, dB1, dA2, dB2)`` of :func:`lora_experts_forward` (an absent
    adapter's gradients: empty tensors); the frozen base weights get none."""
    T, H = x_TH.shape
    NR, I2, _ = w_gate_up_N2IH.shape
    K = weights_TK.shape[1]
    dtype, f32 = x_TH.dtype, torch.float32
    lay = Layout.of_plan(plan, num_local)
    if lay.cap == 0:
        grads = [torch.zeros_like(t) if t is not None else x_TH.new_zeros(0) for t in (a1, b1, a2, b2)]
        return (torch.zeros_like(x_TH), torch.zeros_like(weights_TK), *grads)
    inv = _inverse(lay, T * K, K, x_TH.device, tokens=False)  # padded row -> slot
    inv_t = inv if K == 1 else inv // K  # padded row -> token
    gu = _gather(_first(gate_up_S2I, T * K), inv).view(NR, lay.cap, I2)
    gu = gu if gu.dtype == f32 else gu.float()
    gate, up = gu.chunk(2, -1)
    silu = torch._C._nn.silu(gate)
    h = silu * up  # [NR, cap, I] fp32
    dout_blocks = _gather(dout_TH if dout_TH.dtype == dtype else dout_TH.to(dtype), inv_t).view(NR, lay.cap, H)
    w_S1 = weights_TK.reshape(T * K, 1)
    w_blocks = _gather(w_S1 if w_S1.dtype == f32 else w_S1.float(), inv).view(NR, lay.cap, 1)
    # Unweighted dout @ W_down[e] (and @ B2[e]): their dots with h (and t2) are the router-weight gradient.
    g = torch.bmm(dout_blocks, w_down_NHI)
    g = g if g.dtype == f32 else g.float()
    dw_rows = torch.linalg.vecdot(g, h)
    g.mul_(w_blocks)  # dh of the base GEMM
    if a2 is None:
        dA2, dB2 = x_TH.new_zeros(0), x_TH.new_zeros(0)  # absent adapter (distinct: outputs may not alias)
    else:
        h_in = h if h.dtype == dtype else h.to(dtype)
        t2 = _scaled_bmm(h_in, a2.mT, s2)  # [NR, cap, r2]
        u = torch.bmm(dout_blocks, b2)  # [NR, cap, r2]
        dw_rows += torch.linalg.vecdot(u, t2) if u.dtype == f32 else torch.linalg.vecdot(u.float(), t2.float())
        dB2 = torch.bmm(dout_blocks.mT, t2.mul_(w_blocks) if t2.dtype == f32 else (t2.float() * w_blocks).to(dtype))
        uw = u.mul_(w_blocks) if u.dtype == f32 else (u.float() * w_blocks).to(dtype)  # [NR, cap, r2]
        dA2 = _scaled_bmm(uw.mT, h_in, s2)  # [NR, r2, I]
        if g.dtype == uw.dtype:
            g.baddbmm_(uw, a2, alpha=s2)
        else:
            g += _scaled_bmm(uw, a2, s2).float()
    dw_rows = dw_rows.view(-1)
    if lay.dump:
        dw_rows = torch.cat((dw_rows, dw_rows.new_zeros(1)))
    dweights_TK = dw_rows.index_select(0, lay.rows).view(T, K)
    if dweights_TK.dtype != weights_TK.dtype:
        dweights_TK = dweights_TK.to(weights_TK.dtype)
    d_gu = g.new_empty(NR, lay.cap, I2)
    d_gate, d_up = d_gu.chunk(2, -1)
    _SILU_BACKWARD(g * up, gate, grad_input=d_gate)
    torch.mul(g, silu, out=d_up)
    if dtype != f32:
        d_gu = d_gu.to(dtype)
    dx = torch.bmm(d_gu, w_gate_up_N2IH)  # [NR, cap, H]
    if a1 is None:
        dA1, dB1 = x_TH.new_zeros(0), x_TH.new_zeros(0)
    else:
        xp = _gather(x_TH, inv_t).view(NR, lay.cap, H)
        dB1 = torch.bmm(d_gu.mT, _scaled_bmm(xp, a1.mT, s1))  # [NR, 2I, r1]
        v = _scaled_bmm(d_gu, b1, s1)  # [NR, cap, r1]
        dA1 = torch.bmm(v.mT, xp)  # [NR, r1, H]
        dx.baddbmm_(v, a1)
    dx_TH = _sum_k(_expert_rows(dx, lay).index_select(0, lay.rows).view(T, K, H))
    return dx_TH, dweights_TK, dA1, dB1, dA2, dB2

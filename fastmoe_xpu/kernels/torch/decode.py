"""Stages 2-5 in one piece for layers with about one routed row per expert or fewer (decoding): only the
chosen experts' weights are read, one ``mm`` per chosen expert and projection.

At a decode step (T = 1-8 tokens) most local experts have no row. A batched GEMM over padded expert
blocks (:mod:`.padded`) then reads every expert's weights for a few rows; torch's grouped GEMM on the
CPU runs a GEMM per expert, empty ones included; the staged chain pays for its stages' launches. Here
the slots are sorted by expert (one stable ``argsort``, the experts' row counts read to the host,
free on the CPU), each chosen expert's rows go through ``x @ W_gate_up[e]^T`` and ``h @ W_down[e]^T``
(plain ``mm`` into slices of one output, on views of the weights that are cached per weight tensor),
SiLU*up runs once over all rows, and each token's K rows are weighted and summed. One token (a
decode step of one sequence) takes a matrix-vector product per choice, in slot order, no sort and no
gather; that is where ``auto`` runs this op (the registry's ``max_tokens``): from a few tokens on, the
padded op or torch's grouped GEMM in one piece measured as fast or faster (docs/small_shapes.md).

The backward has the same shape: per chosen expert, the down GEMM's input gradient (unweighted: its
dot with ``h`` is the router-weight gradient), both weight gradients and the input gradient's rows;
experts no slot chose get zero weight gradients. What is kept for backward is what the staged chain
keeps: the input and the chosen pairs' pre-activation ``[T*K, 2I]`` in slot order, and a plan of
``T*K + 1`` integers (:func:`plan_of`): the slots in expert order, each with its expert, then whether
some choice names another rank's expert (bit 0, as in :mod:`.padded`'s plan).

Elementwise work runs in fp32 for bf16/fp16 inputs, the GEMMs in the input dtype; a call no backward
follows rounds each step as transformers' experts do (:mod:`.rounding`).

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, S = T*K slots,
RL routed rows on local experts.
"""
from __future__ import annotations

import weakref

import torch

from ..grouped_mm import _gmm, unsupported_reason
from .buffers import cached_empty
from .counting import all_local
from .rounding import per_step, silu_mul, weighted_sum

__all__ = ["experts_backward", "experts_forward", "plan_of"]

#: Per weight tensor and orientation (by id): ``(weak reference, data_ptr, per-expert views)``; views
#: share the weight's storage, so in-place updates are seen; a new storage (``.data =``) rebuilds them.
_VIEWS: dict[tuple[int, bool], tuple[weakref.ref, int, tuple[torch.Tensor, ...]]] = {}


def _experts_of(w: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, ...]:
    """``w.unbind(0)`` (``transposed``: each expert's matrix transposed, ``w[e].t()``), detached, kept
    while ``w`` lives on the same storage (a layer call asks once per projection; unbinding 64 experts
    costs more than a decode step's arithmetic at small widths, and a transpose per expert and use is
    a dispatch each)."""
    key = (id(w), transposed)
    entry = _VIEWS.get(key)
    ptr = w.data_ptr()
    if entry is not None and entry[0]() is w and entry[1] == ptr and len(entry[2]) == w.shape[0] \
            and (not entry[2] or entry[2][0].shape == (w.shape[:0:-1] if transposed else w.shape[1:])):
        return entry[2]
    views = (w.detach().transpose(1, 2) if transposed else w.detach()).unbind(0)
    _VIEWS[key] = (weakref.ref(w, lambda _, key=key: _VIEWS.pop(key, None)), ptr, views)
    return views


def plan_of(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int) -> tuple[torch.Tensor, list[int], int]:
    """``(plan [S + 1], counts, dump)``: ``plan[:S]`` the slots sorted by local expert (stable), each as
    ``expert * S + slot`` (slots of other ranks' experts last, as expert ``NR``), ``plan[S]`` the dump
    bit; ``counts``: rows per local expert (host list); ``dump``: 1 when some choice is not local."""
    S = topk_idx_TK.numel()
    flat = topk_idx_TK.reshape(S)
    if flat.dtype != torch.int64:
        flat = flat.long()
    if expert_start:
        flat = flat - expert_start
    plan = flat.new_empty(S + 1)
    dump = int(S > 0 and not all_local(topk_idx_TK, expert_start, num_local))
    if dump:  # other ranks' experts count as expert NR
        flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)
    counts = torch.bincount(flat, minlength=num_local + 1).tolist() if S else [0] * (num_local + 1)
    if S:
        key = flat * S + torch.arange(S, device=flat.device)
        torch.sort(key, out=(plan[:S], flat.new_empty(S)))
    plan[S] = dump
    return plan, counts[:num_local], dump


def _groups(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, first row, end row)`` of each expert with rows, in the sorted order."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
            start += n
    return out


#: The most chosen experts whose GEMMs run one ``mm`` each from Python; with more, one grouped GEMM
#: (torch's, a loop in C++ over every local expert) runs each projection where it takes the dtype.
LOOP_EXPERTS = 4


def _offsets(counts: list[int], like: torch.Tensor) -> torch.Tensor | None:
    """grouped_mm's ``offs`` (the experts' cumulative row ends, int32) when more than
    :data:`LOOP_EXPERTS` experts have rows and grouped_mm runs for ``like``'s dtype here; else None."""
    if sum(1 for n in counts if n) <= LOOP_EXPERTS or unsupported_reason(like.device, like.dtype) is not None:
        return None
    return torch.tensor(counts, dtype=torch.int32).cumsum_(0)


def _per_expert(a_RN: torch.Tensor, w: torch.Tensor, transposed: bool, groups: list[tuple[int, int, int]],
                offs: torch.Tensor | None) -> torch.Tensor:
    """Each chosen expert's rows of ``a`` times its weight, ``w[e]^T`` (``transposed``) or ``w[e]``: one
    grouped GEMM where ``offs`` is given (:func:`_offsets`), else an ``mm`` per expert with rows."""
    if offs is not None:
        return _gmm(a_RN, w.mT if transposed else w, offs)
    views = _experts_of(w)
    out = a_RN.new_empty(a_RN.shape[0], w.shape[1] if transposed else w.shape[2])
    for e, a, b in groups:
        torch.mm(a_RN[a:b], views[e].t() if transposed else views[e], out=out[a:b])
    return out


def _weight_grad(w: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """A gradient buffer for ``w [NR, ., .]`` from the torch backend's pool (kept mapped between calls)
    whose experts without rows are zero, one run of consecutive experts at a time; the experts with
    rows are written by the caller."""
    out = cached_empty(w.shape, w)
    done = 0
    for e, _, _ in (*groups, (w.shape[0], 0, 0)):
        if e > done:
            out[done:e].zero_()
        done = e + 1
    return out


def experts_forward(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [T*K, 2I], plan [T*K + 1])``: the layer over the local experts, the chosen
    pairs' pre-activation in slot order (rows of other ranks' choices zero) and the plan."""
    from .padded import _check

    _check(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
    T, H = x_TH.shape
    I2 = w_gate_up_N2IH.shape[1]
    K = topk_idx_TK.shape[1]
    S = T * K
    steps = per_step(x_TH)
    if T == 1:
        # One token's K ids, read to the host (free on the CPU; the one-token path walks them there):
        # whether they are all local is then a question for Python, not another op.
        ids = topk_idx_TK.view(-1).tolist()
        if ids and expert_start <= min(ids) and max(ids) < expert_start + num_local:
            return _one_token(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, ids, expert_start, steps)
    plan, counts, dump = plan_of(topk_idx_TK, expert_start, num_local)
    groups = _groups(counts)
    RL = groups[-1][2] if groups else 0
    if RL == 0:
        return x_TH.new_zeros(T, H), x_TH.new_zeros(S, I2), plan
    slots = plan[:RL] % S
    tokens = slots if K == 1 else slots.div(K, rounding_mode="floor")
    x_RH = x_TH if T == 1 and K == 1 else x_TH.index_select(0, tokens)
    offs = _offsets(counts, x_TH)
    gate_up = _per_expert(x_RH, w_gate_up_N2IH, True, groups, offs)
    h = silu_mul(gate_up, steps)
    y_RH = _per_expert(h if h.dtype == x_TH.dtype else h.to(x_TH.dtype), w_down_NHI, True, groups, offs)
    if steps and RL == S:  # weighted and summed per token as transformers rounds them
        out_TH = weighted_sum(y_RH.new_empty(S, H).index_copy_(0, slots, y_RH).view(T, K, H), weights_TK)
        return out_TH, gate_up.new_empty(S, I2).index_copy_(0, slots, gate_up), plan
    w_R = weights_TK.reshape(S).index_select(0, slots)
    y_RH.mul_(w_R.unsqueeze(1) if w_R.dtype == y_RH.dtype else w_R.to(y_RH.dtype).unsqueeze(1))
    if RL == S and K > 1:  # every slot local: back to slot order, a sum over each token's K rows
        from .padded import _sum_k

        y_SH = y_RH.new_empty(S, H).index_copy_(0, slots, y_RH)
        out_TH = _sum_k(y_SH.view(T, K, H))
        saved = gate_up.new_empty(S, I2).index_copy_(0, slots, gate_up)
    elif RL == S:
        out_TH = y_RH.new_empty(T, H).index_copy_(0, slots, y_RH)
        saved = gate_up.new_empty(S, I2).index_copy_(0, slots, gate_up)
    else:
        out_TH = y_RH.new_zeros(T, H).index_add_(0, tokens, y_RH)
        saved = gate_up.new_zeros(S, I2).index_copy_(0, slots, gate_up)
    return out_TH, saved, plan


#: One token's K experts' bf16/fp16 matrices of one projection are copied side by side and multiplied
#: by one batched product up to this many bytes; above, and in fp32, a matrix-vector product per expert.
#: One thread, Xeon with AMX, 2026-11-29, minimum over five interleaved rounds, the gate/up product of
#: one token (bf16): H=256 I=128 K=4 (512 KiB) 104-115 us batched against 153-158 us per expert
#: (two threads: 106 against 167); 1 MiB (H=256 I=256 K=4) 237 against 178; fp32 at 512 KiB 218
#: against 48 (torch's fp32 matrix-vector product is several times its bf16 one).
GATHER_MAX_BYTES = 512 << 10


def _gathered(w: torch.Tensor, k: int) -> bool:
    """Whether :func:`_one_token` multiplies ``k`` of ``w``'s experts as one batched product."""
    return w.dtype in (torch.bfloat16, torch.float16) and k * w[0].numel() * w.element_size() <= GATHER_MAX_BYTES


def _one_token(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
               ids: list[int], expert_start: int,
               steps: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`experts_forward` of one token whose every choice (``ids``, its K expert ids, read to the
    host) is local: a matrix-vector product per
    choice and projection (small bf16/fp16 ones: one batched product over the chosen experts' matrices,
    :func:`_gathered`; the same bits), in slot order (no sort), the K rows weighted and summed by one
    ``[1, K] @ [K, H]`` product (``steps``, :func:`.rounding.per_step`: as transformers rounds them);
    the plan built on the host from the K ids."""
    K = len(ids)
    if expert_start:
        ids = [e - expert_start for e in ids]
    x_H = x_TH[0]
    gather_gu, gather_d = _gathered(w_gate_up_N2IH, K), _gathered(w_down_NHI, K)
    chosen = torch.tensor(ids, device=x_TH.device) if gather_gu or gather_d else None
    if gather_gu:
        gate_up = torch.bmm(w_gate_up_N2IH.detach().index_select(0, chosen),
                            x_H.view(-1, 1).expand(K, -1, 1)).squeeze(-1)  # [K, 2I], slot order
    else:
        w_gu = _experts_of(w_gate_up_N2IH)
        gate_up = torch.stack([torch.mv(w_gu[e], x_H) for e in ids])  # [K, 2I], slot order
    h = silu_mul(gate_up, steps)
    h = h if h.dtype == x_TH.dtype else h.to(x_TH.dtype)
    if gather_d:
        y_KH = torch.bmm(w_down_NHI.detach().index_select(0, chosen), h.unsqueeze(-1)).squeeze(-1)
    else:
        w_d = _experts_of(w_down_NHI)
        y_KH = torch.stack([torch.mv(w_d[e], h_I) for e, h_I in zip(ids, h.unbind(0))])
    if steps:
        out_TH = weighted_sum(y_KH.unsqueeze(0), weights_TK)
    else:
        out_TH = torch.mm(weights_TK if weights_TK.dtype == y_KH.dtype else weights_TK.to(y_KH.dtype), y_KH)
    order = sorted(range(K), key=ids.__getitem__)
    plan = torch.tensor([ids[k] * K + k for k in order] + [0], dtype=torch.int64, device=x_TH.device)
    return out_TH, gate_up, plan


def experts_backward(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_S2I: torch.Tensor, plan: torch.Tensor, expert_start: int, num_local: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I], dweights [T, K])`` of
    :func:`experts_forward`, from the saved pre-activation and the forward's plan."""
    T, H = x_TH.shape
    K = weights_TK.shape[1]
    S = T * K
    dtype, f32 = x_TH.dtype, torch.float32
    counts = torch.bincount(plan[:S] // S, minlength=num_local + 1).tolist()[:num_local] if S else [0] * num_local
    groups = _groups(counts)
    RL = groups[-1][2] if groups else 0
    dw_gate_up, dw_down = _weight_grad(w_gate_up_N2IH, groups), _weight_grad(w_down_NHI, groups)
    if RL == 0:
        return torch.zeros_like(x_TH), dw_gate_up, dw_down, torch.zeros_like(weights_TK)
    slots = plan[:RL] % S
    tokens = slots if K == 1 else slots.div(K, rounding_mode="floor")
    x_RH = x_TH.index_select(0, tokens)
    dout_RH = dout_TH.index_select(0, tokens)
    dout_RH = dout_RH if dout_RH.dtype == dtype else dout_RH.to(dtype)
    gu = gate_up_S2I.index_select(0, slots)
    gu = gu if gu.dtype == f32 else gu.float()
    gate, up = gu.chunk(2, -1)
    silu = torch._C._nn.silu(gate)
    h = silu * up  # [RL, I] fp32
    offs = _offsets(counts, x_TH)
    g = _per_expert(dout_RH, w_down_NHI, False, groups, offs)  # unweighted dout @ W_down[e]
    g = g if g.dtype == f32 else g.float()
    w_R1 = weights_TK.reshape(S).index_select(0, slots).unsqueeze(1)
    w_R1 = w_R1 if w_R1.dtype == f32 else w_R1.float()
    dweights_S = torch.linalg.vecdot(g, h)
    h.mul_(w_R1)
    h_in = h if h.dtype == dtype else h.to(dtype)
    for e, a, b in groups:
        torch.mm(dout_RH[a:b].t(), h_in[a:b], out=dw_down[e])
    g.mul_(w_R1)
    d_gu = torch.empty(RL, gu.shape[1], dtype=f32, device=x_TH.device)
    d_gate, d_up = d_gu.chunk(2, -1)
    torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=d_gate)
    torch.mul(g, silu, out=d_up)
    if dtype != f32:
        d_gu = d_gu.to(dtype)
    dx_RH = _per_expert(d_gu, w_gate_up_N2IH, False, groups, offs)
    for e, a, b in groups:
        torch.mm(d_gu[a:b].t(), x_RH[a:b], out=dw_gate_up[e])
    dx_TH = torch.zeros_like(x_TH).index_add_(0, tokens, dx_RH)
    dweights_TK = dweights_S.new_zeros(S).index_copy_(0, slots, dweights_S).view(T, K)
    if dweights_TK.dtype != weights_TK.dtype:
        dweights_TK = dweights_TK.to(weights_TK.dtype)
    return dx_TH, dw_gate_up, dw_down, dweights_TK

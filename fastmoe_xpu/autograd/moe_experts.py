"""Stages 2-5 of the MoE layer on this rank's experts: the one experts op.

:func:`moe_experts_forward` is what every caller runs (``FastSparseMoeBlock``, the transformers
``"fastmoe"`` experts function, the benchmark): ``fastmoe::route`` (stages 2-3), then either
``fastmoe::mlp_combine`` (stages 4-5 fused: gather + gate/up GEMM + SiLU*up, down GEMM, weighted
combine) or, for another layout, that layout's stage 4 on ``fastmoe::grouped_linear`` followed by
``fastmoe::combine``. The same custom-op chain runs eagerly, under ``torch.compile`` and in
``torch.export`` (:mod:`.ops`).

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist

from ..kernels import grouped_mm
from ..kernels.contract import INDEX_DTYPE, TOKEN_BLOCK_SIZE
from ..kernels.implementations import module_of
from ..kernels.quantized import small as small_int8
from ..kernels.registry import (
    check_choice, check_precision, precision_engine, resolve_backend, untimed_engine, whole_layer,
)
from ..kernels.torch.counting import all_local
from .lora_ops import ExpertsLora, lora_experts, lora_mlp_combine
from .ops import INFERENCE, ExpertRows, _traced, call, combine, experts, mlp_combine, route

__all__ = ["TOKEN_BLOCK_SIZE", "kernel_backend", "moe_experts_forward"]


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` when nothing has
    yet: that import takes about a second, in every process that imports this package (each rank,
    each node launcher, every command), and the decorator only marks the function
    (``tests/test_compile_block.py`` checks that the mark is the one torch's decorator sets)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_result
def _kernel_backend(backend: str, device_type: str, device_index: int) -> str:
    """:func:`resolve_backend` run outside any traced graph: the compiler calls it once while
    tracing and keeps its answer as a constant (it reads the settings and looks for triton, which
    tracing cannot do). A compiled graph therefore keeps the backend it was traced with; a change of
    ``FASTMOE_BACKEND`` after compiling needs a fresh ``torch.compile``."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    return resolve_backend(backend, device)


def kernel_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"``: the kernels stages 2-5 run on ``device`` for a block's ``backend``."""
    return _kernel_backend(backend, device.type, -1 if device.index is None else device.index)


@constant_result
def _precision_engine(precision: str, base: str, device_type: str, device_index: int, dtype: torch.dtype) -> str:
    """:func:`precision_engine` outside any traced graph (it probes the device with a tiny GEMM once)."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    return precision_engine(precision, base, device, dtype)


def _group_name(group: dist.ProcessGroup | None) -> str:
    if group is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return ""
    return group.group_name


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record a call on ``tensors``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _small_inference(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor,
                     w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, base: str,
                     gemm_engine: str) -> torch.Tensor | None:
    """A call over all the experts (no expert parallelism, precision or adapters: the caller's part)
    that no backward follows (a decode step of several sequences, a prefill, evaluation), of more than
    one token, every id local, on a layer ``auto`` gives ``grouped_mm`` untimed (the padded op's
    layers among them): torch's grouped GEMM in one piece (:func:`.grouped_mm.small_inference`; bf16
    and fp16 rounded at transformers' steps), which reads only the chosen experts' weights where the
    padded blocks read every expert's (as fast or faster at every small layer measured,
    docs/engines.md) and skips the staged chain's ops. None for every other call."""
    T, K = topk_idx_TK.shape
    NR = w_gate_up_N2IH.shape[0]
    # Nothing traces (``_traced``): no compiler, no profiler here; no dispatch mode and no tensor
    # subclass, which ``small_inference_runs`` checks on all four tensors.
    if (T < 2 or _needs_grad(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK) or torch.compiler.is_compiling()
            or torch._C._autograd._profiler_enabled() or not grouped_mm.ONE_PIECE
            or not grouped_mm.small_inference_runs(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK)):
        return None
    shape = (T, K, x_TH.shape[1], w_down_NHI.shape[2], NR)
    if untimed_engine(base, gemm_engine, x_TH.device, x_TH.dtype, shape, inference=True) != "grouped_mm":
        return None
    # None where an id is not local: found by the call's own count of rows per expert.
    return grouped_mm.small_inference(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)


def _small_int8_inference(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor,
                          w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, expert_start: int,
                          num_local: int) -> torch.Tensor | None:
    """An int8 call of the torch base over all the experts that no backward follows, of a few routed
    rows (:data:`.quantized.small.MAX_ROWS`), eager and untraced, every id local: in one piece
    (:func:`~fastmoe_xpu.kernels.quantized.small.small_int8_forward`, the staged chain's bits without
    its route and per-expert walk; its :func:`~fastmoe_xpu.kernels.quantized.small.plan` finds an id
    outside the experts from the ids it reads anyway). None for every other call."""
    if (expert_start != 0 or num_local != w_gate_up_N2IH.shape[0]
            or _needs_grad(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK) or _traced((x_TH, w_gate_up_N2IH))
            or not small_int8.runs(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI)):
        return None
    layout = small_int8.plan(topk_idx_TK, num_local)
    if layout is None:  # an id outside the experts: the staged chain reports it
        return None
    return small_int8.small_int8_forward(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI, layout)


def moe_experts_forward(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor | None,
    w_down_NHI: torch.Tensor | None,
    *,
    backend: str = "torch",
    expert_start: int = 0,
    num_local: int | None = None,
    gemm_engine: str = "native",
    ep_group: dist.ProcessGroup | None = None,
    expert_rows: ExpertRows | None = None,
    expert_precision: str | None = None,
    lora: ExpertsLora | None = None,
    check_ids: Callable[[torch.Tensor], None] | None = None,
    routed_rows: int | None = None,
) -> torch.Tensor:
    """Stages 2-5 on this rank's experts ``[expert_start, expert_start + NR)``; returns ``[T, H]``
    (partial sums when other ranks hold other experts; choices of other experts are skipped).

    ``backend``: ``"auto"``, ``"torch"`` or ``"triton"``. ``gemm_engine``: who runs stage 4
    (:mod:`fastmoe_xpu.kernels.registry`; ``"auto"`` times the candidates on first use, agreed across
    ``ep_group``). ``expert_rows``: another layout's stage 4 (its own gate, biases, norm, on
    ``fastmoe::grouped_linear``), in which case the weights may be None and ``num_local`` is given;
    else the fused gate/up -> SiLU*up -> down path over ``w_gate_up [NR, 2I, H]`` and
    ``w_down [NR, H, I]``. ``lora``: per-expert adapters on those two weights (frozen then), run
    inside the fused path by ``fastmoe::lora_mlp_combine`` (:mod:`.lora_ops`); another layout's
    ``expert_rows`` applies its own. ``expert_precision``: ``"int8"`` or ``"fp8"`` runs every
    stage-4 GEMM quantized, on the registry's implementation of that precision (which then replaces
    ``gemm_engine``); None: full precision. A fused layer with ``gemm_engine="auto"`` small enough for
    one of the registry's ``experts`` implementations (:func:`~fastmoe_xpu.kernels.registry.whole_layer`)
    runs on it instead of the staged chain in eager mode: ``fastmoe::experts``, the same numbers; a
    larger one still small enough (:func:`~fastmoe_xpu.kernels.registry.untimed_engine`) runs the
    staged chain on ``auto``'s engine for its size without timing it, unless ``ep_group`` spans ranks;
    on ``grouped_mm``, fp32, eager, untraced, with every id local and no adapters, in one piece
    (:func:`~fastmoe_xpu.kernels.grouped_mm.small_layer`). A small fp32 ``expert_rows`` layer on the
    CPU with every id local routes and combines its rows with plain torch ops (:func:`_plain_small`).
    ``check_ids``: where every id must name a local expert (no expert parallelism), a function that
    raises on ``topk_idx`` holding another; called first, or on the small-layer path only when its
    layout found such an id (it has counted them anyway).

    On the meta device (shapes only: the trace of a training step, trainer/scale/trace.py) no id can
    be read: :func:`meta_experts` stands in, at ``routed_rows`` rows (default ``T*K``)."""
    if x_TH.is_meta and expert_rows is None and lora is None:
        rows = topk_idx_TK.numel() if routed_rows is None else routed_rows
        return meta_experts(x_TH, weights_TK, w_gate_up_N2IH, w_down_NHI, rows)
    check_choice(gemm_engine)
    check_precision(expert_precision)
    return resolved_forward(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI,
                            kernel_backend(backend, x_TH.device), expert_start, num_local, gemm_engine, ep_group,
                            expert_rows, expert_precision, lora, check_ids)


def resolved_forward(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor,
                     w_gate_up_N2IH: torch.Tensor | None, w_down_NHI: torch.Tensor | None, base: str,
                     expert_start: int = 0, num_local: int | None = None, gemm_engine: str = "native",
                     ep_group: dist.ProcessGroup | None = None, expert_rows: ExpertRows | None = None,
                     expert_precision: str | None = None, lora: ExpertsLora | None = None,
                     check_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """:func:`moe_experts_forward` past its checks, on real tensors: ``base`` is the kernel backend
    (:func:`kernel_backend`) and ``gemm_engine`` and ``expert_precision`` are valid. For a caller
    that checked and resolved them once for many calls (the experts function's per-module memo)."""
    gemm = gemm_engine
    if expert_precision is not None and lora:
        raise ValueError(f"expert_precision={expert_precision!r} with LoRA adapters is not supported: "
                         "train the adapters in the weights' precision")
    if expert_precision is not None:
        dev = x_TH.device
        gemm = _precision_engine(expert_precision, base, dev.type, -1 if dev.index is None else dev.index, x_TH.dtype)
    if num_local is None:
        num_local = w_gate_up_N2IH.shape[0]
    if expert_precision == "int8" and expert_rows is None and base == "torch":
        out_TH = _small_int8_inference(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI, expert_start,
                                       num_local)
        if out_TH is not None:
            return out_TH
    if expert_rows is None and expert_precision is None and not torch.compiler.is_compiling():
        # An eager layer small enough that launches outweigh arithmetic runs in one piece (registry:
        # ``experts``), with its LoRA adapters where it has them. A traced graph keeps the staged
        # chain: it serves any T without a guard on the size (an exported program's dynamic
        # dimensions allow none), and a compiled graph has no launch overhead to save.
        shape = (x_TH.shape[0], topk_idx_TK.shape[1], x_TH.shape[1], w_down_NHI.shape[2], num_local)
        if not lora and expert_start == 0 and num_local == w_gate_up_N2IH.shape[0]:
            out_TH = _small_inference(x_TH, weights_TK, topk_idx_TK, w_gate_up_N2IH, w_down_NHI, base, gemm_engine)
            if out_TH is not None:
                return out_TH
        layer = whole_layer(base, gemm_engine, x_TH.device, x_TH.dtype, shape, lora=bool(lora))
        if layer is not None:
            if lora:
                out_TH, plan = lora_experts(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK, lora,
                                            expert_start, num_local, layer, with_plan=True)
            elif not _needs_grad(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK) and not _traced((x_TH, w_gate_up_N2IH)):
                # No backward follows and nothing traces (generation): the op's body itself, without the
                # autograd Function around it (about a tenth of a one-token step of a tiny layer).
                out_TH, _, plan = module_of(layer).experts_forward(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
                                                                   topk_idx_TK, expert_start, num_local)
            else:
                out_TH, _, plan = call(experts, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK,
                                       expert_start, num_local, layer)
            if check_ids is not None and int(plan[-1]) & 1:  # the plan's dump bit: an id outside the local experts
                check_ids(topk_idx_TK)
            return out_TH
        # A small layer without expert parallelism takes auto's engine for its size untimed (registry:
        # ``untimed_engine``): no timing at the first call, nothing to watch. (Under expert parallelism
        # the ranks' row counts differ; they agree on one timed choice instead.)
        fixed = None if _group_name(ep_group) else untimed_engine(
            base, gemm_engine, x_TH.device, x_TH.dtype, shape,
            inference=not _needs_grad(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK))
        if fixed is not None:
            gemm_engine = gemm = fixed
            # On grouped_mm, a plain fp32 layer whose ids are all local runs in one piece (stages 2-5
            # as one autograd node, grouped_mm.small_layer): fewer ops than route + mlp_combine.
            if (fixed == "grouped_mm" and grouped_mm.ONE_PIECE and not lora and expert_start == 0
                    and num_local == w_gate_up_N2IH.shape[0]
                    and grouped_mm.small_layer_runs(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK)
                    and all_local(topk_idx_TK, 0, num_local)):
                return grouped_mm.small_layer(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
    if expert_rows is not None and PLAIN_ONE_PIECE and _plain_in_one_piece(x_TH, weights_TK, topk_idx_TK, base,
                                                                        expert_start, num_local, expert_precision,
                                                                        ep_group):
        return _plain_small(x_TH, weights_TK, topk_idx_TK, num_local, expert_rows, base)
    if check_ids is not None:
        check_ids(topk_idx_TK)
    # Eager: exact row counts (the torch backend reads them for free). Traced: worst-case rows, so that
    # no shape in the graph depends on data.
    rows = call(route, topk_idx_TK, expert_start, num_local, base, not torch.compiler.is_compiling())
    if expert_rows is None and lora:
        return lora_mlp_combine(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, lora, f"{base}+{gemm_engine}",
                                _group_name(ep_group))
    if expert_rows is None:
        request = gemm
        if expert_precision is None and not _needs_grad(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK):
            # No backward follows (generation, evaluation): a timed choice may run a faster forward.
            request = f"{gemm}:{INFERENCE}"
        out_TH, _ = call(mlp_combine, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, *rows, f"{base}+{request}",
                         _group_name(ep_group))
        return out_TH
    input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts = rows
    y_RH = expert_rows(x_TH, input_indices, cum_token_counts, base if expert_precision is None else f"{base}+{gemm}")
    return call(combine, y_RH.contiguous(), weights_TK, output_indices, selected_expert_indices, cum_expert_counts,
                base)


#: What :func:`meta_experts` is running: ``"experts"`` (its GEMMs, forward or backward), ``"replay"``
#: (its backward's re-run of the forward, which only rebuilds the graph), or None. A FLOP counter of
#: a meta trace reads it to tell the experts' batched GEMMs from attention's.
META_EXPERTS_SCOPE: list[str | None] = [None]


def _meta_chain(x_TH: torch.Tensor, weights_TK: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
                w_down_NHI: torch.Tensor, rows: int) -> torch.Tensor:
    NR, I2, H = w_gate_up_N2IH.shape
    per = max(1, round(rows / NR)) if rows else 0
    pick = torch.zeros(NR * per, dtype=torch.int64, device=x_TH.device)
    x_RH = x_TH.index_select(0, pick).view(NR, per, H)
    gate_up = torch.bmm(x_RH, w_gate_up_N2IH.transpose(1, 2))
    g, u = gate_up.split(I2 // 2, dim=-1)
    y = torch.bmm(torch.nn.functional.silu(g) * u, w_down_NHI.transpose(1, 2)).reshape(NR * per, H)
    w_R = weights_TK.reshape(-1).index_select(0, pick).to(y.dtype)
    return x_TH.new_zeros(x_TH.shape).index_add(0, pick, y * w_R[:, None])


class _MetaExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, weights_TK, w_gate_up_N2IH, w_down_NHI, rows):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x_TH, weights_TK, w_gate_up_N2IH, w_down_NHI)
        ctx.rows = rows
        META_EXPERTS_SCOPE[0] = "experts"
        try:
            return _meta_chain(x_TH, weights_TK, w_gate_up_N2IH, w_down_NHI, rows)
        finally:
            META_EXPERTS_SCOPE[0] = None

    @staticmethod
    def backward(ctx, grad_TH):  # noqa: ANN001, ANN205
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        try:
            with torch.enable_grad():
                META_EXPERTS_SCOPE[0] = "replay"
                out = _meta_chain(*inputs, ctx.rows)
                META_EXPERTS_SCOPE[0] = "experts"
                wanted = [t for t in inputs if t.requires_grad]
                grads = iter(torch.autograd.grad(out, wanted, grad_TH, allow_unused=True))
        finally:
            META_EXPERTS_SCOPE[0] = None
        return (*[next(grads) if t.requires_grad else None for t in inputs], None)


def meta_experts(x_TH: torch.Tensor, weights_TK: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
                 w_down_NHI: torch.Tensor, rows: int) -> torch.Tensor:
    """Stages 2-5 for meta tensors: ``rows`` (token, expert) pairs spread evenly over the NR local
    experts (uniform routing's average), through the same GEMMs (gather, gate/up, SiLU*up, down,
    weighted scatter-add), so that autograd reaches every input and weight with its shape and a FLOP
    counter sees the GEMMs' work (inside :data:`META_EXPERTS_SCOPE`). Returns ``[T, H]``; no value is
    computed."""
    return _MetaExperts.apply(x_TH, weights_TK, w_gate_up_N2IH, w_down_NHI, rows)


#: Whether a small plain-layout layer (another layout's ``expert_rows``) routes and combines its rows
#: with plain torch ops around its stage 4 (:func:`_plain_small`) where it can; False: ``fastmoe::route``
#: and ``fastmoe::combine``.
PLAIN_ONE_PIECE = True
#: The most routed rows (T*K) :func:`_plain_small` takes: its index_add_ sums were measured against
#: the combine op at 512 rows (docs/small_shapes.md), the size a family is first tried at.
PLAIN_SMALL_ROWS = 4096


def _plain_in_one_piece(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, base: str,
                        expert_start: int, num_local: int, expert_precision: str | None,
                        ep_group: dist.ProcessGroup | None) -> bool:
    """Whether :func:`_plain_small` takes this call: the torch base on the CPU, eager and untraced
    (plain tensors, no dispatch mode), fp32, no precision, no expert parallelism, at most
    :data:`PLAIN_SMALL_ROWS` rows, every id local."""
    return (base == "torch" and x_TH.device.type == "cpu" and x_TH.dtype == torch.float32
            and weights_TK.dtype == torch.float32 and expert_precision is None and expert_start == 0
            and 0 < topk_idx_TK.numel() <= PLAIN_SMALL_ROWS and not _group_name(ep_group)
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and type(x_TH) in (torch.Tensor, torch.nn.Parameter) and type(weights_TK) in (torch.Tensor, torch.nn.Parameter)
            and all_local(topk_idx_TK, 0, num_local))


def _plain_small(x_TH: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, num_local: int,
                 expert_rows: ExpertRows, base: str) -> torch.Tensor:
    """Stages 2, 3 and 5 of a small plain-layout layer in plain torch ops around its stage 4: the rows
    sorted by expert (a stable ``argsort``, a ``bincount`` for the group ends), the rows' outputs
    weighted and summed per token by ``index_add``; autograd differentiates the weighting and the
    sums (the router weights' gradient included). Fewer ops than ``fastmoe::route`` and
    ``fastmoe::combine`` with their backward at a small layer's rows; the same rows in the same order."""
    T, K = topk_idx_TK.shape
    flat = topk_idx_TK.reshape(-1)
    order_R = torch.argsort(flat, stable=True)
    token_R = order_R if K == 1 else order_R.div(K, rounding_mode="floor")
    cum_token_counts = torch.zeros(num_local + 1, dtype=INDEX_DTYPE, device=x_TH.device)
    torch.cumsum(torch.bincount(flat, minlength=num_local), 0, out=cum_token_counts[1:])
    y_RH = expert_rows(x_TH, token_R.to(INDEX_DTYPE), cum_token_counts, base)
    w_R1 = weights_TK.reshape(-1).index_select(0, order_R).unsqueeze(1)
    return y_RH.new_zeros(T, y_RH.shape[1]).index_add(0, token_R, y_RH * w_R1)

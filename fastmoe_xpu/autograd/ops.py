"""Stages 2-5 as ``torch.library`` custom ops in the ``fastmoe`` namespace, each differentiable op with
its backward as an Autograd kernel: one path for eager runs, ``torch.compile`` and ``torch.export``.

Every op takes the kernel set that runs it by name (``kernels``: ``"torch"``, ``"triton"``,
``"torch+grouped_mm"``, see :mod:`fastmoe_xpu.kernels.registry`; ``"<base>+auto"`` lets the registry
time the stage-4 implementations on first use, inside the op, on the real tensors). A string is fixed
when a graph is traced; the op's body resolves it and calls the launchers, host reads included (the
torch backend reads the expert bounds on the host, which costs nothing on the CPU). The compiler sees
only the fake implementations, whose shapes never depend on data: routed-row buffers are sized for
the worst case, R = T*K rows (what the Triton backend allocates anyway). Eager calls pass
``exact_rows=True`` to :func:`route`, so the torch backend keeps exactly RT rows under expert
parallelism; a traced call passes False and gets the worst-case rows (past RT: zero on the torch
backend, unspecified on Triton, never read).

=================================  ==============================================================
``fastmoe::route``                 stages 2-3 (no gradient): ``(input_indices, output_indices,
                                   selected_expert_indices, cum_token_counts, cum_expert_counts)``
``fastmoe::mlp_combine``           stages 4-5, the layer's fused path: ``(out [T, H], gate_up
                                   [R, 2I])``; ``gate_up`` is returned so that autograd saves it
                                   (the backward recomputes ``h`` from it; ``h`` and the expert
                                   outputs never leave the op)
``fastmoe::mlp_combine_backward``  ``(dx, dw_gate_up, dw_down, dweights)``
``fastmoe::grouped_linear``        stage 4 for other layouts: ``a [R, in] @ w[e]^T`` per expert group
                                   (``transposed``: ``w`` stored ``[NR, in, out]``, read in place)
``fastmoe::grouped_linear_backward``  ``(da, dw)`` (``dw`` in the stored layout)
``fastmoe::combine``               stage 5 for rows computed outside the fused path: ``out [T, H]``
``fastmoe::combine_backward``      ``(dy [R, H], dweights [T, K])``
``fastmoe::experts``               stages 2-5 in one implementation of the registry's ``experts``
                                   stage (``padded``: batched GEMMs over zero-padded expert blocks,
                                   for layers where launches outweigh arithmetic; chosen by
                                   :func:`~fastmoe_xpu.kernels.registry.whole_layer`): ``(out [T, H],
                                   gate_up [T*K, 2I], plan [T*K+1])``, the chosen pairs'
                                   pre-activation in slot order and the implementation's int64
                                   routing plan, which its backward receives back (built once)
``fastmoe::experts_backward``      ``(dx, dw_gate_up, dw_down, dweights)``
=================================  ==============================================================

The backward ops are ops themselves so that AOTAutograd traces a backward without entering the
launchers. Double backward is not supported.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, R routed-row
buffer (R >= RT, the routed rows on this rank).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..kernels.contract import INDEX_DTYPE, TOKEN_BLOCK_SIZE, KernelBackend
from ..kernels.registry import engine_choice, kernel_set_name, kernels, module_of
from ..kernels.timing import capturing
from ..kernels.torch.rounding import backward_follows, forward_only

__all__ = [
    "BODIES", "OP_NAMES", "call", "combine", "experts", "grouped_linear", "mlp_combine", "mlp_combine_backward", "mlp_combine_forward",
    "resolve_kernels", "resolve_watched", "route", "route_rows",
]

#: Every op this module registers, as ``torch.ops.fastmoe.<name>``.
OP_NAMES = (
    "route", "mlp_combine", "mlp_combine_backward", "grouped_linear", "grouped_linear_backward", "combine",
    "combine_backward", "experts", "experts_backward",
)


# ---------------------------------------------------------------- registration
# The ops are defined on a ``torch.library.Library`` with their bodies as the
# CompositeExplicitAutograd kernel, a fake implementation for tracing, and, for the differentiable
# ones, an Autograd kernel that is a plain ``torch.autograd.Function`` around the op. That is what
# ``torch.library.custom_op`` + ``register_autograd`` build as well, less the per-call layers that
# cost more than a small layer's arithmetic on the CPU (a schema walk that is quadratic in the
# argument count, dynamo-disable wrappers, output alias checks): with mlp_combine's schema the op
# path adds 29 us per forward+backward instead of 58 us (``python -m bench op_overhead``), against
# about 300 us for a whole layer's forward+backward in transformers at T=48 H=64 E=8 K=2. Eager,
# ``torch.compile`` and ``torch.export`` all go through these same kernels.
_LIB = torch.library.Library("fastmoe", "FRAGMENT")

#: The body of every op, by op: what :func:`_below_autograd` calls when nothing traces.
_BODY_OF: dict[Any, Callable[..., Any]] = {}
#: The Autograd kernel of every differentiable op, by op: what :func:`call` runs when nothing traces.
_AUTOGRAD_OF: dict[Any, Callable[..., Any]] = {}
#: Tensor types the bodies run on directly (a subclass such as a fake or functional tensor, or a
#: distributed one, goes through the dispatcher).
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: The Python body of every op by name (what the op runs below autograd; the benchmark's audit runs
#: them under its dispatch mode to see inside).
BODIES: dict[str, Callable[..., Any]] = {}


def _define(schema: str, body: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Define ``fastmoe::<schema>`` with ``body`` as its kernel on every device and ``fake`` for
    tracing; returns the op (``torch.ops.fastmoe.<name>.default``)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fastmoe::{name}", fake, lib=_LIB)
    BODIES[name] = body
    op = getattr(torch.ops.fastmoe, name).default
    _BODY_OF[op] = body
    return op


def _differentiable(op: Any, function: type[torch.autograd.Function], tensor_args: int) -> None:
    """Register ``function`` (whose forward runs ``op`` below autograd) as ``op``'s Autograd kernel.
    Calls that need no gradient (grad mode off, or none of the first ``tensor_args`` arguments
    requiring one; an optional tensor argument may be None) skip the Function and its graph node.
    The Function's forward runs inside :func:`~fastmoe_xpu.kernels.torch.rounding.backward_follows`
    (training numerics); a call without it rounds bf16/fp16 as transformers' experts do."""
    apply = _function_apply(function)

    def autograd_kernel(*args: Any) -> Any:
        if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args[:tensor_args]):
            with backward_follows():
                return apply(*args)
        return _below_autograd(op, *args)

    _LIB.impl(op._schema.name.split("::")[1], autograd_kernel, "Autograd")
    _AUTOGRAD_OF[op] = autograd_kernel


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _function_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` without its Python layer, for a Function that defines no ``setup_context``
    (so no default arguments to bind): with no functorch transform active, the C++ apply on the
    arguments with dead functorch wrappers unwrapped, which is all ``Function.apply`` does then; with
    one active, ``Function.apply`` itself. The layer costs about as much as the rest of the call."""
    if "setup_context" in vars(function):
        return function.apply
    base = super(torch.autograd.Function, function).apply  # torch._C._FunctionBase.apply

    def apply(*args: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            return function.apply(*args)
        return base(*[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])

    return apply


def call(op: Any, *args: Any) -> Any:
    """``op(*args)``. In plain eager execution, the op's Autograd kernel (or, for an op without a
    gradient, its body) called directly: what the
    dispatcher would run, less boxing the arguments into the op's schema and the results out of it,
    which costs about as much as a small layer's combine (``python -m bench op_overhead``). Anything
    traced (a compiler, a dispatch mode, a tensor subclass) calls the op itself and sees it."""
    if _traced(args):
        return op(*args)
    kernel = _AUTOGRAD_OF.get(op)
    return kernel(*args) if kernel is not None else _BODY_OF[op](*args)


def _traced(args: tuple[Any, ...]) -> bool:
    """Whether a call may be seen by something other than plain eager execution: a compiler, a
    dispatch mode (fake tensors, functionalization, proxies, checks), the profiler (which then
    records the op by name) or a tensor subclass."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or torch._C._autograd._profiler_enabled():
        return True
    # An op's leading tensors tell: the rest come from the same program as they do. (Written out: a
    # generator costs a microsecond, and this runs on every op call.)
    a, b = args[0], args[1]
    return ((type(a) not in _PLAIN and isinstance(a, torch.Tensor))
            or (type(b) not in _PLAIN and isinstance(b, torch.Tensor)))


def _below_autograd(op: Any, *args: Any) -> Any:
    """``op(*args)`` below the Autograd key. In plain eager execution that is the op's body, called
    directly: the kernel the dispatcher would choose, less boxing the arguments into the op's schema
    and out again, which costs more than a small layer's arithmetic on the CPU (a forward+backward
    of the fused op at T=48 H=64 E=8 K=2, ``python -m bench op_overhead``). Anything traced goes
    through the dispatcher and sees the op."""
    if not _traced(args):
        return _BODY_OF[op](*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


# ---------------------------------------------------------------- which kernels
def _group(group_name: str) -> Any:
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def resolve_kernels(
    name: str, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, rows: tuple[torch.Tensor, ...], group_name: str = "",
) -> KernelBackend:
    """The launchers of kernel set ``name``: ``"<base>"``, or ``"<base>+<request>"`` with a
    ``gemm_engine`` request (an engine name, ``native`` or ``auto``) that the registry checks and,
    for ``auto``, decides by timing the candidates on these tensors, agreed across the
    expert-parallel group ``group_name`` (its rank 0 decides)."""
    return resolve_watched(name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name)[0]


def resolve_watched(
    name: str, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, rows: tuple[torch.Tensor, ...], group_name: str = "", forward: bool = False,
) -> tuple[KernelBackend, Any]:
    """:func:`resolve_kernels`, and the registry's :class:`~fastmoe_xpu.kernels.registry.Watch` of an
    ``auto`` choice (None otherwise), to which the caller reports the call's time. ``forward``: a
    forward call, where a due check may re-time the candidates on these tensors. A request ending in
    :data:`INFERENCE` (``"torch+auto:inference"``) is a forward call no backward follows: ``auto``
    answers with its fastest engine by forward time, or, where the shape has no choice yet, with the
    untimed engine until the layer has made a few such calls (registry ``INFERENCE_TIME_AFTER``)."""
    base, _, request = name.partition("+")
    if not request:
        return kernels(base), None
    request, _, inference = request.partition(":")
    engine, watch = engine_choice(
        request, backend=base, device=x_TH.device, dtype=x_TH.dtype,
        shape=(w_gate_up_N2IH.shape[2], w_down_NHI.shape[2], w_gate_up_N2IH.shape[0], weights_TK.numel()),
        measure=engine_measure(base, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows),
        group=_group(group_name), check=forward, inference=inference == INFERENCE,
        layer=w_gate_up_N2IH.data_ptr(),  # the layers of a model apart: an inference call's timing may wait
    )
    return kernels(kernel_set_name(base, engine)), watch


#: The suffix of a kernel set's request for a forward call no backward will follow (see
#: :func:`resolve_watched`).
INFERENCE = "inference"
_INFERENCE_SUFFIX = ":" + INFERENCE


# ---------------------------------------------------------------- stages 2-3
def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` grown to ``rows`` entries with zeros (a valid index for every reader, never read)."""
    if t.shape[0] >= rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def route_rows(
    launchers: KernelBackend, topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, exact_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of :func:`route` on given launchers."""
    counts = launchers.count_tokens(topk_idx_TK, expert_start, num_local, TOKEN_BLOCK_SIZE)
    rows = launchers.build_indices(topk_idx_TK, counts.partial_cum_token_counts, counts.cum_expert_counts,
                                   expert_start, num_local, TOKEN_BLOCK_SIZE)
    if not exact_rows:
        rows = tuple(_pad_rows(t, topk_idx_TK.numel()) for t in rows)
    return (*rows, counts.cum_token_counts, counts.cum_expert_counts)


def _route(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, kernels_name: str, exact_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 2-3 for the local experts ``[expert_start, expert_start + num_local)``:
    ``(input_indices [R], output_indices [R], selected_expert_indices [R], cum_token_counts [NR+1],
    cum_expert_counts [T+1])`` (:class:`~fastmoe_xpu.kernels.contract.RowIndices` and the prefix sums of
    :class:`~fastmoe_xpu.kernels.contract.TokenCounts`). ``exact_rows``: R = RT where the backend
    sizes rows exactly (the torch backend), else R = T*K."""
    return route_rows(kernels(kernels_name.partition("+")[0]), topk_idx_TK, expert_start, num_local, exact_rows)


def _route_fake(topk_idx_TK, expert_start, num_local, kernels_name, exact_rows):  # noqa: ANN001, ANN202
    T, K = topk_idx_TK.shape
    new = lambda n: topk_idx_TK.new_empty((n,), dtype=INDEX_DTYPE)  # noqa: E731
    return new(T * K), new(T * K), new(T * K), new(num_local + 1), new(T + 1)


route = _define(
    "route(Tensor topk_idx_TK, int expert_start, int num_local, str kernels_name, bool exact_rows)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)", _route, _route_fake)


# ---------------------------------------------------------------- stages 4-5, fused
def mlp_combine_forward(
    launchers: KernelBackend, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, input_indices: torch.Tensor, output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor, cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [R, 2I])``: the gathered gate/up GEMM with SiLU*up, the down GEMM and the
    weighted sum of each token's rows."""
    fused = getattr(launchers, "gate_up_down_fwd", None)
    if fused is not None:  # the two GEMMs with no h between them (fp8: its codes made from gate_up)
        gate_up_R2I, y_RH = fused(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH, w_down_NHI)
    else:
        gate_up_R2I, h_RI = launchers.gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
        y_RH = launchers.down_fwd(h_RI, cum_token_counts, w_down_NHI)
        del h_RI
    out_TH = launchers.combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
    return out_TH, gate_up_R2I


def mlp_combine_backward_math(
    launchers: KernelBackend, dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor, weights_TK: torch.Tensor, gate_up_R2I: torch.Tensor, input_indices: torch.Tensor,
    output_indices: torch.Tensor, selected_expert_indices: torch.Tensor, cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I], dweights [T, K])``.

    The router-weight gradient ``dweights[t, k] = <dout_t, y_r> = <dout_t @ Wd_e, h_r>`` falls out of
    the down GEMM's backward, where ``dout_t @ Wd_e`` is formed anyway, with ``h`` recomputed from the
    saved pre-activation: neither ``h`` nor the expert outputs are kept (docs/algorithm.md, "Saved
    tensors")."""
    fused = getattr(launchers, "down_silu_bwd", None)
    if fused is not None:
        # The three steps below in one launcher: the rows' output gradients read in the GEMM loads,
        # the SiLU*up gradient formed beside the router-weight dots (no [R, H] nor [R, I] round trip).
        d_gate_up_R2I, dw_down, d_row_weights_R = fused(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                                        cum_expert_counts, input_indices, gate_up_R2I,
                                                        cum_token_counts, w_down_NHI)
    else:
        # Stage 5 backward: each row gets its token's gradient, unweighted, and its weight.
        dy_RH, row_weights_R = launchers.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                                     cum_expert_counts)
        # The down GEMM's backward applies the weights and reduces dy @ Wd against the recomputed h.
        dh_RI, dw_down, d_row_weights_R = launchers.down_weighted_bwd(dy_RH, gate_up_R2I, row_weights_R,
                                                                      cum_token_counts, w_down_NHI)
        del dy_RH
        d_gate_up_R2I = launchers.silu_mul_bwd(gate_up_R2I, dh_RI, cum_token_counts)
        del dh_RI
    dweights_TK = launchers.router_weights_bwd(d_row_weights_R, weights_TK, output_indices, selected_expert_indices,
                                               cum_expert_counts)
    dx_rows_RH, dw_gate_up = launchers.gate_up_bwd(d_gate_up_R2I, x_TH, input_indices, cum_token_counts,
                                                   w_gate_up_N2IH)
    # Each token's rows are summed back in slot order: deterministic, no atomics. Unweighted, so the
    # selected-expert indices are not read (output_indices stands in for them).
    dx_TH = launchers.combine_fwd(dx_rows_RH, None, output_indices, output_indices, cum_expert_counts)
    return dx_TH, dw_gate_up, dw_down, dweights_TK


def engine_measure(
    base: str, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    rows: tuple[torch.Tensor, ...],
) -> Callable[[str], Any]:
    """``measure(engine)``: one :class:`~fastmoe_xpu.kernels.timing.Sample` of the fused op's forward
    and backward bodies with stage 4 on ``engine`` next to ``base``, on these tensors (what ``auto``
    times; its first call per engine is the warm-up, :func:`~fastmoe_xpu.kernels.timing.sampler`);
    ``measure.forward(engine)``: the same of the forward body alone (what a call without a backward
    times, registry ``INFERENCE_TIME_AFTER``)."""
    def measuring(backward: bool) -> Callable[[str], Any]:
        samplers: dict[str, Callable[[], Any]] = {}

        def measure(engine: str) -> Any:
            take = samplers.get(engine)
            if take is None:
                take = samplers[engine] = engine_sampler(kernel_set_name(base, engine), x_TH, w_gate_up_N2IH,
                                                         w_down_NHI, weights_TK, rows, backward)
            with torch.no_grad():
                return take()

        return measure

    measure = measuring(True)
    measure.forward = measuring(False)  # type: ignore[attr-defined]
    return measure


def engine_sampler(
    name: str, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    rows: tuple[torch.Tensor, ...], with_backward: bool = True,
) -> Callable[[], Any]:
    """Samples of the fused op's forward and backward bodies (``with_backward`` False: the forward's
    alone) with kernel set ``name`` on these tensors (:func:`~fastmoe_xpu.kernels.timing.sampler`:
    the first call warms up)."""
    from ..kernels.timing import sampler

    launchers = kernels(name)
    args = (x_TH.detach(), w_gate_up_N2IH.detach(), w_down_NHI.detach(), weights_TK.detach(), *rows)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        return mlp_combine_forward(launchers, *args)

    def backward(res: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not with_backward:
            return
        out, gate_up = res
        mlp_combine_backward_math(launchers, torch.ones_like(out), args[0], args[1], args[2], args[3], gate_up, *rows)

    return sampler(forward, backward, x_TH.device)


def _mlp_combine(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    input_indices: torch.Tensor, output_indices: torch.Tensor, selected_expert_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor, kernels_name: str, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 4-5: ``(out [T, H], gate_up [R, 2I])``. ``group_name``: the expert-parallel group whose
    ranks agree on a timed choice (``""``: none)."""
    rows = (input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts)
    launchers, watch = resolve_watched(kernels_name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name,
                                       forward=True)
    inference = kernels_name.endswith(_INFERENCE_SUFFIX)
    with forward_only(inference):  # no backward follows: bf16/fp16 rounded as transformers' experts round
        if watch is None or capturing(x_TH.device):  # a captured call's host time says nothing of its replays
            return mlp_combine_forward(launchers, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, *rows)
        t0 = time.perf_counter()
        out = mlp_combine_forward(launchers, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, *rows)
    watch.saw(True, time.perf_counter() - t0, weights_TK.numel(), inference=inference)
    return out


def _mlp_combine_fake(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, input_indices, output_indices,  # noqa: ANN001, ANN202
                      selected_expert_indices, cum_token_counts, cum_expert_counts, kernels_name, group_name):
    return x_TH.new_empty((x_TH.shape[0], w_down_NHI.shape[1])), x_TH.new_empty(
        (input_indices.shape[0], w_gate_up_N2IH.shape[1]))


def _mlp_combine_backward_body(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_R2I: torch.Tensor, input_indices: torch.Tensor, output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor, cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
    kernels_name: str, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I], dweights [T, K])``."""
    rows = (input_indices, output_indices, selected_expert_indices, cum_token_counts, cum_expert_counts)
    launchers, watch = resolve_watched(kernels_name, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, rows, group_name)
    if watch is None or capturing(x_TH.device):
        return mlp_combine_backward_math(launchers, dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, gate_up_R2I,
                                         *rows)
    t0 = time.perf_counter()
    out = mlp_combine_backward_math(launchers, dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, gate_up_R2I,
                                    *rows)
    watch.saw(False, time.perf_counter() - t0, weights_TK.numel())
    return out


def _mlp_combine_backward_fake(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, gate_up_R2I,  # noqa: ANN001, ANN202
                               input_indices, output_indices, selected_expert_indices, cum_token_counts,
                               cum_expert_counts, kernels_name, group_name):
    return (torch.empty_like(x_TH), torch.empty_like(w_gate_up_N2IH), torch.empty_like(w_down_NHI),
            torch.empty_like(weights_TK))


_ROWS_SCHEMA = ("Tensor input_indices, Tensor output_indices, Tensor selected_expert_indices, "
                "Tensor cum_token_counts, Tensor cum_expert_counts")
mlp_combine = _define(
    f"mlp_combine(Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, Tensor weights_TK, {_ROWS_SCHEMA}, "
    "str kernels_name, str group_name) -> (Tensor, Tensor)", _mlp_combine, _mlp_combine_fake)
mlp_combine_backward = _define(
    f"mlp_combine_backward(Tensor dout_TH, Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, "
    f"Tensor weights_TK, Tensor gate_up_R2I, {_ROWS_SCHEMA}, str kernels_name, str group_name)"
    " -> (Tensor, Tensor, Tensor, Tensor)", _mlp_combine_backward_body, _mlp_combine_backward_fake)


class _MlpCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_gate_up, w_down, weights_TK, *rest):  # noqa: ANN001, ANN205
        out_TH, gate_up_R2I = _below_autograd(mlp_combine, x_TH, w_gate_up, w_down, weights_TK, *rest)
        # gate_up is a saved activation, not a result: nothing downstream differentiates it.
        ctx.mark_non_differentiable(gate_up_R2I)
        ctx.set_materialize_grads(False)  # no zeros for gate_up's (absent) gradient
        ctx.save_for_backward(x_TH, w_gate_up, w_down, weights_TK, gate_up_R2I, *rest[:5])
        ctx.names = rest[5:]
        return out_TH, gate_up_R2I

    @staticmethod
    def backward(ctx, dout_TH, _d_gate_up):  # noqa: ANN001, ANN205
        dx, dw_gate_up, dw_down, dweights = _below_autograd(mlp_combine_backward, dout_TH.contiguous(),
                                                             *ctx.saved_tensors, *ctx.names)
        return dx, dw_gate_up, dw_down, dweights, None, None, None, None, None, None, None


_differentiable(mlp_combine, _MlpCombine, 4)


# ---------------------------------------------------------------- stage 4 for other layouts
def _grouped_linear(
    a_RK: torch.Tensor, w_NOK: torch.Tensor, cum_token_counts: torch.Tensor, kernels_name: str, transposed: bool,
) -> torch.Tensor:
    """``y [R, O] = a @ w[e]^T`` per local expert group (``transposed``: ``w`` stored ``[NR, K, O]`` and
    ``y = a @ w[e]``, read in place); rows past RT unspecified."""
    return kernels(kernels_name).down_fwd(a_RK, cum_token_counts, w_NOK, transposed=transposed)


def _grouped_linear_fake(a_RK, w_NOK, cum_token_counts, kernels_name, transposed):  # noqa: ANN001, ANN202
    return a_RK.new_empty((a_RK.shape[0], w_NOK.shape[2] if transposed else w_NOK.shape[1]))


def _grouped_linear_backward_body(
    dy_RO: torch.Tensor, a_RK: torch.Tensor, w_NOK: torch.Tensor, cum_token_counts: torch.Tensor,
    kernels_name: str, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da [R, K], dw)``, ``dw`` in ``w``'s stored layout, so it lands on the parameter without a copy.
    ``da`` has ``a``'s rows: behind worst-case row buffers, an exact-rows backend's rows past RT are zero."""
    da, dw = kernels(kernels_name).down_bwd(dy_RO, a_RK, cum_token_counts, w_NOK, transposed=transposed)
    return _pad_rows(da, a_RK.shape[0]), dw


def _grouped_linear_backward_fake(dy_RO, a_RK, w_NOK, cum_token_counts, kernels_name, transposed):  # noqa: ANN001, ANN202
    return torch.empty_like(a_RK), torch.empty_like(w_NOK)


grouped_linear = _define(
    "grouped_linear(Tensor a_RK, Tensor w_NOK, Tensor cum_token_counts, str kernels_name, bool transposed)"
    " -> Tensor", _grouped_linear, _grouped_linear_fake)
grouped_linear_backward = _define(
    "grouped_linear_backward(Tensor dy_RO, Tensor a_RK, Tensor w_NOK, Tensor cum_token_counts, str kernels_name,"
    " bool transposed) -> (Tensor, Tensor)", _grouped_linear_backward_body, _grouped_linear_backward_fake)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_RK, w_NOK, cum_token_counts, kernels_name, transposed):  # noqa: ANN001, ANN205
        ctx.save_for_backward(a_RK, w_NOK, cum_token_counts)
        ctx.names = (kernels_name, transposed)
        return _below_autograd(grouped_linear, a_RK, w_NOK, cum_token_counts, kernels_name, transposed)

    @staticmethod
    def backward(ctx, dy_RO):  # noqa: ANN001, ANN205
        da, dw = _below_autograd(grouped_linear_backward, dy_RO.contiguous(), *ctx.saved_tensors, *ctx.names)
        return da, dw, None, None, None


_differentiable(grouped_linear, _GroupedLinear, 2)


# ---------------------------------------------------------------- stage 5 for rows computed outside
def combine_backward_math(
    launchers: KernelBackend, dout_TH: torch.Tensor, y_RH: torch.Tensor, weights_TK: torch.Tensor,
    output_indices: torch.Tensor, selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy [R, H], dweights [T, K])`` of stage 5 alone, from the output gradient and the kept rows
    ``y``: ``combine_bwd`` gives each row its token's gradient unweighted and its weight; the rows are
    weighted here and the router-weight gradient is ``<dout_t, y_r>`` row by row. ``dy`` has ``y``'s
    rows: where ``y`` is a worst-case buffer and the backend sized its rows exactly, the rest are zero."""
    g_RH, row_weights_R = launchers.combine_bwd(dout_TH, weights_TK, output_indices, selected_expert_indices,
                                                cum_expert_counts)
    # Either side may be a worst-case buffer of the other's exact rows: only the first R are read.
    R = min(g_RH.shape[0], y_RH.shape[0])
    g_RH, row_weights_R = g_RH[:R], row_weights_R[:R]
    d_row_weights_R = torch.linalg.vecdot(g_RH.float(), y_RH[:R].float())
    dy_RH = (g_RH.float() * row_weights_R[:, None]).to(y_RH.dtype)
    if R < y_RH.shape[0]:
        dy_RH = torch.cat([dy_RH, dy_RH.new_zeros(y_RH.shape[0] - R, y_RH.shape[1])])
    dweights_TK = launchers.router_weights_bwd(d_row_weights_R, weights_TK, output_indices, selected_expert_indices,
                                               cum_expert_counts)
    return dy_RH, dweights_TK


def _combine(
    y_RH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor, kernels_name: str,
) -> torch.Tensor:
    """``out [T, H]``: each token's rows weighted by its routing weights and summed."""
    return kernels(kernels_name).combine_fwd(y_RH, weights_TK, output_indices, selected_expert_indices,
                                             cum_expert_counts)


def _combine_fake(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts, kernels_name):  # noqa: ANN001, ANN202
    return y_RH.new_empty((weights_TK.shape[0], y_RH.shape[1]))


def _combine_backward_body(
    dout_TH: torch.Tensor, y_RH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor, kernels_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy [R, H], dweights [T, K])``."""
    return combine_backward_math(kernels(kernels_name), dout_TH, y_RH, weights_TK, output_indices,
                                 selected_expert_indices, cum_expert_counts)


def _combine_backward_fake(dout_TH, y_RH, weights_TK, output_indices, selected_expert_indices,  # noqa: ANN001, ANN202
                           cum_expert_counts, kernels_name):
    return torch.empty_like(y_RH), torch.empty_like(weights_TK)


combine = _define(
    "combine(Tensor y_RH, Tensor weights_TK, Tensor output_indices, Tensor selected_expert_indices,"
    " Tensor cum_expert_counts, str kernels_name) -> Tensor", _combine, _combine_fake)
combine_backward = _define(
    "combine_backward(Tensor dout_TH, Tensor y_RH, Tensor weights_TK, Tensor output_indices,"
    " Tensor selected_expert_indices, Tensor cum_expert_counts, str kernels_name) -> (Tensor, Tensor)",
    _combine_backward_body, _combine_backward_fake)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts,  # noqa: ANN001, ANN205
                kernels_name):
        ctx.save_for_backward(y_RH, weights_TK, output_indices, selected_expert_indices, cum_expert_counts)
        ctx.kernels_name = kernels_name
        return _below_autograd(combine, y_RH, weights_TK, output_indices, selected_expert_indices,
                               cum_expert_counts, kernels_name)

    @staticmethod
    def backward(ctx, dout_TH):  # noqa: ANN001, ANN205
        dy_RH, dweights_TK = _below_autograd(combine_backward, dout_TH.contiguous(), *ctx.saved_tensors,
                                             ctx.kernels_name)
        return dy_RH, dweights_TK, None, None, None, None


_differentiable(combine, _Combine, 2)


# ---------------------------------------------------------------- stages 2-5 in one implementation
def _experts(
    x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor, weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, implementation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [T*K, 2I], plan [T*K+1])``: stages 2-5 on the local experts
    ``[expert_start, expert_start + num_local)`` by an ``experts`` implementation of the registry."""
    return module_of(implementation).experts_forward(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK,
                                                     expert_start, num_local)


def _experts_fake(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK, expert_start, num_local,  # noqa: ANN001, ANN202
                  implementation):
    S = topk_idx_TK.numel()
    return (x_TH.new_empty((x_TH.shape[0], w_down_NHI.shape[1])), x_TH.new_empty((S, w_gate_up_N2IH.shape[1])),
            topk_idx_TK.new_empty((S + 1,), dtype=torch.int64))


def _experts_backward_body(
    dout_TH: torch.Tensor, x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
    weights_TK: torch.Tensor, gate_up_R2I: torch.Tensor, plan: torch.Tensor, expert_start: int,
    num_local: int, implementation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw_gate_up [NR, 2I, H], dw_down [NR, H, I], dweights [T, K])``."""
    return module_of(implementation).experts_backward(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK,
                                                      gate_up_R2I, plan, expert_start, num_local)


def _experts_backward_fake(dout_TH, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, gate_up_R2I,  # noqa: ANN001, ANN202
                           plan, expert_start, num_local, implementation):
    return (torch.empty_like(x_TH), torch.empty_like(w_gate_up_N2IH), torch.empty_like(w_down_NHI),
            torch.empty_like(weights_TK))


experts = _define(
    "experts(Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, Tensor weights_TK, Tensor topk_idx_TK, "
    "int expert_start, int num_local, str implementation) -> (Tensor, Tensor, Tensor)", _experts, _experts_fake)
experts_backward = _define(
    "experts_backward(Tensor dout_TH, Tensor x_TH, Tensor w_gate_up_N2IH, Tensor w_down_NHI, Tensor weights_TK, "
    "Tensor gate_up_R2I, Tensor plan, int expert_start, int num_local, str implementation)"
    " -> (Tensor, Tensor, Tensor, Tensor)", _experts_backward_body, _experts_backward_fake)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_gate_up, w_down, weights_TK, topk_idx_TK, *rest):  # noqa: ANN001, ANN205
        out_TH, gate_up_R2I, plan = _below_autograd(experts, x_TH, w_gate_up, w_down, weights_TK, topk_idx_TK, *rest)
        ctx.mark_non_differentiable(gate_up_R2I, plan)
        ctx.set_materialize_grads(False)  # no zeros for gate_up's and plan's (absent) gradients
        ctx.save_for_backward(x_TH, w_gate_up, w_down, weights_TK, gate_up_R2I, plan)
        ctx.rest = rest
        return out_TH, gate_up_R2I, plan

    @staticmethod
    def backward(ctx, dout_TH, _d_gate_up, _d_plan):  # noqa: ANN001, ANN205
        dx, dw_gate_up, dw_down, dweights = _below_autograd(experts_backward, dout_TH.contiguous(),
                                                             *ctx.saved_tensors, *ctx.rest)
        return dx, dw_gate_up, dw_down, dweights, None, None, None, None


_differentiable(experts, _Experts, 4)


#: ``(x [T, H], input_indices [R], cum_token_counts [NR+1], kernels name) -> y [R, H]``: a stage 4 of
#: another layout (the transformers families' own gates, biases, norms), built on :func:`grouped_linear`.
ExpertRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]

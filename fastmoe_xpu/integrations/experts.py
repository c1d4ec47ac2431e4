"""``"fastmoe"`` as a transformers experts implementation: stages 2-5 behind ``@use_experts_implementation``.

transformers v5 experts modules decorated with ``@use_experts_implementation``
(``transformers/integrations/moe.py``) look their forward up in ``ALL_EXPERTS_FUNCTIONS`` by
``config._experts_implementation``. :func:`.registration.register` adds :func:`fastmoe_experts_forward`
there under :data:`NAME`, so ``from_pretrained(..., experts_implementation="fastmoe")`` or
``model.set_experts_implementation("fastmoe")`` runs our counting (stage 2), index generation
(stage 3), grouped GEMMs (stage 4) and reduction (stage 5) while the family's own router, shared
experts and everything else stay the family's.

Two paths, chosen per call from the attributes the decorator sets:

* fused: gate/up concatenated, not transposed, no biases, no post-expert norm, the default gate
  and a SiLU ``act_fn`` -- exactly the layout our stage-4 kernels fuse (gather + GEMM + SiLU*up);
* plain: every other layout the families use. Stages 2, 3 and 5 are ours, the two GEMMs are our
  grouped-GEMM launchers (``down_fwd``/``down_bwd``, a plain grouped ``a @ w[e]^T``, or ``a @ w[e]``
  on transposed weights, read as stored), and between
  them the module's own ``_apply_gate`` (or ``act_fn`` when ``has_gate=False``), biases and
  ``post_expert_norm`` run in PyTorch, so a custom gate (GPT-OSS's clamped SwiGLU) is the family's
  own code, never a re-implementation that could drift.

An attribute this function does not know how to honour raises :class:`ExpertsLayoutError` naming
it; it never guesses.

Legend: T tokens, H hidden, I intermediate, K experts per token, E experts (this rank's), RT routed
rows on this rank.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from .. import settings
from ..autograd.moe_experts import kernel_backend, moe_experts_forward, resolved_forward
from ..autograd.lora_ops import ExpertsLora, LoraWeights, lora_grouped_linear
from ..autograd.ops import grouped_linear
from ..kernels import grouped_mm
from ..kernels.registry import check_choice, check_precision, untimed_engine
from ..kernels.torch.counting import all_local
from .peft_lora import is_peft_wrapper, parametrized_weights, stored_weight, unwrap_experts, wrapper_chain

#: The name under which the implementation is registered.
NAME = "fastmoe"
#: Attributes ``@use_experts_implementation`` sets on every experts module, all honoured here.
LAYOUT_ATTRIBUTES = ("has_gate", "has_bias", "is_concatenated", "is_transposed", "has_post_expert_norm")
#: Attributes that later transformers releases added to the decorator, with the value that means what
#: the releases before them did (5.17 has no post-expert norm: no module it decorates sets the flag).
LAYOUT_DEFAULTS = {"has_post_expert_norm": False}


class ExpertsLayoutError(ValueError):
    """An experts module whose layout the fastmoe implementation cannot honour."""


#: What the two look-ups below found, filled on first use. A plain dict rather than
#: ``functools.lru_cache``: torch.compile warns about every lru_cache-wrapped function it traces.
_FOUND: dict[str, Any] = {}


def _default_apply_gate() -> Any:
    if "apply_gate" not in _FOUND:
        try:
            from transformers.integrations.moe import _default_apply_gate as fn
        except Exception:  # transformers too old to have the decorator: nothing can carry the default gate
            fn = None
        _FOUND["apply_gate"] = fn
    return _FOUND["apply_gate"]


def _silu_classes() -> tuple[type, ...]:
    if "silu" not in _FOUND:
        try:
            from transformers.activations import SiLUActivation
        except Exception:
            _FOUND["silu"] = (nn.SiLU,)
        else:
            _FOUND["silu"] = (nn.SiLU, SiLUActivation)
    return _FOUND["silu"]


def _is_silu(act: Any) -> bool:
    return isinstance(act, _silu_classes())


def _module_attr(module: nn.Module, name: str, default: Any = None) -> Any:
    """``getattr(module, name, default)`` for a plain attribute or a submodule, without ``nn.Module``'s
    miss (an exception it raises and ``getattr`` catches, which costs more than the lookup itself):
    the experts function reads its optional settings this way on every call."""
    value = module.__dict__.get(name, _MISSING)
    if value is _MISSING:
        value = module._modules.get(name, _MISSING) if "_modules" in module.__dict__ else _MISSING
    if value is _MISSING:
        return getattr(module, name, default) if hasattr(type(module), name) else default
    return value


_MISSING = object()


#: ``id(module) -> (weak reference, key, flags)``: :func:`describe_layout`'s answers (eager calls).
_LAYOUTS: dict[int, tuple[Any, tuple, Mapping[str, Any]]] = {}


def _layout_key(module: nn.Module) -> tuple:
    """Everything :func:`_describe_layout` reads: while it is unchanged, so are the flags. Objects
    are held (compared by identity), never their ids, which a new object may reuse."""
    has_gate = getattr(module, "has_gate", _MISSING)
    has_bias = getattr(module, "has_bias", _MISSING)
    d = module.__dict__
    weights = tuple((type(w), getattr(w, "shape", None)) for w in
                    (stored_weight(module, "gate_up_proj" if has_gate is not False else "up_proj"),
                     stored_weight(module, "down_proj")))
    return (has_gate, has_bias, getattr(module, "is_concatenated", _MISSING),
            getattr(module, "is_transposed", _MISSING), getattr(module, "has_post_expert_norm", _MISSING),
            getattr(module, "num_experts", _MISSING), getattr(module, "_is_expert_parallel", _MISSING),
            getattr(type(module), "_apply_gate", None), d.get("_apply_gate"), _module_attr(module, "act_fn"),
            _module_attr(module, "post_expert_norm"), weights,
            (type(getattr(module, "gate_up_proj_bias", None)), type(getattr(module, "up_proj_bias", None)),
             type(getattr(module, "down_proj_bias", None))) if has_bias else None)


def describe_layout(module: nn.Module) -> Mapping[str, Any]:
    """The layout flags of an experts module, checked: raises :class:`ExpertsLayoutError` naming
    the first attribute that is missing or that this implementation cannot honour. Eager calls on
    a module are answered from the first one's result while what it reads is unchanged (the
    experts function asks on every call)."""
    if torch.compiler.is_compiling():
        return _describe_layout(module)
    key = _layout_key(module)
    entry = _LAYOUTS.get(id(module))
    if entry is not None and entry[0]() is module and entry[1] == key:
        return entry[2]
    flags = MappingProxyType(_describe_layout(module))
    ident = id(module)
    _LAYOUTS[ident] = (weakref.ref(module, lambda _, ident=ident: _LAYOUTS.pop(ident, None)), key, flags)
    return flags


def _describe_layout(module: nn.Module) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    name_of = type(module).__name__
    for attr in LAYOUT_ATTRIBUTES:
        value = getattr(module, attr, _MISSING)  # instance attributes, set by the decorator: no miss
        if value is _MISSING and attr in LAYOUT_DEFAULTS:
            flags[attr] = LAYOUT_DEFAULTS[attr]
            continue
        if value is _MISSING:
            raise ExpertsLayoutError(
                f"{name_of} has no attribute {attr!r}: the fastmoe experts implementation serves "
                "modules decorated with transformers' @use_experts_implementation (transformers >= 5)"
            )
        if not isinstance(value, bool):
            raise ExpertsLayoutError(f"{name_of}.{attr} must be a bool, got {value!r}")
        flags[attr] = value
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int):
        raise ExpertsLayoutError(f"{name_of}.num_experts must be an int (the experts on this rank)")
    up_name = "gate_up_proj" if flags["has_gate"] else "up_proj"
    for name in (up_name, "down_proj"):
        w = stored_weight(module, name)  # never runs a parametrization (PEFT's LoRA) just to check a shape
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ExpertsLayoutError(
                f"{name_of}.{name} must be a 3-D [experts, out, in] (or transposed) tensor with "
                f"has_gate={flags['has_gate']}, got {type(w).__name__}"
            )
        if w.shape[0] != num_experts:
            raise ExpertsLayoutError(f"{name_of}.{name} holds {w.shape[0]} experts but num_experts={num_experts}")
    if flags["has_bias"]:
        for name in (up_name + "_bias", "down_proj_bias"):
            if not isinstance(getattr(module, name, None), torch.Tensor):
                raise ExpertsLayoutError(f"{name_of} has has_bias=True but no tensor {name!r}")
    if flags["has_post_expert_norm"] and not callable(_module_attr(module, "post_expert_norm")):
        raise ExpertsLayoutError(f"{name_of} has has_post_expert_norm=True but no post_expert_norm")
    act = _module_attr(module, "act_fn")
    if flags["has_gate"]:
        if not callable(getattr(module, "_apply_gate", None)):
            raise ExpertsLayoutError(f"{name_of} has has_gate=True but no _apply_gate")
        custom = getattr(type(module), "_apply_gate", None) is not _default_apply_gate()
        flags["custom_gate"] = custom
        if not custom and not callable(act):
            raise ExpertsLayoutError(f"{name_of} uses the default gate but has no callable act_fn")
    elif not callable(act):
        raise ExpertsLayoutError(f"{name_of} has has_gate=False but no callable act_fn")
    ep = getattr(module, "_is_expert_parallel", False)
    if not isinstance(ep, bool):
        raise ExpertsLayoutError(f"{name_of}._is_expert_parallel must be a bool, got {ep!r}")
    flags["expert_parallel"] = ep
    flags["fused"] = (
        flags["has_gate"] and flags["is_concatenated"] and not flags["is_transposed"] and not flags["has_bias"]
        and not flags["has_post_expert_norm"] and not flags["custom_gate"] and _is_silu(act)
    )
    return flags


def check_ids(top_k_index: torch.Tensor, num_experts: int) -> None:
    """Without expert parallelism an id outside ``[0, num_experts)`` is a routing bug (eager would
    index out of range). On the CPU: ValueError at once (reading a host tensor costs no sync). On an
    accelerator: ``torch._assert_async``, a device-side check that never waits for the device (a
    host read here would be a sync per layer); a bad id then fails at the next synchronisation."""
    if top_k_index.device.type == "cpu":
        # One aminmax (a small layer's whole step is a few dozen ops), whose answer the torch
        # backend's counting and index stages then reuse for these ids (``counting.all_local``).
        if top_k_index.numel() and not all_local(top_k_index, 0, num_experts):
            raise ValueError(f"top_k_index holds ids outside [0, {num_experts}) and _is_expert_parallel is False")
        return
    bad = ((top_k_index < 0) | (top_k_index >= num_experts)).any()
    torch._assert_async(~bad, f"fastmoe experts: top_k_index holds ids outside [0, {num_experts}) and "
                              "_is_expert_parallel is False")


def routed_rows(cum_token_counts: torch.Tensor, tokens: int, top_k: int, expert_parallel: bool) -> int:
    """Routed rows on this rank. Without expert parallelism every slot of the ``T`` tokens is routed
    (ids were checked to be in range), so it is ``T * K`` with no device read; with EP sentinels it is
    read back (one host read: the Triton backend sizes row buffers for the worst case, rows past RT
    hold garbage indices, and the elementwise parts must see only real rows)."""
    if not expert_parallel:
        return tokens * top_k
    return int(cum_token_counts[-1])


def fastmoe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: ExpertsLora | None = None,
) -> torch.Tensor:
    """The ``"fastmoe"`` experts implementation: ``[T, H]`` from ``hidden_states [T, H]``,
    ``top_k_index [T, K]`` (ids ``>= num_experts`` are expert-parallel sentinels: rows this rank
    does not own, skipped) and ``top_k_weights [T, K]``. ``lora``: adapters on the stored (frozen)
    weights handed over directly (:func:`run_adapters_in_experts`); else PEFT's active
    parametrization, if any, is read."""
    memo = None if lora is not None else _call_memo(self)
    if memo is not None and hidden_states.dim() == 2 and top_k_index.dim() == 2:
        return _memo_call(memo, hidden_states, top_k_index, top_k_weights)
    flags = describe_layout(self)
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got {tuple(hidden_states.shape)}")
    _check_routing(hidden_states, top_k_index, top_k_weights)
    T = hidden_states.shape[0]
    up_name = "gate_up_proj" if flags["has_gate"] else "up_proj"
    # PEFT's LoRA on the 3-D weights (target_parameters): the frozen weights and the adapters, which
    # run inside the grouped GEMMs (peft_lora.py); else the weights as they read.
    if lora is None:
        (w_up, w_down), lora = parametrized_weights(self, (up_name, "down_proj"), flags["is_transposed"])
    else:
        w_up, w_down = stored_weight(self, up_name), stored_weight(self, "down_proj")
    if T == 0 or top_k_index.shape[1] == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    # Without expert parallelism an id outside the experts is a routing bug: checked (where the layer
    # runs in one piece, from the ids its layout counts anyway). Traced, the ops never read ids back.
    ids_check = (None if flags["expert_parallel"] or torch.compiler.is_compiling()
                 else functools.partial(check_ids, num_experts=self.num_experts))
    # Like transformers' grouped_mm: under autocast the input may be wider than the weights.
    x_TH = _dense(hidden_states if hidden_states.dtype == w_up.dtype else hidden_states.to(w_up.dtype))
    # A per-module override (tests, benchmarks) wins; else the package's one choice (FASTMOE_BACKEND,
    # else Triton on xpu/cuda, torch on the CPU).
    backend = _module_attr(self, "fastmoe_backend", "auto")
    precision = expert_precision(self)
    if flags["fused"]:
        # Stage 4's engine: the module's ``fastmoe_gemm_engine`` or auto. transformers' expert
        # parallelism gives no group to agree on a timed choice, so its shards keep the backend's own
        # engine: ranks must not round differently.
        engine = "native" if flags["expert_parallel"] else _module_attr(self, "fastmoe_gemm_engine", "auto")
        out_TH = moe_experts_forward(x_TH, top_k_weights, top_k_index, _dense(w_up), _dense(w_down),
                                     backend=backend, gemm_engine=engine, lora=lora, expert_precision=precision,
                                     check_ids=ids_check)
    else:
        # The plain path's two grouped GEMMs run on the base's own engine, or, for a small eager layer
        # with the module's engine left to ``auto``, on ``auto``'s engine for its size, untimed
        # (registry ``untimed_engine``: one grouped GEMM per projection instead of a loop over experts).
        engine = None
        if precision is None and not lora and not flags["expert_parallel"] and not torch.compiler.is_compiling():
            inter = w_down.shape[1] if flags["is_transposed"] else w_down.shape[2]
            engine = untimed_engine(kernel_backend(backend, x_TH.device), _module_attr(self, "fastmoe_gemm_engine", "auto"),
                                    x_TH.device, x_TH.dtype, (T, top_k_index.shape[1], x_TH.shape[1], inter,
                                                              self.num_experts))

        def expert_rows(x, input_indices, cum_token_counts, kernels_name):
            if engine is not None and "+" not in kernels_name:
                kernels_name = f"{kernels_name}+{engine}"
            return _plain_stage4(self, flags, x, input_indices, cum_token_counts, kernels_name, top_k_index.shape[1],
                                 (w_up.contiguous(), w_down.contiguous()), lora)

        out_TH = moe_experts_forward(x_TH, top_k_weights, top_k_index, None, None, backend=backend,
                                     num_local=self.num_experts, expert_rows=expert_rows, expert_precision=precision,
                                     check_ids=ids_check)
    return out_TH if out_TH.dtype == hidden_states.dtype else out_TH.to(hidden_states.dtype)


class _Memo(NamedTuple):
    """What :func:`fastmoe_experts_forward` derives from a module for a call of the fused path: kept
    per module while nothing it was derived from changes (:func:`_call_memo`)."""

    num_experts: int
    w_up: torch.Tensor
    w_down: torch.Tensor
    backend: str
    engine: str
    precision: str | None
    ids_check: Any
    #: The kernel backend for CPU inputs, with ``engine`` and ``precision`` found valid (None: a call
    #: takes :func:`moe_experts_forward`'s checks, which then raise where these would).
    cpu_base: str | None


#: ``id(module) -> (weak reference, the inputs' snapshot, memo, the plain attribute values kept)``.
_MEMOS: dict[int, tuple[Any, tuple, _Memo, tuple]] = {}


#: Attribute values a memo keeps alive (they refer to nothing), so that their ids stay theirs.
_SCALARS = frozenset((bool, int, float, str, type(None)))


def _snapshot(module: nn.Module) -> tuple | None:
    """Everything the fused path's derivation reads from ``module``: its attributes, parameters and
    submodules, its config's precision field, the package's settings and the class's gate, each as
    the id of the object (the config's precision as its value); None where a call must derive
    afresh (a PEFT parametrization). An id stands for its object while that object lives: the
    module keeps its attributes alive, the memo its two weights, and :func:`_call_memo` keeps the
    plain values (numbers, strings) the snapshot was taken with, so an id cannot be reused while the
    snapshot could match it. Ids rather than the objects: a module attribute may refer back to the
    module (a hook closing over it), which a global table must not keep alive. (Ids taken by
    ``map``, with no per-value Python: this runs on every call, right after the previous call's
    arithmetic has pushed the interpreter's data out of the caches, where each Python step costs
    several times what it costs warm.)"""
    d = module.__dict__
    modules = module._modules
    if "parametrizations" in modules:
        return None
    config = d.get("config")
    if config is None:
        precision = None
    elif isinstance(_class_field(type(config)), _PrecisionField):  # transformers' configs: kept in the instance
        precision = config.__dict__.get(PRECISION_ATTRIBUTE)
    else:
        precision = getattr(config, PRECISION_ATTRIBUTE, None)
    return (*map(id, d.values()), *map(id, module._parameters.values()), *map(id, modules.values()), precision,
            id(settings.get()), id(getattr(type(module), "_apply_gate", None)), id(type(module)))


def _call_memo(module: nn.Module) -> _Memo | None:
    """The module's :class:`_Memo` for an eager call of the fused path without expert parallelism, or
    None (traced, another layout, PEFT): a decode step of a small layer is tens of microseconds, of
    which deriving these again from the module's attributes took a third."""
    if torch.compiler.is_compiling():
        return None
    snap = _snapshot(module)
    if snap is None:
        return None
    ident = id(module)
    entry = _MEMOS.get(ident)
    if entry is not None and entry[0]() is module and entry[1] == snap:
        return entry[2]
    flags = describe_layout(module)
    if not flags["fused"] or flags["expert_parallel"]:
        return None
    w_up, w_down = stored_weight(module, "gate_up_proj"), stored_weight(module, "down_proj")
    if type(w_up) not in _PLAIN_TYPES or type(w_down) not in _PLAIN_TYPES:
        return None
    backend, engine = _module_attr(module, "fastmoe_backend", "auto"), _module_attr(module, "fastmoe_gemm_engine", "auto")
    precision = expert_precision(module)
    try:
        check_choice(engine)
        check_precision(precision)
        cpu_base = kernel_backend(backend, torch.device("cpu"))
    except (ValueError, RuntimeError):
        cpu_base = None
    memo = _Memo(module.num_experts, w_up, w_down, backend, engine, precision,
                 functools.partial(check_ids, num_experts=module.num_experts), cpu_base)
    if len(_MEMOS) >= 4096:
        _MEMOS.clear()
    kept = tuple(v for v in module.__dict__.values() if v.__class__ in _SCALARS)
    _MEMOS[ident] = (weakref.ref(module, lambda _, ident=ident: _MEMOS.pop(ident, None)), snap, memo, kept)
    return memo


def _memo_call(memo: _Memo, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`fastmoe_experts_forward`'s fused path with the module's part derived (:func:`_call_memo`)."""
    _check_routing(hidden_states, top_k_index, top_k_weights)
    w_up = memo.w_up
    if hidden_states.shape[0] == 0 or top_k_index.shape[1] == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    x_TH = _dense(hidden_states if hidden_states.dtype == w_up.dtype else hidden_states.to(w_up.dtype))
    if memo.cpu_base is not None and x_TH.is_cpu:  # checked and resolved when the memo was made
        out_TH = resolved_forward(x_TH, top_k_weights, top_k_index, _dense(w_up), _dense(memo.w_down), memo.cpu_base,
                                  gemm_engine=memo.engine, expert_precision=memo.precision, check_ids=memo.ids_check)
    else:
        out_TH = moe_experts_forward(x_TH, top_k_weights, top_k_index, _dense(w_up), _dense(memo.w_down),
                                     backend=memo.backend, gemm_engine=memo.engine, expert_precision=memo.precision,
                                     check_ids=memo.ids_check)
    return out_TH if out_TH.dtype == hidden_states.dtype else out_TH.to(hidden_states.dtype)


def _check_routing(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
    """ValueError unless ``top_k_index`` and ``top_k_weights`` are both ``[tokens, top_k]``."""
    if (top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape
            or top_k_index.shape[0] != hidden_states.shape[0]):
        raise ValueError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both be "
            f"[tokens={hidden_states.shape[0]}, top_k]"
        )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, asked first (a call that returns ``t`` still costs a dispatch, per call)."""
    return t if t.is_contiguous() else t.contiguous()


def expert_precision(module: nn.Module) -> str | None:
    """The expert-GEMM precision of an experts module: its ``fastmoe_expert_precision`` attribute,
    else its config's ``fastmoe_expert_precision`` field, else ``FASTMOE_EXPERT_PRECISION``; None:
    full precision."""
    value = _module_attr(module, PRECISION_ATTRIBUTE)
    if value is None:
        config = _module_attr(module, "config")
        # Eager, transformers' configs (the field is a _PrecisionField, kept in the instance) are read
        # there, past their per-access attribute hooks; any other config, or a traced call, as it reads.
        fast = (not torch.compiler.is_compiling()
                and isinstance(getattr(type(config), PRECISION_ATTRIBUTE, None), _PrecisionField))
        value = config.__dict__.get(PRECISION_ATTRIBUTE) if fast else getattr(config, PRECISION_ATTRIBUTE, None)
    return settings.get().expert_precision if value is None else value


def _first_rows(t: torch.Tensor, rt: int) -> torch.Tensor:
    """``t[:rt]``, or ``t`` itself when it has exactly ``rt`` rows (always, without expert
    parallelism): a slice's backward allocates a zero ``[R, width]`` gradient and copies into it,
    a full pass over the rows for nothing."""
    return t if t.shape[0] == rt else t[:rt]


def _plain_stage4(
    module: nn.Module, flags: dict[str, Any], x_TH: torch.Tensor, input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor, kernels_name: str, top_k: int, weights: tuple[torch.Tensor, torch.Tensor],
    lora: ExpertsLora,
) -> torch.Tensor:
    """Stage 4 for every layout the fused kernels do not cover: our grouped GEMMs, the family's gate.
    ``weights``: the up and down weights in their stored orientation (``[E, out, in]``, or ``[E, in,
    out]`` when ``is_transposed``: the launchers take a flag for that), contiguous: the parameters
    themselves whenever they already are, which every family's are, so nothing is copied per call."""
    rt = routed_rows(cum_token_counts, x_TH.shape[0], top_k, flags["expert_parallel"])
    idx = input_indices[:rt].long()
    x_RH = x_TH.index_select(0, idx)
    row_expert = None
    if flags["has_bias"]:
        sizes = (cum_token_counts[1:] - cum_token_counts[:-1]).long()
        row_expert = torch.repeat_interleave(torch.arange(sizes.numel(), device=x_TH.device), sizes, output_size=rt)
    up_name = "gate_up_proj" if flags["has_gate"] else "up_proj"
    transposed = flags["is_transposed"]
    h = _first_rows(_linear(x_RH, weights[0], lora.gate_up, cum_token_counts, kernels_name, transposed), rt)
    if row_expert is not None:
        h = h + getattr(module, up_name + "_bias")[row_expert]
    # The module's own gate (custom ones included) or, without a gate, its activation.
    h = module._apply_gate(h) if flags["has_gate"] else module.act_fn(h)
    y = _first_rows(_linear(h.contiguous(), weights[1], lora.down, cum_token_counts, kernels_name, transposed), rt)
    if row_expert is not None:
        y = y + module.down_proj_bias[row_expert]
    if flags["has_post_expert_norm"]:
        y = module.post_expert_norm(y)
    return y


#: Whether the plain path's grouped GEMMs on the untimed small-layer engine run as torch's own
#: differentiable ``grouped_mm`` (:func:`_linear`); False: the ``fastmoe::grouped_linear`` op. At
#: GPT-OSS's tiny model (docs/small_shapes.md) the op's layers cost about 5% of the whole step.
PLAIN_TORCH_GROUPED_MM = True
_SMALL_PLAIN_KERNELS = "torch+grouped_mm"
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def _linear(a: torch.Tensor, w: torch.Tensor, lora: LoraWeights | None, cum_token_counts: torch.Tensor,
            kernels_name: str, transposed: bool) -> torch.Tensor:
    """One grouped GEMM of the plain path, with its adapter when it has one. On the untimed small-layer
    engine (``torch+grouped_mm``), fp32, eager and untraced, with operands grouped_mm takes as they
    are and both widths a multiple of four: torch's own differentiable ``grouped_mm`` (:data:`PLAIN_TORCH_GROUPED_MM`), the same GEMMs
    as the ``fastmoe::grouped_linear`` op's without its layers around them, forward and backward."""
    if lora is None:
        if (PLAIN_TORCH_GROUPED_MM and kernels_name == _SMALL_PLAIN_KERNELS and a.dtype == torch.float32
                and w.dtype == torch.float32 and a.device.type == "cpu" and not torch.compiler.is_compiling()
                and not torch._C._len_torch_dispatch_stack()
                and type(a) in _PLAIN_TYPES and type(w) in _PLAIN_TYPES):
            b = w if transposed else w.transpose(-2, -1)
            # Both widths a multiple of 16 bytes: then the backward's operands (the output's gradient,
            # a^T) suit grouped_mm as well, as the forward's do when aligned.
            if a.shape[1] % 4 == 0 and b.shape[2] % 4 == 0 and grouped_mm.aligned(a) and grouped_mm.aligned(b):
                return grouped_mm.grouped_mm_op()(a, b, offs=cum_token_counts[1:])
        return grouped_linear(a, w, cum_token_counts, kernels_name, transposed)
    return lora_grouped_linear(a, w, lora, cum_token_counts, kernels_name, transposed)


#: The config attribute (and ``from_pretrained`` keyword) that picks the expert-GEMM precision.
PRECISION_ATTRIBUTE = "fastmoe_expert_precision"
class _PrecisionField:
    """``fastmoe_expert_precision`` on every transformers config: None (the weights' precision)
    unless set. Being an attribute of the class is what makes ``from_pretrained(...,
    fastmoe_expert_precision="int8")`` set it on the config (transformers hands a keyword to the
    config when the config has that attribute, else to the model's ``__init__``, which refuses it).
    A value is checked when set (``"none"`` clears it) and kept in the instance's ``__dict__``, so
    ``save_pretrained`` writes it into ``config.json`` and a load reads it back; it is passed on to
    the config's sub-configs (a multimodal model's text config holds the experts)."""

    def __get__(self, obj: Any, owner: Any = None) -> str | None:
        return None if obj is None else obj.__dict__.get(PRECISION_ATTRIBUTE)

    def __set__(self, obj: Any, value: Any) -> None:
        from ..kernels.registry import check_precision

        if isinstance(value, str) and value.lower() in ("none", ""):
            value = None
        try:
            check_precision(value)
        except ValueError:
            from ..kernels.registry import PRECISIONS

            raise ValueError(f"{PRECISION_ATTRIBUTE} must be one of {(None, *PRECISIONS)}, got {value!r}") from None
        if value is None:
            obj.__dict__.pop(PRECISION_ATTRIBUTE, None)
        else:
            obj.__dict__[PRECISION_ATTRIBUTE] = value
        try:
            keys = list(getattr(obj, "sub_configs", None) or ())
        except Exception:  # noqa: BLE001 - a config half-way through its __init__
            keys = []
        for key in keys:
            sub = obj.__dict__.get(key)
            if sub is not None and sub is not obj \
                    and isinstance(_class_field(type(sub)), _PrecisionField):
                setattr(sub, PRECISION_ATTRIBUTE, value)

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(PRECISION_ATTRIBUTE, None)


def _class_field(cls: type) -> Any:
    """The :data:`PRECISION_ATTRIBUTE` descriptor ``cls`` inherits, if any (without calling it)."""
    for base in cls.__mro__:
        if PRECISION_ATTRIBUTE in base.__dict__:
            return base.__dict__[PRECISION_ATTRIBUTE]
    return None


def run_adapters_in_experts(model: nn.Module) -> int:
    """Let the ``"fastmoe"`` experts of ``model`` take PEFT's expert adapters directly: each outermost
    parameter wrapper around a transformers experts module gets a forward that unwraps the active
    adapters (:func:`unwrap_experts`) and calls the experts function with them, without PEFT's
    per-call parametrization, so that ``torch.compile(model, fullgraph=True)`` traces one graph.
    Experts switched to another implementation keep PEFT's own forward (checked per call). Returns
    how many experts modules were set up; call it again after adding adapters to new modules."""
    wrappers = [m for m in model.modules() if is_peft_wrapper(m)]
    inner = {id(m.base_layer) for m in wrappers}
    count = 0
    for outer in (w for w in wrappers if id(w) not in inner):
        _, experts = wrapper_chain(outer)
        if not hasattr(getattr(experts, "config", None), "_experts_implementation"):
            continue  # not a transformers experts module (FastSparseMoeBlock unwraps its experts itself)
        precision = expert_precision(experts)
        if precision is not None and experts.config._experts_implementation == NAME:
            # refused here, where the adapters are attached, rather than at the first forward
            raise ValueError(f"LoRA adapters on experts running expert precision {precision!r} are not supported: "
                             "train the adapters in the weights' precision (load without fastmoe_expert_precision, "
                             "or pass fastmoe_expert_precision='none')")
        peft_forward = type(outer).forward.__get__(outer)

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args: Any, __outer: nn.Module = outer, __peft: Any = peft_forward, **kwargs: Any) -> torch.Tensor:
            experts, lora = unwrap_experts(__outer)
            if args or kwargs or experts.config._experts_implementation != NAME:
                return __peft(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            return fastmoe_experts_forward(experts, hidden_states, top_k_index, top_k_weights, lora=lora)

        outer.forward = forward
        count += 1
    return count

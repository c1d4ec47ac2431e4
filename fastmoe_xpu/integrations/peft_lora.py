"""PEFT's LoRA on 3-D expert parameters, read as per-expert adapters for the grouped pipeline.

PEFT's ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`` wraps
the experts module in one ``ParamWrapper`` per targeted parameter (nested). Its ``lora_A`` is an
``nn.Linear(in, r*E)`` and ``lora_B`` an ``nn.Linear(r*E, out)``; for one active adapter at training
precision, each wrapper's forward registers a parametrization on the experts module that holds the
two low-rank factors (``lhs``, ``rhs``, ``scaling``: the weight reads as ``W + scaling * lhs @ rhs``)
and calls the experts forward inside it. Two ways in, both without ever forming ``W + delta``:

* :func:`parametrized_weights`: inside that forward (the transformers experts function), the frozen
  base weight from ``parametrizations[name].original`` and the adapter from the proxy's factors;
* :func:`unwrap_experts`: a module that holds experts and reads their weights itself
  (``FastSparseMoeBlock``): walks the wrappers and takes ``get_delta_factors`` of the active
  adapters (several are stacked along the rank).

PEFT's wrapper forward registers and removes a parametrization on every call: ``torch.compile``
cannot trace that (it swaps the module's class and sets a parameter in place: a graph break, so no
``fullgraph``), and the registration's own consistency check computes ``W + delta`` once per call
anyway. :func:`.experts.run_adapters_in_experts` replaces the outermost wrapper's forward, for experts
running ``"fastmoe"``, with one that unwraps the adapters and hands them to the experts function:
the same numbers, one traceable graph, no fold.

Everything else PEFT may put there (several adapters inside one parametrization, float8 weights:
a full delta; a base weight that itself trains) is read as the parametrized weight, which is what
PEFT computes, at the cost of the materialised delta.

The factors are views of ``lora_A.weight``/``lora_B.weight``, so the adapter gradients reach PEFT's
parameters through autograd. PEFT is never imported here.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..autograd.lora_ops import ExpertsLora, LoraWeights

__all__ = ["factors_to_lora", "is_peft_wrapper", "parametrized_weights", "stored_weight", "unwrap_experts", "wrapper_chain"]


def _parametrizations(module: nn.Module) -> Any:
    """``module.parametrizations`` (a ModuleDict, registered by ``torch.nn.utils.parametrize``), or
    None. Read from the submodules directly: ``nn.Module``'s attribute lookup raises and catches an
    exception for a name it does not hold, which on every forward costs more than the rest of this."""
    modules = getattr(module, "_modules", None)
    if modules is None:
        return getattr(module, "parametrizations", None)
    return modules.get("parametrizations")


def stored_weight(module: nn.Module, name: str) -> Any:
    """``module.<name>`` as stored, without running a parametrization registered on it."""
    params = _parametrizations(module)
    if params is not None:
        plist = params._modules.get(name)
        if plist is not None:
            return plist.original
    return getattr(module, name, None)


def factors_to_lora(lhs: torch.Tensor, rhs: torch.Tensor, scaling: float, transposed: bool) -> LoraWeights:
    """PEFT's factors (``W + scaling * lhs @ rhs`` in the stored layout) as ``A [E, r, in]``,
    ``B [E, out, r]``: stored ``[E, out, in]``: ``lhs = B``, ``rhs = A``; ``transposed`` (stored
    ``[E, in, out]``): ``lhs = A^T``, ``rhs = B^T``."""
    if transposed:
        return LoraWeights(lhs.transpose(-2, -1), rhs.transpose(-2, -1), float(scaling))
    return LoraWeights(rhs, lhs, float(scaling))


def _factors_proxy(params: Any, name: str) -> Any:
    """The one factors proxy of ``name``'s parametrization in ``params`` (``module.parametrizations``
    or None) and the parametrization list: ``(None, None)``: not parametrized; ``(False, plist)``:
    something else."""
    plist = None if params is None else params._modules.get(name)
    if plist is None:
        return None, None
    entries = plist._modules  # a ParametrizationList is a ModuleList: its entries by "0", "1", ...
    if len(entries) != 1:
        return False, plist
    proxy = entries.get("0")
    if proxy is not None and all(hasattr(proxy, a) for a in ("lhs", "rhs", "scaling")):
        return proxy, plist
    return False, plist


def parametrized_weights(module: nn.Module, names: tuple[str, str], transposed: bool) -> tuple[list, ExpertsLora]:
    """``([w_up, w_down], adapters)`` of an experts module as its experts function sees it: the stored
    frozen weight and its adapter where a PEFT factors proxy is active on it, else the weight as it
    reads (parametrized or not) and no adapter."""
    params = _parametrizations(module)
    weights, adapters = [], []
    for name in names:
        proxy, plist = _factors_proxy(params, name)
        base = getattr(module, name, None) if plist is None else plist.original
        if proxy and not base.requires_grad:
            weights.append(base)
            adapters.append(factors_to_lora(proxy.lhs, proxy.rhs, proxy.scaling, transposed))
        else:
            weights.append(getattr(module, name) if proxy is not None else base)
            adapters.append(None)
    return weights, ExpertsLora(*adapters)


def wrapper_chain(module: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """PEFT's parameter wrappers around ``module``, outermost first, and the module they wrap."""
    chain = []
    while hasattr(module, "base_layer") and hasattr(module, "parameter_name") and hasattr(module, "lora_A"):
        chain.append(module)
        module = module.base_layer
    return chain, module


def _stack(parts: list[LoraWeights]) -> LoraWeights:
    """Several adapters on one weight as one of the summed rank: ``sum_i s_i B_i A_i = [s_i B_i] @ [A_i]``."""
    if len(parts) == 1:
        return parts[0]
    a = torch.cat([p.a for p in parts], dim=1)
    b = torch.cat([p.b * p.scaling for p in parts], dim=2)
    return LoraWeights(a, b, 1.0)


def unwrap_experts(module: nn.Module) -> tuple[nn.Module, ExpertsLora]:
    """``(experts, adapters)``: the experts module inside PEFT's parameter wrappers and the active,
    unmerged adapters on its ``gate_up_proj`` and ``down_proj`` (none when ``module`` is not wrapped,
    adapters are disabled or merged)."""
    chain, base = wrapper_chain(module)
    found: dict[str, LoraWeights] = {}
    transposed = bool(getattr(base, "is_transposed", False))
    for w in chain:
        if getattr(w, "disable_adapters", False) or getattr(w, "merged", False):
            continue
        active = [a for a in w.active_adapters if a in w.lora_A]
        if not active:
            continue
        if getattr(base, w.parameter_name).requires_grad:
            raise ValueError(f"error: {w.parameter_name} requires grad under a LoRA adapter: freeze the base "
                             "weights (PEFT does) to train the adapters")
        parts = [factors_to_lora(*w.get_delta_factors(a), transposed) for a in active]
        found[w.parameter_name] = _stack(parts)
    up = "gate_up_proj" if getattr(base, "has_gate", True) else "up_proj"
    return base, ExpertsLora(found.get(up), found.get("down_proj"))


def is_peft_wrapper(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "parameter_name") and hasattr(module, "lora_A")

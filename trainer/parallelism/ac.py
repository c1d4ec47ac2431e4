"""Selective activation checkpointing of the decoder layers' norms, attention and MoE/MLP blocks.

``--ac norm,attn,moe`` picks any subset. Each chosen submodule's ``forward`` is run under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: only its inputs are kept for
backward and everything it saves inside is recomputed when backward reaches it. This sits on top of
FastSparseMoeBlock's own autograd Functions (which already save only routing metadata, the gathered
expert inputs and the expert outputs), so ``moe`` drops those as well.

The module tree is not changed: the instance's ``forward`` attribute is replaced, so parameter
names, state dicts and hooks stay exactly as transformers lays them out.

Choices:
  ``norm``  each decoder layer's ``input_layernorm`` and ``post_attention_layernorm``, and the
            model's final norm
  ``attn``  each decoder layer's ``self_attn`` (projections, q/k norms, rotary, attention, o_proj)
  ``moe``   each decoder layer's ``mlp`` (FastSparseMoeBlock / OlmoeSparseMoeBlock, or the dense
            OlmoMLP; ``mlp`` is accepted as a synonym)
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from ..config.ac_spec import AC_CHOICES, parse_ac
from ..model.family import decoder_layers

__all__ = [
    "AC_CHOICES", "SavedTensorCounter", "SavedTensorStats", "ac_targets", "apply_activation_checkpointing",
    "checkpointed_modules", "parse_ac", "remove_activation_checkpointing", "saved_bytes",
]

_ORIG = "_ac_original_forward"


def _final_norms(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None)
    return [norm] if isinstance(norm, nn.Module) else []


def ac_targets(model: nn.Module, choices: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """(choice, module) pairs that :func:`apply_activation_checkpointing` wraps."""
    chosen = parse_ac(list(choices))
    out: list[tuple[str, nn.Module]] = []
    for layer in decoder_layers(model):
        if "norm" in chosen:
            out += [("norm", layer.input_layernorm), ("norm", layer.post_attention_layernorm)]
        if "attn" in chosen:
            out.append(("attn", layer.self_attn))
        if "moe" in chosen:
            out.append(("moe", layer.mlp))
    if "norm" in chosen:
        out += [("norm", m) for m in _final_norms(model)]
    return out


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = getattr(module, _ORIG)
    if not torch.is_grad_enabled():
        # Nothing is saved without autograd; skip the checkpoint machinery (evaluation, inference).
        return original(*args, **kwargs)
    # Pass every tensor (keyword arguments and nested tuples such as the rotary (cos, sin)
    # included) positionally: checkpoint keeps positional tensors through autograd's saved-tensor
    # machinery (so saved_tensors_hooks see and may offload them) but keeps keyword arguments in
    # a closure, invisible to them.
    leaves, spec = tree_flatten((args, kwargs))

    def run(*flat: Any) -> Any:
        a, kw = tree_unflatten(list(flat), spec)
        return original(*a, **kw)

    return checkpoint(run, *leaves, use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module, choices: str | Iterable[str]) -> int:
    """Checkpoint the submodules named by ``choices`` in place; returns how many were wrapped.

    Idempotent per module (a wrapped module is not wrapped twice). Works for OLMoE (with or without
    FastSparseMoeBlock patched in) and dense OLMo models, and on pipeline stages holding a slice of
    the layers."""
    chosen = parse_ac(choices)
    if chosen and not decoder_layers(model):
        raise ValueError(f"activation checkpointing {list(chosen)}: {type(model).__name__} has no decoder layers "
                         "(modules with self_attn, mlp, input_layernorm and post_attention_layernorm)")
    count = 0
    for _, module in ac_targets(model, chosen):
        if _ORIG in module.__dict__:
            continue
        setattr(module, _ORIG, module.forward)
        module.forward = functools.partial(_checkpointed_forward, module)
        count += 1
    return count


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Undo :func:`apply_activation_checkpointing`; returns how many modules were restored."""
    count = 0
    for module in model.modules():
        if _ORIG in module.__dict__:
            del module.__dict__["forward"]
            delattr(module, _ORIG)
            count += 1
    return count


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules currently checkpointed."""
    return [name for name, m in model.named_modules() if _ORIG in m.__dict__]


# ----------------------------------------------------------------------------- measuring saved bytes
@dataclass
class SavedTensorStats:
    """What autograd keeps for backward once a forward is done: distinct storages still held by the
    graph, parameters and buffers excluded."""

    bytes: int = 0
    """Bytes of the distinct storages the graph holds for backward."""
    tensors: int = 0
    """Distinct storages held."""
    saves: int = 0
    """Save calls seen, including those of graph branches already freed and repeated saves."""


class _Held:
    """What the pack hook hands autograd instead of the tensor: autograd keeps it exactly as long
    as the graph node that saved it lives, so the live holders at the end are what backward needs."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorCounter:
    """Count the bytes autograd holds for backward from the tensors saved while the context is open.

    Uses ``torch.autograd.graph.saved_tensors_hooks``. Inside a non-reentrant checkpoint region,
    the checkpoint's own hooks take over (what it drops is, correctly, not counted), while the
    region's inputs, which the checkpoint keeps with an ordinary save, are counted. Only saves whose
    graph node is still alive when the context closes count (a branch whose output was dropped,
    such as routing replaced by forced uniform routing, frees its saves at once); storages are
    deduplicated (views and repeated saves count once); parameters and buffers of ``exclude`` are
    left out since they are not activations. Read ``stats`` after the context closes."""

    def __init__(self, exclude: nn.Module | None = None) -> None:
        self.stats = SavedTensorStats()
        self._skip: set[int] = set()
        if exclude is not None:
            self._skip = {_storage_key(t) for t in list(exclude.parameters()) + list(exclude.buffers())}
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Held:
        self.stats.saves += 1
        h = _Held(t)
        self._held.add(h)
        return h

    @staticmethod
    def _unpack(h: _Held) -> torch.Tensor:
        return h.tensor

    def __enter__(self) -> SavedTensorStats:
        self._ctx.__enter__()
        return self.stats

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        seen: set[int] = set()
        for h in list(self._held):
            key = _storage_key(h.tensor)
            if key in seen or key in self._skip:
                continue
            seen.add(key)
            self.stats.tensors += 1
            self.stats.bytes += h.tensor.untyped_storage().nbytes()
        self._held = weakref.WeakSet()


def _storage_key(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        return id(t)
    return t.untyped_storage().data_ptr()


def saved_bytes(model: nn.Module, fn: Callable[[], torch.Tensor]) -> tuple[SavedTensorStats, torch.Tensor]:
    """Run ``fn()`` (a forward returning a loss) under a :class:`SavedTensorCounter`; returns the
    stats and the loss, whose graph is still alive (call ``backward`` on it)."""
    counter = SavedTensorCounter(exclude=model)
    with counter as stats:
        loss = fn()
    return stats, loss



# ----------------------------------------------------------------------------- report
def saved_bytes_table(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      ) -> list[tuple[tuple[str, ...], SavedTensorStats, torch.Tensor, list[torch.Tensor]]]:
    """For every subset of AC_CHOICES: (choices, saved-tensor stats of one forward, loss, grads).

    ``loss_fn(model, input_ids, labels)`` defaults to transformers' own loss (``labels=`` shifts)."""
    import itertools

    loss_fn = loss_fn or (lambda m, x, y: m(input_ids=x, labels=y).loss)
    rows = []
    try:
        for r in range(len(AC_CHOICES) + 1):
            for combo in itertools.combinations(AC_CHOICES, r):
                remove_activation_checkpointing(model)
                apply_activation_checkpointing(model, combo)
                model.zero_grad(set_to_none=True)
                stats, loss = saved_bytes(model, lambda: loss_fn(model, input_ids, labels))
                loss.backward()
                grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                         for p in model.parameters()]
                rows.append((combo, stats, loss.detach(), grads))
    finally:
        remove_activation_checkpointing(model)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.parallelism.ac``: bytes saved for backward per --ac choice, measured on a
    small model next to the planner's formula."""
    import argparse

    from .plan import ModelShape, stage_activation_bytes

    ap = argparse.ArgumentParser(prog="python -m trainer.parallelism.ac", description=main.__doc__)
    ap.add_argument("--arch", default="olmoe", choices=["olmoe", "olmo"])
    for flag, default in (("--layers", 2), ("--hidden", 64), ("--heads", 4), ("--intermediate", 128), ("--experts", 8),
                          ("--top-k", 2), ("--vocab", 258), ("--micro-batch", 8), ("--context", 64)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.heads, intermediate_size=a.intermediate, max_position_embeddings=a.context,
                  tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    if a.arch == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        from fastmoe_xpu import patch_olmoe

        model = OlmoeForCausalLM(OlmoeConfig(num_experts=a.experts, num_experts_per_tok=a.top_k, **common))
        patch_olmoe(model, backend="torch")
    else:
        from transformers import OlmoConfig, OlmoForCausalLM

        model = OlmoForCausalLM(OlmoConfig(**common))
    model = model.to(dtype)
    shape = ModelShape(a.arch, a.layers, a.hidden, a.heads, a.hidden // a.heads, a.intermediate,
                       a.experts if a.arch == "olmoe" else 0, a.top_k if a.arch == "olmoe" else 0, a.vocab)
    x = torch.randint(0, a.vocab, (a.micro_batch, a.context))
    rows = saved_bytes_table(model, x, x)
    base = rows[0][1].bytes
    print(f"{a.arch} L={a.layers} H={a.hidden} I={a.intermediate}"
          + (f" E={a.experts} K={a.top_k}" if a.arch == "olmoe" else "")
          + f" V={a.vocab}, micro-batch {a.micro_batch} x {a.context} tokens, {a.dtype}")
    print(f"{'--ac':<16} {'saved bytes':>12} {'formula':>12} {'vs none':>8} {'tensors':>8} {'max |dgrad|':>12}")
    for combo, stats, loss, grads in rows:
        f = stage_activation_bytes(shape, a.micro_batch, a.context, a.layers, combo, act_bytes=dtype.itemsize)
        dg = max(float((g - g0).abs().max()) for g, g0 in zip(grads, rows[0][3]))
        print(f"{'+'.join(combo) or 'none':<16} {stats.bytes:>12,} {f:>12,} {stats.bytes / base:>8.2f} "
              f"{stats.tensors:>8} {dg:>12.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

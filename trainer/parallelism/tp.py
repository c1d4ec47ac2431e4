"""Tensor parallelism (Megatron style) for the dense OLMo preset's attention and MLP.

Attention is split by heads: q/k/v projections keep their rank's rows (column parallel), o_proj its
columns (row parallel). The MLP is split along the intermediate size: gate/up keep rows, down_proj
columns. Each block's input passes through ``f`` (identity forward, all-reduce of the gradient
backward) and its output through ``g`` (all-reduce forward, identity backward), so one
all-reduce per block and direction, and every TP rank sees the full residual stream. Embedding,
norms and LM head stay replicated; their gradients come out equal on every TP rank without
further communication, because ``f`` gives every rank the full gradient of each block's input.

OLMoE's attention normalises q and k over all heads together (q_norm/k_norm over H), which a head
split cannot do locally; TP is offered for the dense model, as in the paper's Optimus.

Legend: H hidden, NH heads, D head size, I intermediate, TP ranks; rank r keeps heads
[r*NH/TP, (r+1)*NH/TP) and intermediate rows [r*I/TP, (r+1)*I/TP).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

_ORIG = "_tp_original_forward"


class CopyToTensorParallel(torch.autograd.Function):
    """``f``: identity forward; backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return (
            grad,  # x
            None,  # group
        )


class ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: forward sums the partial outputs over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (
            grad,  # x
            None,  # group
        )


def _rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[1] // tp
    return w[:, rank * n:(rank + 1) * n]


#: name suffix -> how the full weight is cut (rows: column-parallel output; cols: row-parallel input)
_SPLITS = {
    "self_attn.q_proj.weight": _rows, "self_attn.k_proj.weight": _rows, "self_attn.v_proj.weight": _rows,
    "self_attn.o_proj.weight": _cols,
    "mlp.gate_proj.weight": _rows, "mlp.up_proj.weight": _rows, "mlp.down_proj.weight": _cols,
}


def tp_part(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s part of the full tensor ``name`` (the tensor itself when replicated)."""
    for suffix, cut in _SPLITS.items():
        if name.endswith(suffix):
            return cut(full, rank, tp)
    return full


def tp_localize(rank: int, tp: int):
    """A ``localize`` for :func:`trainer.parallelism.broadcast.load_and_broadcast` that cuts each
    full tensor the source sends to this TP rank's part."""

    def localize(name: str, full: torch.Tensor, model: nn.Module) -> torch.Tensor | None:
        if name not in model.state_dict():
            return None
        return tp_part(name, full, rank, tp)

    return localize


def _wrap(module: nn.Module, group: Any, returns_tuple: bool) -> None:
    original = module.forward
    setattr(module, _ORIG, original)

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(CopyToTensorParallel.apply(hidden_states, group), *args, **kwargs)
        if returns_tuple:
            return (ReduceFromTensorParallel.apply(out[0], group), *out[1:])
        return ReduceFromTensorParallel.apply(out, group)

    module.forward = functools.partial(forward, module)


def _check_splittable(model: nn.Module, tp: int) -> None:
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", heads)
    inter = getattr(cfg, "intermediate_size", None)
    if heads is None or inter is None:
        raise TypeError(f"tensor parallelism needs a transformers OLMo model with a config, got {type(model).__name__}")
    if heads % tp or kv % tp:
        raise ValueError(f"TP={tp} must divide the attention heads ({heads}) and key/value heads ({kv})")
    if inter % tp:
        raise ValueError(f"TP={tp} must divide the intermediate size {inter}")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("tensor parallelism here covers bias-free projections (as OLMo's)")


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, group: Any, *, rank: int | None = None, tp: int | None = None) -> int:
    """Split every decoder layer's attention (by heads) and MLP (by intermediate size) of a dense
    OLMo ``model`` over ``group`` in place; returns the number of blocks split.

    The model must hold the full (identical on every TP rank) weights; each rank keeps its slices.
    Apply before activation checkpointing so that checkpoints recompute the split blocks."""
    tp = tp or (dist.get_world_size(group) if group is not None else dist.get_world_size())
    rank = dist.get_rank(group) if rank is None else rank
    if tp == 1:
        return 0
    _check_splittable(model, tp)
    count = 0
    for name, module in model.named_modules():
        if not (hasattr(module, "self_attn") and hasattr(module, "mlp")):
            continue
        attn, mlp = module.self_attn, module.mlp
        if hasattr(attn, "q_norm") or not hasattr(mlp, "gate_proj"):
            raise ValueError(f"{name}: tensor parallelism covers dense OLMo layers (no q/k norm over all heads, "
                             f"a gate/up/down MLP); got {type(attn).__name__} / {type(mlp).__name__}")
        if _ORIG in attn.__dict__:
            raise ValueError(f"{name}: already tensor parallel")
        for sub, suffix in ((attn.q_proj, "self_attn.q_proj.weight"), (attn.k_proj, "self_attn.k_proj.weight"),
                            (attn.v_proj, "self_attn.v_proj.weight"), (attn.o_proj, "self_attn.o_proj.weight"),
                            (mlp.gate_proj, "mlp.gate_proj.weight"), (mlp.up_proj, "mlp.up_proj.weight"),
                            (mlp.down_proj, "mlp.down_proj.weight")):
            part = tp_part(suffix, sub.weight.data, rank, tp).clone()
            sub.weight = nn.Parameter(part, requires_grad=sub.weight.requires_grad)
            sub.weight.tp_split = True  # optimizers: distinct on every TP rank (the rest is replicated)
            sub.out_features, sub.in_features = part.shape
        _wrap(attn, group, returns_tuple=True)
        _wrap(mlp, group, returns_tuple=False)
        count += 2
    return count


def gather_tensor_parallel(model: nn.Module, group: Any, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict (or, with ``grads``, the full gradients by parameter name) of a
    tensor-parallel model; a collective over ``group``, every rank gets the result."""
    tp = dist.get_world_size(group) if group is not None else dist.get_world_size()
    out = {}
    items = ([(n, p.grad) for n, p in model.named_parameters() if p.grad is not None] if grads
             else list(model.state_dict().items()))
    for name, t in items:
        t = t.detach().contiguous()
        cut = next((c for s, c in _SPLITS.items() if name.endswith(s)), None)
        if cut is None or tp == 1:
            out[name] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t, group=group)
        out[name] = torch.cat(parts, dim=0 if cut is _rows else 1)
    return out

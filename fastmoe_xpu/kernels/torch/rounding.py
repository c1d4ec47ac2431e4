"""Where a forward that no backward follows rounds bf16/fp16 values: at the steps transformers' own
experts (``grouped_mm``, ``batched_mm``) round, so that greedy generation picks the same tokens.

transformers computes, in the weights' dtype: ``silu(gate)`` (rounded), its product with ``up``
(rounded), the down GEMM, the product with the routing weight in the promoted dtype of the two (bf16
for Qwen3-MoE and OLMoE, whose routers hand bf16 weights; fp32 for Mixtral, whose router hands fp32
weights), then the sum of each token's K rows (``.view(T, K, H).sum(1)``), rounded once to the
input's dtype. The training paths keep SiLU*up in fp32 with one rounding (their backward recomputes
it in fp32 from the saved pre-activation). The tensors cannot tell the two apart (under ``no_grad`` the
weights still require gradients, and a Function's forward runs with grad mode off), so:

- the whole-layer bodies (decode, padded), which run only in eager mode, round per step unless
  inside :func:`backward_follows` (every differentiable op's Function forward,
  fastmoe_xpu/autograd/ops.py): :func:`per_step`;
- the staged chain's combine, which also runs inside compiled graphs (whose forward, training or
  not, calls it with grad mode off and no Function of ours around it), rounds per step only inside
  :func:`forward_only`, entered by ``fastmoe::mlp_combine`` for a request its caller marked as one no
  backward follows (the ``:inference`` suffix): :func:`per_step_told`.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["backward_follows", "forward_only", "per_step", "per_step_told", "silu_mul", "weighted_sum"]

_HALF = (torch.bfloat16, torch.float16)
_STATE = threading.local()


@contextlib.contextmanager
def backward_follows() -> Iterator[None]:
    """Inside: a forward whose backward will follow (training numerics, no per-step rounding)."""
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def per_step(x: torch.Tensor) -> bool:
    """Whether a forward over ``x`` rounds per step: ``x`` is bf16/fp16 and no backward follows
    (generation, evaluation; not inside :func:`backward_follows`)."""
    return x.dtype in _HALF and not getattr(_STATE, "depth", 0)


@contextlib.contextmanager
def forward_only(on: bool) -> Iterator[None]:
    """Inside (where ``on``): a forward its caller knows no backward follows."""
    was = getattr(_STATE, "forward_only", False)
    _STATE.forward_only = on
    try:
        yield
    finally:
        _STATE.forward_only = was


def per_step_told(x: torch.Tensor) -> bool:
    """Whether ``x`` (bf16/fp16) is inside :func:`forward_only` (and not a :func:`backward_follows`
    inside it)."""
    return x.dtype in _HALF and getattr(_STATE, "forward_only", False) and not getattr(_STATE, "depth", 0)


def silu_mul(gate_up: torch.Tensor, per_step_rounding: bool) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2I]``: in its own dtype, each step rounded, where
    ``per_step_rounding``; else in fp32 (one rounding, by the caller)."""
    g = gate_up if per_step_rounding or gate_up.dtype == torch.float32 else gate_up.float()
    gate, up = g.chunk(2, -1)
    return torch._C._nn.silu(gate).mul_(up)


def weighted_sum(y_TKH: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[t, k] * y[t, k]`` as transformers forms it: the product in the promoted dtype
    of ``y`` and the weights, the sum over K, one rounding to ``y``'s dtype."""
    out = (y_TKH * weights_TK.unsqueeze(-1)).sum(1)
    return out if out.dtype == y_TKH.dtype else out.to(y_TKH.dtype)

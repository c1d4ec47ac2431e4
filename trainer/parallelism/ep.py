"""Expert parallelism for any transformers MoE family (``--model.arch hf --ep N``).

Every family's MoE block calls its experts module as ``experts(hidden [T, H], top_k_index [T, K],
top_k_weights [T, K])`` after its own router. :func:`apply_expert_parallel` turns each such module
into this rank's shard of it, with the package's token dispatcher in front:

* its per-expert tensors (``gate_up_proj``/``up_proj``, ``down_proj`` and, where the family has
  them, their biases; transposed layouts too, the expert axis is always the first) keep rows
  ``[r*NR, (r+1)*NR)`` on EP rank r; ``num_experts`` becomes NR, the global ids are recorded in the
  buffer ``expert_ids`` (checkpoints key expert weights by global id, so any EP size resumes them);
* its forward becomes: dispatch (allgather or all-to-all, :mod:`fastmoe_xpu.dist.dispatch`) ->
  global ids renumbered to this rank's ``[0, NR)``, any other id set to the sentinel NR ->
  the family's own experts forward with ``_is_expert_parallel = True`` (the ``"fastmoe"`` experts
  function skips sentinel rows; the one experts op of the package) -> combine.

The router, shared experts, dense layers (DeepSeek-V3's first-k-dense) and everything else stay
replicated; the optimizers see the expert tensors by name and treat them
as EP-sharded (:func:`fastmoe_xpu.dist.sharding.is_expert_weight`), exactly as for the OLMoE block.
Nothing here depends on the family.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from fastmoe_xpu.dist.dispatch import make_dispatcher
from fastmoe_xpu.dist.groups import member_position
from fastmoe_xpu.dist.sharding import EXPERT_IDS_NAME, expert_range

__all__ = ["apply_expert_parallel", "expert_parallel_modules"]


def _check_input(hidden_size: int):
    def check(hidden_states: torch.Tensor) -> int:
        if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
            raise ValueError(f"expert-parallel experts take [tokens, {hidden_size}], got {tuple(hidden_states.shape)}")
        return hidden_states.shape[0]
    return check


def _ep_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    disp = self.fastmoe_dispatcher
    disp.prepare(hidden_states, self._ep_check, device=hidden_states.device, need_offset=False)
    x_NH, w_NK, idx_NK, state = disp.dispatch(hidden_states, top_k_weights, top_k_index)
    local = idx_NK.long() - self.expert_start
    local = torch.where((local >= 0) & (local < self.num_experts), local, torch.full_like(local, self.num_experts))
    partial_NH = type(self).forward(self, x_NH, local, w_NK.to(top_k_weights.dtype))
    return disp.combine(partial_NH, state)


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules :func:`apply_expert_parallel` sharded."""
    return [m for m in model.modules() if getattr(m, "fastmoe_dispatcher", None) is not None]


def apply_expert_parallel(model: nn.Module, ep_group: Any, *, dispatch: str = "allgather",
                          check_inputs: bool = False) -> int:
    """Shard every decorated experts module of ``model`` over ``ep_group`` (see the module doc);
    returns how many. A no-op (0) without a group of more than one rank."""
    from ..model.family import experts_modules

    rank, size = member_position(ep_group)
    if size == 1:
        return 0
    mods = experts_modules(model)
    for mod in mods.values():
        E = mod.num_experts
        ids = expert_range(E, size, rank)
        impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
        if impl != "fastmoe":
            raise ValueError(f"expert parallelism over a family needs experts_implementation='fastmoe', got {impl!r}")
        with torch.no_grad():
            for name, p in list(mod.named_parameters(recurse=False)):
                if p.dim() >= 1 and p.shape[0] == E:
                    local = nn.Parameter(p.detach()[ids.start:ids.stop].clone(), requires_grad=p.requires_grad)
                    setattr(mod, name, local)
        mod.num_experts = len(ids)
        mod.global_num_experts = E
        mod.expert_start = ids.start
        mod.register_buffer(EXPERT_IDS_NAME, torch.arange(ids.start, ids.stop, dtype=torch.int64,
                                                          device=next(mod.parameters()).device))
        mod._is_expert_parallel = True
        mod.fastmoe_dispatcher = make_dispatcher(ep_group, dispatch, E, check_inputs=check_inputs)
        mod._ep_check = _check_input(int(mod.down_proj.shape[1] if not mod.is_transposed else mod.down_proj.shape[2]))
        mod.forward = types.MethodType(_ep_forward, mod)
    return len(mods)

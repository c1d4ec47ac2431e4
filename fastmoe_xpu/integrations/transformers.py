"""transformers integration: put FastSparseMoeBlock into a loaded OLMoE model in place."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ..block import FastSparseMoeBlock


def _is_hf_olmoe_block(module: nn.Module) -> bool:
    return type(module).__name__ == "OlmoeSparseMoeBlock" and hasattr(module, "gate") and hasattr(module, "experts")


def patch_olmoe(
    model: nn.Module,
    *,
    backend: str = "auto",
    forced_uniform_routing: bool = False,
    ep_group: dist.ProcessGroup | None = None,
    dispatch: str = "allgather",
    check_inputs: bool = True,
) -> int:
    """Replace every ``OlmoeSparseMoeBlock`` in ``model`` in place by a FastSparseMoeBlock with the
    same weights; returns how many were replaced. With ``ep_group`` each block keeps only this
    rank's experts."""
    targets = [(name, m) for name, m in model.named_modules() if _is_hf_olmoe_block(m)]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = FastSparseMoeBlock.from_hf(
            block, backend=backend, forced_uniform_routing=forced_uniform_routing, ep_group=ep_group,
            dispatch=dispatch, check_inputs=check_inputs,
        )
        new.train(block.training)
        setattr(parent, child, new)
    return len(targets)

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
    gemm_engine: str = "auto",
    expert_precision: str | None = None,
) -> int:
    """Replace every ``OlmoeSparseMoeBlock`` in ``model`` in place by a FastSparseMoeBlock with the
    same weights; returns how many were replaced. With ``ep_group`` each block keeps only this
    rank's experts. ``gemm_engine``: stage 4's grouped-GEMM engine, ``expert_precision``: quantized
    expert GEMMs (both as in FastSparseMoeBlock)."""
    targets = [(name, m) for name, m in model.named_modules() if _is_hf_olmoe_block(m)]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = FastSparseMoeBlock.from_hf(
            block, backend=backend, forced_uniform_routing=forced_uniform_routing, ep_group=ep_group,
            dispatch=dispatch, check_inputs=check_inputs, gemm_engine=gemm_engine,
            expert_precision=expert_precision,
        )
        new.train(block.training)
        _follow_experts_implementation(new, block)
        setattr(parent, child, new)
    return len(targets)


def _follow_experts_implementation(new: FastSparseMoeBlock, block: nn.Module) -> None:
    """Make the swapped block answer ``model.set_experts_implementation``: its experts read the
    model config's ``_experts_implementation`` (set to ``"fastmoe"`` now, the swap's choice) and
    dispatch any other registered name through transformers' ExpertsInterface."""
    config = getattr(block.experts, "config", None)
    if config is None or not hasattr(config, "_experts_implementation_internal"):
        return  # transformers v4: no interface to follow
    new.experts.config = config
    new.experts._is_expert_parallel = new.ep_group is not None and new.ep_size > 1
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return
    if "fastmoe" in ALL_EXPERTS_FUNCTIONS:
        config._experts_implementation_internal = "fastmoe"

"""transformers integration: put FastSparseMoeBlock into a loaded OLMoE model in place."""
from __future__ import annotations

import inspect
from typing import Any

import torch.nn as nn

from ..block import FastSparseMoeBlock


def _is_hf_olmoe_block(module: nn.Module) -> bool:
    return type(module).__name__ == "OlmoeSparseMoeBlock" and hasattr(module, "gate") and hasattr(module, "experts")


def patch_olmoe(model: nn.Module, **options: Any) -> int:
    """Replace every ``OlmoeSparseMoeBlock`` in ``model`` in place by a FastSparseMoeBlock with the
    same weights; returns how many were replaced. ``options`` are FastSparseMoeBlock's keyword
    arguments (``backend``, ``gemm_engine``, ``expert_precision``, ...); with ``ep_group`` each
    block keeps only this rank's experts."""
    inspect.signature(FastSparseMoeBlock).bind(None, **options)  # TypeError for an unknown option
    targets = [(name, m) for name, m in model.named_modules() if _is_hf_olmoe_block(m)]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = FastSparseMoeBlock.from_hf(block, **options)
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

"""Sharded AdamW optimizers: ReplicatedAdamW (baseline), ShardedAdamW (ZeRO-1) and EPSO."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .zero import (
    EPSO,
    OPTIMIZERS,
    STATE_BYTES_PER_PARAM,
    BucketSpec,
    ReplicatedAdamW,
    ShardedAdamW,
    ZeroAdamW,
    split_params,
    state_bytes_formula,
    state_bytes_per_param,
    stochastic_round,
)

__all__ = [
    "EPSO", "OPTIMIZERS", "STATE_BYTES_PER_PARAM", "BucketSpec", "ReplicatedAdamW", "ShardedAdamW",
    "ZeroAdamW", "build_optimizer", "split_params", "state_bytes_formula", "state_bytes_per_param",
    "stochastic_round",
]


def build_optimizer(name: str, model: nn.Module, layout: Any, *, is_expert: Any, betas: tuple[float, float],
                    eps: float, weight_decay: float, grad_reduce_dtype: torch.dtype, **options: Any) -> ZeroAdamW:
    """The optimizer ``name`` ("adamw", "sharded" or "epso") over ``model`` with the groups of ``layout``
    (anything with ``dp_group``, ``ep_group``, ``dpep_group`` and ``world_group`` attributes)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name](
        model.named_parameters(), is_expert=is_expert, dp_group=layout.dp_group, ep_group=layout.ep_group,
        dpep_group=layout.dpep_group, norm_group=layout.world_group, betas=betas, eps=eps,
        weight_decay=weight_decay, grad_reduce_dtype=grad_reduce_dtype, **options,
    )

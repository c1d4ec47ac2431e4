"""Rank 0 decides, every rank adopts: small host values agreed on across a process group.

Used where ranks must take one decision that each could take differently (the timed choice of a
grouped-GEMM engine: timings differ per rank, and ranks running different engines round
differently). Without a group, or with one rank, nothing is communicated.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .groups import group_size

__all__ = ["broadcast_from_rank0"]


def broadcast_from_rank0(value: Any, group: Any) -> Any:
    """``value`` of group rank 0 on every rank of ``group`` (a picklable object; other ranks' values
    are ignored). Every rank of the group must call this at the same point."""
    if group_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]

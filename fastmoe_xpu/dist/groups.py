"""A process's place in a process group: size, rank and global rank, with one meaning of ``None``.

``None`` is *no group*: this process alone (size 1, rank 0), and nothing is communicated. A caller
that means torch.distributed's default (world) group passes ``dist.group.WORLD``, or converts a
``None`` it received by :func:`world_if_none` where its own API follows torch.distributed's
convention (None: the default group). Without an initialised torch.distributed every group is this
process alone.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def dist_on() -> bool:
    """True when torch.distributed is available and its default group is initialised."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: Any) -> int:
    """Ranks in ``group``: 1 for None (no group) or when torch.distributed is not initialised."""
    if group is None or not dist_on():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in ``group``: 0 for None (no group) or when torch.distributed is not
    initialised; -1 when this process is not a member (torch.distributed's answer)."""
    if group is None or not dist_on():
        return 0
    return dist.get_rank(group)


def global_rank(group: Any, rank_in_group: int) -> int:
    """The global rank of ``group``'s rank ``rank_in_group``; for None (no group, whose only rank
    is this process) this process's global rank (0 when torch.distributed is not initialised)."""
    if group is None:
        return dist.get_rank() if dist_on() else 0
    return dist.get_global_rank(group, rank_in_group)


def world_if_none(group: Any) -> Any:
    """``group``, or torch.distributed's default (world) group for None: for APIs that follow
    torch.distributed's convention, where a None group means the default one."""
    return dist.group.WORLD if group is None else group


def member_position(group: Any, what: str = "ep_group") -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ``(0, 1)`` for None. RuntimeError when a group
    is given but torch.distributed is not initialised, ValueError when this process is not a member."""
    if group is None:
        return 0, 1
    if not dist_on():
        raise RuntimeError(
            f"{what} given but torch.distributed is not initialised (see fastmoe_xpu.dist.init_distributed)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {what} "
            f"{dist.get_process_group_ranks(group)}"
        )
    return rank, dist.get_world_size(group)

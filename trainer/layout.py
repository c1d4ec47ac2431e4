"""Process layout: world = PP x DP x EP with EP innermost (or PP x DP x TP for a tensor-parallel
dense model, TP innermost), and the process groups the trainer uses.

Global rank ``r = (pp_rank * DP + dp_rank) * EP + ep_rank``. Ranks that differ only in ``ep_rank``
share a node in the paper's layout (EP within a node), exchange tokens every MoE layer and hold
different experts; every one of the DP x EP ranks of a pipeline stage reads its own data.

Groups (None when their size is 1, so that single-process runs make no collective calls):
``ep_group`` (same pp, dp), ``dp_group`` (same pp, ep: replicas of the same experts),
``dpep_group`` (same pp: replicas of the non-expert weights, and the data-parallel world),
``world_group`` (everything; global norms).
"""
from __future__ import annotations

import copy
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import ConfigError, ParallelConfig, TrainConfig


class MeshPosition:
    """The indices of ``self.rank`` in a PP x DP x inner mesh, the inner axis fastest (reads ``rank``,
    ``dp``, ``ep``). The inner axis is EP; a layout whose inner axis is another (TP, with ``ep`` 1)
    overrides :attr:`inner_size`."""

    @property
    def inner_size(self) -> int:
        return self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.inner_size)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.inner_size) % self.dp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep


@dataclass
class Layout(MeshPosition):
    """Where this process sits in the PP x DP x EP mesh, and its process groups."""

    world: int = 1
    rank: int = 0
    pp: int = 1
    dp: int = 1
    ep: int = 1
    device: torch.device = torch.device("cpu")
    mesh: Any = None
    ep_group: Any = None
    dp_group: Any = None
    dpep_group: Any = None
    world_group: Any = None

    @property
    def data_rank(self) -> int:
        """Index of this rank among the DP x EP ranks that read distinct data."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def data_world(self) -> int:
        return self.dp * self.ep

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        return (f"world={self.world} = PP {self.pp} x DP {self.dp} x EP {self.ep}; rank {self.rank} -> "
                f"(pp {self.pp_rank}, dp {self.dp_rank}, ep {self.ep_rank}) on {self.device}")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` -> this process's xpu/cuda device, else the CPU."""
    if name == "auto":
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            name = "xpu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    if name in ("cuda", "xpu"):
        getattr(torch, name).set_device(local_rank)
        return torch.device(name, local_rank)
    return torch.device(name)


def env_world_size() -> int:
    """The world size of the initialised process group, else torchrun's ``WORLD_SIZE`` (1 without)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_layout(p: ParallelConfig, *, timeout_s: float = 600.0) -> Layout:
    """Join (or start) the process group from the launcher's environment and build the mesh groups.

    ``p.dp`` must already be resolved (see ``config.validate``)."""
    world = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(p.device, local_rank)
    if p.pp * p.dp * p.ep != world:
        raise ConfigError(f"world size {world} != PP x DP x EP = {p.pp} x {p.dp} x {p.ep}")
    if world == 1:
        return Layout(device=device)
    if not dist.is_initialized():
        from fastmoe_xpu.dist import init_distributed

        backend = None if p.backend == "auto" else p.backend
        init_distributed(backend=backend, device_type=device.type, timeout=datetime.timedelta(seconds=timeout_s))
    return build_layout(p.pp, p.dp, p.ep, device)


def build_layout(pp: int, dp: int, ep: int, device: torch.device) -> Layout:
    """Groups of an initialised process group laid out as PP x DP x EP (EP innermost), built by
    ``fastmoe_xpu.dist.ParallelMesh``; groups of size 1 become None."""
    from fastmoe_xpu.dist import ParallelMesh

    mesh = ParallelMesh(pp=pp, dp=dp, ep=ep, device_type=device.type)
    layout = Layout(world=mesh.world_size, rank=mesh.rank, pp=pp, dp=dp, ep=ep, device=device, mesh=mesh)
    layout.ep_group = mesh.ep_group if ep > 1 else None
    layout.dp_group = mesh.dp_group if dp > 1 else None
    layout.dpep_group = mesh.dp_ep_group if dp * ep > 1 else None
    layout.world_group = dist.group.WORLD
    return layout


@dataclass
class TPLayout(Layout):
    """The PP x DP x TP layout of a tensor-parallel dense run (TP innermost, where EP sits for MoE;
    ``ep`` is 1): rank = (pp * DP + dp) * TP + tp. TP ranks share their data, so the data world is DP."""

    tp: int = 1
    tp_group: Any = None

    @property
    def inner_size(self) -> int:
        return self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def data_rank(self) -> int:
        return self.dp_rank

    @property
    def data_world(self) -> int:
        return self.dp

    def describe(self) -> str:
        return (f"world={self.world} = PP {self.pp} x DP {self.dp} x TP {self.tp}; rank {self.rank} -> "
                f"(pp {self.pp_rank}, dp {self.dp_rank}, tp {self.tp_rank}) on {self.device}")


def init_tp_layout(cfg: TrainConfig) -> TPLayout:
    """Start (or join) the process group and build the PP x DP x TP groups."""
    p = cfg.parallel
    inner = copy.deepcopy(p)
    inner.ep, inner.tp = p.tp, 1  # the mesh's innermost axis carries TP
    base = init_layout(inner)
    mesh = base.mesh
    lay = TPLayout(world=base.world, rank=base.rank, pp=p.pp, dp=p.dp, ep=1, device=base.device, mesh=mesh, tp=p.tp)
    lay.tp_group = mesh.ep_group if mesh is not None else None
    lay.dp_group = mesh.dp_group if (mesh is not None and p.dp > 1) else None
    lay.dpep_group = lay.dp_group  # the data-parallel world: DP only, TP ranks read the same batch
    lay.world_group = dist.group.WORLD if base.world > 1 else None
    return lay


def pp_group(layout: Layout) -> Any:
    """The pipeline group of ``layout``'s mesh (None in one process)."""
    mesh = layout.mesh
    return getattr(mesh, "pp_group", None) if mesh is not None else None


# ----------------------------------------------------------------------------- small collectives
def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place SUM over ``group``; a no-op for a missing (size-1) group."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier(layout: Layout) -> None:
    if layout.distributed:
        dist.barrier()

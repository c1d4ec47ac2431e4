"""The job's device mesh: one named ``DeviceMesh`` (dimensions pp, dp, ep, tp) that every part of
the trainer takes (the model's parallelisation, the optimizer's groups, checkpoints' ownership).

Global rank ``r = ((pp_rank * DP + dp_rank) * EP + ep_rank) * TP + tp_rank``: the innermost axis is
EP for MoE models (EP ranks share a node in the paper's layout, exchange tokens every MoE layer and
hold different experts) or TP for a tensor-parallel dense model (EP and TP are never both above 1).
Every one of the DP x EP ranks of a pipeline stage reads its own data; TP ranks read the same.

Groups (None when their size is 1, so that single-process runs make no collective calls):
``ep_group`` (same pp, dp), ``tp_group`` (same pp, dp), ``dp_group`` (same pp, ep/tp: replicas of
the same experts or TP shard), ``dpep_group`` (the data-parallel world of a stage: replicas of the
non-expert weights; DP only under TP), ``pp_group`` and ``world_group`` (everything; global norms).
The groups are built by :class:`fastmoe_xpu.dist.ParallelMesh` (the inner axis carrying EP x TP).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import ConfigError, ParallelConfig

#: The mesh's named dimensions, outermost first.
DIMS = ("pp", "dp", "ep", "tp")


@dataclass
class DeviceMesh:
    """Where this process sits in the PP x DP x EP x TP mesh, and its process groups. Without
    groups (``mesh`` None) it is plain rank arithmetic: the position of ``rank`` in such a mesh."""

    rank: int = 0
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1
    device: torch.device = torch.device("cpu")
    mesh: Any = None
    """The :class:`fastmoe_xpu.dist.ParallelMesh` that built the groups (None: no process group)."""
    ep_group: Any = None
    dp_group: Any = None
    dpep_group: Any = None
    world_group: Any = None
    tp_group: Any = None

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    def size(self, dim: str) -> int:
        """The size of dimension ``dim`` (one of :data:`DIMS`)."""
        if dim not in DIMS:
            raise ValueError(f"mesh dimensions are {DIMS}, got {dim!r}")
        return int(getattr(self, dim))

    @property
    def inner_size(self) -> int:
        """Ranks of the innermost axis (EP x TP; one of them is 1)."""
        return self.ep * self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.inner_size)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.inner_size) % self.dp

    @property
    def ep_rank(self) -> int:
        return (self.rank // self.tp) % self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def data_rank(self) -> int:
        """Index of this rank among the DP x EP ranks that read distinct data (TP ranks share)."""
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

    @property
    def pp_group(self) -> Any:
        return getattr(self.mesh, "pp_group", None) if self.mesh is not None else None

    def describe(self) -> str:
        axes = f"PP {self.pp} x DP {self.dp} x EP {self.ep}" + (f" x TP {self.tp}" if self.tp > 1 else "")
        pos = f"pp {self.pp_rank}, dp {self.dp_rank}, ep {self.ep_rank}" + (f", tp {self.tp_rank}" if self.tp > 1 else "")
        return f"world={self.world} = {axes}; rank {self.rank} -> ({pos}) on {self.device}"


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


def init_layout(p: ParallelConfig, *, timeout_s: float = 600.0) -> DeviceMesh:
    """Join (or start) the process group from the launcher's environment and build the mesh groups.

    ``p.dp`` must already be resolved (see ``config.validate``)."""
    world = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(p.device, local_rank)
    if p.pp * p.dp * p.ep * p.tp != world:
        raise ConfigError(f"world size {world} != PP x DP x EP x TP = {p.pp} x {p.dp} x {p.ep} x {p.tp}")
    if world == 1:
        return DeviceMesh(device=device)
    if not dist.is_initialized():
        from fastmoe_xpu.dist import init_distributed

        backend = None if p.backend == "auto" else p.backend
        init_distributed(backend=backend, device_type=device.type, timeout=datetime.timedelta(seconds=timeout_s))
    return build_layout(p.pp, p.dp, p.ep, device, tp=p.tp)


def build_layout(pp: int, dp: int, ep: int, device: torch.device, *, tp: int = 1) -> DeviceMesh:
    """The mesh of an initialised process group laid out as PP x DP x EP x TP, its groups built by
    ``fastmoe_xpu.dist.ParallelMesh`` (whose innermost axis carries EP x TP); size-1 groups are None."""
    from fastmoe_xpu.dist import ParallelMesh

    if ep > 1 and tp > 1:
        raise ConfigError(f"EP={ep} and TP={tp}: tensor parallelism covers the dense model, expert parallelism "
                          "the MoE model; one of them must be 1")
    mesh = ParallelMesh(pp=pp, dp=dp, ep=ep * tp, device_type=device.type)
    lay = DeviceMesh(rank=mesh.rank, pp=pp, dp=dp, ep=ep, tp=tp, device=device, mesh=mesh)
    lay.ep_group = mesh.ep_group if ep > 1 else None
    lay.tp_group = mesh.ep_group if tp > 1 else None
    lay.dp_group = mesh.dp_group if dp > 1 else None
    # the data-parallel world: DP x EP (TP ranks read the same batch)
    lay.dpep_group = (mesh.dp_ep_group if dp * ep > 1 else None) if tp == 1 else lay.dp_group
    lay.world_group = dist.group.WORLD
    return lay


def pp_group(layout: DeviceMesh) -> Any:
    """The pipeline group of ``layout`` (None in one process)."""
    return layout.pp_group


# ----------------------------------------------------------------------------- small collectives
def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place SUM over ``group``; a no-op for a missing (size-1) group."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier(layout: DeviceMesh) -> None:
    if layout.distributed:
        dist.barrier()

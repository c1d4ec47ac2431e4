"""PP x DP x EP process groups: PP outermost, EP innermost.

Global rank ``g = (pp_rank * DP + dp_rank) * EP + ep_rank``: the EP ranks of one replica are
neighbours (on Aurora, the 12 tiles of one node), DP replicas of one pipeline stage come next, and
pipeline stages are furthest apart.

Which group reduces what: expert weights are sharded over EP and replicated over DP, so their
gradients are averaged over ``dp_group``; every other weight (router, attention, norms) is
replicated over DP and EP, so its gradients are averaged over ``dp_ep_group``.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..device import accelerator_type

DIMS = ("pp", "dp", "ep")


class ParallelMesh:
    """The PP x DP x EP layout of the job, with one process group per axis and one for DP x EP.

    Args:
        pp: pipeline-parallel stages.
        dp: data-parallel replicas; None: whatever the world size leaves after PP and EP.
        ep: expert-parallel ranks (experts are split over these).
        device_type: device the groups' collectives run on (default: the best accelerator present).
        use_device_mesh: build the groups with ``init_device_mesh`` (falling back to ``new_group``
            when that fails); False goes straight to ``new_group``.

    Without an initialised process group only the 1 x 1 x 1 layout is allowed and every group is
    None (single-process runs use the same code path).
    """

    def __init__(
        self,
        pp: int = 1,
        dp: int | None = None,
        ep: int = 1,
        device_type: str | None = None,
        *,
        use_device_mesh: bool = True,
    ) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        rank = dist.get_rank() if initialised else 0
        for name, v in (("pp", pp), ("ep", ep)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dp is None:
            if world % (pp * ep):
                raise ValueError(f"world size {world} is not divisible by pp*ep = {pp}*{ep}")
            dp = world // (pp * ep)
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"dp must be a positive int, got {dp!r}")
        if pp * dp * ep != world:
            raise ValueError(f"pp*dp*ep = {pp}*{dp}*{ep} = {pp * dp * ep} does not match the world size {world}")
        self.pp_size, self.dp_size, self.ep_size = pp, dp, ep
        self.world_size, self.rank = world, rank
        self.pp_rank = rank // (dp * ep)
        self.dp_rank = (rank // ep) % dp
        self.ep_rank = rank % ep
        self.device_type = device_type or accelerator_type()
        self.device_mesh: Any = None
        self.ep_group = self.dp_group = self.pp_group = self.dp_ep_group = None
        self.built_with = "none"
        if initialised:
            self._build_groups(use_device_mesh)

    # ---------------------------------------------------------------- rank arithmetic
    @property
    def dp_ep_size(self) -> int:
        return self.dp_size * self.ep_size

    @property
    def dp_ep_rank(self) -> int:
        return self.dp_rank * self.ep_size + self.ep_rank

    def global_rank(self, pp_rank: int, dp_rank: int, ep_rank: int) -> int:
        return (pp_rank * self.dp_size + dp_rank) * self.ep_size + ep_rank

    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along ``dim`` ("pp", "dp", "ep" or "dp_ep"), in group-rank order."""
        pp, dp, ep = self.pp_rank, self.dp_rank, self.ep_rank
        if dim == "ep":
            return [self.global_rank(pp, dp, e) for e in range(self.ep_size)]
        if dim == "dp":
            return [self.global_rank(pp, d, ep) for d in range(self.dp_size)]
        if dim == "pp":
            return [self.global_rank(p, dp, ep) for p in range(self.pp_size)]
        if dim == "dp_ep":
            return [self.global_rank(pp, d, e) for d in range(self.dp_size) for e in range(self.ep_size)]
        raise ValueError(f"dim must be one of pp, dp, ep, dp_ep; got {dim!r}")

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return {"ep": self.ep_group, "dp": self.dp_group, "pp": self.pp_group, "dp_ep": self.dp_ep_group}[dim]

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(pp={self.pp_size}, dp={self.dp_size}, ep={self.ep_size}; rank {self.rank} = "
            f"(pp {self.pp_rank}, dp {self.dp_rank}, ep {self.ep_rank}); groups via {self.built_with})"
        )

    # ---------------------------------------------------------------- group construction
    def _build_groups(self, use_device_mesh: bool) -> None:
        if use_device_mesh:
            try:
                self._build_with_device_mesh()
                self.built_with = "device_mesh"
                return
            except Exception:  # DeviceMesh API absent or unable on this backend: plain new_group does the same
                self.device_mesh = None
        self._build_with_new_group()
        self.built_with = "new_group"

    def _build_with_device_mesh(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device_type, (self.pp_size, self.dp_size, self.ep_size), mesh_dim_names=DIMS)
        flat = mesh["dp", "ep"]._flatten("dp_ep")
        groups = {d: mesh.get_group(d) for d in DIMS}
        groups["dp_ep"] = flat.get_group()
        for dim, g in groups.items():
            got = dist.get_process_group_ranks(g)
            if got != self.ranks(dim):
                raise RuntimeError(f"device mesh gave {dim} ranks {got}, expected {self.ranks(dim)}")
        self.device_mesh = mesh
        self.ep_group, self.dp_group, self.pp_group, self.dp_ep_group = (groups[d] for d in ("ep", "dp", "pp", "dp_ep"))

    def _build_with_new_group(self) -> None:
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        made: dict[str, dist.ProcessGroup] = {}
        P, D, E = self.pp_size, self.dp_size, self.ep_size
        layouts = {
            "ep": [[self.global_rank(p, d, e) for e in range(E)] for p in range(P) for d in range(D)],
            "dp": [[self.global_rank(p, d, e) for d in range(D)] for p in range(P) for e in range(E)],
            "pp": [[self.global_rank(p, d, e) for p in range(P)] for d in range(D) for e in range(E)],
            "dp_ep": [[self.global_rank(p, d, e) for d in range(D) for e in range(E)] for p in range(P)],
        }
        for dim, all_ranks in layouts.items():
            for ranks in all_ranks:
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    made[dim] = g
        self.ep_group, self.dp_group, self.pp_group, self.dp_ep_group = (made[d] for d in ("ep", "dp", "pp", "dp_ep"))

"""``--parallel.dp_shard fsdp``: PyTorch's FSDP2 (``fully_shard``) on the non-expert weights over the
data-parallel world of DP x EP ranks, while the experts stay expert-parallel.

:func:`apply_fsdp` shards every decoder layer and the root module, leaving the expert tensors out
(``ignored_params``): FSDP gathers a layer's weights for its forward and backward and
reduce-scatters their gradients (summed, not averaged: the trainer's loss is already normalised over
the global batch). :class:`FsdpAdamW` steps those DTensor shards with the same AdamW and the same
global clipping as the sharded optimizers, beside the expert bucket (states split over DP, as EPSO).
:func:`fsdp_mesh` gives HSDP's 2-D mesh for ``--parallel.fsdp_shard N``. Checkpoints
(trainer/checkpoint/) write the shards and their optimizer states as DTensors under the plain keys
every layout reads (:meth:`_FsdpShard.checkpoint_states`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .zero import BucketSpec, ZeroAdamW, split_params


def fsdp_mesh(layout: Any, shard: int = 0) -> Any:
    """The device mesh FSDP2 shards over: the stage's DP x EP ranks (``layout.dpep_group``), or with
    ``0 < shard < DP x EP`` the 2-D HSDP mesh ``[DP x EP / shard, shard]`` (replicate, shard), its
    shard groups ``shard`` consecutive ranks. Collective over the world: every rank creates every
    stage's groups, in the same order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    device_type = "cpu" if layout.device.type == "meta" else layout.device.type  # a trace's meta model: host groups
    size = layout.dp * layout.ep
    if shard in (0, size):
        return TorchMesh.from_group(layout.dpep_group, device_type)
    replicas = size // shard
    mine: dict[str, Any] = {}
    for kind in ("shard", "replicate"):
        for stage in range(layout.pp):
            base = stage * size
            blocks = ([[base + b * shard + j for j in range(shard)] for b in range(replicas)] if kind == "shard" else
                      [[base + b * shard + j for b in range(replicas)] for j in range(shard)])
            for ranks in blocks:
                group = dist.new_group(ranks)
                if layout.rank in ranks:
                    mine[kind] = group
    stage_ranks = torch.arange(layout.pp_rank * size, (layout.pp_rank + 1) * size).view(replicas, shard)
    return TorchMesh.from_group([mine["replicate"], mine["shard"]], device_type, mesh=stage_ranks,
                                mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, mesh: Any, *, is_expert: Callable[[str], bool], reduce_dtype: str = "fp32") -> int:
    """``fully_shard`` the decoder layers and ``model`` over ``mesh`` (:func:`fsdp_mesh`: the DP x EP
    ranks, or HSDP's 2-D mesh), the expert tensors excluded, gradients reduce-scattered in
    ``reduce_dtype`` (``--optim.grad_reduce_dtype``); returns the number of modules sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..model.family import decoder_layers

    ignored = {p for n, p in model.named_parameters() if is_expert(n)}
    mp = MixedPrecisionPolicy(reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[reduce_dtype])
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored, mp_policy=mp)
    fully_shard(model, mesh=mesh, ignored_params=ignored, mp_policy=mp)
    for mod in [*layers, model]:  # every FSDP module keeps its own reduction settings
        mod.set_gradient_divide_factor(1.0)  # sums, as the trainer's other reductions
        mod.set_force_sum_reduction_for_comms(True)
    return len(layers) + 1


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (it must then be called as a whole: FSDP2
    gathers a module's own weights in that module's forward hook)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def reshard(module: nn.Module) -> None:
    """Free the gathered weights of every FSDP2 module in ``module`` (a forward without backward,
    as in evaluation, leaves the root's gathered); a no-op without FSDP."""
    for m in module.modules():
        if is_fsdp(m):
            m.reshard()


class _FsdpShard:
    """The FSDP-sharded weights of this rank as one optimizer bucket: fp32 master and Adam moments
    of the local shards, gradients already reduce-scattered by FSDP."""

    name = "fsdp"

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        mesh = self.params[0].device_mesh
        # HSDP: the replicas of a shard hold equal gradients; the first of them counts in the global norm
        owner = mesh.ndim == 1 or mesh.get_local_rank(0) == 0
        self.spec = BucketSpec("fsdp", params, None, None, owner)
        local = [p.to_local() for p in self.params]
        self.device = local[0].device
        self.sizes = [t.numel() for t in local]
        self.master = torch.cat([t.detach().reshape(-1).float() for t in local])
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_t = torch.zeros((), dtype=torch.float32)
        # the flat layout :meth:`ZeroAdamW.state_dict` records (this rank's shards, concatenated)
        self.numel = self.shard_numel = self.master.numel()
        self.group_size, self.group_rank = mesh.size(), mesh.get_rank()

    def layout(self) -> dict[str, Any]:
        return {"numel": self.numel, "shard_numel": self.shard_numel, "group_size": self.group_size,
                "group_rank": self.group_rank,
                "params": [(n, tuple(p.shape), tuple(p.to_local().shape)) for n, p in zip(self.names, self.params)]}

    @property
    def flat_grad(self) -> torch.Tensor:
        grads = [p.grad.to_local().reshape(-1) if p.grad is not None else torch.zeros(n, device=self.device)
                 for p, n in zip(self.params, self.sizes)]
        return torch.cat(grads)

    def reduce_grad_shard(self) -> torch.Tensor:
        return self.flat_grad.float()

    def weights32(self) -> torch.Tensor:
        """The fp32 master of this rank's shards (what the update reads and writes)."""
        return self.master

    def store(self, w32: torch.Tensor, generator: torch.Generator | None) -> None:
        """Keep the updated fp32 shards (always a master here) and write them into the parameters."""
        if w32 is not self.master:
            self.master.copy_(w32)
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        for p, piece in zip(self.params, self.master.split(self.sizes)):
            local = p.to_local()
            local.copy_(piece.view_as(local).to(local.dtype))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_nbytes(self) -> int:
        return 3 * self.master.numel() * self.master.element_size()

    # checkpoints (trainer/checkpoint/optim_state.py): every state of a weight as a DTensor laid out as the
    # weight itself, so DCP writes each rank's shard and any layout reads the whole or its own part
    def _as_dtensors(self, flat: torch.Tensor) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        out = {}
        for n, p, piece in zip(self.names, self.params, flat.split(self.sizes)):
            out[n] = DTensor.from_local(piece.view(p.to_local().shape), p.device_mesh, p.placements,
                                        run_check=False, shape=p.shape, stride=p.stride())
        return out

    def checkpoint_states(self) -> dict[str, dict[str, Any]]:
        """``{state: {weight name: DTensor}}`` of the fp32 master and the two moments."""
        return {"master": self._as_dtensors(self.master), "exp_avg": self._as_dtensors(self.exp_avg),
                "exp_avg_sq": self._as_dtensors(self.exp_avg_sq)}

    def empty_states(self) -> dict[str, dict[str, Any]]:
        """Buffers shaped as :meth:`checkpoint_states` for a checkpoint to be read into."""
        return {k: self._as_dtensors(torch.empty_like(self.master)) for k in ("master", "exp_avg", "exp_avg_sq")}

    @torch.no_grad()
    def load_states(self, states: dict[str, dict[str, Any]]) -> None:
        """Copy states read into :meth:`empty_states`' buffers into this shard (weights not published)."""
        for key, dst in (("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            dst.copy_(torch.cat([states[key][n].to_local().reshape(-1) for n in self.names]))

    @torch.no_grad()
    def sync_from_params(self) -> None:
        """Re-seed the fp32 master from the weights (after weights were loaded into the model)."""
        self.master.copy_(torch.cat([p.to_local().detach().reshape(-1).float() for p in self.params]))


class FsdpAdamW(ZeroAdamW):
    """AdamW over the FSDP shards of the non-expert weights and the expert bucket (states split over
    DP, gradients reduce-scattered over it); one global gradient norm over both, clipped as
    ``torch.nn.utils.clip_grad_norm_`` does."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, is_expert: Callable[[str], bool],
                 dp_group: Any = None, norm_group: Any = None, **kwargs: Any) -> None:
        dense, expert = split_params(named_params, is_expert)
        super().__init__([BucketSpec("expert", expert, dp_group, None, True)], norm_group=norm_group, **kwargs)
        if dense:
            self.buckets.insert(0, _FsdpShard(dense))

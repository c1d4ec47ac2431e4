"""``--parallel.dp_shard fsdp``: PyTorch's FSDP2 (``fully_shard``) on the non-expert weights over the
data-parallel world of DP x EP ranks, while the experts stay expert-parallel.

:func:`apply_fsdp` shards every decoder layer and the root module, leaving the expert tensors out
(``ignored_params``): FSDP gathers a layer's weights for its forward and backward and
reduce-scatters their gradients (summed, not averaged: the trainer's loss is already normalised over
the global batch). :class:`FsdpAdamW` steps those DTensor shards with the same AdamW and the same
global clipping as the sharded optimizers, beside the expert bucket (states split over DP, as EPSO).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .zero import BucketSpec, ZeroAdamW, split_params


def apply_fsdp(model: nn.Module, group: Any, *, is_expert: Callable[[str], bool], device_type: str) -> int:
    """``fully_shard`` the decoder layers and ``model`` over ``group`` (DP x EP ranks), the expert
    tensors excluded; returns the number of modules sharded."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.fsdp import fully_shard

    from ..parallelism.ac import decoder_layers

    mesh = TorchMesh.from_group(group, device_type)
    ignored = {p for n, p in model.named_parameters() if is_expert(n)}
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    for mod in [*layers, model]:  # every FSDP module keeps its own reduction settings
        mod.set_gradient_divide_factor(1.0)  # sums, as the trainer's other reductions
        mod.set_force_sum_reduction_for_comms(True)
    return len(layers) + 1


class _FsdpShard:
    """The FSDP-sharded weights of this rank as one optimizer bucket: fp32 master and Adam moments
    of the local shards, gradients already reduce-scattered by FSDP."""

    name = "fsdp"

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.spec = BucketSpec("fsdp", params, None, None, True)
        local = [p.to_local() for p in self.params]
        self.device = local[0].device
        self.sizes = [t.numel() for t in local]
        self.master = torch.cat([t.detach().reshape(-1).float() for t in local])
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_t = torch.zeros((), dtype=torch.float32)

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

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("checkpoints of --parallel.dp_shard fsdp runs are not implemented")

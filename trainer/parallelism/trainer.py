"""The trainer with pipeline and tensor parallelism, activation checkpointing and model broadcast.

:class:`ParallelTrainer` is :class:`trainer.train.Trainer` with its model construction, optimizer
construction and forward/backward replaced where the layout asks for it:

- ``--pp N`` (``parallel.pp``): this rank builds only its pipeline stage (the full model is never
  allocated when ``--parallel.pp_meta_init``), runs its micro-batches through the chosen schedule
  (``parallel.pp_schedule``: 1F1B by default, or GPipe), and the optimizer covers the stage's
  parameters with the same DP / EP groups (which all lie within one stage).
- ``--tp N`` (``parallel.tp``, dense model): attention heads and MLP columns split over the TP
  ranks (innermost in the mesh, where EP sits for MoE models); TP ranks read the same data.
- ``--ac norm,attn,moe`` (``parallel.ac``): selective activation checkpointing.
- ``--broadcast broadcast|all_reduce`` (``parallel.broadcast``): replicas receive rank 0's initial
  weights instead of drawing their own; with ``--init-from FILE`` (``model.init_from``) only rank 0
  reads the file and every rank receives its part.

Without any of these it behaves exactly like ``Trainer``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import TrainConfig, validate
from ..model import build_model, is_expert_param, torch_dtype
from ..optim import BucketSpec, ZeroAdamW
from ..parallel import Layout, all_reduce_sum, env_world_size, init_layout
from ..train import IGNORE_INDEX, MicroLoss, Trainer
from .ac import apply_activation_checkpointing
from .broadcast import broadcast_replicas, load_and_broadcast
from .pipeline import MoeLossConfig, Pipeline
from .tp import apply_tensor_parallel, tp_localize


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
    mesh = layout.mesh
    return getattr(mesh, "pp_group", None) if mesh is not None else None


class ParallelTrainer(Trainer):
    """:class:`Trainer` plus PP, TP, activation checkpointing and model broadcast (see the module doc)."""

    def __init__(self, cfg: TrainConfig, layout: Layout | None = None) -> None:
        self.pipeline: Pipeline | None = None
        p = cfg.parallel
        if layout is None and p.tp > 1:
            cfg = copy.deepcopy(cfg)
            validate(cfg, env_world_size())
            layout = init_tp_layout(cfg)
        super().__init__(cfg, layout)

    # ------------------------------------------------------------------------------ construction
    def _full_model(self, *, meta: bool = False) -> nn.Module:
        cfg, lay = self.cfg, self.layout
        device = torch.device("meta") if meta else self.device
        if meta:
            with torch.device("meta"):
                return build_model(cfg.model, cfg.data.context, seed=cfg.seed, device=device,
                                   ep_group=lay.ep_group, ep_size=lay.ep)
        return build_model(cfg.model, cfg.data.context, seed=cfg.seed, device=device,
                           ep_group=lay.ep_group, ep_size=lay.ep)

    def build_model(self) -> nn.Module:
        cfg, lay = self.cfg, self.layout
        p = cfg.parallel
        tp = getattr(lay, "tp", 1)

        def prepare(module: nn.Module) -> None:
            if tp > 1:
                apply_tensor_parallel(module, lay.tp_group, rank=lay.tp_rank, tp=tp)
            apply_activation_checkpointing(module, p.ac)

        if p.pp > 1:
            m = cfg.model
            self.pipeline = Pipeline(
                lambda stage: self._full_model(meta=p.pp_meta_init), pp_rank=lay.pp_rank, pp=p.pp,
                group=pp_group(lay), device=self.device, n_microbatches=cfg.schedule.global_batch
                // (lay.data_world * cfg.schedule.micro_batch), schedule=p.pp_schedule,
                loss_cfg=MoeLossConfig(num_layers=m.num_layers, num_experts=m.num_experts if m.is_moe else 0,
                                       top_k=m.top_k if m.is_moe else 0,
                                       load_balancing_coef=m.load_balancing_coef, z_loss_coef=m.z_loss_coef),
                prepare=prepare, meta_seed=cfg.seed)
            model: nn.Module = self.pipeline.modules[0]
            model.to(dtype=torch_dtype(m.param_dtype))
        else:
            model = self._full_model()
            prepare(model)
        self._synchronise_weights(model)
        return model

    def _synchronise_weights(self, model: nn.Module) -> None:
        """``--init-from``: rank 0 reads the file, every rank receives its part. ``--broadcast``
        without a file: every replica takes its group's first rank's initial weights."""
        cfg, lay = self.cfg, self.layout
        method = cfg.parallel.broadcast
        path = cfg.model.init_from
        if path:
            if not lay.distributed:
                load_and_broadcast_local(model, path)
                return
            tp = getattr(lay, "tp", 1)
            load_and_broadcast(model, path, group=None, method="broadcast" if method == "none" else method,
                               localize=tp_localize(lay.tp_rank, tp) if tp > 1 else None)
        elif method != "none" and lay.dpep_group is not None:
            broadcast_replicas(model, group=lay.dpep_group, expert_group=lay.dp_group, method=method,
                               is_expert=is_expert_param)

    def build_optimizer(self) -> ZeroAdamW:
        lay = self.layout
        tp = getattr(lay, "tp", 1)
        if tp == 1:
            return super().build_optimizer()
        # TP-split weights are distinct on every TP rank; replicated ones (embedding, LM head) are
        # equal there, gradients included, so only TP rank 0 counts them in global norms.
        o = self.cfg.optim
        split, replicated = [], []
        for name, prm in self.model.named_parameters():
            if prm.requires_grad:
                (split if getattr(prm, "tp_split", False) else replicated).append((name, prm))
        sharded = o.name != "adamw"
        specs = [BucketSpec("tp_split", split, lay.dp_group if sharded else None,
                            None if sharded else lay.dp_group, True),
                 BucketSpec("tp_replicated", replicated, lay.dp_group if sharded else None,
                            None if sharded else lay.dp_group, lay.tp_rank == 0)]
        return ZeroAdamW(specs, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                         grad_reduce_dtype=torch_dtype(o.grad_reduce_dtype), norm_group=lay.world_group)

    # ------------------------------------------------------------------------------ one step
    def forward_backward(self, micro_batches: Sequence[Any]) -> MicroLoss:
        if self.pipeline is None:
            return super().forward_backward(micro_batches)
        lay, m, pipe = self.layout, self.cfg.model, self.pipeline
        targets = torch.tensor([float(sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches))],
                               device=self.device)
        all_reduce_sum(targets, lay.dpep_group)
        lc = pipe.loss_cfg
        lc.global_targets = max(float(targets.item()), 1.0)
        lc.micro_batches_global = self.micro_batches_global
        input_ids = torch.cat([mb[0] for mb in micro_batches]).to(self.device)
        labels = torch.cat([mb[1] for mb in micro_batches]).to(self.device)
        with self._autocast():
            parts = pipe.step(input_ids if pipe.is_first else None, labels if pipe.is_last else None)
        E = m.num_experts if m.is_moe else 0
        flat = torch.zeros(3 + E, device=self.device)
        counts = getattr(lay, "tp_rank", 0) == 0  # TP ranks compute the same loss: count it once
        for part in parts if counts else ():  # empty except on the last stage
            flat += torch.cat([part.lm.reshape(1), part.lb.reshape(1), part.z.reshape(1),
                               part.tokens_per_expert.float()]).to(flat.device)
        all_reduce_sum(flat, lay.world_group)  # the last stage's DP x EP ranks hold the global sums
        return MicroLoss(flat[0], flat[1], flat[2], flat[3:])


@torch.no_grad()
def load_and_broadcast_local(model: nn.Module, path: str) -> None:
    """One process: load the file's weights into ``model`` (the same reading rules as the broadcast)."""
    from .broadcast import merge_v4_experts, read_state_dict

    sd = merge_v4_experts(read_state_dict(path))
    local = model.state_dict(keep_vars=True)
    missing = [n for n, _ in model.named_parameters() if n not in sd]
    if missing:
        raise ValueError(f"the model file provides no {missing[:5]}")
    for name, t in sd.items():
        if name in local:
            local[name].data.copy_(t)

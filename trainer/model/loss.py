"""The training loss, one recipe for plain and pipelined steps.

Every micro-batch's loss is normalised over the *global* batch: cross-entropy summed over target
tokens and divided by the global count of target tokens (:func:`global_target_count`, all-reduced
over the data-parallel world), router losses divided by the global number of micro-batches. So
gradients are plain sums across ranks and the logged loss is the global-batch mean whatever the
layout. The router losses come from the router logits in a plain step (:func:`micro_batch_loss`)
and from the totals a pipeline carries between its stages in a pipelined one
(:func:`pipeline_loss`, see :mod:`trainer.parallelism.pipeline`); both return the same
:class:`MicroLoss`, summed over ranks by :func:`all_reduce_loss`.

Legend: B micro-batch, C context, V vocabulary, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..layout import all_reduce_sum

IGNORE_INDEX = -100


@dataclass
class MicroLoss:
    """Detached parts of one or more micro-batches' loss (already scaled like the loss)."""

    lm: torch.Tensor
    """Cross-entropy summed over target tokens, divided by the global target count."""
    lb: torch.Tensor
    """Load-balancing loss divided by the global number of micro-batches."""
    z: torch.Tensor
    """Router z-loss divided by the global number of micro-batches."""
    tokens_per_expert: torch.Tensor
    """Routed token slots per expert (summed over layers) ``[E]``."""

    def __add__(self, other: "MicroLoss") -> "MicroLoss":
        return MicroLoss(self.lm + other.lm, self.lb + other.lb, self.z + other.z,
                         self.tokens_per_expert + other.tokens_per_expert)


def global_target_count(micro_batches: Sequence[Any], group: Any, device: torch.device) -> float:
    """Target tokens (labels other than ``-100``) in the global batch: this rank's micro-batches
    summed over ``group`` (the data-parallel world; None in one process). At least 1."""
    targets = torch.tensor([float(sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches))], device=device)
    all_reduce_sum(targets, group)
    return max(float(targets.item()), 1.0)


def all_reduce_loss(parts: Sequence[MicroLoss], num_experts: int, group: Any, device: torch.device) -> MicroLoss:
    """The sum of ``parts`` (in order; may be empty) over ``group``, accumulated in fp32."""
    flat = torch.zeros(3 + num_experts, device=device)
    for part in parts:
        flat += torch.cat([part.lm.reshape(1), part.lb.reshape(1), part.z.reshape(1),
                           part.tokens_per_expert.float()]).to(flat.device)
    all_reduce_sum(flat, group)
    return MicroLoss(flat[0], flat[1], flat[2], flat[3:])


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor, global_targets: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy / ``global_targets``, the same detached) of ``logits [B, C, V]``."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="sum")
    return ce / global_targets, ce.detach() / global_targets


def micro_batch_loss(m: ModelConfig, logits: torch.Tensor, labels: torch.Tensor,
                     router_logits: Sequence[torch.Tensor] | None, *, global_targets: float,
                     micro_batches_global: int) -> tuple[torch.Tensor, MicroLoss]:
    """The differentiable loss of one micro-batch, scaled so that its sum over every micro-batch
    of every rank is the global-batch loss, and its detached parts.

    ``logits [B, C, V]``, ``labels [B, C]`` (already shifted; ``-100`` is ignored), ``router_logits``
    one ``[B*C, E]`` tensor per MoE layer. LM loss: summed cross-entropy / ``global_targets``. Router
    losses (load balancing, z) are per micro-batch statistics, averaged over ``micro_batches_global``.
    """
    loss, lm = _lm_loss(logits, labels, global_targets)
    zero = torch.zeros((), device=logits.device)
    lb = z = zero
    tpe = torch.zeros(m.num_experts if m.is_moe else 0, device=logits.device)
    if m.is_moe and router_logits:
        from fastmoe_xpu import load_balancing_loss, router_z_loss

        lb = load_balancing_loss(router_logits, m.num_experts, m.top_k) / micro_batches_global
        z = router_z_loss(router_logits) / micro_batches_global
        loss = loss + m.load_balancing_coef * lb + m.z_loss_coef * z
        with torch.no_grad():
            idx = torch.cat([r.topk(m.top_k, dim=-1).indices.reshape(-1) for r in router_logits])
            tpe = torch.bincount(idx, minlength=m.num_experts).float()
    return loss, MicroLoss(lm, lb.detach(), z.detach(), tpe)


@dataclass
class MoeLossConfig:
    """How a pipeline's last stage turns its outputs into the loss (the trainer's recipe: the
    coefficients are the model config's, :class:`~trainer.config.ModelConfig`)."""

    num_layers: int
    load_balancing_coef: float
    z_loss_coef: float
    num_experts: int = 0
    top_k: int = 0
    global_targets: float = 1.0
    """Target tokens in the global batch: the cross-entropy sum is divided by it."""
    micro_batches_global: int = 1
    """Micro-batches in the global batch: router losses are averaged over them."""
    parts: list[MicroLoss] = field(default_factory=list)
    """The parts of the micro-batches the loss was called on, in order."""


def pipeline_loss(outputs: Any, labels: torch.Tensor, cfg: MoeLossConfig) -> tuple[torch.Tensor, MicroLoss]:
    """:func:`micro_batch_loss` from a pipeline's last-stage outputs ``(logits, counts_E, probs_E,
    zsum_1)`` (MoE) or ``logits`` (dense): the router losses come from the totals the stages carry,
    ``E * sum_e (C_e / R) * (P_e / R)`` and the layer mean of the z-sums, over the global number of
    micro-batches."""
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    logits = outputs[0]
    loss, lm = _lm_loss(logits, labels, cfg.global_targets)
    zero = torch.zeros((), device=logits.device)
    lb = z = zero
    tpe = torch.zeros(cfg.num_experts, device=logits.device)
    if len(outputs) == 4:
        counts_E, probs_E, zsum = outputs[1], outputs[2], outputs[3]
        rows = float(labels.numel() * cfg.num_layers)
        lb = cfg.num_experts * torch.sum((counts_E / rows) * (probs_E / rows)) / cfg.micro_batches_global
        z = zsum.reshape(()) / cfg.num_layers / cfg.micro_batches_global
        loss = loss + cfg.load_balancing_coef * lb + cfg.z_loss_coef * z
        tpe = counts_E.detach()
    return loss, MicroLoss(lm, lb.detach(), z.detach(), tpe)

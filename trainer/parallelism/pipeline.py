"""Pipeline parallelism with ``torch.distributed.pipelining`` (1F1B by default, GPipe, Interleaved 1F1B).

The decoder layers are split into contiguous stages (:func:`trainer.parallelism.plan.split_layers`):
the first stage also holds the embedding, the last the final norm and the LM head. A stage is the
transformers model pruned in place (:class:`StageModel`), so its parameter names are exactly the
full model's (``model.layers.7.mlp.experts.gate_up_proj``): state dicts, expert markers and the
model broadcast work unchanged.

MoE router losses without extra communication. The load-balancing loss of a micro-batch is
``E * sum_e (C_e / R) * (P_e / R)`` with ``C`` the top-k counts and ``P`` the router probabilities,
both summed over *all* layers, and the z-loss is the mean over layers of ``mean_t lse(logits_t)^2``.
Neither splits into per-stage terms, so each stage adds its layers' ``C`` (no gradient), ``P`` and
z-sum (with gradient) to running totals that travel with the hidden states as extra activations.
The last stage computes the losses from the totals; the gradient of ``P`` and of the z-sum flows
back through the pipeline's ordinary activation-gradient sends, so every router receives exactly
the gradient of the single-process loss. The accumulation runs in layer order, the same order as
``fastmoe_xpu.load_balancing_loss`` and ``router_z_loss``.

Stage inputs/outputs: first stage ``input_ids [B, S]``; between stages
``(hidden [B, S, H], counts_E, probs_E, zsum_1)`` (MoE) or ``(hidden,)`` (dense); the last stage
returns ``(logits [B, S, V], counts_E, probs_E, zsum_1)`` for the loss function
(:func:`trainer.model.loss.pipeline_loss`, the trainer's one loss recipe).

Legend: B micro-batch, S sequence, H hidden, V vocabulary, E experts, L layers.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..config import TrainConfig
from ..layout import DeviceMesh, pp_group
from ..model.loss import MicroLoss, MoeLossConfig, _lm_loss, pipeline_loss
from .plan import split_layers

SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b")


@dataclass
class FamilyLossConfig:
    """The last stage's loss for a transformers family (``--model.arch hf``): the LM loss plus, where
    the family defines one, its own load-balancing ``aux_loss`` (its modeling module's
    ``load_balancing_loss_func``) on the router logits of every layer, which the stages carry
    forward stacked ``[layers so far, T, E]`` (so the family's function sees exactly what the
    one-process forward gives it, and its gradient flows back through the pipeline's sends)."""

    num_experts: int
    top_k: int
    load_balancing_coef: float = 0.0
    global_targets: float = 1.0
    micro_batches_global: int = 1
    parts: list[MicroLoss] = field(default_factory=list)
    aux_fn: Callable[..., torch.Tensor] | None = None
    """Set from the first stage built: the family's ``load_balancing_loss_func`` (None: no aux loss)."""

    def __call__(self, outputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, MicroLoss]:
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        logits = outputs[0]
        loss, lm = _lm_loss(logits, labels, self.global_targets)
        lb = torch.zeros((), device=logits.device)
        if len(outputs) == 2 and self.aux_fn is not None:
            aux = self.aux_fn(tuple(outputs[1].unbind(0)), self.num_experts, self.top_k, None)
            lb = aux.float() / self.micro_batches_global
            loss = loss + self.load_balancing_coef * lb
        zero = torch.zeros((), device=logits.device)
        return loss, MicroLoss(lm, lb.detach(), zero, torch.zeros(0, device=logits.device))


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved1f1b": ScheduleInterleaved1F1B}
    try:
        return classes[name]
    except KeyError:
        raise ValueError(f"pipeline schedule must be one of {list(classes)}, got {name!r}") from None


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Stages a rank runs: ``pp_rank``, ``pp_rank + pp``, ... (``virtual`` of them; the loop order
    of interleaved schedules)."""
    return [pp_rank + k * pp for k in range(virtual)]


class StageModel(nn.Module):
    """One pipeline stage of a transformers OLMoE/OLMo causal LM, pruned in place.

    Children are named as in the full model (``model.embed_tokens``, ``model.layers.<i>``,
    ``model.norm``, ``lm_head``); layers outside the stage, the embedding (except on the first
    stage) and the norm and head (except on the last) are dropped."""

    def __init__(self, causal_lm: nn.Module, stage: int, num_stages: int, layers: range | None = None,
                 router_logits: bool = False) -> None:
        super().__init__()
        base = causal_lm.model
        self.config = causal_lm.config
        total = len(base.layers)
        layers = layers if layers is not None else split_layers(total, num_stages)[stage]
        self.stage, self.num_stages, self.layer_ids = stage, num_stages, layers
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.is_moe = hasattr(self.config, "num_experts") and self.config.model_type == "olmoe"
        self.num_layers_total = total
        base.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        if not self.is_first:
            base.embed_tokens = None
        if not self.is_last:
            base.norm = None
        self.model = base
        self.lm_head = causal_lm.lm_head if self.is_last else None
        self._captured: list[torch.Tensor] | None = None
        self._hooks = []
        if self.is_moe:
            for layer in base.layers.values():
                self._hooks.append(layer.mlp.gate.register_forward_hook(self._capture_router))
        # a transformers family whose loss needs every layer's router logits: they travel stacked
        self.carries_router_logits = bool(router_logits) and not self.is_moe
        self._router_index = 0
        if self.carries_router_logits:
            recorder = getattr(type(causal_lm), "_can_record_outputs", {}).get("router_logits")
            target = getattr(recorder, "target_class", None)
            if target is None:
                raise ValueError(f"{type(causal_lm).__name__} records no router_logits: its aux loss cannot be pipelined")
            self._router_index = int(getattr(recorder, "index", 0) or 0)
            for layer in base.layers.values():
                for mod in layer.modules():
                    if isinstance(mod, target):
                        self._hooks.append(mod.register_forward_hook(self._capture_family_router))

    def _capture_router(self, module: nn.Module, args: Any, output: Any) -> None:
        # Only the stage's own forward counts; activation-checkpoint recomputation in backward
        # calls the router again and must not add anything.
        if self._captured is not None:
            self._captured.append(output[0] if isinstance(output, tuple) else output)

    def _capture_family_router(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._captured is not None:
            self._captured.append(output[self._router_index] if isinstance(output, tuple) else output)

    def _router_totals(self, logits: Sequence[torch.Tensor], counts_E: torch.Tensor, probs_E: torch.Tensor,
                       zsum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        K, E = self.config.num_experts_per_tok, self.config.num_experts
        for logits_TE in logits:
            probs_TE = torch.softmax(logits_TE.float(), dim=-1)
            with torch.no_grad():
                idx_TK = torch.topk(probs_TE, K, dim=-1).indices
                ones = torch.ones(idx_TK.numel(), dtype=torch.float32, device=idx_TK.device)
                layer_counts_E = torch.zeros(E, dtype=torch.float32, device=idx_TK.device).scatter_add_(
                    0, idx_TK.reshape(-1), ones)
            # The sum outside no_grad: a received total keeps its autograd path to the stage's output, so
            # the pipeline has a gradient (ending at the first stage's zeros) to send back for it.
            counts_E = counts_E + layer_counts_E
            probs_E = probs_E + probs_TE.sum(0)
            zsum = zsum + torch.logsumexp(logits_TE.float(), dim=-1).square().mean()
        return counts_E, probs_E, zsum

    def forward(self, *inputs: torch.Tensor, position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``position_ids`` [B, C]: positions restarting per document (``--data.document_mask``), given to every
        stage alike (the schedule passes keyword arguments to each); the block-diagonal mask follows from them.
        None: 0 .. C-1, attention over the whole instance."""
        from transformers.masking_utils import create_causal_mask

        base = self.model
        if self.is_first:
            (input_ids,) = inputs
            hidden = base.embed_tokens(input_ids)
            rest: tuple[torch.Tensor, ...] = ()
            if self.is_moe:
                E = self.config.num_experts
                rest = (torch.zeros(E, device=hidden.device), torch.zeros(E, device=hidden.device),
                        torch.zeros(1, device=hidden.device))
        else:
            hidden, *rest_list = inputs
            rest = tuple(rest_list)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask_kwargs = dict(config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                           position_ids=position_ids)
        mask = create_causal_mask(**mask_kwargs)
        layer_types = getattr(self.config, "layer_types", None)
        masks = {"full_attention": mask}
        if layer_types and "sliding_attention" in layer_types:  # per-layer masks, as the family's forward makes them
            from transformers.masking_utils import create_sliding_window_causal_mask

            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        position_embeddings = base.rotary_emb(hidden, position_ids)
        # the family's router logits feed its aux loss only: evaluation (eval mode) sends the hidden states alone
        carry = self.carries_router_logits and self.training
        self._captured = [] if (self.is_moe or carry) else None
        try:
            for i, layer in base.layers.items():
                m = masks[layer_types[int(i)]] if layer_types and layer_types[int(i)] in masks else mask
                hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=m,
                               position_ids=position_ids, past_key_values=None, use_cache=False)
            captured = self._captured
        finally:
            self._captured = None
        if self.is_moe:
            rest = self._router_totals(captured or [], *rest)
        elif carry:
            if not captured:
                raise ValueError(f"pipeline stage {self.stage} has no router: every stage of a family with an "
                                 "aux loss needs at least one MoE layer")
            stacked = torch.stack(captured)
            rest = (torch.cat([rest[0], stacked]) if rest else stacked,)
        if self.is_last:
            hidden = self.lm_head(base.norm(hidden))
        return (hidden, *rest)

    def boundary(self, micro_batch: int, context: int, dtype: torch.dtype, device: torch.device | str) -> tuple:
        """Empty tensors shaped as what a middle stage receives from the one before it (``(hidden,
        counts_E, probs_E, zsum_1)`` for OLMoE, ``(hidden,)`` for OLMo; see the module doc), those with a
        gradient requiring one: the pipeline's metadata where no other stage runs (the trace of a step
        on a fake process group)."""
        if self.carries_router_logits:
            raise ValueError("the boundary of a pipeline carrying a family's router logits depends on the stage")
        hidden = torch.empty(micro_batch, context, self.config.hidden_size, dtype=dtype, device=device,
                             requires_grad=True)
        if not self.is_moe:
            return (hidden,)
        E = self.config.num_experts
        # the expert counts carry no gradient (top-k counts); the probabilities and the z-sum do
        return (hidden, torch.empty(E, device=device), torch.empty(E, device=device, requires_grad=True),
                torch.empty(1, device=device, requires_grad=True))


@torch.no_grad()
def materialize(stage: nn.Module, device: torch.device | str, *, seed: int, std: float | None = None) -> nn.Module:
    """Allocate a stage built on the ``meta`` device on ``device`` and initialise it like
    transformers does (normal(0, std) for linear, embedding, router and expert weights, ones for
    norm weights, rotary frequencies recomputed, ``expert_ids`` restored), drawing from ``seed``.

    This is how a stage of a model too large for one host comes to exist: only the stage's own
    parameters are ever allocated. (Identical weights to a one-process run come from
    :func:`trainer.parallelism.broadcast.load_and_broadcast` instead.)"""
    cfg = getattr(stage, "config", None)
    std = std if std is not None else getattr(cfg, "initializer_range", 0.02)
    stage.to_empty(device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(t: torch.Tensor) -> None:
        t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(t.dtype))

    for name, module in stage.named_modules():
        kind = type(module).__name__
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal_(module.weight)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif "RMSNorm" in kind or "LayerNorm" in kind:
            if getattr(module, "weight", None) is not None:
                module.weight.fill_(1.0)
        elif "RotaryEmbedding" in kind and hasattr(module, "inv_freq"):
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            module.inv_freq.copy_(fresh.inv_freq)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq.copy_(fresh.original_inv_freq)
        elif kind.endswith("TopKRouter") or kind == "TopKRouter":
            normal_(module.weight)
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            normal_(module.gate_up_proj)
            normal_(module.down_proj)
            ids = getattr(module, "expert_ids", None)
            if isinstance(ids, torch.Tensor):
                block = stage.get_submodule(name.rpartition(".")[0])
                start = int(getattr(block, "expert_start", 0))
                ids.copy_(torch.arange(start, start + ids.numel(), device=ids.device))
    return stage


class Pipeline:
    """This rank's stages of a pipeline and the schedule that runs them.

    ``build(stage)`` returns the full model, pruned here to the stage: either real weights
    (identical on every rank, e.g. built from one seed) or built under ``torch.device("meta")``,
    in which case only the stage is allocated and initialised (:func:`materialize`, from
    ``meta_seed + stage``; load real weights with :mod:`trainer.parallelism.broadcast`). ``step(input_ids, labels)`` runs one batch of this rank's micro-batches through the
    schedule and leaves the gradients in the stage parameters' ``.grad``; on the last stage it
    returns the per-micro-batch :class:`trainer.model.loss.MicroLoss`."""

    def __init__(self, build: Callable[[int], nn.Module], *, pp_rank: int, pp: int, group: Any, device: torch.device,
                 n_microbatches: int, schedule: str = "1f1b", virtual: int = 1,
                 loss_cfg: MoeLossConfig | FamilyLossConfig | None = None,
                 prepare: Callable[[StageModel], None] | None = None, meta_seed: int = 0) -> None:
        from torch.distributed.pipelining import PipelineStage

        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        if virtual < 1 or (virtual > 1) != (schedule == "interleaved1f1b"):
            raise ValueError(f"schedule {schedule!r} runs {'several' if schedule == 'interleaved1f1b' else 'one'} "
                             f"stage(s) per rank; got virtual={virtual}")
        num_stages = pp * virtual
        if schedule in ("1f1b", "interleaved1f1b") and n_microbatches < pp:
            raise ValueError(f"{schedule} needs at least as many micro-batches as pipeline ranks: "
                             f"{n_microbatches} < PP={pp} (raise the global batch or lower the micro-batch)")
        self.pp, self.pp_rank, self.virtual, self.num_stages = pp, pp_rank, virtual, num_stages
        self.n_microbatches = n_microbatches
        self.loss_cfg = loss_cfg
        self.modules: list[StageModel] = []
        stages = []
        for sid in stage_ids(pp_rank, pp, virtual):
            full = build(sid)
            family = isinstance(loss_cfg, FamilyLossConfig)
            if family and loss_cfg.load_balancing_coef:
                loss_cfg.aux_fn = getattr(sys.modules[type(full).__module__], "load_balancing_loss_func", None)
            mod = StageModel(full, sid, num_stages,
                             router_logits=family and loss_cfg.aux_fn is not None)
            if any(p.is_meta for p in mod.parameters()) and torch.device(device).type != "meta":
                materialize(mod, device, seed=meta_seed + sid)  # (on meta, shapes are all there is)
            else:
                mod = mod.to(device)
            if prepare is not None:
                prepare(mod)
            self.modules.append(mod)
            stage = PipelineStage(mod, sid, num_stages, device, group=group)
            self._mark_inference(stage)
            stages.append(stage)
        self.stages = stages
        self.is_last = any(m.is_last for m in self.modules)
        self.is_first = any(m.is_first for m in self.modules)
        cls = _schedule_class(schedule)
        loss_fn = self._loss if loss_cfg is not None else None
        if schedule == "interleaved1f1b":
            self.schedule = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)

    #: True while torch's pipelining runs its shape-inference forward (on the first step, before the
    #: real micro-batches, on placeholder tensors): statistics hooks must not count it.
    inferring: bool = False

    def _mark_inference(self, stage: Any) -> None:
        """Sets :attr:`inferring` around the stage's shape inference and keeps it off the random
        streams. Every release from 2.11 on runs that forward inside ``_prepare_forward_infra`` (2.11
        in ``_shape_inference``, on zeros under ``no_grad``; 2.13 in ``_forward_metadata_inference``,
        under a forked RNG), once, before the first step's micro-batches; the method the schedules
        call is wrapped rather than the inference itself, whose name changed between them."""
        inner = getattr(stage, "_prepare_forward_infra", None)
        if inner is None:
            raise RuntimeError(f"torch {torch.__version__}: PipelineStage has no _prepare_forward_infra, so its "
                               "shape-inference forward cannot be told from training (expert loads would count it): "
                               "run --pp on torch 2.11 to 2.13")
        dev = torch.device(stage.device)
        devices = [dev] if dev.type != "cpu" else []

        def marked(*args: Any, **kwargs: Any) -> Any:
            self.inferring = True
            try:
                with torch.random.fork_rng(devices=devices, device_type=dev.type if devices else "cuda"):
                    return inner(*args, **kwargs)
            finally:
                self.inferring = False
        stage._prepare_forward_infra = marked

    def _loss(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(self.loss_cfg, FamilyLossConfig):
            loss, parts = self.loss_cfg(outputs, labels)
        else:
            loss, parts = pipeline_loss(outputs, labels, self.loss_cfg)  # type: ignore[arg-type]
        self.loss_cfg.parts.append(parts)  # type: ignore[union-attr]
        return loss

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def step(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None,
             position_ids: torch.Tensor | None = None) -> list[MicroLoss]:
        """Forward and backward of ``n_microbatches`` micro-batches (split along dim 0). ``position_ids``
        (``--data.document_mask``, the same on every stage's rank) reach every stage with its micro-batch."""
        if self.loss_cfg is not None:
            self.loss_cfg.parts.clear()
        args = (input_ids,) if self.is_first else ()
        kwargs: dict[str, Any] = {} if position_ids is None else {"position_ids": position_ids}
        if self.is_last:
            kwargs["target"] = labels
        self.schedule.step(*args, **kwargs)
        if not self.is_last or self.loss_cfg is None:
            return []
        # The first step also calls the loss once for shape inference; keep the real micro-batches.
        return list(self.loss_cfg.parts[-self.n_microbatches:])


def parallelize_pipeline(cfg: TrainConfig, layout: DeviceMesh, device: torch.device, build: Callable[[int], nn.Module],
                         prepare: Callable[[nn.Module], None]) -> Pipeline:
    """This rank's stage(s) of the model ``build`` returns, each passed through ``prepare`` (TP,
    activation checkpointing), run by the schedule ``cfg`` names with the trainer's loss."""
    p, m = cfg.parallel, cfg.model
    if m.is_hf:
        loss_cfg: MoeLossConfig | FamilyLossConfig = FamilyLossConfig(
            num_experts=m.num_experts, top_k=m.top_k, load_balancing_coef=m.load_balancing_coef)
    else:
        loss_cfg = MoeLossConfig(num_layers=m.num_layers, num_experts=m.num_experts if m.is_moe else 0,
                                 top_k=m.top_k if m.is_moe else 0,
                                 load_balancing_coef=m.load_balancing_coef, z_loss_coef=m.z_loss_coef)
    return Pipeline(
        build, pp_rank=layout.pp_rank, pp=p.pp, group=pp_group(layout), device=device,
        n_microbatches=cfg.schedule.global_batch // (layout.data_world * cfg.schedule.micro_batch),
        schedule=p.pp_schedule, loss_cfg=loss_cfg, prepare=prepare, meta_seed=cfg.seed)

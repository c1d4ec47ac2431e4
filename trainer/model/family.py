"""Training any transformers MoE causal LM (``--model.arch hf``) with ``experts_implementation="fastmoe"``.

The model is ``AutoModelForCausalLM.from_config(cfg, experts_implementation=...)`` where ``cfg`` is

* a ``config.json`` (``--model.hf_config PATH``, a file or a directory holding one): the file is the
  model, and the trainer's size fields (layers, width, experts, top-k, vocabulary) are read from it;
* or a family's tiny config (``--model.hf_family NAME``, the ``tiny-qwen3-moe`` and
  ``tiny-deepseek-v3`` presets): :func:`fastmoe_xpu.integrations.families.tiny_config` with the
  trainer's size fields written onto the family's own field names.

Each family keeps its own router, shared experts and auxiliary losses:

* families whose causal LM has ``output_router_logits`` (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS, ...)
  return their own load-balancing ``aux_loss``; the trainer adds ``router_aux_loss_coef * aux_loss``
  (the family's coefficient, from its config) averaged over the global batch's micro-batches, as the
  family's own ``forward(labels=...)`` would for one batch. No family defines a z-loss: it is 0.
* routers with a score-correction bias (DeepSeek-V3's ``e_score_correction_bias``, aux-loss-free
  balancing) get no auxiliary loss; after every optimizer step the trainer moves each layer's bias by
  ``bias += rate * sign(mean_load - load)`` from the step's expert loads summed over data-parallel
  ranks (the DeepSeek-V3 report's update; ``--model.router_bias_update_rate``, 0 turns it off). The
  bias is a buffer, not a weight: checkpoints carry it in their metadata.

Per-expert load is measured where every family agrees: a forward pre-hook on each decorated experts
module reads the ``top_k_index`` it is handed (on the device; one all-reduce and one host read per
step). Data, expert and pipeline parallelism, activation checkpointing and compilation are applied
as for the OLMoE model (:func:`trainer.parallelism.apply.parallelize`, :mod:`trainer.parallelism.ep`,
:mod:`trainer.parallelism.pipeline`); TP is refused by :func:`trainer.config.hf.check_hf`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..config.errors import ConfigError
from ..config.hf import EXPERTS_IMPLEMENTATIONS, family_losses, hf_model_config


def build_hf_model(m: ModelConfig, context: int, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The family's causal LM with weights drawn from ``seed``; ConfigError if it has no decorated experts."""
    from transformers import AutoModelForCausalLM

    import fastmoe_xpu  # noqa: F401  (registers "fastmoe" in transformers' experts interface)

    cfg = hf_model_config(m, context)
    if m.vocab_size:
        cfg.vocab_size = m.vocab_size
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=EXPERTS_IMPLEMENTATIONS[m.moe_impl])
    except ValueError as e:
        raise ConfigError(f"{cfg.model_type}: cannot build a causal LM with experts_implementation: {e}") from None
    if not experts_modules(model):
        raise ConfigError(f"{cfg.model_type} has no experts module decorated with @use_experts_implementation; "
                          "--model.arch hf trains MoE families only")
    if m.expert_precision != "none":
        for mod in experts_modules(model).values():  # read by the "fastmoe" experts function
            mod.fastmoe_expert_precision = m.expert_precision
    model = model.to(device=device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[m.param_dtype])
    for router in bias_routers(model).values():  # the bias stays fp32, as the family loads it
        router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()
    return model


def _layer_of(name: str) -> int:
    try:
        return int(name.split("layers.")[1].split(".")[0])
    except (IndexError, ValueError):
        raise ValueError(f"cannot find the layer index in module name {name!r}") from None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """transformers decoder layers of ``model`` (anything with self_attn, mlp and the two norms)."""
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))]


def experts_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{layer: experts module} of every decorated experts module, by layer."""
    return {_layer_of(n): mod for n, mod in model.named_modules()
            if hasattr(mod, "is_concatenated") and hasattr(mod, "has_gate") and isinstance(getattr(mod, "num_experts", None), int)}


def bias_routers(model: nn.Module) -> dict[int, nn.Module]:
    """{layer: router} of every router with a score-correction bias (``e_score_correction_bias``)."""
    return {_layer_of(n): mod for n, mod in model.named_modules()
            if isinstance(getattr(mod, "e_score_correction_bias", None), torch.Tensor) and "layers." in n}




class HfMoeRun:
    """The ``arch="hf"`` parts of a training step: forward/backward through the family's causal LM
    with its own auxiliary loss, per-expert load from the experts' inputs, and the bias update."""

    def __init__(self, model: nn.Module, m: Any, device: torch.device) -> None:
        self.m = m
        self.experts = experts_modules(model)
        self.layers = sorted(self.experts)
        self.E = m.num_experts
        self.routers = bias_routers(model)
        self.rate = m.router_bias_update_rate if self.routers else 0.0
        self.router_logits = hasattr(model.config, "output_router_logits")
        self.loads = torch.zeros(len(self.layers), self.E, dtype=torch.float64, device=device)
        self._handles = [self.experts[layer].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(self.layers)]
        _, _, self.loss_description = family_losses(model.config)
        #: ``() -> bool``: True while a forward must not be counted (a pipeline's shape inference)
        self.paused = lambda: False

    def _hook(self, row: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training or self.paused():
                return
            # a recompute in backward (activation checkpointing) must not count twice; traced, the
            # graph's backward recomputes without running this hook, and the check cannot be traced
            if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
                return
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            with torch.no_grad():
                self.loads[row] += torch.bincount(idx.reshape(-1), minlength=self.E)[:self.E].to(self.loads.dtype)
        return hook

    def forward_backward(self, trainer: Any, micro_batches: Sequence[Any], global_targets: float) -> Any:
        """Like :meth:`trainer.trainer.Trainer.forward_backward`: returns the global sums."""
        from .loss import MicroLoss, _lm_loss, all_reduce_loss
        from .documents import document_kwargs

        acc: MicroLoss | None = None
        nmb = trainer.micro_batches_global
        for mb in micro_batches:
            input_ids = mb[0].to(trainer.device, non_blocking=True)
            labels = mb[1].to(trainer.device, non_blocking=True)
            kw = {"output_router_logits": True} if self.router_logits else {}
            kw.update(document_kwargs(input_ids, trainer.document_eos))
            with trainer._autocast():
                out = trainer.model(input_ids=input_ids, use_cache=False, **kw)
            loss, lm = _lm_loss(out.logits, labels, global_targets)
            lb = torch.zeros((), device=loss.device)
            aux = getattr(out, "aux_loss", None)
            if aux is not None and self.m.load_balancing_coef:
                lb = aux.float() / nmb
                loss = loss + self.m.load_balancing_coef * lb
            loss.backward()
            part = MicroLoss(lm, lb.detach(), torch.zeros((), device=loss.device), torch.zeros(0, device=loss.device))
            trainer._local_loss = loss.detach() if acc is None else trainer._local_loss + loss.detach()
            acc = part if acc is None else acc + part
        assert acc is not None
        return all_reduce_loss([acc], 0, trainer.layout.dpep_group, trainer.device)

    @torch.no_grad()
    def end_step(self, group: Any, stages_group: Any = None) -> dict[str, Any]:
        """After the optimizer step: the step's loads summed over ``group`` (one all-reduce, one host
        read), the bias update, and the step's load metrics. Resets the loads. ``stages_group`` (a
        pipeline's PP group): each stage updates its own layers' biases, and the metrics cover every
        stage's layers (their rows gathered over it, in layer order)."""
        from ..layout import all_reduce_sum

        all_reduce_sum(self.loads, group)
        loads = self.loads.clone()
        self.loads.zero_()
        for i, layer in enumerate(self.layers):
            router = self.routers.get(layer)
            if router is not None and self.rate > 0:
                load = loads[i]
                b = router.e_score_correction_bias
                b += (self.rate * torch.sign(load.mean() - load)).to(b.dtype)
        rows = loads.cpu()
        biases = {layer: float(r.e_score_correction_bias.abs().max()) for layer, r in self.routers.items()}
        if stages_group is not None:
            import torch.distributed as dist

            mine = ({layer: rows[i] for i, layer in enumerate(self.layers)}, biases)
            parts: list[Any] = [None] * dist.get_world_size(stages_group)
            dist.all_gather_object(parts, mine, group=stages_group)
            by_layer = {k: v for part, _ in parts for k, v in part.items()}
            biases = {k: v for _, b in parts for k, v in b.items()}
            rows = torch.stack([by_layer[k] for k in sorted(by_layer)]) if by_layer else rows
        per_layer = [[int(v) for v in r.tolist()] for r in rows]
        mean_e = rows.mean(0)
        mu = float(mean_e.mean())
        cv = [float(r.std(unbiased=False) / r.mean()) if float(r.mean()) > 0 else 0.0 for r in rows]
        rec: dict[str, Any] = {
            "tokens_per_expert": mean_e.tolist(), "moe_tokens_per_expert": per_layer, "moe_load_cv": cv,
            "moe_load_min": [float(r.min()) for r in rows], "moe_load_max": [float(r.max()) for r in rows],
            "expert_load_max_over_mean": float(mean_e.max()) / mu if mu > 0 else 0.0,
        }
        if biases:
            rec["router_bias_absmax"] = [biases[layer] for layer in sorted(biases)]
        return rec

    def state(self, stages_group: Any = None) -> dict[str, Any]:
        """The routers' biases (buffers, which the checkpoint's weights do not carry), by layer;
        with a pipeline's ``stages_group`` every stage's (collective over it)."""
        mine = {str(layer): r.e_score_correction_bias.detach().float().cpu().tolist()
                for layer, r in self.routers.items()}
        if stages_group is None:
            return mine
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(stages_group)
        dist.all_gather_object(parts, mine, group=stages_group)
        return {k: v for part in parts for k, v in part.items()}

    def load_state(self, state: dict[str, Any] | None) -> None:
        for layer, values in (state or {}).items():
            if int(layer) not in self.routers:  # another pipeline stage's layer
                continue
            b = self.routers[int(layer)].e_score_correction_bias
            b.copy_(torch.tensor(values, dtype=b.dtype, device=b.device))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

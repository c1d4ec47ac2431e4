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
step). Only data parallelism is supported here: EP, PP, TP and activation checkpointing target the
OLMoE block and are refused for ``arch="hf"`` by :func:`check_hf`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
import torch.nn as nn

from .config import ConfigError, ModelConfig, TrainConfig

#: ``moe_impl`` -> ``experts_implementation`` for ``arch="hf"``.
EXPERTS_IMPLEMENTATIONS = {"fastmoe": "fastmoe", "hf": "eager"}

#: The trainer's size fields and, in order of preference, the family config fields they map to.
_SIZE_FIELDS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "num_heads": ("num_attention_heads",),
    "intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok",),
}


def _first(cfg: Any, names: Sequence[str]) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def load_config_file(path: str) -> Any:
    """The transformers config of a ``config.json`` (or a directory holding one); ConfigError otherwise."""
    from transformers import CONFIG_MAPPING

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f"--model.hf_config {path}: no such config.json")
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model.hf_config {file} is not a JSON file: {e}") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ConfigError(f"--model.hf_config {file} has no 'model_type' (a transformers config.json has one)")
    mt = d["model_type"]
    if mt not in CONFIG_MAPPING:
        raise ConfigError(f"--model.hf_config {file}: transformers knows no model_type {mt!r}")
    try:
        return CONFIG_MAPPING[mt].from_dict(d)
    except Exception as e:  # a field the config class rejects
        raise ConfigError(f"--model.hf_config {file}: {type(e).__name__}: {e}") from None


def family_config(m: ModelConfig, context: int, vocab_size: int) -> Any:
    """The tiny config of ``m.hf_family`` with the trainer's sizes on the family's own field names."""
    from transformers import CONFIG_MAPPING

    from fastmoe_xpu.integrations.families import tiny_config

    try:
        base = tiny_config(m.hf_family)
    except ValueError as e:
        raise ConfigError(f"--model.hf_family: {e}") from None
    known = set(CONFIG_MAPPING[base.model_type]().to_dict()) | set(vars(base))
    over: dict[str, Any] = {"hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
                            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
                            "num_experts_per_tok": m.top_k, "vocab_size": vocab_size,
                            "max_position_embeddings": max(context, 1), "initializer_range": m.init_std,
                            "norm_topk_prob": m.norm_topk_prob, "use_cache": False,
                            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
    if "moe_intermediate_size" in known:
        over["moe_intermediate_size"] = m.intermediate_size
    over["intermediate_size"] = m.intermediate_size
    for n in _SIZE_FIELDS["num_experts"]:
        if n in known:
            over[n] = m.num_experts
    if "head_dim" in known and getattr(base, "qk_rope_head_dim", None) is None:  # MLA derives its head sizes
        over["head_dim"] = m.head_dim
    over = {k: v for k, v in over.items() if k in known}
    try:
        return tiny_config(m.hf_family, **over)
    except Exception as e:
        raise ConfigError(f"--model.hf_family {m.hf_family}: {type(e).__name__}: {e}") from None


def hf_model_config(m: ModelConfig, context: int) -> Any:
    """The transformers config ``arch="hf"`` builds (``m`` checked by :func:`check_hf`)."""
    if m.hf_config:
        cfg = load_config_file(m.hf_config)
    else:
        cfg = family_config(m, context, m.vocab_size or 258)
    cfg.use_cache = False
    if hasattr(cfg, "output_router_logits"):
        cfg.output_router_logits = False  # the trainer asks per call
    return cfg


def family_losses(cfg: Any) -> tuple[float, float, str]:
    """(load-balancing coefficient, z-loss coefficient, a description) the family defines."""
    if hasattr(cfg, "output_router_logits") and getattr(cfg, "router_aux_loss_coef", None) is not None:
        coef = float(cfg.router_aux_loss_coef)
        return coef, 0.0, f"the family's load-balancing aux_loss x router_aux_loss_coef={coef:g}"
    return 0.0, 0.0, "no auxiliary loss (the family defines none)"


def check_hf(cfg: TrainConfig) -> None:
    """:func:`trainer.config.validate` for ``arch="hf"``: refuse what is not supported, load the
    transformers config, and fill the trainer's size fields and loss coefficients from it."""
    m, p = cfg.model, cfg.parallel
    if bool(m.hf_config) == bool(m.hf_family):
        raise ConfigError("--model.arch hf needs exactly one of --model.hf_config PATH (a config.json) or "
                          "--model.hf_family NAME (a transformers MoE family, e.g. qwen3_moe)")
    for name, value in (("parallel.ep", p.ep), ("parallel.pp", p.pp), ("parallel.tp", p.tp)):
        if value != 1:
            raise ConfigError(f"--{name} {value}: --model.arch hf trains any transformers MoE family with data "
                              "parallelism only; EP, PP and TP are implemented for the OLMoE block (--model.arch olmoe)")
    if p.ac:
        raise ConfigError(f"--parallel.ac {p.ac!r}: activation checkpointing targets the OLMoE block; "
                          "not supported with --model.arch hf")
    if getattr(m, "compile", False):
        raise ConfigError("--model.compile compiles the OLMoE decoder stack; not supported with --model.arch hf")
    if cfg.eval.export_hf:
        raise ConfigError("--eval.export_hf: the transformers export covers OLMoE and OLMo runs; export of "
                          "--model.arch hf runs is not implemented (refused before training rather than after it)")
    if m.forced_uniform_routing:
        raise ConfigError("--model.forced_uniform_routing needs the OLMoE block (--model.arch olmoe)")
    if m.router_bias_update_rate < 0:
        raise ConfigError(f"--model.router_bias_update_rate must be >= 0, got {m.router_bias_update_rate}")
    hf = hf_model_config(m, cfg.data.context)
    if m.hf_config:
        vals = {k: _first(hf, names) for k, names in _SIZE_FIELDS.items()}
        missing = [k for k in ("num_experts", "top_k") if not isinstance(vals[k], int)]
        if missing:
            raise ConfigError(f"--model.hf_config {m.hf_config} ({hf.model_type}) is not a mixture of experts: no "
                              f"{' / '.join(_SIZE_FIELDS[missing[0]])} field")
        for k, v in vals.items():
            if isinstance(v, int):
                setattr(m, k, v)
        m.head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        m.vocab_size = int(hf.vocab_size)
    if not 1 <= m.top_k <= m.num_experts:
        raise ConfigError(f"need 1 <= top_k <= num_experts, got top_k={m.top_k}, num_experts={m.num_experts}")
    m.load_balancing_coef, m.z_loss_coef, _ = family_losses(hf)


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
    model = model.to(device=device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[m.param_dtype])
    for router in bias_routers(model).values():  # the bias stays fp32, as the family loads it
        router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()
    return model


def _layer_of(name: str) -> int:
    try:
        return int(name.split("layers.")[1].split(".")[0])
    except (IndexError, ValueError):
        raise ValueError(f"cannot find the layer index in module name {name!r}") from None


def experts_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{layer: experts module} of every decorated experts module, by layer."""
    return {_layer_of(n): mod for n, mod in model.named_modules()
            if hasattr(mod, "is_concatenated") and hasattr(mod, "has_gate") and isinstance(getattr(mod, "num_experts", None), int)}


def bias_routers(model: nn.Module) -> dict[int, nn.Module]:
    """{layer: router} of every router with a score-correction bias (``e_score_correction_bias``)."""
    return {_layer_of(n): mod for n, mod in model.named_modules()
            if isinstance(getattr(mod, "e_score_correction_bias", None), torch.Tensor) and "layers." in n}


def hf_param_counts(m: ModelConfig, vocab_size: int | None = None) -> Any:
    """:class:`trainer.model.ParamCounts` of ``arch="hf"``, counted on a meta-device build."""
    from transformers import AutoModelForCausalLM

    from .model import ParamCounts, is_expert_param

    cfg = hf_model_config(m, 1)
    if vocab_size or m.vocab_size:
        cfg.vocab_size = vocab_size or m.vocab_size
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = expert = 0
    for n, p in model.named_parameters():
        total += p.numel()
        if is_expert_param(n):
            expert += p.numel()
    embed = model.get_input_embeddings().weight.numel()
    active = total - expert + (expert * m.top_k) // max(m.num_experts, 1)
    return ParamCounts(total=total, active=active, embedding=embed, expert=expert)


class HfMoeRun:
    """The ``arch="hf"`` parts of a training step: forward/backward through the family's causal LM
    with its own auxiliary loss, per-expert load from the experts' inputs, and the bias update."""

    def __init__(self, model: nn.Module, m: ModelConfig, device: torch.device) -> None:
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

    def _hook(self, row: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training or torch._C._current_graph_task_id() != -1:  # eval, or a recompute in backward
                return
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            with torch.no_grad():
                self.loads[row] += torch.bincount(idx.reshape(-1), minlength=self.E)[:self.E].to(self.loads.dtype)
        return hook

    def forward_backward(self, trainer: Any, micro_batches: Sequence[Any], global_targets: float) -> Any:
        """Like :meth:`trainer.trainer.Trainer.forward_backward`: returns the global sums."""
        from .loss import MicroLoss, _lm_loss, all_reduce_loss

        acc: MicroLoss | None = None
        nmb = trainer.micro_batches_global
        for mb in micro_batches:
            input_ids = mb[0].to(trainer.device, non_blocking=True)
            labels = mb[1].to(trainer.device, non_blocking=True)
            kw = {"output_router_logits": True} if self.router_logits else {}
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
    def end_step(self, group: Any) -> dict[str, Any]:
        """After the optimizer step: the step's loads summed over ``group`` (one all-reduce, one host
        read), the bias update, and the step's load metrics. Resets the loads."""
        from .layout import all_reduce_sum

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
        per_layer = [[int(v) for v in r.tolist()] for r in rows]
        mean_e = rows.mean(0)
        mu = float(mean_e.mean())
        cv = [float(r.std(unbiased=False) / r.mean()) if float(r.mean()) > 0 else 0.0 for r in rows]
        rec: dict[str, Any] = {
            "tokens_per_expert": mean_e.tolist(), "moe_tokens_per_expert": per_layer, "moe_load_cv": cv,
            "moe_load_min": [float(r.min()) for r in rows], "moe_load_max": [float(r.max()) for r in rows],
            "expert_load_max_over_mean": float(mean_e.max()) / mu if mu > 0 else 0.0,
        }
        if self.routers:
            rec["router_bias_absmax"] = [float(self.routers[layer].e_score_correction_bias.abs().max())
                                         for layer in sorted(self.routers)]
        return rec

    def state(self) -> dict[str, Any]:
        """The routers' biases (buffers, which the checkpoint's weights do not carry), by layer."""
        return {str(layer): r.e_score_correction_bias.detach().float().cpu().tolist()
                for layer, r in self.routers.items()}

    def load_state(self, state: dict[str, Any] | None) -> None:
        for layer, values in (state or {}).items():
            b = self.routers[int(layer)].e_score_correction_bias
            b.copy_(torch.tensor(values, dtype=b.dtype, device=b.device))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

"""Configs of transformers MoE families for ``--model.arch hf``: reading a ``config.json``, a
family's tiny config with the trainer's sizes, the family's auxiliary-loss settings, and the checks
that :func:`trainer.config.validate` runs on such a config (see :mod:`trainer.model.family` for training).

A leaf of the trainer: ``config`` imports it for its checks, so nothing here imports ``config`` back
(its dataclasses are typed ``Any`` below: ``m`` is a ``ModelConfig``, ``cfg`` a ``TrainConfig``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from .errors import ConfigError

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


#: Fields a family's ``config.json`` must set itself (any one name of a tuple): left out, the config
#: class would fill in its own default (Qwen3-MoE: 128 experts, a 151,936-token vocabulary), a model
#: nobody asked for.
REQUIRED_FIELDS: tuple[tuple[str, ...], ...] = (
    ("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",),
    _SIZE_FIELDS["intermediate_size"], _SIZE_FIELDS["num_experts"], _SIZE_FIELDS["top_k"],
)


def missing_fields(d: dict[str, Any]) -> list[str]:
    """The :data:`REQUIRED_FIELDS` that the config dict ``d`` does not set (alternatives joined by " / ")."""
    return [" / ".join(names) for names in REQUIRED_FIELDS if not any(d.get(n) is not None for n in names)]


def load_config_file(path: str) -> Any:
    """The transformers config of a ``config.json`` (or a directory holding one); ConfigError otherwise,
    also when the file leaves out a field the model needs (:data:`REQUIRED_FIELDS`)."""
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
        cfg = CONFIG_MAPPING[mt].from_dict(d)
    except Exception as e:  # a field the config class rejects
        raise ConfigError(f"--model.hf_config {file}: {type(e).__name__}: {e}") from None
    if _first(cfg, _SIZE_FIELDS["num_experts"]) is None:
        raise ConfigError(f"--model.hf_config {file} ({mt}) is not a mixture of experts: no "
                          f"{' / '.join(_SIZE_FIELDS['num_experts'])} field")
    missing = missing_fields(d)
    if missing:
        raise ConfigError(f"--model.hf_config {file} ({mt}) does not set {', '.join(missing)}: the model needs "
                          f"{'it' if len(missing) == 1 else 'them'} (the config class's default would be a "
                          "different model); add the field to the file")
    return cfg


def family_config(m: Any, context: int, vocab_size: int) -> Any:
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


def hf_model_config(m: Any, context: int) -> Any:
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


def check_hf(cfg: Any) -> None:
    """:func:`trainer.config.validate` for ``arch="hf"``: refuse what is not supported, load the
    transformers config, and fill the trainer's size fields and loss coefficients from it."""
    m, p = cfg.model, cfg.parallel
    if bool(m.hf_config) == bool(m.hf_family):
        raise ConfigError("--model.arch hf needs exactly one of --model.hf_config PATH (a config.json) or "
                          "--model.hf_family NAME (a transformers MoE family, e.g. qwen3_moe)")
    if p.tp != 1:
        raise ConfigError(f"--parallel.tp {p.tp}: --model.arch hf trains any transformers MoE family with data, "
                          "expert and pipeline parallelism (--ep, --pp); TP is implemented for the dense model "
                          "(--model.arch olmo)")
    if p.pp > 1 and p.pp_meta_init:
        raise ConfigError("--parallel.pp_meta_init initialises stages as OLMoE does; a family's stages are built "
                          "from the seed instead (drop --parallel.pp_meta_init)")
    if p.ep > 1 and m.moe_impl != "fastmoe":
        raise ConfigError(f"expert parallelism (EP={p.ep}) needs --model.moe_impl fastmoe, got {m.moe_impl!r}")
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
    if m.num_experts % p.ep:
        raise ConfigError(f"num_experts={m.num_experts} is not divisible by EP={p.ep}")
    m.load_balancing_coef, m.z_loss_coef, _ = family_losses(hf)

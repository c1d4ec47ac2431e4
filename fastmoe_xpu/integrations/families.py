"""The transformers model families whose experts use ``@use_experts_implementation``, and tiny configs for them.

Found by reading the installed transformers' ``models/*/modeling_*.py`` sources (no model module is
imported to list them), with the decorator's layout flags as written there. :func:`tiny_config`
builds a few-experts, two-layer config of a family for tests, the trainer's presets and docs.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_DECORATOR = re.compile(r"^@use_experts_implementation(\((?P<args>[^)]*)\))?\s*\nclass (?P<cls>\w+)", re.M)

#: Overrides applied to a family's default config where the field exists: small everything, MoE in
#: every layer, no dense prefix, few experts, top-2.
TINY_FIELDS: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 24, "expert_hidden_size": 24, "ffn_hidden_size": 48,
    "num_hidden_layers": 2, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "first_k_dense_replace": 0, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_layer_start_index": 0,
    "max_position_embeddings": 64, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 16, "sliding_window": 16, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "router_jitter_noise": 0.0, "tie_word_embeddings": False,
}

#: What a family needs beyond :data:`TINY_FIELDS` to put experts in a tiny two-layer model.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "beam": {"mlp_layer_types": ["sparse", "sparse"]},
    "gemma4": {"enable_moe_block": True, "top_k_experts": 2, "num_experts": 4, "moe_intermediate_size": 24},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "zaya": {"num_experts_per_tok": 1},  # the family routes one expert per token only
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8},
    "ernie4_5_vl_moe": {"moe_intermediate_size": [24, 24], "moe_num_experts": [4, 4]},
    # its multimodal RoPE sections (time, height, width) must sum to half the tiny RoPE head size
    "hy_v4_vl": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}},
}

#: Families the tiny walk cannot build, with the reason (the test checks each still fails, so the
#: list stays true). None of the reasons is in the experts: each stops before the first MoE layer.
NOT_BUILT_TINY: dict[str, str] = {
    "bailing_hybrid": "its linear-attention head width derives to 0 at hidden size 32",
    "deepseek_ocr2": "no causal LM or base model is registered for its text config (OCR wrapper)",
    "diffusion_gemma": "no causal LM or base model is registered for its text config (diffusion wrapper)",
    "ernie4_5_vl_moe": "per-modality expert lists fail the config's field validation when shrunk",
    "glm4v_moe": "its multimodal RoPE sections are fixed to the published head size",
    "glm5_next": "its DSA attention layers require a configuration without RoPE dims (not derivable tiny)",
    "inkling": "transformers registers no config for it",
    "kimi_linear": "its linear-attention layer schedule indexes past a two-layer model",
    "mimo_v2_flash": "its attention sink/value head sizes do not follow the tiny head size",
    "mistral4": "its attention's RoPE split does not follow the tiny head size",
    "qwen3_omni_moe": "no causal LM or base model is registered for its thinker config (omni wrapper)",
    "unlimited_ocr": "no causal LM or base model is registered for its text config (OCR wrapper)",
}


@dataclass
class Family:
    """One model family with decorated experts."""

    name: str
    """The folder under ``transformers/models`` (usually the ``model_type``)."""
    experts_classes: list[str]
    flags: dict[str, bool] = field(default_factory=dict)
    """The decorator's keyword arguments as written (defaults omitted)."""
    custom_gate: bool = False
    """Whether the module defines its own ``_apply_gate``."""


def _models_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


def discover_families() -> list[Family]:
    """Every family in the installed transformers whose experts class uses the decorator, by name."""
    found: list[Family] = []
    for path in sorted(_models_dir().glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "@use_experts_implementation" not in text:
            continue
        classes, flags = [], {}
        for m in _DECORATOR.finditer(text):
            classes.append(m.group("cls"))
            for kv in filter(None, (m.group("args") or "").split(",")):
                k, _, v = kv.partition("=")
                flags[k.strip()] = ast.literal_eval(v.strip())
        if not classes:
            continue
        name = path.parent.name
        if found and found[-1].name == name:  # a second modeling file in the same folder
            found[-1].experts_classes += classes
            continue
        found.append(Family(name, classes, flags, "def _apply_gate" in text))
    return found


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family`` (a ``transformers.models`` folder name or a ``model_type``), built
    for a causal LM: the family's own defaults with :data:`TINY_FIELDS` where those fields exist.
    A multimodal family gives its text config. Raises ValueError when transformers knows no config."""
    from transformers import CONFIG_MAPPING

    model_type = family if family in CONFIG_MAPPING else family.replace("_", "-")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"transformers has no config for model family {family!r}")
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    if isinstance(defaults.get("text_config"), dict):  # multimodal: the language model's config
        text_type = defaults["text_config"].get("model_type")
        if not text_type or text_type not in CONFIG_MAPPING:
            raise ValueError(f"{family}: cannot find the text config class")
        cls = CONFIG_MAPPING[text_type]
        defaults = cls().to_dict()
    kwargs = {k: v for k, v in TINY_FIELDS.items() if k in defaults}
    if defaults.get("q_lora_rank") is None:
        kwargs.pop("q_lora_rank", None)
    kwargs.update({k: v for k, v in FAMILY_OVERRIDES.get(family, {}).items()})
    kwargs.update(overrides)
    return cls(**kwargs)


def build_model(config: Any, experts_implementation: str = "eager") -> tuple[Any, bool]:
    """``(model, is_causal_lm)``: the family's causal LM for ``config``, or its base model where
    transformers registers none for this (text) config."""
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, experts_implementation=experts_implementation), True
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
    return AutoModel.from_config(config, experts_implementation=experts_implementation), False

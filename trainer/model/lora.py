"""LoRA fine-tuning of the expert weights: ``--lora.rank R --lora.alpha A --lora.targets gate_up_proj,down_proj``.

The model is built and its weights loaded as for any run (``--model.init_from`` names a transformers
checkpoint directory or weights file); then PEFT's ``inject_adapter_in_model`` wraps the targeted 3-D
expert parameters (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...])``) in place and
freezes everything else. The MoE layers (``FastSparseMoeBlock`` or a family's experts with
``experts_implementation="fastmoe"``) run the adapters inside their grouped GEMMs, so the optimizer
holds the adapters only, and checkpoints carry them with the model. At the end of the run the adapter
is written in PEFT's own layout (``adapter_config.json``, ``adapter_model.safetensors``), which stock
PEFT loads onto the base checkpoint (``PeftModel.from_pretrained``) and can merge
(``merge_and_unload``).

One process, one model: data parallelism only (no EP, PP or TP split of the adapters), eager.
"""
from __future__ import annotations

import os
from typing import Any

import torch.nn as nn

from ..config import lora_targets
from ..config.errors import ConfigError

#: The name of every adapter file's keys start with, as ``PeftModel.save_pretrained`` writes them.
PEFT_PREFIX = "base_model.model."


def peft_config(section: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=section.rank, lora_alpha=section.alpha,
                      target_parameters=[f"mlp.experts.{t}" for t in lora_targets(section)])


def apply_lora(model: nn.Module, section: Any) -> Any:
    """Wraps ``model``'s targeted expert weights with PEFT's adapters in place and freezes the rest;
    returns the PEFT ``LoraConfig``."""
    try:
        from peft import inject_adapter_in_model
    except ImportError as err:
        raise ConfigError("--lora.rank needs the peft package (scripts/setup_venv.sh installs it)") from err
    from fastmoe_xpu.integrations.experts import run_adapters_in_experts

    config = peft_config(section)
    inject_adapter_in_model(config, model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"--lora.targets {section.targets!r} matched no expert weight of this model")
    # a family's experts take the adapters directly, without PEFT's per-call parametrization (and its fold)
    run_adapters_in_experts(model)
    return config


def export_adapter(model: nn.Module, config: Any, out_dir: str) -> str:
    """Writes the adapter in PEFT's layout to ``out_dir``; returns the directory."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    state = {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    return out_dir

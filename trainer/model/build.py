"""Model construction, parameter counts and the FLOP formula behind MFU.

Models are transformers' ``OlmoeForCausalLM`` / ``OlmoForCausalLM`` built from a config (nothing is
downloaded), with ``fastmoe_xpu.patch_olmoe`` swapping in FastSparseMoeBlock for ``moe_impl="fastmoe"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fastmoe_xpu.dist.sharding import is_expert_weight

from ..config import ConfigError, ModelConfig


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def hf_config(m: ModelConfig, context: int) -> Any:
    """The transformers config of ``m`` (OlmoeConfig or OlmoConfig)."""
    if m.vocab_size < 1:
        raise ConfigError("model.vocab_size is not set (0 means: take it from the data manifest first)")
    common = dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads,
        max_position_embeddings=max(context, 1), initializer_range=m.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        pad_token_id=None, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, use_cache=False,
    )
    if m.arch == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(
            **common, num_experts=m.num_experts, num_experts_per_tok=m.top_k, norm_topk_prob=m.norm_topk_prob,
            router_aux_loss_coef=m.load_balancing_coef, output_router_logits=False,
        )
    from transformers import OlmoConfig

    return OlmoConfig(**common)


def build_model(m: ModelConfig, context: int, *, seed: int, device: torch.device | str = "cpu",
                ep_group: Any = None, ep_size: int = 1) -> nn.Module:
    """Build the model with weights drawn from ``seed`` (identical on every rank), patched with
    FastSparseMoeBlock when ``m.moe_impl == "fastmoe"``; with EP, each rank keeps its own experts.
    ``arch="hf"``: any transformers MoE family (:func:`trainer.model.family.build_hf_model`)."""
    if m.is_hf:
        from .family import build_hf_model

        return build_hf_model(m, context, seed=seed, device=device)
    cfg = hf_config(m, context)
    torch.manual_seed(seed)
    if m.arch == "olmoe":
        from transformers import OlmoeForCausalLM

        model = OlmoeForCausalLM(cfg)
        if m.moe_impl == "fastmoe":
            patch_moe(model, backend=m.moe_backend, forced_uniform_routing=m.forced_uniform_routing,
                      ep_group=ep_group, ep_size=ep_size, dispatch=m.ep_dispatch, check_inputs=m.ep_check_inputs,
                      gemm_engine=m.gemm_engine, expert_precision=expert_precision(m))
        elif m.forced_uniform_routing:
            raise ConfigError("forced_uniform_routing needs --model.moe_impl fastmoe")
    else:
        from transformers import OlmoForCausalLM

        model = OlmoForCausalLM(cfg)
    return model.to(device=device, dtype=torch_dtype(m.param_dtype))


def patch_moe(model: nn.Module, *, backend: str, forced_uniform_routing: bool, ep_group: Any, ep_size: int,
              dispatch: str = "allgather", check_inputs: bool = False, gemm_engine: str = "auto",
              expert_precision: str | None = None) -> int:
    """``fastmoe_xpu.patch_olmoe``; under EP (``ep_size > 1``) each block keeps this rank's experts
    and exchanges tokens over ``ep_group``."""
    from fastmoe_xpu import patch_olmoe

    if ep_size > 1:
        return patch_olmoe(model, backend=backend, forced_uniform_routing=forced_uniform_routing, ep_group=ep_group,
                           dispatch=dispatch, check_inputs=check_inputs, gemm_engine=gemm_engine,
                           expert_precision=expert_precision)
    return patch_olmoe(model, backend=backend, forced_uniform_routing=forced_uniform_routing, gemm_engine=gemm_engine,
                       expert_precision=expert_precision)


def expert_precision(m: Any) -> str | None:
    """``--model.expert_precision`` as the block's argument (``"none"`` -> None)."""
    return None if m.expert_precision == "none" else m.expert_precision


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model config (whole model, not one EP shard)."""

    total: int
    """Every parameter."""
    active: int
    """Parameters one token uses: all but the (E - K) unchosen experts of every layer."""
    embedding: int
    """The input embedding (vocab x hidden), a lookup rather than a matmul."""
    expert: int
    """All expert weights (0 for a dense model)."""

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in matmuls (everything but the input embedding)."""
        return self.active - self.embedding


def param_counts(m: ModelConfig, vocab_size: int | None = None) -> ParamCounts:
    """Count parameters from the config alone, as the transformers classes lay them out
    (no model is built, so this works for the 220B preset); ``arch="hf"`` counts a meta-device build."""
    if m.is_hf:
        return _hf_param_counts(m, vocab_size)
    V = vocab_size or m.vocab_size
    H, L, I = m.hidden_size, m.num_layers, m.intermediate_size
    attn = 4 * H * m.num_heads * m.head_dim
    embed = V * H
    lm_head = V * H
    if m.arch == "olmoe":
        norms = 4 * H  # input, post-attention, q_norm and k_norm RMSNorm weights
        router = m.num_experts * H
        one_expert = 3 * I * H
        per_layer_total = attn + norms + router + m.num_experts * one_expert
        per_layer_active = attn + norms + router + m.top_k * one_expert
        expert = L * m.num_experts * one_expert
        final_norm = H
    else:  # OLMo's LayerNorms have no weights
        per_layer_total = per_layer_active = attn + 3 * I * H
        expert = 0
        final_norm = 0
    total = L * per_layer_total + embed + lm_head + final_norm
    active = L * per_layer_active + embed + lm_head + final_norm
    return ParamCounts(total=total, active=active, embedding=embed, expert=expert)


def flops_per_token(m: ModelConfig, context: int, vocab_size: int | None = None) -> int:
    """Training FLOPs per token, ``6 * N_active + 12 * L * heads * head_dim * T`` (PaLM's formula:
    matmuls of the active weights forward and backward, plus attention scores and values), where
    N_active excludes the input embedding lookup."""
    n = param_counts(m, vocab_size).active_matmul
    return 6 * n + 12 * m.num_layers * m.num_heads * m.head_dim * context

def _hf_param_counts(m: ModelConfig, vocab_size: int | None = None) -> ParamCounts:
    """:class:`ParamCounts` of ``arch="hf"``, counted on a meta-device build."""
    from transformers import AutoModelForCausalLM

    from ..config.hf import hf_model_config

    cfg = hf_model_config(m, 1)
    if vocab_size or m.vocab_size:
        cfg.vocab_size = vocab_size or m.vocab_size
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = expert = 0
    for n, p in model.named_parameters():
        total += p.numel()
        if is_expert_weight(n):
            expert += p.numel()
    embed = model.get_input_embeddings().weight.numel()
    active = total - expert + (expert * m.top_k) // max(m.num_experts, 1)
    return ParamCounts(total=total, active=active, embedding=embed, expert=expert)

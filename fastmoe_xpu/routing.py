"""Stage 1 of FastSparseMoE: the router, forced uniform routing and the router losses.

Legend: T tokens, H hidden size, E experts, K experts chosen per token.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class TopKRouter(nn.Module):
    """Softmax top-k router, numerically identical to transformers v5's ``OlmoeTopKRouter``.

    ``forward(hidden_states [..., H]) -> (router_logits [T, E], top_k_weights [T, K], top_k_index [T, K])``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.num_experts = int(config.num_experts)
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.hidden_dim = int(config.hidden_size)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x_TH = hidden_states.reshape(-1, self.hidden_dim)
        logits_TE = F.linear(x_TH, self.weight)
        return (logits_TE, *topk_routing(logits_TE, self.top_k, self.norm_topk_prob))


def make_router(config) -> nn.Module:
    """transformers' own ``OlmoeTopKRouter`` when installed, so that its ``output_router_logits``
    recording hooks (which match on that class) see our router; else the identical TopKRouter."""
    try:
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    except Exception:  # transformers missing or without v5's router
        return TopKRouter(config)
    return OlmoeTopKRouter(config)


def topk_routing(
    logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax in fp32, top-k, optional renormalisation; weights come back in the logits' dtype."""
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK, idx_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), idx_TK


def uniform_routing_indices(
    num_tokens: int, num_experts: int, top_k: int, device, token_offset: int = 0
) -> torch.Tensor:
    """Forced uniform routing (FUR): token t's k-th expert is ``(t*K + k) mod E``.

    The K experts of a token are distinct (K <= E), and over any T with T*K divisible by E every
    expert receives exactly T*K/E tokens, so benchmarks see no routing imbalance. ``token_offset``
    numbers the tokens from there (a rank's place in an expert-parallel group's batch), so that
    the pattern over the group is the one of the concatenated batch.
    """
    slots = torch.arange(token_offset * top_k, (token_offset + num_tokens) * top_k, device=device, dtype=torch.int64)
    return (slots % num_experts).view(num_tokens, top_k)


def forced_uniform_routing(
    logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool, token_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and indices of FUR: the fixed pattern of :func:`uniform_routing_indices`, weighted by
    the router's own probabilities of those experts, so the router still gets a gradient."""
    num_tokens, num_experts = logits_TE.shape
    idx_TK = uniform_routing_indices(num_tokens, num_experts, top_k, logits_TE.device, token_offset)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK = probs_TE.gather(1, idx_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), idx_TK


def _as_layers(router_logits) -> list[torch.Tensor]:
    if router_logits is None:
        return []
    if isinstance(router_logits, torch.Tensor):
        return [router_logits]
    return list(router_logits)


def load_balancing_loss(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, as transformers' ``load_balancing_loss_func``.

    ``router_logits`` is one layer's ``[T, E]`` logits or a sequence of them (one per layer);
    ``attention_mask [B, S]`` (with T = B*S) excludes padding. Returns
    ``E * sum_e f_e * P_e`` where ``f_e`` is the fraction of top-k assignments to expert e and
    ``P_e`` its mean router probability, both averaged over all layers' tokens.
    """
    layers = _as_layers(router_logits)
    if not layers:
        raise ValueError("load_balancing_loss needs at least one layer of router logits")
    if top_k < 1 or top_k > num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    device = layers[0].device
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask_T = None
    if attention_mask is not None:
        mask_T = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits_TE in layers:
        if logits_TE.shape[-1] != num_experts:
            raise ValueError(f"router logits have {logits_TE.shape[-1]} experts, expected {num_experts}")
        probs_TE = torch.softmax(logits_TE.to(device).float(), dim=-1)
        _, idx_TK = torch.topk(probs_TE, top_k, dim=-1)
        if mask_T is None:
            ones = torch.ones(idx_TK.numel(), dtype=torch.float32, device=device)
            counts_E = counts_E + torch.zeros_like(counts_E).scatter_add_(0, idx_TK.reshape(-1), ones)
            probs_E = probs_E + probs_TE.sum(0)
            rows = rows + probs_TE.shape[0]
        else:
            if mask_T.numel() != probs_TE.shape[0]:
                raise ValueError(
                    f"attention_mask has {mask_T.numel()} tokens but router logits have {probs_TE.shape[0]}"
                )
            counts_E = counts_E + torch.zeros_like(counts_E).scatter_add_(
                0, idx_TK.reshape(-1), mask_T.repeat_interleave(top_k)
            )
            probs_E = probs_E + (probs_TE * mask_T[:, None]).sum(0)
            rows = rows + mask_T.sum()
    return num_experts * torch.sum((counts_E / rows) * (probs_E / rows))


def router_z_loss(router_logits: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2``, averaged over layers."""
    layers = _as_layers(router_logits)
    if not layers:
        raise ValueError("router_z_loss needs at least one layer of router logits")
    total = sum(torch.logsumexp(l.float(), dim=-1).square().mean() for l in layers)
    return total / len(layers)


#: OLMoE's coefficients for the two router losses.
OLMOE_LOAD_BALANCING_COEF = 0.01
OLMOE_Z_LOSS_COEF = 0.001

"""The benchmark's baseline block: transformers 4's OLMoE MoE layer, a ``ModuleList`` of per-expert
MLPs looped with masks. The published speedups were measured against it; the bench's ``hf_v4``
provider runs it and checks every other provider against it, and tests use it as the v4 reference.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class _V4Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFv4SparseMoeBlock(nn.Module):
    """transformers-4-style OLMoE block: a ``ModuleList`` of per-expert MLPs looped with masks.

    The baseline the published speedups were measured against; its state dict uses the v4 keys
    (``gate.weight``, ``experts.{e}.gate_proj.weight``, ...). ``forward`` returns ``[B, S, H]``.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            _V4Expert(config.hidden_size, config.intermediate_size) for _ in range(config.num_experts)
        )

    @torch.no_grad()
    def load_merged(self, gate_weight_EH, w_gate_up_E2IH, w_down_EHI) -> "HFv4SparseMoeBlock":
        """Copy v5-layout weights in (gate rows first, then up)."""
        self.gate.weight.copy_(gate_weight_EH)
        inter = w_down_EHI.shape[2]
        for e, m in enumerate(self.experts):
            m.gate_proj.weight.copy_(w_gate_up_E2IH[e, :inter])
            m.up_proj.weight.copy_(w_gate_up_E2IH[e, inter:])
            m.down_proj.weight.copy_(w_down_EHI[e])
        return self

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = self.experts_forward(hidden_states, routing_weights, selected_experts)
        self.last_router_logits = router_logits
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)

    def experts_forward(
        self,
        hidden_states: torch.Tensor,
        routing_weights: torch.Tensor,
        selected_experts: torch.Tensor,
        num_experts: int | None = None,
    ) -> torch.Tensor:
        """The expert loop alone, on ``[T, H]`` with given routing ``[T, K]``. ``num_experts`` (default
        ``self.num_experts``) is the global expert count when ``self.experts`` holds only the first
        ``len(self.experts)`` of them (a rank's local slice); the result is then that slice's partial sum."""
        hidden_dim = hidden_states.shape[-1]
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=num_experts or self.num_experts).permute(2, 1, 0)
        for expert_idx in range(len(self.experts)):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states

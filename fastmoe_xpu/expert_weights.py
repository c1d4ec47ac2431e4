"""The experts module of a FastSparseMoeBlock: merged expert weights as transformers v5 names them,
and the transformers experts implementation a model config may select instead of ours.

Legend: E experts, NR experts held here, H hidden, I intermediate.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .integrations.registration import when_interface_imported
from .integrations.v4_keys import merge_v4_keys_on_load


class Experts(nn.Module):
    """The merged expert weights, named and shaped as transformers v5's ``OlmoeExperts``.

    ``gate_up_proj [NR, 2I, H]`` (gate rows first, then up) and ``down_proj [NR, H, I]``. Also
    loads transformers v4 per-expert keys (``{e}.gate_proj.weight``, ``{e}.up_proj.weight``,
    ``{e}.down_proj.weight``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_size
        self.intermediate_dim = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_load_state_dict_pre_hook(merge_v4_keys_on_load)
        # What transformers' @use_experts_implementation sets, so that its MoE tooling (expert and
        # tensor parallel plans, exporters) and its experts functions recognise these experts.
        self.has_gate = True
        self.has_bias = False
        self.is_concatenated = True
        self.is_transposed = False
        self.has_post_expert_norm = False
        self._is_expert_parallel = False
        self.act_fn = nn.SiLU()
        #: The model config whose ``_experts_implementation`` the block follows (set by patch_olmoe).
        self.config: Any = None

    def _apply_gate(self, gate_up_R2I: torch.Tensor) -> torch.Tensor:
        """transformers' default gate: ``act_fn(gate) * up`` over the concatenated halves."""
        gate, up = gate_up_R2I.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def _adopt_default_gate(moe: Any) -> None:
    """The very default gate function, so that transformers (and describe_layout) see the default gate;
    without v5's experts interface the identical method above stays."""
    fn = getattr(moe, "_default_apply_gate", None)
    if fn is not None:
        Experts._apply_gate = fn


# when transformers' MoE module is imported (now, or later: importing it costs ~2 s, see
# fastmoe_xpu/__init__.py); nothing happens without transformers
when_interface_imported(_adopt_default_gate)


def dispatch_experts_implementation(experts: Experts) -> Any:
    """The experts function of transformers' ``ExpertsInterface`` that ``experts.config`` selects
    when it selects anything but ``"fastmoe"`` (None: run our stages). ``"eager"`` is the per-expert
    loop of transformers' ``OlmoeExperts``, the class these experts stand in for."""
    name = experts_implementation_name(experts)
    if name is None or name == "fastmoe":
        return None
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if name == "eager":
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

        return OlmoeExperts.forward.__wrapped__
    if name not in ALL_EXPERTS_FUNCTIONS:
        raise ValueError(f"experts_implementation={name!r} is not registered in transformers' ExpertsInterface")
    return ALL_EXPERTS_FUNCTIONS[name]


def experts_implementation_name(experts: Experts) -> str | None:
    """The ``_experts_implementation`` that ``experts.config`` names (None without a config)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None)

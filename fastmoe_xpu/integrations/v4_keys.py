"""transformers v4 expert weights merged into the v5 layout, for state dicts and modules.

v4 saved each expert as its own MLP (``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``);
v5 and :class:`fastmoe_xpu.expert_weights.Experts` hold ``gate_up_proj [E, 2I, H]`` (gate rows
first, then up) and ``down_proj [E, H, I]``. :func:`stack_v4_experts` does the merge; the others
find the v4 weights (in a state dict, while one loads, in a module list) and call it.
"""
from __future__ import annotations

import re
from typing import Mapping

import torch

#: The per-expert v4 weight names, in the order gate_up_proj concatenates them (then down_proj).
V4_NAMES = ("gate_proj", "up_proj", "down_proj")
_V4_KEY = re.compile(r"^(?P<prefix>.*experts\.)(?P<e>\d+)\.(?P<name>gate_proj|up_proj|down_proj)\.weight$")


def stack_v4_experts(
    experts: Mapping[int, Mapping[str, torch.Tensor]], where: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up_proj [E, 2I, H], down_proj [E, H, I])`` from ``{e: {"gate_proj": .., "up_proj": ..,
    "down_proj": ..}}`` for experts ``0..E-1``; ValueError naming ``where`` when one is missing."""
    ids = sorted(experts)
    if ids != list(range(len(ids))) or any(set(experts[e]) != set(V4_NAMES) for e in ids):
        raise ValueError(f"incomplete transformers-v4 expert keys under {where!r}: experts {ids}")
    gate_up = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in ids])
    down = torch.stack([experts[e]["down_proj"] for e in ids])
    return gate_up, down


def merge_v4_expert_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return a copy with transformers-v4 per-expert keys merged into v5's two tensors per block."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in state_dict.items():
        m = _V4_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["name"]] = value
    for prefix, experts in groups.items():
        out[prefix + "gate_up_proj"], out[prefix + "down_proj"] = stack_v4_experts(experts, prefix)
    return out


def merge_v4_keys_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
    """``load_state_dict`` pre-hook of an experts module: turn ``{prefix}{e}.{gate,up,down}_proj.weight``
    (transformers v4) into the merged tensors."""
    if prefix + "gate_up_proj" in state_dict or prefix + "0.gate_proj.weight" not in state_dict:
        return
    # An expert-parallel shard loading a full v4 dict merges all experts; slice_full_experts cuts them.
    n = getattr(module, "global_num_experts", module.num_experts)
    keys = {(e, name): f"{prefix}{e}.{name}.weight" for e in range(n) for name in V4_NAMES}
    absent = [k for k in keys.values() if k not in state_dict]
    if absent:
        error_msgs.append(f"transformers-v4 expert keys incomplete: missing {absent}")
        return
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for (e, name), key in keys.items():
        experts.setdefault(e, {})[name] = state_dict.pop(key)
    state_dict[prefix + "gate_up_proj"], state_dict[prefix + "down_proj"] = stack_v4_experts(experts, prefix)

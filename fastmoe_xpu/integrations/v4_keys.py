"""transformers v4 checkpoints: per-expert keys merged into the v5 layout while a state dict loads.

v4 saved each expert as its own MLP (``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``);
v5 and :class:`fastmoe_xpu.block.Experts` hold ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.
"""
from __future__ import annotations

import torch


def merge_v4_expert_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Turn ``{prefix}{e}.{gate,up,down}_proj.weight`` (transformers v4) into the merged tensors."""
    if prefix + "gate_up_proj" in state_dict or prefix + "0.gate_proj.weight" not in state_dict:
        return
    gate_up, down = [], []
    # An expert-parallel shard loading a full v4 dict merges all experts; _slice_full_experts cuts them.
    n = getattr(module, "global_num_experts", module.num_experts)
    for e in range(n):
        keys = [f"{prefix}{e}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
        absent = [k for k in keys if k not in state_dict]
        if absent:
            error_msgs.append(f"transformers-v4 expert keys incomplete: missing {absent}")
            return
        g, u, d = (state_dict.pop(k) for k in keys)
        gate_up.append(torch.cat([g, u], dim=0))
        down.append(d)
    state_dict[prefix + "gate_up_proj"] = torch.stack(gate_up)
    state_dict[prefix + "down_proj"] = torch.stack(down)

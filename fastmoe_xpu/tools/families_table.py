"""Write the support table of docs/families.md: every transformers family with decorated experts,
its layout flags, and whether the tiny walk (tests/test_experts_families.py) runs it.

    python -m fastmoe_xpu.tools.families_table > table.md
"""
from __future__ import annotations

import sys

from ..integrations.families import NOT_BUILT_TINY, discover_families

_FLAG_ORDER = ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")
_DEFAULTS = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
             "has_post_expert_norm": False}


def table() -> str:
    """The Markdown table, one row per family."""
    rows = ["| family | experts class | layout (non-default flags) | gate | path | status |",
            "|---|---|---|---|---|---|"]
    for fam in discover_families():
        flags = [f"{k}={fam.flags[k]}" for k in _FLAG_ORDER if k in fam.flags and fam.flags[k] != _DEFAULTS[k]]
        fused = not flags and not fam.custom_gate
        gate = "own `_apply_gate`" if fam.custom_gate else ("activation only" if fam.flags.get("has_gate") is False
                                                           else "default (act_fn)")
        path = "fused if act_fn is SiLU" if fused else "plain"
        status = f"not built tiny: {NOT_BUILT_TINY[fam.name]}" if fam.name in NOT_BUILT_TINY else "matches eager"
        rows.append(f"| {fam.name} | {', '.join(fam.experts_classes)} | {', '.join(flags) or '-'} | {gate} | {path} "
                    f"| {status} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())

"""The ``--ac`` choices and their parser (no torch import, so the dry-run planner starts fast)."""
from __future__ import annotations

from typing import Iterable

AC_CHOICES: tuple[str, ...] = ("norm", "attn", "moe")
_ALIASES = {"mlp": "moe", "experts": "moe", "attention": "attn", "norms": "norm"}


def parse_ac(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"norm,attn"`` (or an iterable of names) -> the canonical, ordered subset of AC_CHOICES.

    ``""``, ``"none"`` and None mean no checkpointing; ``"all"`` means every choice."""
    if spec is None:
        return ()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    chosen: set[str] = set()
    for raw in items:
        name = raw.strip().lower()
        if name in ("", "none"):
            continue
        if name == "all":
            chosen.update(AC_CHOICES)
            continue
        name = _ALIASES.get(name, name)
        if name not in AC_CHOICES:
            raise ValueError(f"unknown --ac choice {raw!r}; choose any of {list(AC_CHOICES)} (comma-separated), 'all' or 'none'")
        chosen.add(name)
    return tuple(c for c in AC_CHOICES if c in chosen)

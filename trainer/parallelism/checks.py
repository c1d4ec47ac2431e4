"""Configuration checks for pipeline and tensor parallelism, activation checkpointing and broadcast,
run by ``trainer.config.validate`` so that a bad layout fails in one line before any work."""
from __future__ import annotations

from typing import Any

from .ac_spec import parse_ac


def check_parallel(cfg: Any) -> None:
    """Raise ``trainer.config.ConfigError`` naming the offending values."""
    from ..config import ConfigError

    m, p, s = cfg.model, cfg.parallel, cfg.schedule
    try:
        parse_ac(p.ac)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if p.pp > 1:
        if m.num_layers < p.pp:
            raise ConfigError(f"{m.num_layers} layers cannot fill PP={p.pp} pipeline stages (one layer each at least)")
        dp = p.dp or 1
        micro = s.global_batch // (dp * p.ep * s.micro_batch)
        if p.pp_schedule == "1f1b" and micro < p.pp:
            raise ConfigError(
                f"1F1B needs at least PP={p.pp} micro-batches per rank, got global batch {s.global_batch} / "
                f"(DP x EP x micro batch = {dp} x {p.ep} x {s.micro_batch}) = {micro}; raise --global-batch, "
                f"lower --micro-batch or use --parallel.pp_schedule gpipe")
    if p.tp > 1:
        if m.is_moe:
            raise ConfigError(f"tensor parallelism (TP={p.tp}) covers the dense model's attention and MLP; "
                              f"arch={m.arch!r} uses expert parallelism (--ep) instead")
        if m.num_heads % p.tp or m.intermediate_size % p.tp:
            raise ConfigError(f"TP={p.tp} must divide the heads ({m.num_heads}) and the intermediate size "
                              f"({m.intermediate_size})")

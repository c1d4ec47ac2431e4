"""The start-up summary every run prints once (rank 0) before its first step: what model, on what
layout, on what data, for how long, and where its checkpoints and export go.

It is built from the trainer as constructed (the family's config after the data's vocabulary was
applied, the layout's groups, the optimizer's name), so it states what the run does, not what the
command line asked for.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from ..config import warmup_warning


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def summary_lines(trainer: Any) -> list[str]:
    """The summary of ``trainer`` (a :class:`trainer.trainer.Trainer`), one fact per line."""
    cfg, lay = trainer.cfg, trainer.layout
    m, p, s, d = cfg.model, cfg.parallel, cfg.schedule, cfg.data
    if m.is_hf:
        hf = trainer.model.config
        family = f"{hf.model_type} (--model.arch hf, experts_implementation={hf._experts_implementation!r})"
        source = m.hf_config or f"--model.hf_family {m.hf_family}"
        family += f" from {source}"
    else:
        family = {"olmoe": "olmoe (FastSparseMoeBlock)" if m.moe_impl == "fastmoe" else "olmoe (transformers' block)",
                  "olmo": "olmo (dense)"}[m.arch]
    c = trainer.counts
    lines = [f"family: {family}",
             f"parameters: {_count(c.total)} total, {_count(c.active)} active per token "
             f"({_count(c.expert)} in experts, {_count(c.embedding)} embedding)",
             f"layers: {m.num_layers}, hidden {m.hidden_size}, intermediate {m.intermediate_size}"]
    if m.is_moe or m.is_hf:
        lines.append(f"experts: {m.num_experts} per MoE layer, top-{m.top_k}"
                     + (f", {m.num_experts // lay.ep} per EP rank" if lay.ep > 1 else ""))
    data_vocab = trainer.data_vocab
    lines.append(f"vocabulary: model {m.vocab_size}, data {data_vocab}"
                 + (f" ({m.vocab_size - data_vocab} rows the data never uses)" if m.vocab_size > data_vocab else ""))
    tp = lay.tp
    dispatch = f", dispatcher {m.ep_dispatch}" if lay.ep > 1 else ""
    lines.append(f"layout: world {lay.world} = PP {lay.pp} x DP {lay.dp} x EP {lay.ep} x TP {tp}{dispatch} "
                 f"on {trainer.device}")
    autocast = "none" if trainer._autocast_dtype is None else "bf16"
    optim = "FSDP2 on the non-expert weights + AdamW, experts' states over DP" if (p.dp_shard == "fsdp" and lay.dpep_group is not None) else cfg.optim.name
    lines.append(f"optimizer: {optim}, lr {cfg.optim.lr:g}; precision: weights {m.param_dtype}, "
                 f"autocast {autocast}, gradient reduction {cfg.optim.grad_reduce_dtype}")
    extras = [f"compile {'on (' + m.compile_backend + ')' if m.compile else 'off'}",
              f"activation checkpointing {p.ac or 'off'}"]
    lines.append(", ".join(extras))
    from fastmoe_xpu.threads import current

    threads = current()
    if threads is not None:
        lines.append(threads.summary)
    ds = getattr(getattr(trainer, "loader", None), "dataset", None)
    named = ds.describe() if hasattr(ds, "describe") else trainer.manifest_path  # a mixture names its sources
    eos = getattr(trainer, "document_eos", None)
    lines.append(f"data: {named}, context {d.context}, "
                 + (f"document mask on (attention within each document, split at EOS id {eos})" if eos is not None
                    else "document mask off (attention across the documents of an instance)"))
    lines.append(f"steps: {s.steps} of {s.global_batch} x {d.context} tokens (micro-batch {s.micro_batch})"
                 + (f", resuming at step {trainer.step}" if trainer.step else ""))
    lines.append(f"schedule: {trainer.schedule.phases()}")
    ck = cfg.checkpoint
    root = ck.dir or os.path.join(cfg.logging.out, "checkpoints")
    every = [f"full every {ck.interval}" if ck.interval else "", f"model-only every {ck.model_interval}"
             if ck.model_interval else ""]
    every = [e for e in every if e]
    lines.append(f"checkpoints: {root} ({', '.join(every + ['full at the end of the run'])})")
    lines.append(f"export: {cfg.eval.export_hf or 'none'}; metrics: {cfg.logging.out}")
    return lines


def startup_summary(trainer: Any, warnings: Sequence[str | None] = ()) -> str:
    """The run's summary lines, then its warnings (the run goes on as asked): the warm-up's, and
    ``warnings`` from the layers above (the checkpoints' space: :func:`trainer.checkpoint.writers.checkpoint_space_warning`)."""
    lines = ["run:"] + [f"  {line}" for line in summary_lines(trainer)]
    warning = warmup_warning(trainer.cfg)
    if warning and trainer.step < trainer.cfg.schedule.warmup_steps:
        lines.append(warning)
    lines.extend(w for w in warnings if w)
    return "\n".join(lines)

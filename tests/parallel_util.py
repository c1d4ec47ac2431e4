"""Run a function on W real processes with a gloo process group, for the parallelism tests.

Processes come from a ``forkserver`` that has imported torch and transformers once, so each run
pays no import cost (a fresh ``spawn`` costs several seconds of imports per process on a small
machine). ``run_workers(fn, world, *args)`` is :func:`fastmoe_xpu.dist.testing.run_distributed` on
that server: the W return values in rank order; a rank that raises or hangs makes it raise with
that rank's traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch.multiprocessing as mp

from fastmoe_xpu.dist.testing import run_distributed

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PRELOAD = ["torch", "torch.distributed", "transformers.models.olmoe.modeling_olmoe",
            "transformers.models.olmo.modeling_olmo", "fastmoe_xpu"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        if _ROOT not in sys.path:
            sys.path.insert(0, _ROOT)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``fn(*args)`` on ``world`` gloo processes (``fn`` importable by module and name), forked from
    the preloaded server; the first failed rank ends the run."""
    return run_distributed(fn, world, *args, timeout_s=timeout_s, comm_timeout_s=120.0, context=_context(),
                           fail_fast=True)


# ----------------------------------------------------------------------------- tiny models
TINY = dict(vocab_size=61, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, use_cache=False)


def tiny_model(arch: str = "olmoe", seed: int = 0, *, ep_group: Any = None, forced_uniform_routing: bool = False,
               **overrides: Any):
    """A small OLMoE (FastSparseMoeBlock patched in, torch backend; with ``ep_group`` each rank keeps
    its experts) or OLMo model from ``seed``."""
    import torch

    cfg = dict(TINY, **overrides)
    torch.manual_seed(seed)
    if arch == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        from fastmoe_xpu import patch_olmoe

        cfg.setdefault("intermediate_size", 24)
        cfg.setdefault("num_experts", 8)
        cfg.setdefault("num_experts_per_tok", 2)
        model = OlmoeForCausalLM(OlmoeConfig(**cfg))
        patch_olmoe(model, backend="torch", ep_group=ep_group, forced_uniform_routing=forced_uniform_routing)
        return model
    from transformers import OlmoConfig, OlmoForCausalLM

    cfg.setdefault("intermediate_size", 48)
    return OlmoForCausalLM(OlmoConfig(**cfg))

"""Run a function on W real processes with a gloo process group, for the parallelism tests.

Processes come from a ``forkserver`` that has imported torch and transformers once, so each run
pays no import cost (a fresh ``spawn`` costs several seconds of imports per process on a small
machine). ``run_workers(fn, world, *args)`` returns the W return values in rank order; a rank that
raises or hangs makes it raise with that rank's traceback.
"""
from __future__ import annotations

import importlib
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target: tuple[str, str], args: tuple, result_q: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        fn: Any = importlib.import_module(target[0])
        for part in target[1].split("."):
            fn = getattr(fn, part)
        value = fn(*args)
        result_q.put((rank, True, pickle.dumps(value)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result_q.put((rank, False, traceback.format_exc()))


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``fn(*args)`` on ``world`` gloo processes (``fn`` importable by module and name)."""
    ctx = _context()
    result_q = ctx.Queue()
    port = free_port()
    target = (fn.__module__, fn.__qualname__)
    procs = [ctx.Process(target=_entry, args=(r, world, port, target, args, result_q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(results) - set(failures))
                raise TimeoutError(f"ranks {missing} gave no result within {timeout_s:.0f} s")
            try:
                rank, ok, payload = result_q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in results and r not in failures:
                        failures[r] = f"process exited with code {p.exitcode} before reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
            if failures:
                break  # the others are probably stuck in a collective with the failed rank
        for p in procs:
            p.join(timeout=max(min(deadline - time.monotonic(), 30.0), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    if failures:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise RuntimeError(f"{len(failures)} of {world} ranks failed\n{detail}")
    return [results[r] for r in range(world)]


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

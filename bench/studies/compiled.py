"""``fastmoe-bench --compile``: whole-model forward+backward, eager against ``torch.compile``, for
fastmoe and for transformers' ``grouped_mm`` experts, in one process.

Four contestants per model (fastmoe eager, fastmoe compiled, transformers grouped_mm eager and
compiled), all with the same weights and tokens. Compile time is measured once per compiled
contestant (its first call, forward and backward) and reported apart; the step times are the
minimum over rounds, the contestants interleaved within every round so that a slow moment of a
shared machine hits all of them alike.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from fastmoe_xpu import patch_olmoe
from fastmoe_xpu.compiling import compile_decoder, compile_seconds

from ..harness.measure import check_rounds
from ..harness.usage import fail
from ..harness.report import plural


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    layers: int
    heads: int
    seq: int
    batch: int = 1
    vocab: int = 1024


#: tiny-moe as the trainer's preset (context 64, micro-batch 8); the mid-size OLMoE of the issue.
SHAPES = {
    "tiny-moe": ModelShape("tiny-moe", 64, 128, 8, 2, 2, 4, 64, batch=8),
    "olmoe-mid": ModelShape("olmoe-mid", 512, 256, 32, 4, 2, 8, 256),
}
CONTESTANTS = ("fastmoe", "fastmoe+compile", "hf_grouped_mm", "hf_grouped_mm+compile")


def _build(shape: ModelShape, impl: str, seed: int) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k, max_position_embeddings=max(64, shape.seq),
    )
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(cfg).train()
    if impl == "fastmoe":
        patch_olmoe(model, backend="torch")
    return model


def _step(model: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return run


def measure(shape: ModelShape, rounds: int, seed: int = 0, backend: str = "inductor") -> dict[str, dict[str, float]]:
    """``{contestant: {"step_ms": min over rounds, "compile_s": first-call compile seconds (compiled only)}}``."""
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(seed))
    steps: dict[str, Callable[[], None]] = {}
    result: dict[str, dict[str, float]] = {}
    for name in CONTESTANTS:
        impl = "fastmoe" if name.startswith("fastmoe") else "hf"
        model = _build(shape, impl, seed)
        if name.endswith("+compile"):
            compile_decoder(model, fullgraph=True, backend=backend)
        steps[name] = _step(model, ids)
        c0, t0 = compile_seconds(), time.perf_counter()
        steps[name]()  # first call: compiles (compiled contestants), warms caches (all)
        result[name] = {"first_call_s": time.perf_counter() - t0}
        if name.endswith("+compile"):
            result[name]["compile_s"] = compile_seconds() - c0
    best = {name: float("inf") for name in CONTESTANTS}
    for _ in range(rounds):
        for name in CONTESTANTS:
            t0 = time.perf_counter()
            steps[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    for name in CONTESTANTS:
        result[name]["step_ms"] = best[name] * 1e3
    return result


def format_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "| model | contestant | F+B step (ms, min) | vs its eager | compile (s) |",
        "|---|---|---:|---:|---:|",
    ]
    for model, res in results.items():
        for name in CONTESTANTS:
            eager = res[name.removesuffix("+compile")]["step_ms"]
            r = res[name]
            compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
            lines.append(f"| {model} | {name} | {r['step_ms']:.2f} | {eager / r['step_ms']:.2f}x | {compile_s} |")
        ratio = res["hf_grouped_mm+compile"]["step_ms"] / res["fastmoe+compile"]["step_ms"]
        lines.append(f"| {model} | compiled fastmoe vs compiled grouped_mm | | {ratio:.2f}x | |")
    return "\n".join(lines)


def main_compile(args: argparse.Namespace) -> int:
    """Entry point of ``--compile`` (``--compile-models``, ``--rounds``, ``--threads``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.compile_models or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        fail(f"error: --compile-models: unknown {unknown}; choose from {list(SHAPES)}")
    rounds = check_rounds(args.rounds)
    results = {}
    for i, name in enumerate(names):
        if not args.no_progress:
            print(f"[{i + 1}/{len(names)}] {name}: building, compiling and timing {len(CONTESTANTS)} contestants "
                  f"over {plural(rounds, 'round')}", flush=True)
        results[name] = measure(SHAPES[name], rounds, seed=args.seed)
    print(format_table(results))
    return 0

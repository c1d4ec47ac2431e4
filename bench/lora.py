"""``python -m bench.lora``: one LoRA fine-tuning step (forward + backward) of a family's experts layer
with PEFT's adapters (``target_parameters`` on ``gate_up_proj`` and ``down_proj``), transformers'
default experts implementation (``grouped_mm``) against ``"fastmoe"``, in one run.

Both contestants are one module: the family's own experts class at its bench shape
(:data:`bench.families.FAMILY_SHAPES`, ``--scale`` divides H and I), wrapped by PEFT exactly as
``LoraConfig(target_parameters=[...])`` wraps it in a model; ``config._experts_implementation`` is
switched per call, so every weight and adapter is shared. Step times are interleaved, min over
rounds. Peak memory is the growth of the peak resident set of a fresh process per contestant over
what it held once the layer existed (imports, weights, inputs), across the same steps: the CPU has
no allocator statistics.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, r adapter rank.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn as nn

from .families import FAMILY_SHAPES, family_preset, experts_module

CONTESTANTS = ("grouped_mm", "fastmoe")


def build(family: str, scale: int, tokens: int, rank: int, seed: int = 0) -> tuple[nn.Module, nn.Module, tuple]:
    """``(peft wrapper, experts module, (x, top_k_index, top_k_weights))`` at the family's bench shape."""
    from peft import LoraConfig, inject_adapter_in_model

    preset, _ = family_preset(family, scale=scale, tokens=tokens)
    experts = experts_module(family, preset, torch.float32, torch.device("cpu"), seed)
    holder = nn.Module()
    holder.mlp = nn.Module()
    holder.mlp.experts = experts
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                            holder)
    g = torch.Generator().manual_seed(seed)
    T, E, K = preset.tokens, preset.experts, preset.top_k
    x = torch.randn(T, preset.hidden, generator=g)
    probs = torch.randn(T, E, generator=g).softmax(-1)
    w, idx = probs.topk(K)
    return holder.mlp.experts, experts, (x, idx, (w / w.sum(-1, keepdim=True)))


def step(wrapper: nn.Module, experts: nn.Module, impl: str, inputs: tuple) -> None:
    experts.config._experts_implementation = impl
    x, idx, w = inputs
    for p in wrapper.parameters():
        p.grad = None
    out = wrapper(x.requires_grad_(), idx, w)
    out.backward(torch.ones_like(out))


def _child(args: Any) -> None:
    """One contestant in a fresh process: warm-up and ``rounds`` steps, then its peak RSS."""
    import resource

    wrapper, experts, inputs = build(args.family, args.scale, args.tokens, args.rank)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(args.rounds + 1):
        step(wrapper, experts, args.impl, inputs)
    # the peak above what the process held once the layer existed (imports, weights, inputs)
    print(json.dumps({"peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))


def run(family: str, scale: int, tokens: int, rank: int, rounds: int) -> dict[str, Any]:
    wrapper, experts, inputs = build(family, scale, tokens, rank)
    grads: dict[str, list[torch.Tensor]] = {}
    best = {impl: float("inf") for impl in CONTESTANTS}
    for impl in CONTESTANTS:  # warm-up; the adapter gradients of both, compared below
        step(wrapper, experts, impl, inputs)
        grads[impl] = [p.grad.clone() for p in wrapper.parameters() if p.requires_grad]
    for _ in range(rounds):
        for impl in CONTESTANTS:
            t0 = time.perf_counter()
            step(wrapper, experts, impl, inputs)
            best[impl] = min(best[impl], time.perf_counter() - t0)
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
              for a, b in zip(grads["fastmoe"], grads["grouped_mm"]))
    res: dict[str, Any] = {"family": family, "shape": family_preset(family, scale=scale, tokens=tokens)[0].as_dict(),
                           "rank": rank, "step_s": best, "adapter_grad_rel_err": err}
    peak = {}
    for impl in CONTESTANTS:
        cmd = [sys.executable, "-m", "bench.lora", "--child", impl, "--family", family, "--scale", str(scale),
               "--tokens", str(tokens), "--rank", str(rank), "--rounds", "2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        peak[impl] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    res["peak_rss_mb"] = peak
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILY_SHAPES),
                    help="family (repeat; default: all bench families)")
    ap.add_argument("--scale", type=int, default=4, help="divide H and I by this (CPU-sized layers)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", default=None, choices=CONTESTANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.impl, args.family = args.child, args.family[0]
        _child(args)
        return 0
    results = []
    print(f"# LoRA step (forward + backward, adapters only train), r={args.rank}, T={args.tokens}, "
          f"H and I / {args.scale}, fp32, {torch.get_num_threads()} threads")
    print("| family | H | I | E | K | grouped_mm step ms | fastmoe step ms | speed-up | grouped_mm step peak MB "
          "| fastmoe step peak MB | adapter grad rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for family in args.family or sorted(FAMILY_SHAPES):
        r = run(family, args.scale, args.tokens, args.rank, args.rounds)
        s, p = r["step_s"], r["peak_rss_mb"]
        sh = r["shape"]
        print(f"| {family} | {sh['hidden']} | {sh['intermediate']} | {sh['experts']} | {sh['top_k']} | "
              f"{s['grouped_mm'] * 1e3:.1f} | {s['fastmoe'] * 1e3:.1f} | {s['grouped_mm'] / s['fastmoe']:.2f}x | "
              f"{p['grouped_mm']:.0f} | {p['fastmoe']:.0f} | {r['adapter_grad_rel_err']:.1e} |", flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the small-layer path pays: transformers, the staged chain and the ``padded`` experts op, side by side.

``python -m bench small_shapes`` times, for each layer shape, transformers' ``grouped_mm`` experts
(OLMoE's), the staged chain (``fastmoe::route`` + ``fastmoe::mlp_combine``; the best of the CPU's
full-precision engines, ``loop``, ``grouped_mm`` and ``onednn`` where it runs) and ``fastmoe::experts`` on the registry's ``padded`` entry, forward
(no autograd) and forward+backward, and the layer as ``gemm_engine="auto"`` runs it (what a user
gets: the ``decode`` or ``padded`` op, or the staged chain on the engine ``auto`` takes), fp32 on the
CPU, interleaved, minimum over rounds of CPU thread time (``--threads N`` > 1: wall time), and prints one Markdown row per shape with the layer's work ``max(T*K, NR) * 3 * H * I`` (what
the ``padded`` entry's ``max_layer_macs`` budget is compared with, :func:`fastmoe_xpu.kernels.registry.layer_macs`).
docs/small_shapes.md keeps the table the budget was set from.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch

from fastmoe_xpu import settings

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.autograd.ops import call, experts
from fastmoe_xpu.kernels.registry import candidates, layer_macs
from ..harness.usage import Parser, count
from ..harness.report import plural

#: (T, H, I, E, K): around the budget, from the tiny preset up; two decode steps of an OLMoE layer.
SHAPES = [(48, 64, 32, 8, 2), (192, 64, 32, 8, 2), (48, 128, 64, 8, 2), (48, 128, 64, 16, 2), (48, 64, 32, 64, 8),
          (16, 128, 64, 64, 8), (768, 64, 32, 8, 2), (192, 128, 64, 8, 2), (48, 256, 128, 8, 2),
          (128, 256, 128, 8, 2)]


def _parse_shape(text: str) -> tuple[int, int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is T,H,I,E,K (five positive integers), got {text!r}")
    T, H, I, E, K = (int(p) for p in parts)
    if K > E:
        raise argparse.ArgumentTypeError(f"K={K} experts per token out of E={E}")
    return T, H, I, E, K


def _layer(T: int, H: int, I: int, E: int, K: int) -> dict:
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    w_gu = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.1)
    w_d = torch.nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1)
    weights, idx = torch.randn(T, E, generator=g).softmax(-1).topk(K, -1)
    weights = weights.detach().requires_grad_()
    cfg = OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        hf = OlmoeExperts(cfg)
    hf.gate_up_proj, hf.down_proj = w_gu, w_d
    fns = {"transformers": lambda: hf(x, idx, weights),
           "padded": lambda: call(experts, x, w_gu, w_d, weights, idx, 0, E, "padded")[0],
           "auto": lambda: moe_experts_forward(x, weights, idx, w_gu, w_d, gemm_engine="auto")}
    for engine in candidates("torch", torch.device("cpu"), torch.float32):
        fns[engine] = lambda engine=engine: moe_experts_forward(x, weights, idx, w_gu, w_d, gemm_engine=engine)
    return fns, torch.randn(T, H, generator=g)


def measure(shape: tuple[int, int, int, int, int], rounds: int, reps: int,
            clock: Callable[[], float] = time.thread_time) -> dict[str, dict[str, float]]:
    """``{mode: {variant: seconds}}`` for one shape; modes ``fwd`` and ``fb``, variants
    ``transformers``, ``staged``, ``padded`` and ``auto`` (minimum over rounds), and ``auto_ratio``:
    transformers over ``auto``, the median of the same-round ratios."""
    fns, dout = _layer(*shape)
    out: dict[str, dict[str, float]] = {}
    fixed = ("transformers", "padded", "auto")
    for mode in ("fwd", "fb"):
        samples: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(rounds):
            for name, f in fns.items():
                t0 = clock()
                for _ in range(reps):
                    if mode == "fwd":
                        with torch.no_grad():
                            f()
                    else:
                        f().backward(dout)
                samples[name].append((clock() - t0) / reps)
        best = {n: min(v) for n, v in samples.items()}
        staged = min(v for n, v in best.items() if n not in fixed)
        out[mode] = {"transformers": best["transformers"], "staged": staged, "padded": best["padded"],
                     "auto": best["auto"], "auto_ratio": statistics.median(
                         a / b for a, b in zip(samples["transformers"], samples["auto"]))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench small_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=_parse_shape, default=SHAPES, metavar="T,H,I,E,K")
    ap.add_argument("--rounds", type=count, default=7, help="interleaved rounds; the minimum counts (default 7)")
    ap.add_argument("--reps", type=count, default=5, help="calls per timed round (default 5)")
    ap.add_argument("--threads", type=count, default=1,
                    help="torch threads (default 1: CPU thread time; more: wall time)")
    args = ap.parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"fp32, {plural(args.threads, 'thread')}, {'CPU thread' if args.threads == 1 else 'wall'} time, min over "
          f"{plural(args.rounds, 'interleaved round')}; us, forward / forward+backward; auto: the layer as "
          "gemm_engine='auto' runs it (transformers / auto: the median of same-round ratios)")
    print("| T | H | I | E | K | work (Mi MAC) | transformers | staged | padded | auto | padded / staged (F+B) "
          "| transformers / padded (F+B) | transformers / auto (F / F+B) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for i, shape in enumerate(args.shapes, 1):
            T, H, I, E, K = shape
            with settings.override(gemm_engine="auto"):
                r = measure(shape, args.rounds, args.reps, clock)
            us = {v: f"{r['fwd'][v] * 1e6:.0f} / {r['fb'][v] * 1e6:.0f}" for v in r["fwd"] if v != "auto_ratio"}
            print(f"| {T} | {H} | {I} | {E} | {K} | {layer_macs(T, K, H, I, E) / 2**20:.1f} | {us['transformers']} "
                  f"| {us['staged']} | {us['padded']} | {us['auto']} | {r['fb']['padded'] / r['fb']['staged']:.2f} "
                  f"| {r['fb']['transformers'] / r['fb']['padded']:.2f} "
                  f"| {r['fwd']['auto_ratio']:.2f} / {r['fb']['auto_ratio']:.2f} |", flush=True)
            print(f"[{i}/{len(args.shapes)}]", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())

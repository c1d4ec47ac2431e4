"""Quantized decoding, weights quantized per call against once: ``fastmoe-bench decode_weights``.

One MoE block (``--shape H I E K``, default OLMoE-1B-7B's 2048 1024 64 8) under ``torch.no_grad`` at
each ``--tokens`` count, timed side by side in one process, interleaved, the minimum over
``--rounds``: full precision, ``expert_precision=PRECISION`` as a plain forward (every call quantizes
every expert's weights again, as a training step must after an update), the same inside
``fastmoe_xpu.frozen_expert_weights()`` (each weight quantized once, kept while it is unchanged), and
the full-precision block in bf16 (weights and activations), so that the frozen way is also read
against the faster of the two float blocks.
The frozen outputs are checked equal to the per-call ones before anything is timed. Prints a
markdown table (docs/precision.md) and writes it with ``--out``.
"""
from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import torch

import fastmoe_xpu
from fastmoe_xpu import FastSparseMoeBlock
from fastmoe_xpu.kernels.quantized import core

from ..harness.measure import time_fn
from ..harness.usage import Parser, count, fail


def measure(H: int, I: int, E: int, K: int, tokens: list[int], precision: str, rounds: int,  # noqa: E741
            device: str = "cpu", backend: str = "auto", seed: int = 0) -> list[dict]:
    """One row per token count: ``{tokens, full_ms, per_call_ms, frozen_ms, bf16_ms}`` (minimum over rounds)."""
    dev = torch.device(device)
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                          norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(seed)
    full = FastSparseMoeBlock(cfg, backend=backend).to(dev)
    quant = FastSparseMoeBlock(cfg, backend=backend, expert_precision=precision).to(dev)
    quant.load_state_dict(full.state_dict())
    half = FastSparseMoeBlock(cfg, backend=backend).to(dev, torch.bfloat16)
    half.load_state_dict(full.state_dict())
    with warnings.catch_warnings():
        # quantizing unchanged weights under no_grad is what the per-call way measures: its hint is no news here
        warnings.filterwarnings("ignore", message="fastmoe_xpu: quantized expert weights that did not change")
        return [_row(full, quant, half, T, H, rounds, dev) for T in tokens]


def _row(full: FastSparseMoeBlock, quant: FastSparseMoeBlock, half: FastSparseMoeBlock, T: int, H: int, rounds: int,
         dev: torch.device) -> dict:
    """One token count's minimum times (ms), after checking the frozen outputs."""
    x = torch.randn(1, T, H, device=dev)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        core.forget_weights()
        per_call = quant(x)
        with fastmoe_xpu.frozen_expert_weights():
            if not (torch.equal(quant(x), per_call) and torch.equal(quant(x), per_call)):
                raise RuntimeError(f"T={T}: the frozen weights' output differs from the per-call one")
    ways = {"full_ms": (full, contextlib.nullcontext), "per_call_ms": (quant, contextlib.nullcontext),
            "frozen_ms": (quant, fastmoe_xpu.frozen_expert_weights), "bf16_ms": (half, contextlib.nullcontext)}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(rounds):
        for name, (block, ctx) in ways.items():
            inp = xb if name == "bf16_ms" else x
            with torch.no_grad(), ctx():
                best[name] = min(best[name], time_fn(lambda b=block, i=inp: b(i), dev))
    core.forget_weights()
    return {"tokens": T, **{k: v * 1e3 for k, v in best.items()}}


def table(rows: list[dict], precision: str) -> str:
    lines = [f"| tokens | full precision ms | {precision} per call ms | {precision} frozen ms | frozen over per call "
             f"| frozen over full precision | bf16 ms | frozen over the faster float |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        faster = "bf16" if r["bf16_ms"] < r["full_ms"] else "fp32"
        lines.append(f"| {r['tokens']} | {r['full_ms']:.2f} | {r['per_call_ms']:.2f} | {r['frozen_ms']:.2f} | "
                     f"{r['per_call_ms'] / r['frozen_ms']:.2f}x | {r['full_ms'] / r['frozen_ms']:.2f}x | "
                     f"{r['bf16_ms']:.2f} | {min(r['full_ms'], r['bf16_ms']) / r['frozen_ms']:.2f}x ({faster}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench decode_weights", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs=4, type=count, default=[2048, 1024, 64, 8], metavar=("H", "I", "E", "K"))
    ap.add_argument("--tokens", nargs="+", type=count, default=[1, 8, 64, 256], metavar="T",
                    help="tokens per call, one row each (default 1 8 64 256)")
    ap.add_argument("--precision", default="int8", choices=("int8", "fp8", "fp8-block"))
    ap.add_argument("--rounds", type=count, default=5, help="interleaved timed rounds (default 5)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    H, I, E, K = args.shape  # noqa: E741
    if K > E:
        fail(f"error: --shape: K={K} experts per token of E={E} (see fastmoe-bench decode_weights --help)")
    try:
        rows = measure(H, I, E, K, args.tokens, args.precision, args.rounds, args.device, args.backend)
    except (ValueError, RuntimeError) as exc:
        fail(f"error: {exc}")
    text = (f"H={H} I={I} E={E} K={K}, {args.device}, fp32 activations, no grad, min over {args.rounds} "
            f"interleaved rounds\n\n" + table(rows, args.precision))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

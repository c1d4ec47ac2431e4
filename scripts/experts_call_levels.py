"""One experts layer call without grad, timed at each level of fastmoe's call path beside transformers'
``grouped_mm`` experts function, in one process (rounds interleaved, the order rotated each round):

- ``transformers``: ``transformers.integrations.moe.grouped_mm_experts_forward``;
- ``experts_function``: the ``"fastmoe"`` experts function transformers calls;
- ``memo_call``: the same with the module's part already derived (``integrations.experts._memo_call``);
- ``moe_experts_forward``: the experts op's entry, as the memo calls it;
- ``small_inference``: the one-piece body alone (``kernels.grouped_mm.small_inference``).

``python scripts/experts_call_levels.py [--family F] [--size tiny|small] [--tokens T] [--dtype fp32|bf16]
[--rounds N] [--calls C] [--evict MB]``: prints the minimum and the median over rounds of each level's
mean call time, and transformers' time over each level's (above 1: that level is faster). What it
tells: how much of a small call is the path around the arithmetic. ``--evict MB``: before each call
(untimed) a pass over a buffer of that size pushes the caches' contents out, as a model's other layers
do between two experts calls in ``generate``; each call is then timed on its own. Each Python step
of the path costs several times more so than warm, back to back (docs/small_shapes.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=18)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--evict", type=float, default=0.0, help="MB passed over before each call (0: none)")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1 or args.calls < 1 or args.evict < 0:
        ap.error("--tokens must be at least 2 (one token takes another path), --rounds and --calls at least 1, "
                 "--evict at least 0")
    torch.set_num_threads(1)
    from transformers.integrations.moe import grouped_mm_experts_forward

    from bench.studies.generate import SIZES, build
    from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
    from fastmoe_xpu.integrations import experts as fx
    from fastmoe_xpu.kernels import grouped_mm

    size = SIZES[args.size]
    model = build(args.family, size, args.dtype, 64)
    ex = next(m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, size.hidden, generator=g).to(dtype)
    weights, idx = torch.randn(args.tokens, size.experts, generator=g).softmax(-1).topk(size.top_k, -1)
    weights = weights.to(dtype)
    memo = fx._call_memo(ex)
    w_up, w_down = memo.w_up, memo.w_down
    levels = {
        "transformers": lambda: grouped_mm_experts_forward(ex, x, idx, weights),
        "experts_function": lambda: fx.fastmoe_experts_forward(ex, x, idx, weights),
        "memo_call": lambda: fx._memo_call(memo, x, idx, weights),
        "moe_experts_forward": lambda: moe_experts_forward(x, weights, idx, w_up, w_down, backend=memo.backend,
                                                           gemm_engine=memo.engine, check_ids=memo.ids_check),
        "small_inference": lambda: grouped_mm.small_inference(x, w_up, w_down, weights, idx),
    }
    names = list(levels)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        want = levels["experts_function"]()
        for n, f in levels.items():
            got = f()
            if n != "transformers" and not torch.equal(got, want):
                print(f"note: {n}'s output differs from the experts function's", file=sys.stderr)
            for _ in range(args.calls):
                f()
        buffer = torch.zeros(int(args.evict * 2**20) // 4) if args.evict else None
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(_mean_call(levels[n], args.calls, buffer) * 1e6)
    ref = min(times["transformers"])
    cold = f", {args.evict:g} MB passed over before each call" if args.evict else ""
    print(f"{args.family} {args.size} T={args.tokens} {args.dtype}, one thread, {args.rounds} rounds of "
          f"{args.calls} calls{cold}")
    print(f"{'level':22s} {'min us':>9s} {'median us':>10s} {'transformers / level (min)':>28s}")
    for n in names:
        v = times[n]
        print(f"{n:22s} {min(v):9.1f} {statistics.median(v):10.1f} {ref / min(v):27.2f}x")
    return 0


def _mean_call(f, calls: int, buffer: torch.Tensor | None) -> float:  # noqa: ANN001
    """Seconds per call of ``f``: back to back, or, with ``buffer``, each call after an untimed pass over it."""
    if buffer is None:
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        return (time.perf_counter() - t0) / calls
    total = 0.0
    for _ in range(calls):
        buffer.add_(1.0)
        t0 = time.perf_counter()
        f()
        total += time.perf_counter() - t0
    return total / calls


if __name__ == "__main__":
    raise SystemExit(main())

"""The first calls of a new shape under ``torch.no_grad`` with ``gemm_engine="auto"``, three rules
side by side in one process (a fresh engine cache for every run, the rules interleaved per round):

- ``before``: the first call times the candidates forward and backward (the rule before calls
  without a backward deferred their timing);
- ``fwd-only@1``: the first call times the candidates' forwards only;
- ``after``: the rule in force (``registry.INFERENCE_TIME_AFTER``: untimed ``grouped_mm`` until the
  layer's third call, which times the forwards).

``python scripts/inference_first_calls.py [--tokens T] [--rounds N]``: a layer at H=1024, I=512,
32 experts, top-8 (``--tokens 40``: 10 rows per expert, above the untimed bounds); prints each
call's milliseconds and the choice. The first round also pays the process's first use of every
engine (probes, warm-ups).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from fastmoe_xpu import settings
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import registry

H, I, E, K = 1024, 512, 32, 8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=40, help="tokens of the call (default 40)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the three rules (default 4)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1:
        parser.error("--tokens and --rounds must be at least 1")
    T = args.tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    w_gu = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w_d = torch.randn(E, H, I, generator=g) * I ** -0.5
    print(f"H={H} I={I} E={E} K={K} T={T}: {T * K / E:.1f} rows per expert, "
          f"{registry.layer_macs(T, K, H, I, E) / 2**20:.0f} Mi MAC (untimed up to "
          f"{registry.SMALL_INFERENCE_MACS / 2**20:.0f} Mi or {registry.INFERENCE_ROWS_PER_EXPERT} rows per expert), "
          f"{torch.get_num_threads()} threads")
    n = registry.INFERENCE_TIME_AFTER
    time_first = registry._time_first
    full = lambda *a, **k: time_first(*a[:7])  # noqa: E731  (without ``inference``: forward and backward)
    rules = {"before": (1, full), "fwd-only@1": (1, time_first), f"after (N={n})": (n, time_first)}
    try:
        with torch.no_grad():
            moe_experts_forward(x, w, idx, w_gu, w_d, gemm_engine="grouped_mm")  # torch's own first use
            for r in range(args.rounds):
                for name, (after, timer) in rules.items():
                    registry.INFERENCE_TIME_AFTER, registry._time_first = after, timer
                    registry.forget_choices()
                    with tempfile.TemporaryDirectory() as d, settings.override(
                            gemm_cache=os.path.join(d, "engines.json"), gemm_engine=None):
                        ms = []
                        for _ in range(n + 1):
                            t0 = time.perf_counter()
                            moe_experts_forward(x, w, idx, w_gu, w_d, gemm_engine="auto")
                            ms.append((time.perf_counter() - t0) * 1e3)
                    watch = next(iter(registry._WATCHES.values()), None)
                    choice = "-" if watch is None else watch.engine + (" (forwards only)" if watch.forward_only else "")
                    print(f"round {r} {name:>12}: calls 1..{n + 1} ms " + " ".join(f"{t:7.0f}" for t in ms)
                          + f"   choice: {choice}", flush=True)
    finally:
        registry.INFERENCE_TIME_AFTER, registry._time_first = n, time_first
        registry.forget_choices()


if __name__ == "__main__":
    main()

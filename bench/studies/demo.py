"""``fastmoe-bench --demo`` (``make demo``): a first honest number in well under a minute on two
CPU cores.

One Mula-7B-A1B MoE layer (H=2048, I=1024, E=64, K=8) as one rank of an EP=16 job holds it: its 4
local experts, the 256 all-gathered tokens of which 128 rows reach them, 32 rows per expert (the size where the
per-expert overheads FastSparseMoE removes are a visible share of the step). Forward+backward,
fastmoe against transformers' default experts implementation (``grouped_mm``) and against the
transformers-4-style per-expert loop (``hf_v4``, the published baseline and the correctness
reference), with the layer's GEMM-only bound measured in the same run. The slice keeps the layer's
real matrix sizes; only the number of experts held is one rank's, which keeps the weights (and
their gradients) at 100 MB instead of 1.6 GB: that memory traffic, not the arithmetic, is what
made the whole layer take minutes on a loaded two-core machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..harness.cases import make_case
from ..harness.measure import check_rounds
from ..harness.presets import Preset
from ..harness.providers import REFERENCE, default_fastmoe
from ..harness.report import BOUND_LINE, derive, load_text, machine_line, plural, run_header

#: transformers' default experts implementation, and the published baseline.
DEFAULT_IMPL = "hf_v5_grouped_mm"
DEMO_PRESET = Preset("mula-7b-a1b-ep16-slice", 2048, 1024, 64, 8, 16, 16,
                     "Mula-7B-A1B layer as one EP=16 rank holds it: 4 of 64 experts, 256 tokens, 32 rows per expert")
DEMO_ROUNDS = 3
DEMO_CEILING_N = 1024
#: Published forward+backward speedup of the Mula-7B-A1B layer over the Hugging Face loop (Table 3).
PUBLISHED_FB = 2.83



def measure_demo(device: torch.device, dtype: str = "fp32", rounds: int = DEMO_ROUNDS, progress: bool = True,
                 log=lambda s: None) -> dict:
    """The demo's case measured: ``run_case``'s result with ``metrics`` derived."""
    from ..harness.runner import run_case

    fast = default_fastmoe(device)
    case = make_case(DEMO_PRESET, dtype=dtype, device=device, seed=0)
    res = run_case(case, [REFERENCE, DEFAULT_IMPL, fast], backward=True, rounds=rounds, budget_s=60.0,
                   ceiling_n=DEMO_CEILING_N, progress=progress, log=log)
    return derive(res, [fast])


def format_demo(res: dict, fast: str, transformers_version: str | None) -> str:
    """The headline (fastmoe against transformers' default), the loop baseline, the bound, the
    published figure, each in one line."""
    m = res["metrics"]["fwdbwd"]
    sp = m["speedup"].get(fast, {})
    corr = res["providers"].get(fast, {}).get("correct") or {}
    p = res["case"]["preset"]
    rounds = res["rounds"]
    tv = f"transformers {transformers_version}" if transformers_version else "transformers"

    def ratio(name: str) -> str:
        s = sp.get(name)
        if s is None:
            reason = res["providers"].get(name, {}).get("reason", "did not run")
            return f"not measured ({reason})"
        paired = f", median of same-round ratios {s['paired']:.2f}x" if s.get("paired") is not None else ""
        word = "faster" if s["min"] >= 1 else "slower"
        return f"{s['min']:.2f}x ({word}; min over {plural(rounds, 'interleaved round')}{paired})"

    lines = [f"fastmoe vs transformers' default experts implementation ({DEFAULT_IMPL.removeprefix('hf_v5_')}, "
             f"{tv}): {ratio(DEFAULT_IMPL)}",
             f"  layer: {p['name']}: {DEMO_PRESET.description}; H={p['hidden']} I={p['intermediate']}; "
             f"forward+backward, {res['case']['dtype']} on {res['case']['device']}",
             f"  vs the transformers-4-style per-expert loop ({REFERENCE}): {ratio(REFERENCE)}"]
    q = m["providers"].get(fast)
    if q is not None:
        lines.append(f"  fastmoe takes {q['x_bound']:.2f}x the GEMM-only bound's time "
                     f"({1e3 * q['min_s']:.1f} ms vs {1e3 * m['bound']['min_s']:.1f} ms)")
    lines.append(f"  {BOUND_LINE}")
    if corr:
        worst = max(corr["max_rel_error"].values()) if corr.get("max_rel_error") else 0.0
        lines.append(f"  outputs and gradients vs {REFERENCE}: {'match' if corr['ok'] else 'DIFFER'} "
                     f"(largest relative error {worst:.1e})")
    lines.append(f"  published: {PUBLISHED_FB:.2f}x over the Hugging Face loop (Aurora PVC, bf16, the whole layer)")
    lines.append("  more: fastmoe-bench (the full layer, every baseline), fastmoe-bench --table3 (training steps)")
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    """The ``--demo`` entry of ``fastmoe-bench``: measure, print, write ``demo.json`` into ``--out``."""
    t0 = time.perf_counter()
    device = torch.device(args.device)
    rounds = check_rounds(args.rounds, DEMO_ROUNDS)
    header = run_header(device, {k: v for k, v in vars(args).items()})
    mach = header["machine"]
    print(f"# {header['date_utc']}  {machine_line(mach)}, load average at start "
          f"{load_text(mach['load_average_at_start'])}", flush=True)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    fast = default_fastmoe(device)
    res = measure_demo(device, args.dtype, rounds, progress=not args.no_progress, log=log)
    print(format_demo(res, fast, mach["transformers"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header["seconds"] = time.perf_counter() - t0
    (out / "demo.json").write_text(json.dumps({**header, "cases": [res]}, indent=2, default=str) + "\n",
                                   encoding="utf-8")
    print(f"# {header['seconds']:.0f} s in all; wrote {out / 'demo.json'}")
    corr = res["providers"].get(fast, {}).get("correct") or {}
    return 0 if corr.get("ok", False) else 1

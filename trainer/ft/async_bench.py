"""Measure what ``--checkpoint.async`` saves: two runs of the same preset in one process, one with
synchronous and one with asynchronous periodic checkpoints; per checkpoint, the time the step loop
waited (the stall) and the time the write took, side by side.

    python -m trainer.ft.async_bench [--preset small-moe] [--steps 7] [--interval 2] [--out OUT]

Prints a Markdown table and writes ``OUT/async_bench.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .bench import SMALL


def run(preset: str, steps: int, interval: int, out: Path, async_save: bool) -> list[dict[str, Any]]:
    """The periodic checkpoints' timings of one run (the run's last, synchronous one left out)."""
    from ..cli import config_from_args
    from ..trainer import Trainer

    mode = "async" if async_save else "sync"
    argv = [*SMALL, "--preset", preset, "--steps", str(steps), "--checkpoint.interval", str(interval),
            "--out", str(out / mode), "--no-checkpoint.resume", "--no-eval.enabled",
            "--checkpoint.async" if async_save else "--no-checkpoint.async"]
    cfg, _ = config_from_args(argv)
    t = Trainer(cfg)
    t.fit()
    return [c for c in t.checkpoints.timings if c["step"] % interval == 0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-moe")
    ap.add_argument("--steps", type=int, default=7, help="steps of each run (default 7: checkpoints at 2, 4, 6)")
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--out", default=None, help="directory for both runs and async_bench.json (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        sync = run(args.preset, args.steps, args.interval, out, False)
        asyn = run(args.preset, args.steps, args.interval, out, True)
        rows = [{"step": s["step"], "sync_write_s": s["write_s"], "async_stall_s": a["stall_s"],
                 "async_write_s": a.get("write_s"), "stall_over_sync": a["stall_s"] / s["write_s"]}
                for s, a in zip(sync, asyn)]
        ratio = statistics.median(r["stall_over_sync"] for r in rows) if rows else float("nan")
        result = {"preset": args.preset, "steps": args.steps, "interval": args.interval, "checkpoints": rows,
                  "median_stall_over_sync": ratio}
        if args.out:
            (out / "async_bench.json").write_text(json.dumps(result, indent=2))
    print(f"{args.preset}: periodic full checkpoints, synchronous write vs asynchronous stall (seconds)\n")
    print("| step | sync: write = stall | async: stall | async: background write | stall / sync |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        bg = f"{r['async_write_s']:.3f}" if r["async_write_s"] is not None else "-"
        print(f"| {r['step']} | {r['sync_write_s']:.3f} | {r['async_stall_s']:.3f} | {bg} | {r['stall_over_sync']:.2f}x |")
    print(f"\nmedian stall / sync write: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

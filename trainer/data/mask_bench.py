"""Measure what ``--data.document_mask`` costs: two trainers of one preset in one process, one with and
one without it, on the same data and weights, taking their steps in turn (which goes first alternates),
so that load from other work on the machine falls on both alike; per-step tokens/s, medians side by side.

    python -m trainer.data.mask_bench [--preset small-moe] [--steps 40] [--context C] [--data PATH] [--threads N]

Prints a Markdown table with the share of instances that hold a document boundary (only micro-batches
with one pay for the mask) and both runs' last losses.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

#: steps of each run left out of the medians (allocator and caches warming up)
WARMUP = 2


def trainer_for(args: argparse.Namespace, out: str, mask: bool) -> Any:
    from ..cli import config_from_args
    from ..trainer import Trainer

    argv = ["--preset", args.preset, "--steps", str(args.steps), "--out", out, "--peak-tflops", "1",
            "--no-logging.progress", "--no-logging.plot", "--no-logging.tensorboard", "--no-eval.enabled",
            "--data.document_mask" if mask else "--no-data.document_mask"]
    if args.context:
        argv += ["--context", str(args.context)]
    if args.data:
        argv += ["--data", args.data]
    cfg, _ = config_from_args(argv)
    return Trainer(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.data.mask_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-moe")
    ap.add_argument("--steps", type=int, default=40, help="steps of each run (default 40)")
    ap.add_argument("--context", type=int, default=0, help="tokens per instance (default: the preset's)")
    ap.add_argument("--data", default=None, help="a data set (default: the embedded corpus)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed {WARMUP} (the warm-up steps left out)")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {False: trainer_for(args, f"{tmp}/off", False), True: trainer_for(args, f"{tmp}/on", True)}
        on = runs[True]
        eos = on.document_eos
        rates: dict[bool, list[float]] = {False: [], True: []}
        last: dict[bool, float] = {}
        rows = bounded = 0
        for step in range(args.steps):
            for mb in on.loader.batch_at(on.loader.next_instance):
                rows += mb[0].shape[0]
                bounded += int((mb[0] == eos).any(dim=1).sum())
            for mask in ((False, True) if step % 2 == 0 else (True, False)):
                rec = runs[mask].train_step()
                last[mask] = rec["loss"]
                if step >= WARMUP:
                    rates[mask].append(rec["tokens_per_s"])
        cfg = on.cfg
    off_s, on_s = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"{args.preset}, context {cfg.data.context}, {cfg.schedule.global_batch} x {cfg.data.context} tokens per "
          f"step, {args.steps} steps each (median of steps {WARMUP + 1}-{args.steps}), "
          f"{torch.get_num_threads()} thread(s); instances holding a document boundary: {bounded}/{rows} "
          f"({100 * bounded / max(rows, 1):.0f}%)\n")
    print("| --data.document_mask | tokens/s (median) | tokens/s (min-max) | loss at the last step |")
    print("|---|---:|---:|---:|")
    for mask, med in ((False, off_s), (True, on_s)):
        r = rates[mask]
        print(f"| {'on' if mask else 'off'} | {med:,.0f} | {min(r):,.0f}-{max(r):,.0f} | {last[mask]:.4f} |")
    print(f"\non / off: {on_s / off_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a run writes at its end over every step it took (earlier runs on its --out included):
``summary.json`` and the loss chart ``loss.png`` with the learning rate beside it."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from .metrics import plot_loss

#: What each time in summary.json measures (written into it as ``times``).
TIMES = {
    "wall_s": "wall time of this process's part of the run, from its first step to this summary (checkpoint "
              "stalls, evaluations and the last checkpoint included)",
    "step_time_s": "the training steps' own time over the whole run (earlier runs on this --out included), "
                   "compilation left out",
    "compile_s": "compilation (--compile) over the whole run",
    "eval_s": "validation over the whole run",
    "checkpoint_stall_s": "the step loop's wait for this process's full checkpoints",
    "checkpoint_write_s": "the writes of those checkpoints (in the background with --checkpoint.async)",
}


def write_summary(trainer: Any) -> dict[str, Any]:
    """summary.json and loss.png of ``trainer`` (a :class:`trainer.trainer.Trainer`, on rank 0) over
    the whole run; returns the summary ({} before the first step)."""
    h = trainer.run_records()
    if not h:
        return {}
    timed = h[1:] if len(h) > 1 else h  # the first step pays one-off costs
    summary = {
        "steps": trainer.step, "steps_this_run": len(trainer.history), "loss_first": h[0]["loss"],
        "loss_last": h[-1]["loss"],
        "loss_min": min(r["loss"] for r in h), "grad_spikes": trainer.spikes.count,
        "tokens_per_s_mean": sum(r["tokens_per_s"] for r in timed) / len(timed),
        "step_time_s": sum(r["step_time_s"] for r in h),
        "compile_s": sum(r.get("compile_s", 0.0) for r in h),
        "eval_s": sum(r.get("val_s", 0.0) for r in h),
    }
    started = getattr(trainer, "fit_started", None)
    if started is not None:
        summary["wall_s"] = time.perf_counter() - started
    timings = trainer.checkpoints.timings  # this run's full checkpoints: the step loop's stall, the write
    if timings:
        summary["checkpoints"] = timings
        summary["checkpoint_stall_s"] = sum(t["stall_s"] for t in timings)
        summary["checkpoint_write_s"] = sum(t.get("write_s", 0.0) for t in timings)
    summary["times"] = {k: v for k, v in TIMES.items() if k in summary}
    if "mfu" in h[-1]:
        summary["mfu_mean"] = sum(r.get("mfu") or 0.0 for r in timed) / len(timed)
    with open(os.path.join(trainer.out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    cfg, lay = trainer.cfg, trainer.layout
    if cfg.logging.plot:
        title = f"{cfg.preset} (PP {lay.pp} x DP {lay.dp} x EP {lay.ep}, {trainer.device.type})"
        plot_loss(h, os.path.join(trainer.out_dir, "loss.png"), title=title,
                  schedule=trainer.schedule.phases())
    return summary

"""The lines a run prints when things happen, between its progress lines: the validation loss
(overall and per source), each checkpoint (step, slot, the step loop's stall, the write time, or
that the write goes on in the background, and when that write is done), the schedule's phases (the
warmup's end, a WSD decay's start and end, a decay branch's), and once a warning that asynchronous
checkpoints cannot keep up. Each is flushed as it is printed, on stdout, also when it is a file or
a pipe: a log shows them in order with the steps (rank 0 only)."""
from __future__ import annotations

import sys
from typing import Any


class RunEvents:
    """The event lines of one run (:meth:`lines` per step record), printed by :meth:`say`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.warned_async = False

    def lines(self, rec: dict[str, Any]) -> list[str]:
        t, step = self.trainer, int(rec["step"])
        out = []
        phase = t.schedule.phase_begins(step)
        if phase is not None:
            out.append(f"step {step}: {phase}")
        if "val_loss" in rec:
            out.append(f"step {step}: validation loss {rec['val_loss']:.4f} (perplexity {rec['val_ppl']:.2f}, "
                       f"{rec['val_tokens']} tokens, {rec.get('val_s', 0.0):.2f} s)")
            out += [f"step {step}: validation loss {k[9:]} {v:.4f}" for k, v in rec.items()
                    if k.startswith("val_loss/")]
        asynchronous = rec.get("checkpoint_async")
        if "checkpoint_write_step" in rec and asynchronous is not False:  # a background write collected
            ws, w = int(rec["checkpoint_write_step"]), float(rec["checkpoint_write_s"])
            out.append(f"step {step}: checkpoint of step {ws} written in the background in {w:.2f} s")
            out += self._keep_up(ws, w)
        if asynchronous is not None:
            path = t._last_full[1] if t._last_full is not None and t._last_full[0] == step else t.checkpoints.root
            stall = float(rec["checkpoint_stall_s"])
            out.append(f"step {step}: checkpoint {path} staged ({stall:.2f} s stall), written in the background"
                       if asynchronous else
                       f"step {step}: checkpoint {path} ({stall:.2f} s stall, written in {rec['checkpoint_write_s']:.2f} s)")
        return out

    def _keep_up(self, write_step: int, write_s: float) -> list[str]:
        """Once: the warning that a background write takes longer than the steps between two checkpoints."""
        t = self.trainer
        interval = t.cfg.checkpoint.interval
        steps = [r["step_time_s"] for r in t.history if write_step < r["step"] <= write_step + interval]
        if self.warned_async or interval <= 0 or len(steps) < interval or write_s <= sum(steps):
            return []
        self.warned_async = True
        return [f"warning: asynchronous checkpoints cannot keep up: the background write of step {write_step} took "
                f"{write_s:.2f} s, the {interval} step(s) until the next checkpoint {sum(steps):.2f} s, so each "
                f"checkpoint waits for the last one's write; a larger --checkpoint.interval lets the writes overlap "
                f"the steps"]

    @staticmethod
    def say(bar: Any, line: str) -> None:
        """Print ``line`` on stdout now, above a terminal's progress bar when there is one."""
        if bar is not None and hasattr(bar, "write") and hasattr(bar, "clear"):  # tqdm
            bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

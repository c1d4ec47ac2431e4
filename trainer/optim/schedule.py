"""Learning-rate schedules: linear warmup to the peak, then cosine (the paper's recipe) or linear decay
to the minimum over the rest of the run, or warmup-stable-decay (WSD): the peak until a decay over
the last steps, so that a run can be extended, or a decay branch started from any stable-phase
checkpoint. The options and their checks: :mod:`trainer.config.schedule`."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ..config import ConfigError, ScheduleConfig
from ..config.schedule import decay_window


def lr_at(step: int, *, peak: float, minimum: float, warmup: int, total: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of the cosine schedule.

    Warmup: ``peak * (step + 1) / warmup`` for ``step < warmup`` (the first step already moves);
    then ``minimum + (peak - minimum) * (1 + cos(pi * p)) / 2`` with ``p`` going from 0 at the first
    post-warmup step to 1 at the last step ``total - 1``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - 1 - warmup, 1)
    p = min(max(step - warmup, 0) / span, 1.0)
    return minimum + (peak - minimum) * 0.5 * (1.0 + math.cos(math.pi * p))


def decay_factor(p: float, shape: str) -> float:
    """From 1 at ``p = 0`` to 0 at ``p = 1``: ``1 - p``, ``(1 + cos(pi p)) / 2`` or ``1 - sqrt(p)``."""
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(p)
    raise ValueError(f"decay shape must be linear, cosine or 1-sqrt, got {shape!r}")


class Schedule:
    """One run's learning rate at every step (0-based, as the optimizer counts them), from a validated
    schedule section and the peak rate (``--lr``)."""

    def __init__(self, s: ScheduleConfig, peak: float) -> None:
        self.kind, self.peak, self.minimum = s.kind, peak, s.min_lr
        self.warmup, self.total, self.decay_shape = s.warmup_steps, s.steps, s.decay_shape
        # WSD: the first decaying step (the stable phase runs from the warmup's end up to it) and the decay's length
        self.decay_start, self.decay_steps = decay_window(s) if s.kind == "wsd" else (0, 0)

    @classmethod
    def saved(cls, config: dict[str, Any], like: "Schedule") -> "Schedule":
        """The schedule a checkpoint's config (``meta["config"]``) was trained on; fields it does not
        record (checkpoints older than the field) are taken from today's defaults, the peak from ``like``."""
        known = {f.name for f in dataclasses.fields(ScheduleConfig)}
        section = ScheduleConfig(**{k: v for k, v in config.get("schedule", {}).items() if k in known})
        return cls(section, config.get("optim", {}).get("lr", like.peak))

    def lr(self, step: int) -> float:
        if self.kind == "cosine":
            return lr_at(step, peak=self.peak, minimum=self.minimum, warmup=self.warmup, total=self.total)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.kind == "linear":
            p = min(max(step - self.warmup, 0) / max(self.total - 1 - self.warmup, 1), 1.0)
            return self.minimum + (self.peak - self.minimum) * (1.0 - p)
        if step < self.decay_start:
            return self.peak
        # the decay's first step is already below the peak, its last (and any after it) at the minimum
        p = min((step - self.decay_start + 1) / self.decay_steps, 1.0)
        return self.minimum + (self.peak - self.minimum) * decay_factor(p, self.decay_shape)

    def phases(self) -> str:
        """The schedule in words, with the steps as the records number them (from 1)."""
        w = self.warmup
        warm = f"warmup {_steps(1, w)}, " if w else ""
        if self.kind != "wsd":
            if w >= self.total:
                return f"{self.kind}, warmup through the last step {self.total} (of {w} warmup steps)"
            return f"{self.kind}, {warm}{self.kind} {self.peak:.2e} -> {self.minimum:.2e} {_steps(w + 1, self.total)}"
        a, b = self.decay_start, self.decay_start + self.decay_steps
        stable = f"stable at {self.peak:.2e} {_steps(w + 1, a)}, " if a > w else ""
        after = f", at {self.minimum:.2e} {_steps(b + 1, self.total)}" if b < self.total else ""
        return f"wsd, {warm}{stable}{self.decay_shape} decay to {self.minimum:.2e} {_steps(a + 1, b)}{after}"


    def phase_begins(self, step: int) -> str | None:
        """The phase that begins at record step ``step`` (from 1), in words, or None: the end of the
        warmup, and under WSD the stable phase, the decay (a decay branch's included) and its end."""
        w, n = self.warmup, self.total
        if self.kind != "wsd":
            if w and step == w + 1 <= n:
                return f"warmup over; {self.kind} {self.peak:.2e} -> {self.minimum:.2e} {_steps(w + 1, n)}"
            return None
        a, b = self.decay_start, self.decay_start + self.decay_steps
        if step == a + 1 <= n:
            return f"{'warmup over; ' if w and a == w else ''}{self.decay_shape} decay to {self.minimum:.2e} {_steps(a + 1, b)}"
        if w and step == w + 1 <= a:
            return f"warmup over; stable at {self.peak:.2e} {_steps(w + 1, a)}"
        if step == b + 1 <= n:
            return f"decay over; at {self.minimum:.2e} {_steps(b + 1, n)}"
        return None


def _under(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def clipping_active(step: int, warmup: int) -> bool:
    """Gradient clipping applies only once warmup is over (the paper's recipe)."""
    return step >= warmup


#: The fields that make the learning-rate schedule, as (section, field, option).
SCHEDULE_FIELDS = (("schedule", "steps", "--steps"), ("schedule", "warmup_steps", "--warmup"),
                   ("schedule", "min_lr", "--min-lr"), ("optim", "lr", "--lr"),
                   *(("schedule", name, f"--schedule.{name}")
                     for name in ("kind", "decay_steps", "decay_fraction", "decay_shape", "decay_from")))


def check_resume(cfg: Any, saved: dict[str, Any] | None, step: int, path: str) -> str | None:
    """A resume at ``step`` from the checkpoint ``path`` whose config was ``saved``, on ``cfg``'s schedule.

    None when the schedule is the same. When it differs, a line to print: a note where both are WSD
    and the steps taken had the same rates on both (extending a run in its stable phase, or a decay
    branch from a stable-phase checkpoint); else a warning under ``--checkpoint.reschedule``, and
    without it :class:`ConfigError` naming the change and the way on."""
    if not saved:
        return None
    branch, source = cfg.schedule.decay_from, cfg.checkpoint.resume_from
    if branch is not None and source and step > branch and _under(path, source):
        # a decay branch starts from the source run's checkpoint of its step, which that run no longer keeps
        raise ConfigError(f"--schedule.decay_from {branch} branches at step {branch}, and the newest checkpoint "
                          f"{source} holds is {path} of step {step}: a branch starts from a checkpoint of its own "
                          f"step; give --checkpoint.resume_from a slot of step {branch} (a run keeps its two newest "
                          f"full checkpoints; --checkpoint.model_interval keeps more), or --schedule.decay_from {step}")
    changed, defaults = [], dataclasses.asdict(ScheduleConfig())
    for section, name, option in SCHEDULE_FIELDS:
        kept = saved.get(section, {})
        if name not in kept and section != "schedule":
            continue
        old, new = kept.get(name, defaults.get(name)), getattr(getattr(cfg, section), name)  # older: the defaults
        if old != new:
            changed.append(f"{option} {old} -> {new}")
    if not changed:
        return None
    now = Schedule(cfg.schedule, cfg.optim.lr)
    was = Schedule.saved(saved, now)
    what = (f"the checkpoint {path} (step {step}) was trained on another schedule ({', '.join(changed)}): the "
            f"learning rate of step {step + 1} is {now.lr(step):.2e} on the new one, {was.lr(step):.2e} on the "
            "checkpoint's")
    if was.kind == now.kind == "wsd" and all(was.lr(k) == now.lr(k) for k in range(step)):
        return f"schedule: {what}; steps 1-{step} had the same rates on both, continuing on the new schedule"
    if was.kind == "wsd" and step > was.decay_start and now.kind == "wsd":
        what += (f"; the checkpoint is in its decay (from step {was.decay_start + 1}): extend or branch from a "
                 "stable-phase checkpoint")
    if not cfg.checkpoint.reschedule:
        raise ConfigError(f"{what}; pass --checkpoint.reschedule to continue on the new schedule, or give "
                          f"the old values")
    return f"warning: {what}; continuing on the new schedule (--checkpoint.reschedule)"

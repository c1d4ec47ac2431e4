"""The learning-rate schedule's options: the kinds, the shapes of a WSD decay, where that decay lies,
and the checks :func:`trainer.config.validate` runs on them (and on ``--checkpoint.resume_from``,
which starts a decay branch from another run's checkpoint).

The rates themselves are computed in :mod:`trainer.optim.schedule`.
"""
from __future__ import annotations

import os
from typing import Any

from .errors import ConfigError

#: ``--schedule.kind``: warmup, then cosine or linear to ``min_lr`` over the rest of the run; or
#: warmup-stable-decay (flat at the peak, then a decay over the last steps).
KINDS = ("cosine", "linear", "wsd")
#: ``--schedule.decay_shape`` of a WSD decay.
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
#: The share of a WSD run's steps that decay when neither decay_steps nor decay_fraction is given.
DEFAULT_DECAY_FRACTION = 0.2
#: The WSD-only fields that default to None (set with another kind, they are refused).
WSD_FIELDS = ("decay_steps", "decay_fraction", "decay_from")


def decay_fraction(s: Any) -> float:
    return DEFAULT_DECAY_FRACTION if s.decay_fraction is None else s.decay_fraction


def branch_steps(s: Any) -> int:
    """A decay branch's total steps when ``--steps`` is not given: ``decay_from`` plus its decay, which
    is ``decay_steps``, or the ``decay_fraction`` of that total."""
    if s.decay_steps is not None:
        return s.decay_from + s.decay_steps
    return max(s.decay_from + 1, round(s.decay_from / (1.0 - decay_fraction(s))))


def decay_window(s: Any) -> tuple[int, int]:
    """(first decaying step, 0-based; number of decaying steps) of the WSD section ``s`` (steps
    resolved). Without ``decay_from`` the decay is the run's last steps; with it, the decay starts
    there and lasts ``decay_steps``, or to the end of the run."""
    if s.decay_from is not None:
        return s.decay_from, (s.decay_steps if s.decay_steps is not None else s.steps - s.decay_from)
    length = s.decay_steps if s.decay_steps is not None else max(1, round(decay_fraction(s) * s.steps))
    return s.steps - length, length


def check_schedule(cfg: Any) -> None:
    """Refuse, in one line, a schedule that cannot run; fill in a decay branch's ``steps`` (0 there
    means ``decay_from`` plus the decay). Runs before the other checks of the schedule's numbers."""
    s = cfg.schedule
    if s.kind != "wsd":
        given = [f"--schedule.{name}" for name in WSD_FIELDS if getattr(s, name) is not None]
        if given:
            one = len(given) == 1
            raise ConfigError(f"{', '.join(given)} {'is' if one else 'are'} for --schedule.kind wsd, the kind is "
                              f"{s.kind!r}: add --schedule.kind wsd, or leave {'it' if one else 'them'} out")
        return
    if s.decay_steps is not None and s.decay_fraction is not None:
        raise ConfigError(f"give the decay's length once: --schedule.decay_steps {s.decay_steps} or "
                          f"--schedule.decay_fraction {s.decay_fraction}, not both")
    if s.decay_steps is not None and s.decay_steps < 1:
        raise ConfigError(f"--schedule.decay_steps must be >= 1, got {s.decay_steps}")
    if s.decay_fraction is not None and not 0.0 < s.decay_fraction < 1.0:
        raise ConfigError(f"--schedule.decay_fraction must lie in (0, 1), got {s.decay_fraction}")
    if s.decay_from is not None:
        if s.decay_from < 0:
            raise ConfigError(f"--schedule.decay_from must be >= 0, got {s.decay_from}")
        if s.steps == 0:
            s.steps = branch_steps(s)
        elif s.decay_fraction is not None:
            raise ConfigError(f"with --schedule.decay_from the decay runs to --steps {s.steps}: leave "
                              "--schedule.decay_fraction out, or --steps (then the fraction sets it)")
    if s.steps < 1:
        return  # validate names it
    start, length = decay_window(s)
    if length < 1:
        raise ConfigError(f"--schedule.decay_from {start} leaves no step of --steps {s.steps} to decay")
    if start < 0:
        raise ConfigError(f"the decay ({length} steps) is longer than the run (--steps {s.steps})")
    if start + length > s.steps:
        raise ConfigError(f"the decay (steps {start + 1}-{start + length}) must end within --steps {s.steps}: "
                          "give more --steps or a shorter decay")
    if start < s.warmup_steps:
        raise ConfigError(f"the WSD decay starts at step {start + 1}, inside the warmup ({s.warmup_steps} steps): "
                          "lower --warmup, or give more --steps or a shorter decay")


def check_resume_from(cfg: Any) -> None:
    """``--checkpoint.resume_from`` (a decay branch's start): an existing path outside this run's
    --out and checkpoint directory, which the run never writes to."""
    ck = cfg.checkpoint
    if not ck.resume_from:
        return
    if not os.path.exists(ck.resume_from):
        raise ConfigError(f"--checkpoint.resume_from {ck.resume_from} does not exist")
    if not ck.resume:
        raise ConfigError("--checkpoint.resume_from resumes: it does not combine with --no-checkpoint.resume")
    if ck.init_from:
        raise ConfigError("give one start: --checkpoint.resume_from (the full state) or --checkpoint.init_from "
                          "(the weights), not both")
    source = os.path.realpath(ck.resume_from)
    for mine in (cfg.logging.out, ck.dir or os.path.join(cfg.logging.out, "checkpoints")):
        mine = os.path.realpath(mine)
        if os.path.commonpath([source, mine]) in (source, mine):
            raise ConfigError(f"--checkpoint.resume_from {ck.resume_from} and this run's --out {cfg.logging.out} "
                              "overlap: a run started from another run's checkpoint writes in an --out of its own")

"""What the step-time model's commands share (the command line, the calibration and validation, the search):
the usage error, where a layout's records come from when traced, the device memory, and an atomic JSON
write. Kept apart from :mod:`.model_cli` so that the modules it dispatches to need not import it back."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..parallelism.plan import GiB, Plan


class UsageError(ValueError):
    pass


def trace_or_none(plan: Plan, preset: str, fsdp: bool, strict: bool = False) -> dict | None:
    """Traced profiles of the first rank of every pipeline stage (None where the tracer is not available,
    or, unless ``strict``, where the trainer refuses this layout for a trace: the reason is said in one line
    and the formulas price it instead)."""
    try:
        from .trace import trace_profiles

        return trace_profiles(preset, world=plan.world, pp=plan.pp, ep=plan.ep, dp=plan.dp, ac=plan.ac, fsdp=fsdp,
                              optimizer=plan.optimizer, ranks=[s * plan.dp * plan.ep for s in range(plan.pp)],
                              micro_batch=plan.micro_batch, global_batch=plan.global_batch, context=plan.context,
                              jobs=2)
    except (NotImplementedError, ImportError):
        return None
    except ValueError as e:
        if strict:
            raise UsageError(f"--source trace: {e}") from None
        print(f"fastmoe-plan: world {plan.world} priced from the formulas, not traced: {e}", file=sys.stderr,
              flush=True)
        return None


def fill_memory(traced: dict, formula: dict) -> None:
    """The formula's memory terms a trace does not hold (activations, gathered weights), by stage."""
    by_stage = {p.stage: p for p in formula.values()}
    for p in traced.values():
        for k, v in by_stage[p.stage].memory_bytes.items():
            p.memory_bytes.setdefault(k, v)


def device_memory(args: Any, cluster: Any) -> float:
    return (args.memory_gib or float(cluster["device.memory_gib"])) * GiB


def write_text(path: str, text: str) -> None:
    """Write ``text`` to a temporary name beside ``path`` and rename it there: a process that dies
    leaves no half file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, payload: Any) -> None:
    write_text(path, json.dumps(payload, indent=1, default=str))

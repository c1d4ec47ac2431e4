"""Soft-failure detection, heartbeats and fault-injection hooks for the training loop.

Soft failure: before every optimizer step each rank checks its local loss and gradients for
NaN/Inf; one all-reduce of a flag tells every rank whether anyone saw one, so all ranks stop
*before* the update and no weight changes. The bad ranks append a line each to
``OUT/failures.jsonl`` (step, rank, host, what was bad) and every process exits with
:data:`EXIT_SOFT_FAILURE`; under ``trainer.ft.launch`` the named node leaves the job, a spare takes
its place and the run resumes from the newest valid checkpoint.

Exit codes (documented in docs/fault.md):

====  =========================================================================================
0     finished
2     bad configuration or input (not retried)
75    :data:`EXIT_SOFT_FAILURE`: NaN/Inf caught before the update; ``failures.jsonl`` names hosts
76    :data:`EXIT_CHECKPOINT_FAILURE`: a checkpoint could not be written (disk full, read-only
      directory) or checkpoints exist and none is valid; not retried (a relaunch would fail the same way)
77    ``trainer.ft.watchdog.EXIT_HANG``: no step progress within ``--heartbeat-timeout``; stacks dumped
====  =========================================================================================

Heartbeats: every rank rewrites ``OUT/heartbeat/rank-<r>.json`` (step, phase, time, pid, host,
steps done by this process and when it started)
each step and feeds the in-worker watchdog (``trainer.ft.watchdog``) when the launcher asked for one.

Test hooks, off unless the environment variable is set (the launcher passes them through):

``TRAINER_INJECT_NAN="step=5,host=h1"`` (or ``rank=1``)
    poison the loss with NaN at that step on the matching ranks (host-keyed faults follow the
    machine, so a relaunch on a spare no longer hits them; a bare ``step=5`` hits every rank).
``TRAINER_INJECT_HANG="step=5,host=h1"``
    sleep forever at that step on the matching ranks, without a heartbeat.

Either may be ``@FILE``: the spec is read from that file at each step once it exists (a fault
armed while the job runs).
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

# the shared records live in a leaf module (the watchdog writes them too); re-exported here
from .records import (  # noqa: F401
    FAILURES_FILE, HEARTBEAT_DIR, append_jsonl, check_out_dir, read_failures, read_heartbeats, record_hang,
)
from .watchdog import Watchdog

EXIT_SOFT_FAILURE = 75
EXIT_CHECKPOINT_FAILURE = 76
HOST_ENV = "TRAINER_HOST"
NAN_ENV = "TRAINER_INJECT_NAN"
HANG_ENV = "TRAINER_INJECT_HANG"


def host_name() -> str:
    """This process's host label: ``$TRAINER_HOST`` (set by the launcher), else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


class SoftFailure(RuntimeError):
    """NaN/Inf seen on some rank before the optimizer step; no weight was changed."""

    def __init__(self, step: int, bad_ranks: list[int], reason: str) -> None:
        super().__init__(f"non-finite values at step {step} on rank(s) {bad_ranks}: {reason}; "
                         "stopped before the optimizer step")
        self.step = step
        self.bad_ranks = bad_ranks
        self.reason = reason


def local_nonfinite(loss: torch.Tensor | float | None, tensors: Iterable[torch.Tensor | None]) -> str | None:
    """What is non-finite here (``"loss"``, ``"gradients"`` or both), or None.

    A gradient is tested through its fp32 sum (DeepSpeed's overflow check): NaN and Inf propagate
    into it, it is one pass without a boolean copy (20x cheaper than ``isfinite(x).all()`` on the
    CPU), and a sum beyond fp32's range (3.4e38) is as fatal a sign as an Inf. One host sync."""
    grad_bad = [torch.isfinite(t.detach().sum(dtype=torch.float32)).logical_not()
                for t in tensors if t is not None and t.numel()]
    loss_t = None if loss is None else torch.as_tensor(loss).detach()
    device = loss_t.device if loss_t is not None else (grad_bad[0].device if grad_bad else torch.device("cpu"))
    flags = torch.zeros(2, dtype=torch.bool, device=device)
    if loss_t is not None:
        flags[0] = torch.isfinite(loss_t).all().logical_not()
    if grad_bad:
        flags[1] = torch.stack([f.to(device) for f in grad_bad]).any()
    bad_loss, bad_grad = flags.tolist()
    parts = [name for name, bad in (("loss", bad_loss), ("gradients", bad_grad)) if bad]
    return " and ".join(parts) or None


def check_step(step: int, loss: torch.Tensor | float | None, grads: Iterable[torch.Tensor | None], *,
               out_dir: str | os.PathLike, group: Any = None) -> None:
    """Raise :class:`SoftFailure` on every rank if any rank's loss or gradients are non-finite.

    Collective over ``group`` (default: the world) when distributed: one all-reduce of a scalar,
    and only when it fires a second one that names the bad ranks. Call it after backward and
    before the optimizer step; the bad ranks write ``failures.jsonl`` before raising."""
    reason = local_nonfinite(loss, grads)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        if reason is not None:
            _record(out_dir, step, 0, reason, loss)
            raise SoftFailure(step, [0], reason)
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flag = torch.tensor([1.0 if reason else 0.0])
    backend = dist.get_backend(group)
    device = torch.device("cpu") if backend == "gloo" else _default_device()
    flag = flag.to(device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        return
    who = torch.zeros(world, device=device)
    if reason:
        who[rank] = 1.0
    dist.all_reduce(who, op=dist.ReduceOp.SUM, group=group)
    bad = [int(r) for r in torch.nonzero(who.cpu()).flatten().tolist()]
    if reason:
        _record(out_dir, step, dist.get_rank(), reason, loss)
    dist.barrier(group=group)  # the records are on disk before anyone exits
    raise SoftFailure(step, bad, reason or f"reported by rank(s) {bad}")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _record(out_dir: str | os.PathLike, step: int, rank: int, reason: str, loss: Any) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    try:
        loss_v = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else loss
    except (RuntimeError, ValueError):
        loss_v = None
    if isinstance(loss_v, float) and not math.isfinite(loss_v):
        loss_v = str(loss_v)  # JSON has no NaN
    append_jsonl(Path(out_dir) / FAILURES_FILE, {
        "time": time.time(), "kind": "nonfinite", "step": step, "rank": rank, "host": host_name(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "pid": os.getpid(), "what": reason, "loss": loss_v,
    })


# ============================================================================ injection hooks
@dataclass(frozen=True)
class Injection:
    """A fault to inject at ``step`` on ranks matching ``rank`` and/or ``host`` (None: any)."""

    step: int
    rank: int | None = None
    host: str | None = None
    once: str | None = None
    """A marker file: the fault fires only while it does not exist, and creates it (so a rank-keyed
    fault hits one node once, and the spare that takes the rank over is spared)."""

    @classmethod
    def parse(cls, spec: str) -> "Injection":
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in ("step", "rank", "host", "once"):
                raise ValueError(f"bad fault-injection spec {spec!r}: expected 'step=N[,rank=R][,host=H][,once=FILE]'")
            fields[key] = value
        if "step" not in fields:
            raise ValueError(f"bad fault-injection spec {spec!r}: 'step=N' is required")
        try:
            return cls(step=int(fields["step"]), rank=int(fields["rank"]) if "rank" in fields else None,
                       host=fields.get("host"), once=fields.get("once"))
        except ValueError:
            raise ValueError(f"bad fault-injection spec {spec!r}: step and rank must be integers") from None

    @classmethod
    def from_env(cls, name: str) -> "Injection | None":
        """The spec in ``$name``, or, when it is ``@FILE``, the spec in that file once it exists (a
        fault armed while the job runs: the fault soak writes it)."""
        spec = os.environ.get(name, "").strip()
        if spec.startswith("@"):
            try:
                spec = Path(spec[1:]).read_text().strip()
            except OSError:
                return None
        return cls.parse(spec) if spec else None

    def hits(self, step: int, rank: int) -> bool:
        if not (step == self.step and (self.rank is None or self.rank == rank)
                and (self.host is None or self.host == host_name())):
            return False
        if self.once is None:
            return True
        try:  # O_EXCL: exactly one process wins, even among ranks of several nodes
            os.close(os.open(self.once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return True
        except FileExistsError:
            return False


def maybe_poison(loss: torch.Tensor, step: int, rank: int, grads: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """``loss`` turned into NaN (and ``grads`` filled with NaN in place) when ``$TRAINER_INJECT_NAN``
    targets this step and rank (a test hook). Done through arithmetic, so when it is called before
    backward the gradients become NaN too, as with a real numerical fault; passing the gradient
    buffers poisons them directly (any schedule, pipelines included)."""
    inj = Injection.from_env(NAN_ENV)
    if inj is not None and inj.hits(step, rank):
        with torch.no_grad():
            for g in grads:
                g.fill_(float("nan"))
        return loss * float("nan")
    return loss


def maybe_hang(step: int, rank: int) -> None:
    """Block forever when ``$TRAINER_INJECT_HANG`` targets this step and rank (a test hook)."""
    inj = Injection.from_env(HANG_ENV)
    if inj is not None and inj.hits(step, rank):
        while True:
            time.sleep(3600)


# ============================================================================ heartbeat
def first_new_step(out_dir: str | os.PathLike, since: float) -> float | None:
    """When the first training step was completed by a process started after ``since`` (a
    failure), from the heartbeat files; None while there is none. Recovery time = the result -
    ``since``. (A process of the old group may still finish the step it was in.)"""
    done = [h["mtime"] for h in read_heartbeats(out_dir).values()
            if h.get("new_steps", 0) >= 1 and float(h.get("started", 0.0)) > since]
    return min(done) if done else None


class Heartbeat:
    """Per-rank liveness file ``OUT/heartbeat/rank-<r>.json``, rewritten atomically on every beat."""

    def __init__(self, out_dir: str | os.PathLike, rank: int) -> None:
        self.dir = Path(out_dir) / HEARTBEAT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank-{rank:05d}.json"
        self.rank = rank
        self.host = host_name()
        self.new_steps = 0
        self.started = time.time()
        # under trainer.ft.launch: a thread that turns a stall into an exit the node agent acts on
        self.watchdog = Watchdog.from_env(out_dir, rank, self.host)

    def beat(self, step: int, phase: str = "step", *, completed: bool = False, **extra: Any) -> None:
        """Record liveness; ``completed`` counts a step finished by this process (the launcher
        measures recovery time to the first one after a relaunch)."""
        if completed:
            self.new_steps += 1
        if self.watchdog is not None:
            self.watchdog.progress(step, phase)
        record = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": step, "phase": phase,
                  "time": time.time(), "new_steps": self.new_steps, "started": self.started, **extra}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")  # its own: never another process's half-written one
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

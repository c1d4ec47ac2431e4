"""Supervise a training run: relaunch on a spare host after a crash, a hang or a soft failure.

    python -m trainer.launch --hosts h0,h1 --spares h2 --nproc-per-node 2 --max-restarts 3 \\
        [--heartbeat-timeout 120] --out OUT -- --preset tiny-moe --steps 200 --checkpoint.interval 20

Every attempt starts one process group over all hosts: host ``i`` runs global ranks
``i*N .. i*N+N-1`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set as
torchrun would, plus ``TRAINER_HOST`` = the host label). On this machine a "host" is a set of
local processes carrying that label; on a cluster the same supervisor would start them with
torchrun on the named node. The supervisor polls the processes and their heartbeat files and
treats as a failure:

* any non-zero exit (a rank killed by a signal is blamed before ranks that died of its absence);
* :data:`trainer.fault.EXIT_SOFT_FAILURE`: the hosts named in ``OUT/failures.jsonl`` are blamed;
* a heartbeat older than ``--heartbeat-timeout`` (``--startup-timeout`` before the first one,
  ``--checkpoint-timeout`` while the rank writes a checkpoint): the rank that got least far is
  blamed (then the one silent longest).

It then kills every process (SIGTERM, then SIGKILL after ``--kill-grace``), marks the blamed host
bad, puts a spare in its place and relaunches; the trainer resumes from the newest valid
checkpoint. Exit codes that a relaunch cannot fix (bad configuration 2, checkpoint write failure
:data:`trainer.fault.EXIT_CHECKPOINT_FAILURE`) end the run. Every event goes to stdout and to
``OUT/launcher.jsonl``; per-rank output goes to ``OUT/logs/attempt-<k>/rank-<r>.log``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .fault import (
    EXIT_CHECKPOINT_FAILURE, EXIT_SOFT_FAILURE, HEARTBEAT_DIR, HOST_ENV, read_failures, read_heartbeats,
)

#: Order of heartbeat phases within one ``step`` value: "done"/"checkpoint" of step s-1 write
#: ``step = s``, and "start" of step s comes after them.
PHASE_ORDER = {"startup": 0, "resumed": 1, "done": 2, "checkpoint": 3, "start": 4}
#: Exit codes a relaunch cannot fix.
FATAL_EXIT_CODES = {2: "bad configuration or input", EXIT_CHECKPOINT_FAILURE: "checkpoint write failure"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Failure:
    kind: str
    """``"signal"``, ``"exit"``, ``"soft"``, ``"hang"`` or ``"fatal"``."""
    hosts: list[str]
    rank: int | None
    returncode: int | None
    detail: str


@dataclass
class Attempt:
    index: int
    hosts: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    started: float = 0.0
    failures_seen: int = 0


class Supervisor:
    """Runs attempts until one finishes, a fatal error occurs, or restarts/spares run out."""

    def __init__(self, *, hosts: Sequence[str], spares: Sequence[str], nproc_per_node: int, max_restarts: int,
                 out: str | os.PathLike, command: Sequence[str], heartbeat_timeout: float = 120.0,
                 startup_timeout: float = 600.0, checkpoint_timeout: float = 1800.0, kill_grace: float = 5.0,
                 poll: float = 0.1,
                 env: dict[str, str] | None = None) -> None:
        if not hosts:
            raise ValueError("--hosts must name at least one host")
        names = list(hosts) + list(spares)
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct, got hosts {list(hosts)} and spares {list(spares)}")
        if nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        self.hosts = list(hosts)
        self.spares = list(spares)
        self.bad: list[str] = []
        self.nproc = nproc_per_node
        self.max_restarts = max_restarts
        self.out = Path(out)
        self.command = list(command)
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.checkpoint_timeout = checkpoint_timeout
        self.kill_grace = kill_grace
        self.poll = poll
        self.env = dict(env or {})
        self.out.mkdir(parents=True, exist_ok=True)
        self.events = self.out / "launcher.jsonl"
        self._children: list[subprocess.Popen] = []

    # -------------------------------------------------------------------------- events
    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        line = json.dumps(record, sort_keys=True)
        print(f"[launch] {line}", flush=True)
        with open(self.events, "a") as f:
            f.write(line + "\n")
        return record

    # -------------------------------------------------------------------------- processes
    def _start(self, index: int) -> Attempt:
        hb = self.out / HEARTBEAT_DIR
        if hb.exists():
            for f in hb.iterdir():
                f.unlink()
        logdir = self.out / "logs" / f"attempt-{index:02d}"
        logdir.mkdir(parents=True, exist_ok=True)
        att = Attempt(index=index, hosts=list(self.hosts), started=time.time(),
                      failures_seen=len(read_failures(self.out)))
        world = len(self.hosts) * self.nproc
        port = free_port()
        self.log("start", attempt=index, hosts=self.hosts, spares=self.spares, world=world, port=port,
                 command=self.command)
        for node, host in enumerate(self.hosts):
            for local in range(self.nproc):
                rank = node * self.nproc + local
                env = dict(os.environ)
                env.update(self.env)
                env.update({
                    "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": str(node), "NODE_RANK": str(node),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), HOST_ENV: host,
                    "TORCHELASTIC_RESTART_COUNT": str(index),
                })
                env.setdefault("OMP_NUM_THREADS", "1")
                log = logdir / f"rank-{rank:05d}.log"
                with open(log, "wb") as fh:
                    # own session per rank: killpg reaches anything the rank started (data workers)
                    p = subprocess.Popen(self.command, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
                att.procs.append(p)
                att.logs.append(log)
                self._children.append(p)
        return att

    def _kill_all(self, att: Attempt) -> None:
        live = [p for p in att.procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.time() + self.kill_grace
        while time.time() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.05)
        for p in att.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._children = [p for p in self._children if p.poll() is None]

    def _host_of(self, att: Attempt, rank: int) -> str:
        return att.hosts[rank // self.nproc]

    # -------------------------------------------------------------------------- detection
    def _check(self, att: Attempt) -> Failure | None | bool:
        """A Failure, True when every rank finished cleanly, or None while running."""
        codes = [p.poll() for p in att.procs]
        if all(c == 0 for c in codes):
            return True
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return self._classify_exit(att, failed)
        return self._check_heartbeats(att, codes)

    def _classify_exit(self, att: Attempt, failed: list[tuple[int, int]]) -> Failure:
        soft = [r for r, c in failed if c == EXIT_SOFT_FAILURE]
        if soft:
            records = read_failures(self.out)[att.failures_seen:]
            hosts = sorted({rec["host"] for rec in records if rec.get("host") in att.hosts})
            ranks = sorted({rec["rank"] for rec in records})
            detail = "; ".join(f"rank {rec['rank']} on {rec['host']}: non-finite {rec.get('what')} at step "
                               f"{rec.get('step')}" for rec in records) or "no failures.jsonl record"
            return Failure("soft", hosts, ranks[0] if ranks else soft[0], EXIT_SOFT_FAILURE, detail)
        fatal = [(r, c) for r, c in failed if c in FATAL_EXIT_CODES]
        if fatal:
            r, c = fatal[0]
            return Failure("fatal", [], r, c, f"{FATAL_EXIT_CODES[c]} (see {att.logs[r]})")
        # a rank killed by a signal is the cause; the others died of its absence
        signalled = [(r, c) for r, c in failed if c < 0]
        r, c = (signalled or failed)[0]
        kind = "signal" if c < 0 else "exit"
        detail = (f"rank {r} killed by {signal.Signals(-c).name}" if c < 0 else f"rank {r} exited with {c}")
        return Failure(kind, [self._host_of(att, r)], r, c, detail + f" (log: {att.logs[r]})")

    def _check_heartbeats(self, att: Attempt, codes: list[int | None]) -> Failure | None:
        now = time.time()
        beats = read_heartbeats(self.out)
        stale = []
        for r, c in enumerate(codes):
            if c == 0:
                continue  # finished; no more heartbeats
            rec = beats.get(r)
            if rec is None:
                age, limit = now - att.started, self.startup_timeout
            else:
                age = now - rec["mtime"]
                limit = self.checkpoint_timeout if rec.get("phase") == "checkpoint" else self.heartbeat_timeout
            if age > limit:
                stale.append((rec["mtime"] if rec else att.started, r, rec))
        if not stale:
            return None
        # every rank blocked on the hung one goes quiet too: blame the rank that got least far
        # (then the one silent longest); a rank that never beat has made no progress at all
        def progress(r: int) -> tuple:
            rec = beats.get(r)
            if rec is None:
                return (-1, -1, att.started)
            return (rec["step"], PHASE_ORDER.get(rec["phase"], 0), rec["mtime"])

        live = [r for r, c in enumerate(codes) if c is None]
        r = min(live or [s[1] for s in stale], key=progress)
        rec = beats.get(r)
        last = rec["mtime"] if rec else att.started
        where = f"step {rec['step']} ({rec['phase']})" if rec else "start-up"
        return Failure("hang", [self._host_of(att, r)], r, None,
                       f"rank {r} silent for {now - last:.1f}s since {where}")

    # -------------------------------------------------------------------------- main loop
    def run(self) -> int:
        restarts = 0
        failed_at: float | None = None
        t_begin = time.time()
        index = 0
        while True:
            att = self._start(index)
            recovered = failed_at is None
            while True:
                state = self._check(att)
                if not recovered:
                    done = [b for b in read_heartbeats(self.out).values() if b.get("new_steps", 0) >= 1]
                    if done:
                        first = min(done, key=lambda b: b["mtime"])
                        self.log("recovered", attempt=index, seconds_since_failure=round(first["mtime"] - failed_at, 3),
                                 step=first["step"])
                        recovered = True
                if state is True:
                    self.log("finished", attempt=index, restarts=restarts, seconds=round(time.time() - t_begin, 3))
                    return 0
                if state is not None:
                    break
                time.sleep(self.poll)
            failure: Failure = state
            failed_at = time.time()
            self.log("failure", attempt=index, kind=failure.kind, hosts=failure.hosts, rank=failure.rank,
                     returncode=failure.returncode, detail=failure.detail)
            if failure.rank is not None and failure.kind != "soft":
                _print_tail(att.logs[failure.rank])
            self._kill_all(att)
            self.log("stopped", attempt=index, returncodes=[p.returncode for p in att.procs])
            if failure.kind == "fatal":
                self.log("give_up", reason=failure.detail)
                return int(failure.returncode or 1)
            if restarts >= self.max_restarts:
                self.log("give_up", reason=f"restart limit {self.max_restarts} reached")
                return 1
            for host in failure.hosts:
                if not self.spares:
                    self.log("give_up", reason=f"host {host} failed and no spare is left")
                    return 1
                spare = self.spares.pop(0)
                self.hosts[self.hosts.index(host)] = spare
                self.bad.append(host)
                self.log("replace", host=host, spare=spare, bad_hosts=self.bad)
            restarts += 1
            index += 1

    def shutdown(self) -> None:
        for p in self._children:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)


def _print_tail(log: Path, lines: int = 15) -> None:
    """The end of a failed rank's output, so the cause shows without opening the log."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return
    for line in tail:
        print(f"[launch]   | {line}", flush=True)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ============================================================================ CLI
def _has_out(args: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        for flag in ("--out", "--logging.out"):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.launch",
        description="Run the trainer under a supervisor that replaces failed hosts with spares and resumes.",
        epilog="Everything after -- goes to the trainer; the supervisor appends the resume flag.",
    )
    ap.add_argument("--hosts", required=True, help="comma-separated host labels the run starts on")
    ap.add_argument("--spares", default="", help="comma-separated spare host labels")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="processes (ranks) per host")
    ap.add_argument("--max-restarts", type=int, default=3, help="relaunches before giving up")
    ap.add_argument("--heartbeat-timeout", type=float, default=300.0,
                    help="seconds without a heartbeat before a rank counts as hung")
    ap.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds a rank may take to its first heartbeat (imports, data preparation)")
    ap.add_argument("--checkpoint-timeout", type=float, default=1800.0,
                    help="seconds a rank may stay silent while writing a checkpoint")
    ap.add_argument("--kill-grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--out", default=None, help="run directory (default: the trainer's --out)")
    # the trainer's own package, under whichever name it is installed
    ap.add_argument("--entry", default=__package__.split(".")[0],
                    help="python module (or .py script) to run on every rank")
    ap.add_argument("--resume-arg", default="--checkpoint.resume",
                    help="arguments appended to the trainer's so every attempt resumes from the newest checkpoint")
    ap.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    rest = list(args.trainer_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    out = args.out or _has_out(rest)
    if out is None:
        ap.error("give --out (or --out in the trainer's arguments): the launcher reads heartbeats and failures there")
    if _has_out(rest) is None:
        rest += ["--out", out]
    entry = [args.entry] if args.entry.endswith(".py") else ["-m", args.entry]
    command = [sys.executable, *entry, *rest, *args.resume_arg.split()]
    try:
        sup = Supervisor(hosts=[h for h in args.hosts.split(",") if h],
                         spares=[h for h in args.spares.split(",") if h], nproc_per_node=args.nproc_per_node,
                         max_restarts=args.max_restarts, out=out, command=command,
                         heartbeat_timeout=args.heartbeat_timeout, startup_timeout=args.startup_timeout,
                         checkpoint_timeout=args.checkpoint_timeout, kill_grace=args.kill_grace)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def _terminate(signum: int, frame: Any) -> None:
        sup.shutdown()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    try:
        return sup.run()
    except KeyboardInterrupt:
        sup.shutdown()
        return 130


if __name__ == "__main__":
    sys.exit(main())

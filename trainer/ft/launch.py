"""Per-node launcher on torch's elastic agent: restarts, spares and blame for the trainer.

Run the same command once on every node, spares included (``mpiexec -ppn 1``,
``srun --ntasks-per-node 1``, or by hand)::

    python -m trainer.ft.launch --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 --rdzv-id JOB \\
        --max-restarts 3 [--node-label NAME] [--heartbeat-timeout 300] --out OUT -- <trainer args>

or, on one machine, K node launchers sharing one rendezvous on 127.0.0.1::

    python -m trainer.ft.launch --local-nodes 3 --nnodes 2 --nproc-per-node 1 --out OUT -- <trainer args>

Each node runs torch's ``LocalElasticAgent`` with the ``c10d`` rendezvous; it starts only its own
ranks. The first ``--nnodes`` nodes to arrive train; later ones wait in the rendezvous (its
redundancy list) and take the place of a node that leaves. A failure anywhere makes every agent
restart its workers in a new rendezvous round; the trainer resumes from the newest valid checkpoint.
What this module adds to the agent:

* blame: a node whose rank reported a NaN/Inf (exit 75) or was named by a watchdog (exit 77) in
  ``OUT/failures.jsonl`` leaves the job (its agent stops, leaves the rendezvous and exits without
  closing it), so a spare replaces it;
* fatal codes (2: bad configuration or ``--out``; 76: checkpoint write failure or no valid
  checkpoint) stop the job on every node instead of restarting;
* the watchdog's settings for the workers (``trainer.ft.watchdog``), the node label
  (``TRAINER_HOST``), and ``OUT/launcher.jsonl``, appended by whichever node observes an event;
* a check that every node was started with the same ``--nnodes``/``--nproc-per-node``;
* ``--serve-store``: the rendezvous store in a process of its own, so that losing a training node
  never loses the store (``--local-nodes`` does this for its nodes);
* one rendezvous round per failure: a node that loses the race for the last slot waits as a spare
  instead of making every agent restart its workers again (:class:`~trainer.ft.elastic.agent.RoundGuard`);
* workers stopped within ``--kill-grace`` s on every path (SIGCONT + SIGTERM, then SIGKILL), so a
  stopped worker does not hold a restart for torch's 30 s;
* ``--quorum-timeout``: once the job has trained, a round short of nodes stops the job with one line
  saying how many nodes it has and needs, instead of waiting ``join_timeout``;
* the rendezvous store's loss as one ``error:`` line (workers' stderr goes to their log files;
  each failure event carries one line per failed rank).

Exit codes and the cluster command lines: docs/fault.md.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import typing
from pathlib import Path
from typing import Sequence

# The launcher's own C++ warnings are off (torch reads this when it loads; the workers get the
# user's setting back before run_node starts them): when the store's host dies, c10's TCPStore prints a broken pipe
# with some 30 C++ frames before the launcher's one-line error could say what happened.
_CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
_QUIET_CPP = ((__name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "fastmoe-launch")
              and _CPP_LOG_ENV not in os.environ and "torch" not in sys.modules)
if _QUIET_CPP:
    os.environ[_CPP_LOG_ENV] = "ERROR"

from ..config.errors import OneLineParser
from .elastic.job import (DEFAULT_KILL_GRACE, DEFAULT_PORT, DEFAULT_QUORUM_TIMEOUT, EXIT_CONFIG, NodeOptions,
                          parse_endpoint, say)
from .elastic.local_nodes import run_local_nodes
from .elastic.node import run_node, serve_store
from .records import check_out_dir
from .lease import launcher_lease

#: Rendezvous settings that make a dead node count as dead within seconds (torch: 5 s x 3) and
#: bound every wait; any of them can be overridden with --rdzv-conf.
DEFAULT_RDZV_CONF = {"join_timeout": "600", "last_call_timeout": "1", "close_timeout": "10",
                     "keep_alive_interval": "1", "keep_alive_max_attempt": "5", "read_timeout": "60"}


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"N:M"`` -> (min, max); only a fixed size (N == M) is supported (docs/fault.md)."""
    try:
        lo, _, hi = text.partition(":")
        n_min, n_max = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes must be N or N:M with integers, got {text!r}") from None
    if n_min < 1 or n_max < n_min:
        raise ValueError(f"--nnodes {text!r}: give N, the number of nodes that train (>= 1); N:M would name the "
                         "fewest (N) and the most (M) nodes of an elastic job, and only N:N is supported")
    if n_max != n_min:
        raise ValueError(f"--nnodes {text!r}: only a fixed size is supported (N:N); start extra nodes as spares. "
                         "An elastic data-parallel size would change the micro-batches per rank of a running job")
    return n_min, n_max

def parse_rdzv_conf(text: str) -> dict[str, str]:
    conf = dict(DEFAULT_RDZV_CONF)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv-conf: expected key=value[,key=value...], got {part!r}")
        conf[key.strip()] = value.strip()
    return conf

def _has_out(args: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        for flag in ("--out", "--logging.out"):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None

#: The trainer's own package, under whichever name it is installed (``--entry``'s default).
_TRAINER_ENTRY = __package__.split(".")[0]

#: Set for the node launchers ``--local-nodes`` starts: their parent checked the trainer's arguments.
_ARGS_CHECKED_ENV = "FASTMOE_LAUNCH_ARGS_CHECKED"

def check_trainer_args(trainer_args: Sequence[str], world: int) -> int | None:
    """Parse and validate the trainer's arguments for ``world`` ranks here, before any rendezvous, so
    that a bad preset, option, value or layout ends the launch at once with the trainer's one line
    (exit 2) instead of in every worker after the rendezvous. None when they pass; else the exit
    status (0 after the trainer's ``--help``)."""
    from ..cli import config_from_args
    from ..config import validate

    try:
        cfg, _ = config_from_args(list(trainer_args))
        validate(cfg, world)
    except SystemExit as e:  # argparse printed its own line (an unknown option) or the help
        return e.code if isinstance(e.code, int) else EXIT_CONFIG
    except ValueError as e:  # ConfigError, or a data set that cannot be read
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return None

class _LaunchParser(OneLineParser):
    """One ``error:`` line; an option the launcher does not know is most often the trainer's, given
    without the ``--`` that separates the two."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            words = message.split(":", 1)[1].split()
            if not self.unknown_hint(words):
                given = getattr(self, "argv", words)
                tail = given[given.index(words[0]):] if words[0] in given else words
                shown = " ".join(tail[:4]) + (" ..." if len(tail) > 4 else "")
                message = (f"unrecognized arguments: {' '.join(words)}; trainer options go after --: "
                           f"fastmoe-launch [launcher options] -- {shown}")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _LaunchParser(
        prog="fastmoe-launch", allow_abbrev=False,
        description="Per-node launcher: torch's elastic agent with spares, blame and a watchdog (docs/fault.md).",
        epilog="Everything after -- goes to the trainer; the launcher appends the resume flag.",
    )
    ap.add_argument("--nnodes", default="1", help="N (fixed size; nodes started beyond N are spares)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    ap.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous store")
    ap.add_argument("--rdzv-id", default="trainer", help="job id shared by every node")
    ap.add_argument("--rdzv-conf", default="", help="key=value,... for the c10d rendezvous "
                    f"(defaults: {','.join(f'{k}={v}' for k, v in DEFAULT_RDZV_CONF.items())}; is_host=0|1)")
    ap.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts per node before giving up")
    ap.add_argument("--node-label", default=None, help="this node's name in logs and records (default: host name)")
    ap.add_argument("--local-nodes", type=int, default=0, help="start K node launchers on this machine")
    ap.add_argument("--serve-store", default=None, metavar="HOST:PORT", help="only host the rendezvous store")
    ap.add_argument("--heartbeat-timeout", type=float, default=300.0,
                    help="seconds without progress before a rank's watchdog dumps stacks and exits 77")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="the same before the first step")
    ap.add_argument("--checkpoint-timeout", type=float, default=1800.0, help="the same while writing a checkpoint")
    ap.add_argument("--monitor-interval", type=float, default=0.5, help="seconds between the agent's polls")
    ap.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE,
                    help="seconds between SIGTERM (and SIGCONT) and SIGKILL when workers are stopped")
    ap.add_argument("--quorum-timeout", type=float, default=DEFAULT_QUORUM_TIMEOUT,
                    help="once the job has started, seconds a new round waits for --nnodes nodes before the "
                         "job stops (exit 1, one line saying how many nodes it has and needs)")
    ap.add_argument("--timeout", type=float, default=None, help="--local-nodes: give up after this many seconds")
    ap.add_argument("--out", default=None, help="run directory (default: the trainer's --out)")
    # the trainer's own package, under whichever name it is installed
    ap.add_argument("--entry", default=_TRAINER_ENTRY,
                    help="python module (or .py script) to run on every rank (the trainer's arguments are checked "
                         "before the rendezvous when it is the trainer)")
    ap.add_argument("--resume-arg", default="--checkpoint.resume",
                    help="arguments appended to the trainer's so every start resumes from the newest checkpoint")
    ap.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    return ap

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    ap.argv = argv  # type: ignore[attr-defined] # its error shows the trainer's options after --
    args = ap.parse_args(argv)
    if args.serve_store:
        return serve_store(args.serve_store, ready=Path(args.out) if args.out else None)
    rest = list(args.trainer_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    out = args.out or _has_out(rest)
    if out is None:
        ap.error("give --out (or --out in the trainer's arguments): nodes share records there")
    try:
        n_min, n_max = parse_nnodes(args.nnodes)
        conf = parse_rdzv_conf(args.rdzv_conf)
        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        if args.local_nodes < 0:
            raise ValueError(f"--local-nodes must be >= 0, got {args.local_nodes}")
        if args.rdzv_endpoint:
            parse_endpoint(args.rdzv_endpoint)
        for name in ("heartbeat_timeout", "startup_timeout", "checkpoint_timeout", "monitor_interval", "kill_grace",
                     "quorum_timeout"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    except ValueError as e:
        say(f"error: {e}", err=True)
        return EXIT_CONFIG
    trainer_world = n_min * args.nproc_per_node
    if args.entry == _TRAINER_ENTRY and os.environ.get(_ARGS_CHECKED_ENV) != "1":
        code = check_trainer_args(rest, trainer_world)
        if code is not None:
            return code
    try:
        check_out_dir(out)  # before any rendezvous (a bad --out is not retried), after every cheaper check
        # the job's lease on --out: the first node's launcher takes it, the others and every worker
        # (restarts included) join it; another live job's is refused here (trainer/ft/lease.py)
        lease = launcher_lease(out, command="fastmoe-launch", prefix=f"launch:{args.rdzv_id}@{args.rdzv_endpoint}",
                               shared=not args.local_nodes)
    except ValueError as e:
        say(f"error: {' '.join(str(e).split())}", err=True)
        return EXIT_CONFIG
    try:
        return _run(args, argv, rest, out, n_min, n_max, conf)
    finally:
        if lease is not None:
            lease.release()


def _run(args: argparse.Namespace, argv: list[str], rest: list[str], out: str, n_min: int, n_max: int,
         conf: dict[str, str]) -> int:
    """Run this node's launcher (or ``--local-nodes`` of them) once the checks passed."""
    if args.local_nodes:
        if args.node_label or args.rdzv_endpoint:
            say("error: --local-nodes picks the node labels and the endpoint itself", err=True)
            return EXIT_CONFIG
        node_argv = _strip(argv, {"--local-nodes": 1, "--timeout": 1})
        if "--rdzv-conf" in node_argv:  # the store runs apart: no node may host it
            i = node_argv.index("--rdzv-conf")
            node_argv[i + 1] = "is_host=0," + node_argv[i + 1]
        else:
            node_argv = ["--rdzv-conf", "is_host=0", *node_argv]
        if _has_out(rest) is None and args.out is None:
            node_argv = ["--out", out, *node_argv]
        os.environ[_ARGS_CHECKED_ENV] = "1"  # the nodes' launchers inherit it: the arguments were checked here
        try:
            return run_local_nodes(args.local_nodes, node_argv, Path(out), timeout=args.timeout,
                                   ranks=min(args.local_nodes, n_max) * args.nproc_per_node)
        finally:
            os.environ.pop(_ARGS_CHECKED_ENV, None)
    if _has_out(rest) is None:
        rest += ["--out", out]
    entry = [args.entry] if args.entry.endswith(".py") else ["-m", args.entry]
    opts = NodeOptions(label=args.node_label or socket.gethostname(), out=Path(out),
                       command=[sys.executable, *entry, *rest, *args.resume_arg.split()], n_min=n_min, n_max=n_max,
                       nproc=args.nproc_per_node, endpoint=args.rdzv_endpoint or f"127.0.0.1:{DEFAULT_PORT}",
                       run_id=args.rdzv_id, max_restarts=args.max_restarts, rdzv_conf=conf,
                       heartbeat_timeout=args.heartbeat_timeout, checkpoint_timeout=args.checkpoint_timeout,
                       startup_timeout=args.startup_timeout, monitor_interval=args.monitor_interval,
                       kill_grace=args.kill_grace, quorum_timeout=args.quorum_timeout)
    if _QUIET_CPP:
        import torch  # noqa: F401 (c10 reads the level when it loads)

        os.environ.pop(_CPP_LOG_ENV, None)  # torch has read it; the workers keep their C++ warnings
    return run_node(opts)

def _strip(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` before ``--`` without ``flags`` (and their values); the rest unchanged."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        name = a.split("=", 1)[0]
        if name in flags:
            i += 1 + (0 if "=" in a else flags[name])
            continue
        out.append(a)
        i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())

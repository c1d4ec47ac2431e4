"""``fastmoe-train --nproc-per-node N``: N training processes on this machine, started by torchrun's
own launcher (``torch.distributed.run``) inside this process, so that what a person sees stays
short: Ctrl-C or SIGTERM reaches the launcher, which passes it on to every worker; the workers
finish their step, write one checkpoint and rank 0 prints the one line of :mod:`trainer.ft.stop`;
the launcher exits with the same status (130 / 143) and no traceback of its own. A second signal
kills the workers at once. A worker that fails (a config error, a crash) leaves its own message
above one ``error:`` line from here.

It is the same run as ``torchrun --standalone --nproc-per-node N -m fastmoe_trainer ...``, which
works as well; torchrun prints its own log lines and a traceback when it is interrupted.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Sequence

from .stop import STOP_SIGNALS, SignalCount, signal_name

#: Which signals torch's process context handles itself (its default: SIGTERM, SIGINT, SIGHUP, SIGQUIT).
_TORCH_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: The ones left to torch here: SIGINT and SIGTERM are this process's (``on_signal`` in :func:`launch`).
_TORCH_SIGNALS = "SIGHUP,SIGQUIT"


def _children() -> list[int]:
    """Pids of this process's children (Linux /proc; empty elsewhere)."""
    me, out = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(me):
            out.append(int(name))
    return out


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m <this package> argv`` in ``nproc`` processes; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if nproc < 1:
        print(f"error: --nproc-per-node must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    # torchrun's start-up and shutdown notices are for its own users; the workers say what matters
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)
    # The N processes share this machine's cores (fastmoe_xpu/threads.py): each takes its share.
    from fastmoe_xpu import threads

    os.environ.setdefault(threads.LOCAL_PROCESSES_ENV, str(nproc))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads.share(local=int(os.environ[threads.LOCAL_PROCESSES_ENV]))))
    package = (__package__ or "trainer").split(".")[0]  # the trainer package, not .ft
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "-m", package, *argv])
    # torchrun's launch_agent writes this option (default SIGTERM,SIGINT,SIGHUP,SIGQUIT) to
    # TORCHELASTIC_SIGNALS_TO_HANDLE just before the workers start, over the value set below: torch's
    # handlers would replace on_signal, and the echo of a Ctrl-C that lands during the agent's
    # shutdown(SIGINT) would end it with a SIGTERM to every worker, some before their SIGINT.
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = _TORCH_SIGNALS
    # The signals are this process's, not torch's agent's: it would take the echoes of one Ctrl-C
    # (the terminal's and ``timeout``'s) for a second signal, end its gentle shutdown half way and
    # close the workers with SIGTERM, which they would report instead of the signal sent here.
    count, got = SignalCount(), []

    def on_signal(signum: int, frame: Any) -> None:
        if count.again():
            _abort(signum)
        if got:
            return  # an echo of the first
        got.append(signum)
        # torch's own way out: its agent passes this signal on to every worker and waits for them
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    saved = os.environ.get(_TORCH_SIGNALS_ENV)
    os.environ[_TORCH_SIGNALS_ENV] = _TORCH_SIGNALS
    try:
        run(args)
    except SignalException as e:
        if _children():  # the workers did not end in torch's shutdown time
            _abort(int(e.sigval))
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"error: training process {rank} exited with status {failure.exitcode} (its message is above)",
              file=sys.stderr)
        return code
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if saved is None:
            os.environ.pop(_TORCH_SIGNALS_ENV, None)
        else:
            os.environ[_TORCH_SIGNALS_ENV] = saved
    return 0


def _abort(signum: int) -> None:
    """A second signal: the workers are killed at once, one line, and this process exits."""
    for pid in _children():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.write(2, f"\naborted at once ({signal_name(signum)} again); the newest complete checkpoint stays "
                "valid\n".encode())
    os._exit(128 + signum)

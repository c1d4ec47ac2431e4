"""Ctrl-C and SIGTERM end ``fastmoe-bench`` in one line: ``fastmoe-bench: stopped (SIGINT)``, exit status
128 + the signal's number (130, 143), no traceback, whatever the signal interrupted (a GEMM, the autograd
engine, a worker's join). The handlers are installed explicitly, so a benchmark started where SIGINT was
ignored on entry (a non-interactive shell's background job) still stops on it. A second signal while the
first is being unwound exits at once.

Not the trainer's ``stoppable`` (trainer/ft/stop.py): its stop is an ``Exception`` and its second-signal line
speaks of checkpoints; the benchmark's providers and studies catch ``Exception`` to report a provider as
skipped, which would swallow a stop and run on, so the stop here is a ``BaseException``."""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop(BaseException):
    """Raised in the main thread by the first stop signal (a BaseException, so that no ``except
    Exception`` of a study swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stoppable(work: Callable[[], int], prog: str = "fastmoe-bench") -> int:
    """Run ``work()``, turning the first SIGINT / SIGTERM into one line and its exit status."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        return work()
    got: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if got:  # a second signal: no more unwinding
            os._exit(128 + got[0])
        got.append(signum)
        raise Stop(signum)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        return work()
    except BaseException:
        if not got:
            raise
        print(f"\n{prog}: stopped ({signal.Signals(got[0]).name}); files written before the stop are kept, "
              "nothing more was written", file=sys.stderr, flush=True)
        return 128 + got[0]
    finally:
        for s, h in old.items():
            signal.signal(s, h)

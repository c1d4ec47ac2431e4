"""Stopping a run by signal without losing it.

SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice, ``kill``) during training lets the current
step finish; then every rank writes a full checkpoint at that step, rank 0 prints one line

    stopped at step N (SIGINT); checkpoint at OUT/checkpoints/slot-B; run the same command to resume

and the process exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A second
signal aborts at once (the checkpoint being written, if any, is never taken for valid: its
manifest is written last). Before the first step and after the last the signal stops the run
at once, with one line and the same status, saying what that leaves (``stopped by SIGINT before
training began; nothing needed saving``, or after the last step: the newest checkpoint stays).

Under ``torchrun`` the workers run in their own session, so the terminal's Ctrl-C reaches
torchrun, which sends the signal on to every worker: each finishes its step, and the ranks agree
(one all-reduce of the flag per step) on the step they stop after, so none waits in a collective
for another that already left.

Under the node launcher (``fastmoe-launch``, which sets :data:`LAUNCHER_ENV`) a stop reaches a
worker two ways, often both: a scheduler signals every process of the job (Slurm and PBS do), and
the launcher passes the signal it got on as SIGUSR1 (for SIGTERM) or SIGUSR2 (for SIGINT). The
passed-on request counts as the signal it stands for and never as a second signal, so a worker
that gets both stops after its step and does not abort. Every rank prints the stopped line there
(the launcher reads it from its workers' logs), and the launcher stops its workers for a restart
with SIGKILL, not SIGTERM. Under another elastic agent that restarts failed workers (torchrun
``--max-restarts N``, N > 0) only SIGINT is handled so: there SIGTERM is the agent's way of
ending the survivors before a restart, and it keeps ending them at once.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

#: The signals that stop a run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Set (to 1) by the node launcher for its workers: it passes a stop on as these signals.
LAUNCHER_ENV = "TRAINER_NODE_LAUNCHER"
#: The launcher's passed-on stop request -> the signal it stands for.
FORWARDED = {signal.SIGUSR1: signal.SIGTERM, signal.SIGUSR2: signal.SIGINT}
#: The signal the launcher passes a stop on as, by the signal it got.
FORWARD_AS = {v: k for k, v in FORWARDED.items()}


#: A signal this soon after the first is the same stop delivered twice (a terminal's Ctrl-C reaches
#: the whole process group, and ``timeout`` passes the signal it got on to its command as well), not
#: a second request; a person's second Ctrl-C comes later.
REPEAT_WINDOW_S = 0.05


class SignalCount:
    """Counts the stop signals a process gets from outside, echoes of the first left out."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.count = 0

    def again(self) -> bool:
        """Count one signal; True when it is a second request (not the first, nor an echo of it)."""
        now = time.monotonic()
        if self.first is None:
            self.first, self.count = now, 1
            return False
        if self.count == 1 and now - self.first < REPEAT_WINDOW_S:
            return False
        self.count += 1
        return True


def under_launcher() -> bool:
    return os.environ.get(LAUNCHER_ENV, "") == "1"


def handled_signals() -> tuple[int, ...]:
    """SIGINT and SIGTERM, plus the launcher's passed-on requests under ``fastmoe-launch``; SIGINT
    alone under another elastic agent that restarts workers (``TORCHELASTIC_MAX_RESTARTS`` > 0):
    there SIGTERM is how the agent ends the survivors of a failed worker before it restarts them,
    and they must end at once, not try to finish a step whose peers are gone."""
    if under_launcher():
        return (*STOP_SIGNALS, *FORWARDED)
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    return (signal.SIGINT,) if restarts > 0 else STOP_SIGNALS


class Stopped(Exception):
    """Raised out of the training loop (or start-up) when a signal stopped the run."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """The handlers of SIGINT and SIGTERM for one run.

    ``deferred`` (inside the training loop): the first signal is remembered and the loop polls
    :meth:`agreed`; otherwise (start-up, the end of the run) the first signal raises
    :class:`Stopped` where the program is. A second signal from outside exits at once (the
    launcher's passed-on request is never a second signal)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred = False
        #: where a signal that stops at once finds the run, and what that leaves, for its line
        self.phase = "before training began; nothing needed saving"
        self._received = SignalCount()  # signals from outside (the launcher's passed-on requests do not count)
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in handled_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._previous.items():
            # the launcher may pass a stop on after this process stopped by itself (its peers' flag):
            # SIGUSR1's default action would end it by that signal instead of its own exit status
            signal.signal(sig, signal.SIG_IGN if sig in FORWARDED else old)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        forwarded = signum in FORWARDED
        if forwarded:
            signum = FORWARDED[signum]
            if self.signum is not None:
                return  # the launcher passing on a signal this process got too
        else:
            if self._received.again():
                sys.stderr.write(f"\naborted at once ({signal_name(signum)} again); the newest complete "
                                 f"checkpoint stays valid\n")
                sys.stderr.flush()
                os._exit(128 + signum)
            if self.signum is not None:
                return  # the launcher's request came first; this is the same stop
        self.signum = signum
        if not self.deferred:
            if _holding[0]:
                _held_back.append(self)  # raised at the end of the signals_held() block
                return
            raise Stopped(signum, self.message())

    def message(self) -> str:
        return f"stopped by {signal_name(self.signum or signal.SIGINT)} {self.phase}"

    def agreed(self, group: Any = None, distributed: bool = False, device: Any = "cpu") -> int | None:
        """The signal every rank stops for after this step (None: go on); collective when
        ``distributed``."""
        if not distributed:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        got = int(flag.item())
        return got or None


#: How deep this process is in :func:`signals_held` blocks, and the stop requests that came meanwhile.
_holding = [0]
_held_back: list["StopRequest"] = []


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A stop that would end the command at once waits for the end of the block (a few renames that
    must happen together), and ends it there. (Held in Python, not by the signal mask: any thread
    of the process may receive the signal.)"""
    _holding[0] += 1
    try:
        yield
    finally:
        _holding[0] -= 1
    if not _holding[0] and _held_back:
        req = _held_back[0]
        _held_back.clear()
        raise Stopped(req.signum or signal.SIGINT, req.message())


def stoppable(prog: str, left: str | Callable[[], str], work: Callable[[], int]) -> int:
    """Run a command's ``work`` with SIGINT / SIGTERM stopping it at once in one line, ``PROG:
    stopped (SIGINT); LEFT`` (``left`` may be a function, asked then), and exit status 128 + the signal's number, whatever the stop surfaced
    as where it landed (a library may wrap it in an exception of its own); no traceback. The work
    cleans up its own temporary files on the way out (a second signal exits at once)."""
    stop = StopRequest().install()
    try:
        return work()
    except BaseException:
        if stop.signum is None:
            raise
        said = left() if callable(left) else left
        print(f"\n{prog}: stopped ({signal_name(stop.signum)}); {said}", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        stop.uninstall()

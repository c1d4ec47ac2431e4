"""Progress of the training loop: a tqdm bar on a terminal, and plain lines elsewhere.

Written to a file or a pipe (a job's log, ``| tee``), a tqdm bar is thousands of carriage-return
redraws on one line; there the loop prints one line every ``total / LINES`` steps instead, and at
least one every ``EVERY_S`` seconds while steps complete (and the last step), with the same
numbers the bar shows. Under the node launcher (``fastmoe-launch``) the lines go to stdout, which
the launcher holding rank 0 shows on its console (the workers' stderr goes to log files only).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

#: Lines a non-terminal log gets over a whole run (plus the last step).
LINES = 20
#: Longest time between two lines of a non-terminal log while steps complete (seconds).
EVERY_S = 10.0


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``close``, as one line per ``every`` steps."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "step",
                 file: TextIO | None = None, every: int | None = None, every_s: float | None = EVERY_S) -> None:
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.file = file if file is not None else sys.stderr
        self.every = every or max(1, (total - initial) // LINES)
        self.every_s = every_s
        self.postfix: dict[str, Any] = {}
        self._t0, self._n0 = time.perf_counter(), initial
        self._last_printed = initial
        self._last_t = self._t0

    def update(self, n: int = 1) -> None:
        self.n += n
        late = self.every_s is not None and time.perf_counter() - self._last_t >= self.every_s
        if self.n - self._last_printed >= self.every or (self.n >= self.total > self._last_printed) or late:
            self._print()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kw: Any) -> None:
        """The fields the next line shows (tqdm's signature; a line is printed by ``update`` only,
        so set them before the ``update`` of the step they describe)."""
        self.postfix = {**(ordered_dict or {}), **kw}

    def _print(self) -> None:
        rate = (self.n - self._n0) / max(time.perf_counter() - self._t0, 1e-9)
        extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
        self.file.write(f"{self.desc}: {self.unit} {self.n}/{self.total} ({rate:.2f} {self.unit}/s){extra}\n")
        self.file.flush()
        self._last_printed = self.n
        self._last_t = time.perf_counter()

    def close(self) -> None:
        if self.n != self._last_printed:  # the last count, when no line showed it yet
            self._print()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(total: int, initial: int = 0, desc: str = "", unit: str = "step", file: TextIO | None = None) -> Any:
    """A tqdm bar when ``file`` (stderr; stdout under the node launcher) is a terminal, else a
    :class:`LineProgress`."""
    if file is None:
        from ..ft.stop import LAUNCHER_ENV

        file = sys.stdout if os.environ.get(LAUNCHER_ENV) == "1" else sys.stderr
    if file.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=file)
    return LineProgress(total, initial, desc, unit, file)


def stage_bar(total: int, desc: str, unit: str, enabled: bool, file: TextIO | None = None, **tqdm_kw: Any) -> Any:
    """One stage of a longer job (data preprocessing): a tqdm bar on a terminal, else one line when
    the stage ends; nothing when not ``enabled``."""
    file = file if file is not None else sys.stderr
    if enabled and not file.isatty():
        return LineProgress(total, 0, desc, unit, file, every=max(1, total), every_s=None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=file, **tqdm_kw)

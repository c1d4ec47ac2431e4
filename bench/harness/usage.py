"""A misused command line, told before any work: one line on stderr that names what is wrong and
the way forward, exit status 2, no traceback.

:class:`Parser` is ``argparse.ArgumentParser`` with a one-line ``error()`` and size options checked
after parsing (``type=count``: an integer >= 1; ``type=seconds``: a number > 0); :func:`output_dir`
and :func:`output_file` check where results will be written (a file where a directory goes, a
read-only target, a path under a regular file) before anything is measured.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn


class UsageError(SystemExit):
    """Exit status 2; ``str()`` is the line printed (what ``pytest.raises(match=...)`` reads)."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(message: str) -> NoReturn:
    """Print ``message`` as one line on stderr and exit 2."""
    line = " ".join(str(message).split())
    print(line, file=sys.stderr, flush=True)
    raise UsageError(line)


def count(text: str) -> int:
    """An ``argparse`` type: an integer that counts something (rounds, tokens, layers); >= 1, checked by
    :class:`Parser` so that the message names the option."""
    return int(text)


def seconds(text: str) -> float:
    """An ``argparse`` type: a positive number (seconds, a scale); > 0, checked by :class:`Parser`."""
    return float(text)


def nonnegative(text: str) -> float:
    """An ``argparse`` type: a number >= 0 (a budget that may be spent at once), checked by :class:`Parser`."""
    return float(text)


#: the bound of each checked type: (test, words of the message)
_BOUNDS = {count: (lambda v: v >= 1, ">= 1"), seconds: (lambda v: v > 0, "> 0"),
           nonnegative: (lambda v: v >= 0, ">= 0")}


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line naming the option and ``--help``."""

    def error(self, message: str) -> NoReturn:  # argparse's own: usage and error on two or more lines
        fail(f"error: {message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201
        ns, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            bound = _BOUNDS.get(action.type)
            value = getattr(ns, action.dest, None)
            if bound is None or value is None:
                continue
            for v in value if isinstance(value, list) else [value]:
                if not bound[0](v):
                    fail(f"error: {action.option_strings[-1]} must be {bound[1]}, got {v:g} "
                         f"(see {self.prog} --help)")
        return ns, rest


def _first_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_writable_under(option: str, path: Path, target: str) -> None:
    """``path`` (a directory to be, or a file to be) can be made and written: the nearest existing
    folder above it is a directory, and writable."""
    here = _first_existing(path.absolute().parent if target == "file" else path.absolute())
    if not here.is_dir():
        fail(f"error: {option} {path}: {here} is a file, so no {target} can be made under it; "
             f"give a path in a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        fail(f"error: {option} {path}: {here} is not writable; give a path you can write")


def output_dir(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a directory the results can be written into (made later, when the results are):
    one error line and exit 2 when it cannot be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        fail(f"error: {option} {path}: a file is there, where a directory of results goes; "
             f"give a directory (made if missing) or move the file")
    _check_writable_under(option, path, "directory")
    return path


def output_file(path: str | Path | None, option: str = "--json") -> Path | None:
    """``path`` as a file that can be written (None passes): one error line and exit 2 when it cannot be."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        fail(f"error: {option} {path}: a directory is there, where a file goes; give a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            fail(f"error: {option} {path}: the file is not writable; give a path you can write")
        return path
    _check_writable_under(option, path, "file")
    if not path.parent.is_dir():
        fail(f"error: {option} {path}: no directory {path.parent}; make it first or give a path in an existing "
             f"directory")
    return path

"""The trainer's configuration error, in a leaf module so that every part of the trainer can raise it
without importing the config module (which imports some of them back for its checks); and the
argument parser every console command of the trainer uses, whose errors are one line."""
from __future__ import annotations

import argparse
import difflib
import typing

#: The exit status of every console command of the trainer for a bad command line or configuration.
EXIT_USAGE = 2


class ConfigError(ValueError):
    """A configuration that cannot run; the CLI prints its message as one line and exits non-zero."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage block left out of errors: one ``error:`` line naming the problem and
    ``--help`` (exit 2), and for an unknown option the nearest known ones. ``prog_prefix``: the
    line starts with ``PROG: `` (commands whose other errors say their name)."""

    def __init__(self, *args: typing.Any, prog_prefix: bool = False, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self.prog_prefix = prog_prefix

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            message += self.unknown_hint(message.split(":", 1)[1].split())
        head = f"{self.prog}: " if self.prog_prefix else ""
        self.exit(EXIT_USAGE, f"{head}error: {message}; {self.prog} --help lists every option\n")

    def unknown_hint(self, words: list[str]) -> str:
        """`` (did you mean --x?)`` for the unknown options in ``words`` close to a known one ('' if none)."""
        known = [o for a in self._actions for o in a.option_strings]
        hints = []
        for word in words:
            if word.startswith("--"):
                hints += difflib.get_close_matches(word.split("=", 1)[0], known, n=2, cutoff=0.75)
        return f" (did you mean {' or '.join(dict.fromkeys(hints))}?)" if hints else ""

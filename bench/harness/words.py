"""How the benchmark's outputs write counts and load averages, one way everywhere."""
from __future__ import annotations


def load_text(v) -> str:  # noqa: ANN001
    """A load average (1, 5 and 15 minutes) as every output of the benchmark prints it: ``1.8/1.7/1.7``."""
    return "-" if not v else "/".join(f"{x:.1f}" for x in v)


def plural(n: int, word: str) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{n} {word}{'' if n == 1 else 's'}"

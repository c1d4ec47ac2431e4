"""``fastmoe-bench --engines [list|clear]``: the ``auto`` engine choices kept on disk, with the times
they were chosen on and how those were taken, and a way to drop them (docs/engines.md).

Each entry is one shape bucket on one machine (device name, torch and triton versions): the engine
chosen, every candidate's forward+backward time at the routed rows it was timed at, and the record of
the timing (rounds, how starvation was told, threads, why it was taken: at first use, or again in
use). Only trusted timings are stored (fastmoe_xpu/kernels/timing.py).
"""
from __future__ import annotations

from typing import Any

from fastmoe_xpu.kernels import registry, timing

from .words import plural


def _ms(v: Any) -> str:
    return "-" if v is None else f"{1e3 * float(v):.3g}"


def describe_entries(entries: dict[str, dict[str, Any]]) -> list[str]:
    """One block of lines per cache entry."""
    lines = []
    for key in sorted(entries):
        e = entries[key]
        device, torch_v, triton_v, *shape = key.split("|")
        seconds, forward = e.get("seconds") or {}, e.get("forward") or {}
        timed = e.get("timed") or {}
        lines.append(f"{device} ({torch_v}, {triton_v}) {' '.join(shape)}: {e['engine']}"
                     + (f"  [timed at {e['rows']} rows]" if e.get("rows") else ""))
        lines.append("    F+B ms: " + ", ".join(f"{n} {_ms(s)}" + ("*" if n == e["engine"] else "")
                                              for n, s in sorted(seconds.items(), key=lambda kv: kv[1])))
        if forward:
            infer = registry.inference_engine(e["engine"], forward)
            lines.append("    forward ms: " + ", ".join(f"{n} {_ms(s)}" for n, s in sorted(forward.items()))
                         + (f"  (forward calls without a backward run {infer})" if infer != e["engine"] else ""))
        if timed:
            starved = timed.get("starved") or {}
            threads = timed.get("threads", "?")
            lines.append(f"    timed: {timed.get('reason', '?')}; {_count(timed.get('rounds'), 'interleaved round')}, "
                         f"{_count(threads, 'thread')}, starvation told by {timed.get('check', '?')}"
                         + (f", starved samples {sum(starved.values())}" if starved else "")
                         + f"; saved {e.get('saved', '?')}")
        else:
            lines.append(f"    saved {e.get('saved', '?')}")
    return lines


def run_engines(action: str) -> int:
    """List (``list``) or delete (``clear``) the cached choices; prints what it did."""
    path = timing.cache_path()
    if action == "clear":
        held = timing.clear()
        print(f"# {path}: {held} cached engine choice{'s' if held != 1 else ''} removed; the next run times again")
        return 0
    entries = timing.entries()
    print(f"# {path}: {len(entries)} cached engine choice{'s' if len(entries) != 1 else ''} "
          f"(* chosen; fastmoe-bench --engines clear removes them)")
    for line in describe_entries(entries):
        print(line)
    return 0


def _count(n: Any, word: str) -> str:
    """``plural(n, word)``, or ``? words`` where the cache holds no count."""
    return plural(n, word) if isinstance(n, int) else f"{n if n is not None else '?'} {word}s"

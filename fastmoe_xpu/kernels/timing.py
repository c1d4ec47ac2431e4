"""Timing for the measured choices: the synchronised best-of timer, the power-of-two shape buckets,
the device names choices are keyed by, and the disk cache of timed engine choices.

Both measured choices use it: the stage-4 implementation (:func:`.registry.choose_engine`, remembered
on disk) and the Triton config of each grouped GEMM (``triton/autotune.py``, remembered in-process).

The disk cache is one small JSON file.

Location: ``FASTMOE_GEMM_CACHE`` if set, else ``$XDG_CACHE_HOME/fastmoe_xpu/gemm_engines.json``
(``~/.cache/fastmoe_xpu/gemm_engines.json`` without XDG_CACHE_HOME). Layout::

    {"format": 1,
     "entries": {"<device>|torch=<v>|triton=<v>|<backend>|<dtype>|H=..|I=..|NR=..|rows<=..":
                 {"engine": "grouped_mm", "seconds": {"loop": 0.012, "grouped_mm": 0.009}, "saved": "<UTC>"}}}

The key names the device, torch and triton versions, so an upgrade or another GPU misses and
times again instead of trusting old numbers. Several ranks may start at once: each writes a whole
new file next to the old one and renames it over (atomic on POSIX), so a reader sees the old file
or a new one, never half of one; a lost update only means one more timing run later. A file that
is not valid JSON, has another format, or names an unknown engine is ignored with a warning and
replaced on the next write: the cache can cost a timing run, never a crash.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import settings
from ..device import cpu_model

FORMAT = 1
FILE_NAME = "gemm_engines.json"


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The timer for runs on ``device``: this thread's CPU time on a CPU running one thread (what the
    work costs, whatever else runs on a shared machine: a choice timed on a loaded machine would
    otherwise follow the load, and the disk cache keeps it), else synchronised wall-clock time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def best_seconds(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Best of ``repeats`` synchronised runs of ``run`` (timed by :func:`clock`) after one warm-up
    run (which compiles, autotunes or fills buffers: first-use costs are not the speed being measured)."""
    now = clock(device)
    run()
    best = float("inf")
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = now()
        run()
        sync(device)
        best = min(best, now() - t0)
    return best


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 1): sizes within a factor of two share a choice."""
    return 1 << max(0, int(n) - 1).bit_length()


def device_name(device: torch.device | str) -> str:
    """A name for the hardware behind ``device``: choices made on one GPU model or CPU (and thread
    count) do not carry over to another."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    if dev.type == "xpu":
        return f"xpu:{torch.xpu.get_device_name(dev)}"
    return f"{dev.type}:{cpu_model()}x{torch.get_num_threads()}"


def cache_path() -> Path:
    """Where the choices are kept (see the module docstring)."""
    explicit = settings.get().gemm_cache
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastmoe_xpu" / FILE_NAME


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except Exception:  # not installed (or broken): part of the key all the same
        return "none"


def entry_key(device_name: str, key: Any) -> str:
    """The JSON key of one choice: device, versions, then the shape key's fields."""
    rows = f"rows<={key.rows_bucket}" if key.rows_bucket else "rows<=any"
    return (f"{device_name}|torch={torch.__version__}|triton={_triton_version()}|{key.backend}|{key.dtype}|"
            f"H={key.hidden}|I={key.intermediate}|NR={key.local_experts}|{rows}")


def _load(path: Path) -> dict[str, Any]:
    """The file's entries; {} (with a warning) when it is unreadable, corrupt or of another format."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"gemm engine cache {path} unreadable ({exc}); timing again", RuntimeWarning, stacklevel=3)
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        warnings.warn(f"gemm engine cache {path} is corrupt ({exc}); ignoring it and timing again",
                      RuntimeWarning, stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        warnings.warn(f"gemm engine cache {path} has format {found!r}, expected {FORMAT}; ignoring it and timing again",
                      RuntimeWarning, stacklevel=3)
        return {}
    entries = {}
    for k, v in data["entries"].items():
        if isinstance(v, dict) and v.get("engine") in settings.gemm_engines():
            entries[k] = v
        else:
            warnings.warn(f"gemm engine cache {path}: stale entry {k!r} ({v!r}) ignored", RuntimeWarning, stacklevel=3)
    return entries


def lookup(device_name: str, key: Any, candidates: Sequence[str] | None = None) -> str | None:
    """The cached engine for ``key`` on ``device_name`` with these versions, or None. With
    ``candidates``: None unless that choice was timed against every one of them (an engine added
    since, or newly available here, is timed rather than never tried)."""
    entry = _load(cache_path()).get(entry_key(device_name, key))
    if not entry:
        return None
    timed = entry.get("seconds")
    if candidates is not None and not (isinstance(timed, dict) and set(candidates) <= set(timed)):
        return None
    return entry["engine"]


def store(device_name: str, key: Any, engine: str, seconds: Mapping[str, float]) -> Path | None:
    """Add one choice (read, update, write a temporary file, rename it over). Returns the path, or
    None with a warning when the location cannot be written (the choice still holds in-process)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _load(path)
        entries[entry_key(device_name, key)] = {
            "engine": engine,
            "seconds": {k: float(v) for k, v in seconds.items()},
            "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        warnings.warn(f"gemm engine cache {path} not written ({exc}); the choice holds for this process only",
                      RuntimeWarning, stacklevel=2)
        return None
    return path


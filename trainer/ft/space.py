"""Full disks, said as such: a write that ran out of space names the path, the bytes it needed and
the bytes free, whatever shape the failure took on its way up (``OSError`` ENOSPC or EDQUOT, DCP's
aggregated ``CheckpointException``, or torch's zip writer's short write, ``unexpected pos``).
Standard library only."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class OutOfSpace(RuntimeError):
    """A run's own record could not be written for want of space (the metrics); the trainer's command
    line says it in one line and exits as for a failed checkpoint (76), the newest checkpoint valid."""


#: What torch's writers say when a write came back short (a full disk under them).
_SHORT_WRITE = ("unexpected pos", "No space left", "file write failed")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing parent); None if unknown."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _causes(e: BaseException) -> list[BaseException]:
    seen, todo, out = set(), [e], []
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: {rank: exception or (exception, tb)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]
    return out


def is_no_space(e: BaseException, path: str | os.PathLike | None = None, needed: int | None = None) -> bool:
    """Whether ``e`` is a write that ran out of space: an ENOSPC / EDQUOT anywhere in its chain, or a
    short write of torch's where the file system of ``path`` has less than ``needed`` bytes free."""
    causes = _causes(e)
    if any(isinstance(x, OSError) and x.errno in _SPACE_ERRNOS for x in causes):
        return True
    if any(s in str(x) for x in causes for s in _SHORT_WRITE):
        if "No space left" in " ".join(str(x) for x in causes):
            return True
        free = free_bytes(path) if path is not None else None
        return free is not None and needed is not None and free < needed
    return False


def human(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def no_space(path: str | os.PathLike, needed: int | None, *, most: bool = False) -> str:
    """``out of disk space writing PATH: it needs N bytes, M are free``, in one line (``most``:
    ``needed`` is a bound, said as "up to")."""
    free = free_bytes(path)
    need = (f"it needs {'up to ' if most else ''}{needed:,} bytes ({human(needed)})" if needed is not None
            else "it needs more room")
    have = f"{free:,} bytes ({human(free)}) are free there" if free is not None else "the free space is unknown"
    return f"out of disk space writing {path}: {need}, {have}"


def describe_space(e: BaseException, path: str | os.PathLike, needed: int | None, *, most: bool = False) -> str | None:
    """:func:`no_space`'s line when ``e`` is a full disk (see :func:`is_no_space`), else None."""
    return no_space(path, needed, most=most) if is_no_space(e, path, needed) else None


def space_warning(path: str | os.PathLike, planned: int, what: str) -> str | None:
    """A one-line warning when ``planned`` bytes of ``what`` exceed the free space at ``path``."""
    free = free_bytes(path)
    if free is None or planned <= free:
        return None
    return (f"warning: {what} take about {planned:,} bytes ({human(planned)}), and the file system of {path} has "
            f"{free:,} ({human(free)}) free: the run will stop when a write meets a full disk (exit 76)")


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors in a mapping (what a checkpoint of them writes, before metadata)."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values() if hasattr(t, "element_size")))

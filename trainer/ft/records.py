"""The run's shared records on disk: ``OUT/failures.jsonl`` and the per-rank heartbeat files, and the
check that ``--out`` can hold them.

A leaf module (standard library only): the trainer's fault checks (``trainer.ft.fault``), the in-worker
watchdog (``trainer.ft.watchdog``) and the node launcher (``trainer.ft.launch``) all write or read these
files, and none of them needs the others to do so. ``trainer.ft.fault`` re-exports every name here.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

FAILURES_FILE = "failures.jsonl"
HEARTBEAT_DIR = "heartbeat"


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line durably (one ``write`` on an O_APPEND descriptor: lines from many
    processes do not interleave)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def record_hang(out_dir: str | os.PathLike, record: dict[str, Any], since: float) -> dict[str, Any]:
    """Append ``record`` (a ``"hang"`` record) to ``OUT/failures.jsonl`` unless a hang of the same
    stall (recorded at ``since`` or later, wall time) is there already: one record per stall, under a
    lock of that file, whichever process finds the stall first (a rank's watchdog, a node
    launcher). Returns the stall's record, this one or the earlier."""
    with open(Path(out_dir) / FAILURES_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for r in read_failures(out_dir):
            if r.get("kind") == "hang" and float(r.get("time", 0)) >= since:
                return r
        append_jsonl(Path(out_dir) / FAILURES_FILE, record)
        return record


def read_failures(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(out_dir) / FAILURES_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a process killed mid-write
    return out


def read_heartbeats(out_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{rank: last heartbeat record, with the file's mtime as "mtime"}``."""
    out = {}
    d = Path(out_dir) / HEARTBEAT_DIR
    if not d.exists():
        return out
    for f in d.glob("rank-*.json"):
        try:
            rec = json.loads(f.read_text())
            rec["mtime"] = f.stat().st_mtime
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError):
            continue  # being replaced right now; read again next poll
    return out


def check_out_dir(path: str | os.PathLike) -> None:
    """Raise ValueError (one line naming the path and the reason) unless ``path`` is, or can be
    made, a writable directory. Called before any model is built, so a bad ``--out`` costs nothing
    and is not retried by the launcher (exit 2). A directory that was there keeps its times: the probe
    file made and removed in it does not show as a change (a refused command changes nothing)."""
    p = Path(path)
    try:
        before = p.stat() if p.is_dir() else None
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        if before is not None:
            os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, (NotADirectoryError, FileExistsError)):
            reason = "a path component is a regular file, not a directory"
        raise ValueError(f"output directory {str(p)!r} cannot be written: {reason}") from None

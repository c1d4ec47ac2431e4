"""The run's shared records on disk: ``OUT/failures.jsonl`` and the per-rank heartbeat files.

A leaf module (standard library only): the trainer's fault checks (``trainer.ft.fault``), the in-worker
watchdog (``trainer.ft.watchdog``) and the node launcher (``trainer.ft.launch``) all write or read these
files, and none of them needs the others to do so. ``trainer.ft.fault`` re-exports every name here.
"""
from __future__ import annotations

import fcntl
import json
import os
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

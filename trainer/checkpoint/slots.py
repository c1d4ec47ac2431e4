"""The checkpoint directories on disk: slots, atomic files, the manifest, verification, and
finding the newest valid slot (see :mod:`trainer.checkpoint` for the layout)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
META = "meta.json"
SLOTS = ("A", "B")
_READ_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which, where and why."""


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed files) durable; a no-op where not supported."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_file(path: Path, data: bytes) -> None:
    """Write, flush and fsync one file (the single place small checkpoint files are written)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def manifest_digest(files: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def verify(path: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """None when the checkpoint directory is complete and intact, else the reason it is not.

    Checks the manifest's own digest, then every listed file's size and (``checksums``) sha256."""
    path = Path(path)
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_bytes())
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION:
            return f"{mpath}: unknown format {manifest.get('format')!r}"
        if manifest.get("digest") != manifest_digest(files):
            return f"{mpath}: digest mismatch (the manifest itself is corrupt)"
    except FileNotFoundError:
        return f"{mpath} is missing (the write did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{mpath} is unreadable: {e}"
    if META not in files:
        return f"{mpath} does not list {META}"
    for name, entry in sorted(files.items()):
        fpath = path / name
        try:
            size = fpath.stat().st_size
        except OSError:
            return f"{fpath} is missing"
        if size != entry["size"]:
            return f"{fpath} has {size} bytes, the manifest says {entry['size']} (truncated?)"
        if checksums and sha256_file(fpath) != entry["sha256"]:
            return f"{fpath} fails its sha256 check (corrupt)"
    return None


@dataclass(frozen=True)
class CheckpointInfo:
    """A verified checkpoint directory."""

    path: Path
    kind: str
    """``"full"`` or ``"model"``."""
    step: int
    index: int
    """Checkpoint index (full checkpoints: slot = "AB"[index % 2])."""
    meta: dict[str, Any] = field(compare=False, repr=False)


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    path = Path(path)
    meta = json.loads((path / META).read_text())
    return CheckpointInfo(path=path, kind=meta["kind"], step=int(meta["step"]), index=int(meta["index"]), meta=meta)


def scan(root: str | os.PathLike, *, checksums: bool = True) -> list[tuple[Path, CheckpointInfo | None, str | None]]:
    """Every full-state slot under ``root`` as ``(path, info or None, reason it is invalid or None)``."""
    root = Path(root)
    out = []
    for slot in SLOTS:
        path = root / f"slot-{slot}"
        if not path.exists():
            continue
        reason = verify(path, checksums=checksums)
        info = None
        if reason is None:
            try:
                info = read_info(path)
            except (OSError, ValueError, KeyError) as e:
                reason = f"{path / META} is unreadable: {e}"
        out.append((path, info, reason))
    return out


def latest_valid(root: str | os.PathLike, *, checksums: bool = True) -> CheckpointInfo | None:
    """The newest full-state slot under ``root`` whose manifest verifies, or None."""
    good = [info for _, info, reason in scan(root, checksums=checksums) if info is not None]
    return max(good, key=lambda i: (i.step, i.index), default=None)


def model_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The persistent model-only checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    return sorted(p for p in root.glob("model-step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"

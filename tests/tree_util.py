"""One record of a directory tree, for tests that check a command changed nothing under it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def snapshot(root: Path, dirs: bool = False) -> dict[str, tuple]:
    """Every file under ``root`` (not following links): path -> (mode, size, mtime_ns, sha256 of its
    bytes). ``dirs``: the directories too, with their mode, size and mtime (None for the digest), so
    that a file made and removed again shows. Equal snapshots: nothing was written, added, removed or
    changed in mode under ``root``."""
    out = {}
    for dirpath, subdirs, files in os.walk(root):
        for name in (subdirs if dirs else []) + files:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            out[p.relative_to(root).as_posix()] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out

"""Which directories this package may replace: the ones it wrote, and nothing else.

Every output that replaces a directory (an export, a preprocessed data set) writes a marker file
(:data:`MARKER`) last, once the output is complete: its kind and the files it wrote. ``--overwrite``
replaces a directory only when it is empty or holds an earlier output of the same kind and nothing
but that output's files; anything else (a training run, a checkpoint, files of another kind or of
no kind) is refused in one line naming what is there (:func:`check_replace`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

MARKER = ".fastmoe-output.json"
#: The kinds of output, as the marker names them.
HF_EXPORT = "transformers export"
DATA_SET = "data set"
#: Files that make a directory a checkpoint (its manifest, metadata, DCP index) or a training run.
_CHECKPOINT_FILES = ("MANIFEST.json", "meta.json", ".metadata")
_RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints", "summary.json", "tensorboard")
_MOST_FILES = 10_000


class NotOwned(ValueError):
    """The directory holds something this package did not write as an output of that kind."""


def _files(directory: Path) -> list[str]:
    """The files under ``directory`` (relative, '/'-separated), at most a few more than _MOST_FILES."""
    found: list[str] = []
    for top, dirs, names in os.walk(directory):
        rel = Path(top).relative_to(directory)
        found += [(rel / n).as_posix() for n in names]
        if len(found) > _MOST_FILES:
            break
    return found


def write_marker(directory: str | os.PathLike, kind: str, files: list[str] | None = None, **info: Any) -> None:
    """Mark ``directory`` as a complete output of ``kind`` made of ``files`` (default: every file
    now in it). Call it last."""
    d = Path(directory)
    files = sorted(f for f in (_files(d) if files is None else files) if f != MARKER)
    tmp = d / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"kind": kind, "files": files, **info}, indent=1))
    os.replace(tmp, d / MARKER)


def read_marker(directory: str | os.PathLike) -> dict[str, Any] | None:
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def found_in(directory: str | os.PathLike, kind: str) -> str | None:
    """None when an output of ``kind`` may replace ``directory`` (empty, or only the files of an
    earlier output of that kind), else what it holds, in a few words."""
    d = Path(directory)
    files = _files(d)
    if not files:
        return None
    marker = read_marker(d)
    if marker is not None and marker.get("kind") == kind and \
            set(files) - {MARKER} <= set(marker.get("files") or []):
        return None
    top = sorted(os.listdir(d))
    run = [n + ("/" if (d / n).is_dir() else "") for n in top if n in _RUN_FILES]
    if run:
        return f"a training run ({_listed(run)})"
    ckpt = sorted(f for f in files if f.rsplit("/", 1)[-1] in _CHECKPOINT_FILES)
    if ckpt:
        return f"a checkpoint ({ckpt[0]})"
    if marker is not None and marker.get("kind") and marker.get("kind") != kind:
        return f"a {marker['kind']} and not a {kind}"
    foreign = sorted(set(files) - set((marker or {}).get("files") or []) - {MARKER})
    more = f"{len(foreign)}+" if len(files) > _MOST_FILES else str(len(foreign))
    return f"{more} file(s) that are not of a {kind} this package wrote ({_listed(foreign)})"


def check_replace(path: str | os.PathLike, kind: str, *, option: str = "--out", flag: str = "--overwrite") -> bool:
    """Whether ``path`` exists (then it may be replaced by an output of ``kind``); raises
    :class:`NotOwned` in one line when it is a file or holds anything else."""
    p = Path(path)
    if not p.exists():
        return False
    if not p.is_dir():
        raise NotOwned(f"{option} {p} is a file, not a directory; give a directory path")
    held = found_in(p, kind)
    if held is not None:
        raise NotOwned(f"{option} {p} holds {held}; {flag} replaces only a {kind} written there and nothing "
                       f"else: give a new or empty directory")
    return True


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Move the complete output ``tmp`` (its marker written) to ``out``, replacing what
    :func:`check_replace` allowed there (checked again, as the directory may have changed since)."""
    from .ft.stop import signals_held

    kind = (read_marker(tmp) or {}).get("kind", "")
    out = Path(out)
    aside = out.parent / f".{out.name}.replaced"
    try:
        with signals_held():  # a stop here waits for the two renames: --out is the old output or the new one
            if check_replace(out, kind):
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(out, aside)
            try:
                os.replace(tmp, out)
            except BaseException:
                if aside.exists():
                    os.replace(aside, out)
                raise
    finally:
        if out.exists():
            shutil.rmtree(aside, ignore_errors=True)

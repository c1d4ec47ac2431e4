"""The kept Triton config tables: the grouped GEMMs' measured configs per device, shipped with the package.

One JSON file per device under ``fastmoe_xpu/kernels/tuned/<slug>.json`` (the slug of the name
``torch.cuda.get_device_name`` or ``torch.xpu.get_device_name`` gives, e.g. ``nvidia-h200``), written by
``python -m fastmoe_xpu.tools.config_sweep`` and committed. It names the device exactly, the torch and
Triton versions and the date of the sweep, and holds one entry per key ``(kernel, config table,
dtype, N, K, rows-per-expert bucket)``: the config that won (:func:`config_id`) and each candidate's
measured seconds (None for one that did not launch)::

    {"format": 1, "device": "NVIDIA H200", "torch": "...", "triton": "...", "date": "2026-11-28",
     "entries": [{"kernel": "gate_up_fwd", "table": "cuda", "dtype": "bfloat16", "n": 768, "k": 2048,
                  "rows_bucket": 2048, "config": "m128n64k64/w4s4", "seconds": {...}, "shape": "qwen3-30b-a3b"}]}

:mod:`.triton.autotune` looks a key up here before timing; an entry is used only when the file names
this very device and its config is still in the kernel's list (lists change; a stale entry is timed
again). ``FASTMOE_KEPT_CONFIGS=0`` ignores the files.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .. import settings
from .configs import KernelConfig

FORMAT = 1
#: Where the package's kept tables live (package data: setup.py's ``package_data``).
TUNED_DIR = Path(__file__).resolve().parent / "tuned"

#: (kernel, config table, dtype name, N, K, rows bucket): the key of one choice.
Key = tuple[str, str, str, int, int, int]

#: device name -> its kept choices (key -> config id), or None when there is no table for it.
_LOADED: dict[str, dict[Key, str] | None] = {}


def config_id(cfg: KernelConfig) -> str:
    """A config's name in the kept tables: its tile name with warps and stages (``m128n128k64/w8s4``);
    a tile name alone is not unique within a list (the ``sm100`` lists hold one tile at two warp counts)."""
    return f"{cfg.name}/w{cfg.num_warps}s{cfg.num_stages}"


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; None -> ``""`` (a launch that did not say)."""
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def slug(device_name: str) -> str:
    """A device name as a file name: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def device_name(device: torch.device) -> str | None:
    """The name the device reports (``torch.cuda`` / ``torch.xpu.get_device_name``); None elsewhere
    or when it cannot be asked."""
    if device.type not in ("cuda", "xpu"):
        return None
    try:
        return str(getattr(torch, device.type).get_device_name(device.index if device.index is not None else None))
    except Exception:  # no such device in this process: nothing is kept for it
        return None


def path_for(name: str, directory: Path | None = None) -> Path:
    return (directory or TUNED_DIR) / f"{slug(name)}.json"


def entry_key(entry: Mapping[str, Any]) -> Key:
    return (str(entry["kernel"]), str(entry["table"]), str(entry["dtype"]), int(entry["n"]), int(entry["k"]),
            int(entry["rows_bucket"]))


def read(path: Path) -> dict[str, Any]:
    """A kept table file; ValueError when it is not one."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a kept config table of format {FORMAT}")
    for entry in data["entries"]:
        entry_key(entry)  # every field present
        if not isinstance(entry.get("config"), str):
            raise ValueError(f"{path}: an entry without a config name: {entry}")
    return data


def document(device: str, entries: Iterable[Mapping[str, Any]], **extra: Any) -> dict[str, Any]:
    """A kept table for ``device`` with this process's torch and Triton versions and today's date (UTC)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    ordered = sorted((dict(e) for e in entries), key=entry_key)
    return {"format": FORMAT, "device": device, "torch": torch.__version__, "triton": triton_version,
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), **extra, "entries": ordered}


def write(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` whole (a temporary file renamed over it: no half-written table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def choices(name: str) -> dict[Key, str] | None:
    """The kept choices for the device named ``name`` (read once per process), None when the package
    keeps none for it: no file of its slug, or a file naming another device exactly."""
    if name not in _LOADED:
        path = path_for(name)
        found = None
        if path.is_file():
            try:
                data = read(path)
            except (OSError, ValueError, KeyError, TypeError):
                data = None  # an unreadable table is no table: the configs are timed as without one
            if data is not None and data.get("device") == name:
                found = {entry_key(e): e["config"] for e in data["entries"]}
        _LOADED[name] = found
    return _LOADED[name]


def lookup(key: Key, candidates: Sequence[KernelConfig], device: torch.device) -> KernelConfig | None:
    """The kept config of ``key`` on ``device`` among ``candidates``; None when the kept tables are
    switched off, none names this device, it has no entry for the key or its config is no longer a
    candidate."""
    if not settings.get().kept_configs:
        return None
    name = device_name(device)
    kept = choices(name) if name is not None else None
    wanted = kept.get(key) if kept else None
    if wanted is None:
        return None
    return next((c for c in candidates if config_id(c) == wanted), None)


def forget() -> None:
    """Read the files again at the next lookup (tests, and the sweep after it writes one)."""
    _LOADED.clear()

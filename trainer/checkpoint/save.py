"""Writing a checkpoint: one directory, collectively and atomically (staging directory, every rank's
files, then the metadata and the manifest last, then the rename); full state or model only."""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from fastmoe_xpu.dist.sharding import is_expert_weight

from ..ft.space import tensor_bytes
from .dcp_io import CheckpointException, agree, dcp_save, describe_os_error, dtensor_params, raise_if_failed
from .optim_state import optimizer_steps, optimizer_writes
from .slots import (FORMAT_VERSION, MANIFEST, META, SLOTS, fsync_dir, json_bytes, manifest_digest, rank_file,
                    sha256_file, write_file)
from .writers import Coords, coords_of, model_segments, model_writes, segment_tensor, tp_rank_of, tp_size

@dataclass
class SaveStats:
    """What one save wrote and how long it took (on this rank)."""

    path: Path
    step: int
    seconds: float
    rank_bytes: int
    """Bytes of the files this rank wrote."""
    total_bytes: int
    """Bytes of the whole checkpoint directory (from its manifest)."""


#: ``--checkpoint.model_dtype`` names.
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _own_files(tmp: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote into a checkpoint directory (DCP names them ``__<rank>_<i>``)."""
    out = sorted(tmp.glob(f"__{rank}_*"))
    rf = tmp / rank_file(rank)
    if rf.exists():
        out.append(rf)
    return out


def _write_dir(root: Path, name: str, *, step: int, index: int, kind: str, coords: Coords,
               tensors: dict[str, torch.Tensor], rank_state: Any, meta: dict[str, Any], tp_size: int = 1,
               group: Any = None) -> SaveStats:
    """Collectively write one checkpoint directory ``root/name`` atomically (see the module docstring);
    every collective on ``group`` (None: the default group)."""
    t0 = time.perf_counter()
    final, tmp = root / name, root / f"{name}.tmp"
    rank = coords.rank
    what = f"could not write the {kind} checkpoint of step {step} to {final}"
    needed = tensor_bytes(tensors)  # this rank's share; a full disk is said with it and the bytes free

    # 1. rank 0 prepares an empty staging directory, then frees this slot's old contents (the slot
    #    being rewritten is never the newest valid one, so at most two full checkpoints use the disk);
    #    an unwritable directory fails at the mkdir, before anything is deleted
    ok, msg = True, ""
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            fsync_dir(root)
            if final.exists():
                (final / MANIFEST).unlink(missing_ok=True)  # invalid at once, however far rmtree gets
                shutil.rmtree(final)
                fsync_dir(root)
        except Exception as e:  # every rank must reach the agreement below
            ok, msg = False, describe_os_error(e, tmp, needed)
            shutil.rmtree(tmp, ignore_errors=True)
    raise_if_failed(agree(ok, msg, group=group), what)

    # 2. every rank writes its tensors (DCP) and its own state file, then hashes what it wrote
    ok, msg, hashes = True, "", {}
    try:
        dcp_save(tensors, tmp, group)
    except (Exception, CheckpointException) as e:  # DCP raises the same aggregated error on every rank
        ok, msg = False, describe_os_error(e, tmp, needed)
    if ok:
        try:
            if rank_state is not None:
                import io

                buf = io.BytesIO()
                torch.save(rank_state, buf)
                write_file(tmp / rank_file(rank), buf.getvalue())
            for f in _own_files(tmp, rank):
                hashes[f.name] = {"sha256": sha256_file(f), "size": f.stat().st_size}
        except Exception as e:  # every rank must reach the agreement below
            ok, msg = False, describe_os_error(e, tmp, needed)
    results = agree(ok, msg, hashes, group)
    if not all(r[0] for r in results) and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise_if_failed(results, what)

    # 3. rank 0 adds the metadata, the manifest (last), and renames the directory into place
    total = 0
    ok, msg = True, ""
    if rank == 0:
        try:
            files: dict[str, Any] = {}
            for _, _, h in results:
                files.update(h)
            md = tmp / ".metadata"
            if md.exists():
                files[md.name] = {"sha256": sha256_file(md), "size": md.stat().st_size}
            meta_all = {
                "format": FORMAT_VERSION, "kind": kind, "step": step, "index": index,
                "layout": {"world": coords.world, "pp": coords.pp, "dp": coords.dp, "ep": coords.ep,
                           "tp": tp_size},
                "time": time.time(), "host": socket.gethostname(), **meta,
            }
            meta_bytes = json_bytes(meta_all)
            write_file(tmp / META, meta_bytes)
            files[META] = {"sha256": hashlib.sha256(meta_bytes).hexdigest(), "size": len(meta_bytes)}
            manifest_size = _write_manifest(tmp, files)
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(root)
            total = sum(f["size"] for f in files.values()) + manifest_size
        except Exception as e:  # every rank must reach the agreement below
            ok, msg = False, describe_os_error(e, tmp, needed)
            shutil.rmtree(tmp, ignore_errors=True)
    results = agree(ok, msg, total, group)
    raise_if_failed(results, what)
    my_bytes = sum(h["size"] for h in hashes.values())
    return SaveStats(path=final, step=step, seconds=time.perf_counter() - t0, rank_bytes=my_bytes,
                     total_bytes=int(results[0][2]))


def _model_tensors(model: nn.Module, coords: Coords, dtype: torch.dtype | None,
                   is_expert: Callable[[str], bool], tp_rank: int | None = None) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    sharded = dtensor_params(model)
    out = {}
    for s in model_writes([s for s in model_segments(model, is_expert, tp_rank) if s.param not in sharded], coords):
        t = segment_tensor(params, s).detach()
        out[f"model/{s.key}"] = (t.to(dtype) if dtype is not None and t.dtype != dtype else t).contiguous()
    for name in sharded:  # FSDP2: every rank writes its own shard of the weight
        t = params[name].detach()
        out[f"model/{name}"] = t.to(dtype) if dtype is not None and t.dtype != dtype else t
    return out


def save_full(root: str | os.PathLike, *, step: int, index: int, model: nn.Module, optimizer: Any,
              layout: Any = None, meta: dict[str, Any] | None = None, rank_extra: Any = None,
              is_expert: Callable[[str], bool] = is_expert_weight,
              staged: Callable[[FullWrite], Callable[[], SaveStats]] | None = None) -> SaveStats | Callable[[], SaveStats]:
    """Write the full training state as checkpoint ``index`` into slot ``"AB"[index % 2]`` (collective).

    ``meta``: JSON-able, global (the step's data position, the config...), written by rank 0;
    ``rank_extra``: anything picklable, per rank, restored only when the layout is unchanged.
    ``staged``: turns the gathered state into a write to run later (an asynchronous save, see
    :mod:`.background`), which is returned instead of being run."""
    coords, tp = coords_of(layout), tp_rank_of(layout)
    tensors = _model_tensors(model, coords, None, is_expert, tp)
    tensors.update(optimizer_writes(model, optimizer, is_expert, tp))
    slot = SLOTS[index % 2]
    rank_state = {"rng": capture_rng(), "extra": rank_extra}
    if getattr(optimizer, "master", "fp32") == "stochastic":  # the rounding's generator, per rank
        rank_state["rng"]["optimizer_rounding"] = optimizer.generator.get_state()
    meta_all = {"slot": slot, "optimizer": {"kind": type(optimizer).__name__, "steps": optimizer_steps(optimizer)},
                "meta": meta or {}}
    w = FullWrite(Path(root), f"slot-{slot}", step, index, coords, tensors, rank_state, meta_all, tp_size(layout))
    return staged(w) if staged is not None else w.write()


@dataclass
class FullWrite:
    """A full checkpoint's gathered state and where it goes; :meth:`write` writes it (collective)."""

    root: Path
    name: str
    step: int
    index: int
    coords: Coords
    tensors: dict[str, torch.Tensor]
    rank_state: Any
    meta: dict[str, Any]
    tp_size: int

    def write(self, group: Any = None) -> SaveStats:
        return _write_dir(self.root, self.name, step=self.step, index=self.index, kind="full", coords=self.coords,
                          tensors=self.tensors, rank_state=self.rank_state, meta=self.meta, tp_size=self.tp_size,
                          group=group)


def save_model(root: str | os.PathLike, *, step: int, model: nn.Module, layout: Any = None,
               dtype: str | None = "bf16", meta: dict[str, Any] | None = None,
               is_expert: Callable[[str], bool] = is_expert_weight) -> SaveStats:
    """Write a persistent model-only checkpoint ``model-step-<step>`` (weights cast to ``dtype``,
    None keeps the parameter dtype); collective."""
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)} or None, got {dtype!r}")
    coords = coords_of(layout)
    tensors = _model_tensors(model, coords, DTYPE_NAMES[dtype] if dtype else None, is_expert, tp_rank_of(layout))
    return _write_dir(Path(root), f"model-step-{step:08d}", step=step, index=step, kind="model", coords=coords,
                      tensors=tensors, rank_state=None, meta={"dtype": dtype, "meta": meta or {}},
                      tp_size=tp_size(layout))


def _write_manifest(tmp: Path, files: dict[str, Any]) -> int:
    data = json_bytes({"format": FORMAT_VERSION, "files": files, "digest": manifest_digest(files)})
    write_file(tmp / MANIFEST, data)
    return len(data)


def capture_rng() -> dict[str, Any]:
    """RNG states of python, numpy, torch (CPU) and the accelerator, if any."""
    state: dict[str, Any] = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        state["xpu"] = torch.xpu.get_rng_state_all()
    return state

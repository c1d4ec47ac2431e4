"""Checkpoints: two alternating full-state slots, persistent model-only snapshots, DP-scattered
writes, and resuming on a different data-parallel size.

On disk, under the checkpoint root (``OUT/checkpoints`` by default)::

    slot-A/  slot-B/         full training state; checkpoint index k goes to slot "AB"[k % 2]
      .metadata              torch.distributed.checkpoint (DCP) index of every tensor key
      __<rank>_0.distcp      DCP data, one file per rank that writes something
      rank-<rank>.pt         that rank's RNG states (python, numpy, torch, accelerator) and extras
      meta.json              step, checkpoint index, layout, optimizer steps, the caller's metadata
      MANIFEST.json          sha256 and size of every other file, written last
    model-step-<step>/       model-only checkpoints, kept forever (same files, no optimizer state)
    slot-A.tmp/ ...          a write in progress: ignored by readers, removed by the next write

A write is atomic: everything goes into ``<name>.tmp``, every file and the directory are fsynced,
the manifest is written last, and only then is the directory renamed into place (and its parent
fsynced). Before slot A is reused its old contents are deleted, so at most two full checkpoints
occupy the disk, and a crash (or a full disk) while writing A leaves slot B, the newest complete
checkpoint, untouched. :func:`latest_valid` returns the newest slot whose manifest verifies:
missing, truncated or bit-flipped files disqualify a slot.

Key scheme (whole tensors keyed by name, so any layout can read any checkpoint; under
``--parallel.dp_shard fsdp`` a sharded weight and its states are saved as DTensors under the same
keys: every rank writes its own shard, DCP's index records the pieces, and a reader asks for the
whole tensor or its own part of it):

``model/<param>``
    a non-expert weight, whole, in the parameter dtype (or bf16 for model-only snapshots);
``model/<param>/<e>``
    global expert ``e``'s slice of a merged expert weight (``experts.gate_up_proj [E, 2I, H]`` ->
    ``[2I, H]``); global ids come from the block's ``experts.expert_ids`` buffer under EP;
``optim/<state>/<param>[/<e>]``
    the *unsharded* fp32 optimizer state of that weight, ``<state>`` in master / exp_avg /
    exp_avg_sq. Each rank owns a contiguous shard of a flat buffer of parameters; a weight that
    straddles shard boundaries is assembled (point-to-point sends) on the rank holding its first
    element, which writes it. On load, each rank reads the weights overlapping its new shard and
    copies out its slice, so DP (and EP, when E stays divisible) may differ from the saving run.

Writers: model-parallel shard ``m = pp_rank * EP + ep_rank`` is written by the rank with those
coordinates and ``dp_rank = m % DP`` (:func:`model_shard_writer`), so model writes spread across
nodes rather than all landing on DP rank 0. Non-expert weights, replicated on all EP ranks of a
stage, are split among that stage's EP shards by size (:func:`balance`). When DP exceeds the
number of shards (``PP*EP``; EP=1 runs have a single shard), each shard is further cut into
``DP // (PP*EP)`` size-balanced chunks written by DP ranks ``(m + j*PP*EP) % DP`` (chunk 0 by the
shard writer), so every node writes a share. Optimizer states are unique per shard and written by
their owners; replicas of a state (EP replicas under ShardedAdamW, every rank under the
replicated AdamW) take turns weight by weight. FSDP2 shards (weights and their states) are written
by every rank that holds one, replicas of an HSDP shard once (DCP keeps one copy of identical pieces).
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import shutil
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from fastmoe_xpu.dist.groups import dist_on, global_rank, group_rank, group_size
from fastmoe_xpu.dist.sharding import is_expert_weight

from .layout import DeviceMesh

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
META = "meta.json"
SLOTS = ("A", "B")
OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")
_READ_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which, where and why."""


# ============================================================================ layout and writers
#: A rank's position: the trainer's one mesh type, without process groups.
Coords = DeviceMesh


def coords_of(layout: Any) -> Coords:
    """Coords from anything with ``rank``, ``pp``, ``dp`` and ``ep`` attributes (None: one process).

    Under tensor parallelism (a layout with ``tp > 1``; TP sits innermost, where EP does for MoE
    models) the TP axis plays EP's part: TP-split weights are owned by their TP rank."""
    if layout is None:
        return Coords()
    inner = int(getattr(layout, "tp", 1) or 1)
    return Coords(rank=int(layout.rank), pp=int(layout.pp), dp=int(layout.dp),
                  ep=inner if inner > 1 else int(layout.ep))


def _tp_size(layout: Any) -> int:
    return int(getattr(layout, "tp", 1) or 1) if layout is not None else 1


def tp_rank_of(layout: Any) -> int | None:
    """This rank's TP index when the layout is tensor-parallel, else None."""
    if layout is not None and int(getattr(layout, "tp", 1) or 1) > 1:
        return int(layout.tp_rank)
    return None


def layout_rank(pp_rank: int, dp_rank: int, ep_rank: int, *, dp: int, ep: int) -> int:
    """Global rank of mesh coordinates ``(pp_rank, dp_rank, ep_rank)``."""
    return (pp_rank * dp + dp_rank) * ep + ep_rank


def model_shard_writer(pp_rank: int, ep_rank: int, *, pp: int, dp: int, ep: int) -> int:
    """The rank that writes model-parallel shard ``m = pp_rank * EP + ep_rank``: DP rank ``m % DP``."""
    if not (0 <= pp_rank < pp and 0 <= ep_rank < ep) or dp < 1:
        raise ValueError(f"shard (pp {pp_rank}, ep {ep_rank}) is outside PP x DP x EP = {pp} x {dp} x {ep}")
    m = pp_rank * ep + ep_rank
    return layout_rank(pp_rank, m % dp, ep_rank, dp=dp, ep=ep)


def shard_chunks(pp: int, dp: int, ep: int) -> int:
    """Writers per model-parallel shard: ``max(1, DP // (PP*EP))``, so that with few shards (EP=1)
    the weights still spread over all DP ranks instead of landing on one."""
    return max(1, dp // (pp * ep))


def chunk_writer_dp(pp_rank: int, ep_rank: int, chunk: int, *, pp: int, dp: int, ep: int) -> int:
    """DP rank that writes chunk ``chunk`` of shard ``m = pp_rank*EP + ep_rank``: ``(m + chunk*PP*EP) % DP``
    (chunk 0 is the shard writer ``m % DP``; distinct chunks of one shard go to distinct DP ranks)."""
    if not 0 <= chunk < shard_chunks(pp, dp, ep):
        raise ValueError(f"chunk {chunk} is outside [0, {shard_chunks(pp, dp, ep)})")
    return (pp_rank * ep + ep_rank + chunk * pp * ep) % dp


def writer_plan(pp: int, dp: int, ep: int) -> dict[tuple[int, int], int]:
    """``{(pp_rank, ep_rank): writer rank}`` for every model-parallel shard."""
    return {(p, e): model_shard_writer(p, e, pp=pp, dp=dp, ep=ep) for p in range(pp) for e in range(ep)}


def balance(sizes: Sequence[int], bins: int) -> list[int]:
    """Bin of every item, largest first into the emptiest bin (ties: lowest index): deterministic,
    so every rank computes the same assignment, and within the largest item of perfect balance."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    load = [0] * bins
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda k: (load[k], k))
        out[i] = b
        load[b] += sizes[i]
    return out


def checkpoint_bytes(n_dense: int, n_expert: int, *, pp: int = 1, dp: int = 1, ep: int = 1, weight_bytes: int = 4,
                     model_only_bytes: int = 2) -> dict[str, float]:
    """Sizes of a full and a model-only checkpoint and the bytes one rank writes, for ``n_dense``
    non-expert and ``n_expert`` expert weights (whole model), stages of equal size.

    Full checkpoint: weights (``weight_bytes`` each) + fp32 master, exp_avg, exp_avg_sq (12 bytes).
    Per rank: its 1/(PP*DP*EP) share of the optimizer state (EPSO and ShardedAdamW alike), plus,
    on the ``PP*EP*c`` ranks that write weights (``c`` = :func:`shard_chunks`), a 1/c chunk of one
    model-parallel shard's weights ``N / (PP*EP)``."""
    n = n_dense + n_expert
    c = shard_chunks(pp, dp, ep)
    state = 12 * n / (pp * dp * ep)
    chunk = weight_bytes * n / (pp * ep * c)
    return {
        "params": n, "full": (weight_bytes + 12) * n, "model_only": model_only_bytes * n,
        "full_over_model_only": (weight_bytes + 12) / model_only_bytes,
        "rank_writer": state + chunk, "rank_other": state, "writers": pp * ep * c, "ranks": pp * dp * ep,
    }


# ============================================================================ segments
@dataclass(frozen=True)
class Segment:
    """One checkpoint tensor: a whole weight, or one global expert's slice of a merged expert weight."""

    key: str
    """``<param>`` or ``<param>/<global expert id>``."""
    param: str
    """Parameter name in the model."""
    local_index: int | None
    """Index along dim 0 of the local parameter (expert slices), None for a whole weight."""
    shape: tuple[int, ...]
    inner: bool = False
    """Held by one inner-axis rank only (an expert slice under EP, a TP-split weight under TP),
    rather than replicated over that axis."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        return self.local_index is not None


def expert_ids(model: nn.Module, name: str, local_experts: int) -> list[int]:
    """Global ids of the experts an expert weight holds: the block's ``experts.expert_ids`` buffer
    under expert parallelism, ``0..E-1`` otherwise."""
    prefix = name.rsplit(".", 1)[0]
    for bname, buf in model.named_buffers():
        if bname == prefix + ".expert_ids":
            ids = [int(i) for i in buf.tolist()]
            if len(ids) != local_experts:
                raise CheckpointError(f"{bname} lists {len(ids)} experts but {name} holds {local_experts}")
            return ids
    return list(range(local_experts))


def param_segments(model: nn.Module, name: str, p: torch.Tensor,
                   is_expert: Callable[[str], bool] = is_expert_weight, tp_rank: int | None = None) -> list[Segment]:
    """A weight's checkpoint segments: one per global expert for merged expert weights; under TP a
    split weight is keyed ``<param>/tp<r>`` (a checkpoint then loads at the same TP size only)."""
    if is_expert(name) and p.dim() >= 2:
        ids = expert_ids(model, name, p.shape[0])
        return [Segment(f"{name}/{e}", name, i, tuple(p.shape[1:]), inner=True) for i, e in enumerate(ids)]
    if tp_rank is not None and getattr(p, "tp_split", False):
        return [Segment(f"{name}/tp{tp_rank}", name, None, tuple(p.shape), inner=True)]
    return [Segment(name, name, None, tuple(p.shape))]


def model_segments(model: nn.Module, is_expert: Callable[[str], bool] = is_expert_weight,
                   tp_rank: int | None = None) -> list[Segment]:
    """Checkpoint segments of the model's trainable weights, in parameter order."""
    out: list[Segment] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            out.extend(param_segments(model, name, p, is_expert, tp_rank))
    return out


def model_writes(segments: Sequence[Segment], coords: Coords) -> list[Segment]:
    """The model segments this rank writes under the DP-scattered plan.

    Segments belong to the model-parallel shard of their EP (or TP) rank; replicated ones to the
    EP rank :func:`balance` gives them. The shard's writers are its :func:`shard_chunks` DP replicas
    (:func:`chunk_writer_dp`), each writing one size-balanced chunk."""
    c = coords
    dense = [s for s in segments if not s.inner]
    dense_ep = iter(balance([s.numel for s in dense], c.ep))
    mine = [s for s in segments if s.inner or next(dense_ep) == c.ep_rank]  # this rank's shard
    chunk = balance([s.numel for s in mine], shard_chunks(c.pp, c.dp, c.ep))
    return [s for s, j in zip(mine, chunk)
            if chunk_writer_dp(c.pp_rank, c.ep_rank, j, pp=c.pp, dp=c.dp, ep=c.ep) == c.dp_rank]


def _segment_tensor(model_params: Mapping[str, torch.Tensor], s: Segment) -> torch.Tensor:
    p = model_params[s.param]
    return p if s.local_index is None else p[s.local_index]


# ============================================================================ files
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


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def _manifest_digest(files: Mapping[str, Any]) -> str:
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
        if manifest.get("digest") != _manifest_digest(files):
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


# ============================================================================ RNG
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


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "xpu" in state and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.set_rng_state_all(state["xpu"])


# ============================================================================ collectives
def _agree(ok: bool, message: str, payload: Any = None) -> list[tuple[bool, str, Any]]:
    """Every rank's ``(ok, message, payload)``; one all-gather, so all ranks take the same branch."""
    mine = (ok, message, payload)
    if not dist_on():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _raise_if_failed(results: list[tuple[bool, str, Any]], what: str) -> None:
    bad = [(r, msg) for r, (ok, msg, _) in enumerate(results) if not ok]
    if bad:
        r, msg = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise CheckpointError(f"{what}: rank {r}: {msg}{more}")


def _broadcast(obj: Any) -> Any:
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


try:
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
except ImportError:  # pragma: no cover - older torch
    class _CheckpointException(BaseException):  # type: ignore[no-redef]
        pass


def _describe_os_error(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"no space left on device ({e})"
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the output directory is not writable ({e})"
    failures = getattr(e, "failures", None)
    if isinstance(e, _CheckpointException) and isinstance(failures, dict) and failures:
        # DCP gathers every rank's exception; name the first rank and its underlying error
        rank, first = next(iter(sorted(failures.items())))
        cause = first[0] if isinstance(first, tuple) else first
        return f"rank {rank}: {_describe_os_error(cause)}"
    return f"{type(e).__name__}: {e}"


# ============================================================================ optimizer states
@dataclass(frozen=True)
class _OptSegment:
    """A checkpoint segment inside one optimizer bucket's flat buffer."""

    seg: Segment
    offset: int
    """First element in the bucket's (unpadded) flat buffer."""


def _bucket_segments(model: nn.Module, bucket: Any, is_expert: Callable[[str], bool],
                     tp_rank: int | None = None) -> list[_OptSegment]:
    out = []
    for name, off, p in zip(bucket.names, bucket.offsets, bucket.params):
        segs = param_segments(model, name, p, is_expert, tp_rank)
        step = segs[0].numel
        for k, s in enumerate(segs):
            out.append(_OptSegment(s, off + k * step))
    return out


def _optimizer_writes(model: nn.Module, optimizer: Any, is_expert: Callable[[str], bool],
                      tp_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Unsharded fp32 states of the weights this rank writes, assembling weights that straddle
    shard boundaries on the rank holding their first element (collective over every shard group)."""
    out: dict[str, torch.Tensor] = {}
    for b in optimizer.buckets:
        if hasattr(b, "checkpoint_states"):  # FSDP2 shards: DTensors, every rank writes its own piece
            for state, by_name in b.checkpoint_states().items():
                out.update({f"optim/{state}/{n}": t for n, t in by_name.items()})
            continue
        states = (b.master_view(), b.exp_avg, b.exp_avg_sq)
        group = b.spec.shard_group
        G, g, S = group_size(group), group_rank(group), b.shard_numel
        R, j = group_size(b.spec.pre_reduce_group), group_rank(b.spec.pre_reduce_group)
        lo_me = g * S
        full: dict[int, torch.Tensor] = {}
        sends: dict[int, list[tuple[int, int]]] = {}
        recvs: dict[int, list[tuple[int, int, int]]] = {}
        segs = _bucket_segments(model, b, is_expert, tp_rank)
        for i, os_ in enumerate(segs):
            if i % R != j:
                continue  # an identical replica (another EP rank, or another rank of a replicated state) writes it
            start, end = os_.offset, os_.offset + os_.seg.numel
            writer, last = start // S, (end - 1) // S
            if writer == g:
                buf = torch.empty((3, os_.seg.numel), dtype=torch.float32, device=b.device)
                mine_end = min(end, lo_me + S)
                for k, st in enumerate(states):
                    buf[k, : mine_end - start].copy_(st[start - lo_me: mine_end - lo_me])
                full[i] = buf
                for src in range(writer + 1, last + 1):
                    lo, hi = src * S, min(end, (src + 1) * S)
                    recvs.setdefault(src, []).append((i, lo - start, hi - lo))
            elif writer < g <= last:
                lo, hi = lo_me, min(end, lo_me + S)
                sends.setdefault(writer, []).append((lo - lo_me, hi - lo))
        ops = []
        recv_bufs = {}
        for dst, pieces in sends.items():
            payload = torch.cat([st[a:a + n] for st in states for a, n in pieces])
            ops.append(dist.P2POp(dist.isend, payload, global_rank(group, dst)))
        for src, pieces in recvs.items():
            n_total = sum(n for _, _, n in pieces)
            recv_bufs[src] = torch.empty(3 * n_total, dtype=torch.float32, device=b.device)
            ops.append(dist.P2POp(dist.irecv, recv_bufs[src], global_rank(group, src)))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for src, pieces in recvs.items():
            n_total = sum(n for _, _, n in pieces)
            flat = recv_bufs[src].view(3, n_total)
            pos = 0
            for i, at, n in pieces:
                full[i][:, at:at + n].copy_(flat[:, pos:pos + n])
                pos += n
        for i, buf in full.items():
            s = segs[i].seg
            for k, state in enumerate(OPTIM_STATES):
                out[f"optim/{state}/{s.key}"] = buf[k].view(s.shape)
    return out


def _optimizer_reads(model: nn.Module, optimizer: Any, is_expert: Callable[[str], bool], tp_rank: int | None = None
                     ) -> tuple[dict[str, torch.Tensor], list[tuple[Any, int, int, int, str]]]:
    """Tensors to load (the unsharded states of every weight overlapping this rank's shards) and
    where each piece goes: ``(bucket, shard offset, segment offset, length, key suffix)``."""
    want: dict[str, torch.Tensor] = {}
    copies = []
    for b in optimizer.buckets:
        if hasattr(b, "empty_states"):  # FSDP2 shards: read as DTensors, copied by restore_full
            for state, by_name in b.empty_states().items():
                want.update({f"optim/{state}/{n}": t for n, t in by_name.items()})
            continue
        g, S = group_rank(b.spec.shard_group), b.shard_numel
        lo_me, hi_me = g * S, min(b.numel, (g + 1) * S)
        for os_ in _bucket_segments(model, b, is_expert, tp_rank):
            start, end = os_.offset, os_.offset + os_.seg.numel
            lo, hi = max(start, lo_me), min(end, hi_me)
            if lo >= hi:
                continue
            for state in OPTIM_STATES:
                want[f"optim/{state}/{os_.seg.key}"] = torch.empty(os_.seg.shape, dtype=torch.float32,
                                                                   device=b.device)
            copies.append((b, lo - lo_me, lo - start, hi - lo, os_.seg.key))
    return want, copies


def optimizer_steps(optimizer: Any) -> dict[str, int]:
    return {b.name: int(b.step_t.item()) for b in optimizer.buckets}


@torch.no_grad()
def sync_master_from_model(optimizer: Any) -> None:
    """Re-seed the optimizer's fp32 master shards from the model's current weights (after loading
    weights into a model whose optimizer already exists, e.g. ``--init-from``)."""
    for b in optimizer.buckets:
        if hasattr(b, "sync_from_params"):  # FSDP2 shards
            b.sync_from_params()
            continue
        if b.master is None:  # the weights are the parameters' own shard already
            continue
        lo = b.group_rank * b.shard_numel
        b.master.copy_(b.flat_param[lo:lo + b.shard_numel].to(torch.float32))


# ============================================================================ DCP I/O
def _storage_writer(path: Path) -> Any:
    """The DCP writer (one file per rank, fsynced); a separate function so tests can make it fail."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)


def _storage_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


def _dcp_save(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state, storage_writer=_storage_writer(path), no_dist=not dist_on())


def _dcp_load(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(state, storage_reader=_storage_reader(path), no_dist=not dist_on())
        except _CheckpointException as e:
            raise CheckpointError(f"reading {path} failed: {_describe_os_error(e)}") from None


def _key_problem(path: Path, want: Mapping[str, torch.Tensor]) -> str | None:
    md = _storage_reader(path).read_metadata().state_dict_metadata
    missing = [k for k in want if k not in md]
    if missing:
        return (f"{path} has no tensor {missing[0]!r} ({len(missing)} missing): it was written for a different "
                "model, or without optimizer state")
    for k, t in want.items():
        size = tuple(md[k].size)
        if size != tuple(t.shape):
            return f"{path}: tensor {k!r} has shape {list(size)}, this model expects {list(t.shape)}"
    return None


def _check_keys(path: Path, want: Mapping[str, torch.Tensor]) -> None:
    """Every rank's wanted keys exist in the checkpoint with the wanted shapes, else the same clear
    error on every rank (collective: a rank must not enter the load while another gave up)."""
    try:
        problem = _key_problem(path, want)
    except Exception as e:  # an unreadable index
        problem = f"{path}: cannot read the checkpoint index: {_describe_os_error(e)}"
    results = _agree(problem is None, problem or "")
    bad = [msg for ok, msg, _ in results if not ok]
    if bad:
        raise CheckpointError(bad[0])


# ============================================================================ writing
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


_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _own_files(tmp: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote into a checkpoint directory (DCP names them ``__<rank>_<i>``)."""
    out = sorted(tmp.glob(f"__{rank}_*"))
    rf = tmp / _rank_file(rank)
    if rf.exists():
        out.append(rf)
    return out


def _write_dir(root: Path, name: str, *, step: int, index: int, kind: str, coords: Coords,
               tensors: dict[str, torch.Tensor], rank_state: Any, meta: dict[str, Any], tp_size: int = 1) -> SaveStats:
    """Collectively write one checkpoint directory ``root/name`` atomically (see the module docstring)."""
    t0 = time.perf_counter()
    final, tmp = root / name, root / f"{name}.tmp"
    rank = coords.rank
    what = f"could not write the {kind} checkpoint of step {step} to {final}"

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
            ok, msg = False, _describe_os_error(e)
            shutil.rmtree(tmp, ignore_errors=True)
    _raise_if_failed(_agree(ok, msg), what)

    # 2. every rank writes its tensors (DCP) and its own state file, then hashes what it wrote
    ok, msg, hashes = True, "", {}
    try:
        _dcp_save(tensors, tmp)
    except (Exception, _CheckpointException) as e:  # DCP raises the same aggregated error on every rank
        ok, msg = False, _describe_os_error(e)
    if ok:
        try:
            if rank_state is not None:
                import io

                buf = io.BytesIO()
                torch.save(rank_state, buf)
                write_file(tmp / _rank_file(rank), buf.getvalue())
            for f in _own_files(tmp, rank):
                hashes[f.name] = {"sha256": sha256_file(f), "size": f.stat().st_size}
        except Exception as e:  # every rank must reach the agreement below
            ok, msg = False, _describe_os_error(e)
    results = _agree(ok, msg, hashes)
    if not all(r[0] for r in results) and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_if_failed(results, what)

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
            meta_bytes = _json_bytes(meta_all)
            write_file(tmp / META, meta_bytes)
            files[META] = {"sha256": hashlib.sha256(meta_bytes).hexdigest(), "size": len(meta_bytes)}
            manifest_size = _write_manifest(tmp, files)
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(root)
            total = sum(f["size"] for f in files.values()) + manifest_size
        except Exception as e:  # every rank must reach the agreement below
            ok, msg = False, _describe_os_error(e)
            shutil.rmtree(tmp, ignore_errors=True)
    results = _agree(ok, msg, total)
    _raise_if_failed(results, what)
    my_bytes = sum(h["size"] for h in hashes.values())
    return SaveStats(path=final, step=step, seconds=time.perf_counter() - t0, rank_bytes=my_bytes,
                     total_bytes=int(results[0][2]))


def _write_manifest(tmp: Path, files: dict[str, Any]) -> int:
    data = _json_bytes({"format": FORMAT_VERSION, "files": files, "digest": _manifest_digest(files)})
    write_file(tmp / MANIFEST, data)
    return len(data)


def _model_tensors(model: nn.Module, coords: Coords, dtype: torch.dtype | None,
                   is_expert: Callable[[str], bool], tp_rank: int | None = None) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    sharded = _dtensor_params(model)
    out = {}
    for s in model_writes([s for s in model_segments(model, is_expert, tp_rank) if s.param not in sharded], coords):
        t = _segment_tensor(params, s).detach()
        out[f"model/{s.key}"] = (t.to(dtype) if dtype is not None and t.dtype != dtype else t).contiguous()
    for name in sharded:  # FSDP2: every rank writes its own shard of the weight
        t = params[name].detach()
        out[f"model/{name}"] = t.to(dtype) if dtype is not None and t.dtype != dtype else t
    return out


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def _dtensor_params(model: nn.Module) -> list[str]:
    """Names of the trainable weights held as DTensors (sharded by FSDP2 under
    ``--parallel.dp_shard fsdp``): checkpointed whole under their plain key, each rank writing and
    reading its own shard through DCP."""
    return [n for n, p in model.named_parameters() if p.requires_grad and _is_dtensor(p)]


def save_full(root: str | os.PathLike, *, step: int, index: int, model: nn.Module, optimizer: Any,
              layout: Any = None, meta: dict[str, Any] | None = None, rank_extra: Any = None,
              is_expert: Callable[[str], bool] = is_expert_weight) -> SaveStats:
    """Write the full training state as checkpoint ``index`` into slot ``"AB"[index % 2]`` (collective).

    ``meta``: JSON-able, global (the step's data position, the config...), written by rank 0;
    ``rank_extra``: anything picklable, per rank, restored only when the layout is unchanged."""
    coords, tp = coords_of(layout), tp_rank_of(layout)
    tensors = _model_tensors(model, coords, None, is_expert, tp)
    tensors.update(_optimizer_writes(model, optimizer, is_expert, tp))
    slot = SLOTS[index % 2]
    rank_state = {"rng": capture_rng(), "extra": rank_extra}
    if getattr(optimizer, "master", "fp32") == "stochastic":  # the rounding's generator, per rank
        rank_state["rng"]["optimizer_rounding"] = optimizer.generator.get_state()
    meta_all = {"slot": slot, "optimizer": {"kind": type(optimizer).__name__, "steps": optimizer_steps(optimizer)},
                "meta": meta or {}}
    return _write_dir(Path(root), f"slot-{slot}", step=step, index=index, kind="full", coords=coords,
                      tensors=tensors, rank_state=rank_state, meta=meta_all, tp_size=_tp_size(layout))


def save_model(root: str | os.PathLike, *, step: int, model: nn.Module, layout: Any = None,
               dtype: str | None = "bf16", meta: dict[str, Any] | None = None,
               is_expert: Callable[[str], bool] = is_expert_weight) -> SaveStats:
    """Write a persistent model-only checkpoint ``model-step-<step>`` (weights cast to ``dtype``,
    None keeps the parameter dtype); collective."""
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES)} or None, got {dtype!r}")
    coords = coords_of(layout)
    tensors = _model_tensors(model, coords, _DTYPE_NAMES[dtype] if dtype else None, is_expert, tp_rank_of(layout))
    return _write_dir(Path(root), f"model-step-{step:08d}", step=step, index=step, kind="model", coords=coords,
                      tensors=tensors, rank_state=None, meta={"dtype": dtype, "meta": meta or {}},
                      tp_size=_tp_size(layout))


# ============================================================================ reading
@dataclass
class RestoreResult:
    info: CheckpointInfo
    seconds: float
    same_layout: bool
    """Whether the saving run had this run's PP x DP x EP (then RNG and rank extras were restored)."""
    rank_extra: Any = None

    @property
    def meta(self) -> dict[str, Any]:
        return self.info.meta.get("meta", {})


class NoValidCheckpoint(CheckpointError):
    """Checkpoint slots exist but none verifies (and no fresh start was asked for)."""


def _choose(root: str | os.PathLike) -> tuple[CheckpointInfo | None, list[tuple[Path, str]]]:
    """The newest valid full slot and the ``(slot, reason)`` of every slot that does not verify."""
    slots = scan(root)
    good = [info for _, info, _ in slots if info is not None]
    rejected = [(p, why) for p, info, why in slots if info is None]
    return max(good, key=lambda i: (i.step, i.index), default=None), rejected


def find_latest(root: str | os.PathLike) -> CheckpointInfo | None:
    """:func:`latest_valid`, verified by rank 0 and broadcast (collective when distributed)."""
    info = None
    if not dist_on() or dist.get_rank() == 0:
        info = latest_valid(root)
    return _broadcast(info)


@torch.no_grad()
def load_model(path: str | os.PathLike, model: nn.Module, *, layout: Any = None, verify_first: bool = True,
               is_expert: Callable[[str], bool] = is_expert_weight) -> CheckpointInfo:
    """Load model weights (only) from a full or model-only checkpoint into ``model`` (collective).
    Any DP size and any EP size dividing E can read it; a different model gives a clear error."""
    path = Path(path)
    if verify_first:
        reason = None
        if not dist_on() or dist.get_rank() == 0:
            reason = verify(path) if path.is_dir() else f"{path} is not a checkpoint directory"
        reason = _broadcast(reason)
        if reason is not None:
            raise CheckpointError(f"cannot initialise from {path}: {reason}")
    info = read_info(path)
    params = dict(model.named_parameters())
    segments = model_segments(model, is_expert, tp_rank_of(layout))
    want = {f"model/{s.key}": torch.empty_like(params[s.param]) if _is_dtensor(params[s.param]) else
            torch.empty(s.shape, dtype=params[s.param].dtype, device=params[s.param].device) for s in segments}
    _check_keys(path, want)
    _dcp_load(want, path)
    for s in segments:
        _segment_tensor(params, s).copy_(want[f"model/{s.key}"])
    return info


@torch.no_grad()
def restore_full(info: CheckpointInfo, model: nn.Module, optimizer: Any, layout: Any = None,
                 is_expert: Callable[[str], bool] = is_expert_weight) -> RestoreResult:
    """Restore weights, optimizer shards and steps (and, on the same layout, RNG states and rank
    extras) from a verified full checkpoint (collective)."""
    t0 = time.perf_counter()
    if info.kind != "full":
        raise CheckpointError(f"{info.path} is a {info.kind}-only checkpoint; use it with --init-from")
    coords = coords_of(layout)
    want, copies = _optimizer_reads(model, optimizer, is_expert, tp_rank_of(layout))
    _check_keys(info.path, want)
    _dcp_load(want, info.path)
    for b, at, seg_at, n, key in copies:
        for state, dst in zip(OPTIM_STATES, (b.master_view(), b.exp_avg, b.exp_avg_sq)):
            dst[at:at + n].copy_(want[f"optim/{state}/{key}"].reshape(-1)[seg_at:seg_at + n])
    for b in optimizer.buckets:
        if hasattr(b, "load_states"):
            b.load_states({st: {n: want[f"optim/{st}/{n}"] for n in b.names} for st in OPTIM_STATES})
    steps = info.meta.get("optimizer", {}).get("steps", {})
    for b in optimizer.buckets:
        b.step_t.fill_(float(steps.get(b.name, max(steps.values(), default=0))))
        b.publish()  # the weights are the master weights cast to the parameter dtype
    saved = info.meta["layout"]
    same = ((saved["pp"], saved["dp"], saved["ep"], saved.get("tp", 1))
            == (coords.pp, coords.dp, coords.ep, _tp_size(layout)))
    extra = None
    if same:
        state = torch.load(info.path / _rank_file(coords.rank), map_location="cpu", weights_only=False)
        restore_rng(state["rng"])
        if "optimizer_rounding" in state["rng"] and hasattr(optimizer, "generator"):
            optimizer.generator.set_state(state["rng"]["optimizer_rounding"])
        extra = state["extra"]
    return RestoreResult(info=info, seconds=time.perf_counter() - t0, same_layout=same, rank_extra=extra)


# ============================================================================ manager
class CheckpointManager:
    """Periodic full checkpoints in alternating slots plus persistent model-only ones.

    ``interval``: full checkpoint every this many steps (0: never); ``model_interval``: model-only
    checkpoint every this many steps (0: never), cast to ``model_dtype`` (None: parameter dtype)."""

    def __init__(self, root: str | os.PathLike, *, layout: Any = None, interval: int = 0, model_interval: int = 0,
                 model_dtype: str | None = "bf16", is_expert: Callable[[str], bool] = is_expert_weight,
                 allow_fresh_start: bool = False, failures_dir: str | os.PathLike | None = None) -> None:
        if interval < 0 or model_interval < 0:
            raise ValueError(f"checkpoint intervals must be >= 0, got {interval} and {model_interval}")
        self.root = Path(root)
        self.allow_fresh_start = allow_fresh_start
        self.failures_dir = Path(failures_dir) if failures_dir is not None else self.root.parent
        self.layout = layout
        self.interval = interval
        self.model_interval = model_interval
        self.model_dtype = model_dtype
        self.is_expert = is_expert
        self.last_index: int | None = None
        self.last: CheckpointInfo | None = None

    def latest(self) -> CheckpointInfo | None:
        info = find_latest(self.root)
        if info is not None:
            self.last, self.last_index = info, info.index
        return info

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def model_due(self, step: int) -> bool:
        return self.model_interval > 0 and step > 0 and step % self.model_interval == 0

    def save(self, step: int, model: nn.Module, optimizer: Any, *, meta: dict[str, Any] | None = None,
             rank_extra: Any = None) -> SaveStats:
        if self.last_index is None:
            # never overwrite the newest valid slot, even in a run that did not resume from it
            self.latest()
        index = 0 if self.last_index is None else self.last_index + 1
        try:
            stats = save_full(self.root, step=step, index=index, model=model, optimizer=optimizer, layout=self.layout,
                              meta=meta, rank_extra=rank_extra, is_expert=self.is_expert)
        except CheckpointError as e:
            prev = (f"the previous checkpoint {self.last.path} (step {self.last.step}) is untouched"
                    if self.last is not None else "there is no previous checkpoint")
            raise CheckpointError(f"{e}; {prev}") from e
        self.last_index = index
        self.last = CheckpointInfo(stats.path, "full", step, index, {})
        return stats

    def save_model(self, step: int, model: nn.Module, *, meta: dict[str, Any] | None = None) -> SaveStats:
        return save_model(self.root, step=step, model=model, layout=self.layout, dtype=self.model_dtype, meta=meta,
                          is_expert=self.is_expert)

    def restore(self, model: nn.Module, optimizer: Any, info: CheckpointInfo | None = None) -> RestoreResult | None:
        """Restore the newest valid checkpoint (or ``info``); None when there is none.

        Slots that exist but do not verify are never passed over silently: when a valid one is
        left, one line per skipped slot is printed (rank 0) and recorded in ``failures.jsonl``
        (``failures_dir``, default the checkpoint root's parent); when none is left, a
        :class:`NoValidCheckpoint` lists every slot and why, unless ``allow_fresh_start``."""
        if info is None:
            info, rejected = _broadcast(_choose(self.root) if not dist_on() or dist.get_rank() == 0 else None)
            if rejected and info is None and not self.allow_fresh_start:
                raise NoValidCheckpoint(
                    f"{self.root} holds checkpoints but none is valid: "
                    + "; ".join(f"{p.name}: {why}" for p, why in rejected)
                    + ". Fix or remove them, or pass --allow-fresh-start to start again from step 0")
            if rejected and (not dist_on() or dist.get_rank() == 0):
                from .ft.fault import FAILURES_FILE, append_jsonl

                for p, why in rejected:
                    then = f"resuming from {info.path.name} (step {info.step})" if info is not None else \
                        "starting again from step 0 (--allow-fresh-start)"
                    print(f"checkpoint: skipped damaged {p}: {why}; {then}", flush=True)
                    try:
                        append_jsonl(Path(self.failures_dir) / FAILURES_FILE, {
                            "time": time.time(), "kind": "checkpoint_skipped", "slot": str(p), "reason": why,
                            "used": str(info.path) if info is not None else None})
                    except OSError:
                        pass  # the record is a courtesy; the printed line already says it
            if info is not None:
                self.last, self.last_index = info, info.index
        if info is None:
            return None
        result = restore_full(info, model, optimizer, self.layout, is_expert=self.is_expert)
        self.last, self.last_index = info, info.index
        return result

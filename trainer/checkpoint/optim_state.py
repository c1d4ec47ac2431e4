"""The optimizer's state in a checkpoint: each weight's unsharded fp32 master and Adam moments,
assembled from and copied back into the flat buffers' shards, whatever the DP size of either run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fastmoe_xpu.dist.groups import global_rank, group_rank, group_size

from .writers import Segment, param_segments

OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class _OptSegment:
    """A checkpoint segment inside one optimizer bucket's flat buffer."""

    seg: Segment
    offset: int
    """First element in the bucket's (unpadded) flat buffer."""


def bucket_segments(model: nn.Module, bucket: Any, is_expert: Callable[[str], bool],
                     tp_rank: int | None = None) -> list[_OptSegment]:
    out = []
    for name, off, p in zip(bucket.names, bucket.offsets, bucket.params):
        segs = param_segments(model, name, p, is_expert, tp_rank)
        step = segs[0].numel
        for k, s in enumerate(segs):
            out.append(_OptSegment(s, off + k * step))
    return out


def state_writer(index: int, offset: int, shard_numel: int, replicas: int) -> tuple[int, int]:
    """(shard rank, replica rank) that writes the states of a bucket's segment ``index`` starting at
    element ``offset``: the shard holding its first element, and among ``replicas`` identical
    replicas (a pre-reduce group) replica ``index % replicas``."""
    return offset // shard_numel, index % replicas


def optimizer_writes(model: nn.Module, optimizer: Any, is_expert: Callable[[str], bool],
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
        if R == 1 and not b.spec.norm_owner:
            continue  # an identical replica of another rank's states (TP's replicated weights): that rank writes them
        lo_me = g * S
        full: dict[int, torch.Tensor] = {}
        sends: dict[int, list[tuple[int, int]]] = {}
        recvs: dict[int, list[tuple[int, int, int]]] = {}
        segs = bucket_segments(model, b, is_expert, tp_rank)
        for i, os_ in enumerate(segs):
            if state_writer(i, os_.offset, S, R)[1] != j:
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


def optimizer_reads(model: nn.Module, optimizer: Any, is_expert: Callable[[str], bool], tp_rank: int | None = None
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
        for os_ in bucket_segments(model, b, is_expert, tp_rank):
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

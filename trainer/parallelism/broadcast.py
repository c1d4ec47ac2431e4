"""Model broadcast: one rank reads the weights, every other rank receives them over the network.

On thousands of ranks, every rank opening the same checkpoint hammers the shared file system; here
only the source rank reads (``load_and_broadcast``), or, for a freshly initialised model, the
source replica's weights are sent to the others (``broadcast_replicas``). Two transports:

``broadcast``   ``dist.broadcast`` from the source.
``all_reduce``  every other rank contributes -0.0 and the group sums (x + -0.0 == x bit for bit,
                for every x including +0.0, -0.0, inf and NaN), for stacks whose all-reduce is
                faster or better tested than their broadcast.

Either way all ranks end bit-identical to the source. Tensors go one at a time, so no rank holds
more than one full tensor besides its model.

Receivers keep what they own of each full tensor (:func:`default_localize`): entries their model
does not have (other pipeline stages' layers) are dropped, expert tensors are cut to the rank's
experts (``experts.expert_ids`` or the block's ``expert_start``), and a ``localize`` callable can
cut anything else (tensor-parallel slices).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from fastmoe_xpu.dist.groups import global_rank, group_rank, world_if_none
from fastmoe_xpu.dist.sharding import is_expert_weight
from fastmoe_xpu.integrations.v4_keys import merge_v4_expert_keys

METHODS = ("broadcast", "all_reduce")

#: (name, full tensor, this rank's model) -> this rank's part of it, or None to drop it.
Localize = Callable[[str, torch.Tensor, nn.Module], "torch.Tensor | None"]


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from ``path``: a ``.safetensors`` file (as ``save_pretrained`` writes), or a
    ``torch.save`` file holding a state dict or a dict with a ``"model"`` entry (trainer checkpoints),
    or a transformers model directory (``python -m trainer.outputs.export``'s output, ``save_pretrained``'s)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return read_hf_directory(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(obj, Mapping) and "model" in obj and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: expected a state dict (name -> tensor) or a dict with a 'model' state dict")
    return dict(obj)


def read_hf_directory(path: str) -> dict[str, torch.Tensor]:
    """The weights of a transformers model directory: ``model.safetensors``, or every shard its
    ``model.safetensors.index.json`` names. ValueError naming the file when one is missing."""
    from safetensors.torch import load_file

    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        import json

        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{index} is unreadable: {e}") from None
        files = [os.path.join(path, n) for n in names]
    else:
        raise ValueError(f"{path} is a directory without model.safetensors or model.safetensors.index.json")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"{f} is missing (named by {index})")
        try:
            sd.update(load_file(f, device="cpu"))
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise ValueError(f"{f} does not load: {' '.join(str(e).split())}") from None
    return sd


def _local_expert_ids(model: nn.Module, name: str, local: torch.Tensor) -> torch.Tensor | None:
    """Global ids of the experts ``name`` (``...experts.gate_up_proj`` / ``down_proj``) holds here."""
    experts_name = name.rpartition(".")[0]
    try:
        experts = model.get_submodule(experts_name)
    except AttributeError:
        return None
    ids = getattr(experts, "expert_ids", None)
    if isinstance(ids, torch.Tensor):
        return ids.detach().long().cpu()
    block = model.get_submodule(experts_name.rpartition(".")[0]) if "." in experts_name else model
    start = getattr(block, "expert_start", None)
    if start is None:
        return None
    return torch.arange(int(start), int(start) + local.shape[0])


def default_localize(name: str, full: torch.Tensor, model: nn.Module, local: torch.Tensor | None = None) -> torch.Tensor | None:
    """This rank's part of ``full``: the whole tensor when shapes agree, the rank's experts of an
    expert tensor, None for entries the model does not hold; ValueError for anything else."""
    if local is None:
        return None
    if tuple(local.shape) == tuple(full.shape):
        return full
    if is_expert_weight(name) and local.shape[1:] == full.shape[1:]:
        ids = _local_expert_ids(model, name, local)
        if ids is not None and ids.numel() == local.shape[0]:
            return full[ids.to(full.device)]
    raise ValueError(f"{name}: the source sends shape {tuple(full.shape)}, this rank holds {tuple(local.shape)} "
                     "and no rule says which part it owns (pass localize=)")


def _transport(t: torch.Tensor, *, is_src: bool, src_global: int, group: Any, method: str) -> None:
    """Make ``t`` equal to the source's on every rank of ``group``, in place."""
    if t.dtype == torch.bool:  # no sum of bools; a byte copy travels by broadcast either way
        buf = t.to(torch.uint8)
        dist.broadcast(buf, src=src_global, group=group)
        t.copy_(buf.bool())
    elif method == "broadcast":
        dist.broadcast(t, src=src_global, group=group)
    else:
        if not is_src:
            if t.is_floating_point() or t.is_complex():
                t.fill_(-0.0)  # the additive identity that also keeps a -0.0 on the source -0.0
            else:
                t.zero_()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def _comm_device(model: nn.Module, group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def load_and_broadcast(model: nn.Module, path: str | os.PathLike | None, *, group: Any = None, src: int = 0,
                       method: str = "broadcast", localize: Localize | None = None,
                       state_dict: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Fill ``model`` on every rank of ``group`` from the full state dict that only group rank
    ``src`` reads (from ``path``, or given as ``state_dict``); other ranks never open ``path``.

    Call on every rank of ``group`` (None: the whole world). The source first sends the names, shapes and dtypes, then every
    tensor; each rank keeps its part (see :func:`default_localize`). Returns the model's state-dict
    entries that the source did not provide (rotary buffers, ``expert_ids``), and raises ValueError
    on every rank when a parameter is missing or the source could not read the file."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    group = world_if_none(group)  # None: the whole world
    is_src = group_rank(group) == src
    src_global = global_rank(group, src)
    full: Mapping[str, torch.Tensor] | None = None
    header: list[Any] = [None]
    if is_src:
        try:
            full = merge_v4_expert_keys(state_dict if state_dict is not None else read_state_dict(path))  # type: ignore[arg-type]
            header = [("ok", [(k, tuple(v.shape), v.dtype) for k, v in full.items()])]
        except Exception as e:  # every rank must learn about it, not just the reader
            header = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(header, src=src_global, group=group)
    status, payload = header[0]
    if status != "ok":
        raise ValueError(f"rank {src_global} could not read the model from {os.fspath(path) if path else 'its state dict'}: {payload}")
    local = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    dev = _comm_device(model, group)
    received: set[str] = set()
    for name, shape, dtype in payload:
        buf = full[name].to(dev).contiguous() if is_src else torch.empty(shape, dtype=dtype, device=dev)  # type: ignore[index]
        _transport(buf, is_src=is_src, src_global=src_global, group=group, method=method)
        target = local.get(name)
        part = (localize or (lambda n, f, m: default_localize(n, f, m, target)))(name, buf, model)
        if part is None or target is None:
            continue
        if tuple(part.shape) != tuple(target.shape):
            raise ValueError(f"{name}: localized to {tuple(part.shape)} but this rank holds {tuple(target.shape)}")
        target.data.copy_(part)
        received.add(name)
    missing_params = sorted(n for n in params if n not in received)
    if missing_params:
        raise ValueError(f"the model file provides no {missing_params[:5]}{' ...' if len(missing_params) > 5 else ''}")
    return sorted(n for n in local if n not in received)


_SAME = object()


@torch.no_grad()
def broadcast_replicas(model: nn.Module, *, group: Any, expert_group: Any = _SAME, src: int = 0,
                       method: str = "broadcast", is_expert: Callable[[str], bool] | None = None) -> int:
    """Make every replica equal to group rank ``src``'s model (an initialised model, no file).

    Non-expert tensors go over ``group`` (all ranks holding them: DP x EP of a pipeline stage;
    None is the whole world); expert tensors over ``expert_group`` (ranks holding the same experts:
    DP), from its rank ``src``: it defaults to ``group`` (no expert parallelism), and None means
    each rank holds its experts alone (DP = 1), so they stay. Every rank calls this with the same
    model structure. Returns the number of tensors sent."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    is_expert = is_expert or (lambda n: is_expert_weight(n, with_ids=True))
    group = world_if_none(group)  # None: the whole world
    dev = _comm_device(model, group)
    count = 0
    for name, t in model.state_dict(keep_vars=True).items():
        g = group
        if is_expert(name) and expert_group is not _SAME:
            if expert_group is None:
                continue  # one rank per expert shard: nothing to agree on
            g = expert_group
        buf = t.detach().to(dev).contiguous()
        _transport(buf, is_src=group_rank(g) == src, src_global=global_rank(g, src), group=g, method=method)
        t.data.copy_(buf)
        count += 1
    return count


def state_digest(model: nn.Module) -> list[tuple[str, str]]:
    """(name, sha256 of the raw bytes) per state-dict entry: equal digests mean bit-identical weights."""
    import hashlib

    out = []
    for name, t in model.state_dict().items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out.append((name, hashlib.sha256(raw.numpy().tobytes()).hexdigest()))
    return out


@torch.no_grad()
def load_and_broadcast_local(model: nn.Module, path: str) -> None:
    """One process: load the file's weights into ``model`` (the same reading rules as the broadcast)."""
    sd = merge_v4_expert_keys(read_state_dict(path))
    local = model.state_dict(keep_vars=True)
    missing = [n for n, _ in model.named_parameters() if n not in sd]
    if missing:
        raise ValueError(f"the model file provides no {missing[:5]}")
    for name, t in sd.items():
        if name in local:
            local[name].data.copy_(t)

"""Expert sharding: which experts a rank holds, and moving state dicts between full and EP-sharded.

An expert-parallel block holds experts ``[r*NR, (r+1)*NR)`` on EP rank r and records their global
ids in the buffer ``experts.expert_ids``. A full state dict is exactly Hugging Face's (v5 merged
``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``; v4 per-expert keys are
accepted as input); a shard holds ``[NR, ...]`` slices plus ``experts.expert_ids``.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..integrations.v4_keys import merge_v4_expert_keys
from .groups import group_rank, group_size, world_if_none

#: The merged expert weights of an experts module (``[E, ...]`` full, ``[NR, ...]`` on a shard).
EXPERT_PARAM_NAMES = ("gate_up_proj", "down_proj")
#: Every per-expert tensor name of transformers' experts modules (``[E, ...]``, the expert axis
#: first): the merged weights, ``up_proj`` of families without a gate, and the biases some have.
EXPERT_TENSOR_NAMES = EXPERT_PARAM_NAMES + ("up_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
#: The buffer of an expert-parallel shard's experts module holding its experts' global ids.
EXPERT_IDS_NAME = "expert_ids"


def is_expert_weight(name: str, *, with_ids: bool = False) -> bool:
    """True for the per-expert tensors ``[...].experts.<name>`` (:data:`EXPERT_TENSOR_NAMES`: the merged
    ``gate_up_proj`` / ``down_proj``, and the ``up_proj`` and biases some transformers families have)
    of a parameter or state-dict name (the tensors expert parallelism shards); ``with_ids``: also the
    shard's ``experts.expert_ids`` buffer."""
    module, _, leaf = name.rpartition(".")
    if module != "experts" and not module.endswith(".experts"):
        return False
    return leaf in EXPERT_TENSOR_NAMES or (with_ids and leaf == EXPERT_IDS_NAME)


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global expert ids EP rank ``ep_rank`` holds."""
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}: "
            f"every EP rank must hold the same number of experts (choose an EP size dividing {num_experts})"
        )
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def expected_remote_rows(tokens_per_rank: int, num_experts: int, top_k: int, ep_size: int) -> float:
    """Expected RO (= expected RI by symmetry) when each token picks K distinct experts uniformly
    at random: a given remote rank is hit unless all K picks avoid its NR experts."""
    NR = len(expert_range(num_experts, ep_size, 0))
    miss = math.comb(num_experts - NR, top_k) / math.comb(num_experts, top_k)
    return tokens_per_rank * (ep_size - 1) * (1.0 - miss)


def slice_full_experts(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs):
    """``load_state_dict`` pre-hook of an expert-parallel shard's experts module: cut a full
    (all-expert) state dict to this shard's experts, and refuse a shard saved for other experts."""
    ids_key = prefix + EXPERT_IDS_NAME
    mine = module.expert_ids
    if ids_key in state_dict:
        theirs = state_dict[ids_key]
        if theirs.shape != mine.shape or not torch.equal(theirs.cpu(), mine.cpu()):
            error_msgs.append(
                f"{prefix}: the state dict holds experts {theirs.tolist()} but this expert-parallel shard holds "
                f"{mine.tolist()}; gather a full state dict (gather_full_state_dict) and load that instead"
            )
        return
    total = module.global_num_experts
    full = [prefix + n for n in EXPERT_PARAM_NAMES if prefix + n in state_dict]
    if full and all(state_dict[k].shape[0] == total for k in full) and total != module.num_experts:
        index = mine.to(device=state_dict[full[0]].device)
        for k in full:
            state_dict[k] = state_dict[k].index_select(0, index)
        state_dict[ids_key] = mine.clone()


def _expert_prefixes(keys) -> list[str]:
    """``"...experts."`` prefixes that have both merged expert tensors."""
    prefixes = []
    for key in keys:
        if key.endswith("experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")]
            if prefix + "down_proj" in keys:
                prefixes.append(prefix)
    return prefixes


def shard_state_dict(full: Mapping[str, torch.Tensor], ep_rank: int, ep_size: int) -> dict[str, torch.Tensor]:
    """Slice a full (Hugging Face) state dict into EP rank ``ep_rank``'s shard, without communicating.

    Every block's expert tensors are cut to the rank's experts and ``experts.expert_ids`` is
    added; all other entries (router, attention, norms, ...) are kept whole.
    """
    merged = merge_v4_expert_keys(full)
    out = dict(merged)
    for prefix in _expert_prefixes(merged):
        num_experts = merged[prefix + "gate_up_proj"].shape[0]
        ids = expert_range(num_experts, ep_size, ep_rank)
        for name in EXPERT_PARAM_NAMES:
            out[prefix + name] = merged[prefix + name][ids.start:ids.stop].clone()
        out[prefix + EXPERT_IDS_NAME] = torch.arange(ids.start, ids.stop, dtype=torch.int64)
    return out


def _sharded_prefixes(module: nn.Module) -> list[str]:
    return [name + "." for name, m in module.named_modules() if hasattr(m, EXPERT_IDS_NAME) and name]


def gather_full_state_dict(
    module: nn.Module, ep_group: dist.ProcessGroup | None, dst: int = 0
) -> dict[str, torch.Tensor] | None:
    """Collect the full Hugging Face state dict of an expert-parallel ``module`` on EP rank ``dst``.

    Call on every rank of ``ep_group``. Expert tensors are gathered and placed by their recorded
    global ids; ``expert_ids`` entries are dropped; everything else is this rank's (replicated)
    copy. Returns the dict on ``dst`` and None elsewhere. Tensors come back on the CPU.
    """
    ep_group = world_if_none(ep_group)  # None: the default group, as in torch.distributed's calls
    local = module.state_dict()
    world = group_size(ep_group)
    me = group_rank(ep_group)
    dst_global = dist.get_global_rank(ep_group, dst)
    prefixes = _sharded_prefixes(module)
    out: dict[str, torch.Tensor] | None = {} if me == dst else None
    expert_keys = {p + n for p in prefixes for n in (*EXPERT_PARAM_NAMES, EXPERT_IDS_NAME)}
    for prefix in prefixes:
        ids = local[prefix + EXPERT_IDS_NAME]
        all_ids = [torch.empty_like(ids) for _ in range(world)] if me == dst else None
        dist.gather(ids, all_ids, dst=dst_global, group=ep_group)
        for name in EXPERT_PARAM_NAMES:
            shard = local[prefix + name].detach().contiguous()
            parts = [torch.empty_like(shard) for _ in range(world)] if me == dst else None
            dist.gather(shard, parts, dst=dst_global, group=ep_group)
            if out is not None:
                order = torch.cat(all_ids).cpu()
                full = torch.cat(parts).cpu()
                if sorted(order.tolist()) != list(range(order.numel())):
                    raise ValueError(f"{prefix}: the EP shards hold expert ids {order.tolist()}, not each expert once")
                placed = torch.empty_like(full)
                placed[order] = full
                out[prefix + name] = placed
    if out is not None:
        for key, value in local.items():
            if key not in expert_keys:
                out[key] = value.detach().cpu()
    return out


def scatter_full_state_dict(
    module: nn.Module,
    full: Mapping[str, torch.Tensor] | None,
    ep_group: dist.ProcessGroup | None,
    src: int = 0,
) -> dict[str, torch.Tensor]:
    """Send a full (Hugging Face) state dict held by EP rank ``src`` out as every rank's shard.

    Call on every rank of ``ep_group``; only ``src`` passes ``full``. Returns this rank's shard,
    ready for ``module.load_state_dict``: expert tensors are scattered by the experts each rank's
    module holds, everything else is broadcast from ``src``.
    """
    ep_group = world_if_none(ep_group)  # None: the default group, as in torch.distributed's calls
    me = group_rank(ep_group)
    if me == src and full is None:
        raise ValueError("scatter_full_state_dict: the source rank must pass the full state dict")
    world = group_size(ep_group)
    src_global = dist.get_global_rank(ep_group, src)
    local = module.state_dict()
    prefixes = _sharded_prefixes(module)
    expert_keys = {p + n for p in prefixes for n in (*EXPERT_PARAM_NAMES, EXPERT_IDS_NAME)}
    merged = None
    problem = ""
    if me == src:
        merged = merge_v4_expert_keys(full)
        problem = _check_full_against(merged, local, prefixes, expert_keys)
    # The source's verdict is shared before any payload moves, so a bad dict stops every rank.
    device = next(iter(local.values())).device if local else torch.device("cpu")
    verdict = torch.tensor([1 if problem else 0], dtype=torch.int64, device=device)
    dist.broadcast(verdict, src=src_global, group=ep_group)
    if int(verdict.item()):
        raise ValueError(f"scatter_full_state_dict: {problem or f'the full state dict on EP rank {src} does not fit'}")
    out: dict[str, torch.Tensor] = {}
    for prefix in prefixes:
        ids = local[prefix + EXPERT_IDS_NAME]
        out[prefix + EXPERT_IDS_NAME] = ids.clone()
        all_ids = [torch.empty_like(ids) for _ in range(world)] if me == src else None
        dist.gather(ids, all_ids, dst=src_global, group=ep_group)
        for name in EXPERT_PARAM_NAMES:
            target = local[prefix + name]
            recv = torch.empty_like(target)
            parts = None
            if me == src:
                whole = merged[prefix + name]
                parts = [whole[i.long().cpu()].to(device=target.device, dtype=target.dtype).contiguous() for i in all_ids]
            dist.scatter(recv, parts, src=src_global, group=ep_group)
            out[prefix + name] = recv
    for key, target in local.items():
        if key in expert_keys:
            continue
        buf = torch.empty_like(target)
        if me == src:
            buf.copy_(merged[key])
        dist.broadcast(buf, src=src_global, group=ep_group)
        out[key] = buf
    return out


def _check_full_against(
    merged: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor], prefixes: list[str], expert_keys: set[str]
) -> str:
    """Empty when ``merged`` is a full state dict for a module whose shard is ``local``; else why not."""
    for key, target in local.items():
        if key.endswith("." + EXPERT_IDS_NAME) and key in expert_keys:
            continue
        if key not in merged:
            return f"the full state dict has no entry {key!r}"
        want = tuple(target.shape)
        if key in expert_keys:
            prefix = key[: key.rfind(".") + 1]
            num_experts = merged[key].shape[0]
            ids = local[prefix + EXPERT_IDS_NAME]
            if int(ids.max()) >= num_experts:
                return f"{key} holds {num_experts} experts but this module holds expert ids up to {int(ids.max())}"
            want = (num_experts, *want[1:])
        if tuple(merged[key].shape) != want:
            return f"{key} has shape {tuple(merged[key].shape)}, expected {want}"
    return ""

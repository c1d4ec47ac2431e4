"""Expert parallelism on real processes (gloo, world 2 and 4) against the single-process block.

Each world size is started once (module fixture) and runs every case in turn; the tests then read
each rank's verdict. Every case compares with the single-process block run on the EP group's
concatenated batch: outputs and input gradients row by row, router-weight gradients summed over EP
ranks, expert-weight gradients slice by slice. Unit tests of launcher detection, backend choice,
sharding and the byte formula run in this process.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import sys
import traceback
import types
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fastmoe_xpu import FastSparseMoeBlock, patch_olmoe, settings
from fastmoe_xpu.dist import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    LocalDispatcher,
    ParallelMesh,
    TokenDispatcher,
    all_to_all_autograd,
    choose_backend,
    detect_launch_env,
    expert_range,
    forward_allgather_backward_reducescatter,
    make_dispatcher,
    forward_reducescatter_backward_allgather,
    gather_full_state_dict,
    init_distributed,
    merge_v4_expert_keys,
    reduce_scatter_dim0,
    scatter_full_state_dict,
    shard_state_dict,
)
from fastmoe_xpu.dist import collectives as coll
from fastmoe_xpu.dist import env as dist_env
from fastmoe_xpu.dist.comm_bytes import (
    alltoall_remote_rows,
    count_collective_bytes,
    ep_layer_comm_bytes,
    expected_remote_rows,
    worst_case_remote_rows,
)
from fastmoe_xpu.dist.testing import run_distributed
from bench.harness.baselines import HFv4SparseMoeBlock
from tolerances import assert_close


# Odd H and I, K=3 not dividing E, E=8 split 4+4 (world 2) or 2+2+2+2 (world 4: every token spans ranks).
CFG = dict(hidden_size=12, intermediate_size=10, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
           hidden_act="silu")


def _cfg(**over) -> SimpleNamespace:
    return SimpleNamespace(**{**CFG, **over})


# ================================================================ worker side
def _group() -> dist.ProcessGroup:
    return dist.group.WORLD


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert_close(got, want, want.dtype, what)


def _reference_block(cfg, seed: int, dtype=torch.float32, favour: int | None = None, fur: bool = False,
                     precision: str | None = None, backend: str = "torch"):
    torch.manual_seed(seed)
    ref = FastSparseMoeBlock(cfg, backend=backend, forced_uniform_routing=fur, expert_precision=precision)
    ref.reset_parameters(0.3)  # outputs of order 1, so that relative errors mean something
    ref = ref.to(dtype)
    if favour is not None:  # router that sends every token to experts [0, favour) only
        with torch.no_grad():
            w = torch.full_like(ref.gate.weight, -0.5)
            w[:favour] = 0.5
            ref.gate.weight.copy_(w + 0.01 * torch.randn_like(w))
    return ref


def _inputs(sizes: list[int], H: int, seed: int, dtype, positive: bool = False):
    g = torch.Generator().manual_seed(seed + 1)
    T = sum(sizes)
    x = torch.randn(T, H, generator=g)
    if positive:
        x = x.abs() + 0.5
    return x.to(dtype), torch.randn(T, H, generator=g).to(dtype)


def _run_pair(cfg, sizes, *, dispatch, fur=False, dtype=torch.float32, favour=None, seed=0, shape3d=False,
              group=None, backend="torch", check_inputs=True, precision=None, ref_backend="torch"):
    """Single-process block (on ``ref_backend``) on the concatenated batch vs the EP block on this
    rank's rows; returns everything to compare (collectives all done before any assertion)."""
    group = group or _group()
    r = dist.get_rank(group)
    ref = _reference_block(cfg, seed, dtype, favour, fur, precision, ref_backend)
    x_full, g_full = _inputs(sizes, cfg.hidden_size, seed, dtype, positive=favour is not None)
    xr = x_full.clone().requires_grad_(True)
    out_ref = ref(xr)
    out_ref.backward(g_full)
    _, _, idx_full = ref.route(x_full)

    ep = FastSparseMoeBlock(cfg, backend=backend, forced_uniform_routing=fur, ep_group=group, dispatch=dispatch,
                            check_inputs=check_inputs, expert_precision=precision).to(dtype)
    ep.load_state_dict(ref.state_dict())  # a full HF state dict: the block keeps its slice
    lo = sum(sizes[:r])
    rows = slice(lo, lo + sizes[r])
    x_mine = x_full[rows].clone()
    if shape3d:
        x_mine = x_mine.view(2, -1, cfg.hidden_size)
    x_mine.requires_grad_(True)
    out = ep(x_mine)
    out.backward(g_full[rows].view_as(out))
    gate_grad_sum = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad_sum, group=group)
    ids = expert_range(cfg.num_experts, dist.get_world_size(group), r)
    return dict(ref=ref, ep=ep, out=out, out_ref=out_ref[rows], dx=x_mine.grad, dx_ref=xr.grad[rows],
                gate_grad_sum=gate_grad_sum, ids=ids, idx_full=idx_full)


_DISPATCHERS = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}


def _check_pair(res, cfg) -> None:
    ref, ep, ids = res["ref"], res["ep"], res["ids"]
    assert type(ep.dispatcher) is _DISPATCHERS[ep.dispatch], (type(ep.dispatcher), ep.dispatch)
    _close(res["out"].reshape(-1, cfg.hidden_size), res["out_ref"], "output rows")
    _close(res["dx"].reshape(-1, cfg.hidden_size), res["dx_ref"], "input gradient rows")
    _close(res["gate_grad_sum"], ref.gate.weight.grad, "router gradient summed over EP ranks")
    for name in ("gate_up_proj", "down_proj"):
        _close(getattr(ep.experts, name).grad, getattr(ref.experts, name).grad[ids.start:ids.stop], f"{name} gradient slice")
    assert ep.experts.gate_up_proj.shape[0] == len(ids)
    assert ep.experts.expert_ids.tolist() == list(ids)


def case_match(*, dispatch, fur=False, sizes=None, dtype=torch.float32, shape3d=False, check_inputs=True,
               precision=None, **cfg_over):
    W = dist.get_world_size()
    cfg = _cfg(**cfg_over)
    sizes = sizes(W) if callable(sizes) else (sizes or [6] * W)
    res = _run_pair(cfg, sizes, dispatch=dispatch, fur=fur, dtype=dtype, shape3d=shape3d, check_inputs=check_inputs,
                    precision=precision)
    _check_pair(res, cfg)


def case_empty_rank(*, dispatch, backend="torch"):
    """The router favours experts [0, K): ranks holding only experts >= K receive no tokens."""
    W = dist.get_world_size()
    cfg = _cfg()
    K = cfg.num_experts_per_tok
    res = _run_pair(cfg, [5] * W, dispatch=dispatch, favour=K, backend=backend)
    assert int(res["idx_full"].max()) < K, "the favouring router did not concentrate the routing"
    _check_pair(res, cfg)
    ids = res["ids"]
    if ids.start >= K:  # this rank got no token: its expert gradients are exactly zero
        for name in ("gate_up_proj", "down_proj"):
            assert torch.count_nonzero(getattr(res["ep"].experts, name).grad) == 0
    return ids.start >= K


def case_triton(*, dispatch, precision=None):
    """The Triton base under EP against the torch base in one process; with a quantized precision,
    against the Triton base in one process (the same GEMMs: only the split over ranks differs)."""
    cfg = _cfg()
    W = dist.get_world_size()
    res = _run_pair(cfg, [6] * W, dispatch=dispatch, backend="triton", precision=precision,
                    ref_backend="triton" if precision else "torch")
    _check_pair(res, cfg)


def _expect_error(fn, exc_type, fragment: str) -> str:
    try:
        fn()
    except exc_type as err:
        if fragment not in str(err):
            raise AssertionError(f"error message lacks {fragment!r}: {err}") from err
        return f"{type(err).__name__}: {err}"
    raise AssertionError(f"no {exc_type.__name__} raised")


def case_bad_divisibility():
    W = dist.get_world_size()
    cfg = _cfg(num_experts=W * 2 + 1)  # 5 experts over 2 ranks, 9 over 4
    return _expect_error(lambda: FastSparseMoeBlock(cfg, ep_group=_group()), ValueError, "not divisible")


def case_bad_mismatched_sizes():
    """allgather needs equal token counts: rank r brings 4 + r tokens."""
    r = dist.get_rank()
    block = FastSparseMoeBlock(_cfg(), ep_group=_group(), dispatch="allgather")
    x = torch.randn(4 + r, CFG["hidden_size"])
    return _expect_error(lambda: block(x), ValueError, "same number of tokens")


def case_bad_input_one_rank(*, dispatch):
    """Only rank 0's input is malformed; every rank must raise, none may wait."""
    r = dist.get_rank()
    block = FastSparseMoeBlock(_cfg(), ep_group=_group(), dispatch=dispatch)
    H = CFG["hidden_size"]
    x = torch.randn(5, H + 1 if r == 0 else H)
    if r == 0:
        return _expect_error(lambda: block(x), ValueError, "hidden_size")
    return _expect_error(lambda: block(x), ValueError, "rank(s) rejected their input: rank 0")


def case_bad_device_for_group():
    """A gloo group cannot run collectives on meta tensors: every rank raises before communicating."""
    with torch.device("meta"):
        block = FastSparseMoeBlock(_cfg(), ep_group=_group())
        x = torch.empty(5, CFG["hidden_size"])
    return _expect_error(lambda: block(x), ValueError, "runs collectives on")


def case_bad_not_member():
    g = dist.new_group([0])  # collective: every rank creates it, only rank 0 belongs
    if dist.get_rank() == 0:
        block = FastSparseMoeBlock(_cfg(), ep_group=g)
        assert block.ep_size == 1 and block.experts.gate_up_proj.shape[0] == CFG["num_experts"]
        return "member"
    return _expect_error(lambda: FastSparseMoeBlock(_cfg(), ep_group=g), ValueError, "not a member")


def case_local_dispatcher():
    """A group of one rank picks the LocalDispatcher: bit for bit the block without a group (outputs
    and every gradient), the forward being the same check -> route -> dispatch -> experts -> combine."""
    r = dist.get_rank()
    singles = [dist.new_group([q]) for q in range(dist.get_world_size())]  # collective: every rank creates all
    cfg = _cfg()
    plain = _reference_block(cfg, 4)
    alone = FastSparseMoeBlock(cfg, backend="torch", ep_group=singles[r])
    alone.load_state_dict({**plain.state_dict(), "experts.expert_ids": torch.arange(cfg.num_experts)})
    assert type(plain.dispatcher) is LocalDispatcher and type(alone.dispatcher) is LocalDispatcher
    x, g = _inputs([7], cfg.hidden_size, 4 + r, torch.float32)
    got, want = [], []
    for block, out in ((alone, got), (plain, want)):
        xr = x.clone().requires_grad_(True)
        y = block(xr)
        y.backward(g)
        out.extend([y.detach(), xr.grad, *(p.grad for p in block.parameters())])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def case_bad_experts_implementation():
    """transformers' per-expert loop needs every expert here: an EP block refuses it on every rank."""
    block = FastSparseMoeBlock(_cfg(), ep_group=_group())
    block.experts.config = SimpleNamespace(_experts_implementation="eager")
    x = torch.randn(4, CFG["hidden_size"])
    return _expect_error(lambda: block(x), ValueError, "cannot run on a FastSparseMoeBlock sharded")


def case_bad_shard_for_other_rank():
    W, r = dist.get_world_size(), dist.get_rank()
    ref = _reference_block(_cfg(), 0)
    other = shard_state_dict(ref.state_dict(), (r + 1) % W, W)
    block = FastSparseMoeBlock(_cfg(), ep_group=_group())
    return _expect_error(lambda: block.load_state_dict(other), RuntimeError, "shard holds")


def case_state_dicts():
    W, r = dist.get_world_size(), dist.get_rank()
    cfg = _cfg()
    ref = _reference_block(cfg, 3)
    full = ref.state_dict()
    # A full state dict loaded on every rank: kept sliced, then gathered back whole on rank 0.
    ep = FastSparseMoeBlock(cfg, ep_group=_group())
    ep.load_state_dict(full)
    gathered = gather_full_state_dict(ep, _group(), dst=0)
    # Scattered from rank 0 into a fresh block.
    fresh = FastSparseMoeBlock(cfg, ep_group=_group())
    shard = scatter_full_state_dict(fresh, full if r == 0 else None, _group(), src=0)
    fresh.load_state_dict(shard)
    ids = expert_range(cfg.num_experts, W, r)
    if r == 0:
        assert sorted(gathered) == sorted(full), (sorted(gathered), sorted(full))
        for k in full:
            assert torch.equal(gathered[k], full[k]), k
    else:
        assert gathered is None
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(fresh.experts, name), full[f"experts.{name}"][ids.start:ids.stop])
    assert torch.equal(fresh.gate.weight, full["gate.weight"])
    # transformers-v4 keys shard to the same slices.
    v4 = HFv4SparseMoeBlock(cfg).load_merged(full["gate.weight"], full["experts.gate_up_proj"], full["experts.down_proj"])
    local = shard_state_dict(v4.state_dict(), r, W)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(local[f"experts.{name}"], full[f"experts.{name}"][ids.start:ids.stop])
    assert local["experts.expert_ids"].tolist() == list(ids)
    # A full v4 dict loads straight into an EP block too.
    ep_v4 = FastSparseMoeBlock(cfg, ep_group=_group())
    ep_v4.load_state_dict(v4.state_dict())
    assert torch.equal(ep_v4.experts.down_proj, full["experts.down_proj"][ids.start:ids.stop])


def case_from_hf():
    """transformers' OlmoeSparseMoeBlock -> EP block (own experts only), via from_hf and patch_olmoe."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    W, r = dist.get_world_size(), dist.get_rank()
    hf_cfg = OlmoeConfig(hidden_size=CFG["hidden_size"], intermediate_size=CFG["intermediate_size"],
                         num_experts=CFG["num_experts"], num_experts_per_tok=CFG["num_experts_per_tok"],
                         norm_topk_prob=False)
    torch.manual_seed(5)
    hf = OlmoeSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    S = 4
    x_full = torch.randn(1, W * S, CFG["hidden_size"])
    want = hf(x_full)
    want = want[0] if isinstance(want, tuple) else want
    ep = FastSparseMoeBlock.from_hf(hf, ep_group=_group(), dispatch="alltoall")
    ids = expert_range(CFG["num_experts"], W, r)
    assert torch.equal(ep.experts.gate_up_proj, hf.experts.gate_up_proj[ids.start:ids.stop])
    got = ep(x_full[:, r * S:(r + 1) * S])
    _close(got, want[:, r * S:(r + 1) * S], "from_hf output rows")
    holder = torch.nn.ModuleDict({"mlp": hf})
    assert patch_olmoe(holder, ep_group=_group()) == 1
    assert holder["mlp"].experts.down_proj.shape == (len(ids), CFG["hidden_size"], CFG["intermediate_size"])
    _close(holder["mlp"](x_full[:, r * S:(r + 1) * S]), want[:, r * S:(r + 1) * S], "patch_olmoe output rows")


def case_collectives():
    W, r = dist.get_world_size(), dist.get_rank()
    g = _group()
    # all-gather forward, reduce-scatter backward: d/dx_r of sum_q <c_q, AG(x)> = sum_q c_q[rows r].
    x = torch.full((2, 3), float(r + 1), requires_grad=True)
    y = forward_allgather_backward_reducescatter(x, g)
    assert torch.equal(y[:, 0], torch.arange(1, W + 1, dtype=torch.float32).repeat_interleave(2))
    c = torch.arange(W * 6, dtype=torch.float32).view(W * 2, 3) * (r + 1)
    (y * c).sum().backward()
    want = torch.arange(W * 6, dtype=torch.float32).view(W * 2, 3)[2 * r:2 * r + 2] * sum(range(1, W + 1))
    assert torch.equal(x.grad, want)
    # reduce-scatter forward, all-gather backward.
    z = torch.arange(W * 4, dtype=torch.float32).view(W * 2, 2).mul(r + 1).requires_grad_(True)
    s = forward_reducescatter_backward_allgather(z, g)
    assert torch.equal(s, torch.arange(W * 4, dtype=torch.float32).view(W * 2, 2)[2 * r:2 * r + 2] * sum(range(1, W + 1)))
    (s * (r + 1)).sum().backward()
    assert torch.equal(z.grad, torch.arange(1, W + 1, dtype=torch.float32).repeat_interleave(2)[:, None].expand(W * 2, 2))
    # The all_reduce fallback gives the real reduce-scatter's numbers.
    real = reduce_scatter_dim0(z.detach(), g)
    coll._REDUCE_SCATTER_FALLBACK.add(str(dist.get_backend(g)))
    try:
        fallback = reduce_scatter_dim0(z.detach(), g)
    finally:
        coll._REDUCE_SCATTER_FALLBACK.clear()
    assert torch.equal(real, fallback)
    # Uneven all-to-all with empty splits: rank r sends (q + r) % 3 rows to rank q.
    send = [(q + r) % 3 for q in range(W)]
    recv = [(r + q) % 3 for q in range(W)]
    a = torch.arange(sum(send), dtype=torch.float32)[:, None].add(100 * r).repeat(1, 2).requires_grad_(True)
    b = all_to_all_autograd(a, recv, send, g)
    assert b.shape[0] == sum(recv)
    offs = [sum(recv[:q]) for q in range(W)]
    for q in range(W):
        first_row_at_q = sum((p + q) % 3 for p in range(r))  # rows rank q sent to ranks before me
        want_rows = torch.arange(first_row_at_q, first_row_at_q + recv[q], dtype=torch.float32) + 100 * q
        assert torch.equal(b[offs[q]:offs[q] + recv[q], 0], want_rows)
    (b * (r + 1)).sum().backward()
    want_grad = torch.tensor([float(q + 1) for q in range(W) for _ in range(send[q])])[:, None].expand(-1, 2)
    assert torch.equal(a.grad, want_grad)


def case_byte_counts(*, dispatch, fur, check_inputs=True):
    """Counted bytes of one layer's forward and backward equal the formula, on every rank."""
    W, r = dist.get_world_size(), dist.get_rank()
    cfg = _cfg()
    S = 6
    ref = _reference_block(cfg, 0, fur=fur)
    x_full, g_full = _inputs([S] * W, cfg.hidden_size, 0, torch.float32)
    _, _, idx_full = ref.route(x_full)
    ep = FastSparseMoeBlock(cfg, forced_uniform_routing=fur, ep_group=_group(), dispatch=dispatch,
                            check_inputs=check_inputs)
    ep.load_state_dict(ref.state_dict())
    x = x_full[r * S:(r + 1) * S].clone().requires_grad_(True)
    with count_collective_bytes() as counter:
        out = ep(x)
        fwd = counter.snapshot()
        out.backward(g_full[r * S:(r + 1) * S])
        total = counter.snapshot()
    rows = alltoall_remote_rows(list(idx_full.split(S)), cfg.num_experts)[r]
    want = ep_layer_comm_bytes(dispatch, hidden=cfg.hidden_size, num_experts=cfg.num_experts,
                               top_k=cfg.num_experts_per_tok, tokens_per_rank=S, ep_size=W, act_bytes=4,
                               rows_sent=rows[0], rows_recv=rows[1], check_inputs=check_inputs)
    got = (fwd[0], fwd[1], total[0] - fwd[0], total[1] - fwd[1])
    assert got == (want.forward_sent, want.forward_recv, want.backward_sent, want.backward_recv), (got, want, counter.calls)
    return got


def case_mesh():
    W = dist.get_world_size()
    layouts = [(1, 2, W // 2), (W // 2, 1, 2), (2, W // 2, 1)] if W == 4 else [(1, 1, 2), (2, 1, 1), (1, 2, 1)]
    seen = []
    for use_dm in (True, False):
        for pp, dp, ep in layouts:
            m = ParallelMesh(pp, dp, ep, device_type="cpu", use_device_mesh=use_dm)
            assert m.built_with == ("device_mesh" if use_dm else "new_group"), m.built_with
            assert m.global_rank(m.pp_rank, m.dp_rank, m.ep_rank) == dist.get_rank()
            for dim in ("pp", "dp", "ep", "dp_ep"):
                g = m.group(dim)
                assert dist.get_process_group_ranks(g) == m.ranks(dim), (dim, m)
                t = torch.tensor([dist.get_rank()])
                dist.all_reduce(t, group=g)
                assert int(t) == sum(m.ranks(dim)), (dim, m)
            seen.append(repr(m))
    return seen


def case_dp_ep():
    """DP x EP on world 4 (dp=2, ep=2): each DP replica's EP pair matches the single-process block on
    that replica's batch, with expert slices taken by EP rank."""
    m = ParallelMesh(1, 2, 2, device_type="cpu")
    cfg = _cfg()
    sizes = [5, 5]
    res = _run_pair(cfg, sizes, dispatch="allgather", seed=10 + m.dp_rank, group=m.ep_group)
    _check_pair(res, cfg)


def case_launch_env():
    info = detect_launch_env()
    assert (info.rank, info.world_size, info.launcher) == (dist.get_rank(), dist.get_world_size(), "torchrun")
    again, device = init_distributed()  # idempotent
    assert again == info and device.type == "cpu"
    assert str(dist.get_backend()) == "gloo"


#: name -> (function, kwargs, worlds it runs on). One comment per row: the edge case it covers.
CASES = {
    # allgather, router routing, 3-D input [2, 3, H] per rank
    "allgather": (case_match, dict(dispatch="allgather", shape3d=True), (2, 4)),
    # allgather with forced uniform routing: pattern offset by each rank's place in the batch
    "allgather-fur": (case_match, dict(dispatch="allgather", fur=True, norm_topk_prob=False), (2, 4)),
    # allgather without the per-forward input agreement (no host read at all)
    "allgather-unchecked": (case_match, dict(dispatch="allgather", check_inputs=False), (2,)),
    # all-to-all, router routing
    "alltoall": (case_match, dict(dispatch="alltoall", shape3d=True), (2, 4)),
    # quantized expert GEMMs: the EP block equals the single-process block of the same precision
    "int8-allgather": (case_match, dict(dispatch="allgather", precision="int8"), (2,)),
    "int8-alltoall": (case_match, dict(dispatch="alltoall", precision="int8", sizes=lambda W: [7, 4][:W]), (2,)),
    "fp8-alltoall": (case_match, dict(dispatch="alltoall", precision="fp8"), (2,)),
    # all-to-all with forced uniform routing
    "alltoall-fur": (case_match, dict(dispatch="alltoall", fur=True, norm_topk_prob=False), (2, 4)),
    # all-to-all with a different token count on every rank (3, 5, 7, 9)
    "alltoall-uneven": (case_match, dict(dispatch="alltoall", sizes=lambda W: [3 + 2 * r for r in range(W)]), (2, 4)),
    # ... and forced routing whose offsets follow the uneven counts
    "alltoall-uneven-fur": (case_match, dict(dispatch="alltoall", fur=True, sizes=lambda W: [3 + 2 * r for r in range(W)]), (2, 4)),
    # all-to-all where the last rank brings no tokens at all
    "alltoall-rank-without-tokens": (case_match, dict(dispatch="alltoall", sizes=lambda W: [4] * (W - 1) + [0]), (2, 4)),
    # K = 1 and every rank holding a single expert's worth (E = W)
    "allgather-k1": (case_match, dict(dispatch="allgather", num_experts_per_tok=1, num_experts=4), (2, 4)),
    # K = E: every token on every rank
    "alltoall-k-equals-e": (case_match, dict(dispatch="alltoall", num_experts_per_tok=4, num_experts=4), (2, 4)),
    # bf16 through both dispatches (weights packed with tokens in the activation dtype)
    "allgather-bf16": (case_match, dict(dispatch="allgather", dtype=torch.bfloat16), (2,)),
    "alltoall-bf16": (case_match, dict(dispatch="alltoall", dtype=torch.bfloat16), (2,)),
    # ranks whose experts receive no token (router favours experts [0, K))
    "allgather-empty-rank": (case_empty_rank, dict(dispatch="allgather"), (2, 4)),
    "alltoall-empty-rank": (case_empty_rank, dict(dispatch="alltoall"), (2, 4)),
    # num_experts not divisible by the EP size
    "bad-divisibility": (case_bad_divisibility, {}, (2, 4)),
    # allgather with different token counts per rank
    "bad-mismatched-sizes": (case_bad_mismatched_sizes, {}, (2, 4)),
    # a malformed input on one rank only, both dispatch modes
    "bad-input-one-rank-allgather": (case_bad_input_one_rank, dict(dispatch="allgather"), (2, 4)),
    "bad-input-one-rank-alltoall": (case_bad_input_one_rank, dict(dispatch="alltoall"), (2, 4)),
    # a group whose backend cannot handle the block's device
    "bad-device-for-group": (case_bad_device_for_group, {}, (2,)),
    # a group this process is not part of
    "bad-not-member": (case_bad_not_member, {}, (2,)),
    # a group of one rank: the local dispatcher, identical to no group
    "local-dispatcher": (case_local_dispatcher, {}, (2,)),
    # another experts implementation on an EP block
    "bad-experts-implementation": (case_bad_experts_implementation, {}, (2,)),
    # loading another rank's shard
    "bad-shard-for-other-rank": (case_bad_shard_for_other_rank, {}, (2,)),
    # full <-> sharded state dicts (gather, scatter, local slicing, v4 keys)
    "state-dicts": (case_state_dicts, {}, (2, 4)),
    # from transformers' block and patch_olmoe
    "from-hf": (case_from_hf, {}, (2,)),
    # the collectives' forward and backward, reduce-scatter fallback, uneven/empty all-to-all
    "collectives": (case_collectives, {}, (2, 4)),
    # bytes counted on the wire == formula
    "bytes-allgather": (case_byte_counts, dict(dispatch="allgather", fur=False), (2, 4)),
    "bytes-allgather-unchecked": (case_byte_counts, dict(dispatch="allgather", fur=False, check_inputs=False), (2,)),
    "bytes-alltoall": (case_byte_counts, dict(dispatch="alltoall", fur=False), (2, 4)),
    "bytes-alltoall-fur": (case_byte_counts, dict(dispatch="alltoall", fur=True), (2, 4)),
    # PP x DP x EP groups, via DeviceMesh and via new_group
    "mesh": (case_mesh, {}, (2, 4)),
    # EP inside DP replicas
    "dp-ep": (case_dp_ep, {}, (4,)),
    # torchrun variables read by init_distributed in real processes
    "launch-env": (case_launch_env, {}, (2,)),
}
TRITON_CASES = {
    # Triton kernels under the interpreter, both dispatch modes
    "triton-allgather": (case_triton, dict(dispatch="allgather"), (2,)),
    "triton-alltoall": (case_triton, dict(dispatch="alltoall"), (2,)),
    # fp8 on the Triton base: its fp8 grouped GEMMs under EP (they need no torch._scaled_mm)
    "triton-fp8-alltoall": (case_triton, dict(dispatch="alltoall", precision="fp8"), (2,)),
    # block-scaled fp8 (quantized in the GEMMs' loads) under EP
    "triton-fp8-block-allgather": (case_triton, dict(dispatch="allgather", precision="fp8-block"), (2,)),
    # ... with rank 1's experts receiving no token
    "triton-allgather-empty-rank": (case_empty_rank, dict(dispatch="allgather", backend="triton"), (2,)),
}


def worker(names: list[str], table: str = "CASES") -> dict[str, tuple[bool, object]]:
    cases = globals()[table]
    out = {}
    for name in names:
        fn, kwargs, _ = cases[name]
        dist.barrier()
        try:
            out[name] = (True, fn(**kwargs))
        except Exception:
            out[name] = (False, traceback.format_exc())
    return out


# ================================================================ test side
_RESULTS: dict[tuple[str, int], object] = {}


def _not_here(name: str) -> str | None:
    """Why case ``name`` of CASES cannot run here (None: it can). The torch base's fp8 GEMMs need
    row-wise scales in ``torch._scaled_mm``, which the CPU takes from torch 2.13 on; the package
    refuses with that reason, and the Triton table's ``triton-fp8-alltoall`` runs fp8 under EP instead."""
    kw = CASES[name][1] if name in CASES else {}
    precision = kw.get("precision")
    if precision is None:
        return None
    from fastmoe_xpu.kernels.quantized import core

    return core.unsupported_reason(precision, "cpu", torch.float32)


def _results(table: str, world: int):
    key = (table, world)
    if key not in _RESULTS:
        cases = globals()[table]
        names = [n for n, (_, _, worlds) in cases.items() if world in worlds and
                 (table != "CASES" or _not_here(n) is None)]
        env = {"TRITON_INTERPRET": "1"} if table == "TRITON_CASES" else {}
        try:
            _RESULTS[key] = run_distributed(worker, world, names, table, env=env, timeout_s=600)
        except Exception as err:  # every test of this world reports the launch failure
            _RESULTS[key] = err
    return _RESULTS[key]


def _assert_case(table: str, world: int, name: str):
    per_rank = _results(table, world)
    if isinstance(per_rank, Exception):
        pytest.fail(f"world {world} did not run: {per_rank}")
    failed = {r: res[name][1] for r, res in enumerate(per_rank) if not res[name][0]}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    return [res[name][1] for res in per_rank]


_PARAMS = [(w, n) for n, (_, _, worlds) in CASES.items() for w in worlds]


@pytest.mark.parametrize("world,name", _PARAMS, ids=[f"w{w}-{n}" for w, n in _PARAMS])
def test_distributed_case(world: int, name: str) -> None:
    reason = _not_here(name)
    if reason is not None:
        pytest.skip(f"{reason} (tests/test_dist_ep.py::test_distributed_triton_interpreter[triton-fp8-alltoall] "
                    "runs fp8 under EP on the Triton base)")
    values = _assert_case("CASES", world, name)
    if name == "allgather-empty-rank" or name == "alltoall-empty-rank":
        assert any(values), "no rank was left without tokens"
    if name.startswith("bad-"):
        assert all(isinstance(v, str) for v in values)


def _triton_ops_present() -> bool:
    return importlib.util.find_spec("triton") is not None and importlib.util.find_spec(
        "fastmoe_xpu.kernels.triton") is not None


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_distributed_triton_interpreter(name: str) -> None:
    if not _triton_ops_present():
        print("skipping: fastmoe_xpu.kernels.triton (or triton) is not installed")
        pytest.skip("fastmoe_xpu.kernels.triton (or triton) is not installed")
    _assert_case("TRITON_CASES", 2, name)


# ================================================================ single-process unit tests
_LAUNCH_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
]


@pytest.mark.parametrize("env,want", [
    # torchrun
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (5, 8, 1, 4, "torchrun")),
    # Open MPI's mpirun
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2, "openmpi")),
    # Aurora's mpiexec (PALS + Cray PMI): world size from PMI_SIZE, local rank from PALS
    ({"PALS_RANKID": "13", "PALS_LOCAL_RANKID": "1", "PMI_RANK": "13", "PMI_SIZE": "24"}, (13, 24, 1, None, "pals")),
    # Intel MPI / MPICH hydra
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}, (2, 3, 2, 3, "pmi")),
    # torchrun variables win over MPI ones (torchrun launched under mpiexec)
    ({"RANK": "0", "WORLD_SIZE": "2", "PMI_RANK": "7", "PMI_SIZE": "12"}, (0, 2, None, None, "torchrun")),
    # no launcher: one process
    ({}, (0, 1, 0, 1, "none")),
])
def test_detect_launch_env(monkeypatch, env, want):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    info = detect_launch_env()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher) == want


@pytest.mark.parametrize("env,fragment", [
    # rank past the world size
    ({"RANK": "4", "WORLD_SIZE": "4"}, "need 0 <= rank < size"),
    # non-integer value
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "not an integer"),
    # local rank past the local size
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "local rank 3 of local size 2"),
])
def test_detect_launch_env_rejects(monkeypatch, env, fragment):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=fragment):
        detect_launch_env()


@pytest.mark.parametrize("device,xccl,oneccl,nccl,forced,want", [
    # CPU: gloo
    ("cpu", False, False, True, "", "gloo"),
    # CUDA: nccl
    ("cuda", False, False, True, "", "nccl"),
    # XPU with PyTorch's own XCCL
    ("xpu", True, True, True, "", "xccl"),
    # XPU without XCCL but with oneCCL bindings
    ("xpu", False, True, True, "", "ccl"),
    # the environment variable overrides everything
    ("xpu", True, True, True, "gloo", "gloo"),
    ("cpu", False, False, True, "CCL", "ccl"),
])
def test_choose_backend(monkeypatch, device, xccl, oneccl, nccl, forced, want):
    monkeypatch.setattr(dist_env, "_xccl_available", lambda: xccl)
    monkeypatch.setattr(dist_env, "_oneccl_importable", lambda: oneccl)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setenv(dist_env.BACKEND_ENV, forced)
    with settings.reloaded():
        assert choose_backend(device) == want


def test_choose_backend_errors(monkeypatch):
    monkeypatch.delenv(dist_env.BACKEND_ENV, raising=False)
    monkeypatch.setattr(dist_env, "_xccl_available", lambda: False)
    monkeypatch.setattr(dist_env, "_oneccl_importable", lambda: False)
    with settings.reloaded():
        with pytest.raises(RuntimeError, match="no communication backend for xpu"):
            choose_backend("xpu")
        monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
        with pytest.raises(RuntimeError, match="no NCCL"):
            choose_backend("cuda")


def test_oneccl_probe_imports_the_bindings(monkeypatch):
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", types.ModuleType("oneccl_bindings_for_pytorch"))
    assert dist_env._oneccl_importable()
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", None)  # import raises ImportError
    assert not dist_env._oneccl_importable()


def test_ep_group_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        FastSparseMoeBlock(_cfg(), ep_group=object())
    with pytest.raises(ValueError, match="dispatch must be one of"):
        FastSparseMoeBlock(_cfg(), dispatch="broadcast")


def test_dispatchers_share_one_interface():
    """Local, allgather and all-to-all dispatchers are TokenDispatchers with the base's signatures;
    make_dispatcher picks the local one without a group, and only the EP ones refuse another experts
    implementation."""
    for cls in (LocalDispatcher, AllGatherDispatcher, AllToAllDispatcher):
        assert issubclass(cls, TokenDispatcher)
        for method in ("prepare", "dispatch", "combine", "check_experts_implementation", "run"):
            mine = list(inspect.signature(getattr(cls, method)).parameters)
            assert mine == list(inspect.signature(getattr(TokenDispatcher, method)).parameters), (cls, method)
    for mode in ("allgather", "alltoall"):
        assert type(make_dispatcher(None, mode, 8)) is LocalDispatcher
    with pytest.raises(ValueError, match="dispatch must be one of"):
        make_dispatcher(None, "broadcast", 8)
    local = LocalDispatcher()
    assert local.check_experts_implementation("eager") is None
    x, w, idx = torch.randn(3, 4), torch.rand(3, 2), torch.randint(0, 8, (3, 2))
    assert local.prepare(x, lambda h: h.shape[0], device=x.device, need_offset=True) == 0
    moved = local.dispatch(x, w, idx)
    assert moved[0] is x and moved[1] is w and moved[2] is idx
    assert local.combine(x, moved[3]) is x
    for ep in (AllGatherDispatcher(None), AllToAllDispatcher(None, 4)):
        with pytest.raises(ValueError, match="cannot run on a FastSparseMoeBlock sharded"):
            ep.check_experts_implementation("eager")


def test_single_process_mesh():
    m = ParallelMesh()
    assert (m.pp_size, m.dp_size, m.ep_size, m.ep_group) == (1, 1, 1, None)
    with pytest.raises(ValueError, match="does not match the world size"):
        ParallelMesh(1, 1, 2)


@pytest.mark.parametrize("E,W,r,want", [
    # even split
    (8, 2, 1, range(4, 8)),
    # one expert per rank
    (12, 12, 11, range(11, 12)),
])
def test_expert_range(E, W, r, want):
    assert expert_range(E, W, r) == want


def test_expert_range_rejects():
    with pytest.raises(ValueError, match="not divisible"):
        expert_range(64, 12, 0)  # Mula-7B-A1B's 64 experts do not split over 12 ranks
    with pytest.raises(ValueError, match="ep_rank"):
        expert_range(8, 2, 2)


def test_shard_state_dict_v5_and_v4_agree():
    cfg = _cfg()
    torch.manual_seed(0)
    block = FastSparseMoeBlock(cfg, backend="torch")
    v5 = block.state_dict()
    v4 = HFv4SparseMoeBlock(cfg).load_merged(v5["gate.weight"], v5["experts.gate_up_proj"], v5["experts.down_proj"]).state_dict()
    merged = merge_v4_expert_keys(v4)
    assert set(merged) == set(v5)
    for W in (1, 2, 4, 8):
        for r in range(W):
            a, b = shard_state_dict(v5, r, W), shard_state_dict(v4, r, W)
            assert set(a) == set(b) == set(v5) | {"experts.expert_ids"}
            for k in a:
                assert torch.equal(a[k], b[k]), k
    with pytest.raises(ValueError, match="incomplete"):
        merge_v4_expert_keys({k: v for k, v in v4.items() if k != "experts.3.up_proj.weight"})


@pytest.mark.parametrize("W", [2, 4, 8])
def test_expected_remote_rows_matches_sampling(W):
    """The closed form for uniform random routing against 20k sampled tokens (E=64, K=8)."""
    E, K, S = 64, 8, 20000
    g = torch.Generator().manual_seed(W)
    idx = torch.rand(S, E, generator=g).argsort(dim=1)[:, :K]  # K distinct experts, uniform
    NR = E // W
    hit = torch.zeros(S, W, dtype=torch.bool).scatter_(1, idx // NR, True)
    sampled = float(hit[:, 1:].sum())  # tokens of rank 0 reaching remote ranks
    want = expected_remote_rows(S, E, K, W)
    assert abs(sampled - want) / want < 0.01
    assert want <= worst_case_remote_rows(S, K, W)


def test_comm_bytes_formula_shapes():
    mula = dict(hidden=2048, num_experts=64, top_k=8, tokens_per_rank=2048)
    ag2 = ep_layer_comm_bytes("allgather", ep_size=2, **mula)
    ag4 = ep_layer_comm_bytes("allgather", ep_size=4, **mula)
    # allgather traffic grows with W-1 (apart from the 16-byte check per peer).
    assert (ag4.forward_sent - 3 * 16) == 3 * (ag2.forward_sent - 16)
    # forward: x, weights, indices out and the partial output in; backward: three H- or K-wide tensors.
    assert ag2.forward_sent == 16 + 2048 * (2048 * 2 + 8 * 2 + 8 * 4) + 2048 * 2048 * 2
    assert ag2.backward_sent == 2048 * (2 * 2048 * 2 + 8 * 2)
    with pytest.raises(ValueError, match="not divisible"):
        ep_layer_comm_bytes("allgather", ep_size=12, **mula)
    with pytest.raises(ValueError, match="rows_sent"):
        ep_layer_comm_bytes("alltoall", ep_size=2, **mula)
    # All-to-all with every token staying home moves only the checks and the counts.
    home = ep_layer_comm_bytes("alltoall", ep_size=4, rows_sent=0, rows_recv=0, **mula)
    assert (home.forward_sent, home.backward_sent) == (3 * (16 + 8), 0)


def test_alltoall_remote_rows_small():
    # 2 ranks, experts 0-1 on rank 0 and 2-3 on rank 1.
    idx = [torch.tensor([[0, 1], [0, 2], [3, 2]]), torch.tensor([[2, 3], [1, 3]])]
    # rank 0 sends tokens 1 and 2 to rank 1; rank 1 sends token 1 to rank 0.
    assert alltoall_remote_rows(idx, 4) == [(2, 1), (1, 2)]

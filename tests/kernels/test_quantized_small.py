"""The one-piece int8 layer of calls no backward follows (``kernels/quantized/small.py``): the staged
int8 chain's bits, the plain-PyTorch reference's numbers, and only the calls it is meant for."""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu import frozen_expert_weights
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels.quantized import reference as qref
from fastmoe_xpu.kernels.quantized import small
from fastmoe_xpu.routing import topk_routing
from tests.tolerances import assert_close


def _case(T, H, I, E, K, seed=0, zero_token=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    if zero_token:  # a row of zeros: scale 0, codes 0
        x[T // 2] = 0
    weights, idx = topk_routing(torch.randn(T, E, generator=g), K, True)
    w_gu = torch.randn(E, 2 * I, H, generator=g) * 0.3
    w_d = torch.randn(E, H, I, generator=g) * 0.3
    return x, weights, idx, w_gu, w_d


@pytest.fixture
def taken(monkeypatch):
    """The calls the one-piece path took."""
    calls = []
    real = small.small_int8_forward

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(small, "small_int8_forward", counted)
    return calls


def _staged(monkeypatch, *args):
    """The staged int8 chain (``fastmoe::route`` + ``fastmoe::mlp_combine``) on the same call."""
    with monkeypatch.context() as m:
        m.setattr(small, "MAX_ROWS", 0)
        return moe_experts_forward(*args, backend="torch", expert_precision="int8")


# T, H, I, E, K: one token (its own path) and several, K = 1, awkward widths, experts left empty
SHAPES = [(1, 40, 24, 7, 3), (1, 64, 32, 5, 1), (2, 48, 20, 9, 2), (5, 40, 24, 7, 3), (17, 72, 40, 16, 4),
          (64, 32, 16, 8, 4)]


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_equals_the_staged_chain_and_the_reference(shape, frozen, taken, monkeypatch):
    x, weights, idx, w_gu, w_d = _case(*shape, seed=shape[0], zero_token=shape[0] > 2)
    with torch.no_grad(), (frozen_expert_weights() if frozen else torch.enable_grad()):
        for _ in range(2):  # inside frozen_expert_weights the second call runs on the remembered codes
            got = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", expert_precision="int8")
            assert taken[-1] == shape[0]
            want = _staged(monkeypatch, x, weights, idx, w_gu, w_d)
            assert torch.equal(got, want)
    assert len(taken) == 2
    # the reference: exact integer products too, its sums over K in its own order (fp32's tolerance)
    assert_close(got, qref.moe_forward_backward(x, weights, idx, w_gu, w_d, torch.zeros_like(x), "int8")[0],
                 msg="int8 one-piece layer vs the reference")


def test_a_call_with_a_backward_keeps_the_staged_chain(taken):
    x, weights, idx, w_gu, w_d = _case(5, 40, 24, 7, 3)
    xg = x.clone().requires_grad_(True)
    out = moe_experts_forward(xg, weights, idx, w_gu, w_d, backend="torch", expert_precision="int8")
    out.sum().backward()
    assert not taken and xg.grad is not None
    with torch.no_grad():
        assert torch.equal(moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", expert_precision="int8"),
                           out.detach())
    assert taken == [5]


def test_other_calls_keep_the_staged_chain(taken):
    x, weights, idx, w_gu, w_d = _case(5, 40, 24, 7, 3)
    with torch.no_grad():
        # expert parallelism: this rank holds experts [2, 7) only
        moe_experts_forward(x, weights, idx, w_gu[2:], w_d[2:], backend="torch", expert_precision="int8",
                            expert_start=2, num_local=5)
        # more routed rows than the one-piece path takes
        xb, wb, ib, gb, db = _case(small.MAX_ROWS // 3 + 1, 40, 24, 7, 3)
        moe_experts_forward(xb, wb, ib, gb, db, backend="torch", expert_precision="int8")
        # another dtype
        moe_experts_forward(x.bfloat16(), weights, idx, w_gu.bfloat16(), w_d.bfloat16(), backend="torch",
                            expert_precision="int8")
    assert not taken


def test_an_id_outside_the_experts_is_refused(taken):
    x, weights, idx, w_gu, w_d = _case(3, 40, 24, 7, 2)
    idx = idx.clone()
    idx[1, 0] = 7

    def check(ids):
        raise ValueError(f"expert id {int(ids.max())} outside [0, 7)")

    with torch.no_grad(), pytest.raises(ValueError, match="outside"):
        moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", expert_precision="int8", check_ids=check)
    assert not taken


@pytest.mark.parametrize("T", [1, 5])
def test_plan_declines_ids_outside_the_experts(T):
    """``plan`` finds an id outside ``[0, NR)`` from the ids it reads to the host for the walk (one
    token: its K ids; several: the sorted distinct ids): None for an id past the last expert and for
    a negative one, at one token and at several; in-range ids give the experts it walks."""
    _, _, idx, _, _ = _case(T, 40, 24, 7, 3)
    layout = small.plan(idx, 7)
    assert layout is not None
    assert (layout.experts == idx[0].tolist() if T == 1
            else layout.experts == sorted(set(idx.flatten().tolist())) and sum(layout.counts) == idx.numel())
    for bad in (7, 12, -1):
        wrong = idx.clone()
        wrong[T // 2, 1] = bad
        assert small.plan(wrong, 7) is None, bad

"""The loop engine's stage-4 launchers when most local experts have no rows (decode) and when all do.

The launchers visit only the experts that have rows, index those experts' weights one by one when
fewer than half have rows (one ``unbind`` otherwise) and zero the weight gradients of the empty ones
a run at a time. Every launcher is checked against autograd through the plain references at given
per-expert row counts: few experts non-empty (runs of empty ones at the start, middle and end),
exactly half, most, one expert holding every row, none at all; with the default pieces and with
8-row pieces. Buffers come back NaN-filled, so a row or gradient left unwritten fails.
"""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu import reference as ref
from fastmoe_xpu.kernels.contract import INDEX_DTYPE
from fastmoe_xpu.kernels.torch import grouped_gemm as gg
from fastmoe_xpu.kernels.torch import onednn
from tolerances import assert_close

COUNTS = [
    pytest.param([0, 0, 1, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0], id="few-nonempty-runs-everywhere"),
    pytest.param([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3], id="few-first-and-last"),
    pytest.param([0, 2, 0, 1, 0, 3, 0, 1], id="half-nonempty"),
    pytest.param([3, 1, 0, 2, 5, 1], id="most-nonempty"),
    pytest.param([0, 0, 0, 11, 0, 0, 0, 0], id="one-expert-all-rows"),
    pytest.param([0, 0, 0, 0, 0], id="all-empty"),
]


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every launcher buffer starts as NaN: what a launcher leaves unwritten shows up."""
    def full_nan(shape, like, dtype=None):
        return torch.full(tuple(shape), float("nan"), dtype=dtype or like.dtype, device=like.device)

    monkeypatch.setattr(gg, "cached_empty", full_nan)


def _problem(counts, T=5, H=12, I=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, rt = len(counts), sum(counts)
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=INDEX_DTYPE)
    inp = torch.randint(0, T, (rt,), generator=g).to(INDEX_DTYPE)
    x = torch.randn(T, H, generator=g).requires_grad_()
    wgu = (torch.randn(E, 2 * I, H, generator=g) * 0.3).requires_grad_()
    wd = (torch.randn(E, H, I, generator=g) * 0.3).requires_grad_()
    row_w = torch.rand(rt, generator=g).requires_grad_()
    dy = torch.randn(rt, H, generator=g)
    return cum, inp, x, wgu, wd, row_w, dy


# The onednn engine runs these loops on oneDNN's matmul (and its accumulate, for an expert spanning
# several pieces of the weighted down backward).
_ONEDNN_REASON = onednn.unsupported_reason("cpu", torch.float32)


@pytest.mark.parametrize("engine", ["loop", pytest.param("onednn", marks=pytest.mark.skipif(
    _ONEDNN_REASON is not None, reason=f"the onednn engine cannot run here: {_ONEDNN_REASON}"))])
@pytest.mark.parametrize("pieces", ["default", "8-row"])
@pytest.mark.parametrize("counts", COUNTS)
def test_launchers_match_reference_at_sparse_counts(monkeypatch, nan_buffers, counts, pieces, engine):
    mod = gg if engine == "loop" else onednn
    if pieces == "8-row":
        monkeypatch.setattr(gg, "piece_rows", lambda width: 8)
    cum, inp, x, wgu, wd, row_w, dy = _problem(counts)
    rt, T = sum(counts), x.shape[0]
    want_gu, want_h = ref.reference_gate_up(x, inp, cum, wgu)
    want_y = ref.reference_down(want_h, cum, wd)
    (want_y * row_w[:, None]).backward(dy)

    gu, h = mod.gate_up_fwd(x.detach(), inp, cum, wgu.detach())
    assert_close(gu, want_gu, torch.float32, "gate_up")
    assert_close(h, want_h, torch.float32, "h")
    y = mod.down_fwd(h, cum, wd.detach())
    assert_close(y, want_y, torch.float32, "down")
    y_t = mod.down_fwd(h, cum, wd.detach().transpose(1, 2).contiguous(), transposed=True)
    assert_close(y_t, want_y, torch.float32, "down, transposed storage")

    dh, dwd, d_row_w = mod.down_weighted_bwd(dy, gu, row_w.detach(), cum, wd.detach())
    assert_close(dwd, wd.grad, torch.float32, "d w_down (zero for empty experts)")
    assert_close(d_row_w, row_w.grad, torch.float32, "d row weights")
    d_gu = gg.silu_mul_bwd(gu, dh, cum)
    dx_rows, dwgu = mod.gate_up_bwd(d_gu, x.detach(), inp, cum, wgu.detach())
    assert_close(dwgu, wgu.grad, torch.float32, "d w_gate_up (zero for empty experts)")
    dx = torch.zeros(T, x.shape[1]).index_add_(0, inp.long(), dx_rows)
    assert_close(dx, x.grad, torch.float32, "d x")
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(dwd[e]) == 0 and torch.count_nonzero(dwgu[e]) == 0, e

    # The unweighted down backward, both storage orders, against autograd through reference_down.
    h_leaf = h.detach().requires_grad_()
    wd_leaf = wd.detach().requires_grad_()
    ref.reference_down(h_leaf, cum, wd_leaf).backward(dy)
    dh_u, dwd_u = mod.down_bwd(dy, h, cum, wd.detach())
    assert_close(dh_u, h_leaf.grad, torch.float32, "down_bwd dh")
    assert_close(dwd_u, wd_leaf.grad, torch.float32, "down_bwd dw")
    dh_t, dwd_t = mod.down_bwd(dy, h, cum, wd.detach().transpose(1, 2).contiguous(), transposed=True)
    assert_close(dh_t, h_leaf.grad, torch.float32, "down_bwd dh, transposed storage")
    assert_close(dwd_t, wd_leaf.grad.transpose(1, 2), torch.float32, "down_bwd dw, transposed storage")
    assert rt == gu.shape[0] == dx_rows.shape[0]


def test_rows_past_rt_are_zero_with_few_experts(nan_buffers):
    """A caller that sizes rows for the worst case (R = T*K > RT) gets zeros past RT."""
    cum, inp, x, wgu, wd, _, _ = _problem([0, 2, 0, 0, 0, 0, 1, 0])
    padded = torch.cat([inp, torch.zeros(5, dtype=INDEX_DTYPE)])
    gu, h = gg.gate_up_fwd(x.detach(), padded, cum, wgu.detach())
    y = gg.down_fwd(h, cum, wd.detach())
    assert gu.shape[0] == h.shape[0] == y.shape[0] == 8
    assert not gu[3:].any() and not h[3:].any() and not y[3:].any()
    assert_close(y[:3], ref.reference_down(ref.reference_gate_up(x, inp, cum, wgu)[1], cum, wd), torch.float32, "y")


def test_weight_views_switch_at_half_the_experts():
    """``w[e]`` per non-empty expert below half of them, one ``unbind`` from half on: either way
    ``views[e]`` is expert e's matrix."""
    w = torch.randn(8, 3, 2)
    for nonempty, indexed in (([1, 6], True), ([0, 2, 5], True), ([0, 2, 4, 6], False), (list(range(8)), False)):
        groups = [(e, 0, 1) for e in nonempty]
        views = gg._per_expert(w, groups)
        assert isinstance(views, dict) == indexed
        for e in nonempty:
            assert torch.equal(views[e], w[e]) and views[e].data_ptr() == w[e].data_ptr()


def test_empty_runs():
    assert gg._empty_runs([0, 0, 0, 2, 2, 3, 3, 3]) == [(0, 2), (3, 4), (5, 7)]
    assert gg._empty_runs([0, 1, 2]) == []
    assert gg._empty_runs([0, 0, 0]) == [(0, 2)]

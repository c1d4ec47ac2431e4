"""The torch backend's lean paths for small batches against the plain references.

Stages 2-3 take a mask-free path when every id is local, stage 5 an ``embedding_bag`` below
``_BAG_MAX_BYTES`` (the CSR product above it) and index-only backwards when every slot is local,
and the loop engine's weighted down backward a whole-rows path when RT fits one piece. Each is
compared with the reference at awkward shapes (T=1, T not a multiple of the block, K=1, empty
experts, ids outside the local range), and the gradients through the launchers' backward contract.
"""
import pytest
import torch

from fastmoe_xpu import reference as ref
from fastmoe_xpu.kernels import torch as ops
from fastmoe_xpu.kernels.torch import combine, counting, grouped_gemm
from tolerances import assert_close


def _topk(T, E, K, seed, offset=0):
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) + offset


# (T, E, K, block, expert_start, num_local, id offset): the ids are offset + [0, E)
ROUTING = [
    (1, 8, 2, 8, 0, 8, 0),  # T=1: one block
    (13, 8, 3, 8, 0, 8, 0),  # T not a multiple of the block
    (13, 8, 1, 8, 0, 8, 0),  # K=1
    (5, 64, 2, 8, 0, 64, 0),  # most experts empty
    (17, 6, 6, 4, 0, 6, 0),  # K = E
    (11, 4, 2, 3, 5, 4, 5),  # expert_start > 0, every id local
    (11, 4, 2, 1, 6, 4, 5),  # expert_start > 0, ids below the local range
    (11, 8, 3, 8, 2, 3, 0),  # ids on both sides of the local range
    (0, 4, 2, 8, 0, 4, 0),  # no tokens
]


@pytest.mark.parametrize("T,E,K,block,start,nl,offset", ROUTING)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_counts_and_indices_match_reference(T, E, K, block, start, nl, offset, dtype):
    idx = _topk(T, E, K, seed=T + E + K, offset=offset).to(dtype)
    local = T > 0 and bool(((idx >= start) & (idx < start + nl)).all())
    assert counting.all_local(idx, start, nl) == local
    got = ops.count_tokens(idx, start, nl, block)
    want = ref.reference_count_tokens(idx, start, nl, block)
    for name, a, b in zip(got._fields, got, want):
        assert a.dtype == b.dtype and a.is_contiguous(), name
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    rows = ops.build_indices(idx, got.partial_cum_token_counts, got.cum_expert_counts, start, nl, block)
    want_rows = ref.reference_build_indices(idx, want.partial_cum_token_counts, want.cum_expert_counts, start, nl, block)
    for name, a, b in zip(rows._fields, rows, want_rows):
        assert a.dtype == b.dtype and a.is_contiguous(), name
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"


def _routed(T, E, K, start, nl, offset, seed=0):
    idx = _topk(T, E, K, seed=seed, offset=offset)
    counts = ops.count_tokens(idx, start, nl, 8)
    rows = ops.build_indices(idx, counts.partial_cum_token_counts, counts.cum_expert_counts, start, nl, 8)
    return idx, counts, rows


@pytest.mark.parametrize("T,E,K,block,start,nl,offset", [c for c in ROUTING if c[0] > 0])
@pytest.mark.parametrize("bag", [True, False])
def test_combine_paths_match_reference(monkeypatch, T, E, K, block, start, nl, offset, bag):
    """The embedding_bag and the CSR product (forced with a zero size limit) against the slot sums,
    weighted and unweighted, and the index-only backwards against their definitions."""
    if not bag:
        monkeypatch.setattr(combine, "_BAG_MAX_BYTES", 0)
    H = 7
    _, counts, rows = _routed(T, E, K, start, nl, offset, seed=T)
    rt = int(counts.cum_token_counts[-1])
    g = torch.Generator().manual_seed(1)
    y = torch.randn(rt, H, generator=g)
    w = torch.rand(T, K, generator=g)
    args = (rows.output_indices, rows.selected_expert_indices, counts.cum_expert_counts)
    for weights in (w, None):
        got = ops.combine_fwd(y, weights, *args)
        assert_close(got, ref.reference_combine(y, weights, *args), torch.float32, f"combine weights={weights is not None}")
    # Backward: dy[row] = dout[t], row_w[row] = w[t, k], dweights[t, k] = d_row_w[row] (0 if not local).
    dout = torch.randn(T, H, generator=g)
    dy, row_w = ops.combine_bwd(dout, w, *args)
    d_row_w = torch.randn(rt, generator=g)
    dweights = ops.router_weights_bwd(d_row_w, w, *args)
    want_dy, want_row_w = torch.empty(rt, H), torch.empty(rt)
    want_dw = torch.zeros(T, K)
    cexp = counts.cum_expert_counts.tolist()
    for t in range(T):
        for i in range(cexp[t], cexp[t + 1]):
            r, k = int(rows.output_indices[i]), int(rows.selected_expert_indices[i])
            want_dy[r], want_row_w[r], want_dw[t, k] = dout[t], w[t, k], d_row_w[r]
    assert torch.equal(dy, want_dy) and torch.equal(row_w, want_row_w) and torch.equal(dweights, want_dw)
    assert dweights.dtype == w.dtype and row_w.dtype == torch.float32


@pytest.mark.parametrize("T,H,I,E,K", [(1, 16, 8, 8, 2), (13, 12, 6, 5, 1), (48, 64, 32, 8, 2), (9, 8, 4, 16, 3)])
@pytest.mark.parametrize("pieces", ["one", "many"])
def test_weighted_down_backward_one_piece_and_pieces_agree(monkeypatch, T, H, I, E, K, pieces):
    """The whole-rows path (RT within one piece) and the piece loop (forced with 8-row pieces)
    against autograd through ``w_r * (h_r @ w_down[e]^T)``."""
    if pieces == "many":
        monkeypatch.setattr(grouped_gemm, "piece_rows", lambda width: 8)
    idx, counts, rows = _routed(T, E, K, 0, E, 0, seed=H)
    ctok = counts.cum_token_counts
    rt = int(ctok[-1])
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(rt, 2 * I, generator=g).requires_grad_()
    wd = (torch.randn(E, H, I, generator=g) * 0.3).requires_grad_()
    row_w = torch.rand(rt, generator=g).requires_grad_()
    dy = torch.randn(rt, H, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    y = ref.reference_down(torch.nn.functional.silu(gate) * up, ctok, wd) * row_w[:, None]
    y.backward(dy)
    dh, dwd, d_row_w = ops.down_weighted_bwd(dy, gate_up.detach(), row_w.detach(), ctok, wd.detach())
    d_gate_up = ops.silu_mul_bwd(gate_up.detach(), dh, ctok)
    assert_close(d_gate_up, gate_up.grad, torch.float32, "d gate_up")
    assert_close(dwd, wd.grad, torch.float32, "d w_down (zero for empty experts)")
    assert_close(d_row_w, row_w.grad, torch.float32, "d row weights")


@pytest.mark.parametrize("engine", ["loop", "grouped_mm"])
@pytest.mark.parametrize("T,H,I,E,K,start,nl,offset", [
    (1, 16, 8, 8, 2, 0, 8, 0),  # decode-size, one token
    (13, 12, 8, 6, 1, 0, 6, 0),  # K=1, T not a multiple of 8
    (48, 64, 32, 8, 2, 0, 8, 0),  # the tiny preset
    (10, 16, 8, 12, 3, 0, 12, 0),  # empty experts
    (11, 16, 8, 8, 3, 2, 4, 0),  # expert_start > 0, ids on both sides of the local range
])
def test_layer_gradients_through_launchers(engine, T, H, I, E, K, start, nl, offset):
    """Forward and backward of stages 2-5 through the launchers' backward contract
    (the experts op fastmoe::mlp_combine) against autograd through the mask-based reference."""
    from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
    from fastmoe_xpu.kernels.grouped_mm import unsupported_reason

    if engine == "grouped_mm" and unsupported_reason("cpu", torch.float32):
        pytest.skip(unsupported_reason("cpu", torch.float32))
    g = torch.Generator().manual_seed(T * 7 + K)
    idx = _topk(T, E, K, seed=T, offset=offset)
    x = torch.randn(T, H, generator=g).requires_grad_()
    wgu = (torch.randn(nl, 2 * I, H, generator=g) * 0.3).requires_grad_()
    wd = (torch.randn(nl, H, I, generator=g) * 0.3).requires_grad_()
    w = torch.rand(T, K, generator=g).requires_grad_()
    dout = torch.randn(T, H, generator=g)
    out = moe_experts_forward(x, w, idx, wgu, wd, expert_start=start, gemm_engine=engine)
    grads = torch.autograd.grad(out, (x, wgu, wd, w), dout)
    want = ref.reference_experts_forward(x, w, idx, wgu, wd, expert_start=start)
    want_grads = torch.autograd.grad(want, (x, wgu, wd, w), dout)
    assert_close(out, want, torch.float32, "out")
    for name, a, b in zip(("x", "w_gate_up", "w_down", "weights"), grads, want_grads):
        assert_close(a, b, torch.float32, f"d {name}")


@pytest.mark.parametrize("inter", [1, 7, grouped_gemm.SHORT_ROWS - 1, grouped_gemm.SHORT_ROWS, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra_rows", [0, 3])
def test_silu_mul_bwd_both_row_lengths_match_autograd(inter, dtype, extra_rows):
    """``silu_mul_bwd`` below ``SHORT_ROWS`` columns (contiguous copies of gate and up) and from it
    on (the column slices, a piece of rows at a time) against autograd of ``silu(gate) * up`` in
    fp64; ``gate_up`` may hold rows past the ``dh`` rows (R > RT), which are not read."""
    g = torch.Generator().manual_seed(inter)
    rt = 37
    gate_up = torch.randn(rt + extra_rows, 2 * inter, generator=g).to(dtype)
    dh = torch.randn(rt, inter, generator=g).to(dtype)
    got = grouped_gemm.silu_mul_bwd(gate_up, dh)
    assert got.shape == (rt, 2 * inter) and got.dtype == dtype
    gu = gate_up[:rt].double().requires_grad_()
    gate, up = gu.chunk(2, 1)
    (torch.nn.functional.silu(gate) * up).backward(dh.double())
    assert_close(got, gu.grad.to(dtype), dtype, f"silu_mul_bwd I={inter}")


def test_all_local_answers_again_only_for_the_same_unmodified_ids():
    """``all_local`` keeps its last answer for the same ids tensor at the same version: an in-place
    change of the ids, another local range or another tensor with the same values asks again."""
    idx = torch.tensor([[0, 1], [2, 3]])
    assert counting.all_local(idx, 0, 4) and counting.all_local(idx, 0, 4)
    assert not counting.all_local(idx, 1, 4)  # another range: asked again
    assert counting.all_local(idx, 0, 4)
    idx[1, 1] = 7  # in place: the version counter moves
    assert not counting.all_local(idx, 0, 4)
    idx[1, 1] = 3
    assert counting.all_local(idx, 0, 4)
    other = idx.clone()
    other[0, 0] = -1
    assert not counting.all_local(other, 0, 4)
    # stages 2 and 3 on ids changed in place between two layer calls follow the change
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    for step in range(3):
        c = ops.count_tokens(ids, 0, 4, 2)
        r = ops.build_indices(ids, c.partial_cum_token_counts, c.cum_expert_counts, 0, 4, 2)
        want_c = ref.reference_count_tokens(ids, 0, 4, 2)
        want_r = ref.reference_build_indices(ids, want_c.partial_cum_token_counts, want_c.cum_expert_counts, 0, 4, 2)
        for got, want in zip((*c, *r), (*want_c, *want_r)):
            assert torch.equal(got, want)
        ids[2, 0] = 5 if step == 0 else 1  # an id outside the local range, then back

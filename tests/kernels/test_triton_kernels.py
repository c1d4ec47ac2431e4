"""Triton kernels of stages 2-5 under the Triton interpreter, against ``reference.py`` and the torch backend.

``@triton.jit`` (Triton's own ``tl.sum``, ``tl.cdiv``... included) chooses interpreter or compiler
when ``triton`` is first imported, so ``TRITON_INTERPRET=1`` is set here before anything imports
triton; the suite's command exports it too (docs/triton.md), which keeps this right whichever test
module pytest imports first. Shapes are tiny: the interpreter runs every program in Python.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, NR local experts,
TBS token block size, RT routed rows on this rank.
"""
from __future__ import annotations

import os

import pytest
from device_util import test_device_name

if test_device_name() != "cpu":  # these build CPU tensors for the interpreter; a GPU run compiles instead
    pytest.skip("interpreter tests on CPU tensors; on a GPU run tests/kernels/test_gemm_engines.py runs the "
                "kernels compiled on the device", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"  # before the first 'import triton' of this process

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu import FastSparseMoeBlock, reference  # noqa: E402
from fastmoe_xpu.autograd import ops  # noqa: E402
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward  # noqa: E402
from fastmoe_xpu import settings  # noqa: E402
from fastmoe_xpu.kernels import configs  # noqa: E402
from fastmoe_xpu.kernels import torch as torch_ops  # noqa: E402
from fastmoe_xpu.kernels import triton as tops  # noqa: E402
from bench.studies.audit import audit_layer  # noqa: E402
from stage4_shapes import stage4_cases  # noqa: E402
from tolerances import assert_close  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Row buffers are allocated for the worst case and rows past RT hold uninitialised memory; the
# elementwise SiLU backward runs over all of them (its contract has no row count), and numpy warns
# when such garbage overflows exp(). Those rows are never read.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

def _bf16_as_on_gpus(mp: pytest.MonkeyPatch) -> None:
    """Make the interpreter's bfloat16 arithmetic what GPUs do. It stores bf16 as raw uint16 bits
    and (1) its ``tl.dot`` multiplies those bits (triton-lang/triton#11584, "not supported yet"),
    (2) its fp32 -> bf16 cast truncates where GPUs round to nearest even, which biases every sum of
    rounded values. GPUs multiply bf16 operands exactly and accumulate in fp32, so widening the
    operands to fp32 first gives the same products; the cast rounds through PyTorch."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    mp.setattr(builder, "create_dot", lambda self, a, b, d, *rest: create_dot(self, widen(a), widen(b), d, *rest))
    mp.setattr(builder, "cast_impl", cast)


@pytest.fixture(autouse=True, scope="module")
def _clean_triton_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv("FASTMOE_TRITON_CONFIGS", raising=False)
        mp.delenv("FASTMOE_TRITON_BLOCK_PTR", raising=False)
        _bf16_as_on_gpus(mp)
        with settings.reloaded():
            yield


def make_routing(T: int, K: int, E: int, pattern: str, seed: int = 0) -> torch.Tensor:
    """``[T, K]`` int64 expert choices, distinct within a token (as top-k gives)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(T):
        if pattern == "one_expert":  # every token's first choice is expert 3
            rest = [e for e in torch.randperm(E, generator=g).tolist() if e != 3]
            rows.append([3] + rest[: K - 1])
        elif pattern == "low_half":  # experts E/2 .. E-1 receive nothing
            rows.append(torch.randperm(E // 2, generator=g)[:K].tolist())
        else:
            rows.append(torch.randperm(E, generator=g)[:K].tolist())
    return torch.tensor(rows, dtype=torch.int64).reshape(T, K)


# (T, K, E, expert_start, num_local, TBS, pattern)
ROUTING_CASES = [
    pytest.param(37, 3, 7, 0, 7, 8, "random", id="odd-T-prime-E-ragged-last-block"),
    pytest.param(5, 2, 4, 0, 4, 8, "random", id="T-below-token-block"),
    pytest.param(19, 1, 5, 0, 5, 8, "random", id="K1"),
    pytest.param(11, 5, 5, 0, 5, 8, "random", id="K-equals-E"),
    pytest.param(24, 2, 6, 0, 6, 8, "one_expert", id="all-tokens-to-one-expert"),
    pytest.param(24, 2, 8, 0, 8, 8, "low_half", id="empty-experts"),
    pytest.param(37, 3, 7, 3, 2, 8, "random", id="expert-parallel-start-3"),
    pytest.param(30, 2, 6, 4, 2, 6, "random", id="expert-parallel-last-rank-TBS6"),
    pytest.param(0, 2, 4, 0, 4, 8, "random", id="T0"),
]


def _stages_2_3(ops, idx, start, num_local, tbs):
    counts = ops.count_tokens(idx, start, num_local, tbs)
    indices = ops.build_indices(idx, counts[1], counts[3], start, num_local, tbs)
    return counts, indices


# ---------------------------------------------------------------- stages 2 and 3
@pytest.mark.parametrize(
    "start,num_local,expected",
    [
        # No expert parallelism: one rank holds experts 0..3.
        (0, 4, dict(partial=[2, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 2], cum_token=[0, 3, 6, 9, 12],
                    expert_counts=[2] * 6, cum_expert=[0, 2, 4, 6, 8, 10, 12],
                    input=[0, 1, 3, 1, 3, 5, 0, 2, 4, 2, 4, 5], output=[0, 6, 3, 1, 9, 7, 2, 4, 8, 10, 5, 11],
                    selected=[0, 1] * 6)),
        # EP=2, rank 0 (experts 0 and 1).
        (0, 2, dict(partial=[2, 1, 0, 1, 1, 1], cum_token=[0, 3, 6], expert_counts=[1, 2, 0, 2, 0, 1],
                    cum_expert=[0, 1, 3, 3, 5, 5, 6], input=[0, 1, 3, 1, 3, 5], output=[0, 3, 1, 2, 4, 5],
                    selected=[0, 0, 1, 0, 1, 0])),
        # EP=2, rank 1 (experts 2 and 3): local filtering with expert_start > 0.
        (2, 2, dict(partial=[1, 1, 1, 0, 1, 2], cum_token=[0, 3, 6], expert_counts=[1, 0, 2, 0, 2, 1],
                    cum_expert=[0, 1, 1, 3, 3, 5, 6], input=[0, 2, 4, 2, 4, 5], output=[0, 3, 1, 2, 4, 5],
                    selected=[1, 0, 1, 0, 1, 1])),
    ],
    ids=["no-EP", "EP2-rank0", "EP2-rank1"],
)
def test_algorithm_worked_example(start, num_local, expected):
    idx = torch.tensor([[0, 2], [1, 0], [3, 2], [0, 1], [2, 3], [1, 3]])
    (partial, partial_cum, expert_counts, cum_expert, cum_token), (inp, out, sel) = _stages_2_3(
        tops, idx, start, num_local, 2)
    rt = expected["cum_token"][-1]
    assert partial.tolist() == expected["partial"]
    assert partial_cum.tolist() == [0] + torch.tensor(expected["partial"]).cumsum(0).tolist()
    assert cum_token.tolist() == expected["cum_token"]
    assert expert_counts.tolist() == expected["expert_counts"]
    assert cum_expert.tolist() == expected["cum_expert"]
    assert inp[:rt].tolist() == expected["input"]
    assert out[:rt].tolist() == expected["output"]
    assert sel[:rt].tolist() == expected["selected"]


@pytest.mark.parametrize("T,K,E,start,num_local,tbs,pattern", ROUTING_CASES)
def test_counting_and_indices_match_reference(T, K, E, start, num_local, tbs, pattern):
    idx = make_routing(T, K, E, pattern)
    counts, (inp, out, sel) = _stages_2_3(tops, idx, start, num_local, tbs)
    ref_counts = reference.reference_count_tokens(idx, start, num_local, tbs)
    for name, got, want in zip(("partial", "partial_cum", "expert_counts", "cum_expert", "cum_token"),
                               counts, ref_counts):
        assert got.dtype == torch.int32, name
        assert torch.equal(got, want), name
    rt = int(counts[4][-1])
    ref_inp, ref_out, ref_sel = reference.reference_build_indices(idx, ref_counts[1], ref_counts[3], start,
                                                                  num_local, tbs)
    assert inp.shape == (T * K,)  # worst-case allocation, rows past RT unspecified
    assert torch.equal(inp[:rt], ref_inp) and torch.equal(out[:rt], ref_out) and torch.equal(sel[:rt], ref_sel)
    # Invariants: RT = local choices; rows sorted by expert then token (stable); slots round-trip.
    local = (idx >= start) & (idx < start + num_local)
    assert rt == int(local.sum()) == int(counts[3][-1])
    bounds = counts[4].tolist()
    for e in range(num_local):
        rows = inp[bounds[e]:bounds[e + 1]]
        assert torch.all(rows[1:] > rows[:-1])
        assert bool((idx[rows.long()] == start + e).any(dim=1).all())
    assert sorted(out[:rt].tolist()) == list(range(rt))
    slot_token = torch.repeat_interleave(torch.arange(T), counts[2].long())
    assert torch.equal(inp[out[:rt].long()].long(), slot_token)
    assert torch.equal(idx[slot_token, sel[:rt].long()], idx[local])


# ---------------------------------------------------------------- stage 4
MLP_CASES = stage4_cases("odd-H-I-prime-E", "T-below-block", "K1-I-above-H", "all-tokens-to-one-expert",
                         "empty-experts-zero-weight-grad", "expert-parallel-start-3", "bf16-fp32-accumulation")


@pytest.mark.parametrize("T,K,E,start,num_local,H,I,pattern,dtype", MLP_CASES)
def test_expert_mlp_matches_reference(T, K, E, start, num_local, H, I, pattern, dtype):
    torch.manual_seed(0)
    idx = make_routing(T, K, E, pattern)
    counts, (inp, out, _) = _stages_2_3(tops, idx, start, num_local, 8)
    cum_token, cum_expert = counts[4], counts[3]
    rt = int(cum_token[-1])
    x = torch.randn(T, H, dtype=dtype)
    w_gu = (torch.randn(num_local, 2 * I, H) / H ** 0.5).to(dtype)
    w_d = (torch.randn(num_local, H, I) / I ** 0.5).to(dtype)
    dy = torch.randn(T * K, H, dtype=dtype)
    row_w = torch.rand(T * K)  # fp32 routing weight of each row

    # Reference: plain ops with autograd, in fp32; the rows are weighted as in the forward.
    xr, gur, dr = (t.float().requires_grad_() for t in (x, w_gu, w_d))
    rwr = row_w[:rt].clone().requires_grad_()
    ref_gu, ref_h = reference.reference_gate_up(xr, inp, cum_token, gur)
    ref_y = reference.reference_down(ref_h, cum_token, dr)
    (ref_y * rwr[:, None]).backward(dy[:rt].float())

    gate_up, h = tops.gate_up_fwd(x, inp, cum_token, w_gu)
    y = tops.down_fwd(h, cum_token, w_d)
    assert gate_up.shape == (T * K, 2 * I) and y.shape == (T * K, H)
    assert_close(gate_up[:rt], ref_gu, dtype)
    assert_close(h[:rt], ref_h, dtype)
    assert_close(y[:rt], ref_y, dtype)

    dh, dw_d, d_row_w = tops.down_weighted_bwd(dy, gate_up, row_w, cum_token, w_d)
    d_gate_up = tops.silu_mul_bwd(gate_up, dh)
    dx_rows, dw_gu = tops.gate_up_bwd(d_gate_up, x, inp, cum_token, w_gu)
    dx = tops.combine_fwd(dx_rows, None, out, out, cum_expert)
    assert_close(dw_d, dr.grad, dtype)
    assert_close(dw_gu, gur.grad, dtype)
    assert_close(dx, xr.grad, dtype)
    assert d_row_w.dtype == torch.float32  # whatever the operands' dtype
    assert_close(d_row_w[:rt], rwr.grad, dtype)
    # The torch backend's down backward on the same inputs (h recomputed there too).
    with torch.no_grad():  # for fp32 the reference's leaves are the very tensors w_d, x, w_gu
        tdh, tdw_d, td_row_w = torch_ops.down_weighted_bwd(dy[:rt], gate_up[:rt], row_w[:rt], cum_token, w_d)
    assert_close(dh[:rt], tdh, dtype)
    assert_close(dw_d, tdw_d, dtype)
    assert_close(d_row_w[:rt], td_row_w, dtype)
    # The torch backend's SiLU*up backward on the same inputs.
    assert_close(d_gate_up[:rt], torch_ops.silu_mul_bwd(gate_up[:rt], dh[:rt]), dtype)
    if pattern == "low_half":
        assert torch.count_nonzero(dw_gu[E // 2:]) == 0 and torch.count_nonzero(dw_d[E // 2:]) == 0


@pytest.mark.parametrize("T,K,E,start,num_local,H,I,pattern,dtype", MLP_CASES + stage4_cases("K-equals-E"))
def test_down_silu_bwd_matches_reference(T, K, E, start, num_local, H, I, pattern, dtype):
    """The fused ``down_silu_bwd`` (the output gradient's rows gathered in the GEMM loads, the SiLU*up
    gradient in the router-weight pass) against autograd through the reference down GEMM in fp32, and
    against the launchers it replaces (``combine_bwd``, ``down_weighted_bwd``, ``silu_mul_bwd``)."""
    torch.manual_seed(2)
    idx = make_routing(T, K, E, pattern, seed=1)
    counts, (inp, out, sel) = _stages_2_3(tops, idx, start, num_local, 8)
    cum_token, cum_expert = counts[4], counts[3]
    rt = int(cum_token[-1])
    weights = torch.rand(T, K).to(dtype)
    dout = torch.randn(T, H, dtype=dtype)
    w_d = (torch.randn(num_local, H, I) / I ** 0.5).to(dtype)
    gate_up = torch.randn(T * K, 2 * I).to(dtype)
    # Each routed row's weight and token, from the slots.
    slot_token = torch.repeat_interleave(torch.arange(T), counts[2].long())
    rw_ref = torch.zeros(rt)
    rw_ref[out[:rt].long()] = weights[slot_token, sel[:rt].long()].float()
    assert torch.equal(inp[:rt].long()[out[:rt].long()], slot_token)

    gur = gate_up[:rt].float().requires_grad_()
    dr = w_d.float().requires_grad_()
    rwr = rw_ref.clone().requires_grad_()
    hr = torch.nn.functional.silu(gur[:, :I]) * gur[:, I:]
    ref_y = reference.reference_down(hr, cum_token, dr)
    (ref_y * rwr[:, None]).backward(dout[inp[:rt].long()].float())

    rw = tops.combine.row_weights(weights, out, sel, cum_expert, T * K)
    assert rw.dtype == torch.float32 and torch.equal(rw[:rt], rw_ref)
    d_gate_up, dw_d, d_row_w = tops.down_silu_bwd(dout, weights, out, sel, cum_expert, inp, gate_up, cum_token, w_d)
    assert d_gate_up.shape == (T * K, 2 * I) and d_gate_up.dtype == dtype and d_row_w.dtype == torch.float32
    assert dw_d.shape == w_d.shape and dw_d.dtype == dtype
    assert_close(d_gate_up[:rt], gur.grad, dtype)
    assert_close(dw_d, dr.grad, dtype)
    assert_close(d_row_w[:rt], rwr.grad, dtype)
    # The composed launchers on the same inputs.
    dy, row_w = tops.combine_bwd(dout, weights, out, sel, cum_expert)
    dh, c_dw_d, c_d_row_w = tops.down_weighted_bwd(dy, gate_up, row_w, cum_token, w_d)
    c_d_gate_up = tops.silu_mul_bwd(gate_up, dh, cum_token)
    assert_close(d_gate_up[:rt], c_d_gate_up[:rt], dtype)
    assert_close(dw_d, c_dw_d, dtype)
    assert_close(d_row_w[:rt], c_d_row_w[:rt], dtype)
    if pattern == "low_half":
        assert torch.count_nonzero(dw_d[E // 2:]) == 0


def test_down_silu_bwd_rejects_bad_inputs():
    T, H, I, NR, K = 4, 8, 6, 2, 2
    dout, weights = torch.randn(T, H), torch.rand(T, K)
    inp = torch.zeros(T * K, dtype=torch.int32)
    out = torch.arange(T * K, dtype=torch.int32)
    sel = (torch.arange(T * K) % K).to(torch.int32)
    cum_e = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    cum = torch.tensor([0, 4, 8], dtype=torch.int32)
    w_d, gate_up = torch.randn(NR, H, I), torch.randn(T * K, 2 * I)
    with pytest.raises(ValueError, match="down_silu_bwd: dout"):
        tops.down_silu_bwd(torch.randn(T, H + 1), weights, out, sel, cum_e, inp, gate_up, cum, w_d)
    with pytest.raises(ValueError, match="down_silu_bwd: dout"):
        tops.down_silu_bwd(dout, weights, out, sel, cum_e, inp, torch.randn(T * K, 2 * I + 2), cum, w_d)
    with pytest.raises(ValueError, match="cum_token_counts has 2 entries"):
        tops.down_silu_bwd(dout, weights, out, sel, cum_e, inp, gate_up, cum[:2], w_d)
    with pytest.raises(ValueError, match="row_weights"):
        tops.down_silu_bwd(dout, torch.rand(T + 1, K), out, sel, cum_e, inp, gate_up, cum, w_d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_dot_scale_writes_the_weighted_h(dtype):
    """``row_dot_scale`` (the down backward's row pass): over the RT routed rows, the router-weight
    dots ``<dh_r, h_r>`` in fp32, ``dh_r`` scaled by its weight in place, and ``hw_r = w_r * h_r``,
    the down weight gradient's B operand, rounded once to the activations' dtype; rows past RT keep
    ``dh`` as it was. I=45 crosses the interpreter's 16-wide column steps with a ragged last one."""
    torch.manual_seed(5)
    R, I, RT = 37, 45, 29
    cum = torch.tensor([0, 11, 11, RT], dtype=torch.int32)  # an empty expert in the middle
    gate_up = torch.randn(R, 2 * I).to(dtype)
    dh = torch.randn(R, I).to(dtype)
    rw = torch.rand(R)
    before = dh.clone()
    d_row, hw = tops.grouped_gemm.row_dot_scale(dh, gate_up, rw, cum)
    g, u = gate_up[:RT, :I].float(), gate_up[:RT, I:].float()
    h = torch.nn.functional.silu(g) * u
    assert d_row.dtype == torch.float32 and hw.dtype == dtype and hw.shape == (R, I)
    assert_close(d_row[:RT], (before[:RT].float() * h).sum(1), dtype)
    assert_close(dh[:RT], before[:RT].float() * rw[:RT, None], dtype)
    assert_close(hw[:RT], h * rw[:RT, None], dtype)
    assert torch.equal(dh[RT:], before[RT:])


def test_expert_ops_with_triton_kernels():
    """The stage-alone ops (grouped_linear, combine) and the fused op (mlp_combine) on the Triton
    kernels, against autograd through the mask-based reference of stages 2-5 (expert parallelism:
    only experts 2..4 of 6 are local)."""
    torch.manual_seed(1)
    T, K, E, H, I, start, NR = 23, 3, 6, 18, 10, 2, 3
    idx = make_routing(T, K, E, "random", seed=3)
    x = torch.randn(T, H, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    w_gu = torch.randn(NR, 2 * I, H, requires_grad=True)
    w_d = torch.randn(NR, H, I, requires_grad=True)
    counts, (inp, out, sel) = _stages_2_3(tops, idx, start, NR, 8)
    g = torch.randn(T, H)
    want = reference.reference_experts_forward(x, w, idx, w_gu, w_d, expert_start=start)
    ref_grads = torch.autograd.grad(want, (x, w, w_gu, w_d), g)
    # Stage by stage (the expert rows y as a tensor), and the layer's fused op (nothing but gate/up kept).
    rows = ops.route(idx, start, NR, "triton", True)
    rt = int(counts[4][-1])
    for got, want_t in zip(rows[:3], (inp, out, sel)):  # rows past RT are unspecified on Triton
        assert torch.equal(got[:rt], want_t[:rt])
    assert torch.equal(rows[3], counts[4]) and torch.equal(rows[4], counts[3])
    gate_up = ops.grouped_linear(x.index_select(0, inp[:rt].long()), w_gu, counts[4], "triton", False)
    h = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
    y = ops.grouped_linear(h.contiguous(), w_d, counts[4], "triton", False)
    staged = ops.combine(y, w, out, sel, counts[3], "triton")
    fused, _ = ops.mlp_combine(x, w_gu, w_d, w, *rows, "triton", "")
    for got in (staged, fused):
        grads = torch.autograd.grad(got, (x, w, w_gu, w_d), g)
        assert_close(got, want)
        for a, b in zip(grads, ref_grads):
            assert_close(a, b)


# ---------------------------------------------------------------- stage 5
# (T, K, E, expert_start, num_local, H, pattern)
COMBINE_CASES = [
    pytest.param(37, 3, 7, 0, 7, 33, "random", id="odd-H-all-local"),
    pytest.param(5, 1, 4, 0, 4, 16, "random", id="K1-T-below-block"),
    pytest.param(37, 3, 7, 3, 2, 20, "random", id="expert-parallel-tokens-without-slots"),
    pytest.param(11, 5, 5, 0, 5, 9, "random", id="K-equals-E"),
]


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("T,K,E,start,num_local,H,pattern", COMBINE_CASES)
def test_combine_matches_reference(T, K, E, start, num_local, H, pattern, weighted):
    torch.manual_seed(2)
    idx = make_routing(T, K, E, pattern)
    counts, (inp, out, sel) = _stages_2_3(tops, idx, start, num_local, 8)
    cum_expert = counts[3]
    rt = int(counts[4][-1])
    y = torch.randn(T * K, H)
    weights = torch.rand(T, K) if weighted else None
    got = tops.combine_fwd(y, weights, out, sel, cum_expert)
    yr = y[:rt].clone().requires_grad_()
    wr = weights.clone().requires_grad_() if weighted else None
    want = reference.reference_combine(yr, wr, out[:rt], sel[:rt], cum_expert)
    assert_close(got, want)
    if not weighted:
        return
    dout = torch.randn(T, H)
    dy, row_w = tops.combine_bwd(dout, weights, out, sel, cum_expert)
    # The router-weight gradient per row, <dout_t, y_r> (formed in down_bwd in the layer), goes to
    # [T, K] through router_weights_bwd.
    d_row_w = torch.full((T * K,), float("nan"))  # rows past RT are never read
    slot_tok = torch.repeat_interleave(torch.arange(T), (cum_expert[1:] - cum_expert[:-1]).long())
    d_row_w[out[:rt].long()] = (y[out[:rt].long()] * dout[slot_tok]).sum(1)
    dweights = tops.router_weights_bwd(d_row_w, weights, out, sel, cum_expert)
    want.backward(dout)
    w_row = torch.zeros(rt)
    w_row[out[:rt].long()] = weights[slot_tok, sel[:rt].long()]
    assert_close(dy[:rt] * w_row[:, None], yr.grad)  # dy is unweighted: the weight is applied in down_bwd
    assert_close(row_w[:rt], w_row)
    assert_close(dweights, wr.grad)
    if start > 0:  # choices of other ranks' experts get exactly zero here
        non_local = (idx < start) | (idx >= start + num_local)
        assert torch.count_nonzero(dweights[non_local]) == 0


# ---------------------------------------------------------------- the whole block
def _config(H: int, I: int, E: int, K: int, norm: bool = True) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                           norm_topk_prob=norm, hidden_act="silu")


def _run_block(block: FastSparseMoeBlock, x: torch.Tensor, g: torch.Tensor):
    xx = x.clone().requires_grad_()
    out = block(xx)
    out.backward(g)
    return out.detach(), xx.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize(
    "table,shape,dtype",
    [
        pytest.param("interpreter", (2, 19, 33, 21, 7, 3), torch.float32, id="small-tiles-odd-H-I-prime-E"),
        pytest.param("interpreter", (1, 9, 16, 8, 4, 4), torch.float32, id="small-tiles-K-equals-E"),
        pytest.param("cuda", (2, 19, 33, 21, 7, 3), torch.float32, id="cuda-tiles-one-tile-per-expert"),
        pytest.param("sm100", (1, 23, 40, 24, 5, 2), torch.bfloat16, id="sm100-tiles-bf16"),
        pytest.param("xpu", (1, 13, 24, 40, 5, 2), torch.float32, id="xpu-tiles-I-above-H"),
        pytest.param("interpreter", (1, 21, 32, 16, 6, 2), torch.bfloat16, id="small-tiles-bf16"),
        pytest.param("interpreter", (2, 0, 16, 8, 4, 2), torch.float32, id="T0-empty-batch"),
    ],
)
def test_block_triton_backend_equals_torch_backend(table, shape, dtype):
    B, S, H, I, E, K = shape
    torch.manual_seed(0)
    ref = FastSparseMoeBlock(_config(H, I, E, K), backend="torch").to(dtype)
    tri = FastSparseMoeBlock(_config(H, I, E, K), backend="triton").to(dtype)
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(B, S, H, dtype=dtype)
    g = torch.randn(B, S, H, dtype=dtype)
    want = _run_block(ref, x, g)
    with configs.use(table):
        got = _run_block(tri, x, g)
    assert_close(got[0], want[0], dtype)  # output
    assert_close(got[1], want[1], dtype)  # input gradient
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        if S == 0:  # no tokens: every weight gradient is exactly zero (or absent on both backends)
            assert (got[2][name] is None) == (want[2][name] is None), name
            if got[2][name] is not None:
                assert torch.count_nonzero(got[2][name]) == 0 and torch.count_nonzero(want[2][name]) == 0
            continue
        assert_close(got[2][name], want[2][name], dtype)


def test_expert_parallel_ranks_sum_to_the_full_layer():
    """Stages 2-5 on EP=3 ranks (2 experts each, expert_start 0, 2, 4) sum to the single-rank
    layer, gradients of the router weights and of the input included."""
    torch.manual_seed(4)
    T, H, I, E, K = 17, 12, 10, 6, 2
    x = torch.randn(T, H)
    logits = torch.randn(T, E)
    w_gu = torch.randn(E, 2 * I, H)
    w_d = torch.randn(E, H, I)
    weights, idx = torch.topk(torch.softmax(logits, -1), K)
    g = torch.randn(T, H)

    def run(parts):
        xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = sum(moe_experts_forward(xs, ws, idx, w_gu[s:s + n], w_d[s:s + n], backend="triton", expert_start=s)
                  for s, n in parts)
        out.backward(g)
        return out, xs.grad, ws.grad

    full = run([(0, E)])
    split = run([(0, 2), (2, 2), (4, 2)])
    for a, b in zip(split, full):
        assert_close(a, b)
    want = reference.reference_experts_forward(x, weights, idx, w_gu, w_d)
    assert_close(full[0], want)


# ---------------------------------------------------------------- host syncs and launches
def test_no_host_sync_and_launches_per_layer():
    torch.manual_seed(5)
    cfg = _config(16, 8, 8, 2)
    block = FastSparseMoeBlock(cfg, backend="triton")
    x = torch.randn(1, 12, 16)
    audit = audit_layer(block, x)
    fwd, bwd = audit.launches["forward"], audit.launches["backward"]
    print(f"\nlaunches per layer: forward {sum(fwd.values())} Triton + {audit.total(audit.ops, 'forward')} other ops "
          f"{dict(audit.ops['forward'])}; backward {sum(bwd.values())} Triton + "
          f"{audit.total(audit.ops, 'backward')} other ops {dict(audit.ops['backward'])}")
    assert audit.syncs["forward"] == [] and audit.syncs["backward"] == []
    assert dict(fwd) == {"_count_tokens_fwd_kernel": 1, "_cumsum_counts_fwd_kernel": 1, "_build_indices_fwd_kernel": 1,
                         "_gate_up_fwd_kernel": 1, "_grouped_mm_fwd_kernel": 1, "_combine_fwd_kernel": 1}
    # combine_bwd's kernel writes only the rows' weights: the down backward reads dout's rows in its loads,
    # and the row pass forms the SiLU*up gradient (no _silu_mul_bwd_kernel).
    assert dict(bwd) == {"_combine_bwd_kernel": 1, "_grouped_mm_fwd_kernel": 2, "_grouped_mm_bwd_kernel": 2,
                         "_router_weights_bwd_kernel": 1, "_combine_fwd_kernel": 1, "_row_dot_scale_kernel": 1}
    # Besides the router, stages 2-5 add one memset (the per-expert totals of the counting stage).
    assert audit.ops["forward"]["aten::zeros"] == 1
    # The detector does detect: the torch backend reads counts on the host.
    block.backend = "torch"
    control = audit_layer(block, x)
    assert len(control.syncs["forward"]) > 0 and len(control.syncs["backward"]) > 0


# ---------------------------------------------------------------- launcher checks
def test_launchers_reject_bad_inputs():
    x = torch.randn(4, 8)
    w = torch.randn(2, 6, 8)
    idx = torch.zeros(8, dtype=torch.int32)
    cum = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(2, 6, 9\)|width 8"):
        tops.gate_up_fwd(x, idx, cum, torch.randn(2, 6, 9))
    with pytest.raises(TypeError, match="int32"):
        tops.gate_up_fwd(x, idx.long(), cum, w)
    with pytest.raises(ValueError, match="contiguous"):
        tops.gate_up_fwd(torch.randn(8, 4).t(), idx, cum, w)
    with pytest.raises(ValueError, match="cum_token_counts has 2 entries"):
        tops.down_fwd(torch.randn(8, 3), cum[:2], torch.randn(2, 8, 3))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        tops.silu_mul_bwd(torch.zeros(4, 6, dtype=torch.int64), torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="cum_token_counts must be int32"):
        tops.silu_mul_bwd(torch.zeros(4, 6), torch.zeros(4, 3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"weights \(3, 2\)"):
        tops.combine_fwd(torch.randn(8, 4), torch.rand(3, 2), idx, idx, torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"partial_cum_token_counts has shape \(5,\), expected \(3,\)"):
        tops.build_indices(torch.zeros(4, 2, dtype=torch.int64), torch.zeros(5, dtype=torch.int32),
                           torch.zeros(5, dtype=torch.int32), 0, 2)
    with pytest.raises(TypeError, match="integer"):
        tops.count_tokens(torch.zeros(4, 2), 0, 2)


# ---------------------------------------------------------------- Triton 3.3 (Intel's XPU build's API)
_TRITON33 = os.environ.get("FASTMOE_TRITON33")


@pytest.mark.skipif(not _TRITON33, reason="set FASTMOE_TRITON33 to a directory holding triton 3.3 (see docs/triton.md)")
def test_block_pointer_path_under_triton_3_3():
    """The XPU path (block pointers, removed from upstream Triton after 3.3) runs the whole block
    correctly under Triton 3.3's interpreter, and every kernel compiles with 3.3 for sm_90 (block
    pointer variants with the cuda tiles: the XPU tiles exceed an H100's shared memory)."""
    run_block = textwrap.dedent("""
        import torch
        import triton, triton.runtime.interpreter as interp
        assert triton.__version__.startswith("3.3"), triton.__version__
        _orig = interp._patch_lang_tensor
        def _patched(tensor):  # Triton 3.3's interpreter predates numpy 2's scalar conversion rules
            _orig(tensor)
            tensor.__index__ = lambda self: int(self.handle.data.squeeze())
        interp._patch_lang_tensor = _patched
        from types import SimpleNamespace
        from fastmoe_xpu import FastSparseMoeBlock
        from fastmoe_xpu.kernels import configs
        assert configs.uses_block_ptr("interpreter")
        torch.manual_seed(0)
        cfg = SimpleNamespace(hidden_size=33, intermediate_size=21, num_experts=7, num_experts_per_tok=3,
                              norm_topk_prob=True, hidden_act="silu")
        a = FastSparseMoeBlock(cfg, backend="torch"); b = FastSparseMoeBlock(cfg, backend="triton")
        b.load_state_dict(a.state_dict())
        x = torch.randn(2, 19, 33); g = torch.randn(2, 19, 33)
        outs = []
        for blk in (a, b):
            xx = x.clone().requires_grad_(); y = blk(xx); y.backward(g)
            outs.append([y, xx.grad] + [p.grad for p in blk.parameters()])
        for u, v in zip(*outs):
            torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5)
        print("interpreter ok")
    """)
    compile_all = textwrap.dedent("""
        import triton
        assert triton.__version__.startswith("3.3"), triton.__version__
        from fastmoe_xpu.tools import compile_check as cc
        cuda = {s.name: s for s in cc.kernel_specs("cuda") if s.is_default}
        for spec in list(cuda.values()) + [s for s in cc.kernel_specs("xpu") if s.is_default]:
            if spec.name.startswith("tma_"):  # Hopper tensor descriptors: a type Triton 3.3 does not have
                continue
            if spec.constexprs.get("BLOCK_PTR"):
                ref = cuda[spec.name]
                spec.constexprs = {**ref.constexprs, "BLOCK_PTR": True}
                spec.num_warps, spec.num_stages, spec.extra_options = ref.num_warps, ref.num_stages, {}
            elif "grf_mode" in spec.extra_options:
                continue
            cc.compile_spec(spec, "cuda")
        print("compile ok")
    """)
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base["PYTHONPATH"] = os.pathsep.join([_TRITON33, str(REPO)])
    for script, extra, marker in ((run_block, {"TRITON_INTERPRET": "1", "FASTMOE_TRITON_BLOCK_PTR": "1"},
                                   "interpreter ok"), (compile_all, {}, "compile ok")):
        res = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**base, **extra}, capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0 and marker in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_bwd_computes_only_the_routed_rows(monkeypatch, dtype):
    """With the row count (as the autograd Function passes it), rows past RT are neither read nor
    written: under expert parallelism RT is about 1/EP of the T*K rows allocated."""
    from fastmoe_xpu.kernels.triton import grouped_gemm

    R, I, rt = 50, 20, 19  # RT ends inside a BLOCK_R tile, and later tiles hold no routed row
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(R, 2 * I, generator=g).to(dtype)
    dh = torch.randn(R, I, generator=g).to(dtype)
    gate_up[rt:] = float("nan")  # never read
    cum_token = torch.tensor([0, 7, 7, rt], dtype=torch.int32)  # 3 local experts, one empty
    monkeypatch.setattr(grouped_gemm, "_alloc_rows", lambda like, rows, cols: torch.full((rows, cols), 7.0, dtype=like.dtype))
    got = tops.silu_mul_bwd(gate_up, dh, cum_token)
    assert_close(got[:rt], torch_ops.silu_mul_bwd(gate_up[:rt], dh[:rt]), dtype)
    assert torch.equal(got[rt:], torch.full((R - rt, 2 * I), 7.0, dtype=dtype))  # untouched
    everything = tops.silu_mul_bwd(gate_up, dh)  # without counts: all R rows
    assert torch.isnan(everything[rt:]).all()
    assert torch.equal(everything[:rt], got[:rt])

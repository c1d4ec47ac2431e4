"""The ``decode`` experts implementation (stages 2-5 in one piece on the chosen experts alone,
``fastmoe_xpu/kernels/torch/decode.py``; ``auto`` takes it for one token) against the mask-based reference, and the
registry's choice of it.

Awkward shapes: one token (its matrix-vector path), one token naming an expert twice, K=1, K=E, many
empty experts, an odd width, expert-parallel slices with ids on both sides of the local range and one
no token chose, bf16; each multi-token case both with one ``mm`` per chosen expert and with torch's
grouped GEMM (``LOOP_EXPERTS``). Gradients of the input, both weights and the routing weights through
``fastmoe::experts`` and its backward op, against autograd through the reference.
"""
import pytest
import torch

from fastmoe_xpu import settings
from fastmoe_xpu.autograd import ops
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import registry
from fastmoe_xpu.kernels.torch import decode
from fastmoe_xpu.reference import reference_experts_forward
from test_padded_experts import CASES as PADDED_CASES, _grads, _inputs, check_auto_layer_runs
from tolerances import assert_close

# (T, H, I, E, K, expert_start, num_local, duplicate)
CASES = {
    **PADDED_CASES,
    "T1-wide": (1, 20, 12, 16, 8, 0, 16, False),
    "T1-duplicate": (1, 12, 6, 4, 2, 0, 4, True),
    "T1-ep": (1, 12, 6, 8, 3, 2, 3, False),
    "T4-many-experts": (4, 16, 8, 16, 4, 0, 16, False),
}


def _check(case, dtype=torch.float32):
    T, H, I, E, K, start, nl, dup = CASES[case]
    x, w_gu, w_d, weights, idx = _inputs(T, H, I, E, K, start, nl, dup, dtype=dtype)
    out, gate_up, plan = ops.experts(x, w_gu, w_d, weights, idx, start, nl, "decode")
    assert gate_up.shape == (T * K, 2 * I) and plan.shape == (T * K + 1,) and plan.dtype == torch.int64
    f = lambda t: t.detach().float().requires_grad_()  # noqa: E731
    ref_in = (x, w_gu, w_d, weights) if dtype == torch.float32 else (f(x), f(w_gu), f(w_d), f(weights))
    want = reference_experts_forward(ref_in[0], ref_in[3], idx, ref_in[1], ref_in[2], expert_start=start)
    assert out.dtype == dtype
    assert_close(out, want, dtype, msg=f"{case} output")
    for name, got, ref in zip(("dx", "dw_gate_up", "dw_down", "dweights"), _grads(out, (x, w_gu, w_d, weights)),
                              _grads(want, ref_in)):
        ref = torch.zeros_like(got) if ref is None else ref
        assert_close(got, ref, dtype, msg=f"{case} {name}")


@pytest.mark.parametrize("loop_experts", [0, 1000], ids=["grouped_mm", "mm-per-expert"])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_equals_reference(case, loop_experts, monkeypatch):
    monkeypatch.setattr(decode, "LOOP_EXPERTS", loop_experts)
    _check(case)


@pytest.mark.parametrize("case", ["T1-wide", "odd", "ep-slice"])
def test_decode_bf16_matches_fp32_reference(case):
    _check(case, torch.bfloat16)


def test_plan_sorts_slots_by_expert_and_flags_other_ranks_choices():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 1]])
    plan, counts, dump = decode.plan_of(idx, 0, 4)
    S = 8
    assert counts == [2, 2, 3, 1] and dump == 0 and int(plan[-1]) == 0
    assert [(int(p) // S, int(p) % S) for p in plan[:S]] == [(0, 1), (0, 4), (1, 3), (1, 7), (2, 0), (2, 2), (2, 5),
                                                             (3, 6)]
    plan, counts, dump = decode.plan_of(idx, 1, 2)  # local experts 1 and 2; the rest count as expert 2 (the dump)
    assert counts == [2, 3] and dump == 1 and int(plan[-1]) == 1
    assert [int(p) % S for p in plan[:5]] == [3, 7, 0, 2, 5]


def test_weight_views_follow_a_new_storage():
    w = torch.randn(3, 4, 5)
    assert decode._experts_of(w)[1].data_ptr() == w[1].data_ptr()
    w.data = torch.randn(3, 4, 5)  # a new storage: the views are built again
    assert torch.equal(decode._experts_of(w)[2], w[2])


# ---------------------------------------------------------------- the registry's choice
def test_whole_layer_takes_decode_at_one_token():
    with settings.override(gemm_engine="auto"):  # the tests' conftest pins "native"
        choose = lambda shape: registry.whole_layer("torch", "auto", "cpu", torch.float32, shape)  # noqa: E731
        assert choose((1, 8, 2048, 1024, 64)) == "decode"  # OLMoE decoding one sequence: 8 rows of 64 experts
        assert choose((1, 4, 256, 128, 16)) == "decode"  # within the padded budget too: decode first
        assert choose((2, 8, 2048, 1024, 64)) is None  # two tokens, past the padded budget: staged
        assert choose((4, 4, 256, 128, 16)) == "padded"  # four tokens of a small layer
        assert choose((1, 8, 64, 32, 4)) == "padded"  # more choices than local experts
        assert choose((48, 2, 64, 32, 8)) == "padded"  # 12 rows per expert, a small layer
        assert registry.whole_layer("torch", "loop", "cpu", torch.float32, (1, 8, 2048, 1024, 64)) is None
        assert registry.whole_layer("triton", "auto", "cpu", torch.float32, (1, 8, 64, 32, 64)) is None


def test_layer_takes_the_decode_op_at_one_token():
    check_auto_layer_runs("decode", CASES["T1-wide"])


@pytest.mark.parametrize("case", ["T1-wide", "odd", "ep-slice"])
def test_layer_without_grad_runs_the_body_directly_with_the_same_output(case, monkeypatch):
    """Under ``no_grad`` (generation) a whole-layer op's body runs directly, not through the op; the
    output is the op's and the reference's, the id check still fires on the plan's dump bit."""
    T, H, I, E, K, start, nl, dup = CASES[case]
    x, w_gu, w_d, weights, idx = _inputs(T, H, I, E, K, start, nl, dup)
    want = reference_experts_forward(x, weights, idx, w_gu, w_d, expert_start=start)
    applied, below = [], ops._below_autograd
    monkeypatch.setattr(ops, "_below_autograd", lambda *a: applied.append(a[0]) or below(*a))
    with settings.override(gemm_engine="auto"):  # the op path, with grad, does go through it
        moe_experts_forward(x, weights, idx, w_gu, w_d, expert_start=start, num_local=nl, gemm_engine="auto")
    assert applied == [ops.experts]
    applied.clear()
    checked = []
    with settings.override(gemm_engine="auto"), torch.no_grad():
        got = moe_experts_forward(x, weights, idx, w_gu, w_d, expert_start=start, num_local=nl, gemm_engine="auto",
                                  check_ids=checked.append)
    assert not applied and got.grad_fn is None
    assert_close(got, want, msg=case)
    assert len(checked) == (1 if case == "ep-slice" else 0)  # some ids there are other ranks' experts

"""Stages 2-5 of the torch backend against the plain references, and the worked example of docs/algorithm.md."""
import pytest
import torch

from fastmoe_xpu import reference as ref
from fastmoe_xpu.kernels import torch as ops
from tolerances import assert_close

# docs/algorithm.md's worked example: N=4, K=2, T=6, TBS=2.
EXAMPLE_IDX = torch.tensor([[0, 2], [1, 0], [3, 2], [0, 1], [2, 3], [1, 3]])
EXAMPLE = {
    # (expert_start, num_local): expected vectors
    (0, 4): dict(
        partial=[2, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 2], cum_token=[0, 3, 6, 9, 12],
        expert_counts=[2, 2, 2, 2, 2, 2], cum_expert=[0, 2, 4, 6, 8, 10, 12],
        input=[0, 1, 3, 1, 3, 5, 0, 2, 4, 2, 4, 5], output=[0, 6, 3, 1, 9, 7, 2, 4, 8, 10, 5, 11],
        selected=[0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1],
    ),
    (0, 2): dict(
        partial=[2, 1, 0, 1, 1, 1], cum_token=[0, 3, 6], expert_counts=[1, 2, 0, 2, 0, 1],
        cum_expert=[0, 1, 3, 3, 5, 5, 6], input=[0, 1, 3, 1, 3, 5], output=[0, 3, 1, 2, 4, 5],
        selected=[0, 0, 1, 0, 1, 0],
    ),
    (2, 2): dict(
        partial=[1, 1, 1, 0, 1, 2], cum_token=[0, 3, 6], expert_counts=[1, 0, 2, 0, 2, 1],
        cum_expert=[0, 1, 1, 3, 3, 5, 6], input=[0, 2, 4, 2, 4, 5], output=[0, 3, 1, 2, 4, 5],
        selected=[1, 0, 1, 0, 1, 1],
    ),
}


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("start_local", list(EXAMPLE))
def test_worked_example(impl, start_local):
    start, nl = start_local
    exp = EXAMPLE[start_local]
    count = ops.count_tokens if impl == "torch" else ref.reference_count_tokens
    build = ops.build_indices if impl == "torch" else ref.reference_build_indices
    partial, pcum, ecounts, cexp, ctok = count(EXAMPLE_IDX, start, nl, 2)
    assert partial.tolist() == exp["partial"]
    assert ctok.tolist() == exp["cum_token"]
    assert ecounts.tolist() == exp["expert_counts"]
    assert cexp.tolist() == exp["cum_expert"]
    inp, out, sel = build(EXAMPLE_IDX, pcum, cexp, start, nl, 2)
    assert inp.tolist() == exp["input"]
    assert out.tolist() == exp["output"]
    assert sel.tolist() == exp["selected"]


def _random_topk(T, E, K, seed, mode="random"):
    g = torch.Generator().manual_seed(seed)
    if mode == "one_expert":  # every token picks expert 0 first: one expert gets all T tokens
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: K - 1] + 1 for _ in range(T)]) if K > 1 else None
        first = torch.zeros(T, 1, dtype=torch.int64)
        return first if rest is None else torch.cat([first, rest], 1)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)


ROUTING_CASES = [
    # (T, E, K, block, expert_start, num_local, mode)
    (1, 4, 2, 8, 0, 4, "random"),  # T=1, fewer tokens than one block
    (13, 7, 3, 8, 0, 7, "random"),  # prime E, T not a multiple of the block
    (13, 7, 7, 4, 0, 7, "random"),  # K=E: every token goes everywhere
    (29, 5, 1, 8, 0, 5, "random"),  # K=1
    (17, 6, 2, 8, 0, 6, "one_expert"),  # one expert receives every token
    (40, 64, 2, 8, 0, 64, "random"),  # more experts than routed rows: many empty experts
    (21, 8, 3, 8, 4, 2, "random"),  # expert parallelism: a middle slice of local experts
    (21, 8, 3, 3, 6, 2, "random"),  # expert parallelism: the last rank, odd block size
    (0, 4, 2, 8, 0, 4, "random"),  # zero tokens
]


@pytest.mark.parametrize("T,E,K,block,start,nl,mode", ROUTING_CASES)
def test_routing_metadata(T, E, K, block, start, nl, mode):
    idx = _random_topk(T, E, K, seed=T * 31 + E, mode=mode)
    got = ops.count_tokens(idx, start, nl, block)
    want = ref.reference_count_tokens(idx, start, nl, block)
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()
    _, pcum, ecounts, cexp, ctok = got
    local = ((idx >= start) & (idx < start + nl)).sum().item()
    assert int(ctok[-1]) == local and int(cexp[-1]) == local  # offsets sum to the routed rows
    inp, out, sel = ops.build_indices(idx, pcum, cexp, start, nl, block)
    rinp, rout, rsel = ref.reference_build_indices(idx, pcum, cexp, start, nl, block)
    assert inp.tolist() == rinp.tolist() and out.tolist() == rout.tolist() and sel.tolist() == rsel.tolist()
    # Invariants: output_indices is a permutation of the rows; slot -> row -> token round-trips.
    assert sorted(out.tolist()) == list(range(local))
    slot_tok = torch.repeat_interleave(torch.arange(T), ecounts.long())
    assert torch.equal(inp[out.long()].long(), slot_tok)
    assert torch.equal(idx[slot_tok, sel.long()] - start, torch.searchsorted(ctok[1:].long(), out.long(), right=True))


GEMM_CASES = [
    # (T, H, I, E, K, dtype)
    (11, 17, 9, 5, 2, torch.float32),  # odd H and I, prime E
    (1, 8, 4, 3, 3, torch.float32),  # T=1, K=E
    (30, 16, 12, 6, 1, torch.float32),  # K=1
    (9, 12, 6, 4, 2, torch.bfloat16),  # bf16 (fp32 accumulation)
]


@pytest.mark.parametrize("T,H,I,E,K,dtype", GEMM_CASES)
def test_expert_gemms_and_combine_match_reference(T, H, I, E, K, dtype):
    torch.manual_seed(T + H)
    idx = _random_topk(T, E, K, seed=7)
    x = torch.randn(T, H).to(dtype).requires_grad_()
    wgu = (torch.randn(E, 2 * I, H) * 0.2).to(dtype).requires_grad_()
    wd = (torch.randn(E, H, I) * 0.2).to(dtype).requires_grad_()
    w = torch.rand(T, K).to(dtype).requires_grad_()
    _, pcum, _, cexp, ctok = ops.count_tokens(idx, 0, E, 8)
    inp, out, sel = ops.build_indices(idx, pcum, cexp, 0, E, 8)

    gu, h = ops.gate_up_fwd(x.detach(), inp, ctok, wgu.detach())
    rgu, rh = ref.reference_gate_up(x, inp, ctok, wgu)
    assert_close(gu, rgu, dtype, "gate_up")
    assert_close(h, rh, dtype, "h")
    y = ops.down_fwd(h, ctok, wd.detach())
    ry = ref.reference_down(rh, ctok, wd)
    assert_close(y, ry, dtype, "down")
    o = ops.combine_fwd(y, w.detach(), out, sel, cexp)
    ro = ref.reference_combine(ry, w, out, sel, cexp)
    assert_close(o, ro, dtype, "combine")

    # Backward through the launchers by hand, against autograd through the reference.
    dout = torch.randn(T, H).to(dtype)
    ro.backward(dout)
    dy, row_w = ops.combine_bwd(dout, w.detach(), out, sel, cexp)
    dh, dwd, drow = ops.down_weighted_bwd(dy, gu, row_w, ctok, wd.detach())
    dw = ops.router_weights_bwd(drow, w.detach(), out, sel, cexp)
    dgu = ops.silu_mul_bwd(gu, dh)
    dx_rows, dwgu = ops.gate_up_bwd(dgu, x.detach(), inp, ctok, wgu.detach())
    dx = ops.combine_fwd(dx_rows, None, out, sel, cexp)
    assert_close(dw, w.grad, dtype, "router weights grad")
    assert_close(dwd, wd.grad, dtype, "down_proj grad")
    assert_close(dwgu, wgu.grad, dtype, "gate_up_proj grad")
    assert_close(dx, x.grad, dtype, "input grad")


def test_empty_experts_get_zero_weight_grad():
    idx = torch.tensor([[0], [0], [2]])  # experts 1 and 3 receive nothing
    x, wgu, wd = torch.randn(3, 4), torch.randn(4, 6, 4), torch.randn(4, 4, 3)
    _, pcum, _, cexp, ctok = ops.count_tokens(idx, 0, 4, 8)
    inp, out, sel = ops.build_indices(idx, pcum, cexp, 0, 4, 8)
    gu, h = ops.gate_up_fwd(x, inp, ctok, wgu)
    dh, dwd = ops.down_bwd(torch.ones(3, 4), h, ctok, wd)
    _, dwgu = ops.gate_up_bwd(ops.silu_mul_bwd(gu, dh), x, inp, ctok, wgu)
    for e in (1, 3):
        assert torch.count_nonzero(dwd[e]) == 0 and torch.count_nonzero(dwgu[e]) == 0
    assert torch.count_nonzero(dwd[0]) > 0 and torch.count_nonzero(dwgu[2]) > 0


@pytest.mark.parametrize("bad, err", [
    (lambda: ops.count_tokens(torch.zeros(3), 0, 2), ValueError),  # 1-D indices
    (lambda: ops.count_tokens(torch.zeros(3, 2), 0, 2), TypeError),  # float indices
    (lambda: ops.count_tokens(torch.zeros(3, 2, dtype=torch.long), 0, 0), ValueError),  # no local experts
    (lambda: ops.gate_up_fwd(torch.randn(3, 5), torch.zeros(3, dtype=torch.int32),
                             torch.tensor([0, 3], dtype=torch.int32), torch.randn(1, 4, 4)), ValueError),  # H mismatch
    (lambda: ops.gate_up_fwd(torch.randn(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.int32),
                             torch.tensor([0, 3], dtype=torch.int32), torch.randn(1, 4, 4)), TypeError),  # dtype mismatch
    (lambda: ops.down_fwd(torch.randn(3, 4), torch.tensor([0, 3], dtype=torch.int32), torch.randn(2, 4, 4)), ValueError),  # counts vs experts
])
def test_launchers_reject_bad_input(bad, err):
    with pytest.raises(err):
        bad()

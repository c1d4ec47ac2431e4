"""The block-scaled fp8 recipe (``expert_precision="fp8-block"``, ``kernels/triton/fp8_block_gemm.py``)
against its plain-PyTorch reference (``kernels/quantized/block_reference.py``): the weights' block
quantizer bit for bit, each GEMM variant (activations and gradients quantized in the GEMMs' loads),
and the whole layer forward and backward at awkward shapes, gradients included.

The recipe's block is 128; most tests also run it at 16 (``fp8_block_gemm.BLOCK`` set for the test) so
that the interpreter's small shapes span several blocks along every contracted axis. Device-aware as
tests/kernels/test_fp8_triton.py: the interpreter on the CPU, ``--device cuda`` compiled on sm_89+.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward  # noqa: E402
from fastmoe_xpu.kernels import kernels, registry  # noqa: E402
from fastmoe_xpu.kernels.quantized import block_reference as bref, core as qcore  # noqa: E402
from fastmoe_xpu.kernels.triton import fp8_block_gemm as fb  # noqa: E402
from fastmoe_xpu.routing import topk_routing  # noqa: E402
from quantized_util import (  # noqa: E402, F401  (no_host_bounds: a fixture)
    bf16_layer, check_layer, close_to_scale, fp8_layer_tol, layer_case, no_host_bounds, wgrad_case, within_of,
)

BLOCKS = pytest.mark.parametrize("qb", [16, 128], ids=["qb16", "qb128"])
#: The quantization passes of the per-channel fp8 recipe: the block recipe runs none of them.
PASSES = {"_fp8q_rows_kernel", "_fp8q_cols_kernel", "_fp8q_silu_rows_kernel", "_fp8q_silu_mul_kernel",
          "_silu_mul_bwd_kernel", "_fp8_grouped_mm_kernel", "_fp8_grouped_wgrad_kernel"}


@pytest.fixture
def dev(device):
    if not fb.available(device):
        pytest.skip(f"the block-scaled fp8 kernels do not run on {device} (fp8 tensor cores: sm_89 or newer)")
    return device


def _on(device, qb: int) -> int:
    """The block ``qb`` where ``device`` runs it: a GPU's fp8 MMA contracts at least 32 values per step."""
    return qb if torch.device(device).type == "cpu" else max(qb, 32)


@pytest.fixture
def block(monkeypatch, device):
    """Sets the recipe's block for the test (the launchers read ``fp8_block_gemm.BLOCK`` at each call)
    and returns it (:func:`_on` the device)."""
    def use(qb: int) -> int:
        qb = _on(device, qb)
        monkeypatch.setattr(fb, "BLOCK", qb)
        qcore.forget_weights()
        return qb
    yield use
    qcore.forget_weights()


def _cum(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("qb", [16, 32, 128])
def test_weight_blocks_same_codes(dev, qb, launched):
    """One kernel: e4m3 codes in the weight's layout and one scale per ``qb x qb`` block, bit for bit
    the reference's, with dimensions not multiples of the block, a zero block (zero codes and scale),
    values at rounding ties and a tiny block."""
    g = torch.Generator().manual_seed(qb)
    w = torch.randn(3, 45, 37, generator=g) * torch.rand(3, 45, 1, generator=g) * 10
    w[1, :qb, :qb] = 0
    w[2, 5, 7] = 31.73 * w[2, :qb, :qb].abs().max() / 448  # a code on the edge of a binade
    w[0, -3:, -2:] *= 1e-6
    codes, scales = fb.quantize_weight_blocks(w.to(dev), qb)
    assert launched == ["_fp8b_weight_kernel"]
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, -(-45 // qb), -(-37 // qb))
    for e in range(3):
        q, s = bref.weight_blocks(w[e], qb)
        assert torch.equal(codes[e].cpu().double(), q[:45, :37]), e
        assert torch.equal(scales[e].cpu(), s), e
    assert scales[1, 0, 0] == 0 and codes[1, :qb, :qb].float().eq(0).all()


def _rows_want(a_mode, a, idx, w, s, t, qb, grad, out_dtype):
    """The reference rows of expert ``w`` for rows ``s:t``."""
    if a_mode == "gather":
        rows = a[idx[s:t].long()]
    elif a_mode == "silu":
        k = a.shape[1] // 2
        rows = (torch.nn.functional.silu(a[s:t, :k]) * a[s:t, k:]).to(out_dtype).float()
    else:
        rows = a[s:t]
    # the forward x W^T with W [N, K]; the input gradient dy W with W [K, N] = [O, In]
    return bref.qlinear_input_grad(rows, w, qb) if grad else bref.qlinear(rows, w, qb)


@BLOCKS
@pytest.mark.parametrize("case", ["x:gather", "h:silu", "h:rows", "dgrad:rows", "dgrad:gather"])
def test_row_gemm_matches_reference(dev, qb, case, launched):
    """Each expert row against the reference's block products; counts 19, 0, 1, 17, 3 (an empty expert,
    a single row, partial row tiles), K = 37 and N = 45 (partial blocks and tiles), rows past RT
    untouched; the activations' tiles quantized to e4m3 in the loads (gathered by token, SiLU*up of
    ``gate_up``), the gradients' to e5m2 against the forward's weight codes read along the other axis."""
    qb = _on(dev, qb)
    what, a_mode = case.split(":")
    grad = what == "dgrad"
    g = torch.Generator().manual_seed(qb + len(case))
    counts = [19, 0, 1, 17, 3]
    cum = _cum(counts)
    rt, R, N, K, T = sum(counts), sum(counts) + 3, 45, 37, 23
    NR = len(counts)
    # the forward: W [N, K] (out x in); the input gradient: W [K, N] is the forward's [O, In] weight
    w = torch.randn(NR, K if grad else N, N if grad else K, generator=g) * torch.rand(NR, 1, 1, generator=g)
    codes, scales = fb.quantize_weight_blocks(w.to(dev), qb)
    width = 2 * K if a_mode == "silu" else K
    a = torch.randn(T if a_mode == "gather" else R, width, generator=g) * torch.rand(width, generator=g) * 3
    a[2] = 0  # a zero row
    idx = torch.randint(0, T, (R,), generator=g, dtype=torch.int32) if a_mode == "gather" else None
    for out_dtype in (torch.float32, torch.bfloat16):
        out = torch.full((R, N), 7.0, dtype=out_dtype, device=dev)
        fb.fp8b_grouped_mm(a.to(dev), None if idx is None else idx.to(dev), codes, scales, cum.to(dev), out,
                           trans_w=not grad, a_mode=a_mode, grad=grad, qb=qb)
        out = out.cpu()
        for e in range(NR):
            s, t = int(cum[e]), int(cum[e + 1])
            if s < t:
                want = _rows_want(a_mode, a, idx, w[e], s, t, qb, grad, out_dtype)
                tol = fp8_layer_tol(dev)
                if out_dtype == torch.bfloat16:  # and one bf16 rounding of the result
                    tol = dict(rtol=max(tol["rtol"], 2 ** -7), atol=tol["atol"])
                close_to_scale(out[s:t], want, f"expert {e} ({out_dtype})", tol)
        assert out[rt:].eq(7.0).all()
    assert set(launched) == {"_fp8b_weight_kernel", "_fp8b_grouped_mm_kernel"}


@BLOCKS
@pytest.mark.parametrize("case", ["gate_up", "down:silu", "down", "down:W^T", "grad:gather"])
@pytest.mark.parametrize("counts", [[19, 0, 1, 17, 33], [1], [0, 0, 2]], ids=["awkward", "T1", "leading-empty"])
def test_wgrad_matches_reference(dev, qb, case, counts, launched):
    """The weight gradient against the reference's block products over each expert's rows (blocks of
    ``qb`` rows from the expert's first): the gradient's rows (e5m2) against x's rows gathered by token,
    SiLU*up of ``gate_up`` times the router weights, plain rows, the transposed layout's ``h^T dy``
    (e4m3 on the left), and gathered gradient rows; zero for an empty expert; the rows past RT (NaN,
    inf, out-of-range indices) never read. M = 21, N = 37: partial tiles; 33 rows: three blocks of 16."""
    qb = _on(dev, qb)
    M, N = 21, 37
    cum, grad, x, idx = wgrad_case(counts, M, N, seed=len(counts))
    NR, R = len(counts), len(idx)
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(R, 2 * N, generator=g)
    rw = torch.rand(R, generator=g)
    rows_h = torch.randn(R, N, generator=g)
    left_grad = case != "down:W^T"
    out = torch.full((NR, N, M) if not left_grad else (NR, M, N), 7.0, device=dev)
    d = lambda t: t.to(dev)  # noqa: E731
    if case == "gate_up":
        fb.fp8b_grouped_wgrad(d(grad), d(x), d(cum), out, right_idx=d(idx), qb=qb)
    elif case == "down:silu":
        fb.fp8b_grouped_wgrad(d(grad), d(gate_up), d(cum), out, right_silu_weights=d(rw), qb=qb)
    elif case == "down":
        fb.fp8b_grouped_wgrad(d(grad), d(rows_h), d(cum), out, qb=qb)
    elif case == "down:W^T":
        fb.fp8b_grouped_wgrad(d(rows_h), d(grad), d(cum), out, left_grad=False, qb=qb)
    else:  # the gradient's rows gathered by token from a [T, M] tensor
        grad_t = torch.randn(13, M, generator=g)
        fb.fp8b_grouped_wgrad(d(grad_t), d(rows_h), d(cum), out, left_idx=d(idx), qb=qb)
    assert launched == ["_fp8b_grouped_wgrad_kernel"]
    out = out.cpu()
    for e in range(NR):
        s, t = int(cum[e]), int(cum[e + 1])
        if s == t:
            assert torch.count_nonzero(out[e]) == 0, e
            continue
        if case == "gate_up":
            want = bref.qweight_grad(grad[s:t], x[idx[s:t].long()], qb)
        elif case == "down:silu":
            h = torch.nn.functional.silu(gate_up[s:t, :N]) * gate_up[s:t, N:] * rw[s:t, None]
            want = bref.qweight_grad(grad[s:t], h, qb)
        elif case == "down:W^T":  # e4m3 rows on the left, e5m2 on the right
            want = bref.qweight_grad(rows_h[s:t], grad[s:t], qb, bref.FWD, bref.GRAD)
        elif case == "down":
            want = bref.qweight_grad(grad[s:t], rows_h[s:t], qb)
        else:
            want = bref.qweight_grad(grad_t[idx[s:t].long()], rows_h[s:t], qb)
        close_to_scale(out[e], want, f"expert {e}", fp8_layer_tol(dev))


def _routing(T, E, K, mode, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if mode == "one-expert":  # every token's first choice is expert E - 1
        logits[:, E - 1] += 100
    return topk_routing(logits, K, True)


LAYERS = pytest.mark.parametrize("shape", [
    (37, 33, 20, 7, 3, "random"),     # odd H and I, prime E
    (5, 16, 9, 9, 2, "empty"),        # T below a tile, experts left empty
    (1, 12, 10, 4, 2, "random"),      # one token
    (11, 24, 20, 5, 1, "random"),     # K = 1
    (6, 20, 12, 3, 3, "random"),      # K = E
    (19, 40, 24, 6, 1, "one-expert"),  # every token to one expert
], ids=lambda s: "T{}-H{}-I{}-E{}-K{}-{}".format(*s))


@BLOCKS
@LAYERS
def test_layer_matches_reference(dev, qb, shape, block, launched, no_host_bounds):
    """``expert_precision="fp8-block"`` next to the Triton base: output and every gradient against the
    reference, with the fused launchers (h never written, the output gradient's rows read by token) and
    no quantization pass: the weights quantized once each per step (the backward finds them again),
    every expert GEMM one block-scaled kernel, no host read of the expert bounds."""
    T, H, I, E, K, mode = shape
    qb = block(qb)
    x, _, _, w_gu, w_d, dout = layer_case(T, H, I, E, K, seed=T + E)
    if mode == "empty":
        x, weights, idx, w_gu, w_d, dout = layer_case(T, H, I, E, K, empty=True)
    else:
        weights, idx = _routing(T, E, K, mode, seed=T * E)
    leaves = [t.clone().to(dev).requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = moe_experts_forward(leaves[0], leaves[1], idx.to(dev), leaves[2], leaves[3], backend="triton",
                              expert_precision="fp8-block")
    out.backward(dout.to(dev))
    want = bref.moe_forward_backward(x, weights, idx, w_gu, w_d, dout, qb)
    tol = fp8_layer_tol(dev)
    check_layer(lambda got, ref, what: close_to_scale(got, ref, what, tol), out, leaves, want)
    assert launched.count("_fp8b_weight_kernel") == 2, launched
    # gate_up forward, down forward (SiLU*up in its loads), down input gradient, gate_up input gradient
    assert launched.count("_fp8b_grouped_mm_kernel") == 4, launched
    assert launched.count("_fp8b_grouped_wgrad_kernel") == 2, launched
    assert not PASSES & set(launched), launched
    if mode == "empty":
        assert torch.count_nonzero(leaves[2].grad[K + 1:]) == 0
    if mode == "one-expert":
        assert torch.count_nonzero(leaves[2].grad[:-1]) == 0 and torch.count_nonzero(leaves[2].grad[-1]) > 0


def test_local_experts_match_reference(dev, block, launched, no_host_bounds):
    """A local slice of many experts (an expert-parallel rank's: the routing's other experts' slots
    never reach these GEMMs), some empty, at 16-value blocks: output and every gradient against the
    reference of that slice."""
    qb = block(16)
    x, weights, idx, w_gu, w_d, dout = layer_case(29, 40, 20, 16, 4, seed=8)
    start, nl = 3, 9
    w_gu, w_d = w_gu[start:start + nl].contiguous(), w_d[start:start + nl].contiguous()
    leaves = [t.clone().to(dev).requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = moe_experts_forward(leaves[0], leaves[1], idx.to(dev), leaves[2], leaves[3], backend="triton",
                              expert_start=start, num_local=nl, expert_precision="fp8-block")
    out.backward(dout.to(dev))
    want = bref.moe_forward_backward(x, weights, idx, w_gu, w_d, dout, qb, expert_start=start)
    tol = fp8_layer_tol(dev)
    check_layer(lambda got, ref, what: close_to_scale(got, ref, what, tol), out, leaves, want)
    assert launched.count("_fp8b_weight_kernel") == 2 and not PASSES & set(launched), launched


def test_decode_under_frozen_weights_quantizes_each_weight_once(dev, block, launched, no_host_bounds):
    """Decoding (no grad) inside ``fastmoe_xpu.frozen_expert_weights``: the weights' block codes are made
    by the first call only, and every call's output is exactly the one of quantizing anew."""
    import fastmoe_xpu

    block(16)
    x, weights, idx, w_gu, w_d, _ = layer_case(9, 40, 20, 6, 2, seed=4)
    x, weights, idx, w_gu, w_d = (t.to(dev) for t in (x, weights, idx, w_gu, w_d))
    calls = [(x[i:i + n], weights[i:i + n], idx[i:i + n]) for i, n in ((0, 1), (1, 1), (2, 7))]

    def run(c):
        return moe_experts_forward(*c, w_gu, w_d, backend="triton", expert_precision="fp8-block")
    with torch.no_grad():
        want = [run(c) for c in calls]
        assert launched.count("_fp8b_weight_kernel") == 2 * len(calls), launched
        launched.clear()
        qcore.forget_weights()
        with fastmoe_xpu.frozen_expert_weights():
            got = [run(c) for c in calls]
    assert launched.count("_fp8b_weight_kernel") == 2 and launched.count("_fp8b_grouped_mm_kernel") == 2 * len(calls)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("transposed", [False, True])
def test_down_launchers_both_layouts(dev, transposed, block, launched, no_host_bounds):
    """``down_fwd`` / ``down_bwd`` of ``triton+fp8-block`` in the stored and transposed layouts against
    the reference per expert: the square blocks of the stored weight serve both orientations."""
    qb = block(16)
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 19, 1]
    cum = _cum(counts)
    a, dy = torch.randn(sum(counts) + 2, 21, generator=g), torch.randn(sum(counts) + 2, 35, generator=g)
    w = torch.randn(4, 35, 21, generator=g)
    stored = w.transpose(1, 2).contiguous() if transposed else w
    ks = kernels("triton+fp8-block")
    y = ks.down_fwd(a.to(dev), cum.to(dev), stored.to(dev), transposed=transposed).cpu()
    da, dw = (t.cpu() for t in ks.down_bwd(dy.to(dev), a.to(dev), cum.to(dev), stored.to(dev), transposed=transposed))
    assert launched.count("_fp8b_grouped_mm_kernel") == 2 and launched.count("_fp8b_grouped_wgrad_kernel") == 1
    tol = fp8_layer_tol(dev)
    for e in range(4):
        s, t = int(cum[e]), int(cum[e + 1])
        if s == t:
            assert torch.count_nonzero(dw[e]) == 0
            continue
        # the transposed layout's blocks are the same squares read the other way: the same codes
        close_to_scale(y[s:t], bref.qlinear(a[s:t], w[e], qb), f"expert {e} forward", tol)
        close_to_scale(da[s:t], bref.qlinear_input_grad(dy[s:t], w[e], qb), f"expert {e} input gradient", tol)
        if transposed:
            close_to_scale(dw[e], bref.qweight_grad(a[s:t], dy[s:t], qb, bref.FWD, bref.GRAD), f"expert {e} weight gradient", tol)
        else:
            close_to_scale(dw[e], bref.qweight_grad(dy[s:t], a[s:t], qb), f"expert {e} weight gradient", tol)


def test_bf16_layer_close_to_reference(dev):
    """bf16 activations and weights at the recipe's block of 128 (H = 160: two blocks, one partial):
    the layer agrees with the reference on the same bf16 values up to the bf16 roundings of the stored
    rows, output and every gradient."""
    got, (x, weights, idx, w_gu, w_d, dout) = bf16_layer(dev, "fp8-block", (23, 160, 40, 5, 2), seed=2)
    want = bref.moe_forward_backward(x, weights.float(), idx, w_gu, w_d, dout, 128)
    within_of(got, want, 0.05)  # as tests/kernels/test_fp8_triton.py's bf16 bound


def test_compiled_block_equals_eager(dev):
    """``torch.compile(fullgraph=True)`` (``aot_eager``: dynamo and AOTAutograd trace the custom ops and
    their backward) of a block in ``fp8-block``: the same output and gradients as eager, bit for bit."""
    from types import SimpleNamespace

    from compile_util import block_step
    from fastmoe_xpu import FastSparseMoeBlock

    torch._dynamo.reset()
    cfg = SimpleNamespace(hidden_size=24, intermediate_size=20, num_experts=7, num_experts_per_tok=3,
                          norm_topk_prob=False, hidden_act="silu")
    torch.manual_seed(0)
    block = FastSparseMoeBlock(cfg, backend="triton", expert_precision="fp8-block").to(dev)
    x = torch.randn(2, 19, 24, device=dev, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")

    want, got = block_step(block, x, block), block_step(block, x, compiled)
    for k, v in want.items():
        assert v is not None and torch.equal(got[k], v), k


def test_unavailable_and_bad_input():
    """The recipe runs next to the Triton base only, and says so; bad operands are refused with the
    shapes named."""
    reason = registry.unavailable_reason("fp8-block", "torch", "cpu", torch.float32)
    assert reason and "triton kernel base only" in reason
    with pytest.raises(RuntimeError, match="expert_precision='fp8-block' cannot run here: .*triton kernel base"):
        registry.precision_engine("fp8-block", "torch", "cpu", torch.float32)
    codes = torch.zeros(2, 8, 8, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(2, 1, 1)
    cum = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="block scales"):
        fb.fp8b_grouped_mm(torch.zeros(4, 8), None, codes, torch.zeros(2, 2, 1), cum, torch.empty(4, 8), True, qb=8)
    with pytest.raises(ValueError, match="a_mode"):
        fb.fp8b_grouped_mm(torch.zeros(4, 8), None, codes, scales, cum, torch.empty(4, 8), True, a_mode="cols", qb=8)
    with pytest.raises(ValueError, match="do not fit"):
        fb.fp8b_grouped_mm(torch.zeros(4, 7), None, codes, scales, cum, torch.empty(4, 8), True, qb=8)
    with pytest.raises(ValueError, match="weight codes"):
        fb.fp8b_grouped_mm(torch.zeros(4, 8), None, codes.float(), scales, cum, torch.empty(4, 8), True, qb=8)
    with pytest.raises(ValueError, match="fp8b_grouped_wgrad"):
        fb.fp8b_grouped_wgrad(torch.zeros(4, 8), torch.zeros(4, 6), cum, torch.empty(2, 8, 5))

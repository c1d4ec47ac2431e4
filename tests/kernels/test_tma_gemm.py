"""The persistent TMA grouped GEMMs (``kernels/triton/tma_gemm.py``, engine ``triton_tma``) under the
Triton interpreter, against per-expert ``torch.mm`` and the mask-based reference, gradients included.

Shapes are awkward in every way the descriptors allow (widths that are no multiple of the tiles but
give 16-byte aligned rows, experts with no rows, one expert with several row tiles, an expert-parallel
slice, T not a multiple of anything) and run on worst-case row buffers whose rows past RT hold NaN,
so a descriptor box reaching past an expert's rows would show. A spy on the one launch function
checks that the TMA kernels ran (not the plain kernels they hand unaligned shapes to); the
compiled sm_90 code is checked in tests/tools/test_compile_check.py.
"""
from __future__ import annotations

import collections
import os

import pytest
from device_util import test_device_name

if test_device_name() != "cpu":
    pytest.skip("these tests run the kernel in the Triton interpreter on CPU tensors; on a device the compiled "
                "engine runs in every case of tests/kernels/test_gemm_engines.py", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

pytest.importorskip("triton")

from fastmoe_xpu import reference, settings  # noqa: E402
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward  # noqa: E402
from fastmoe_xpu.kernels import registry  # noqa: E402
from fastmoe_xpu.kernels import torch as torch_ops  # noqa: E402
from fastmoe_xpu.kernels.triton import launch as _launch  # noqa: E402
from fastmoe_xpu.kernels.triton import tma_gemm  # noqa: E402
from stage4_shapes import stage4_cases  # noqa: E402
from tolerances import assert_close  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

TMA_KERNELS = {"_tma_gate_up_fwd_kernel", "_tma_grouped_mm_kernel", "_tma_wgrad_kernel"}


@pytest.fixture(autouse=True)
def _interpreter_configs():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv("FASTMOE_TRITON_CONFIGS", raising=False)
        with settings.reloaded():
            yield


@pytest.fixture
def launched(monkeypatch):
    """Names of the kernels started through ``launch.launch`` during the test."""
    seen: collections.Counter = collections.Counter()
    real = _launch.launch

    def spy(kernel, grid, *args, **kw):
        seen[kernel.fn.__name__] += 1
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(_launch, "launch", spy)
    return seen


def _routing(T, K, E, pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = E // 2 if pattern == "low_half" else E
    rows = [torch.randperm(pool, generator=g)[:K].tolist() for _ in range(T)]
    if pattern == "one_expert":  # expert 1 takes every token (several row tiles of 16)
        rows = [[1] + [e for e in torch.randperm(E, generator=g).tolist() if e != 1][: K - 1] for _ in range(T)]
    return torch.tensor(rows, dtype=torch.int64).reshape(T, K)


def _buffers(idx, start, num_local, T, K):
    """Worst-case rows (R = T*K) as the Triton backend allocates them: ``cum_token_counts`` and
    ``input_indices`` from the torch backend's exact stages 2-3, padded with token 0 past RT."""
    counts = torch_ops.count_tokens(idx, start, num_local, 8)
    rows = torch_ops.build_indices(idx, counts[1], counts[3], start, num_local, 8)
    cum = counts.cum_token_counts
    RT = int(cum[-1])
    R = T * K
    input_idx = torch.zeros(R, dtype=torch.int32)
    input_idx[:RT] = rows.input_indices[:RT]
    return cum, input_idx, RT, R


def _rows(R, RT, width, dtype, g):
    """``[R, width]`` with real values in the RT routed rows and NaN past them."""
    t = torch.full((R, width), float("nan"), dtype=dtype)
    t[:RT] = torch.randn(RT, width, generator=g).to(dtype)
    return t


def _per_expert(cum, fn):
    return [fn(e, int(cum[e]), int(cum[e + 1])) for e in range(len(cum) - 1)]


CASES = stage4_cases("tma-ragged-tiles-prime-E", "empty-experts-zero-weight-grad", "tma-one-expert-many-row-tiles",
                     "tma-expert-parallel-slice", "tma-fp16")


@pytest.mark.parametrize("T,K,E,start,NR,H,I,pattern,dtype", CASES)
def test_tma_launchers_match_per_expert_mm(launched, T, K, E, start, NR, H, I, pattern, dtype):
    """Every launcher of the engine, both weight orientations of the down GEMM, on worst-case row
    buffers with NaN past RT, against one ``torch.mm`` per expert in fp64."""
    g = torch.Generator().manual_seed(1)
    idx = _routing(T, K, E, pattern)
    cum, input_idx, RT, R = _buffers(idx, start, NR, T, K)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gu = (torch.randn(NR, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w_d = (torch.randn(NR, H, I, generator=g) / I ** 0.5).to(dtype)
    h_in = _rows(R, RT, I, dtype, g)
    dy = _rows(R, RT, H, dtype, g)
    rw = torch.full((R,), float("nan"))
    rw[:RT] = torch.rand(RT, generator=g)
    d64 = lambda t: t.double()  # noqa: E731
    xs = d64(x)[input_idx[:RT].long()]

    gate_up, h = tma_gemm.gate_up_fwd(x, input_idx, cum, w_gu)
    want_gu = torch.cat(_per_expert(cum, lambda e, a, b: xs[a:b] @ d64(w_gu[e]).t()), 0)
    want_h = torch.nn.functional.silu(want_gu[:, :I]) * want_gu[:, I:]
    assert_close(gate_up[:RT], want_gu, dtype, "gate_up")
    assert_close(h[:RT], want_h, dtype, "h")

    want_y = torch.cat(_per_expert(cum, lambda e, a, b: d64(h_in[a:b]) @ d64(w_d[e]).t()), 0)
    assert_close(tma_gemm.down_fwd(h_in, cum, w_d)[:RT], want_y, dtype, "down_fwd")
    w_d_t = w_d.transpose(1, 2).contiguous()  # stored [NR, I, H]
    assert_close(tma_gemm.down_fwd(h_in, cum, w_d_t, transposed=True)[:RT], want_y, dtype, "down_fwd[transposed]")

    want_dh = torch.cat(_per_expert(cum, lambda e, a, b: d64(dy[a:b]) @ d64(w_d[e])), 0)
    want_dw = torch.stack(_per_expert(cum, lambda e, a, b: d64(dy[a:b]).t() @ d64(h_in[a:b])))
    dh, dw = tma_gemm.down_bwd(dy, h_in, cum, w_d)
    assert_close(dh[:RT], want_dh, dtype, "down_bwd dh")
    assert_close(dw, want_dw, dtype, "down_bwd dw")
    dh_t, dw_t = tma_gemm.down_bwd(dy, h_in, cum, w_d_t, transposed=True)
    assert_close(dh_t[:RT], want_dh, dtype, "down_bwd[transposed] dh")
    assert_close(dw_t, want_dw.transpose(1, 2), dtype, "down_bwd[transposed] dw")

    gu_rows = _rows(R, RT, 2 * I, dtype, g)
    gu64 = d64(gu_rows[:RT])
    h64 = torch.nn.functional.silu(gu64[:, :I]) * gu64[:, I:]
    dh_w, dw_w, d_rw = tma_gemm.down_weighted_bwd(dy, gu_rows, rw, cum, w_d)
    assert_close(dh_w[:RT], want_dh * rw[:RT, None].double(), dtype, "down_weighted_bwd dh")
    assert_close(d_rw[:RT], (want_dh * h64).sum(1), dtype, "down_weighted_bwd d_row_weights")
    want_dw_w = torch.stack(_per_expert(cum, lambda e, a, b: d64(dy[a:b]).t() @ (h64[a:b] * rw[a:b, None].double())))
    assert_close(dw_w, want_dw_w, dtype, "down_weighted_bwd dw")

    d_gu = _rows(R, RT, 2 * I, dtype, g)
    dx_rows, dw_gu = tma_gemm.gate_up_bwd(d_gu, x, input_idx, cum, w_gu)
    assert_close(dx_rows[:RT], torch.cat(_per_expert(cum, lambda e, a, b: d64(d_gu[a:b]) @ d64(w_gu[e])), 0),
                 dtype, "gate_up_bwd dx")
    assert_close(dw_gu, torch.stack(_per_expert(cum, lambda e, a, b: d64(d_gu[a:b]).t() @ xs[a:b])), dtype,
                 "gate_up_bwd dw")
    if pattern == "low_half":  # experts without rows: exactly zero weight gradients
        empty = [e for e in range(NR) if cum[e] == cum[e + 1]]
        assert empty and all(torch.count_nonzero(t[empty]) == 0 for t in (dw, dw_t, dw_w, dw_gu))
    assert TMA_KERNELS <= set(launched) and "_grouped_mm_fwd_kernel" not in launched
    assert "_grouped_mm_bwd_kernel" not in launched and "_gate_up_fwd_kernel" not in launched


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tma_engine_through_autograd_matches_reference(launched, backend):
    """Stages 2-5 with stage 4 on ``triton_tma`` as the block runs them (forward and backward through
    the experts op) against the mask-based reference: output, input, router-weight and both weight
    gradients; uneven routing with an expert that gets nothing."""
    T, K, E, H, I = 29, 3, 6, 28, 36
    torch.manual_seed(0)
    idx = _routing(T, K, E - 1, "random")
    idx = idx + (idx >= 4).long()  # experts 0-3 and 5: expert 4 gets no rows
    x, w = torch.randn(T, H), torch.rand(T, K)
    w_gu, w_d, g = torch.randn(E, 2 * I, H) / H ** 0.5, torch.randn(E, H, I) / I ** 0.5, torch.randn(T, H)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w_gu, w_d)]
    want = reference.reference_experts_forward(*leaves[:2], idx, *leaves[2:], expert_start=0)
    want_grads = torch.autograd.grad(want, leaves, g)
    args = [t.detach().clone().requires_grad_() for t in (x, w, w_gu, w_d)]
    got = moe_experts_forward(*args[:2], idx, *args[2:], backend=backend, expert_start=0, gemm_engine="triton_tma")
    grads = torch.autograd.grad(got, args, g)
    assert_close(got, want, torch.float32, "output")
    for name, a, b in zip(("x", "weights", "gate_up_proj", "down_proj"), grads, want_grads):
        assert_close(a, b, torch.float32, f"d{name}")
    assert torch.count_nonzero(grads[2][4]) == 0 and torch.count_nonzero(grads[3][4]) == 0
    assert TMA_KERNELS <= set(launched)
    # the engine's fused down backward: the SiLU*up gradient in the router-weight pass, no silu_mul_bwd
    assert launched["_row_dot_scale_kernel"] == 1 and "_silu_mul_bwd_kernel" not in launched


def test_unaligned_widths_run_the_plain_kernels(launched):
    """H=33 in fp32 gives rows of 132 bytes, which no TMA descriptor takes: the call runs the plain
    Triton kernels instead, with the same results."""
    T, K, E, H, I = 13, 2, 4, 33, 20
    idx = _routing(T, K, E, "random")
    cum, input_idx, RT, R = _buffers(idx, 0, E, T, K)
    x, w_gu = torch.randn(T, H), torch.randn(E, 2 * I, H)
    assert not tma_gemm.descriptor_ready(x.new_empty(R, H)) and tma_gemm.descriptor_ready(x.new_empty(R, 36))
    gate_up, _ = tma_gemm.gate_up_fwd(x, input_idx, cum, w_gu)
    want = torch.cat(_per_expert(cum, lambda e, a, b: x[input_idx[a:b].long()] @ w_gu[e].t()), 0)
    assert_close(gate_up[:RT], want, torch.float32, "gate_up")
    assert set(launched) == {"_gate_up_fwd_kernel"}


def test_auto_keeps_tma_off_the_cpu():
    """The engine runs on CPU tensors only when asked for by name under the interpreter; auto never
    times or picks it there, and without the interpreter it says why it cannot run."""
    for backend in registry.BASES:
        assert "triton_tma" not in registry.candidates(backend, "cpu", torch.float32)
    assert registry.unavailable_reason("triton_tma", "torch", "cpu", torch.float32) is None  # interpreter on
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        assert "TRITON_INTERPRET=1" in registry.unavailable_reason("triton_tma", "torch", "cpu", torch.float32)
    assert "runs on cpu/cuda" in registry.unavailable_reason("triton_tma", "torch", "xpu", torch.float32)
    assert registry.kernels("triton+triton_tma").gate_up_fwd is tma_gemm.gate_up_fwd
    assert registry.kernels("triton+triton_tma").silu_mul_bwd is registry.kernels("triton").silu_mul_bwd

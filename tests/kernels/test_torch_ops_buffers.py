"""The torch backend's CPU buffer cache: reuse only what nobody holds, and training semantics intact."""
import pytest
import torch

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu import settings
from fastmoe_xpu.kernels import torch as ops
from fastmoe_xpu.kernels.torch import buffers
from tolerances import assert_close

MB = 1 << 20


@pytest.fixture
def cache():
    c = buffers._CpuBufferCache()
    c.enabled = True
    return c


def test_buffer_is_reused_only_when_idle(cache):
    a = cache.empty((MB // 4,), torch.float32, torch.device("cpu"))  # 1 MiB: cached
    a.fill_(1.0)
    b = cache.empty((MB // 4,), torch.float32, torch.device("cpu"))
    assert a.data_ptr() != b.data_ptr()  # a is alive: never handed out twice
    ptr = a.data_ptr()
    del a
    c = cache.empty((MB // 4,), torch.float32, torch.device("cpu"))
    assert c.data_ptr() == ptr  # a's storage came back
    assert b.data_ptr() != ptr


def test_views_keep_a_buffer_alive(cache):
    a = cache.empty((2, MB // 8), torch.float32, torch.device("cpu"))
    view = a[1]
    ptr = a.data_ptr()
    del a
    b = cache.empty((2, MB // 8), torch.float32, torch.device("cpu"))
    assert b.data_ptr() != ptr  # the view still refers to the storage
    del view


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((3, 5), torch.float32),  # under the threshold: plain allocation, not cached
        ((513, 1031), torch.float32),  # odd sizes: rounded up to a size class
        ((700, 1024), torch.bfloat16),  # 2-byte dtype
    ],
)
def test_shapes_and_dtypes(cache, shape, dtype):
    t = cache.empty(shape, dtype, torch.device("cpu"))
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def test_idle_limit_releases_other_size_classes(cache):
    cache.max_idle = 0
    a = cache.empty((MB,), torch.float32, torch.device("cpu"))
    del a
    cache.empty((3 * MB,), torch.float32, torch.device("cpu"))
    assert all(len(v) <= 1 for v in cache.pool.values())
    assert sum(len(v) for v in cache.pool.values()) == 1  # the idle 4 MiB block was dropped


def _layer(T=512, H=256, I=128, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    wgu = (torch.randn(E, 2 * I, H, generator=g) * 0.05).requires_grad_()
    wd = (torch.randn(E, H, I, generator=g) * 0.05).requires_grad_()
    return x, idx, w, wgu, wd


def test_gradients_accumulate_across_steps_with_cached_buffers():
    # Large enough that the row buffers and weight gradients (>= 1 MiB) come from the cache.
    x, idx, w, wgu, wd = _layer()
    moe_experts_forward(x, w, idx, wgu, wd).sum().backward()
    g1 = (wgu.grad.clone(), wd.grad.clone())
    keep = wgu.grad  # held by the caller: must not be overwritten by the next step
    snapshot = keep.clone()
    moe_experts_forward(x, w, idx, wgu, wd).sum().backward()  # accumulates into .grad
    assert_close(wgu.grad, 2 * g1[0])
    assert_close(wd.grad, 2 * g1[1])
    wgu.grad = None
    wd.grad = None
    moe_experts_forward(x * 2, w, idx, wgu, wd).sum().backward()  # fresh gradients, buffers recycled
    torch.testing.assert_close(keep, 2 * snapshot)  # keep is wgu's accumulated grad of step 2, untouched
    assert not torch.equal(wgu.grad, g1[0])


def test_outputs_held_by_the_caller_survive_later_calls():
    x, idx, w, wgu, wd = _layer()
    _, pcum, _, cexp, ctok = ops.count_tokens(idx, 0, 4, 8)
    inp, _, _ = ops.build_indices(idx, pcum, cexp, 0, 4, 8)
    gu1, h1 = ops.gate_up_fwd(x, inp, ctok, wgu.detach())
    before = gu1.clone()
    gu2, _ = ops.gate_up_fwd(x * 3, inp, ctok, wgu.detach())
    assert gu1.data_ptr() != gu2.data_ptr()
    assert torch.equal(gu1, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("expert_start,num_local", [(0, 8), (3, 2)])  # all slots local; an EP slice
def test_row_sums_match_embedding_bag_and_ignore_stale_buffers(monkeypatch, dtype, expert_start, num_local):
    """combine_fwd's sparse-CSR product (fp32/fp64 on the CPU) writes into a recycled buffer:
    it must equal the embedding_bag path bit for bit-ish, tokens without local rows must come out
    as exact zeros, and NaN left in the buffer by its previous user must not leak in."""
    T, H, E, K = 1000, 300, 8, 3  # [T, H] fp32 output > 1 MiB: it comes from the buffer cache
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    _, pcum, _, cexp, ctok = ops.count_tokens(idx, expert_start, num_local, 8)
    _, out_idx, sel = ops.build_indices(idx, pcum, cexp, expert_start, num_local, 8)
    y = torch.randn(int(ctok[-1]), H, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g).to(dtype)
    tol = torch.float32 if dtype == torch.float64 else dtype  # fp64: held to fp32's (tighter) table
    results = {}
    for csr in (True, False):
        monkeypatch.setattr(ops.combine, "_MKL", csr)
        with settings.override(cpu_csr=csr):
            for weights in (w, None):
                stale = buffers.cached_empty((T, H), y)
                stale.fill_(float("nan"))
                del stale  # idle again: the next [T, H] buffer of this size class is this one
                results[csr, weights is None] = ops.combine_fwd(y, weights, out_idx, sel, cexp)
    for unweighted in (False, True):
        got, want = results[True, unweighted], results[False, unweighted]
        assert not got.isnan().any()
        assert_close(got, want, tol, f"csr vs embedding_bag (unweighted={unweighted})")
        no_rows = (cexp[1:] == cexp[:-1])
        assert (expert_start, num_local) == (0, 8) or no_rows.any()
        assert torch.equal(got[no_rows], torch.zeros_like(got[no_rows]))
    # the reference: the sum written out slot by slot
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for i in range(int(cexp[t]), int(cexp[t + 1])):
            k = int(sel[i])
            ref[t] += float(w[t, k]) * y[int(out_idx[i])].double()
    assert_close(results[True, False], ref.to(dtype), tol, "csr vs slot-by-slot sum")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_release_buffers_returns_idle_memory():
    """fastmoe_xpu.release_buffers() empties the process-wide pool: its idle buffers go back to the
    operating system (glibc unmaps allocations this large at free), buffers in use stay valid."""
    import fastmoe_xpu

    if not buffers._CACHE.enabled:
        pytest.skip("the CPU buffer cache is off here (FASTMOE_CPU_CACHE=0 or an older torch)")
    fastmoe_xpu.release_buffers()
    held = buffers.cached_empty((8 * MB,), torch.empty(0))  # 32 MiB, stays in use
    held.fill_(2.0)
    idle = buffers.cached_empty((16 * MB,), torch.empty(0))  # 64 MiB, touched then idle
    idle.fill_(1.0)
    del idle
    assert buffers._CACHE.idle_bytes() >= 64 * MB
    before = _rss_bytes()
    freed = fastmoe_xpu.release_buffers()
    assert freed >= 64 * MB
    assert buffers._CACHE.idle_bytes() == 0
    assert before - _rss_bytes() >= 48 * MB  # the pages really left the process
    assert torch.equal(held, torch.full_like(held, 2.0))  # the buffer in use is untouched


def test_idle_bound_is_a_setting():
    with settings.override(cpu_cache_idle_mb=3.0):
        c = buffers._CpuBufferCache(enabled=True)
    assert c.max_idle == 3 * MB

"""Grouped-GEMM engines (kernels/registry.py): every engine equals the references, gradients
included, at the suite's awkward shapes; the measured choice picks the fastest, survives a corrupt
cache and agrees across expert-parallel ranks.

Device-aware: ``--device cuda`` runs the engines on the GPU with compiled Triton kernels; on the
CPU (the default) the triton engine runs under the interpreter, on the Triton backend's
worst-case row buffers.
"""
from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from fastmoe_xpu import FastSparseMoeBlock, reference, settings
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.dist.testing import run_distributed
from fastmoe_xpu.kernels import registry, timing
from fastmoe_xpu.kernels.contract import LAUNCHERS, STAGE4_LAUNCHERS
from stage4_shapes import stage4_cases
from tolerances import assert_close

# Rows past RT of the Triton backend's buffers are uninitialised; SiLU's backward runs over them.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _routing(T: int, K: int, E: int, pattern: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if pattern == "low_half":  # experts E/2 .. E-1 receive nothing
        rows = [torch.randperm(E // 2, generator=g)[:K].tolist() for _ in range(T)]
    elif pattern == "one_expert":
        rows = [[3] + [e for e in torch.randperm(E, generator=g).tolist() if e != 3][: K - 1] for _ in range(T)]
    else:
        rows = [torch.randperm(E, generator=g)[:K].tolist() for _ in range(T)]
    return torch.tensor(rows, dtype=torch.int64).reshape(T, K)


def _backends(device: torch.device) -> list[str]:
    """Kernel backends whose row buffers the engines run on: the Triton backend's (worst case, rows
    past RT unspecified) wherever triton can run, the torch backend's (exact) on the CPU."""
    out = ["torch"] if device.type == "cpu" else []
    if registry.unavailable_reason("triton", "triton", device, torch.float32) is None:
        out.append("triton")
    return out


def _interpreted_triton(engine: str, device: torch.device) -> bool:
    """Whether ``engine`` is Triton kernels that run in the interpreter here (CPU tensors)."""
    return device.type == "cpu" and registry.IMPLEMENTATIONS[engine].module.startswith(".triton")


# The stage-4 shapes of tests/kernels/test_triton_kernels.py but T below a block (tests/stage4_shapes.py).
CASES = stage4_cases("odd-H-I-prime-E", "K1-I-above-H", "all-tokens-to-one-expert", "empty-experts-zero-weight-grad",
                     "expert-parallel-start-3", "bf16-fp32-accumulation")


@pytest.mark.parametrize("engine", registry.ENGINES)
@pytest.mark.parametrize("T,K,E,start,num_local,H,I,pattern,dtype", CASES)
def test_engine_matches_reference(device, engine, T, K, E, start, num_local, H, I, pattern, dtype):
    """Stages 2-5 with ``engine`` running stage 4 (through autograd, as the block runs them) equal
    the mask-based reference: output, input, router-weight and both weight gradients."""
    if _interpreted_triton(engine, device) and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 tl.dot multiplies raw bits (triton-lang/triton#11584); "
                    "test_triton_kernels.py patches it for its own bf16 cases, the GPU run covers this one")
    torch.manual_seed(0)
    idx = _routing(T, K, E, pattern).to(device)
    x = torch.randn(T, H, device=device, dtype=dtype)
    w = torch.rand(T, K, device=device, dtype=dtype)
    w_gu = (torch.randn(num_local, 2 * I, H, device=device) / H ** 0.5).to(dtype)
    w_d = (torch.randn(num_local, H, I, device=device) / I ** 0.5).to(dtype)
    g = torch.randn(T, H, device=device, dtype=dtype)
    leaves = [t.float().detach().requires_grad_() for t in (x, w, w_gu, w_d)]
    want = reference.reference_experts_forward(*leaves[:2], idx, *leaves[2:], expert_start=start)
    want_grads = torch.autograd.grad(want, leaves, g.float())
    ran = 0
    for backend in _backends(device):
        reason = registry.unavailable_reason(engine, backend, device, dtype)
        if reason is not None:
            continue
        ran += 1
        args = [t.detach().clone().requires_grad_() for t in (x, w, w_gu, w_d)]
        got = moe_experts_forward(args[0], args[1], idx, args[2], args[3], backend=backend, expert_start=start,
                                  gemm_engine=engine)
        grads = torch.autograd.grad(got, args, g)
        assert_close(got, want, dtype, f"{backend}+{engine} output")
        for name, a, b in zip(("x", "weights", "gate_up_proj", "down_proj"), grads, want_grads):
            assert_close(a, b, dtype, f"{backend}+{engine} d{name}")
        if pattern == "low_half":  # experts without rows get exactly zero weight gradients
            assert torch.count_nonzero(grads[2][E // 2:]) == 0 and torch.count_nonzero(grads[3][E // 2:]) == 0
    if not ran:
        pytest.skip(f"{engine} cannot run on {device} in {dtype}: "
                    f"{registry.unavailable_reason(engine, _backends(device)[0], device, dtype)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_on_the_device_with_every_engine(device, dtype):
    """The whole block (router included) on the test device with each engine its default backend
    can run (compiled Triton on a GPU), against the same weights on the CPU's loop engine in fp32."""
    torch.manual_seed(0)
    ref = FastSparseMoeBlock(_cfg(40, 24, 6, 2), backend="torch", gemm_engine="loop")
    x = torch.randn(2, 13, 40)
    g = torch.randn(2, 13, 40)
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.backward(g)
    backend = "triton" if device.type != "cpu" else "torch"
    ran = []
    for engine in registry.ENGINES:
        if registry.unavailable_reason(engine, backend, device, dtype) or _interpreted_triton(engine, device):
            continue
        block = FastSparseMoeBlock(_cfg(40, 24, 6, 2), backend=backend, gemm_engine=engine)
        block.load_state_dict(ref.state_dict())
        block.to(device=device, dtype=dtype)
        xx = x.to(device=device, dtype=dtype).detach().clone().requires_grad_()
        out = block(xx)
        out.backward(g.to(device=device, dtype=dtype))
        assert_close(out.cpu(), want, dtype, f"{engine} output")
        assert_close(xx.grad.cpu(), xr.grad, dtype, f"{engine} dx")
        for name, p in ref.named_parameters():
            assert_close(dict(block.named_parameters())[name].grad.cpu(), p.grad, dtype, f"{engine} d{name}")
        ran.append(engine)
    assert ran, f"no engine runs {backend} on {device} in {dtype}"


def test_grouped_mm_runs_on_this_cpu_for_float_dtypes():
    """What torch 2.13 offers on the CPU, measured here: grouped_mm for fp32, bf16 and fp16, not fp64
    (so the engine is a real candidate here, and fp64 blocks keep the loop)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert registry.unavailable_reason("grouped_mm", "torch", "cpu", dtype) is None, dtype
    assert "Double" in registry.unavailable_reason("grouped_mm", "torch", "cpu", torch.float64)
    assert registry.candidates("torch", "cpu", torch.float64) == ["loop"]


def test_engines_compose_with_the_backend_by_the_contract():
    """Stage 4 from the engine, stages 2, 3 and 5 (and grouped_mm's missing silu_mul_bwd) from the
    backend; the native pairing is the backend itself."""
    ops = registry.kernels("torch")
    assert registry.kernels("torch+loop") is ops
    mixed = registry.kernels("torch+grouped_mm")
    assert mixed is registry.kernels("torch+grouped_mm")
    from fastmoe_xpu.kernels import grouped_mm

    for name in LAUNCHERS:
        expected = grouped_mm if name in grouped_mm.LAUNCHERS else ops
        assert getattr(mixed, name) is getattr(expected, name), name
    assert set(grouped_mm.LAUNCHERS) < set(STAGE4_LAUNCHERS)
    with pytest.raises(ValueError, match="unknown gemm engine"):
        registry.kernels("torch+cutlass")
    with pytest.raises(ValueError, match="gemm_engine must be one of"):
        FastSparseMoeBlock(_cfg(16, 8, 4, 2), gemm_engine="fast")


# ---------------------------------------------------------------- the measured choice
def _cfg(H: int, I: int, E: int, K: int) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                           norm_topk_prob=True, hidden_act="silu")


@pytest.fixture
def cache_file(tmp_path):
    """A private cache file and no remembered choices; auto not pinned by the suite's setting."""
    path = tmp_path / "engines.json"
    registry.forget_choices()
    with settings.override(gemm_cache=str(path), gemm_engine=None):
        yield path
    registry.forget_choices()


def _choose(measure, shape=(16, 8, 4, 64), **kw):
    return registry.choose_engine("auto", backend="torch", device="cpu", dtype=torch.float32, shape=shape,
                                 measure=measure, **kw)


_CPU_CANDIDATES = registry.candidates("torch", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("fastest", _CPU_CANDIDATES)
def test_chooser_picks_the_fastest_and_caches_it(cache_file, fastest):
    assert {"loop", "grouped_mm"} <= set(_CPU_CANDIDATES)
    times = dict.fromkeys(_CPU_CANDIDATES, 2.0)
    times[fastest] = 1.0
    calls: list[str] = []

    def measure(engine):
        calls.append(engine)
        return times[engine]

    assert _choose(measure) == fastest
    # A warm-up call each, then interleaved rounds of one sample each; the samples agree, so the
    # timing stops after the fewest rounds.
    n = len(_CPU_CANDIDATES)
    assert sorted(calls) == sorted(_CPU_CANDIDATES * (1 + timing.MIN_ROUNDS))
    assert all(sorted(calls[i:i + n]) == sorted(_CPU_CANDIDATES) for i in range(0, len(calls), n))
    assert calls[n:2 * n] != calls[2 * n:3 * n]  # the order rotates from round to round
    timed = len(calls)
    assert _choose(measure) == fastest and len(calls) == timed  # in-process: no second timing
    data = json.loads(cache_file.read_text())
    (key, entry), = data["entries"].items()
    assert entry["engine"] == fastest and entry["seconds"] == times and entry["rows"] == 64
    # How it was timed is kept with it.
    assert entry["timed"]["rounds"] == timing.MIN_ROUNDS and entry["timed"]["reason"] == "first use"
    assert entry["timed"]["samples"] == {e: [t] * timing.MIN_ROUNDS for e, t in times.items()}
    assert entry["timed"]["starved"] == dict.fromkeys(times, 0)
    assert f"torch={torch.__version__}" in key and key.startswith("cpu:") and "rows<=64" in key
    registry.forget_choices()
    assert _choose(lambda e: pytest.fail("a cached choice is not timed again")) == fastest  # from disk
    # Another shape bucket is timed on its own.
    assert _choose(lambda e: 1.0 if e == "loop" else 3.0, shape=(16, 8, 4, 1000)) == "loop"
    assert len(json.loads(cache_file.read_text())["entries"]) == 2


def test_a_cached_choice_missing_a_candidate_is_timed_again(cache_file):
    """A cache written before an engine existed (or ran here) names a choice among fewer engines:
    it is timed again with every candidate, not trusted."""
    assert _choose(lambda e: 1.0 if e == "loop" else 2.0) == "loop"
    data = json.loads(cache_file.read_text())
    (key, entry), = data["entries"].items()
    entry["seconds"] = {"loop": 1.0, "grouped_mm": 2.0}  # as written before a third engine
    entry["engine"] = "grouped_mm"
    cache_file.write_text(json.dumps(data))
    registry.forget_choices()
    timed: list[str] = []
    fastest = _CPU_CANDIDATES[-1]

    def measure(engine):
        timed.append(engine)
        return 1.0 if engine == fastest else 2.0

    if len(_CPU_CANDIDATES) > 2:
        assert _choose(measure) == fastest and set(timed) == set(_CPU_CANDIDATES)
        assert set(json.loads(cache_file.read_text())["entries"][key]["seconds"]) == set(_CPU_CANDIDATES)
    else:  # every candidate was timed: the cached choice holds
        assert _choose(measure) == "grouped_mm" and not timed


def test_explicit_engine_and_setting_win_over_timing(cache_file):
    never = lambda e: pytest.fail("not timed")  # noqa: E731
    assert registry.choose_engine("grouped_mm", backend="torch", device="cpu", dtype=torch.float32,
                                 shape=(16, 8, 4, 64), measure=never) == "grouped_mm"
    with settings.override(gemm_engine="native"):
        assert _choose(never) == "loop"
    with settings.override(gemm_engine="grouped_mm"):
        assert _choose(never) == "grouped_mm"
    with pytest.raises(ValueError, match="cannot run here"):
        registry.choose_engine("grouped_mm", backend="torch", device="cpu", dtype=torch.float64,
                              shape=(16, 8, 4, 64), measure=never)
    assert not cache_file.exists()


@pytest.mark.parametrize("content", ["{not json", '{"format": 99, "entries": {}}', "[1, 2]",
                                     '{"format": 2, "entries": {"k": {"engine": "cutlass"}}}'],
                         ids=["corrupt", "other-format", "not-an-object", "stale-engine"])
def test_corrupt_or_stale_cache_warns_and_is_replaced(cache_file, content):
    cache_file.write_text(content)
    with pytest.warns(RuntimeWarning, match="gemm engine cache"):
        assert _choose(lambda e: 1.0 if e == "loop" else 2.0) == "loop"
    data = json.loads(cache_file.read_text())  # rewritten whole and valid
    assert data["format"] == timing.FORMAT and [v["engine"] for v in data["entries"].values()] == ["loop"]


def test_a_cache_of_the_unchecked_format_is_timed_again_quietly(cache_file):
    """Format 1 files were written from timings nobody checked (one pass, maybe under load): their
    choices are not used, without a warning, and the file is rewritten in the current format."""
    key = timing.entry_key(timing.device_name("cpu"), registry.ShapeKey("torch", "float32", 16, 8, 4, 64))
    cache_file.write_text(json.dumps({"format": 1, "entries": {key: {
        "engine": "grouped_mm", "seconds": dict.fromkeys(_CPU_CANDIDATES, 1.0), "saved": "2020-01-01T00:00:00Z"}}}))
    timed: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _choose(lambda e: timed.append(e) or (1.0 if e == "loop" else 2.0)) == "loop"
    assert set(timed) == set(_CPU_CANDIDATES)
    data = json.loads(cache_file.read_text())
    assert data["format"] == timing.FORMAT and data["entries"][key]["engine"] == "loop"


def test_unwritable_cache_location_warns_and_keeps_the_choice(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    registry.forget_choices()
    with settings.override(gemm_cache=str(blocker / "sub" / "engines.json"), gemm_engine=None):
        with pytest.warns(RuntimeWarning, match="not written"):
            assert _choose(lambda e: 1.0 if e == "grouped_mm" else 3.0) == "grouped_mm"
        assert _choose(lambda e: pytest.fail("remembered in-process")) == "grouped_mm"
    registry.forget_choices()


def test_block_auto_times_once_on_real_shapes_and_matches_native(cache_file, monkeypatch):
    """A block with the default gemm_engine='auto' times the engines with the real timer at its
    first forward, writes the cache, and computes what the native engine computes. The layer is
    above the small-layer budgets (``max(T*K, NR)*3*H*I`` = 27 Mi MAC), where no ``experts``
    implementation stands in for the staged chain (tests/kernels/test_padded_experts.py) and ``auto``
    times its engines (below ``registry.SMALL_LAYER_MACS`` it takes one untimed). The
    checks of a timing are relaxed (every sample trusted, as on a quiet machine): whether this
    machine is quiet is not the test's business (tests/kernels/test_engine_trust.py)."""
    monkeypatch.setattr(timing, "STARVED_WAIT", float("inf"))
    monkeypatch.setattr(timing, "STARVED_CPU", 0.0)
    monkeypatch.setattr(timing, "AGREE", float("inf"))
    torch.manual_seed(0)
    auto = FastSparseMoeBlock(_cfg(128, 64, 6, 2), backend="torch")
    native = FastSparseMoeBlock(_cfg(128, 64, 6, 2), backend="torch", gemm_engine="native")
    native.load_state_dict(auto.state_dict())
    x = torch.randn(2, 288, 128)
    assert registry.layer_macs(2 * 288, 2, 128, 64, 6) > registry.SMALL_LAYER_MACS
    outs = []
    for block in (auto, native):
        xx = x.clone().requires_grad_()
        out = block(xx)
        out.sum().backward()
        outs.append((out, xx.grad, block.experts.gate_up_proj.grad))
    for a, b in zip(*outs):
        assert_close(a, b)
    (entry,) = json.loads(cache_file.read_text())["entries"].values()
    assert entry["engine"] in _CPU_CANDIDATES and set(entry["seconds"]) == set(_CPU_CANDIDATES)
    assert all(s > 0 for s in entry["seconds"].values())
    assert all(0 < entry["forward"][e] < entry["seconds"][e] for e in _CPU_CANDIDATES)
    assert entry["rows"] == 2 * 288 * 2 and entry["timed"]["threads"] == torch.get_num_threads()
    assert all(len(v) == timing.MIN_ROUNDS for v in entry["timed"]["samples"].values())
    assert entry["timed"]["check"] in ("run-queue wait", "thread CPU time")


def test_timer_counts_this_threads_cpu_time_on_a_one_thread_cpu():
    """On a one-thread CPU the choice is timed in this thread's CPU time, so that another process
    holding the core does not count; a sleep (no CPU work) then costs nothing. Wall time otherwise."""
    import time

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert timing.clock(torch.device("cpu")) is time.thread_time
        slept = timing.best_seconds(lambda: time.sleep(0.02), torch.device("cpu"), 1)
        assert slept < 0.01, slept
        torch.set_num_threads(2)
        assert timing.clock(torch.device("cpu")) is time.perf_counter
        assert timing.best_seconds(lambda: time.sleep(0.02), torch.device("cpu"), 1) >= 0.02
    finally:
        torch.set_num_threads(threads)


def test_cache_location_default_and_override(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with settings.override(gemm_cache=None):
        assert timing.cache_path() == tmp_path / "fastmoe_xpu" / "gemm_engines.json"
    with settings.override(gemm_cache=str(tmp_path / "x.json")):
        assert timing.cache_path() == tmp_path / "x.json"


def _rank_choice(cache_dir: str) -> tuple[str, list[str]]:
    """One rank of an EP group of 2: each rank's timer says a different engine is fastest (rank 0:
    grouped_mm, rank 1: loop); every rank must come out with rank 0's choice, and only rank 0 times."""
    import torch.distributed as dist

    rank = dist.get_rank()
    timed: list[str] = []

    def measure(engine):
        timed.append(engine)
        fast = "grouped_mm" if rank == 0 else "loop"
        return 1.0 if engine == fast else 2.0

    group = dist.new_group([0, 1])
    with settings.override(gemm_cache=f"{cache_dir}/rank{rank}.json", gemm_engine=None):
        choice = registry.choose_engine("auto", backend="torch", device="cpu", dtype=torch.float32,
                                       shape=(16, 8, 2, 64 + 40 * rank), measure=measure, group=group)
    return choice, timed


def test_expert_parallel_ranks_agree_on_rank0_choice(tmp_path):
    results = run_distributed(_rank_choice, 2, str(tmp_path), timeout_s=120.0, comm_timeout_s=60.0, fail_fast=True)
    assert [c for c, _ in results] == ["grouped_mm", "grouped_mm"]
    assert sorted(results[0][1]) == sorted(_CPU_CANDIDATES * (1 + timing.MIN_ROUNDS)) and results[1][1] == []


def test_interpreted_triton_is_never_timed():
    """Under the interpreter, auto on the Triton backend is its own engine: timing an interpreter
    would always pick something else and leave the Triton kernels untested."""
    assert registry.candidates("triton", "cpu", torch.float32) == ["triton"]
    with settings.override(gemm_engine=None):
        assert registry.choose_engine("auto", backend="triton", device="cpu", dtype=torch.float32,
                                     shape=(16, 8, 4, 64), measure=lambda e: pytest.fail("timed")) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.rows_bucket(0) == 1 and registry.rows_bucket(64) == 64 and registry.rows_bucket(65) == 128

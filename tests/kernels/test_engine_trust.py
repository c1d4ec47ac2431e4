"""The ``auto`` engine choice on a loaded machine (kernels/timing.py, kernels/registry.py): a timing is
trusted only when its interleaved samples ran unstarved and agree; an untrusted choice is used but
not stored, and timed again later; a stored choice whose layer runs far slower than its stored time
is timed again in use.

Speed itself is the benchmark's (``python -m bench engine_choice``); these tests check the rules
with injected samples, and with real busy processes that a loaded timing is not stored.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from fastmoe_xpu import FastSparseMoeBlock, settings
from fastmoe_xpu.kernels import registry, timing
from fastmoe_xpu.kernels.timing import Sample

_CANDIDATES = registry.candidates("torch", torch.device("cpu"), torch.float32)
_SHAPE = (16, 8, 4, 64)


@pytest.fixture
def cache_file(tmp_path):
    """A private cache, no remembered choices, auto not pinned; and one torch thread, the setting of
    a loaded machine (two threads on two busy cores spend most of their time at barriers)."""
    path = tmp_path / "engines.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    registry.forget_choices()
    try:
        with settings.override(gemm_cache=str(path), gemm_engine=None):
            yield path
    finally:
        torch.set_num_threads(threads)
        registry.forget_choices()


@pytest.fixture
def unknown_load(monkeypatch):
    """The process's run-queue wait unknown: a check in use takes every stretch for a quiet one (the
    injected samples say whether a timing was starved)."""
    monkeypatch.setattr(timing, "run_queue_wait_ns", lambda: None)


@pytest.fixture
def quiet(monkeypatch):
    """Every sample counts as unstarved and agreeing: the rules under test are the registry's, not
    whether this machine is quiet."""
    monkeypatch.setattr(timing, "STARVED_WAIT", float("inf"))
    monkeypatch.setattr(timing, "STARVED_CPU", 0.0)
    monkeypatch.setattr(timing, "AGREE", float("inf"))


def _choice(measure, check=False, shape=_SHAPE):
    return registry.engine_choice("auto", backend="torch", device="cpu", dtype=torch.float32, shape=shape,
                                  measure=measure, check=check)


def _entries(path):
    return json.loads(path.read_text())["entries"] if path.exists() else {}


def test_judge_trusts_only_unstarved_agreeing_samples():
    clean = [Sample(1.0), Sample(1.05), Sample(1.3)]
    assert timing.judge({"a": clean, "b": [Sample(2.0)] * 3}) == ({"a": 1.0, "b": 2.0}, {"a": None, "b": None}, "")
    # A starved sample does not count, however fast; with fewer than two left, no trust.
    seconds, _, why = timing.judge({"a": [Sample(0.5, starved=True), Sample(1.0), Sample(1.02)],
                                    "b": [Sample(2.0, starved=True), Sample(2.1, starved=True), Sample(2.0)]})
    assert seconds["a"] == 1.0 and "b: 2 of 3 samples starved" in why
    # The two fastest unstarved samples must agree.
    _, _, why = timing.judge({"a": [Sample(1.0), Sample(1.5), Sample(1.6)], "b": [Sample(2.0)] * 2})
    assert why == "a: its fastest samples differ by 50%"
    # Where nothing ran unstarved, the fastest sample still decides in-process.
    seconds, _, why = timing.judge({"a": [Sample(3.0, starved=True), Sample(2.0, starved=True)]})
    assert seconds == {"a": 2.0} and why


def test_the_probe_tells_a_starved_sample(monkeypatch):
    """A sample is starved when the process's threads waited for a CPU longer than STARVED_WAIT of
    its wall time (the run-queue wait, faked here: the real one follows whatever else runs)."""
    if timing.run_queue_wait_ns() is None:
        pytest.skip("no /proc/self/task/*/schedstat here: the thread CPU time check applies")
    assert timing.starvation_check(torch.device("cpu")) == "run-queue wait"
    assert timing.starvation_check(torch.device("meta")) == "none"
    # ns read at start and stop: nothing waited; a second waited over a 20 ms sample
    waits = iter([5, 5, 0, 10**9])
    monkeypatch.setattr(timing, "run_queue_wait_ns", lambda: next(waits))
    probe = timing.Probe("run-queue wait")
    for starved in (False, True):
        probe.start()
        time.sleep(0.02)
        wall, seen = probe.stop()
        assert wall >= 0.02 and seen is starved
    probe = timing.Probe("thread CPU time")  # where the wait is not known: a sleep is not running
    probe.start()
    time.sleep(0.02)
    assert probe.stop()[1] is True


def test_a_busy_stretch_postpones_retiming(cache_file, monkeypatch):
    """A check in use re-times only after a stretch in which the process did not wait for a CPU: a
    timing now would be starved, and costs calls for nothing."""
    wait = [0]
    monkeypatch.setattr(timing, "run_queue_wait_ns", lambda: wait[0])
    engine, watch = _choice(lambda e: Sample(1.0 if e == "loop" else 2.0, 0.4, True))
    assert not watch.trusted
    measure = lambda e: Sample(1.0 if e == "loop" else 2.0, 0.4, False)  # noqa: E731
    while watch.calls < 4 * registry.RETIME_FIRST:
        wait[0] += 10**10  # 10 s of waiting between calls: busy
        _choice(measure, check=True)
        watch.saw(True, 0.4, 64)
    assert watch.retimes == 0 and not watch.trusted
    for _ in range(registry.CHECK_EVERY + 1):  # quiet again: timed at the next check
        _choice(measure, check=True)
        watch.saw(True, 0.4, 64)
    assert watch.retimes == 1 and watch.trusted


def test_an_untrusted_choice_is_used_not_stored_and_timed_again(cache_file, unknown_load):
    starved = [True]

    def measure(engine):
        return Sample(1.0 if engine == "grouped_mm" else 2.0, 0.4, starved[0])

    engine, watch = _choice(measure)
    assert engine == "grouped_mm" and not watch.trusted
    assert not cache_file.exists()  # used in this process, not written
    assert "not trusted" in watch.history[0][1] and "starved" in watch.history[0][1]
    starved[0] = False
    calls = 0
    while not watch.trusted:
        calls += 1
        assert calls <= registry.RETIME_FIRST + registry.CHECK_EVERY, "the untrusted choice was never timed again"
        engine, _ = _choice(measure, check=True)
        watch.saw(True, 0.4, 64)
    assert calls >= registry.RETIME_FIRST  # not at once: re-timing costs a timing's calls
    (entry,) = _entries(cache_file).values()
    assert entry["engine"] == "grouped_mm" and entry["timed"]["reason"] == "re-timed: the last timing was not trusted"
    assert watch.retime_at == 3 * registry.RETIME_FIRST  # the next try waits twice as long


def test_a_slow_stored_choice_is_timed_again_and_replaced(cache_file, unknown_load):
    """A stored choice (its timed speed on record) whose layer runs far slower in use is timed again;
    a trusted re-timing replaces and stores it."""
    timing.store(timing.device_name("cpu"), registry.ShapeKey("torch", "float32", 16, 8, 4, 64), "loop",
                 dict.fromkeys(_CANDIDATES, 1.0), forward=dict.fromkeys(_CANDIDATES, 0.4), rows=64,
                 timed={"reason": "first use"})
    timed: list[str] = []

    def measure(engine):
        timed.append(engine)
        return Sample(1.0 if engine == "onednn" or len(_CANDIDATES) == 2 and engine == "grouped_mm" else 2.5, 0.4)

    engine, watch = _choice(measure)
    assert engine == "loop" and watch.trusted and not timed  # from disk
    for _ in range(registry.CHECK_EVERY):  # running at its stored speed: no re-timing
        _choice(measure, check=True)
        watch.saw(True, 0.41, 64)
        watch.saw(False, 0.62, 64)
    # Calls of half the rows may take more than half the time (fixed costs): not slow either.
    for _ in range(registry.CHECK_EVERY):
        _choice(measure, check=True)
        watch.saw(True, 0.3, 32)
        watch.saw(False, 0.45, 32)
    assert not timed and watch.slowdown() < registry.SLOW
    for _ in range(registry.RETIME_FIRST):  # then 2.5x slower
        _choice(measure, check=True)
        watch.saw(True, 1.0, 64)
        watch.saw(False, 1.5, 64)
    assert timed, "the slow layer was not timed again"
    faster = "onednn" if "onednn" in _CANDIDATES else "grouped_mm"
    assert watch.engine == faster and _choice(measure)[0] == faster
    (entry,) = _entries(cache_file).values()
    assert entry["engine"] == faster and entry["timed"]["reason"].startswith("re-timed in use: loop ran 2.50x")


def test_a_loaded_retiming_keeps_a_trusted_choice(cache_file, unknown_load):
    """Slow because the machine is busy now, not because the choice is wrong: the re-timing is
    starved, the stored choice stays (in use and on disk), and the next try waits twice as long."""
    timing.store(timing.device_name("cpu"), registry.ShapeKey("torch", "float32", 16, 8, 4, 64), "loop",
                 dict.fromkeys(_CANDIDATES, 1.0), forward=dict.fromkeys(_CANDIDATES, 0.4), rows=64)
    before = cache_file.read_text()
    # Under load every engine is slow, each sample by however much the load hit it.
    loads = iter([3.0, 2.0, 3.5, 2.2, 4.0, 2.6] * 20)

    def measure(engine):
        return Sample(next(loads), 0.4, True)

    engine, watch = _choice(measure)

    def slow_call():
        _choice(measure, check=True)
        watch.saw(True, 1.2, 64)
        watch.saw(False, 1.8, 64)

    while not watch.retimes:
        assert watch.calls <= 2 * registry.CHECK_EVERY, "the slow layer was not timed again"
        slow_call()
    assert watch.engine == "loop" and watch.trusted and cache_file.read_text() == before
    assert "not trusted" in watch.history[-1][1]
    retimed_at = watch.history[-1][0]
    while watch.calls < retimed_at + 2 * registry.RETIME_FIRST + registry.CHECK_EVERY:
        slow_call()
    assert [c for c, _ in watch.history] == [retimed_at, retimed_at + 2 * registry.RETIME_FIRST]
    assert watch.engine == "loop" and cache_file.read_text() == before


#: Tokens per sequence of the real layers below (two sequences, H=128, I=64, E=6, K=2): 27 Mi
#: multiply-accumulates, above ``registry.SMALL_LAYER_MACS``, where ``auto`` times its engines.
_T = 288


def _cfg(H, I, E, K):
    return SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                           norm_topk_prob=True, hidden_act="silu")


def _fb(block, x):
    out = block(x)
    out.sum().backward()


def test_a_wrong_stored_choice_is_found_out_in_use(cache_file, quiet):
    """A real layer with a cache that claims its engine runs far faster than anything can: within a
    few forward+backward calls the layer is timed again and the cache holds real times."""
    torch.manual_seed(0)
    assert registry.layer_macs(2 * _T, 2, 128, 64, 6) > registry.SMALL_LAYER_MACS
    block = FastSparseMoeBlock(_cfg(128, 64, 6, 2), backend="torch")
    x = torch.randn(2, _T, 128, requires_grad=True)
    key = registry.ShapeKey("torch", "float32", 128, 64, 6, registry.rows_bucket(2 * _T * 2))
    timing.store(timing.device_name("cpu"), key, "loop", dict.fromkeys(_CANDIDATES, 1e-7),
                 forward=dict.fromkeys(_CANDIDATES, 4e-8), rows=2 * _T * 2, timed={"reason": "poisoned"})
    for call in range(1, 3 * registry.CHECK_EVERY + 1):
        _fb(block, x)
        (entry,) = _entries(cache_file).values()
        if entry["timed"]["reason"] != "poisoned":
            break
    assert entry["timed"]["reason"].startswith("re-timed in use: loop ran"), entry["timed"]
    assert call <= 2 * registry.CHECK_EVERY
    assert all(s > 1e-6 for s in entry["seconds"].values()) and entry["engine"] in _CANDIDATES


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_a_timing_on_busy_cores_is_not_stored(cache_file):
    """With a busy process on every core this process may use, the first timing of a real layer is
    starved: the layer runs on its in-process choice, and nothing is written to the cache."""
    if timing.starvation_check(torch.device("cpu")) != "run-queue wait":
        pytest.skip("needs Linux's per-thread run-queue wait (/proc/self/task/*/schedstat)")
    torch.manual_seed(0)
    block = FastSparseMoeBlock(_cfg(256, 128, 8, 2), backend="torch")
    x = torch.randn(2, 128, 256, requires_grad=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # 4 * cores + 1: this process's thread waits four fifths of its time whichever core it runs on (at
    # 2 * cores + 1, two thirds, a run beside another test suite once timed samples that were not starved)
    procs = _busy(4 * cores + 1)
    try:
        # Let them take the cores, spinning meanwhile: a process that slept comes back with credit
        # the scheduler repays by running it first for a while (EEVDF's lag), unstarved.
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        _fb(block, x)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)
    (watch,) = registry._WATCHES.values()
    assert not watch.trusted and "starved" in watch.history[0][1], watch.history
    assert not _entries(cache_file)
    assert watch.engine in _CANDIDATES


def _other(engine: str) -> str:
    return next(e for e in _CANDIDATES if e != engine)


def test_a_forward_without_backward_takes_the_fastest_forward(cache_file, unknown_load):
    """The forward+backward choice holds for training calls; a call no backward follows takes the
    engine whose timed forward is fastest, but only when it is faster by INFERENCE_GAIN or more."""
    key = registry.ShapeKey("torch", "float32", 16, 8, 4, 64)
    quick = _other("loop")
    forward = {e: 0.4 for e in _CANDIDATES} | {quick: 0.2}
    timing.store(timing.device_name("cpu"), key, "loop", {e: 1.0 if e == "loop" else 1.5 for e in _CANDIDATES},
                 forward=forward, rows=64, timed={"reason": "first use"})
    measure = lambda engine: pytest.fail("a stored choice is not timed")  # noqa: E731
    engine, watch = _choice(measure)
    assert engine == "loop" and watch.inference_engine == quick and watch.expected_inference == 0.2
    inf = registry.engine_choice("auto", backend="torch", device="cpu", dtype=torch.float32, shape=_SHAPE,
                                 measure=measure, inference=True)
    assert inf == (quick, watch)
    # Within the gain: one engine for both.
    registry.forget_choices()
    timing.store(timing.device_name("cpu"), key, "loop", {e: 1.0 if e == "loop" else 1.5 for e in _CANDIDATES},
                 forward={e: 0.4 if e == "loop" else 0.39 for e in _CANDIDATES}, rows=64)
    engine, watch = _choice(measure)
    assert engine == watch.inference_engine == "loop"


def test_slow_inference_calls_time_the_choice_again(cache_file, unknown_load):
    """Forward calls without a backward are watched against their own engine's timed forward: far
    slower, the candidates are timed again."""
    key = registry.ShapeKey("torch", "float32", 16, 8, 4, 64)
    quick = _other("loop")
    timing.store(timing.device_name("cpu"), key, "loop", {e: 1.0 if e == "loop" else 1.5 for e in _CANDIDATES},
                 forward={e: 0.4 for e in _CANDIDATES} | {quick: 0.2}, rows=64)
    timed: list[str] = []

    def measure(engine):
        timed.append(engine)
        return Sample(1.0 if engine == "loop" else 1.5, 0.4)

    def infer(seconds):
        registry.engine_choice("auto", backend="torch", device="cpu", dtype=torch.float32, shape=_SHAPE,
                               measure=measure, check=True, inference=True)
        watch.saw(True, seconds, 64, inference=True)

    _, watch = _choice(measure)
    for _ in range(2 * registry.CHECK_EVERY):  # at its timed forward speed: nothing to do
        infer(0.21)
    assert not timed and watch.slowdown() < registry.SLOW
    while not timed:  # 2.5x its timed forward
        assert watch.calls <= 5 * registry.CHECK_EVERY, "slow inference calls were not timed again"
        infer(0.5)
    assert watch.history[-1][1].startswith(f"re-timed in use: {quick} ran 2.50x")
    # The new timing's forwards are equal: both kinds of call run the forward+backward choice.
    assert watch.engine == watch.inference_engine == "loop"


def test_no_grad_calls_run_the_inference_engine(cache_file, monkeypatch):
    """A real layer: with autograd on, the forward+backward choice runs; under torch.no_grad the
    fastest forward's engine, with the same numbers. (A call without grad takes grouped_mm untimed up
    to ``registry.SMALL_INFERENCE_MACS``, 384 Mi; the bound is lowered here to the training one so
    that this 27 Mi layer stands for the larger layers whose inference choice is timed.)"""
    from fastmoe_xpu.autograd import ops

    monkeypatch.setattr(registry, "SMALL_INFERENCE_MACS", registry.SMALL_LAYER_MACS)
    torch.manual_seed(0)
    block = FastSparseMoeBlock(_cfg(128, 64, 6, 2), backend="torch", gemm_engine="auto")
    x = torch.randn(2, _T, 128)
    quick = _other("loop")
    key = registry.ShapeKey("torch", "float32", 128, 64, 6, registry.rows_bucket(2 * _T * 2))
    timing.store(timing.device_name("cpu"), key, "loop", {e: 1.0 if e == "loop" else 1.5 for e in _CANDIDATES},
                 forward={e: 0.4 for e in _CANDIDATES} | {quick: 0.2}, rows=2 * _T * 2)
    ran: list[str] = []
    kernels = ops.kernels
    monkeypatch.setattr(ops, "kernels", lambda name: ran.append(name) or kernels(name))
    trained = block(x.requires_grad_())
    trained.sum().backward()
    assert registry.kernel_set_name("torch", quick) not in ran and "torch" in ran
    ran.clear()
    with torch.no_grad():
        inferred = block(x)
    assert registry.kernel_set_name("torch", quick) in ran
    torch.testing.assert_close(inferred, trained.detach(), rtol=1e-5, atol=1e-6)
    shape = (128, 64, 6, 2 * _T * 2)
    assert registry.chosen_for("torch", "cpu", torch.float32, shape) == "loop"
    assert registry.chosen_for("torch", "cpu", torch.float32, shape, inference=True) == quick


def test_a_graph_capture_neither_times_nor_checks_the_choice(cache_file, unknown_load, monkeypatch):
    """Inside a CUDA graph capture nothing may be timed or synchronised: the first call of a shape,
    which times the candidates, is refused with a line saying to warm up first; after warm-up a due
    check is skipped under capture (and runs again once the capture is over), and a block called
    under capture reports no host time to the choice's watch."""
    from fastmoe_xpu.autograd import ops

    timed: list[str] = []

    def measure(engine):
        timed.append(engine)
        return Sample(1.0 if engine == "loop" else 2.0, 0.4)

    monkeypatch.setattr(registry, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="call the layer once at this shape before capturing"):
        _choice(measure)
    assert not timed
    monkeypatch.setattr(registry, "capturing", lambda device: False)
    engine, watch = _choice(measure)  # the warm-up: timed here
    assert engine == "loop" and len(timed) > 0
    timed.clear()
    watch.next_check = watch.calls  # a check is due
    monkeypatch.setattr(registry, "capturing", lambda device: True)
    for _ in range(3):
        assert _choice(measure, check=True)[0] == "loop"
    assert not timed, "the choice was timed inside a capture"
    monkeypatch.setattr(registry, "capturing", lambda device: False)
    _choice(measure, check=True)  # out of the capture the due check runs (it may re-time)
    assert watch.next_check > watch.calls or timed

    # a whole block (past the fused small-layer path: its stages report to a watch): under capture
    # its calls leave the watch's record alone
    monkeypatch.setattr(registry, "capturing", lambda device: False)
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, hidden_act="silu")
    block = FastSparseMoeBlock(cfg, backend="torch")
    x = torch.randn(1, 1152, 64)
    assert registry.layer_macs(1152, 2, 64, 64, 4) > registry.SMALL_LAYER_MACS  # timed, so watched
    block(x)  # warm-up: the choice for this shape
    (w,) = [w for (name, key), w in registry._WATCHES.items() if key.hidden == 64 and key.intermediate == 64]
    calls = w.calls
    block(x)
    assert w.calls == calls + 1  # out of a capture every forward call is counted
    before = (w.calls, list(w.fwd), list(w.inf))
    monkeypatch.setattr(ops, "capturing", lambda device: True)
    monkeypatch.setattr(registry, "capturing", lambda device: True)
    block(x)
    assert (w.calls, list(w.fwd), list(w.inf)) == before

"""The ``auto`` engine choice for forward calls without a backward (kernels/registry.py:
``INFERENCE_TIME_AFTER``): a shape key with no choice yet (none in-process, none on disk) times
nothing on such a call; it runs the untimed engine until one layer has made ``INFERENCE_TIME_AFTER``
such calls of the key, and that call times the candidates' forwards alone, a choice never stored
and timed in full by the first call with a backward to come. A call with a backward to come, or a
key with a cached choice, is answered at once, as before; under expert parallelism the group's first
call times, as before (ranks must agree).
"""
from __future__ import annotations

import json

import pytest
import torch

from fastmoe_xpu import settings
from fastmoe_xpu.autograd import ops
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.dist.testing import run_distributed
from fastmoe_xpu.kernels import registry, timing
from fastmoe_xpu.kernels.timing import Sample
from fastmoe_xpu.reference import reference_experts_forward
from tolerances import assert_close

_CANDIDATES = registry.candidates("torch", torch.device("cpu"), torch.float32)
_SHAPE = (16, 8, 4, 64)
_KEY = registry.ShapeKey("torch", "float32", 16, 8, 4, 64)
_N = registry.INFERENCE_TIME_AFTER


@pytest.fixture
def cache_file(tmp_path):
    """A private cache, no remembered choices, auto not pinned."""
    path = tmp_path / "engines.json"
    registry.forget_choices()
    try:
        with settings.override(gemm_cache=str(path), gemm_engine=None):
            yield path
    finally:
        registry.forget_choices()


class Counter:
    """An injected ``measure``: loop is the fastest forward+backward, the last candidate the fastest
    forward; every sample agrees (a trusted timing)."""

    def __init__(self) -> None:
        self.timed: list[str] = []

    def __call__(self, engine: str) -> Sample:
        self.timed.append(engine)
        return Sample(1.0 if engine == "loop" else 2.0, 0.2 if engine == _CANDIDATES[-1] else 0.4, False)


def _choice(measure, inference: bool, layer=None, shape=_SHAPE):
    return registry.engine_choice("auto", backend="torch", device="cpu", dtype=torch.float32, shape=shape,
                                  measure=measure, check=True, inference=inference, layer=layer)


def test_the_constant_defers_at_least_one_call():
    assert isinstance(_N, int) and _N >= 2
    assert registry.SMALL_LAYER_ENGINE in _CANDIDATES  # else nothing is deferred here (tested below)


def test_inference_calls_of_a_new_key_time_only_at_the_nth(cache_file):
    measure = Counter()
    for i in range(_N - 1):
        assert _choice(measure, True) == (registry.SMALL_LAYER_ENGINE, None), i
    assert not measure.timed and not cache_file.exists()
    assert registry.watch_for("torch", "cpu", torch.float32, _SHAPE) is None
    assert registry.chosen_for("torch", "cpu", torch.float32, _SHAPE) is None
    engine, watch = _choice(measure, True)  # the N-th: timed now
    assert sorted(measure.timed) == sorted(_CANDIDATES * (1 + timing.MIN_ROUNDS))
    assert watch is not None and watch.engine == "loop" and engine == watch.inference_engine == _CANDIDATES[-1]
    assert watch.history == [(0, "timed at first use: loop, trusted")]
    (entry,) = json.loads(cache_file.read_text())["entries"].values()
    assert entry["engine"] == "loop" and set(entry["seconds"]) == set(_CANDIDATES)
    # Timed once: the calls after it, of either kind, take the choice.
    measure.timed.clear()
    assert _choice(measure, True) == (_CANDIDATES[-1], watch)
    assert _choice(measure, False) == ("loop", watch)
    assert not measure.timed
    assert not registry._INFERENCE_SEEN  # the count is dropped once the key is timed


def test_the_calls_are_counted_per_layer_and_per_key(cache_file):
    """A model's layers share a key (one prefill calls it once per layer): a shape is timed only when
    one layer has called it N times; another shape bucket counts on its own."""
    measure = Counter()
    for _ in range(_N - 1):
        for layer in ("first", "second", "third"):
            assert _choice(measure, True, layer) == (registry.SMALL_LAYER_ENGINE, None)
        assert _choice(measure, True, "first", shape=(16, 8, 4, 1000)) == (registry.SMALL_LAYER_ENGINE, None)
    assert not measure.timed
    engine, watch = _choice(measure, True, "second")
    assert watch is not None and measure.timed
    measure.timed.clear()
    assert _choice(measure, True, "third")[1] is watch and not measure.timed
    # the other bucket has had N-1 calls of one layer: its N-th times
    assert _choice(measure, True, "first", shape=(16, 8, 4, 1000))[1] is not watch and measure.timed


def test_a_training_call_times_at_once(cache_file):
    """A call with a backward to come times at its first call, deferred inference calls before it or not;
    the inference calls after it take its choice."""
    measure = Counter()
    engine, watch = _choice(measure, False)
    assert engine == "loop" and watch is not None and measure.timed
    registry.forget_choices()
    cache_file.unlink()
    measure.timed.clear()
    assert _choice(measure, True) == (registry.SMALL_LAYER_ENGINE, None) and not measure.timed
    engine, watch = _choice(measure, False)
    assert engine == "loop" and watch is not None and measure.timed
    measure.timed.clear()
    assert _choice(measure, True) == (_CANDIDATES[-1], watch) and not measure.timed


def test_a_cached_choice_is_used_at_the_first_inference_call(cache_file):
    quick = _CANDIDATES[-1]
    timing.store(timing.device_name("cpu"), _KEY, "loop", {e: 1.0 if e == "loop" else 1.5 for e in _CANDIDATES},
                 forward={e: 0.4 for e in _CANDIDATES} | {quick: 0.2}, rows=64, timed={"reason": "first use"})
    engine, watch = _choice(lambda e: pytest.fail("a cached choice is not timed"), True)
    assert watch is not None and watch.engine == "loop" and watch.trusted and engine == quick
    assert not registry._INFERENCE_SEEN


def test_no_deferral_where_the_untimed_engine_is_not_a_candidate(cache_file, monkeypatch):
    monkeypatch.setattr(registry, "SMALL_LAYER_ENGINE", "not-an-engine")
    measure = Counter()
    engine, watch = _choice(measure, True)
    assert watch is not None and measure.timed


def _inputs(T, H, I, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, idx, w


def _weights(H, I, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * H ** -0.5, torch.randn(E, H, I, generator=g) * I ** -0.5


def test_a_model_without_grad_times_its_layers_shape_only_when_it_recurs(cache_file, monkeypatch):
    """Two real layers of one shape under torch.no_grad: their calls run the untimed engine, with the
    reference's numbers, until one of them makes its N-th call, which times the candidates' forwards
    (once, for both; nothing stored); a call with grad then times them in full and stores the choice,
    with the reference's output and gradients. The layer is a 28 Mi one: the inference bound of
    untimed layers is lowered to the training one so that it stands for the larger layers whose
    inference choice is timed. The timing's checks are relaxed (every sample trusted): whether this
    machine is quiet is not this test's business."""
    monkeypatch.setattr(registry, "SMALL_INFERENCE_MACS", registry.SMALL_LAYER_MACS)
    monkeypatch.setattr(timing, "STARVED_WAIT", float("inf"))
    monkeypatch.setattr(timing, "STARVED_CPU", 0.0)
    monkeypatch.setattr(timing, "AGREE", float("inf"))
    T, H, I, E, K = 571, 128, 64, 6, 2  # 190 routed rows per expert, odd T
    assert registry.layer_macs(T, K, H, I, E) > registry.SMALL_LAYER_MACS
    x, idx, w = _inputs(T, H, I, E, K)
    layers = [_weights(H, I, E, seed) for seed in (1, 2)]
    timings: list[int] = []
    time_interleaved = timing.time_interleaved
    monkeypatch.setattr(timing, "time_interleaved", lambda *a, **k: timings.append(1) or time_interleaved(*a, **k))
    ran: list[str] = []
    kernels = ops.kernels
    monkeypatch.setattr(ops, "kernels", lambda name: ran.append(name) or kernels(name))
    untimed = registry.kernel_set_name("torch", registry.SMALL_LAYER_ENGINE)
    others = {registry.kernel_set_name("torch", e) for e in registry.ENGINES} - {"torch", untimed}
    with torch.no_grad():
        for _ in range(_N - 1):
            for w_gu, w_d in layers:
                ran.clear()
                out = moe_experts_forward(x, w, idx, w_gu, w_d, gemm_engine="auto")
                assert untimed in ran and not set(ran) & others, ran
                assert_close(out, reference_experts_forward(x, w, idx, w_gu, w_d))
        assert not timings and not registry._WATCHES and not cache_file.exists()
        w_gu, w_d = layers[0]
        out = moe_experts_forward(x, w, idx, w_gu, w_d, gemm_engine="auto")
        assert timings == [1]
        assert_close(out, reference_experts_forward(x, w, idx, w_gu, w_d))
        w_gu, w_d = layers[1]
        out = moe_experts_forward(x, w, idx, w_gu, w_d, gemm_engine="auto")
        assert timings == [1]
        assert_close(out, reference_experts_forward(x, w, idx, w_gu, w_d))
    shape = (H, I, E, T * K)
    watch = registry.watch_for("torch", "cpu", torch.float32, shape)
    assert watch.forward_only and watch.engine in _CANDIDATES and not cache_file.exists()
    xx = x.clone().requires_grad_()
    out = moe_experts_forward(xx, w, idx, w_gu, w_d, gemm_engine="auto")
    assert timings == [1, 1] and not watch.forward_only
    (entry,) = json.loads(cache_file.read_text())["entries"].values()
    assert entry["engine"] == watch.engine and all(0 < entry["forward"][e] < entry["seconds"][e] for e in _CANDIDATES)
    xr = x.clone().requires_grad_()
    want = reference_experts_forward(xr, w, idx, w_gu, w_d)
    assert_close(out, want)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    assert_close(torch.autograd.grad(out, xx, dout)[0], torch.autograd.grad(want, xr, dout)[0])
    assert registry.chosen_for("torch", "cpu", torch.float32, shape) == watch.engine
    assert registry.chosen_for("torch", "cpu", torch.float32, shape, inference=True) in _CANDIDATES


def _rank_inference_choice(cache_dir: str) -> tuple[str, list[str]]:
    """One rank of an EP group of 2 making a call without a backward: rank 0 times at once (no
    deferral under expert parallelism: the ranks' row counts differ, their counts could too) and
    every rank takes its choice."""
    import torch.distributed as dist

    rank = dist.get_rank()
    timed: list[str] = []

    def measure(engine):
        timed.append(engine)
        return 1.0 if engine == ("grouped_mm" if rank == 0 else "loop") else 2.0

    group = dist.new_group([0, 1])
    with settings.override(gemm_cache=f"{cache_dir}/rank{rank}.json", gemm_engine=None):
        engine, watch = registry.engine_choice("auto", backend="torch", device="cpu", dtype=torch.float32,
                                               shape=(16, 8, 2, 64 + 40 * rank), measure=measure, group=group,
                                               check=True, inference=True, layer=rank)
    assert watch is None
    return engine, timed


def test_expert_parallel_inference_calls_time_at_once_and_agree(tmp_path):
    results = run_distributed(_rank_inference_choice, 2, str(tmp_path), timeout_s=120.0, comm_timeout_s=60.0,
                              fail_fast=True)
    assert [c for c, _ in results] == ["grouped_mm", "grouped_mm"]
    assert sorted(results[0][1]) == sorted(_CANDIDATES * (1 + timing.MIN_ROUNDS)) and results[1][1] == []


class ForwardCounter(Counter):
    """A ``measure`` that also times forwards alone (``measure.forward``, as the fused op's does):
    there the last candidate is the fastest, in a full timing loop."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards: list[str] = []

    def forward(self, engine: str) -> Sample:
        self.forwards.append(engine)
        s = 0.2 if engine == _CANDIDATES[-1] else 0.4
        return Sample(s, s, False)


def test_an_inference_call_times_forwards_only_and_a_backward_times_again_in_full(cache_file):
    """The N-th inference call of a key times forwards alone (the full measure is not called): the
    fastest forward runs, nothing is stored; the next inference calls take it untimed; the first
    call with a backward to come times forward+backward, takes that choice and stores it."""
    measure = ForwardCounter()
    for _ in range(_N - 1):
        _choice(measure, True)
    assert not measure.forwards and not measure.timed
    engine, watch = _choice(measure, True)
    assert sorted(measure.forwards) == sorted(_CANDIDATES * (1 + timing.MIN_ROUNDS)) and not measure.timed
    assert watch.forward_only and watch.trusted and engine == watch.engine == _CANDIDATES[-1]
    assert watch.expected == watch.expected_inference == 0.2 and watch.expected_forward is None
    assert not cache_file.exists(), "a forwards-only timing was stored"
    assert "forwards only" in watch.history[-1][1] and "not stored" in watch.history[-1][1]
    measure.forwards.clear()
    assert _choice(measure, True) == (_CANDIDATES[-1], watch) and not measure.forwards and not measure.timed
    engine, again = _choice(measure, False)  # a backward is to come: timed in full, once
    assert again is watch and engine == watch.engine == "loop" and not watch.forward_only
    assert sorted(measure.timed) == sorted(_CANDIDATES * (1 + timing.MIN_ROUNDS)) and not measure.forwards
    (entry,) = json.loads(cache_file.read_text())["entries"].values()
    assert entry["engine"] == "loop" and entry["seconds"]["loop"] == 1.0 and entry["forward"]["loop"] == 0.4
    assert "backward" in entry["timed"]["reason"]
    measure.timed.clear()
    assert _choice(measure, False) == ("loop", watch) and _choice(measure, True) == (_CANDIDATES[-1], watch)
    assert not measure.timed and not measure.forwards


def test_a_forwards_only_choice_is_retimed_forwards_only_and_never_stored(cache_file, monkeypatch):
    """An untrusted forwards-only choice is timed again in use (after RETIME_FIRST calls, in a quiet
    stretch) by forwards alone, and a trusted result of that is still not stored."""
    monkeypatch.setattr(registry.Watch, "_quiet_since_last_check", lambda self: True)
    measure = ForwardCounter()
    starved = [True]
    forward = measure.forward

    def first_starved(engine):  # the first timing's samples starved: not trusted
        s = forward(engine)
        return s._replace(starved=starved[0])

    measure.forward = first_starved
    for _ in range(_N):
        engine, watch = _choice(measure, True)
    assert watch.forward_only and not watch.trusted and not cache_file.exists()
    starved[0] = False
    measure.forwards.clear()
    for _ in range(registry.RETIME_FIRST + 2 * registry.CHECK_EVERY):
        _choice(measure, True)
        watch.saw(True, 0.2, 64, inference=True)
    assert measure.forwards and not measure.timed, "not re-timed by forwards alone"
    assert watch.forward_only and watch.trusted and not cache_file.exists()
    assert watch.history[-1][1].startswith("re-timed: the last timing was not trusted") and "stored" not in \
        watch.history[-1][1]


def test_the_fused_ops_measure_times_forwards_alone(monkeypatch):
    """``measure.forward`` of the fused op runs no backward body; ``measure`` runs one per call."""
    T, H, I, E, K = 13, 16, 8, 4, 2
    x, idx, w = _inputs(T, H, I, E, K)
    w_gu, w_d = _weights(H, I, E, 3)
    launchers = ops.kernels("torch")
    counts = launchers.count_tokens(idx, 0, E, ops.TOKEN_BLOCK_SIZE)
    rows = (*launchers.build_indices(idx, counts.partial_cum_token_counts, counts.cum_expert_counts, 0, E,
                                     ops.TOKEN_BLOCK_SIZE), counts.cum_token_counts, counts.cum_expert_counts)
    backwards: list[int] = []
    body = ops.mlp_combine_backward_math
    monkeypatch.setattr(ops, "mlp_combine_backward_math", lambda *a: backwards.append(1) or body(*a))
    measure = ops.engine_measure("torch", x, w_gu, w_d, w, rows)
    for _ in range(2):  # the warm-up, then a sample
        s = measure.forward("loop")
        assert s.seconds > 0 and s.forward > 0
    assert not backwards
    measure("loop")
    assert backwards

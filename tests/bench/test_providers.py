"""``pytest tests/bench``: the benchmark's cases through pytest-benchmark, at the tiny presets (fast).

Each case is built by the same setup factory as ``python -m bench``; each provider's result is
checked against hf_v4 before it is timed, so a fast wrong provider fails instead of winning.
"""
from __future__ import annotations

import pytest
import torch

# the timing half of every test is the pytest-benchmark fixture; without the plugin nothing here can run
pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed (pip install -e .[test])")

from bench.harness.cases import make_case  # noqa: E402
from bench.harness.measure import compare, timed_call  # noqa: E402
from bench.harness.presets import PRESETS  # noqa: E402
from bench.harness.providers import ALL_PROVIDERS, NAMED_PROVIDERS, REFERENCE, ProviderSkipped, build_provider  # noqa: E402

PRESET_NAMES = ["tiny", "tiny-ep"]


@pytest.fixture(scope="module", params=PRESET_NAMES)
def case_and_ref(request):
    case = make_case(PRESETS[request.param], dtype="fp32", device="cpu", seed=0)
    ref = build_provider(REFERENCE, case)
    _, _, got = timed_call(ref, case, backward=True, capture=True)
    return case, got


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("name", ALL_PROVIDERS + NAMED_PROVIDERS)
def test_provider(benchmark, case_and_ref, name, mode):
    case, ref = case_and_ref
    try:
        prov = build_provider(name, case)
    except ProviderSkipped as exc:
        pytest.skip(str(exc))
    backward = mode == "fwdbwd"
    _, _, got = timed_call(prov, case, backward=backward, capture=True)
    check = compare(got, ref, case.dtype)
    assert check["ok"], check
    benchmark.group = f"{case.preset.name}-{mode}"
    benchmark.extra_info.update(preset=case.preset.name, rows=case.rows, flops=case.flops()[mode])
    torch.set_grad_enabled(True)
    benchmark.pedantic(timed_call, args=(prov, case), kwargs={"backward": backward}, rounds=3, iterations=1,
                       warmup_rounds=1)


class _FakeGraphs:
    """What ``capture_forward`` uses of ``torch.cuda``, on the CPU: streams that do nothing, a capture
    that records how often the forward ran inside it, replays counted."""

    def __init__(self):
        self.replays = 0
        self.capturing = False
        self.captured_calls = 0

    class _Stream:
        def wait_stream(self, other):
            pass

    def Stream(self, device):  # noqa: N802
        return self._Stream()

    def current_stream(self, device):
        return self._Stream()

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802
        api = self

        class G:
            def replay(self):
                api.replays += 1
        return G()

    def graph(self, g):
        import contextlib

        api = self

        @contextlib.contextmanager
        def cm():
            api.capturing = True
            try:
                yield
            finally:
                api.capturing = False
        return cm()


def test_a_captured_forward_is_timed_by_its_replays():
    """``capture_forward``: warm-up calls, then one call inside the capture, whose output the replays
    return; ``timed_call`` with it times a replay (no eager forward) and only as an inference call."""
    from bench.harness.measure import GRAPH_WARMUP, capture_forward

    case = make_case(PRESETS["tiny"], dtype="fp32", device="cpu", seed=0)
    prov = build_provider("hf_v5_grouped_mm", case)
    api = _FakeGraphs()
    calls = {"eager": 0, "captured": 0}
    real = prov.forward

    def counting(*a):
        calls["captured" if api.capturing else "eager"] += 1
        return real(*a)

    prov.forward = counting
    replay = capture_forward(prov, case, api=api)
    assert calls == {"eager": GRAPH_WARMUP, "captured": 1} and api.replays == 0
    f, b, got = timed_call(prov, case, backward=False, capture=True, grad=False, graphed=replay)
    assert api.replays == 1 and calls["eager"] == GRAPH_WARMUP and b == 0.0 and f >= 0.0
    with torch.no_grad():
        want = real(case.x_TH, case.weights_TK, case.topk_idx_TK)
    torch.testing.assert_close(got["out"], want)
    with pytest.raises(ValueError, match="only as an inference call"):
        timed_call(prov, case, backward=True, grad=True, graphed=replay)


def test_decode_presets():
    from bench.harness.presets import resolve_presets

    got = [(p.name, p.hidden, p.intermediate, p.experts, p.top_k, p.tokens) for p in resolve_presets(["decode"])]
    assert got == [(f"olmoe-decode-{t}", 2048, 1024, 64, 8, t) for t in (1, 8, 64, 256)] + \
        [(f"qwen3-decode-{t}", 2048, 768, 128, 8, t) for t in (1, 8, 64, 256)]


def test_inference_calls_keep_quantized_weights_and_training_steps_do_not():
    """An inference call (``grad=False``) and a captured forward run inside
    ``fastmoe_xpu.frozen_expert_weights`` (a server quantizes its weights once); a training step does
    not (after an update the weights are new), nor does anything after them."""
    from bench.harness.measure import capture_forward
    from fastmoe_xpu.kernels.quantized.core import weights_frozen

    case = make_case(PRESETS["tiny"], dtype="fp32", device="cpu", seed=0)
    prov = build_provider("hf_v5_grouped_mm", case)
    seen = []
    real = prov.forward

    def recording(*a):
        seen.append(weights_frozen())
        return real(*a)
    prov.forward = recording
    timed_call(prov, case, backward=False, grad=False)
    timed_call(prov, case, backward=True)
    timed_call(prov, case, backward=False)
    capture_forward(prov, case, api=_FakeGraphs())
    assert seen == [True, False, False] + [True] * (len(seen) - 3) and len(seen) > 3
    assert not weights_frozen()

"""The benchmark suite end to end at the tiny presets, and the pieces its numbers rest on."""
from __future__ import annotations

import csv
import json
import mmap

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.cli import main
from bench.harness.bounds import GemmBound
from bench.harness.cases import make_case
from bench.harness.measure import page_faults, saved_bytes, timed_call
from bench.harness.presets import PRESETS
from bench.harness.providers import build_provider
from bench.harness.runner import run_case


def test_cli_tiny_end_to_end(tmp_path, capsys):
    rc = main(["--preset", "tiny", "tiny-ep", "--rounds", "2", "--out", str(tmp_path), "--no-progress",
               "--threads", "1"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["machine"]["torch"] == torch.__version__
    assert [c["case"]["preset"]["name"] for c in data["cases"]] == ["tiny", "tiny-ep"]
    for c in data["cases"]:
        provs = c["providers"]
        assert provs["fastmoe/triton"]["status"] == "skipped" and provs["fastmoe/triton"]["reason"]
        for name in ("hf_v5_eager", "hf_v5_grouped_mm", "fastmoe/torch"):
            assert provs[name]["status"] == "ok"
            assert provs[name]["correct"]["ok"], (name, provs[name]["correct"])
            assert provs[name]["fwdbwd"]["n"] == 2
            assert isinstance(provs[name]["page_faults_per_call"], int) and provs[name]["page_faults_per_call"] >= 0
        sp = c["metrics"]["fwdbwd"]["speedup"]["fastmoe/torch"]["hf_v4"]["min"]
        ratio = provs["hf_v4"]["fwdbwd"]["min_s"] / provs["fastmoe/torch"]["fwdbwd"]["min_s"]
        assert sp == pytest.approx(ratio)
    rows = list(csv.DictReader(line for line in (tmp_path / "results.csv").open() if not line.startswith("#")))
    assert {r["provider"] for r in rows} >= {"gemm_bound", "hf_v4", "fastmoe/torch", "fastmoe/triton"}
    assert all(r["page_faults_per_call"] != "" for r in rows if r["status"] == "ok")
    assert (tmp_path / "chart_fwdbwd.png").stat().st_size > 1000
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("Measured ") and "| tiny |" in md and "| tiny-ep |" in md
    assert f"{sp:.2f}x" in md  # the last case's speedup over hf_v4, as in the JSON
    assert "fastmoe/triton | skipped" in md
    assert "fastmoe/torch forward+backward speedup" in printed and "skipped" in printed


@pytest.mark.parametrize(
    "preset",
    [
        "tiny",  # every expert local (EP=1)
        "tiny-ep",  # half the experts local: rows only for experts [0, NR)
    ],
)
def test_flop_formula_matches_counted_gemms(preset):
    case = make_case(PRESETS[preset])
    bound = GemmBound(case)
    flops = case.flops()
    with FlopCounterMode(display=False) as fwd:
        bound.forward()
    with FlopCounterMode(display=False) as bwd:
        bound.backward()
    assert fwd.get_total_flops() == flops["fwd"]
    assert bwd.get_total_flops() == flops["bwd"]
    assert case.rows == int((case.topk_idx_TK < PRESETS[preset].local_experts).sum())


def test_saved_bytes_counts_activations_not_parameters():
    case = make_case(PRESETS["tiny"])
    fast = saved_bytes(build_provider("fastmoe/torch", case), case)
    v4 = saved_bytes(build_provider("hf_v4", case), case)
    params = sum(p.numel() * p.element_size() for p in (case.w_gate_up_N2IH, case.w_down_NHI))
    assert 0 < fast < params  # activations only: far smaller than the expert weights here
    assert 0 < v4 < params


def test_budget_limits_rounds_and_says_so():
    case = make_case(PRESETS["tiny"])
    res = run_case(case, ["hf_v4", "fastmoe/torch"], rounds=3, budget_s=0.0, ceiling_n=32, progress=False)
    for name in ("hf_v4", "fastmoe/torch"):
        p = res["providers"][name]
        assert p["budget_limited"] and "budget" in p["budget_note"]
        assert p["rounds"] == 1 and "a warm call took" in p["budget_note"]  # a warm call is the one sample
    assert res["bound"]["fwdbwd"]["n"] == 3  # the limits always run every round


def test_a_slow_first_call_does_not_cut_the_rounds():
    """A provider whose first call compiles (here: sleeps) is judged by a warm call: all rounds run and
    none of its samples holds the first call's time."""
    import time

    case = make_case(PRESETS["tiny"])
    first = {"done": False}

    def build(name, c):
        prov = build_provider(name, c)
        inner = prov.forward

        def forward(*args):
            if not first["done"]:
                first["done"] = True
                time.sleep(0.6)
            return inner(*args)

        prov.forward = forward
        return prov

    res = run_case(case, ["fastmoe/torch"], rounds=3, budget_s=1.0, ceiling_n=32, progress=False, build=build,
                   reference="fastmoe/torch", min_sample_s=0.0)
    p = res["providers"]["fastmoe/torch"]
    assert first["done"] and not p.get("budget_limited") and p["rounds"] == 3
    assert max(p["fwd"]["samples_s"]) < 0.3


@pytest.mark.parametrize("min_sample_s", [0.0, 0.05])
def test_short_calls_are_timed_several_to_a_sample(min_sample_s):
    case = make_case(PRESETS["tiny"])
    calls = {"hf_v4": 0, "fastmoe/torch": 0}

    def counted(name, case):
        prov = build_provider(name, case)
        forward = prov.forward

        def count(*args):
            calls[name] += 1
            return forward(*args)

        prov.forward = count
        return prov

    res = run_case(case, list(calls), rounds=3, ceiling_n=32, progress=False, build=counted, min_sample_s=min_sample_s)
    for name, n_calls in calls.items():
        p = res["providers"][name]
        n = p["calls_per_sample"]
        assert p["fwdbwd"]["n"] == 3 and len(p["fwdbwd"]["samples_s"]) == 3
        if min_sample_s == 0:
            assert n == 1
        else:  # a tiny layer's call is about 1 ms: each sample is the mean of several, lasting about 50 ms
            assert n > 1
            # (a calibrating call slowed by load gives a smaller n: the bound allows one 10x slower)
            assert min(p["fwdbwd"]["samples_s"]) * n >= 0.1 * min_sample_s
        # the cold call, the saved-bytes count, the calibrating call (only when a sample takes several), the rounds
        assert n_calls == 2 + (n > 1) + 3 * n, (name, n_calls, n)
    assert res["bound"]["calls_per_sample"] >= 1


def test_timed_call_leaves_no_gradients_behind():
    case = make_case(PRESETS["tiny"])
    prov = build_provider("fastmoe/torch", case)
    f, b, got = timed_call(prov, case, backward=True, capture=True)
    assert f > 0 and b > 0
    assert got["dw_gate_up"].abs().sum() > 0
    assert all(p.grad is None for p in prov.params)


def test_page_faults_count_fresh_memory():
    # 64 MiB of anonymous memory mapped afresh, each page faulted in on first touch (a torch.empty of
    # that size may reuse pages an earlier test freed and the allocator kept mapped).
    fresh = mmap.mmap(-1, 64 << 20)
    before = page_faults()
    torch.frombuffer(fresh, dtype=torch.uint8).fill_(1)
    assert page_faults() - before >= (64 << 20) // (2 << 20)  # at least one fault per 2 MiB huge page


def test_infer_mode_times_forward_calls_without_autograd(tmp_path, capsys):
    """``--mode infer``: every provider's forward runs under torch.no_grad (nothing records a
    graph), is checked against the reference's output, and is reported as its own mode."""
    grad_seen: list[bool] = []
    real = build_provider

    def spying(name, case, *args):
        prov = real(name, case, *args)
        forward = prov.forward

        def spy(x, w, idx):
            out = forward(x, w, idx)
            grad_seen.append(torch.is_grad_enabled() or out.requires_grad)
            return out

        prov.forward = spy
        return prov

    import bench.harness.runner as runner

    monkey = pytest.MonkeyPatch()
    monkey.setattr(runner, "build_provider", spying)
    try:
        rc = main(["--preset", "tiny", "--mode", "infer", "--rounds", "2", "--out", str(tmp_path), "--no-progress",
                   "--threads", "1", "--providers", "hf_v5_grouped_mm", "fastmoe/torch"])
    finally:
        monkey.undo()
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert grad_seen and not any(grad_seen)
    (c,) = json.loads((tmp_path / "results.json").read_text())["cases"]
    assert c["inference"] and not c["backward"]
    for name in ("hf_v5_grouped_mm", "fastmoe/torch"):
        p = c["providers"][name]
        assert p["status"] == "ok" and p["correct"]["ok"] and p["infer"]["n"] == 2 and "fwd" not in p
    assert set(c["metrics"]) == {"infer"}
    assert "forward under torch.no_grad (inference)" in printed
    assert (tmp_path / "chart_infer.png").stat().st_size > 1000

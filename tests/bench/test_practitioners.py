"""``python -m bench --shapes practitioners``: the shape set, and one whole run at tiny scale."""
from __future__ import annotations

import json

import pytest
import torch

from bench.cli import main
from bench.harness.presets import SHAPE_SETS, shape_set


def test_practitioner_shapes_are_the_published_layers():
    got = {p.name: (p.hidden, p.intermediate, p.experts, p.top_k, p.local_experts, p.tokens)
           for p in SHAPE_SETS["practitioners"]}
    assert got == {
        "olmoe-1b-7b": (2048, 1024, 64, 8, 64, 32768), "qwen3-30b-a3b": (2048, 768, 128, 8, 128, 32768),
        "qwen3-235b-a22b": (4096, 1536, 128, 8, 128, 32768), "gpt-oss-20b": (2880, 2880, 32, 4, 32, 32768),
        "mixtral-8x7b": (4096, 14336, 8, 2, 8, 32768), "deepseek-v3-ep8": (7168, 2048, 256, 8, 32, 32768)}
    small = shape_set("practitioners", scale=8, tokens=256)
    assert [(p.name, p.hidden, p.tokens) for p in small][-1] == ("deepseek-v3-ep8/8", 896, 256)
    with pytest.raises(ValueError, match="unknown shape set"):
        shape_set("nope")


def test_shapes_run_prints_tflops_beside_the_dense_mm(tmp_path, capsys, monkeypatch):
    """Two of the six shapes (one whole layer and the expert-parallel slice) keep the run short."""
    full = SHAPE_SETS["practitioners"]
    monkeypatch.setitem(SHAPE_SETS, "practitioners", (full[1], full[-1]))
    assert main(["--shapes", "practitioners", "--shape-scale", "128", "--shape-tokens", "8", "--rounds", "1",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| torch.mm (same FLOPs) |") == 2 and "qwen3-30b-a3b/128: H=16 I=8 E=128 K=8 T=8" in out
    assert "| sonicmoe | skipped: " in out and "| hf_v5_grouped_mm | " in out
    # the comparison: one row per shape, our default against the fastest peer that ran
    summary = (tmp_path / "summary.md").read_text()
    first = summary.index("| shape | fastmoe (auto ->) |")
    assert first < summary.index("qwen3-30b-a3b/128: H=16")  # the comparison comes first
    assert summary.count("| qwen3-30b-a3b/128 | fastmoe/torch (") == 1
    data = json.loads((tmp_path / "shapes_practitioners.json").read_text())
    for case in data["cases"]:
        flops = case["case"]["flops"]
        assert flops["fwd"] == 6.0 * case["case"]["preset"]["hidden"] * case["case"]["preset"]["intermediate"] * \
            case["case"]["rows"] and flops["fwdbwd"] == 3 * flops["fwd"]
        assert case["ceiling"]["flops"] == flops["fwd"] or case["case"]["rows"] == 0
        rows = {r["provider"]: r for r in case["table"]}
        fast = rows["fastmoe/torch"]
        assert fast["status"] == "ok" and fast["correct"] is True and fast["fwdbwd_tflops"] > 0
        assert fast["fwd_vs_mm"] == pytest.approx(fast["fwd_tflops"] / rows["torch.mm (same FLOPs)"]["fwd_tflops"])
        # checked against the fp32 reference: every tensor's error is there and small
        errors = case["providers"]["fastmoe/torch"]["correct"]["max_rel_error"]
        assert set(errors) == {"out", "dx", "dweights", "dw_gate_up", "dw_down"} and fast["max_error"] < 1e-4
        cmp = case["comparison"]
        peer = rows[cmp["peer"]]
        assert cmp["fastmoe"] == "fastmoe/torch" and peer["status"] == "ok"
        assert cmp["fwdbwd_ratio"] == pytest.approx(peer["fwdbwd_ms"] / fast["fwdbwd_ms"])
        assert all(rows[n]["fwdbwd_ms"] >= peer["fwdbwd_ms"] for n in ("hf_v5_grouped_mm", "hf_v5_eager"))


def test_shape_names_choose_a_subset_and_refuse_unknown_ones(tmp_path, capsys):
    args = ["--shapes", "practitioners", "--shape-scale", "128", "--shape-tokens", "4", "--rounds", "1",
            "--no-progress", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="--shape-names qwen9: not in shape set practitioners"):
        main([*args, "--shape-names", "qwen9"])
    assert main([*args, "--shape-names", "mixtral-8x7b"]) == 0
    data = json.loads((tmp_path / "shapes_practitioners.json").read_text())
    assert [c["case"]["preset"]["name"] for c in data["cases"]] == ["mixtral-8x7b/128"]


def test_shapes_run_times_a_precision_beside_the_plain_provider(tmp_path, capsys, monkeypatch):
    """``--precision none fp8``: the default fastmoe provider in fp8 beside the plain one, checked with
    fp8's tolerance, and its speed over the plain one printed under the table and kept in the JSON."""
    from fastmoe_xpu.kernels.quantized.core import unsupported_reason

    monkeypatch.setitem(SHAPE_SETS, "practitioners", SHAPE_SETS["practitioners"][1:2])
    assert main(["--shapes", "practitioners", "--shape-scale", "128", "--shape-tokens", "8", "--rounds", "1",
                 "--precision", "none", "fp8", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    reason = unsupported_reason("fp8", "cpu", torch.float32)
    if reason is not None:  # torch 2.11's CPU _scaled_mm takes per-tensor scales only: the row says why
        assert f"| fastmoe/torch:fp8 | skipped: expert_precision='fp8' cannot run here: {reason} |" in out
        assert "fastmoe/torch:fp8 over" not in out and "| fastmoe/torch (auto" in out
        pytest.skip(f"{reason} (the fp8 row says so; its timing and tolerance need torch's fp8 GEMMs)")
    assert "| fastmoe/torch:fp8 | " in out and "fastmoe/torch:fp8 over fastmoe/torch (same run): forward " in out
    case = json.loads((tmp_path / "shapes_practitioners.json").read_text())["cases"][0]
    rows = {r["provider"]: r for r in case["table"]}
    assert rows["fastmoe/torch:fp8"]["correct"] is True and rows["fastmoe/torch"]["correct"] is True
    assert case["providers"]["fastmoe/torch:fp8"]["correct"]["tolerance"] == 0.25
    ratio = case["precision_speedups"]["fastmoe/torch:fp8"]
    assert ratio["fwdbwd"] == pytest.approx(rows["fastmoe/torch"]["fwdbwd_ms"] / rows["fastmoe/torch:fp8"]["fwdbwd_ms"])
    with pytest.raises(SystemExit, match="--shapes takes --precision none or one of"):
        main(["--shapes", "practitioners", "--precision", "bf16-sr", "--out", str(tmp_path)])


def test_providers_name_the_shape_sets_subset(tmp_path, capsys, monkeypatch):
    """``--providers`` with ``--shapes``: only the named ones run (a named plain fastmoe provider brings its
    quantized twin), one the set would leave out here is reported skipped with why, an unknown one is
    refused in one line; no hf_v4 is added (the fp32 reference is the check)."""
    from bench.studies.practitioners import named_providers, providers_for

    cuda = torch.device("cuda")
    assert providers_for(cuda, torch.bfloat16, ["none", "fp8"], only=["hf_v5_grouped_mm", "fastmoe/triton",
                                                                     "fastmoe/triton@triton_tma", "liger"]) == \
        ["hf_v5_grouped_mm", "fastmoe/triton", "fastmoe/triton:fp8", "fastmoe/triton@triton_tma", "liger"]
    assert named_providers(None) is None and named_providers(["fastmoe", "liger"]) == \
        ["fastmoe/torch", "fastmoe/triton", "liger"]
    assert named_providers(["hf_v4", "liger"]) == ["hf_v4", "liger"]
    monkeypatch.setitem(SHAPE_SETS, "practitioners", SHAPE_SETS["practitioners"][1:2])
    args = ["--shapes", "practitioners", "--shape-scale", "128", "--shape-tokens", "8", "--rounds", "1",
            "--no-progress", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="--providers: unknown provider 'fastmoe/triton@nope'"):
        main([*args, "--providers", "fastmoe/triton@nope"])
    assert main([*args, "--providers", "hf_v5_grouped_mm", "fastmoe/torch", "fastmoe/triton@triton"]) == 0
    case = json.loads((tmp_path / "shapes_practitioners.json").read_text())["cases"][0]
    assert set(case["providers"]) == {"hf_v5_grouped_mm", "fastmoe/torch", "fastmoe/triton@triton"}
    assert case["providers"]["fastmoe/triton@triton"]["status"] == "skipped"
    assert case["comparison"]["fastmoe"] == "fastmoe/torch" and case["comparison"]["peer"] == "hf_v5_grouped_mm"


def test_inputs_are_drawn_on_the_gpu_and_on_the_cpu_as_before():
    """A GPU case draws its inputs there (billions of elements at T=32k took minutes on the host); the
    CPU's values are those of the CPU generator with the same seed, as they always were."""
    from bench.harness.cases import draw_device, make_case

    assert draw_device("cuda:1") == torch.device("cuda:1") and draw_device(torch.device("xpu")).type == "xpu"
    assert draw_device("cpu") == torch.device("cpu") and draw_device("meta") == torch.device("cpu")
    preset = shape_set("practitioners", scale=128, tokens=8)[1]
    case = make_case(preset, dtype="fp32", device="cpu", seed=3)
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(preset.tokens, preset.hidden, generator=g)
    assert torch.equal(case.x_TH, x)

"""``python -m bench --family``: a family's experts layer, tiny, eager and grouped_mm against fastmoe."""
from __future__ import annotations

import json

import pytest
import torch

from bench.cli import main
from bench.studies.families import FAMILY_SHAPES, family_preset


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_family_tiny_end_to_end(tmp_path, capsys, family) -> None:
    old = torch.get_num_threads()
    try:
        rc = main(["--family", family, "--family-scale", "64", "--tokens", "12", "--rounds", "2", "--out",
                   str(tmp_path), "--no-progress", "--threads", "1", "--ceiling-size", "64"])
    finally:
        torch.set_num_threads(old)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "SCALED: H and I divided by 64" in printed and "12 tokens instead of 2048" in printed
    data = json.loads((tmp_path / f"family_{family}.json").read_text())
    (case,) = data["cases"]
    provs = case["providers"]
    assert list(provs) == [f"{family}/eager", f"{family}/grouped_mm", f"{family}/fastmoe"]
    for name, p in provs.items():
        assert p["status"] == "ok" and p["correct"]["ok"], (name, p.get("correct"))
        assert p["fwdbwd"]["n"] == 2 and p["fwdbwd"]["min_s"] > 0
        assert name in printed
    s = FAMILY_SHAPES[family]
    pre = case["case"]["preset"]
    assert (pre["experts"], pre["top_k"], pre["tokens"]) == (s.experts, s.top_k, 12)
    # the speedups are the fastmoe row's against each family implementation
    sp = case["metrics"]["fwdbwd"]["speedup"][f"{family}/fastmoe"]
    assert set(sp) == {f"{family}/eager", f"{family}/grouped_mm"}


def test_family_published_shapes_and_errors() -> None:
    p, note = family_preset("mixtral")
    assert (p.hidden, p.intermediate, p.experts, p.top_k, note) == (4096, 14336, 8, 2, "")
    p, note = family_preset("qwen3_moe", scale=4)
    assert (p.hidden, p.intermediate) == (512, 192) and "divided by 4" in note
    with pytest.raises(ValueError, match="unknown family"):
        family_preset("no_such")
    with pytest.raises(ValueError, match="family-scale"):
        family_preset("gpt_oss", scale=0)
    with pytest.raises(SystemExit, match="unknown family"):
        main(["--family", "no_such", "--no-progress"])


def test_family_models_tiny_whole_models(tmp_path, capsys) -> None:
    """``--family-models``: whole tiny models, transformers' grouped_mm against fastmoe, one row each
    with the median of same-round ratios and both first calls; the two losses agree."""
    old = torch.get_num_threads()
    try:
        rc = main(["--family-models", "qwen3_moe", "gpt_oss", "--rounds", "2", "--min-sample-ms", "0", "--threads", "1",
                   "--out", str(tmp_path), "--no-progress"])
    finally:
        torch.set_num_threads(old)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    data = json.loads((tmp_path / "family_models.json").read_text())
    assert list(data["families"]) == ["qwen3_moe", "gpt_oss"]
    for family, res in data["families"].items():
        assert res["experts"].startswith("H=128 ") and "E=8 K=2" in res["experts"]
        assert res["calls"] == 1 and res["loss_diff"] <= 1e-4
        assert all(len(v) == 2 and min(v) > 0 for v in res["samples"].values())
        assert all(res["first_s"][impl] > 0 for impl in ("grouped_mm", "fastmoe"))
        assert f"| {family} | {res['experts']} |" in printed
    assert "median of same-round ratios" in printed

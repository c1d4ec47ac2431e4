"""What the benchmark prints first: the headline against transformers' default experts
implementation, named; the GEMM-only bound in one line; every column explained; no footnote
without a row that carries its mark; one ``error:`` line for bad input."""
from __future__ import annotations

import json

import pytest

import bench.studies.demo as demo
from bench.cli import main
from bench.harness.cases import make_case
from bench.harness.presets import PRESETS
from bench.harness.report import (BASELINE_NAMES, BOUND_LINE, BUDGET_NOTE, CASE_COLUMNS, derive, format_case,
                          format_markdown, format_summary, headline)
from bench.harness.runner import run_case

FAST = "fastmoe/torch"
NAMES = ["hf_v4", "hf_v5_grouped_mm", "hf_v5_eager", FAST]


def _tiny(budget_s: float) -> dict:
    res = run_case(make_case(PRESETS["tiny"]), NAMES, rounds=2, budget_s=budget_s, ceiling_n=32, progress=False)
    return derive(res, [FAST])


def test_headline_names_transformers_default_and_explains_every_column():
    res = _tiny(budget_s=60.0)
    head = headline([res], "fwdbwd", FAST)
    sp = res["metrics"]["fwdbwd"]["speedup"][FAST]["hf_v5_grouped_mm"]["min"]
    assert head[0].startswith("tiny: fastmoe vs transformers' default experts implementation (grouped_mm): ")
    assert f"{sp:.2f}x" in head[0]
    summary = format_summary([res], "fwdbwd", FAST)
    assert summary.splitlines()[1].split()[2:4] == ["vs", "hf_v5_grouped_mm"]  # the default first
    for name in ("hf_v5_grouped_mm", "hf_v4", "hf_v5_eager"):
        assert f"vs {name}: {BASELINE_NAMES[name]}" in summary
    assert BOUND_LINE in summary and "rows/exp:" in summary and "x bound:" in summary
    assert "*" not in summary  # no provider ran short of rounds: no mark, no footnote
    case = format_case(res, "fwdbwd", FAST)
    header = case.splitlines()[2]
    for column in ("median ms", "spread", "min ms", "GFLOP/s", "%ceil", "x bound", "%bound", "paired",
                   "speedup", "saved MB", "faults", "rounds", "correct"):
        assert column in header
        assert any(column in line for line in CASE_COLUMNS), f"column {column!r} is not explained"
    assert all(line in case for line in CASE_COLUMNS) and BOUND_LINE in case
    md = format_markdown({"date_utc": "d", "command": "c", "settings": {}, "machine": {
        "cpu_model": "cpu", "usable_cpus": 2, "torch_threads": 2, "torch": "t", "transformers": "x"}},
        [res], "fwdbwd", FAST)
    assert "fewer rounds than asked" not in md and BASELINE_NAMES["hf_v5_grouped_mm"] in md


def test_the_budget_footnote_comes_with_its_mark():
    res = _tiny(budget_s=0.0)  # every provider keeps its cold call only: marked
    summary = format_summary([res], "fwdbwd", FAST)
    assert BUDGET_NOTE in summary
    row = summary.splitlines()[3]
    assert row.startswith("tiny ") and "*" in row  # the row's speedup cells carry the mark


def test_demo_prints_the_headline_first(tmp_path, capsys, monkeypatch):
    # the demo's measurement on the tiny layer (the real one is a Mula-7B-A1B slice: seconds, not ms)
    monkeypatch.setattr(demo, "DEMO_PRESET", PRESETS["tiny"])
    monkeypatch.setattr(demo, "DEMO_CEILING_N", 32)
    assert main(["--demo", "--rounds", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("fastmoe vs transformers' default experts implementation (grouped_mm, transformers ")
    assert any("vs the transformers-4-style per-expert loop (hf_v4):" in line for line in out)
    assert any(BOUND_LINE in line for line in out)
    assert any("match" in line and "hf_v4" in line for line in out)
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["cases"][0]["metrics"]["fwdbwd"]["speedup"][FAST]["hf_v5_grouped_mm"]["min"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tinyy"], "error: unknown preset 'tinyy'"),
    (["--preset", "tiny", "--rounds", "0"], "error: --rounds must be >= 1"),
])
def test_bad_input_is_one_error_line(argv, message, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path), "--no-progress"])
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_a_quantized_provider_is_printed_over_its_plain_one():
    """``--precision none int8``: the case ends with the int8 provider's speedup over the plain one, by
    min times and by the median of same-round ratios, and the JSON metrics carry the same numbers."""
    q = f"{FAST}:int8"
    res = derive(run_case(make_case(PRESETS["tiny"]), ["hf_v4", FAST, q], rounds=2, budget_s=60.0, ceiling_n=32,
                          progress=False), [FAST])
    m = res["metrics"]["fwdbwd"]
    got = m["precision_speedups"][q]
    p = m["providers"]
    assert got["over"] == FAST and got["min"] == pytest.approx(p[FAST]["min_s"] / p[q]["min_s"])
    assert got["paired"] is not None and got["paired"] > 0
    line = f"{q} over {FAST}: {got['min']:.2f}x (min) | {got['paired']:.2f}x (paired)"
    assert line in format_case(res, "fwdbwd", FAST)
    assert "int8-layer" in PRESETS and (PRESETS["int8-layer"].hidden, PRESETS["int8-layer"].intermediate) == (1536, 768)
    mid = PRESETS["mid-layer"]
    assert (mid.hidden, mid.intermediate, mid.experts, mid.top_k, mid.tokens) == (1536, 768, 48, 6, 1024)

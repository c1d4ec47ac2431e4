"""``python -m bench --table3 --precision``: precision rows for the F+B and training columns, each
against fastmoe in fp32 in the same run, at tiny sizes (plumbing and correctness checks; no timing
is asserted)."""
from __future__ import annotations

import json
import math

import pytest

from bench.cli import main
from bench.studies.table3.table import QUICK, precision_fb_cell, precision_training_cell, run_table3

MODEL = "mula-7b-a1b"  # no EP in the paper: no gloo processes at all


@pytest.fixture(scope="module")
def table3_precision(tmp_path_factory):
    out = tmp_path_factory.mktemp("table3_precision")
    rc = main(["--table3", "--quick", "--models", MODEL, "--precision", "none", "int8", "bf16-sr", "--out", str(out),
               "--no-progress", "--no-chart"])
    return rc, json.loads((out / "table3.json").read_text())["cases"][0], out


def test_precision_rows_are_measured_beside_fp32(table3_precision):
    rc, res, _ = table3_precision
    assert rc == 0
    rows = res["precision_rows"][MODEL]
    assert list(rows) == ["int8", "bf16-sr"]
    fb = rows["int8"]["fsmoe_fb"]
    assert math.isfinite(fb["value"]) and fb["value"] > 0 and fb["correct"]["ok"]
    assert fb["correct"]["tolerance"] >= 5e-2  # judged with int8's tolerance against hf_v4
    # the value is fp32 fastmoe's time over int8's, both from the same layer run
    case = res["models"][MODEL]["fb_case"]["metrics"]["fwdbwd"]["providers"]
    assert fb["value"] == pytest.approx(case["fastmoe/torch"]["min_s"] / case["fastmoe/torch:int8"]["min_s"])
    assert fb["fp32_s"] == case["fastmoe/torch"]["min_s"]
    assert rows["bf16-sr"]["fsmoe_fb"]["value"] is None
    assert "training mode" in rows["bf16-sr"]["fsmoe_fb"]["reason"]
    for p in ("int8", "bf16-sr"):
        tr = rows[p]["fsmoe_training"]
        assert math.isfinite(tr["value"]) and tr["value"] > 0 and tr["correct"]["ok"], (p, tr)
        assert tr["value"] == pytest.approx(tr["fp32_step_s"] / tr["step_s"])
        steps = res["models"][MODEL]["precision_steps"][p]["steps"]
        assert len(steps["fp32"]) == len(steps[p]) == QUICK.rounds + 1
    # bf16 + stochastic rounding keeps no fp32 master: 8 optimizer bytes per parameter, not 12
    state = rows["bf16-sr"]["fsmoe_training"]["optimizer_state_bytes"]
    assert state["bf16-sr"] * 12 == state["fp32"] * 8
    # the fp32 table itself is unchanged by the precision rows
    assert res["rows"][MODEL]["fsmoe_fb"]["correct"]["ok"] and res["rows"][MODEL]["fsmoe_training"]["correct"]["ok"]


def test_precision_rows_in_every_output(table3_precision):
    _, _, out = table3_precision
    md = (out / "table3.md").read_text()
    assert "| precision | FSMOE F+B vs fp32 | FSMOE training vs fp32 |" in md
    assert f"| {MODEL} | int8 |" in md and "|  | bf16-sr | n/a |" in md
    csv_rows = [line.split(",")[:2] for line in (out / "table3.csv").read_text().splitlines()[1:]]
    assert [MODEL, "int8 vs fp32"] in csv_rows and [MODEL, "bf16-sr vs fp32"] in csv_rows


def test_precision_cells_say_why(tmp_path):
    bad = {"correct": {"ok": False, "tolerance": 5e-2, "max_rel_error": {"loss": 0.3}}}
    assert "disagrees with fp32's" in precision_training_cell(bad, "int8")["reason"]
    res = {"providers": {"fastmoe/torch:fp8": {"status": "skipped", "reason": "no fp8 here"}}}
    assert "no fp8 here" in precision_fb_cell(res, "fp8", "fastmoe/torch")["reason"]
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        run_table3([MODEL], QUICK, device=__import__("torch").device("cpu"), dtype="fp32", out_dir=tmp_path,
                   budget_s=1.0, progress=False, precisions=("int4",))
    with pytest.raises(SystemExit, match="error: --precision bf16-sr is a training mode: it needs --table3"):
        main(["--preset", "tiny", "--precision", "none", "bf16-sr", "--out", str(tmp_path), "--no-progress"])

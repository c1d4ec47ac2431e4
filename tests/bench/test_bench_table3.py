"""``python -m bench --table3 --quick``: the whole table at tiny sizes, end to end (one layer per row,
two trainers per row, four gloo processes for the EPSO columns)."""
from __future__ import annotations

import json
import math

import pytest

from bench.cli import main
from bench.studies.table3.table import COLUMNS, MODELS, PUBLISHED, _cell, combined_cell, state_bytes_match
from trainer.optim import state_bytes_formula


@pytest.fixture(scope="module")
def table3(tmp_path_factory):
    out = tmp_path_factory.mktemp("table3")
    rc = main(["--table3", "--quick", "--out", str(out), "--no-progress", "--no-chart"])
    data = json.loads((out / "table3.json").read_text())
    return rc, data["cases"][0], out


def test_runs_and_every_cell_is_filled_or_says_why(table3):
    rc, res, _ = table3
    assert rc == 0
    assert list(res["rows"]) == list(MODELS)
    for m, row in res["rows"].items():
        assert set(row) == set(COLUMNS)
        for c, cell in row.items():
            if cell["value"] is None:
                assert isinstance(cell["reason"], str) and len(cell["reason"]) > 10, (m, c, cell)
            else:
                assert math.isfinite(cell["value"]) and cell["value"] > 0, (m, c, cell)
    # at tiny sizes everything but 7B's EPSO columns (the paper ran 7B without EP) is measurable
    for m in MODELS:
        for c in ("fsmoe_fb", "fsmoe_training", "combined"):
            assert res["rows"][m][c]["value"] is not None, (m, c, res["rows"][m][c])
        if m != "mula-7b-a1b":
            for c in ("epso_optimizer", "epso_training"):
                assert res["rows"][m][c]["value"] is not None, (m, c, res["rows"][m][c])
    assert "without EP" in res["rows"]["mula-7b-a1b"]["epso_optimizer"]["reason"]


def test_contestants_agree_with_their_baselines(table3):
    _, res, _ = table3
    for m, row in res["rows"].items():
        assert row["fsmoe_fb"]["correct"]["ok"], m
        assert row["fsmoe_training"]["correct"]["ok"], m
        if m != "mula-7b-a1b":
            assert row["epso_training"]["correct"]["ok"], m


def test_published_rows_are_present(table3):
    _, res, out = table3
    assert res["published"] == PUBLISHED
    md = (out / "table3.md").read_text()
    csv_rows = [line.split(",")[:2] for line in (out / "table3.csv").read_text().splitlines()[1:]]
    for m in MODELS:
        assert [m, "published"] in csv_rows and [m, "measured"] in csv_rows
    assert md.count("| published |") == len(MODELS)
    assert "| 2.83 |" in md and "| 1.51 |" in md  # 7B F+B, 220B combined as published


def test_optimizer_state_bytes_equal_the_formula(table3):
    _, res, _ = table3
    assert state_bytes_match(res)
    for m in MODELS[1:]:
        per = res["models"][m]["optimizer_state_bytes"]
        assert len(per["sharded"]) == len(per["epso"]) == 4  # every rank of DP 2 x EP 2
        for kind, ranks in per.items():
            for r in ranks:
                assert r["measured"] == state_bytes_formula(kind, r["dense_params"], r["expert_params"], 2, 2)
        # EPSO splits the non-expert states over DP x EP instead of DP: strictly fewer bytes per rank
        assert per["epso"][0]["measured"] < per["sharded"][0]["measured"]


def test_combined_is_marked_derived_and_reasons_are_required():
    row = {"fsmoe_training": _cell(1.5), "epso_training": _cell(1.2)}
    assert combined_cell(row, 12)["value"] == pytest.approx(1.8)
    assert "x EPSO training" in combined_cell(row, 12)["derived"]
    assert combined_cell(row, 1)["value"] == 1.5
    row["epso_training"] = _cell(reason="the DP x EP run failed")
    assert combined_cell(row, 12)["value"] is None and "failed" in combined_cell(row, 12)["reason"]
    with pytest.raises(ValueError):
        _cell()


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown model"):
        main(["--table3", "--quick", "--models", "mula-1t", "--out", str(tmp_path), "--no-progress"])
    with pytest.raises(SystemExit, match="--layers must be >= 1"):
        main(["--table3", "--quick", "--layers", "0", "--out", str(tmp_path), "--no-progress"])

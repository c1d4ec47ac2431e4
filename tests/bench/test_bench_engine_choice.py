"""``python -m bench engine_choice``: the wrong-cache scenario with and without the in-use check, at a
small layer above the budgets of the padded op and of the untimed choice (what it prints about speed is the benchmark's; here: that it
runs, and that without the check nothing ever changes the wrong choice)."""
from __future__ import annotations

import json

import torch

from bench.studies.engine_choice import main


def test_engine_choice_scenarios_run(tmp_path, capsys) -> None:
    old = torch.get_num_threads()
    try:
        rc = main(["--shape", "96,96,6,2,512", "--calls", "6", "--rounds", "1", "--busy", "0", "--threads", "1",
                   "--json", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(old)
    assert rc == 0
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    on, off = r["in_use_check"], r["no_in_use_check"]
    for run in (on, off):
        assert len(run["trace"]) == 6 and run["ratio"] > 0 and run["slowest"] in run["per_engine_s"]
    # Without the check the stored (slowest) engine runs every call and stays in the cache.
    assert {t["engine"] for t in off["trace"]} == {off["slowest"]} and off["stored_engine"] == off["slowest"]
    assert not off["history"]
    assert "## wrong stored choice, in-use check on (as shipped)" in out and "after 6 calls: layer" in out


def test_a_layer_auto_does_not_time_is_refused_in_one_line(tmp_path, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--shape", "96,64,6,2,512", "--calls", "2", "--rounds", "1", "--json", str(tmp_path / "r.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "18.0 Mi" in err and "untimed" in err and "larger layer" in err
    assert not (tmp_path / "r.json").exists()

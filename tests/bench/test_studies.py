"""``fastmoe-bench --help`` lists every study under bench/studies/ and every provider, and each study
without a flag runs as ``fastmoe-bench NAME``."""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import bench.studies
from bench.cli import build_parser, main
from bench.harness.providers import ALL_PROVIDERS, EXTERNAL_PROVIDERS, NAMED_PROVIDERS
from bench.studies import STUDIES, SUBCOMMANDS


def test_every_study_module_is_listed():
    modules = {m.name for m in pkgutil.iter_modules([str(Path(bench.studies.__file__).parent)])}
    assert modules == {s.name for s in STUDIES}


def test_help_names_every_study_and_how_to_run_it():
    text = build_parser().format_help()
    for s in STUDIES:
        assert f"  {s.name} " in text, s.name
        assert (s.run or f"fastmoe-bench {s.name}") in text, s.name


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_a_subcommand_is_the_study_s_own_command_line(name, capsys):
    assert callable(importlib.import_module(f"bench.studies.{name}").main)
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert f"usage: fastmoe-bench {name}" in capsys.readouterr().out


def test_help_names_every_provider():
    text = build_parser().format_help()
    for name in (*ALL_PROVIDERS, *NAMED_PROVIDERS, *EXTERNAL_PROVIDERS):
        assert name in text, name


def test_fp8_recipes_prints_both_recipes_errors(capsys):
    """``fastmoe-bench fp8_recipes`` at a tiny layer: one row per recipe and outlier factor, each error a
    few percent (fp8's noise), none zero (the layer really ran quantized) or past 30%."""
    from bench.studies import fp8_recipes

    assert fp8_recipes.main(["--shape", "8", "32", "16", "3", "2", "--outliers", "1", "100"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| x") and "recipe" not in line]
    assert [r.split("|")[1:3] for r in rows] == [[" x1 ", " fp8 "], [" x1 ", " fp8-block "], [" x100 ", " fp8 "],
                                                 [" x100 ", " fp8-block "]]
    for r in rows:
        errs = [float(v) for v in r.strip("|").split("|")[2:]]
        assert len(errs) == 5 and all(0 < e < 30 for e in errs), r


def test_decode_weights_times_the_three_ways_and_checks_them_equal(tmp_path, capsys):
    """``fastmoe-bench decode_weights`` at a tiny block: a row per token count with the three times, the
    ratios computed from them, the table written with ``--out``; a bad shape is one line, exit 2."""
    from bench.harness.usage import UsageError
    from bench.studies import decode_weights

    out = tmp_path / "decode.md"
    assert decode_weights.main(["--shape", "32", "24", "6", "2", "--tokens", "1", "5", "--rounds", "2",
                                "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line.strip("|").split("|") for line in printed.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [int(r[0]) for r in rows] == [1, 5]
    for r in rows:
        full, per_call, frozen = (float(v) for v in r[1:4])
        assert min(full, per_call, frozen) > 0
        # the ratios of the unrounded times: within the rounding of the printed ones
        assert float(r[4].strip()[:-1]) == pytest.approx(per_call / frozen, rel=0.05, abs=0.01), r
        assert float(r[5].strip()[:-1]) == pytest.approx(full / frozen, rel=0.05, abs=0.01), r
        bf16 = float(r[6])  # the bf16 block, and the frozen way over the faster float block
        ratio, faster = r[7].split()
        assert bf16 > 0 and faster == ("(bf16)" if bf16 < full else "(fp32)"), r
        assert float(ratio[:-1]) == pytest.approx(min(full, bf16) / frozen, rel=0.05, abs=0.01), r
    assert out.read_text().strip() in printed
    with pytest.raises(UsageError, match="K=7 experts per token of E=6"):
        decode_weights.main(["--shape", "32", "24", "6", "7"])

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

"""A misused command line of ``fastmoe-bench`` or a study: exit status 2, one line on stderr that names
what is wrong, no traceback, and nothing written under the working directory, before any work."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import build_parser, main
from bench.harness.usage import count, nonnegative, seconds
from bench.studies import SUBCOMMANDS
from tree_util import snapshot

ROOT = Path(__file__).resolve().parents[2]

#: the size options of each study's own command line (the layer benchmark's are read off its parser)
STUDY_SIZES = {
    "audit": ["--experts", "--top-k", "--tokens"],
    "engine_choice": ["--calls", "--rounds", "--threads"],
    "lora": ["--scale", "--tokens", "--rank", "--rounds", "--threads"],
    "op_overhead": ["--rounds", "--calls"],
    "precision": ["--steps", "--context", "--micro-batch", "--threads", "--rounds"],
    "saved": ["--tokens", "--rounds"],
    "small_shapes": ["--rounds", "--reps"],
    "traffic": ["--rounds", "--scale", "--tokens", "--bandwidth", "--peak-tflops"],
}
#: where each command writes: (prefix, option, what goes there)
OUTPUTS = [([], "--out", "dir"), (["--demo"], "--out", "dir"), (["precision"], "--out", "dir"),
           (["engine_choice"], "--json", "file"), (["lora"], "--json", "file")]


def _main_sizes() -> list[tuple[str, bool]]:
    """The layer benchmark's size options, each with whether 0 is refused."""
    out = []
    for a in build_parser()._actions:
        if a.type in (count, seconds):
            out.append((a.option_strings[-1], True))
        elif a.type is nonnegative:
            out.append((a.option_strings[-1], False))
    return out


def _size_cases() -> list[tuple[list[str], str]]:
    cases = []
    for opt, zero_refused in _main_sizes():
        for prefix in ([], ["--demo"]):
            cases += [([*prefix, opt, v], opt) for v in (["0", "-1"] if zero_refused else ["-1"])]
    for name, opts in STUDY_SIZES.items():
        cases += [([name, opt, v], opt) for opt in opts for v in ("0", "-1")]
    return cases


def test_every_study_has_its_sizes_listed():
    assert set(STUDY_SIZES) <= set(SUBCOMMANDS)
    main_sizes = {o for o, _ in _main_sizes()}
    assert {"--rounds", "--tokens", "--layers", "--context", "--shape-tokens", "--budget"} <= main_sizes


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """A working directory with a file ``afile``, a directory ``adir`` and a read-only directory ``ro``."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    (tmp_path / "ro").chmod(stat.S_IRWXU)


def _refused(argv: list[str], root: Path, capsys) -> str:
    """``main(argv)`` exits 2 with one stderr line and changes nothing under ``root``: that line."""
    capsys.readouterr()
    before = snapshot(root, dirs=True)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, (argv, exc.value.code, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, (argv, err)
    assert snapshot(root, dirs=True) == before, argv
    return err


@pytest.mark.parametrize("prefix", [[], ["--demo"], *([name] for name in SUBCOMMANDS)], ids=str)
def test_an_unknown_option(prefix, cwd, capsys):
    err = _refused([*prefix, "--no-such-option"], cwd, capsys)
    assert "--no-such-option" in err and "--help" in err


@pytest.mark.parametrize("argv, option", _size_cases(), ids=str)
def test_a_size_below_its_bound(argv, option, cwd, capsys):
    err = _refused(argv, cwd, capsys)
    assert option in err and argv[-1] in err and "--help" in err


@pytest.mark.parametrize("prefix, option, kind", OUTPUTS, ids=str)
def test_a_file_where_a_directory_goes_and_back(prefix, option, kind, cwd, capsys):
    wrong = "afile" if kind == "dir" else "adir"
    err = _refused([*prefix, option, wrong], cwd, capsys)
    assert f"{option} {wrong}:" in err and ("a file is there" if kind == "dir" else "a directory is there") in err


@pytest.mark.parametrize("prefix, option, kind", OUTPUTS, ids=str)
def test_a_path_under_a_regular_file(prefix, option, kind, cwd, capsys):
    err = _refused([*prefix, option, "afile/sub"], cwd, capsys)
    assert f"{cwd / 'afile'} is a file" in err


@pytest.mark.parametrize("prefix, option, kind", OUTPUTS, ids=str)
def test_a_read_only_target(prefix, option, kind, cwd, capsys):
    if os.access(cwd / "ro", os.W_OK):
        pytest.skip("the read-only directory is writable here (running as root)")
    err = _refused([*prefix, option, "ro/sub"], cwd, capsys)
    assert f"{cwd / 'ro'} is not writable" in err


@pytest.mark.parametrize("prefix, option", [(p, o) for p, o, kind in OUTPUTS if kind == "file"], ids=str)
def test_a_file_in_a_missing_directory(prefix, option, cwd, capsys):
    err = _refused([*prefix, option, "missing/x.json"], cwd, capsys)
    assert "no directory missing" in err


@pytest.mark.parametrize("argv", [["--out", "afile"], ["traffic", "--no-such-option"]], ids=str)
def test_from_a_shell(argv, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "bench", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [["--cuda-graph"], ["--cuda-graph", "--mode", "infer"],
                                  ["--cuda-graph", "--mode", "fwd", "--device", "cuda"]], ids=str)
def test_cuda_graphs_need_inference_on_cuda(argv, cwd, capsys):
    err = _refused([*argv, "--preset", "tiny"], cwd, capsys)
    assert "--cuda-graph captures inference calls on a CUDA device" in err and "--mode infer" in err

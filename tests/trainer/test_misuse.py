"""The trainer's console commands used wrongly: a missing path, a file where a directory goes and
the reverse, a read-only target, a negative or zero size, an unknown option. Each ends with exit
status 2 and one line on stderr, no traceback, before any work: nothing under the working
directory changes. In-process calls of each command's ``main(argv)``; one subprocess per command
shows the installed console behaviour."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import main as train_main
from trainer.data.preprocess import main as preprocess_main
from trainer.ft.launch import main as launch_main
from trainer.outputs.export import main as export_main
from tree_util import snapshot

REPO = Path(__file__).resolve().parents[2]
COMMANDS = {"fastmoe-train": train_main, "fastmoe-launch": launch_main, "fastmoe-preprocess": preprocess_main,
            "fastmoe-export": export_main}

#: Inputs made in the working directory before each case: a text file, a file, a directory, a
#: directory named like a config file, and a read-only directory.
PRE = ["--input", "corpus.txt", "--context", "8"]
CASES = {
    "fastmoe-train": {
        "missing path": ["--data", "missing"],
        "missing config": ["--config", "missing.toml"],
        "file for a directory": ["--out", "afile/run"],
        "directory for a file": ["--config", "adir.toml"],
        "read-only target": ["--out", "ro/run"],
        "zero size": ["--steps", "0"],
        "negative size": ["--micro-batch", "-1"],
        "zero processes": ["--nproc-per-node", "0"],
        "unknown option": ["--bogus", "1"],
        "read-only export folder": ["--export-hf", "/sys/hf"],  # before training, not after it
    },
    "fastmoe-launch": {
        "missing path": ["--out", "run", "--", "--data", "missing"],
        "file for a directory": ["--out", "afile/run", "--"],
        "directory for a file": ["--out", "run", "--", "--config", "adir.toml"],
        "read-only target": ["--out", "ro/run", "--"],
        "zero size": ["--nnodes", "0", "--out", "run", "--"],
        "zero processes": ["--nproc-per-node", "0", "--out", "run", "--"],
        "negative size": ["--max-restarts", "-1", "--out", "run", "--"],
        "unknown option": ["--bogus", "--out", "run", "--"],
        "trainer option before --": ["--out", "run", "--preset", "tiny-moe"],
    },
    "fastmoe-preprocess": {
        "missing path": ["--input", "missing.txt", "--context", "8", "--out", "data"],
        "file for a directory": [*PRE, "--out", "afile"],
        "directory for a file": [*PRE, "--tokenizer", "adir.toml", "--out", "data"],
        "read-only target": [*PRE, "--out", "ro"],
        "zero size": ["--input", "corpus.txt", "--context", "0", "--out", "data"],
        "negative size": [*PRE, "--shards", "-1", "--out", "data"],
        "bad fraction": [*PRE, "--valid", "1.5", "--out", "data"],
        "unknown option": [*PRE, "--out", "data", "--bogus"],
        "binary input": ["--input", "/bin/ls", "--context", "8", "--out", "data"],
        "--out inside an input": ["--input", ".", "--context", "8", "--out", "data"],
        "--out is an input": ["--input", "adir.toml", "corpus.txt", "--context", "8", "--out", "adir.toml"],
    },
    "fastmoe-export": {
        "missing path": ["--checkpoint", "missing", "--out", "hf"],
        "file for a directory": ["--checkpoint", "afile", "--out", "hf"],
        "file for an output directory": ["--checkpoint", "adir.toml", "--out", "afile"],
        "directory for a file": ["--checkpoint", "adir.toml", "--out", "hf", "--config", "adir.toml"],
        "read-only target": ["--checkpoint", "adir.toml", "--out", "ro/hf"],
        "zero size": ["--checkpoint", "adir.toml", "--out", "hf", "--max-shard-size", "0"],
        "negative size": ["--checkpoint", "adir.toml", "--out", "hf", "--max-shard-size", "-1"],
        "unknown option": ["--checkpoint", "adir.toml", "--out", "hf", "--bogus"],
    },
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text("words of a small corpus. " * 40)
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "adir.toml").mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    ro.chmod(stat.S_IRWXU)


def _run(command: str, argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = COMMANDS[command](argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command,case", [(c, k) for c, cases in CASES.items() for k in cases])
def test_misuse_is_one_line_and_exit_2_changing_nothing(workdir, capsys, command, case):
    if case == "read-only target" and os.access(workdir / "ro", os.W_OK):
        pytest.skip("this user writes in a read-only directory (root)")
    before = snapshot(workdir, dirs=True)
    code, err = _run(command, CASES[command][case], capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "error:" in lines[0], err
    assert snapshot(workdir, dirs=True) == before, f"{command} {case} changed the working directory"


@pytest.mark.parametrize("command,argv,says", [
    ("fastmoe-launch", ["--out", "run", "--preset", "tiny-moe"],
     "error: unrecognized arguments: --preset; trainer options go after --: fastmoe-launch [launcher options] -- "
     "--preset tiny-moe; fastmoe-launch --help lists every option"),
    ("fastmoe-launch", ["--nnodes", "0", "--out", "run", "--"],
     "error: --nnodes '0': give N, the number of nodes that train (>= 1); N:M would name the fewest (N) and the "
     "most (M) nodes of an elastic job, and only N:N is supported"),
    ("fastmoe-launch", ["--nproc-per-nod", "2"],
     "error: unrecognized arguments: --nproc-per-nod (did you mean --nproc-per-node?); fastmoe-launch --help lists "
     "every option"),
    ("fastmoe-preprocess", [*PRE, "--out", "data", "--bogus"],
     "fastmoe-preprocess: error: unrecognized arguments: --bogus; fastmoe-preprocess --help lists every option"),
    ("fastmoe-preprocess", [*PRE, "--valid", "1.5", "--out", "data"],
     "fastmoe-preprocess: error: --valid must be a fraction in (0, 1) or a whole count, got 1.5"),
    ("fastmoe-train", ["--ep", "3", "--nproc-per-node", "2"],
     "error: num_experts=8 is not divisible by EP=3; --ep must divide num_experts=8 and the world 2: 1 or 2"),
    ("fastmoe-train", ["--ep", "4", "--nproc-per-node", "2"],
     "error: world size 2 is not divisible by PP x EP = 1 x 4; --ep must divide num_experts=8 and the world 2: "
     "1 or 2"),
])
def test_the_line_names_the_way_forward(workdir, capsys, command, argv, says):
    code, err = _run(command, argv, capsys)
    assert code == 2 and err.strip() == says, err


def test_a_directory_input_names_what_it_skips_and_the_last_line_counts_everything(workdir, capsys):
    src = workdir / "src"
    src.mkdir()
    for name in ("a.py", "b.py", "c.py"):
        (src / name).write_text("print('hello')\n")
    (src / "README").write_text("read me\n")
    code, err = _run("fastmoe-preprocess", ["--input", "src", "--context", "8", "--out", "data"], capsys)
    assert code == 2 and err.strip() == (
        "fastmoe-preprocess: error: input directory 'src' holds no .txt .md .jsonl .parquet .arrow .txt.gz .md.gz "
        ".jsonl.gz files (it holds 4 other files: README, a.py, b.py, c.py; name such files themselves to read them "
        "as plain text)")
    (src / "doc.txt").write_text("some words here. " * 40)
    assert preprocess_main(["--input", "src", "--context", "8", "--out", "data", "--valid", "2", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == ("fastmoe-preprocess: src: reading its .txt .md .jsonl .parquet .arrow .txt.gz .md.gz "
                           ".jsonl.gz files; skipped 4 other files: README, a.py, b.py, c.py (name a file itself to "
                           "read it as plain text)")
    import json

    m = json.loads((workdir / "data" / "manifest.json").read_text())
    dropped = m["valid"]["train_instances_dropped_as_duplicates"]
    assert dropped > 0  # the corpus repeats itself: copies of the held-out instances leave training
    assert out.strip().startswith(f"wrote {m['num_instances']} training instances + 2 held out for validation "
                                  f"({dropped} training instances equal to a held-out one dropped) of 8+1 tokens")


@pytest.mark.parametrize("command,argv", [("fastmoe-launch", ["--nnodes", "0", "--out", "run", "--"]),
                                          ("fastmoe-preprocess", [*PRE, "--out", "afile"])])
def test_the_console_command_says_one_line(workdir, command, argv):
    module = {"fastmoe-launch": "trainer.ft.launch", "fastmoe-preprocess": "trainer.data.preprocess"}[command]
    before = snapshot(workdir, dirs=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert snapshot(workdir, dirs=True) == before


@pytest.mark.parametrize("argv,says", [
    (["--input", "/bin/ls", "--context", "8", "--out", "data"], "input '/bin/ls' is not text (NUL bytes"),
    (["--input", ".", "--context", "8", "--out", "data"], "--out data is inside the input directory ."),
])
def test_preprocess_refuses_what_it_would_garble(workdir, capsys, argv, says):
    if not os.path.isfile("/bin/ls"):
        pytest.skip("no /bin/ls here")
    code, err = _run("fastmoe-preprocess", argv, capsys)
    assert code == 2 and says in err, err


def test_preprocess_progress_shows_the_final_token_count(workdir, capsys):
    (workdir / "b.txt").write_text("more words, in a second file. " * 300)
    assert preprocess_main(["--input", "corpus.txt", "b.txt", "--context", "8", "--out", "data"]) == 0
    err = capsys.readouterr().err
    manifest = json.loads((workdir / "data" / "manifest.json").read_text())
    line = next(ln for ln in err.splitlines() if ln.startswith("1/3 tokenize"))
    assert line.endswith(f"tokens={sum(i['tokens'] for i in manifest['inputs'])}"), (line, manifest["inputs"])

"""The documented first run, installed: preprocess one's own text, train on two processes under
torchrun, export, from a directory outside the checkout, against the installed wheel.

The commands are read from docs/trainer.md ("Own data, two processes, export"; README.md shows the
same lines) and run as they stand, the training line with a smaller ``--steps``, batch and checkpoint interval appended (later
options win). The wheel is built offline from a copy of the sources (as tests/test_packaging.py
does) and installed into a fresh virtual environment; that environment reaches torch,
transformers and the rest through one ``.pth`` line naming the project venv's site-packages (a
venv made from a venv with ``--system-site-packages`` sees the base interpreter's packages, not
the project's, and nothing is downloaded). The ``.pth`` line adds the directory alone, without
running the ``.pth`` files in it, so the project venv's editable install of the checkout is not
active: ``trainer`` is not importable there, ``fastmoe_trainer`` comes from the wheel.

Slow (about 40 s on two shared cores): it imports torch in four processes, two of them under
torchrun, which is what the documented command does.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("setuptools")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "trainer.md"
SECTION = "## Own data, two processes, export"
#: Appended to the documented training line: two steps of a small batch, a checkpoint at the end.
SMALL = ["--steps", "2", "--global-batch", "4", "--micro-batch", "2", "--checkpoint.interval", "2",
         "--eval.instances", "4", "--no-logging.tensorboard", "--no-logging.plot", "--logging.peak_tflops", "1"]


def documented_commands() -> list[list[str]]:
    """The lines of the first bash block after :data:`SECTION`."""
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION):], re.S)
    assert block, f"no bash block under {SECTION!r}"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def _clean_env() -> dict[str, str]:
    """This process's environment without what points Python at the checkout: other tests leave
    ``PYTHONPATH`` naming it, where pip would find the checkout's egg-info, take the package as
    installed already and skip installing the wheel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _build_wheel(tmp: Path) -> Path:
    src, out = tmp / "src", tmp / "wheel"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("fastmoe_xpu", "trainer", "bench"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=180, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def _venv_with(wheel: Path, tmp: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120, env=_clean_env())
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip()
    Path(purelib, "_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                           "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=180,
                          env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # torchrun's console script, as installing torch into this venv would write it
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text(f"#!{py}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
    torchrun.chmod(0o755)
    return venv


def test_documented_commands_run_installed_outside_the_checkout(tmp_path):
    cmds = documented_commands()
    assert [c[0] for c in cmds] == ["fastmoe-preprocess", "torchrun", "fastmoe-export"]
    assert cmds[1][cmds[1].index("-m") + 1] == "fastmoe_trainer"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert all(shlex.join(c) in readme for c in cmds), "README.md shows other commands than docs/trainer.md"
    venv = _venv_with(_build_wheel(tmp_path), tmp_path)
    work = tmp_path / "user"  # outside the checkout: nothing there is importable
    work.mkdir()
    corpus = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))
    (work / "corpus.txt").write_text(corpus[:200_000], encoding="utf-8")
    env = _clean_env()
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")

    def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)

    where = run(["python", "-c", "import fastmoe_trainer, importlib.util as u; print(fastmoe_trainer.__file__); "
                                "print(u.find_spec('trainer'))"])
    assert where.returncode == 0, where.stderr
    installed_at, trainer_spec = where.stdout.splitlines()
    assert installed_at.startswith(str(venv)) and trainer_spec == "None", where.stdout

    for argv in cmds:
        argv = argv + SMALL if argv[0] == "torchrun" else argv
        proc = run(argv)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{out[-4000:]}"
        assert "Traceback" not in out and "No module named" not in out, out[-4000:]
    # what the three commands leave behind
    data = work / cmds[0][cmds[0].index("--out") + 1]
    run_out = work / cmds[1][cmds[1].index("--out") + 1]
    export = work / cmds[2][cmds[2].index("--out") + 1]
    assert (data / "manifest.json").is_file()
    assert len((run_out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (export / "config.json").is_file() and any(export.glob("*.safetensors"))

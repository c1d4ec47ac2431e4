"""The built wheel: the library's modules are in it, the repository's tooling is not.

Builds the wheel the way ``pip wheel .`` does, offline (``--no-index``, ``--no-build-isolation``: the
running Python's setuptools), from a copy of what the build reads (setup.py, pyproject.toml,
README.md and the three package folders), so that no ``build/`` or ``*.egg-info`` lands in the
checkout and none left there by an earlier build is read. About 2 s.
"""
from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("setuptools")

REPO = Path(__file__).resolve().parents[1]
#: installed package -> folder in the checkout (setup.py's PACKAGE_DIRS)
PACKAGE_DIRS = {"fastmoe_xpu": "fastmoe_xpu", "fastmoe_trainer": "trainer", "fastmoe_bench": "bench"}
#: Run from the checkout only (python -m fastmoe_xpu.demo, python -m fastmoe_xpu.tools.<name>, tests).
TOOLING = ("fastmoe_xpu/tools/", "fastmoe_xpu/demo.py", "fastmoe_xpu/reference.py")
#: Where the kept Triton config tables live (package data: setup.py's PACKAGE_DATA).
TUNED = "fastmoe_xpu/kernels/tuned"
SAMPLE_TABLE = f"{TUNED}/sample-gpu.json"


def _checkout_modules() -> set[str]:
    """Every module of the three package folders, under its installed path."""
    found = set()
    for name, folder in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            found.add(f"{name}/{path.relative_to(REPO / folder).as_posix()}")
    return found


def _is_tooling(path: str) -> bool:
    return any(path == t or (t.endswith("/") and path.startswith(t)) for t in TOOLING)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "out"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # one kept config table more than the checkout holds, so that the package data is seen shipped
    # before the first device sweep has committed one
    (src / SAMPLE_TABLE).write_text('{"format": 1, "device": "Sample GPU", "entries": []}\n', encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def _modules(zf: zipfile.ZipFile) -> set[str]:
    return {n for n in zf.namelist() if n.endswith(".py")}


def test_wheel_holds_the_library(wheel):
    names = _modules(wheel)
    for path in ("fastmoe_xpu/__init__.py", "fastmoe_xpu/block.py", "fastmoe_xpu/autograd/ops.py",
                 "fastmoe_xpu/kernels/contract.py", "fastmoe_xpu/kernels/triton/grouped_gemm.py",
                 "fastmoe_xpu/autograd/__init__.py", "fastmoe_xpu/integrations/__init__.py",
                 # library code imports it: fastmoe_xpu.dist.comm_bytes and fastmoe_bench.studies.table3.table
                 "fastmoe_xpu/dist/testing.py",
                 "fastmoe_trainer/cli.py", "fastmoe_trainer/ft/launch.py", "fastmoe_trainer/data/preprocess.py",
                 "fastmoe_bench/cli.py", "fastmoe_bench/studies/table3/table.py"):
        assert path in names, f"{path} is missing from the wheel"
    library = {p for p in _checkout_modules() if not _is_tooling(p)}
    assert library - names == set(), f"library modules missing from the wheel: {sorted(library - names)}"


def test_wheel_leaves_the_tooling_out(wheel):
    names = wheel.namelist()
    assert [n for n in names if _is_tooling(n)] == [], "tooling shipped in the wheel"
    # nothing but the three packages and the metadata: no top-level trainer/, bench/, tests/
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == set(PACKAGE_DIRS)
    assert _modules(wheel) == {p for p in _checkout_modules() if not _is_tooling(p)}


def test_wheel_holds_the_kept_config_tables(wheel):
    """The library reads them at a launch (fastmoe_xpu/kernels/kept_configs.py): every one of the
    checkout, and the sample the build's source was given."""
    kept = {f"{TUNED}/{p.name}" for p in (REPO / TUNED).glob("*.json")} | {SAMPLE_TABLE}
    names = set(wheel.namelist())
    assert kept - names == set(), f"kept config tables missing from the wheel: {sorted(kept - names)}"


def test_every_console_script_runs_from_the_wheel(wheel):
    """Each ``[project.scripts]`` entry names a module the wheel carries."""
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    cfg = configparser.ConfigParser()
    cfg.read_string(wheel.read(entry_points).decode())
    scripts = dict(cfg["console_scripts"])
    assert {"fastmoe-train", "fastmoe-bench", "fastmoe-launch", "fastmoe-preprocess"} <= set(scripts)
    names = set(wheel.namelist())
    for script, target in scripts.items():
        module = target.split(":", 1)[0].strip()
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, (
            f"console script {script} points at {module}, which the wheel does not carry")

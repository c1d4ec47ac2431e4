"""scripts/gpu_check.sh and fastmoe_xpu/tools/gpu_check.py without a GPU: a tool that refuses the
device is reported as not run in its own words and fails nothing, the budget is a hard end, the kit's
pure-Python wheels are unpacked into the output folder only where a module is missing, and the dry
run works from the script alone (no make, no torch)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fastmoe_xpu.tools.gpu_check import (SANITIZER_REFUSALS, STEP_KEYS, Step, exit_status, plan, provide_wheels,
                                         run_steps, step_env, summary)

ROOT = Path(__file__).resolve().parents[2]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_refused_device_is_not_run_in_the_tools_words(tmp_path: Path) -> None:
    words = "========= Error: Device not supported. Please refer to the documentation for supported devices."
    steps = [
        Step("timing", _py("print('timed')"), timeout_s=30),
        Step("sanitizer refuses", _py(f"print({words!r}); raise SystemExit(1)"), timeout_s=30,
             refusals=SANITIZER_REFUSALS),
        Step("sanitizer finds an error", _py("print('========= Invalid __global__ read'); raise SystemExit(1)"),
             timeout_s=30, refusals=SANITIZER_REFUSALS),
    ]
    run_steps(steps[:2], tmp_path, tmp_path)
    assert steps[0].status == "passed"
    assert steps[1].status.startswith("not run") and "Error: Device not supported. Please refer" in steps[1].status
    assert exit_status(steps[:2]) == 0
    run_steps(steps[2:], tmp_path, tmp_path)
    assert steps[2].status == "FAILED (exit 1)" and exit_status(steps) == 1


def test_no_step_runs_past_the_budget(tmp_path: Path) -> None:
    import time

    steps = [Step("long", _py("import time; time.sleep(30)"), timeout_s=60),
             Step("after", _py("pass"), timeout_s=60)]
    t0 = time.monotonic()
    run_steps(steps, tmp_path, tmp_path, deadline=t0 + 2.0)
    assert time.monotonic() - t0 < 10
    assert steps[0].status.startswith("FAILED (over its")
    assert steps[1].status == "not run: no time left in the --budget"


def _wheel(path: Path, module: str) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{module}-1.0.dist-info/top_level.txt", f"{module}\n")
    return path


def test_kit_wheels_unpack_into_the_output_folder_only_where_missing(tmp_path: Path) -> None:
    wheels, out = tmp_path / "kit_wheels", tmp_path / "out"
    wheels.mkdir()
    _wheel(wheels / "fastmoe_kit_probe-1.0-py3-none-any.whl", "fastmoe_kit_probe")
    _wheel(wheels / "json-1.0-py3-none-any.whl", "json")  # importable already: left alone
    assert provide_wheels(wheels, out / "pylib") == ["fastmoe_kit_probe-1.0-py3-none-any.whl"]
    assert not (out / "pylib" / "json").exists()
    env = step_env(out)
    assert all(Path(env[k]).is_relative_to(out.resolve()) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"))
    got = subprocess.run(_py("import fastmoe_kit_probe as m; print(m.VALUE, m.__file__)"), env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert got[0] == "42" and Path(got[1]).is_relative_to(out.resolve() / "pylib")
    _wheel(wheels / "native-1.0-cp312-cp312-linux_x86_64.whl", "native")
    with pytest.raises(ValueError, match="not a pure-Python wheel"):
        provide_wheels(wheels, out / "pylib")


def test_dry_run_from_the_script_alone(tmp_path: Path) -> None:
    """With only bash, dirname and a Python on PATH (no make, no venv): the script lists the steps."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").symlink_to(sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path / "o")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "kit wheels" in proc.stdout and "compute-sanitizer --tool racecheck" in proc.stdout
    assert str(tmp_path / "o" / "pylib") in proc.stdout


def test_the_comparison_runs_first_and_leads_the_summary(tmp_path: Path) -> None:
    steps = plan("cuda", tmp_path, ROOT, 540.0)
    assert [s.key for s in steps] == list(STEP_KEYS) and steps[0].key == "compare"
    assert "--shapes" in steps[0].argv and steps[0].env["LIGER_FUSED_MOE_AUTOTUNE"] == "0"
    # a subset: the others are reported, not dropped
    chosen = plan("cuda", tmp_path, ROOT, 540.0, only=("compare", "tests"))
    assert {"mula", "liger-tuned"} <= {s.key for s in chosen if s.skip == "not selected (--steps)"}
    assert all(s.skip for s in chosen if s.key not in ("compare", "tests"))
    assert all(s.skip is None for s in chosen if s.key in ("compare", "tests"))
    run_steps([s for s in chosen if s.skip], tmp_path, tmp_path)  # runs nothing: marks them not run, saying why
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "summary.md").write_text(
        "# Shape set\n\nintro\n\n| shape | fastmoe (auto ->) | F+B TFLOP/s |\n|---|---|---|\n"
        "| qwen3-30b-a3b | fastmoe/triton (triton_tma) | 354.3 |\n\nolmoe: H=2048 ...\n")
    info = {"device_name": "GPU", "date_utc": "today", "python": "3", "torch": "t", "triton": "tr",
            "transformers": "hf"}
    text = summary(chosen, info, tmp_path)
    assert text.index("| qwen3-30b-a3b | fastmoe/triton (triton_tma) | 354.3 |") < text.index("## Steps")
    assert "olmoe: H=2048" not in text and "not selected (--steps)" in text
    assert "(no benchmark table: see the mula step's log)" in text


def test_unknown_steps_are_refused_in_one_line(capsys) -> None:
    from fastmoe_xpu.tools.gpu_check import main

    with pytest.raises(SystemExit):
        main(["--dry-run", "--steps", "compare,nope"])
    assert "unknown step nope; the steps are compare, tests" in capsys.readouterr().err

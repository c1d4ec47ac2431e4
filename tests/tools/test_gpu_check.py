"""scripts/gpu_check.sh and fastmoe_xpu/tools/gpu_check.py without a GPU: a tool that refuses the
device is reported as not run in its own words and fails nothing, the budget is a hard end shared by
the steps that run (their limits add up within it, time left unused goes to the later steps), a step
stopped at its limit leaves its stacks in its log and nothing it started running, the tests step's
pytest command names each test and dumps a stuck one, the first table gives the backward's TFLOP/s,
a failed step's last lines are in the summary, the kit's pure-Python wheels are unpacked into the
output folder only where a module is missing, and the dry run works from the script alone (no make,
no torch)."""
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


def _limits_printed(stdout: str) -> list[float]:
    import re

    return [float(m) for m in re.findall(r"\[limit (\d+) s\]", stdout)]


def test_the_limits_share_the_budget_and_a_selection_shares_all_of_it(tmp_path: Path, capsys) -> None:
    """The default steps' limits add up to the budget less the reserve; racecheck and liger-tuned are not
    default steps (said so); ``--steps`` divides the whole budget among the steps it names, in proportion
    to their shares; the dry run prints each limit and their sum."""
    from fastmoe_xpu.tools.gpu_check import DEFAULT_STEPS, SHARES, main

    assert sum(SHARES[k] for k in DEFAULT_STEPS) == pytest.approx(1.0)
    steps = plan("cuda", tmp_path, ROOT, 540.0)
    run = [s for s in steps if s.key in DEFAULT_STEPS]
    assert [s.key for s in run] == ["compare", "tests", "rows", "mula", "launches", "memcheck"]
    total = sum(s.timeout_s for s in run)  # whole seconds, each rounded down
    assert 535.0 - len(run) <= total <= 535.0 and all(s.timeout_s > 20 and s.timeout_s.is_integer() for s in run)
    for key in ("racecheck", "liger-tuned", "decode", "configs"):
        step = next(s for s in steps if s.key == key)
        assert step.skip.startswith(f"not a default step: --steps {key} runs it")
    chosen = plan("cuda", tmp_path, ROOT, 230.0, only=("liger-tuned", "launches"))
    runs = {s.key: s.timeout_s for s in chosen if s.key in ("liger-tuned", "launches")}
    assert 223.0 <= sum(runs.values()) <= 225.0
    assert runs["liger-tuned"] / runs["launches"] == pytest.approx(SHARES["liger-tuned"] / SHARES["launches"], rel=0.05)
    assert main(["--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    printed = _limits_printed(out)
    assert len(printed) == len(DEFAULT_STEPS) and sum(printed) <= 540.0
    assert out.count("[no limit: not run]") == 4 and f"= {sum(printed):.0f} s of the 540 s budget" in out
    assert main(["--dry-run", "--out", str(tmp_path / "o"), "--steps", "liger-tuned,launches", "--budget", "230"]) == 0
    printed = _limits_printed(capsys.readouterr().out)
    assert len(printed) == 2 and 220 <= sum(printed) <= 230


def test_the_comparison_leaves_out_the_loop_engine_and_liger_tuned_runs_the_least() -> None:
    steps = {s.key: s for s in plan("cuda", Path("/o"), ROOT, 540.0)}
    compare, liger = steps["compare"].argv, steps["liger-tuned"].argv
    providers = compare[compare.index("--providers") + 1:compare.index("--rounds")]
    assert "fastmoe/triton@loop" not in providers and "fastmoe/triton@loop" in steps["mula"].argv
    assert {"fastmoe/triton", "fastmoe/triton@triton_tma", "fastmoe/triton@grouped_mm", "hf_v5_grouped_mm",
            "liger"} <= set(providers) and compare[compare.index("--precision") + 1:][:3] == ["none", "fp8", "fp8-block"]
    assert liger[liger.index("--providers") + 1:liger.index("--rounds")] == ["fastmoe/triton", "liger"]
    assert steps["liger-tuned"].env["LIGER_FUSED_MOE_AUTOTUNE"] == "1"


def test_the_tests_step_names_each_test_dumps_a_stuck_one_and_runs_workers_where_xdist_is(
        tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    from fastmoe_xpu.tools import gpu_check

    argv = gpu_check.tests_argv("py", ["tests/kernels"], "cuda", tmp_path, 80.0, 4)
    assert argv[:3] == ["py", "-m", "pytest"] and "-v" in argv and "--durations=15" in argv
    assert argv[argv.index("-o") + 1] == "faulthandler_timeout=40" and argv[-2:] == ["-n", "4"]
    assert f"--junitxml={tmp_path / 'tests.xml'}" in argv and "-rfEs" in argv
    assert "-n" not in gpu_check.tests_argv("py", [], "cuda", tmp_path, 400.0, None)
    assert "faulthandler_timeout=60" in gpu_check.tests_argv("py", [], "cuda", tmp_path, 400.0, None)
    real = importlib.util.find_spec
    for found, want in ((True, ["-n", str(gpu_check.TEST_WORKERS)]), (False, None)):
        def find_spec(name, *a, found=found):  # noqa: ANN001, ANN202
            return (object() if found else None) if name == "xdist" else real(name, *a)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        tests = next(s for s in plan("cuda", tmp_path, ROOT, 540.0) if s.key == "tests").argv
        assert (tests[-2:] == want) if want else "-n" not in tests
    monkeypatch.undo()
    # the argv runs: pytest takes every option (one tiny test file, in this process's Python)
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    argv = gpu_check.tests_argv(sys.executable, [str(tmp_path / "test_one.py")], "cpu", tmp_path, 80.0, None)
    argv = [a for a in argv if a not in ("--device", "cpu")]  # the suite's own option (tests/conftest.py)
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_one.py::test_one PASSED" in proc.stdout and "slowest" in proc.stdout
    assert (tmp_path / "tests.xml").exists()


def test_a_step_at_its_limit_dumps_its_stacks_and_its_whole_group_stops(tmp_path: Path) -> None:
    """SIGABRT before the limit: a Python step (PYTHONFAULTHANDLER, as step_env sets) ends its log with
    where it was; SIGKILL at the limit to its process group: a process it started is gone too."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen(['sleep', '120']); open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('started', flush=True)\n"
            "def waiting_here():\n    time.sleep(120)\n"
            "waiting_here()\n")
    step = Step("stuck", _py(code), timeout_s=60)
    t0 = time.monotonic()
    run_steps([step], tmp_path, tmp_path, env={"PYTHONFAULTHANDLER": "1"}, deadline=t0 + 5.0)
    assert time.monotonic() - t0 < 15
    assert step.status.startswith("FAILED (over its 5 s limit") and step.limit_s == pytest.approx(5.0, abs=0.5)
    log = Path(step.log).read_text()
    assert "started" in log and "Fatal Python error: Aborted" in log and "waiting_here" in log
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":  # killed, not yet reaped by its new parent
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail(f"the step's child {child} outlived the step")
    assert not list(tmp_path.glob("core*"))


def test_time_an_early_step_leaves_goes_to_the_steps_after_it(tmp_path: Path) -> None:
    import time

    steps = [Step("quick", _py("pass"), timeout_s=10, share=0.5),
             Step("next", _py("pass"), timeout_s=6, share=0.3),
             Step("last", _py("pass"), timeout_s=4, share=0.2)]
    run_steps(steps, tmp_path, tmp_path, deadline=time.monotonic() + 20.0)
    assert all(s.status == "passed" for s in steps)
    assert steps[0].limit_s == pytest.approx(10, abs=0.5)
    assert steps[1].limit_s > 6 + 1 and steps[2].limit_s > steps[1].limit_s * 0.2 / 0.3


def _shapes_json() -> dict:
    """Two shapes as the comparison's JSON holds them (the fields the summary reads, values of an H200 run)."""
    def case(name: str, fwd_flops: float, ours: tuple, peer: tuple, peer_name: str) -> dict:
        rows = [{"provider": "torch.mm (same FLOPs)", "status": "ok", "fwd_ms": 4.4, "fwdbwd_ms": None,
                 "fwd_tflops": 749.3, "fwdbwd_tflops": None},
                {"provider": "fastmoe/triton", "status": "ok", "fwd_ms": ours[0], "fwdbwd_ms": ours[1],
                 "fwd_tflops": fwd_flops / ours[0] / 1e9, "fwdbwd_tflops": 3 * fwd_flops / ours[1] / 1e9},
                {"provider": peer_name, "status": "ok", "fwd_ms": peer[0], "fwdbwd_ms": peer[1],
                 "fwd_tflops": fwd_flops / peer[0] / 1e9, "fwdbwd_tflops": 3 * fwd_flops / peer[1] / 1e9}]
        return {"case": {"preset": {"name": name}, "flops": {"fwd": fwd_flops, "bwd": 2 * fwd_flops,
                                                               "fwdbwd": 3 * fwd_flops, "infer": fwd_flops}},
                "table": rows,
                "comparison": {"shape": name, "fastmoe": "fastmoe/triton", "engine": "triton_tma",
                               "fastmoe_fwd_tflops": rows[1]["fwd_tflops"],
                               "fastmoe_fwdbwd_tflops": rows[1]["fwdbwd_tflops"],
                               "peer": peer_name, "peer_fwd_tflops": rows[2]["fwd_tflops"],
                               "peer_fwdbwd_tflops": rows[2]["fwdbwd_tflops"], "fwd_ratio": peer[0] / ours[0],
                               "fwdbwd_ratio": peer[1] / ours[1], "fastmoe_peak_mb": 5637.6, "peer_peak_mb": 7301.3,
                               "fastmoe_error": 7.27e-3, "peer_error": 8.66e-3}}

    olmoe = case("olmoe-1b-7b", 3298534883328.0, (7.31, 27.54), (14.84, 39.73), "hf_v5_grouped_mm")
    stub = case("deepseek-v3-ep8", 1e12, (1.0, 3.0), (2.0, 5.0), "hf_v5_grouped_mm")
    stub["comparison"] = None
    return {"command": "fastmoe-bench --shapes practitioners", "cases": [olmoe, stub]}


def test_the_first_table_gives_the_backwards_tflops_from_the_comparisons_json(tmp_path: Path) -> None:
    import json

    from fastmoe_xpu.tools.gpu_check import backward_tflops, comparison_table

    data = _shapes_json()
    olmoe = data["cases"][0]
    ours = olmoe["table"][1]
    # (F+B FLOPs - forward FLOPs) / (F+B ms - forward ms): 6.597e12 FLOPs in 20.23 ms
    assert backward_tflops(olmoe["case"]["flops"], ours) == pytest.approx(6597069766656.0 / 20.23e-3 / 1e12)
    assert backward_tflops(olmoe["case"]["flops"], {"fwd_ms": 3.0, "fwdbwd_ms": 3.0}) is None
    table = comparison_table(data)
    assert "bwd TFLOP/s (x fwd)" in table[0] and "peer bwd TFLOP/s (x fwd)" in table[0]
    row = table[2].split(" | ")
    assert row[0] == "| olmoe-1b-7b" and row[1] == "fastmoe/triton (triton_tma)" and row[2] == "359.3"
    assert row[3] == "326.1 (0.72x)"  # 6.597e12 / 20.23 ms; 451.2 TFLOP/s forward
    assert row[4] == "hf_v5_grouped_mm" and row[5] == "249.1" and row[6] == "265.0 (1.19x)"
    assert row[7:9] == ["2.03x", "1.44x"] and row[9] == "5638 / 7301"
    assert "| deepseek-v3-ep8 | no comparison:" in table[3]
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "shapes_practitioners.json").write_text(json.dumps(data))
    info = {"device_name": "GPU", "date_utc": "today", "python": "3", "torch": "t", "triton": "tr",
            "transformers": "hf"}
    text = summary(plan("cuda", tmp_path, ROOT, 540.0), info, tmp_path)
    assert text.index("| olmoe-1b-7b | fastmoe/triton (triton_tma) | 359.3 | 326.1 (0.72x) |") < text.index("## Steps")


def test_a_failed_steps_last_lines_are_in_the_summary(tmp_path: Path) -> None:
    steps = [Step("fails", _py("print('line one'); print('the last words'); raise SystemExit(3)"), timeout_s=30,
                  key="tests"),
             Step("passes", _py("print('quiet')"), timeout_s=30, key="rows")]
    run_steps(steps, tmp_path, tmp_path)
    info = {"device_name": "GPU", "date_utc": "today", "python": "3", "torch": "t", "triton": "tr",
            "transformers": "hf"}
    text = summary(steps, info, tmp_path)
    assert "## What the failed steps printed last" in text and "### tests: the last lines of" in text
    assert "the last words" in text and "quiet" not in text
    assert "| tests: fails | FAILED (exit 3) |" in text


def test_the_decode_and_config_steps(tmp_path):
    """Opt-in: decode times CUDA-graph replays at the decode presets beside transformers' two
    implementations for small batches; configs writes this GPU's kept config table into the output
    folder, its own budget inside the step's limit; decode is CUDA's alone."""
    steps = {s.key: s for s in plan("cuda", tmp_path, ROOT, 540.0, only=("decode", "configs"))}
    dec, cfg = steps["decode"], steps["configs"]
    assert dec.skip is None and cfg.skip is None
    assert {"--mode", "infer", "--cuda-graph", "--preset", "decode"} <= set(dec.argv)
    assert dec.argv[dec.argv.index("--providers") + 1:][:3] == ["hf_v5_grouped_mm", "hf_v5_batched_mm", "fastmoe/triton"]
    assert dec.argv[dec.argv.index("--precision") + 1:][:3] == ["none", "fp8", "fp8-block"]  # bf16 and both fp8 recipes
    assert cfg.argv[cfg.argv.index("--out") + 1] == str(tmp_path / "tuned.json")
    assert float(cfg.argv[cfg.argv.index("--budget") + 1]) < cfg.timeout_s
    xpu = {s.key: s for s in plan("xpu", tmp_path, ROOT, 540.0, only=("decode",))}
    assert xpu["decode"].skip == "CUDA graphs are CUDA's; no capture on xpu"

"""One command that proves the package on a GPU: ``make gpu-check`` (``scripts/gpu_check.sh``).

Runs on any machine with a CUDA or XPU device, with the Python and the torch / triton /
transformers versions found there (no network), and writes everything into one folder:

1. ``versions.json``: device, driver-visible name, Python, torch, triton, transformers, date;
2. the kernel and block tests on the device with compiled kernels (``pytest --device <dev>``; their
   fp32 and bf16 cases), JUnit XML and log;
3. ``bench --device <dev> --dtype bf16`` on the Mula presets against ``hf_v4``,
   ``hf_v5_grouped_mm`` and ``hf_v5_eager``, each grouped-GEMM engine of ours as its own provider
   (``fastmoe/<backend>@<engine>``) beside the ``auto`` one, whose choice the report names; the
   benchmark's GEMM-only bound is its dense ``torch.mm`` of the same FLOPs in the same run; then
   ``bench --shapes practitioners``: TFLOP/s of one layer at the shapes published kernels are
   compared on (T=32k), beside a dense ``torch.mm`` of the same FLOPs;
4. ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` over a small forward+backward
   (CUDA, where the tool is installed; otherwise the step says why it did not run; where the tool
   refuses the device, e.g. ``Device not supported``, the step is reported as not run with the tool's
   own words and does not fail the check);
5. ``summary.md``: one row per step (ran / failed / not run, and why) and the benchmark's table,
   ready to paste into docs/bench.md.

What the machine's Python lacks and the kit carries (pure-Python wheels in ``kit_wheels/``, prepared
by ``scripts/prepare_kit_wheels.sh``) is unpacked into ``<out>/pylib`` and put on the steps'
``PYTHONPATH``; the Triton and TorchInductor caches go to ``<out>/cache``: nothing is written outside
the output folder.

Without a device it says so and exits 2; ``--dry-run`` lists the steps and exits 0. Every step has
a time limit, and none may run past the ``--budget`` (default 600 s) counted from the start, so the
whole run ends within it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PRESETS = ("mula-7b-a1b", "mula-7b-a1b-small", "mula-20b-a2b", "mula-220b-a10b")
BASELINES = ("hf_v4", "hf_v5_grouped_mm", "hf_v5_eager")
ENGINES = ("triton", "triton_tma", "grouped_mm", "loop")
NO_DEVICE_EXIT = 2
#: compute-sanitizer's words when it cannot instrument the GPU it finds (seen on an H200).
SANITIZER_REFUSALS = ("Device not supported",)
#: Seconds kept back from the budget for writing the summary after the last step.
_RESERVE_S = 5.0
#: This module's name for ``python -m`` (scripts/gpu_check.sh runs the file, where __package__ is empty).
_THIS_MODULE = f"{__package__}.gpu_check" if __package__ else "fastmoe_xpu.tools.gpu_check"


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None
    """Why the step cannot run here (reported in the summary, never dropped silently)."""
    refusals: tuple[str, ...] = ()
    """Words of a tool that refuses this machine (case-insensitive): a failed run whose log holds
    one is reported as not run, with the tool's line, instead of as a failure."""
    status: str = "not run"
    seconds: float = 0.0
    log: str = ""


def find_device() -> str | None:
    """``"cuda"`` or ``"xpu"`` when torch sees one, else None (also when torch is not installed)."""
    try:
        import torch
    except ImportError:
        return None

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


def _bench_module() -> str:
    """The benchmark's module name: ``bench`` in a checkout, ``fastmoe_bench`` when installed."""
    for name in ("bench", "fastmoe_bench"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "bench"


def plan(device: str, out: Path, repo: Path, budget_s: float, python: str = sys.executable) -> list[Step]:
    """The steps for ``device``, writing under ``out`` (nothing runs here)."""
    steps: list[Step] = []
    tests = [p for p in ("tests/kernels", "tests/test_block.py") if (repo / p).exists()]
    steps.append(Step(
        "kernel and block tests on the device (fp32 and bf16 cases)",
        [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests, "--device", device,
         "-m", "not distributed and not slow", f"--junitxml={out / 'tests.xml'}"],
        timeout_s=0.3 * budget_s, env={"FASTMOE_TEST_DEVICE": device, "TRITON_INTERPRET": "0"},
        skip=None if tests else f"no tests/ folder under {repo} (an installed package): run from a checkout",
    ))
    providers = [*BASELINES, "fastmoe/triton", *(f"fastmoe/triton@{e}" for e in ENGINES)]
    steps.append(Step(
        "bench bf16 F+B on the Mula presets, every engine, against transformers",
        [python, "-m", _bench_module(), "--device", device, "--dtype", "bf16", "--mode", "fwdbwd",
         "--preset", *PRESETS, "--providers", *providers, "--rounds", "5", "--budget", str(int(0.08 * budget_s)),
         "--no-progress", "--out", str(out / "bench")],
        timeout_s=0.35 * budget_s, env={"FASTMOE_GEMM_CACHE": str(out / "gemm_engines.json")},
    ))
    steps.append(Step(
        "bench bf16 TFLOP/s at the practitioners' shapes (OLMoE, Qwen3, GPT-OSS, Mixtral, DeepSeek-V3 slice)",
        [python, "-m", _bench_module(), "--shapes", "practitioners", "--device", device, "--dtype", "bf16",
         "--rounds", "3", "--no-progress", "--out", str(out / "practitioners")],
        timeout_s=0.2 * budget_s, env={"FASTMOE_GEMM_CACHE": str(out / "gemm_engines.json")},
    ))
    sanitizer = shutil.which("compute-sanitizer")
    for tool in ("memcheck", "racecheck"):
        why = None
        if device != "cuda":
            why = f"compute-sanitizer is NVIDIA's tool; no equivalent run on {device}"
        elif sanitizer is None:
            why = "compute-sanitizer not found on PATH (CUDA toolkit not installed)"
        steps.append(Step(
            f"compute-sanitizer --tool {tool} over a small forward+backward",
            [sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "1", python, "-m",
             _THIS_MODULE, "--small-fwdbwd", "--device", device],
            timeout_s=0.1 * budget_s, skip=why, refusals=SANITIZER_REFUSALS,
        ))
    return steps


def small_fwdbwd(device: str) -> None:
    """One small forward and backward of the block on the Triton backend (for the sanitizers)."""
    from types import SimpleNamespace

    import torch

    from fastmoe_xpu.block import FastSparseMoeBlock  # absolute: the script runs this file by path

    cfg = SimpleNamespace(hidden_size=128, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=True, hidden_act="silu")
    for dtype in (torch.float32, torch.bfloat16):
        block = FastSparseMoeBlock(cfg, backend="triton", gemm_engine="triton").to(device=device, dtype=dtype)
        x = torch.randn(2, 37, 128, device=device, dtype=dtype, requires_grad=True)
        block(x).float().square().mean().backward()
    getattr(torch, device).synchronize()
    print(f"small forward+backward on {device}: ok")


def versions(device: str | None) -> dict[str, str | None]:
    import torch

    def ver(mod: str) -> str | None:
        try:
            return str(__import__(mod).__version__)
        except Exception:
            return None

    name = None
    if device == "cuda":
        name = torch.cuda.get_device_name()
    elif device == "xpu":
        name = torch.xpu.get_device_name()
    return {"device": device, "device_name": name, "python": platform.python_version(), "torch": torch.__version__,
            "triton": ver("triton"), "transformers": ver("transformers"),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def refusal(log_text: str, words: tuple[str, ...]) -> str | None:
    """The first line of a tool's output that holds one of ``words`` (its refusal), stripped of the
    tool's ``=========`` prefix; None when there is none."""
    for line in log_text.splitlines():
        if any(w.lower() in line.lower() for w in words):
            return line.strip().lstrip("=").strip()
    return None


def run_steps(steps: list[Step], out: Path, cwd: Path, env: dict[str, str] | None = None,
              deadline: float | None = None) -> None:
    """Run the steps in order, each within its own limit and, given ``deadline`` (a
    ``time.monotonic()`` value), none past it: a step with no time left is reported as not run."""
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.name}", flush=True)
        limit = step.timeout_s
        if deadline is not None and not step.skip:
            limit = min(limit, deadline - time.monotonic())
            if limit < 1:
                step.skip = "no time left in the --budget"
        if step.skip:
            step.status = f"not run: {step.skip}"
            print(f"    {step.status}", flush=True)
            continue
        log_path = out / f"step{i}.log"
        t0 = time.monotonic()
        try:
            with open(log_path, "w", encoding="utf-8") as log:
                proc = subprocess.run(step.argv, cwd=cwd, env={**os.environ, **(env or {}), **step.env}, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=limit)
            step.status = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            refused = refusal(log_path.read_text(encoding="utf-8", errors="replace"), step.refusals) \
                if proc.returncode != 0 and step.refusals else None
            if refused:
                step.status = f"not run: the tool refused this machine: {refused!r}"
        except subprocess.TimeoutExpired:
            step.status = f"FAILED (over its {limit:.0f} s limit)"
        except OSError as exc:
            step.status = f"FAILED to start: {exc}"
        step.seconds = time.monotonic() - t0
        step.log = str(log_path)
        print(f"    {step.status} in {step.seconds:.0f} s (log: {log_path})", flush=True)


def _wheel_modules(whl: zipfile.ZipFile) -> list[str]:
    names = whl.namelist()
    top = next((n for n in names if n.endswith(".dist-info/top_level.txt")), None)
    if top is not None:
        return [m for m in whl.read(top).decode().split() if m]
    return sorted({n.split("/", 1)[0].removesuffix(".py") for n in names
                   if not n.split("/", 1)[0].endswith((".dist-info", ".data"))})


def provide_wheels(wheel_dir: Path, target: Path) -> list[str]:
    """Unpack each pure-Python wheel of ``wheel_dir`` whose modules this Python cannot import into
    ``target`` (a pure-Python wheel's files are its installed layout); returns the wheels unpacked.
    Raises ValueError for a wheel that is not pure Python (it could not run everywhere)."""
    used = []
    for path in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        if not path.name.endswith("-none-any.whl"):
            raise ValueError(f"error: {path} is not a pure-Python wheel (*-none-any.whl); the kit carries only those")
        with zipfile.ZipFile(path) as whl:
            modules = _wheel_modules(whl)
            if modules and all(importlib.util.find_spec(m) is not None for m in modules):
                continue
            target.mkdir(parents=True, exist_ok=True)
            whl.extractall(target)
        used.append(path.name)
    return used


def step_env(out: Path) -> dict[str, str]:
    """What every step runs with: the unpacked kit wheels importable, the compilers' caches in ``out``."""
    env = {"TRITON_CACHE_DIR": str((out / "cache" / "triton").resolve()),
           "TORCHINDUCTOR_CACHE_DIR": str((out / "cache" / "inductor").resolve())}
    pylib = out / "pylib"
    if pylib.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pylib.resolve()), os.environ.get("PYTHONPATH")) if p)
    return env


def summary(steps: list[Step], info: dict, out: Path) -> str:
    lines = [f"# GPU check: {info.get('device_name') or info.get('device')}", "",
             f"{info['date_utc']}; Python {info['python']}, torch {info['torch']}, triton {info['triton']}, "
             f"transformers {info['transformers']}; kit wheels unpacked: {', '.join(info.get('kit_wheels') or []) or 'none'}",
             "", "| step | result | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in steps]
    table = out / "bench" / "results.md"
    lines += ["", "## Benchmark (bf16, forward+backward, one MoE layer)", ""]
    lines += [table.read_text(encoding="utf-8")] if table.exists() else ["(no benchmark table: see the bench step's log)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default gpu_check_out/<date>)")
    ap.add_argument("--dry-run", action="store_true", help="list the steps and exit 0")
    ap.add_argument("--device", choices=("cuda", "xpu"), default=None, help="default: the one torch sees")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds for the whole run (default 600)")
    ap.add_argument("--small-fwdbwd", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    started = time.monotonic()
    if args.budget <= 0:
        raise SystemExit("--budget must be > 0")
    if args.small_fwdbwd:
        small_fwdbwd(args.device or find_device() or "cpu")
        return 0
    repo = Path.cwd()
    out = Path(args.out or f"gpu_check_out/{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}")
    if args.dry_run:
        device = args.device or "cuda"
        print(f"gpu-check dry run (device {device}; the real run uses the device torch sees), output {out}:")
        wheels = sorted(p.name for p in (repo / "kit_wheels").glob("*.whl"))
        print(f"  0. unpack into {out / 'pylib'} the kit wheels whose modules are missing: "
              f"{', '.join(wheels) or 'none in kit_wheels/ (scripts/prepare_kit_wheels.sh)'}")
        for i, step in enumerate(plan(device, out, repo, args.budget), 1):
            print(f"  {i}. {step.name}  [limit {step.timeout_s:.0f} s]")
            print(f"     {shlex.join(step.argv)}")
            if step.skip:
                print(f"     (would not run: {step.skip})")
        print(f"  {len(plan(device, out, repo, args.budget)) + 1}. write {out / 'versions.json'} and {out / 'summary.md'}")
        return 0
    device = args.device or find_device()
    if device is None:
        print("gpu-check: no device found (torch sees neither CUDA nor XPU); nothing was measured", file=sys.stderr)
        return NO_DEVICE_EXIT
    out.mkdir(parents=True, exist_ok=True)
    info = versions(device)
    info["kit_wheels"] = provide_wheels(repo / "kit_wheels", out / "pylib")
    (out / "versions.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    steps = plan(device, out, repo, args.budget)
    run_steps(steps, out, repo, env=step_env(out), deadline=started + args.budget - _RESERVE_S)
    text = summary(steps, info, out)
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(f"wrote {out / 'summary.md'}")
    return exit_status(steps)


def exit_status(steps: list[Step]) -> int:
    """0 when every step passed or did not run (each saying why), 1 when one failed."""
    return 0 if all(s.status == "passed" or s.status.startswith("not run") for s in steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""One command that proves the package on a GPU: ``make gpu-check`` (``scripts/gpu_check.sh``).

Runs on any machine with a CUDA or XPU device, with the Python and the torch / triton /
transformers versions found there (no network), and writes everything into one folder:

1. ``versions.json``: device, driver-visible name, Python, torch, triton, transformers, date;
2. ``compare``: the question a user asks first, is it faster than what I would use instead on this GPU?
   ``bench --shapes practitioners`` in bf16 at the shapes published MoE kernels compare on (OLMoE-1B-7B,
   Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-20B, Mixtral-8x7B, DeepSeek-V3's EP=8 slice; T=32k):
   forward and F+B TFLOP/s of FastSparseMoE's ``auto`` (the engine it picked named) and its engines
   ``triton``, ``triton_tma`` and ``grouped_mm`` (not ``loop``, a torch.mm per expert at 130-190 ms a
   call here: the mula step times it), transformers' ``grouped_mm`` and Liger-Kernel's fused MoE (with
   its one pinned config, ``LIGER_FUSED_MOE_AUTOTUNE=0``: its autotuner compiles some 200 configs,
   minutes on a fresh machine; set the variable to 1 to let it tune), the ratio of ours to the
   fastest peer, peak memory and each one's error against an fp32 reference; the summary's first
   table, with the backward's TFLOP/s beside the forward's for ours and the peer. ``fastmoe/triton:fp8``
   (the Triton fp8 grouped GEMMs, per-row and per-channel scales) and ``fastmoe/triton:fp8-block``
   (block-scaled, quantized inside the GEMMs' loads) run beside the plain provider, their speed over bf16
   printed under each table;
3. ``tests``: the kernel and block tests on the device with compiled kernels (``pytest --device <dev>``;
   their fp32 and bf16 cases), ``-v`` (each test named in the log as it finishes), a test stuck for
   half the step's limit (at most 60 s) dumping every thread's stack into the log, the 15 slowest
   listed, in 4 pytest-xdist workers where xdist is importable; JUnit XML and log;
4. ``rows``: ``python -m fastmoe_xpu.tools.large_rows``: a bf16 layer at T=140,000, K=8, E=16, H=512,
   I=1024, whose gate/up buffer holds 2.3e9 elements, on each Triton engine: outputs and gradients finite
   and equal to the torch backend on sampled tokens (an int32 offset that wraps shows here);
5. ``mula``: ``bench --device <dev> --dtype bf16`` on the Mula presets against ``hf_v4``,
   ``hf_v5_grouped_mm`` and ``hf_v5_eager``, each grouped-GEMM engine of ours as its own provider
   (``fastmoe/<backend>@<engine>``) beside the ``auto`` one, with the benchmark's GEMM-only bound;
6. ``launches``: ``bench traffic --shape olmoe-1b-7b qwen3-30b-a3b qwen3-235b-a22b --sets triton triton:composed
   triton+fp8 triton+fp8-block --time <dev>``: each Triton launch of one bf16 and each fp8 recipe's
   forward+backward (stages 4-5) at
   three practitioners' shapes (the goals' two first) timed with device events (min of 3 after a
   warm-up): its ms, GB/s and TFLOP/s beside the bytes and GEMM FLOPs counted on the meta device and
   the pass's roofline floor (H200's figures), so the backward's time is placed pass by pass; beside it
   the same set without its fused launchers (``:composed``), what the fused down backward gains or loses;
7. ``memcheck``: ``compute-sanitizer`` over a small forward+backward (CUDA, where the tool is installed;
   otherwise the step says why it did not run; where the tool refuses the device, e.g. ``Device not
   supported``, the step is reported as not run with the tool's own words and does not fail the check);
8. ``summary.md``: the comparison, one row per step (ran / failed / not run, and why; its time and
   limit), the last lines of each failed step's log, then the Mula table.

Four more steps run only when ``--steps`` names them (the dry run and the summary say so):
``racecheck``, ``compute-sanitizer --tool racecheck`` over a tinier bf16 forward+backward (it
instruments every shared-memory access: not done in 45 s on an H200); ``liger-tuned``, Qwen3-30B-A3B
again with Liger's autotuner on (its published shape), FastSparseMoE beside it and nothing else;
``decode``, ``bench --mode infer --cuda-graph --preset decode``: OLMoE-1B-7B and Qwen3-30B-A3B layers at
T = 1, 8, 64 and 256 tokens, each provider's forward captured in a CUDA graph and its replays timed,
against transformers' ``grouped_mm`` and ``batched_mm`` (CUDA only); and ``configs``, ``python -m
fastmoe_xpu.tools.config_sweep``: this GPU's kept Triton config table, written as ``<out>/tuned.json``
to be copied into ``fastmoe_xpu/kernels/tuned/`` and committed.

A step that fails does not stop the others; ``--steps`` runs a subset (the others are reported as not
selected). What the machine's Python lacks and the kit carries (pure-Python wheels in ``kit_wheels/``, prepared
by ``scripts/prepare_kit_wheels.sh``) is unpacked into ``<out>/pylib`` and put on the steps'
``PYTHONPATH``; the Triton and TorchInductor caches go to ``<out>/cache``: nothing is written outside
the output folder.

Without a device it says so and exits 2; ``--dry-run`` lists the steps with their limits and exits 0.
The ``--budget`` (default 540 s, nine minutes) less a 5 s reserve for the summary is shared by the steps
that run, each in proportion to its share (:data:`SHARES`; the default steps' shares add up to 1, and
the steps ``--steps`` names divide the whole budget among themselves); time a step leaves unused goes
to the steps after it. A step at its limit gets SIGABRT (every Python process of it prints its
threads' stacks into the log) and then SIGKILL, its whole process group, so the run ends within the
budget and the log says where the step was.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PRESETS = ("mula-7b-a1b", "mula-7b-a1b-small", "mula-20b-a2b", "mula-220b-a10b")
BASELINES = ("hf_v4", "hf_v5_grouped_mm", "hf_v5_eager")
ENGINES = ("triton", "triton_tma", "grouped_mm", "loop")
#: The comparison's providers: transformers' grouped_mm, our ``auto`` (its fp8 twin follows it) and each
#: engine but ``loop`` (a torch.mm per expert, 130-190 ms a call at T=32k: the mula step times it), the peers.
COMPARE_PROVIDERS = ("hf_v5_grouped_mm", "fastmoe/triton", *(f"fastmoe/triton@{e}" for e in ENGINES if e != "loop"),
                     "liger", "sonicmoe")
#: The steps in the order they run (``--steps`` names a subset).
STEP_KEYS = ("compare", "tests", "rows", "mula", "launches", "memcheck", "racecheck", "liger-tuned", "decode",
             "configs")
#: The steps a run without ``--steps`` runs. racecheck did not finish a tiny forward+backward in 45 s on
#: an H200, and Liger's autotuner compiles some 200 kernel configs (minutes) on a fresh machine: each
#: runs when ``--steps`` names it, with the budget shared among the steps named.
DEFAULT_STEPS = ("compare", "tests", "rows", "mula", "launches", "memcheck")
#: Each step's share of the budget less the reserve. The default steps' shares add up to 1; the steps
#: a run selects divide the budget in proportion to theirs. Sized from runs on a fresh H200 (torch 2.11,
#: triton 3.6, 16 cores): compare took 243 s for 3 of its 6 shapes, some 170 s of it drawing their
#: inputs on the host (by their element counts at one core's rate), which the bench now draws on the
#: device; launches 115 s, most of it drawing inputs on the host too; tests 34 s (one process), rows
#: 12 s, mula 56 s, memcheck 41 s.
SHARES = {"compare": 0.42, "tests": 0.15, "rows": 0.05, "mula": 0.14, "launches": 0.10, "memcheck": 0.14,
          "racecheck": 0.3, "liger-tuned": 0.8, "decode": 0.3, "configs": 0.8}
#: The launches step's shapes (of the practitioners' set, timed in this order): the device goals' two first.
LAUNCH_SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "qwen3-235b-a22b")
#: The decode step's providers: transformers' two implementations for small batches and ours (hf_v4, the
#: correctness reference, runs too, eagerly: its masks are read on the host, so it cannot be captured).
DECODE_PROVIDERS = ("hf_v5_grouped_mm", "hf_v5_batched_mm", "fastmoe/triton")
#: ... and fastmoe/triton's fp8 recipes beside its bf16 (inference calls keep the quantized weights,
#: ``frozen_expert_weights``: the codes are made before the capture, the graphs replay the GEMMs alone).
DECODE_PRECISIONS = ("none", "fp8", "fp8-block")
#: pytest-xdist workers of the tests step where xdist is importable (the kernel compilations run in
#: parallel; the GPU machine has 16 cores).
TEST_WORKERS = 4
DEFAULT_BUDGET_S = 540.0
NO_DEVICE_EXIT = 2
#: compute-sanitizer's words when it cannot instrument the GPU it finds (seen on an H200).
SANITIZER_REFUSALS = ("Device not supported",)
#: Seconds kept back from the budget for writing the summary after the last step.
_RESERVE_S = 5.0
#: A step at its limit is sent SIGABRT this many seconds before it (every Python process of it dumps
#: its threads' stacks into the log: PYTHONFAULTHANDLER), then SIGKILL at the limit, its process group whole.
_STOP_GRACE_S = 3.0
#: Lines of a failed step's log quoted in the summary.
_TAIL_LINES = 25
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
    key: str = ""
    """The step's name for ``--steps``."""
    share: float | None = None
    """Its share of the budget (:data:`SHARES`): at run time the step gets this share of the time left,
    over the shares of the steps still to run (never less than ``timeout_s`` when the earlier steps kept
    to theirs); None: ``timeout_s`` alone, cut to the deadline."""
    status: str = "not run"
    seconds: float = 0.0
    limit_s: float = 0.0
    """The limit it ran under."""
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


def limits(keys: list[str] | tuple[str, ...], budget_s: float) -> dict[str, float]:
    """Each step's limit in whole seconds: ``keys`` (the steps that will run) share the budget less the
    reserve in proportion to their :data:`SHARES`, each rounded down, so they add up to at most that."""
    usable = max(0.0, budget_s - _RESERVE_S)
    total = sum(SHARES[k] for k in keys)
    return {k: float(math.floor(usable * SHARES[k] / total)) for k in keys} if total else {}


def tests_argv(python: str, tests: list[str], device: str, out: Path, limit_s: float,
               workers: int | None) -> list[str]:
    """The tests step's pytest command: each test named as it finishes (``-v``), a test stuck for half
    the step's limit (at most 60 s) dumps every thread's stack into the log (pytest's
    ``faulthandler_timeout``), the 15 slowest listed, JUnit XML; ``workers``: pytest-xdist processes
    (None: one process)."""
    stuck = max(5, min(60, int(limit_s / 2)))
    argv = [python, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", *tests, "--device", device,
            "-m", "not distributed and not slow", "-o", f"faulthandler_timeout={stuck}", "--durations=15",
            f"--junitxml={out / 'tests.xml'}"]
    if workers:
        argv += ["-n", str(workers)]
    return argv


def plan(device: str, out: Path, repo: Path, budget_s: float, python: str = sys.executable,
         only: tuple[str, ...] | None = None, test_workers: int | None = -1) -> list[Step]:
    """The steps for ``device``, writing under ``out`` (nothing runs here); ``only``: the keys to run
    (:data:`STEP_KEYS`; default :data:`DEFAULT_STEPS`), the others reported as not selected or not
    default. The steps that will run share the budget (:func:`limits`). ``test_workers``: pytest-xdist
    workers of the tests step (-1: :data:`TEST_WORKERS` where xdist is importable, else none)."""
    if test_workers == -1:
        test_workers = TEST_WORKERS if importlib.util.find_spec("xdist") is not None else None
    bench = [python, "-m", _bench_module()]
    cache = {"FASTMOE_GEMM_CACHE": str(out / "gemm_engines.json")}
    liger_pinned = os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "0")
    tests = [p for p in ("tests/kernels", "tests/test_block.py") if (repo / p).exists()]
    sanitizer = shutil.which("compute-sanitizer")

    def sanitizer_skip() -> str | None:
        if device != "cuda":
            return f"compute-sanitizer is NVIDIA's tool; no equivalent run on {device}"
        if sanitizer is None:
            return "compute-sanitizer not found on PATH (CUDA toolkit not installed)"
        return None

    skips = {
        "tests": None if tests else f"no tests/ folder under {repo} (an installed package): run from a checkout",
        "memcheck": sanitizer_skip(), "racecheck": sanitizer_skip(),
        "liger-tuned": None if liger_pinned == "0" else "Liger's autotuner was on in the comparison already",
    }
    chosen = DEFAULT_STEPS if only is None else only
    for key in STEP_KEYS:
        if key not in chosen:  # the reason that holds first, before any the machine would give
            skips[key] = ("not selected (--steps)" if only is not None else
                          f"not a default step: --steps {key} runs it (with the whole budget; name the other "
                          "steps too to run them beside it)")
    # the selection shares the budget; a selected step that cannot run on this machine (no sanitizer)
    # keeps its planned share, which goes to the others at run time (run_steps)
    limit = limits([k for k in STEP_KEYS if k in chosen], budget_s)

    def lim(key: str) -> float:
        return limit.get(key) or limits([key], budget_s)[key]  # a step that will not run: its share alone

    steps: list[Step] = [Step(
        key="compare", name="the comparison: bf16 TFLOP/s against transformers and Liger at the practitioners' shapes",
        argv=[*bench, "--shapes", "practitioners", "--device", device, "--dtype", "bf16", "--precision", "none",
              "fp8", "fp8-block", "--providers", *COMPARE_PROVIDERS, "--rounds", "3",
              "--budget", str(max(2, round(0.025 * lim("compare")))), "--no-progress", "--out", str(out / "compare")],
        timeout_s=lim("compare"), env={**cache, "LIGER_FUSED_MOE_AUTOTUNE": liger_pinned},
    )]
    steps.append(Step(
        key="tests", name="kernel and block tests on the device (fp32 and bf16 cases)",
        argv=tests_argv(python, tests, device, out, lim("tests"), test_workers),
        timeout_s=lim("tests"), env={"FASTMOE_TEST_DEVICE": device, "TRITON_INTERPRET": "0"},
    ))
    steps.append(Step(
        key="rows", name="a bf16 layer whose row buffers pass 2^31 elements (T=140,000, K=8), against the torch backend",
        argv=[python, "-m", "fastmoe_xpu.tools.large_rows", "--device", device, "--json", str(out / "large_rows.json")],
        timeout_s=lim("rows"), env=cache,
    ))
    def bench_presets(key: str, name: str, mode: list[str], presets: list[str], providers: list[str], rounds: int,
                      per_provider: float, folder: str) -> Step:
        """A bf16 ``fastmoe-bench`` run over presets; ``per_provider``: each provider's budget per case as
        a share of the step's limit."""
        return Step(key=key, name=name, timeout_s=lim(key), env=cache,
                    argv=[*bench, "--device", device, "--dtype", "bf16", *mode, "--preset", *presets, "--providers",
                          *providers, "--rounds", str(rounds), "--budget", str(max(2, round(per_provider * lim(key)))),
                          "--no-progress", "--out", str(out / folder)])

    steps.append(bench_presets("mula", "bench bf16 F+B on the Mula presets, every engine, against transformers",
                               ["--mode", "fwdbwd"], list(PRESETS),
                               [*BASELINES, "fastmoe/triton", *(f"fastmoe/triton@{e}" for e in ENGINES)], 3, 0.2,
                               "bench"))
    steps.append(Step(
        key="launches", name="each launch of one bf16 F+B timed at the practitioners' shapes (ms, GB/s, TFLOP/s), "
                             "beside its counted bytes, FLOPs and roofline floor",
        argv=[*bench, "traffic", "--shape", *LAUNCH_SHAPES, "--sets", "triton", "triton:composed", "triton+fp8",
              "triton+fp8-block", "--time", device, "--rounds", "3"],
        timeout_s=lim("launches"), env=cache,
    ))
    for tool, size in (("memcheck", "small"), ("racecheck", "tiny")):
        steps.append(Step(
            key=tool, name=f"compute-sanitizer --tool {tool} over a {size} forward+backward",
            argv=[sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "1", python, "-m",
                  _THIS_MODULE, f"--{size}-fwdbwd", "--device", device],
            timeout_s=lim(tool), refusals=SANITIZER_REFUSALS,
        ))
    steps.append(Step(
        key="liger-tuned", name="Qwen3-30B-A3B with Liger's autotuner on (its published shape), fastmoe beside it",
        argv=[*bench, "--shapes", "practitioners", "--shape-names", "qwen3-30b-a3b", "--device", device, "--dtype",
              "bf16", "--providers", "fastmoe/triton", "liger", "--rounds", "3",
              "--budget", str(max(2, round(0.025 * lim("liger-tuned")))), "--no-progress", "--out",
              str(out / "liger_tuned")],
        timeout_s=lim("liger-tuned"), env={**cache, "LIGER_FUSED_MOE_AUTOTUNE": "1"},
    ))
    steps.append(bench_presets("decode", "decode in CUDA graphs: OLMoE-1B-7B and Qwen3-30B-A3B layers at T=1, 8, 64, "
                               "256, bf16 and fp8 experts, against transformers' grouped_mm and batched_mm",
                               ["--mode", "infer", "--cuda-graph", "--precision", *DECODE_PRECISIONS], ["decode"],
                               list(DECODE_PROVIDERS), 5, 0.04, "decode"))
    steps.append(Step(
        key="configs", name="the Triton config sweep at the practitioners' shapes: this GPU's kept table "
                            "(copy it into fastmoe_xpu/kernels/tuned/ and commit it)",
        argv=[python, "-m", "fastmoe_xpu.tools.config_sweep", "--device", device, "--budget",
              str(max(10, int(lim("configs")) - 30)), "--out", str(out / "tuned.json")],
        timeout_s=lim("configs"),
    ))
    if device != "cuda":
        skips["decode"] = skips.get("decode") or f"CUDA graphs are CUDA's; no capture on {device}"
    for step in steps:
        step.skip = skips.get(step.key)
        step.share = SHARES[step.key]
    return steps


def _fwdbwd(device: str, hidden: int, inter: int, experts: int, tokens: int, dtypes) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    import torch

    from fastmoe_xpu.block import FastSparseMoeBlock  # absolute: the script runs this file by path

    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, num_experts=experts, num_experts_per_tok=2,
                          norm_topk_prob=True, hidden_act="silu")
    for dtype in dtypes:
        block = FastSparseMoeBlock(cfg, backend="triton", gemm_engine="triton").to(device=device, dtype=dtype)
        x = torch.randn(2, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        block(x).float().square().mean().backward()
    getattr(torch, device).synchronize()


def small_fwdbwd(device: str) -> None:
    """One small forward and backward of the block on the Triton backend, fp32 and bf16 (for memcheck)."""
    import torch

    _fwdbwd(device, 128, 96, 8, 37, (torch.float32, torch.bfloat16))
    print(f"small forward+backward on {device}: ok")


def tiny_fwdbwd(device: str) -> None:
    """A tinier one, bf16 only, for racecheck (which instruments every shared-memory access)."""
    import torch

    _fwdbwd(device, 64, 32, 4, 9, (torch.bfloat16,))
    print(f"tiny forward+backward on {device}: ok")


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


def _no_core_dumps() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The SIGABRT that stops a step at its limit must not leave a core file in the checkout."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _run_one(step: Step, log, cwd: Path, env: dict[str, str], limit: float) -> int | None:  # noqa: ANN001
    """Run ``step`` in a process group of its own; its exit code, or None when it reached ``limit``:
    then SIGABRT to the group ``_STOP_GRACE_S`` before the limit (Python processes started with
    PYTHONFAULTHANDLER dump their stacks into the log: what it was doing, a stuck test's xdist worker
    included), SIGKILL to whatever is left of the group at the limit."""
    posix = os.name == "posix"
    proc = subprocess.Popen(step.argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=posix, preexec_fn=_no_core_dumps if posix else None)
    soft = max(limit - _STOP_GRACE_S, limit / 2)
    try:
        return proc.wait(timeout=soft)
    except subprocess.TimeoutExpired:
        pass
    if not posix:
        proc.kill()
        proc.wait()
        return None
    log.flush()
    _signal_group(proc, signal.SIGABRT)
    try:
        proc.wait(timeout=limit - soft)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()
    return None


def run_steps(steps: list[Step], out: Path, cwd: Path, env: dict[str, str] | None = None,
              deadline: float | None = None) -> None:
    """Run the steps in order, each within its limit and, given ``deadline`` (a ``time.monotonic()``
    value), none past it: a step with a share (:attr:`Step.share`) gets that share of the time left
    over the shares of the steps still to run, so time an earlier step did not use goes to the later
    ones; a step with no time left is reported as not run."""
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.name}", flush=True)
        limit = step.timeout_s
        if deadline is not None and not step.skip:
            left = deadline - time.monotonic()
            pending = [s.share for s in steps[i - 1:] if not s.skip and s.share]
            limit = left * step.share / sum(pending) if step.share and pending else min(limit, left)
            if limit < 1:
                step.skip = "no time left in the --budget"
        if step.skip:
            step.status = f"not run: {step.skip}"
            print(f"    {step.status}", flush=True)
            continue
        log_path = out / f"step{i}.log"
        step.limit_s = limit
        t0 = time.monotonic()
        try:
            with open(log_path, "w", encoding="utf-8") as log:
                code = _run_one(step, log, cwd, {**os.environ, **(env or {}), **step.env}, limit)
            if code is None:
                step.status = f"FAILED (over its {limit:.0f} s limit; the stacks at the stop end its log)"
            else:
                step.status = "passed" if code == 0 else f"FAILED (exit {code})"
                refused = refusal(log_path.read_text(encoding="utf-8", errors="replace"), step.refusals) \
                    if code != 0 and step.refusals else None
                if refused:
                    step.status = f"not run: the tool refused this machine: {refused!r}"
        except OSError as exc:
            step.status = f"FAILED to start: {exc}"
        step.seconds = time.monotonic() - t0
        step.log = str(log_path)
        print(f"    {step.status} in {step.seconds:.0f} s of its {limit:.0f} (log: {log_path})", flush=True)


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
    """What every step runs with: the unpacked kit wheels importable, the compilers' caches in ``out``,
    Python's fault handler on and its output unbuffered (a stopped step's log ends where it was)."""
    env = {"TRITON_CACHE_DIR": str((out / "cache" / "triton").resolve()),
           "TORCHINDUCTOR_CACHE_DIR": str((out / "cache" / "inductor").resolve()),
           # a step stopped at its limit says where it was (SIGABRT dumps every thread's stack), and
           # its log holds what it printed up to then
           "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    pylib = out / "pylib"
    if pylib.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pylib.resolve()), os.environ.get("PYTHONPATH")) if p)
    return env


def backward_tflops(flops: dict, row: dict) -> float | None:
    """The backward's TFLOP/s of one provider's row: (F+B FLOPs - forward FLOPs) over (F+B ms - forward
    ms), both medians; None where either time is missing or the difference is not positive."""
    fwd_ms, fb_ms = row.get("fwd_ms"), row.get("fwdbwd_ms")
    if not fwd_ms or not fb_ms or fb_ms <= fwd_ms:
        return None
    return (flops["fwdbwd"] - flops["fwd"]) / ((fb_ms - fwd_ms) / 1e3) / 1e12


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _bwd_cell(flops: dict, row: dict | None) -> str:
    """``bwd TFLOP/s (bwd over fwd TFLOP/s)``."""
    bwd = backward_tflops(flops, row) if row else None
    fwd = (row or {}).get("fwd_tflops")
    return "-" if bwd is None else f"{bwd:.1f} ({bwd / fwd:.2f}x)" if fwd else f"{bwd:.1f}"


COMPARISON_COLUMNS = ("shape", "fastmoe (auto ->)", "F+B TFLOP/s", "bwd TFLOP/s (x fwd)", "fastest peer",
                      "peer F+B TFLOP/s", "peer bwd TFLOP/s (x fwd)", "fwd ratio", "F+B ratio",
                      "peak MB ours / peer", "max error ours / peer")


def comparison_table(data: dict) -> list[str]:
    """The comparison of a ``bench --shapes`` JSON (``shapes_practitioners.json``), one row per shape: our
    default against the fastest peer, forward and F+B ratios, and each one's backward TFLOP/s
    (:func:`backward_tflops`) with its ratio to the forward's."""
    cols = COMPARISON_COLUMNS
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for case in data.get("cases", []):
        c, flops = case.get("comparison"), case["case"]["flops"]
        if c is None:
            lines.append(f"| {case['case']['preset']['name']} | no comparison: FastSparseMoE or every peer did not "
                         "run |" + " |" * (len(cols) - 2))
            continue
        rows = {r["provider"]: r for r in case.get("table", [])}
        lines.append("| " + " | ".join((
            c["shape"], f"{c['fastmoe']} ({c.get('engine') or '-'})", _num(c["fastmoe_fwdbwd_tflops"], ".1f"),
            _bwd_cell(flops, rows.get(c["fastmoe"])), c["peer"], _num(c["peer_fwdbwd_tflops"], ".1f"),
            _bwd_cell(flops, rows.get(c["peer"])), f"{c['fwd_ratio']:.2f}x", f"{c['fwdbwd_ratio']:.2f}x",
            f"{_num(c.get('fastmoe_peak_mb'), '.0f')} / {_num(c.get('peer_peak_mb'), '.0f')}",
            f"{_num(c.get('fastmoe_error'), '.1e')} / {_num(c.get('peer_error'), '.1e')}")) + " |")
    return lines


def _comparison(folder: Path) -> list[str]:
    """The comparison table of a ``bench --shapes`` run: built from its JSON (:func:`comparison_table`),
    else its summary.md's (from the table's header to the first blank line after it); a line saying
    why when there is none."""
    found = sorted(folder.glob("shapes_*.json"))
    if found:
        try:
            return comparison_table(json.loads(found[0].read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as exc:
            return [f"(no comparison: {found[0]} could not be read: {type(exc).__name__}: {exc})"]
    path = folder / "summary.md"
    if not path.exists():
        return [f"(no comparison: {path} was not written; see the step's log)"]
    text = path.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith("| shape |")), None)
    if start is None:
        return [f"(no comparison table in {path})"]
    end = next((i for i in range(start, len(text)) if not text[i].strip()), len(text))
    return text[start:end]


def _tail(path: Path, n: int = _TAIL_LINES) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return [f"(log not readable: {exc})"]
    return text.rstrip("\n").splitlines()[-n:] or ["(the log is empty)"]


def _failed_tails(steps: list[Step]) -> list[str]:
    """For each failed step, the last lines of its log (a stopped step's end with the stacks it was in)."""
    lines: list[str] = []
    for s in steps:
        if s.status.startswith("FAILED") and s.log:
            lines += ["", f"### {s.key}: the last lines of {s.log}", "", "```", *_tail(Path(s.log)), "```"]
    return (["", "## What the failed steps printed last"] + lines) if lines else []


def summary(steps: list[Step], info: dict, out: Path) -> str:
    lines = [f"# GPU check: {info.get('device_name') or info.get('device')}", "",
             f"{info['date_utc']}; Python {info['python']}, torch {info['torch']}, triton {info['triton']}, "
             f"transformers {info['transformers']}; kit wheels unpacked: {', '.join(info.get('kit_wheels') or []) or 'none'}",
             "", "## FastSparseMoE against the fastest peer (bf16, T=32k, forward and forward+backward)", "",
             "Ratio: the peer's median time over ours (above 1: FastSparseMoE is faster); errors against an fp32 "
             "reference. bwd TFLOP/s: the backward's FLOPs (F+B less forward) over the F+B median less the "
             "forward's, and in brackets that over the forward's TFLOP/s. Every provider's table: "
             "compare/summary.md.", ""]
    lines += _comparison(out / "compare")
    if (out / "liger_tuned" / "summary.md").exists():
        lines += ["", "With Liger's autotuner on, at its published shape:", ""] + _comparison(out / "liger_tuned")
    lines += ["", "## Steps", "", "| step | result | seconds | limit s |", "|---|---|---|---|"]
    lines += [f"| {s.key}: {s.name} | {s.status} | {s.seconds:.0f} | {f'{s.limit_s:.0f}' if s.limit_s else '-'} |"
              for s in steps]
    lines += _failed_tails(steps)
    table = out / "bench" / "results.md"
    lines += ["", "## Mula presets (bf16, forward+backward, one MoE layer)", ""]
    lines += [table.read_text(encoding="utf-8")] if table.exists() else ["(no benchmark table: see the mula step's log)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default gpu_check_out/<date>)")
    ap.add_argument("--dry-run", action="store_true", help="list the steps and exit 0")
    ap.add_argument("--device", choices=("cuda", "xpu"), default=None, help="default: the one torch sees")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--steps", default=None, metavar="KEY,...",
                    help=f"run only these steps, comma-separated, of: {', '.join(STEP_KEYS)}")
    ap.add_argument("--small-fwdbwd", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny-fwdbwd", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    started = time.monotonic()
    if args.budget <= 0:
        raise SystemExit("--budget must be > 0")
    only = None
    if args.steps is not None:
        only = tuple(k.strip() for k in args.steps.split(",") if k.strip())
        unknown = [k for k in only if k not in STEP_KEYS]
        if unknown or not only:
            ap.error(f"--steps {args.steps!r}: unknown step {', '.join(unknown) or '(none given)'}; "
                     f"the steps are {', '.join(STEP_KEYS)}")
    if args.small_fwdbwd or args.tiny_fwdbwd:
        (small_fwdbwd if args.small_fwdbwd else tiny_fwdbwd)(args.device or find_device() or "cpu")
        return 0
    repo = Path.cwd()
    out = Path(args.out or f"gpu_check_out/{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}")
    if args.dry_run:
        device = args.device or "cuda"
        print(f"gpu-check dry run (device {device}; the real run uses the device torch sees), output {out}:")
        wheels = sorted(p.name for p in (repo / "kit_wheels").glob("*.whl"))
        print(f"  0. unpack into {out / 'pylib'} the kit wheels whose modules are missing: "
              f"{', '.join(wheels) or 'none in kit_wheels/ (scripts/prepare_kit_wheels.sh)'}")
        steps = plan(device, out, repo, args.budget, only=only)
        selected = [s for s in steps if s.key in (only or DEFAULT_STEPS)]
        for i, step in enumerate(steps, 1):
            limit = f"limit {step.timeout_s:.0f} s" if step in selected else "no limit: not run"
            print(f"  {i}. {step.key}: {step.name}  [{limit}]")
            print(f"     {shlex.join(step.argv)}")
            if step.skip:
                print(f"     (would not run: {step.skip})")
        print(f"  {len(steps) + 1}. write {out / 'versions.json'} and {out / 'summary.md'}")
        print(f"  limits: {' + '.join(f'{s.key} {s.timeout_s:.0f}' for s in selected)} = "
              f"{sum(s.timeout_s for s in selected):.0f} s of the {args.budget:.0f} s budget ({_RESERVE_S:.0f} s "
              "kept for the summary); time a step leaves unused, or the share of one that cannot run here, goes "
              "to the steps after it")
        return 0
    device = args.device or find_device()
    if device is None:
        print("gpu-check: no device found (torch sees neither CUDA nor XPU); nothing was measured", file=sys.stderr)
        return NO_DEVICE_EXIT
    out.mkdir(parents=True, exist_ok=True)
    info = versions(device)
    info["kit_wheels"] = provide_wheels(repo / "kit_wheels", out / "pylib")
    (out / "versions.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    steps = plan(device, out, repo, args.budget, only=only)
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

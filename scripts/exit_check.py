"""Run the 2-process resume run N times in a row and count the ones that did not end cleanly.

Each round: ``python -m trainer --nproc-per-node 2`` (torchrun's launcher) trains tiny-moe to a
checkpoint, then the same command with more steps resumes from it and finishes: validation loss,
charts, summary. A round is clean when both runs exit 0, neither output holds ``terminate called``
(a rank that aborted at exit, SIGABRT, -6) and the finished run printed its validation loss and
wrote its loss chart. Before the process groups were freed at the end of ``trainer.cli.main``, one
finished run in 11 ended with rank 1 aborted at exit that way (docs/fault.md).

    PYTHONPATH=$PWD .venv/bin/python scripts/exit_check.py --runs 20 --out out/exit_check

Exit status 0 when every round was clean, 1 otherwise; a line per round and a summary.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _train(out: Path, cache: Path, steps: int, timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "trainer", "--nproc-per-node", "2", "--preset", "tiny-moe", "--steps", str(steps),
           "--context", "32", "--global-batch", "8", "--micro-batch", "2", "--checkpoint.interval", "2",
           "--data.cache_dir", str(cache), "--out", str(out), "--logging.peak_tflops", "1",
           "--no-logging.tensorboard", "--checkpoint.reschedule"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout:.0f}s\n{e.stdout or ''}{e.stderr or ''}"
    return p.returncode, p.stdout + p.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="rounds (each: a run to a checkpoint, then a resume)")
    ap.add_argument("--out", default="out/exit_check", help="work directory (rounds' outputs; the failed ones kept)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one training command may take")
    args = ap.parse_args(argv)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "data_cache"
    bad = 0
    t0 = time.time()
    for i in range(1, args.runs + 1):
        out = work / f"round-{i:03d}"
        shutil.rmtree(out, ignore_errors=True)
        first, log1 = _train(out, cache, 2, args.timeout)
        second, log2 = _train(out, cache, 4, args.timeout)
        aborted = ("terminate called" in log1) or ("terminate called" in log2)
        finished = "validation loss" in log2 and "resumed from" in log2 and (out / "loss.png").is_file()
        clean = first == 0 and second == 0 and not aborted and finished
        (out / "first.log").write_text(log1)
        (out / "resume.log").write_text(log2)
        print(f"round {i}: exit {first} then {second}; terminate called: {'yes' if aborted else 'no'}; "
              f"resumed and finished: {'yes' if finished else 'no'} -> {'clean' if clean else 'FAILED'}", flush=True)
        if clean:
            shutil.rmtree(out, ignore_errors=True)
        else:
            bad += 1
    print(f"{args.runs - bad} of {args.runs} rounds clean ({bad} failed; outputs of failed rounds under {work}); "
          f"{time.time() - t0:.0f}s", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Measure the fault-tolerance numbers: checkpoint write/restore time and size for ``tiny-moe``,
the per-rank bytes formula at the Mula presets, the model-only vs full ratio, and the recovery
times under ``trainer.ft.launch`` (``kill -9`` of a rank, of a whole node, a stopped rank found by the
watchdogs) to the first new step, with their medians and the effective training time they imply.

    python -m fastmoe_trainer.ft.bench [--out OUT] [--repeats 5] [--tries 3] [--faults rank,node,hang]
                                       [--no-checkpoint] [--no-recovery]

Writes ``OUT/ft_bench.json`` and prints Markdown tables (docs/fault.md quotes them).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..checkpoint.manager import CheckpointManager
from ..checkpoint.save import SaveStats
from ..checkpoint.slots import latest_valid, verify
from ..checkpoint.writers import checkpoint_bytes
from ..records.metrics import median_seconds as _median_time
from . import fault

SMALL = ["--preset", "tiny-moe", "--peak-tflops", "1", "--no-logging.progress", "--no-logging.plot",
         "--no-logging.tensorboard"]


def measure_tiny(out: Path, repeats: int) -> dict[str, Any]:
    """Write/restore times and sizes of tiny-moe checkpoints in one process."""
    from ..cli import config_from_args
    from ..trainer import Trainer

    cfg, _ = config_from_args([*SMALL, "--steps", "3", "--out", str(out / "tiny"), "--no-checkpoint.resume"])
    t = Trainer(cfg)
    t.fit()
    root = out / "tiny" / "bench-ckpt"
    mgr = CheckpointManager(root, is_expert=t.checkpoints.is_expert, model_dtype="bf16")
    stats: list[SaveStats] = []
    save_s = _median_time(lambda: stats.append(mgr.save(t.step, t.model, t.optimizer,
                                                         meta={"data": t.loader.state_dict()})), repeats)
    model_stats: list[SaveStats] = []
    model_s = _median_time(lambda: model_stats.append(mgr.save_model(t.step, t.model)), repeats)
    info = latest_valid(root)
    verify_s = _median_time(lambda: verify(info.path), repeats)
    restore_s = _median_time(lambda: mgr.restore(t.model, t.optimizer, info), repeats)
    grads = [b.flat_grad for b in t.optimizer.buckets]
    check_s = _median_time(lambda: fault.local_nonfinite(t._local_loss, grads), max(repeats, 20))
    step_s = statistics.median(r["step_time_s"] for r in t.history)
    n = sum(p.numel() for p in t.model.parameters())
    full, model = stats[-1].total_bytes, model_stats[-1].total_bytes
    return {
        "params": n, "param_dtype": cfg.model.param_dtype, "optimizer": cfg.optim.name,
        "full_bytes": full, "model_only_bf16_bytes": model, "full_over_model_only": full / model,
        "tensor_bytes_full": 16 * n if cfg.model.param_dtype == "fp32" else 14 * n, "tensor_bytes_model_only": 2 * n,
        "save_full_s": save_s, "save_model_only_s": model_s, "verify_s": verify_s, "restore_s": restore_s,
        "nonfinite_check_s": check_s, "train_step_s": step_s,
    }


def formula_table() -> list[dict[str, Any]]:
    """Checkpoint bytes per rank at the Mula presets (fp32 weights, EPSO), for a few layouts."""
    from ..model.build import param_counts
    from ..config.presets import get_preset

    rows = []
    layouts = {"mula-7b-a1b": [(1, 64, 1), (1, 8, 8), (1, 128, 8)], "mula-20b-a2b": [(1, 32, 12)],
               "mula-100b-a7b": [(4, 16, 12)], "mula-220b-a10b": [(8, 16, 12)]}
    for name, lays in layouts.items():
        m = get_preset(name).model
        pc = param_counts(m)
        for pp, dp, ep in lays:
            b = checkpoint_bytes(pc.total - pc.expert, pc.expert, pp=pp, dp=dp, ep=ep)
            rows.append({"preset": name, "pp": pp, "dp": dp, "ep": ep, **b})
    return rows


FAULTS = ("rank", "node", "hang")


def measure_recovery(out: Path, fault_kind: str = "node", kill_step: int = 3, heartbeat_timeout: float = 10.0,
                     steps: int = 6) -> dict[str, Any]:
    """One recovery of tiny-moe run the way an operator starts it: a ``--serve-store`` process and
    three node launchers (h0, h1, h2) for ``--nnodes 2``, one rank each, a checkpoint every 2 steps.
    Inside step ``kill_step`` of rank 1 (after the step-2 checkpoint) the fault is injected:

    ``rank``: ``kill -9`` of rank 1's worker (its node launcher lives on);
    ``node``: ``kill -9`` of rank 1's whole node (launcher and worker);
    ``hang``: ``SIGSTOP`` of rank 1's worker, found by the watchdogs after ``heartbeat_timeout``.

    Returns the seconds from the fault to its detection (the first ``failure``/``leave`` event or,
    for a hang, the watchdog's record), to the new rendezvous round, and to the first training
    step completed after it, the rounds formed (one per failure is the goal) and the exit codes."""
    from .elastic.job import read_events
    from .elastic.local_nodes import descendants, free_port

    run = out / f"recovery-{fault_kind}-{time.time_ns()}"
    run.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    mod = __package__ + ".launch"
    endpoint = f"127.0.0.1:{free_port()}"
    ready = run / ".store"
    store = subprocess.Popen([sys.executable, "-m", mod, "--serve-store", endpoint, "--out", str(ready)], env=env,
                             stdout=subprocess.DEVNULL)
    while not ready.exists() and store.poll() is None:
        time.sleep(0.05)
    nodes = {}
    for h in ("h0", "h1", "h2"):
        cmd = [sys.executable, "-m", mod, "--node-label", h, "--rdzv-endpoint", endpoint, "--nnodes", "2",
               "--rdzv-conf", "is_host=0", "--max-restarts", "2", "--heartbeat-timeout", str(heartbeat_timeout),
               "--out", str(run), "--", *SMALL, "--steps", str(steps), "--checkpoint.interval", "2"]
        log = open(run / f"launcher-{h}.log", "w")
        nodes[h] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        beat = None
        deadline = time.time() + 900
        while time.time() < deadline and all(p.poll() is None for p in nodes.values()):
            beat = fault.read_heartbeats(run).get(1)
            if beat and beat["phase"] == "start" and beat["step"] >= kill_step:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"rank 1 never reached step {kill_step}; see {run}/launcher-*.log")
        victim = beat["host"]
        t0 = time.time()
        if fault_kind == "rank":
            os.kill(beat["pid"], signal.SIGKILL)
        elif fault_kind == "node":
            for pid in [nodes[victim].pid, *descendants(nodes[victim].pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            os.kill(beat["pid"], signal.SIGSTOP)
        first_new = None
        while time.time() < deadline and any(p.poll() is None for h, p in nodes.items()):
            if first_new is None:
                first_new = fault.first_new_step(run, t0)
            time.sleep(0.05)
        codes = {h: p.wait(timeout=max(1.0, deadline - time.time())) for h, p in nodes.items()}
    finally:
        for p in nodes.values():
            if p.poll() is None:
                for pid in [p.pid, *descendants(p.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        store.kill()  # the store ignores SIGTERM (a scheduler's stop notice)
        store.wait(timeout=30)
    ev = [e for e in read_events(run) if e["time"] > t0]
    if fault_kind == "hang":
        hangs = [r for r in fault.read_failures(run) if r.get("kind") == "hang" and r["time"] > t0]
        detected = min((r["time"] for r in hangs), default=float("nan"))
        blamed = sorted({r.get("host") for r in hangs})
    else:
        detected = min((e["time"] for e in ev if e["event"] in ("failure", "leave", "stop_workers")),
                       default=float("nan"))
        blamed = []
    rounds = sorted({round(e["time"]) for e in ev if e["event"] == "round"})
    return {
        "fault": fault_kind, "victim": victim, "exit_codes": codes, "blamed": blamed,
        "round_events": sum(e["event"] == "round" for e in ev), "rounds": len(rounds),
        "detect_s": detected - t0, "round_s": min((e["time"] for e in ev if e["event"] == "round"),
                                                 default=float("nan")) - t0,
        "first_new_step_s": (first_new or float("nan")) - t0,
        "detect_to_first_new_step_s": (first_new or float("nan")) - detected,
    }


def _median(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastmoe_trainer.ft.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/ft_bench")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-recovery", action="store_true", help="skip the recovery runs")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint measurements")
    ap.add_argument("--tries", type=int, default=3, help="recovery runs per fault kind")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="watchdog limit of the hang runs")
    ap.add_argument("--failures-per-day", type=float, default=419 / 54,
                    help="job interruptions per day for the effective-training-time figure (Llama 3: 419 in 54 days)")
    ap.add_argument("--checkpoint-minutes", type=float, default=10.0,
                    help="checkpoint interval for the effective-training-time figure")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "python": platform.python_version()}}
    faults = [f for f in args.faults.split(",") if f]
    bad = sorted(set(faults) - set(FAULTS))
    if bad or args.tries < 1:
        print(f"error: --faults takes {','.join(FAULTS)} and --tries >= 1 (got {args.faults!r}, {args.tries})",
              file=sys.stderr)
        return 2
    if not args.no_checkpoint:
        res["tiny"] = measure_tiny(out, args.repeats)
        res["formula"] = formula_table()
    if not args.no_recovery:
        res["recovery"] = {f: [measure_recovery(out, f, heartbeat_timeout=args.heartbeat_timeout)
                               for _ in range(args.tries)] for f in faults}
    (out / "ft_bench.json").write_text(json.dumps(res, indent=1))
    if "tiny" in res:
        _print_checkpoints(res, args.repeats)
    if "recovery" in res:
        _print_recovery(res["recovery"], args)
    return 0


def effective_fraction(failures_per_day: float, lost_s_per_failure: float) -> float:
    """The share of wall time spent training when each failure costs ``lost_s_per_failure``."""
    return max(0.0, 1.0 - failures_per_day * lost_s_per_failure / 86400.0)


def _print_recovery(rec: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"\nrecovery, tiny-moe, --serve-store + 3 node launchers for --nnodes 2 (one spare), one rank each, "
          f"median of {args.tries} (hang: SIGSTOP, --heartbeat-timeout {args.heartbeat_timeout:g}):\n")
    print("| fault | detected | new round | first new step | detection to first new step | rounds | all tries |")
    print("|---|---|---|---|---|---|---|")
    for f, rows in rec.items():
        tries = ", ".join(f"{r['first_new_step_s']:.1f}" for r in rows)
        print(f"| {f} | {_median(rows, 'detect_s'):.1f} s | {_median(rows, 'round_s'):.1f} s "
              f"| {_median(rows, 'first_new_step_s'):.1f} s | {_median(rows, 'detect_to_first_new_step_s'):.1f} s "
              f"| {max(r['rounds'] for r in rows)} | {tries} |")
    worst = max(_median(rs, "first_new_step_s") for rs in rec.values())
    lost = args.checkpoint_minutes * 60 / 2  # work redone after a failure: half an interval on average
    f = args.failures_per_day
    print(f"\neffective training time at {f:.2f} failures a day, {worst:.1f} s from a failure to the first new "
          f"step (the slowest median above): {100 * effective_fraction(f, worst):.3f}% counting recovery alone, "
          f"{100 * effective_fraction(f, worst + lost):.2f}% with a checkpoint every {args.checkpoint_minutes:g} "
          f"min (half an interval redone per failure)")


def _print_checkpoints(res: dict[str, Any], repeats: int) -> None:
    tiny, rows = res["tiny"], res["formula"]

    print(f"\ntiny-moe ({tiny['params']:,} parameters, {tiny['param_dtype']} weights, {tiny['optimizer']}), one process, "
          f"median of {repeats}:\n")
    print("| checkpoint | bytes | write | verify (sha256) | restore |\n|---|---|---|---|---|")
    print(f"| full | {tiny['full_bytes']:,} | {tiny['save_full_s'] * 1e3:.0f} ms | {tiny['verify_s'] * 1e3:.0f} ms "
          f"| {tiny['restore_s'] * 1e3:.0f} ms |")
    print(f"| model-only bf16 | {tiny['model_only_bf16_bytes']:,} | {tiny['save_model_only_s'] * 1e3:.0f} ms | | |")
    print(f"\nNaN/Inf check of the loss and all gradients: {tiny['nonfinite_check_s'] * 1e6:.0f} us "
          f"(a training step: {tiny['train_step_s'] * 1e3:.0f} ms)")
    print(f"\nfull / model-only: {tiny['full_over_model_only']:.2f}x on disk, "
          f"{tiny['tensor_bytes_full'] / tiny['tensor_bytes_model_only']:.0f}x in tensor bytes\n")
    print("| preset | PP x DP x EP | params | full | model-only bf16 | per rank (shard writer) | per rank (others) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['pp']} x {r['dp']} x {r['ep']} | {r['params'] / 1e9:.2f} B | {_gb(r['full'])} "
              f"| {_gb(r['model_only'])} | {_gb(r['rank_writer'])} | {_gb(r['rank_other'])} |")


if __name__ == "__main__":
    sys.exit(main())

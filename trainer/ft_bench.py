"""Measure the fault-tolerance numbers: checkpoint write/restore time and size for ``tiny-moe``,
the per-rank bytes formula at the Mula presets, the model-only vs full ratio, and the recovery
time from ``kill -9`` of a rank to the first new step under ``trainer.launch``.

    python -m fastmoe_trainer.ft_bench [--out OUT] [--repeats 5] [--no-recovery]

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

from . import checkpoint as ck
from . import fault

SMALL = ["--preset", "tiny-moe", "--peak-tflops", "1", "--no-logging.progress", "--no-logging.plot",
         "--no-logging.tensorboard"]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_tiny(out: Path, repeats: int) -> dict[str, Any]:
    """Write/restore times and sizes of tiny-moe checkpoints in one process."""
    from .cli import config_from_args
    from .trainer import Trainer

    cfg, _ = config_from_args([*SMALL, "--steps", "3", "--out", str(out / "tiny"), "--no-checkpoint.resume"])
    t = Trainer(cfg)
    t.fit()
    root = out / "tiny" / "bench-ckpt"
    mgr = ck.CheckpointManager(root, is_expert=t.checkpoints.is_expert, model_dtype="bf16")
    stats: list[ck.SaveStats] = []
    save_s = _median_time(lambda: stats.append(mgr.save(t.step, t.model, t.optimizer,
                                                         meta={"data": t.loader.state_dict()})), repeats)
    model_stats: list[ck.SaveStats] = []
    model_s = _median_time(lambda: model_stats.append(mgr.save_model(t.step, t.model)), repeats)
    info = ck.latest_valid(root)
    verify_s = _median_time(lambda: ck.verify(info.path), repeats)
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
    from .model import param_counts
    from .presets import get_preset

    rows = []
    layouts = {"mula-7b-a1b": [(1, 64, 1), (1, 8, 8), (1, 128, 8)], "mula-20b-a2b": [(1, 32, 12)],
               "mula-100b-a7b": [(4, 16, 12)], "mula-220b-a10b": [(8, 16, 12)]}
    for name, lays in layouts.items():
        m = get_preset(name).model
        pc = param_counts(m)
        for pp, dp, ep in lays:
            b = ck.checkpoint_bytes(pc.total - pc.expert, pc.expert, pp=pp, dp=dp, ep=ep)
            rows.append({"preset": name, "pp": pp, "dp": dp, "ep": ep, **b})
    return rows


def measure_recovery(out: Path, kill_step: int = 3) -> dict[str, Any]:
    """Run tiny-moe under ``trainer.launch --local-nodes 3 --nnodes 2`` (one rank per node, one
    spare); kill -9 the whole node of rank 1 inside step ``kill_step`` (after the step-2
    checkpoint) and time the failure's detection, the new rendezvous round and the first new step."""
    from .launch import descendants, read_events

    run = out / "recovery"
    cmd = [sys.executable, "-m", __package__ + ".launch", "--local-nodes", "3", "--nnodes", "2", "--max-restarts", "1",
           "--monitor-interval", "0.2", "--timeout", "900", "--out", str(run), "--", *SMALL, "--steps", "6",
           "--checkpoint.interval", "2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    beat = None
    while p.poll() is None:
        beat = fault.read_heartbeats(run).get(1)
        if beat and beat["phase"] == "start" and beat["step"] >= kill_step:
            break
        time.sleep(0.02)
    (node_pid,) = [e["pid"] for e in read_events(run) if e["event"] == "node_start" and e["node"] == beat["host"]]
    killed_at = time.time()
    for pid in [node_pid, *descendants(node_pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first_new = None
    while p.poll() is None:
        done = [h for h in fault.read_heartbeats(run).values()
                if h["new_steps"] >= 1 and h["mtime"] > killed_at and h["pid"] != beat["pid"]]
        if done and first_new is None:
            first_new = min(h["mtime"] for h in done)
        time.sleep(0.02)
    p.communicate(timeout=900)
    ev = read_events(run)
    fail = min(e["time"] for e in ev if e["event"] == "failure" and e["time"] > killed_at)
    round2 = min(e["time"] for e in ev if e["event"] == "round" and e["time"] > killed_at)
    return {
        "returncode": p.returncode, "kill_to_detect_s": fail - killed_at, "kill_to_relaunch_s": round2 - killed_at,
        "kill_to_first_new_step_s": (first_new or float("nan")) - killed_at,
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastmoe_trainer.ft_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/ft_bench")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-recovery", action="store_true", help="skip the kill -9 recovery run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "python": platform.python_version()}}
    res["tiny"] = tiny = measure_tiny(out, args.repeats)
    res["formula"] = rows = formula_table()
    if not args.no_recovery:
        res["recovery"] = measure_recovery(out)
    (out / "ft_bench.json").write_text(json.dumps(res, indent=1))

    print(f"\ntiny-moe ({tiny['params']:,} parameters, {tiny['param_dtype']} weights, {tiny['optimizer']}), one process, "
          f"median of {args.repeats}:\n")
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
    if "recovery" in res:
        rc = res["recovery"]
        print(f"\nrecovery (tiny-moe, 2 hosts x 1 rank, kill -9 of rank 1 in step 3): detected after "
              f"{rc['kill_to_detect_s']:.2f}s, new rendezvous round after {rc['kill_to_relaunch_s']:.2f}s, "
              f"first new step after {rc['kill_to_first_new_step_s']:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

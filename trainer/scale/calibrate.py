"""The step-time model held to this machine: ``--calibrate here`` measures it into a cluster file, and
``--validate`` predicts layouts of a small preset from that file and measures the trainer running them.

Calibration (at most ``--budget`` seconds, default 90): ``world`` gloo processes on this machine (as many
as the validation starts, so each measures what a rank gets while the others run), one thread each:

* the GEMM rate (fp32 and bf16 ``torch.mm`` at 128..512, the median of the sizes; what a rank's
  projections and experts see) and the memory bandwidth (``add`` of 64 KiB, 1 MiB and 16 MiB tensors,
  the median: from in-cache activations to the optimizer's buffers), all ranks at once, each
  the mean over a second of calls (what a rank gets while the others run);
* the cost of one small op with autograd (forward and backward of an element-wise product on 64
  elements, per op): the ``launch_us`` of a CPU, where every torch op costs its dispatch;
* gloo's all-reduce, all-gather, reduce-scatter, all-to-all and send/recv at 4 KiB .. 16 MiB (the
  optimizer's buffers reach tens of MiB): for each, ``time = latency + wire bytes / bandwidth``
  fitted robustly (Theil-Sen; the latency per algorithm step of :func:`trainer.scale.model.steps`).

Validation: each layout runs in ``world`` gloo processes (the trainer itself, fp32, one warm-up step and
``--steps`` timed steps; the step time is the slowest rank's, the median over the timed steps), beside
the model's prediction from the traced step (the formulas where the tracer is not available).
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

SIZES_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
CALIBRATED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _timed(fn: Any, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    from ..records.metrics import median_seconds

    fn()
    return median_seconds(fn, reps)


def _mean_over(fn: Any, seconds: float) -> float:
    """Mean seconds per call of ``fn`` over about ``seconds`` of wall time, after one warm-up: on a machine
    whose cores the ranks share, what a rank gets (a median of single calls would pick the calls that ran
    alone)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        t = time.perf_counter() - t0
        if t >= seconds:
            return t / n


def _collective(op: str, nbytes: int) -> Any:
    """A call of ``op`` on a buffer of ``nbytes`` (the :class:`Collective` convention: the whole buffer)."""
    import torch
    import torch.distributed as dist

    w, r = dist.get_world_size(), dist.get_rank()
    n = max(w, nbytes // 4 // w * w)
    full, part = torch.ones(n), torch.ones(n // w)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if op == "all_to_all":
        out = torch.empty(n)
        return lambda: dist.all_to_all_single(out, full)
    peer = r ^ 1  # pairs (0, 1), (2, 3): every rank sends and receives once per call

    def send() -> None:
        if r % 2 == 0:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)
    return send


def calibrate_rank(budget_s: float) -> dict:
    """One rank's measurements (every rank runs the same calls in the same order)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames; 2.11 has only these names
    deadline = time.perf_counter() + budget_s
    each = min(1.0, budget_s / 40)  # seconds per compute measurement: about a quarter of the budget in all
    out: dict[str, Any] = {"gemm": {}, "ops": {}}
    for dtype in (torch.float32, torch.bfloat16):
        rates = []
        for n in (128, 256, 512):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            dist.barrier()  # every rank computes at once, as in a training step
            t = _mean_over(lambda: torch.mm(a, b), each)
            rates.append(2 * n ** 3 / t)
        out["gemm"][str(dtype).split(".")[-1]] = statistics.median(rates)
    rates = []
    for n in (16 << 10, 256 << 10, 4 << 20):  # 64 KiB (in cache, like a small model's activations) .. 16 MiB
        x, y = torch.ones(n), torch.ones(n)
        dist.barrier()
        rates.append(3 * n * 4 / _mean_over(lambda: torch.add(x, y), 0.7 * each))
    out["memory_Bps"] = statistics.median(rates)
    u = torch.ones(64, requires_grad=True)
    v = torch.ones(64)

    def tiny() -> None:
        z = u
        for _ in range(20):
            z = z * v
        z.sum().backward()
    dist.barrier()
    out["launch_s"] = _mean_over(tiny, each) / 42  # 20 products and a sum, forward and backward
    dist.barrier()
    w = dist.get_world_size()
    for op in CALIBRATED_OPS:
        pts = []
        for nbytes in SIZES_BYTES:
            if time.perf_counter() > deadline:
                break
            fn = _collective(op, nbytes)
            dist.barrier()
            pts.append((nbytes, _timed(fn, 9 if nbytes < (1 << 20) else 5 if nbytes < (16 << 20) else 3)))
        out["ops"][op] = pts
    out["world"] = w
    return out


def fit(op: str, pts: list[tuple[int, float]], w: int) -> tuple[float, float]:
    """(latency s per algorithm step, bandwidth B/s of wire bytes) of ``time = a + wire / B``."""
    from .model import steps
    from .profile import Collective, wire_bytes

    xs = [wire_bytes(Collective(op, tuple(range(w if op != "send" else 2)), "fp32", n // 4)) for n, _ in pts]
    if op == "send":  # a call is a send and a receive each way: twice the bytes and two steps
        xs = [2 * x for x in xs]
    ys = [t for _, t in pts]
    # Theil-Sen: the median of the pairwise slopes, robust to a point a busy machine inflated
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    slope = statistics.median(slopes) if slopes else 0.0
    if slope <= 0:  # noise: the largest buffer's time is all bandwidth
        slope = ys[-1] / xs[-1]
    a = max(statistics.median(y - slope * x for x, y in zip(xs, ys)), min(ys) * 0.5)
    n_steps = 2 if op == "send" else steps(op, w)
    return a / max(n_steps, 1), 1.0 / slope


def calibrate_main(out_path: str, world: int = 4, budget_s: float = 90.0) -> int:
    from fastmoe_xpu.dist.testing import run_distributed

    from .cluster import write_cluster

    if world < 2 or world % 2:
        raise ValueError(f"--calibrate here measures an even number of ranks (send/recv pairs); got --world {world}")
    t0 = time.perf_counter()
    print(f"calibrating this machine: {world} gloo processes, at most {budget_s:.0f} s ...", flush=True)
    spare = 25.0  # process start-up (torch imports on every rank)
    res = run_distributed(calibrate_rank, world, max(10.0, budget_s - spare), env={"OMP_NUM_THREADS": "1"},
                          timeout_s=budget_s + 60, comm_timeout_s=budget_s, fail_fast=True)
    took = time.perf_counter() - t0
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = cpu_name()
    how = f"--calibrate here, {when}, {world} ranks on {cpu}"
    med = lambda xs: statistics.median(xs)  # noqa: E731
    gemm32 = med([r["gemm"]["float32"] for r in res])
    gemm16 = med([r["gemm"]["bfloat16"] for r in res])
    mem = med([r["memory_Bps"] for r in res])
    launch = med([r["launch_s"] for r in res])
    ops: dict[str, tuple[float, float]] = {}
    for op in CALIBRATED_OPS:
        pts = [(n, max(r["ops"][op][i][1] for r in res)) for i, (n, _) in enumerate(res[0]["ops"][op])]
        if len(pts) >= 2:
            ops[op] = fit(op, pts, world)
    if not ops:
        raise ValueError(f"--budget {budget_s}: no time was left for the collectives; raise it")
    lat_med = med([v[0] for v in ops.values()]) * 1e6
    bw_med = med([v[1] for v in ops.values()]) / 1e9
    total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    M, A = "measurement", "assumption"
    sections: dict[str, dict[str, tuple]] = {
        "device": {
            "peak_tflops_fp32": (round(gemm32 / 1e12, 6), M, f"torch.mm fp32 128..512, median of sizes, per rank ({how})"),
            "peak_tflops_bf16": (round(gemm16 / 1e12, 6), M, f"torch.mm bf16 128..512, median of sizes, per rank ({how})"),
            "memory_gib": (round(total_gib / world, 2), M, f"physical memory over {world} ranks ({how})"),
            "memory_gbps": (round(mem / 1e9, 3), M,
                            f"torch.add of 64 KiB / 1 MiB / 16 MiB fp32 tensors, median, per rank ({how})"),
            "gemm_efficiency": (1.0, M, "the GEMM rate above is the measured rate itself"),
            "memory_efficiency": (1.0, M, "the bandwidth above is the measured rate itself"),
            "launch_us": (round(launch * 1e6, 3), M, f"one element-wise op with autograd, forward and backward ({how})"),
        },
        "node": {"devices_per_node": (world, M, f"{world} ranks on this machine ({how})")},
        "intra": {"bandwidth_gbps": (round(bw_med, 4), M, f"median of the collectives' fitted bandwidths ({how})"),
                  "latency_us": (round(lat_med, 3), M, f"median of the collectives' fitted latencies per step ({how})")},
        "inter": {"nics_per_node": (1, A, "one machine: no group leaves it"),
                  "nic_gbps": (round(bw_med, 4), A, "one machine: no group leaves it (the intra-node figure)"),
                  "latency_us": (round(lat_med, 3), A, "one machine: no group leaves it (the intra-node figure)")},
        "overlap": {"fsdp": (False, A, "the ranks share the CPU cores: gloo's transfers and the compute take turns")},
    }
    for op, (lat, bw) in ops.items():
        sections[f"ops.{op}"] = {"latency_us": (round(lat * 1e6, 3), M, f"gloo {op} 4 KiB..16 MiB, fitted ({how})"),
                                 "bandwidth_gbps": (round(bw / 1e9, 4), M, f"gloo {op} 4 KiB..16 MiB, fitted ({how})")}
    write_cluster(out_path, "here", f"this machine: {cpu}, {world} gloo ranks, calibrated {when}", sections)
    print(f"  GEMM fp32 {gemm32 / 1e9:.1f} GFLOP/s, bf16 {gemm16 / 1e9:.1f} GFLOP/s per rank; memory {mem / 1e9:.1f} GB/s; "
          f"one op {launch * 1e6:.1f} us")
    for op, (lat, bw) in ops.items():
        print(f"  {op:15s} latency {lat * 1e6:8.1f} us per step, {bw / 1e9:6.2f} GB/s")
    print(f"wrote {out_path} in {took:.0f} s")
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


# ----------------------------------------------------------------------------- validation
#: name -> (optimizer, dp_shard, ep, pp, ac)
VALIDATION_LAYOUTS = {
    "DP 4, ZeRO-1": ("sharded", "none", 1, 1, ""),
    "EP 2 x DP 2, EPSO": ("epso", "none", 2, 1, ""),
    "PP 2 x DP 2, ZeRO-1": ("sharded", "none", 1, 2, ""),
    "DP 4, FSDP2": ("epso", "fsdp", 1, 1, ""),
    "EP 2 x DP 2, EPSO, --ac all": ("epso", "none", 2, 1, "norm,attn,moe"),
}


def validate_rank(preset: str, world: int, layout: str, sizes: dict[str, int], steps: int) -> list[float]:
    """Seconds of each of ``steps`` timed training steps on this rank (after one warm-up step)."""
    from ..config import validate
    from ..parallelism.measure import quiet_config
    from ..trainer import Trainer

    opt, shard, ep, pp, ac = VALIDATION_LAYOUTS[layout]
    cfg = quiet_config(preset, sizes, optimizer=opt, dp_shard=shard, ep=ep, pp=pp, ac=ac, steps=steps + 1,
                       name="validate")
    t = Trainer(validate(cfg, world))
    t.train_step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        t.train_step()
        out.append(time.perf_counter() - t0)
    return out


def predict(preset: str, world: int, layout: str, sizes: dict[str, int], cluster: Any, source: str) -> tuple[float, str]:
    from ..parallelism.plan import make_plan
    from .model import estimate
    from .sources import fill_memory, trace_or_none
    from .formula import stage_profiles

    opt, shard, ep, pp, ac = VALIDATION_LAYOUTS[layout]
    plan = make_plan(preset, world=world, pp=pp, ep=ep, ranks_per_node=world, micro_batch=sizes["micro_batch"],
                     context=sizes["context"], global_batch=sizes["global_batch"], ac=ac, weights="fp32",
                     optimizer=opt)
    formula = stage_profiles(plan, fsdp=shard == "fsdp", grad_bytes=4)
    profs = trace_or_none(plan, preset, shard == "fsdp") if source != "formula" else None
    if profs is None:
        return estimate(formula, cluster).step_s, "formula"
    fill_memory(profs, formula)
    return estimate({r: as_fp32(p) for r, p in profs.items()}, cluster).step_s, "trace"


def as_fp32(p: Any) -> Any:
    """``p`` with its bf16 records made fp32: the tracer runs the preset's precision, the validation runs
    the trainer in fp32 (``quiet_config``), whose activations, weights and tokens are twice the bytes."""
    from dataclasses import replace

    def up(rec: Any) -> Any:
        if rec.dtype != "bf16":
            return rec
        if hasattr(rec, "elements"):
            return replace(rec, dtype="fp32")
        return replace(rec, dtype="fp32", bytes=2 * rec.bytes)
    return replace(p, collectives=[up(c) for c in p.collectives], compute=[up(c) for c in p.compute])


def validate_main(args: Any, cluster: Any) -> int:
    from fastmoe_xpu.dist.testing import run_distributed

    world = args.world[0]
    if len(args.world) != 1 or world != 4:
        raise ValueError("--validate runs the layouts of a world of 4 (DP 4, EP 2 x DP 2, PP 2 x DP 2); use --world 4")
    sizes = {"context": args.context or 64, "micro_batch": args.micro_batch or 2,
             "global_batch": args.global_batch or 16}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{args.preset}, world {world}, micro-batch {sizes['micro_batch']} x context {sizes['context']}, global "
          f"batch {sizes['global_batch']}, fp32; cluster {cluster.path}; {cpu_name()}; {when}; {load_average()} "
          "before", flush=True)
    from ..data import ensure_default_dataset

    ensure_default_dataset(None, sizes["context"], 0, progress=False)  # once, before the ranks
    rows = []
    for i, name in enumerate(VALIDATION_LAYOUTS, 1):
        pred, src = predict(args.preset, world, name, sizes, cluster, args.source)
        res = run_distributed(validate_rank, world, args.preset, world, name, sizes, args.steps,
                              env={"OMP_NUM_THREADS": "1"}, timeout_s=600, comm_timeout_s=300, fail_fast=True)
        per_step = [max(r[k] for r in res) for k in range(args.steps)]
        meas = statistics.median(per_step)
        rows.append((name, pred, meas, src))
        print(f"  [{i}/{len(VALIDATION_LAYOUTS)}] {name}: predicted {pred * 1e3:.0f} ms ({src}), measured "
              f"{meas * 1e3:.0f} ms (steps {', '.join(f'{x * 1e3:.0f}' for x in per_step)})", flush=True)
    print(f"\n  {'layout':<30} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6}  within 30%")
    ok_all = True
    for name, pred, meas, src in rows:
        ok = abs(pred / meas - 1) <= 0.30
        ok_all &= ok
        print(f"  {name:<30} {pred * 1e3:>12.0f} {meas * 1e3:>12.0f} {pred / meas:>6.2f}  {'PASS' if ok else 'FAIL'}")
    print(f"{'PASS' if ok_all else 'FAIL'}: every prediction within +-30% of its measurement")
    bad = order_violations(rows)
    print(("PASS: the predicted order matches the measured one wherever the measured times differ by more than 15%"
           if not bad else "FAIL: predicted order differs from the measured one for " + "; ".join(bad)))
    print(f"  ({load_average()} after: the machine is shared, timings are noisy)")
    print("\n" + h200_check())
    if args.json:
        from .sources import write_json

        write_json(args.json, {"preset": args.preset, "world": world, "sizes": sizes, "cpu": cpu_name(), "date": when,
                               "rows": [dict(layout=n, predicted_s=p, measured_s=m, source=s) for n, p, m, s in rows]})
    return 0


def order_violations(rows: list[tuple[str, float, float, str]]) -> list[str]:
    """Pairs whose measured times differ by more than 15% but whose predictions rank them the other way."""
    bad = []
    for i, (a, pa, ma, _) in enumerate(rows):
        for b, pb, mb, _ in rows[i + 1:]:
            if max(ma, mb) / min(ma, mb) > 1.15 and (pa - pb) * (ma - mb) < 0:
                bad.append(f"{a} / {b}")
    return bad


#: Qwen3-30B-A3B's MoE layer at T=32768, bf16: docs/bench_results/gpu-2026-11-27-h200/README.md
#: (practitioners-compare.md), FastSparseMoE F+B on one H200.
H200_QWEN3 = {"H": 2048, "I": 768, "E": 128, "K": 8, "T": 32768, "measured_ms": 21.80}


def h200_check() -> str:
    """One MoE layer's F+B at Qwen3-30B-A3B, T=32k, predicted from h200-dgx beside the measured time."""
    from .cluster import load_cluster
    from .formula import moe_expert_compute
    from .model import compute_seconds

    c = load_cluster("h200-dgx")
    q = H200_QWEN3
    recs = moe_expert_compute(q["H"], q["I"], q["K"], q["T"], 2)
    parts = [compute_seconds(r, c) for r in recs]
    pred = sum(w + l for w, l in parts)
    gemm = sum(w for (w, _), r in zip(parts, recs) if r.kind == "grouped_gemm")
    ratio = pred * 1e3 / q["measured_ms"]
    return (f"H200: one MoE layer F+B at Qwen3-30B-A3B (H 2048, I 768, E 128, K 8), T=32768, bf16: predicted "
            f"{pred * 1e3:.2f} ms from h200-dgx (grouped GEMMs {gemm * 1e3:.2f} ms at {c['device.gemm_efficiency']:.3f} "
            f"of peak, memory-bound passes and launches {(pred - gemm) * 1e3:.2f} ms), measured {q['measured_ms']:.2f} ms "
            f"(docs/bench_results/gpu-2026-11-27-h200/README.md); ratio {ratio:.2f}: "
            f"{'PASS' if abs(ratio - 1) <= 0.30 else 'FAIL'} (within 30%)")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(calibrate_main(sys.argv[1]))

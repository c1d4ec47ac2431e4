"""``fastmoe-plan --cluster ...``: a layout's step time on a named cluster, the layout search, and the
model held to measurements (``--calibrate here``, ``--validate``).

    fastmoe-plan --preset mula-220b-a10b --pp 8 --ep 12 --ac norm,attn,moe --cluster aurora \\
        --world 384 768 1536 3072 6144 12288
    fastmoe-plan --preset mula-220b-a10b --world 3072 --cluster aurora --search [--memory-gib 64]
    fastmoe-plan --calibrate here --out cluster.toml
    fastmoe-plan --preset small-moe --world 4 --cluster cluster.toml --validate

(also ``python -m trainer.scale.model_cli ...``). docs/scale.md describes the model and its checks.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..parallelism.plan import GiB, Plan, make_plan
from .cluster import ClusterError, load_cluster
from .model import TERMS, estimate, largest_terms
from .sources import UsageError, device_memory, fill_memory, trace_or_none, write_json  # noqa: F401 (re-exported)

#: The paper's Figure 4 (weak scaling of Mula-220B-A10B on Aurora from 384 tiles): efficiency bands.
FIGURE4 = {"preset": "mula-220b-a10b", "pp": 8, "ep": 12, "base": 384,
           "bands": ((768, 768, 0.94, 1.00), (1536, 12288, 0.85, 0.95))}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastmoe-plan", description="Step time of a layout on a cluster, the layout "
                                 "search, and the model's checks against measurements.")
    ap.add_argument("--preset")
    ap.add_argument("--world", type=int, nargs="+", help="one or more world sizes (weak scaling: the global batch "
                    "grows with DP from the first)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=0, help="0: the preset's")
    ap.add_argument("--dp", type=int, default=0, help="0: world / (PP x EP x TP)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ac", default="", help="checkpointed parts: any of norm,attn,moe")
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--global-batch", type=int, default=0, help="at the first world (default: the preset's)")
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on the non-expert weights (--parallel.dp_shard fsdp)")
    ap.add_argument("--optimizer", choices=["adamw", "sharded", "epso"], default=None)
    ap.add_argument("--weights", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--cluster", help="aurora, h100-dgx, h200-dgx, b200-dgx or a cluster file")
    ap.add_argument("--source", choices=["auto", "trace", "formula"], default=None,
                    help="where the step's records come from: the planner's formulas (milliseconds; the default "
                         "but with --validate), the trainer's step traced on a fake process group (one rank per "
                         "stage), or auto (the tracer where it is available; the default with --validate)")
    ap.add_argument("--json", metavar="FILE", help="write the predictions as JSON")
    ap.add_argument("--calibrate", metavar="WHERE", help="'here': measure this machine and write --out")
    ap.add_argument("--out", help="the cluster file --calibrate writes")
    ap.add_argument("--budget", type=float, default=90.0, help="--calibrate: seconds at most")
    ap.add_argument("--validate", action="store_true", help="predict and measure layouts on this machine")
    ap.add_argument("--steps", type=int, default=4, help="--validate: timed steps per layout (after one warm-up)")
    ap.add_argument("--search", action="store_true", help="the five fastest layouts that fit")
    ap.add_argument("--memory-gib", type=float, default=0.0, help="device memory (default: the cluster's)")
    ap.add_argument("--top", type=int, default=5)
    return ap


# ----------------------------------------------------------------------------- layouts
def plan_for(args: Any, world: int, global_batch: int | None, devices_per_node: int) -> Plan:
    if args.tp != 1:
        raise UsageError(f"--tp {args.tp}: the step-time model prices TP=1 layouts (tensor parallelism covers the "
                         "dense model only); use --tp 1")
    if args.dp and len(args.world) > 1:
        raise UsageError("--dp fixes one world's layout; leave it out with several --world sizes")
    return make_plan(args.preset, world=world, pp=args.pp, ep=args.ep or preset_ep(args.preset), dp=args.dp,
                     ranks_per_node=devices_per_node, micro_batch=args.micro_batch or None, context=args.context or None,
                     global_batch=global_batch, ac=args.ac, weights=args.weights, optimizer=args.optimizer)


def preset_ep(preset: str) -> int:
    from ..config.presets import get_preset

    return get_preset(preset).parallel.ep or 1


def weak_scaling_batches(args: Any, worlds: Sequence[int], devices_per_node: int) -> list[int | None]:
    """The global batch of each world: the first's (--global-batch or the preset's), grown with DP."""
    first = plan_for(args, worlds[0], args.global_batch or None, devices_per_node)
    out: list[int | None] = []
    for w in worlds:
        dp = w // (first.pp * first.ep) if not args.dp else args.dp
        gb = first.global_batch * dp // first.dp
        if first.global_batch * dp % first.dp:
            raise UsageError(f"world {w}: the global batch {first.global_batch} x DP {dp} / {first.dp} is not whole")
        out.append(gb)
    return out


def profiles_for(plan: Plan, args: Any, source: str) -> tuple[dict, str]:
    """(profiles, their source) of ``plan``: traced where asked for and available, else the formulas."""
    from .formula import stage_profiles

    formula = stage_profiles(plan, fsdp=args.fsdp)
    if source in ("auto", "trace"):
        traced = trace_or_none(plan, args.preset, args.fsdp, strict=source == "trace")
        if traced is not None:
            fill_memory(traced, formula)
            return traced, "trace"
        if source == "trace":
            raise UsageError("--source trace: the tracer is not available in this build; use --source formula")
    return formula, "formula"


# ----------------------------------------------------------------------------- the table
def layout_name(plan: Plan, fsdp: bool) -> str:
    opt = "FSDP2" if fsdp else {"sharded": "ZeRO-1", "epso": "EPSO", "adamw": "AdamW"}[plan.optimizer]
    return (f"PP {plan.pp} x DP {plan.dp} x EP {plan.ep}, {opt}, --ac {'+'.join(plan.ac) or 'none'}, "
            f"micro-batch {plan.micro_batch}")


def scaling_rows(args: Any, cluster: Any) -> list[dict]:
    rows = []
    dpn = cluster.devices_per_node
    batches = weak_scaling_batches(args, args.world, dpn)
    for w, gb in zip(args.world, batches):
        plan = plan_for(args, w, gb, dpn)
        profs, src = profiles_for(plan, args, args.source)
        e = estimate(profs, cluster)
        rows.append({"plan": plan, "estimate": e, "source": src})
    base = rows[0]["estimate"]
    for r in rows:
        e = r["estimate"]
        r["efficiency"] = (e.tokens_per_s / e.world) / (base.tokens_per_s / base.world)
    return rows


def format_scaling(args: Any, cluster: Any, rows: list[dict]) -> str:
    p0 = rows[0]["plan"]
    mem = device_memory(args, cluster)
    lines = [f"{args.preset} on {cluster.path}: {layout_name(p0, args.fsdp)}; step records from "
             f"the {rows[0]['source']}" + (" (the tracer is not available in this build)" if rows[0]["source"] ==
                                            "formula" and args.source != "formula" else ""),
             f"  {'world':>6} {'DP':>5} {'batch':>7} {'M':>4} {'step s':>8} {'tokens/s':>11} {'TFLOP/s/dev':>11} "
             f"{'MFU':>6} {'GiB/rank':>8} {'weak-scaling':>12}  largest terms"]
    for r in rows:
        e, p = r["estimate"], r["plan"]
        fits = "" if e.memory_total <= mem else " (over the device's memory)"
        lines.append(f"  {e.world:>6} {p.dp:>5} {p.global_batch:>7} {p.micro_batches:>4} {e.step_s:>8.4g} "
                     f"{e.tokens_per_s:>11,.0f} {e.tflops_per_device():>11.1f} {e.mfu(cluster, args.weights):>6.1%} "
                     f"{e.memory_total / GiB:>8.1f} {r['efficiency']:>12.3f}  {largest_terms(e)}{fits}")
    widths = [max(len(t), 5) for t in TERMS]  # every term's whole name heads its column
    lines += ["", "  share of the step by term (%):",
              "  " + f"{'world':>6} " + " ".join(f"{t:>{w}}" for t, w in zip(TERMS, widths))]
    for r in rows:
        e = r["estimate"]
        lines.append("  " + f"{e.world:>6} " + " ".join(f"{100 * e.terms[t] / e.step_s:>{w}.1f}"
                                                        for t, w in zip(TERMS, widths)))
    return "\n".join(lines)


def figure4_check(args: Any, cluster: Any, rows: list[dict]) -> list[str]:
    """PASS/FAIL lines for the paper's Figure 4 bands, when the run is that layout on aurora from 384."""
    f = FIGURE4
    if (args.preset, args.pp, rows[0]["plan"].ep, args.world[0], cluster.name) != (f["preset"], f["pp"], f["ep"],
                                                                                     f["base"], "aurora"):
        return []
    out = []
    for lo_w, hi_w, lo, hi in f["bands"]:
        for r in rows:
            if lo_w <= r["estimate"].world <= hi_w:
                ok = lo <= r["efficiency"] <= hi
                out.append(f"{'PASS' if ok else 'FAIL'}: Figure 4 weak-scaling efficiency at {r['estimate'].world} tiles "
                           f"{r['efficiency']:.3f}, the paper's band [{lo:.2f}, {hi:.2f}]")
    return out


def rows_json(cluster: Any, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        d = r["estimate"].to_dict(cluster, r["plan"].weight_bytes == 4 and "fp32" or "bf16")
        p = r["plan"]
        d.update(pp=p.pp, dp=p.dp, ep=p.ep, global_batch=p.global_batch, micro_batch=p.micro_batch,
                 micro_batches=p.micro_batches, ac=list(p.ac), optimizer=p.optimizer,
                 weak_scaling_efficiency=r["efficiency"], source=r["source"])
        out.append(d)
    return out


# ----------------------------------------------------------------------------- main
def run(args: Any) -> int:
    if args.calibrate is not None:
        from .calibrate import calibrate_main

        if args.calibrate != "here":
            raise UsageError(f"--calibrate {args.calibrate}: only 'here' (this machine) can be measured")
        if not args.out:
            raise UsageError("--calibrate here needs --out FILE (the cluster file it writes)")
        return calibrate_main(args.out, world=(args.world or [4])[0], budget_s=args.budget)
    if not args.preset:
        raise UsageError("--preset is required (e.g. --preset mula-220b-a10b)")
    if not args.world:
        raise UsageError("--world is required (one or more world sizes)")
    if not args.cluster:
        raise UsageError("--cluster is required: aurora, h100-dgx, h200-dgx, b200-dgx or a cluster file")
    cluster = load_cluster(args.cluster)
    args.source = args.source or ("auto" if args.validate else "formula")
    if args.validate:
        from .calibrate import validate_main

        return validate_main(args, cluster)
    if args.search:
        from .search import search_main

        return search_main(args, cluster)
    rows = scaling_rows(args, cluster)
    print(format_scaling(args, cluster, rows))
    checks = figure4_check(args, cluster, rows)
    if checks:
        print("\n" + "\n".join(checks))
    if args.json:
        write_json(args.json, {"preset": args.preset, "cluster": cluster.name, "worlds": rows_json(cluster, rows),
                               "figure4": checks})
        print(f"\nwrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(args)
    except (UsageError, ClusterError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``fastmoe-plan``: the planner's command.

    fastmoe-plan --preset mula-220b-a10b --world 12288 --pp 8 --ep 12              # the formula plan
    fastmoe-plan --preset mula-220b-a10b --world 12288 --pp 8 --ep 12 --ac norm,attn,moe --trace

Without ``--trace`` it prints what ``python -m trainer.parallelism.plan`` prints (the same options).
``--trace [--ranks auto|LIST]`` runs the trainer's own set-up and one training step as each chosen
rank of the world on the fake process group (:mod:`trainer.scale.trace`) and prints, per rank, its
parameters, optimizer shard, checkpoint share, data shard, collectives and bytes sent, then the
world-wide checks as PASS / FAIL lines (:mod:`trainer.scale.trace_checks`). ``--cluster``,
``--calibrate``, ``--validate`` and ``--search`` go to the step-time model's command
(:mod:`trainer.scale.model_cli`).

A layout that cannot run is refused in one line before any work, naming the nearest valid choice
(exit 2): a world not divisible by PP x EP x TP, EP not dividing the experts, PP above the layers, a
global batch the data ranks cannot split, memory above ``--memory-gib``, ``--ranks`` outside the world.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Sequence

from ..parallelism import plan as planner

#: Options that belong to the step-time model's command.
MODEL_OPTIONS = ("--cluster", "--calibrate", "--validate", "--search")
GiB = 1024 ** 3


class LayoutError(ValueError):
    """A layout refused before any work (one line, naming the nearest valid choice)."""


def build_parser() -> argparse.ArgumentParser:
    ap = planner.build_parser(prog="fastmoe-plan")
    ap.description = ("Plan a PP x DP x EP run: layout, parameters and memory per rank; with --trace, run the "
                      "trainer's own set-up and one step as sampled ranks of the world on a fake process group.")
    ap.add_argument("--trace", action="store_true", help="run the trainer's step as sampled ranks (see --ranks)")
    ap.add_argument("--ranks", default="auto", help="with --trace: 'auto' (first and last rank of every stage, one "
                    "rank per expert position, the last rank) or comma-separated global ranks")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (dense models; with --trace)")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on the non-expert weights (--parallel.dp_shard fsdp)")
    ap.add_argument("--ep-comm", default=None, choices=["allgather", "alltoall"],
                    help="the EP token exchange (default: the preset's)")
    ap.add_argument("--jobs", type=int, default=0, help="with --trace: worker processes (0: the CPUs, at most 2)")
    ap.add_argument("--memory-gib", type=float, default=0.0, help="device memory per rank: refuse layouts above it")
    return ap


def _nearest_multiples(n: int, k: int) -> str:
    lo, hi = (n // k) * k, (n // k + 1) * k
    return f"{hi}" if lo == 0 else f"{lo} or {hi}"


def _nearest_divisors(n: int, x: int) -> str:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    below = max((d for d in divs if d < x), default=None)
    above = min((d for d in divs if d > x), default=None)
    return " or ".join(str(d) for d in (below, above) if d is not None)


def _shape(preset: str) -> Any:
    return planner.preset_shape(preset)


def check_layout(args: argparse.Namespace) -> None:
    """Raise :class:`LayoutError` (one line, the nearest valid choice named) for a layout that cannot
    run; nothing is built."""
    try:
        shape, mb0, ctx0, gb0 = _shape(args.preset)
    except (KeyError, ValueError) as e:
        raise LayoutError(str(e).strip("'\"")) from None
    pp, ep, tp, world = args.pp, args.ep or 1, args.tp, args.world
    for name, v in (("--world", world), ("--pp", pp), ("--ep", ep), ("--tp", tp)):
        if v < 1:
            raise LayoutError(f"{name} must be >= 1, got {v}")
    if pp > shape.num_layers:
        raise LayoutError(f"--pp {pp} is above the {shape.num_layers} layers of {args.preset} (every stage needs a "
                          f"layer); the largest valid PP is {shape.num_layers}")
    if shape.is_moe and shape.num_experts % ep:
        raise LayoutError(f"--ep {ep} does not divide the {shape.num_experts} experts of {args.preset}; the nearest "
                          f"valid EP is {_nearest_divisors(shape.num_experts, ep)}")
    inner = pp * ep * tp
    if world % inner:
        raise LayoutError(f"--world {world} is not divisible by PP x EP x TP = {pp} x {ep} x {tp} = {inner}; the nearest "
                          f"valid world is {_nearest_multiples(world, inner)}")
    dp = args.dp or world // inner
    if dp * inner != world:
        raise LayoutError(f"--dp {args.dp}: PP x DP x EP x TP = {dp * inner} is not the world {world}; the valid DP is "
                          f"{world // inner}")
    mb = args.micro_batch or mb0
    gb = args.global_batch or gb0
    step = dp * ep * mb
    if args.global_batch and gb % step:
        raise LayoutError(f"--global-batch {gb} is not divisible by DP x EP x micro batch = {dp} x {ep} x {mb} = {step}; "
                          f"the nearest valid global batch is {_nearest_multiples(gb, step)}")


def trace_global_batch(args: argparse.Namespace) -> tuple[int | None, str]:
    """The global batch the trace runs and a note when it is not the preset's: the preset's when it
    splits over the data ranks into at least PP micro-batches each (1F1B needs them), else the
    smallest multiple of it that does (as the paper's weak scaling grows the batch with DP)."""
    if args.global_batch:
        return args.global_batch, ""
    _, mb0, _, gb0 = _shape(args.preset)
    ep, tp = args.ep or 1, args.tp
    dp = args.dp or args.world // (args.pp * ep * tp)
    per = dp * ep * (args.micro_batch or mb0)
    need = per * max(1, args.pp)
    if gb0 % per == 0 and gb0 >= need:
        return None, ""
    gb = math.lcm(gb0, per)
    while gb < need:
        gb += math.lcm(gb0, per)
    return gb, (f"note: the preset's global batch {gb0} gives {gb0 // per if gb0 % per == 0 else 'no whole number of'} "
                f"micro-batch(es) per rank, fewer than 1F1B's PP={args.pp} or not whole; traced at {gb} (the smallest "
                f"multiple of it that gives each data rank whole micro-batches, at least PP; --global-batch sets it)")


def check_memory(args: argparse.Namespace, plan: Any) -> None:
    """Refuse a layout whose busiest rank needs more than ``--memory-gib``, naming the nearest layout
    (more checkpointing, then more pipeline stages) that fits."""
    if not args.memory_gib:
        return
    kind = "fsdp" if args.fsdp else plan.optimizer

    def need(p: Any) -> tuple[float, int]:
        worst = (0.0, 0)
        for st in p.stages:
            w, g, o, tr = p.state_bytes(st, kind)
            total = w + g + o + tr + p.activation_bytes(st) * p.in_flight(st.stage)
            worst = max(worst, (total, st.stage))
        return worst

    have, stage = need(plan)
    if have <= args.memory_gib * GiB:
        return
    hint = "no layout with more checkpointing or more pipeline stages fits either"
    ac_all = ("norm", "attn", "moe")
    options = [("--ac norm,attn,moe", dict(ac=ac_all, pp=plan.pp))]
    for pp in range(plan.pp + 1, plan.shape.num_layers + 1):
        if plan.world % (pp * plan.ep) == 0:
            options.append((f"--pp {pp} --ac norm,attn,moe", dict(ac=ac_all, pp=pp)))
    for text, kw in options:
        try:
            p = planner.make_plan(plan.preset, world=plan.world, pp=kw["pp"], ep=plan.ep,
                                  ranks_per_node=plan.ranks_per_node, micro_batch=plan.micro_batch,
                                  context=plan.context, global_batch=plan.global_batch, ac=kw["ac"],
                                  optimizer=plan.optimizer, shape=plan.shape)
        except ValueError:
            continue
        got = need(p)[0]
        if got <= args.memory_gib * GiB:
            hint = f"the nearest that fits is {text} ({got / GiB:.1f} GiB)"
            break
    raise LayoutError(f"the layout needs {have / GiB:.1f} GiB on a stage-{stage} rank, above --memory-gib "
                      f"{args.memory_gib:g}; {hint}")


def _plan(args: argparse.Namespace, global_batch: int | None = None) -> Any:
    return planner.make_plan(args.preset, world=args.world, pp=args.pp, ep=args.ep or 1, dp=args.dp,
                             ranks_per_node=args.ranks_per_node, micro_batch=args.micro_batch or None,
                             context=args.context or None, global_batch=global_batch or args.global_batch or None,
                             ac=args.ac, weights=args.weights, optimizer=args.optimizer)


def _model_command(argv: list[str]) -> int:
    try:
        from . import model_cli
    except ImportError:
        opts = [a for a in argv if a.split("=")[0] in MODEL_OPTIONS]
        print(f"error: {' '.join(opts)} need the step-time model (trainer.scale.model_cli), which this installation "
              "does not have", file=sys.stderr)
        return 2
    return int(model_cli.main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=")[0] in MODEL_OPTIONS for a in argv):
        return _model_command(argv)
    args = build_parser().parse_args(argv)
    try:
        check_layout(args)
        if args.tp > 1 and not args.trace:
            raise LayoutError(f"--tp {args.tp}: the formula plan models PP x DP x EP only; add --trace to run the "
                              "trainer's step at this layout")
        gb, note = trace_global_batch(args) if args.trace else (None, "")
        plan = _plan(args, gb) if args.tp == 1 else None
        if plan is not None:
            check_memory(args, plan)
        ranks = None
        if args.trace:
            from .trace import parse_ranks

            ep = args.ep or 1
            ranks = parse_ranks(args.ranks, args.world, args.pp, args.world // (args.pp * ep * args.tp), ep, args.tp)
    except ValueError as e:  # LayoutError, and the planner's own one-line refusals
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.trace:
        print(planner.format_plan(plan))
        return 0
    from ..config import ConfigError
    from .trace import build_config, trace_world
    from .trace_checks import format_report, run_checks

    try:
        cfg = build_config(args.preset, world=args.world, pp=args.pp, ep=args.ep or 1, dp=args.dp, tp=args.tp,
                           ac=args.ac, fsdp=args.fsdp, optimizer=args.optimizer, micro_batch=args.micro_batch or None,
                           global_batch=gb, context=args.context or None, ep_comm=args.ep_comm, weights=args.weights)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if note:
        print(note)
    from .trace import default_jobs

    traces = trace_world(cfg, args.world, ranks, progress=True, jobs=args.jobs or default_jobs())
    checks = run_checks(cfg, traces)
    print(format_report(cfg, traces, checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The layout search: every PP x DP x EP layout of a world with either EP token exchange, ZeRO-1, EPSO
or FSDP2, each activation checkpointing policy and micro-batch that fits the device's memory, priced by
the step-time model on the planner's formulas (:mod:`.formula`), fastest first.

Tensor parallelism is held at 1: the model prices TP=1 layouts, and the trainer's TP covers the dense
model only. The global batch is the one asked for (or the preset's) in every layout, so the step times
compare the same work; a layout whose DP x EP x micro-batch does not divide it, or whose micro-batches
are fewer than its pipeline stages (1F1B refuses them), is skipped.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator

from ..config.ac_spec import AC_CHOICES
from ..parallelism.plan import GiB, Plan, make_plan
from .formula import formula_profile
from .model import Estimate, behind, estimate

KINDS = ("epso", "sharded", "fsdp")
MICRO_BATCHES = (1, 2, 4, 8)
#: The EP token exchange (``--model.ep_dispatch``): tokens gathered on every EP rank, or sent only where
#: their experts are.
DISPATCHES = ("allgather", "alltoall")
AC_POLICIES = tuple(c for r in range(len(AC_CHOICES) + 1) for c in itertools.combinations(AC_CHOICES, r))


@dataclass
class Candidate:
    plan: Plan
    kind: str
    memory: int
    dispatch: str = "allgather"
    estimate: Estimate | None = None

    @property
    def name(self) -> str:
        p = self.plan
        kind = {"epso": "EPSO", "sharded": "ZeRO-1", "fsdp": "FSDP2"}[self.kind]
        ex = {"allgather": "ag", "alltoall": "a2a"}[self.dispatch] if p.ep > 1 else "-"
        return (f"PP {p.pp:>2} x DP {p.dp:>4} x EP {p.ep:>2} {ex:>3}  {kind:6s} --ac {'+'.join(p.ac) or 'none':<14} "
                f"mb {p.micro_batch}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_memory(plan: Plan, kind: str) -> int:
    """The largest rank's bytes: weights, gradients, optimizer states, gathered weights and the 1F1B
    in-flight activations (the sum the planner prints)."""
    best = 0
    for st in plan.stages:
        w, g, o, tr = plan.state_bytes(st, kind)
        best = max(best, w + g + o + tr + plan.activation_bytes(st) * plan.in_flight(st.stage))
    return best


def layouts(preset: str, world: int, devices_per_node: int, global_batch: int | None = None,
            context: int | None = None, weights: str = "bf16") -> Iterator[tuple[Plan, str]]:
    from ..parallelism.plan import preset_shape

    shape, _, _, gb0 = preset_shape(preset)
    gb = global_batch or gb0
    eps = [e for e in _divisors(devices_per_node) if not shape.is_moe and e == 1
           or shape.is_moe and shape.num_experts % e == 0]
    for pp in _divisors(world):
        if pp > shape.num_layers:
            break
        for ep in eps:
            if (world // pp) % ep:
                continue
            dp = world // (pp * ep)
            for mb in MICRO_BATCHES:
                if gb % (dp * ep * mb) or gb // (dp * ep * mb) < (pp if pp > 1 else 1):
                    continue
                for ac in AC_POLICIES:
                    for kind in KINDS if shape.is_moe else ("sharded", "fsdp"):
                        plan = make_plan(preset, world=world, pp=pp, ep=ep, dp=dp, ranks_per_node=devices_per_node,
                                         micro_batch=mb, context=context, global_batch=gb, ac=ac, weights=weights,
                                         optimizer="epso" if kind == "fsdp" and shape.is_moe else
                                         ("sharded" if kind == "fsdp" else kind))
                        yield plan, kind


def price_candidate(c: Candidate, cluster: Any) -> Estimate:
    """Stages that do the same work (the same layer count, no embedding or head) are priced once."""
    plan = c.plan
    per_stage = plan.dp * plan.ep
    reps: dict[tuple, int] = {}
    counts: dict[int, int] = {}
    for st in plan.stages:
        key = (len(st.layers), st.has_embedding, st.has_head)
        if key not in reps:
            reps[key] = st.stage
        counts[reps[key]] = counts.get(reps[key], 0) + 1
    profs = {s * per_stage: formula_profile(plan, s * per_stage, fsdp=c.kind == "fsdp", ep_dispatch=c.dispatch)
             for s in counts}
    return estimate(profs, cluster, stage_counts=counts)


def search(preset: str, world: int, cluster: Any, *, memory_bytes: float, global_batch: int | None = None,
           context: int | None = None, weights: str = "bf16") -> tuple[list[Candidate], int]:
    """(candidates that fit, fastest per token first; how many layouts were enumerated)."""
    fits, seen = [], 0
    for plan, kind in layouts(preset, world, cluster.devices_per_node, global_batch, context, weights):
        dispatches = DISPATCHES if plan.ep > 1 else DISPATCHES[:1]
        seen += len(dispatches)
        mem = rank_memory(plan, kind)
        if mem <= memory_bytes:
            fits += [Candidate(plan, kind, mem, d) for d in dispatches]
    for c in fits:
        c.estimate = price_candidate(c, cluster)
    fits.sort(key=lambda c: c.estimate.step_s / c.estimate.tokens_per_step)
    return fits, seen


def paper_layout(c: Candidate) -> bool:
    """Mula-220B-A10B's published layout: PP=8, EP=12, EPSO, AC on norms, attention and experts (the
    trainer's default allgather exchange)."""
    p = c.plan
    return ((p.preset, p.pp, p.ep, c.kind, tuple(p.ac), c.dispatch)
            == ("mula-220b-a10b", 8, 12, "epso", ("norm", "attn", "moe"), "allgather"))


def search_main(args: Any, cluster: Any) -> int:
    from .sources import UsageError, device_memory, write_json

    if len(args.world) != 1:
        raise UsageError("--search takes one --world")
    world = args.world[0]
    mem = device_memory(args, cluster)
    t0 = time.perf_counter()
    found, seen = search(args.preset, world, cluster, memory_bytes=mem, global_batch=args.global_batch or None,
                         context=args.context or None, weights=args.weights)
    took = time.perf_counter() - t0
    print(f"{args.preset} at world {world} on {cluster.name}: {seen} layouts enumerated (PP x DP x EP with the EP "
          f"exchange allgather (ag) or all-to-all (a2a), EPSO / ZeRO-1 / FSDP2, {len(AC_POLICIES)} --ac policies, "
          f"micro-batch {'/'.join(map(str, MICRO_BATCHES))}; TP held at 1), {len(found)} fit in {mem / GiB:.0f} GiB, "
          f"priced in {took:.1f} s")
    if not found:
        print("no layout fits; raise --memory-gib or use more devices")
        return 1
    best = found[0]
    print(f"  {'#':>2}  {'layout':<56} {'step s':>8} {'tokens/s':>11} {'GiB/rank':>8}  behind the first by")
    for i, c in enumerate(found[:args.top], 1):
        e = c.estimate
        print(f"  {i:>2}  {c.name:<56} {e.step_s:>8.2f} {e.tokens_per_s:>11,.0f} {c.memory / GiB:>8.1f}  "
              f"{behind(e, best.estimate)}")
    paper = [i for i, c in enumerate(found, 1) if paper_layout(c)]
    if args.preset == "mula-220b-a10b":
        if paper:
            c = found[paper[0] - 1]
            print(f"  the paper's layout (PP 8 x EP 12, EPSO, --ac norm+attn+moe) ranks {paper[0]} of "
                  f"{len(found)} at its best micro-batch ({c.plan.micro_batch}): {c.estimate.step_s:.2f} s, "
                  f"{c.memory / GiB:.1f} GiB; behind the first by "
                  f"{behind(c.estimate, best.estimate)}")
        else:
            print("  the paper's layout (PP 8 x EP 12, EPSO, --ac norm+attn+moe) does not fit here "
                  "or does not divide this world and batch")
    if args.json:
        write_json(args.json, {"preset": args.preset, "world": world, "cluster": cluster.name, "enumerated": seen,
                               "fit": len(found), "seconds": took,
                               "top": [dict(layout=c.name, memory=c.memory, **c.estimate.to_dict(cluster))
                                       for c in found[:args.top]], "paper_rank": paper[0] if paper else None})
    return 0

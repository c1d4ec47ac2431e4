"""The step-time model: a layout's step on a named cluster, from one :class:`StepProfile` per traced (or
formula) rank and a :class:`~trainer.scale.cluster.Cluster`.

Terms, and what overlaps with what (nothing overlaps unless stated):

compute      per op kind: GEMMs, grouped (expert) GEMMs and attention at ``peak x gemm_efficiency`` of the
             record's dtype (or their bytes at the memory bandwidth, whichever is longer); memory-bound ops
             at ``memory_gbps x memory_efficiency``; ``launch_us`` per launch.
collectives  per call ``latency x steps + wire bytes / bandwidth``: wire bytes by the ring algorithms'
             factors (:func:`trainer.scale.profile.wire_bytes`); steps ``ceil(log2 W)`` for an all-gather,
             reduce-scatter or broadcast, twice that for an all-reduce, ``W - 1`` for an all-to-all, one for
             a send. A group within one node uses the intra-node link (or a calibrated op's own figures); a
             group spanning nodes is limited by the node's NICs shared by every rank of the node (all of
             them run their own group's collective at the same time): ``min(intra, nics x nic_gbps x k /
             devices_per_node)`` for ``k`` members of the group per node, and the network's latency.
pipeline     1F1B: a stage's slot is one micro-batch's forward and backward with its EP exchange,
             tensor-parallel reductions and pipeline sends (on the critical path); the step's pipeline part
             is ``(M - 1) x slowest slot + sum of the stages' slots``; the bubble is what exceeds ``M x
             slowest slot``.
FSDP2        its per-layer gathers and reduce-scatters run beside the compute when the cluster says so
             (``overlap.fsdp``): only what exceeds the stage's compute is exposed; otherwise all of it.
after        the optimizer's reductions and gathers, its step, and the scalar reductions follow the last
             backward on every stage (the slowest rank counts).

Left out: stragglers, routing skew beyond forced-uniform routing, network contention between jobs,
failures and restarts (docs/scale.md).
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from .cluster import Cluster
from .profile import COLLECTIVE_TERMS, Collective, Compute, StepProfile, wire_bytes

PIPE_TERMS = ("gemm", "grouped_gemm", "attention", "memory", "launches", "ep tokens", "tp activations",
              "pipeline activations", "fsdp exposed")
AFTER_TERMS = ("dp sync", "optimizer step", "scalars")
TERMS = PIPE_TERMS + ("bubble",) + AFTER_TERMS


def steps(op: str, w: int) -> int:
    """Latency-bound steps of one call over ``w`` ranks."""
    if op in ("send", "recv"):
        return 1
    if w <= 1:
        return 0
    lg = math.ceil(math.log2(w))
    return {"all_reduce": 2 * lg, "all_to_all": w - 1}.get(op, lg)


@functools.lru_cache(maxsize=4096)
def nodes_spanned(group: tuple[int, ...], devices_per_node: int) -> int:
    return len({r // devices_per_node for r in group})


def link(c: Collective, cluster: Cluster) -> tuple[float, float, bool]:
    """(latency s per step, bandwidth B/s, spans nodes) of ``c``'s group on ``cluster``."""
    dpn = cluster.devices_per_node
    nodes = nodes_spanned(c.group, dpn)
    intra = float(cluster.get(f"ops.{c.op}.bandwidth_gbps", cluster["intra.bandwidth_gbps"])) * 1e9
    if nodes <= 1:
        lat = float(cluster.get(f"ops.{c.op}.latency_us", cluster["intra.latency_us"]))
        return lat * 1e-6, intra, False
    k = 1 if c.op in ("send", "recv") else math.ceil(len(c.group) / nodes)
    nic = float(cluster["inter.nics_per_node"]) * float(cluster["inter.nic_gbps"]) * 1e9 * k / dpn
    return float(cluster["inter.latency_us"]) * 1e-6, min(intra, nic), True


def collective_seconds(c: Collective, cluster: Cluster) -> float:
    """All ``count`` calls of ``c`` on ``cluster`` (a receive costs its sender's time, not its own)."""
    if c.op == "recv" or (len(c.group) <= 1 and c.op != "send"):
        return 0.0
    lat, bw, _ = link(c, cluster)
    return c.count * lat * steps(c.op, len(c.group)) + wire_bytes(c) / bw


def compute_seconds(c: Compute, cluster: Cluster) -> tuple[float, float]:
    """(work seconds, launch seconds) of ``c``."""
    mem = float(cluster["device.memory_gbps"]) * 1e9 * float(cluster["device.memory_efficiency"])
    by_bytes = c.bytes / mem
    if c.kind == "memory":
        work = by_bytes
    else:
        work = max(c.flops / (cluster.peak_flops(c.dtype) * float(cluster["device.gemm_efficiency"])), by_bytes)
    return work, c.count * float(cluster["device.launch_us"]) * 1e-6


def collective_term(c: Collective) -> str:
    """The model's term for ``c`` (:data:`trainer.scale.profile.COLLECTIVE_TERMS`)."""
    for t in COLLECTIVE_TERMS:
        if c.label.startswith(t):
            return {"optimizer": "dp sync", "fsdp weights and gradients": "fsdp"}.get(t, t)
    return "pipeline activations" if c.op in ("send", "recv") else "scalars"


@dataclass
class RankTimes:
    """One profile priced: its per-micro-batch slot (pipeline terms, seconds per step, all ``M``), and
    what follows the backward."""

    rank: int
    stage: int
    pipe: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)

    @property
    def pipe_s(self) -> float:
        return sum(self.pipe.values())

    @property
    def after_s(self) -> float:
        return sum(self.after.values())


def price(p: StepProfile, cluster: Cluster) -> RankTimes:
    rt = RankTimes(p.rank, p.stage, pipe={t: 0.0 for t in PIPE_TERMS}, after={t: 0.0 for t in AFTER_TERMS})
    for c in p.compute:
        work, launch = compute_seconds(c, cluster)
        if c.label == "optimizer":
            rt.after["optimizer step"] += work + launch
        else:
            rt.pipe[c.kind] += work
            rt.pipe["launches"] += launch
    fsdp = 0.0
    for c in p.collectives:
        if c.phase != "step":
            continue
        t, term = collective_seconds(c, cluster), collective_term(c)
        if term == "fsdp":
            fsdp += t
        elif term in rt.after:
            rt.after[term] += t
        else:
            rt.pipe[term] += t
    compute = sum(rt.pipe[k] for k in ("gemm", "grouped_gemm", "attention", "memory", "launches"))
    rt.pipe["fsdp exposed"] = max(0.0, fsdp - compute) if cluster["overlap.fsdp"] else fsdp
    return rt


@dataclass
class Estimate:
    """A layout's predicted step on a cluster."""

    world: int
    step_s: float
    terms: dict[str, float]
    tokens_per_step: int
    model_flops: float
    """FLOPs of the step over the whole world, recomputation left out."""
    memory_bytes: dict[str, int]
    """The largest rank's memory by term (its total is the largest total over the profiles)."""
    bottleneck_stage: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def tflops_per_device(self) -> float:
        return self.model_flops / self.step_s / self.world / 1e12

    def mfu(self, cluster: Cluster, dtype: str = "bf16") -> float:
        return self.tflops_per_device() * 1e12 / cluster.peak_flops(dtype)

    @property
    def memory_total(self) -> int:
        return sum(self.memory_bytes.values())

    def to_dict(self, cluster: Cluster | None = None, dtype: str = "bf16") -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, tflops_per_device=self.tflops_per_device(),
                 memory_total=self.memory_total, shares={k: v / self.step_s for k, v in self.terms.items()})
        if cluster is not None:
            d["mfu"] = self.mfu(cluster, dtype)
        return d


def model_flops(p: StepProfile) -> float:
    return sum(c.flops for c in p.compute if not c.label.endswith("recompute") and c.kind != "memory")


def estimate(profiles: dict[int, StepProfile], cluster: Cluster, stage_counts: dict[int, int] | None = None) -> Estimate:
    """The step of the layout ``profiles`` describe (at least one profile per pipeline stage; several of
    one stage: the slowest counts). ``stage_counts``: stage -> how many stages of the pipeline it stands
    for (stages that do the same work are priced once; default one each, and every stage present)."""
    if not profiles:
        raise ValueError("no profiles to price")
    first = next(iter(profiles.values()))
    pp, M, world = first.pp, first.micro_batches, first.world
    priced = {r: price(p, cluster) for r, p in profiles.items()}
    slowest: dict[int, RankTimes] = {}
    for rt in priced.values():
        if rt.stage not in slowest or rt.pipe_s > slowest[rt.stage].pipe_s:
            slowest[rt.stage] = rt
    counts = stage_counts or {s: 1 for s in range(pp)}
    missing = sorted(set(counts) - set(slowest))
    if missing or sum(counts.values()) != pp:
        raise ValueError(f"no profile for pipeline stage(s) {missing or sorted(set(range(pp)) - set(counts))}")
    neck = max(slowest.values(), key=lambda r: r.pipe_s)
    slot = neck.pipe_s / M
    pipe = slot * (M - 1) + sum(counts[s] * r.pipe_s / M for s, r in slowest.items())
    terms = dict(neck.pipe)
    terms["bubble"] = pipe - neck.pipe_s
    tail = max(priced.values(), key=lambda r: r.after_s)
    terms.update(tail.after)
    flops = 0.0
    for stage, n in counts.items():
        ps = [profiles[r] for r, t in priced.items() if t.stage == stage]
        flops += n * sum(model_flops(p) for p in ps) / len(ps) * (world // pp)
    mem_rank = max(profiles.values(), key=lambda p: sum(p.memory_bytes.values()))
    return Estimate(world=world, step_s=sum(terms.values()), terms=terms, tokens_per_step=first.tokens_per_step,
                    model_flops=flops, memory_bytes=dict(mem_rank.memory_bytes), bottleneck_stage=neck.stage)


def largest_terms(e: Estimate, n: int = 3) -> str:
    ranked = sorted(e.terms.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v / e.step_s:.0%}" for k, v in ranked if v > 0)


def behind(e: Estimate, best: Estimate) -> str:
    """The term that puts ``e`` behind ``best`` the most (per token: the batches may differ)."""
    if e is best:
        return "-"
    scale = best.tokens_per_step / e.tokens_per_step
    diffs = {k: e.terms[k] * scale - best.terms.get(k, 0.0) for k in e.terms}
    k, v = max(diffs.items(), key=lambda kv: kv[1])
    return f"{k} +{v * 1e3:.1f} ms" if v > 0 else "-"

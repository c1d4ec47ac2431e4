"""The checks a trace of the trainer's step answers, over the whole world: the traced ranks from
what they recorded, every other rank by the same code's index arithmetic (mesh coordinates, the
optimizer's shard layout, :func:`trainer.checkpoint.writers.model_writes`,
:func:`trainer.checkpoint.optim_state.state_writer`, the loader's :meth:`rank_indices`).

Each check gives a :class:`Check`: a name, whether it passed, and the figures it rests on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..checkpoint.writers import Segment, coords_of, model_writes
from ..layout import DeviceMesh
from ..parallelism.plan import _b as _n  # counts as the planner prints them
from .profile import wire_bytes
from .trace import WEIGHT_LABELS, RankTrace

#: Buckets whose elements differ between the ranks of the inner axis (EP's experts, TP's split weights).
INNER_BUCKETS = ("expert", "tp_split")
#: All-reduces of at most this many elements are the step's scalars (norms, losses), not weights.
SCALAR_ELEMENTS = 16


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


# ----------------------------------------------------------------------------- mesh arithmetic
def mesh_of(cfg: Any, rank: int) -> DeviceMesh:
    p = cfg.parallel
    return DeviceMesh(rank=rank, pp=p.pp, dp=p.dp, ep=p.ep, tp=p.tp)


def expected_groups(m: DeviceMesh) -> dict[str, tuple[int, ...]]:
    """The groups rank ``m.rank`` belongs to by the layout's formula ``((pp*DP + dp)*EP + ep)*TP + tp``
    (:mod:`trainer.layout`); size-1 groups left out, as the trainer leaves them None."""
    P, D, E, T = m.pp, m.dp, m.ep, m.tp
    p, d, e, t = m.pp_rank, m.dp_rank, m.ep_rank, m.tp_rank

    def at(p_: int, d_: int, e_: int, t_: int) -> int:
        return ((p_ * D + d_) * E + e_) * T + t_

    out = {"ep": tuple(at(p, d, x, t) for x in range(E)), "tp": tuple(at(p, d, e, x) for x in range(T)),
           "dp": tuple(at(p, x, e, t) for x in range(D)), "pp": tuple(at(x, d, e, t) for x in range(P))}
    out["dp_ep"] = tuple(at(p, x, y, t) for x in range(D) for y in range(E)) if T == 1 else out["dp"]
    return {k: v for k, v in out.items() if len(v) > 1}


def _position(m: DeviceMesh, dim: str) -> int:
    return {"dp": m.dp_rank, "ep": m.ep_rank, "tp": m.tp_rank, "dp_ep": m.data_rank, "self": 0}[dim]


def _axes(dim: str) -> set[str]:
    return {"dp": {"dp"}, "ep": {"ep"}, "tp": {"tp"}, "dp_ep": {"dp", "ep"}, "self": set()}[dim]


def _dim_of(group: Sequence[int], m: DeviceMesh) -> str:
    """Which mesh group of ``m``'s rank ``group`` is ("self" for this rank alone)."""
    if len(group) == 1:
        return "self"
    for name, ranks in expected_groups(m).items():
        if tuple(group) == ranks and name != "pp":
            return name
    raise ValueError(f"group {tuple(group)[:8]}... of rank {m.rank} is none of the mesh's groups")


def _inner(m: DeviceMesh) -> int:
    return m.tp_rank if m.tp > 1 else m.ep_rank


# ----------------------------------------------------------------------------- tiling
def _tiles(claims: dict[Any, list[tuple[int, int, int]]], sizes: dict[Any, int]) -> tuple[int, int, list[str]]:
    """(keys covered exactly once, keys, first problems) for ``claims`` ``{key: [(lo, hi, rank)]}``
    against ``sizes`` ``{key: size}``."""
    bad: list[str] = []
    good = 0
    for key, size in sizes.items():
        spans = sorted(claims.get(key, []))
        at, ok = 0, True
        for lo, hi, r in spans:
            if lo != at:
                ok = False
                what = "twice" if lo < at else "by no rank"
                bad.append(f"{key}: elements [{min(lo, at)}, {max(lo, at)}) written {what} (rank {r})")
                break
            at = hi
        if ok and at != size:
            ok = False
            bad.append(f"{key}: elements [{at}, {size}) by no rank")
        good += ok
    for key in claims:
        if key not in sizes:
            bad.append(f"{key}: claimed but not a weight of the model")
    return good, len(sizes), bad[:3]


def _chunk(n: int, parts: int, g: int) -> tuple[int, int]:
    """Rows of ``Shard(0)`` piece ``g`` of ``n`` rows over ``parts`` ranks (torch.chunk's rule)."""
    c = math.ceil(n / parts)
    return min(g * c, n), min((g + 1) * c, n)


class World:
    """The whole world's ranks seen through the traced ones: for every rank the trace of its stage
    (of its inner position where one was traced) stands for its weights and buckets."""

    def __init__(self, cfg: Any, traces: dict[int, RankTrace]) -> None:
        self.cfg, self.traces = cfg, traces
        p = cfg.parallel
        self.world = p.pp * p.dp * p.ep * p.tp
        self.by_stage: dict[int, list[RankTrace]] = {}
        for tr in traces.values():
            self.by_stage.setdefault(tr.coords["pp"], []).append(tr)
        self.stages = sorted(self.by_stage)
        self.inner = p.ep * p.tp

    def rep(self, m: DeviceMesh) -> RankTrace | None:
        cands = self.by_stage.get(m.pp_rank)
        if not cands:
            return None
        for tr in cands:
            if tr.coords["ep"] == m.ep_rank and tr.coords["tp"] == m.tp_rank:
                return tr
        return cands[0]

    def ranks(self) -> Iterable[DeviceMesh]:
        for r in range(self.world):
            m = mesh_of(self.cfg, r)
            if m.pp_rank in self.by_stage:
                yield m


def remap(seg_key: str, seg_inner: bool, local_index: int | None, param: str, per_param: int, inner: int) -> str:
    """A segment's key on inner position ``inner`` (global expert id ``inner * NR + local``, or TP ``/tp<inner>``)."""
    if not seg_inner:
        return seg_key
    if local_index is not None:
        return f"{param}/{inner * per_param + local_index}"
    return f"{param}/tp{inner}"


def _segments_at(tr: RankTrace, inner: int) -> list[Segment]:
    counts: dict[str, int] = {}
    for s in tr.segments:
        counts[s.param] = counts.get(s.param, 0) + 1
    return [Segment(remap(s.key, s.inner, s.local_index, s.param, counts[s.param], inner), s.param, s.local_index,
                    s.shape, s.inner) for s in tr.segments]


def _bucket_key_at(key: str, inner: int, rep_inner: int, per_param: dict[str, int]) -> str:
    """A bucket segment's key (``param`` or ``param/<id>`` or ``param/tp<r>``) on inner position ``inner``."""
    param, _, tail = key.partition("/")
    if not tail:
        return key
    if tail.startswith("tp"):
        return f"{param}/tp{inner}"
    nr = per_param[param]
    return f"{param}/{int(tail) - rep_inner * nr + inner * nr}"


# ----------------------------------------------------------------------------- the checks
def check_optimizer_owners(w: World) -> Check:
    claims: dict[Any, list[tuple[int, int, int]]] = {}
    sizes: dict[Any, int] = {}
    mismatch = []
    for m in w.ranks():
        tr = w.rep(m)
        assert tr is not None
        rep_m = mesh_of(w.cfg, tr.profile.rank)
        for b in tr.optimizer:
            if b["fsdp"]:
                g, parts = m.data_rank, m.dp * m.ep
                for name, shape, _ in b["sharded"]:
                    key = ("fsdp", m.pp_rank, name)
                    sizes[key] = shape[0]
                    lo, hi = _chunk(shape[0], parts, g)
                    if hi > lo:
                        claims.setdefault(key, []).append((lo, hi, m.rank))
                continue
            dim = _dim_of(b["shard_group"], rep_m)
            ident = _inner(m) if b["name"] in INNER_BUCKETS else None
            owner = _owner(m, b, dim)
            if m.rank == tr.profile.rank and owner != b["norm_owner"]:
                mismatch.append(m.rank)
            key = (b["name"], m.pp_rank, ident)
            sizes[key] = b["numel"]
            if owner:
                g, S = _position(m, dim), b["shard_numel"]
                lo, hi = min(g * S, b["numel"]), min((g + 1) * S, b["numel"])
                if hi > lo:
                    claims.setdefault(key, []).append((lo, hi, m.rank))
    good, n, bad = _tiles(claims, sizes)
    ok = good == n and not mismatch
    detail = (f"{good}/{n} buckets (stage x bucket x expert/TP position) have every element owned by exactly one rank"
              + (f"; {'; '.join(bad)}" if bad else "")
              + (f"; ranks {mismatch} count their shard in the norm though the arithmetic says a replica does" if mismatch else ""))
    return Check("every parameter element has exactly one optimizer owner", ok, detail + _stages_note(w))


def _owner(m: DeviceMesh, b: dict[str, Any], dim: str) -> bool:
    """Whether rank ``m`` counts its shard of bucket ``b`` (sharded over mesh group ``dim``) as the
    owner: its position is 0 on every axis of the stage where ranks hold identical copies (outside
    the shard group, and outside the inner axis for buckets whose elements differ along it)."""
    replica_axes = {"dp", "ep", "tp"} - _axes(dim) - ({"ep", "tp"} if b["name"] in INNER_BUCKETS else set())
    return all(_position(m, a) == 0 for a in replica_axes)


def _stages_note(w: World) -> str:
    missing = [s for s in range(w.cfg.parallel.pp) if s not in w.by_stage]
    return f" (stages {missing} not traced, not checked)" if missing else ""


def check_checkpoint_writers(w: World) -> Check:
    """Every checkpoint byte (model weights, and the optimizer's fp32 master and moments) one writer."""
    from ..checkpoint.optim_state import state_writer

    claims: dict[Any, list[tuple[int, int, int]]] = {}
    sizes: dict[Any, int] = {}
    wb = 2 if w.cfg.model.param_dtype == "bf16" else 4
    total = 0
    segs_cache: dict[tuple[int, int], list[Segment]] = {}
    for m in w.ranks():
        tr = w.rep(m)
        assert tr is not None
        rep_m = mesh_of(w.cfg, tr.profile.rank)
        inner = _inner(m)
        segs = segs_cache.get((m.pp_rank, inner))
        if segs is None:
            segs = segs_cache[(m.pp_rank, inner)] = _segments_at(tr, inner)
            for s in segs:
                sizes[("model", s.key)] = s.numel
        sharded = {name for b in tr.optimizer if b["fsdp"] for name, _, _ in b["sharded"]}
        for s in model_writes([s for s in segs if s.param not in sharded], coords_of(m)):
            claims.setdefault(("model", s.key), []).append((0, s.numel, m.rank))
            total += wb * s.numel
        for b in tr.optimizer:
            if b["fsdp"]:
                for name, shape, _ in b["sharded"]:
                    row = math.prod(shape[1:])
                    lo, hi = _chunk(shape[0], m.dp * m.ep, m.data_rank)
                    for space in ("model", "optim"):
                        sizes[(space, name)] = shape[0]
                        if hi > lo:
                            claims.setdefault((space, name), []).append((lo, hi, m.rank))
                    total += (wb + 12) * row * (hi - lo)
                continue
            dim = _dim_of(b["shard_group"], rep_m)
            pre_dim = _dim_of(b["pre_reduce_group"], rep_m)
            g, j, R = _position(m, dim), _position(m, pre_dim), len(b["pre_reduce_group"])
            if R == 1 and not _owner(m, b, dim):
                continue  # an identical replica's states: their owner writes them (optimizer_writes)
            per_param: dict[str, int] = {}
            for key, _, _ in b["segments"]:
                per_param[key.partition("/")[0]] = per_param.get(key.partition("/")[0], 0) + 1
            rep_inner = _inner(rep_m)
            for i, (key, off, n) in enumerate(b["segments"]):
                k = ("optim", _bucket_key_at(key, inner, rep_inner, per_param) if inner != rep_inner else key)
                sizes[k] = n
                if state_writer(i, off, b["shard_numel"], R) == (g, j):
                    claims.setdefault(k, []).append((0, n, m.rank))
                    total += 12 * n
    good, n, bad = _tiles(claims, sizes)
    return Check("every checkpoint byte has one writer", good == n,
                 f"{good}/{n} checkpoint tensors (model weights, optimizer states) written exactly once, "
                 f"{_gib(total)} in all" + (f"; {'; '.join(bad)}" if bad else "") + _stages_note(w))


def check_data_shards(cfg: Any) -> Check:
    from ..data.loader import ShardedLoader
    from .trace import _Shape

    p, s = cfg.parallel, cfg.schedule
    D = p.dp * p.ep
    spans = []
    for d in range(D):
        idx = ShardedLoader(_Shape(cfg.data.context), s.global_batch, s.micro_batch, dp_rank=d, dp_size=D,
                            verify=False).rank_indices(0)
        spans.append((int(idx[0]), int(idx[-1]) + 1, d))
    good, n, bad = _tiles({"batch": spans}, {"batch": s.global_batch})
    return Check("the data shards of all DP ranks are disjoint and cover the global batch", good == n,
                 f"{D} data ranks x {s.global_batch // D} instances = global batch {s.global_batch}"
                 + (f"; {'; '.join(bad)}" if bad else ""))


def traced_weight_bytes(tr: RankTrace) -> float:
    """Bytes the rank sends per step for its weights and gradients (the optimizer's and FSDP2's
    collectives, without the scalar all-reduces of norms)."""
    return sum(wire_bytes(c) for c in tr.profile.collectives if c.phase == "step" and c.label in WEIGHT_LABELS
               and not (c.op == "all_reduce" and c.elements <= SCALAR_ELEMENTS))


def traced_label_bytes(tr: RankTrace, label: str) -> float:
    return sum(wire_bytes(c) for c in tr.profile.collectives if c.phase == "step" and c.label == label)


def plan_of(cfg: Any) -> Any:
    from ..parallelism.plan import ModelShape, make_plan

    p, s = cfg.parallel, cfg.schedule
    kind = cfg.optim.name
    return make_plan(cfg.preset, world=p.pp * p.dp * p.ep, pp=p.pp, ep=p.ep, dp=p.dp, ranks_per_node=max(12, p.ep),
                     micro_batch=s.micro_batch, context=cfg.data.context, global_batch=s.global_batch, ac=p.ac,
                     weights=cfg.model.param_dtype, optimizer=kind if kind in ("adamw", "sharded", "epso") else None,
                     shape=ModelShape.of(cfg.model))


def check_traffic(cfg: Any, traces: dict[int, RankTrace]) -> Check:
    p = cfg.parallel
    if p.tp > 1:
        return Check("weight and gradient bytes equal Plan.traffic_bytes", True,
                     "not compared: the planner does not model tensor parallelism")
    plan = plan_of(cfg)
    kind = "fsdp" if p.dp_shard == "fsdp" else cfg.optim.name
    gb = 4 if cfg.optim.grad_reduce_dtype == "fp32" else 2
    worst, parts = 0.0, []
    for r, tr in sorted(traces.items()):
        want = plan.traffic_bytes(plan.stages[tr.coords["pp"]], kind, grad_bytes=gb)
        got = traced_weight_bytes(tr)
        err = abs(got - want) / want if want else (0.0 if got == 0 else math.inf)
        worst = max(worst, err)
        parts.append(f"rank {r} {_gib(got)} vs {_gib(want)}")
    return Check("traced weight and gradient bytes per rank equal Plan.traffic_bytes within 1%", worst <= 0.01,
                 f"worst {worst:.2%}; " + ", ".join(parts[:4]) + (" ..." if len(parts) > 4 else ""))


def ep_token_bytes(cfg: Any, stage_layers: int, micro_batches: int) -> float:
    """The EP token exchange one rank sends per step by :func:`fastmoe_xpu.dist.comm_bytes.ep_layer_comm_bytes`
    (uniform routing's expected rows under all-to-all): per layer, forward and backward, for every
    micro-batch. A checkpointed MoE block (``--ac moe``) exchanges again when recomputed, as far as
    torch's checkpoint recomputes (it stops once every saved tensor is back): under allgather the
    dispatch only (the combine's reduce-scatter saves nothing), under all-to-all the combine too (its
    scatter-add keeps the row index)."""
    from fastmoe_xpu.dist.comm_bytes import ep_layer_comm_bytes, expected_remote_rows

    from ..config.ac_spec import parse_ac

    m, p = cfg.model, cfg.parallel
    S = cfg.schedule.micro_batch * cfg.data.context
    a = 2 if m.param_dtype == "bf16" else 4
    rows = expected_remote_rows(S, m.num_experts, m.top_k, p.ep) if m.ep_dispatch == "alltoall" else None
    c = ep_layer_comm_bytes(m.ep_dispatch, hidden=m.hidden_size, num_experts=m.num_experts, top_k=m.top_k,
                            tokens_per_rank=S, ep_size=p.ep, act_bytes=a, rows_sent=rows, rows_recv=rows,
                            check_inputs=m.ep_check_inputs)
    a_row = m.hidden_size * a  # (the allgather combine reduce-scatters one [S, H] row block per peer)
    combine = (p.ep - 1) * S * a_row if m.ep_dispatch == "allgather" else 0
    again = c.forward_sent - combine if "moe" in parse_ac(p.ac) else 0
    return stage_layers * micro_batches * (c.forward_sent + again + c.backward_sent)


def check_ep_tokens(cfg: Any, traces: dict[int, RankTrace]) -> Check | None:
    if cfg.parallel.ep == 1 or not cfg.model.is_moe:
        return None
    from ..parallelism.plan import split_layers

    stages = split_layers(cfg.model.num_layers, cfg.parallel.pp)
    worst, parts = 0.0, []
    for r, tr in sorted(traces.items()):
        want = ep_token_bytes(cfg, len(stages[tr.coords["pp"]]), tr.profile.micro_batches)
        got = traced_label_bytes(tr, "ep tokens")
        err = abs(got - want) / want
        worst = max(worst, err)
        parts.append(f"rank {r} {_gib(got)} vs {_gib(want)}")
    return Check(f"the EP token exchange ({cfg.model.ep_dispatch}) equals its formula within 1%", worst <= 0.01,
                 f"worst {worst:.2%}; " + ", ".join(parts[:4]) + (" ..." if len(parts) > 4 else ""))


def check_groups(cfg: Any, traces: dict[int, RankTrace]) -> Check:
    bad = []
    n = 0
    for r, tr in sorted(traces.items()):
        m = mesh_of(cfg, r)
        want = expected_groups(m)
        if tr.groups != want:
            bad.append(f"rank {r}: groups {sorted(tr.groups)} differ from the mesh's")
        allowed = set(want.values()) | {tuple(range(m.world))}
        for c in tr.profile.collectives:
            n += 1
            if c.op in ("send", "recv"):
                peer = c.group[1]
                if not any(peer in g for g in want.values()):
                    bad.append(f"rank {r}: {c.op} with {peer}, outside its groups")
            elif c.group not in allowed:
                bad.append(f"rank {r}: {c.op} over {len(c.group)} ranks that are none of its mesh groups")
    return Check("each group's size and members follow the mesh", not bad,
                 f"{len(traces)} ranks' groups and {n} collective records checked" + (f"; {'; '.join(bad[:3])}" if bad else ""))


def run_checks(cfg: Any, traces: dict[int, RankTrace]) -> list[Check]:
    w = World(cfg, traces)
    out = [check_optimizer_owners(w), check_checkpoint_writers(w), check_data_shards(cfg), check_traffic(cfg, traces)]
    ep = check_ep_tokens(cfg, traces)
    if ep is not None:
        out.append(ep)
    out.append(check_groups(cfg, traces))
    return out


# ----------------------------------------------------------------------------- the report
def _gib(x: float) -> str:
    """Bytes in the largest binary unit that keeps them >= 1."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def rank_lines(cfg: Any, tr: RankTrace) -> list[str]:
    """What one traced rank holds and sends, in a few lines."""
    c = tr.coords
    pos = f"pp {c['pp']}, dp {c['dp']}, ep {c['ep']}" + (f", tp {c['tp']}" if cfg.parallel.tp > 1 else "")
    prof = tr.profile
    lines = [f"rank {prof.rank} ({pos}), traced in {tr.seconds:.1f}s",
             f"  parameters      non-expert {_n(tr.params['non_expert'])}, expert {_n(tr.params['expert'])}"
             f" ({_gib(prof.memory_bytes['weights'])} of weights)"]
    shards = []
    for b in tr.optimizer:
        if b["fsdp"]:
            shards.append(f"fsdp {_n(sum(math.prod(l) for _, _, l in b['sharded']))} elements (FSDP2 shards)")
        else:
            shards.append(f"{b['name']} {_n(b['shard_numel'])} of {_n(b['numel'])} (over {len(b['shard_group'])})")
    lines.append(f"  optimizer shard {'; '.join(shards)}: {_gib(prof.memory_bytes['optimizer'])} of states")
    ck = tr.checkpoint
    lines.append(f"  checkpoint      writes {_gib(sum(ck['model'].values()))} of weights ({len(ck['model'])} tensors)"
                 f" and {_gib(sum(ck['optim'].values()))} of optimizer states ({len(ck['optim'])} tensors)")
    G = cfg.schedule.global_batch
    lines.append(f"  data shard      instances [{tr.data[0]}, {tr.data[1]}) of the global batch {G}: "
                 f"{prof.micro_batches} micro-batches of {cfg.schedule.micro_batch} x {cfg.data.context} tokens")
    by: dict[str, list[float]] = {}
    for col in prof.collectives:
        if col.phase != "step":
            continue
        rec = by.setdefault(col.label or "other", [0, 0.0])
        rec[0] += col.count
        rec[1] += wire_bytes(col)
    parts = ", ".join(f"{k} {int(v[0])} calls {_gib(v[1])}" for k, v in sorted(by.items(), key=lambda kv: -kv[1][1]))
    lines.append(f"  collectives     {sum(int(v[0]) for v in by.values())} per step: {parts}")
    ckb = prof.wire_bytes("checkpoint")
    lines.append(f"  sends per step  {_gib(prof.wire_bytes('step'))}"
                 + (f" (a checkpoint's planning adds {_gib(ckb)})" if ckb else ""))
    flops = sum(x.flops for x in prof.compute)
    kinds = ", ".join(f"{x.kind} {x.flops / flops:.0%}" for x in prof.compute if x.flops)
    lines.append(f"  compute         {flops / 1e12:.1f} TFLOP per step ({kinds})")
    return lines


def format_report(cfg: Any, traces: dict[int, RankTrace], checks: list[Check]) -> str:
    p = cfg.parallel
    head = (f"Trace: {cfg.preset} on world {p.pp * p.dp * p.ep * p.tp} = PP {p.pp} x DP {p.dp} x EP {p.ep}"
            + (f" x TP {p.tp}" if p.tp > 1 else "") + f"; optimizer {'FSDP2 + ' if p.dp_shard == 'fsdp' else ''}"
            f"{cfg.optim.name}, --ac {p.ac or 'none'}, EP exchange {cfg.model.ep_dispatch}, weights "
            f"{cfg.model.param_dtype}, gradients reduced in {cfg.optim.grad_reduce_dtype}; global batch "
            f"{cfg.schedule.global_batch} x {cfg.data.context}; {len(traces)} rank(s) traced on the fake process group")
    lines = [head, ""]
    for r in sorted(traces):
        lines += rank_lines(cfg, traces[r])
    lines += ["", "Checks (the traced ranks traced, the others by the same code's index arithmetic)"]
    lines += ["  " + c.line() for c in checks]
    return "\n".join(lines)

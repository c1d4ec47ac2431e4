"""Dry-run planner: layout, parameters and memory per rank of a PP x DP x EP run, with no model built.

    python -m trainer.parallelism.plan --preset mula-220b-a10b --world 12288 --pp 8 --ep 12

Everything is computed from the model shape alone, so the 220B preset plans in milliseconds.

Parameters follow transformers' OlmoeForCausalLM / OlmoForCausalLM exactly (untied LM head; OLMoE:
RMSNorm weights on the two layer norms, q_norm, k_norm and the final norm; OLMo: weightless
LayerNorms). Pipeline stages hold contiguous decoder layers (the first ``L mod PP`` stages one
more), the embedding on the first stage and the final norm + LM head on the last.

Memory per rank:
  weights      stage's non-expert parameters + its expert parameters / EP, in the weight dtype
  gradients    the same count, in the gradient dtype (bf16 or fp32)
  optimizer    12 bytes (fp32 master, Adam m and v) per element of the rank's shard; under EPSO
               non-expert states / (DP x EP), expert states / DP (of the rank's 1/EP of experts)
  activations  bytes saved for backward per micro-batch, from :func:`layer_activation_bytes`, a
               formula checked byte for byte against autograd's saved tensors on small models
               (tests/test_parallel_plan.py); a 1F1B stage s keeps min(PP - s, micro-batches)
               micro-batches in flight.

Legend: T tokens per micro-batch on one rank, H hidden, I intermediate, E experts, K top-k, V vocab,
L layers, R routed rows (T*K on average), a bytes per activation element.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..config.ac_spec import AC_CHOICES, parse_ac

GiB = 1024 ** 3
OPT_STATE_BYTES = 12  # fp32 master weight, exp_avg, exp_avg_sq
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The shape fields the planner needs (a trainer ModelConfig converts with :meth:`of`)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    top_k: int
    vocab_size: int

    @property
    def is_moe(self) -> bool:
        return self.arch == "olmoe"

    @classmethod
    def of(cls, m: Any, vocab_size: int | None = None) -> "ModelShape":
        """From any object with the same attribute names (e.g. ``trainer.config.ModelConfig``)."""
        return cls(arch=m.arch, num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                   head_dim=m.head_dim, intermediate_size=m.intermediate_size,
                   num_experts=m.num_experts if m.arch == "olmoe" else 0,
                   top_k=m.top_k if m.arch == "olmoe" else 0, vocab_size=vocab_size or m.vocab_size)


#: Vocabulary assumed for presets that take theirs from the data (the byte-level tokenizer's).
DEFAULT_VOCAB = 258


def preset_shape(name: str) -> tuple[ModelShape, int, int, int]:
    """(shape, micro batch, context, global batch) of trainer preset ``name``."""
    from ..config.presets import get_preset

    cfg = get_preset(name)
    return (ModelShape.of(cfg.model, cfg.model.vocab_size or DEFAULT_VOCAB), cfg.schedule.micro_batch,
            cfg.data.context, cfg.schedule.global_batch)


def plan_from_config(cfg: Any, world: int, ranks_per_node: int = 12) -> str:
    """The dry-run report of a trainer config (``python -m trainer --preset P --dry-run --world N``)."""
    m, p, s = cfg.model, cfg.parallel, cfg.schedule
    if p.tp > 1:
        raise ValueError("the dry run plans PP x DP x EP layouts; tensor parallelism is not modelled (use --tp 1)")
    gpu_bf16 = m.param_dtype == "bf16" or m.autocast in ("auto", "bf16")
    plan = make_plan(cfg.preset, world=world, pp=p.pp, ep=p.ep, dp=p.dp, ranks_per_node=ranks_per_node,
                     micro_batch=s.micro_batch, context=cfg.data.context, global_batch=s.global_batch, ac=p.ac,
                     weights=m.param_dtype, optimizer=cfg.optim.name,
                     shape=ModelShape.of(m, m.vocab_size or DEFAULT_VOCAB))
    o = cfg.optim
    master = "stochastic" if o.stochastic_rounding else "fp32" if o.master_weights else "none"
    plan.opt_bytes_per_param = (4 if master == "fp32" else 0) + (4 if o.moments_dtype == "fp32" else 2) * 2
    if gpu_bf16:
        plan.act_bytes = 2
    text = format_plan(plan)
    if cfg.checkpoint.async_save:
        return text + "\n\n" + async_staging_line(plan)
    return text


def async_staging_line(p: "Plan") -> str:
    """The host memory ``--checkpoint.async`` stages on a stage-0 rank while a write runs: its optimizer
    states and the share of the weights it writes (the non-expert ones split over EP, a model shard cut
    into ``max(1, DP // (PP*EP))`` chunks: trainer.checkpoint.writers)."""
    ne, ex = p.rank_params(p.stages[0])
    chunks = max(1, p.dp // (p.pp * p.ep))
    host = p.optimizer_bytes(p.stages[0]) + p.weight_bytes * (ne / p.ep + ex) / chunks
    return (f"Host memory per rank for --checkpoint.async (stage 0, while a write runs): about {_g(host).strip()} GiB"
            " (its optimizer states and its share of the weights, staged)")


# ----------------------------------------------------------------------------- parameters
class _Total:
    """``total``: the non-expert and expert parameters together."""

    non_expert: int
    expert: int

    @property
    def total(self) -> int:
        return self.non_expert + self.expert


@dataclass(frozen=True)
class LayerParams(_Total):
    """Parameters of one decoder layer."""

    attn: int
    norms: int
    router: int
    expert: int
    """All experts of the layer (or the dense MLP, counted here as non-expert by ``dense``)."""
    dense_mlp: int
    active_expert: int

    @property
    def non_expert(self) -> int:
        return self.attn + self.norms + self.router + self.dense_mlp

    @property
    def active(self) -> int:
        return self.non_expert + self.active_expert


def layer_params(s: ModelShape) -> LayerParams:
    H, I, Q = s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim
    attn = 3 * H * Q + Q * H
    if s.is_moe:
        one = 3 * I * H
        return LayerParams(attn=attn, norms=2 * H + 2 * Q, router=s.num_experts * H,
                           expert=s.num_experts * one, dense_mlp=0, active_expert=s.top_k * one)
    return LayerParams(attn=attn, norms=0, router=0, expert=0, dense_mlp=3 * I * H, active_expert=0)


def embedding_params(s: ModelShape) -> int:
    return s.vocab_size * s.hidden_size


def head_params(s: ModelShape) -> int:
    """Final norm (RMSNorm weight for OLMoE; OLMo's LayerNorm has none) + untied LM head."""
    return (s.hidden_size if s.is_moe else 0) + s.vocab_size * s.hidden_size


@dataclass(frozen=True)
class ParamTotals:
    total: int
    active: int
    expert: int
    non_expert: int


def param_totals(s: ModelShape) -> ParamTotals:
    lp = layer_params(s)
    extra = embedding_params(s) + head_params(s)
    L = s.num_layers
    return ParamTotals(total=L * lp.total + extra, active=L * lp.active + extra, expert=L * lp.expert,
                       non_expert=L * lp.non_expert + extra)


def split_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of ``pp`` stages; the first ``num_layers % pp`` stages get one more."""
    if pp < 1:
        raise ValueError(f"pipeline size must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages (each needs at least one layer)")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        n = base + (1 if stage < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class StageParams(_Total):
    stage: int
    layers: range
    non_expert: int
    expert: int
    active: int
    has_embedding: bool
    has_head: bool


def stage_params(s: ModelShape, pp: int) -> list[StageParams]:
    lp = layer_params(s)
    out = []
    for i, layers in enumerate(split_layers(s.num_layers, pp)):
        extra = (embedding_params(s) if i == 0 else 0) + (head_params(s) if i == pp - 1 else 0)
        n = len(layers)
        out.append(StageParams(stage=i, layers=layers, non_expert=n * lp.non_expert + extra, expert=n * lp.expert,
                               active=n * lp.active + extra, has_embedding=i == 0, has_head=i == pp - 1))
    return out


# ----------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActivationBytes:
    """Bytes saved for backward by one micro-batch, by part."""

    norms: int = 0
    """The two layer norms' internals (fp32 input copy, statistics, normalised value)."""
    norm_outputs: int = 0
    """The two norms' outputs, kept by the attention and MoE/MLP blocks (or their checkpoints)."""
    attn: int = 0
    """Inside attention: q/k norms, q, k, v after rotary, attention output and its logsumexp."""
    moe: int = 0
    """Inside the MoE block (router probabilities and indices, routing metadata, the gate/up
    pre-activation, gathered tokens under EP) or the dense MLP."""

    @property
    def total(self) -> int:
        return self.norms + self.norm_outputs + self.attn + self.moe

    def __add__(self, other: "ActivationBytes") -> "ActivationBytes":
        return ActivationBytes(self.norms + other.norms, self.norm_outputs + other.norm_outputs,
                               self.attn + other.attn, self.moe + other.moe)

    def scaled(self, n: int) -> "ActivationBytes":
        return ActivationBytes(self.norms * n, self.norm_outputs * n, self.attn * n, self.moe * n)


def _norm_internal(s: ModelShape, T: int, width: int, a: int) -> int:
    """Saved inside one norm over ``width`` features: OLMoE's RMSNorm keeps the fp32 input, the
    fp32 rsqrt and the normalised value (activation dtype) for the weight product; OLMo's weightless
    LayerNorm keeps the fp32 input, mean and rstd."""
    if s.is_moe:
        return 4 * T * width + 4 * T + a * T * width
    return 4 * T * width + 8 * T


def layer_activation_bytes(s: ModelShape, tokens: int, ac: Iterable[str] = (), *, act_bytes: int = 2,
                           ep: int = 1, routed_rows: int | None = None, forced_uniform: bool = False) -> ActivationBytes:
    """Bytes one decoder layer saves for backward for ``tokens`` tokens of this rank.

    ``ac``: checkpointed parts (``norm``, ``attn``, ``moe``); a checkpointed part keeps only its
    inputs (the residual stream for a norm; the norm's output, already counted, for attn and moe).
    ``routed_rows``: rows this rank's experts compute (default T*K, exact on average and under
    forced uniform routing, which keeps a second softmax)."""
    chosen = set(parse_ac(list(ac)))
    T, H, a = tokens, s.hidden_size, act_bytes
    Q = s.num_heads * s.head_dim
    norms = 2 * (a * T * H if "norm" in chosen else _norm_internal(s, T, H, a))
    norm_outputs = 2 * a * T * H
    attn = 0
    if "attn" not in chosen:
        qk_norms = 2 * _norm_internal(s, T, Q, a) if s.is_moe else 0
        attn = qk_norms + 4 * a * T * Q + 4 * T * s.num_heads  # q, k, v, out; fp32 logsumexp per head
    moe = 0
    if "moe" not in chosen:
        if s.is_moe:
            E, K, I = s.num_experts, s.top_k, s.intermediate_size
            T_all = ep * T  # tokens after the EP allgather
            R = T * K if routed_rows is None else routed_rows
            router = 4 * T * E + 8 * T * K  # fp32 probabilities (softmax), int64 top-k indices
            if forced_uniform:
                router += 4 * T * E  # the fixed pattern's own fp32 softmax (its indices replace top-k's)
            metadata = 3 * 4 * R + 4 * (E // ep + 1) + 4 * (T_all + 1)  # int32 index lists and prefix sums
            # Only the gate/up pre-activation: SiLU*up is recomputed from it and the router-weight
            # gradient is formed in the down GEMM's backward, so neither h [R, I] nor y [R, H] is kept.
            experts = a * R * 2 * I
            combine = a * T_all * K  # routing weights
            gathered = a * T_all * H if ep > 1 else 0  # allgathered tokens (the local norm output otherwise)
            moe = router + metadata + experts + combine + gathered
        else:
            moe = 4 * a * T * s.intermediate_size  # gate out, SiLU out, up out, their product
    return ActivationBytes(norms=norms, norm_outputs=norm_outputs, attn=attn, moe=moe)


def stage_activation_bytes(s: ModelShape, micro_batch: int, context: int, num_layers: int, ac: Iterable[str] = (),
                           *, first: bool = True, last: bool = True, act_bytes: int = 2, ep: int = 1,
                           loss_bytes: bool = True, forced_uniform: bool = False) -> int:
    """Bytes a pipeline stage (or the whole model: first=last=True) saves for one micro-batch.

    Besides its layers: the rotary cos/sin and, when attention is checkpointed, the position ids
    (both shared by the stage's layers), the token ids on the
    first stage, and on the last the final norm, its output (LM head input), the fp32
    log-probabilities [T, V] of the cross entropy, the shifted labels and the loss scalar."""
    chosen = set(parse_ac(list(ac)))
    T, H, a = micro_batch * context, s.hidden_size, act_bytes
    total = num_layers * layer_activation_bytes(s, T, chosen, act_bytes=a, ep=ep, forced_uniform=forced_uniform).total
    # rotary cos and sin [1, S, head_dim], in the activation dtype for OLMoE, fp32 for OLMo
    total += 2 * (a if s.is_moe else 4) * context * s.head_dim
    if "attn" in chosen:
        total += 8 * context  # int64 position ids, an input the attention checkpoints keep
    if first:
        total += 8 * T  # int64 token ids (embedding backward)
    if last:
        total += a * T * H if "norm" in chosen else _norm_internal(s, T, H, a)
        total += a * T * H  # final norm output, kept by the LM head
        if loss_bytes:
            total += 4 * T * s.vocab_size + 8 * T + 4  # log-softmax output, labels, loss
    return total


# ----------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """Everything the dry run prints."""

    preset: str
    shape: ModelShape
    world: int
    pp: int
    dp: int
    ep: int
    ranks_per_node: int
    micro_batch: int
    context: int
    global_batch: int
    ac: tuple[str, ...]
    weight_bytes: int
    act_bytes: int
    optimizer: str
    opt_bytes_per_param: int = OPT_STATE_BYTES
    """Optimizer-state bytes per parameter of a shard: 12 with an fp32 master, 8 without one (bf16 +
    stochastic rounding, fp32 moments), 4 with bf16 moments too."""
    totals: ParamTotals = field(init=False)
    stages: list[StageParams] = field(init=False)

    def __post_init__(self) -> None:
        self.totals = param_totals(self.shape)
        self.stages = stage_params(self.shape, self.pp)

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.data_ranks * self.micro_batch)

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations a 1F1B stage holds at its peak."""
        return min(self.pp - stage, self.micro_batches)

    def rank_params(self, st: StageParams) -> tuple[int, int]:
        """(non-expert, expert) parameters held by one rank of stage ``st``."""
        return st.non_expert, st.expert // self.ep

    def optimizer_bytes(self, st: StageParams, kind: str | None = None) -> int:
        kind = kind or self.optimizer
        ne, ex = self.rank_params(st)
        dense_shards = {"adamw": 1, "sharded": self.dp, "epso": self.dp * self.ep}[kind]
        expert_shards = 1 if kind == "adamw" else self.dp
        return self.opt_bytes_per_param * (math.ceil(ne / dense_shards) + math.ceil(ex / expert_shards))

    def state_bytes(self, st: StageParams, kind: str) -> tuple[int, int, int, int]:
        """(weights, gradients, optimizer states, transient) bytes one rank of stage ``st`` holds under
        ``kind``: an optimizer name (weights and gradients whole, states sharded as it shards them) or
        ``"fsdp"`` (FSDP2 on the non-expert weights over DP x EP: their weights, gradients and states
        sharded there, experts as EPSO; transient: the weights gathered at once, the stage's own
        (embedding, final norm and head, which the root module keeps gathered from its forward to its
        backward) and two layers' non-expert weights (the one running and the next, prefetched))."""
        ne, ex = self.rank_params(st)
        wb = self.weight_bytes
        if kind != "fsdp":
            return wb * (ne + ex), wb * (ne + ex), self.optimizer_bytes(st, kind), 0
        shards = self.dp * self.ep
        ne_local = math.ceil(ne / shards)
        optim = self.opt_bytes_per_param * (ne_local + math.ceil(ex / self.dp))
        layer = layer_params(self.shape).non_expert
        gathered = wb * (ne - len(st.layers) * layer + min(2, len(st.layers)) * layer)
        return wb * (ne_local + ex), wb * (ne_local + ex), optim, gathered

    def traffic_bytes(self, st: StageParams, kind: str, grad_bytes: int | None = None) -> int:
        """Bytes one rank of stage ``st`` sends per step for its weights and gradients under ``kind``
        (ring algorithms: an all-reduce of S bytes over W ranks sends 2 (W-1)/W S, an all-gather or a
        reduce-scatter (W-1)/W S of the whole buffer); the EP token exchange and the scalar all-reduces
        are not counted. ``grad_bytes``: bytes per reduced gradient element (default the weights').

        ZeRO-1 (``"sharded"``): non-expert gradients all-reduced over EP, then reduce-scattered and the
        weights all-gathered over DP; EPSO: both over DP x EP; experts over DP in all three. FSDP2
        (``"fsdp"``), every micro-batch: a layer's weights gathered for its forward and again for its
        backward, the stage's own (embedding, norm, head) once, every gradient reduce-scattered."""
        ne, ex = self.rank_params(st)
        wb, gb = self.weight_bytes, grad_bytes or self.weight_bytes
        dp, ep, s = self.dp, self.ep, self.dp * self.ep

        def frac(w: int) -> float:
            return (w - 1) / w

        experts = frac(dp) * (gb + wb) * ex
        if kind == "adamw":
            return round(2 * frac(s) * gb * ne + 2 * frac(dp) * gb * ex)
        if kind == "sharded":
            return round(2 * frac(ep) * gb * ne + frac(dp) * (gb + wb) * ne + experts)
        if kind == "epso":
            return round(frac(s) * (gb + wb) * ne + experts)
        if kind != "fsdp":
            raise ValueError(f"kind must be adamw, sharded, epso or fsdp, got {kind!r}")
        layers = len(st.layers) * layer_params(self.shape).non_expert
        per_micro = frac(s) * (wb * (2 * layers + (ne - layers)) + gb * ne)
        return round(self.micro_batches * per_micro + experts)

    def activation_bytes(self, st: StageParams, ac: Iterable[str] | None = None) -> int:
        return stage_activation_bytes(self.shape, self.micro_batch, self.context, len(st.layers),
                                      self.ac if ac is None else ac, first=st.has_embedding, last=st.has_head,
                                      act_bytes=self.act_bytes, ep=self.ep)


def make_plan(preset: str, *, world: int, pp: int = 1, ep: int = 1, dp: int = 0, ranks_per_node: int = 12,
              micro_batch: int | None = None, context: int | None = None, global_batch: int | None = None,
              ac: str | Sequence[str] = "", weights: str = "bf16", optimizer: str | None = None,
              shape: ModelShape | None = None) -> Plan:
    """Validate the layout and build a :class:`Plan` (raises ValueError naming the bad numbers)."""
    if shape is None:
        shape, mb0, ctx0, gb0 = preset_shape(preset)
    else:
        mb0, ctx0, gb0 = 2, 2048, 3072
    micro_batch = micro_batch or mb0
    context = context or ctx0
    global_batch = global_batch or gb0
    if world < 1 or pp < 1 or ep < 1 or dp < 0:
        raise ValueError(f"need world, pp, ep >= 1 and dp >= 0; got world={world} pp={pp} ep={ep} dp={dp}")
    if world % (pp * ep):
        raise ValueError(f"world {world} is not divisible by PP x EP = {pp} x {ep}")
    dp = dp or world // (pp * ep)
    if pp * dp * ep != world:
        raise ValueError(f"world {world} != PP x DP x EP = {pp} x {dp} x {ep}")
    if shape.is_moe and shape.num_experts % ep:
        raise ValueError(f"{shape.num_experts} experts are not divisible by EP={ep}")
    if not shape.is_moe and ep != 1:
        raise ValueError(f"a dense model has no experts; EP must be 1, got {ep}")
    if ep > ranks_per_node or ranks_per_node % ep:
        raise ValueError(f"EP={ep} does not fit within a node of {ranks_per_node} ranks (EP must divide it)")
    if global_batch % (dp * ep * micro_batch):
        raise ValueError(f"global batch {global_batch} is not divisible by DP x EP x micro batch = "
                         f"{dp} x {ep} x {micro_batch}")
    if weights not in DTYPE_BYTES:
        raise ValueError(f"weights must be one of {list(DTYPE_BYTES)}, got {weights!r}")
    optimizer = optimizer or ("epso" if shape.is_moe else "sharded")
    if optimizer not in ("adamw", "sharded", "epso"):
        raise ValueError(f"optimizer must be adamw, sharded or epso, got {optimizer!r}")
    return Plan(preset=preset, shape=shape, world=world, pp=pp, dp=dp, ep=ep, ranks_per_node=ranks_per_node,
                micro_batch=micro_batch, context=context, global_batch=global_batch, ac=parse_ac(ac),
                weight_bytes=DTYPE_BYTES[weights], act_bytes=DTYPE_BYTES[weights], optimizer=optimizer)


def _b(n: float) -> str:
    """Human-readable count (parameters)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _g(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _ac_name(choice: Iterable[str]) -> str:
    return "+".join(choice) or "none"


def format_plan(p: Plan) -> str:
    s, t = p.shape, p.totals
    nodes = p.world // p.ranks_per_node if p.world % p.ranks_per_node == 0 else p.world / p.ranks_per_node
    lines = [
        f"Dry run: {p.preset} ({s.arch}: L={s.num_layers} H={s.hidden_size} heads={s.num_heads}x{s.head_dim} "
        f"I={s.intermediate_size}" + (f" E={s.num_experts} K={s.top_k}" if s.is_moe else "") + f" V={s.vocab_size})",
        "",
        "Layout",
        f"  world {p.world} = PP {p.pp} x DP {p.dp} x EP {p.ep}  (rank = (pp * DP + dp) * EP + ep; EP innermost)",
        f"  {p.ranks_per_node} ranks per node -> {nodes} nodes; EP={p.ep} stays within a node"
        + (f" ({p.ranks_per_node // p.ep} EP group{'s' if p.ranks_per_node // p.ep > 1 else ''} per node)" if p.ep > 1 else ""),
        f"  a pipeline stage spans {p.dp * p.ep} ranks"
        + (f" = {p.dp * p.ep / p.ranks_per_node:g} nodes; stages talk across nodes" if p.pp > 1 else ""),
        f"  batch: global {p.global_batch} x context {p.context} = {p.global_batch * p.context / 1e6:.2f}M tokens; "
        f"{p.data_ranks} data ranks (DP x EP) x micro-batch {p.micro_batch} x {p.micro_batches} micro-batches",
    ]
    if p.pp > 1:
        bubble = (p.pp - 1) / (p.micro_batches + p.pp - 1)
        lines.append(f"  1F1B: {p.micro_batches} micro-batches over {p.pp} stages, bubble (PP-1)/(M+PP-1) = {bubble:.0%}"
                     + ("\n  [fewer micro-batches than stages: 1F1B refuses this; raise the global batch, lower the"
                        " micro-batch, or use --pp-schedule gpipe]" if p.micro_batches < p.pp else ""))
    lines += [
        "",
        "Parameters (whole model)",
        f"  total {_b(t.total)}  active {_b(t.active)}  expert {_b(t.expert)}  non-expert {_b(t.non_expert)}",
        "",
        "Parameters per rank, by pipeline stage (expert parameters / EP)",
        f"  {'stage':>5} {'layers':>9} {'extra':>12} {'non-expert':>11} {'expert':>10} {'rank total':>11} "
        f"{'active/token':>13}",
    ]
    for st in p.stages:
        ne, ex = p.rank_params(st)
        extra = "+".join(x for x, on in (("embed", st.has_embedding), ("norm+head", st.has_head)) if on) or "-"
        lines.append(f"  {st.stage:>5} {st.layers.start:>4}-{st.layers.stop - 1:<4} {extra:>12} {_b(ne):>11} "
                     f"{_b(ex):>10} {_b(ne + ex):>11} {_b(st.active):>13}")
    wb = p.weight_bytes
    dt = "bf16" if wb == 2 else "fp32"
    lines += [
        "",
        f"Memory per rank, GiB (weights and gradients {dt}; optimizer {p.optimizer}: {p.opt_bytes_per_param} B per param "
        + ("of non-expert / (DP x EP) and expert / DP" if p.optimizer == "epso" else
           "over DP" if p.optimizer == "sharded" else "unsharded") + f"; activations {'bf16' if p.act_bytes == 2 else 'fp32'}"
        f" at --ac {_ac_name(p.ac)}, times the 1F1B in-flight micro-batches)",
        f"  {'stage':>5} {'weights':>8} {'grads':>8} {'optim':>8} {'act/mb':>8} {'inflight':>8} {'act peak':>8} "
        f"{'total':>8}",
    ]
    for st in p.stages:
        ne, ex = p.rank_params(st)
        n = ne + ex
        w, opt = wb * n, p.optimizer_bytes(st)
        act = p.activation_bytes(st)
        k = p.in_flight(st.stage)
        lines.append(f"  {st.stage:>5} {_g(w)} {_g(w)} {_g(opt)} {_g(act)} {k:>8} {_g(act * k)} "
                     f"{_g(2 * w + opt + act * k)}")
    lines += ["", "  optimizer states per rank for comparison (stage 0 / last stage), GiB:"]
    for kind in ("adamw", "sharded", "epso"):
        if kind == "epso" and not s.is_moe:
            continue
        lines.append(f"    {kind:8s} {_g(p.optimizer_bytes(p.stages[0], kind))} / {_g(p.optimizer_bytes(p.stages[-1], kind))}")
    kinds = [k for k in ("sharded", "epso", "fsdp") if s.is_moe or k != "epso"]
    lines += ["", "  weights + gradients + optimizer states per rank, stage 0, GiB (--parallel.dp_shard fsdp: FSDP2 on"
                  " the non-expert weights over DP x EP, experts EP; + the weights gathered at once), and the"
                  " weight and gradient bytes it sends per step"]
    for kind in kinds:
        w, g, o, tr = p.state_bytes(p.stages[0], kind)
        name = {"sharded": "ZeRO-1", "epso": "EPSO", "fsdp": "FSDP2"}[kind]
        lines.append(f"    {name:8s} {_g(w)} + {_g(g)} + {_g(o)} = {_g(w + g + o)}"
                     + (f"  (+{_g(tr).strip()} gathered)" if tr else "")
                     + f"; sends {_g(p.traffic_bytes(p.stages[0], kind)).strip()} per step")
    lines += ["", "Bytes per parameter (weights + gradients + optimizer state; bf16 weights and gradients)",
              f"  {'fp32 master (mixed precision)':<38} 2 + 2 + 12 = 16",
              f"  {'bf16 + stochastic rounding, fp32 m, v':<38} 2 + 2 +  8 = 12",
              f"  {'bf16 + stochastic rounding, bf16 m, v':<38} 2 + 2 +  4 =  8",
              f"  this run: {wb} + {wb} + {p.opt_bytes_per_param} = {2 * wb + p.opt_bytes_per_param}"
              " (--optim.stochastic_rounding, --optim.master_weights, --optim.moments_dtype)"]
    lines += ["", "Activations per micro-batch by --ac choice, GiB (stage 0 / last stage; x in-flight = 1F1B peak)",
              f"  {'--ac':<16} {'stage 0':>8} {'peak 0':>8} {'last':>8} {'peak last':>9} {'vs none':>8}"]
    first, last = p.stages[0], p.stages[-1]
    base = p.activation_bytes(first, ())
    for r in range(len(AC_CHOICES) + 1):
        for combo in itertools.combinations(AC_CHOICES, r):
            a0, al = p.activation_bytes(first, combo), p.activation_bytes(last, combo)
            lines.append(f"  {_ac_name(combo):<16} {_g(a0)} {_g(a0 * p.in_flight(0))} {_g(al)} "
                         f"{_g(al * p.in_flight(last.stage)):>9} {a0 / base:8.2f}")
    lines.append("  (formula checked byte for byte against autograd on small models with fp32 and bf16 weights;"
                 " T = micro-batch x context per rank,\n   routed rows T*K on average; with fp32 weights under bf16"
                 " autocast the residual stream stays fp32 and autocast caches bf16 weight copies)")
    return "\n".join(lines)


def build_parser(prog: str = "python -m trainer.parallelism.plan") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Plan a PP x DP x EP run: layout, parameters and memory per rank.")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--world", type=int, required=True, help="total ranks (GPUs / tiles)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=0, help="0: the preset's EP (1 when it has none)")
    ap.add_argument("--dp", type=int, default=0, help="0: world / (PP x EP)")
    ap.add_argument("--ranks-per-node", type=int, default=12, help="12 on Aurora (6 GPUs x 2 tiles)")
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--global-batch", type=int, default=0)
    ap.add_argument("--ac", default="", help="checkpointed parts for the memory total: any of norm,attn,moe")
    ap.add_argument("--weights", default="bf16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--optimizer", default=None, choices=["adamw", "sharded", "epso"])
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args.preset, world=args.world, pp=args.pp, ep=args.ep or 1, dp=args.dp,
                         ranks_per_node=args.ranks_per_node, micro_batch=args.micro_batch or None,
                         context=args.context or None, global_batch=args.global_batch or None, ac=args.ac,
                         weights=args.weights, optimizer=args.optimizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())

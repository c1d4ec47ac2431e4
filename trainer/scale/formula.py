"""A rank's step from the planner's formulas (:class:`trainer.parallelism.plan.Plan`): the same records a
trace of the trainer's code gives (:mod:`trainer.scale.profile`), in microseconds of arithmetic, so the
layout search can price thousands of layouts.

What each record holds, per optimizer step of one rank of pipeline stage ``s`` (``M`` micro-batches of
``T`` = micro-batch x context tokens; ``a`` activation bytes, ``R = T K`` routed rows):

compute      attention projections (GEMM, ``8 T H Q`` FLOPs forward), attention itself (causal, ``2 b S^2 Q``
             forward, backward 2.5x: the flash backward recomputes the scores), router (``2 T H E``), experts
             (grouped GEMM, ``6 R H I``), LM head on the last stage (``2 T H V``); backward twice the forward
             (attention 2.5x); a checkpointed part (``--ac``) runs its forward once more (label
             ``recompute``). Memory-bound work by bytes: the two norms and residual adds, rotary and q/k
             norms, the router's softmax, the expert engine's gather/combine and SiLU passes (the bytes
             docs/bench_results/gpu-2026-11-27-h200/launches.md lists for the Triton engine), the loss's
             log-softmax, and the optimizer's pass over its shard (label ``optimizer``). Launch counts are
             estimates (:data:`LAUNCHES`).
collectives  the EP token exchange per layer and micro-batch (the default allgather dispatch: tokens,
             routing weights and indices gathered, partial outputs reduce-scattered; backward the
             transposes; a checkpointed MoE block gathers again, its recomputation stopping before
             the return), the pipeline's activation and gradient
             sends, the weights' and gradients' collectives of ZeRO-1 / EPSO / AdamW / FSDP2 exactly as
             :meth:`Plan.traffic_bytes` counts them, and two scalar all-reduces over the world (loss and
             gradient norm).
memory       :meth:`Plan.state_bytes` and :meth:`Plan.activation_bytes` times the 1F1B in-flight count.

Labels name the step-time model's terms (:data:`trainer.scale.profile.COLLECTIVE_TERMS`).
"""
from __future__ import annotations

import functools

from ..parallelism.plan import Plan, layer_params
from .profile import Collective, Compute, StepProfile

#: Estimated launches (kernels, or torch ops on the CPU) of one layer's forward, by part; the backward
#: counts twice as many.
LAUNCHES = {"attn": 14, "moe": 12, "norm": 6, "dense_mlp": 6}
#: Bytes the optimizer's step reads and writes per element of its shard besides the gradient and the
#: weight (fp32 master, Adam m and v: each read and written).
OPT_PASS_BYTES = 24


def mesh_coords(plan: Plan, rank: int) -> tuple[int, int, int]:
    """(stage, dp, ep) of ``rank``: rank = (pp * DP + dp) * EP + ep (trainer/layout.py, TP = 1)."""
    if not 0 <= rank < plan.world:
        raise ValueError(f"rank {rank} is outside the world (0..{plan.world - 1})")
    ep = rank % plan.ep
    dp = (rank // plan.ep) % plan.dp
    return rank // (plan.ep * plan.dp), dp, ep


def groups(plan: Plan, rank: int) -> dict[str, tuple[int, ...]]:
    """The global ranks of ``rank``'s EP, DP, stage (DP x EP) groups and the world."""
    s, d, e = mesh_coords(plan, rank)
    DP, EP = plan.dp, plan.ep
    return {"ep": tuple((s * DP + d) * EP + j for j in range(EP)),
            "dp": tuple((s * DP + j) * EP + e for j in range(DP)),
            "stage": tuple((s * DP + j) * EP + k for j in range(DP) for k in range(EP)),
            "world": _world(plan.world)}


@functools.lru_cache(maxsize=64)
def _world(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def moe_expert_compute(H: int, I: int, K: int, tokens: int, act_bytes: int, *, recompute: bool = False,
                       tokens_gathered: int | None = None) -> list[Compute]:
    """One MoE layer's expert work for ``tokens`` tokens (forward and backward; with ``recompute`` the
    forward again): the grouped GEMMs and the engine's memory-bound passes (gather/combine forward, its
    transposes and the SiLU-and-multiply backward)."""
    R, a = tokens * K, act_bytes
    T_all = tokens_gathered or tokens
    fwd = 6.0 * R * H * I
    combine = a * (R * H + T_all * H)
    out = [Compute("grouped_gemm", 3 * fwd, 0.0, count=5, dtype=_dt(a), label="experts"),
           Compute("memory", 0.0, 3 * combine + 5 * a * R * I, count=7, dtype=_dt(a), label="experts")]
    if recompute:
        out += [Compute("grouped_gemm", fwd, 0.0, count=2, dtype=_dt(a), label="experts recompute"),
                Compute("memory", 0.0, combine, count=1, dtype=_dt(a), label="experts recompute")]
    return out


def _dt(a: int) -> str:
    return "bf16" if a == 2 else "fp32"


def formula_profile(plan: Plan, rank: int, *, fsdp: bool = False, grad_bytes: int | None = None,
                    ep_dispatch: str = "allgather") -> StepProfile:
    """The step of ``rank`` under ``plan`` (``fsdp``: FSDP2 on the non-expert weights, experts EPSO)."""
    s_idx, _, _ = mesh_coords(plan, rank)
    st = plan.stages[s_idx]
    sh, M, a = plan.shape, plan.micro_batches, plan.act_bytes
    wb, gb = plan.weight_bytes, grad_bytes or plan.weight_bytes
    dt, gdt = _dt(a), _dt(gb)
    H, Q, V, n = sh.hidden_size, sh.num_heads * sh.head_dim, sh.vocab_size, len(st.layers)
    b, S = plan.micro_batch, plan.context
    T = b * S
    ac = set(plan.ac)
    g = groups(plan, rank)
    comp: list[Compute] = []

    def add(kind: str, fwd_flops: float, fwd_bytes: float, launches: int, label: str, part: str | None,
            bwd: float = 2.0) -> None:
        """``M`` micro-batches x ``n_layers`` of a part: forward, backward (``bwd`` x), a recomputed forward."""
        comp.append(Compute(kind, M * fwd_flops * (1 + bwd), M * fwd_bytes * (1 + bwd),
                            count=M * launches * 3, dtype=dt, label=label))
        if part is not None and part in ac:
            comp.append(Compute(kind, M * fwd_flops, M * fwd_bytes, count=M * launches, dtype=dt,
                                label=f"{label} recompute"))

    # attention: projections, the causal product, rotary and q/k norms
    add("gemm", n * 8.0 * T * H * Q, n * a * 4 * T * (H + Q), n * 4, "attention projections", "attn")
    add("attention", n * 2.0 * b * S * S * Q, n * a * 4 * T * Q, n * 2, "attention", "attn", bwd=2.5)
    add("memory", 0.0, n * a * (4 + (4 if sh.is_moe else 0)) * T * Q, n * (LAUNCHES["attn"] - 6), "rotary", "attn")
    # norms and residual adds (the fp32 statistics of the two layer norms with them)
    add("memory", 0.0, n * (2 * (a + 4) * T * H + 2 * 3 * a * T * H), n * LAUNCHES["norm"], "norms", "norm")
    if sh.is_moe:
        E, K, I = sh.num_experts, sh.top_k, sh.intermediate_size
        add("gemm", n * 2.0 * T * H * E, n * (a * T * H + 4 * T * E), n, "router", "moe")
        add("memory", 0.0, n * 3 * 4 * T * E, n * 3, "router softmax", "moe")
        for c in moe_expert_compute(H, I, K, T, a, recompute="moe" in ac, tokens_gathered=plan.ep * T):
            comp.append(Compute(c.kind, M * n * c.flops, M * n * c.bytes, count=M * n * c.count, dtype=dt,
                                label=c.label))
    else:
        I = sh.intermediate_size
        add("gemm", n * 6.0 * T * H * I, n * a * (T * H + 3 * T * I), n * 3, "mlp", "moe")
        add("memory", 0.0, n * a * 3 * T * I, n * LAUNCHES["dense_mlp"], "mlp activation", "moe", bwd=5 / 3)
    if st.has_embedding:
        add("memory", 0.0, a * 2 * T * H, 1, "embedding", None, bwd=1.0)
    if st.has_head:
        add("gemm", 2.0 * T * H * V, a * (T * H + T * V), 1, "lm head", None)
        add("memory", 0.0, 3 * 4 * T * V, 3, "loss", None, bwd=2 / 3)

    # weights and gradients: one optimizer step
    kind = "fsdp" if fsdp else plan.optimizer
    w, grads, opt, gathered = plan.state_bytes(st, kind)
    shard_elems = opt / plan.opt_bytes_per_param
    comp.append(Compute("memory", 0.0, shard_elems * (OPT_PASS_BYTES + gb + wb), count=8, dtype="fp32",
                        label="optimizer"))

    coll: list[Collective] = []
    ne, ex = plan.rank_params(st)
    if plan.ep > 1 and sh.is_moe:
        coll += ep_exchange(g["ep"], T, H, sh.top_k, sh.num_experts, n * M, dt, recompute="moe" in ac,
                            dispatch=ep_dispatch)
    if plan.pp > 1:
        per = b * S * H
        stride = plan.dp * plan.ep
        if not st.has_head:
            nxt = (rank, rank + stride)
            coll += [Collective("send", nxt, dt, per, count=M, label="pipeline activations"),
                     Collective("recv", nxt, dt, per, count=M, label="pipeline activations")]
        if not st.has_embedding:
            prv = (rank, rank - stride)
            coll += [Collective("recv", prv, dt, per, count=M, label="pipeline activations"),
                     Collective("send", prv, dt, per, count=M, label="pipeline activations")]
    coll += weight_collectives(plan, st, kind, g, ne, ex, dt, gdt)
    coll.append(Collective("all_reduce", g["world"], "fp32", 1, count=2, label="loss"))

    in_flight = plan.in_flight(st.stage)
    memory = {"weights": w, "gradients": grads, "optimizer": opt,
              "activations": plan.activation_bytes(st) * in_flight, "transient": gathered}
    return StepProfile(rank=rank, world=plan.world, source="formula", tokens_per_step=plan.global_batch * S,
                       micro_batches=M, pp=plan.pp, stage=st.stage, collectives=coll, compute=comp,
                       memory_bytes=memory)


def ep_exchange(ep_group: tuple[int, ...], T: int, H: int, K: int, E: int, calls: int, dt: str, *,
                recompute: bool = False, dispatch: str = "allgather") -> list[Collective]:
    """The EP token exchange of ``calls`` MoE layer passes (layers x micro-batches) of ``T`` tokens."""
    W = len(ep_group)
    # a checkpointed block's recomputation stops once it has what the backward needs (torch's
    # non-reentrant checkpoint): the exchange out is repeated, the partial outputs' return is not
    fwd_calls = calls * (2 if recompute else 1)
    if dispatch == "allgather":
        Tg = W * T  # gathered tokens
        return [Collective("all_gather", ep_group, dt, Tg * H, count=fwd_calls, label="ep tokens"),
                Collective("all_gather", ep_group, dt, Tg * K, count=fwd_calls, label="ep tokens"),
                Collective("all_gather", ep_group, "int32", Tg * K, count=fwd_calls, label="ep tokens"),
                Collective("reduce_scatter", ep_group, dt, Tg * H, count=calls, label="ep tokens"),
                Collective("reduce_scatter", ep_group, dt, Tg * H, count=calls, label="ep tokens"),
                Collective("reduce_scatter", ep_group, dt, Tg * K, count=calls, label="ep tokens"),
                Collective("all_gather", ep_group, dt, Tg * H, count=calls, label="ep tokens")]
    remote = _remote_rows(T, E, K, W)
    rows = round(remote * W / (W - 1))  # the input's rows, all destinations, so that (W-1)/W of it leaves
    return [Collective("all_to_all", ep_group, "int64", W, count=fwd_calls, label="ep tokens"),
            Collective("all_to_all", ep_group, dt, rows * (H + K), count=fwd_calls, label="ep tokens"),
            Collective("all_to_all", ep_group, "int32", rows * K, count=fwd_calls, label="ep tokens"),
            Collective("all_to_all", ep_group, dt, rows * H, count=calls, label="ep tokens"),
            Collective("all_to_all", ep_group, dt, rows * H, count=2 * calls, label="ep tokens")]


@functools.lru_cache(maxsize=None)
def _remote_rows(T: int, E: int, K: int, W: int) -> float:
    from fastmoe_xpu.dist.comm_bytes import expected_remote_rows

    return expected_remote_rows(T, E, K, W)


def weight_collectives(plan: Plan, st, kind: str, g: dict, ne: int, ex: int, dt: str, gdt: str) -> list[Collective]:
    """The weights' and gradients' collectives of one step, as :meth:`Plan.traffic_bytes` counts them."""
    wdt = _dt(plan.weight_bytes)
    out: list[Collective] = []
    M = plan.micro_batches
    if kind == "adamw":
        return [Collective("all_reduce", g["stage"], gdt, ne, label="optimizer"),
                Collective("all_reduce", g["dp"], gdt, ex, label="optimizer")]
    if kind == "sharded" and plan.ep > 1:
        out.append(Collective("all_reduce", g["ep"], gdt, ne, label="optimizer"))
    if kind in ("sharded", "epso"):
        grp = g["dp"] if kind == "sharded" else g["stage"]
        out += [Collective("reduce_scatter", grp, gdt, ne, label="optimizer"),
                Collective("all_gather", grp, wdt, ne, label="optimizer")]
    elif kind == "fsdp":
        layer = layer_params(plan.shape).non_expert
        n = len(st.layers)
        own = ne - n * layer
        out += [Collective("all_gather", g["stage"], wdt, layer, count=2 * M * n, label="fsdp weights and gradients"),
                Collective("reduce_scatter", g["stage"], gdt, layer, count=M * n, label="fsdp weights and gradients")]
        if own:
            out += [Collective("all_gather", g["stage"], wdt, own, count=M, label="fsdp weights and gradients"),
                    Collective("reduce_scatter", g["stage"], gdt, own, count=M, label="fsdp weights and gradients")]
    else:
        raise ValueError(f"kind must be adamw, sharded, epso or fsdp, got {kind!r}")
    if ex:
        out += [Collective("reduce_scatter", g["dp"], gdt, ex, label="optimizer"),
                Collective("all_gather", g["dp"], wdt, ex, label="optimizer")]
    return out


def stage_profiles(plan: Plan, *, fsdp: bool = False, grad_bytes: int | None = None,
                   ep_dispatch: str = "allgather") -> dict[int, StepProfile]:
    """One formula profile per pipeline stage (its first rank: the ranks of a stage do the same work)."""
    per_stage = plan.dp * plan.ep
    return {s * per_stage: formula_profile(plan, s * per_stage, fsdp=fsdp, grad_bytes=grad_bytes,
                                           ep_dispatch=ep_dispatch) for s in range(plan.pp)}

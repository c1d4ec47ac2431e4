"""``--mode stages``: where fastmoe's time goes, launcher by launcher, next to the GEMM-only bound.

The launchers are called in the order the autograd Functions call them (block.moe_experts_forward,
ExpertMLPFunction, CombineFunction), on the case's inputs, in interleaved rounds with the bound's
four GEMM groups. The GEMM stages' excess over their bound part is the cost of their gather,
activation and allocation; the other stages have no GEMM and are pure overhead.

Legend: T tokens, H hidden, K experts per token, NR local experts, R routed rows.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fastmoe_xpu.kernels.contract import TOKEN_BLOCK_SIZE
from fastmoe_xpu.kernels import kernels
from fastmoe_xpu.routing import topk_routing

from .bounds import GemmBound
from .cases import Case
from .measure import stats, time_fn
from .providers import ProviderSkipped, build_provider
from .runner import _progress

#: Launcher stage -> the bound's GEMM group it contains (None: no GEMM in it).
BOUND_PART = {
    "gate_up_fwd": "gate_up_fwd", "down_fwd": "down_fwd", "down_bwd": "down_bwd", "gate_up_bwd": "gate_up_bwd",
}


def _pipeline(case: Case, ops) -> dict[str, Callable[[], object]]:
    """One callable per launcher; each reads the previous stages' results from ``st``."""
    NR = case.preset.local_experts
    x, w, idx, dout = case.x_TH, case.weights_TK, case.topk_idx_TK, case.dout_TH
    w_gu, w_d = case.w_gate_up_N2IH.detach(), case.w_down_NHI.detach()
    st: dict = {}

    def router():
        st["logits"] = F.linear(x, case.gate_EH)
        topk_routing(st["logits"], case.preset.top_k, False)

    def count():
        st["count"] = ops.count_tokens(idx, 0, NR, TOKEN_BLOCK_SIZE)

    def indices():
        counts = st["count"]
        st["cexp"], st["ctok"] = counts.cum_expert_counts, counts.cum_token_counts
        rows = ops.build_indices(idx, counts.partial_cum_token_counts, counts.cum_expert_counts, 0, NR, TOKEN_BLOCK_SIZE)
        st["ii"], st["oi"], st["sel"] = rows.input_indices, rows.output_indices, rows.selected_expert_indices

    def gate_up_fwd():
        st["gu"], st["h"] = ops.gate_up_fwd(x, st["ii"], st["ctok"], w_gu)

    def down_fwd():
        st["y"] = ops.down_fwd(st["h"], st["ctok"], w_d)

    def combine_fwd():
        st["out"] = ops.combine_fwd(st["y"], w, st["oi"], st["sel"], st["cexp"])

    def combine_bwd():
        # as the layer trains: unweighted row gradients and row weights; y is not read
        st["dy"], st["rw"] = ops.combine_bwd(dout, w, st["oi"], st["sel"], st["cexp"])

    def down_bwd():
        # the weighted down backward: h recomputed from gate/up, router-weight gradient per row
        st["dh"], st["dwd"], st["drw"] = ops.down_weighted_bwd(st["dy"], st["gu"], st["rw"], st["ctok"], w_d)

    def router_weights_bwd():
        st["dw"] = ops.router_weights_bwd(st["drw"], w, st["oi"], st["sel"], st["cexp"])

    def silu_mul_bwd():
        # with the counts, as ExpertMLPFunction calls it: the Triton kernel then computes only the RT routed rows
        st["dgu"] = ops.silu_mul_bwd(st["gu"], st["dh"], st["ctok"])

    def gate_up_bwd():
        st["dxr"], st["dwgu"] = ops.gate_up_bwd(st["dgu"], x, st["ii"], st["ctok"], w_gu)

    def combine_dx():
        st["dx"] = ops.combine_fwd(st["dxr"], None, st["oi"], st["oi"], st["cexp"])

    def release():
        st.clear()

    return {
        "router (stage 1, not in providers)": router, "count_tokens": count, "build_indices": indices,
        "gate_up_fwd": gate_up_fwd, "down_fwd": down_fwd, "combine_fwd": combine_fwd,
        "combine_bwd": combine_bwd, "down_bwd": down_bwd, "router_weights_bwd": router_weights_bwd,
        "silu_mul_bwd": silu_mul_bwd,
        "gate_up_bwd": gate_up_bwd, "combine_dx": combine_dx, "_release": release,
    }


def run_stages(case: Case, backends: list[str], *, rounds: int = 5, progress: bool = True,
               log: Callable[[str], None] = lambda s: None) -> dict:
    bound = GemmBound(case)
    parts = {"gate_up_fwd": bound.gate_up_fwd, "down_fwd": bound.down_fwd,
             "down_bwd": bound.down_bwd, "gate_up_bwd": bound.gate_up_bwd}
    out: dict = {"case": case.describe(), "bound": {}, "backends": {}}
    pipes: dict[str, dict] = {}
    for b in backends:
        try:
            build_provider(f"fastmoe/{b}", case)  # same availability rules as the providers
        except ProviderSkipped as exc:
            out["backends"][b] = {"status": "skipped", "reason": str(exc)}
            log(f"  fastmoe/{b}: skipped: {exc}")
            continue
        pipes[b] = _pipeline(case, kernels(b))
    samples = {b: {k: [] for k in p if k != "_release"} for b, p in pipes.items()}
    bsamples = {k: [] for k in parts}
    dev = case.device
    bar = _progress((rounds + 1) * (len(pipes) + 1), f"{case.preset.name} stages", progress)
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 is the cold one, not recorded
            for b, pipe in pipes.items():
                for k, fn in pipe.items():
                    if k == "_release":
                        fn()
                        continue
                    t = time_fn(fn, dev)
                    if r:
                        samples[b][k].append(t)
                if bar is not None:
                    bar.update(1)
            for k, fn in parts.items():
                t = time_fn(fn, dev)
                if r:
                    bsamples[k].append(t)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    out["bound"] = {k: stats(v) for k, v in bsamples.items()}
    for b in pipes:
        out["backends"][b] = {"status": "ok", "stages": {k: stats(v) for k, v in samples[b].items()}}
    return out


def format_stages(res: dict) -> str:
    from .report import case_title

    lines = [f"{case_title(res)} -- per stage (min over rounds, ms)"]
    for b, r in res["backends"].items():
        if r["status"] != "ok":
            lines.append(f"  fastmoe/{b}: skipped: {r['reason']}")
            continue
        st = r["stages"]
        total = sum(v["min_s"] for k, v in st.items() if not k.startswith("router"))
        btotal = sum(v["min_s"] for v in res["bound"].values())
        lines.append(f"  fastmoe/{b}: stages 2-5 total {1e3 * total:.1f} ms; GEMM-only bound {1e3 * btotal:.1f} ms "
                     f"({total / btotal:.2f}x)")
        lines.append(f"  {'stage':<36} {'min ms':>9} {'median ms':>10} {'share':>6} {'bound ms':>9} {'excess ms':>10}")
        for k, v in st.items():
            bp = BOUND_PART.get(k)
            bt = res["bound"][bp]["min_s"] if bp else 0.0
            share = "" if k.startswith("router") else f"{100 * v['min_s'] / total:5.1f}%"
            lines.append(f"  {k:<36} {1e3 * v['min_s']:>9.1f} {1e3 * v['median_s']:>10.1f} {share:>6} "
                         f"{1e3 * bt if bp else 0:>9.1f} {1e3 * (v['min_s'] - bt):>10.1f}")
    return "\n".join(lines)

"""``--mode stages``: where fastmoe's time goes, launcher by launcher, next to the GEMM-only bound.

The launchers run inside the experts op's own forward and backward bodies
(:mod:`fastmoe_xpu.autograd.ops`), each timed as it is called, on the case's inputs, in interleaved
rounds with the bound's four GEMM groups. The GEMM stages' excess over their bound part is the cost of their gather,
activation and allocation; the other stages have no GEMM and are pure overhead.

Legend: T tokens, H hidden, K experts per token, NR local experts, R routed rows.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fastmoe_xpu.autograd.ops import mlp_combine_backward_math, mlp_combine_forward, route_rows
from fastmoe_xpu.kernels import kernels
from fastmoe_xpu.routing import topk_routing

from ..harness.bounds import GemmBound
from ..harness.cases import Case
from ..harness.measure import stats, time_fn
from ..harness.providers import ProviderSkipped, build_provider
from ..harness.runner import _progress

#: Launcher stage -> the bound's GEMM group it contains (None: no GEMM in it).
BOUND_PART = {
    "gate_up_fwd": "gate_up_fwd", "down_fwd": "down_fwd", "down_weighted_bwd": "down_bwd",
    "gate_up_bwd": "gate_up_bwd",
}


class _TimedLaunchers:
    """A kernel set whose launchers record their own synchronised wall time, by call order: the op's
    bodies run unchanged on it, so the stages are timed exactly as the layer calls them."""

    #: Second calls of a launcher within one F+B, named by what they do.
    SECOND_CALL = {"combine_fwd": "combine_dx"}

    def __init__(self, launchers, device: torch.device) -> None:
        self._launchers, self._device, self.times = launchers, device, {}

    def __getattr__(self, name: str):
        fn = getattr(self._launchers, name)

        def timed(*args, **kwargs):
            out: list = []
            t = time_fn(lambda: out.append(fn(*args, **kwargs)), self._device)
            key = self.SECOND_CALL.get(name, name) if name in self.times else name
            self.times[key] = t
            return out[0]

        return timed


def _pipeline(case: Case, launchers) -> Callable[[], dict[str, float]]:
    """One forward and backward of stages 2-5 through the experts op's bodies (``route_rows``,
    ``mlp_combine_forward``, ``mlp_combine_backward_math``) on timed launchers; returns the seconds
    per launcher, the router (stage 1, not part of the providers) timed beside."""
    NR = case.preset.local_experts
    x, w, idx, dout = case.x_TH, case.weights_TK, case.topk_idx_TK, case.dout_TH
    w_gu, w_d = case.w_gate_up_N2IH.detach(), case.w_down_NHI.detach()

    def run() -> dict[str, float]:
        timed = _TimedLaunchers(launchers, case.device)
        router = time_fn(lambda: topk_routing(F.linear(x, case.gate_EH), case.preset.top_k, False), case.device)
        rows = route_rows(timed, idx, 0, NR, True)
        out, gate_up = mlp_combine_forward(timed, x, w_gu, w_d, w, *rows)
        mlp_combine_backward_math(timed, dout, x, w_gu, w_d, w, gate_up, *rows)
        return {"router (stage 1, not in providers)": router, **timed.times}

    return run


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
        # a quantized provider, fastmoe/<backend>:<precision>, runs kernel set <backend>+<precision>
        pipes[b] = _pipeline(case, kernels(b.replace(":", "+")))
    samples: dict[str, dict[str, list[float]]] = {b: {} for b in pipes}
    bsamples = {k: [] for k in parts}
    dev = case.device
    bar = _progress((rounds + 1) * (len(pipes) + 1), f"{case.preset.name} stages", progress)
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 is the cold one, not recorded
            for b, pipe in pipes.items():
                for k, t in pipe().items():
                    if r:
                        samples[b].setdefault(k, []).append(t)
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
    from ..harness.report import case_title

    lines = [f"{case_title(res)} -- per stage (min over rounds, ms)"]
    for b, r in res["backends"].items():
        if r["status"] != "ok":
            lines.append(f"  fastmoe/{b}: skipped: {r['reason']}")
            continue
        st = r["stages"]
        total = sum(v["min_s"] for k, v in st.items() if not k.startswith("router ("))
        btotal = sum(v["min_s"] for v in res["bound"].values())
        lines.append(f"  fastmoe/{b}: stages 2-5 total {1e3 * total:.1f} ms; GEMM-only bound {1e3 * btotal:.1f} ms "
                     f"({total / btotal:.2f}x)")
        lines.append(f"  {'stage':<36} {'min ms':>9} {'median ms':>10} {'share':>6} {'bound ms':>9} {'excess ms':>10}")
        for k, v in st.items():
            bp = BOUND_PART.get(k)
            bt = res["bound"][bp]["min_s"] if bp else 0.0
            share = "" if k.startswith("router (") else f"{100 * v['min_s'] / total:5.1f}%"
            lines.append(f"  {k:<36} {1e3 * v['min_s']:>9.1f} {1e3 * v['median_s']:>10.1f} {share:>6} "
                         f"{1e3 * bt if bp else 0:>9.1f} {1e3 * (v['min_s'] - bt):>10.1f}")
    return "\n".join(lines)

"""``python -m bench engine_choice``: the ``auto`` engine choice under a wrong cache and under load.

Three scenarios on one MoE layer (``FastSparseMoeBlock``, fp32, forward+backward), in one process:

1. **A wrong stored choice.** Each engine is timed apart (interleaved rounds, minimum); then the
   cache is written as a loaded first timing could have left it: the *slowest* engine chosen, stored
   with the *fastest* one's time. A fresh process state runs ``--calls`` forward+backward calls with
   ``gemm_engine="auto"``; the table shows each call's time and engine. The layer is then timed
   against the fastest engine named directly (interleaved rounds, minimum): the ratio is what a
   user keeps. The same is run with the in-use check switched off (what the package did before it
   had one): that layer stays on the slowest engine.
2. **A timing on busy cores** (``--busy N``, default one busy process per core this process may use,
   plus one): a fresh cache, the first call times the engines while they run; whether the choice
   was stored is printed (it must not be).

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from fastmoe_xpu import FastSparseMoeBlock, settings
from fastmoe_xpu.kernels import registry, timing
from ..harness.usage import Parser, count, fail, output_file
from ..harness.report import load_text, plural


def _block(H: int, I: int, E: int, K: int, engine: str, seed: int = 0) -> FastSparseMoeBlock:
    torch.manual_seed(seed)
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                          norm_topk_prob=True, hidden_act="silu")
    return FastSparseMoeBlock(cfg, backend="torch", gemm_engine=engine)


def _fb(block: FastSparseMoeBlock, x: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        block.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        block(x).sum().backward()
        return time.perf_counter() - t0
    return run


def _interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    best = dict.fromkeys(runs, float("inf"))
    for name, run in runs.items():
        run()  # warm-up
    for r in range(rounds):
        names = list(runs)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            best[name] = min(best[name], runs[name]())
    return best


def auto_layer_inputs(block: FastSparseMoeBlock, x: torch.Tensor) -> tuple:
    """The fused op's inputs at this layer (what ``auto`` times on): routed with the block's router."""
    from fastmoe_xpu.autograd.ops import route

    x_TH = x.detach().reshape(-1, x.shape[-1])
    with torch.no_grad():
        _, weights, idx = block.gate(x_TH)
        rows = route(idx, 0, block.num_experts, "torch", True)
    return x_TH, block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), weights, rows


def _stage4_measure(inputs: tuple) -> Callable[[str], Any]:
    from fastmoe_xpu.autograd.ops import engine_measure

    x_TH, w_gu, w_d, weights, rows = inputs
    return engine_measure("torch", x_TH, w_gu, w_d, weights, rows)


def _poison(cache: Path, key: registry.ShapeKey, rows: int, slowest: str, fastest_s: float,
            engines: list[str], fastest_fwd: float | None) -> None:
    if cache.exists():
        cache.unlink()
    with settings.override(gemm_cache=str(cache)):
        timing.store(timing.device_name("cpu"), key, slowest, dict.fromkeys(engines, fastest_s),
                     forward=dict.fromkeys(engines, fastest_fwd), rows=rows,
                     timed={"reason": "written by a loaded timing: the slowest engine with the fastest one's time"})


def wrong_cache(H: int, I: int, E: int, K: int, T: int, calls: int, rounds: int, check: bool,
                cache: Path) -> dict[str, Any]:
    """Scenario 1 (``check``: the in-use check on, as shipped; off: never re-timed in use)."""
    engines = registry.candidates("torch", torch.device("cpu"), torch.float32)
    x = torch.randn(1, T, H, requires_grad=True)
    named = {e: _block(H, I, E, K, e) for e in engines}
    per_engine = _interleaved({e: _fb(b, x) for e, b in named.items()}, rounds)
    rows = T * K
    key = registry.ShapeKey("torch", "float32", H, I, E, registry.rows_bucket(rows))
    # What a timing stores is the fused op's stages 4-5, timed as ``auto`` times them (6 rounds,
    # whatever this machine's load says about trusting them): the slowest engine there is stored
    # with the fastest one's time.
    t = timing.time_interleaved(engines, _stage4_measure(auto_layer_inputs(named[engines[0]], x)), min_rounds=6)
    fastest, slowest = min(t.seconds, key=t.seconds.get), max(t.seconds, key=t.seconds.get)
    _poison(cache, key, rows, slowest, t.seconds[fastest], engines, t.forward[fastest])
    registry.forget_choices()
    auto = _block(H, I, E, K, "auto")
    saved_slow = registry.SLOW
    trace = []
    try:
        if not check:
            registry.SLOW = float("inf")
        with settings.override(gemm_cache=str(cache), gemm_engine=None):
            run = _fb(auto, x)
            for i in range(calls):
                t0 = time.perf_counter()
                took = run()
                total = time.perf_counter() - t0
                (watch,) = registry._WATCHES.values()
                trace.append({"call": i + 1, "layer_s": took, "with_timing_s": total, "engine": watch.engine})
            final = _interleaved({"auto": run, "fastest": _fb(named[fastest], x)}, rounds)
            history = list(watch.history)
            stored = json.loads(cache.read_text())["entries"]
    finally:
        registry.SLOW = saved_slow
        registry.forget_choices()
    (entry,) = stored.values()
    return {"check": check, "per_engine_s": per_engine, "stage4_s": t.seconds, "fastest": fastest, "slowest": slowest,
            "trace": trace,
            "history": history, "auto_s": final["auto"], "fastest_s": final["fastest"],
            "ratio": final["auto"] / final["fastest"], "stored_engine": entry["engine"],
            "stored_reason": (entry.get("timed") or {}).get("reason")}


def busy_timing(H: int, I: int, E: int, K: int, T: int, busy: int, cache: Path) -> dict[str, Any]:
    """Scenario 2: the first timing with ``busy`` busy processes on the cores."""
    if cache.exists():
        cache.unlink()
    x = torch.randn(1, T, H, requires_grad=True)
    registry.forget_choices()
    block = _block(H, I, E, K, "auto")
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.3)
        with settings.override(gemm_cache=str(cache), gemm_engine=None):
            _fb(block, x)()
            (watch,) = registry._WATCHES.values()
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)
    stored = json.loads(cache.read_text())["entries"] if cache.exists() else {}
    registry.forget_choices()
    return {"busy": busy, "trusted": watch.trusted, "engine": watch.engine, "stored": bool(stored),
            "history": list(watch.history)}


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench engine_choice", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="512,256,16,4,256", metavar="H,I,E,K,T",
                    help="the layer (default 512,256,16,4,256: above the small-layer budget, so stage 4 is timed)")
    ap.add_argument("--calls", type=count, default=30, help="forward+backward calls on the wrong cache (default 30)")
    ap.add_argument("--rounds", type=count, default=5, help="interleaved rounds of each comparison (default 5)")
    ap.add_argument("--busy", type=int, default=None,
                    help="busy processes for the loaded timing (default: cores + 1; 0 skips it)")
    ap.add_argument("--threads", type=count, default=None, help="torch threads (default: fastmoe_xpu.threads' rule)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    output_file(args.json)
    try:
        H, I, E, K, T = (int(v) for v in args.shape.split(","))
    except ValueError:
        fail(f"error: --shape is H,I,E,K,T (five integers), got {args.shape!r}")
    from fastmoe_xpu.kernels.registry import SMALL_LAYER_MACS, layer_macs

    if layer_macs(T, K, H, I, E) <= SMALL_LAYER_MACS:  # auto times nothing there: no choice to study
        fail(f"error: --shape {args.shape}: {layer_macs(T, K, H, I, E) / 2**20:.1f} Mi multiply-accumulates, at "
             f"or below the {SMALL_LAYER_MACS // 2**20} Mi up to which auto takes its small-layer engine untimed; "
             "give a larger layer")
    from fastmoe_xpu.threads import configure, usable_cores

    print(f"# {configure(args.threads).summary}")
    load = load_text(list(os.getloadavg()) if hasattr(os, "getloadavg") else None)
    print(f"# layer H={H} I={I} E={E} K={K} T={T}, fp32 forward+backward, torch backend; "
          f"min over {plural(args.rounds, 'interleaved round')}; load average {load}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "gemm_engines.json"
        for check in (True, False):
            r = wrong_cache(H, I, E, K, T, args.calls, args.rounds, check, cache)
            results["in_use_check" if check else "no_in_use_check"] = r
            label = "in-use check on (as shipped)" if check else "in-use check off (never re-timed in use)"
            print(f"\n## wrong stored choice, {label}")
            named = ", ".join(f"{e} {s * 1e3:.1f}" for e, s in r["per_engine_s"].items())
            print(f"layer per engine, named (ms): {named}"
                  + "; stages 4-5 as auto times them (ms): "
                  + ", ".join(f"{e} {s * 1e3:.1f}" for e, s in r["stage4_s"].items())
                  + f"; stored: {r['slowest']} with {r['fastest']}'s time")
            switched = next((t["call"] for t in r["trace"] if t["engine"] != r["slowest"]), None)
            marks = (f"{t['layer_s'] * 1e3:.0f}{'' if t['engine'] == r['slowest'] else '*'}" for t in r["trace"])
            print("calls (ms, engine): " + " ".join(marks)
                  + ("  (* after the switch)" if switched else ""))
            for calls_seen, what in r["history"]:
                print(f"  after {plural(calls_seen, 'call')}: {what}")
            print(f"after {plural(args.calls, 'call')}: layer {r['auto_s'] * 1e3:.1f} ms vs {r['fastest']} named "
                  f"{r['fastest_s'] * 1e3:.1f} ms: {r['ratio']:.2f}x (cache now: {r['stored_engine']}, "
                  f"{r['stored_reason']})")
        busy = usable_cores() + 1 if args.busy is None else args.busy
        if busy:
            r = busy_timing(H, I, E, K, T, busy, cache)
            results["busy"] = r
            print(f"\n## first timing with {busy} busy processes on the cores")
            print(f"trusted: {r['trusted']}; in-process choice {r['engine']}; stored: {r['stored']}")
            for calls_seen, what in r["history"]:
                print(f"  {what}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

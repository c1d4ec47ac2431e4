"""``python -m bench --shapes practitioners``: one MoE layer at each shape the published MoE kernels
compare on, in TFLOP/s, beside a dense ``torch.mm`` of the same FLOPs timed in the same run.

Shapes (``presets.SHAPE_SETS``): OLMoE-1B-7B, Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-20B,
Mixtral-8x7B and DeepSeek-V3's local slice at EP=8, at T = 32768 tokens on a GPU. Elsewhere (the
CPU) the default is T = 256 with H and I divided by 8, printed in every shape's name
(``--shape-tokens``, ``--shape-scale`` choose).

FLOPs are the usual count over the routed rows RT (= T*K without expert parallelism): forward
``6*RT*H*I``, backward ``12*RT*H*I``; TFLOP/s = FLOPs / median seconds. ``vs mm`` is that rate over
the rate of the dense ``[RT, H] @ [H, 3I]`` product (the forward's FLOPs in one ``torch.mm``),
timed interleaved with the providers (:func:`bench.runner.run_case`).

Providers: transformers' ``grouped_mm`` and ``eager`` experts, FastSparseMoE on the default
backend (its ``auto`` engine choice named) and on each grouped-GEMM engine that runs here
(``triton_tma`` on sm_90+), and Liger-Kernel's fused MoE and SonicMoE, reported as skipped with the
reason when they cannot run. Every provider is checked against transformers' eager experts.

``--precision none fp8`` adds FastSparseMoE with its expert GEMMs in fp8 (``fastmoe/triton:fp8`` on a
GPU: the Triton fp8 grouped GEMMs) beside the plain one, checked with fp8's tolerance, and a line
under each table with its speed over the plain provider's (same FLOPs, so the ratio of the times).
"""
from __future__ import annotations

import gc
import importlib
import json
import sys
from pathlib import Path

import torch

from fastmoe_xpu.kernels import registry

from .bounds import DenseCeiling
from .cases import make_case
from .measure import run_options
from .presets import shape_set
from .providers import ProviderSkipped, build_provider, default_fastmoe
from .report import run_header
from .runner import run_case

#: Defaults off a GPU: a layer small enough for a shared CPU.
CPU_TOKENS, CPU_SCALE = 256, 8
GPU_TOKENS = 32768
REFERENCE = "hf_v5_eager"
#: Other projects' MoE kernels the published comparisons name: (provider, module).
EXTERNAL = (("liger_fused_moe", "liger_kernel"), ("sonicmoe", "sonicmoe"))


def providers_for(device: torch.device, dtype: torch.dtype, precisions: list[str] | tuple[str, ...] = ()) -> list[str]:
    """transformers' two, FastSparseMoE's default (and, for each of ``precisions`` other than
    ``none``, the same with its expert GEMMs quantized: ``fastmoe/triton:fp8``) and each engine
    available next to its backend, then the external kernels."""
    fast = default_fastmoe(device)
    backend = fast.split("/", 1)[1]
    names = ["hf_v5_grouped_mm", REFERENCE, fast, *(f"{fast}:{p}" for p in precisions if p != "none")]
    names += [f"{fast}@{e}" for e in registry.ENGINES
              if registry.IMPLEMENTATIONS[e].timed(device) and registry.unavailable_reason(e, backend, device, dtype) is None]
    return names + [name for name, _ in EXTERNAL]


def _external(name: str) -> None:
    """Raise :class:`ProviderSkipped` saying why ``name`` does not run in this process."""
    module = dict(EXTERNAL)[name]
    try:
        importlib.import_module(module)
    except Exception as exc:
        raise ProviderSkipped(f"{module} not importable: {exc}") from None
    raise ProviderSkipped(f"{module} is importable, but its layer routes tokens itself with its own router and "
                          "weights, so it cannot take this case's routing: not measured side by side")


def build(name: str, case):  # noqa: ANN001
    if name in dict(EXTERNAL):
        _external(name)
    return build_provider(name, case, "auto")


def tflops(flops: float, seconds: float | None) -> float | None:
    return flops / seconds / 1e12 if seconds else None


def rows_of(res: dict) -> list[dict]:
    """The table's rows for one case: the dense mm first, then every provider."""
    flops = res["case"]["flops"]
    ceil = res["ceiling"]
    mm = tflops(ceil["flops"], ceil.get("median_s"))
    out = [{"provider": "torch.mm (same FLOPs)", "status": "ok", "fwd_tflops": mm, "fwdbwd_tflops": None,
            "fwd_vs_mm": 1.0 if mm else None, "fwdbwd_vs_mm": None, "fwd_ms": 1e3 * ceil.get("median_s", 0.0),
            "fwdbwd_ms": None, "correct": None}]
    for name, pr in res["providers"].items():
        if pr["status"] != "ok":
            out.append({"provider": name, "status": "skipped: " + pr["reason"]})
            continue
        f = tflops(flops["fwd"], pr["fwd"].get("median_s"))
        fb = tflops(flops["fwdbwd"], pr["fwdbwd"].get("median_s")) if "fwdbwd" in pr else None
        out.append({"provider": name, "status": "ok", "fwd_tflops": f, "fwdbwd_tflops": fb,
                    "fwd_vs_mm": f / mm if f and mm else None, "fwdbwd_vs_mm": fb / mm if fb and mm else None,
                    "fwd_ms": 1e3 * pr["fwd"]["median_s"],
                    "fwdbwd_ms": 1e3 * pr["fwdbwd"]["median_s"] if "fwdbwd" in pr else None,
                    "correct": pr.get("correct", {}).get("ok"), "note": pr.get("note", "")})
    return out


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(res: dict) -> str:
    p = res["case"]["preset"]
    head = (f"{p['name']}: H={p['hidden']} I={p['intermediate']} E={p['experts']} K={p['top_k']}"
            + (f" EP={p['ep']} (NR={p['local_experts']})" if p["ep"] > 1 else "")
            + f" T={p['tokens']} RT={res['case']['rows']} {res['case']['dtype']} {res['case']['device']}")
    cols = ("provider", "fwd ms", "fwd TFLOP/s", "vs mm", "F+B ms", "F+B TFLOP/s", "vs mm", "correct")
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows_of(res):
        if r["status"] != "ok":
            lines.append(f"| {r['provider']} | {r['status']} |" + " |" * (len(cols) - 2))
            continue
        ok = {None: "-", True: "yes", False: "NO"}[r["correct"]]
        lines.append("| " + " | ".join((r["provider"], _num(r["fwd_ms"], ".2f"), _num(r["fwd_tflops"], ".3f"),
                                        _num(r["fwd_vs_mm"], ".2f"), _num(r["fwdbwd_ms"], ".2f"),
                                        _num(r["fwdbwd_tflops"], ".3f"), _num(r["fwdbwd_vs_mm"], ".2f"), ok)) + " |")
    for name, q in precision_speedups(res).items():
        lines.append(f"{name} over {name.split(':', 1)[0]} (same run): forward {_num(q['fwd'], '.2f')}x, "
                     f"F+B {_num(q['fwdbwd'], '.2f')}x")
    return "\n".join(lines)


def precision_speedups(res: dict) -> dict[str, dict[str, float | None]]:
    """For each quantized provider (``fastmoe/<backend>:<precision>``) that ran beside its plain one:
    the plain provider's median time over its own, forward and F+B (above 1: the quantized one is
    faster)."""
    rows = {r["provider"]: r for r in rows_of(res) if r["status"] == "ok"}
    out = {}
    for name, r in rows.items():
        base = rows.get(name.split(":", 1)[0]) if ":" in name else None
        if base is None:
            continue
        out[name] = {mode: (base[f"{mode}_ms"] / r[f"{mode}_ms"]) if base[f"{mode}_ms"] and r[f"{mode}_ms"] else None
                     for mode in ("fwd", "fwdbwd")}
    return out


def run_shapes(args) -> int:  # noqa: ANN001
    """The ``--shapes`` mode of ``python -m bench``: table per shape, JSON under ``--out``."""
    device = torch.device(args.device)
    on_gpu = device.type in ("cuda", "xpu")
    tokens = args.shape_tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
    scale = args.shape_scale or (1 if on_gpu else CPU_SCALE)
    try:
        presets = shape_set(args.shapes, scale=scale, tokens=tokens)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    precisions = getattr(args, "precision", None) or ["none"]
    unknown = [p for p in precisions if p != "none" and p not in registry.PRECISIONS]
    if unknown:
        raise SystemExit(f"error: --shapes takes --precision none or one of {tuple(registry.PRECISIONS)} "
                         f"(expert-GEMM precisions), not {unknown[0]!r}")
    rounds = run_options(args)
    header = run_header(device, {k: v for k, v in vars(args).items()})
    print(f"# {header['date_utc']}  {header['machine'].get('device_name', header['machine']['cpu_model'])}, "
          f"torch {header['machine']['torch']}, triton {header['machine']['triton']}, "
          f"transformers {header['machine']['transformers']}")
    print(f"# {header['command']}")
    print(f"# shape set {args.shapes}: T={tokens}" + (f", H and I divided by {scale}" if scale > 1 else "")
          + "; FLOPs: forward 6*RT*H*I, backward 12*RT*H*I; vs mm: over a dense torch.mm of the forward's FLOPs")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    torch.set_grad_enabled(True)
    results = []
    for p in presets:
        log(f"{p.name}: building inputs")
        case = make_case(p, dtype=args.dtype, device=device, seed=args.seed, routing=args.routing)
        names = providers_for(device, case.dtype, precisions)
        res = run_case(case, names, backward=True, rounds=rounds, budget_s=args.budget, progress=not args.no_progress,
                       log=log, build=build, reference=REFERENCE, ceiling=DenseCeiling.same_flops(case))
        res["table"] = rows_of(res)
        res["precision_speedups"] = precision_speedups(res)
        print()
        print(format_table(res), flush=True)
        results.append(res)
        del case
        gc.collect()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"shapes_{args.shapes}.json"
    path.write_text(json.dumps({**header, "cases": results}, indent=1, default=str) + "\n")
    print(f"\n# wrote {path}")
    bad = [(r["case"]["preset"]["name"], n) for r in results for n, pr in r["providers"].items()
           if pr.get("correct") is not None and not pr["correct"]["ok"]]
    if bad:
        print(f"# CORRECTNESS FAILURE against {REFERENCE}: {bad}", file=sys.stderr)
        return 1
    return 0

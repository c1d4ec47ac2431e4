"""``python -m bench --shapes practitioners``: one MoE layer at each shape the published MoE kernels
compare on, in TFLOP/s, beside a dense ``torch.mm`` of the same FLOPs timed in the same run.

Shapes (``presets.SHAPE_SETS``): OLMoE-1B-7B, Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-20B,
Mixtral-8x7B and DeepSeek-V3's local slice at EP=8, at T = 32768 tokens on a GPU. Elsewhere (the
CPU) the default is T = 256 with H and I divided by 8, printed in every shape's name
(``--shape-tokens``, ``--shape-scale`` choose).

FLOPs are the usual count over the routed rows RT (= T*K without expert parallelism): forward
``6*RT*H*I``, backward ``12*RT*H*I``; TFLOP/s = FLOPs / median seconds. ``vs mm`` is that rate over
the rate of the dense ``[RT, H] @ [H, 3I]`` product (the forward's FLOPs in one ``torch.mm``),
timed interleaved with the providers (:func:`bench.harness.runner.run_case`).

Providers: transformers' ``grouped_mm`` experts (every user's default), FastSparseMoE on the default
backend (its ``auto`` engine choice named) and on each grouped-GEMM engine that runs here
(``triton_tma`` on sm_90+), Liger-Kernel's fused MoE (``liger``) and SonicMoE (``sonicmoe``), each
reported as skipped with the reason when it cannot run; off a GPU transformers' ``eager`` experts too.
``--providers`` runs only the ones it names (``fastmoe/triton`` names its fp8 twin too under
``--precision none fp8``; the GPU kit leaves out ``fastmoe/triton@loop``, a torch.mm per expert that
takes 130-190 ms a call at T=32k and is timed at the Mula presets). The inputs are drawn on the device
where it is a GPU (``harness.cases.draw_device``). Every provider is checked against one fp32 reference computed apart from the timing (the mask-based
``fastmoe_xpu.reference`` on fp32 copies of the case's tensors): the table gives each one's largest
relative error over the output and the four gradients, and its peak memory on the device (what one
forward+backward adds to what was allocated before it).

The first table is the comparison the shape set exists for: at each shape, FastSparseMoE's default
against the fastest peer (transformers or another project) that ran, forward and F+B, as a ratio of
their median times; ``summary.md`` under ``--out`` holds it with every shape's table.

``--precision none fp8`` adds FastSparseMoE with its expert GEMMs in fp8 (``fastmoe/triton:fp8`` on a
GPU: the Triton fp8 grouped GEMMs) beside the plain one, checked with fp8's tolerance, and a line
under each table with its speed over the plain provider's (same FLOPs, so the ratio of the times).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from fastmoe_xpu import reference as fp32_ref
from fastmoe_xpu.kernels import registry

from ..harness.bounds import DenseCeiling
from ..harness.cases import make_case
from ..harness.measure import run_options
from ..harness.presets import shape_set
from ..harness.providers import EXTERNAL_PROVIDERS, REFERENCE, build_provider, default_fastmoe, expand_names
from ..harness.report import run_header
from ..harness.runner import run_case
from ..harness.usage import fail

#: Defaults off a GPU: a layer small enough for a shared CPU.
CPU_TOKENS, CPU_SCALE = 256, 8
GPU_TOKENS = 32768
#: The peers FastSparseMoE is compared with: transformers' default and the other projects' layers.
PEERS = ("hf_v5_grouped_mm", "hf_v5_eager", *EXTERNAL_PROVIDERS)


def providers_for(device: torch.device, dtype: torch.dtype, precisions: list[str] | tuple[str, ...] = (),
                  only: list[str] | None = None) -> list[str]:
    """transformers' grouped_mm (and, off a GPU, its eager loop: 10-40x slower than the rest at T=32k on a
    GPU, it would take most of the time budget there), FastSparseMoE's default (and, for each of
    ``precisions`` other than ``none``, the same with its expert GEMMs quantized: ``fastmoe/triton:fp8``)
    and each engine available next to its backend, then the other projects' layers.

    ``only`` (``--providers``): just the providers it names, in that order, a named plain fastmoe
    provider followed by its quantized twins; a named one that cannot run here is built all the same
    and reported skipped with the reason (``fastmoe/triton@triton_tma`` before sm_90, say)."""
    fast = default_fastmoe(device)
    backend = fast.split("/", 1)[1]
    if only is not None:
        names = []
        for n in only:
            names.append(n)
            if n.startswith("fastmoe/") and "@" not in n and ":" not in n:
                names += [f"{n}:{p}" for p in precisions if p != "none"]
        return list(dict.fromkeys(names))
    names = ["hf_v5_grouped_mm"] + ([] if device.type in ("cuda", "xpu") else ["hf_v5_eager"]) + [fast]
    names += [f"{fast}:{p}" for p in precisions if p != "none"]
    names += [f"{fast}@{e}" for e in registry.ENGINES
              if registry.IMPLEMENTATIONS[e].timed(device) and registry.unavailable_reason(e, backend, device, dtype) is None]
    return names + list(EXTERNAL_PROVIDERS)


def named_providers(names: list[str] | None) -> list[str] | None:
    """``--providers`` for the shape set: the names checked and ``fastmoe`` expanded
    (:func:`~bench.harness.providers.expand_names`), without the ``hf_v4`` reference it adds (here the
    fp32 reference is the check); None when none were named. Raises ValueError for an unknown name."""
    if not names:
        return None
    return [n for n in expand_names(names) if n != REFERENCE or REFERENCE in names]


def fp32_reference(case) -> dict:  # noqa: ANN001
    """Output and gradients (input, routing weights, both expert weights) of the case's layer in fp32 by the
    mask-based reference, on the case's device: what every provider's results are checked against."""
    leaves = [t.detach().float().requires_grad_() for t in (case.x_TH, case.weights_TK, case.w_gate_up_N2IH,
                                                           case.w_down_NHI)]
    out = fp32_ref.reference_experts_forward(leaves[0], leaves[1], case.topk_idx_TK, leaves[2], leaves[3])
    grads = torch.autograd.grad(out, leaves, case.dout_TH.float())
    return {"out": out.detach(), **dict(zip(("dx", "dweights", "dw_gate_up", "dw_down"), grads))}


def tflops(flops: float, seconds: float | None) -> float | None:
    return flops / seconds / 1e12 if seconds else None


def rows_of(res: dict) -> list[dict]:
    """The table's rows for one case: the dense mm first, then every provider."""
    flops = res["case"]["flops"]
    ceil = res["ceiling"]
    mm = tflops(ceil["flops"], ceil.get("median_s"))
    out = [{"provider": "torch.mm (same FLOPs)", "status": "ok", "fwd_tflops": mm, "fwdbwd_tflops": None,
            "fwd_vs_mm": 1.0 if mm else None, "fwdbwd_vs_mm": None, "fwd_ms": 1e3 * ceil.get("median_s", 0.0),
            "fwdbwd_ms": None, "correct": None, "peak_mb": None, "max_error": None}]
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
                    "correct": pr.get("correct", {}).get("ok"), "note": pr.get("note", ""),
                    "peak_mb": pr["peak_bytes"] / 2**20 if "peak_bytes" in pr else None,
                    "max_error": max(pr["correct"]["max_rel_error"].values()) if pr.get("correct") else None,
                    "budget_note": pr.get("budget_note", ""), "auto_note": pr.get("auto_note", "")})
    return out


def _engine(note: str) -> str:
    """The engine ``auto`` picked, from the default provider's note (``... auto -> triton_tma``)."""
    return note.rsplit("auto -> ", 1)[1] if "auto -> " in note else ""


def comparison(res: dict) -> dict | None:
    """FastSparseMoE's default provider against the fastest peer that ran at this shape: ratios of the peer's
    median time to ours (above 1: we are faster), forward and F+B; None when either is missing."""
    rows = {r["provider"]: r for r in rows_of(res) if r["status"] == "ok"}
    fast = next((n for n in rows if n.startswith("fastmoe/") and "@" not in n and ":" not in n), None)
    peers = [n for n in rows if n in PEERS and rows[n]["fwdbwd_ms"]]
    if fast is None or not peers or not rows[fast]["fwdbwd_ms"]:
        return None
    best = min(peers, key=lambda n: rows[n]["fwdbwd_ms"])
    f, p = rows[fast], rows[best]
    return {"shape": res["case"]["preset"]["name"], "fastmoe": fast, "engine": _engine(f.get("note", "")),
            "fastmoe_fwd_tflops": f["fwd_tflops"], "fastmoe_fwdbwd_tflops": f["fwdbwd_tflops"], "peer": best,
            "peer_fwd_tflops": p["fwd_tflops"], "peer_fwdbwd_tflops": p["fwdbwd_tflops"],
            "fwd_ratio": p["fwd_ms"] / f["fwd_ms"], "fwdbwd_ratio": p["fwdbwd_ms"] / f["fwdbwd_ms"],
            "fastmoe_peak_mb": f["peak_mb"], "peer_peak_mb": p["peak_mb"],
            "fastmoe_error": f["max_error"], "peer_error": p["max_error"]}


def format_comparison(results: list[dict]) -> str:
    """One row per shape: our default against the fastest peer, the first table of the shape set's report."""
    cols = ("shape", "fastmoe (auto ->)", "F+B TFLOP/s", "fastest peer", "peer F+B TFLOP/s", "fwd ratio",
            "F+B ratio", "peak MB ours / peer", "max error ours / peer")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for res in results:
        c = comparison(res)
        if c is None:
            lines.append(f"| {res['case']['preset']['name']} | no comparison: FastSparseMoE or every peer did not run |"
                         + " |" * (len(cols) - 2))
            continue
        lines.append("| " + " | ".join((
            c["shape"], f"{c['fastmoe']} ({c['engine'] or '-'})", _num(c["fastmoe_fwdbwd_tflops"], ".1f"), c["peer"],
            _num(c["peer_fwdbwd_tflops"], ".1f"), f"{c['fwd_ratio']:.2f}x", f"{c['fwdbwd_ratio']:.2f}x",
            f"{_num(c['fastmoe_peak_mb'], '.0f')} / {_num(c['peer_peak_mb'], '.0f')}",
            f"{_num(c['fastmoe_error'], '.1e')} / {_num(c['peer_error'], '.1e')}")) + " |")
    return "\n".join(lines)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(res: dict) -> str:
    p = res["case"]["preset"]
    head = (f"{p['name']}: H={p['hidden']} I={p['intermediate']} E={p['experts']} K={p['top_k']}"
            + (f" EP={p['ep']} (NR={p['local_experts']})" if p["ep"] > 1 else "")
            + f" T={p['tokens']} RT={res['case']['rows']} {res['case']['dtype']} {res['case']['device']}")
    cols = ("provider", "fwd ms", "fwd TFLOP/s", "vs mm", "F+B ms", "F+B TFLOP/s", "vs mm", "peak MB", "max error",
            "correct")
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows_of(res):
        if r["status"] != "ok":
            lines.append(f"| {r['provider']} | {r['status']} |" + " |" * (len(cols) - 2))
            continue
        ok = {None: "-", True: "yes", False: "NO"}[r["correct"]]
        name = r["provider"] + (f" (auto -> {_engine(r.get('note', ''))})" if _engine(r.get("note", "")) else "")
        name += " *" if r.get("budget_note") else ""
        lines.append("| " + " | ".join((name, _num(r["fwd_ms"], ".2f"), _num(r["fwd_tflops"], ".3f"),
                                        _num(r["fwd_vs_mm"], ".2f"), _num(r["fwdbwd_ms"], ".2f"),
                                        _num(r["fwdbwd_tflops"], ".3f"), _num(r["fwdbwd_vs_mm"], ".2f"),
                                        _num(r["peak_mb"], ".0f"), _num(r["max_error"], ".1e"), ok)) + " |")
    lines += [f"* {r['provider']}: {r[k]}" for r in rows_of(res) for k in ("budget_note", "auto_note") if r.get(k)]
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


def _write(out_dir: Path, shapes: str, header: dict, results: list[dict]) -> Path:
    """The JSON and ``summary.md`` (comparison first, then each shape's table), rewritten after every shape so
    that a run stopped part-way (a time limit) keeps what it measured."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"shapes_{shapes}.json"
    path.write_text(json.dumps({**header, "cases": results}, indent=1, default=str) + "\n")
    md = [f"# Shape set {shapes}: FastSparseMoE against the fastest peer", "",
          f"{header['date_utc']}, {header['machine'].get('device_name', header['machine']['cpu_model'])}, "
          f"torch {header['machine']['torch']}, triton {header['machine']['triton']}, "
          f"transformers {header['machine']['transformers']}; `{header['command']}`", "",
          "Ratio: the peer's median time over ours (above 1: FastSparseMoE is faster). Max error: the largest "
          "relative error over the output and the four gradients against the fp32 reference.", "",
          format_comparison(results), ""]
    for res in results:
        md += [format_table(res), ""]
    (out_dir / "summary.md").write_text("\n".join(md))
    return path


def run_shapes(args) -> int:  # noqa: ANN001
    """The ``--shapes`` mode of ``python -m bench``: the comparison, a table per shape, JSON and summary.md
    under ``--out``."""
    device = torch.device(args.device)
    on_gpu = device.type in ("cuda", "xpu")
    tokens = args.shape_tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
    scale = args.shape_scale or (1 if on_gpu else CPU_SCALE)
    try:
        presets = shape_set(args.shapes, scale=scale, tokens=tokens)
    except ValueError as exc:
        fail(f"error: {exc}")
    wanted = getattr(args, "shape_names", None)
    if wanted:
        known = [p.name.split("/")[0] for p in presets]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            fail(f"error: --shape-names {' '.join(unknown)}: not in shape set {args.shapes} ({', '.join(known)})")
        presets = [p for p in presets if p.name.split("/")[0] in wanted]
    precisions = getattr(args, "precision", None) or ["none"]
    unknown = [p for p in precisions if p != "none" and p not in registry.PRECISIONS]
    if unknown:
        fail(f"error: --shapes takes --precision none or one of {tuple(registry.PRECISIONS)} "
             f"(expert-GEMM precisions), not {unknown[0]!r}")
    try:
        only = named_providers(getattr(args, "providers", None))
    except ValueError as exc:
        fail(f"error: --providers: {exc}")
    rounds = run_options(args)
    header = run_header(device, {k: v for k, v in vars(args).items()})
    print(f"# {header['date_utc']}  {header['machine'].get('device_name', header['machine']['cpu_model'])}, "
          f"torch {header['machine']['torch']}, triton {header['machine']['triton']}, "
          f"transformers {header['machine']['transformers']}")
    print(f"# {header['command']}")
    print(f"# shape set {args.shapes}: T={tokens}" + (f", H and I divided by {scale}" if scale > 1 else "")
          + "; FLOPs: forward 6*RT*H*I, backward 12*RT*H*I; vs mm: over a dense torch.mm of the forward's FLOPs; "
          "max error: against the fp32 reference")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    torch.set_grad_enabled(True)
    out_dir = Path(args.out)
    results: list[dict] = []
    for p in presets:
        log(f"{p.name}: building inputs and the fp32 reference")
        case = make_case(p, dtype=args.dtype, device=device, seed=args.seed, routing=args.routing)
        ref = fp32_reference(case)
        names = providers_for(device, case.dtype, precisions, only)
        res = run_case(case, names, backward=True, rounds=rounds, budget_s=args.budget, progress=not args.no_progress,
                       log=log, build=lambda name, c: build_provider(name, c, "auto"), reference_out=ref,
                       ceiling=DenseCeiling.same_flops(case))
        res["table"] = rows_of(res)
        res["comparison"] = comparison(res)
        res["precision_speedups"] = precision_speedups(res)
        print()
        print(format_table(res), flush=True)
        results.append(res)
        path = _write(out_dir, args.shapes, header, results)
        del case, ref
        gc.collect()
    print("\n# FastSparseMoE against the fastest peer (ratio: the peer's median time over ours)")
    print(format_comparison(results))
    print(f"\n# wrote {path} and {out_dir / 'summary.md'}")
    wrong = [(r["case"]["preset"]["name"], n, max(pr["correct"]["max_rel_error"].values()))
             for r in results for n, pr in r["providers"].items() if pr.get("correct") and not pr["correct"]["ok"]]
    for shape, name, err in wrong:
        print(f"# {shape}: {name} is off the fp32 reference by {err:.2e} (over the {args.dtype} tolerance)",
              file=sys.stderr)
    if any(name.startswith("fastmoe/") for _, name, _ in wrong):
        print("# CORRECTNESS FAILURE of FastSparseMoE (above)", file=sys.stderr)
        return 1
    return 0

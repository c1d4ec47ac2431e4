"""Derived metrics, the printed tables, and the JSON / CSV / PNG outputs.

Every ratio (fraction of the ceiling, multiple of the GEMM-only bound, speedup) compares the
minimum over interleaved rounds of the two timings: on a shared machine noise only ever adds
time, so the minimum is the most repeatable estimate. Medians and spreads are reported beside.
"""
from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from fastmoe_xpu.device import cpu_matrix_extensions, cpu_model

from .words import load_text, plural

MODES = ("fwd", "bwd", "fwdbwd")
MODE_TITLE = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward",
              "infer": "forward under torch.no_grad (inference)"}


# ---------------------------------------------------------------- machine
def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None



def _cpu_capability() -> str | None:
    """The vector ISA torch's CPU kernels were dispatched to (``AVX512``, ``AVX2``, ...), if it says."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - an older torch or an unknown platform: not known
        return None


def machine_description(device: torch.device) -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    d = {
        "cpu_model": cpu_model(),
        "matrix_extensions": list(cpu_matrix_extensions()),
        "torch_cpu_capability": _cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "mkl": torch.backends.mkl.is_available(),
        "device": str(device),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        d["device_name"] = torch.cuda.get_device_name(device)
    elif device.type == "xpu":
        d["device_name"] = torch.xpu.get_device_name(device)
    return d


def run_header(device: torch.device, settings: dict) -> dict:
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["fastmoe-bench", *sys.argv[1:]]),
        "machine": machine_description(device),
        "settings": settings,
    }


# ---------------------------------------------------------------- metrics
def _paired(a: dict, b: dict) -> float | None:
    """Median over rounds of ``a[r] / b[r]`` (both timed in round r), or None without common rounds."""
    ra, rb = a.get("by_round") or [], b.get("by_round") or []
    ratios = [x / y for x, y in zip(ra, rb) if y > 0]
    return statistics.median(ratios) if ratios else None


def derive(result: dict, fast_names: list[str]) -> dict:
    """Add ``metrics[mode]`` to one case's result: GFLOP/s, fractions and speedups."""
    flops = result["case"]["flops"]
    ceil = result["ceiling"]
    ceiling_gflops = ceil["flops"] / ceil["min_s"] / 1e9
    metrics: dict = {}
    modes = ("infer",) if result.get("inference") else MODES if result["backward"] else ("fwd",)
    for mode in modes:
        b = result["bound"][mode]
        bound_gflops = flops[mode] / b["min_s"] / 1e9
        m = {
            "ceiling_gflops": ceiling_gflops,
            "bound": {"min_s": b["min_s"], "median_s": b["median_s"], "gflops": bound_gflops,
                      "frac_ceiling": bound_gflops / ceiling_gflops},
            "providers": {},
            "speedup": {},
        }
        ok = {n: p for n, p in result["providers"].items() if p.get("status") == "ok" and p.get(mode, {}).get("n")}
        for n, p in ok.items():
            t = p[mode]["min_s"]
            g = flops[mode] / t / 1e9
            m["providers"][n] = {"min_s": t, "median_s": p[mode]["median_s"], "spread": p[mode]["spread"],
                                 "gflops": g, "frac_ceiling": g / ceiling_gflops, "x_bound": t / b["min_s"],
                                 "x_bound_paired": _paired(p[mode], b)}
        for f in fast_names:
            if f not in ok:
                continue
            tf, mf = ok[f][mode]["min_s"], ok[f][mode]["median_s"]
            m["speedup"][f] = {
                n: {"min": p[mode]["min_s"] / tf, "median": p[mode]["median_s"] / mf,
                    "paired": _paired(p[mode], ok[f][mode])}
                for n, p in ok.items() if n != f
            }
        metrics[mode] = m
    result["metrics"] = metrics
    for mode in modes:  # each quantized provider over its plain one (in the JSON as well)
        metrics[mode]["precision_speedups"] = {name: {"over": base, "min": lo, "paired": paired}
                                               for name, base, lo, paired in precision_speedups(result, mode)}
    return result


# ---------------------------------------------------------------- printed tables
def _faults(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1000:.0f}k" if n >= 10_000 else str(n)


def _mb(n: int | None) -> str:
    if n is None:
        return "-"
    mb = n / 2**20
    return f"{mb:.0f}" if mb >= 10 else f"{mb:.2f}"


def case_title(result: dict) -> str:
    c = result["case"]
    p = c["preset"]
    r = c["rows_per_expert"]
    return (f"{p['name']}: T={p['tokens']} H={p['hidden']} I={p['intermediate']} E={p['experts']} K={p['top_k']} "
            f"NR={p['local_experts']} (EP={p['ep']}); {c['rows']} routed rows, {r['mean']:.0f} per expert "
            f"[{r['min']}..{r['max']}]; {c['dtype']} on {c['device']}")


#: The baselines of the summary, transformers' default experts implementation first (the headline).
SUMMARY_BASELINES = ["hf_v5_grouped_mm", "hf_v4", "hf_v5_eager"]
#: What each baseline is, in the words the tables print.
BASELINE_NAMES = {"hf_v5_grouped_mm": "transformers' default experts implementation (grouped_mm)",
                  "hf_v4": "the transformers-4-style per-expert loop (the published baseline, correctness reference)",
                  "hf_v5_eager": "transformers 5's eager per-expert loop"}
#: The GEMM-only bound in one line.
BOUND_LINE = ("GEMM-only bound: the time of the same expert matmuls of forward and backward on torch.mm with "
              "nothing else (no routing, gather, combine or allocation), what an implementation on torch.mm without "
              "overhead would take; an engine on a faster GEMM (onednn on the CPU) can run below it")
#: One line per column of the per-case table.
CASE_COLUMNS = (
    "median ms / min ms: time per call over the timed rounds; spread: (max - min) / median",
    "GFLOP/s: the layer's FLOPs over the min time; %ceil: that as a share of the dense-matmul ceiling",
    "x bound: min time over the GEMM-only bound's min time (1.00 = as fast as the bare matmuls); %bound: its inverse; "
    "paired: x bound as the median of same-round ratios",
    "speedup: the provider's time over fastmoe's (min over rounds | median of same-round ratios; >1: fastmoe faster)",
    "saved MB: tensors kept for backward; faults: minor page faults per call; rounds: timed rounds (x N: each "
    "sample the mean of N calls in a row, for calls shorter than --min-sample-ms); "
    "correct: outputs and gradients against hf_v4 (largest relative error)",
)
BUDGET_NOTE = "* fewer rounds than asked (time budget); a kept cold call pairs with no round"


def _pair(a: float, b: float | None, sep: str, unit: str = "") -> str:
    """``"a<unit><sep>b<unit>"``, ``-`` for a missing paired value."""
    return f"{a:.2f}{unit}{sep}" + (f"{b:.2f}{unit}" if b is not None else "-")


def _rounds(n: int, calls: int | None) -> str:
    """Timed rounds, with ``xN`` when each sample was the mean of N calls."""
    return f"{n}x{calls}" if calls and calls > 1 else str(n)


def _case_rows(result: dict, mode: str, fast: str, sep: str) -> list[dict]:
    """One row per contestant of a case (the bound first), as strings both tables print."""
    m = result["metrics"][mode]
    b = result["bound"][mode]
    rows = [dict(name="gemm_bound", median=f"{1e3 * b['median_s']:.1f}", spread=100 * b["spread"],
                 min=f"{1e3 * b['min_s']:.1f}", gflops=f"{m['bound']['gflops']:.1f}",
                 ceil=100 * m["bound"]["frac_ceiling"], x_bound=1.0, x_paired="1.00", speedup="", saved="",
                 faults=_faults(result["bound"].get("page_faults_per_call")),
                 rounds=_rounds(b["n"], result["bound"].get("calls_per_sample")), star="",
                 correct="")]
    sp = m["speedup"].get(fast, {})
    for name, p in result["providers"].items():
        if p.get("status") != "ok":
            rows.append(dict(name=name, skipped=p.get("reason", "")))
            continue
        q = m["providers"].get(name)
        if q is None:
            continue
        s = sp.get(name)
        corr = p.get("correct")
        if name == "hf_v4" or corr is None:
            c_txt = "reference" if name == "hf_v4" else "-"
        else:
            worst = max(corr["max_rel_error"].values()) if corr["max_rel_error"] else 0.0
            c_txt = f"{'ok' if corr['ok'] else 'FAIL'} ({worst:.1e})"
        rows.append(dict(
            name=name, median=f"{1e3 * q['median_s']:.1f}", spread=100 * q["spread"], min=f"{1e3 * q['min_s']:.1f}",
            gflops=f"{q['gflops']:.1f}", ceil=100 * q["frac_ceiling"], x_bound=q["x_bound"],
            x_paired=f"{q['x_bound_paired']:.2f}" if q["x_bound_paired"] is not None else "-",
            speedup=_pair(s["min"], s["paired"], sep, "x") if s else ("-" if name == fast else ""),
            saved=_mb(p.get("saved_bytes")), faults=_faults(p.get("page_faults_per_call")),
            rounds=_rounds(p.get("rounds", 0), p.get("calls_per_sample")),
            star=" *" if p.get("budget_limited") else "", correct=c_txt))
    return rows


def _case_notes(result: dict) -> list[tuple[str, str]]:
    """The notes under a case's table: rounds cut by the time budget, ``auto`` re-timed while measured."""
    return [(name, p[k]) for name, p in result["providers"].items() for k in ("budget_note", "auto_note")
            if p.get(k)]


def precision_speedups(result: dict, mode: str) -> list[tuple[str, str, float, float | None]]:
    """``(quantized provider, its plain provider, speedup by min times, by the median of same-round
    ratios)`` for each ``<fastmoe provider>:<precision>`` that ran beside its plain one (above 1: the
    quantized provider is faster)."""
    ok = {n: p for n, p in result["providers"].items() if p.get("status") == "ok" and p.get(mode, {}).get("n")}
    out = []
    for name, p in ok.items():
        base = ok.get(name.split(":", 1)[0]) if ":" in name else None
        if base is not None and p[mode]["min_s"] > 0:
            out.append((name, name.split(":", 1)[0], base[mode]["min_s"] / p[mode]["min_s"], _paired(base[mode], p[mode])))
    return out


def _precision_lines(result: dict, mode: str) -> list[str]:
    return [f"{name} over {base}: {lo:.2f}x (min) | {'-' if paired is None else f'{paired:.2f}x'} (paired)"
            for name, base, lo, paired in precision_speedups(result, mode)]


def format_case(result: dict, mode: str, fast: str, legend: bool = True) -> str:
    """One case's table; ``legend``: with the lines that say what the columns mean (a run of several
    cases prints them once, after the last case: :func:`case_legend`)."""
    m = result["metrics"][mode]
    lines = [f"{case_title(result)} -- {MODE_TITLE[mode]}",
             f"  dense-matmul ceiling {m['ceiling_gflops']:.1f} GFLOP/s ({result['ceiling']['size']}^3 torch.mm); "
             f"GEMM-only bound {m['bound']['gflops']:.1f} GFLOP/s = {100 * m['bound']['frac_ceiling']:.0f}% of it"]
    hdr = (f"  {'provider':<18} {'median ms':>10} {'spread':>7} {'min ms':>10} {'GFLOP/s':>8} {'%ceil':>6} "
           f"{'x bound':>8} {'%bound':>6} {'paired':>7} {'speedup (min | paired)':>23} {'saved MB':>9} "
           f"{'faults':>7} {'rounds':>6}  correct")
    lines += [hdr, "  " + "-" * (len(hdr) - 2)]
    for r in _case_rows(result, mode, fast, " | "):
        if "skipped" in r:
            lines.append(f"  {r['name']:<18} skipped: {r['skipped']}")
            continue
        lines.append(f"  {r['name']:<18} {r['median']:>10} {r['spread']:>6.1f}% {r['min']:>10} {r['gflops']:>8} "
                     f"{r['ceil']:>5.0f}% {r['x_bound']:>8.2f} {100 / r['x_bound']:>5.0f}% {r['x_paired']:>7} "
                     f"{r['speedup']:>23} {r['saved']:>9} {r['faults']:>7} {r['rounds']:>5}{r['star']}  {r['correct']}".rstrip())
    lines += [f"  * {name}: {note}" for name, note in _case_notes(result)]
    lines += [f"  {line}" for line in _precision_lines(result, mode)]
    if legend:
        lines += [f"  {c}" for c in case_legend()]
    return "\n".join(lines)


def case_legend(bound: bool = True) -> list[str]:
    """What the columns of :func:`format_case` mean, the GEMM-only bound's line first (``bound``)."""
    return [BOUND_LINE, *CASE_COLUMNS] if bound else list(CASE_COLUMNS)


def _summary_rows(results: list[dict], mode: str, fast: str, sep: str, star: str) -> list[tuple[dict, list[str], str]]:
    """Per case with this mode: ``(result, speedup cell per baseline, fastmoe's x-bound cell)``."""
    out = []
    for r in results:
        m = r["metrics"].get(mode)
        if m is None:
            continue
        sp = m["speedup"].get(fast, {})
        cells = []
        for o in SUMMARY_BASELINES:
            s = sp.get(o)
            if s is None:
                cells.append("skipped" if r["providers"].get(o, {}).get("status") == "skipped" else "-")
            else:
                cells.append(_pair(s["min"], s["paired"], sep, "x") + (star if r["providers"][o].get("budget_limited") else ""))
        q = m["providers"].get(fast)
        out.append((r, cells, "-" if not q else _pair(q["x_bound"], q["x_bound_paired"], sep)))
    return out


def format_summary(results: list[dict], mode: str, fast: str) -> str:
    """The paper's Table 3 layout: one row per layer, fastmoe's speedup over each baseline."""
    hdr = (f"{'preset':<20} {'rows/exp':>8} " + " ".join(f"{'vs ' + o:>20}" for o in SUMMARY_BASELINES)
           + f" {'x bound':>13} {'bound %ceil':>11}")
    lines = [f"{fast} {MODE_TITLE[mode]} speedup, min over interleaved rounds | median of same-round ratios "
             "(>1: fastmoe is faster)", hdr, "-" * len(hdr)]
    rows = _summary_rows(results, mode, fast, " | ", "*")
    for r, cells, xb in rows:
        lines.append(f"{r['case']['preset']['name']:<20} {r['case']['rows_per_expert']['mean']:>8.0f} "
                     + " ".join(f"{c:>20}" for c in cells)
                     + f" {xb:>13} {100 * r['metrics'][mode]['bound']['frac_ceiling']:>10.0f}%")
    lines += [f"vs {o}: {BASELINE_NAMES[o]}" for o in SUMMARY_BASELINES]
    lines += ["rows/exp: routed rows per expert; x bound: fastmoe's time over the GEMM-only bound's; "
              "bound %ceil: the bound's speed as a share of the dense-matmul ceiling", BOUND_LINE]
    if any(c.endswith("*") for _, cells, _ in rows for c in cells):
        lines.append(BUDGET_NOTE)
    return "\n".join(lines)


def headline(results: list[dict], mode: str, fast: str) -> list[str]:
    """One line per case: fastmoe against transformers' default experts implementation."""
    out = []
    for r, cells, xb in _summary_rows(results, mode, fast, " | ", "*"):
        out.append(f"{r['case']['preset']['name']}: fastmoe vs {BASELINE_NAMES['hf_v5_grouped_mm']}: "
                   f"{cells[0]} (min | paired); {xb.split(' | ')[0]}x the GEMM-only bound")
    return out


# ---------------------------------------------------------------- files
def write_json(path: Path, header: dict, results: list[dict]) -> None:
    path.write_text(json.dumps({**header, "cases": results}, indent=2, default=str) + "\n", encoding="utf-8")


def write_csv(path: Path, header: dict, results: list[dict], fast_names: list[str]) -> None:
    cols = ["preset", "mode", "provider", "status", "reason", "rounds", "median_ms", "min_ms", "max_ms", "spread",
            "gflops", "frac_ceiling", "x_bound", "x_bound_paired"] + [f"speedup_of_{f}" for f in fast_names] + [
            f"speedup_of_{f}_paired" for f in fast_names] + [
            "saved_mb", "page_faults_per_call", "correct", "max_rel_error", "budget_limited", "note"]
    mach = header["machine"]
    with path.open("w", newline="", encoding="utf-8") as fh:
        fh.write(f"# {header['date_utc']} {header['command']}\n")
        fh.write(f"# {machine_line(mach)}, triton {mach['triton']}, device {mach['device']}\n")
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in results:
            pname = r["case"]["preset"]["name"]
            for mode, m in r["metrics"].items():
                b = r["bound"][mode]
                w.writerow({"preset": pname, "mode": mode, "provider": "gemm_bound", "status": "ok",
                            "rounds": b["n"], "median_ms": 1e3 * b["median_s"], "min_ms": 1e3 * b["min_s"],
                            "max_ms": 1e3 * b["max_s"], "spread": b["spread"], "gflops": m["bound"]["gflops"],
                            "frac_ceiling": m["bound"]["frac_ceiling"], "x_bound": 1.0,
                            "page_faults_per_call": r["bound"].get("page_faults_per_call")})
                for name, p in r["providers"].items():
                    row = {"preset": pname, "mode": mode, "provider": name, "status": p.get("status"),
                           "reason": p.get("reason", ""), "note": p.get("note", "")}
                    q = m["providers"].get(name)
                    if q is not None:
                        s = p[mode]
                        corr = p.get("correct") or {}
                        errs = corr.get("max_rel_error") or {}
                        row.update(rounds=s["n"], median_ms=1e3 * s["median_s"], min_ms=1e3 * s["min_s"],
                                   max_ms=1e3 * s["max_s"], spread=s["spread"], gflops=q["gflops"],
                                   frac_ceiling=q["frac_ceiling"], x_bound=q["x_bound"],
                                   x_bound_paired=q["x_bound_paired"],
                                   saved_mb=p.get("saved_bytes", 0) / 2**20,
                                   page_faults_per_call=p.get("page_faults_per_call"),
                                   correct=corr.get("ok", "reference" if name == "hf_v4" else ""),
                                   max_rel_error=max(errs.values()) if errs else "",
                                   budget_limited=bool(p.get("budget_limited")))
                        for f in fast_names:
                            s_f = m["speedup"].get(f, {}).get(name)
                            if s_f is not None:
                                row[f"speedup_of_{f}"] = s_f["min"]
                                row[f"speedup_of_{f}_paired"] = s_f["paired"]
                    w.writerow(row)


def write_chart(path: Path, header: dict, results: list[dict], mode: str) -> bool:
    """Grouped bars: each provider's time as a multiple of the GEMM-only bound (log scale); False
    (nothing written) without matplotlib or without a case of this mode."""
    fig = chart_figure(header, results, mode)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def chart_figure(header: dict, results: list[dict], mode: str):  # noqa: ANN201
    """The chart of :func:`write_chart` as a matplotlib figure, every label inside it (None: nothing to draw)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results if mode in r["metrics"]]
    if not rows:
        return None
    names: list[str] = []
    for r in rows:
        for n in r["metrics"][mode]["providers"]:
            if n not in names:
                names.append(n)
    fig, ax = plt.subplots(figsize=(max(7.0, 2.2 * len(rows) + 3.5), 4.5), layout="constrained")
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        xs, ys = [], []
        for j, r in enumerate(rows):
            q = r["metrics"][mode]["providers"].get(n)
            if q is not None:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(q["x_bound"])
        bars = ax.bar(xs, ys, width, label=n)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
        del bars
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="GEMM-only bound")
    ax.set_yscale("log")
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    xb = [q["x_bound"] for r in rows for q in r["metrics"][mode]["providers"].values()] or [1.0]
    lo, hi = min(0.8, 0.9 * min(xb)), 1.3 * max(xb)
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(FixedLocator([t for t in (0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500)
                                             if lo <= t <= hi]))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["case"]["preset"]["name"] for r in rows])
    ax.set_ylabel(f"{MODE_TITLE[mode]} time\n/ GEMM-only bound (min over rounds)")
    mach = header["machine"]
    ax.set_title(f"{mach['cpu_model']}, {plural(mach['torch_threads'], 'thread')}, {rows[0]['case']['dtype']} "
                 f"({header['date_utc'][:10]})", fontsize=9)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="outside right upper")
    return fig


def format_markdown(header: dict, results: list[dict], mode: str, fast: str) -> str:
    """The run as Markdown: a summary in the paper's Table 3 layout, then one table per case."""
    mach = header["machine"]
    out = [f"Measured {header['date_utc']} with `{header['command']}`  ",
           f"{machine_line(mach)}; clock: {header['settings'].get('clock', 'wall')}; "
           f"load average at start {load_text(mach.get('load_average_at_start'))}, at end "
           f"{load_text(mach.get('load_average_at_end'))}.", ""]
    out.append(f"{fast} {MODE_TITLE[mode]} speedup (min over rounds / median of same-round ratios):")
    out.append("")
    out.append("| preset | rows per expert | vs " + " | vs ".join(SUMMARY_BASELINES) + " | x GEMM-only bound | bound % of ceiling |")
    out.append("|---|---:|" + "---:|" * len(SUMMARY_BASELINES) + "---:|---:|")
    for r, cells, xb in _summary_rows(results, mode, fast, " / ", " *"):
        out.append(f"| {r['case']['preset']['name']} | {r['case']['rows_per_expert']['mean']:.0f} | "
                   + " | ".join(cells) + f" | {xb} | {100 * r['metrics'][mode]['bound']['frac_ceiling']:.0f}% |")
    out += [""] + [f"vs {o}: {BASELINE_NAMES[o]}.  " for o in SUMMARY_BASELINES] + [f"{BOUND_LINE}.", ""]
    if any(c.endswith("*") for _, cells, _ in _summary_rows(results, mode, fast, " / ", " *") for c in cells):
        out += ["\\* fewer rounds than asked (time budget): see the case's note.", ""]
    for r in results:
        m = r["metrics"].get(mode)
        if m is None:
            continue
        out.append(f"**{case_title(r)}**; ceiling {m['ceiling_gflops']:.0f} GFLOP/s, "
                   f"GEMM-only bound {m['bound']['gflops']:.0f} GFLOP/s ({100 * m['bound']['frac_ceiling']:.0f}% of it)")
        out.append("")
        out.append("| provider | median ms | spread | min ms | GFLOP/s | % ceiling | x bound (min / paired) | "
                   f"{fast} speedup (min / paired) | saved for backward MB | page faults per call | rounds | correct vs hf_v4 |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for row in _case_rows(r, mode, fast, " / "):
            name = "GEMM-only bound" if row["name"] == "gemm_bound" else row["name"]
            if "skipped" in row:
                out.append(f"| {name} | skipped: {row['skipped']} | | | | | | | | | | |")
                continue
            speedup = "" if row["speedup"] == "-" else row["speedup"]
            out.append(f"| {name} | {row['median']} | {row['spread']:.0f}% | {row['min']} | {row['gflops']} | "
                       f"{row['ceil']:.0f}% | {row['x_bound']:.2f} / {row['x_paired']} | {speedup} | {row['saved']} | "
                       f"{row['faults']} | {row['rounds']}{row['star']} | {row['correct']} |")
        out += [f"\n\\* {name}: {note}" for name, note in _case_notes(r)]
        out += [f"\n{line}" for line in _precision_lines(r, mode)]
        out.append("")
    return "\n".join(out)


def machine_line(mach: dict) -> str:
    """The machine in one line: CPU, cores, torch threads, versions (the header of every run)."""
    line = (f"{mach['cpu_model']}, {plural(mach['usable_cpus'], 'cpu')}, "
            f"{plural(mach['torch_threads'], 'torch thread')}, "
            f"torch {mach['torch']}, transformers {mach['transformers']}")
    return line + matrix_text(mach)


def matrix_text(mach: dict) -> str:
    """``"; matrix extensions: avx512f avx512_vnni amx_bf16 ... (torch kernels: AVX512)"`` for a
    description that lists them (empty for one from before they were recorded)."""
    if "matrix_extensions" not in mach:
        return ""
    names = " ".join(mach["matrix_extensions"]) or "none of AVX-512, VNNI, AMX"
    cap = mach.get("torch_cpu_capability")
    return f"; matrix extensions: {names}" + (f" (torch kernels: {cap})" if cap else "")

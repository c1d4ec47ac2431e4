"""``fastmoe-bench``: every provider side by side in one process; table, JSON, CSV and PNG; and the
studies (``bench/studies/``), each by its flag or as ``fastmoe-bench NAME``."""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

import torch

from fastmoe_xpu.kernels.registry import CHOICES as GEMM_ENGINES, ENGINES

from .harness.cases import DTYPES, make_case
from .harness.measure import run_options
from .harness.presets import PRESETS, resolve_presets
from .harness.stop import stoppable
from .harness.providers import (ALL_PROVIDERS, EXTERNAL_PROVIDERS, FASTMOE_BACKENDS, NAMED_PROVIDERS, default_fastmoe,
                                expand_names, with_precisions)
from .harness.report import (MODES, case_legend, derive, format_case, format_markdown, format_summary, headline,
                             load_text, machine_line, run_header, write_chart, write_csv, write_json)
from .harness.runner import MIN_SAMPLE_S, run_case
from .harness.usage import Parser, count, fail, nonnegative, output_dir, seconds
from .studies import STUDIES, SUBCOMMANDS


def _studies_help(width: int = 100) -> str:
    """The epilog of ``--help``: every study, how to run it and what it measures, one entry each."""
    lines = ["studies (bench/studies/): a flag of this command, or 'fastmoe-bench NAME [options]' "
             "('NAME --help' for its options):"]
    name_w = max(len(s.name) for s in STUDIES) + 2  # the columns fit the longest name and command
    run_w = max(len(s.run or f"fastmoe-bench {s.name}") for s in STUDIES) + 2
    for s in STUDIES:
        run = s.run or f"fastmoe-bench {s.name}"
        head = f"  {s.name:<{name_w}}{run:<{run_w}}"
        lines += textwrap.wrap(s.measures, width, initial_indent=head, subsequent_indent=" " * len(head))
    return "\n".join(lines)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, except that a text of several lines (the studies' table) is printed as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    description = ("Benchmark FastSparseMoE's expert layer against transformers' references (hf_v4, hf_v5_eager, "
                   "hf_v5_grouped_mm) and, on request, the peers' MoE layers (liger, sonicmoe), with the "
                   "dense-matmul ceiling and the layer's GEMM-only bound measured in the same run.")
    ap = Parser(
        prog="fastmoe-bench", usage="%(prog)s [options]\n       %(prog)s STUDY [options]",
        description=description, epilog=_studies_help(), formatter_class=_HelpFormatter,
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xpu"])
    ap.add_argument("--preset", nargs="+", metavar="NAME",
                    help=f"presets to run ({', '.join(PRESETS)}, 'all' (the Mula presets), 'sweep' (tiny, decode T=1/8/64, the Mula-7B layer) or 'decode' (OLMoE-1B-7B and Qwen3-30B-A3B at T=1/8/64/256)); default: mula-7b-a1b-small mula-7b-a1b")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--out", default="bench_out", help="directory for results.json, results.csv and the chart")
    ap.add_argument("--mode", default="fwdbwd", choices=[*MODES, "infer", "stages"],
                    help="fwd: forward only (of a training step: autograd on); bwd / fwdbwd: forward and "
                         "backward (both reported, the table shows the chosen one); infer: forward under "
                         "torch.no_grad (generation, evaluation); stages: fastmoe launcher by launcher")
    ap.add_argument("--rounds", type=count, default=None,
                    help="timed interleaved rounds (after one cold call; default 5, --table3 3, --quick 1)")
    ap.add_argument("--min-sample-ms", type=nonnegative, default=1e3 * MIN_SAMPLE_S,
                    help="calls shorter than this are timed several in a row, their mean one sample "
                         f"(default {1e3 * MIN_SAMPLE_S:g}; 0: one call per sample)")
    ap.add_argument("--threads", type=count, default=None,
                    help="torch intra-op threads (default: this process's share of the cores, less cores other "
                         "work keeps busy at start; printed)")
    ap.add_argument("--providers", nargs="+", metavar="NAME",
                    help=f"subset of {' '.join(ALL_PROVIDERS)} (the default: all of these) or fastmoe (every "
                         f"backend); {' '.join(NAMED_PROVIDERS)} (transformers' other experts implementation, run "
                         f"when named); the peers {' and '.join(EXTERNAL_PROVIDERS)} (other projects' MoE layers on "
                         "the case's routing, run when named); fastmoe/<backend>@<engine> for one grouped-GEMM "
                         f"engine ({', '.join(ENGINES)}) "
                         "(hf_v4 always runs: it is the correctness reference); with --shapes: only these of "
                         "the set's providers (default: all that run here; the fp32 reference is the check)")
    ap.add_argument("--gemm-engine", default="auto", choices=list(GEMM_ENGINES),
                    help="stage 4's engine for the plain fastmoe/<backend> providers (default auto: timed once "
                         "per device, dtype and shape, its choice named in the provider's note)")
    ap.add_argument("--precision", nargs="+", default=["none"], choices=["none", "int8", "fp8", "fp8-block", "bf16", "bf16-sr"],
                    help="expert-GEMM precisions of the fastmoe providers, side by side in one run: int8 / fp8 / "
                         "fp8-block (block-scaled, quantized in the GEMMs' loads; Triton backend) add "
                         "fastmoe/<backend>:<precision> next to each fastmoe provider (none: the plain one); "
                         "with --table3, precision rows for the F+B and training columns against fastmoe in fp32 "
                         "(bf16: bf16 weights, fp32 master; bf16-sr: bf16 weights, stochastic rounding; "
                         "training column only)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="with --mode infer on --device cuda: capture each provider's forward once in a CUDA graph "
                         "and time its replays (decode as servers run it; try --preset decode); a provider that "
                         "cannot be captured is timed eagerly and says why")
    ap.add_argument("--budget", type=nonnegative, default=120.0,
                    help="seconds of timed calls one provider may take per case; slower ones run fewer "
                         "rounds (flagged), at least their cold call")
    ap.add_argument("--routing", default="router", choices=["router", "uniform"],
                    help="router: OLMoE's top-k router on random weights; uniform: forced uniform routing")
    ap.add_argument("--ceiling-size", type=count, default=None,
                    help="n of the n x n dense-matmul ceiling (default 4096; 256 for tiny presets)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall: elapsed time (default); cpu: the process's CPU time, which leaves out "
                         "time other jobs hold the cores (use with --threads 1 on a shared machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG")
    ap.add_argument("--engines", nargs="?", const="list", choices=["list", "clear"], default=None,
                    help="list the auto engine choices cached on disk with their timings and how they were taken "
                         "(list, the default), or remove them (clear); nothing is benchmarked")
    fam = ap.add_argument_group("families", "one experts layer of a transformers MoE family at its published "
                                "shape: the family's eager and grouped_mm against fastmoe (bench/studies/families.py)")
    fam.add_argument("--family", default=None, metavar="NAME", help="qwen3_moe, gpt_oss or mixtral")
    fam.add_argument("--family-scale", type=count, default=1,
                     help="with --family: divide H and I by this (a layer too large or slow here; printed)")
    fam.add_argument("--tokens", type=count, default=None, help="with --family: tokens of the layer call (default 2048)")
    fam.add_argument("--family-models", nargs="*", default=None, metavar="NAME",
                     help="whole tiny models instead (hidden 128, 8 experts, 4 x 64 tokens): transformers' grouped_mm "
                          "against fastmoe, forward+backward, median of same-round ratios and first calls "
                          "(default: qwen3_moe mixtral deepseek_v3 gpt_oss olmoe)")
    sh = ap.add_argument_group("shapes", "one MoE layer at each shape of a published set, in TFLOP/s beside a dense "
                               "torch.mm of the same FLOPs (bench/studies/practitioners.py)")
    sh.add_argument("--shapes", default=None, choices=["practitioners"],
                    help="OLMoE-1B-7B, Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-20B, Mixtral-8x7B, DeepSeek-V3 EP=8 slice")
    sh.add_argument("--shape-tokens", type=count, default=None, help="with --shapes: T (default 32768 on a GPU, 256 here)")
    sh.add_argument("--shape-names", nargs="+", default=None, metavar="NAME",
                    help="with --shapes: only these shapes of the set (e.g. qwen3-30b-a3b olmoe-1b-7b)")
    sh.add_argument("--shape-scale", type=count, default=None,
                    help="with --shapes: divide H and I by this (default 1 on a GPU, 8 on the CPU)")
    cg = ap.add_argument_group("compile", "whole-model F+B, eager vs torch.compile (bench/studies/compiled.py)")
    cg.add_argument("--compile", action="store_true",
                    help="fastmoe and transformers grouped_mm, eager and compiled, compile time apart from step time")
    cg.add_argument("--compile-models", nargs="+", metavar="NAME", default=None,
                    help="with --compile: tiny-moe and/or olmoe-mid (default both)")
    t3 = ap.add_argument_group("Table 3", "the published speedup table, layer to training step (bench/studies/table3/table.py)")
    t3.add_argument("--table3", action="store_true",
                    help="measure the five Table-3 columns for the four Mula models, the published rows beside")
    t3.add_argument("--demo", action="store_true",
                    help="a first number in well under a minute: forward+backward of a Mula-7B-A1B layer slice, "
                         "fastmoe against transformers' default (grouped_mm), with the GEMM-only bound")
    t3.add_argument("--quick", action="store_true", help="with --table3: tiny sizes, one round (tests)")
    t3.add_argument("--models", dest="table3_models", nargs="+", metavar="NAME",
                    help="with --table3: a subset of mula-7b-a1b mula-20b-a2b mula-100b-a7b mula-220b-a10b")
    t3.add_argument("--layers", type=count, default=None, help="with --table3: layers of the scaled models (default 2)")
    t3.add_argument("--train-experts", type=count, default=None,
                    help="with --table3: experts of the scaled training models (default 16)")
    t3.add_argument("--fb-tokens-per-rank", type=count, default=None,
                    help="with --table3: tokens per rank of the F+B layer (default 256; x EP under EP)")
    t3.add_argument("--context", type=count, default=None, help="with --table3: tokens per training instance (default 64)")
    t3.add_argument("--blocks", type=count, default=None,
                    help="with --table3: alternating sharded/epso blocks on the DP x EP processes (default 2)")
    t3.add_argument("--dist-timeout", type=seconds, default=1800.0,
                    help="with --table3: seconds the DP x EP processes may take in all")
    return ap


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    if device == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError("--device xpu: no XPU device is visible to torch")


def main(argv: list[str] | None = None) -> int:
    return stoppable(lambda: _main(sys.argv[1:] if argv is None else list(argv)))


def _main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:  # a study with a command line of its own
        study = importlib.import_module(f"{__package__}.studies.{argv[0]}")
        return study.main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    if not args.engines:  # every other run writes into --out: a path that cannot take it is told before any work
        output_dir(args.out)
    try:
        return _run(args)
    except ValueError as exc:  # bad input (an unknown preset, a value out of range): one line, no traceback
        fail(f"error: {exc} (see fastmoe-bench --help)")


def _run(args: argparse.Namespace) -> int:
    if args.engines:
        from .harness.engines_cache import run_engines

        return run_engines(args.engines)
    if args.cuda_graph and (args.mode != "infer" or args.device != "cuda"):
        raise ValueError("--cuda-graph captures inference calls on a CUDA device: it needs --mode infer and "
                         f"--device cuda (got --mode {args.mode} --device {args.device})")
    _check_device(args.device)
    from fastmoe_xpu.threads import configure

    print(f"fastmoe-bench: {configure(args.threads).summary}", file=sys.stderr, flush=True)
    if args.family_models is not None:
        from .studies.families import run_tiny_models

        return run_tiny_models(args)
    if args.family:
        from .studies.families import run_family

        return run_family(args)
    if args.shapes:
        from .studies.practitioners import run_shapes

        return run_shapes(args)
    if args.compile:
        from .studies.compiled import main_compile

        return main_compile(args)
    if args.demo:
        from .studies.demo import run_demo

        return run_demo(args)
    if args.table3:
        from .studies.table3.table import main_table3

        return main_table3(args)
    training_only = [p for p in args.precision if p in ("bf16", "bf16-sr")]
    if training_only:
        raise ValueError(f"--precision {training_only[0]} is a training mode: it needs --table3 (the layer "
                         "benchmark takes --dtype bf16)")
    args.rounds = run_options(args)
    if args.min_sample_ms < 0:
        raise ValueError(f"--min-sample-ms must be >= 0, got {args.min_sample_ms}")
    presets = resolve_presets(args.preset)
    names = with_precisions(expand_names(args.providers), args.precision)
    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items()}
    header = run_header(device, settings)
    progress = not args.no_progress
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    m = header["machine"]
    print(f"# {header['date_utc']}  {machine_line(m)}, triton {m['triton']}")
    print(f"# {header['command']}")
    print(f"# clock: {args.clock}; load average at start: {load_text(m['load_average_at_start'])}")

    torch.set_grad_enabled(True)
    if args.mode == "stages":
        from .studies.stages import format_stages, run_stages

        results = []
        backends = [n.split("/", 1)[1] for n in names if n.startswith("fastmoe/")] or list(FASTMOE_BACKENDS)
        for p in presets:
            log(f"{p.name}: building inputs")
            case = make_case(p, dtype=args.dtype, device=device, seed=args.seed, routing=args.routing)
            res = run_stages(case, backends, rounds=args.rounds, progress=progress, log=log)
            print(format_stages(res), flush=True)
            results.append(res)
            del case
            gc.collect()
        (out_dir / "stages.json").write_text(json.dumps({**header, "cases": results}, indent=2) + "\n")
        print(f"# wrote {out_dir / 'stages.json'}")
        return 0

    backward = args.mode not in ("fwd", "infer")
    mode = args.mode
    fast_names = [n for n in names if n.startswith("fastmoe/")]
    fast = default_fastmoe(device)
    if fast not in fast_names and fast_names:
        fast = fast_names[0]
    results = []
    all_ok = True
    for p in presets:
        log(f"{p.name}: building inputs")
        case = make_case(p, dtype=args.dtype, device=device, seed=args.seed, routing=args.routing)
        ceiling_n = args.ceiling_size or (256 if p.name.startswith("tiny") else 4096)
        res = run_case(case, names, backward=backward, rounds=args.rounds, budget_s=args.budget,
                       ceiling_n=ceiling_n, progress=progress, log=log, gemm_engine=args.gemm_engine,
                       min_sample_s=args.min_sample_ms / 1e3, inference=args.mode == "infer",
                       cuda_graph=args.cuda_graph)
        derive(res, fast_names)
        print()
        print(format_case(res, mode, fast, legend=False), flush=True)
        for n, pr in res["providers"].items():  # which engine 'auto' took, beside the engines measured apart
            if "GEMM engine auto ->" in (pr.get("note") or ""):
                print(f"  {n}: {pr['note'].split(', ')[-1]}", flush=True)
        for n, pr in res["providers"].items():
            if pr.get("correct") is not None and not pr["correct"]["ok"]:
                all_ok = False
        results.append(res)
        del case
        gc.collect()

    header["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print()
    print("\n".join(headline(results, mode, fast)))
    print()
    print(format_summary(results, mode, fast))  # the GEMM-only bound's line among its notes
    print("\n".join(case_legend(bound=False)))
    print(f"# load average at end: {load_text(header['machine']['load_average_at_end'])}")
    write_json(out_dir / "results.json", header, results)
    write_csv(out_dir / "results.csv", header, results, fast_names)
    (out_dir / "results.md").write_text(format_markdown(header, results, mode, fast) + "\n", encoding="utf-8")
    wrote = [out_dir / "results.json", out_dir / "results.csv", out_dir / "results.md"]
    if not args.no_chart and write_chart(out_dir / f"chart_{mode}.png", header, results, mode):
        wrote.append(out_dir / f"chart_{mode}.png")
    print("# wrote " + ", ".join(str(w) for w in wrote))
    if not all_ok:
        print("# CORRECTNESS FAILURE: a provider disagrees with hf_v4 (see 'correct' above)", file=sys.stderr)
        return 1
    return 0

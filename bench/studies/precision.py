"""Convergence and training speed of the precisions, one run each on the same seed and data.

``python -m bench precision --steps 150 --out docs/bench_results/precision`` trains the ``tiny-moe``
preset (or ``--preset``) from the same seed on the embedded corpus in every variant:

=============  ====================================================================================
fp32           fp32 weights, gradients and optimizer
bf16-mixed     bf16 weights and gradients, fp32 master weights in the optimizer
bf16-plain     bf16 weights, no master: updates rounded to nearest
bf16-sr        bf16 weights, no master: updates rounded stochastically
int8-experts   fp32 model, every expert GEMM (forward, input and weight gradient) quantized to int8
fp8-experts    the same in fp8 (e4m3 forward, e5m2 gradients)
=============  ====================================================================================

and writes ``results.json``, ``results.md`` (final training loss as the mean of the last 10
steps, validation loss, steps/s, optimizer bytes per parameter) and ``loss.png`` (the loss curves in
one chart). The AQT comparison rides along: the models trained in fp32 and bf16-mixed are evaluated
again with their expert GEMMs quantized to int8 after training (post-training quantization), next
to the int8-trained model's validation loss. Runs go one after another: on a shared machine the
steps/s column is as noisy as the load; the layer benchmark (``python -m bench --precision``)
interleaves its variants instead.

``python -m bench precision --layer int8-layer mula-7b-a1b --rounds 5 --threads 1`` times one expert
layer's forward + backward (stages 2-5, the torch backend) in fp32 and in bf16 (each on its ``auto``
engine) and in each quantized precision on the fp32 model and on the bf16 model, with the layer's
six GEMMs alone on fp32 and bf16 ``torch.mm`` and on ``torch._int_mm``, all interleaved in the same
rounds (the order rotating each round), and prints the minimum over rounds and the medians of
same-round ratios: each precision over fp32, over bf16 and over the faster of the two, beside G
(``torch._int_mm``'s speed over the faster float GEMM at the layer's GEMM shapes), the goal
``max(1.5, G/2)``, and the bf16 layer over its GEMM-only bound; the CPU's model and matrix
extensions head the output. The first call of each variant (which compiles the fused int8 passes
and times the engine choice) is not timed.
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any, Callable
from ..harness.usage import Parser, count, output_dir

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16-mixed": {"model.param_dtype": "bf16"},
    "bf16-plain": {"model.param_dtype": "bf16", "optim.master_weights": False},
    "bf16-sr": {"model.param_dtype": "bf16", "optim.stochastic_rounding": True},
    "int8-experts": {"model.expert_precision": "int8"},
    "fp8-experts": {"model.expert_precision": "fp8"},
}
#: Variants evaluated again with int8 expert GEMMs after training (post-training quantization).
PTQ = ("fp32", "bf16-mixed")


def _config(preset: str, steps: int, out: Path, over: dict[str, Any], context: int, micro_batch: int, seed: int):
    from trainer.config.presets import get_preset

    cfg = get_preset(preset)
    cfg.seed = seed
    cfg.data.context = context
    cfg.schedule.steps, cfg.schedule.micro_batch = steps, micro_batch
    cfg.schedule.global_batch = micro_batch
    cfg.schedule.warmup_steps = max(1, steps // 10)
    cfg.logging.out = str(out)
    cfg.logging.progress = cfg.logging.plot = cfg.logging.tensorboard = False
    cfg.logging.peak_tflops = 1.0
    for key, value in over.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _set_precision(model: Any, precision: str | None) -> int:
    blocks = [m for m in model.modules() if hasattr(m, "expert_precision")]
    for m in blocks:
        m.expert_precision = precision
    return len(blocks)


def _steps_per_s(hist: list[dict[str, Any]], cfg: Any, seconds: float) -> float:
    """Steps per second of the steady state: the median step time after the first (which pays for
    buffers and compilation), from the tokens/s the trainer records; the whole run's rate where the
    records lack it."""
    tokens = cfg.schedule.global_batch * cfg.data.context
    rates = sorted(r["tokens_per_s"] for r in hist[1:] if r.get("tokens_per_s"))
    return rates[len(rates) // 2] / tokens if rates else len(hist) / seconds


def run(preset: str, steps: int, out: Path, variants: list[str], context: int, micro_batch: int,
        seed: int, sets: dict[str, Any] | None = None) -> dict[str, Any]:
    """One training run per variant; a variant named again runs again, its steps/s the best of its
    runs (alternate them to compare speed on a shared machine)."""
    import torch

    from trainer.trainer import Trainer

    results: dict[str, Any] = {}
    for name in variants:
        cfg = _config(preset, steps, out / name, {**(sets or {}), **VARIANTS[name]}, context, micro_batch, seed)
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        hist = trainer.fit()
        seconds = time.perf_counter() - t0
        val = trainer.evaluate()["val_loss"]
        n = sum(p.numel() for p in trainer.model.parameters())
        res = {
            "overrides": VARIANTS[name], "losses": [r["loss"] for r in hist],
            "train_loss_last10": sum(r["loss"] for r in hist[-10:]) / min(10, len(hist)),
            "val_loss": val, "steps_per_s": _steps_per_s(hist, cfg, seconds), "seconds": seconds,
            "optimizer_bytes_per_param": trainer.optimizer.state_bytes() / n,
            "diverged": any(r["loss"] != r["loss"] or r["loss"] > 1e3 for r in hist),
        }
        if name in results:  # a repeat: only the speed is new
            results[name]["steps_per_s_runs"].append(res["steps_per_s"])
            results[name]["steps_per_s"] = max(results[name]["steps_per_s_runs"])
            print(f"{name:13s} again: {res['steps_per_s']:.3f} steps/s", flush=True)
            continue
        res["steps_per_s_runs"] = [res["steps_per_s"]]
        if name in PTQ:
            if not _set_precision(trainer.model, "int8"):
                raise RuntimeError("no FastSparseMoeBlock in the model: nothing to quantize")
            with torch.no_grad():
                res["val_loss_ptq_int8"] = trainer.evaluate()["val_loss"]
        results[name] = res
        print(f"{name:13s} train {res['train_loss_last10']:.4f}  val {val:.5f}"
              + (f"  val after int8 PTQ {res['val_loss_ptq_int8']:.5f}" if name in PTQ else "")
              + f"  {res['steps_per_s']:.2f} steps/s", flush=True)
    return results


def markdown(results: dict[str, Any], header: str) -> str:
    lines = [header, "", "| variant | final train loss (mean of last 10) | validation loss | val loss, int8 after training "
             "| steps/s | optimizer B/param |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        ptq = f"{r['val_loss_ptq_int8']:.5f}" if "val_loss_ptq_int8" in r else ""
        lines.append(f"| {name} | {r['train_loss_last10']:.4f} | {r['val_loss']:.5f} | {ptq} | "
                     f"{r['steps_per_s']:.2f} | {r['optimizer_bytes_per_param']:.0f} |")
    if "int8-experts" in results and "fp32" in results:
        f, q = results["fp32"], results["int8-experts"]
        lines += ["", f"AQT comparison (validation loss gap to fp32): int8-trained {q['val_loss'] - f['val_loss']:+.4f}, "
                  f"fp32-trained then quantized to int8 {f['val_loss_ptq_int8'] - f['val_loss']:+.4f}"]
    return "\n".join(lines) + "\n"


def chart(results: dict[str, Any], path: Path, window: int = 25, preset: str = "tiny-moe") -> None:
    """The loss curves (moving average over ``window`` steps) and, below, each one's difference to
    fp32's, where the precisions separate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(v: list[float]) -> list[float]:
        return [sum(v[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(v))]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    base = smooth(results["fp32"]["losses"]) if "fp32" in results else None
    for name, r in results.items():
        curve = smooth(r["losses"])
        steps = range(1, len(curve) + 1)
        (line,) = top.plot(steps, curve, label=name, linewidth=1)
        if base is not None and name != "fp32":
            bottom.plot(steps, [c - b for c, b in zip(curve, base)], label=name, linewidth=1, color=line.get_color())
    top.set_ylabel(f"training loss ({window}-step mean)")
    top.set_title(f"{preset} on the embedded corpus: same seed and data per precision")
    top.legend()
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("difference to fp32")
    bottom.set_xlabel("step")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _IntGemms:
    """The layer's six GEMMs per expert (:class:`..harness.bounds.GemmBound`'s, the same layouts) on
    ``torch._int_mm`` with int8 operands and int32 results: what the int8 GEMMs alone take, no
    quantization or dequantization."""

    def __new__(cls, case):  # noqa: ANN001, ANN204
        import torch

        from ..harness.bounds import GemmBound

        class IntGemmBound(GemmBound):
            mm = staticmethod(torch._int_mm)

        bound = IntGemmBound(case)
        g = torch.Generator().manual_seed(3)
        for name in ("w_gu", "w_d", "a", "h", "dy", "dgu"):
            t = getattr(bound, name)
            setattr(bound, name, torch.randint(-127, 128, tuple(t.shape), generator=g, dtype=torch.int8))
        for name in ("gu", "y", "dh", "da", "dw_gu", "dw_d"):
            setattr(bound, name, torch.empty(tuple(getattr(bound, name).shape), dtype=torch.int32))
        return bound


def _gemm_fns(bound) -> dict:  # noqa: ANN001
    """``{GEMM name: callable}`` of a bound, and ``"all"``: its forward and backward."""
    fns = {name: getattr(bound, name) for name in bound.GEMMS}
    fns["all"] = lambda: (bound.forward(), bound.backward())
    return fns


def _paired_median(a: list[float], b: list[float]) -> float:
    """The median of same-round ratios ``a[r] / b[r]``."""
    ratios = sorted(x / y for x, y in zip(a, b))
    return ratios[len(ratios) // 2]


#: The variants :func:`layer` times in the same rounds: (label, model dtype, expert precision).
FLOAT_VARIANTS = (("fp32", "fp32", None), ("bf16", "bf16", None))


def layer(preset_names: list[str], precisions: list[str], rounds: int,
          done: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Each preset's layer forward + backward (stages 2-5, the torch backend) in fp32 and in bf16 (the
    stage-4 engine ``auto``, each dtype's fastest), and in each quantized precision on the fp32 model
    and on the bf16 model (``<precision>/bf16``), interleaved in the same rounds (the order rotating),
    with the GEMM-only bounds of the three GEMMs (fp32 and bf16 ``torch.mm``, int8 ``torch._int_mm``)
    in the same rounds. One row per precision: its speed over fp32, over bf16 and over the faster of
    the two (``float_best``), and G, ``torch._int_mm``'s speed over the faster float GEMM at the
    layer's six GEMM shapes (their sums; per GEMM in ``gemms``). ``done(rows)``: called with the rows so
    far after each preset (the caller writes them: a run killed at a later preset keeps the earlier)."""
    import torch

    from fastmoe_xpu.autograd.moe_experts import moe_experts_forward

    from ..harness.bounds import GemmBound
    from ..harness.cases import make_case
    from ..harness.presets import resolve_presets

    rows = []
    for preset in resolve_presets(preset_names):
        cases = {dt: make_case(preset, dtype=dt, device="cpu") for dt in ("fp32", "bf16")}
        leaves = {dt: [t.detach().requires_grad_(True) for t in (c.x_TH, c.w_gate_up_N2IH, c.w_down_NHI)]
                  for dt, c in cases.items()}

        def run(dt: str, precision: str | None) -> None:
            x, w_gu, w_d = leaves[dt]
            c = cases[dt]
            out = moe_experts_forward(x, c.weights_TK, c.topk_idx_TK, w_gu, w_d, backend="torch",
                                      gemm_engine="auto", expert_precision=precision)
            out.backward(torch.ones_like(out))
            x.grad = w_gu.grad = w_d.grad = None

        variants = {label: functools.partial(run, dt, p) for label, dt, p in FLOAT_VARIANTS}
        for p in precisions:
            variants[p] = functools.partial(run, "fp32", p)
            variants[f"{p}/bf16"] = functools.partial(run, "bf16", p)
        gemms = {"fp32": _gemm_fns(GemmBound(cases["fp32"])), "bf16": _gemm_fns(GemmBound(cases["bf16"])),
                 "int8": _gemm_fns(_IntGemms(cases["fp32"]))}
        for kind, fns in gemms.items():
            for name, fn in fns.items():
                variants[f"gemm {kind} {name}"] = fn
        names = list(variants)
        for name in names:
            variants[name]()  # cold: buffers, engine choices, the int8 kernels' compilation
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                variants[n]()
                times[n].append(time.perf_counter() - t0)
        best = {n: min(v) for n, v in times.items()}
        faster = "bf16" if _paired_median(times["fp32"], times["bf16"]) > 1 else "fp32"
        per_gemm = {}
        for name in (*GemmBound.GEMMS, "all"):
            f32, b16, i8 = (best[f"gemm {k} {name}"] for k in ("fp32", "bf16", "int8"))
            per_gemm[name] = {"fp32_s": f32, "bf16_s": b16, "int8_s": i8, "G": min(f32, b16) / i8}
        G = per_gemm["all"]["G"]
        bf16_bound = best["gemm bf16 all"]
        print(f"{preset.name}: F+B min ms fp32 {best['fp32'] * 1e3:.0f}, bf16 {best['bf16'] * 1e3:.0f} "
              f"(faster float: {faster}; bf16 over fp32 {_paired_median(times['fp32'], times['bf16']):.2f}x); "
              f"GEMM-only bound fp32 {best['gemm fp32 all'] * 1e3:.0f}, bf16 {bf16_bound * 1e3:.0f}, "
              f"int8 {best['gemm int8 all'] * 1e3:.0f}; bf16 layer {best['bf16'] / bf16_bound:.2f}x its bound",
              flush=True)
        print("  G per GEMM (int_mm over the faster float mm): "
              + ", ".join(f"{n} {v['G']:.2f}" for n, v in per_gemm.items() if n != "all")
              + f"; G = {G:.2f} over the six", flush=True)
        goal = max(1.5, G / 2)
        for p in precisions:
            row = {"preset": preset.name, "precision": p, "rounds": rounds, "faster_float": faster, "G": G,
                   "goal": goal, "fp32_min_s": best["fp32"], "bf16_min_s": best["bf16"], "min_s": best[p],
                   "speedup_min": best["fp32"] / best[p],
                   "speedup_paired_median": _paired_median(times["fp32"], times[p]),
                   "over_bf16_paired_median": _paired_median(times["bf16"], times[p]),
                   "over_float_best_paired_median": _paired_median(times[faster], times[p]),
                   "bf16_weights": {"min_s": best[f"{p}/bf16"],
                                    "over_bf16_paired_median": _paired_median(times["bf16"], times[f"{p}/bf16"]),
                                    "over_float_best_paired_median": _paired_median(times[faster],
                                                                                    times[f"{p}/bf16"])},
                   "bf16_over_bound": best["bf16"] / bf16_bound, "gemms": per_gemm,
                   "fp32_s": times["fp32"], "bf16_s": times["bf16"], "s": times[p], "bf16_weights_s": times[f"{p}/bf16"]}
            rows.append(row)
            print(f"  {p}: {row['min_s'] * 1e3:.0f} ms, over fp32 {row['speedup_paired_median']:.2f}x, over bf16 "
                  f"{row['over_bf16_paired_median']:.2f}x, over the faster float ({faster}) "
                  f"{row['over_float_best_paired_median']:.2f}x [goal {goal:.2f}x: max(1.5, G/2), G = {G:.2f}]; "
                  f"on bf16 weights {row['bf16_weights']['min_s'] * 1e3:.0f} ms, over the faster float "
                  f"{row['bf16_weights']['over_float_best_paired_median']:.2f}x (paired medians)", flush=True)
        del cases, leaves, gemms, variants
        if done is not None:
            done(rows)
    return rows


def layer_markdown(rows: list[dict[str, Any]], machine: dict[str, Any], cmd: str) -> str:
    """The rows of :func:`layer` as a markdown table under the command, date and CPU."""
    lines = [f"Measured {machine['date_utc']} with `{cmd}`  ",
             f"{machine['cpu_model']} ({', '.join(machine['matrix_extensions']) or 'no AVX-512 / AMX'}), "
             f"{machine['torch_threads']} torch threads, torch {machine['torch']}; F+B min over rounds, ratios the "
             "median of same-round ratios.", "",
             "| preset | precision | fp32 ms | bf16 ms | faster float | precision ms | over fp32 | over bf16 | over the "
             "faster float | G | goal max(1.5, G/2) | on bf16 weights ms | on bf16 weights over the faster float "
             "| bf16 layer over its GEMM-only bound |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['precision']} | {r['fp32_min_s'] * 1e3:.0f} | {r['bf16_min_s'] * 1e3:.0f} | "
                     f"{r['faster_float']} | {r['min_s'] * 1e3:.0f} | {r['speedup_paired_median']:.2f}x | "
                     f"{r['over_bf16_paired_median']:.2f}x | {r['over_float_best_paired_median']:.2f}x | {r['G']:.2f} | "
                     f"{r['goal']:.2f}x | {r['bf16_weights']['min_s'] * 1e3:.0f} | "
                     f"{r['bf16_weights']['over_float_best_paired_median']:.2f}x | {r['bf16_over_bound']:.2f}x |")
    lines += ["", "G per GEMM (`torch._int_mm` over the faster of fp32 and bf16 `torch.mm`, the layer's per-expert shapes):",
              "", "| preset | " + " | ".join(rows[0]["gemms"]) + " |", "|---|" + "---:|" * len(rows[0]["gemms"])]
    seen = set()
    for r in rows:
        if r["preset"] not in seen:
            seen.add(r["preset"])
            lines.append(f"| {r['preset']} | " + " | ".join(f"{v['G']:.2f}" for v in r["gemms"].values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--steps", type=count, default=150)
    ap.add_argument("--context", type=count, default=32)
    ap.add_argument("--micro-batch", type=count, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=count, default=None)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="the variants, in order; one named twice runs twice (best steps/s kept)")
    ap.add_argument("--set", nargs="+", default=[], metavar="SECTION.FIELD=VALUE",
                    help="overrides of the preset for every variant, e.g. model.hidden_size=1024")
    ap.add_argument("--out", default="precision_out")
    ap.add_argument("--layer", nargs="+", metavar="PRESET", default=None,
                    help="time one layer's F+B at these bench presets instead: fp32, bf16 and --precision side by "
                         "side, with G (int_mm over the faster float GEMM at the layer's shapes)")
    ap.add_argument("--precision", nargs="+", default=["int8"], choices=["int8", "fp8"])
    ap.add_argument("--rounds", type=count, default=3)
    args = ap.parse_args(argv)
    output_dir(args.out)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.layer:
        import datetime

        from fastmoe_xpu.device import cpu_matrix_extensions, cpu_model

        machine = {"cpu_model": cpu_model(), "matrix_extensions": list(cpu_matrix_extensions()),
                   "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                   "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        print(f"{machine['cpu_model']} ({', '.join(machine['matrix_extensions']) or 'no AVX-512 / AMX'}), "
              f"{machine['torch_threads']} torch threads, torch {machine['torch']}", flush=True)
        cmd = (f"python -m bench precision --layer {' '.join(args.layer)} --precision {' '.join(args.precision)} "
               f"--rounds {args.rounds}" + (f" --threads {args.threads}" if args.threads else ""))

        def write(rows: list[dict[str, Any]]) -> None:
            (out / "layer.json").write_text(json.dumps({"command": cmd, "machine": machine, "rows": rows}, indent=1)
                                            + "\n")
            (out / "layer.md").write_text(layer_markdown(rows, machine, cmd))

        layer(args.layer, args.precision, args.rounds, done=write)
        return 0
    sets = {}
    for item in args.set:
        key, _, value = item.partition("=")
        sets[key] = int(value) if value.lstrip("-").isdigit() else value
    results = run(args.preset, args.steps, out / "runs", args.variants, args.context, args.micro_batch, args.seed,
                  sets)
    cmd = (f"python -m bench precision --preset {args.preset} --steps {args.steps} --context {args.context} "
           f"--micro-batch {args.micro_batch} --seed {args.seed}" + (f" --threads {args.threads}" if args.threads else "")
           + (f" --variants {' '.join(args.variants)}" if args.variants != list(VARIANTS) else "")
           + (f" --set {' '.join(args.set)}" if args.set else ""))
    (out / "results.json").write_text(json.dumps({"command": cmd, "results": results}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results, f"`{cmd}`"))
    chart(results, out / "loss.png", preset=args.preset)
    print(markdown(results, f"`{cmd}`"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

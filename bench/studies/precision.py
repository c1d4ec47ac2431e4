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

``python -m bench precision --layer mula-7b-a1b --rounds 3`` times one expert layer's forward +
backward (stages 2-5, the torch backend on the ``loop`` engine) in fp32 against each quantized
precision, interleaved in the same rounds (the order rotating each round), and prints the minimum
over rounds and the median of same-round ratios: the comparison a shared machine allows. The first
call of each precision (which compiles the fused int8 passes) is not timed.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
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


def layer(preset_names: list[str], precisions: list[str], rounds: int) -> list[dict[str, Any]]:
    import torch

    from fastmoe_xpu.autograd.moe_experts import moe_experts_forward

    from ..harness.cases import make_case
    from ..harness.presets import resolve_presets

    rows = []
    for preset in resolve_presets(preset_names):
        case = make_case(preset, dtype="fp32", device="cpu")
        w_gu = case.w_gate_up_N2IH.detach().requires_grad_(True)
        w_d = case.w_down_NHI.detach().requires_grad_(True)
        x = case.x_TH.detach().requires_grad_(True)

        def run(precision):  # noqa: ANN001, ANN202
            out = moe_experts_forward(x, case.weights_TK, case.topk_idx_TK, w_gu, w_d, backend="torch",
                                      gemm_engine="loop", expert_precision=precision)
            out.backward(torch.ones_like(out))
            x.grad = w_gu.grad = w_d.grad = None

        names = [None, *precisions]
        for p in names:
            run(p)  # cold: buffers, the int8 kernels' compilation
        times: dict[Any, list[float]] = {p: [] for p in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for p in order:
                t0 = time.perf_counter()
                run(p)
                times[p].append(time.perf_counter() - t0)
        base = times[None]
        for p in precisions:
            ratios = sorted(b / q for b, q in zip(base, times[p]))
            row = {"preset": preset.name, "precision": p, "fp32_min_s": min(base), "min_s": min(times[p]),
                   "speedup_min": min(base) / min(times[p]), "speedup_paired_median": ratios[len(ratios) // 2],
                   "rounds": rounds, "fp32_s": base, "s": times[p]}
            rows.append(row)
            print(f"{preset.name:20s} F+B fp32 {row['fp32_min_s'] * 1e3:.0f} ms  {p} {row['min_s'] * 1e3:.0f} ms  "
                  f"speedup {row['speedup_min']:.2f}x (min) | {row['speedup_paired_median']:.2f}x (paired median)",
                  flush=True)
        del case
    return rows


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
                    help="time one layer's F+B at these bench presets instead (fp32 against --precision)")
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
        rows = layer(args.layer, args.precision, args.rounds)
        cmd = (f"python -m bench precision --layer {' '.join(args.layer)} --precision {' '.join(args.precision)} "
               f"--rounds {args.rounds}" + (f" --threads {args.threads}" if args.threads else ""))
        (out / "layer.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
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

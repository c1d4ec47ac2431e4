"""What the end of a training run leaves behind besides metrics and checkpoints: the MoE health
charts, the transformers export with generated samples (``--eval.export_hf DIR``), and a short
printed account of the validation loss, a sample and the paths."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..layout import barrier


def finish_run(trainer: Any) -> dict[str, Any]:
    """Collective: every rank takes part in the export's checkpoint write; rank 0 does the rest."""
    cfg, lay = trainer.cfg, trainer.layout
    out = trainer.out_dir
    art: dict[str, Any] = trainer.artefacts
    hist = trainer.run_records() if lay.is_main else trainer.history  # the whole run's charts (resumes included)
    if lay.is_main and hist:
        art["loss_chart"] = os.path.join(out, "loss.png") if cfg.logging.plot else None
        if cfg.logging.plot and any("moe_tokens_per_expert" in r for r in hist):
            from ..records.moe_health import plot_moe

            title = f"{cfg.preset} (PP {lay.pp} x DP {lay.dp} x EP {lay.ep})"
            heat, imb = os.path.join(out, "moe_load.png"), os.path.join(out, "moe_imbalance.png")
            plot_moe(hist, heat, imb, title=title)
            art["moe_load_heatmap"], art["moe_imbalance_chart"] = heat, imb
        writer = getattr(trainer, "writer", None)
        if writer is not None and writer.tensorboard_enabled:
            art["tensorboard"] = os.path.join(out, "tensorboard")
    if trainer.eval_history:
        art["val_loss"] = trainer.eval_history[-1]["val_loss"]
        art["val_ppl"] = trainer.eval_history[-1]["val_ppl"]
        art["val_tokens"] = trainer.eval_history[-1]["val_tokens"]
        per_source = {k.split("/", 1)[1]: v for k, v in trainer.eval_history[-1].items() if k.startswith("val_loss/")}
        if per_source:  # a mixture's sources
            art["val_sources"] = per_source
    if cfg.eval.export_hf:
        _export(trainer, art)
    if lay.is_main and hist:
        with open(os.path.join(out, "artefacts.json"), "w", encoding="utf-8") as f:
            json.dump(art, f, indent=2)
        _print(art)
    return art


def _export(trainer: Any, art: dict[str, Any]) -> None:
    from ..checkpoint.save import save_model
    from .export import ExportError, export_hf

    cfg, lay = trainer.cfg, trainer.layout
    root = cfg.checkpoint.dir or os.path.join(trainer.out_dir, "checkpoints")
    # the parameter dtype, not the bf16 of periodic snapshots: the export reproduces the trainer's logits
    stats = save_model(root, step=trainer.step, model=trainer.model, layout=lay, dtype=None,
                       meta={"preset": cfg.preset, **trainer._export_meta()})
    if lay.is_main:
        try:
            res = export_hf(stats.path, cfg.eval.export_hf, overwrite=cfg.eval.overwrite)
            art["export"] = str(res.out)
            art["export_peak_bytes"] = res.peak_bytes
        except ExportError as e:
            # e.g. the folder was created or filled while the run trained: the trained model is in the
            # model-only checkpoint just written, so the run ends its records and says how to export
            art["export_error"] = (f"export to {cfg.eval.export_hf} failed: {' '.join(str(e).split())}; the "
                                   f"trained model is saved in {stats.path}: fastmoe-export --checkpoint "
                                   f"{stats.path} --out DIR writes it")
            print(f"error: {art['export_error']}", file=sys.stderr, flush=True)
    barrier(lay)
    if lay.is_main and cfg.eval.samples and "export" in art:
        from .generate import format_samples, generate_samples, save_samples

        samples = generate_samples(art["export"], seed=cfg.seed, max_new_tokens=cfg.eval.sample_tokens)
        art["samples"] = save_samples(samples, os.path.join(trainer.out_dir, "samples.json"))
        art["sample"] = samples[0]["prompt"] + samples[0]["text"]
        print(format_samples(samples), flush=True)


def _print(art: dict[str, Any]) -> None:
    lines = []
    if "val_loss" in art:
        lines.append(f"validation loss {art['val_loss']:.4f} (perplexity {art['val_ppl']:.2f}, "
                     f"{art['val_tokens']} tokens)")
        lines += [f"validation loss {name} {v:.4f}" for name, v in art.get("val_sources", {}).items()]
    if "sample" in art:
        lines.append(f"sample: {art['sample']!r}")
    for key in ("checkpoint", "export", "loss_chart", "moe_load_heatmap", "moe_imbalance_chart", "tensorboard", "samples"):
        if art.get(key):
            lines.append(f"{key.replace('_', ' ')}: {art[key]}")
    if lines:
        print("\n".join(lines), flush=True)

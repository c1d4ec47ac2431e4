"""``fastmoe-bench --table3``: the published Table 3 (speedups over the Hugging Face baseline),
measured on the machine at hand, each measured row printed above the published one.

Columns (a speedup is the baseline's time over ours, min over rounds; >1: ours is faster):

- ``fsmoe_fb``: forward+backward of one MoE layer, FastSparseMoE against ``hf_v4`` (the paper's
  baseline; ``hf_v5_grouped_mm`` beside it): :func:`bench.harness.runner.run_case`, the layer benchmark, on
  the preset's real H, I, E, K and, for EP models, one rank's local slice (as the layer presets do).
- ``fsmoe_training``: a whole training step of the scaled model through the trainer,
  ``--model.moe_impl fastmoe`` against ``hf``, one process, interleaved.
- ``epso_optimizer`` / ``epso_training``: the optimizer step and the whole step with
  ``--optimizer epso`` against ``sharded`` on real gloo processes (DP x EP), with the per-rank
  optimizer-state bytes measured and by the formula.
- ``--precision int8 fp8 bf16 bf16-sr``: precision rows beside the table, the fastmoe layer and
  training step at each precision against the same fastmoe run in fp32, side by side. F+B:
  ``fastmoe/<backend>:<precision>`` in the same interleaved rounds as the fp32 provider (int8 and
  fp8 only: bf16 weights are a training mode, the CPU layer runs fp32). Training: two trainers of
  the scaled model, fp32 and the precision (:func:`bench.studies.table3.workers.precision_steps`), stepped
  in turn, one pair per precision so that never more than two are alive.
- ``combined``: both changes against neither. transformers' block cannot run under EP in the
  trainer, so it is derived: the product of the two measured training speedups (marked so).

The models are scaled to fit: the real hidden, intermediate, top-k and heads of each preset, with
fewer layers, the byte-level vocabulary of the embedded corpus, a small batch and fewer experts in
the training columns (said in every row). A cell that cannot be measured says why instead.

Legend: H hidden, I intermediate, E experts, K experts per token, EP expert-parallel degree.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ...harness.cases import make_case
from ...harness.presets import Preset
from ...harness.providers import REFERENCE, default_fastmoe
from ...harness.report import derive, machine_line, run_header, write_json
from ...harness.runner import _progress, run_case
from .workers import (TRAIN_PRECISIONS, StepSpec, check_steps, moe_impl_steps, optimizer_steps_rank,
                             precision_steps, trainer_module)

COLUMNS = ("fsmoe_fb", "fsmoe_training", "epso_optimizer", "epso_training", "combined")
COLUMN_TITLE = {"fsmoe_fb": "FSMOE F+B", "fsmoe_training": "FSMOE training", "epso_optimizer": "EPSO optimizer",
                "epso_training": "EPSO training", "combined": "FSMOE+EPSO training"}
MODELS = ("mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b")

#: The published Table 3 (speedups over the Hugging Face baseline; None: not reported, 7B ran without EP).
PUBLISHED: dict[str, dict[str, float | None]] = {
    "mula-7b-a1b": dict(zip(COLUMNS, (2.83, 1.71, None, None, 1.71))),
    "mula-20b-a2b": dict(zip(COLUMNS, (1.33, 1.11, 1.36, 1.19, 1.35))),
    "mula-100b-a7b": dict(zip(COLUMNS, (1.51, 1.31, 1.23, 1.06, 1.41))),
    "mula-220b-a10b": dict(zip(COLUMNS, (1.66, 1.48, 1.07, 1.01, 1.51))),
}
PUBLISHED_NOTE = ("published: Aurora PVC tiles, bf16, full models; 7B without EP, the others EP=12; "
                  "'-' not reported (EPSO needs EP)")


#: Precisions of the precision rows; the F+B column runs the quantized ones (expert GEMMs) only.
PRECISIONS = tuple(TRAIN_PRECISIONS)
FB_PRECISIONS = ("int8", "fp8")
PRECISION_COLUMNS = ("fsmoe_fb", "fsmoe_training")

#: The DP x EP mesh of the EPSO columns: four gloo processes, one instance of the batch each.
DP, EP = 2, 2


@dataclass(frozen=True)
class Scale:
    """How far the models are scaled down; ``quick`` replaces their sizes too (tests)."""

    quick: bool = False
    layers: int = 2
    train_experts: int = 16
    context: int = 64

    @property
    def global_batch(self) -> int:
        """Instances per step of the one-process training column."""
        return 4 if self.quick else 8

    fb_tokens_per_rank: int = 256
    rounds: int = 3
    blocks: int = 2
    ceiling_n: int = 2048


QUICK = Scale(quick=True, layers=1, train_experts=8, context=16, fb_tokens_per_rank=16, rounds=1, blocks=1,
              ceiling_n=128)


def fb_ep(paper_ep: int, s: Scale) -> int:
    """EP of the F+B slice: the paper's (12), or 2 at the tiny sizes."""
    return 1 if paper_ep == 1 else (2 if s.quick else paper_ep)


def model_dims(name: str, quick: bool) -> tuple[Any, int]:
    """(the preset's ModelConfig, or tiny sizes with ``quick``; the paper's EP)."""
    cfg = trainer_module("config.presets").get_preset(name)
    m = cfg.model
    if quick:
        m = replace(m, hidden_size=64, num_heads=4, head_dim=16, intermediate_size=32, num_experts=8, top_k=2)
    return m, cfg.parallel.ep


def describe(m: Any, paper_ep: int, s: Scale) -> str:
    ep = fb_ep(paper_ep, s)
    E = m.num_experts
    fb = (f"F+B: one layer, {E // ep} of {E} experts (EP={ep} slice), T={s.fb_tokens_per_rank * ep}" if ep > 1
          else f"F+B: one layer, all {E} experts, T={s.fb_tokens_per_rank}")
    return (f"H={m.hidden_size} I={m.intermediate_size} K={m.top_k} heads={m.num_heads}x{m.head_dim}; {fb}; "
            f"training: {s.layers} layer(s) of the preset's {'many' if s.quick else m.num_layers}, "
            f"{s.train_experts} experts of {E}, vocab 258 (bytes), {s.global_batch} x {s.context} tokens per step "
            f"(DP x EP run: {DP * EP} x {s.context})")


def _cell(value: float | None = None, reason: str | None = None, **detail: Any) -> dict:
    if value is None and not reason:
        raise ValueError("a cell without a value needs the reason")
    return {"value": value, "reason": reason, **detail}


def _min_ratio(base: list[float], ours: list[float]) -> tuple[float, float | None]:
    """(min(base) / min(ours), median of same-round ratios)."""
    paired = [b / o for b, o in zip(base, ours) if o > 0]
    return min(base) / min(ours), (statistics.median(paired) if paired else None)


# ---------------------------------------------------------------- the columns
def fb_cell(name: str, m: Any, paper_ep: int, s: Scale, device: torch.device, dtype: str, budget_s: float,
            progress: bool, log: Callable[[str], None], precisions: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """FSMOE F+B: the layer benchmark on the preset's layer (local slice under EP), with
    ``fastmoe/<backend>:<precision>`` in the same rounds for each quantized precision (see
    :func:`precision_fb_cell`)."""
    preset = Preset(f"{name}-layer", m.hidden_size, m.intermediate_size, m.num_experts, m.top_k,
                    s.fb_tokens_per_rank, fb_ep(paper_ep, s), f"{name} layer for Table 3")
    fast = default_fastmoe(device)
    case = make_case(preset, dtype=dtype, device=device, seed=0)
    quantized = [f"{fast}:{p}" for p in precisions if p in FB_PRECISIONS]
    res = run_case(case, [REFERENCE, "hf_v5_grouped_mm", fast, *quantized], backward=True, rounds=s.rounds,
                   budget_s=budget_s, ceiling_n=s.ceiling_n, progress=progress, log=log)
    derive(res, [fast, *quantized])
    del case
    gc.collect()
    m = res["metrics"]["fwdbwd"]
    sp = m["speedup"].get(fast, {})
    corr = res["providers"][fast].get("correct", {})
    if not corr.get("ok"):
        return _cell(reason=f"{fast} disagrees with {REFERENCE}: {corr.get('max_rel_error')}"), res
    if REFERENCE not in sp:
        return _cell(reason=f"{REFERENCE} did not run: {res['providers'][REFERENCE].get('reason', '')}"), res
    gm = sp.get("hf_v5_grouped_mm")
    return _cell(sp[REFERENCE]["min"], paired=sp[REFERENCE]["paired"],
                 vs_hf_v5_grouped_mm=gm["min"] if gm else None, x_bound=m["providers"][fast]["x_bound"],
                 correct=corr), res


def precision_fb_cell(res: dict, precision: str, fast: str) -> dict:
    """A precision row's F+B cell from :func:`fb_cell`'s run: fp32 fastmoe's time over the
    precision's, the same rounds (and its speedup over the baseline beside)."""
    if precision not in FB_PRECISIONS:
        return _cell(reason=f"{precision} is a training mode (bf16 weights); on the CPU the layer runs in fp32")
    name = f"{fast}:{precision}"
    prov = res["providers"].get(name, {})
    if prov.get("status") != "ok":
        return _cell(reason=f"{name} did not run: {prov.get('reason', 'no result')}")
    corr = prov.get("correct", {})
    if not corr.get("ok"):
        return _cell(reason=f"{name} disagrees with {REFERENCE} beyond {precision}'s tolerance: "
                            f"{corr.get('max_rel_error')}")
    sp = res["metrics"]["fwdbwd"]["speedup"].get(name, {})
    if fast not in sp:
        return _cell(reason=f"{fast} has no F+B time to compare with")
    ref = sp.get(REFERENCE)
    return _cell(sp[fast]["min"], paired=sp[fast]["paired"], vs_baseline=ref["min"] if ref else None,
                 fp32_s=res["metrics"]["fwdbwd"]["providers"][fast]["min_s"],
                 s=res["metrics"]["fwdbwd"]["providers"][name]["min_s"], correct=corr)


def precision_training_cell(steps: dict, precision: str) -> dict:
    """A precision row's training cell from :func:`precision_steps`: fp32's step time over the
    precision's, the timed rounds (the first step is cold)."""
    if not steps["correct"]["ok"]:
        return _cell(reason=f"the {precision} step disagrees with fp32's beyond {steps['correct']['tolerance']}: "
                            f"{steps['correct']['max_rel_error']}")
    base = [r["step_s"] for r in steps["steps"]["fp32"][1:]]
    ours = [r["step_s"] for r in steps["steps"][precision][1:]]
    v, paired = _min_ratio(base, ours)
    fb = (min(r["fwdbwd_s"] for r in steps["steps"]["fp32"][1:])
          / min(r["fwdbwd_s"] for r in steps["steps"][precision][1:]))
    return _cell(v, paired=paired, fp32_step_s=min(base), step_s=min(ours), fwdbwd_speedup=fb,
                 optimizer_state_bytes=steps["optimizer_state_bytes"], correct=steps["correct"])


def training_cell(steps: dict) -> dict:
    """FSMOE training from :func:`moe_impl_steps`: the timed rounds (the first step is cold)."""
    if not steps["correct"]["ok"]:
        return _cell(reason=f"fastmoe's step disagrees with hf's: {steps['correct']['max_rel_error']}")
    hf = [r["step_s"] for r in steps["steps"]["hf"][1:]]
    fm = [r["step_s"] for r in steps["steps"]["fastmoe"][1:]]
    v, paired = _min_ratio(hf, fm)
    hf_fb = min(r["fwdbwd_s"] for r in steps["steps"]["hf"][1:])
    fm_fb = min(r["fwdbwd_s"] for r in steps["steps"]["fastmoe"][1:])
    return _cell(v, paired=paired, hf_step_s=min(hf), fastmoe_step_s=min(fm), fwdbwd_speedup=hf_fb / fm_fb,
                 correct=steps["correct"])


def epso_cells(ranks: list[dict], name: str) -> tuple[dict, dict, dict]:
    """EPSO optimizer and training cells and the state-byte record, from every rank's steps: a
    round's time is its slowest rank's (the step ends when all have)."""
    recs = [r["models"][name] for r in ranks]
    per_round = {opt: [[max(rec["steps"][opt][i][k] for rec in recs) for i in range(len(recs[0]["steps"][opt]))]
                       for k in ("optimizer_s", "step_s")] for opt in ("sharded", "epso")}
    first = {opt: [recs[0]["cold"][opt][0]] + recs[0]["steps"][opt][:1] for opt in ("sharded", "epso")}
    corr = check_steps(first["epso"], first["sharded"])
    state = {opt: [rec["state_bytes"][opt] for rec in recs] for opt in ("sharded", "epso")}
    if not corr["ok"]:
        bad = _cell(reason=f"epso's step disagrees with sharded's: {corr['max_rel_error']}")
        return bad, bad, state
    cells = []
    for k, key in enumerate(("optimizer_s", "step_s")):
        v, paired = _min_ratio(per_round["sharded"][k], per_round["epso"][k])
        cells.append(_cell(v, paired=paired, sharded_s=min(per_round["sharded"][k]), epso_s=min(per_round["epso"][k]),
                           correct=corr))
    return cells[0], cells[1], state


def combined_cell(row: dict, paper_ep: int) -> dict:
    t, e = row["fsmoe_training"], row["epso_training"]
    if paper_ep == 1:
        if t["value"] is None:
            return _cell(reason=f"FSMOE training not measured: {t['reason']}")
        return _cell(t["value"], derived="= FSMOE training: no EP, so EPSO is the standard sharded optimizer")
    if t["value"] is None or e["value"] is None:
        return _cell(reason="needs both training speedups: " + "; ".join(c["reason"] for c in (t, e) if c["reason"]))
    return _cell(t["value"] * e["value"], derived="FSMOE training x EPSO training: transformers' block cannot "
                 "run under EP in the trainer, so 'neither' has no measured step here")


def _preloaded_context() -> Any:
    """A forkserver that imports torch, transformers' OLMoE and fastmoe_xpu once for all ranks (a
    fresh spawn costs every rank those imports again: most of a quick run on two cores)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers.models.olmoe.modeling_olmoe",
                                "fastmoe_xpu"])
    return ctx


# ---------------------------------------------------------------- the run
def run_table3(models: list[str], s: Scale, *, device: torch.device, dtype: str, out_dir: Path, budget_s: float,
               progress: bool, columns: tuple[str, ...] = COLUMNS, dist_timeout_s: float = 1800.0,
               log: Callable[[str], None] = lambda m: None, not_run: str | None = None,
               precisions: tuple[str, ...] = ()) -> dict:
    """Measure ``columns`` for ``models``; returns ``{"rows": {model: {column: cell}}, ...}``, and
    with ``precisions`` ``"precision_rows": {model: {precision: {column: cell}}}`` for the F+B and
    training columns among ``columns``."""
    for m in models:
        if m not in PUBLISHED:
            raise ValueError(f"unknown model {m!r}; Table 3 has {list(PUBLISHED)}")
    for p in precisions:
        if p not in PRECISIONS:
            raise ValueError(f"unknown precision {p!r} for Table 3; known: {list(PRECISIONS)}")
    prec_rows: dict[str, dict] = {m: {p: {} for p in precisions} for m in models}
    dims = {m: model_dims(m, s.quick) for m in models}
    rows: dict[str, dict] = {m: {} for m in models}
    extra: dict[str, dict] = {m: {"scaled": describe(*dims[m], s), "model": dataclasses.asdict(dims[m][0]),
                                  "paper_ep": dims[m][1]} for m in models}
    train = "fsmoe_training" in columns or "combined" in columns
    want_dist = any(c in columns for c in ("epso_optimizer", "epso_training", "combined"))
    dist_models = [m for m in models if dims[m][1] > 1]
    ticks = (len(models) * ("fsmoe_fb" in columns) + len(models) * 2 * (s.rounds + 1) * train + want_dist
             + len(models) * len(precisions) * 2 * (s.rounds + 1) * ("fsmoe_training" in columns))
    bar = _progress(ticks, "table3", progress)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    # the trainers' scratch (embedded corpus, run folders), removed at the end
    work = Path(tempfile.mkdtemp(prefix="table3-", dir=out_dir))
    data_cache = str(work / "data_cache")

    def spec(name: str, global_batch: int, micro: int) -> StepSpec:
        scaled = replace(dims[name][0], num_layers=s.layers, num_experts=s.train_experts)
        return StepSpec(name, scaled, s.context, global_batch, micro, data_cache, str(work / name))

    for m in models:
        d, paper_ep = dims[m]
        if "fsmoe_fb" in columns:
            log(f"{m}: FSMOE F+B (one layer)")
            rows[m]["fsmoe_fb"], extra[m]["fb_case"] = fb_cell(m, d, paper_ep, s, device, dtype, budget_s, progress, log,
                                                               precisions)
            for p in precisions:
                prec_rows[m][p]["fsmoe_fb"] = precision_fb_cell(extra[m]["fb_case"], p, default_fastmoe(device))
            tick()
        if train:
            if device.type != "cpu":
                rows[m]["fsmoe_training"] = _cell(reason=f"the training columns run on the CPU trainer only here; "
                                                         f"--device {device.type} measures the F+B column")
            elif s.train_experts < d.top_k:
                rows[m]["fsmoe_training"] = _cell(reason=f"{s.train_experts} experts < top-k {d.top_k}")
            else:
                log(f"{m}: FSMOE training (whole step, fastmoe vs hf)")
                st = moe_impl_steps(spec(m, s.global_batch, s.global_batch), s.rounds, tick)
                rows[m]["fsmoe_training"] = training_cell(st)
                extra[m]["training_steps"] = st
        if "fsmoe_training" in columns:
            for p in precisions:
                if device.type != "cpu" or s.train_experts < d.top_k:
                    prec_rows[m][p]["fsmoe_training"] = _cell(reason=rows[m]["fsmoe_training"]["reason"])
                    continue
                log(f"{m}: training at {p} against fp32 (whole step, fastmoe)")
                st = precision_steps(spec(m, s.global_batch, s.global_batch), p, s.rounds, tick)
                prec_rows[m][p]["fsmoe_training"] = precision_training_cell(st, p)
                extra[m].setdefault("precision_steps", {})[p] = st
    if want_dist:
        for m in models:
            if dims[m][1] == 1:
                reason = "not in the paper: 7B ran without EP, where EPSO is the standard sharded optimizer"
                rows[m]["epso_optimizer"] = rows[m]["epso_training"] = _cell(reason=reason)
        world = DP * EP
        reason = None
        if device.type != "cpu":
            reason = f"runs on gloo CPU processes; not measured with --device {device.type}"
        elif s.train_experts % EP:
            reason = f"{s.train_experts} experts do not split over EP={EP}"
        if dist_models and reason is None:
            log(f"EPSO: {world} gloo processes (DP {DP} x EP {EP}), models {', '.join(dist_models)}")
            from fastmoe_xpu.dist.testing import run_distributed

            specs = [spec(m, world, 1) for m in dist_models]
            try:
                ranks = run_distributed(optimizer_steps_rank, world, specs, DP, EP, s.rounds, s.blocks,
                                        env={"OMP_NUM_THREADS": "1"}, timeout_s=dist_timeout_s,
                                        comm_timeout_s=min(dist_timeout_s, 600.0), fail_fast=True,
                                        context=_preloaded_context())
            except (RuntimeError, TimeoutError) as exc:
                reason = f"the DP x EP run failed: {str(exc).splitlines()[0]}"
                log(str(exc))
            else:
                for m in dist_models:
                    o, t, state = epso_cells(ranks, m)
                    rows[m]["epso_optimizer"], rows[m]["epso_training"] = o, t
                    extra[m]["optimizer_state_bytes"] = state
                    extra[m]["dist_steps"] = [r["models"][m] for r in ranks]
        if reason is not None:
            for m in dist_models:
                rows[m]["epso_optimizer"] = rows[m]["epso_training"] = _cell(reason=reason)
        tick()
    for m in models:
        if "combined" in columns:
            rows[m]["combined"] = combined_cell(rows[m], dims[m][1])
        for c in COLUMNS:
            rows[m].setdefault(c, _cell(reason=not_run or f"not run (columns asked: {', '.join(columns)})"))
        for p in precisions:
            for c in PRECISION_COLUMNS:
                prec_rows[m][p].setdefault(c, _cell(reason=not_run or f"not run (columns asked: {', '.join(columns)})"))
    if bar is not None:
        bar.close()
    shutil.rmtree(work, ignore_errors=True)
    return {"rows": rows, "published": {m: PUBLISHED[m] for m in models}, "models": extra,
            "scale": {**dataclasses.asdict(s), "global_batch": s.global_batch},
            "layout": {"dp": DP, "ep": EP}, "device": str(device), "dtype": dtype,
            **({"precision_rows": prec_rows} if precisions else {})}


# ---------------------------------------------------------------- the outputs
def _fmt(c: dict | float | None) -> str:
    if isinstance(c, dict):
        if c["value"] is None:
            return "n/a"
        return f"{c['value']:.2f}" + ("~" if c.get("derived", "").startswith("FSMOE training x") else "")
    return "-" if c is None else f"{c:.2f}"


def _reasons(result: dict) -> list[str]:
    out = []
    for m, row in result["rows"].items():
        for c in COLUMNS:
            if row[c]["value"] is None:
                out.append(f"{m} {COLUMN_TITLE[c]}: {row[c]['reason']}")
    return out


def state_rows(result: dict) -> list[tuple[str, str, int, int, int, int]]:
    """(model, optimizer, rank 0 measured bytes, formula, dense params, expert params per rank)."""
    out = []
    for m, ex in result["models"].items():
        for opt, per_rank in ex.get("optimizer_state_bytes", {}).items():
            r0 = per_rank[0]
            out.append((m, opt, r0["measured"], r0["formula"], r0["dense_params"], r0["expert_params"]))
    return out


def format_table3(result: dict, markdown: bool = False) -> str:
    """Measured rows with the published row under each, the scaled sizes, reasons and state bytes."""
    head = ["model", ""] + [COLUMN_TITLE[c] for c in COLUMNS]
    body = []
    for m, row in result["rows"].items():
        body.append([m, "measured"] + [_fmt(row[c]) for c in COLUMNS])
        body.append(["", "published"] + [_fmt(result["published"][m][c]) for c in COLUMNS])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * len(COLUMNS)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        w = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
        lines = ["  ".join(x.ljust(w[i]) if i < 2 else x.rjust(w[i]) for i, x in enumerate(r)) for r in [head] + body]
        lines.insert(1, "-" * len(lines[0]))
    notes = ["speedup over the baseline, min over rounds (>1: ours faster); n/a: not measured, reason below; "
             "~: derived, not measured", PUBLISHED_NOTE]
    lay = result["layout"]
    notes.append(f"EPSO columns: DP {lay['dp']} x EP {lay['ep']} gloo processes, one thread each")
    for m, ex in result["models"].items():
        notes.append(f"{m}: {ex['scaled']}")
    notes += _reasons(result)
    for m, row in result["rows"].items():
        fb = row["fsmoe_fb"]
        if fb["value"] is not None:
            gm = fb.get("vs_hf_v5_grouped_mm")
            notes.append(f"{m} F+B: vs hf_v5_grouped_mm {gm:.2f}x; fastmoe at {fb['x_bound']:.2f}x the GEMM-only "
                         f"bound" if gm else f"{m} F+B: fastmoe at {fb['x_bound']:.2f}x the GEMM-only bound")
    st = state_rows(result)
    if st:
        notes.append("optimizer state bytes per rank (rank 0): " + "; ".join(
            f"{m} {opt} {meas / 2**20:.1f} MiB (formula {form / 2**20:.1f} MiB)" for m, opt, meas, form, _, _ in st))
    sep = "  \n" if markdown else "\n"
    text = "\n".join(lines) + "\n\n" + sep.join(("" if markdown else "# ") + n for n in notes)
    if result.get("precision_rows"):
        text += "\n\n" + format_precision_rows(result, markdown)
    return text


def format_precision_rows(result: dict, markdown: bool = False) -> str:
    """The precision rows: fastmoe at each precision against fastmoe in fp32, measured side by side
    (F+B in the same layer rounds, training in alternating steps), the reasons below."""
    head = ["model", "precision"] + [f"{COLUMN_TITLE[c]} vs fp32" for c in PRECISION_COLUMNS] + [
        "F+B vs baseline", "fwd+bwd part of the step vs fp32"]
    body, notes = [], []
    for m, per in result["precision_rows"].items():
        for j, (p, cells) in enumerate(per.items()):
            fb, tr = cells["fsmoe_fb"], cells["fsmoe_training"]
            body.append(["" if j else m, p, _fmt(fb), _fmt(tr), _fmt(fb.get("vs_baseline")),
                         _fmt(tr.get("fwdbwd_speedup"))])
            notes += [f"{m} {p} {COLUMN_TITLE[c]}: {cells[c]['reason']}" for c in PRECISION_COLUMNS
                      if cells[c]["value"] is None]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        w = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
        lines = ["  ".join(x.ljust(w[i]) if i < 2 else x.rjust(w[i]) for i, x in enumerate(r)) for r in [head] + body]
        lines.insert(1, "-" * len(lines[0]))
    notes.insert(0, "precision rows: fastmoe's time in fp32 over its time at the precision, min over rounds, "
                    "both in the same run (>1: the precision is faster); F+B vs baseline: the precision's layer "
                    f"against {REFERENCE}")
    sep = "  \n" if markdown else "\n"
    return "\n".join(lines) + "\n\n" + sep.join(("" if markdown else "# ") + n for n in notes)


def write_table3_csv(path: Path, result: dict) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["model", "row"] + list(COLUMNS) + [f"{c}_reason" for c in COLUMNS] + ["scaled"])
        for m, row in result["rows"].items():
            w.writerow([m, "measured"] + [row[c]["value"] if row[c]["value"] is not None else "" for c in COLUMNS]
                       + [row[c]["reason"] or row[c].get("derived", "") for c in COLUMNS]
                       + [result["models"][m]["scaled"]])
            for p, cells in result.get("precision_rows", {}).get(m, {}).items():
                w.writerow([m, f"{p} vs fp32"] + [cells[c]["value"] if c in cells and cells[c]["value"] is not None
                                                   else "" for c in COLUMNS]
                           + [(cells[c]["reason"] or "") if c in cells else "precision rows: F+B and training only"
                              for c in COLUMNS] + [result["models"][m]["scaled"]])
            pub = result["published"][m]
            w.writerow([m, "published"] + ["" if pub[c] is None else pub[c] for c in COLUMNS]
                       + ["not reported" if pub[c] is None else "" for c in COLUMNS] + [PUBLISHED_NOTE])


def write_table3_chart(path: Path, header: dict, result: dict) -> bool:
    """Per column and model: the measured bar beside the published one (hatched)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(result["rows"])
    fig, axes = plt.subplots(1, len(COLUMNS), figsize=(3.2 * len(COLUMNS), 3.8), sharey=True)
    for ax, c in zip(axes, COLUMNS):
        for j, m in enumerate(models):
            meas, pub = result["rows"][m][c]["value"], result["published"][m][c]
            for dx, v, kw in ((-0.2, meas, dict(color="tab:blue")), (0.2, pub, dict(color="white", edgecolor="tab:gray",
                                                                                      hatch="//"))):
                if v is not None:
                    ax.bar(j + dx, v, 0.4, **kw)
                    ax.annotate(f"{v:.2f}", (j + dx, v), ha="center", va="bottom", fontsize=6)
                else:
                    ax.annotate("n/a" if dx < 0 else "-", (j + dx, 0.05), ha="center", fontsize=6)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_title(COLUMN_TITLE[c], fontsize=9)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([m.replace("mula-", "") for m in models], fontsize=7, rotation=30)
    from matplotlib.patches import Patch

    axes[0].set_ylabel("speedup over the baseline")
    values = [v for m in models for c in COLUMNS
              for v in (result["rows"][m][c]["value"], result["published"][m][c]) if v is not None]
    axes[0].set_ylim(0, 1.15 * max(values + [1.0]))  # room for the labels above the tallest bar
    axes[-1].legend(handles=[Patch(color="tab:blue", label="measured (scaled models)"),
                             Patch(facecolor="white", edgecolor="tab:gray", hatch="//", label="published")],
                    fontsize=7, loc="upper right")
    mach = header["machine"]
    fig.suptitle(f"Table 3 on {mach['cpu_model']}, {mach['usable_cpus']} cpus, {result['dtype']} "
                 f"({header['date_utc'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _scale_from_args(args: argparse.Namespace) -> Scale:
    s = QUICK if args.quick else Scale()
    if args.rounds is not None:
        s = replace(s, rounds=args.rounds)
    over = {k: getattr(args, k) for k in ("layers", "train_experts", "fb_tokens_per_rank", "context", "blocks")
            if getattr(args, k, None) is not None}
    for k, v in over.items():
        if v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    return replace(s, **over)


def main_table3(args: argparse.Namespace, columns: tuple[str, ...] = COLUMNS, models: list[str] | None = None,
                scale: Scale | None = None, not_run: str | None = None) -> int:
    """The ``--table3`` run of ``fastmoe-bench``: print, then write JSON, CSV,
    Markdown and the chart into ``--out``."""
    s = scale or _scale_from_args(args)
    if args.dtype != "fp32" and args.device == "cpu":
        raise ValueError("--table3 on the CPU runs in fp32 (the trainer's CPU path)")
    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = run_header(device, {k: v for k, v in vars(args).items()})
    m = header["machine"]
    print(f"# {header['date_utc']}  {machine_line(m)}")
    print(f"# {header['command']}", flush=True)
    log = lambda t: print(t, file=sys.stderr, flush=True)  # noqa: E731
    result = run_table3(models or args.table3_models or list(MODELS), s, device=device, dtype=args.dtype,
                        out_dir=out_dir, budget_s=args.budget, progress=not args.no_progress, columns=columns,
                        dist_timeout_s=args.dist_timeout, log=log, not_run=not_run,
                        precisions=tuple(p for p in getattr(args, "precision", None) or () if p != "none"))
    header["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print()
    print(format_table3(result))
    write_json(out_dir / "table3.json", header, [result])
    write_table3_csv(out_dir / "table3.csv", result)
    (out_dir / "table3.md").write_text(
        f"Measured {header['date_utc']} with `{header['command']}`  \n{m['cpu_model']}, {m['usable_cpus']} CPUs, "
        f"torch {m['torch']}, transformers {m['transformers']}.\n\n" + format_table3(result, markdown=True) + "\n",
        encoding="utf-8")
    wrote = [out_dir / n for n in ("table3.json", "table3.csv", "table3.md")]
    if not args.no_chart and write_table3_chart(out_dir / "table3.png", header, result):
        wrote.append(out_dir / "table3.png")
    print("# wrote " + ", ".join(str(w) for w in wrote))
    failed = [r for r in _reasons(result) if "disagrees" in r]
    if failed:
        print("# CORRECTNESS FAILURE: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def state_bytes_match(result: dict) -> bool:
    """Every rank's measured optimizer-state bytes equal the formula's (the test's check)."""
    recs = [r for ex in result["models"].values() for per in ex.get("optimizer_state_bytes", {}).values() for r in per]
    return bool(recs) and all(r["measured"] == r["formula"] for r in recs)


"""Training-step measurements behind Table 3: the trainer's own step, timed piece by piece.

A step here is exactly what ``Trainer.train_step`` runs, less its metrics and NaN checks:
``loader.next_batch()``, ``forward_backward`` (forward and backward of every micro-batch, gradients
into the optimizer's flat buffers) and ``optimizer_step`` (reduce, clip, AdamW, publish). The two
parts are timed separately, so the same steps give the optimizer column and the training column.

- :func:`moe_impl_steps` (one process): ``--model.moe_impl fastmoe`` against ``hf``, two trainers
  built from the same seed and reading the same batches, one step of each per round.
- :func:`precision_steps` (one process, ``--table3 --precision``): the fastmoe model in fp32 against
  the same model at one lower precision (int8 or fp8 expert GEMMs, bf16 weights with or without
  stochastic rounding), built from the same seed and reading the same batches.
- :func:`optimizer_steps_rank` (every rank of a DP x EP gloo group, started by
  ``fastmoe_xpu.dist.testing.run_distributed``): ``--optimizer sharded`` against ``epso``, with the
  per-rank optimizer-state bytes measured (``ZeroAdamW.state_bytes``) and by the formula.

The trainer package is imported by the name it is installed under (``fastmoe_trainer``) or, in a
checkout, ``trainer``: bench depends on it as it depends on fastmoe_xpu, never the other way round.

Legend: H hidden, I intermediate, E experts, K experts per token, DP x EP the process mesh.
"""
from __future__ import annotations

import gc
import importlib
import time
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Callable

import torch

#: Relative tolerance of a contestant's first-step loss and gradient norm against the baseline's:
#: fp32, the same weights and data, different summation orders.
STEP_RTOL = 1e-4

#: The training column's precisions: the trainer fields each one sets on the fp32 fastmoe model.
TRAIN_PRECISIONS: dict[str, dict[str, dict[str, Any]]] = {
    "int8": {"model": {"expert_precision": "int8"}},
    "fp8": {"model": {"expert_precision": "fp8"}},
    "bf16": {"model": {"param_dtype": "bf16"}},
    "bf16-sr": {"model": {"param_dtype": "bf16"}, "optim": {"stochastic_rounding": True}},
}
#: A precision's first-step loss and gradient norm (and weight norm after one update) against fp32's:
#: the same weights and data, the numbers moved by the rounding only.
PRECISION_STEP_RTOL = {"int8": 5e-2, "fp8": 2.5e-1, "bf16": 5e-2, "bf16-sr": 5e-2}


def trainer_module(name: str) -> ModuleType:
    """``<trainer package>.<name>``: the installed ``fastmoe_trainer`` first, else the checkout's ``trainer``."""
    last: Exception | None = None
    for pkg in ("fastmoe_trainer", "trainer"):
        try:
            return importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name not in (pkg, f"{pkg}.{name}"):
                raise  # the package is there but something it imports is missing: say so
            last = exc
    raise ModuleNotFoundError(f"the trainer package (fastmoe_trainer or trainer) is not importable: {last}")


@dataclass(frozen=True)
class StepSpec:
    """One scaled training model and its batch: what ``--table3`` trains."""

    name: str
    model: Any
    """The trainer's ModelConfig, already scaled (layers, experts); vocabulary and impl are set here."""
    context: int
    global_batch: int
    micro_batch: int
    data_cache: str
    out: str
    seed: int = 0


def build_config(spec: StepSpec, *, moe_impl: str, optimizer: str, dp: int = 1, ep: int = 1,
                 precision: str | None = None) -> Any:
    """The TrainConfig of ``spec``: byte-level vocabulary from the embedded corpus, no clipping warmup
    (clipping is part of the step), no checkpoints, no logging side work; ``precision`` (a key of
    :data:`TRAIN_PRECISIONS`) lowers the fp32 model's precision."""
    cfg = trainer_module("config.presets").get_preset("tiny-moe")
    cfg.model = replace(spec.model, vocab_size=0, moe_impl=moe_impl, moe_backend="auto", param_dtype="fp32",
                        autocast="none", init_from=None)
    cfg.seed = spec.seed
    cfg.data.context, cfg.data.cache_dir = spec.context, spec.data_cache
    cfg.optim.name = optimizer
    cfg.schedule.steps, cfg.schedule.warmup_steps = 1_000_000, 0
    cfg.schedule.global_batch, cfg.schedule.micro_batch = spec.global_batch, spec.micro_batch
    cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.device = dp, ep, "cpu"
    cfg.checkpoint.resume = False
    lg = cfg.logging
    lg.out, lg.progress, lg.tensorboard, lg.plot, lg.peak_tflops = spec.out, False, False, False, 1.0
    if precision is not None:
        for section, fields in TRAIN_PRECISIONS[precision].items():
            for key, value in fields.items():
                setattr(getattr(cfg, section), key, value)
    return cfg


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def timed_step(tr: Any) -> dict[str, float]:
    """One training step of trainer ``tr``: forward+backward and optimizer step timed apart (ranks
    start together), with its loss and norms for the correctness check."""
    micro = tr.loader.next_batch()
    _barrier()
    t0 = time.perf_counter()
    parts = tr.forward_backward(micro)
    t1 = time.perf_counter()
    upd = tr.optimizer_step()
    t2 = time.perf_counter()
    tr.step += 1
    return {"fwdbwd_s": t1 - t0, "optimizer_s": t2 - t1, "step_s": t2 - t0, "loss": float(parts.lm),
            "grad_norm": float(upd["grad_norm"]), "param_norm": float(upd["param_norm"])}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def check_steps(got: list[dict], ref: list[dict], rtol: float = STEP_RTOL) -> dict:
    """The first step's loss and gradient norm and the second step's weight norm (after one update)
    of a contestant against the baseline's: the same weights and data must give the same numbers
    (to ``rtol``)."""
    errors = {"loss": rel_diff(got[0]["loss"], ref[0]["loss"]),
              "grad_norm": rel_diff(got[0]["grad_norm"], ref[0]["grad_norm"])}
    if len(got) > 1 and len(ref) > 1:
        errors["param_norm_after_update"] = rel_diff(got[1]["param_norm"], ref[1]["param_norm"])
    return {"ok": all(e <= rtol for e in errors.values()), "tolerance": rtol, "max_rel_error": errors}


def moe_impl_steps(spec: StepSpec, rounds: int, tick: Callable[[], None] = lambda: None) -> dict:
    """``--model.moe_impl fastmoe`` against ``hf`` in this process: one untimed step each, then
    ``rounds`` interleaved rounds (the order flips every round). Returns every step's record."""
    Trainer = trainer_module("trainer").Trainer
    impls = ("hf", "fastmoe")
    trainers = {i: Trainer(build_config(spec, moe_impl=i, optimizer="sharded")) for i in impls}
    steps: dict[str, list[dict]] = {i: [] for i in impls}
    for r in range(rounds + 1):
        for i in (impls if r % 2 == 0 else impls[::-1]):
            steps[i].append(timed_step(trainers[i]))
            tick()
    params = {i: sum(p.numel() for p in trainers[i].model.parameters()) for i in impls}
    del trainers
    gc.collect()
    return {"steps": steps, "params": params, "correct": check_steps(steps["fastmoe"], steps["hf"])}


def precision_steps(spec: StepSpec, precision: str, rounds: int, tick: Callable[[], None] = lambda: None) -> dict:
    """The fastmoe model in fp32 against the same model at ``precision`` in this process, as
    :func:`moe_impl_steps` runs its two (one untimed step each, then ``rounds`` interleaved rounds,
    the order flipping every round); the first steps checked with :data:`PRECISION_STEP_RTOL`.
    Two trainers alive at a time, whatever the number of precisions asked."""
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"unknown training precision {precision!r}; known: {list(TRAIN_PRECISIONS)}")
    Trainer = trainer_module("trainer").Trainer
    names = ("fp32", precision)
    trainers = {n: Trainer(build_config(spec, moe_impl="fastmoe", optimizer="sharded",
                                        precision=None if n == "fp32" else n)) for n in names}
    steps: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in (names if r % 2 == 0 else names[::-1]):
            steps[n].append(timed_step(trainers[n]))
            tick()
    state = {n: trainers[n].optimizer.state_bytes() for n in names}
    del trainers
    gc.collect()
    return {"steps": steps, "optimizer_state_bytes": state,
            "correct": check_steps(steps[precision], steps["fp32"], PRECISION_STEP_RTOL[precision])}


def optimizer_steps_rank(specs: list[StepSpec], dp: int, ep: int, rounds: int, blocks: int) -> dict:
    """On every rank of a DP x EP gloo world: for each spec, ``--optimizer sharded`` and ``epso`` in
    alternating blocks (one trainer alive at a time, so the largest models fit), each block one
    untimed step and ``rounds`` timed ones. Returns this rank's steps and optimizer-state bytes."""
    Trainer = trainer_module("trainer").Trainer
    lay = trainer_module("layout").build_layout(1, dp, ep, torch.device("cpu"))
    out: dict = {"rank": lay.rank, "models": {}}
    for spec in specs:
        rec: dict = {"steps": {"sharded": [], "epso": []}, "cold": {"sharded": [], "epso": []}, "state_bytes": {}}
        for b in range(blocks):
            for opt in (("sharded", "epso") if b % 2 == 0 else ("epso", "sharded")):
                tr = Trainer(build_config(spec, moe_impl="fastmoe", optimizer=opt, dp=dp, ep=ep), lay)
                if b == 0:
                    dense, expert = tr.local_param_counts()
                    rec["state_bytes"][opt] = {"measured": tr.optimizer.state_bytes(),
                                               "formula": tr.state_bytes_formula(),
                                               "dense_params": dense, "expert_params": expert}
                rec["cold"][opt].append(timed_step(tr))
                rec["steps"][opt] += [timed_step(tr) for _ in range(rounds)]
                del tr
                gc.collect()
                _barrier()
        out["models"][spec.name] = rec
    return out

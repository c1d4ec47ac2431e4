"""Training-step measurements behind Table 3: the trainer's own step, timed piece by piece.

A step here is exactly what ``Trainer.train_step`` runs, less its metrics and NaN checks:
``loader.next_batch()``, ``forward_backward`` (forward and backward of every micro-batch, gradients
into the optimizer's flat buffers) and ``optimizer_step`` (reduce, clip, AdamW, publish). The two
parts are timed separately, so the same steps give the optimizer column and the training column.

- :func:`moe_impl_steps` (one process): ``--model.moe_impl fastmoe`` against ``hf``, two trainers
  built from the same seed and reading the same batches, one step of each per round.
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


def build_config(spec: StepSpec, *, moe_impl: str, optimizer: str, dp: int = 1, ep: int = 1) -> Any:
    """The TrainConfig of ``spec``: byte-level vocabulary from the embedded corpus, no clipping warmup
    (clipping is part of the step), no checkpoints, no logging side work."""
    cfg = trainer_module("presets").get_preset("tiny-moe")
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


def check_steps(got: list[dict], ref: list[dict]) -> dict:
    """The first step's loss and gradient norm and the second step's weight norm (after one update)
    of a contestant against the baseline's: the same weights and data must give the same numbers."""
    errors = {"loss": rel_diff(got[0]["loss"], ref[0]["loss"]),
              "grad_norm": rel_diff(got[0]["grad_norm"], ref[0]["grad_norm"])}
    if len(got) > 1 and len(ref) > 1:
        errors["param_norm_after_update"] = rel_diff(got[1]["param_norm"], ref[1]["param_norm"])
    return {"ok": all(e <= STEP_RTOL for e in errors.values()), "tolerance": STEP_RTOL, "max_rel_error": errors}


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

"""``fastmoe-bench --family NAME``: one experts layer of a transformers MoE family at its published
shape, run by the family's own experts module with ``experts_implementation`` ``"eager"``,
``"grouped_mm"`` and ``"fastmoe"``, in the same run, interleaved, min over rounds.

The three contestants are one module (the family's decorated experts class, so its own layout:
transposed, interleaved, biased, custom gate) whose ``config._experts_implementation`` is switched
per call, so they share every weight. Inputs and routing come from :func:`bench.harness.cases.make_case`
(a softmax top-K router on random weights: the family's router is not part of the experts layer);
timing, the GEMM-only bound, the dense ceiling and the correctness check against ``eager`` are
:func:`bench.harness.runner.run_case`'s, the table :func:`bench.harness.report.format_case`'s.

``--family-scale S`` divides H and I by S (rounded to a multiple of 8) and ``--tokens T`` sets the
tokens, for machines where the published layer does not fit or takes too long; the output says so.

``fastmoe-bench --family-models [NAME ...]`` runs whole models instead, at the size people first try
a family at (:data:`TINY_MODEL`: :func:`fastmoe_xpu.integrations.families.tiny_config` with hidden
128 and 8 experts, top-2, a batch of 4 x 64 tokens): one forward+backward of the causal LM with
``experts_implementation="grouped_mm"`` (transformers' own) against ``"fastmoe"``, both models with the
same weights, interleaved in every round; per family the median of the same-round ratios, the
ratio of the minimums, and each model's first call (wall time: what a first step waits, the
``auto`` engine choice included), after one untimed call of an ``"eager"`` model has warmed torch.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token.
"""
from __future__ import annotations

import gc
import importlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..harness.cases import Case, make_case
from ..harness.presets import Preset
from ..harness.providers import Provider
from ..harness.report import MODES, derive, format_case, machine_line, plural, run_header
from ..harness.runner import run_case
from ..harness.usage import fail

#: Implementations every family is run with, the family's eager first (the correctness reference).
IMPLEMENTATIONS = ("eager", "grouped_mm", "fastmoe")


@dataclass(frozen=True)
class FamilyShape:
    model: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int


#: One MoE layer of each family's published model (its config.json on the Hub).
FAMILY_SHAPES: dict[str, FamilyShape] = {
    "qwen3_moe": FamilyShape("Qwen3-30B-A3B", 2048, 768, 128, 8),
    "gpt_oss": FamilyShape("GPT-OSS-20B", 2880, 2880, 32, 4),
    "mixtral": FamilyShape("Mixtral-8x7B", 4096, 14336, 8, 2),
    "olmoe": FamilyShape("OLMoE-1B-7B", 2048, 1024, 64, 8),
}

#: Tokens of one layer call unless ``--tokens`` says otherwise.
DEFAULT_TOKENS = 2048


def _round8(v: float) -> int:
    return max(8, int(round(v / 8)) * 8)


def family_preset(family: str, *, scale: int = 1, tokens: int | None = None) -> tuple[Preset, str]:
    """The bench preset of ``family``'s layer and a note of what was scaled (empty: the published shape)."""
    if family not in FAMILY_SHAPES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILY_SHAPES)}")
    if scale < 1:
        raise ValueError(f"--family-scale must be >= 1, got {scale}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    s = FAMILY_SHAPES[family]
    H, I = (s.hidden, s.intermediate) if scale == 1 else (_round8(s.hidden / scale), _round8(s.intermediate / scale))
    T = DEFAULT_TOKENS if tokens is None else tokens
    notes = []
    if scale != 1:
        notes.append(f"H and I divided by {scale} (published H={s.hidden}, I={s.intermediate})")
    if T != DEFAULT_TOKENS:
        notes.append(f"{T} tokens instead of {DEFAULT_TOKENS}")
    name = f"{family} ({s.model}{', scaled' if notes else ''})"
    return Preset(name, H, I, s.experts, s.top_k, T, 1, f"{s.model} experts layer"), "; ".join(notes)


def experts_module(family: str, preset: Preset, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """The family's own experts module at ``preset``'s shape, every weight drawn ~ N(0, 0.02) from ``seed``."""
    from fastmoe_xpu.integrations.families import discover_families, tiny_config

    import fastmoe_xpu  # noqa: F401  (registers "fastmoe")

    fam = {f.name: f for f in discover_families()}.get(family)
    if fam is None:
        raise ValueError(f"transformers has no decorated experts class for {family!r}")
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(mod, fam.experts_classes[0])
    fields = {"hidden_size": preset.hidden, "intermediate_size": preset.intermediate,
              "moe_intermediate_size": preset.intermediate, "num_experts": preset.experts,
              "num_local_experts": preset.experts, "num_experts_per_tok": preset.top_k}
    base = tiny_config(family)
    cfg = tiny_config(family, **{k: v for k, v in fields.items() if hasattr(base, k)})
    cfg._experts_implementation = "eager"
    with torch.device("meta"):
        experts = cls(cfg)
    experts = experts.to_empty(device=device).to(dtype)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    return experts


def family_providers(family: str, case: Case, seed: int = 0) -> dict[str, Provider]:
    """One provider per implementation, all on one experts module (shared weights)."""
    experts = experts_module(family, case.preset, case.dtype, case.device, seed)
    params = [p for p in experts.parameters()]
    named = dict(experts.named_parameters())
    up = "gate_up_proj" if "gate_up_proj" in named else "up_proj"

    def make(impl: str) -> Provider:
        def forward(x_TH: torch.Tensor, weights_TK: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
            experts.config._experts_implementation = impl
            return experts(x_TH, idx_TK, weights_TK)

        def merged_grads() -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(w.grad if w.grad is not None else torch.zeros_like(w)
                         for w in (named[up], named["down_proj"]))  # type: ignore[return-value]

        flags = ", ".join(f"{a}={getattr(experts, a)}" for a in ("is_transposed", "is_concatenated", "has_bias"))
        return Provider(f"{family}/{impl}", forward, params, merged_grads,
                        f"{type(experts).__name__} ({flags}), experts_implementation={impl!r}", [experts])

    return {f"{family}/{impl}": make(impl) for impl in IMPLEMENTATIONS}


def run_family(args: Any) -> int:
    """The ``--family`` entry of ``fastmoe-bench`` (``args`` from :func:`bench.cli.build_parser`)."""
    from ..harness.measure import run_options

    if args.mode not in MODES:
        fail(f"error: --family runs --mode {' / '.join(MODES)}, got {args.mode!r}")
    rounds = run_options(args)
    try:
        preset, note = family_preset(args.family, scale=args.family_scale, tokens=args.tokens)
    except ValueError as exc:
        fail(f"error: {exc}")
    device = torch.device(args.device)
    header = run_header(device, dict(vars(args)))
    m = header["machine"]
    print(f"# {header['date_utc']}  {machine_line(m)}")
    print(f"# {header['command']}")
    print(f"# {args.family}: one experts layer of {FAMILY_SHAPES[args.family].model}"
          + (f"; SCALED: {note}" if note else " at its published shape"))
    print("# routing: softmax top-K on random router weights (the router is not timed); weights N(0, 0.02)")
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.no_progress else (lambda s: None)
    case = make_case(preset, dtype=args.dtype, device=device, seed=args.seed, routing=args.routing)
    providers = family_providers(args.family, case, args.seed)
    names = list(providers)
    res = run_case(case, names, backward=args.mode != "fwd", rounds=rounds, budget_s=args.budget,
                   ceiling_n=args.ceiling_size or 1024, progress=not args.no_progress, log=log,
                   build=lambda name, _case: providers[name], reference=names[0])
    res["family"] = {"name": args.family, "model": FAMILY_SHAPES[args.family].model, "scaled": note}
    fast = f"{args.family}/fastmoe"
    derive(res, [fast])
    print()
    print(format_case(res, args.mode, fast), flush=True)
    ok = all(p.get("correct", {}).get("ok", True) for p in res["providers"].values() if p.get("status") == "ok")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"family_{args.family}.json"
    path.write_text(json.dumps({**header, "cases": [res]}, indent=2, default=str) + "\n")
    print(f"# wrote {path}")
    del case, providers
    gc.collect()
    if not ok:
        print(f"# CORRECTNESS FAILURE: an implementation disagrees with {names[0]}", file=sys.stderr)
        return 1
    return 0


#: The whole model a family is first tried at (``--family-models``): the fields of
#: :func:`~fastmoe_xpu.integrations.families.tiny_config` set here where the family's config has them.
TINY_MODEL: dict[str, int] = {"hidden_size": 128, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8}
#: Its batch: sequences x tokens.
TINY_BATCH = (4, 64)
#: The families ``--family-models`` runs unless named.
TINY_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe")
#: The two contestants: transformers' own grouped_mm experts, and fastmoe.
TINY_IMPLEMENTATIONS = ("grouped_mm", "fastmoe")


def tiny_model(family: str, implementation: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """``(model, config)``: ``family``'s causal LM (or base model) at :data:`TINY_MODEL`, fp32, in train
    mode, its weights drawn from ``seed`` (the same for every implementation)."""
    from fastmoe_xpu.integrations.families import build_model, tiny_config

    import fastmoe_xpu  # noqa: F401  (registers "fastmoe")

    base = tiny_config(family)
    cfg = tiny_config(family, **{k: v for k, v in TINY_MODEL.items() if hasattr(base, k)})
    torch.manual_seed(seed)
    model, _ = build_model(cfg, experts_implementation=implementation)
    return model.train(), cfg


def _experts_shape(cfg: Any) -> str:
    inter = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None)
    experts = next((getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(cfg, k, None), int)), None)
    return f"H={cfg.hidden_size} I={inter} E={experts} K={getattr(cfg, 'num_experts_per_tok', None)}"


def measure_tiny_model(family: str, rounds: int, *, seed: int = 0, min_sample_s: float = 0.01,
                       clock: Any = time.perf_counter) -> dict[str, Any]:
    """One family at :data:`TINY_MODEL`: ``{"experts": shape, "first_s": {impl: s}, "samples": {impl: [s]},
    "calls": per sample, "loss_diff": |loss difference| at the first call}``; a sample is the mean
    of ``calls`` forward+backward steps (enough for ``min_sample_s``), the implementations
    interleaved in every round, their order rotating."""
    from fastmoe_xpu.kernels import registry

    ids = torch.randint(3, 96, TINY_BATCH, generator=torch.Generator().manual_seed(seed + 1))

    def stepper(model: nn.Module) -> Any:
        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.detach()
        return step

    stepper(tiny_model(family, "eager", seed)[0])()  # warms torch (autograd, attention) for both first calls
    registry.forget_choices()  # the fastmoe model's first call makes its engine choices afresh
    steps, first, losses, cfg = {}, {}, {}, None
    for impl in TINY_IMPLEMENTATIONS:
        model, cfg = tiny_model(family, impl, seed)
        steps[impl] = stepper(model)
        t0 = time.perf_counter()
        losses[impl] = steps[impl]()
        first[impl] = time.perf_counter() - t0
    warm = []
    for step in steps.values():
        t0 = clock()
        step()
        warm.append(clock() - t0)
    calls = max(1, math.ceil(min_sample_s / max(min(warm), 1e-9)))
    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            for _ in range(calls):
                steps[name]()
            samples[name].append((clock() - t0) / calls)
    return {"experts": _experts_shape(cfg), "first_s": first, "samples": samples, "calls": calls,
            "loss_diff": float((losses["fastmoe"] - losses["grouped_mm"]).abs())}


def tiny_model_row(family: str, res: dict[str, Any]) -> str:
    """One Markdown row of :func:`measure_tiny_model`'s result: fastmoe's speedup over transformers'
    ``grouped_mm`` as the median of same-round ratios and the ratio of the minimums."""
    hf, fm = res["samples"]["grouped_mm"], res["samples"]["fastmoe"]
    median = statistics.median(a / b for a, b in zip(hf, fm))
    return (f"| {family} | {res['experts']} | {min(hf) * 1e3:.2f} | {min(fm) * 1e3:.2f} | {median:.3f}x "
            f"| {min(hf) / min(fm):.3f}x | {res['first_s']['grouped_mm'] * 1e3:.0f} / {res['first_s']['fastmoe'] * 1e3:.0f} "
            f"| {res['loss_diff']:.1e} |")


def run_tiny_models(args: Any) -> int:
    """The ``--family-models`` entry of ``fastmoe-bench`` (``args`` from :func:`bench.cli.build_parser`)."""
    from ..harness.measure import CLOCKS, run_options

    rounds = run_options(args, default_rounds=15)
    families = args.family_models or list(TINY_FAMILIES)
    device = torch.device(args.device)
    if device.type != "cpu":
        fail("error: --family-models runs on the CPU")
    header = run_header(device, dict(vars(args)))
    print(f"# {header['date_utc']}  {machine_line(header['machine'])}")
    print(f"# {header['command']}")
    print(f"# whole model, fp32, forward+backward of the causal LM at {TINY_MODEL}, batch "
          f"{TINY_BATCH[0]} x {TINY_BATCH[1]} tokens; {plural(rounds, 'interleaved round')}, clock {args.clock}; "
          "first call: wall time, after an eager model's")
    print("| family | experts layer | grouped_mm ms (min) | fastmoe ms (min) | fastmoe speedup, median of "
          "same-round ratios | ratio of minimums | first call ms, grouped_mm / fastmoe | loss difference |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    results = {}
    for family in families:
        res = measure_tiny_model(family, rounds, seed=args.seed, min_sample_s=args.min_sample_ms / 1e3,
                                 clock=CLOCKS[args.clock])
        results[family] = res
        print(tiny_model_row(family, res), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "family_models.json"
    path.write_text(json.dumps({**header, "families": results}, indent=2, default=str) + "\n")
    print(f"# wrote {path}")
    bad = [f for f, r in results.items() if not r["loss_diff"] <= 1e-4]
    if bad:
        print(f"# CORRECTNESS FAILURE: fastmoe's loss differs from grouped_mm's for {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0

"""Fill the kept Triton config table of this GPU: every grouped GEMM's candidates timed at real shapes.

``python -m fastmoe_xpu.tools.config_sweep --device cuda`` runs, at each shape of the practitioners'
set (``bench/harness/presets.py``: OLMoE-1B-7B, Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-20B,
Mixtral-8x7B and DeepSeek-V3's EP=8 slice, T = 32768), one bf16 forward and backward of the MoE
experts layer (stages 2-5) on each Triton GEMM engine (``triton``, and ``triton_tma`` where the GPU
has TMA), with the kept table switched off and the process's choices dropped, so that
:mod:`fastmoe_xpu.kernels.triton.autotune` times every candidate of every grouped-GEMM key the layer
launches. It then writes each key's winner and every candidate's seconds (what autotune measured,
:func:`~fastmoe_xpu.kernels.triton.autotune.timings`) to the kept table
(:mod:`fastmoe_xpu.kernels.kept_configs`): by default the package's file for this device,
``fastmoe_xpu/kernels/tuned/<slug>.json``, which is committed. Entries of an earlier sweep on the
same device, torch and Triton that this run did not time again are kept; any other file is replaced.

One progress line per shape, engine and dtype. ``--budget S`` (default 420) stops before a step that
would end past S seconds (judged from the last step of the same engine) and writes what it has, so
the whole command fits one device call of under 8 minutes. ``--dry-run`` lists the steps and the
candidates of each kernel without running anything (no GPU needed). Without the GPU it exits 2 with
one line saying so.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..shape_sets import SHAPE_SETS as _SHAPE_DATA

#: The Triton GEMM engines the sweep runs, and the grouped-GEMM kernels of each that autotune keys.
ENGINE_KERNELS: dict[str, tuple[str, ...]] = {
    "triton": ("gate_up_fwd", "grouped_mm_fwd", "grouped_mm_bwd"),
    "triton_tma": ("tma_gate_up_fwd", "tma_grouped_mm", "tma_grouped_mm_bwd"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_BUDGET_S = 420.0
SHAPE_SETS = tuple(_SHAPE_DATA)


def engines_of(table: str) -> list[str]:
    """The engines whose kernels config table ``table`` has (the TMA kernels are NVIDIA's only)."""
    from ..kernels.configs import CONFIGS

    return [e for e, kernels in ENGINE_KERNELS.items() if all(k in CONFIGS[table] for k in kernels)]


@dataclass(frozen=True)
class Shape:
    """One MoE layer as one rank computes it: T tokens reach NR of E experts, K choices per token."""

    name: str
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    local_experts: int

    def describe(self) -> str:
        return (f"T={self.tokens} H={self.hidden} I={self.intermediate} E={self.experts} K={self.top_k} "
                f"NR={self.local_experts}")


@dataclass(frozen=True)
class Step:
    shape: Shape
    dtype: str
    engine: str

    @property
    def label(self) -> str:
        return f"{self.shape.name} {self.dtype} {self.engine}"


def shapes(shape_set: str, names: Sequence[str] | None = None) -> list[Shape]:
    """The shapes of a shape set (:data:`..shape_sets.SHAPE_SETS`, the benchmark's ``--shapes``), or those named."""
    sets = _SHAPE_DATA
    if shape_set not in sets:
        raise ValueError(f"unknown shape set {shape_set!r}; known: {sorted(sets)}")
    found = [Shape(name, per_rank * ep, H, I, E, K, E // ep)
             for name, H, I, E, K, per_rank, ep, _ in sets[shape_set]]
    if names:
        unknown = sorted(set(names) - {s.name for s in found})
        if unknown:
            raise ValueError(f"unknown shape(s) {unknown} in {shape_set!r}; known: {[s.name for s in found]}")
        found = [s for s in found if s.name in names]
    return found


def layer_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The layer's tensors on ``device``: every expert gets ``T*K/E`` rows (token t's choices are
    experts ``(t*K + j) mod E``), the routing weights a softmax of random logits, the weights scaled
    by ``1/sqrt(fan_in)``. The rows per expert are what the keys depend on; values only need to be finite."""
    T, H, I, E, K, NR = (shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k,
                         shape.local_experts)
    g = torch.Generator(device=device).manual_seed(seed)
    idx = (torch.arange(T, device=device)[:, None] * K + torch.arange(K, device=device)) % E
    weights = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=-1).to(dtype)
    return dict(
        x=torch.randn(T, H, generator=g, device=device).to(dtype),
        weights=weights, idx=idx,
        w_gu=(torch.randn(NR, 2 * I, H, generator=g, device=device) * H**-0.5).to(dtype),
        w_d=(torch.randn(NR, H, I, generator=g, device=device) * I**-0.5).to(dtype),
        dout=torch.randn(T, H, generator=g, device=device).to(dtype),
    )


def run_layer(inputs: dict[str, torch.Tensor], engine: str, num_local: int) -> None:
    """One forward and backward of stages 2-5 with the Triton backend and ``engine`` for stage 4."""
    from ..autograd.moe_experts import moe_experts_forward

    x = inputs["x"].detach().requires_grad_()
    w = inputs["weights"].detach().requires_grad_()
    w_gu = inputs["w_gu"].detach().requires_grad_()
    w_d = inputs["w_d"].detach().requires_grad_()
    out = moe_experts_forward(x, w, inputs["idx"], w_gu, w_d, backend="triton", expert_start=0,
                              num_local=num_local, gemm_engine=engine)
    out.backward(inputs["dout"])


def run_step(step: Step, device: torch.device) -> None:
    """Build ``step``'s layer on ``device``, run it forward and backward, wait for it and free it."""
    try:
        run_layer(layer_inputs(step.shape, DTYPES[step.dtype], device), step.engine, step.shape.local_experts)
        if device.type in ("cuda", "xpu"):
            getattr(torch, device.type).synchronize()
    finally:  # the next shape gets the memory back, after an out-of-memory error too
        if device.type in ("cuda", "xpu"):
            getattr(torch, device.type).empty_cache()


def entries_of(timings: dict, step: Step) -> list[dict[str, Any]]:
    """Kept-table entries of autotune's timings (key -> (winner, seconds by config)) found at ``step``."""
    out = []
    for (kernel, table, dtype, n, k, bucket), (winner, seconds) in timings.items():
        out.append({"kernel": kernel, "table": table, "dtype": dtype, "n": n, "k": k, "rows_bucket": bucket,
                    "config": winner, "seconds": seconds, "shape": step.shape.name, "engine": step.engine})
    return out


def merged(path: Path, device: str, entries: list[dict[str, Any]], **header: Any) -> tuple[dict[str, Any], int]:
    """The document to write at ``path``: this run's entries, and those of the file already there that
    this run did not time again when it names the same device, torch and Triton (else it is replaced);
    with how many old entries were kept."""
    from ..kernels import kept_configs

    fresh = kept_configs.document(device, entries, **header)
    kept: list[dict[str, Any]] = []
    if path.is_file():
        try:
            old = kept_configs.read(path)
        except (OSError, ValueError, KeyError, TypeError):
            old = None
        if old is not None and all(old.get(f) == fresh[f] for f in ("device", "torch", "triton")):
            timed = {kept_configs.entry_key(e) for e in entries}
            kept = [e for e in old["entries"] if kept_configs.entry_key(e) not in timed]
    if kept:
        fresh = kept_configs.document(device, [*kept, *entries], **header)
    return fresh, len(kept)


def sweep(steps: Sequence[Step], device: torch.device, budget_s: float,
          progress: Callable[[str], None] = print, run: Callable[[Step, torch.device], None] | None = None,
          clock: Callable[[], float] = time.perf_counter) -> tuple[list[dict[str, Any]], list[Step]]:
    """Run ``steps`` with the kept table off until the budget says stop; (the entries timed, the
    steps done). ``run``: :func:`run_step` (tests give another)."""
    from .. import settings
    from ..kernels.triton import autotune

    run = run or run_step
    start = clock()
    last: dict[str, float] = {}
    entries: list[dict[str, Any]] = []
    done: list[Step] = []
    autotune.forget()
    with settings.override(kept_configs=False):
        for i, step in enumerate(steps, 1):
            elapsed = clock() - start
            estimate = last.get(step.engine, max(last.values(), default=0.0))
            if elapsed + estimate > budget_s:
                progress(f"budget: {elapsed:.0f} s spent of {budget_s:.0f} s and '{step.label}' takes about "
                         f"{estimate:.0f} s; stopping after {len(done)} of {len(steps)} steps")
                break
            t0 = clock()
            before = set(autotune.timings())
            failure = None
            try:
                run(step, device)
            except Exception as exc:  # out of memory at one shape: the others still count
                failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            now = autotune.timings()
            new = {key: now[key] for key in now if key not in before}  # a failed step's timed keys count too
            entries += entries_of(new, step)
            last[step.engine] = clock() - t0
            if failure is None:
                done.append(step)
            progress(f"[{i}/{len(steps)}] {step.label} ({step.shape.describe()}): "
                     + (f"failed ({failure}); " if failure else "")
                     + f"{len(new)} keys, {sum(len(s) for _, s in new.values())} candidates timed in "
                     f"{last[step.engine]:.1f} s ({clock() - start:.0f} of {budget_s:.0f} s)")
    return entries, done


def _device_ready(dev: torch.device) -> bool:
    if dev.type == "cuda":
        return torch.cuda.is_available()
    if dev.type == "xpu":
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    return False


def main(argv: list[str] | None = None) -> int:
    from ..kernels import configs, kept_configs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "xpu"), help="the GPU to sweep (default cuda)")
    ap.add_argument("--shapes", default="practitioners", choices=SHAPE_SETS, help="shape set (default practitioners)")
    ap.add_argument("--shape-names", nargs="+", default=None, help="only these shapes of the set")
    ap.add_argument("--dtype", nargs="+", choices=tuple(DTYPES), default=["bf16"], help="dtypes (default bf16)")
    ap.add_argument("--engines", nargs="+", choices=tuple(ENGINE_KERNELS), default=None,
                    help="Triton GEMM engines (default: triton, and triton_tma where it runs)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON file to write (default: the package's kept table for this device, "
                         "fastmoe_xpu/kernels/tuned/<slug>.json)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds the sweep may take; it stops before a step that would end past them and "
                         f"writes what it has (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--dry-run", action="store_true", help="list the steps and each kernel's candidates; run nothing")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    ready = _device_ready(dev)
    try:
        chosen_shapes = shapes(args.shapes, args.shape_names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    table = configs.table_for(dev) if ready else {"cuda": "cuda", "xpu": "xpu"}[dev.type]
    engines = list(args.engines or engines_of(table))
    if ready and args.engines is None:
        from ..kernels import registry

        engines = [e for e in engines if registry.unavailable_reason(e, "triton", dev, DTYPES[args.dtype[0]]) is None]
    missing = [e for e in engines if e not in engines_of(table)]
    if missing:
        print(f"error: config table {table!r} has no kernels of engine(s) {missing}", file=sys.stderr)
        return 2
    steps = [Step(s, d, e) for s in chosen_shapes for d in args.dtype for e in engines]

    if args.dry_run:
        name = kept_configs.device_name(dev) if ready else None
        out = args.out or (kept_configs.path_for(name) if name else kept_configs.TUNED_DIR / "<slug of the device name>.json")
        print(f"config sweep (dry run): {len(steps)} steps on {dev.type} ({name or 'no device here'}), config table "
              f"{table!r}, budget {args.budget:.0f} s, would write {out}")
        for e in engines:
            print(f"  {e}: " + ", ".join(f"{k} ({len(configs.configs(table, k))} candidates)" for k in ENGINE_KERNELS[e]))
        for i, step in enumerate(steps, 1):
            print(f"  [{i}/{len(steps)}] {step.label} ({step.shape.describe()})")
        return 0
    if not ready:
        print(f"error: torch sees no {dev.type} device here; the config sweep times kernels on the GPU itself "
              f"(--dry-run lists what it would time)", file=sys.stderr)
        return 2
    if not steps:
        print(f"error: no Triton GEMM engine runs on this {dev.type} device", file=sys.stderr)
        return 2

    name = kept_configs.device_name(dev) or dev.type
    out = args.out or kept_configs.path_for(name)
    print(f"config sweep: {len(steps)} steps on {name}, config table {table!r}, budget {args.budget:.0f} s, "
          f"writing {out}", flush=True)
    entries, done = sweep(steps, dev, args.budget, progress=lambda s: print(s, flush=True))
    command = "python -m fastmoe_xpu.tools.config_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    doc, kept = merged(out, name, entries, command=command.strip(), complete=len(done) == len(steps),
                       steps=[s.label for s in done])
    kept_configs.write(out, doc)
    kept_configs.forget()
    print(f"wrote {len(entries)} timed keys" + (f" and kept {kept} of the earlier sweep" if kept else "")
          + f" to {out} ({len(done)} of {len(steps)} steps)")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench lora``: one LoRA fine-tuning step (forward + backward) of a family's experts layer
with PEFT's adapters (``target_parameters`` on ``gate_up_proj`` and ``down_proj``), transformers'
default experts implementation (``grouped_mm``) against ``"fastmoe"``, in one run.

Both contestants are one module: the family's own experts class at its bench shape
(:data:`bench.studies.families.FAMILY_SHAPES`, ``--scale`` divides H and I), wrapped by PEFT exactly as
``LoraConfig(target_parameters=[...])`` wraps it in a model; ``config._experts_implementation`` is
switched per call, so every weight and adapter is shared. ``--low-rank ENGINE`` adds a ``fastmoe``
contestant whose adapters' ``r``-wide products run on ``ENGINE`` instead of the registry's choice;
``--handed-in`` one whose adapters reach the experts function through
:func:`fastmoe_xpu.integrations.experts.run_adapters_in_experts` instead of PEFT's per-call
parametrization (whose registration folds ``W + delta`` once per forward, for every contestant).

Time: the steps are interleaved (one step of each contestant per round) and each contestant's
minimum over the rounds is kept, of the CPU time of the calling thread (``time.thread_time``) and of
the wall clock. With ``--threads 1`` (the default) every op runs on that thread, so its CPU time is
the step's work, which other processes on a loaded machine barely change; the wall clock is what a
quiet machine would show.

Peak memory: one step of each contestant (after the timed ones, idle buffer pools released first)
under ``torch.profiler`` with ``profile_memory``: every allocation and free of PyTorch's allocator in
order, the running sum's maximum above the step's start. That is the step's peak of tensor bytes
(activations, temporaries, the adapters' gradients), counted the same way for both.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, r adapter rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .families import FAMILY_SHAPES, experts_module, family_preset
from ..harness.presets import Preset
from ..harness.usage import Parser, count, output_file
from ..harness.report import plural

BASELINE, OURS = "grouped_mm", "fastmoe"


#: The tiny layers: a first model's experts (transformers' tiny test configs at H=96), 66 tokens, where
#: launches and per-call overhead, not arithmetic, set the time.
TINY = {"mixtral": (96, 48, 6, 2), "qwen3_moe": (96, 24, 10, 2)}
TINY_TOKENS = 66
#: Tokens of a decode step at the families' scaled bench shapes.
DECODE_TOKENS = 8
SHAPE_SETS = ("bench", "tiny", "decode")


@dataclasses.dataclass(frozen=True)
class LoraCase:
    """One layer of the benchmark: a family's experts module at ``H, I, E, K`` for ``T`` tokens."""

    family: str
    shape_set: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int

    def preset(self) -> Preset:
        return Preset(f"{self.family} ({self.shape_set})", self.hidden, self.intermediate, self.experts, self.top_k,
                      self.tokens, 1, f"{self.family} experts, {self.shape_set}")

    def as_dict(self) -> dict[str, Any]:
        return self.preset().as_dict() | {"shape_set": self.shape_set}


def cases(shape_sets: list[str], families: list[str], scale: int, tokens: int) -> list[LoraCase]:
    """The layers of ``shape_sets``: ``bench`` (each family's bench shape, H and I / ``scale``,
    ``tokens``), ``tiny`` (:data:`TINY`, the families that have one) and ``decode`` (the bench shape
    at :data:`DECODE_TOKENS` tokens)."""
    out = []
    for shape_set in shape_sets:
        for family in families:
            if shape_set == "tiny":
                if family in TINY:
                    out.append(LoraCase(family, "tiny", *TINY[family], TINY_TOKENS))
                continue
            t = tokens if shape_set == "bench" else DECODE_TOKENS
            pr, _ = family_preset(family, scale=scale, tokens=t)
            out.append(LoraCase(family, f"{shape_set} /{scale}" if scale != 1 else shape_set, pr.hidden,
                                pr.intermediate, pr.experts, pr.top_k, t))
    return out


def build(case: LoraCase, rank: int, seed: int = 0) -> tuple[nn.Module, nn.Module, tuple]:
    """``(peft wrapper, experts module, (x, top_k_index, top_k_weights))`` at ``case``'s shape."""
    from peft import LoraConfig, inject_adapter_in_model

    preset = case.preset()
    experts = experts_module(case.family, preset, torch.float32, torch.device("cpu"), seed)
    holder = nn.Module()
    holder.mlp = nn.Module()
    holder.mlp.experts = experts
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                            holder)
    g = torch.Generator().manual_seed(seed)
    T, E, K = preset.tokens, preset.experts, preset.top_k
    x = torch.randn(T, preset.hidden, generator=g)
    probs = torch.randn(T, E, generator=g).softmax(-1)
    w, idx = probs.topk(K)
    return holder.mlp.experts, experts, (x, idx, (w / w.sum(-1, keepdim=True)))


@contextlib.contextmanager
def low_rank_engine(engine: str | None) -> Iterator[None]:
    """The torch base's adapters' ``r``-wide products on ``engine`` for a while (None: as registered)."""
    from fastmoe_xpu.kernels import registry

    if engine is None:
        yield
        return
    impl = registry.IMPLEMENTATIONS["torch"]
    registry.IMPLEMENTATIONS["torch"] = dataclasses.replace(impl, low_rank_gemm=(engine,))
    registry._low_rank_set.cache_clear()
    try:
        yield
    finally:
        registry.IMPLEMENTATIONS["torch"] = impl
        registry._low_rank_set.cache_clear()


HANDED_IN = "handed-in"


@contextlib.contextmanager
def handed_in(wrapper: nn.Module, on: bool) -> Iterator[None]:
    """PEFT's adapters handed to the experts function directly for a while (``run_adapters_in_experts``)."""
    from fastmoe_xpu.integrations.experts import run_adapters_in_experts

    if not on:
        yield
        return
    run_adapters_in_experts(wrapper)
    try:
        yield
    finally:
        del wrapper.forward  # back to the class's (PEFT's) forward


def contestants(low_rank: list[str], handed: bool = False) -> dict[str, tuple[str, str | None]]:
    """name -> (experts implementation, low-rank engine override or ``HANDED_IN``)."""
    out = {BASELINE: (BASELINE, None), OURS: (OURS, None)}
    out.update({f"{OURS} (r-wide on {e})": (OURS, e) for e in low_rank})
    if handed:
        out[f"{OURS} (adapters handed in)"] = (OURS, HANDED_IN)
    return out


def step_fn(wrapper: nn.Module, experts: nn.Module, impl: str, option: str | None, inputs: tuple) -> Callable[[], None]:
    """One forward + backward of contestant ``impl`` (the adapters' gradients reset first)."""
    x, idx, w = inputs
    x = x.detach().requires_grad_()
    low_rank = None if option == HANDED_IN else option

    def run() -> None:
        experts.config._experts_implementation = impl
        with low_rank_engine(low_rank), handed_in(wrapper, option == HANDED_IN):
            out = wrapper(x, idx, w)
            out.backward(torch.ones_like(out))

    return run


def _zero(wrapper: nn.Module) -> None:
    for p in wrapper.parameters():
        p.grad = None


def peak_bytes(fn: Callable[[], None]) -> int:
    """The peak of tensor bytes allocated by ``fn`` above what was allocated when it started: the
    running sum of the allocator's events recorded by ``torch.profiler`` (``profile_memory``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def run(case: LoraCase, rank: int, rounds: int, low_rank: list[str], handed: bool = False) -> dict[str, Any]:
    from fastmoe_xpu import release_buffers

    wrapper, experts, inputs = build(case, rank)
    who = contestants(low_rank, handed)
    steps = {name: step_fn(wrapper, experts, impl, lr, inputs) for name, (impl, lr) in who.items()}
    grads: dict[str, list[torch.Tensor]] = {}
    for name, fn in steps.items():  # warm-up (the auto engine choice is timed here); the adapter gradients
        _zero(wrapper)
        fn()
        grads[name] = [p.grad.clone() for p in wrapper.parameters() if p.requires_grad]
    cpu = {name: float("inf") for name in steps}
    wall = dict(cpu)
    for _ in range(rounds):
        for name, fn in steps.items():
            _zero(wrapper)
            t0, w0 = time.thread_time(), time.perf_counter()
            fn()
            cpu[name] = min(cpu[name], time.thread_time() - t0)
            wall[name] = min(wall[name], time.perf_counter() - w0)
    peak = {}
    for name, fn in steps.items():
        _zero(wrapper)
        release_buffers()
        peak[name] = peak_bytes(fn)
    err = {name: max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                     for a, b in zip(g, grads[BASELINE])) for name, g in grads.items() if name != BASELINE}
    return {"family": case.family, "shape": case.as_dict(), "rank": rank,
            "threads": torch.get_num_threads(), "rounds": rounds, "cpu_s": cpu, "wall_s": wall, "peak_bytes": peak,
            "adapter_grad_rel_err": err}


def format_row(r: dict[str, Any]) -> list[str]:
    sh, cpu, wall, peak = r["shape"], r["cpu_s"], r["wall_s"], r["peak_bytes"]
    rows = []
    for name in cpu:
        if name == BASELINE:
            continue
        rows.append(
            f"| {r['family']} | {sh['shape_set']} | {sh['hidden']} | {sh['intermediate']} | {sh['experts']} | "
            f"{sh['top_k']} | {sh['tokens']} | {name} | "
            f"{cpu[BASELINE] * 1e3:.2f} | {cpu[name] * 1e3:.2f} | {cpu[BASELINE] / cpu[name]:.2f}x | "
            f"{wall[BASELINE] * 1e3:.2f} | {wall[name] * 1e3:.2f} | {wall[BASELINE] / wall[name]:.2f}x | "
            f"{peak[BASELINE] / 2**20:.1f} | {peak[name] / 2**20:.1f} | {peak[BASELINE] / max(peak[name], 1):.2f}x | "
            f"{r['adapter_grad_rel_err'][name]:.1e} |")
    return rows


HEADER = ("| family | shapes | H | I | E | K | T | ours | grouped_mm CPU ms | ours CPU ms | speed-up | grouped_mm wall ms "
          "| ours wall ms | wall speed-up | grouped_mm peak MiB | ours peak MiB | memory ratio | adapter grad rel err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench lora", description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILY_SHAPES),
                    help="family (repeat; default: all bench families)")
    ap.add_argument("--shapes", nargs="+", choices=SHAPE_SETS, default=["bench"],
                    help="bench: each family's bench shape (H and I / --scale, --tokens); tiny: tiny models' experts "
                         f"(mixtral H=96 E=6, qwen3_moe H=96 E=10, T={TINY_TOKENS}); decode: the bench shape at "
                         f"T={DECODE_TOKENS} (default: bench)")
    ap.add_argument("--scale", type=count, default=4, help="divide H and I by this (CPU-sized layers)")
    ap.add_argument("--tokens", type=count, default=1024)
    ap.add_argument("--rank", type=count, default=16)
    ap.add_argument("--rounds", type=count, default=5)
    ap.add_argument("--threads", type=count, default=1, help="torch threads (1: the CPU time is the whole step's)")
    ap.add_argument("--low-rank", action="append", default=[], choices=("loop", "grouped_mm"),
                    help="also time fastmoe with the adapters' r-wide products on this engine (repeat)")
    ap.add_argument("--handed-in", action="store_true",
                    help="also time fastmoe with the adapters handed to the experts function (run_adapters_in_experts)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    output_file(args.json)
    torch.set_num_threads(args.threads)
    results = []
    print(f"# LoRA step (forward + backward, adapters only train), r={args.rank}, shapes {' '.join(args.shapes)}, "
          f"fp32, {plural(torch.get_num_threads(), 'thread')}; min over {plural(args.rounds, 'interleaved round')} "
          "of the calling thread's CPU time and of the wall clock; peak = allocator bytes above the "
          "step's start (torch.profiler profile_memory)")
    print(HEADER)
    for case in cases(args.shapes, args.family or list(FAMILY_SHAPES), args.scale, args.tokens):
        r = run(case, args.rank, args.rounds, args.low_rank, args.handed_in)
        print("\n".join(format_row(r)), flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

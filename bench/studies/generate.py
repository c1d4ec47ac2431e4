"""``fastmoe-bench generate``: ``model.generate`` (greedy) of two-layer MoE models through transformers, the
experts run by ``"fastmoe"`` against transformers' own ``"grouped_mm"`` and ``"batched_mm"``.

One model per family, size and precision; the three experts implementations are switched on it
(``set_experts_implementation``), so they share every weight. Per batch size and thread count, the
three ``generate`` calls run interleaved in each round (their order rotating), the same prompt each
time, and a sample is the wall time of one call. The table gives fastmoe's speedup over the faster of
the two transformers implementations as the median of same-round ratios (with its spread, min-max
over the rounds) and the ratio of the minimums, and whether the tokens were the same.

Precisions: ``fp32``; ``bf16`` (the whole model in bfloat16); ``int8``: fastmoe with
``fastmoe_expert_precision="int8"`` inside :func:`fastmoe_xpu.frozen_expert_weights` (each expert weight
quantized once for the run), against transformers in fp32 and in bf16, whichever is faster (its
tokens are compared with the fp32 run's: quantization may change a greedy choice, so the row gives
the share of tokens that agree instead of a yes/no).

The first ``generate`` of each implementation (wall time) is timed apart, after one untimed
``generate`` of the family's ``eager`` experts has warmed torch; fastmoe's makes its engine choices
afresh (each model runs with an empty engine cache of its own, as on a new machine). A prefill shape
above ``auto``'s untimed bounds is timed (forwards only) at its third call by a layer
(``registry.INFERENCE_TIME_AFTER``), so the second timed round's fastmoe sample holds that timing:
the median of the rounds is the figure.

Sizes (:data:`SIZES`): ``tiny`` H=256 I=128 E=16 K=4, ``small`` H=512 I=256 E=32 K=8, ``olmoe``
OLMoE-1B-7B's layer H=2048 I=1024 E=64 K=8 (two layers: 3.2 GB of fp32 expert weights); ``micro``
H=64 I=32 E=8 K=2 for tests.

Legend: H hidden, I expert intermediate, E experts, K experts per token, B batch.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastmoe_xpu import settings

from ..harness.report import machine_line, run_header
from .families import FamilyShape as Size
from ..harness.usage import Parser, count, fail, output_file

#: The experts implementations compared; the first is ours.
IMPLEMENTATIONS = ("fastmoe", "grouped_mm", "batched_mm")
#: The transformers implementations fastmoe is measured against (the faster of them per round).
PEERS = IMPLEMENTATIONS[1:]
FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
PRECISIONS = ("fp32", "bf16", "int8")


#: The experts layer of each size (``model``: the size's name).
SIZES: dict[str, Size] = {
    "tiny": Size("tiny", 256, 128, 16, 4),
    "small": Size("small", 512, 256, 32, 8),
    "olmoe": Size("OLMoE-1B-7B", 2048, 1024, 64, 8),
    "micro": Size("micro", 64, 32, 8, 2),  # for tests: seconds, not minutes
}

#: Vocabulary of the models (small: the LM head is not what is measured).
VOCAB = 512


def model_config(family: str, size: Size, max_positions: int) -> Any:
    """A two-layer config of ``family`` with experts of ``size`` in both layers and attention heads of
    64 (at most 16 heads)."""
    from fastmoe_xpu.integrations.families import tiny_config

    heads = max(4, min(16, size.hidden // 64))
    wanted = {"hidden_size": size.hidden, "intermediate_size": size.intermediate,
              "moe_intermediate_size": size.intermediate, "num_experts": size.experts,
              "num_local_experts": size.experts, "num_experts_per_tok": size.top_k,
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": size.hidden // heads,
              "vocab_size": VOCAB, "max_position_embeddings": max_positions, "norm_topk_prob": True}
    base = tiny_config(family)
    return tiny_config(family, **{k: v for k, v in wanted.items() if hasattr(base, k)})


def build(family: str, size: Size, precision: str, max_positions: int, seed: int = 0) -> torch.nn.Module:
    """The family's causal LM at ``size``, weights from ``seed``, in eval mode; bf16 when asked, the
    experts set to run int8 under fastmoe for ``int8``."""
    from fastmoe_xpu.integrations.families import build_model

    import fastmoe_xpu  # noqa: F401  (registers "fastmoe")

    torch.manual_seed(seed)
    model, causal = build_model(model_config(family, size, max_positions), experts_implementation="grouped_mm")
    if not causal:
        raise ValueError(f"{family}: transformers has no causal LM for it")
    model = model.eval()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    return model


def set_int8(model: torch.nn.Module, on: bool) -> None:
    """Every experts module of ``model`` runs its fastmoe GEMMs in int8 (``on``) or full precision."""
    from fastmoe_xpu.integrations.experts import PRECISION_ATTRIBUTE

    for m in model.modules():
        if hasattr(m, "has_gate") and hasattr(m, "down_proj"):
            setattr(m, PRECISION_ATTRIBUTE, "int8" if on else None)


def generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens after ``ids``: the new tokens."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@dataclass
class Contestant:
    """One way of running ``generate`` on a model: an experts implementation, maybe inside a context."""

    name: str
    model: torch.nn.Module
    implementation: str
    context: Any = contextlib.nullcontext

    def __call__(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        self.model.set_experts_implementation(self.implementation)
        with self.context():
            return generate(self.model, ids, new_tokens)


def measure(contestants: list[Contestant], ids: torch.Tensor, new_tokens: int, rounds: int,
            bar: Any = None) -> dict[str, Any]:
    """``{"first_s", "samples", "tokens"}`` per contestant: the first call (wall), ``rounds`` interleaved
    samples (wall, rotating order), the tokens of the first call."""
    first, tokens, samples = {}, {}, {c.name: [] for c in contestants}
    for c in contestants:
        t0 = time.perf_counter()
        tokens[c.name] = c(ids, new_tokens)
        first[c.name] = time.perf_counter() - t0
    for r in range(rounds):
        k = r % len(contestants)
        for c in contestants[k:] + contestants[:k]:
            t0 = time.perf_counter()
            c(ids, new_tokens)
            samples[c.name].append(time.perf_counter() - t0)
        if bar is not None:
            bar.update(1)
    return {"first_s": first, "samples": samples, "tokens": tokens}


def speedup(samples: dict[str, list[float]], ours: str, peers: list[str]) -> dict[str, float]:
    """fastmoe against the faster peer of each round: the median of the same-round ratios, their min and
    max, and the ratio of the minimums (peer over ours: above 1, fastmoe is faster)."""
    per_round = [min(samples[p][r] for p in peers) / samples[ours][r] for r in range(len(samples[ours]))]
    best_peer = min(min(samples[p]) for p in peers)
    return {"median": statistics.median(per_round), "lo": min(per_round), "hi": max(per_round),
            "of_minimums": best_peer / min(samples[ours])}


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of positions where two runs' tokens agree."""
    return float((a == b).float().mean())


def run_config(family: str, size_name: str, precision: str, batches: list[int], threads: list[int],
               prompt: int, new_tokens: int, rounds: int, seed: int, bar: Any = None) -> list[dict[str, Any]]:
    """Every (batch, threads) row of one family, size and precision, with an engine cache of its own."""
    size = SIZES[size_name]
    with tempfile.TemporaryDirectory() as tmp, settings.override(gemm_cache=str(Path(tmp) / "engines.json")):
        # a fresh engine cache: fastmoe's first generate makes its engine choices as on a new machine
        return _run_config(family, size_name, size, precision, batches, threads, prompt, new_tokens, rounds, seed, bar)


def _run_config(family: str, size_name: str, size: Size, precision: str, batches: list[int], threads: list[int],
                prompt: int, new_tokens: int, rounds: int, seed: int, bar: Any) -> list[dict[str, Any]]:
    from fastmoe_xpu import frozen_expert_weights
    from fastmoe_xpu.kernels import registry
    from fastmoe_xpu.kernels.quantized import core

    models = {"fp32": build(family, size, "fp32" if precision != "bf16" else "bf16", prompt + new_tokens, seed)}
    if precision == "int8":
        models["bf16"] = build(family, size, "bf16", prompt + new_tokens, seed)
    main = models["fp32"]
    rows = []
    for batch in batches:
        ids = torch.randint(3, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(seed + batch))
        for n in threads:
            torch.set_num_threads(n)
            # warm torch (attention, sampling loop) with the family's eager experts, then a fresh engine choice
            Contestant("eager", main, "eager")(ids, 2)
            registry.forget_choices()
            if precision == "int8":
                set_int8(main, True)
                core.forget_weights()
                ours = Contestant("fastmoe", main, "fastmoe", frozen_expert_weights)
                peers = [Contestant(f"{impl} {p}", m, impl) for p, m in models.items() for impl in PEERS]
            else:
                ours = Contestant("fastmoe", main, "fastmoe")
                peers = [Contestant(impl, main, impl) for impl in PEERS]
            try:
                res = measure([ours, *peers], ids, new_tokens, rounds, bar)
            finally:
                set_int8(main, False)
                core.forget_weights()
            names = [p.name for p in peers]
            ref = res["tokens"][names[0]]
            same = all(torch.equal(res["tokens"][n], ref) for n in names[1:])
            first_peer = min(res["first_s"][n] for n in names)
            rows.append({
                "family": family, "size": size_name, "shape": f"H={size.hidden} I={size.intermediate} "
                f"E={size.experts} K={size.top_k}", "precision": precision, "batch": batch, "threads": n,
                **speedup(res["samples"], "fastmoe", names),
                "fastmoe_ms": 1e3 * min(res["samples"]["fastmoe"]),
                "peers_ms": {p: 1e3 * min(res["samples"][p]) for p in names},
                "first_ratio": res["first_s"]["fastmoe"] / first_peer,
                "first_ms": {k: 1e3 * v for k, v in res["first_s"].items()},
                "tokens_agree": agreement(res["tokens"]["fastmoe"], ref), "peers_agree": same,
            })
    return rows


HEADER = ("| family | size | precision | B | threads | fastmoe ms | grouped_mm ms | batched_mm ms | speedup (median "
          "of rounds, min-max) | ratio of minimums | first generate, fastmoe / peer | tokens equal |")


def format_row(r: dict[str, Any]) -> str:
    peers = r["peers_ms"]
    gm = min(v for k, v in peers.items() if k.startswith("grouped_mm"))
    bm = min(v for k, v in peers.items() if k.startswith("batched_mm"))
    if r["precision"] == "int8":
        equal = f"{100 * r['tokens_agree']:.0f}% of fp32's"
    else:
        equal = "yes" if r["tokens_agree"] == 1.0 and r["peers_agree"] else (
            f"NO ({100 * r['tokens_agree']:.0f}%; grouped_mm and batched_mm {'agree' if r['peers_agree'] else 'differ'})")
    return (f"| {r['family']} | {r['size']} | {r['precision']} | {r['batch']} | {r['threads']} | "
            f"{r['fastmoe_ms']:.1f} | {gm:.1f} | {bm:.1f} | {r['median']:.2f}x ({r['lo']:.2f}-{r['hi']:.2f}) | "
            f"{r['of_minimums']:.2f}x | {r['first_ratio']:.2f}x | {equal} |")


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench generate", description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES, metavar="NAME",
                    help=f"model families (default: {' '.join(FAMILIES)})")
    ap.add_argument("--sizes", nargs="+", default=["tiny"], choices=list(SIZES), metavar="SIZE",
                    help=f"expert sizes, of {' '.join(SIZES)} (default: tiny)")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS, metavar="P",
                    help="fp32, bf16, int8 (default: all three)")
    ap.add_argument("--batch", nargs="+", type=count, default=[1, 4], help="sequences per generate (default 1 4)")
    ap.add_argument("--threads", nargs="+", type=count, default=[1], help="torch threads, a row each (default 1)")
    ap.add_argument("--prompt", type=count, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--new-tokens", type=count, default=32, help="tokens generated, greedy (default 32)")
    ap.add_argument("--rounds", type=count, default=5, help="interleaved timed rounds (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the table (markdown) and a .json beside it")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.out:
        output_file(args.out, "--out")
    header = run_header(torch.device("cpu"), dict(vars(args)))
    lines = [f"# {header['date_utc']}  {machine_line(header['machine'])}", f"# {header['command']}",
             f"# greedy generate, prompt {args.prompt} + {args.new_tokens} new tokens, two decoder layers, wall time, "
             f"{args.rounds} interleaved rounds; speedup: the faster of grouped_mm and batched_mm over fastmoe "
             "(int8: fastmoe in int8 inside frozen_expert_weights against the faster of fp32 and bf16)", "",
             HEADER, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    configs = [(f, s, p) for s in args.sizes for f in args.families for p in args.precisions]
    total = len(configs) * len(args.batch) * len(args.threads) * args.rounds
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            bar = tqdm(total=total, desc="generate rounds", file=sys.stderr, leave=False, dynamic_ncols=True)
    rows: list[dict[str, Any]] = []
    threads_before = torch.get_num_threads()
    try:
        for family, size, precision in configs:
            if bar is not None:
                bar.set_postfix_str(f"{family} {size} {precision}")
            try:
                new = run_config(family, size, precision, args.batch, args.threads, args.prompt, args.new_tokens,
                                 args.rounds, args.seed, bar)
            except (ValueError, RuntimeError) as exc:
                fail(f"error: {family} {size} {precision}: {exc}")
            for r in new:
                line = format_row(r)
                (bar.write if bar is not None else print)(line)
                lines.append(line)
            rows += new
            if args.out:  # rewritten after every model: a run stopped part-way keeps what it measured
                Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
                Path(args.out).with_suffix(".json").write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
    finally:
        torch.set_num_threads(threads_before)
        if bar is not None:
            bar.close()
    if bar is not None:  # the rows went past the bar: the table once more, in one piece
        print("\n".join(lines[-len(rows):]))
    if args.out:
        print(f"# wrote {args.out}")
    differ = [r for r in rows if r["precision"] != "int8" and not (r["tokens_agree"] == 1.0 and r["peers_agree"])]
    for r in differ:
        print(f"# {r['family']} {r['size']} {r['precision']} B={r['batch']}: the tokens differ", file=sys.stderr)
    # fp32 must give transformers' tokens; bf16 rounds differently per kernel (the row says whether
    # transformers' own two implementations agree), int8 changes the numbers by design
    return 1 if any(r["precision"] == "fp32" for r in differ) else 0


if __name__ == "__main__":
    raise SystemExit(main())

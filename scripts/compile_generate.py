"""Compiled generation, stock OLMoE against a patched one, each in a fresh process.

``python scripts/compile_generate.py [--pairs 3] [--new-tokens 32] [--prompt 8]``

transformers' static-cache generation with a compiled forward (``compile_config``,
``fullgraph=True``, inductor) costs mostly compilation at small sizes, and a process that has
compiled once pays less the second time (inductor's start-up, warm caches). So every run is its
own process, the stock and the patched model alternate (stock first in one pair, patched first in
the next), and the table keeps the minimum over pairs. Each process reports the first
``generate`` call's wall time (compile included: what a user waits for), a second call's (the
steady state), the seconds torch spent compiling, how many frames it compiled (a recompile per
length would show here) and whether the tokens equal eager generation's.

Inductor's on-disk caches would let a later process skip work an earlier one did, so each process
gets its own empty cache directory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: tiny-moe's model shape (the trainer's preset), vocabulary 1024.
SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
             eos_token_id=None, pad_token_id=0)


def worker(kind: str, prompt: int, new_tokens: int, seed: int) -> dict:
    """One measurement in this process: ``kind`` is ``"stock"`` or ``"patched"``."""
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(OlmoeConfig(**SHAPE)).eval()
    if kind == "patched":
        from fastmoe_xpu import patch_olmoe

        patch_olmoe(model, backend="torch")
    from torch._dynamo.utils import compilation_time_metrics, counters

    ids = torch.randint(1, SHAPE["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(seed))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    eager = model.generate(ids, disable_compile=True, **kw)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    t0 = time.perf_counter()
    first = model.generate(ids, compile_config=config, **kw)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    second = model.generate(ids, compile_config=config, **kw)
    second_s = time.perf_counter() - t0
    return {
        "kind": kind,
        "first_s": first_s,
        "second_s": second_s,
        "compile_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))),
        "frames": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "equal_to_eager": bool(torch.equal(first, eager) and torch.equal(second, eager)),
    }


def run_one(kind: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="fastmoe_gen_cache_") as cache:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--seed", str(args.seed)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["process_s"] = time.perf_counter() - t0
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="process pairs (stock, patched), order alternating")
    p.add_argument("--prompt", type=int, default=8, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one process may take")
    p.add_argument("--worker", choices=("stock", "patched"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pairs < 1 or args.prompt < 1 or args.new_tokens < 1:
        raise SystemExit("--pairs, --prompt and --new-tokens must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompt, args.new_tokens, args.seed)))
        return 0
    runs: dict[str, list[dict]] = {"stock": [], "patched": []}
    for i in range(args.pairs):
        order = ("stock", "patched") if i % 2 == 0 else ("patched", "stock")
        for kind in order:
            print(f"[pair {i + 1}/{args.pairs}] {kind} ...", end=" ", flush=True, file=sys.stderr)
            r = run_one(kind, args)
            runs[kind].append(r)
            print(f"first generate {r['first_s']:.1f} s, compile {r['compile_s']:.1f} s, frames {r['frames']}",
                  file=sys.stderr, flush=True)
    print(f"\ncompiled generation, tiny-moe shape, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"fresh process each, min over {args.pairs} pairs\n")
    print("| model | first generate, compile included (s) | second generate (s) | compile (s) | frames compiled "
          "| graph breaks | tokens = eager | process (s) |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for kind in ("stock", "patched"):
        rs = runs[kind]
        print(f"| {kind} | {min(r['first_s'] for r in rs):.2f} | {min(r['second_s'] for r in rs):.3f} | "
              f"{min(r['compile_s'] for r in rs):.2f} | {max(r['frames'] for r in rs)} | "
              f"{max(r['graph_breaks'] for r in rs)} | {all(r['equal_to_eager'] for r in rs)} | "
              f"{min(r['process_s'] for r in rs):.1f} |")
    ratio = min(r["first_s"] for r in runs["patched"]) / min(r["first_s"] for r in runs["stock"])
    print(f"\npatched / stock, first generate: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A short demo: patch a tiny OLMoE model and compare it with the original.

``python -m fastmoe_xpu.demo [--layers N] [--tokens T] [--steps S]`` builds a small transformers
``OlmoeForCausalLM`` (random weights, nothing downloaded), copies it, swaps in FastSparseMoeBlock
with :func:`fastmoe_xpu.patch_olmoe`, and prints the largest differences in logits, loss and
gradients together with forward+backward times of both models, measured interleaved.

The default shape is small so that the check takes seconds; there the whole model's fixed costs
(attention, embeddings, Python) hide the expert layer and the speedup is near 1x. The number that
says what the design buys is the layer at a real shape beside its GEMM-only bound:
``fastmoe-bench --demo`` (what ``make demo`` runs after this), or the whole of Table 3 with
``fastmoe-bench --table3``. This module imports nothing from the benchmark package.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512, help="tokens per batch (batch 1)")
    p.add_argument("--steps", type=int, default=5, help="timed forward+backward rounds per model")
    args = p.parse_args(argv)
    try:
        from transformers import OlmoeConfig, OlmoeForCausalLM
    except ImportError:
        print("error: the demo needs transformers (pip install 'fastmoe_xpu[hf]')")
        return 2
    from fastmoe_xpu import patch_olmoe

    torch.manual_seed(0)
    cfg = OlmoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        num_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=args.tokens,
        output_router_logits=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    ref = OlmoeForCausalLM(cfg)
    fast = copy.deepcopy(ref)
    n = patch_olmoe(fast)
    print(f"patched {n} OlmoeSparseMoeBlock(s) -> FastSparseMoeBlock "
          f"(H={args.hidden}, I={args.intermediate}, E={args.experts}, K={args.top_k}, T={args.tokens})")
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out

    out_r, out_f = step(ref), step(fast)
    grads_r = dict(ref.named_parameters())
    gdiff = max((p.grad - grads_r[k].grad).abs().max().item() for k, p in fast.named_parameters())
    print(f"max |logits diff| {(out_f.logits - out_r.logits).abs().max().item():.3e}   "
          f"loss {out_r.loss.item():.6f} vs {out_f.loss.item():.6f}   "
          f"aux {out_r.aux_loss.item():.6f} vs {out_f.aux_loss.item():.6f}   max |grad diff| {gdiff:.3e}")
    best = {"transformers": float("inf"), "fastmoe": float("inf")}
    for _ in range(args.steps):  # interleaved, minimum over rounds: this machine is noisy
        for name, model in (("transformers", ref), ("fastmoe", fast)):
            t0 = time.perf_counter()
            step(model)
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"forward+backward of the whole model, best of {args.steps}: transformers {best['transformers']*1e3:.1f} ms, "
          f"fastmoe {best['fastmoe']*1e3:.1f} ms, speedup {best['transformers'] / best['fastmoe']:.2f}x")
    print(f"(at H={args.hidden}, {args.tokens} tokens the expert layer is a small part of the step, so this ratio "
          "says little; fastmoe-bench --demo measures the Mula-7B-A1B layer against its GEMM-only bound)")
    ok = torch.allclose(out_f.logits, out_r.logits, rtol=1e-4, atol=1e-5)
    print("numbers match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

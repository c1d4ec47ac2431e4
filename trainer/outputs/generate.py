"""Greedy and sampled continuations of fixed prompts from an exported transformers directory, so a
run ends by showing what the model writes. Only transformers is used (the same path a user takes),
and sampling is seeded per prompt, so the same model and seed give the same text."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

#: Prompts of the embedded corpus's kind: the Python reference documentation (prose about code, and code).
PROMPTS = ("The ", "If ", "class ", ">>> ")


@torch.no_grad()
def generate_samples(model_dir: str, prompts: Sequence[str] = PROMPTS, *, seed: int = 0, max_new_tokens: int = 48,
                     temperature: float = 0.8, top_k: int = 40) -> list[dict[str, Any]]:
    """One greedy and one sampled continuation of each prompt: ``[{prompt, mode, text}]``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tok(prompt)["input_ids"]], dtype=torch.long)
        mask = torch.ones_like(ids)
        common = dict(attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                      eos_token_id=None)  # keep going past a document end: the sample shows it
        greedy = model.generate(ids, do_sample=False, **common)
        torch.manual_seed(seed + i)
        sampled = model.generate(ids, do_sample=True, temperature=temperature, top_k=top_k, **common)
        for mode, seq in (("greedy", greedy), ("sampled", sampled)):
            out.append({"prompt": prompt, "mode": mode, "seed": seed + i if mode == "sampled" else None,
                        "text": tok.decode(seq[0, ids.shape[1]:].tolist(), skip_special_tokens=False)})
    return out


def save_samples(samples: list[dict[str, Any]], path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(samples, f, indent=2, ensure_ascii=False)
    return path


def format_samples(samples: list[dict[str, Any]]) -> str:
    return "\n".join(f"[{s['mode']:7s}] {s['prompt']!r} -> {s['text']!r}" for s in samples)


if __name__ == "__main__":  # python -m fastmoe_trainer.outputs.generate DIR
    import sys

    d = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    print(format_samples(generate_samples(d)))

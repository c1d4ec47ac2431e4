"""Throughput of preprocessing and of the loader on a synthetic corpus (no downloads).

    python -m fastmoe_trainer.data.bench [--docs 20000] [--context 2048] [--shards 8] [--bpe-vocab 8000]

Writes a reproducible JSONL corpus of random words to a temporary folder, preprocesses it with
the byte tokenizer and with a BPE `tokenizer.json` trained on the same words, then times loader
construction (with and without checksums) and `next_batch`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from .build import preprocess_files
from .loader import ShardedLoader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmoe_trainer.data.bench", description=__doc__.split("\n\n")[0])
    for flag, default in (("--docs", 20000), ("--context", 2048), ("--shards", 8), ("--bpe-vocab", 8000),
                          ("--global-batch", 64), ("--micro-batch", 8)):
        p.add_argument(flag, type=int, default=default)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(5000)]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        with open(corpus, "w") as f:
            for _ in range(a.docs):
                f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(50, 300))))}) + "\n")
        size_mb = os.path.getsize(corpus) / 1e6
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator([" ".join(words)] * 3, trainers.BpeTrainer(
            vocab_size=a.bpe_vocab, special_tokens=["<|endoftext|>"], show_progress=False))
        bpe_path = os.path.join(tmp, "tokenizer.json")
        bpe.save(bpe_path)
        print(f"corpus: {a.docs} documents, {size_mb:.1f} MB JSONL; context {a.context}, {a.shards} shards, "
              f"G={a.global_batch} B={a.micro_batch}")
        for name, tok in (("byte", "byte"), (f"bpe-{a.bpe_vocab}", bpe_path)):
            out = os.path.join(tmp, name)
            t0 = time.perf_counter()
            mpath = preprocess_files([corpus], out, a.context, tok, shards=a.shards, progress=False)
            dt = time.perf_counter() - t0
            with open(mpath) as f:
                m = json.load(f)
            line = f"{name:>9}: preprocess {dt:6.2f} s ({size_mb / dt:5.1f} MB/s, {m['stream_tokens'] / 1e6 / dt:5.2f} Mtok/s)"
            for verify in (True, False):
                t0 = time.perf_counter()
                loader = ShardedLoader(mpath, a.global_batch, a.micro_batch, verify=verify)
                t_open = time.perf_counter() - t0
                steps = 50
                t0 = time.perf_counter()
                for _ in range(steps):
                    loader.next_batch()
                t_step = (time.perf_counter() - t0) / steps
                line += f" | open verify={'on' if verify else 'off'} {t_open * 1e3:5.0f} ms, step {t_step * 1e3:.2f} ms"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

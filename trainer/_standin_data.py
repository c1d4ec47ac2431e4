"""Minimal in-memory stand-in with the interface of ``trainer.data`` (used only when that package
is absent): the pydoc topics of this Python as UTF-8 bytes (EOS 256, vocabulary 258), cut into
instances of C + 1 tokens, shuffled with ``seed``; DP rank d reads its contiguous slice."""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np
import torch


class MicroBatch(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor


def ensure_default_dataset(out_dir: str | None, context: int, seed: int = 0, progress: bool = True, **_: Any) -> str:
    from pydoc_data.topics import topics

    out_dir = out_dir or os.path.join(os.path.expanduser("~"), ".cache", "fastmoe_xpu", "standin")
    final = os.path.join(out_dir, f"standin-c{context}-s{seed}")
    manifest = os.path.join(final, "manifest.json")
    if os.path.isfile(manifest):
        return manifest
    os.makedirs(final, exist_ok=True)
    stream = []
    for k in sorted(topics):
        stream.append(np.frombuffer(topics[k].encode("utf-8"), dtype=np.uint8).astype(np.uint16))
        stream.append(np.array([256], dtype=np.uint16))
    tokens = np.concatenate(stream)
    n = (len(tokens) - 1) // context
    inst = np.stack([tokens[i * context:i * context + context + 1] for i in range(n)])
    inst = inst[np.random.default_rng(seed).permutation(n)]
    np.save(os.path.join(final, "shard0.npy"), inst)
    with open(manifest + ".tmp", "w") as f:
        json.dump({"context": context, "num_instances": n, "tokenizer": {"type": "byte", "vocab_size": 258}}, f)
    os.replace(manifest + ".tmp", manifest)
    return manifest


def load_manifest(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        path = os.path.join(path, "manifest.json")
    if not os.path.isfile(path):
        raise ValueError(f"data manifest {path!r} does not exist")
    with open(path) as f:
        m = json.load(f)
    m["_path"] = path
    return m


class ShardedLoader:
    def __init__(self, data: str, global_batch: int, micro_batch: int | None = None, dp_rank: int = 0,
                 dp_size: int = 1, verify: bool = True) -> None:
        m = load_manifest(data)
        self.tokens = np.load(os.path.join(os.path.dirname(m["_path"]), "shard0.npy"), mmap_mode="r")
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.micro_batch = micro_batch or global_batch // dp_size
        self.next_instance = 0

    def next_batch(self) -> list[MicroBatch]:
        per = self.global_batch // self.dp_size
        idx = (self.next_instance + self.dp_rank * per + np.arange(per)) % len(self.tokens)
        t = torch.from_numpy(self.tokens[idx].astype(np.int64))
        self.next_instance += self.global_batch
        return [MicroBatch(t[a:a + self.micro_batch, :-1].contiguous(), t[a:a + self.micro_batch, 1:].contiguous())
                for a in range(0, per, self.micro_batch)]

    def state_dict(self) -> dict[str, Any]:
        return {"next_instance": self.next_instance}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_instance = int(state["next_instance"])

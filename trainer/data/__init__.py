"""Data pipeline of the trainer: preprocessing into shuffled `.npy` shards, and the loader.

API for the training loop:
    ensure_default_dataset(out_dir, context, seed=0, shards=1, tokenizer="byte") -> manifest path
    preprocess_files(inputs, out_dir, context, tokenizer="byte", shards=1, seed=0) -> manifest path
    ShardedLoader(manifest, global_batch, micro_batch=None, dp_rank=0, dp_size=1, verify=True)
        .next_batch() -> list[MicroBatch(input_ids [B, C], labels [B, C])]
        .state_dict() / .load_state_dict(state)
    open_dataset(spec, verify=True, seed=0) -> ShardedDataset, or MixtureDataset for NAME=PATH:WEIGHT,...
    load_manifest(path) -> dict;  manifest_eos_id(manifest) -> the recorded EOS id or None;  tokenizer_from_description(manifest["tokenizer"])

Names resolve lazily so that `fastmoe-preprocess` starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenizer_from_description": "tokenizer",
    "build_dataset": "build",
    "preprocess_files": "build",
    "MicroBatch": "loader",
    "ShardedDataset": "loader",
    "ShardedLoader": "loader",
    "load_manifest": "loader",
    "manifest_eos_id": "loader",
    "MixtureDataset": "mixture",
    "data_context": "mixture",
    "open_dataset": "mixture",
    "parse_mixture": "mixture",
    "default_cache_dir": "default_corpus",
    "default_corpus": "default_corpus",
    "ensure_default_dataset": "default_corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

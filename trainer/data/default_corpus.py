"""The corpus the main job trains on when given no data: text from the Python installation.

Primary source: the Python Language Reference and library topics that CPython ships as
`pydoc_data.topics` (English prose with code, about 470 KB in 3.11), one document per topic in
sorted topic order. If a distribution strips that module, the fallback is the standard library's
top-level `*.py` files in sorted name order, whole files, until the byte cap. The text therefore
depends on the Python version; the manifest records the version and a sha256 of the text, and the
cache key contains that hash, so a different Python never reuses a stale data set.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import shutil
import sysconfig
import tempfile
from typing import Any

from .loader import load_manifest
from .build import FORMAT_VERSION, MANIFEST_NAME, build_dataset, memory_source
from .tokenizer import load_tokenizer

CORPUS_BYTE_CAP = 1 << 20  # bounds preprocessing time on a fresh machine (about a second)


def default_corpus() -> tuple[list[str], dict[str, Any]]:
    """The documents and a description (name, python version, document count, bytes, sha256)."""
    docs: list[str] = []
    try:
        from pydoc_data.topics import topics

        name = "python-pydoc-topics"
        candidates = [topics[k] for k in sorted(topics)]
    except ImportError:
        name = "python-stdlib-sources"
        candidates = []
        for p in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            with open(p, "rb") as f:
                candidates.append(f.read().decode("utf-8", errors="replace"))
    total = 0
    for d in candidates:
        n = len(d.encode("utf-8"))
        if total + n > CORPUS_BYTE_CAP:
            break
        docs.append(d)
        total += n
    h = hashlib.sha256("\0".join(docs).encode("utf-8")).hexdigest()
    return docs, {"name": name, "python": platform.python_version(), "documents": len(docs), "bytes": total, "sha256": h}


def default_cache_dir() -> str:
    """`$FASTMOE_DATA_CACHE` (read through the package's one settings object), else
    `~/.cache/fastmoe_xpu/data`."""
    # Imported here: the data tools start without torch, and only the trainer asks for the cache.
    from fastmoe_xpu import settings

    return settings.get().data_cache or os.path.join(os.path.expanduser("~"), ".cache", "fastmoe_xpu", "data")


def ensure_default_dataset(
    out_dir: str | None,
    context: int,
    seed: int = 0,
    shards: int = 1,
    tokenizer: str = "byte",
    progress: bool = True,
    valid: float = 0.05,
) -> str:
    """Preprocess the default corpus once into `out_dir/default-c{context}-s{seed}-{key}/` and return
    its manifest path (holding out `valid` of the instances as the validation split); later calls with the same parameters (and the same corpus text) reuse it.

    Safe to call from every rank at once: each builds in a private folder and renames it into
    place; a loser of the race discards its copy and uses the winner's, which is identical."""
    out_dir = default_cache_dir() if out_dir is None else out_dir
    docs, corpus = default_corpus()
    tok = load_tokenizer(tokenizer)
    desc = tok.describe()
    key_src = json.dumps(
        {"format": FORMAT_VERSION, "corpus": corpus["sha256"], "context": context, "seed": seed, "shards": shards,
         **({"valid": valid} if valid else {}),
         "tokenizer": {k: desc.get(k) for k in ("type", "sha256", "eos_id", "vocab_size")}},
        sort_keys=True,
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:12]
    final = os.path.join(out_dir, f"default-c{context}-s{seed}-{key}")
    manifest = os.path.join(final, MANIFEST_NAME)
    if os.path.isfile(manifest):
        load_manifest(manifest)  # raises on an unreadable manifest instead of training on it
        return manifest
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=out_dir)
    try:
        build_dataset([memory_source(f"<{corpus['name']}>", docs)], tmp, context, tok, shards, seed, progress,
                      extra={"corpus": corpus}, valid=valid)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(manifest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest

"""Turn text into shuffled, sharded training instances (the library behind
`fastmoe-preprocess`).

Three steps, each with a progress bar:
1. tokenize: every document, followed by EOS, is appended to one token stream (input files in the
   order given, documents in file order);
2. shuffle: the stream is cut into N = (L - 1) // C instances of C + 1 tokens, instance i being
   tokens [i*C, i*C + C + 1): consecutive instances share one boundary token, so every token
   after the first is a training target exactly once; the tail that does not fill an instance is
   dropped. A permutation `numpy.random.default_rng(seed).permutation(N)` orders them;
3. shard: the permuted instances are split into `shards` contiguous runs, each written as a 2-D
   `.npy` array [n_k, C + 1] (uint16 when the vocabulary fits, else uint32), plus
   `manifest.json` (see docs/data.md) written last, so a directory with a manifest is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..ft.stop import signals_held
from ..owned import DATA_SET, write_marker
from ..records.progress import stage_bar
from .sources import expand_inputs, input_format, iter_documents
from .tokenizer import Tokenizer, load_tokenizer, token_dtype

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = "fastmoe_xpu.trainer.data/1"
_ENCODE_BATCH = 256  # documents per tokenizer call: amortises the Python/Rust crossing
_GATHER_TOKENS = 1 << 24  # tokens gathered per write in step 3: bounds peak memory


@dataclass
class Source:
    """A named stream of documents: one input file, or an in-memory corpus."""

    name: str
    format: str
    size: int  # bytes, for the progress bar
    documents: Callable[[], Iterator[tuple[str, float]]]  # yields (text, fraction of `size` consumed)


def file_sources(inputs: list[str], text_field: str = "text") -> list[Source]:
    files = expand_inputs(list(inputs))
    return [
        Source(os.path.abspath(p), input_format(p), os.path.getsize(p), (lambda p=p: iter_documents(p, text_field)))
        for p in files
    ]


def memory_source(name: str, documents: list[str]) -> Source:
    size = sum(len(d.encode("utf-8")) for d in documents)

    def gen() -> Iterator[tuple[str, float]]:
        done = 0
        for d in documents:
            done += len(d.encode("utf-8"))
            if d:
                yield d, done / max(size, 1)

    return Source(name, "memory", size, gen)


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def shard_sizes(num_instances: int, shards: int) -> list[int]:
    """The first `num_instances % shards` shards hold one instance more than the rest."""
    base, extra = divmod(num_instances, shards)
    return [base + (k < extra) for k in range(shards)]


def check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _clear_previous(out_dir: str) -> None:
    """Remove an earlier data set's manifest (first, so a crash leaves no stale manifest) and the
    shards it lists. Other files in the directory are left alone."""
    mpath = os.path.join(out_dir, MANIFEST_NAME)
    if not os.path.exists(mpath):
        return
    try:
        with open(mpath) as f:
            old = json.load(f)
        names = [s["file"] for s in old.get("shards", [])]
    except (OSError, ValueError, KeyError, TypeError):
        names = []
    os.remove(mpath)
    for n in names:
        p = os.path.join(out_dir, os.path.basename(n))
        if os.path.exists(p):
            os.remove(p)


def _tokenize(sources: list[Source], tok: Tokenizer, dtype: np.dtype, stream_path: str, progress: bool) -> list[dict]:
    stats = []
    total_bytes = sum(s.size for s in sources)
    with open(stream_path, "wb") as out, stage_bar(total_bytes, "1/3 tokenize", "B", progress, unit_scale=True) as bar:
        for src in sources:
            n_docs = n_tok = 0
            reported = 0
            pending: list[str] = []
            frac = 0.0

            def flush() -> None:
                nonlocal n_docs, n_tok
                if not pending:
                    return
                ids = tok.encode_batch(pending)
                parts = []
                for a in ids:
                    parts.append(a)
                    parts.append(np.array([tok.eos_id], dtype=np.int64))
                flat = np.concatenate(parts)
                if flat.size and (flat.min() < 0 or flat.max() >= tok.vocab_size):
                    raise ValueError(f"{src.name}: tokenizer produced an id outside [0, {tok.vocab_size})")
                out.write(flat.astype(dtype).tobytes())
                n_docs += len(pending)
                n_tok += int(flat.size)
                pending.clear()

            for text, frac in src.documents():
                pending.append(text)
                if len(pending) >= _ENCODE_BATCH:
                    flush()
                    now = int(frac * src.size)
                    bar.update(now - reported)
                    reported = now
            flush()
            stats.append({"path": src.name, "format": src.format, "documents": n_docs, "tokens": n_tok})
            # the count first: the update below draws (or prints) the line that shows it
            bar.set_postfix(tokens=sum(s["tokens"] for s in stats), refresh=False)
            bar.update(src.size - reported)
    return stats


def build_dataset(
    sources: list[Source],
    out_dir: str,
    context: int,
    tokenizer: str | Tokenizer = "byte",
    shards: int = 1,
    seed: int = 0,
    progress: bool = True,
    extra: dict[str, Any] | None = None,
    valid: float = 0,
    marked: bool = False,
) -> str:
    """Tokenize, shuffle and shard `sources` into `out_dir`; returns the manifest path.
    `marked`: the data set's marker (trainer/owned.py) is written with it, as ``fastmoe-preprocess`` does.
    `valid`: held-out validation instances, a fraction in (0, 1) or a count >= 1 (0: none), kept in
    `valid.npy` and never trained on (see :func:`split_validation`).
    Raises ValueError with a one-line message for every bad input."""
    context = check_positive("context", context)
    shards = check_positive("shards", shards)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    dtype = token_dtype(tok.vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    # Everything is built in a staging folder and moved in at the end, so a failure (empty
    # corpus, bad line, full disk) leaves an earlier data set in `out_dir` intact.
    staging = tempfile.mkdtemp(prefix=".staging-", dir=out_dir)
    stream_path = os.path.join(staging, "tokens.tmp")
    try:
        stats = _tokenize(sources, tok, dtype, stream_path, progress)
        n_docs = sum(s["documents"] for s in stats)
        length = os.path.getsize(stream_path) // dtype.itemsize
        if n_docs == 0:
            raise ValueError(f"the corpus is empty: no documents in {', '.join(s.name for s in sources)}")
        num = (length - 1) // context if length > context else 0
        if num == 0:
            raise ValueError(
                f"the corpus has {length} tokens, fewer than context + 1 = {context + 1} needed for one instance"
            )
        if shards > num:
            raise ValueError(f"shards ({shards}) exceeds the number of instances ({num}); use at most {num}")

        with stage_bar(num, "2/3 shuffle", "inst", progress) as bar:
            perm = np.random.default_rng(seed).permutation(num)
            bar.update(num)

        stream = np.memmap(stream_path, dtype=dtype, mode="r", shape=(length,))
        # Row i of `windows` is instance i: a strided view, nothing is copied until gathered.
        windows = np.lib.stride_tricks.sliding_window_view(stream, context + 1)[::context]
        total_instances = num
        valid_meta = None
        n_valid = validation_count(valid, num)
        if n_valid:
            perm, valid_rows, dropped = split_validation(windows, perm, n_valid, progress)
            vpath = os.path.join(staging, VALID_NAME)
            np.save(vpath, valid_rows)
            valid_meta = {"file": VALID_NAME, "instances": int(valid_rows.shape[0]), "requested": valid,
                          "sha256": sha256_file(vpath), "train_instances_dropped_as_duplicates": dropped,
                          "hash": "blake2b-128 of the instance's token bytes"}
            num = int(perm.shape[0])
            if num < 1:
                raise ValueError(f"validation split {valid!r} leaves no training instance")
            if shards > num:
                raise ValueError(f"shards ({shards}) exceeds the number of training instances ({num})")
        shard_meta = []
        rows_per_gather = max(1, _GATHER_TOKENS // (context + 1))
        start = 0
        with stage_bar(num, "3/3 shard", "inst", progress) as bar:
            for k, n in enumerate(shard_sizes(num, shards)):
                name = f"shard-{k:05d}-of-{shards:05d}.npy"
                path = os.path.join(staging, name)
                arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(n, context + 1))
                for a in range(0, n, rows_per_gather):
                    b = min(n, a + rows_per_gather)
                    arr[a:b] = windows[perm[start + a : start + b]]
                    bar.update(b - a)
                arr.flush()
                del arr
                shard_meta.append({"file": name, "instances": n, "first_instance": start, "sha256": sha256_file(path)})
                start += n
        del windows, stream
        os.remove(stream_path)
        fingerprint = hashlib.sha256("".join(s["sha256"] for s in shard_meta).encode()).hexdigest()
        manifest = {
            "format": FORMAT_VERSION,
            "context": context,
            "instance_length": context + 1,
            "stride": context,
            "dtype": dtype.name,
            "seed": int(seed),
            "num_instances": num,
            "num_documents": n_docs,
            "stream_tokens": length,
            "dropped_tokens": length - (total_instances * context + 1),
            "tokenizer": tok.describe(),
            "inputs": stats,
            "num_shards": shards,
            "shards": shard_meta,
            "fingerprint": fingerprint,
        }
        if valid_meta is not None:
            manifest["valid"] = valid_meta
        if extra:
            manifest.update(extra)
        mpath = os.path.join(out_dir, MANIFEST_NAME)
        with open(os.path.join(staging, MANIFEST_NAME), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        # the move-in: a stop waits for it, so out_dir holds the earlier data set or this one, whole
        with signals_held():
            _clear_previous(out_dir)
            for s in shard_meta:
                os.replace(os.path.join(staging, s["file"]), os.path.join(out_dir, s["file"]))
            if valid_meta is not None:
                os.replace(os.path.join(staging, VALID_NAME), os.path.join(out_dir, VALID_NAME))
            elif os.path.exists(os.path.join(out_dir, VALID_NAME)):
                os.remove(os.path.join(out_dir, VALID_NAME))
            os.replace(os.path.join(staging, MANIFEST_NAME), mpath)
            if marked:
                data_files = [MANIFEST_NAME] + [s["file"] for s in shard_meta] + ([VALID_NAME] if valid_meta else [])
                write_marker(out_dir, DATA_SET, data_files, fingerprint=fingerprint)  # last: the data set is complete
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return mpath


VALID_NAME = "valid.npy"


def check_valid(valid: Any, name: str = "valid") -> None:
    """ValueError unless ``valid`` is 0, a fraction in (0, 1) or a whole count >= 1 (before any input is read)."""
    if isinstance(valid, bool) or not isinstance(valid, (int, float, np.integer, np.floating)) or valid < 0:
        raise ValueError(f"{name} must be 0, a fraction in (0, 1) or a count >= 1, got {valid!r}")
    if valid >= 1 and not float(valid).is_integer():
        raise ValueError(f"{name} must be a fraction in (0, 1) or a whole count, got {valid!r}")


def validation_count(valid: float, num: int) -> int:
    """Instances held out for `valid` (a fraction in (0, 1), a count >= 1, or 0) of `num`; at least
    one when a fraction is asked for. ValueError when it would leave no training instance."""
    check_valid(valid)
    if valid == 0:
        return 0
    n = max(1, int(round(valid * num))) if valid < 1 else int(valid)
    if n >= num:
        raise ValueError(f"valid={valid!r} holds out {n} of {num} instances, leaving none to train on")
    return n


def instance_hash(row: np.ndarray) -> bytes:
    """Content hash of one instance (its token ids as stored)."""
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


def split_validation(windows: np.ndarray, perm: np.ndarray, n_valid: int,
                     progress: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """Hold out the last `n_valid` instances of the shuffled order `perm` as the validation split:
    returns (training order without them and without every instance whose content equals a held-out
    one, the held-out rows [n_valid, C + 1], how many training instances were dropped as copies).
    Repeated text in a corpus makes equal instances; dropping them keeps the split truly unseen."""
    valid_rows = np.ascontiguousarray(windows[np.sort(perm[-n_valid:])])
    held = {instance_hash(r) for r in valid_rows}
    train = perm[:-n_valid]
    keep = np.ones(train.shape[0], dtype=bool)
    step = 1 << 14
    with stage_bar(train.shape[0], "   hold out", "inst", progress) as bar:
        for a in range(0, train.shape[0], step):
            rows = windows[train[a:a + step]]
            keep[a:a + rows.shape[0]] = [instance_hash(r) not in held for r in rows]
            bar.update(rows.shape[0])
    return train[keep], valid_rows, int((~keep).sum())


def preprocess_files(
    inputs: Iterable[str],
    out_dir: str,
    context: int,
    tokenizer: str | Tokenizer = "byte",
    shards: int = 1,
    seed: int = 0,
    text_field: str = "text",
    eos_token: str | None = None,
    progress: bool = True,
    valid: float = 0,
    marked: bool = False,
) -> str:
    """Preprocess input files (text, JSONL, Parquet, Arrow, directories of them) into `out_dir`;
    returns the manifest path. Every bad input raises ValueError with a one-line message."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer, eos_token=eos_token)
    # Validate the cheap parameters before any file is read.
    check_positive("context", context)
    check_positive("shards", shards)
    return build_dataset(file_sources(list(inputs), text_field), out_dir, context, tokenizer, shards, seed, progress,
                         valid=valid, marked=marked)

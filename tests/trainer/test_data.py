"""Data pipeline: preprocess -> shards -> loader, DP slicing, resume, input formats, tokenizers,
corruption and the CLI's error paths. Expected tokens are rebuilt here from the raw text with the
documented definition (stream = docs + EOS; instance i = stream[i*C : i*C + C + 1]; order =
default_rng(seed).permutation(N); epoch e >= 1 = default_rng([seed, e]).permutation(N)), never
by calling the code under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import trainer.data.preprocess as preprocess  # run by module name, whichever the package has
from trainer.data import (
    ShardedLoader,
    ensure_default_dataset,
    load_manifest,
    preprocess_files,
    tokenizer_from_description,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS = 256


def make_docs(n: int, seed: int) -> list[str]:
    """Short documents mixing ASCII and multi-byte UTF-8, of varied lengths."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghij klmnop\nqrstuvwxyz.,") + ["é", "ß", "中", "🙂"]
    return ["".join(rng.choice(alphabet, size=int(rng.integers(1, 40)))) for _ in range(n)]


def write_txt(path, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def write_jsonl(path, docs: list[str]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 7}) + "\n")
        f.write("\n")  # trailing blank line: skipped
    return str(path)


def byte_stream(docs_per_file: list[list[str]]) -> np.ndarray:
    ids: list[int] = []
    for docs in docs_per_file:
        for d in docs:
            ids += list(d.encode("utf-8")) + [EOS]
    return np.array(ids, dtype=np.int64)


def expected_instances(stream: np.ndarray, context: int, seed: int, count: int) -> np.ndarray:
    """The first `count` instances of the loader's endless stream, epochs wrapped."""
    n = (len(stream) - 1) // context
    table = np.stack([stream[i * context : i * context + context + 1] for i in range(n)])
    order = [np.random.default_rng(seed).permutation(n)]
    rows = []
    for g in range(count):
        e, r = divmod(g, n)
        if e == 0:
            rows.append(table[order[0][r]])
        else:
            # epoch e reshuffles the stored (already permuted) order
            rows.append(table[order[0][np.random.default_rng([seed, e]).permutation(n)[r]]])
    return np.stack(rows)


def read_steps(loader: ShardedLoader, steps: int) -> list[list]:
    return [loader.next_batch() for _ in range(steps)]


def flatten(steps: list[list]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([mb.input_ids for s in steps for mb in s])
    y = torch.cat([mb.labels for s in steps for mb in s])
    return x, y


@pytest.fixture
def corpus(tmp_path):
    """Two text files (one document each) and a JSONL file of 30 documents."""
    a, b, c = "First file.\n\nSecond paragraph, same document. 中文", "second ✓ file", make_docs(30, 0)
    files = [write_txt(tmp_path / "a.txt", a), write_txt(tmp_path / "b.txt", b), write_jsonl(tmp_path / "c.jsonl", c)]
    return files, byte_stream([[a], [b], c])


@pytest.mark.parametrize(
    "context,shards,seed,global_batch,micro_batch",
    [
        (7, 3, 5, 4, 2),  # odd context, instances split unevenly over shards
        (1, 1, 0, 6, 3),  # context 1: instances are single (input, target) pairs
        (16, 5, 123, 5, 1),  # global batch not dividing N: steps straddle epoch boundaries
        (50, 1, 9, 2, 2),  # context larger than most documents: instances span many documents
    ],
)
def test_round_trip_reproduces_permuted_tokens(tmp_path, corpus, context, shards, seed, global_batch, micro_batch):
    files, stream = corpus
    out = tmp_path / "out"
    mpath = preprocess_files(files, str(out), context, "byte", shards=shards, seed=seed, progress=False)
    m = load_manifest(mpath)
    n = (len(stream) - 1) // context
    assert m["num_instances"] == n and m["stream_tokens"] == len(stream) and m["num_documents"] == 32
    assert m["dtype"] == "uint16" and m["tokenizer"]["eos_id"] == EOS and m["tokenizer"]["vocab_size"] == 258
    assert m["dropped_tokens"] == len(stream) - (n * context + 1)
    assert [s["instances"] for s in m["shards"]] == [n // shards + (k < n % shards) for k in range(shards)]
    assert [i["documents"] for i in m["inputs"]] == [1, 1, 30]

    # The shards, concatenated, are the permuted instances.
    stored = np.concatenate([np.load(out / s["file"]) for s in m["shards"]])
    assert stored.dtype == np.uint16
    np.testing.assert_array_equal(stored, expected_instances(stream, context, seed, n))

    # The loader reproduces them, and wraps into a reshuffled second and third epoch.
    steps = -(-(2 * n + 3) // global_batch)
    loader = ShardedLoader(mpath, global_batch, micro_batch)
    batches = read_steps(loader, steps)
    assert all(len(s) == global_batch // micro_batch for s in batches)
    x, y = flatten(batches)
    want = torch.from_numpy(expected_instances(stream, context, seed, steps * global_batch))
    assert x.dtype == torch.int64 and x.shape == (steps * global_batch, context) and y.shape == x.shape
    torch.testing.assert_close(x, want[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(y, want[:, 1:], rtol=0, atol=0)
    assert loader.state_dict()["next_instance"] == steps * global_batch


@pytest.mark.parametrize(
    "dp_size,global_batch,micro_batch",
    [
        (2, 8, 2),  # D=2, two micro-batches per rank
        (4, 8, 1),  # D=4, micro batch 1
        (2, 6, 3),  # per-rank batch equals the micro batch
    ],
)
def test_dp_ranks_read_contiguous_slices_of_the_global_batch(tmp_path, corpus, dp_size, global_batch, micro_batch):
    files, _ = corpus
    mpath = preprocess_files(files, str(tmp_path / "out"), 5, shards=2, seed=1, progress=False)
    steps = 7
    whole = [flatten([s])[0] for s in read_steps(ShardedLoader(mpath, global_batch, global_batch), steps)]
    ranks = [read_steps(ShardedLoader(mpath, global_batch, micro_batch, d, dp_size, verify=False), steps) for d in range(dp_size)]
    per_rank = global_batch // dp_size
    for s in range(steps):
        for d in range(dp_size):
            assert len(ranks[d][s]) == per_rank // micro_batch
            x, _ = flatten([ranks[d][s]])
            # rank d owns rows [d*G/D, (d+1)*G/D) of the D=1 global batch, in order
            torch.testing.assert_close(x, whole[s][d * per_rank : (d + 1) * per_rank], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([flatten([ranks[d][s]])[0] for d in range(dp_size)]), whole[s], rtol=0, atol=0)


@pytest.mark.parametrize(
    "stop_after,resume_dp,resume_micro",
    [
        (3, 1, 2),  # same layout
        (0, 1, 4),  # resume before the first step
        (11, 2, 1),  # past an epoch boundary, resumed with another DP size and micro batch
    ],
)
def test_resume_continues_at_the_next_unseen_instance(tmp_path, corpus, stop_after, resume_dp, resume_micro):
    files, _ = corpus
    mpath = preprocess_files(files, str(tmp_path / "out"), 9, shards=3, seed=2, progress=False)
    total = stop_after + 6
    uninterrupted = [flatten([s]) for s in read_steps(ShardedLoader(mpath, 4, 2), total)]

    first = ShardedLoader(mpath, 4, 2)
    read_steps(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a checkpoint's serialisation
    assert state["next_instance"] == 4 * stop_after and state["step"] == stop_after

    resumed = []
    for d in range(resume_dp):
        r = ShardedLoader(mpath, 4, resume_micro, d, resume_dp, verify=False)
        r.load_state_dict(state)
        resumed.append(read_steps(r, total - stop_after))
    for s in range(total - stop_after):
        x = torch.cat([flatten([resumed[d][s]])[0] for d in range(resume_dp)])
        y = torch.cat([flatten([resumed[d][s]])[1] for d in range(resume_dp)])
        torch.testing.assert_close(x, uninterrupted[stop_after + s][0], rtol=0, atol=0)
        torch.testing.assert_close(y, uninterrupted[stop_after + s][1], rtol=0, atol=0)


def test_resume_refuses_another_data_set(tmp_path, corpus):
    files, _ = corpus
    a = ShardedLoader(preprocess_files(files, str(tmp_path / "a"), 4, seed=0, progress=False), 2)
    b = ShardedLoader(preprocess_files(files, str(tmp_path / "b"), 4, seed=1, progress=False), 2)
    with pytest.raises(ValueError, match="different data set"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "fmt",
    [
        "parquet",  # as datasets stores Hub data
        "arrow-stream",  # as datasets stores its cache and save_to_disk output
        "arrow-file",  # Arrow IPC file (random-access) format
    ],
)
def test_parquet_and_arrow_inputs_match_jsonl(tmp_path, fmt):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: Parquet/Arrow input untested")
    import pyarrow.parquet as pq

    docs = make_docs(40, 3)
    rows = docs[:10] + [None, ""] + docs[10:]  # a null and an empty row: both skipped
    table = pa.table({"id": list(range(len(rows))), "text": rows})
    path = str(tmp_path / ("d.parquet" if fmt == "parquet" else "d.arrow"))
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=7)
    else:
        with pa.OSFile(path, "wb") as sink:
            make = pa.ipc.new_stream if fmt == "arrow-stream" else pa.ipc.new_file
            with make(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=9):
                    w.write_batch(batch)
    got = load_manifest(preprocess_files([path], str(tmp_path / "p"), 6, shards=2, seed=4, progress=False))
    ref = load_manifest(preprocess_files([write_jsonl(tmp_path / "d.jsonl", docs)], str(tmp_path / "j"), 6, shards=2, seed=4, progress=False))
    assert got["num_documents"] == len(docs)
    assert got["fingerprint"] == ref["fingerprint"]  # identical shard bytes


def test_directory_input_is_expanded_sorted(tmp_path):
    d = tmp_path / "ds"
    (d / "sub").mkdir(parents=True)
    write_txt(d / "b.txt", "bbbb")
    write_txt(d / "sub" / "c.txt", "cccc")
    write_txt(d / "a.txt", "aaaa")
    write_txt(d / "dataset_info.json", '{"not": "data"}')  # metadata: ignored in a directory
    m = load_manifest(preprocess_files([str(d)], str(tmp_path / "out"), 2, progress=False))
    assert [os.path.relpath(i["path"], d) for i in m["inputs"]] == ["a.txt", "b.txt", os.path.join("sub", "c.txt")]
    stored = np.load(tmp_path / "out" / m["shards"][0]["file"])
    np.testing.assert_array_equal(stored, expected_instances(byte_stream([["aaaa"], ["bbbb"], ["cccc"]]), 2, 0, m["num_instances"]))


def _train_tokenizer(path, vocab_size: int, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def test_tokenizers_json_file(tmp_path):
    from tokenizers import Tokenizer

    docs = make_docs(60, 5)
    _train_tokenizer(tmp_path / "tok.json", 320, docs)
    ref = Tokenizer.from_file(str(tmp_path / "tok.json"))
    eos = ref.token_to_id("<|endoftext|>")
    stream = np.array([t for d in docs for t in ref.encode(d, add_special_tokens=False).ids + [eos]], dtype=np.int64)
    mpath = preprocess_files([write_jsonl(tmp_path / "d.jsonl", docs)], str(tmp_path / "out"), 8,
                       str(tmp_path / "tok.json"), shards=2, seed=3, progress=False)
    m = load_manifest(mpath)
    assert m["tokenizer"]["type"] == "tokenizers" and m["tokenizer"]["eos_id"] == eos
    assert m["tokenizer"]["pad_id"] == ref.token_to_id("<pad>") and m["tokenizer"]["vocab_size"] == ref.get_vocab_size()
    n = m["num_instances"]
    x, y = flatten(read_steps(ShardedLoader(mpath, n), 1))
    want = torch.from_numpy(expected_instances(stream, 8, 3, n))
    torch.testing.assert_close(x, want[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(y, want[:, 1:], rtol=0, atol=0)
    # The manifest's description rebuilds the tokenizer, and decoding gives back the text.
    tok = tokenizer_from_description(m["tokenizer"])
    assert tok.decode(stream[: stream.tolist().index(eos)]) == docs[0]


def test_vocabulary_above_65536_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"], vocab["</s>"] = 70000, 70001
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    text = "w1 w69999 w65536 w3 nope w0"
    mpath = preprocess_files([write_txt(tmp_path / "a.txt", text)], str(tmp_path / "out"), 2, str(tmp_path / "big.json"),
                       progress=False)
    m = load_manifest(mpath)
    assert m["dtype"] == "uint32" and m["tokenizer"]["eos_id"] == 70001
    stored = np.load(tmp_path / "out" / m["shards"][0]["file"])
    want = expected_instances(np.array([1, 69999, 65536, 3, 70000, 0, 70001]), 2, 0, 3)
    np.testing.assert_array_equal(stored, want)


@pytest.mark.parametrize(
    "damage,verify,match",
    [
        ("flip", True, "shard-00001-of-00003.npy is corrupt"),  # one flipped data byte: checksum
        ("truncate", True, "shard-00001-of-00003.npy is corrupt"),  # truncated file: checksum
        ("delete", True, "shard-00001-of-00003.npy is missing"),  # missing file
        ("delete", False, "shard-00001-of-00003.npy is missing"),  # missing even without checksums
        ("truncate", False, "shard-00001-of-00003.npy"),  # without checksums: caught when mapped
    ],
)
def test_corrupt_or_missing_shard_is_named(tmp_path, corpus, damage, verify, match):
    files, _ = corpus
    out = tmp_path / "out"
    mpath = preprocess_files(files, str(out), 3, shards=3, progress=False)
    shard = out / "shard-00001-of-00003.npy"
    if damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 1
        shard.write_bytes(bytes(raw))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-5])
    else:
        shard.unlink()
    with pytest.raises(ValueError, match=match):
        loader = ShardedLoader(mpath, 4, verify=verify)
        for _ in range(load_manifest(mpath)["num_instances"] // 4 + 1):  # touch every shard
            loader.next_batch()


def test_failed_preprocess_keeps_previous_data_set_and_rerun_replaces_it(tmp_path, corpus):
    files, _ = corpus
    out = tmp_path / "out"
    first = load_manifest(preprocess_files(files, str(out), 4, shards=3, progress=False))
    with pytest.raises(ValueError, match="empty"):
        preprocess_files([write_txt(tmp_path / "empty.txt", "")], str(out), 4, progress=False)
    assert load_manifest(str(out))["fingerprint"] == first["fingerprint"]
    ShardedLoader(str(out), 2).next_batch()
    second = load_manifest(preprocess_files(files, str(out), 4, shards=1, seed=8, progress=False))
    assert sorted(p for p in os.listdir(out)) == sorted([second["shards"][0]["file"], "manifest.json"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(global_batch=6, dp_size=4), "not divisible by data-parallel size 4"),  # G % D != 0
        (dict(global_batch=8, dp_size=2, micro_batch=3), "per-rank batch 4"),  # G/D % B != 0
        (dict(global_batch=8, dp_size=2, dp_rank=2), "outside \\[0, 2\\)"),  # rank out of range
        (dict(global_batch=0), "global batch must be a positive integer"),  # zero batch
    ],
)
def test_loader_rejects_bad_layouts(tmp_path, corpus, kwargs, match):
    files, _ = corpus
    mpath = preprocess_files(files, str(tmp_path / "out"), 4, progress=False)
    with pytest.raises(ValueError, match=match):
        ShardedLoader(mpath, **kwargs)


def test_default_dataset_is_built_once_and_reused(tmp_path):
    m1 = ensure_default_dataset(str(tmp_path), 64, seed=0, progress=False)
    shard = os.path.join(os.path.dirname(m1), load_manifest(m1)["shards"][0]["file"])
    mtime = os.stat(shard).st_mtime_ns
    assert ensure_default_dataset(str(tmp_path), 64, seed=0, progress=False) == m1
    assert os.stat(shard).st_mtime_ns == mtime  # reused, not rebuilt
    m2 = ensure_default_dataset(str(tmp_path), 64, seed=1, progress=False)
    assert os.path.dirname(m2) != os.path.dirname(m1)
    m = load_manifest(m1)
    assert m["corpus"]["bytes"] > 100_000 and m["num_instances"] * 64 < m["stream_tokens"]
    assert [f for f in os.listdir(tmp_path) if f.startswith(".")] == []  # no leftover build folders
    x, y = flatten(read_steps(ShardedLoader(m1, 8, 4), 1))
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", preprocess.__name__, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_a_data_set_with_progress_bars(tmp_path, corpus):
    files, stream = corpus
    r = run_cli("--input", *files, "--context", "6", "--out", str(tmp_path / "out"), "--shards", "2", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "1/3 tokenize" in r.stderr and "2/3 shuffle" in r.stderr and "3/3 shard" in r.stderr
    m = load_manifest(str(tmp_path / "out"))
    assert m["num_instances"] == (len(stream) - 1) // 6 and m["seed"] == 3 and "wrote" in r.stdout


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing-input", "does not exist"),  # input path absent
        ("empty-corpus", "corpus is empty"),  # only an empty file
        ("too-short", "fewer than context + 1"),  # text shorter than one instance
        ("context-0", "context must be a positive integer"),  # context < 1
        ("shards-0", "shards must be a positive integer"),  # shards < 1
        ("shards-too-many", "exceeds the number of instances"),  # more shards than instances
        ("bad-tokenizer", "does not load"),  # tokenizer file that is not a tokenizer
        ("missing-tokenizer", "tokenizer file"),  # tokenizer path absent
        ("bad-jsonl", "bad.jsonl:2: not valid JSON"),  # malformed JSONL line, named with its line
        ("context-not-int", "invalid int value"),  # argparse's own error, still one line
    ],
)
def test_cli_errors_are_one_line_and_non_zero(tmp_path, case, match):
    good = write_txt(tmp_path / "good.txt", "some text to tokenize " * 3)
    out = str(tmp_path / "out")
    args = {
        "missing-input": ["--input", str(tmp_path / "nope.txt"), "--context", "4"],
        "empty-corpus": ["--input", write_txt(tmp_path / "e.txt", ""), "--context", "4"],
        "too-short": ["--input", write_txt(tmp_path / "s.txt", "abc"), "--context", "4"],
        "context-0": ["--input", good, "--context", "0"],
        "shards-0": ["--input", good, "--context", "4", "--shards", "0"],
        "shards-too-many": ["--input", good, "--context", "4", "--shards", "1000"],
        "bad-tokenizer": ["--input", good, "--context", "4", "--tokenizer", write_txt(tmp_path / "t.json", "{oops")],
        "missing-tokenizer": ["--input", good, "--context", "4", "--tokenizer", str(tmp_path / "none.json")],
        "bad-jsonl": ["--input", write_txt(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": \n'), "--context", "4"],
        "context-not-int": ["--input", good, "--context", "four"],
    }[case]
    r = run_cli(*args, "--out", out, "--quiet")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert match in lines[0]
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def test_gzip_inputs_match_plain(tmp_path):
    import gzip

    docs = make_docs(12, 8)
    plain = [write_txt(tmp_path / "a.txt", docs[0]), write_jsonl(tmp_path / "b.jsonl", docs[1:])]
    for p in plain:
        with open(p, "rb") as f, gzip.open(p + ".gz", "wb") as g:
            g.write(f.read())
    ref = load_manifest(preprocess_files(plain, str(tmp_path / "p"), 5, seed=1, progress=False))
    got = load_manifest(preprocess_files([p + ".gz" for p in plain], str(tmp_path / "g"), 5, seed=1, progress=False))
    assert got["num_documents"] == len(docs) and got["fingerprint"] == ref["fingerprint"]


def test_parquet_without_pyarrow_is_one_clear_error(tmp_path, monkeypatch):
    from trainer.data.sources import iter_documents

    path = write_txt(tmp_path / "x.parquet", "not really parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    with pytest.raises(ValueError, match="needs pyarrow, which is not installed"):
        next(iter_documents(path))

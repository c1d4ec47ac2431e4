"""Document masking (``--data.document_mask``): every data set records its EOS id and the trainer finds it."""
from __future__ import annotations

import json
import os

import pytest

from trainer.data import ShardedDataset, ensure_default_dataset, load_manifest, manifest_eos_id, preprocess_files
from trainer.data.build import build_dataset, memory_source
from trainer.data.mixture import MixtureDataset

EOS = 256  # the byte tokenizer's


def _docs(n: int) -> list[str]:
    return [f"document {i} " + "abcdefgh"[: 1 + i % 8] * (1 + i % 5) for i in range(n)]


@pytest.fixture(scope="module")
def text_set(tmp_path_factory) -> str:
    """A data set of a JSONL file (one document per line), context 16, made as fastmoe-preprocess makes it."""
    d = tmp_path_factory.mktemp("docs")
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(60)), encoding="utf-8")
    return preprocess_files([str(src)], str(d / "set"), 16, progress=False)


def test_every_built_data_set_records_the_eos_id(text_set, tmp_path) -> None:
    """Files (fastmoe-preprocess), memory sources and the embedded corpus all record the tokenizer's EOS
    id in the manifest, and the data set and a mixture of sets read it back."""
    mem = build_dataset([memory_source("<mem>", _docs(40))], str(tmp_path / "mem"), 16, progress=False)
    default = ensure_default_dataset(str(tmp_path / "cache"), 16, progress=False, valid=0)
    for path in (text_set, mem, default):
        m = load_manifest(path)
        assert m["tokenizer"]["eos_id"] == EOS
        assert manifest_eos_id(m) == EOS
        assert ShardedDataset(path).eos_id == EOS
    mix = MixtureDataset(f"a={os.path.dirname(text_set)}:1,b={os.path.dirname(mem)}:1")
    assert mix.eos_id == EOS and manifest_eos_id(mix.manifest) == EOS


def test_a_manifest_without_an_eos_id_reads_as_none() -> None:
    assert manifest_eos_id({"tokenizer": {"type": "byte", "vocab_size": 258}}) is None
    assert manifest_eos_id({}) is None
    assert manifest_eos_id({"tokenizer": {"eos_id": 7}}) == 7

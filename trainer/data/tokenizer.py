"""Tokenizers for the data pipeline: a byte-level one (the default) and any `tokenizers` JSON file.

Both expose the same small interface (`encode_batch`, `decode`, `vocab_size`, `eos_id`, `pad_id`,
`describe`) so that preprocessing and the trainer never care which one is in use. The manifest
stores `describe()`, and `tokenizer_from_description` rebuilds the tokenizer from it.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import numpy as np

# Special tokens of a `tokenizers` file that we accept as end-of-document, in order of preference.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")
PAD_CANDIDATES = ("<|padding|>", "<pad>", "<|pad|>", "[PAD]")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 is EOS, 257 is PAD (never emitted by
    preprocessing; it exists so a model config can name a padding id). Vocabulary size 258."""

    eos_id: int = 256
    pad_id: int | None = 257
    vocab_size: int = 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        # Special tokens are rendered visibly so samples show document boundaries.
        out: list[str] = []
        buf = bytearray()
        for i in np.asarray(ids, dtype=np.int64).tolist():
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append("<|eos|>" if i == self.eos_id else "<|pad|>" if i == self.pad_id else f"<|{i}|>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def describe(self) -> dict[str, Any]:
        return {"type": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id, "pad_id": self.pad_id}


class HFTokenizer:
    """A tokenizer loaded from a `tokenizers` JSON file (the `tokenizer.json` of a Hugging Face
    model). The EOS id is the first special token found in `EOS_CANDIDATES` unless `eos_token`
    names one explicitly."""

    def __init__(self, path: str, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - the package is a hard dependency of the trainer
            raise ValueError("the `tokenizers` package is required to load a tokenizer file: pip install tokenizers") from e
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception with a parse message
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"tokenizer file {path!r} does not load: {msg}") from e
        self.path = os.path.abspath(path)
        with open(path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if eos_token is not None:
            if eos_token not in vocab:
                raise ValueError(f"tokenizer file {path!r} has no token {eos_token!r} to use as EOS")
            self.eos_token = eos_token
        else:
            found = [t for t in EOS_CANDIDATES if t in vocab]
            if not found:
                raise ValueError(
                    f"tokenizer file {path!r} has none of the EOS tokens {list(EOS_CANDIDATES)}; name one with --eos-token"
                )
            self.eos_token = found[0]
        self.eos_id = int(vocab[self.eos_token])
        pads = [t for t in PAD_CANDIDATES if t in vocab]
        self.pad_id = int(vocab[pads[0]]) if pads else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        return {
            "type": "tokenizers",
            "path": self.path,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
            "pad_id": self.pad_id,
        }


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str = "byte", eos_token: str | None = None) -> Tokenizer:
    """`"byte"` gives the byte-level tokenizer; anything else is a path to a `tokenizers` JSON file.
    Raises ValueError with one clear line when the file is missing or does not load."""
    if spec == "byte":
        if eos_token is not None:
            raise ValueError("--eos-token applies only to a tokenizer file; the byte tokenizer's EOS is id 256")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token=eos_token)


def tokenizer_from_description(desc: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer a manifest was made with (for decoding samples)."""
    if desc.get("type") == "byte":
        return ByteTokenizer()
    if desc.get("type") == "tokenizers":
        tok = HFTokenizer(desc["path"], eos_token=desc.get("eos_token"))
        if tok.sha256 != desc.get("sha256"):
            raise ValueError(f"tokenizer file {desc['path']!r} changed since the data set was made (sha256 differs)")
        return tok
    raise ValueError(f"unknown tokenizer type {desc.get('type')!r} in manifest")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every id below `vocab_size`."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)

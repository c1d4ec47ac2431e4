"""The data set's tokenizer as Hugging Face files (``tokenizer.json`` + ``tokenizer_config.json``)
that ``AutoTokenizer.from_pretrained`` loads without this package.

The byte-level tokenizer (ids 0..255 the UTF-8 bytes, 256 EOS, 257 PAD) becomes a ``tokenizers``
BPE model without merges over GPT-2's byte-to-unicode alphabet, with a ByteLevel pre-tokenizer and
decoder: every byte is one token whose id is the byte value, exactly as :class:`ByteTokenizer`
encodes. A ``tokenizers`` JSON file is copied as it is.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

BYTE_EOS = "<|eos|>"
BYTE_PAD = "<|pad|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer_json() -> str:
    """``tokenizer.json`` text of the byte-level tokenizer (vocabulary 258)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    # no prefix space and no regex split: the byte stream is encoded as it is, one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    added = tok.add_special_tokens([AddedToken(BYTE_EOS, special=True, normalized=False),
                                    AddedToken(BYTE_PAD, special=True, normalized=False)])
    if added != 2 or tok.token_to_id(BYTE_EOS) != 256 or tok.token_to_id(BYTE_PAD) != 257:
        raise RuntimeError("the byte tokenizer's special tokens did not get ids 256 and 257")
    return tok.to_str()


def write_tokenizer(desc: dict[str, Any], out_dir: str, *, model_max_length: int) -> dict[str, Any]:
    """Write the tokenizer a data manifest describes (``manifest["tokenizer"]``) into ``out_dir``;
    returns ``{"eos_token_id", "pad_token_id"}`` for the model config."""
    kind = desc.get("type")
    if kind == "byte":
        text = byte_tokenizer_json()
        eos, pad = BYTE_EOS, BYTE_PAD
        eos_id, pad_id = int(desc.get("eos_id", 256)), desc.get("pad_id", 257)
        with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(text)
    elif kind == "tokenizers":
        path = desc.get("path", "")
        if not os.path.isfile(path):
            raise ValueError(f"the data set's tokenizer file {path!r} no longer exists; cannot export the tokenizer")
        shutil.copyfile(path, os.path.join(out_dir, "tokenizer.json"))
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        eos = desc.get("eos_token") or tok.id_to_token(int(desc["eos_id"]))
        eos_id, pad_id = int(desc["eos_id"]), desc.get("pad_id")
        pad = tok.id_to_token(int(pad_id)) if pad_id is not None else None
    else:
        raise ValueError(f"unknown tokenizer type {kind!r} in the data manifest")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": int(model_max_length),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if pad is not None:
        cfg["pad_token"] = pad
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    special = {"eos_token": eos, **({"pad_token": pad} if pad is not None else {})}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2)
    return {"eos_token_id": eos_id, "pad_token_id": None if pad_id is None else int(pad_id)}

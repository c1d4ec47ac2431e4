"""Command line of the preprocessing step:

    fastmoe-preprocess --input PATH... --tokenizer byte|PATH/tokenizer.json \
        --context C --out DIR [--shards N] [--seed S] [--overwrite]

Tokenizes, shuffles and shards the inputs (see `trainer.data.build`); every bad input ends with
one error line on stderr and a non-zero exit. A ``--out`` that already holds a data set is refused
unless ``--overwrite`` (runs resuming on it would otherwise meet other data).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from ..owned import DATA_SET, NotOwned, check_replace, write_marker
from .build import MANIFEST_NAME, VALID_NAME, preprocess_files


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the usage block first
        self.exit(2, f"{self.prog}: error: {message}\n")


def existing_data_set(out: str) -> str | None:
    """What makes ``out`` an existing data set, in a few words (None when it holds none): its
    manifest (instances and fingerprint), else the shard or validation files a data set leaves."""
    mpath = os.path.join(out, MANIFEST_NAME)
    if os.path.isfile(mpath):
        try:
            with open(mpath) as f:
                m = json.load(f)
            return (f"a data set ({MANIFEST_NAME}: {int(m['num_instances'])} instances of {int(m['context'])}+1 "
                    f"tokens, fingerprint {str(m['fingerprint'])[:12]})")
        except (OSError, ValueError, KeyError, TypeError):
            return f"a data set ({MANIFEST_NAME}, unreadable)"
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "shard-*-of-*.npy")))
    if os.path.isfile(os.path.join(out, VALID_NAME)):
        files.append(VALID_NAME)
    if files:
        return f"data set files ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = _OneLineParser(prog="fastmoe-preprocess", description="Tokenize, shuffle and shard text into .npy training instances.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="text/JSONL/Parquet/Arrow files or directories")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tokenizers JSON file")
    p.add_argument("--context", type=int, required=True, help="tokens of input per instance (instances hold C+1)")
    p.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    p.add_argument("--shards", type=int, default=1, help="number of .npy shards (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle permutation (default 0)")
    p.add_argument("--text-field", default="text", help="JSONL/Parquet/Arrow field holding the text (default text)")
    p.add_argument("--eos-token", default=None, help="EOS token of a tokenizer file, if not a usual name")
    p.add_argument("--valid", type=float, default=0,
                   help="held-out validation instances: a fraction in (0, 1) or a count (default 0: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a data set already in --out (its shards and valid.npy go; default: refuse)")
    a = p.parse_args(argv)
    held = existing_data_set(a.out) if os.path.isdir(a.out) else None
    if held is not None and not a.overwrite:
        # a run that trained on it could no longer resume, and its validation split would be gone
        print(f"{p.prog}: error: --out {a.out} already holds {held}; pass --overwrite to replace it, or choose "
              f"another --out", file=sys.stderr)
        return 1
    if held is not None:  # --overwrite: a data set this command wrote there, and nothing else
        try:
            check_replace(a.out, DATA_SET)
        except NotOwned as e:
            print(f"{p.prog}: error: {e}", file=sys.stderr)
            return 2
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        print(f"{p.prog}: error: cannot create --out {a.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        path = preprocess_files(a.input, a.out, a.context, a.tokenizer, a.shards, a.seed, a.text_field, a.eos_token, not a.quiet,
                                valid=a.valid)
    except (ValueError, OSError) as e:
        if isinstance(e, OSError) and e.strerror:  # "[Errno 2] ..." says less than the path and the reason
            msg = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
        else:
            msg = " ".join(str(e).split())  # one line, whatever the underlying library printed
        print(f"{p.prog}: error: {msg}", file=sys.stderr)
        return 1
    with open(path) as f:
        m = json.load(f)
    data_files = [MANIFEST_NAME] + [s["file"] for s in m["shards"]] + ([m["valid"]["file"]] if m.get("valid") else [])
    write_marker(a.out, DATA_SET, data_files, fingerprint=m["fingerprint"])  # last: the data set is complete
    print(
        f"wrote {m['num_instances']} instances of {m['context']}+1 tokens in {m['num_shards']} shard(s) "
        f"({m['dtype']}, {m['stream_tokens']} tokens from {m['num_documents']} documents) -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

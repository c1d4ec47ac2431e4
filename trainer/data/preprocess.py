"""Command line of the preprocessing step:

    fastmoe-preprocess --input PATH... --tokenizer byte|PATH/tokenizer.json \
        --context C --out DIR [--shards N] [--seed S] [--overwrite]

Tokenizes, shuffles and shards the inputs (see `trainer.data.build`). Every option, the inputs'
paths, the tokenizer and ``--out`` are checked before any input is read; every bad one ends with
one error line on stderr and exit status 2. A ``--out`` that already holds a data set is refused
unless ``--overwrite`` (runs resuming on it would otherwise meet other data). A directory given as
``--input`` is read for its files of the known suffixes; one line names the files it skipped.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Any, Callable

from ..config.errors import EXIT_USAGE, OneLineParser
from ..ft.lease import take_output_lease
from ..ft.space import describe_space
from ..ft.stop import stoppable
from ..owned import DATA_SET, MARKER, NotOwned, check_replace
from .build import MANIFEST_NAME, VALID_NAME, check_positive, check_valid, preprocess_files
from .sources import DIR_SUFFIXES, check_out_apart, check_text_inputs, describe_files, scan_inputs
from .tokenizer import load_tokenizer, token_dtype


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
    p = OneLineParser(prog="fastmoe-preprocess", prog_prefix=True, allow_abbrev=False,
                      description="Tokenize, shuffle and shard text into .npy training instances.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help=f"text/JSONL/Parquet/Arrow files or directories (a directory: its {' '.join(DIR_SUFFIXES)} "
                        "files; a file named here is read whatever its suffix, as plain text if not one of those)")
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

    def fail(msg: str) -> int:
        print(f"{p.prog}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE

    try:  # every option before any input is read
        check_positive("--context", a.context)
        check_positive("--shards", a.shards)
        if a.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {a.seed}")
        check_valid(a.valid, "--valid")
        files, skipped = scan_inputs(a.input)
        check_out_apart(a.out, a.input)
        check_text_inputs(files)
        tokenizer = load_tokenizer(a.tokenizer, eos_token=a.eos_token)
    except ValueError as e:
        return fail(" ".join(str(e).split()))
    except OSError as e:
        return fail(_os_error(e))
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        return fail(f"--out {a.out} is a file, not a directory; choose a directory (it is created if missing)")
    held = existing_data_set(a.out) if os.path.isdir(a.out) else None
    if held is not None and not a.overwrite:
        # a run that trained on it could no longer resume, and its validation split would be gone
        return fail(f"--out {a.out} already holds {held}; pass --overwrite to replace it, or choose another --out")
    if held is not None:  # --overwrite: a data set this command wrote there, and nothing else
        try:
            check_replace(a.out, DATA_SET)
        except NotOwned as e:
            return fail(str(e))
    try:  # one command writes --out at a time (trainer/ft/lease.py)
        lease = take_output_lease(a.out, command="fastmoe-preprocess")
    except ValueError as e:
        return fail(" ".join(str(e).split()))
    try:
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            return fail(f"cannot create --out {a.out}: {e.strerror or e}")
        if not os.access(a.out, os.W_OK | os.X_OK):
            return fail(f"cannot write in --out {a.out}: permission denied; choose a directory you can write to")
        for directory, other in skipped:
            print(f"{p.prog}: {directory}: reading its {' '.join(DIR_SUFFIXES)} files; skipped "
                  f"{describe_files(directory, other)} (name a file itself to read it as plain text)", file=sys.stderr)
        started = time.time()

        def left() -> str:
            marker = os.path.join(a.out, MARKER)
            if os.path.isfile(marker) and os.path.getmtime(marker) >= started:  # the stop came after the move-in
                return f"the data set had finished: --out {a.out} holds it"
            return f"nothing was written to --out {a.out} (a data set already there stays as it was)"

        # Ctrl-C / SIGTERM: the staging folder goes, one line (a second: at once)
        return stoppable(p.prog, left, lambda: _build(a, files, tokenizer, fail))
    finally:
        if lease is not None:
            lease.release()


def _build(a: argparse.Namespace, files: list[str], tokenizer: Any, fail: Callable[[str], int]) -> int:
    """The data set ``a`` asks for, written whole into ``a.out`` with its marker; the exit status."""
    try:
        path = preprocess_files(files, a.out, a.context, tokenizer, a.shards, a.seed, a.text_field, None,
                                not a.quiet, valid=a.valid, marked=True)
    except ValueError as e:
        return fail(" ".join(str(e).split()))
    except OSError as e:
        # a full disk: the bytes the token stream and the shards take at most (a token per input byte)
        needed = 2 * token_dtype(tokenizer.vocab_size).itemsize * sum(os.path.getsize(f) for f in files)
        return fail(describe_space(e, a.out, needed, most=True) or _os_error(e))
    with open(path) as f:
        m = json.load(f)
    print(summary_line(m, path))
    return 0


def _os_error(e: OSError) -> str:
    """``PATH: reason`` ("[Errno 2] ..." says less than the path and the reason)."""
    if not e.strerror:
        return " ".join(str(e).split())
    return f"{e.filename}: {e.strerror}" if e.filename else e.strerror


def summary_line(m: dict, path: str) -> str:
    """The last line: what was written, the held-out split and the copies of it left out of training."""
    valid = m.get("valid")
    held = (f" + {valid['instances']} held out for validation ({valid['train_instances_dropped_as_duplicates']} "
            "training instances equal to a held-out one dropped)") if valid else ""
    return (f"wrote {m['num_instances']} training instances{held} of {m['context']}+1 tokens in {m['num_shards']} "
            f"shard(s) ({m['dtype']}, {m['stream_tokens']} tokens from {m['num_documents']} documents) -> {path}")


if __name__ == "__main__":
    sys.exit(main())

"""Reading documents out of input files.

Formats, chosen by file name:
- `*.jsonl`, `*.json` (JSON Lines, one object per line) and their `.gz`: one document per line,
  the string in field `text_field` (default `text`); blank lines are skipped.
- `*.parquet`: Parquet, one document per row of column `text_field` (as Hugging Face datasets
  store them on the Hub).
- `*.arrow`: Arrow IPC stream or file, one document per row (as `datasets` stores its cache and
  `save_to_disk` output).
- anything else (`*.txt`, `*.md`, ...) and its `.gz`: UTF-8 plain text, the whole file is ONE
  document. Splitting on blank lines would mark every paragraph as unrelated to the next, which
  is wrong for books and articles; split such files beforehand or use JSONL when documents are
  smaller than files.

Undecodable UTF-8 is replaced by U+FFFD. Empty documents (and null rows) are skipped.
A directory is expanded, recursively and sorted, to its `.txt .md .jsonl .parquet .arrow` files
(and their `.gz`), so a `save_to_disk` folder can be passed as is (its `*.json` metadata is not
read).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import IO, Iterator

DIR_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet", ".arrow", ".txt.gz", ".md.gz", ".jsonl.gz")


def input_format(path: str) -> str:
    """One of `jsonl`, `parquet`, `arrow`, `text`."""
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "text"


def expand_inputs(paths: list[str]) -> list[str]:
    """Files in the order given, directories expanded sorted; raises ValueError for a missing path
    or when nothing is left."""
    return scan_inputs(paths)[0]


def scan_inputs(paths: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the files to read, [(directory, the files in it not read)]): a directory gives its files with
    :data:`DIR_SUFFIXES` only. Raises ValueError for a missing path or a directory with nothing to read."""
    if not paths:
        raise ValueError("no input files given")
    out: list[str] = []
    skipped: list[tuple[str, list[str]]] = []
    for p in paths:
        if os.path.isdir(p):
            found, other = [], []
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for f in sorted(files):
                    (found if f.lower().endswith(DIR_SUFFIXES) else other).append(os.path.join(root, f))
            if not found:
                raise ValueError(f"input directory {p!r} holds no {' '.join(DIR_SUFFIXES)} files"
                                 + (f" (it holds {describe_files(p, other)}; name such files themselves to read "
                                    "them as plain text)" if other else ""))
            out += found
            if other:
                skipped.append((p, other))
        elif os.path.isfile(p):
            out.append(p)
        elif os.path.exists(p):
            raise ValueError(f"input {p!r} is neither a file nor a directory")
        else:
            raise ValueError(f"input file {p!r} does not exist")
    return out, skipped


#: Bytes of a text or JSONL input looked at to tell it from a binary file.
SNIFF_BYTES = 64 << 10


def check_text_inputs(files: list[str]) -> None:
    """Raise ValueError (one line naming the file and what it holds) for a text or JSONL input that
    is binary: a NUL byte, or more than a tenth of its first :data:`SNIFF_BYTES` not UTF-8 (an
    executable read as text would become mostly U+FFFD tokens)."""
    for f in files:
        if input_format(f) not in ("text", "jsonl"):
            continue
        try:
            with _open_binary(f) as fh:
                head = fh.read(SNIFF_BYTES)
        except (OSError, EOFError) as e:
            raise ValueError(f"input {f!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
        if not head:
            continue
        if b"\0" in head:
            bad = f"NUL bytes in its first {len(head):,} bytes"
        else:
            text = head.decode("utf-8", "replace")
            lost = text.count("\ufffd") - head.decode("utf-8", "ignore").count("\ufffd")
            if lost * 10 <= len(text) - 3:  # a character cut at the end of the sample is not a sign
                continue
            bad = f"{lost:,} of its first {len(text):,} characters are not UTF-8"
        raise ValueError(f"input {f!r} is not text ({bad}): a binary file would become tokens of nothing; leave it "
                         f"out, or name text, JSONL, Parquet or Arrow files")


def check_out_apart(out: str, inputs: list[str]) -> None:
    """Raise ValueError when ``out`` is an input directory or lies inside one (the data set's files
    would be written among the inputs)."""
    target = os.path.realpath(out)
    for p in inputs:
        if os.path.isdir(p):
            d = os.path.realpath(p)
            if target == d or target.startswith(d.rstrip(os.sep) + os.sep):
                raise ValueError(f"--out {out} is {'the' if target == d else 'inside the'} input directory {p}: the "
                                 f"data set would be written among its inputs; give --out a directory of its own")


def describe_files(directory: str, files: list[str], most: int = 5) -> str:
    """``N file(s): a, b, ...`` with the paths relative to ``directory``."""
    names = [os.path.relpath(f, directory) for f in files]
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return f"{len(names)} other file{'s' if len(names) != 1 else ''}: {', '.join(names[:most])}{more}"


def _open_binary(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _pyarrow(path: str):
    try:
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"reading {path!r} needs pyarrow, which is not installed: pip install pyarrow"
        ) from e
    import pyarrow as pa

    return pa


def _column_batches(path: str, batches, schema_names: list[str], text_field: str) -> Iterator[list]:
    if text_field not in schema_names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(schema_names)})")
    for b in batches:
        yield b.column(b.schema.get_field_index(text_field)).to_pylist()


def iter_documents(path: str, text_field: str = "text") -> Iterator[tuple[str, float]]:
    """Yield `(document, progress)` where progress is the fraction of the file's bytes consumed
    so far (for progress bars). Raises ValueError naming file and line/row for malformed input."""
    fmt = input_format(path)
    size = max(os.path.getsize(path), 1)
    if fmt == "text":
        with _open_binary(path) as f:
            text = f.read().decode("utf-8", errors="replace")
        if text:
            yield text, 1.0
        return
    if fmt == "jsonl":
        with _open_binary(path) as raw:
            # For .gz the position is of the decompressed stream; clamp so the bar never overshoots.
            consumed = 0
            for lineno, line in enumerate(raw, start=1):
                consumed += len(line)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise ValueError(f"{path}:{lineno}: no {text_field!r} field")
                text = obj[text_field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string")
                if text:
                    yield text, min(consumed / size, 1.0)
        return
    pa = _pyarrow(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
        total = max(pf.metadata.num_rows, 1)
        batches = pf.iter_batches(batch_size=1024, columns=[text_field] if text_field in pf.schema_arrow.names else None)
        names = pf.schema_arrow.names
    else:
        source = pa.memory_map(path, "r")
        try:
            reader = pa.ipc.open_stream(source)
        except Exception:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except Exception as e:
                raise ValueError(f"{path}: not a readable Arrow IPC stream or file ({e})") from None
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            total = max(sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches)), 1)
        else:
            batches = iter(reader)
            total = None
        names = reader.schema.names
    rows = 0
    for col in _column_batches(path, batches, names, text_field):
        for text in col:
            rows += 1
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise ValueError(f"{path}: row {rows - 1}: column {text_field!r} is {type(text).__name__}, not a string")
            # An IPC stream does not announce its row count; its read position does as well.
            yield text, (rows / total if total else min(source.tell() / size, 1.0))

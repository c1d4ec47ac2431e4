"""Export a training checkpoint as a Hugging Face model directory:
``fastmoe-export --checkpoint OUT/checkpoints[/slot-A | /model-step-N] --out DIR``.

``DIR`` then holds what transformers and its ecosystem load with no trace of this package:
``config.json`` of the stock class (``OlmoeForCausalLM`` / ``OlmoForCausalLM``),
``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``
when larger than ``--max-shard-size``), ``generation_config.json`` and the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``).

Any layout's checkpoint exports: the checkpoint keys are plain tensors by parameter name (see
:mod:`trainer.checkpoint`), whole for replicated weights, one per global expert for expert
weights (so EP does not matter), ``/tp<r>`` parts for TP-split weights (concatenated back along
the split dimension), and each pipeline stage's weights under their global names. The export runs
in one process and streams: it reads one weight (one expert's slice) at a time and holds at most
one output shard plus that weight; the peak is reported (``peak_bytes``) and bounded by
``--max-shard-size`` plus the largest single weight.

Expert weights are written the way transformers saves OLMoE (``experts.<e>.{gate,up,down}_proj.weight``),
which both transformers 4 and 5 load.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from fastmoe_xpu.dist.sharding import is_expert_weight

from ..checkpoint.dcp_io import storage_reader
from ..owned import HF_EXPORT, MARKER, NotOwned, check_replace, replace_dir, write_marker
from ..checkpoint.slots import (CheckpointError, CheckpointInfo, latest_valid, MANIFEST, META, model_checkpoints,
                                read_info, verify)

DEFAULT_MAX_SHARD = 2 << 30
#: TP-split weights: name suffix -> dimension their ``/tp<r>`` parts are concatenated along
_TP_DIMS = {
    "self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1,
}


class ExportError(ValueError):
    """The checkpoint or the output directory cannot be used; the message names the file."""


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    step: int
    architecture: str
    files: list[str]
    total_bytes: int
    """Bytes of weights written."""
    peak_bytes: int
    """Most tensor bytes held at once (the pending shard plus the weight being read)."""
    seconds: float


# ------------------------------------------------------------------------------ locating
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it is one checkpoint directory, else the newest valid checkpoint under
    the checkpoint root ``path``, or under ``path/checkpoints`` when ``path`` is a run's directory
    (full slots and model-only snapshots, by step). Every damaged checkpoint passed over is said on
    stderr, one line each, as the trainer's resume says it."""
    p = Path(path)
    hint = ("a training run keeps one at its end in OUT/checkpoints (fastmoe-train --out OUT), and one every N "
            "steps with --checkpoint.interval N")
    if not p.exists():
        raise ExportError(f"checkpoint {p} does not exist; give a run's directory, its checkpoints folder or one "
                          f"slot-*/model-step-* directory: {hint}")
    if not p.is_dir():
        raise ExportError(f"checkpoint {p} is not a directory (give a checkpoint root or one slot-*/model-step-* directory)")
    if (p / MANIFEST).exists() or (p / META).exists() or (p / ".metadata").exists():
        return p
    if not any(p.glob("slot-*")) and not model_checkpoints(p) and (p / "checkpoints").is_dir():
        p = p / "checkpoints"  # a run's directory
    candidates: list[tuple[int, int, Path]] = []
    damaged: list[tuple[Path, str]] = []
    full = latest_valid(p)
    if full is not None:
        candidates.append((full.step, 1, full.path))
    for m in model_checkpoints(p):
        reason = verify(m)
        if reason is None:
            candidates.append((read_info(m).step, 0, m))
        else:
            damaged.append((m, reason))
    for slot in sorted(p.glob("slot-*")):
        if slot.is_dir() and not slot.name.endswith(".tmp") and (full is None or slot != full.path):
            reason = verify(slot)
            if reason:
                damaged.append((slot, reason))
    if not candidates:
        if damaged:  # every damaged checkpoint and why, as the trainer's resume names them
            raise ExportError(f"no valid checkpoint under {p}: {'; '.join(why for _, why in damaged)}")
        raise ExportError(f"no checkpoint under {p} (looked for slot-A, slot-B and model-step-* directories "
                          f"there{'' if p.name == 'checkpoints' else ' and in its checkpoints/'}): {hint}")
    step, _, chosen = max(candidates)
    for slot, why in damaged:
        print(f"checkpoint: skipped damaged {slot}: {why}; exporting {chosen.name} (step {step})",
              file=sys.stderr, flush=True)
    return chosen


def _run_config(ckpt: Path, info: CheckpointInfo) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the training config dict, the data manifest's tokenizer description or None): from the
    checkpoint's metadata, else from ``run.json`` of the run directory holding the checkpoint."""
    meta = info.meta.get("meta", {}) or {}
    cfg, tok = meta.get("config"), meta.get("tokenizer")
    manifest_path = meta.get("data_manifest")
    if cfg is None:
        for run in (ckpt.parent.parent / "run.json", ckpt.parent / "run.json"):
            if run.is_file():
                try:
                    info_json = json.loads(run.read_text())
                except ValueError as e:
                    raise ExportError(f"{run} is unreadable: {e}") from None
                cfg = info_json.get("config")
                manifest_path = manifest_path or info_json.get("data")
                break
    if cfg is None:
        raise ExportError(f"{ckpt / META} records no training config and no run.json lies beside the checkpoint "
                          "root; pass --config OUT/run.json")
    if tok is None and manifest_path:
        try:
            with open(manifest_path, encoding="utf-8") as f:
                tok = json.load(f).get("tokenizer")
        except (OSError, ValueError):
            tok = None
    return cfg, tok


# ------------------------------------------------------------------------------ reading weights
class _Reader:
    """Reads single tensors of one DCP checkpoint directory (only the bytes of that tensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.md = storage_reader(path).read_metadata().state_dict_metadata
        except Exception as e:
            raise ExportError(f"{path / '.metadata'}: cannot read the checkpoint index: {e}") from None

    def has(self, key: str) -> bool:
        return key in self.md

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.md[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.md[key].properties.dtype

    def read(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        t = torch.empty(self.shape(key), dtype=self.dtype(key))
        box = {key: t}
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(box, storage_reader=storage_reader(self.path), no_dist=True)
        except Exception as e:  # a truncated or missing data file
            raise ExportError(f"{self.path}: reading tensor {key!r} failed: {' '.join(str(e).split())[:400]}") from None
        return box[key]


def _tp_parts(reader: _Reader, name: str) -> list[str]:
    keys, r = [], 0
    while reader.has(f"model/{name}/tp{r}"):
        keys.append(f"model/{name}/tp{r}")
        r += 1
    return keys


def hf_tensors(reader: _Reader, names: Sequence[str], num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers save name, tensor)`` for every parameter in ``names`` (the stock model's
    merged names), one at a time."""
    for name in names:
        if is_expert_weight(name):
            base = name.rsplit(".", 1)[0]  # ...mlp.experts
            for e in range(num_experts):
                key = f"model/{name}/{e}"
                if not reader.has(key):
                    raise ExportError(f"{reader.path} has no tensor {key!r}: a partial checkpoint, or another model")
                t = reader.read(key)
                if name.endswith("gate_up_proj"):
                    inter = t.shape[0] // 2
                    yield f"{base}.{e}.gate_proj.weight", t[:inter].contiguous()
                    yield f"{base}.{e}.up_proj.weight", t[inter:].contiguous()
                else:
                    yield f"{base}.{e}.down_proj.weight", t
            continue
        key = f"model/{name}"
        if reader.has(key):
            yield name, reader.read(key)
            continue
        parts = _tp_parts(reader, name)
        if parts:
            dim = next((d for s, d in _TP_DIMS.items() if name.endswith(s)), None)
            if dim is None:
                raise ExportError(f"{reader.path}: {name} has tensor-parallel parts but no known split dimension")
            yield name, torch.cat([reader.read(k) for k in parts], dim=dim)
            continue
        raise ExportError(f"{reader.path} has no tensor {key!r}: a partial checkpoint, or another model")


# ------------------------------------------------------------------------------ writing
@contextlib.contextmanager
def _writing(out: Path, overwrite: bool) -> Iterator[Path]:
    """The staging directory the export is written in, beside ``out`` (which :func:`_finish` moves
    to ``out``), under a lease on ``out`` (trainer/ft/lease.py: another export into it is refused);
    on any way out (an error, a stop) the staging directory goes and the lease is released."""
    from ..ft.lease import take_output_lease

    try:
        exists = check_replace(out, HF_EXPORT)
    except NotOwned as e:
        raise ExportError(str(e)) from None
    if exists and not overwrite:
        raise ExportError(f"output directory {out} exists; pass --overwrite to replace it")
    lease = take_output_lease(out, command="fastmoe-export")
    tmp = out.parent / f".{out.name}.exporting"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:  # a parent that is a file (/dev/null/x), no permission, a read-only disk
            raise ExportError(f"cannot create --out {out}: {e.strerror or e}") from None
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if lease is not None:
            lease.release()


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
              max_shard_bytes: int = DEFAULT_MAX_SHARD, config: dict[str, Any] | None = None,
              tokenizer: dict[str, Any] | None = None, progress: bool = False) -> ExportResult:
    """Write the transformers directory ``out`` from ``checkpoint`` (a checkpoint root or one
    checkpoint directory). ``config`` / ``tokenizer`` override what the checkpoint records (the
    training config dict, the manifest's tokenizer description). Raises :class:`ExportError`."""
    from safetensors.torch import save_file

    from ..config import TrainConfig
    from ..model.hf_tokenizer import write_tokenizer
    from ..model.build import hf_config

    t0 = time.perf_counter()
    if max_shard_bytes < 1:
        raise ExportError(f"max shard size must be >= 1 byte, got {max_shard_bytes}")
    ckpt = resolve_checkpoint(checkpoint)
    reason = verify(ckpt)
    if reason is not None:
        raise ExportError(f"cannot export {ckpt}: {reason}")
    info = read_info(ckpt)
    run_cfg, tok_desc = config, tokenizer
    if config is None:
        run_cfg, found_tok = _run_config(ckpt, info)
        tok_desc = tokenizer or found_tok
    cfg = TrainConfig.from_dict(run_cfg)
    m = cfg.model
    if m.vocab_size < 1:
        if tok_desc is None:
            raise ExportError(f"the config of {ckpt} has vocab_size 0 and the data set's tokenizer is unknown")
        m.vocab_size = int(tok_desc["vocab_size"])
    if m.is_hf:
        return _export_family(ckpt, info, cfg, tok_desc, Path(out), overwrite, max_shard_bytes, t0)
    hf = hf_config(m, cfg.data.context)
    arch = "OlmoeForCausalLM" if m.is_moe else "OlmoForCausalLM"
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        names = list(dict(AutoModelForCausalLM.from_config(hf).named_parameters()))

    out = Path(out)
    with _writing(out, overwrite) as tmp:
        reader = _Reader(ckpt)
        shards: list[dict[str, torch.Tensor]] = [{}]
        pending = peak = total = 0
        written: list[tuple[str, list[str], int]] = []
        files: list[str] = []

        def flush() -> None:
            nonlocal pending
            if not shards[-1]:
                return
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
            written.append((name, list(shards[-1]), pending))
            shards[-1] = {}
            pending = 0

        bar = None
        if progress:
            from tqdm import tqdm

            experts = m.num_experts if m.is_moe else 0
            count = sum(experts * (2 if n.endswith("gate_up_proj") else 1) if is_expert_weight(n) else 1
                        for n in names)
            bar = tqdm(total=count, desc="export", unit="tensor", file=sys.stderr)
        dtype = None
        for key, t in hf_tensors(reader, names, m.num_experts if m.is_moe else 0):
            nbytes = t.numel() * t.element_size()
            if shards[-1] and pending + nbytes > max_shard_bytes:
                flush()
            shards[-1][key] = t
            pending += nbytes
            total += nbytes
            peak = max(peak, pending)
            dtype = t.dtype
            if bar is not None:
                bar.update(1)
        flush()
        if bar is not None:
            bar.close()
        if len(written) == 1:
            os.replace(tmp / written[0][0], tmp / "model.safetensors")
            files.append("model.safetensors")
        else:
            n = len(written)
            weight_map = {}
            for i, (name, keys, _) in enumerate(written):
                final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(tmp / name, tmp / final)
                files.append(final)
                weight_map.update({k: final for k in keys})
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            files.append("model.safetensors.index.json")

        special = {"eos_token_id": None, "pad_token_id": None}
        if tok_desc is not None:
            special = write_tokenizer(tok_desc, str(tmp), model_max_length=cfg.data.context)
            files += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        hf.architectures = [arch]
        hf.eos_token_id = special["eos_token_id"]
        hf.pad_token_id = special["pad_token_id"]
        hf.use_cache = True  # training turns the KV cache off; generation wants it
        if m.is_moe:
            hf.output_router_logits = False
        hf.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
        hf.save_pretrained(str(tmp))
        files.append("config.json")
        from transformers import GenerationConfig

        GenerationConfig(eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"]
                         ).save_pretrained(str(tmp))
        files.append("generation_config.json")
        _finish(tmp, out, ckpt, info, {"preset": cfg.preset})
        files.append("fastmoe_export.json")
    return ExportResult(out=out, checkpoint=ckpt, step=info.step, architecture=arch, files=sorted(files),
                        total_bytes=total, peak_bytes=peak, seconds=time.perf_counter() - t0)


def _finish(tmp: Path, out: Path, ckpt: Path, info: CheckpointInfo, extra: dict[str, Any]) -> list[str]:
    """Record where the export came from (``fastmoe_export.json``) and move ``tmp`` to ``out``;
    returns the files written. A checkpoint a running run rewrote while it was read (its slot's
    manifest gone or of another step: the run rewrites its older slot) is refused, nothing moved."""
    if not (ckpt / MANIFEST).is_file() or _step_of(ckpt) != (info.step, info.index):
        raise ExportError(f"{ckpt} was rewritten while the export read it (the run that writes it went on to "
                          f"its next checkpoint): export again, or export a slot the run is done with")
    (tmp / "fastmoe_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt), "step": info.step, "kind": info.kind, "layout": info.meta.get("layout"), **extra},
        indent=2))
    files = sorted(f.name for f in tmp.iterdir())
    write_marker(tmp, HF_EXPORT, checkpoint=str(ckpt), step=info.step)  # last: the export is complete
    try:
        replace_dir(tmp, out)
    except NotOwned as e:  # --out changed while the export was written
        raise ExportError(str(e)) from None
    return files


# ------------------------------------------------------------------------------ transformers families
def family_state_dict(reader: _Reader, model: Any, router_bias: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """The family model's full state dict from a checkpoint: expert tensors stacked back from their
    per-expert segments (so any EP layout exports), every other weight whole, and the routers'
    score-correction biases (buffers the checkpoint keeps in its metadata) by layer."""
    sd: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if is_expert_weight(name):
            keys = [f"model/{name}/{e}" for e in range(p.shape[0])]
            missing = [k for k in keys if not reader.has(k)]
            if missing:
                raise ExportError(f"{reader.path} has no tensor {missing[0]!r}: a partial checkpoint, or another model")
            sd[name] = torch.stack([reader.read(k) for k in keys])
        elif reader.has(f"model/{name}"):
            sd[name] = reader.read(f"model/{name}")
        else:
            raise ExportError(f"{reader.path} has no tensor 'model/{name}': a partial checkpoint, or another model")
    for layer, values in (router_bias or {}).items():
        names = [n for n, _ in model.named_buffers()
                 if n.endswith("e_score_correction_bias") and f"layers.{layer}." in n]
        if len(names) != 1:
            raise ExportError(f"the checkpoint's router bias of layer {layer} matches no buffer of the model")
        sd[names[0]] = torch.tensor(values, dtype=torch.float32)
    return sd


def _export_family(ckpt: Path, info: CheckpointInfo, cfg: Any, tok_desc: dict[str, Any] | None, out: Path,
                   overwrite: bool, max_shard_bytes: int, t0: float) -> ExportResult:
    """``--model.arch hf``: the family's own transformers directory (its config class, its weight
    names, saved by transformers' ``save_pretrained``), loadable without this package. The model is
    built once on the CPU (not streamed as the OLMoE export is)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ..config.hf import hf_model_config
    from ..model.hf_tokenizer import write_tokenizer

    m = cfg.model
    meta = info.meta.get("meta", {}) or {}
    if meta.get("hf_config"):
        d = dict(meta["hf_config"])
        # the trainer ran with experts_implementation="fastmoe"; the export is for any transformers
        for key in ("experts_implementation", "_experts_implementation", "fastmoe_experts_implementation"):
            d.pop(key, None)
        hf = AutoConfig.for_model(d.pop("model_type"), **d)
    else:
        hf = hf_model_config(m, cfg.data.context)
    hf.vocab_size = m.vocab_size
    reader = _Reader(ckpt)
    first = next((k for k in reader.md if k.startswith("model/")), None)
    dtype = reader.dtype(first) if first else torch.float32
    model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
    sd = family_state_dict(reader, model, meta.get("router_bias"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    persistent = set(model.state_dict())
    missing = [k for k in missing if k in persistent]
    if missing or unexpected:
        raise ExportError(f"{ckpt}: the checkpoint does not fill {hf.model_type}: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    with _writing(out, overwrite) as tmp:
        special = {"eos_token_id": None, "pad_token_id": None}
        files: list[str] = []
        if tok_desc is not None:
            special = write_tokenizer(tok_desc, str(tmp), model_max_length=cfg.data.context)
        hf = model.config
        hf.eos_token_id, hf.pad_token_id = special["eos_token_id"], special["pad_token_id"]
        hf.use_cache = True  # training turns the KV cache off; generation wants it
        model.generation_config = GenerationConfig(eos_token_id=special["eos_token_id"],
                                                   pad_token_id=special["pad_token_id"])
        model.save_pretrained(str(tmp), max_shard_size=max_shard_bytes)
        # every field written out, not only those differing from the class's defaults: a reader (and
        # --model.hf_config) never depends on another version's defaults
        hf.to_json_file(str(tmp / "config.json"), use_diff=False)
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        files = _finish(tmp, out, ckpt, info, {"preset": cfg.preset, "family": hf.model_type})
    arch = (hf.architectures or [type(model).__name__])[0]
    return ExportResult(out=out, checkpoint=ckpt, step=info.step, architecture=arch, files=files,
                        total_bytes=total, peak_bytes=total, seconds=time.perf_counter() - t0)


def _step_of(ckpt: Path) -> tuple[int, int] | None:
    try:
        info = read_info(ckpt)
    except (OSError, ValueError, KeyError):
        return None
    return info.step, info.index


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 2GB)") from None


def main(argv: Sequence[str] | None = None) -> int:
    from ..config.errors import OneLineParser

    p = OneLineParser(prog="fastmoe-export", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--checkpoint", required=True,
                   help="OUT/checkpoints (newest valid checkpoint) or one slot-*/model-step-* directory")
    p.add_argument("--out", required=True, help="directory to write (refused when it exists, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (a directory holding anything else is refused)")
    p.add_argument("--max-shard-size", type=_size, default=DEFAULT_MAX_SHARD,
                   help="largest safetensors file before the weights are split with an index (e.g. 500MB)")
    p.add_argument("--config", default=None, help="run.json (or a config JSON) when the checkpoint records none")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    from ..ft.stop import stoppable

    started = time.time()

    def left() -> str:
        marker = Path(args.out) / MARKER
        if marker.is_file() and marker.stat().st_mtime >= started:  # the stop came after the last rename
            return f"the export had finished: --out {args.out} holds it"
        return f"nothing was written to --out {args.out} (an export already there stays as it was)"

    # Ctrl-C / SIGTERM: the staging directory goes, one line (trainer/ft/stop.py)
    return stoppable("fastmoe-export", left, lambda: _export_command(args))


def _export_command(args: argparse.Namespace) -> int:
    """The export ``args`` ask for; its exit status, and one line for an error."""
    config = tok = None
    try:
        if args.config:
            try:
                blob = json.loads(Path(args.config).read_text())
            except (OSError, ValueError) as e:
                raise ExportError(f"--config {args.config}: {e}") from None
            config = blob.get("config", blob)
            if blob.get("data"):
                try:
                    tok = json.loads(Path(blob["data"]).read_text()).get("tokenizer")
                except (OSError, ValueError):
                    tok = None
        res = export_hf(args.checkpoint, args.out, overwrite=args.overwrite, max_shard_bytes=args.max_shard_size,
                        config=config, tokenizer=tok, progress=not args.no_progress)
    except (ExportError, CheckpointError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # writing the output failed (disk full, permissions): the path and the reason
        from ..ft.space import describe_space

        where = f"{e.filename}: " if e.filename else ""
        # a full disk: the export's weights take at most what the checkpoint's files do
        ckpt = Path(args.checkpoint)
        needed = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else None
        space = describe_space(e, e.filename or args.out, needed, most=True)
        print(f"error: {space or where + (e.strerror or ' '.join(str(e).split()))}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(res.out), "checkpoint": str(res.checkpoint), "step": res.step,
                      "architecture": res.architecture, "weights_bytes": res.total_bytes,
                      "peak_bytes": res.peak_bytes, "seconds": round(res.seconds, 3), "files": res.files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

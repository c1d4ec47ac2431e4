"""What a run's ``--out`` may already hold, checked before any work (data, model): the same run
(resumed from its checkpoint), never another run, and an ``--eval.export_hf`` that replaces
neither the run nor anything this package did not export there."""
from __future__ import annotations

import json
import os
from typing import Any

from ..config import ConfigError, TrainConfig
from ..owned import HF_EXPORT, NotOwned, check_replace

#: The fields that make a run what it is, as (section or None, field): a resume keeps them. The
#: others may change on a resume (the layout, the optimizer's sharding and precision, logging,
#: checkpoint intervals, the end-of-run outputs, and the schedule, which the resume itself checks
#: against --checkpoint.reschedule).
IDENTITY = ((None, "preset"), (None, "seed"),
            *(("model", f) for f in ("arch", "num_layers", "hidden_size", "num_heads", "head_dim",
                                     "intermediate_size", "num_experts", "top_k", "norm_topk_prob", "rope_theta",
                                     "init_std", "init_from", "hf_config", "hf_family")),
            ("data", "path"), ("data", "context"), ("data", "seed"), ("data", "document_mask"),
            ("schedule", "global_batch"), ("checkpoint", "init_from"), ("lora", "rank"), ("lora", "targets"))


def take_run_lease(out: str, rank: int) -> Any:
    """The lease on the run directory ``out`` (trainer/ft/lease.py), taken by the job's first rank;
    another live job's is refused there in one line (:class:`~trainer.ft.lease.LeaseHeld`), which
    ends the job. The other ranks leave it to rank 0: they need not share its job id (processes
    started by hand or by ``multiprocessing`` know only their rank), and one refusing alone would
    leave its peers waiting in a collective."""
    from ..ft.lease import lease_path, take_lease

    if rank != 0:
        return None
    return take_lease(lease_path(out), what=f"--out {out}", command="fastmoe-train")


class RunDirClaim:
    """``fastmoe-train``'s hold on ``--out`` before any other check: the directory made (or found
    writable) and its lease taken, by the launcher for its workers (``launcher``), else by rank 0
    :meth:`undo` after a refusal leaves ``--out`` as it was found."""

    def __init__(self, out: str, *, launcher: bool = False) -> None:
        from ..ft.records import check_out_dir

        self.out = os.path.abspath(out)
        self.before = set(os.listdir(out)) if os.path.isdir(out) else None
        self.made = []  # the directories check_out_dir makes, --out first, its missing parents after
        d = self.out
        while not os.path.exists(d) and os.path.dirname(d) != d:
            self.made.append(d)
            d = os.path.dirname(d)
        check_out_dir(out)
        try:
            if launcher:
                from ..ft.lease import launcher_lease

                self.lease = launcher_lease(out, command="fastmoe-train --nproc-per-node", prefix="local",
                                            shared=False)
            else:
                self.lease = take_run_lease(out, int(os.environ.get("RANK", "0")))
        except ConfigError:
            self.undo()
            raise

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def undo(self) -> None:
        """The directories this run made in ``--out`` that stayed empty go, and ``--out`` itself when
        this run made it (with the parents it made) and it stayed empty: a refused run leaves no empty
        ``--out``, no empty ``heartbeat/``."""
        if not os.path.isdir(self.out):
            return
        for name in set(os.listdir(self.out)) - (self.before or set()):
            path = os.path.join(self.out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                for d, _, _ in sorted(os.walk(path, topdown=False), key=lambda w: -len(w[0])):
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
        for d in self.made:
            try:
                os.rmdir(d)
            except OSError:
                return


def check_run_dir(cfg: TrainConfig) -> None:
    """Raise ConfigError (one line: what was found and the ``--out`` choices) when ``--out`` holds
    another run, or ``--eval.export_hf`` would replace the run or what it may not."""
    _check_export_dir(cfg)
    out = cfg.logging.out
    saved = _saved_config(os.path.join(out, "run.json"))
    if saved is None:
        return
    new = cfg.to_dict()
    default = TrainConfig().to_dict()  # a field a run.json of an earlier version lacks had its default there
    changed = []
    for section, name in IDENTITY:
        had = saved if section is None else saved.get(section, {})
        old_v = had[name] if name in had else (default if section is None else default.get(section, {})).get(name)
        new_v = (new if section is None else new.get(section, {})).get(name)
        if old_v != new_v:
            option = name if section is None else f"{section}.{name}"
            changed.append(f"--{option} {_shown(old_v)} -> {_shown(new_v)}")
    if changed:
        raise ConfigError(
            f"--out {out} holds another run ({os.path.join(out, 'run.json')}: {', '.join(changed[:4])}"
            f"{', ...' if len(changed) > 4 else ''}); give this run a fresh --out, or that run's configuration "
            f"to resume it")


def _shown(v: Any) -> str:
    return "none" if v is None or v == "" else str(v)


def _saved_config(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f).get("config")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); give a fresh --out, or remove it to use this one") from None
    return cfg if isinstance(cfg, dict) else None


def _check_export_dir(cfg: TrainConfig) -> None:
    export = cfg.eval.export_hf
    if not export:
        return
    out = cfg.logging.out
    target = os.path.abspath(export)
    for option, d in (("--out", out), ("--checkpoint.dir", cfg.checkpoint.dir or os.path.join(out, "checkpoints"))):
        d = os.path.abspath(d)
        if d == target or d.startswith(target.rstrip(os.sep) + os.sep):
            raise ConfigError(f"--eval.export_hf {export} is or holds the run's {option} {d}, which the export "
                              f"would replace; give the export a directory of its own, e.g. "
                              f"--eval.export_hf {os.path.join(out, 'hf')}")
    try:
        exists = check_replace(export, HF_EXPORT, option="--eval.export_hf", flag="--eval.overwrite")
    except NotOwned as e:
        raise ConfigError(str(e)) from None
    if exists and not cfg.eval.overwrite:
        raise ConfigError(f"--eval.export_hf {export} exists; pass --eval.overwrite to replace it")
    _check_writable(target, "--eval.export_hf")


def _check_writable(target: str, option: str) -> None:
    """Raise ConfigError when no file can be made beside ``target`` (where its output is staged and
    moved in) or, with no such folder yet, in its nearest existing parent: a read-only export folder
    is found before training, not after. The folder probed keeps its times."""
    d = os.path.dirname(target.rstrip(os.sep)) or os.sep
    while not os.path.exists(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    probe = os.path.join(d, f".write-test-{os.getpid()}")
    try:
        before = os.stat(d)
        with open(probe, "wb"):
            pass
        os.unlink(probe)
        os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError as e:
        raise ConfigError(f"{option} {target}: cannot write in {d} ({e.strerror or e}), where the export is made; "
                          f"give a directory you can write to, or leave {option} out") from None


def check_data_set(meta: dict[str, Any], step: int, path: str, now: str, manifest_path: str) -> None:
    """A resume on another data set than the checkpoint's (other files, or the same path
    preprocessed again: fingerprint ``now`` of ``manifest_path``) is refused in one line naming
    both fingerprints and the ways on."""
    saved = (meta.get("data") or {}).get("fingerprint")
    if saved is None or saved == now:
        return
    old_path = meta.get("data_manifest") or "its data set"

    def manifest_file(p: str) -> str:
        return os.path.abspath(os.path.join(p, "manifest.json") if os.path.isdir(p) else p)

    same = manifest_file(str(old_path)) == manifest_file(manifest_path)
    raise ConfigError(
        f"the checkpoint {path} (step {step}) was trained on {old_path} (fingerprint {str(saved)[:12]}), "
        f"this run reads {manifest_path} (fingerprint {now[:12]}): "
        f"{'it was preprocessed again since' if same else 'another data set'}; give --data the checkpoint's "
        f"data set to resume, or train on the new one in another --out (--checkpoint.init_from {path} starts "
        f"it from these weights)")

"""Weights & Biases logging of the training records (``--logging.wandb``), beside TensorBoard.

The ``wandb`` package is optional (the ``wandb`` extra: ``pip install 'fastmoe_xpu[wandb]'``); asking
for it without the package installed is one ``error:`` line before any work
(:func:`trainer.config.check_wandb_available`, called by the config's validation).

Rank 0 logs the scalars TensorBoard gets (:func:`trainer.records.tb_writer.record_scalars`: every numeric
field of a step's record, the MoE health lists per layer as ``<name>/layer_<l>``) at the record's
step, with the run's config. W&B itself reads its usual environment: ``WANDB_MODE=offline`` writes
the run under ``OUT/wandb`` to ``wandb sync`` later, ``WANDB_ENTITY``, ``WANDB_API_KEY``, ...

Resume: the run's W&B id is kept in ``OUT/wandb_run.json``, so a resumed run logs into the same W&B
run. W&B keeps one value per step and only accepts steps after the last one logged; the steps a
resume redoes after its checkpoint were logged by the earlier process (with the same values: a
resume continues bit for bit), so they are skipped rather than sent again.
"""
from __future__ import annotations

import json
import os
import secrets
from typing import Any

from ..config import WANDB_INSTALL_HINT as INSTALL_HINT
from ..config.errors import ConfigError
from .tb_writer import record_scalars

#: The file in OUT that keeps the W&B run id across resumes.
RUN_FILE = "wandb_run.json"
class WandbScalars:
    """One W&B run for ``out_dir``: ``write(record)`` logs a step's scalars, ``close()`` finishes.

    ``logged_through``: the last step an earlier process of this run logged (records up to it are
    skipped). Raises :class:`ConfigError` in one line when W&B cannot start a run."""

    def __init__(self, out_dir: str, *, project: str, config: dict[str, Any] | None = None,
                 name: str | None = None, logged_through: int = 0) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(f"--logging.wandb: the wandb package does not import ({e}): {INSTALL_HINT}") from None
        self.logged_through = logged_through
        self.run_file = os.path.join(out_dir, RUN_FILE)
        previous = _read_run_file(self.run_file) if logged_through > 0 else None
        run_id = previous["id"] if previous else secrets.token_hex(4)  # W&B's ids: 8 characters of [a-z0-9]
        name = name or os.path.basename(os.path.abspath(out_dir))
        try:
            self.run = wandb.init(project=project, name=name, dir=out_dir, config=config, id=run_id,
                                  resume="allow")
        except Exception as e:  # noqa: BLE001 - not logged in, no network, a bad setting: one line
            raise ConfigError(f"--logging.wandb: W&B could not start a run ({' '.join(str(e).split())[:300]}); "
                              "log in with `wandb login`, or set WANDB_MODE=offline to write the run under "
                              f"{os.path.join(out_dir, 'wandb')} and `wandb sync` it later") from None
        with open(self.run_file + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"id": self.run.id, "project": project, "name": name}, f)
        os.replace(self.run_file + ".tmp", self.run_file)

    def write(self, record: dict[str, Any]) -> int:
        """Logs the record's scalars at its step; returns how many (0 for a step logged before)."""
        step = int(record.get("step", 0))
        if step <= self.logged_through:
            return 0
        scalars = dict(record_scalars(record))
        self.run.log(scalars, step=step)
        self.logged_through = step
        return len(scalars)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _read_run_file(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("id"), str) else None

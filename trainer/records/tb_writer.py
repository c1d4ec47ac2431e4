"""TensorBoard scalars of the training records: the writer library and the tags.

The event files are written by ``tensorboardX`` (the ``trainer`` extra; an 87 KB wheel whose only
new need is protobuf, 343 KB) or, where only the ``tensorboard`` package is installed, by
``torch.utils.tensorboard``; both write the same TFRecord files of ``Event`` protos, which
``tensorboard --logdir OUT/tensorboard`` reads. With neither importable the run says so in one
line and keeps ``metrics.jsonl`` and the charts.

Tags: every numeric field of a record under its own name (``loss``, ``lm_loss``, ``lr``,
``grad_norm``, ``val_loss``, ``val_ppl``, ``tokens_per_s``, ...), and the per-layer MoE health
lists (``moe_load_min``, ``moe_load_max``, ``moe_load_cv``, ``moe_router_entropy``, ``moe_lb_loss``,
``moe_z_loss``, ``moe_dropped_frac``, ...) as ``<name>/layer_<l>``. The tokens of every expert
(``moe_tokens_per_expert``, a list per layer) stay in ``metrics.jsonl`` and the heat map.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

# What a person reads when no event file is written; one line, printed once per writer.
NO_WRITER_MESSAGE = ("tensorboard: no event writer (pip install tensorboardX, or tensorboard); "
                     "scalars stay in metrics.jsonl and the charts")


def _load_writer_class() -> tuple[Callable[..., Any] | None, str]:
    """(SummaryWriter class, library name), tensorboardX first: it is the declared dependency."""
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter, "tensorboardX"
    except Exception:  # absent, or broken by a protobuf it cannot use
        pass
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter, "torch.utils.tensorboard"
    except Exception:  # torch's writer needs the tensorboard package
        return None, ""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def record_scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The (tag, value) pairs of one metrics record; non-finite values are kept (a NaN loss is news)."""
    for key, value in record.items():
        if key == "step":
            continue
        if _is_number(value):
            yield key, float(value)
        elif key.startswith("moe_") and isinstance(value, (list, tuple)) and value \
                and all(_is_number(v) for v in value):
            # MoE health lists are indexed by layer; nested lists (tokens of each expert) are not scalars
            for layer, v in enumerate(value):
                yield f"{key}/layer_{layer}", float(v)


class TensorBoardScalars:
    """Scalars of each record into ``log_dir``; ``enabled`` is False when no writer library imports."""

    def __init__(self, log_dir: str, *, start_step: int = 0, quiet: bool = False) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.log_dir = log_dir
        cls, self.library = _load_writer_class()
        self._w = None
        if cls is None:
            if not quiet:
                print(NO_WRITER_MESSAGE, file=sys.stderr, flush=True)
            return
        # A resumed run re-does the steps after its checkpoint: purge_step makes TensorBoard drop the
        # earlier run's events from there on instead of drawing both.
        self._w = cls(log_dir, purge_step=start_step + 1 if start_step > 0 else None)

    @property
    def enabled(self) -> bool:
        return self._w is not None

    def write(self, record: dict[str, Any]) -> int:
        """Adds the record's scalars at its step; returns how many were written."""
        if self._w is None:
            return 0
        step = int(record.get("step", 0))
        n = 0
        for tag, value in record_scalars(record):
            self._w.add_scalar(tag, value, step)
            n += 1
        return n

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

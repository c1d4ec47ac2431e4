"""Metrics: JSON lines, TensorBoard scalars, gradient-spike detection, device peak FLOP/s, loss plot."""
from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from typing import Any, Iterable

import torch

# Dense bf16 peak TFLOP/s of one device (one tile for Intel's Max 1550, which PyTorch sees as two devices).
KNOWN_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("Max 1550", 416.0),
    ("MI300X", 1307.0),
    ("MI250X", 191.5),
)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512,
                          seconds: float = 0.25) -> float:
    """A short dense-matmul benchmark: the achievable ceiling on a device with no known peak."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    iters, t0 = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if device.type != "cpu":
            getattr(torch, device.type).synchronize()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return 2 * n ** 3 * iters / dt / 1e12


def device_peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number came from)."""
    if override > 0:
        return override, "configured"
    if device.type in ("cuda", "xpu"):
        name = getattr(torch, device.type).get_device_name(device)
        for key, tflops in KNOWN_PEAK_TFLOPS:
            if key.lower() in name.lower():
                return tflops, f"table ({name})"
    return measure_matmul_tflops(device), "measured fp32 matmul"


class SpikeDetector:
    """Flags a gradient norm above ``factor`` times the mean of the previous ``window`` norms."""

    def __init__(self, window: int = 20, factor: float = 2.0) -> None:
        if window < 1 or factor <= 0:
            raise ValueError(f"spike window must be >= 1 and factor > 0, got {window}, {factor}")
        self.window = window
        self.factor = factor
        self.history: deque[float] = deque(maxlen=window)
        self.count = 0

    def update(self, grad_norm: float) -> tuple[bool, float]:
        """(is this a spike, the running mean it was compared with); non-finite norms are spikes."""
        mean = sum(self.history) / len(self.history) if self.history else float("nan")
        full = len(self.history) == self.window
        spike = (not math.isfinite(grad_norm)) or (full and grad_norm > self.factor * mean)
        if spike:
            self.count += 1
        if math.isfinite(grad_norm):
            self.history.append(grad_norm)
        return spike, mean

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.count = int(state["count"])


class MetricsWriter:
    """Appends one JSON object per step to ``OUT/metrics.jsonl`` and its scalars to TensorBoard
    event files under ``OUT/tensorboard`` (see :mod:`trainer.tb_writer`)."""

    def __init__(self, out_dir: str, *, tensorboard: bool = True, append: bool = False,
                 start_step: int = 0) -> None:
        from .tb_writer import TensorBoardScalars

        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if append and os.path.isfile(self.path):
            # a resume re-does the steps after its checkpoint: the earlier run's records of those go
            drop_records_after(self.path, start_step)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        self._tb = None
        if tensorboard:
            tb = TensorBoardScalars(os.path.join(out_dir, "tensorboard"), start_step=start_step)
            self._tb = tb if tb.enabled else None

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        # strict JSON: a non-finite number is written as null (JSON has no NaN)
        self._f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._f.flush()
        if self._tb is not None:
            self._tb.write(record)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def drop_records_after(path: str, step: int) -> int:
    """Rewrites the metrics file ``path`` without the records of steps after ``step`` (and without
    lines that do not parse: a write cut short); returns how many lines went."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return len(lines) - len(keep)


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: Iterable[dict[str, Any]], path: str, title: str = "") -> str:
    """Loss and LM loss against step (log-scale y), with gradient spikes marked; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [r["loss"] for r in records], label="loss", lw=1.2)
    if records and "lm_loss" in records[0]:
        ax.plot(steps, [r["lm_loss"] for r in records], label="lm loss", lw=1.0, alpha=0.8)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], label="validation loss", lw=1.2,
                marker="o", ms=3, color="black")
    spikes = [r for r in records if r.get("grad_spike")]
    if spikes:
        ax.scatter([r["step"] for r in spikes], [r["loss"] for r in spikes], color="red", s=12, zorder=3,
                   label=f"gradient spikes ({len(spikes)})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

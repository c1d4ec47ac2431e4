"""Metrics: JSON lines, TensorBoard scalars, gradient-spike detection, device peak FLOP/s, loss plot."""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from typing import Any, Iterable

import torch

#: Dense (no sparsity) bf16 peak TFLOP/s of one device as its vendor states it, by a piece of the
#: name torch reports; the first match wins, so the variants come before their family's name.
KNOWN_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4),       # Grace Hopper: an H100 SXM's tensor cores
    ("H200 NVL", 835.0),
    ("H200", 989.4),        # SXM
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),        # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
    ("MI325X", 1307.4),
    ("MI300X", 1307.4),
    ("MI300A", 980.6),
    ("MI250X", 191.5),      # one of its two dies, which torch sees as two devices
)
#: Intel Data Center GPU Max (Ponte Vecchio): bf16 on the XMX engines is 4096 FLOP per clock per
#: Xe core (8 vector engines, torch's ``gpu_eu_count``), at the product's peak clock in GHz. In the
#: default FLAT mode torch sees each of a Max 1550's two tiles as a device of 64 Xe cores (419.4).
PVC_PEAK_GHZ: tuple[tuple[str, float, int], ...] = (
    # (name piece, clock, Xe cores of one device when the properties do not say)
    ("Max 1550", 1.6, 64),
    ("Max 1450", 1.4, 64),
    ("Max 1100", 1.55, 56),
)
PVC_FLOP_PER_CLOCK_PER_CORE = 4096
#: Lowest fp32 TFLOP/s one CPU thread is taken to have (an SSE core at 2.5 GHz does 0.02): a
#: measurement below it was disturbed, not the machine's peak.
CPU_FLOOR_TFLOPS_PER_THREAD = 0.01


def median_seconds(fn: Any, repeats: int) -> float:
    """The median wall-clock seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _best_call_seconds(fn: Any, sync: Any, rounds: int, seconds: float) -> float:
    """The fastest of many calls of ``fn``, over ``rounds`` rounds of about ``seconds`` each: on a
    shared machine the least disturbed call is the nearest to what the device can do."""
    fn()
    sync()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        end = time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            fn()
            sync()
            t1 = time.perf_counter()
            best = min(best, t1 - t0)
            if t1 >= end:
                break
    return best


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype | None = None, n: int | None = None,
                          seconds: float = 0.05, rounds: int = 5) -> float:
    """A dense-matmul benchmark, the ceiling on a device with no stated peak: the best of many
    calls over several rounds. On the CPU, one thread's best (fp32, n = 256: in cache, a call of
    well under a millisecond that a loaded machine rarely interrupts) times the threads torch uses,
    never below :data:`CPU_FLOOR_TFLOPS_PER_THREAD` per thread; elsewhere bf16 at n = 4096."""
    if device.type == "cpu":
        dtype, n = dtype or torch.float32, n or 256
        threads = torch.get_num_threads()
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        torch.set_num_threads(1)
        try:
            best = _best_call_seconds(lambda: a @ b, lambda: None, rounds, seconds)
        finally:
            torch.set_num_threads(threads)
        return max(2 * n ** 3 / best / 1e12, CPU_FLOOR_TFLOPS_PER_THREAD) * threads
    dtype, n = dtype or torch.bfloat16, n or 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = getattr(torch, device.type).synchronize
    return 2 * n ** 3 / _best_call_seconds(lambda: a @ b, sync, rounds, seconds) / 1e12


def stated_peak_tflops(name: str, properties: Any = None) -> float | None:
    """The vendor's dense bf16 peak of a device called ``name`` (None when unknown); Intel's Max
    GPUs from their Xe cores (``properties.gpu_eu_count / 8``: a tile or a whole card)."""
    low = name.lower()
    for key, tflops in KNOWN_PEAK_TFLOPS:
        if key.lower() in low:
            return tflops
    for key, ghz, cores in PVC_PEAK_GHZ:
        if key.lower() in low:
            eus = getattr(properties, "gpu_eu_count", 0) or 0
            if eus >= 8:
                cores = eus // 8
            return round(cores * PVC_FLOP_PER_CLOCK_PER_CORE * ghz / 1e3, 1)
    return None


def device_peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number came from): ``override`` when > 0, the stated
    peak of a known accelerator, else a measurement (:func:`measure_matmul_tflops`)."""
    if override > 0:
        return override, "configured"
    if device.type in ("cuda", "xpu"):
        mod = getattr(torch, device.type)
        name = mod.get_device_name(device)
        try:
            props = mod.get_device_properties(device)
        except Exception:  # noqa: BLE001 - the name alone still finds the table's entries
            props = None
        stated = stated_peak_tflops(name, props)
        if stated is not None:
            return stated, f"stated bf16 peak ({name})"
        return measure_matmul_tflops(device), f"measured bf16 matmul ({name})"
    return measure_matmul_tflops(device), (f"measured fp32 matmul ({torch.get_num_threads()} thread(s), "
                                           "best call of one thread x threads)")


class MfuMeter:
    """Model FLOPs utilisation of each step: achieved FLOP/s per device over the peak, never above 1.

    A step faster than the peak means the peak is wrong. A measured one was an underestimate (the
    run has shown the device does more), so it is raised to the step's rate; a stated or configured
    one is kept and the step counts as 1. Either way one line says so, once."""

    def __init__(self, peak_tflops: float, source: str, flops_per_token: float, world: int,
                 warn: Any = None) -> None:
        self.peak_tflops, self.source = peak_tflops, source
        self.flops_per_token, self.world = flops_per_token, world
        self._warn = warn if warn is not None else (lambda msg: print(msg, flush=True))
        self._warned = False

    def __call__(self, tokens_per_s: float) -> float:
        achieved = self.flops_per_token * tokens_per_s / self.world / 1e12  # TFLOP/s of one device
        if achieved <= self.peak_tflops:
            return achieved / self.peak_tflops
        measured = self.source.startswith("measured")
        if not self._warned:
            self._warned = True
            then = ("the peak is raised to it" if measured else
                    "MFU counts as 1 (give the device's peak with --logging.peak_tflops)")
            self._warn(f"mfu: a step ran at {achieved:.4g} TFLOP/s per device, above the peak of "
                       f"{self.peak_tflops:.4g} ({self.source}); {then}")
        if measured:
            self.peak_tflops = achieved
        return 1.0


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
    """Appends one JSON object per step to ``OUT/metrics.jsonl``, its scalars to TensorBoard event
    files under ``OUT/tensorboard`` (see :mod:`trainer.records.tb_writer`) and, given ``wandb`` (the
    keywords of :class:`trainer.records.wandb_writer.WandbScalars`: ``project``, ``config``, ``name``), to a
    Weights & Biases run."""

    def __init__(self, out_dir: str, *, tensorboard: bool = True, append: bool = False,
                 start_step: int = 0, wandb: dict[str, Any] | None = None) -> None:
        from .tb_writer import TensorBoardScalars

        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        logged_through = 0
        if append and os.path.isfile(self.path):
            logged_through = last_step(self.path)  # what the earlier process logged (W&B keeps it)
            # a resume re-does the steps after its checkpoint: the earlier run's records of those go
            drop_records_after(self.path, start_step)
        self._wandb = None
        if wandb is not None:  # first: a run W&B cannot start stops here, before anything is written
            from .wandb_writer import WandbScalars

            self._wandb = WandbScalars(out_dir, logged_through=logged_through, **wandb)
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
        line = json.dumps(json_safe(record), allow_nan=False) + "\n"
        try:
            self._f.write(line)
            self._f.flush()
        except OSError as e:  # a full disk stops the run in one line (exit 76), its newest checkpoint valid
            from ..ft.space import OutOfSpace, describe_space

            space = describe_space(e, self.path, len(line.encode()))
            if space is None:
                raise
            raise OutOfSpace(f"could not write the record of step {record.get('step')}: {space}; the newest "
                                  f"checkpoint stays valid") from None
        if self._tb is not None:
            self._tb.write(record)
        if self._wandb is not None:
            self._wandb.write(record)

    @property
    def wandb_run(self) -> Any:
        """The W&B run being logged to (None without ``wandb``)."""
        return self._wandb.run if self._wandb is not None else None

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def last_step(path: str) -> int:
    """The highest ``step`` of the metrics file ``path`` (0 when none; unparsable lines skipped)."""
    best = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                best = max(best, int(rec.get("step", 0) or 0))
    return best


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


def plot_loss(records: Iterable[dict[str, Any]], path: str, title: str = "", schedule: str = "") -> str:
    """:func:`loss_figure` written to ``path``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig = loss_figure(records, title, schedule)
    fig.savefig(path)
    plt.close(fig)
    return path


def loss_figure(records: Iterable[dict[str, Any]], title: str = "", schedule: str = "") -> Any:
    """Loss and LM loss against step, with gradient spikes marked and the validation loss where
    evaluated; the learning rate (the records' ``lr``) on a second axis, ``schedule`` (its phases in
    words) under the title. The figure's axes: loss first, learning rate second."""
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
        for key in sorted({k for r in val for k in r if k.startswith("val_loss/")}):  # a mixture's sources
            own = [r for r in val if key in r]
            ax.plot([r["step"] for r in own], [r[key] for r in own], label=f"validation loss {key[9:]}", lw=1.0,
                    marker=".", ms=3, ls=":")
    spikes = [r for r in records if r.get("grad_spike")]
    if spikes:
        ax.scatter([r["step"] for r in spikes], [r["loss"] for r in spikes], color="red", s=12, zorder=3,
                   label=f"gradient spikes ({len(spikes)})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    with_lr = [r for r in records if r.get("lr") is not None]
    if with_lr:
        lr_ax = ax.twinx()
        lr_ax.plot([r["step"] for r in with_lr], [r["lr"] for r in with_lr], color="tab:green", lw=1.0, ls="--",
                   label="learning rate (right)")
        lr_ax.set_ylabel("learning rate")
        lr_ax.set_ylim(bottom=0)
        more, more_labels = lr_ax.get_legend_handles_labels()
        handles, labels = handles + more, labels + more_labels
    ax.legend(handles, labels)
    if title or schedule:
        ax.set_title("\n".join(x for x in (title, schedule) if x), **({"fontsize": 9} if schedule else {}))
    fig.tight_layout()
    return fig

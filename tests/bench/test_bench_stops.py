"""Ctrl-C and SIGTERM stop ``fastmoe-bench`` (the layer benchmark and a study) in one line with exit
status 128 + the signal's number and no traceback, at several moments of a run: while the inputs are
built, while the providers are timed, and in a study's rounds; nothing is written into --out after it."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _stop_at(argv: list[str], marker: str, delay: float, sig: int, timeout: float = 120.0) -> tuple[int, str]:
    """Start ``python -m bench ARGV``, wait for ``marker`` in its output (then ``delay`` seconds), send
    ``sig``; (exit status, output: stdout and stderr together). SIGINT is set to its default for the child, as a terminal's job has it
    (a background job of a non-interactive shell inherits it ignored, which the benchmark overrides)."""
    proc = subprocess.Popen([sys.executable, "-m", "bench", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                                                 signal.SIG_DFL))
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the benchmark ended before {marker!r}: {''.join(seen)[-2000:]}")
            seen.append(line)
            if marker in line:
                break
        time.sleep(delay)
        assert proc.poll() is None, f"the benchmark ended before the signal: {''.join(seen)[-2000:]}"
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
        return rc, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _one_line_stop(rc: int, err: str, sig: int) -> None:
    name = signal.Signals(sig).name
    assert rc == 128 + sig, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = [l for l in err.splitlines() if l.strip()][-1]
    assert last.startswith(f"fastmoe-bench: stopped ({name});"), err[-2000:]


@pytest.mark.parametrize("marker, delay, sig", [
    ("building inputs", 0.0, signal.SIGINT),       # while the layer's inputs are built
    ("building inputs", 3.0, signal.SIGINT),       # while the providers are timed
    ("building inputs", 3.0, signal.SIGTERM),
], ids=["inputs-sigint", "timing-sigint", "timing-sigterm"])
def test_the_layer_benchmark_stops_in_one_line(tmp_path, marker, delay, sig):
    out = tmp_path / "out"
    rc, err = _stop_at(["--preset", "tiny", "--rounds", "2000", "--threads", "1", "--out", str(out)], marker, delay,
                       sig)
    _one_line_stop(rc, err, sig)
    assert not any(out.glob("results*")), sorted(p.name for p in out.iterdir())


def test_a_study_stops_in_one_line(tmp_path):
    rc, err = _stop_at(["small_shapes", "--shapes", "256,512,512,16,4", "--rounds", "400"], "interleaved rounds",
                       1.0, signal.SIGINT)
    _one_line_stop(rc, err, signal.SIGINT)

"""What the benchmark prints reads alike in every mode: each explanation once per run, a load
average in one format, a count with its noun in the right number, and a chart whose labels lie
inside the figure."""
from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

import bench.studies.demo as demo
from bench.cli import main
from bench.harness.presets import PRESETS
from bench.harness.report import BASELINE_NAMES, BOUND_LINE, CASE_COLUMNS, chart_figure, load_text, machine_line, plural

#: a load average as every output prints it (three numbers, one decimal each)
LOAD = r"\d+\.\d/\d+\.\d/\d+\.\d"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The layer benchmark at two tiny presets, one round, one thread: (stdout, output folder)."""
    out = tmp_path_factory.mktemp("tiny")
    old = torch.get_num_threads()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(["--preset", "tiny", "tiny-ep", "--rounds", "1", "--out", str(out), "--no-progress",
                       "--threads", "1"])
    finally:
        torch.set_num_threads(old)
    assert rc == 0, buf.getvalue()
    return buf.getvalue(), out


def test_each_explanation_is_printed_once(tiny_run):
    printed, _ = tiny_run
    for line in (BOUND_LINE, *CASE_COLUMNS, *(f"vs {o}: {name}" for o, name in BASELINE_NAMES.items())):
        assert printed.count(line) == 1, (line, printed.count(line))
    assert printed.count("\n  dense-matmul ceiling ") == 2  # one per case: the explanations went, not the tables


def test_the_load_average_reads_alike_at_start_and_end(tiny_run):
    printed, out = tiny_run
    loads = [line for line in printed.splitlines() if "load average" in line]
    assert len(loads) == 2 and all(re.search(rf"load average at (start|end): {LOAD}$", x) for x in loads), loads
    md = (out / "results.md").read_text()
    assert re.search(rf"load average at start {LOAD}, at end {LOAD}\.", md), md[:400]
    assert "[" not in "".join(loads)


def test_one_thread_is_singular(tiny_run):
    printed, out = tiny_run
    assert "1 torch thread," in printed.splitlines()[0] and "1 torch threads" not in printed
    assert "1 torch thread," in (out / "results.md").read_text()
    assert "1 torch thread," in (out / "results.csv").read_text()
    assert plural(1, "thread") == "1 thread" and plural(2, "thread") == "2 threads" and plural(0, "cpu") == "0 cpus"


def test_load_text_and_machine_line():
    assert load_text([1.77783203125, 1.7, 0.04]) == "1.8/1.7/0.0" and load_text(None) == "-"
    mach = {"cpu_model": "X", "usable_cpus": 1, "torch_threads": 4, "torch": "2", "transformers": None}
    assert machine_line(mach) == "X, 1 cpu, 4 torch threads, torch 2, transformers None"


def test_the_chart_keeps_every_label_inside_the_figure(tiny_run):
    _, out = tiny_run
    data = json.loads((out / "results.json").read_text())
    fig = chart_figure(data, data["cases"], "fwdbwd")
    assert fig is not None
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    ax = fig.axes[0]
    texts = [ax.yaxis.label, ax.xaxis.label, ax.title, *ax.get_xticklabels(), *ax.get_yticklabels(),
             *(t for leg in fig.legends for t in leg.get_texts())]
    assert ax.yaxis.label.get_text() and fig.legends
    for t in texts:
        if not t.get_text():
            continue
        e = t.get_window_extent(renderer)
        assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, (t.get_text(), e, box)
    assert "1 thread," in ax.title.get_text()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_demo_prints_its_explanations_once_and_the_load_as_elsewhere(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_PRESET", PRESETS["tiny"])
    monkeypatch.setattr(demo, "DEMO_CEILING_N", 32)
    assert main(["--demo", "--rounds", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count(BOUND_LINE) == 1
    assert re.search(rf"load average at start {LOAD}$", out.splitlines()[0]), out.splitlines()[0]


def test_a_study_says_one_round(capsys):
    from bench.studies import small_shapes

    old = torch.get_num_threads()
    try:
        assert small_shapes.main(["--shapes", "5,8,4,4,2", "--rounds", "1", "--reps", "1"]) == 0
    finally:
        torch.set_num_threads(old)
    first = capsys.readouterr().out.splitlines()[0]
    assert "min over 1 interleaved round;" in first, first

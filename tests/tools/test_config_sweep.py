"""The config sweep (``python -m fastmoe_xpu.tools.config_sweep``) on the CPU: its refusal without a
GPU, its dry run, its budget, and the kept table it writes read back by autotune without timing. The
layer runs are fakes that go through autotune.choose with a fake timer, as the GEMM launchers do."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu import settings  # noqa: E402
from fastmoe_xpu.kernels import configs, kept_configs  # noqa: E402
from fastmoe_xpu.kernels.triton import autotune  # noqa: E402
from fastmoe_xpu.tools import config_sweep  # noqa: E402

DEVICE = "NVIDIA Test GPU"
GPU = torch.device("cuda")  # never touched: device name, readiness and the layer runs are fakes
SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b", "mixtral-8x7b", "deepseek-v3-ep8")


@pytest.fixture
def fresh():
    kept_configs.forget()
    autotune.forget()
    yield
    kept_configs.forget()
    autotune.forget()


def fake_step(step: config_sweep.Step, device: torch.device) -> None:
    """What a layer's forward and backward does to autotune: one choice per grouped-GEMM key, timed
    by a fake timer under which each kernel's last candidate is the fastest."""
    s = step.shape
    rows = s.tokens * s.top_k
    for kernel in config_sweep.ENGINE_KERNELS[step.engine]:
        cands = configs.configs("cuda", kernel)
        seconds = {c.name: 1.0 - 0.1 * i for i, c in enumerate(cands)}
        last: list[str] = []

        def launch(cfg, last=last):
            last.append(cfg.name)
            assert settings.get().kept_configs is False  # the sweep times: it never reads the kept table

        def timer(run, last=last, seconds=seconds):
            run()
            return seconds[last[-1]]

        autotune.choose(kernel, "cuda", s.intermediate, s.hidden, rows, s.local_experts, device, launch, timer,
                        dtype=config_sweep.DTYPES[step.dtype])


def test_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert config_sweep.main(["--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no cuda device" in err


def test_dry_run_lists_every_step_and_writes_nothing(capsys):
    before = sorted(kept_configs.TUNED_DIR.iterdir())
    assert config_sweep.main(["--device", "cuda", "--shapes", "practitioners", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 steps" in out and "budget 420 s" in out
    for name in SHAPES:
        assert f"{name} bf16 triton (" in out and f"{name} bf16 triton_tma (" in out
    assert "deepseek-v3-ep8 bf16 triton (T=32768 H=7168 I=2048 E=256 K=8 NR=32)" in out
    assert "gate_up_fwd (2 candidates)" in out
    assert sorted(kept_configs.TUNED_DIR.iterdir()) == before


def test_engine_kernels_are_the_tables_kernels():
    for table in ("cuda", "sm100", "hip", "xpu"):
        assert config_sweep.engines_of(table) == (["triton", "triton_tma"] if table in ("cuda", "sm100") else ["triton"])
        for engine in config_sweep.engines_of(table):
            for kernel in config_sweep.ENGINE_KERNELS[engine]:
                assert configs.configs(table, kernel)


def test_the_layer_inputs_route_every_expert_alike():
    shape = config_sweep.Shape("toy", tokens=64, hidden=16, intermediate=8, experts=8, top_k=2, local_experts=4)
    t = config_sweep.layer_inputs(shape, torch.float32, torch.device("cpu"))
    assert torch.bincount(t["idx"].flatten(), minlength=8).tolist() == [16] * 8
    assert t["w_gu"].shape == (4, 16, 16) and t["w_d"].shape == (4, 16, 8)
    assert (t["idx"].sort(-1).values.diff(dim=-1) > 0).all()  # K distinct experts per token


def test_budget_stops_before_a_step_that_would_overrun(fresh):
    steps = [config_sweep.Step(s, "bf16", e) for s in config_sweep.shapes("practitioners")[:3]
             for e in config_sweep.ENGINE_KERNELS]
    now = [0.0]

    def run(step, device):
        now[0] += 100.0 if step.engine == "triton" else 30.0
        fake_step(step, device)

    lines: list[str] = []
    entries, done = config_sweep.sweep(steps, GPU, 300.0, progress=lines.append, run=run, clock=lambda: now[0])
    # 100 + 30 + 100 + 30 = 260 s; the next triton step would end near 360 s
    assert [s.label for s in done] == [s.label for s in steps[:4]]
    assert lines[-1].startswith("budget: 260 s spent of 300 s") and "stopping after 4 of 6 steps" in lines[-1]
    assert lines[0].startswith("[1/6] olmoe-1b-7b bf16 triton (T=32768") and "3 keys, 6 candidates" in lines[0]
    assert len(entries) == 4 * 3 and {e["shape"] for e in entries} == {"olmoe-1b-7b", "qwen3-30b-a3b"}
    assert settings.get().kept_configs is True  # restored


def test_a_failed_step_keeps_what_it_timed(fresh):
    steps = [config_sweep.Step(s, "bf16", "triton") for s in config_sweep.shapes("practitioners", ["mixtral-8x7b"])]

    def run(step, device):
        fake_step(step, device)
        raise RuntimeError("CUDA out of memory\nmore")

    lines: list[str] = []
    entries, done = config_sweep.sweep(steps, GPU, 300.0, progress=lines.append, run=run)
    assert done == [] and len(entries) == 3 and "failed (RuntimeError: CUDA out of memory)" in lines[0]


def test_the_written_table_is_used_without_timing(fresh, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kept_configs, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(kept_configs, "device_name", lambda device: DEVICE)
    monkeypatch.setattr(config_sweep, "_device_ready", lambda device: True)
    monkeypatch.setattr(config_sweep, "run_step", fake_step)
    argv = ["--device", "cuda", "--shape-names", "qwen3-30b-a3b", "gpt-oss-20b", "--engines", "triton", "triton_tma"]
    with settings.override(triton_configs="cuda"):
        assert config_sweep.main(argv) == 0
    out = capsys.readouterr().out
    path = tmp_path / "nvidia-test-gpu.json"
    assert f"wrote 12 timed keys to {path} (4 of 4 steps)" in out
    data = kept_configs.read(path)
    assert data["device"] == DEVICE and data["complete"] is True and data["torch"] == torch.__version__
    assert data["command"] == "python -m fastmoe_xpu.tools.config_sweep " + " ".join(argv)
    assert len(data["entries"]) == 12
    entry = next(e for e in data["entries"] if e["kernel"] == "tma_gate_up_fwd" and e["shape"] == "gpt-oss-20b")
    cands = configs.configs("cuda", "tma_gate_up_fwd")
    assert entry["config"] == kept_configs.config_id(cands[-1]) and entry["dtype"] == "bfloat16"
    assert set(entry["seconds"]) == {kept_configs.config_id(c) for c in cands}
    assert (entry["n"], entry["k"], entry["rows_bucket"]) == (2880, 2880, 4096)  # 32768*4 rows over 32 experts

    # a new process: the kept entry, no timing
    autotune.forget()
    kept_configs.forget()

    def launch(cfg):
        pytest.fail("timed although the kept table has the key")

    got = autotune.choose("tma_gate_up_fwd", "cuda", 2880, 2880, 32768 * 4, 32, GPU, launch, dtype=torch.bfloat16)
    assert got == cands[-1]

    # a later sweep of one shape keeps the other shape's entries
    autotune.forget()
    with settings.override(triton_configs="cuda"):
        assert config_sweep.main(["--device", "cuda", "--shape-names", "gpt-oss-20b", "--engines", "triton"]) == 0
    assert "wrote 3 timed keys and kept 9 of the earlier sweep" in capsys.readouterr().out
    assert len(kept_configs.read(path)["entries"]) == 12


def test_a_table_of_another_device_or_triton_is_replaced(tmp_path):
    path = tmp_path / "t.json"
    old = [{"kernel": "gate_up_fwd", "table": "cuda", "dtype": "bfloat16", "n": 1, "k": 1, "rows_bucket": 1,
            "config": "x", "seconds": {}}]
    new = [dict(old[0], n=2)]
    kept_configs.write(path, kept_configs.document(DEVICE, old))
    doc, kept = config_sweep.merged(path, DEVICE, new)
    assert kept == 1 and len(doc["entries"]) == 2
    doc, kept = config_sweep.merged(path, DEVICE + " 2", new)
    assert kept == 0 and len(doc["entries"]) == 1
    stale = json.loads(path.read_text())
    stale["triton"] = "0.0"
    path.write_text(json.dumps(stale))
    doc, kept = config_sweep.merged(path, DEVICE, new)
    assert kept == 0 and len(doc["entries"]) == 1


def test_a_step_runs_the_triton_layer_forward_and_backward(launched):
    """The real step at a toy shape (fp32 under the interpreter, where nothing is timed): the layer
    builds and runs with the engine and the local experts the sweep asks for."""
    from fastmoe_xpu.kernels import registry

    if not registry.triton_interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (this run compiles for a GPU)")
    shape = config_sweep.Shape("toy", tokens=12, hidden=16, intermediate=8, experts=6, top_k=2, local_experts=3)
    config_sweep.run_step(config_sweep.Step(shape, "fp32", "triton"), torch.device("cpu"))
    assert {"_gate_up_fwd_kernel", "_grouped_mm_fwd_kernel", "_grouped_mm_bwd_kernel"} <= set(launched)

"""The kept Triton config tables (kernels/kept_configs.py) and their place in autotune.choose: a kept
entry for this very device is used without timing; another device, a config no longer in the list or
FASTMOE_KEPT_CONFIGS=0 time the list as before; dtype is part of the key; the file round-trips."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu import settings  # noqa: E402
from fastmoe_xpu.kernels import configs, kept_configs  # noqa: E402
from fastmoe_xpu.kernels.triton import autotune  # noqa: E402

DEVICE = "NVIDIA Test GPU 80GB"
GPU = torch.device("cuda")  # never touched: the launch, the timer and the device name are fakes


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A kept-table directory of this test, the fake GPU named DEVICE, fresh choices."""
    monkeypatch.setattr(kept_configs, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(kept_configs, "device_name", lambda device: DEVICE)
    kept_configs.forget()
    autotune.forget()
    yield tmp_path
    kept_configs.forget()
    autotune.forget()


def _fake(seconds: dict[str, float]):
    launched: list[str] = []

    def launch(cfg):
        launched.append(cfg.name)

    def timer(run):
        run()
        return seconds[launched[-1]]

    return launch, timer, launched


def _table(directory, device: str, entries: list[dict]) -> None:
    kept_configs.write(kept_configs.path_for(DEVICE, directory), kept_configs.document(device, entries))


def _entry(cfg: configs.KernelConfig, dtype: str = "bfloat16", **over) -> dict:
    # N=1024, K=2048, 2048 rows over 8 experts: bucket 256
    return {"kernel": "gate_up_fwd", "table": "cuda", "dtype": dtype, "n": 1024, "k": 2048, "rows_bucket": 256,
            "config": kept_configs.config_id(cfg), "seconds": {}, **over}


def _pick(launch, timer, dtype=torch.bfloat16, rows=2048):
    return autotune.choose("gate_up_fwd", "cuda", 1024, 2048, rows, 8, GPU, launch, timer, dtype=dtype)


def test_a_kept_entry_is_used_without_timing(kept):
    cands = configs.configs("cuda", "gate_up_fwd")
    _table(kept, DEVICE, [_entry(cands[1])])
    launch, timer, launched = _fake({cands[0].name: 1.0, cands[1].name: 2.0})
    assert _pick(launch, timer) == cands[1] and launched == []
    assert autotune.timings() == {}  # nothing timed, so nothing for a sweep to write
    # another key of the same device (another bucket) is timed
    assert _pick(launch, timer, rows=4096) == cands[0] and len(launched) == len(cands)


def test_dtype_is_part_of_the_key(kept):
    cands = configs.configs("cuda", "gate_up_fwd")
    _table(kept, DEVICE, [_entry(cands[1], dtype="bfloat16")])
    launch, timer, launched = _fake({cands[0].name: 1.0, cands[1].name: 2.0})
    assert _pick(launch, timer, dtype=torch.bfloat16) == cands[1] and launched == []
    assert _pick(launch, timer, dtype=torch.float16) == cands[0] and len(launched) == len(cands)
    keys = set(autotune.chosen())
    assert {k[2] for k in keys} == {"bfloat16", "float16"} and len(keys) == 2


@pytest.mark.parametrize("case", ["other device", "config gone", "switched off"])
def test_the_list_is_timed_when_the_entry_does_not_apply(kept, case):
    cands = configs.configs("cuda", "gate_up_fwd")
    entry = _entry(cands[1])
    if case == "config gone":
        entry["config"] = "m256n256k256/w1s1"
    # a file of this device's slug that names another device (a renamed SKU) is not this device's
    _table(kept, DEVICE + " (other)" if case == "other device" else DEVICE, [entry])
    launch, timer, launched = _fake({cands[0].name: 1.0, cands[1].name: 2.0})
    with settings.override(kept_configs=case != "switched off"):
        assert _pick(launch, timer) == cands[0]
    assert len(launched) == len(cands)


def test_timings_hold_every_candidates_seconds(kept):
    cands = configs.configs("cuda", "grouped_mm_fwd")
    seconds = {c.name: 1.0 + i for i, c in enumerate(cands)}
    seconds[cands[-1].name] = 0.5
    launch, timer, _ = _fake(seconds)
    autotune.choose("grouped_mm_fwd", "cuda", 512, 256, 1000, 4, GPU, launch, timer, dtype=torch.float32)
    ((key, (winner, measured)),) = autotune.timings().items()
    assert key == ("grouped_mm_fwd", "cuda", "float32", 512, 256, 256)
    assert winner == kept_configs.config_id(cands[-1])
    assert measured == {kept_configs.config_id(c): seconds[c.name] for c in cands}


def test_a_config_that_fails_is_kept_as_none():
    cands = configs.configs("cuda", "grouped_mm_bwd")
    measured: dict = {}

    def launch(cfg):
        if cfg is cands[0]:
            raise RuntimeError("out of resource: shared memory")

    autotune.select(cands, launch, lambda run: (run(), 1.0)[1], measured)
    assert measured[kept_configs.config_id(cands[0])] is None
    assert all(measured[kept_configs.config_id(c)] == 1.0 for c in cands[1:])


def test_the_file_round_trips(tmp_path):
    cands = configs.configs("cuda", "gate_up_fwd")
    entries = [_entry(cands[0], n=4096, seconds={kept_configs.config_id(cands[0]): 1e-4}), _entry(cands[1])]
    path = tmp_path / "t.json"
    kept_configs.write(path, kept_configs.document(DEVICE, entries, command="x"))
    data = kept_configs.read(path)
    assert data["device"] == DEVICE and data["torch"] == torch.__version__ and data["command"] == "x"
    assert data["triton"] and len(data["date"]) == 10
    assert sorted(map(kept_configs.entry_key, data["entries"])) == sorted(map(kept_configs.entry_key, entries))
    assert data["entries"][0]["n"] == 1024  # entries sorted by key
    path.write_text(json.dumps({"format": 99, "entries": []}))
    with pytest.raises(ValueError, match="not a kept config table"):
        kept_configs.read(path)


def test_names_and_slugs():
    assert kept_configs.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert kept_configs.slug("Intel(R) Data Center GPU Max 1550") == "intel-r-data-center-gpu-max-1550"
    assert kept_configs.dtype_name(torch.bfloat16) == "bfloat16" and kept_configs.dtype_name(None) == ""
    assert kept_configs.device_name(torch.device("cpu")) is None


@pytest.mark.parametrize("table", configs.TABLES)
def test_config_ids_are_unique_within_each_list(table):
    for kernel in configs.KERNELS:
        try:
            cands = configs.configs(table, kernel)
        except ValueError:
            continue
        ids = [kept_configs.config_id(c) for c in cands]
        assert len(set(ids)) == len(ids), (table, kernel, ids)


def test_every_kept_table_in_the_package_reads():
    for path in sorted(kept_configs.TUNED_DIR.glob("*.json")):
        data = kept_configs.read(path)
        assert path.name == kept_configs.slug(data["device"]) + ".json", path
        for entry in data["entries"]:
            assert entry["table"] in configs.TABLES and entry["kernel"] in configs.KERNELS, entry

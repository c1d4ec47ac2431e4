"""Hugging Face export, held-out evaluation, generation and MoE health: the exported
directory loads in a process that cannot import fastmoe_xpu and reproduces the trainer's logits;
the validation loss is the same on every layout and equals plain transformers' on the export."""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallel_util import run_workers
from trainer_util import data_cache, one_thread  # noqa: F401 (fixtures)
from trainer_util import small_cfg as _small_cfg
from trainer.data.build import build_dataset, instance_hash, memory_source
from trainer.data.loader import load_manifest
from trainer.outputs.evaluate import load_validation
from trainer.outputs.export import ExportError, export_hf
from trainer.trainer import Trainer

PYTHON = sys.executable
PROMPT_IDS = [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110]  # "The quick brown"


def small_cfg(data_cache: str, out: str, preset: str = "tiny-moe", **over):
    over.setdefault("eval__instances", 48)
    over.setdefault("eval__micro_batch", 4)
    return _small_cfg(data_cache, out, preset, steps=3, **over)


# a child that refuses to import the project: what it does, plain transformers does
_CLEAN = textwrap.dedent("""
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("fastmoe_xpu", "trainer", "fastmoe_trainer", "fastmoe_bench", "bench"):
                raise ImportError("the exported model must load without " + name)
    sys.meta_path.insert(0, Block())
    import numpy as np, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, ids_path, out_path = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.load(ids_path))
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    np.save(out_path, logits.numpy())
    print(json.dumps({"class": type(model).__name__, "tok": tok("The quick brown")["input_ids"],
                      "generated": gen.shape[1], "project": [m for m in sys.modules if m.startswith("fastmoe")]}))
""")


def _clean_logits(model_dir: str, ids: torch.Tensor, tmp) -> tuple[np.ndarray, dict]:
    ids_path, out_path = str(tmp / "ids.npy"), str(tmp / "logits.npy")
    np.save(ids_path, ids.numpy())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["OMP_NUM_THREADS"] = "1"
    # -I: no script directory, no PYTHONPATH, no user site on sys.path
    proc = subprocess.run([PYTHON, "-I", "-c", _CLEAN, model_dir, ids_path, out_path], capture_output=True,
                          text=True, timeout=240, cwd=str(tmp), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out_path), json.loads(proc.stdout.strip().splitlines()[-1])


def _trainer_logits(t: Trainer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.model.lm_head(t.model.model(input_ids=ids, use_cache=False).last_hidden_state)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_export_loads_without_the_project_and_matches_the_trainer(data_cache, tmp_path, preset):
    out = tmp_path / "run"
    t = Trainer(small_cfg(data_cache, str(out), preset, eval__export_hf=str(tmp_path / "hf"), eval__samples=False))
    hist = t.fit()
    assert "val_loss" in hist[-1] and hist[-1]["val_tokens"] == 48 * 16
    ids = torch.tensor([PROMPT_IDS, PROMPT_IDS[::-1]])
    ref = _trainer_logits(t, ids)
    logits, info = _clean_logits(str(tmp_path / "hf"), ids, tmp_path)
    assert info["class"] == ("OlmoeForCausalLM" if preset == "tiny-moe" else "OlmoForCausalLM")
    assert info["tok"] == PROMPT_IDS  # the byte-level tokenizer through AutoTokenizer
    assert info["generated"] == 11 and info["project"] == []
    torch.testing.assert_close(torch.from_numpy(logits), ref, rtol=1e-5, atol=1e-5)
    # the validation loss equals a direct computation with the exported weights (here, in-process)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    rows = torch.from_numpy(load_validation(load_manifest(t.manifest_path))[:48])
    with torch.no_grad():
        lg = hf(rows[:, :-1]).logits
    direct = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).double(), rows[:, 1:].reshape(-1), reduction="mean")
    assert hist[-1]["val_loss"] == pytest.approx(float(direct), rel=1e-5)
    # import back: --init-from the directory gives the exported weights
    t2 = Trainer(small_cfg(data_cache, str(tmp_path / "again"), preset, model__init_from=str(tmp_path / "hf")))
    torch.testing.assert_close(_trainer_logits(t2, ids), ref, rtol=0, atol=0)


def test_export_refuses_existing_output_and_names_corrupt_files(data_cache, tmp_path):
    t = Trainer(small_cfg(data_cache, str(tmp_path / "run"), checkpoint__interval=3, eval__enabled=False))
    t.fit()
    root = tmp_path / "run" / "checkpoints"
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match="exists; pass --overwrite"):
        export_hf(root, tmp_path / "taken")
    res = export_hf(root, tmp_path / "taken", overwrite=True)
    assert (tmp_path / "taken" / "model.safetensors").is_file() and res.step == 3
    # a small shard limit splits the weights with an index
    res = export_hf(root, tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and res.peak_bytes <= 200_000 + 258 * 64 * 4
    # a flipped byte in a data file: the error names that file
    slot = root / "slot-A"
    data = sorted(slot.glob("__*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match=data.name):
        export_hf(slot, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    # a partial checkpoint (no manifest: the write never finished)
    (slot / "MANIFEST.json").unlink()
    with pytest.raises(ExportError, match="MANIFEST.json is missing"):
        export_hf(slot, tmp_path / "bad")
    with pytest.raises(ExportError, match="no valid checkpoint"):
        export_hf(root, tmp_path / "bad")


def test_validation_split_never_overlaps_training_by_content(tmp_path):
    # repeated documents make identical instances: the copies of held-out ones leave training
    docs = ["abcdefgh" * 8] * 40 + [f"document {i} " * 5 for i in range(60)]
    path = build_dataset([memory_source("<t>", docs)], str(tmp_path / "d"), 8, valid=0.1, progress=False)
    m = load_manifest(path)
    rows = load_validation(m)
    assert m["valid"]["instances"] == rows.shape[0] == round(0.1 * (m["num_instances"] + rows.shape[0]
                                                                     + m["valid"]["train_instances_dropped_as_duplicates"]))
    assert m["valid"]["train_instances_dropped_as_duplicates"] > 0
    held = {instance_hash(r) for r in rows}
    for s in m["shards"]:
        train = np.load(tmp_path / "d" / s["file"])
        assert not held & {instance_hash(r) for r in train}
    with pytest.raises(ValueError, match="leaving none"):
        build_dataset([memory_source("<t>", docs)], str(tmp_path / "e"), 8, valid=10_000, progress=False)


def test_moe_health_charts_and_generation(data_cache, tmp_path):
    from trainer.outputs.generate import generate_samples
    from trainer.records.moe_health import plot_moe

    cfg = small_cfg(data_cache, str(tmp_path / "run"), eval__export_hf=str(tmp_path / "hf"), eval__sample_tokens=8)
    cfg.logging.plot = True
    t = Trainer(cfg)
    hist = t.fit()
    E, L = cfg.model.num_experts, cfg.model.num_layers
    for r in hist:
        assert len(r["moe_tokens_per_expert"]) == L and all(len(c) == E for c in r["moe_tokens_per_expert"])
        # 8 instances x 16 tokens x 4 micro-batches... every token reaches K experts in every layer
        assert [sum(c) for c in r["moe_tokens_per_expert"]] == [8 * 16 * cfg.model.top_k] * L
        assert r["moe_dropped_frac"] == [0.0] * L
        assert all(0 < h <= math.log(E) + 1e-6 for h in r["moe_router_entropy"])
        # the layer mean of the per-layer counts is the step's tokens_per_expert
        assert np.allclose(np.mean(r["moe_tokens_per_expert"], axis=0), r["tokens_per_expert"])
        assert np.mean(r["moe_z_loss"]) == pytest.approx(r["z_loss"], rel=1e-4)
    for name in ("moe_load.png", "moe_imbalance.png", "loss.png", "samples.json"):
        assert (tmp_path / "run" / name).stat().st_size > 0, name
    mats = plot_moe(hist, str(tmp_path / "h.png"), str(tmp_path / "i.png"))["load"]
    assert len(mats) == L and all(m.shape == (E, len(hist)) for m in mats)
    a = generate_samples(str(tmp_path / "hf"), ["The "], seed=3, max_new_tokens=8)
    b = generate_samples(str(tmp_path / "hf"), ["The "], seed=3, max_new_tokens=8)
    assert a == b and [s["mode"] for s in a] == ["greedy", "sampled"]


def _layout_worker(data_cache: str, out: str, over: dict) -> dict:
    t = Trainer(small_cfg(data_cache, out, "tiny-moe", **over))
    rec = t.evaluate()
    return {"val_loss": rec["val_loss"], "val_tokens": rec["val_tokens"]}


@pytest.mark.distributed
def test_validation_loss_is_the_same_on_every_layout(data_cache, tmp_path):
    ref = Trainer(small_cfg(data_cache, str(tmp_path / "one"))).evaluate()
    dpep = run_workers(_layout_worker, 4, data_cache, str(tmp_path / "dpep"), {"parallel__ep": 2})
    pp = run_workers(_layout_worker, 2, data_cache, str(tmp_path / "pp"), {"parallel__pp": 2})
    for r in dpep + pp:
        assert r["val_tokens"] == ref["val_tokens"] == 48 * 16
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)
    assert len({r["val_loss"] for r in dpep}) == 1 and len({r["val_loss"] for r in pp}) == 1


def _export_worker(data_cache: str, out: str, over: dict) -> int:
    t = Trainer(small_cfg(data_cache, out, "tiny-moe", eval__enabled=False, eval__samples=False, **over))
    t.fit()
    return t.step


@pytest.mark.distributed
@pytest.mark.parametrize("over,world", [({"parallel__ep": 2}, 4), ({"parallel__pp": 2}, 2)])
def test_export_gathers_expert_and_pipeline_checkpoints(data_cache, tmp_path, over, world):
    from trainer.checkpoint.restore import load_model
    from trainer.checkpoint.slots import model_checkpoints
    from transformers import AutoModelForCausalLM

    run_workers(_export_worker, world, data_cache, str(tmp_path / "run"),
                {**over, "eval__export_hf": str(tmp_path / "hf")})
    ckpt = model_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    # the same checkpoint read back by the trainer's own loader in one process
    one = Trainer(small_cfg(data_cache, str(tmp_path / "one"), eval__enabled=False))
    load_model(ckpt, one.model)
    ids = torch.tensor([PROMPT_IDS])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, _trainer_logits(one, ids), rtol=1e-5, atol=1e-5)


def test_existing_export_directory_is_refused_before_training(data_cache, tmp_path):
    from trainer.config import ConfigError

    (tmp_path / "hf").mkdir()
    with pytest.raises(ConfigError, match="exists; pass --eval.overwrite"):
        Trainer(small_cfg(data_cache, str(tmp_path / "run"), eval__export_hf=str(tmp_path / "hf")))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_int8_evaluation_quantizes_each_expert_weight_once_and_follows_the_updates(data_cache, tmp_path,
                                                                                  monkeypatch):
    """With int8 experts an evaluation quantizes each expert weight once for all its batches (inside
    fastmoe_xpu.frozen_expert_weights), gives exactly the loss of quantizing them per batch, and after
    training steps quantizes the new weights: no codes outlive the evaluation."""
    import fastmoe_xpu
    from fastmoe_xpu.kernels.quantized import core
    from quantized_util import count_weight_codes

    made = count_weight_codes(monkeypatch)
    t = Trainer(small_cfg(str(data_cache), str(tmp_path / "run"), model__expert_precision="int8"))
    weights = [p for n, p in t.model.named_parameters() if ".experts." in n]
    assert len(weights) >= 4

    def evaluate():
        made.clear()
        return t.evaluate()["val_loss"]
    first = evaluate()
    first_codes = list(made)
    batches = 48 // 4
    assert len(first_codes) == len(weights) and made.calls == len(weights) * batches, (len(made), made.calls)
    assert not core._WEIGHTS  # forgotten once the evaluation is over
    with monkeypatch.context() as m:  # the same evaluation, every batch quantizing anew
        m.setattr(fastmoe_xpu, "frozen_expert_weights", contextlib.nullcontext)
        assert evaluate() == first and len(made) == len(weights) * batches
    t.fit(steps=1)
    after = evaluate()
    assert after != first and len(made) == len(weights) and not any(a is b for a in made for b in first_codes)
    with monkeypatch.context() as m:
        m.setattr(fastmoe_xpu, "frozen_expert_weights", contextlib.nullcontext)
        assert evaluate() == after

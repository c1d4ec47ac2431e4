"""``--parallel.dp_shard fsdp`` (FSDP2 on the non-expert weights) as a layout like the others: the
end-of-run evaluation, checkpoints in the two-slot scheme (each rank writes its own shard of every
FSDP weight and of its optimizer states through DCP), the stop checkpoint, exact resume, resume on
another layout with the optimizer state carried, export, and the options it refuses.

Real gloo processes, fp32. Qwen3-MoE at tiny-qwen3-moe's sizes (the family the trainer's default
FSDP2 command trains), a few steps each."""
from __future__ import annotations

import signal

import pytest
import torch

from parallel_util import run_workers
from trainer.cli import config_from_args
from trainer.config import ConfigError, validate
from trainer.trainer import Trainer
from trainer_util import RTOL, data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

#: exact resume: the same operations on the same numbers (fp32, gloo)
EXACT = 1e-6


def fsdp_cfg(data_cache: str, out: str, *, steps: int = 4, fsdp: bool = True, family: str = "qwen3_moe", **over):
    """``steps`` steps of tiny-qwen3-moe's sizes on ``family``, lr 1e-3, no validation pass unless asked."""
    over = {"model__hf_family": family, "optim__lr": 1e-3, "parallel__dp_shard": "fsdp" if fsdp else "none",
            "model__ep_dispatch": "alltoall", **over}
    cfg = small_cfg(data_cache, out, "tiny-qwen3-moe", steps=steps, **over)
    cfg.eval.enabled = bool(over.get("eval__enabled", False))
    cfg.eval.moe_health = False
    return cfg


def _losses(hist: list[dict]) -> list[float]:
    return [r["loss"] for r in hist]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("flags,option", [
    (["--preset", "tiny-dense", "--tp", "2"], "--parallel.tp 2"),
    (["--preset", "tiny-qwen3-moe", "--optim.moments_dtype", "bf16"], "--optim.moments_dtype bf16"),
    (["--preset", "tiny-moe", "--lora.rank", "4", "--model.init_from", "x"], "--lora.rank"),
    (["--preset", "tiny-qwen3-moe", "--model.param_dtype", "bf16", "--optim.stochastic_rounding"],
     "--optim.stochastic_rounding"),
])
def test_fsdp_refuses_in_one_line_naming_both_options(flags, option) -> None:
    cfg, _ = config_from_args([*flags, "--parallel.dp_shard", "fsdp"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 2)
    msg = str(e.value)
    assert "\n" not in msg and "--parallel.dp_shard fsdp" in msg and option in msg, msg


# ----------------------------------------------------------------------------- evaluation
def _eval_worker(data_cache: str, out: str, fsdp: bool) -> dict:
    t = Trainer(fsdp_cfg(data_cache, out, steps=2, fsdp=fsdp, parallel__ep=2, eval__enabled=True,
                         eval__instances=24, eval__micro_batch=4))
    hist = t.fit()
    from torch.distributed.tensor import DTensor

    sharded = all(isinstance(p, DTensor) for n, p in t.model.named_parameters() if ".experts." not in n)
    return {"val": hist[-1]["val_loss"], "losses": _losses(hist), "sharded_after": sharded}


def test_fsdp_end_of_run_evaluation_equals_epso(data_cache, tmp_path) -> None:  # noqa: F811
    """The default end-of-run evaluation under FSDP2 (EP 2) gives EPSO's validation loss, and the
    weights are sharded again afterwards (evaluation's forward leaves no gathered copy behind)."""
    epso = run_workers(_eval_worker, 2, data_cache, str(tmp_path / "epso"), False)
    fsdp = run_workers(_eval_worker, 2, data_cache, str(tmp_path / "fsdp"), True)
    for r in fsdp:
        assert r["losses"] == pytest.approx(epso[0]["losses"], rel=RTOL)
        assert r["val"] == pytest.approx(epso[0]["val"], rel=1e-6)
        assert r["sharded_after"]


# ----------------------------------------------------------------------------- stop and resume
def _stop_after(t: Trainer, step: int) -> None:
    """A stop request (as SIGTERM's) raised on the last rank once step ``step`` is done."""
    from trainer.ft.stop import StopRequest

    t.stop = StopRequest()
    inner = t.train_step

    def train_step():
        rec = inner()
        if t.step == step and t.layout.rank == t.layout.world - 1:
            t.stop.signum = signal.SIGTERM
        return rec
    t.train_step = train_step


def _resume_worker(data_cache: str, root: str, ep: int) -> dict:
    from trainer.ft.stop import Stopped

    whole = Trainer(fsdp_cfg(data_cache, f"{root}/whole", parallel__ep=ep)).fit()
    # periodic checkpoints every 2 steps, stopped at 2 and resumed
    a = Trainer(fsdp_cfg(data_cache, f"{root}/periodic", parallel__ep=ep, checkpoint__interval=2))
    first = a.fit(steps=2)
    b = Trainer(fsdp_cfg(data_cache, f"{root}/periodic", parallel__ep=ep, checkpoint__interval=2))
    rest = b.fit()
    # a stop request after step 3 (no periodic checkpoint due): the stop checkpoint, then resume
    c = Trainer(fsdp_cfg(data_cache, f"{root}/stop", parallel__ep=ep, checkpoint__model_interval=2))
    _stop_after(c, 3)
    try:
        c.fit()
        stopped = None
    except Stopped as e:
        stopped = str(e)
    d = Trainer(fsdp_cfg(data_cache, f"{root}/stop", parallel__ep=ep))
    after_stop = d.fit()
    return {"whole": _losses(whole), "periodic": _losses(first) + _losses(rest), "resumed_at": rest[0]["step"],
            "stopped": stopped, "stop": _losses(c.history) + _losses(after_stop),
            "stop_resumed_at": after_stop[0]["step"]}


@pytest.mark.parametrize("ep", [1, 2])
def test_fsdp_stop_and_resume_is_exact(data_cache, tmp_path, ep) -> None:  # noqa: F811
    """FSDP2 at world 2 (DP 2, or DP 1 x EP 2): a run stopped at a periodic checkpoint, or by a stop
    request between checkpoints (the stop checkpoint), and started again with the same config
    continues exactly as the uninterrupted run (losses to 1e-6); a model-only checkpoint is kept."""
    results = run_workers(_resume_worker, 2, data_cache, str(tmp_path), ep)
    for r in results:
        assert r["resumed_at"] == 3 and r["stop_resumed_at"] == 4
        assert "stopped at step 3 (SIGTERM)" in r["stopped"] and "slot-A" in r["stopped"]
        assert r["periodic"] == pytest.approx(r["whole"], rel=EXACT)
        assert r["stop"] == pytest.approx(r["whole"], rel=EXACT)
    assert (tmp_path / "stop" / "checkpoints" / "model-step-00000002" / "MANIFEST.json").is_file()


def test_fsdp_checkpoint_holds_every_rank_shard(data_cache, tmp_path) -> None:  # noqa: F811
    """The FSDP weights and their states are written by both ranks (each its own shard, DCP's
    index keeps the pieces), under the plain keys every layout reads; the manifest lists every file."""
    import json

    from trainer.checkpoint.dcp_io import storage_reader
    from trainer.checkpoint.slots import verify

    run_workers(_save_worker, 2, data_cache, str(tmp_path / "fsdp"), {"parallel__ep": 1}, 2)
    slot = tmp_path / "fsdp" / "checkpoints" / "slot-A"
    assert verify(slot) is None
    md = storage_reader(slot).read_metadata()
    files: dict[str, set] = {}
    for idx, info in md.storage_data.items():
        files.setdefault(idx.fqn, set()).add(info.relative_path)
    for key in ("model/model.embed_tokens.weight", "optim/exp_avg/model.embed_tokens.weight",
                "optim/master/lm_head.weight"):
        assert files[key] == {"__0_0.distcp", "__1_0.distcp"}, key
    listed = set(json.loads((slot / "MANIFEST.json").read_text())["files"])
    assert {p.name for p in slot.iterdir()} == listed | {"MANIFEST.json"}


# ----------------------------------------------------------------------------- resume on another layout
def _save_worker(data_cache: str, out: str, over: dict, steps: int) -> None:
    """The 4-step schedule stopped after ``steps`` with a checkpoint there."""
    Trainer(fsdp_cfg(data_cache, out, checkpoint__interval=steps, **over)).fit(steps=steps)


def _resume_from(data_cache: str, out: str, root: str, over: dict) -> list[float]:
    """Losses of the steps after resuming from the checkpoints under ``root`` (writing none there: the
    run's own checkpoint, the one every run keeps at its end, goes under ``out``)."""
    t = Trainer(fsdp_cfg(data_cache, out, checkpoint__resume_from=root, **over))
    hist = t.fit()
    assert t.step == 4 and hist[0]["step"] == 3
    return _losses(hist)


def _cross_worker(data_cache: str, root: str, jobs: list) -> list:
    """Run ``jobs`` in order: ``("save", name, over)`` or ``("resume", name, source, over)``."""
    out = []
    for job in jobs:
        if job[0] == "save":
            _save_worker(data_cache, f"{root}/{job[1]}", job[2], 2)
        else:
            out.append(_resume_from(data_cache, f"{root}/{job[1]}", f"{root}/{job[2]}/checkpoints", job[3]))
    return out


FSDP = {"parallel__dp_shard": "fsdp"}
EPSO = {"parallel__dp_shard": "none", "optim__name": "epso"}


def test_fsdp_resumes_on_another_layout_and_back(data_cache, tmp_path) -> None:  # noqa: F811
    """Checkpoints cross between FSDP2 and the other layouts, the Adam moments and master weights with
    them: FSDP2 DP 2 x EP 2 (world 4) -> one process, ZeRO-1 DP 2 and FSDP2 DP 1 x EP 2; one process
    -> FSDP2 DP 2 and DP 2 x EP 2; FSDP2 DP 1 x EP 2 -> EPSO DP 2 x EP 2. Every continuation equals the
    uninterrupted one-process run (1e-5): moments started afresh would move step 3 by ~lr."""
    root = str(tmp_path)
    ref = _losses(Trainer(validate(fsdp_cfg(data_cache, f"{root}/ref", **EPSO), 1)).fit())
    _save_worker(data_cache, f"{root}/one", EPSO, 2)
    run_workers(_cross_worker, 4, data_cache, root, [("save", "fsdp4", {**FSDP, "parallel__ep": 2})])
    got = {"fsdp4 -> one": [_resume_from(data_cache, f"{root}/r1", f"{root}/fsdp4/checkpoints", EPSO)]}
    two = run_workers(_cross_worker, 2, data_cache, root, [
        ("resume", "r2", "fsdp4", {"parallel__dp_shard": "none", "optim__name": "sharded"}),
        ("resume", "r3", "fsdp4", {**FSDP, "parallel__ep": 2}),
        ("resume", "r4", "one", FSDP),
        ("save", "fsdp2", {**FSDP, "parallel__ep": 2})])
    got.update({"fsdp4 -> zero1 dp2": [r[0] for r in two], "fsdp4 -> fsdp ep2": [r[1] for r in two],
                "one -> fsdp dp2": [r[2] for r in two]})
    four = run_workers(_cross_worker, 4, data_cache, root, [
        ("resume", "r5", "fsdp2", {**EPSO, "parallel__ep": 2}),
        ("resume", "r6", "one", {**FSDP, "parallel__ep": 2})])
    got.update({"fsdp ep2 -> epso dp2 x ep2": [r[0] for r in four], "one -> fsdp dp2 x ep2": [r[1] for r in four]})
    for label, runs in got.items():
        for losses in runs:
            assert losses == pytest.approx(ref[2:], rel=RTOL), label


# ----------------------------------------------------------------------------- export and samples
#: Plain transformers in an isolated interpreter (-I; the project's modules refused): the validation
#: loss of each exported directory on the given rows, as the trainer computes it (summed CE / tokens).
_PLAIN_VAL = r"""
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastmoe_xpu", "trainer", "fastmoe_trainer"):
            raise ImportError("the export must load without " + name)
sys.meta_path.insert(0, Block())
import numpy as np, torch
from transformers import AutoModelForCausalLM
jobs = json.loads(sys.argv[1])
rows = torch.from_numpy(np.load(jobs["rows"]))
out = {}
for d in jobs["dirs"]:
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                           reduction="sum")
    out[d] = float(ce.double()) / rows[:, 1:].numel()
print(json.dumps(out))
"""


def _export_worker(data_cache: str, out: str) -> dict:
    t = Trainer(fsdp_cfg(data_cache, out, steps=2, parallel__ep=2, eval__enabled=True, eval__instances=24,
                         eval__micro_batch=4, eval__export_hf=f"{out}/hf", eval__samples=True,
                         eval__sample_tokens=4))
    hist = t.fit()
    return {"val": hist[-1]["val_loss"], "manifest": t.manifest_path, "samples": t.artefacts.get("samples")}


def test_fsdp_export_and_samples_reload_without_the_package(data_cache, tmp_path) -> None:  # noqa: F811
    """``--eval.export_hf`` under FSDP2 (DP 1 x EP 2) and ``python -m trainer.outputs.export`` on its model-only
    checkpoint: both directories load with transformers alone and give the trainer's validation loss;
    the generated samples are written."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    from trainer.data.loader import load_manifest
    from trainer.outputs.evaluate import load_validation
    from trainer.outputs.export import main as export_main

    out = tmp_path / "run"
    r = run_workers(_export_worker, 2, data_cache, str(out))[0]
    samples = json.loads(open(r["samples"]).read())
    assert len(samples) == 8 and all(s["text"] for s in samples)
    assert export_main(["--checkpoint", str(out / "checkpoints"), "--out", str(tmp_path / "cli"),
                        "--no-progress"]) == 0
    rows = load_validation(load_manifest(r["manifest"]))[:24]
    np.save(tmp_path / "rows.npy", rows)
    dirs = [str(out / "hf"), str(tmp_path / "cli")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    job = json.dumps({"dirs": dirs, "rows": str(tmp_path / "rows.npy")})
    proc = subprocess.run([sys.executable, "-I", "-c", _PLAIN_VAL, job],
                          capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for d in dirs:
        assert got[d] == pytest.approx(r["val"], rel=1e-5), d


# ----------------------------------------------------------------------------- pipeline and compile
def _pp_worker(data_cache: str, root: str) -> dict:
    over = dict(parallel__pp=2, eval__enabled=True, eval__instances=16, eval__micro_batch=4)
    a = Trainer(fsdp_cfg(data_cache, f"{root}/pp", checkpoint__interval=2, **over))
    from torch.distributed.tensor import DTensor

    sharded = [isinstance(p, DTensor) for n, p in a.model.named_parameters() if ".experts." not in n]
    first = a.fit(steps=2)
    b = Trainer(fsdp_cfg(data_cache, f"{root}/pp", checkpoint__interval=2, **over))
    rest = b.fit()
    hist = first + rest
    return {"losses": _losses(hist), "grad_norms": [r["grad_norm"] for r in hist], "val": rest[-1]["val_loss"],
            "sharded": all(sharded) and len(sharded) > 0, "stage": b.pipeline.modules[0].stage,
            "resumed_at": rest[0]["step"]}


def test_fsdp_with_pipeline_equals_one_process(data_cache, tmp_path) -> None:  # noqa: F811
    """PP 2 x DP 2 (world 4), each stage fully_shard'ed over its two DP ranks, 1F1B: losses, gradient
    norms and the validation loss equal one process (1e-5); stopped at step 2 and resumed on the same
    layout, and the pipeline's checkpoint resumes in one process."""
    ref = Trainer(validate(fsdp_cfg(data_cache, str(tmp_path / "one"), fsdp=False, eval__enabled=True,
                                    eval__instances=16, eval__micro_batch=4), 1))
    hist = ref.fit()
    results = run_workers(_pp_worker, 4, data_cache, str(tmp_path))
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]
    for r in results:
        assert r["sharded"] and r["resumed_at"] == 3
        assert r["losses"] == pytest.approx(_losses(hist), rel=RTOL)
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in hist], rel=RTOL)
        assert r["val"] == pytest.approx(hist[-1]["val_loss"], rel=RTOL)
    # the pipeline's checkpoint of step 4 (both stages' shards) continues in one process
    one = Trainer(validate(fsdp_cfg(data_cache, str(tmp_path / "again"), fsdp=False, eval__enabled=True,
                                    eval__instances=16, eval__micro_batch=4,
                                    checkpoint__dir=str(tmp_path / "pp" / "checkpoints")), 1))
    one.resume()
    assert one.step == 4
    assert one.evaluate()["val_loss"] == pytest.approx(hist[-1]["val_loss"], rel=RTOL)


def _olmoe_cfg(data_cache: str, out: str, **over):
    cfg = small_cfg(data_cache, out, "tiny-moe", steps=3, optim__lr=1e-3, **over)
    cfg.eval.enabled = cfg.eval.moe_health = False
    return cfg


def _compile_worker(data_cache: str, out: str) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    t = Trainer(_olmoe_cfg(data_cache, out, parallel__dp_shard="fsdp", model__compile=True,
                           model__compile_backend="aot_eager"))
    hist = t.fit()
    return {"losses": _losses(hist), "grad_norms": [r["grad_norm"] for r in hist],
            "compile_s": [r["compile_s"] for r in hist], "fsdp": t.fsdp,
            "state_bytes": (t.optimizer.state_bytes(), t.state_bytes_formula())}


def test_fsdp_with_compile_equals_one_process(data_cache, tmp_path) -> None:  # noqa: F811
    """``--model.compile`` (aot_eager) on the OLMoE model (FastSparseMoeBlock) under FSDP2 at DP 2: each
    decoder layer's forward is compiled, FSDP2's gathers run around it; losses and gradient norms
    equal the eager one-process run (1e-5), compiled on the first step only."""
    ref = Trainer(validate(_olmoe_cfg(data_cache, str(tmp_path / "one")), 1)).fit()
    for r in run_workers(_compile_worker, 2, data_cache, str(tmp_path / "fsdp")):
        assert r["fsdp"]
        assert r["losses"] == pytest.approx(_losses(ref), rel=RTOL)
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in ref], rel=RTOL)
        assert r["compile_s"][0] > 0 and r["compile_s"][1:] == [0.0, 0.0]
        assert r["state_bytes"][0] == r["state_bytes"][1]  # run.json's formula for FSDP2's shards


def _init_from_worker(data_cache: str, out: str, path: str) -> list[float]:
    return _losses(Trainer(fsdp_cfg(data_cache, out, steps=2, parallel__ep=2, model__init_from=path)).fit())


def test_fsdp_starts_from_init_from_weights(data_cache, tmp_path) -> None:  # noqa: F811
    """``--model.init_from`` under FSDP2 x EP 2: rank 0 reads the file and every rank receives its part
    before the weights are sharded; the run equals one process started from the same file."""
    other = Trainer(validate(fsdp_cfg(data_cache, str(tmp_path / "seed5"), fsdp=False, steps=1), 1))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = str(tmp_path / "init.pt")
    torch.save(other.model.state_dict(), path)
    ref = _losses(Trainer(validate(fsdp_cfg(data_cache, str(tmp_path / "one"), fsdp=False, steps=2,
                                            model__init_from=path), 1)).fit())
    plain = _losses(Trainer(validate(fsdp_cfg(data_cache, str(tmp_path / "plain"), fsdp=False, steps=2), 1)).fit())
    assert ref[0] != pytest.approx(plain[0], rel=1e-4)  # the file's weights are not the seed's
    for r in run_workers(_init_from_worker, 2, data_cache, str(tmp_path / "fsdp"), path):
        assert r == pytest.approx(ref, rel=RTOL)


def _olmoe_worker(data_cache: str, out: str) -> dict:
    t = Trainer(_olmoe_cfg(data_cache, out, parallel__dp_shard="fsdp", parallel__ep=2))
    hist = t.fit()
    from torch.distributed.tensor import DTensor

    kinds = {n: isinstance(p, DTensor) for n, p in t.model.named_parameters()}
    return {"losses": _losses(hist), "grad_norms": [r["grad_norm"] for r in hist],
            "loads": [r["tokens_per_expert"] for r in hist], "kinds": kinds}


def test_fsdp_olmoe_block_with_expert_parallelism_equals_one_process(data_cache, tmp_path) -> None:  # noqa: F811
    """The OLMoE model (FastSparseMoeBlock, tiny-moe) under FSDP2 x EP 2 (allgather): the block's
    expert weights stay expert-parallel plain tensors, every other weight is an FSDP2 DTensor; losses,
    gradient norms and expert loads equal one process."""
    ref = Trainer(validate(_olmoe_cfg(data_cache, str(tmp_path / "one")), 1)).fit()
    for r in run_workers(_olmoe_worker, 2, data_cache, str(tmp_path / "fsdp")):
        assert r["losses"] == pytest.approx(_losses(ref), rel=RTOL)
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in ref], rel=RTOL)
        assert r["loads"] == [h["tokens_per_expert"] for h in ref]  # counts: exact
        experts = {n for n in r["kinds"] if ".experts." in n}
        assert experts and not any(r["kinds"][n] for n in experts)
        assert all(v for n, v in r["kinds"].items() if n not in experts)


# ----------------------------------------------------------------------------- HSDP
def _hsdp_worker(data_cache: str, root: str) -> dict:
    t = Trainer(fsdp_cfg(data_cache, f"{root}/hsdp", parallel__fsdp_shard=2, checkpoint__interval=2))
    mesh = next(p for n, p in t.model.named_parameters() if ".experts." not in n).device_mesh
    hist = t.fit(steps=2)
    return {"losses": _losses(hist), "grad_norms": [r["grad_norm"] for r in hist],
            "mesh": (mesh.mesh_dim_names, tuple(mesh.mesh.shape)), "state_bytes": t.optimizer.state_bytes()}


def test_hsdp_shards_within_pairs_and_equals_one_process(data_cache, tmp_path) -> None:  # noqa: F811
    """``--parallel.fsdp_shard 2`` at DP 4 (world 4): a 2-D mesh, weights sharded within pairs of ranks
    and replicated across the two pairs; losses and gradient norms (counted once per replica) equal
    one process, and its checkpoint resumes in one process."""
    ref = Trainer(validate(fsdp_cfg(data_cache, str(tmp_path / "one"), fsdp=False), 1)).fit()
    results = run_workers(_hsdp_worker, 4, data_cache, str(tmp_path))
    for r in results:
        assert r["mesh"] == (("replicate", "shard"), (2, 2))
        assert r["losses"] == pytest.approx(_losses(ref)[:2], rel=RTOL)
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in ref][:2], rel=RTOL)
    rest = _resume_from(data_cache, str(tmp_path / "again"), str(tmp_path / "hsdp" / "checkpoints"), EPSO)
    assert rest == pytest.approx(_losses(ref)[2:], rel=RTOL)


def test_hsdp_shard_size_is_checked() -> None:
    cfg, _ = config_from_args(["--preset", "tiny-qwen3-moe", "--global-batch", "32", "--parallel.dp_shard", "fsdp",
                               "--parallel.fsdp_shard", "3"])
    with pytest.raises(ConfigError, match="--parallel.fsdp_shard 3 must divide DP x EP = 4 x 1"):
        validate(cfg, 4)
    cfg, _ = config_from_args(["--preset", "tiny-qwen3-moe", "--global-batch", "32", "--parallel.fsdp_shard", "2"])
    with pytest.raises(ConfigError, match="--parallel.fsdp_shard 2 needs --parallel.dp_shard fsdp"):
        validate(cfg, 4)

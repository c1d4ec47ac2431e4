"""The trace of the trainer's step on the fake process group (trainer/scale/trace.py): the collectives
a traced rank records equal those a real gloo run of the same layout records (the same recorder in
both); the world-wide checks pass on sound layouts and fail on a broken one; ``fastmoe-plan`` refuses
bad layouts in one line naming the nearest valid choice, and hands the step-time model's options on."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from parallel_util import run_workers
from trainer_util import one_thread  # noqa: F401 (fixture)
from trainer.scale import command
from trainer.scale.trace import build_config, record_rank, trace_world
from trainer.scale.trace_checks import run_checks

# (preset, world, layout keywords of build_config): every layout the trace covers, at worlds 2 and 4
LAYOUTS_2 = [
    ("tiny-moe", dict(optimizer="sharded")),                        # ZeRO-1 over DP=2
    ("tiny-moe", dict(fsdp=True)),                                  # FSDP2 over DP=2
    ("tiny-moe", dict(pp=2)),                                       # PP=2, 1F1B
    ("tiny-dense", dict(tp=2)),                                     # TP=2
    ("tiny-moe", dict(ep=2, ep_comm="allgather", ac="moe")),        # EP allgather, a checkpointed block
    ("tiny-moe", dict(ep=2, ep_comm="alltoall")),                   # EP all-to-all
]
LAYOUTS_4 = [
    ("tiny-moe", dict(ep=2, optimizer="epso")),                     # EPSO, EP=2 x DP=2
    ("tiny-moe", dict(pp=2, ep=2, ac="norm,attn,moe")),            # PP=2 x EP=2, all checkpointed
]
SMALL = dict(micro_batch=2, global_batch=8, context=16)


def _cfg(preset: str, world: int, kw: dict):
    return build_config(preset, world=world, **SMALL, **kw)


def _comparable(collectives) -> list[tuple]:
    """The step's and the checkpoint planning's records, calls summed (set-up differs: the fake group
    receives no pipeline metadata); an all-to-all's payload sizes depend on the routing, so its calls
    are compared without them."""
    out: dict[tuple, int] = {}
    for c in collectives:
        if c.phase == "setup":
            continue
        elements = None if c.op == "all_to_all" and c.label == "ep tokens" and c.dtype != "int64" else c.elements
        key = (c.phase, c.label, c.op, c.group, c.dtype, elements)
        out[key] = out.get(key, 0) + c.count
    return sorted(out.items(), key=repr)


def _real_worker(layouts: list, world: int) -> list:
    """Every layout's records of this rank, from the real gloo group (one process start for all)."""
    import torch.distributed as dist

    out = []
    for preset, kw in layouts:
        cfg = _cfg(preset, world, kw)
        p = cfg.parallel
        data_rank = (dist.get_rank() // p.tp) % (p.dp * p.ep)
        gen = torch.Generator().manual_seed(1000 + data_rank)
        n = cfg.schedule.global_batch // (p.dp * p.ep * cfg.schedule.micro_batch)
        shape = (cfg.schedule.micro_batch, cfg.data.context)
        batches = [(torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
                    torch.randint(0, cfg.model.vocab_size, shape, generator=gen)) for _ in range(n)]
        out.append(record_rank(cfg, batches))
    return out


@pytest.mark.parametrize("world,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["world2", "world4"])
def test_traced_collectives_equal_a_gloo_run(world, layouts):
    real = run_workers(_real_worker, world, layouts, world, timeout_s=600)
    for i, (preset, kw) in enumerate(layouts):
        cfg = _cfg(preset, world, kw)
        traced = trace_world(cfg, world, list(range(world)))
        for r in range(world):
            got, want = _comparable(traced[r].profile.collectives), _comparable(real[r][i])
            assert got == want, f"{preset} {kw} rank {r}"
            assert any(key[0] == "step" for key, _ in want)
        if kw.get("ep_comm") == "alltoall":  # the routing-dependent payloads: present in both, same calls
            for r in range(world):
                calls = [c for c in traced[r].profile.collectives if c.op == "all_to_all" and c.phase == "step"]
                assert calls and all(c.group == (0, 1) for c in calls)


@pytest.mark.parametrize("preset,world,kw", [
    ("tiny-moe", 4, dict(pp=2, ep=2, ep_comm="alltoall", ac="moe")),
    ("tiny-moe", 4, dict(ep=2, fsdp=True)),
    ("tiny-moe", 4, dict(optimizer="sharded", ep=2)),
    ("tiny-dense", 4, dict(tp=2)),  # TP's replicated weights: their states written by TP rank 0 only
])
def test_world_checks_pass_on_sound_layouts(preset, world, kw):
    cfg = _cfg(preset, world, kw)
    traces = trace_world(cfg, world, [0, world - 1])
    checks = run_checks(cfg, traces)
    assert [c.name for c in checks if not c.ok] == [], "\n".join(c.line() for c in checks)
    assert len(checks) >= 5


def test_world_checks_fail_on_a_broken_shard_layout():
    """A bucket whose shards are one element short leaves elements without an owner; a segment listed
    twice in a bucket is written twice; a wrong group is not the mesh's."""
    cfg = _cfg("tiny-moe", 2, dict(optimizer="sharded"))
    traces = trace_world(cfg, 2, [0, 1])
    for tr in traces.values():
        tr.optimizer[0]["shard_numel"] -= 1
        tr.optimizer[1]["segments"].append(tr.optimizer[1]["segments"][0])
    tr.groups["dp"] = (1, 0)
    checks = {c.name: c for c in run_checks(cfg, traces)}
    owners = checks["every parameter element has exactly one optimizer owner"]
    assert not owners.ok and "by no rank" in owners.detail
    writers = checks["every checkpoint byte has one writer"]
    assert not writers.ok and "twice" in writers.detail
    assert not checks["each group's size and members follow the mesh"].ok


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = command.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv,needle", [
    (["--world", "12100", "--pp", "8", "--ep", "12"], "the nearest valid world is 12096 or 12192"),
    (["--world", "12288", "--pp", "8", "--ep", "7"], "the nearest valid EP is 6 or 8"),
    (["--world", "12288", "--pp", "96", "--ep", "1"], "the largest valid PP is 64"),
    (["--world", "12288", "--pp", "8", "--ep", "12", "--trace", "--ranks", "0,12288"],
     "the nearest valid rank is 12287"),
    (["--world", "384", "--pp", "8", "--ep", "12", "--memory-gib", "16"], "above --memory-gib 16"),
    (["--world", "12288", "--pp", "8", "--ep", "12", "--global-batch", "1000"], "the nearest valid global batch is"),
])
def test_bad_layouts_refused_in_one_line(capsys, argv, needle):
    rc, out, err = _run(capsys, "--preset", "mula-220b-a10b", *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert needle in lines[0], lines[0]


def test_memory_refusal_names_a_layout_that_fits(capsys):
    rc, _, err = _run(capsys, "--preset", "mula-220b-a10b", "--world", "384", "--pp", "8", "--ep", "12",
                      "--memory-gib", "60")
    assert rc == 2
    assert "the nearest that fits is" in err or "no layout" in err


def test_plan_output_unchanged(capsys):
    from trainer.parallelism import plan

    argv = ["--preset", "mula-220b-a10b", "--world", "12288", "--pp", "8", "--ep", "12", "--ac", "norm,attn,moe"]
    assert plan.main(argv) == 0
    want = capsys.readouterr().out
    rc, got, _ = _run(capsys, *argv)
    assert rc == 0 and got == want and got.startswith("Dry run: mula-220b-a10b")


def test_model_options_go_to_the_model_command(capsys, monkeypatch):
    seen = []
    fake = types.ModuleType("trainer.scale.model_cli")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "trainer.scale.model_cli", fake)
    import trainer.scale as scale

    monkeypatch.setattr(scale, "model_cli", fake, raising=False)
    argv = ["--preset", "mula-220b-a10b", "--pp", "8", "--ep", "12", "--cluster", "aurora", "--world", "384", "768"]
    assert command.main(argv) == 0
    assert seen == [argv]


def test_trace_command_prints_ranks_and_checks(capsys):
    rc, out, _ = _run(capsys, "--preset", "tiny-moe", "--world", "4", "--pp", "2", "--ep", "2", "--micro-batch", "2",
                      "--trace", "--ranks", "0,3", "--jobs", "1")
    assert rc == 0, out
    for what in ("rank 0 (pp 0, dp 0, ep 0)", "rank 3 (pp 1, dp 0, ep 1)", "optimizer shard", "checkpoint",
                 "data shard", "collectives", "sends per step"):
        assert what in out
    assert out.count("PASS") == 6 and "FAIL" not in out


def test_meta_experts_shapes_and_gradients():
    """On meta tensors the experts op runs the GEMMs at the average rows, reaching every input."""
    from fastmoe_xpu.autograd.moe_experts import moe_experts_forward

    T, H, I, E, K = 6, 8, 5, 4, 2
    x = torch.empty(T, H, device="meta", requires_grad=True)
    w = torch.empty(T, K, device="meta", requires_grad=True)
    idx = torch.empty(T, K, dtype=torch.int64, device="meta")
    gu = torch.empty(E, 2 * I, H, device="meta", requires_grad=True)
    dn = torch.empty(E, H, I, device="meta", requires_grad=True)
    out = moe_experts_forward(x, w, idx, gu, dn)
    assert out.shape == (T, H) and out.is_meta
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert gu.grad.shape == gu.shape and dn.grad.shape == dn.shape


def test_uniform_rows_per_rank_is_the_expected_remote_rows():
    from fastmoe_xpu.dist.comm_bytes import expected_remote_rows
    from fastmoe_xpu.dist.dispatch import uniform_rows_per_rank

    for S, E, K, W in ((4096, 240, 8, 12), (128, 8, 2, 2), (1000, 64, 6, 8)):
        assert uniform_rows_per_rank(S, K, E, W) == round(expected_remote_rows(S, E, K, W) / (W - 1))
    assert uniform_rows_per_rank(128, 2, 8, 2) == round(128 * (1 - 6 / 28))  # misses: C(4, 2) of C(8, 2) pairs


@pytest.mark.parametrize("preset,world,kw", [("tiny-moe", 4, dict(pp=2, ep=2, ac="moe")), ("tiny-dense", 2, dict(tp=2)),
                                             ("tiny-moe", 2, dict(fsdp=True))])
def test_meta_layout_cache_changes_nothing(preset, world, kw, monkeypatch):
    """The recorder's memo of pure ops' meta outputs gives the same records as running every kernel."""
    from trainer.scale import trace

    cfg = _cfg(preset, world, kw)
    cached = trace_world(cfg, world, [world - 1])[world - 1]
    monkeypatch.setattr(trace.CollectiveRecorder, "_meta_cached", lambda self, func, args, kwargs: None)
    plain = trace_world(cfg, world, [world - 1])[world - 1]
    assert cached.profile.collectives == plain.profile.collectives
    assert cached.profile.compute == plain.profile.compute and cached.profile.compute
    assert cached.profile.memory_bytes == plain.profile.memory_bytes and cached.checkpoint == plain.checkpoint

"""Checkpoints: writer plan, exact restore, dual slots under corruption and crashes, full or
read-only disks, model-only snapshots and --init-from, resuming on a different DP x EP layout."""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import _ft_toy as toy
from trainer.checkpoint import dcp_io as ck_dcp_io
from trainer.checkpoint import save as ck_save
from trainer.checkpoint.dcp_io import storage_reader
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.optim_state import optimizer_steps, sync_master_from_model
from trainer.checkpoint.restore import load_model, restore_full
from trainer.checkpoint.save import save_model
from trainer.checkpoint.slots import CheckpointError, latest_valid, model_checkpoints, read_info, scan, verify
from trainer.checkpoint.writers import (balance, checkpoint_bytes, Coords, coords_of, model_segments,
                                        model_shard_writer, model_writes, Segment, shard_chunks, tp_rank_of,
                                        writer_plan)


# ============================================================================ writer plan (pure)
@pytest.mark.parametrize("pp,dp,ep", [
    (1, 1, 1),      # one process: rank 0 writes everything
    (1, 2, 1),      # plain data parallel: only shard 0 exists
    (1, 64, 8),     # EP inside a node, many nodes: 8 shards on 8 different nodes
    (1, 3, 16),     # more EP shards than DP replicas: writers wrap around the DP ranks
    (4, 128, 8),    # 4096 ranks with pipeline stages
    (2, 1, 4),      # no data parallelism: every shard written by its only holder
    (3, 5, 7),      # prime sizes
])
def test_writer_plan_spreads_shards_over_dp_ranks(pp: int, dp: int, ep: int) -> None:
    plan = writer_plan(pp, dp, ep)
    assert len(plan) == pp * ep
    assert len(set(plan.values())) == pp * ep, "two shards share a writer"
    nodes: dict[tuple[int, int], int] = {}
    for (p, e), r in plan.items():
        c = Coords(rank=r, pp=pp, dp=dp, ep=ep)
        assert (c.pp_rank, c.ep_rank) == (p, e), "the writer must hold the shard it writes"
        assert c.dp_rank == (p * ep + e) % dp
        assert 0 <= r < pp * dp * ep
        nodes[(p, c.dp_rank)] = nodes.get((p, c.dp_rank), 0) + 1
    # a node is (pp_rank, dp_rank): the EP ranks sharing it; no node writes more than its share
    assert max(nodes.values()) == math.ceil(ep / min(dp, ep))
    assert len(nodes) == pp * min(dp, ep)


def test_writer_plan_rejects_out_of_mesh_shards() -> None:
    with pytest.raises(ValueError, match="outside"):
        model_shard_writer(0, 4, pp=1, dp=2, ep=4)


@pytest.mark.parametrize("sizes,bins", [
    ([5, 5, 5, 5], 2),          # equal items split evenly
    ([100, 1, 1, 1, 1], 3),     # one dominant item alone in its bin
    ([], 4),                    # nothing to place
    ([7], 1),                   # a single bin
    (list(range(1, 50)), 8),    # many items
])
def test_balance_is_within_one_item_of_perfect(sizes: list[int], bins: int) -> None:
    out = balance(sizes, bins)
    assert out == balance(sizes, bins), "must be deterministic (every rank computes it)"
    loads = [sum(s for s, b in zip(sizes, out) if b == k) for k in range(bins)]
    assert sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= max(sizes, default=0)


@pytest.mark.parametrize("pp,dp,ep", [
    (1, 1, 1),    # single process
    (1, 16, 4),   # EPSO-like layout: 4 shards, each cut into 4 chunks
    (1, 2, 8),    # EP wider than DP: one writer per shard
    (2, 8, 2),    # pipeline stages (each stage has its own weights)
    (1, 64, 1),   # EP=1: one shard, spread over every DP rank
    (1, 6, 4),    # DP not a multiple of EP
])
def test_model_writes_cover_every_segment_exactly_once(pp: int, dp: int, ep: int) -> None:
    experts = 8 * ep
    def segments(pp_rank: int, ep_rank: int) -> list[Segment]:
        dense = [Segment(f"s{pp_rank}.w{i}", f"s{pp_rank}.w{i}", None, (i % 7 + 1, 3)) for i in range(90)]
        per = experts // ep
        ex = [Segment(f"s{pp_rank}.experts.gate_up_proj/{e}", f"s{pp_rank}.experts.gate_up_proj",
                         e - ep_rank * per, (4, 2), inner=True) for e in range(ep_rank * per, (ep_rank + 1) * per)]
        return dense[:5] + ex + dense[5:]
    written: dict[str, int] = {}
    per_rank = []
    for r in range(pp * dp * ep):
        c = Coords(rank=r, pp=pp, dp=dp, ep=ep)
        mine = model_writes(segments(c.pp_rank, c.ep_rank), c)
        per_rank.append(sum(s.numel for s in mine))
        for s in mine:
            assert s.key not in written, f"{s.key} written by ranks {written[s.key]} and {r}"
            written[s.key] = r
        if any(s.is_expert for s in mine):
            assert all(s.key.startswith(f"s{c.pp_rank}.") for s in mine)
    expected = {s.key for p in range(pp) for e in range(ep) for s in segments(p, e)}
    assert set(written) == expected
    chunks = shard_chunks(pp, dp, ep)
    writers = [b for b in per_rank if b]
    assert len(writers) == pp * ep * chunks  # a chunk per writer, the other replicas write nothing
    total = sum(per_rank)
    assert max(writers) <= total / len(writers) + 3 * 7  # balanced within a few segments
    bound = checkpoint_bytes(0, total, pp=pp, dp=dp, ep=ep, weight_bytes=1)
    assert max(writers) == pytest.approx(bound["rank_writer"] - bound["rank_other"], abs=3 * 7)


def test_tensor_parallel_weights_are_keyed_by_tp_rank() -> None:
    """Under TP (innermost, where EP sits), a split weight is distinct on every TP rank: it gets its
    own key and is written by that rank's shard; replicated weights keep their plain name."""
    from types import SimpleNamespace

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    model[0].weight.tp_split = True
    keys = {}
    for r in range(8):  # PP 1 x DP 4 x TP 2
        lay = SimpleNamespace(rank=r, pp=1, dp=4, ep=1, tp=2, tp_rank=r % 2)
        c = coords_of(lay)
        assert (c.ep, c.ep_rank, c.dp_rank) == (2, r % 2, r // 2)
        segs = model_segments(model, tp_rank=tp_rank_of(lay))
        assert [s.key for s in segs] == [f"0.weight/tp{r % 2}", "0.bias", "1.weight", "1.bias"]
        for s in model_writes(segs, c):
            assert s.key not in keys
            keys[s.key] = r
    assert set(keys) == {"0.weight/tp0", "0.weight/tp1", "0.bias", "1.weight", "1.bias"}
    assert keys["0.weight/tp1"] % 2 == 1  # written by a TP-rank-1 process
    assert tp_rank_of(SimpleNamespace(rank=0, pp=1, dp=1, ep=2)) is None  # no TP: plain names


# ============================================================================ single process
def _train(model, opt, lay, steps: range, out: Path) -> None:
    for s in steps:
        toy.train_step(model, opt, lay, s, out)


def _layout1():
    return toy.make_layout(1)


def _fresh(optim: str = "sharded"):
    lay = _layout1()
    model, opt = toy.build(optim, lay)
    return lay, model, opt


def _tree_hashes(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def _tensor_bytes(path: Path) -> int:
    md = storage_reader(path).read_metadata().state_dict_metadata
    return sum(math.prod(m.size) * m.properties.dtype.itemsize for m in md.values())


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("optim", [
    "sharded",  # ZeRO-1 buckets (one shard in one process)
    "adamw",    # replicated states
])
def test_full_restore_is_exact(tmp_path: Path, optim: str) -> None:
    torch.manual_seed(1)
    lay, model, opt = _fresh(optim)
    _train(model, opt, lay, range(0, 3), tmp_path)
    mgr = CheckpointManager(tmp_path / "ck", interval=3)
    stats = mgr.save(3, model, opt, meta={"next_instance": 24}, rank_extra={"loader": 7})
    assert stats.total_bytes == sum(f.stat().st_size for f in stats.path.iterdir())
    _train(model, opt, lay, range(3, 5), tmp_path)  # consumes RNG; the restore must rewind it
    expected = _weights(model)

    torch.manual_seed(99)  # a different RNG state and fresh weights
    lay, model2, opt2 = _fresh(optim)
    res = CheckpointManager(tmp_path / "ck").restore(model2, opt2)
    assert res is not None and res.info.step == 3 and res.same_layout
    assert res.meta == {"next_instance": 24} and res.rank_extra == {"loader": 7}
    assert optimizer_steps(opt2) == {b.name: 3 for b in opt2.buckets}
    _train(model2, opt2, lay, range(3, 5), tmp_path)
    for k, v in _weights(model2).items():
        assert torch.equal(v, expected[k]), k


def _two_slots(root: Path):
    """Checkpoints at steps 2 (slot A) and 4 (slot B); returns the model/opt and the step-4 weights."""
    lay, model, opt = _fresh()
    mgr = CheckpointManager(root, interval=2)
    _train(model, opt, lay, range(0, 2), root)
    a = mgr.save(2, model, opt)
    w2 = _weights(model)
    _train(model, opt, lay, range(2, 4), root)
    b = mgr.save(4, model, opt)
    assert (a.path.name, b.path.name) == ("slot-A", "slot-B")
    return lay, model, opt, w2, _weights(model)


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x10
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("target,damage", [
    ("__0_0.distcp", _truncate),      # a data file cut short (crash during a copy, full disk)
    ("__0_0.distcp", _flip),          # one flipped bit in the tensors
    (".metadata", _flip),             # the DCP index corrupted
    ("rank-00000.pt", _flip),         # RNG/extras of one rank corrupted
    ("meta.json", _truncate),         # the step record damaged
    ("MANIFEST.json", _flip),         # the manifest itself corrupted
    ("MANIFEST.json", lambda p: p.unlink()),  # never finished writing
])
def test_corrupt_newest_slot_falls_back_to_the_other(tmp_path: Path, target: str, damage) -> None:
    root = tmp_path / "ck"
    lay, model, opt, w2, w4 = _two_slots(root)
    assert latest_valid(root).step == 4
    damage(root / "slot-B" / target)
    info = latest_valid(root)
    assert info is not None and info.step == 2 and info.path.name == "slot-A"
    reasons = {p.name: r for p, _, r in scan(root)}
    assert reasons["slot-A"] is None and reasons["slot-B"]
    _, model2, opt2 = _fresh()
    CheckpointManager(root).restore(model2, opt2)
    for k, v in _weights(model2).items():
        assert torch.equal(v, w2[k]), k
    # the next write reuses the damaged slot, never the valid one
    stats = CheckpointManager(root, interval=2).save(4, model2, opt2)
    assert stats.path.name == "slot-B" and verify(root / "slot-A") is None


class _Died(BaseException):
    """Stands in for the process dying (not an Exception: nothing may catch and tidy up)."""


def test_crash_while_writing_leaves_the_other_slot(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ck"
    lay, model, opt, w2, w4 = _two_slots(root)
    _train(model, opt, lay, range(4, 6), root)

    def die(tmp: Path, files) -> None:
        (tmp / "MANIFEST.json").write_bytes(b'{"format": 1, "fi')  # torn mid-write
        raise _Died()

    monkeypatch.setattr(ck_save, "_write_manifest", die)
    with pytest.raises(_Died):
        CheckpointManager(root, interval=2).save(6, model, opt)
    monkeypatch.undo()
    assert (root / "slot-A.tmp").exists() and not (root / "slot-A").exists()
    info = latest_valid(root)
    assert info.step == 4 and info.path.name == "slot-B"
    # a restarted run resumes from B and its next checkpoint cleans up and takes slot A
    _, model2, opt2 = _fresh()
    mgr = CheckpointManager(root, interval=2)
    mgr.restore(model2, opt2)
    assert all(torch.equal(v, w4[k]) for k, v in _weights(model2).items())
    _train(model2, opt2, lay, range(4, 6), root)
    assert mgr.save(6, model2, opt2).path.name == "slot-A"
    assert not (root / "slot-A.tmp").exists() and latest_valid(root).step == 6


class _NoSpaceWriter:
    """A DCP storage writer that runs out of disk after writing part of its data."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def write_data(self, plan, planner):
        from torch.futures import Future

        fut: Future = Future()
        path = Path(self._inner.path) / "__0_0.distcp"
        path.write_bytes(b"\0" * 1000)  # a partial file, as a full disk leaves behind
        fut.set_exception(OSError(errno.ENOSPC, "No space left on device", str(path)))
        return fut


@pytest.mark.parametrize("where", [
    "data",      # DCP's tensor files
    "manifest",  # the last file of the write
    "short",     # torch's zip writer's short write: no errno, only "unexpected pos" (a full tmpfs under it)
    "async",     # DCP's tensor files, written in the background
])
def test_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch,
                                                                         where: str) -> None:
    root = tmp_path / "ck"
    lay, model, opt, w2, w4 = _two_slots(root)
    before = _tree_hashes(root / "slot-B")
    if where in ("data", "async"):
        real = ck_dcp_io.storage_writer
        monkeypatch.setattr(ck_dcp_io, "storage_writer", lambda path: _NoSpaceWriter(real(path)))
    else:
        real_write = ck_save.write_file

        def write_file(path: Path, data: bytes) -> None:
            if path.name == "MANIFEST.json":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real_write(path, data)

        monkeypatch.setattr(ck_save, "write_file", write_file)
        if where == "short":
            monkeypatch.setattr(ck_save, "write_file", lambda path, data: (_ for _ in ()).throw(RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")))
            import trainer.ft.space as space

            monkeypatch.setattr(space, "free_bytes", lambda path: 100)  # the disk as full as the write met it
    with pytest.raises(CheckpointError) as err:
        mgr = CheckpointManager(root, interval=2, async_save=where == "async")
        mgr.save(6, model, opt)
        mgr.wait()
    msg = str(err.value)
    # one line: "space", the path, the bytes needed and free, and what stays valid
    assert "step 6" in msg and "out of disk space writing" in msg and "slot-A.tmp" in msg, msg
    assert re.search(r"it needs [\d,]+ bytes .*, [\d,]+ bytes .* are free there", msg), msg
    assert "slot-B (step 4) is untouched" in msg and "\n" not in msg
    monkeypatch.undo()
    assert _tree_hashes(root / "slot-B") == before
    assert latest_valid(root).step == 4
    assert not (root / "slot-A.tmp").exists(), "the partial write must be cleaned up"


def _make_read_only(path: Path) -> str | None:
    """Make ``path`` unwritable (chmod; for root, which ignores modes, the immutable attribute);
    returns how, or None when this machine allows neither."""
    os.chmod(path, 0o555)
    probe = path / ".probe"
    try:
        probe.mkdir()
    except OSError:
        return "chmod"
    probe.rmdir()
    os.chmod(path, 0o755)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return "chattr"
    return None


def test_read_only_directory_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    lay, model, opt, w2, w4 = _two_slots(root)
    before = {s: _tree_hashes(root / s) for s in ("slot-A", "slot-B")}
    how = _make_read_only(root)
    if how is None:
        pytest.skip("cannot make a directory read-only here (root without chattr)")
    try:
        with pytest.raises(CheckpointError, match=r"step 6 .*not writable.*slot-B \(step 4\) is untouched"):
            CheckpointManager(root, interval=2).save(6, model, opt)
    finally:
        if how == "chattr":
            subprocess.run(["chattr", "-i", str(root)], check=True)
        os.chmod(root, 0o755)
    assert {s: _tree_hashes(root / s) for s in ("slot-A", "slot-B")} == before
    assert latest_valid(root).step == 4


# ============================================================================ model-only, --init-from
def test_model_only_checkpoints_are_kept_and_initialise_a_fresh_run(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    lay, model, opt = _fresh()
    mgr = CheckpointManager(root, interval=2, model_interval=1, model_dtype="bf16")
    sizes = {}
    for s in range(3):
        _train(model, opt, lay, range(s, s + 1), root)
        sizes["model"] = mgr.save_model(s + 1, model).total_bytes
    sizes["full"] = mgr.save(3, model, opt).total_bytes
    assert [p.name for p in model_checkpoints(root)] == [f"model-step-{s:08d}" for s in (1, 2, 3)]
    # tensor bytes: model-only 2 per weight (bf16); full 16 (fp32 weight, master, exp_avg, exp_avg_sq)
    n = sum(p.numel() for p in model.parameters())
    assert _tensor_bytes(root / "model-step-00000003") == 2 * n
    assert _tensor_bytes(root / "slot-A") == 16 * n
    assert sizes["full"] > sizes["model"]

    _, fresh, fresh_opt = _fresh()
    info = load_model(root / "model-step-00000003", fresh)
    assert info.kind == "model" and info.step == 3
    for k, v in fresh.named_parameters():
        assert torch.equal(v, dict(model.named_parameters())[k].detach().to(torch.bfloat16).float()), k
    sync_master_from_model(fresh_opt)
    assert torch.equal(fresh_opt.buckets[0].master[:5], fresh_opt.buckets[0].flat_param[:5])
    assert optimizer_steps(fresh_opt) == {b.name: 0 for b in fresh_opt.buckets}  # fresh optimizer
    # a full checkpoint initialises weights exactly
    _, fresh2, _ = _fresh()
    load_model(root / "slot-A", fresh2)
    assert all(torch.equal(v, dict(model.named_parameters())[k]) for k, v in fresh2.named_parameters())
    with pytest.raises(CheckpointError, match="model-only checkpoint; use it with --init-from"):
        restore_full(read_info(root / "model-step-00000003"), fresh2, fresh_opt)


def test_init_from_a_different_model_or_a_damaged_checkpoint_fails_clearly(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    lay, model, opt = _fresh()
    path = save_model(root, step=1, model=model).path
    bigger = torch.nn.Sequential()
    bigger.add_module("inp", torch.nn.Linear(toy.D_IN, toy.H + 1))
    with pytest.raises(CheckpointError, match=r"'model/inp.weight' has shape \[8, 6\], this model expects \[9, 6\]"):
        load_model(path, bigger)
    _flip(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="cannot initialise from .*sha256"):
        load_model(path, model)


# ============================================================================ distributed
def test_dp_scattered_writes_and_resume_on_a_different_layout(tmp_path: Path) -> None:
    """World 4 (DP 2 x EP 2, EPSO) saves; world 2 (DP 2, EP 1, ShardedAdamW) and one process
    (ZeRO over nothing) restore exactly the same unsharded state."""
    src = tmp_path / "src"
    codes = toy.spawn(4, ["--out", str(src), "--steps", "3", "--interval", "3", "--optim", "epso", "--ep", "2",
                          "--dump", str(src / "dump")])
    assert codes == [0] * 4, (src / "spawn-rank-0.log").read_text()[-3000:]
    saved = toy.assemble(toy.load_dumps(src / "dump"))
    slot = src / "checkpoints" / "slot-A"
    meta = json.loads((slot / "meta.json").read_text())
    assert meta["layout"] == {"world": 4, "pp": 1, "dp": 2, "ep": 2, "tp": 1} and meta["step"] == 3

    # who wrote what: model shard (ep 0) by rank 0 = (dp 0, ep 0), shard (ep 1) by rank 3 = (dp 1, ep 1)
    md = storage_reader(slot).read_metadata()
    files = {idx.fqn: info.relative_path for idx, info in md.storage_data.items()}
    model_files = {k: v for k, v in files.items() if k.startswith("model/")}
    assert set(model_files.values()) == {"__0_0.distcp", "__3_0.distcp"}
    assert all(model_files[f"model/blk.experts.{w}/{e}"] == "__3_0.distcp" for w in ("gate_up_proj", "down_proj")
               for e in (2, 3))
    optim_files = {v for k, v in files.items() if k.startswith("optim/")}
    assert optim_files == {f"__{r}_0.distcp" for r in range(4)}, "every rank writes its own optimizer shard"

    # world 2, another optimizer and EP size: loads and dumps without training
    dst = tmp_path / "dst"
    dst.mkdir()
    os.symlink(src / "checkpoints", dst / "checkpoints")
    codes = toy.spawn(2, ["--out", str(dst), "--steps", "3", "--optim", "sharded", "--ep", "1", "--resume", "auto",
                          "--dump", str(dst / "dump")])
    assert codes == [0, 0], (dst / "spawn-rank-0.log").read_text()[-3000:]
    assert toy.assemble(toy.load_dumps(dst / "dump")).keys() == saved.keys()
    for k, v in toy.assemble(toy.load_dumps(dst / "dump")).items():
        assert torch.equal(v, saved[k]), k

    # one process
    lay, model, opt = _fresh("adamw")
    res = CheckpointManager(src / "checkpoints").restore(model, opt)
    assert not res.same_layout and res.info.step == 3
    for k, v in toy.assemble([toy.dump_state(model, opt)]).items():
        assert torch.equal(v, saved[k]), k

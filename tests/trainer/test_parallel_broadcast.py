"""Model broadcast: only the source rank touches the model file; every rank ends bit-identical.

Proof that other ranks never open the file: in every worker, a guard records and (on ranks other
than 0) refuses each access to the file: Python's audit hook sees every Python-level open
(builtins.open, io.open, os.open, pathlib, numpy), and torch.load / safetensors' loaders (which
open files from C++/Rust) are wrapped. Rank 0's own reads through the same guard are the positive
control: they show the guard sees the loader that is actually used.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from fastmoe_xpu.dist.sharding import is_expert_weight
from parallel_util import run_workers, tiny_model

class FileGuard:
    """Count accesses to ``path``; raise PermissionError on them when ``forbid``."""

    def __init__(self, path: str, forbid: bool) -> None:
        self.path = os.path.realpath(path)
        self.base = os.path.basename(path)
        self.forbid = forbid
        self.hits: list[str] = []
        sys.addaudithook(self._audit)
        import safetensors.torch
        import torch.serialization

        self._patch(torch, "load")
        self._patch(torch.serialization, "load")
        self._patch(safetensors.torch, "load_file")
        self._patch(safetensors.torch, "safe_open")

    def _touch(self, what: str, target: object) -> None:
        if isinstance(target, (str, bytes, os.PathLike)):
            p = os.fsdecode(target)
            if os.path.basename(p) == self.base or os.path.realpath(p) == self.path:
                self.hits.append(what)
                if self.forbid:
                    raise PermissionError(f"rank {torch.distributed.get_rank()} tried to {what} the model file")

    def _audit(self, event: str, args: tuple) -> None:
        if event == "open" and args:
            self._touch("open", args[0])

    def _patch(self, mod: object, name: str) -> None:
        original = getattr(mod, name)

        def wrapped(*a, **kw):
            self._touch(f"{name}", a[0] if a else kw.get("f", kw.get("filename")))
            return original(*a, **kw)

        setattr(mod, name, wrapped)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _file_worker(path: str, method: str, sharded: bool) -> dict:
    import torch.distributed as dist

    from trainer.parallelism.broadcast import load_and_broadcast, state_digest

    rank = dist.get_rank()
    guard = FileGuard(path, forbid=rank != 0)
    # a different init on every rank; sharded: expert parallelism over all ranks, each keeps its experts
    model = tiny_model("olmoe", seed=1000 + rank, num_hidden_layers=2, ep_group=dist.group.WORLD if sharded else None)
    not_sent = load_and_broadcast(model, path, method=method)
    out = {"hits": list(guard.hits), "digest": state_digest(model), "not_sent": not_sent}
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["expert_ids"] = {n.rpartition(".")[0]: b.clone() for n, b in model.named_buffers() if n.endswith("expert_ids")}
    return out


def _replica_worker(method: str) -> dict:
    import torch.distributed as dist

    from trainer.parallelism.broadcast import broadcast_replicas, state_digest

    rank = dist.get_rank()
    model = tiny_model("olmoe", seed=2000 + rank, num_hidden_layers=2)
    before = state_digest(model)
    n = broadcast_replicas(model, group=None, method=method)
    return {"before": before, "after": state_digest(model), "sent": n}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """The same weights as a torch.save trainer checkpoint and as safetensors; some entries are
    -0.0, which a naive all-reduce (adding +0.0) would turn into +0.0."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("ckpt")
    sd = {k: v.detach().clone() for k, v in tiny_model("olmoe", seed=7, num_hidden_layers=2).state_dict().items()}
    first = next(k for k in sd if k.endswith("q_proj.weight"))
    sd[first].view(-1)[:5] = -0.0
    pt, st = d / "model.pt", d / "model.safetensors"
    torch.save({"model": sd, "step": 3}, pt)
    save_file(sd, str(st))
    return {"pt": str(pt), "safetensors": str(st), "sd": sd, "neg_zero_key": first}


@pytest.mark.parametrize("fmt,method,sharded", [
    ("pt", "broadcast", False),         # torch.save checkpoint with a "model" entry, plain broadcast
    ("safetensors", "all_reduce", False),  # safetensors file, all-reduce transport (-0.0 must survive)
    ("pt", "all_reduce", True),         # EP=2: each receiver keeps its own experts of the full tensors
])
def test_only_rank0_reads_and_all_end_identical(model_files, fmt, method, sharded):
    world = 2
    res = run_workers(_file_worker, world, model_files[fmt], method, sharded)
    assert res[0]["hits"], "the guard saw no read on rank 0: it cannot prove anything about the others"
    for r in range(1, world):
        assert res[r]["hits"] == [], f"rank {r} touched the model file: {res[r]['hits']}"
    sd = model_files["sd"]
    for r in range(world):
        state = res[r]["state"]
        for k, v in state.items():
            if k not in sd:
                continue  # buffers the file does not carry (rotary inverse frequencies)
            want = sd[k]
            if sharded and is_expert_weight(k):
                ids = res[r]["expert_ids"][k.rpartition(".")[0]]
                assert len(ids) == want.shape[0] // 2, "experts not split"
                want = want[ids]
            assert torch.equal(_bits(v), _bits(want)), f"rank {r}: {k} differs from the file bit for bit"
        assert torch.signbit(state[model_files["neg_zero_key"]].view(-1)[:5]).all(), "-0.0 lost its sign"
    if not sharded:
        assert res[0]["digest"] == res[1]["digest"]
    assert all(not n.endswith("weight") for n in res[0]["not_sent"]), res[0]["not_sent"]


@pytest.mark.parametrize("method", ["broadcast", "all_reduce"])  # both transports of an initialised model
def test_replicas_take_rank0_init(method):
    res = run_workers(_replica_worker, 2, method)
    assert res[0]["before"] != res[1]["before"], "ranks started equal: the test would prove nothing"
    assert res[1]["after"] == res[0]["before"] == res[0]["after"]
    assert res[0]["sent"] == len(res[0]["before"])


def test_unreadable_file_fails_on_every_rank(tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError) as e:
        run_workers(_file_worker, 2, str(bad), "broadcast", False)
    assert "could not read the model" in str(e.value)

"""A tiny stand-in trainer for the checkpoint, fault and launcher tests.

It uses the real pieces (``trainer.optim`` optimizers, ``trainer.checkpoint``, ``trainer.ft.fault``)
around a model small enough to start in a second: an input layer, a block of "experts" named like
OLMoE's merged expert weights (so EP sharding, expert keys and EPSO buckets are exercised) and an
output layer. Data and noise are deterministic functions of (seed, step) and of the RNG states the
checkpoint restores, so an interrupted run must end with an uninterrupted run's exact weights.

Run as ``python tests/_ft_toy.py --out DIR [--steps N] [--interval K] [--resume auto] ...`` under
``trainer.ft.launch --entry tests/_ft_toy.py`` or any torchrun-like environment (RANK, WORLD_SIZE, ...).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastmoe_xpu.dist.sharding import is_expert_weight  # noqa: E402
from trainer.checkpoint.dcp_io import dcp_load, storage_reader  # noqa: E402
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.optim_state import bucket_segments, OPTIM_STATES, optimizer_steps
from trainer.checkpoint.slots import CheckpointError
from trainer.checkpoint.writers import model_segments, segment_tensor
from trainer.ft import fault  # noqa: E402
from trainer.optim import OPTIMIZERS  # noqa: E402
from trainer.ft.stop import StopRequest, Stopped, signal_name  # noqa: E402

H, E, D_IN, D_OUT, GLOBAL_BATCH = 8, 4, 6, 3, 8


class ToyExperts(nn.Module):
    def __init__(self, ids: list[int], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 1)
        gate_up = torch.randn(E, 2 * H, H, generator=g) * 0.3
        down = torch.randn(E, H, H, generator=g) * 0.3
        self.gate_up_proj = nn.Parameter(gate_up[ids].clone())
        self.down_proj = nn.Parameter(down[ids].clone())
        self.register_buffer("expert_ids", torch.tensor(ids))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in range(self.gate_up_proj.shape[0]):
            gu = h @ self.gate_up_proj[e].T
            out = out + (torch.tanh(gu[:, :H]) * gu[:, H:]) @ self.down_proj[e].T
        return out / E


class Block(nn.Module):
    def __init__(self, ids: list[int], seed: int) -> None:
        super().__init__()
        self.experts = ToyExperts(ids, seed)


class Toy(nn.Module):
    def __init__(self, ep: int = 1, ep_rank: int = 0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(D_IN, H)
        self.out = nn.Linear(H, D_OUT)
        per = E // ep
        self.blk = Block(list(range(ep_rank * per, (ep_rank + 1) * per)), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.blk.experts(h))


def batch(step: int, data_rank: int, data_world: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (same on any restart)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    n = GLOBAL_BATCH // data_world
    return x[data_rank * n:(data_rank + 1) * n], y[data_rank * n:(data_rank + 1) * n]


def make_layout(ep: int) -> SimpleNamespace:
    """PP=1 x DP x EP (EP innermost) over the process group from the environment, with the groups
    ``trainer.optim`` expects (None where a group would have one rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if world > 1 else 0
    if world % ep:
        raise SystemExit(f"world {world} is not divisible by EP {ep}")
    dp = world // ep
    lay = SimpleNamespace(rank=rank, world=world, pp=1, dp=dp, ep=ep, dp_rank=rank // ep, ep_rank=rank % ep,
                          dp_group=None, ep_group=None, dpep_group=None, world_group=None)
    if world > 1:
        for e in range(ep):  # every rank creates every group, in the same order
            g = dist.new_group([d * ep + e for d in range(dp)])
            if e == lay.ep_rank and dp > 1:
                lay.dp_group = g
        for d in range(dp):
            g = dist.new_group([d * ep + e for e in range(ep)])
            if d == lay.dp_rank and ep > 1:
                lay.ep_group = g
        lay.dpep_group = dist.group.WORLD
        lay.world_group = dist.group.WORLD
    return lay


def build(optim: str, lay: Any, seed: int = 0) -> tuple[Toy, Any]:
    model = Toy(lay.ep, lay.ep_rank, seed)
    opt = OPTIMIZERS[optim](
        model.named_parameters(), is_expert=is_expert_weight, dp_group=lay.dp_group, ep_group=lay.ep_group,
        dpep_group=lay.dpep_group, norm_group=lay.world_group, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
    )
    return model, opt


def train_step(model: Toy, opt: Any, lay: Any, step: int, out: Path) -> float:
    x, y = batch(step, lay.rank, lay.world)
    # the RNG states are part of the training state: noise from torch, numpy and python
    x = x + 0.01 * torch.randn(x.shape) + 0.001 * float(np.random.randn()) + 0.001 * random.random()
    loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
    loss = fault.maybe_poison(loss, step, lay.rank)
    loss.backward()
    fault.check_step(step, loss, [b.flat_grad for b in opt.buckets], out_dir=out)
    opt.step(lr=0.05)
    return float(loss.detach())


def dump_state(model: Toy, opt: Any) -> dict[str, Any]:
    """Every optimizer-state piece this rank holds, keyed like the checkpoint (``(state, key)`` ->
    list of (offset within the weight, values)), and the model's weights by checkpoint key."""
    pieces: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for b in opt.buckets:
        lo_me = b.group_rank * b.shard_numel
        hi_me = min(b.numel, lo_me + b.shard_numel)
        for os_ in bucket_segments(model, b, is_expert_weight):
            lo, hi = max(os_.offset, lo_me), min(os_.offset + os_.seg.numel, hi_me)
            if lo < hi:
                for state, t in zip(OPTIM_STATES, (b.master, b.exp_avg, b.exp_avg_sq)):
                    pieces.setdefault((state, os_.seg.key), []).append((lo - os_.offset, t[lo - lo_me:hi - lo_me].clone()))
    params = dict(model.named_parameters())
    weights = {s.key: segment_tensor(params, s).detach().clone() for s in model_segments(model)}
    return {"pieces": pieces, "weights": weights, "steps": optimizer_steps(opt)}


def spawn(world: int, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 300.0) -> list[int]:
    """Run this script on ``world`` local ranks (torchrun's environment variables) and wait;
    returns the exit codes. Output goes to ``<out>/spawn-rank-<r>.log``."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = Path(argv[argv.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(env or {}))
        with open(out / f"spawn-rank-{r}.log", "ab") as fh:
            procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=e, stdout=fh, stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def load_dumps(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [torch.load(f, weights_only=False) for f in sorted(Path(path).glob("rank-*.pt"))]


def assemble(dumps: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's dump: ``"w/<key>"`` weights and ``"<state>/<key>"`` optimizer
    states (flattened); replicas must agree exactly."""
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for d in dumps:
        for key, w in d["weights"].items():
            k = f"w/{key}"
            if k in full and not torch.equal(full[k], w):
                raise AssertionError(f"replicas of {key} differ")
            full[k] = w
        for (state, key), pieces in d["pieces"].items():
            k = f"{state}/{key}"
            n = d["weights"][key].numel() if key in d["weights"] else None
            if k not in full:
                full[k] = torch.full((n,), float("nan"))
                filled[k] = torch.zeros(n, dtype=torch.bool)
            for at, t in pieces:
                cur = full[k][at:at + t.numel()]
                seen = filled[k][at:at + t.numel()]
                if seen.any() and not torch.equal(cur[seen], t[seen]):
                    raise AssertionError(f"replicas of {k} differ")
                cur.copy_(t)
                seen.fill_(True)
    missing = [k for k, f in filled.items() if not f.all()]
    if missing:
        raise AssertionError(f"no rank holds all of {missing[:3]}")
    return full


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in :func:`assemble`'s naming, read in this process (no process group)."""
    path = Path(path)
    md = storage_reader(path).read_metadata().state_dict_metadata
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
    dcp_load(want, path)
    out = {}
    for k, t in want.items():
        kind, _, rest = k.partition("/")
        if kind == "model":
            out[f"w/{rest}"] = t
        else:
            state, _, key = rest.partition("/")
            out[f"{state}/{key}"] = t.reshape(-1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--model-interval", type=int, default=0)
    ap.add_argument("--resume", default="none", choices=["auto", "none"])
    ap.add_argument("--checkpoint.resume", dest="resume", action="store_const", const="auto",
                    help="the trainer's spelling of --resume auto (what trainer.ft.launch appends)")
    ap.add_argument("--optim", default="sharded", choices=sorted(OPTIMIZERS))
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to kill mid-run)")
    ap.add_argument("--checkpoint-sleep", type=float, default=0.0,
                    help="seconds in the checkpoint phase before each periodic write (to stop a rank there)")
    ap.add_argument("--async", dest="async_save", action="store_true",
                    help="periodic checkpoints written in the background (trainer/checkpoint/background.py)")
    ap.add_argument("--die-in-write", type=int, default=0,
                    help="os._exit(9) in the middle of the background write of the checkpoint of this step")
    ap.add_argument("--dump", default=None, help="directory for per-rank state dumps at the end")
    args = ap.parse_args(argv)
    stop = StopRequest().install()  # SIGTERM / SIGINT (or the launcher's SIGUSR1 / SIGUSR2): trainer/ft/stop.py
    try:
        return _run(args, stop)
    except Stopped as e:  # before the first step or after the last: at once
        print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        stop.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # the groups' threads end here, not in interpreter shutdown (trainer/cli.py)


def _die_in_write(step: int) -> None:
    """The process dies while the background thread writes checkpoint ``step``: after its tensor
    files, before its manifest (the step loop has gone on meanwhile)."""
    import threading

    from trainer.checkpoint import save as ck_save

    write = ck_save._write_manifest

    def die(tmp: Path, files: Any) -> int:
        if json.loads((tmp / "meta.json").read_text())["step"] == step:
            assert threading.current_thread() is not threading.main_thread(), "the write is not in the background"
            (tmp / "MANIFEST.json").write_bytes(b'{"format": 1, "fi')  # torn mid-write
            os._exit(9)
        return write(tmp, files)

    ck_save._write_manifest = die


def _run(args: argparse.Namespace, stop: StopRequest) -> int:
    out = Path(args.out)
    lay = make_layout(args.ep)
    seed = 0
    torch.manual_seed(seed + 17 * lay.rank)
    np.random.seed(seed + lay.rank)
    random.seed(seed + lay.rank)
    model, opt = build(args.optim, lay, seed)
    mgr = CheckpointManager(out / "checkpoints", layout=lay, interval=args.interval,
                               model_interval=args.model_interval, async_save=args.async_save)
    if args.die_in_write:
        _die_in_write(args.die_in_write)
    hb = fault.Heartbeat(out, lay.rank)
    hb.beat(0, "startup")
    start = 0
    if args.resume == "auto":
        try:
            res = mgr.restore(model, opt)
        except CheckpointError as e:  # every slot damaged: the trainer's exit 76, on every rank
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
            return fault.EXIT_CHECKPOINT_FAILURE
        if res is not None:
            start = res.info.step
            if lay.rank == 0:
                print(f"resumed from {res.info.path} at step {start} in {res.seconds:.3f}s", flush=True)
    stop.deferred = True  # a signal from here on lets the step finish
    try:
        for step in range(start, args.steps):
            fault.maybe_hang(step, lay.rank)
            hb.beat(step, "start")
            if args.step_sleep:
                time.sleep(args.step_sleep)  # inside the step, so a kill lands mid-step
            loss = train_step(model, opt, lay, step, out)
            hb.beat(step + 1, "done", completed=True)
            if lay.rank == 0:
                print(f"step {step + 1} loss {loss:.6f}", flush=True)
            saved = None
            if mgr.due(step + 1):
                hb.beat(step + 1, "checkpoint")
                if args.checkpoint_sleep:
                    time.sleep(args.checkpoint_sleep)  # a slow write: a signal lands in this phase
                saved = mgr.save(step + 1, model, opt, meta={"next_step": step + 1}).path
            if mgr.model_due(step + 1):
                mgr.save_model(step + 1, model)
            sig = stop.agreed(None, dist.is_initialized())
            if sig is not None:  # every rank stops after this step, with one checkpoint of it
                if saved is None:
                    hb.beat(step + 1, "checkpoint")
                    saved = mgr.save(step + 1, model, opt, meta={"next_step": step + 1}).path
                print(f"stopped at step {step + 1} ({signal_name(sig)}); checkpoint at {saved}; run the same "
                      "command to resume", file=sys.stderr, flush=True)
                return 128 + sig
    except fault.SoftFailure as e:
        print(f"soft failure: {e}", file=sys.stderr, flush=True)
        if args.dump:  # the state at the failure: must equal the state before the bad step
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            torch.save(dump_state(model, opt), Path(args.dump) / f"rank-{lay.rank:05d}.pt")
        return fault.EXIT_SOFT_FAILURE
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return fault.EXIT_CHECKPOINT_FAILURE
    mgr.wait()  # the last background write, before the run's end
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        torch.save(dump_state(model, opt), Path(args.dump) / f"rank-{lay.rank:05d}.pt")
    stop.deferred = False
    if dist.is_initialized():
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())

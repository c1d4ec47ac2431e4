"""AdamW with fp32 master weights and Adam states sharded over process groups (ZeRO stage 1).

Parameters are split into buckets by how they are replicated. Each bucket lays its parameters and
gradients out in one flat, padded buffer (the model's ``p.data`` and ``p.grad`` become views of it,
so backward accumulates straight into the buffer). A step:

1. sums the bucket's gradient over the replicas that do *not* share its states (``pre_reduce_group``,
   all-reduce), then reduce-scatters it over the ranks that do (``shard_group``), in the chosen
   reduction dtype, so each rank holds the summed gradient of its own contiguous shard;
2. computes the global gradient norm from the shards (one all-reduce of two scalars over the world,
   each shard counted once) and clips the shards when asked;
3. runs torch's own AdamW update (``torch.optim.adamw.adamw``) on the fp32 master shard with its
   ``exp_avg`` / ``exp_avg_sq`` shards: elementwise, so sharding changes nothing numerically;
4. all-gathers the updated shards, cast to the parameter dtype, back into the flat parameter buffer.

``master`` chooses where the weights live between steps. ``"fp32"`` (the default): an fp32 master
copy of the shard, as above. ``"none"`` or ``"stochastic"``: no copy at all (pure low-precision
training, e.g. bf16 weights): the update runs in fp32 on the shard read from the parameters and is
written back into their dtype, rounded to nearest (``"none"``: plain bf16, whose small updates are
lost to rounding) or stochastically (``"stochastic"``: up or down with the probabilities that make
the rounding unbiased, so small updates survive on average). The rounding draws from the
optimizer's own generator (seeded per rank, saved in :meth:`ZeroAdamW.state_dict`, so a resumed
run rounds exactly as an uninterrupted one). ``moments_dtype`` keeps ``exp_avg`` / ``exp_avg_sq``
in fp32 (default) or bf16 (rounded the same way as the weights).

Gradients are *summed* across replicas: the loss must already be normalised over the global batch
(the trainer divides by the global token count), which makes a step independent of the layout.

Which buckets exist:

================  ======================================  ===========================================
optimizer         non-expert weights                      expert weights (``...experts.*_proj``)
================  ======================================  ===========================================
ReplicatedAdamW   all-reduce over DP x EP; states whole   all-reduce over DP; states whole
ShardedAdamW      all-reduce over EP, then RS over DP     reduce-scatter over DP
EPSO              reduce-scatter over DP x EP             reduce-scatter over DP
================  ======================================  ===========================================

Legend: N parameters in a bucket, G ranks sharing its states, S = ceil(N / G) shard size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.adamw import adamw as _adamw_functional

from fastmoe_xpu.dist.groups import group_rank, group_size

#: Bytes of optimizer state per parameter of a shard: fp32 master weight, exp_avg and exp_avg_sq.
STATE_BYTES_PER_PARAM = 12
#: Where the weights live between steps (see the module docstring).
MASTER_MODES = ("fp32", "none", "stochastic")


def state_bytes_per_param(master: str = "fp32", moments_dtype: torch.dtype = torch.float32) -> int:
    """Optimizer-state bytes per parameter of a shard: the fp32 master (4, or 0 without one) and the
    two moments (4 each in fp32, 2 in bf16)."""
    if master not in MASTER_MODES:
        raise ValueError(f"master must be one of {MASTER_MODES}, got {master!r}")
    return (4 if master == "fp32" else 0) + 2 * torch.empty((), dtype=moments_dtype).element_size()


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype`` (bf16) stochastically: up with probability equal to the
    dropped fraction of the distance to the next value, so ``E[round(x)] = x``. A random 16-bit
    integer is added to the fp32 bit pattern and the low 16 bits are cut (bf16 is fp32's top half);
    sign-magnitude makes this symmetric for negative numbers. Non-bf16 targets round to nearest."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device="cpu", generator=generator)
    out = (bits + noise.to(bits.device)).bitwise_and_(-65536)
    return out.view(torch.float32).to(torch.bfloat16)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class BucketSpec:
    """How one set of parameters is reduced and sharded."""

    name: str
    params: list[tuple[str, nn.Parameter]]
    shard_group: Any = None
    """Ranks that split this bucket's optimizer states between them (None: this rank holds all)."""
    pre_reduce_group: Any = None
    """Replicas outside ``shard_group`` whose gradients must be summed in first (None: none)."""
    norm_owner: bool = True
    """Whether this rank's shard counts in global norms (False on all but one of identical replicas)."""


class _Bucket:
    """Flat parameter/gradient buffers of one bucket and this rank's shard of its states."""

    def __init__(self, spec: BucketSpec, reduce_dtype: torch.dtype, master: str = "fp32",
                 moments_dtype: torch.dtype = torch.float32) -> None:
        if not spec.params:
            raise ValueError(f"bucket {spec.name!r} has no parameters")
        dtypes = {p.dtype for _, p in spec.params}
        devices = {p.device for _, p in spec.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise TypeError(f"bucket {spec.name!r} mixes dtypes {dtypes} or devices {devices}; "
                            "cast the model to one dtype and device first")
        self.spec = spec
        self.name = spec.name
        self.reduce_dtype = reduce_dtype
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.params = [p for _, p in spec.params]
        self.names = [n for n, _ in spec.params]
        self.numel = sum(p.numel() for p in self.params)
        self.group_size = group_size(spec.shard_group)
        self.group_rank = group_rank(spec.shard_group)
        self.shard_numel = math.ceil(self.numel / self.group_size)
        self.padded_numel = self.shard_numel * self.group_size
        self.offsets: list[int] = []
        self.flat_param = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.flat_grad = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat_param[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.flat_param[off:off + n].view_as(p)
                self.offsets.append(off)
                off += n
        self.attach_grads()
        lo = self.group_rank * self.shard_numel
        self.shard_slice = slice(lo, lo + self.shard_numel)
        self.master_mode = master
        #: The fp32 master shard (None without one: the weights are the parameters' own shard).
        self.master = self.flat_param[self.shard_slice].to(torch.float32).clone() if master == "fp32" else None
        self.exp_avg = torch.zeros(self.shard_numel, dtype=moments_dtype, device=self.device)
        self.exp_avg_sq = torch.zeros(self.shard_numel, dtype=moments_dtype, device=self.device)
        self.step_t = torch.zeros((), dtype=torch.float32)

    # -------------------------------------------------------------------------- gradients
    def _grad_view(self, i: int) -> torch.Tensor:
        p, off = self.params[i], self.offsets[i]
        return self.flat_grad[off:off + p.numel()].view_as(p)

    def attach_grads(self) -> None:
        """Point every ``p.grad`` at its slice of the flat gradient buffer."""
        for i, p in enumerate(self.params):
            p.grad = self._grad_view(i)

    def gather_stray_grads(self) -> None:
        """Copy in gradients that live outside the buffer (someone set ``p.grad`` to None or a new tensor)."""
        for i, p in enumerate(self.params):
            view = self._grad_view(i)
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
        self.attach_grads()

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        self.attach_grads()

    def reduce_grad_shard(self) -> torch.Tensor:
        """This rank's shard of the summed gradient, in fp32 (``[S]``)."""
        self.gather_stray_grads()
        g = self.flat_grad if self.flat_grad.dtype == self.reduce_dtype else self.flat_grad.to(self.reduce_dtype)
        if self.spec.pre_reduce_group is not None:
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.spec.pre_reduce_group)
        if self.spec.shard_group is not None:
            out = torch.empty(self.shard_numel, dtype=g.dtype, device=g.device)
            _reduce_scatter(out, g, op=dist.ReduceOp.SUM, group=self.spec.shard_group)
        else:
            out = g
        # a fresh fp32 tensor: the flat buffer is zeroed for the next step
        return out.to(torch.float32, copy=True)

    # -------------------------------------------------------------------------- parameters
    def master_view(self) -> torch.Tensor:
        """The tensor holding this rank's weight shard between steps: the fp32 master, or the
        parameters' own shard (bf16 without a master). Checkpoints read and write it."""
        return self.master if self.master is not None else self.flat_param[self.shard_slice]

    def weights32(self) -> torch.Tensor:
        """This rank's weight shard in fp32 (the master, or the parameters' shard widened)."""
        if self.master is not None:
            return self.master
        return self.flat_param[self.shard_slice].to(torch.float32)

    def store(self, w32: torch.Tensor, generator: torch.Generator | None) -> None:
        """Write the updated fp32 shard back: into the master, or rounded into the parameters' shard
        (stochastically when ``generator`` is given), then publish."""
        if self.master is not None:
            if w32 is not self.master:
                self.master.copy_(w32)
        elif generator is not None:
            self.flat_param[self.shard_slice].copy_(stochastic_round(w32, self.dtype, generator))
        else:
            self.flat_param[self.shard_slice].copy_(w32)
        self.publish()

    def publish(self) -> None:
        """All-gather the updated master shards into the flat parameter buffer (the model's weights)."""
        if self.master is None:  # the local shard is already in place
            if self.spec.shard_group is not None:
                _all_gather(self.flat_param, self.flat_param[self.shard_slice].clone(), group=self.spec.shard_group)
            return
        shard = self.master.to(self.dtype)
        if self.spec.shard_group is None:
            self.flat_param.copy_(shard)
        else:
            _all_gather(self.flat_param, shard, group=self.spec.shard_group)

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq)
                   if t is not None)

    def layout(self) -> dict[str, Any]:
        return {
            "numel": self.numel, "shard_numel": self.shard_numel, "group_size": self.group_size,
            "group_rank": self.group_rank,
            "params": [(n, off, tuple(p.shape)) for n, off, p in zip(self.names, self.offsets, self.params)],
        }


class ZeroAdamW:
    """AdamW over buckets of parameters with sharded fp32 master weights and states.

    Not a ``torch.optim.Optimizer``: the learning rate and clipping threshold are passed to
    :meth:`step`, which returns the global gradient and parameter norms.
    """

    def __init__(
        self,
        buckets: Sequence[BucketSpec],
        *,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        grad_reduce_dtype: torch.dtype = torch.float32,
        norm_group: Any = None,
        master: str = "fp32",
        moments_dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
    ) -> None:
        if grad_reduce_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"grad_reduce_dtype must be torch.float32 or torch.bfloat16, got {grad_reduce_dtype}")
        state_bytes_per_param(master, moments_dtype)  # checks both
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"moments_dtype must be torch.float32 or torch.bfloat16, got {moments_dtype}")
        self.master = master
        self.moments_dtype = moments_dtype
        #: The stochastic rounding's generator (one per rank: callers pass a per-rank seed).
        self.generator = torch.Generator().manual_seed(int(rounding_seed))
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.grad_reduce_dtype = grad_reduce_dtype
        self.norm_group = norm_group
        self.buckets = [_Bucket(spec, grad_reduce_dtype, master, moments_dtype) for spec in buckets if spec.params]
        seen: set[int] = set()
        for b in self.buckets:
            for p in b.params:
                if id(p) in seen:
                    raise ValueError("a parameter appears in two buckets")
                seen.add(id(p))

    # -------------------------------------------------------------------------- step
    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()

    @torch.no_grad()
    def step(self, lr: float, max_grad_norm: float | None = None) -> dict[str, float]:
        """Reduce gradients, clip (when ``max_grad_norm``), update, publish weights, zero gradients.

        Returns ``{"grad_norm": ..., "param_norm": ...}`` (the weights' norm before this update),
        identical on every rank."""
        shards = [b.reduce_grad_shard() for b in self.buckets]
        device = self.buckets[0].device
        sq = torch.zeros(2, dtype=torch.float32, device=device)
        for b, g in zip(self.buckets, shards):
            if b.spec.norm_owner:
                sq[0] += g.square().sum()
                sq[1] += b.weights32().square().sum()
        if self.norm_group is not None:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.norm_group)
        grad_norm, param_norm = sq.sqrt().tolist()
        if max_grad_norm is not None and max_grad_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, so that one process matches torch exactly
            coef = min(max_grad_norm / (grad_norm + 1e-6), 1.0)
            if coef < 1.0:
                for g in shards:
                    g.mul_(coef)
        sr = self.generator if self.master == "stochastic" else None
        for b, g in zip(self.buckets, shards):
            w32 = b.weights32()
            m1, m2 = b.exp_avg, b.exp_avg_sq
            if m1.dtype != torch.float32:
                m1, m2 = m1.float(), m2.float()
            _adamw_functional(
                [w32], [g], [m1], [m2], [], [b.step_t],
                amsgrad=False, beta1=self.betas[0], beta2=self.betas[1], lr=float(lr),
                weight_decay=self.weight_decay, eps=self.eps, maximize=False,
            )
            if m1 is not b.exp_avg:  # bf16 moments: rounded like the weights
                for low, wide in ((b.exp_avg, m1), (b.exp_avg_sq, m2)):
                    low.copy_(stochastic_round(wide, low.dtype, sr) if sr is not None else wide)
            b.store(w32, sr)
            b.zero_grad()
        return {"grad_norm": grad_norm, "param_norm": param_norm}

    # -------------------------------------------------------------------------- accounting
    def state_bytes(self) -> int:
        """Optimizer-state bytes held by this rank (master weights and both Adam moments)."""
        return sum(b.state_nbytes() for b in self.buckets)

    def state_bytes_by_bucket(self) -> dict[str, int]:
        return {b.name: b.state_nbytes() for b in self.buckets}

    @property
    def step_count(self) -> int:
        return int(self.buckets[0].step_t.item()) if self.buckets else 0

    # -------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """This rank's shards, with the flat layout needed to reshard them elsewhere."""
        out = {
            "kind": type(self).__name__,
            "buckets": {
                b.name: {
                    "master": b.weights32().clone(), "exp_avg": b.exp_avg.clone(), "exp_avg_sq": b.exp_avg_sq.clone(),
                    "step": b.step_t.clone(), "layout": b.layout(),
                }
                for b in self.buckets
            },
        }
        if self.master == "stochastic":
            out["rounding_rng"] = self.generator.get_state()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["buckets"]
        if set(saved) != {b.name for b in self.buckets}:
            raise ValueError(f"optimizer state has buckets {sorted(saved)}, expected {[b.name for b in self.buckets]}")
        for b in self.buckets:
            s = saved[b.name]
            lay = s["layout"]
            if (lay["numel"], lay["shard_numel"], lay["group_rank"]) != (b.numel, b.shard_numel, b.group_rank):
                raise ValueError(
                    f"optimizer bucket {b.name!r} was saved as shard {lay['group_rank']} of "
                    f"{lay['group_size']} ({lay['shard_numel']} of {lay['numel']} elements); this rank holds "
                    f"shard {b.group_rank} of {b.group_size} ({b.shard_numel} of {b.numel})"
                )
            b.exp_avg.copy_(s["exp_avg"])
            b.exp_avg_sq.copy_(s["exp_avg_sq"])
            b.step_t.copy_(s["step"])
            if b.master is not None:
                b.master.copy_(s["master"])
            else:  # the saved fp32 shard is exactly representable: it was read from these weights
                b.flat_param[b.shard_slice].copy_(s["master"])
            b.publish()
        if "rounding_rng" in state:
            self.generator.set_state(state["rounding_rng"])


def split_params(named_params: Iterable[tuple[str, nn.Parameter]],
                 is_expert: Callable[[str], bool]) -> tuple[list, list]:
    """(non-expert, expert) lists of trainable named parameters."""
    dense, expert = [], []
    for name, p in named_params:
        if p.requires_grad:
            (expert if is_expert(name) else dense).append((name, p))
    return dense, expert


def _is_first(group: Any) -> bool:
    return group_rank(group) == 0


class ReplicatedAdamW(ZeroAdamW):
    """AdamW with whole states on every rank (the unsharded baseline): gradients all-reduced over
    DP x EP (non-expert) and DP (expert)."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, is_expert: Callable[[str], bool],
                 dp_group: Any = None, ep_group: Any = None, dpep_group: Any = None, norm_group: Any = None,
                 **kwargs: Any) -> None:
        dense, expert = split_params(named_params, is_expert)
        super().__init__([
            BucketSpec("dense", dense, None, dpep_group, _is_first(dpep_group)),
            BucketSpec("expert", expert, None, dp_group, _is_first(dp_group)),
        ], norm_group=norm_group, **kwargs)


class ShardedAdamW(ZeroAdamW):
    """ZeRO-1 over DP: every weight's states split across its DP replicas. With EP, non-expert
    gradients are first summed over the EP group (whose ranks then hold identical shards)."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, is_expert: Callable[[str], bool],
                 dp_group: Any = None, ep_group: Any = None, dpep_group: Any = None, norm_group: Any = None,
                 **kwargs: Any) -> None:
        dense, expert = split_params(named_params, is_expert)
        super().__init__([
            BucketSpec("dense", dense, dp_group, ep_group, _is_first(ep_group)),
            BucketSpec("expert", expert, dp_group, None, True),
        ], norm_group=norm_group, **kwargs)


class EPSO(ZeroAdamW):
    """The EP-aware sharded optimizer: non-expert states split across all DP x EP ranks (every one
    of them holds a replica of those weights), expert states across DP only (EP ranks hold different
    experts already)."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, is_expert: Callable[[str], bool],
                 dp_group: Any = None, ep_group: Any = None, dpep_group: Any = None, norm_group: Any = None,
                 **kwargs: Any) -> None:
        dense, expert = split_params(named_params, is_expert)
        super().__init__([
            BucketSpec("dense", dense, dpep_group, None, True),
            BucketSpec("expert", expert, dp_group, None, True),
        ], norm_group=norm_group, **kwargs)


OPTIMIZERS: dict[str, type[ZeroAdamW]] = {"adamw": ReplicatedAdamW, "sharded": ShardedAdamW, "epso": EPSO}


def state_bytes_formula(kind: str, n_dense: int, n_expert_local: int, dp: int, ep: int,
                        per_param: int = STATE_BYTES_PER_PARAM) -> int:
    """Optimizer-state bytes per rank: ``per_param`` bytes (12: fp32 master, exp_avg, exp_avg_sq;
    :func:`state_bytes_per_param` for the other modes) per element of the rank's shards, shards
    padded to equal size.

    ``n_dense``: non-expert parameters (replicated on every DP x EP rank); ``n_expert_local``: expert
    parameters held by one EP rank (total expert parameters / EP)."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"kind must be one of {list(OPTIMIZERS)}, got {kind!r}")
    dense_shards = {"adamw": 1, "sharded": dp, "epso": dp * ep}[kind]
    expert_shards = 1 if kind == "adamw" else dp
    per = per_param
    return per * (math.ceil(n_dense / dense_shards) + math.ceil(n_expert_local / expert_shards))

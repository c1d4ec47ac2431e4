"""The trainer's own set-up and one training step, run as one rank of a large world on torch's fake
process group (``init_process_group("fake")``: collectives return at once, no other process exists)
with the model on the meta device; every collective and the compute per op kind are recorded as
:class:`trainer.scale.profile.StepProfile` records.

What runs is the trainer's code: :func:`trainer.layout.build_layout` (the device mesh and its
process groups), :meth:`Trainer.build_model` (model build, TP / EP / activation checkpointing /
FSDP2, the pipeline stage), :meth:`Trainer.build_optimizer` (ZeRO-1, EPSO, FSDP2's shards), the
loader's shard arithmetic, :meth:`Trainer.forward_backward` (1F1B under PP) and
:meth:`Trainer.optimizer_step`, and the checkpoint's planning (which segments a rank writes,
:func:`trainer.checkpoint.save.model_tensors` and :func:`trainer.checkpoint.optim_state.optimizer_writes`).

Meta tensors carry shapes, not values. Where the step reads a value (a norm, a count), the
recorder answers: a copy to the host reads zeros, a boolean ``.item()`` reads True (the checks that
take the ordinary path), ``bincount`` gives its ``minlength`` zeros; the MoE layer's experts run at
uniform routing's average rows (:func:`fastmoe_xpu.autograd.moe_experts.meta_experts`, and an
all-to-all dispatch sends each rank the expected rows).

``fastmoe-plan ... --trace`` (:mod:`trainer.scale.command`) prints it;
:func:`trace_profiles` returns the records for the step-time model.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from unittest import mock
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .profile import Collective, Compute, StepProfile

_DTYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
           torch.int64: "int64", torch.int32: "int32", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = "fp8"


def _numel(ts: Any) -> int:
    if isinstance(ts, torch.Tensor):
        return ts.numel()
    return sum(_numel(t) for t in ts)


def _first(ts: Any) -> torch.Tensor:
    return ts if isinstance(ts, torch.Tensor) else _first(ts[0])


# c10d op name -> (collective op, index of the process group argument, what ``elements`` counts:
# the index of the tensor argument(s) whose numel is the whole buffer, see trainer.scale.profile)
_C10D = {
    "allreduce_": ("all_reduce", 1, 0), "allreduce_coalesced_": ("all_reduce", 1, 0),
    "_allgather_base_": ("all_gather", 2, 0), "allgather_": ("all_gather", 2, 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 2, 0), "allgather_coalesced_": ("all_gather", 2, 0),
    "_reduce_scatter_base_": ("reduce_scatter", 2, 1), "reduce_scatter_": ("reduce_scatter", 2, 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, 1),
    "alltoall_base_": ("all_to_all", 2, 1), "alltoall_": ("all_to_all", 2, 1),
    "broadcast_": ("broadcast", 1, 0), "send": ("send", 1, 0), "recv_": ("recv", 1, 0),
    "recv_any_source_": ("recv", 1, 0), "barrier": ("barrier", 1, None),
}
# _c10d_functional op name -> (collective op, index of the group name argument); elements: argument 0
# (an all-gather's input is 1/W of the gathered buffer: scaled by the group size)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2), "all_reduce_": ("all_reduce", 2), "all_reduce_coalesced": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 2), "all_gather_into_tensor_out": ("all_gather", 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 2), "reduce_scatter_tensor": ("reduce_scatter", 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3), "all_to_all_single": ("all_to_all", 3),
    "broadcast": ("broadcast", 2), "broadcast_": ("broadcast", 2),
}

#: What a collective carries, from the code that issued it (the innermost matching frame of the call
#: stack): path fragment -> label.
LABELS = (("fastmoe_xpu/dist/dispatch.py", "ep tokens"), ("fastmoe_xpu/dist/collectives.py", "ep tokens"),
          ("torch/distributed/fsdp/", "fsdp weights and gradients"), ("trainer/optim/", "optimizer"),
          ("torch/distributed/pipelining/", "pipeline activations"), ("trainer/model/loss.py", "loss"),
          ("trainer/checkpoint/", "checkpoint"), ("trainer/parallelism/broadcast.py", "weights broadcast"),
          ("trainer/parallelism/tp.py", "tp activations"), ("torch/distributed/device_mesh", "mesh"))
#: Labels whose bytes are the weights and gradients :meth:`Plan.traffic_bytes` counts.
WEIGHT_LABELS = ("optimizer", "fsdp weights and gradients")


def label_of_stack() -> str:
    """The :data:`LABELS` label of the innermost frame that has one ("" when none does)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        for frag, label in LABELS:
            if frag in name:
                return label
        f = f.f_back
    return ""


class CollectiveRecorder(TorchDispatchMode):
    """Records every ``c10d`` and ``_c10d_functional`` op the code under it issues, as
    :class:`Collective` keys with a call count, in the current :attr:`phase`; on meta tensors it also
    answers the value reads described in the module doc, and counts element-wise ops' bytes.

    The same recorder runs on a real (gloo) process group: then it only records."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.calls: dict[tuple, int] = {}
        self.memory_ops: dict[str, list[float]] = {}
        self.flops: dict[str, float] = {}
        """FLOPs of the step by kind (:func:`compute_records`), counted by torch's flop counter's
        formulas (``torch.utils.flop_counter``) without its decompositions, which cost a meta trace
        of a large model several times its own time; the experts' GEMMs told apart by
        :data:`fastmoe_xpu.autograd.moe_experts.META_EXPERTS_SCOPE`."""
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._pure: dict[Any, bool] = {}
        self._layouts: dict[tuple, tuple] = {}

    # ------------------------------------------------------------------ groups
    def _group_ranks(self, pg: Any) -> tuple[int, ...]:
        if isinstance(pg, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(pg)
        elif not isinstance(pg, dist.ProcessGroup):
            pg = dist.ProcessGroup.unbox(pg)
        key = id(pg)
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(pg))
        return self._ranks[key]

    def _record(self, op: str, group: tuple[int, ...], tensor: torch.Tensor | None, elements: int,
                peer: int | None = None) -> None:
        dtype = _DTYPES.get(tensor.dtype, "fp32") if tensor is not None else "fp32"
        if peer is not None:  # a point-to-point op's group: this rank and its peer, in that order
            group = (dist.get_rank(), group[peer])
        key = (op, group, dtype, int(elements), self.phase, label_of_stack())
        self.calls[key] = self.calls.get(key, 0) + 1

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        if ns == "c10d" and name in _C10D:
            op, gi, ti = _C10D[name]
            group = self._group_ranks(args[gi])
            tensor = _first(args[ti]) if ti is not None and _numel(args[ti]) else None
            elements = _numel(args[ti]) if ti is not None else 0
            self._record(op, group, tensor, elements, peer=args[2] if op in ("send", "recv") else None)
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            op, gi = _FUNCTIONAL[name]
            group = self._group_ranks(args[gi])
            elements = _numel(args[0]) * (len(group) if op == "all_gather" else 1)
            self._record(op, group, _first(args[0]), elements)
        elif ns == "c10d" and name not in ("monitored_barrier_",):
            raise RuntimeError(f"the trace does not know collective c10d.{name}; add it to trainer.scale.trace")
        out = self._meta_answer(func, args, kwargs)
        if out is not NotImplemented:
            return out
        out = self._meta_cached(func, args, kwargs) if ns == "aten" else None
        if out is None:
            out = func(*args, **kwargs)
        if ns == "aten" and self.phase == "step":
            packet = func._overloadpacket
            if packet in FLOP_REGISTRY:
                self._count_flops(packet, args, kwargs, out)
            else:
                self._count_memory(name, args, out)
        return out

    def _count_flops(self, packet: Any, args: tuple, kwargs: dict, out: Any) -> None:
        from fastmoe_xpu.autograd.moe_experts import META_EXPERTS_SCOPE

        scope = META_EXPERTS_SCOPE[0]
        if scope == "replay":  # the meta experts' backward rebuilding its graph: not work of the step
            return
        n = FLOP_REGISTRY[packet](*args, **kwargs, out_val=out)
        name = str(packet)
        if scope == "experts":
            kind = "grouped_gemm"
        else:
            kind = "attention" if "bmm" in name or "attention" in name else "gemm"
        self.flops[kind] = self.flops.get(kind, 0) + n

    def _meta_cached(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """A pure op's meta output from an earlier call with the same input shapes, strides, dtypes and
        arguments, made anew (an empty meta tensor of the remembered layout): meta kernels of
        element-wise ops are Python decompositions of ~0.3-1 ms each, thousands of them per step.
        None when the op may not be answered so (it mutates, aliases, returns several tensors, or
        touches a non-meta tensor) or was not seen yet (then it runs, and is remembered)."""
        ok = self._pure.get(func)
        if ok is None:
            schema = func._schema
            ok = self._pure[func] = (not schema.is_mutable and len(schema.returns) == 1
                                     and schema.returns[0].alias_info is None
                                     and str(schema.returns[0].type) == "Tensor")
        if not ok:
            return None
        try:
            key = (func, _signature(args), _signature(kwargs))
        except _NotMeta:
            return None
        hit = self._layouts.get(key)
        if hit is not None:
            return torch.empty_strided(hit[0], hit[1], dtype=hit[2], device="meta")
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_meta:
            self._layouts[key] = (tuple(out.shape), tuple(out.stride()), out.dtype)
        return out

    def _meta_answer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        aten = torch.ops.aten
        if not (args and isinstance(args[0], torch.Tensor) and args[0].is_meta):
            return NotImplemented
        if func is aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default and str(kwargs.get("device", "meta")) != "meta":
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        if func is aten.bincount.default:
            n = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.zeros(n, dtype=torch.int64, device="meta")
        return NotImplemented

    def _count_memory(self, name: str, args: tuple, out: Any) -> None:
        if name in ("view", "_unsafe_view", "t", "transpose", "expand", "detach", "alias",
                                            "empty", "zeros", "slice", "select", "split", "as_strided",
                                            "split_with_sizes", "unsqueeze", "squeeze", "permute", "reshape"):
            return
        nbytes = 0
        for a in list(args) + ([out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (list, tuple)) else []):
            if isinstance(a, torch.Tensor):
                nbytes += a.numel() * a.element_size()
        rec = self.memory_ops.setdefault(name, [0, 0.0])
        rec[0] += 1
        rec[1] += nbytes

    def collectives(self) -> list[Collective]:
        return [Collective(op=op, group=g, dtype=dt, elements=n, count=c, phase=ph, label=lb)
                for (op, g, dt, n, ph, lb), c in sorted(self.calls.items(), key=lambda kv: (PHASE_ORDER[kv[0][4]], kv[0]))]


PHASE_ORDER = {"setup": 0, "step": 1, "checkpoint": 2}


class _NotMeta(Exception):
    """An argument the meta cache does not key (a tensor off the meta device, an unknown object)."""


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise _NotMeta
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in sorted(x.items()))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(x).__name__, x)
    raise _NotMeta


def _flop_registry() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry

    return flop_registry


FLOP_REGISTRY = _flop_registry()


def compute_records(flops: dict[str, float], memory_ops: dict[str, list[float]]) -> list[Compute]:
    """The step's FLOPs by kind (``grouped_gemm``: batched GEMMs inside the decoder layers' MoE blocks
    (``*.mlp``); ``attention``: every other batched GEMM or attention op, the score and value
    products; ``gemm``: every matmul, the projections, router and LM head) and the element-wise ops'
    bytes (``memory``)."""
    out = [Compute(kind=k, flops=float(v), bytes=0.0, label="flop counter's formulas")
           for k, v in sorted(flops.items())]
    if memory_ops:
        out.append(Compute(kind="memory", flops=0.0, bytes=float(sum(v[1] for v in memory_ops.values())),
                           count=int(sum(v[0] for v in memory_ops.values())), label="element-wise ops' bytes"))
    return out


# ----------------------------------------------------------------------------- one rank's trace
@dataclass
class RankTrace:
    """What one traced rank did and holds, beside its :class:`StepProfile`."""

    profile: StepProfile
    coords: dict[str, int]
    params: dict[str, int]
    """``non_expert`` and ``expert`` elements this rank holds (FSDP2 shards: their local part)."""
    optimizer: list[dict[str, Any]]
    """Per bucket: name, numel, shard group ranks, shard position, shard numel, pre-reduce group size,
    norm owner."""
    checkpoint: dict[str, Any]
    """``model``: segment keys and bytes this rank writes; ``optim``: the same for optimizer states."""
    data: tuple[int, int]
    """[first, last) global instance indices of this rank's share of the first step's batch."""
    groups: dict[str, tuple[int, ...]]
    seconds: float = 0.0
    segments: list[Any] = field(default_factory=list)
    """This rank's model checkpoint segments (every weight it holds), for the world-wide check."""


def build_config(preset: str, *, world: int, pp: int = 1, ep: int = 1, dp: int = 0, tp: int = 1,
                 ac: str | Sequence[str] = "", fsdp: bool = False, optimizer: str | None = None,
                 micro_batch: int | None = None, global_batch: int | None = None, context: int | None = None,
                 ep_comm: str | None = None, weights: str = "bf16", overrides: dict[str, Any] | None = None) -> Any:
    """The trainer config of a preset at this layout, validated for ``world`` (raises ConfigError in
    one line). ``weights``: the parameters' dtype (``--model.param_dtype``; bf16 as the planner
    assumes; the meta device has no autocast, so the step runs in the weights' dtype).
    ``overrides``: ``{"section.name": value}``."""
    from ..config import validate
    from ..config.presets import get_preset
    from ..parallelism.plan import DEFAULT_VOCAB

    cfg = get_preset(preset)
    p = cfg.parallel
    p.pp, p.ep, p.dp, p.tp = pp, ep, dp, tp
    p.ac = ac if isinstance(ac, str) else ",".join(ac)
    p.dp_shard = "fsdp" if fsdp else "none"
    p.pp_meta_init = pp > 1
    if optimizer:
        cfg.optim.name = optimizer
    if micro_batch:
        cfg.schedule.micro_batch = micro_batch
    if global_batch:
        cfg.schedule.global_batch = global_batch
    if context:
        cfg.data.context = context
    if ep_comm:
        cfg.model.ep_dispatch = "alltoall" if ep_comm in ("all_to_all", "alltoall") else ep_comm
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = DEFAULT_VOCAB
    cfg.model.param_dtype, cfg.model.autocast = weights, "none"
    cfg.logging.progress = False
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return validate(cfg, world)


@contextlib.contextmanager
def fake_world(rank: int, world: int):  # noqa: ANN201
    """torch.distributed's fake process group as global rank ``rank`` of ``world`` (torch's
    ``FakeStore``; collectives return at once, nothing reaches another process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; the trace needs its own")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fsdp_on_meta():  # noqa: ANN201
    """FSDP2 over a meta model: its parameters and buffers on the meta device (``fully_shard`` takes
    its device from the mesh, a host mesh here, and refuses meta parameters at its first forward);
    on a fake process group nothing else needs values."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state, _fully_shard

    handles = (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state)
    saved = ([m._get_device_handle for m in handles], _fsdp_init._get_device_from_mesh,
             _fully_shard._get_device_from_mesh, _fsdp_param_group.FSDPParamGroup._validate_no_meta_params)

    def handle(device_type: str, get: Any = saved[0][0]) -> Any:
        return torch.cpu if device_type == "meta" else get(device_type)  # the host's no-op streams and events

    for m in handles:
        m._get_device_handle = handle
    _fsdp_init._get_device_from_mesh = _fully_shard._get_device_from_mesh = lambda mesh: torch.device("meta")
    _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        yield
    finally:
        for m, h in zip(handles, saved[0]):
            m._get_device_handle = h
        (_fsdp_init._get_device_from_mesh, _fully_shard._get_device_from_mesh,
         _fsdp_param_group.FSDPParamGroup._validate_no_meta_params) = saved[1:]


def _meta_batches(cfg: Any, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    B, C = cfg.schedule.micro_batch, cfg.data.context
    return [(torch.empty(B, C, dtype=torch.int64, device="meta"), torch.empty(B, C, dtype=torch.int64, device="meta"))
            for _ in range(n)]


def _fix_expert_ids(model: torch.nn.Module, ep_rank: int) -> None:
    """Expert-id buffers built under ``torch.device("meta")`` hold no ids: this rank's range again, on
    the host (checkpoints key expert weights by them)."""
    from fastmoe_xpu.dist.sharding import EXPERT_IDS_NAME

    for mod in model.modules():
        buf = mod._buffers.get(EXPERT_IDS_NAME)
        if buf is not None and buf.is_meta:
            n = buf.numel()
            mod._buffers[EXPERT_IDS_NAME] = torch.arange(ep_rank * n, (ep_rank + 1) * n, dtype=torch.int64)


def step_trainer(cfg: Any, layout: Any) -> Any:
    """A :class:`trainer.trainer.Trainer` for ``cfg`` on ``layout`` with what one training step needs
    (model, optimizer, schedule, loss bookkeeping) and nothing of a run (data set, output
    directory, metrics, checkpoints directory): the trace's and its gloo comparison's."""
    from ..optim.fsdp import is_fsdp
    from ..optim.schedule import Schedule
    from ..trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg, t.layout, t.pipeline, t.device = cfg, layout, None, layout.device
    t.hf = t.lora_config = t.document_eos = None
    with torch.device("meta") if layout.device.type == "meta" else contextlib.nullcontext():
        t.model = t.build_model()  # the full model is never allocated: only this rank's part, on meta
    t.model.train()
    t.fsdp = is_fsdp(t.model)
    if layout.device.type == "meta":
        for mod in (t.pipeline.modules if t.pipeline is not None else [t.model]):
            _fix_expert_ids(mod, layout.ep_rank)
    t.optimizer = t.build_optimizer()
    t.schedule = Schedule(cfg.schedule, cfg.optim.lr)
    t.step = 0
    t.micro_batches_global = cfg.schedule.global_batch // cfg.schedule.micro_batch
    t._autocast_dtype = t._resolve_autocast()
    t._local_loss = torch.zeros((), device=layout.device)
    return t


def pipeline_metadata(t: Any, rec: CollectiveRecorder | None) -> None:
    """Under PP: the stages' metadata inference before their first micro-batch (a forward and a
    backward on placeholders, send/recv of pickled shapes) recorded as set-up; on the fake process group, where no neighbour sends anything, the
    received metadata are made here: the previous stage's output (:meth:`StageModel.boundary`) and
    the gradients of this stage's outputs."""
    if t.pipeline is None:
        return
    try:
        from torch.distributed.pipelining._utils import extract_tensor_metas
        from torch.distributed.pipelining.stage import _StageBackwardMeta, _StageForwardMeta
    except ImportError:  # torch before 2.13: shapes inferred in _shape_inference (recv_object_list)
        extract_tensor_metas = None
    cfg = t.cfg
    fake = t.device.type == "meta"
    for stage, mod in zip(t.pipeline.stages, t.pipeline.modules):
        def setup(fn: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                if rec is None:
                    return fn(*args, **kwargs)
                old, rec.phase = rec.phase, "setup"
                try:
                    return fn(*args, **kwargs)
                finally:
                    rec.phase = old
            return wrapped

        for infra in ("_prepare_forward_infra", "_prepare_backward_infra"):  # the metadata inference's step
            if hasattr(stage, infra):
                setattr(stage, infra, setup(getattr(stage, infra)))
        if extract_tensor_metas is None:
            if fake:
                stage._shape_inference = _shapes_received_as_sent(stage, mod, cfg)
            continue
        if fake:
            def recv(src: int, stage: Any = stage, mod: Any = mod) -> Any:
                if src < stage.stage_index:
                    metas = mod.boundary(cfg.schedule.micro_batch, cfg.data.context,
                                         next(mod.parameters()).dtype, "meta")
                    return _StageForwardMeta(forward_metas=extract_tensor_metas(metas))
                outs = stage._stage_meta.outputs
                return _StageBackwardMeta(backward_metas=tuple(m if m.requires_grad else None for m in outs))
            stage._recv_meta = recv
        else:
            stage._recv_meta = setup(stage._recv_meta)
        stage._send_meta = setup(stage._send_meta)


def _shapes_received_as_sent(stage: Any, mod: Any, cfg: Any) -> Any:
    """torch before 2.13 infers a stage's input shapes by receiving the previous stage's output metas as a
    pickled object; on the fake process group nothing arrives, so the receive is answered here with what
    the previous stage sends (:meth:`StageModel.boundary`). The send and the rest run as in a real run."""
    infer = stage._shape_inference

    def shape_inference(args: tuple, kwargs: dict | None = None) -> Any:
        if stage.is_first:
            return infer(args, kwargs)
        metas = tuple(mod.boundary(cfg.schedule.micro_batch, cfg.data.context, next(mod.parameters()).dtype,
                                   "meta"))

        def recv_object_list(objects: list, *_: Any, **__: Any) -> None:
            objects[0] = metas

        with mock.patch.object(torch.distributed, "recv_object_list", recv_object_list):
            return infer(args, kwargs)

    return shape_inference


def micro_batches_per_rank(cfg: Any, layout: Any) -> int:
    return cfg.schedule.global_batch // (layout.data_world * cfg.schedule.micro_batch)


def run_step(t: Any, batches: Sequence[Any], rec: CollectiveRecorder) -> None:
    """One training step of ``t`` on ``batches`` under ``rec`` (phase ``"step"``, its FLOPs counted
    there): forward and backward, the optimizer step."""
    from ..trainer import _weights_hold_still

    rec.phase = "step"
    with _weights_hold_still():
        t.forward_backward(batches)
    t.optimizer_step()


def checkpoint_plan(t: Any, rec: CollectiveRecorder) -> dict[str, Any]:
    """Which checkpoint tensors this rank writes (the full checkpoint's model and optimizer parts),
    by the checkpoint's own planning code; its collectives recorded in phase ``"checkpoint"``."""
    from fastmoe_xpu.dist.sharding import is_expert_weight

    from ..checkpoint.optim_state import optimizer_writes
    from ..checkpoint.save import _model_tensors
    from ..checkpoint.writers import coords_of, tp_rank_of

    rec.phase = "checkpoint"
    lay = t.layout
    model = t.model
    tensors = _model_tensors(model, coords_of(lay), None, is_expert_weight, tp_rank_of(lay))
    optim = optimizer_writes(model, t.optimizer, is_expert_weight, tp_rank_of(lay))
    return {"model": {k: v.numel() * v.element_size() for k, v in tensors.items()},
            "optim": {k: v.numel() * v.element_size() for k, v in optim.items()}}


def _step_on(cfg: Any, device: torch.device, rec: CollectiveRecorder, batches: Any = None) -> dict[str, Any]:
    """The trainer's set-up and one step of ``cfg`` as this process's rank of the initialised process
    group, under ``rec``; the model on ``device`` (meta: shapes only, for the fake process group).
    ``batches``: ``(input_ids, labels)`` pairs (default: meta tensors of the micro-batch's shape)."""
    from fastmoe_xpu.dist.sharding import is_expert_weight

    from ..checkpoint.writers import model_segments, tp_rank_of
    from ..data.loader import ShardedLoader
    from ..layout import build_layout

    p = cfg.parallel
    lay = build_layout(p.pp, p.dp, p.ep, torch.device("cpu"), tp=p.tp)
    lay.device = device
    t = step_trainer(cfg, lay)
    pipeline_metadata(t, rec)
    loader = ShardedLoader(_Shape(cfg.data.context), cfg.schedule.global_batch, cfg.schedule.micro_batch,
                           dp_rank=lay.data_rank, dp_size=lay.data_world, verify=False)
    run_step(t, batches if batches is not None else _meta_batches(cfg, loader.micro_batches_per_step), rec)
    return {"trainer": t, "layout": lay, "loader": loader, "checkpoint": checkpoint_plan(t, rec),
            "segments": model_segments(t.model, is_expert_weight, tp_rank_of(lay))}


def record_rank(cfg: Any, batches: Sequence[Any]) -> list[Collective]:
    """The collectives of the trainer's set-up and one step of ``cfg`` on ``batches`` (this rank's
    micro-batches) in the initialised, real process group (gloo on the host): what :func:`trace_rank`
    records on the fake one, by the same recorder."""
    rec = CollectiveRecorder()
    with rec:
        _step_on(cfg, torch.device("cpu"), rec, batches)
    return rec.collectives()


def trace_rank(cfg: Any, rank: int, world: int) -> RankTrace:
    """Set up and run one step of ``cfg`` as global rank ``rank`` of ``world`` on the fake process
    group (see the module doc)."""
    from ..checkpoint.writers import tp_rank_of

    t0 = time.perf_counter()
    p = cfg.parallel
    rec = CollectiveRecorder()
    with fake_world(rank, world), rec, fsdp_on_meta():
        done = _step_on(cfg, torch.device("meta"), rec)
        t, lay, loader = done["trainer"], done["layout"], done["loader"]
        idx = loader.rank_indices(0)
        prof = StepProfile(rank=rank, world=world, source="trace",
                           tokens_per_step=cfg.schedule.global_batch * cfg.data.context,
                           micro_batches=loader.micro_batches_per_step, pp=p.pp, stage=lay.pp_rank,
                           collectives=rec.collectives(), compute=compute_records(rec.flops, rec.memory_ops),
                           memory_bytes=_memory(t))
        dense, expert = _local_params(t.model)
        return RankTrace(profile=prof, coords={"pp": lay.pp_rank, "dp": lay.dp_rank, "ep": lay.ep_rank,
                                               "tp": lay.tp_rank},
                         params={"non_expert": dense, "expert": expert},
                         optimizer=_buckets(t.model, t.optimizer, tp_rank_of(lay)), checkpoint=done["checkpoint"],
                         data=(int(idx[0]), int(idx[-1]) + 1), groups=_groups(lay),
                         seconds=time.perf_counter() - t0, segments=done["segments"])


class _Shape:
    """The loader's view of a data set when only its shard arithmetic is wanted."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.num_instances = 1
        self.fingerprint = ""


def _local_params(model: torch.nn.Module) -> tuple[int, int]:
    from fastmoe_xpu.dist.sharding import is_expert_weight

    dense = expert = 0
    for n, prm in model.named_parameters():
        local = prm.to_local() if hasattr(prm, "to_local") else prm
        if is_expert_weight(n):
            expert += local.numel()
        else:
            dense += local.numel()
    return dense, expert


def _memory(t: Any) -> dict[str, int]:
    w = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in t.model.parameters())
    return {"weights": w, "gradients": w, "optimizer": int(t.optimizer.state_bytes())}


def _buckets(model: torch.nn.Module, optimizer: Any, tp_rank: int | None) -> list[dict[str, Any]]:
    from fastmoe_xpu.dist.groups import group_rank, group_size
    from fastmoe_xpu.dist.sharding import is_expert_weight

    from ..checkpoint.optim_state import bucket_segments

    out = []
    for b in optimizer.buckets:
        fsdp = hasattr(b, "checkpoint_states")
        spec = getattr(b, "spec", None)
        shard = getattr(spec, "shard_group", None)
        pre = getattr(spec, "pre_reduce_group", None)
        out.append({"name": b.name, "numel": int(getattr(b, "numel", 0)),
                    "shard_group": tuple(dist.get_process_group_ranks(shard)) if shard is not None else (dist.get_rank(),),
                    "shard_rank": group_rank(shard), "shard_numel": int(getattr(b, "shard_numel", 0)),
                    "pre_reduce_group": tuple(dist.get_process_group_ranks(pre)) if pre is not None else (dist.get_rank(),),
                    "norm_owner": bool(getattr(spec, "norm_owner", True)),
                    "state_bytes": int(b.state_nbytes()), "fsdp": fsdp,
                    # (key, first element, elements) of every checkpoint segment in the flat buffer; FSDP2:
                    # (name, global shape, local shape) of every sharded weight
                    "segments": [] if fsdp else [(o.seg.key, o.offset, o.seg.numel)
                                                 for o in bucket_segments(model, b, is_expert_weight, tp_rank)],
                    "sharded": [(n, tuple(p.shape), tuple(p.to_local().shape)) for n, p in zip(b.names, b.params)]
                    if fsdp else []})
    return out


def _groups(lay: Any) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, g in (("ep", lay.ep_group), ("tp", lay.tp_group), ("dp", lay.dp_group), ("dp_ep", lay.dpep_group),
                    ("pp", lay.pp_group)):
        if g is not None and dist.get_world_size(g) > 1:  # (the pipeline's group exists at PP=1 too)
            out[name] = tuple(dist.get_process_group_ranks(g))
    return out


# ----------------------------------------------------------------------------- which ranks
def auto_ranks(pp: int, dp: int, ep: int, tp: int = 1) -> list[int]:
    """The first and last rank of every pipeline stage, one rank at each expert (or TP) position
    (of the first stage), and the world's last rank."""
    from ..checkpoint.writers import layout_rank

    inner = ep * tp
    stage = dp * inner
    world = pp * stage
    ranks = {world - 1}
    for s in range(pp):
        ranks |= {s * stage, s * stage + stage - 1}
    ranks |= {layout_rank(0, 0, e, dp=dp, ep=inner) for e in range(inner)}
    return sorted(ranks)


def parse_ranks(spec: str | Sequence[int], world: int, pp: int, dp: int, ep: int, tp: int = 1) -> list[int]:
    """``"auto"`` (:func:`auto_ranks`) or a comma-separated list / sequence of global ranks;
    ValueError naming the nearest valid rank for one outside the world."""
    if isinstance(spec, str) and spec.strip() == "auto":
        return auto_ranks(pp, dp, ep, tp)
    if isinstance(spec, str):
        try:
            ranks = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--ranks takes 'auto' or comma-separated global ranks, got {spec!r}") from None
    else:
        ranks = [int(r) for r in spec]
    if not ranks:
        raise ValueError("--ranks names no rank; give 'auto' or global ranks such as 0,5")
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"--ranks {r} is outside the world [0, {world}); the nearest valid rank is "
                             f"{min(max(r, 0), world - 1)}")
    return sorted(set(ranks))


def _trace_one(args: tuple[Any, int, int]) -> RankTrace:
    return trace_rank(*args)


def default_jobs() -> int:
    """Worker processes for a trace: the CPUs this process may use, at most 2 (each rank's trace is
    one process of ~0.5 GiB at the 220B model)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cpus))


def trace_world(cfg: Any, world: int, ranks: Sequence[int], *, progress: bool = False,
                jobs: int = 1) -> dict[int, RankTrace]:
    """:func:`trace_rank` for each of ``ranks``: in this process (``jobs`` 1), or in ``jobs`` fresh
    worker processes (each with its own fake process group); a progress line on stderr when
    ``progress``."""
    out: dict[int, RankTrace] = {}
    t0 = time.perf_counter()

    def tick(done: int, last: int) -> None:
        if progress:
            print(f"\rtraced {done}/{len(ranks)} rank(s), last {last}, {time.perf_counter() - t0:.0f}s", end="",
                  file=sys.stderr, flush=True)

    if jobs <= 1 or len(ranks) <= 1:
        for r in ranks:
            out[r] = trace_rank(cfg, r, world)
            tick(len(out), r)
    else:
        import concurrent.futures as cf
        import multiprocessing as mp
        import os

        # the workers' fake groups warn, per rank, that no backend serves an undefined device type
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(ranks)), mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_trace_one, (cfg, r, world)): r for r in ranks}
            for fut in cf.as_completed(futures):
                r = futures[fut]
                out[r] = fut.result()
                tick(len(out), r)
    if progress:
        print(f"\rtraced {len(ranks)} rank(s) in {time.perf_counter() - t0:.0f}s" + " " * 20, file=sys.stderr,
              flush=True)
    return {r: out[r] for r in sorted(out)}


def trace_profiles(preset: str, *, world: int, pp: int = 1, ep: int = 1, dp: int = 0, tp: int = 1,
                   ac: str | Sequence[str] = "", fsdp: bool = False, optimizer: str | None = None,
                   ranks: str | Sequence[int] = "auto", micro_batch: int | None = None,
                   global_batch: int | None = None, context: int | None = None,
                   ep_comm: str | None = None, progress: bool = False, jobs: int = 1) -> dict[int, StepProfile]:
    """One :class:`StepProfile` (source ``"trace"``) per traced rank of the layout.

    ``ranks``: ``"auto"`` (the first and last rank of every pipeline stage, one rank at each expert
    position, the world's last rank) or the global ranks to trace. ``fsdp``: FSDP2 on the non-expert
    weights (``--parallel.dp_shard fsdp``); ``optimizer``: adamw, sharded (ZeRO-1) or epso (default:
    the preset's). ``ep_comm``: the EP token exchange (``all_to_all`` or ``allgather``; default the
    preset's). ``jobs``: worker processes (:func:`trace_world`). Raises ValueError (ConfigError) in one
    line for a layout the trainer refuses."""
    cfg = build_config(preset, world=world, pp=pp, ep=ep, dp=dp, tp=tp, ac=ac, fsdp=fsdp, optimizer=optimizer,
                       micro_batch=micro_batch, global_batch=global_batch, context=context, ep_comm=ep_comm)
    p = cfg.parallel
    chosen = parse_ranks(ranks, world, p.pp, p.dp, p.ep, p.tp)
    return {r: tr.profile for r, tr in trace_world(cfg, world, chosen, progress=progress, jobs=jobs).items()}

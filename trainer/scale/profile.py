"""What one rank does in one training step, as the step-time model reads it.

A :class:`StepProfile` comes either from a trace of the trainer's own code on a fake process group (one
process playing one rank of the real world) or from the planner's formulas; the model
(:mod:`trainer.scale.model`) prices both the same way.

Conventions, the same in every producer:

* ``Collective.elements`` counts the elements of the *whole* buffer the collective is about, per call:
  an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's unscattered input, an
  all-to-all's input (this rank's, all destinations together), a broadcast's tensor, a send's or recv's
  tensor. The bytes a rank puts on the wire follow from the op, the group size and this number (the
  ring algorithms' factors: :func:`wire_bytes`).
* ``Collective.group`` lists the group's global ranks in group-rank order; the model reads from it which
  links the group spans (intra- or inter-node) for a given number of devices per node.
* ``Collective.phase``: ``"setup"`` (once per run: model broadcast, group creation barriers), ``"step"``
  (every optimizer step: what the step time is made of) or ``"checkpoint"``.
* ``Compute.kind``: ``"gemm"`` (dense matmuls), ``"grouped_gemm"`` (expert GEMMs), ``"attention"``, or
  ``"memory"`` (element-wise, norms, softmax, copies: priced by bytes). ``flops`` and ``bytes`` are per
  step, summed over ``count`` launches, forward, backward and recomputation together.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: Bytes per element of the dtype names the records use.
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int64": 8, "int32": 4, "int8": 1,
               "uint8": 1, "bool": 1}

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv",
                  "barrier")
PHASES = ("setup", "step", "checkpoint")
COMPUTE_KINDS = ("gemm", "grouped_gemm", "attention", "memory")


@dataclass(frozen=True)
class Collective:
    op: str
    group: tuple[int, ...]
    dtype: str
    elements: int
    count: int = 1
    phase: str = "step"
    label: str = ""
    """Free text naming what the collective carries (``"expert grads"``, ``"ep tokens"``, ...)."""

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ValueError(f"collective op must be one of {COLLECTIVE_OPS}, got {self.op!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer per call (see ``elements``)."""
        return self.elements * DTYPE_BYTES[self.dtype]


def wire_bytes(c: Collective) -> float:
    """Bytes one rank sends for all ``count`` calls of ``c`` (ring algorithms: an all-reduce of S bytes over
    W ranks sends 2 (W-1)/W S; all-gather, reduce-scatter and all-to-all (W-1)/W S; a broadcast's or a
    send's whole tensor; recv and barrier nothing)."""
    w = len(c.group)
    s = c.nbytes
    if c.op in ("recv", "barrier") or w <= 1 and c.op != "send":
        return 0.0
    per_call = {"all_reduce": 2 * (w - 1) / w * s, "all_gather": (w - 1) / w * s,
                "reduce_scatter": (w - 1) / w * s, "all_to_all": (w - 1) / w * s,
                "broadcast": float(s), "send": float(s)}[c.op]
    return per_call * c.count


@dataclass(frozen=True)
class Compute:
    kind: str
    flops: float
    bytes: float
    count: int = 1
    dtype: str = "bf16"
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS:
            raise ValueError(f"compute kind must be one of {COMPUTE_KINDS}, got {self.kind!r}")


@dataclass
class StepProfile:
    """One rank's step: its collectives, its compute and its memory, and where they came from."""

    rank: int
    world: int
    source: str
    """``"trace"`` (the trainer's code on a fake process group) or ``"formula"`` (the planner's)."""
    tokens_per_step: int
    """Tokens of the global batch per optimizer step (all data ranks together)."""
    micro_batches: int
    pp: int
    stage: int
    collectives: list[Collective] = field(default_factory=list)
    compute: list[Compute] = field(default_factory=list)
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """Peak bytes per term: ``weights``, ``gradients``, ``optimizer``, ``activations``, ``transient``."""

    def wire_bytes(self, phase: str = "step") -> float:
        return sum(wire_bytes(c) for c in self.collectives if c.phase == phase)

    def to_dict(self) -> dict:
        return asdict(self)



#: What the step-time model (:mod:`trainer.scale.model`) reads from a collective's ``label`` (the tracer
#: names the code that issued it, :data:`trainer.scale.trace.LABELS`; the formulas use the same words):
#: ``"ep tokens"`` (the EP token exchange, on the critical path of every micro-batch), ``"pipeline
#: activations"`` (sends and receives between stages), ``"tp activations"``, ``"fsdp weights and
#: gradients"`` (FSDP2's per-layer gathers and reduce-scatters, which may overlap the compute),
#: ``"optimizer"`` (the optimizer's reductions and gathers after the backward); anything else (the loss's
#: and the gradient norm's scalars, ...) is priced after the backward as ``scalars``. A compute record
#: labelled ``"optimizer"`` is the optimizer's step; one whose label ends in ``"recompute"`` is activation
#: checkpointing's repeated forward (not counted as model FLOPs).
COLLECTIVE_TERMS = ("ep tokens", "pipeline activations", "tp activations", "fsdp weights and gradients",
                    "optimizer")

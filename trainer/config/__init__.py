"""Training configuration: nested dataclasses, one docstring per field.

Presets (``trainer.config.presets``) fill these in; the CLI (``trainer.cli``) overrides single fields on
top (``--optim.lr 1e-3`` or the short alias ``--lr 1e-3``). No file is ever executed as config.
"""
from __future__ import annotations

import ast
import importlib.util
import dataclasses
import inspect
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

from .ac_spec import parse_ac
from .schedule import DECAY_SHAPES, KINDS as SCHEDULE_KINDS, check_resume_from, check_schedule


@dataclass
class ModelConfig:
    """The network: transformers' OlmoeForCausalLM (``arch="olmoe"``) or OlmoForCausalLM (``"olmo"``)."""

    arch: str = "olmoe"
    """``"olmoe"`` (mixture of experts, transformers' OlmoeForCausalLM), ``"olmo"`` (dense OlmoForCausalLM) or ``"hf"``
    (any transformers MoE causal LM from ``hf_config`` or ``hf_family``, see trainer/model/family.py; DP, EP, PP)."""
    num_layers: int = 2
    """Decoder layers (L)."""
    hidden_size: int = 64
    """Model width (H in the paper's table); must equal num_heads * head_dim."""
    num_heads: int = 4
    """Attention heads."""
    head_dim: int = 16
    """Size of one attention head (Q in the MFU formula)."""
    intermediate_size: int = 128
    """Intermediate size of one expert (MoE) or of the MLP (dense)."""
    num_experts: int = 8
    """Experts per MoE layer (E); ignored for ``arch="olmo"``."""
    top_k: int = 2
    """Experts chosen per token (K)."""
    norm_topk_prob: bool = False
    """Renormalise the K routing weights to sum to 1 (OLMoE does not)."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's size from the data manifest."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    moe_impl: str = "fastmoe"
    """``"fastmoe"`` (FastSparseMoeBlock patched in) or ``"hf"`` (transformers' own block, for comparison)."""
    moe_backend: str = "auto"
    """Kernel backend of FastSparseMoeBlock: ``"auto"``, ``"torch"`` or ``"triton"``."""
    gemm_engine: str = "auto"
    """Stage 4's grouped-GEMM engine: ``"auto"`` (timed once per shape, cached; rank 0's choice under
    EP), ``"native"``, ``"triton"``, ``"grouped_mm"`` or ``"loop"`` (``fastmoe_xpu/kernels/registry.py``)."""
    expert_precision: str = "none"
    """Precision of the expert GEMMs: ``"none"`` (the weights' dtype), ``"int8"`` (every expert GEMM,
    forward and backward, quantized to int8 with per-row / per-channel scales) or ``"fp8"`` (e4m3
    forward, e5m2 gradients); docs/precision.md."""
    ep_dispatch: str = "allgather"
    """Token exchange under EP: ``"allgather"`` (the paper's choice) or ``"alltoall"``."""
    ep_check_inputs: bool = False
    """Agree on every rank's token count before each EP exchange (one small all-gather and host sync per layer);
    the trainer's micro-batches have equal shapes everywhere, so this is off by default."""
    forced_uniform_routing: bool = False
    """Route every token to a fixed pattern that loads experts evenly (benchmarks only)."""
    load_balancing_coef: float = 0.01
    """Weight of the load-balancing loss in the total loss."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss in the total loss."""
    param_dtype: str = "fp32"
    """Dtype of the model's weights and gradients: ``"fp32"`` or ``"bf16"`` (fp32 master weights stay in the optimizer)."""
    init_from: str | None = None
    """Model weights file (safetensors or torch.save state dict) or a transformers model directory (``python -m
    trainer.outputs.export``'s output), read by rank 0 only and sent to every rank."""
    autocast: str = "auto"
    """``"auto"`` (bf16 autocast on GPUs, none on the CPU), ``"bf16"`` or ``"none"``."""
    hf_config: str | None = None
    """A transformers ``config.json`` (or a directory holding one) to train with ``arch="hf"`` (setting it selects
    that arch); its sizes replace the fields above. ``moe_impl`` picks experts_implementation ``"fastmoe"`` or ``"eager"`` (hf)."""
    hf_family: str = ""
    """With ``arch="hf"`` and no ``hf_config``: a transformers MoE family (``qwen3_moe``, ``deepseek_v3``, ...) whose tiny
    config takes the sizes above."""
    router_bias_update_rate: float = 0.001
    """``arch="hf"`` routers with a score-correction bias (DeepSeek-V3): ``bias += rate * sign(mean_load - load)``
    after every step (aux-loss-free balancing); 0 turns it off; ignored by families without such a bias."""
    compile: bool = False
    """``torch.compile`` the decoder stack (fullgraph; the MoE blocks run as ``fastmoe`` custom ops); the step records report compile time apart from step time."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend of ``--compile`` (``"inductor"``; ``"aot_eager"`` traces the same graphs without generating code, for checks)."""

    @property
    def is_moe(self) -> bool:
        """The OLMoE block's model (the paths EP, PP, TP and the OLMoE loss serve)."""
        return self.arch == "olmoe"

    @property
    def is_hf(self) -> bool:
        """Any transformers MoE family (trainer/model/family.py)."""
        return self.arch == "hf"


@dataclass
class DataConfig:
    """Where the tokens come from."""

    path: str | None = None
    """A preprocessed data set (its manifest.json or directory), or a mixture of several ``NAME=PATH:WEIGHT,...``
    (docs/data.md); None prepares the embedded default corpus."""
    cache_dir: str | None = None
    """Where the embedded corpus is preprocessed to; None: ``$FASTMOE_DATA_CACHE`` or ``~/.cache/fastmoe_xpu/data``."""
    verify: bool = True
    """Check every shard's sha256 against the manifest before training."""
    context: int = 64
    """Tokens per training instance (C)."""
    seed: int = 0
    """Seed of the global shuffle of training instances."""
    valid: float = 0.05
    """Held-out validation split of the embedded default corpus: a fraction in (0, 1) or a count of instances
    (0: none); a data set of your own keeps the split ``fastmoe-preprocess --valid`` gave it."""
    document_mask: bool = False
    """Attend only within each document of an instance (block-diagonal causal attention, positions restarting
    after every EOS the data set records), as OLMo 2 and Llama 3 pretrain; off: every token attends to the whole
    instance, as the paper's runs did. The target after an EOS (the next document's first token) is still trained."""


@dataclass
class OptimConfig:
    """AdamW and the way its states are sharded."""

    name: str = "epso"
    """``"adamw"`` (states replicated), ``"sharded"`` (ZeRO-1 over DP) or ``"epso"`` (non-expert states over DP x EP, expert states over DP)."""
    lr: float = 4e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.99
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this after warmup; 0 disables clipping."""
    grad_reduce_dtype: str = "fp32"
    """Dtype gradients are reduced (and reduce-scattered) in: ``"fp32"`` or ``"bf16"``."""
    stochastic_rounding: bool = False
    """Pure bf16 training: no fp32 master copy; each update is computed in fp32 and rounded into the
    bf16 weights stochastically (unbiased), the rounding generator saved with the checkpoint. Needs
    ``--model.param_dtype bf16``."""
    master_weights: bool = True
    """Keep an fp32 master copy of the weights in the optimizer. False with bf16 weights (and no
    stochastic rounding): plain bf16 updates, rounded to nearest."""
    moments_dtype: str = "fp32"
    """Dtype of the Adam moments: ``"fp32"`` or ``"bf16"`` (rounded like the weights)."""


@dataclass
class ScheduleConfig:
    """Steps, batch sizes and the learning-rate schedule."""

    steps: int = 300
    """Optimizer steps to train (with ``decay_from`` and no ``--steps``: ``decay_from`` plus the decay)."""
    global_batch: int = 16
    """Instances per optimizer step, over all data-parallel ranks (tokens per step = global_batch * context)."""
    micro_batch: int = 8
    """Instances per forward/backward on one rank; the rest is gradient accumulation."""
    warmup_steps: int = 30
    """Linear warmup from 0 to the peak learning rate; gradient clipping starts after it."""
    min_lr: float = 4e-5
    """Learning rate at the end of the decay (the last step's)."""
    kind: str = "cosine"
    """After the warmup: ``"cosine"`` or ``"linear"`` from the peak to ``min_lr`` over the rest of the run, or
    ``"wsd"`` (warmup-stable-decay: the peak until the decay of the last steps; docs/trainer.md, Schedules)."""
    decay_steps: int | None = None
    """WSD: steps of the decay (or ``decay_fraction``; neither: 0.2 of the run)."""
    decay_fraction: float | None = None
    """WSD: the share of the run's steps that decay, in (0, 1) (default 0.2)."""
    decay_shape: str = "linear"
    """WSD: the decay's shape, ``"linear"``, ``"cosine"`` or ``"1-sqrt"``."""
    decay_from: int | None = None
    """WSD: the step the decay starts after (a decay branch from a stable-phase checkpoint, with
    ``--checkpoint.resume_from``); None: the decay is the run's last steps."""


@dataclass
class ParallelConfig:
    """Process layout: world = PP x DP x EP, EP innermost."""

    dp: int = 0
    """Data-parallel size; 0 takes world / (PP * EP)."""
    ep: int = 1
    """Expert-parallel size (experts split across EP ranks; must divide num_experts)."""
    pp: int = 1
    """Pipeline-parallel size: contiguous layer stages, embedding on the first, norm + LM head on the last (PP outermost in the mesh)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule of torch.distributed.pipelining: ``"1f1b"`` or ``"gpipe"``."""
    pp_meta_init: bool = False
    """Build pipeline stages on the meta device and initialise only this rank's stage (for models too large for one host; weights then differ from a one-process run unless loaded with --init-from)."""
    tp: int = 1
    """Tensor-parallel size for the dense model: attention heads and MLP intermediate split, innermost in the mesh (EP must be 1)."""
    ac: str = ""
    """Selective activation checkpointing: any of ``norm``, ``attn``, ``moe`` (comma-separated), ``all`` or empty."""
    dp_shard: str = "none"
    """``"fsdp"``: FSDP2 ``fully_shard`` on the non-expert weights over the DP x EP ranks of a stage, experts stay
    expert-parallel (any arch; trainer/optim/fsdp.py, docs/parallel.md); ``"none"``: the optimizer shards states only
    (``--optim.name``)."""
    fsdp_shard: int = 0
    """With ``dp_shard="fsdp"``: ranks that shard the non-expert weights among them. 0 (or DP x EP): all the
    DP x EP ranks of a stage (FSDP); a divisor N of DP x EP: HSDP, ``fully_shard`` over a 2-D mesh that shards
    within groups of N consecutive ranks (put them in one node) and replicates across the DP x EP / N groups."""
    broadcast: str = "none"
    """Initial weights: ``"none"`` (every rank draws them from the seed), or rank 0's sent by ``"broadcast"`` or ``"all_reduce"`` (also how --model.init_from travels)."""
    backend: str = "auto"
    """torch.distributed backend: ``"auto"`` (nccl on CUDA, xccl or ccl on XPU, gloo on CPU; FASTMOE_DIST_BACKEND overrides) or a name."""
    device: str = "auto"
    """``"auto"`` (xpu, cuda or cpu), or an explicit device type."""


@dataclass
class CheckpointConfig:
    """Saving and resuming the full training state."""

    interval: int = 0
    """Save every this many steps (0: never)."""
    dir: str | None = None
    """Checkpoint directory; None means ``OUT/checkpoints``."""
    resume: bool = True
    """Resume from the checkpoint in ``dir`` when one exists."""
    model_interval: int = 0
    """Write a model-only checkpoint (kept, never rotated) every this many steps (0: never)."""
    model_dtype: str = "bf16"
    """Dtype of model-only checkpoints: ``"bf16"`` or ``"fp32"``."""
    init_from: str | None = None
    """Start from the model weights of this checkpoint directory (fresh optimizer, step 0)."""
    allow_fresh_start: bool = False
    """Start again from step 0 when checkpoints exist but none is valid (default: stop with an error)."""
    resume_from: str | None = None
    """Resume the full state from this checkpoint (a slot, a checkpoint directory or a run's --out: its newest)
    when this run's own has none, writing only in this run's --out (a decay branch: ``--schedule.decay_from``)."""
    async_save: bool = False
    """``--checkpoint.async``: stage each periodic full checkpoint in host memory and write it in a background
    thread while training goes on (one write at a time; the run's end waits for it, and a last checkpoint no
    periodic one covers is written synchronously). Every layout: ZeRO-1, EPSO, replicated AdamW, FSDP2 and PP."""
    reschedule: bool = False
    """Resume although --steps, --warmup, --lr, --min-lr or --schedule.* differ from the checkpoint's (default: refuse,
    naming the change, unless only a WSD run's future rates change): the learning rate follows the new schedule from
    the next step."""


@dataclass
class LoggingConfig:
    """Metrics, progress and plots."""

    out: str = "out/run"
    """Output directory (metrics.jsonl, loss.png, TensorBoard events, data, checkpoints)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    tensorboard: bool = True
    """Write TensorBoard scalars to ``OUT/tensorboard`` (tensorboardX, or the tensorboard package)."""
    wandb: bool = False
    """Log the same scalars to Weights & Biases (the optional wandb package; ``WANDB_MODE=offline`` keeps the run
    in ``OUT/wandb`` to sync later; trainer/records/wandb_writer.py)."""
    wandb_project: str = "fastmoe"
    """The W&B project of ``--logging.wandb`` (the run is named after OUT)."""
    plot: bool = True
    """Write ``OUT/loss.png`` at the end."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 looks the device up, or measures a matmul on unknown devices."""
    spike_window: int = 20
    """Steps in the running mean a gradient norm is compared with."""
    spike_factor: float = 2.0
    """A step is a gradient spike when its norm exceeds this times the running mean."""


@dataclass
class EvalConfig:
    """Held-out evaluation, MoE health, and what the end of a run leaves behind."""

    interval: int = 0
    """Evaluate the validation split every this many steps (0: at the last step only)."""
    enabled: bool = True
    """Evaluate the validation split (when the data set keeps one) at the intervals and at the last step."""
    instances: int = 512
    """Validation instances evaluated (the first of the split, the same on every layout; 0: all of them)."""
    micro_batch: int = 32
    """Validation instances per forward pass on one rank."""
    moe_health: bool = True
    """Log per-layer MoE health (expert load, router entropy, per-layer losses) and plot it at the end."""
    export_hf: str | None = None
    """At the end, write the trained model as a transformers directory here (``fastmoe-export``)."""
    overwrite: bool = False
    """Let ``--eval.export_hf`` replace an earlier export there (never a directory holding anything else)."""
    samples: bool = True
    """After ``--eval.export_hf``: print and save (``OUT/samples.json``) greedy and sampled continuations of fixed prompts."""
    sample_tokens: int = 48
    """New tokens per generated sample."""


@dataclass
class LoraSection:
    """LoRA fine-tuning of the expert weights (PEFT adapters, run inside the grouped GEMMs; trainer/model/lora.py)."""

    rank: int = 0
    """Adapter rank r of every targeted expert weight; 0 trains the whole model instead."""
    alpha: float = 16.0
    """LoRA alpha: the adapters are scaled by alpha / rank."""
    targets: str = "gate_up_proj,down_proj"
    """Comma-separated expert weights to adapt (``gate_up_proj``, ``down_proj``); everything else is frozen."""
    export: str | None = None
    """Where the trained adapter is written in PEFT's layout at the end of the run (default ``OUT/lora``)."""


@dataclass
class TrainConfig:
    """Everything one training run needs."""

    preset: str = "tiny-moe"
    """Name of the preset this config started from."""
    seed: int = 0
    """Seed of the model initialisation (identical on every rank)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraSection = field(default_factory=LoraSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in sections:
                raise ConfigError(f"unknown config key {key!r}")
            sub = _SECTION_CLASSES.get(key)
            if sub is not None:
                known = {f.name for f in dataclasses.fields(sub)}
                unknown = set(value) - known
                if unknown:
                    raise ConfigError(f"unknown field(s) {sorted(unknown)} in config section {key!r}")
                kwargs[key] = sub(**value)
            else:
                kwargs[key] = value
        return cls(**kwargs)


_SECTION_CLASSES: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
    "lora": LoraSection,
}


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal after each field)."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def section_classes() -> dict[str, type]:
    return dict(_SECTION_CLASSES)


# ----------------------------------------------------------------------------- validation
def _choices() -> dict[tuple[str, str], tuple[str, ...]]:
    """The options with a fixed set of values. The kernel registry's sets are read here, on use, so
    that importing the configuration (the planner does, for :mod:`.ac_spec`) does not load torch."""
    from fastmoe_xpu.kernels.registry import CHOICES as GEMM_ENGINES
    from fastmoe_xpu.kernels.registry import PRECISIONS

    return {
        ("model", "arch"): ("olmoe", "olmo", "hf"),
        ("parallel", "dp_shard"): ("none", "fsdp"),
        ("model", "moe_impl"): ("fastmoe", "hf"),
        ("model", "moe_backend"): ("auto", "torch", "triton"),
        ("model", "gemm_engine"): GEMM_ENGINES,
        ("model", "expert_precision"): ("none", *PRECISIONS),
        ("model", "ep_dispatch"): ("allgather", "alltoall"),
        ("model", "param_dtype"): ("fp32", "bf16"),
        ("model", "autocast"): ("auto", "bf16", "none"),
        ("optim", "name"): ("adamw", "sharded", "epso"),
        ("optim", "grad_reduce_dtype"): ("fp32", "bf16"),
        ("optim", "moments_dtype"): ("fp32", "bf16"),
        ("parallel", "pp_schedule"): ("1f1b", "gpipe"),
        ("parallel", "broadcast"): ("none", "broadcast", "all_reduce"),
        ("checkpoint", "model_dtype"): ("bf16", "fp32"),
        ("schedule", "kind"): SCHEDULE_KINDS,
        ("schedule", "decay_shape"): DECAY_SHAPES,
    }


def validate(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """Check everything that can be checked before any work; fill ``parallel.dp`` from the world
    size. Raises :class:`ConfigError` with a one-line message naming the offending values."""
    m, s, p, o = cfg.model, cfg.schedule, cfg.parallel, cfg.optim
    check_lora_config(cfg)
    if m.hf_config and m.arch == "olmoe":
        m.arch = "hf"  # --model.hf_config on top of any preset trains that config
    for (section, name), allowed in _choices().items():
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"--{section}.{name} must be one of {list(allowed)}, got {value!r}")
    check_schedule(cfg)  # before the steps are checked: a decay branch's may be derived
    check_resume_from(cfg)
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size, "model.num_heads": m.num_heads,
        "model.head_dim": m.head_dim, "model.intermediate_size": m.intermediate_size,
        "data.context": cfg.data.context, "schedule.steps": s.steps, "schedule.global_batch": s.global_batch,
        "schedule.micro_batch": s.micro_batch, "parallel.ep": p.ep, "parallel.pp": p.pp, "parallel.tp": p.tp,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"--{name} must be >= 1, got {value}")
    if m.vocab_size < 0:
        raise ConfigError(f"--model.vocab_size must be >= 0 (0: from the data), got {m.vocab_size}")
    if p.dp < 0:
        raise ConfigError(f"--parallel.dp must be >= 0 (0: world / (pp * ep)), got {p.dp}")
    if cfg.eval.instances < 0 or cfg.eval.micro_batch < 1:
        raise ConfigError(f"--eval.instances must be >= 0 and --eval.micro_batch >= 1, got {cfg.eval.instances} "
                          f"and {cfg.eval.micro_batch}")
    if cfg.eval.interval < 0 or cfg.eval.sample_tokens < 0:
        raise ConfigError(f"--eval.interval and --eval.sample_tokens must be >= 0, got {cfg.eval.interval} and "
                          f"{cfg.eval.sample_tokens}")
    if s.warmup_steps < 0:
        raise ConfigError(f"--schedule.warmup_steps must be >= 0, got {s.warmup_steps}")
    if not (0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0):
        raise ConfigError(f"Adam betas must lie in [0, 1), got ({o.beta1}, {o.beta2})")
    if o.lr < 0 or s.min_lr < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        raise ConfigError("--optim.lr, --schedule.min_lr, --optim.grad_clip and --optim.weight_decay must be >= 0")
    if m.is_hf:
        from .hf import check_hf

        check_hf(cfg)  # fills the size fields from the transformers config
    elif m.hf_config or m.hf_family:
        raise ConfigError(f"--model.hf_config / --model.hf_family need --model.arch hf, got {m.arch!r}")
    if not m.is_hf and m.num_heads * m.head_dim != m.hidden_size:
        raise ConfigError(
            f"hidden_size={m.hidden_size} must equal num_heads * head_dim = {m.num_heads} * {m.head_dim}"
        )
    if m.is_moe:
        if m.num_experts < 1 or not 1 <= m.top_k <= m.num_experts:
            raise ConfigError(f"need 1 <= top_k <= num_experts, got top_k={m.top_k}, num_experts={m.num_experts}")
        if m.num_experts % p.ep:
            raise ConfigError(f"num_experts={m.num_experts} is not divisible by EP={p.ep}"
                              + _ep_choices(m.num_experts, world_size, p.pp * p.tp))
        if p.ep > 1 and m.moe_impl != "fastmoe":
            raise ConfigError(f"expert parallelism (EP={p.ep}) needs --model.moe_impl fastmoe, got {m.moe_impl!r}")
    elif p.ep != 1 and not m.is_hf:
        raise ConfigError(f"arch={m.arch!r} has no experts; EP must be 1, got {p.ep}")
    if (o.stochastic_rounding or not o.master_weights) and m.param_dtype != "bf16":
        raise ConfigError("--optim.stochastic_rounding / --no-optim.master_weights train bf16 weights without an "
                          f"fp32 master: they need --model.param_dtype bf16, got {m.param_dtype!r}")
    if m.expert_precision != "none" and (not m.is_moe or m.moe_impl != "fastmoe"):
        raise ConfigError(f"--model.expert_precision {m.expert_precision} needs a MoE model with --model.moe_impl "
                          f"fastmoe, got arch={m.arch!r}, moe_impl={m.moe_impl!r}")
    if world_size is not None:
        if p.dp == 0:
            if world_size % (p.pp * p.ep * p.tp):
                axes = f"PP x EP = {p.pp} x {p.ep}" + (f" x TP {p.tp}" if p.tp > 1 else "")
                way = _start_more(world_size, p.pp * p.ep * p.tp)
                if not way and m.is_moe and p.ep > 1:
                    way = _ep_choices(m.num_experts, world_size, p.pp * p.tp)
                raise ConfigError(f"world size {world_size} is not divisible by {axes}{way}")
            p.dp = world_size // (p.pp * p.ep * p.tp)
        if p.pp * p.dp * p.ep * p.tp != world_size:
            axes = f"PP x DP x EP = {p.pp} x {p.dp} x {p.ep}" + (f" x TP {p.tp}" if p.tp > 1 else "")
            raise ConfigError(f"world size {world_size} != {axes}" + _start_more(world_size, p.pp * p.dp * p.ep * p.tp))
    dp = p.dp or 1
    data_ranks = dp * p.ep
    if s.global_batch % (data_ranks * s.micro_batch):
        raise ConfigError(
            f"global batch {s.global_batch} is not divisible by DP x EP x micro batch = "
            f"{dp} x {p.ep} x {s.micro_batch} (every DP x EP rank reads its own micro-batches)"
        )
    if p.dp_shard == "fsdp":
        check_fsdp(cfg)
    if p.fsdp_shard:
        shards = dp * p.ep
        if p.dp_shard != "fsdp":
            raise ConfigError(f"--parallel.fsdp_shard {p.fsdp_shard} needs --parallel.dp_shard fsdp")
        if p.fsdp_shard < 0 or shards % p.fsdp_shard:
            raise ConfigError(f"--parallel.fsdp_shard {p.fsdp_shard} must divide DP x EP = {dp} x {p.ep} (the ranks "
                              "of a stage); 0 shards over all of them")
    check_parallel(cfg)
    if cfg.logging.wandb:
        check_wandb_available()  # an optional package: one line now, not a traceback at the first step
    if world_size is not None:
        # the Trainer takes a config validated for its world as it is, without a copy or a second check
        cfg._validated_world = world_size  # type: ignore[attr-defined]
    return cfg


def _ep_choices(num_experts: int, world_size: int | None, other_axes: int) -> str:
    """The EP sizes that divide the experts and (when known) the ranks left after PP x TP, as the
    way on from an EP that does not."""
    ranks = world_size // other_axes if world_size is not None and world_size % other_axes == 0 else None
    sizes = [e for e in range(1, num_experts + 1) if num_experts % e == 0 and (ranks is None or ranks % e == 0)]
    what = f"num_experts={num_experts}" + (f" and the world {ranks}" if ranks is not None else "")
    if ranks is not None and other_axes > 1:
        what += f" (of {world_size} ranks over PP x TP = {other_axes})"
    listed = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    return f"; --ep must divide {what}: {listed}"


def warmup_warning(cfg: TrainConfig) -> str | None:
    """One ``warning:`` line when the warmup is longer than the run (it never reaches the peak
    learning rate); None otherwise. The run goes on as asked."""
    s = cfg.schedule
    if s.warmup_steps <= s.steps:
        return None
    return (f"warning: --warmup {s.warmup_steps} is longer than the run (--steps {s.steps}): the learning rate "
            f"climbs from 1/{s.warmup_steps} to {s.steps}/{s.warmup_steps} of --lr {cfg.optim.lr:g} and never reaches "
            f"it; give --warmup {s.steps // 10} (or any value up to {s.steps}) to reach it")


def _start_more(world_size: int, needed: int) -> str:
    """The way on when one process was started for a layout of ``needed`` ranks."""
    if world_size != 1 or needed <= 1:
        return ""
    return (f"; this is one process: start {needed} with fastmoe-train --nproc-per-node {needed} ... (or torchrun "
            f"--nproc-per-node {needed} -m fastmoe_trainer ...)")


def validated_for(cfg: TrainConfig, world_size: int) -> bool:
    """Whether :func:`validate` passed ``cfg`` for ``world_size`` (edits after it are not noticed:
    validate last)."""
    return getattr(cfg, "_validated_world", None) == world_size


#: The expert weights LoRA adapts (``--lora.targets``, see trainer/model/lora.py).
LORA_TARGETS = ("gate_up_proj", "down_proj")


def lora_targets(section: Any) -> list[str]:
    return [t.strip() for t in section.targets.split(",") if t.strip()]


def check_lora_config(cfg: Any) -> None:
    """ConfigError (one line) for a LoRA section this trainer cannot run."""
    lo, p, m = cfg.lora, cfg.parallel, cfg.model
    if lo.rank < 0:
        raise ConfigError(f"--lora.rank must be >= 0, got {lo.rank}")
    if lo.rank == 0:
        return
    if lo.alpha <= 0:
        raise ConfigError(f"--lora.alpha must be > 0, got {lo.alpha}")
    bad = [t for t in lora_targets(lo) if t not in LORA_TARGETS] or ([] if lora_targets(lo) else ["(none)"])
    if bad:
        raise ConfigError(f"--lora.targets must name some of {list(LORA_TARGETS)}, got {lo.targets!r}")
    if m.arch == "olmo":
        raise ConfigError("--lora.rank adapts expert weights; --model.arch olmo has none")
    if m.moe_impl != "fastmoe":
        raise ConfigError(f"--lora.rank needs --model.moe_impl fastmoe (the adapters run in its GEMMs), got {m.moe_impl!r}")
    for name, value in (("pp", p.pp), ("tp", p.tp), ("ep", p.ep)):
        if value > 1:
            raise ConfigError(f"--lora.rank trains with data parallelism only, got --parallel.{name} {value}")
    if m.compile:
        raise ConfigError("--lora.rank runs eagerly; drop --model.compile")
    if cfg.checkpoint.init_from:
        raise ConfigError("--lora.rank starts from --model.init_from (a transformers checkpoint), "
                          "not --checkpoint.init_from")
    if cfg.eval.export_hf:
        raise ConfigError("--lora.rank exports the adapter (--lora.export), not the whole model (--eval.export_hf)")


WANDB_INSTALL_HINT = "pip install wandb (or the package's wandb extra: pip install 'fastmoe_xpu[wandb]')"


def check_wandb_available() -> None:
    """Raise :class:`ConfigError` with one line when the ``wandb`` package is not installed."""
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"--logging.wandb needs the wandb package, which is not installed: {WANDB_INSTALL_HINT}; "
                          "or leave --logging.wandb out (TensorBoard and metrics.jsonl stay)")


def check_fsdp(cfg: TrainConfig) -> None:
    """What ``--parallel.dp_shard fsdp`` does not combine with, refused in one line naming both
    options (before any process group forms)."""
    m, p, o = cfg.model, cfg.parallel, cfg.optim
    refused = [
        (p.tp > 1, f"--parallel.tp {p.tp}", "FSDP2 shards the weights TP would split; use --ep or DP instead"),
        (cfg.lora.rank > 0, "--lora.rank", "LoRA freezes the weights FSDP2 would shard; train LoRA on DP"),
        (p.pp_meta_init, "--parallel.pp_meta_init", "FSDP2 shards weights built on the device"),
        (o.stochastic_rounding, "--optim.stochastic_rounding", "it keeps an fp32 master of the sharded weights"),
        (not o.master_weights, "--no-optim.master_weights", "it keeps an fp32 master of the sharded weights"),
        (o.moments_dtype != "fp32", f"--optim.moments_dtype {o.moments_dtype}",
         "the sharded weights' Adam moments are fp32"),
    ]
    for bad, option, why in refused:
        if bad:
            raise ConfigError(f"--parallel.dp_shard fsdp does not combine with {option} ({why})")


def check_parallel(cfg: TrainConfig) -> None:
    """The pipeline, tensor-parallel and activation-checkpointing checks of :func:`validate`; raise
    :class:`ConfigError` naming the offending values."""
    m, p, s = cfg.model, cfg.parallel, cfg.schedule
    try:
        parse_ac(p.ac)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if p.pp > 1:
        if m.compile:
            raise ConfigError(f"--model.compile does not combine with --pp {p.pp} (pipeline stages run eagerly); "
                              "drop one of them")
        if m.num_layers < p.pp:
            raise ConfigError(f"{m.num_layers} layers cannot fill PP={p.pp} pipeline stages (one layer each at least)")
        dp = p.dp or 1
        micro = s.global_batch // (dp * p.ep * s.micro_batch)
        if p.pp_schedule == "1f1b" and micro < p.pp:
            raise ConfigError(
                f"1F1B needs at least PP={p.pp} micro-batches per rank, got global batch {s.global_batch} / "
                f"(DP x EP x micro batch = {dp} x {p.ep} x {s.micro_batch}) = {micro}; raise --global-batch, "
                f"lower --micro-batch or use --parallel.pp_schedule gpipe")
    if p.tp > 1:
        if m.is_moe:
            raise ConfigError(f"tensor parallelism (TP={p.tp}) covers the dense model's attention and MLP; "
                              f"arch={m.arch!r} uses expert parallelism (--ep) instead")
        if m.num_heads % p.tp or m.intermediate_size % p.tp:
            raise ConfigError(f"TP={p.tp} must divide the heads ({m.num_heads}) and the intermediate size "
                              f"({m.intermediate_size})")

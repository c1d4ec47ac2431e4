"""Model and recipe presets, one Python function each.

The Mula family follows the published table (layers / hidden / heads / head size / intermediate /
experts / top-k): 1B 16/2048/16/128/8192/-/-, 7B-A1B 16/2048/16/128/1024/64/8, 20B-A2B
32/2048/16/128/1024/96/8, 100B-A7B 48/3072/24/128/1536/144/8, 220B-A10B 64/3072/24/128/1536/240/8,
with the paper's recipe: context 2048, 3072 x 2048 = 6.3M tokens per global batch, AdamW (0.9,
0.99, 1e-8), weight decay 0.1, 2,500 warmup steps, cosine 4e-4 -> 4e-5, clipping at 1.0 after
warmup, load-balancing 0.01 and z-loss 0.001. ``tiny-moe`` and ``tiny-dense`` train on a laptop CPU.
"""
from __future__ import annotations

from typing import Callable

from . import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)

#: GPT-NeoX / OLMo tokenizer size padded to a multiple of 128, as OLMo and OLMoE use.
OLMO_VOCAB = 50304


def _mula(name: str, *, layers: int, hidden: int, heads: int, intermediate: int, experts: int,
          ep: int) -> TrainConfig:
    arch = "olmo" if experts == 0 else "olmoe"
    return TrainConfig(
        preset=name,
        model=ModelConfig(
            arch=arch, num_layers=layers, hidden_size=hidden, num_heads=heads, head_dim=128,
            intermediate_size=intermediate, num_experts=max(experts, 1), top_k=8 if experts else 1,
            vocab_size=OLMO_VOCAB,
        ),
        data=DataConfig(context=2048),
        optim=OptimConfig(name="epso" if experts else "sharded"),
        schedule=ScheduleConfig(steps=100_000, global_batch=3072, micro_batch=2, warmup_steps=2500, min_lr=4e-5),
        parallel=ParallelConfig(ep=ep),
    )


def mula_1b() -> TrainConfig:
    """Dense OLMo, 1.3B parameters."""
    return _mula("mula-1b", layers=16, hidden=2048, heads=16, intermediate=8192, experts=0, ep=1)


def mula_7b_a1b() -> TrainConfig:
    """6.9B total, 1.3B active; 64 experts (the paper ran it without EP)."""
    return _mula("mula-7b-a1b", layers=16, hidden=2048, heads=16, intermediate=1024, experts=64, ep=1)


def mula_20b_a2b() -> TrainConfig:
    """20B total, 2.4B active; EP=12 within a node in the paper."""
    return _mula("mula-20b-a2b", layers=32, hidden=2048, heads=16, intermediate=1024, experts=96, ep=12)


def mula_100b_a7b() -> TrainConfig:
    """100B total, 7.6B active; PP=4 x EP=12 in the paper."""
    return _mula("mula-100b-a7b", layers=48, hidden=3072, heads=24, intermediate=1536, experts=144, ep=12)


def mula_220b_a10b() -> TrainConfig:
    """220B total, 10B active; PP=8 x EP=12 in the paper."""
    return _mula("mula-220b-a10b", layers=64, hidden=3072, heads=24, intermediate=1536, experts=240, ep=12)


def _tiny(name: str, *, arch: str, intermediate: int, experts: int, top_k: int, optim: str,
          **model: object) -> TrainConfig:
    """Width 64, 2 layers, context 64 and one CPU-sized recipe, shared by every tiny preset."""
    return TrainConfig(
        preset=name,
        model=ModelConfig(arch=arch, num_layers=2, hidden_size=64, num_heads=4, head_dim=16,
                          intermediate_size=intermediate, num_experts=experts, top_k=top_k, vocab_size=0,
                          **model),  # type: ignore[arg-type]
        data=DataConfig(context=64),
        optim=OptimConfig(name=optim, lr=3e-3),
        schedule=ScheduleConfig(steps=300, global_batch=16, micro_batch=8, warmup_steps=30, min_lr=3e-4),
    )


def tiny_moe() -> TrainConfig:
    """2 layers, width 64, 8 experts top-2, context 64: trains on two CPU cores in well under a minute."""
    return _tiny("tiny-moe", arch="olmoe", intermediate=128, experts=8, top_k=2, optim="epso")


def small_moe() -> TrainConfig:
    """4 layers, width 128, 16 experts top-2 (6.6M parameters, 1.1M active), context 64: tiny-moe's
    recipe four times deeper and wider, still a few minutes of training on two CPU cores (the
    precision comparison's larger model, docs/precision.md)."""
    return TrainConfig(
        preset="small-moe",
        model=ModelConfig(arch="olmoe", num_layers=4, hidden_size=128, num_heads=4, head_dim=32,
                          intermediate_size=256, num_experts=16, top_k=2, vocab_size=0),
        data=DataConfig(context=64),
        optim=OptimConfig(name="epso", lr=2e-3),
        schedule=ScheduleConfig(steps=600, global_batch=16, micro_batch=16, warmup_steps=60, min_lr=2e-4),
    )


def tiny_dense() -> TrainConfig:
    """The dense counterpart of tiny-moe (OLMo, MLP width 256)."""
    return _tiny("tiny-dense", arch="olmo", intermediate=256, experts=1, top_k=1, optim="sharded")


def _tiny_family(name: str, family: str, **model: object) -> TrainConfig:
    """tiny-moe's sizes and recipe on a transformers MoE family (``arch="hf"``, trainer/model/family.py);
    ``adamw``: one process ("sharded" (ZeRO-1) and "epso" shard it over DP and EP)."""
    return _tiny(name, arch="hf", intermediate=128, experts=8, top_k=2, optim="adamw", hf_family=family, **model)


def tiny_qwen3_moe() -> TrainConfig:
    """Qwen3-MoE-like (softmax top-k router, the family's load-balancing aux loss), tiny-moe's sizes."""
    return _tiny_family("tiny-qwen3-moe", "qwen3_moe")


def tiny_deepseek_v3() -> TrainConfig:
    """DeepSeek-V3-like (MLA attention, sigmoid group-limited router with a score-correction bias updated
    from the loads, one shared expert), tiny-moe's sizes; 8 experts in 2 groups, 1 group per token."""
    return _tiny_family("tiny-deepseek-v3", "deepseek_v3", norm_topk_prob=True)


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "mula-1b": mula_1b,
    "mula-7b-a1b": mula_7b_a1b,
    "mula-20b-a2b": mula_20b_a2b,
    "mula-100b-a7b": mula_100b_a7b,
    "mula-220b-a10b": mula_220b_a10b,
    "tiny-moe": tiny_moe,
    "small-moe": small_moe,
    "tiny-dense": tiny_dense,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "tiny-deepseek-v3": tiny_deepseek_v3,
}


def get_preset(name: str) -> TrainConfig:
    """A fresh config for preset ``name``; :class:`ConfigError` naming the known ones otherwise."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None

"""The layers the published MoE kernels compare on, as data: the benchmark's ``--shapes`` sets
(``bench/harness/presets.py`` builds its presets from these) and the Triton config sweep's shapes
(:mod:`.tools.config_sweep`), kept in the package so that neither depends on the other.

Each entry: ``(name, H, I, E, K, tokens per rank, EP, description)``; with EP > 1 the rank holds
``E / EP`` experts and sees ``EP * tokens per rank`` all-gathered tokens.
"""
from __future__ import annotations

#: At T = 32768 tokens: (H, I, E, K) from each model's configuration. DeepSeek-V3 is its local slice
#: at EP=8 (32 of 256 experts on the rank, the 32768 tokens all-gathered from 8 x 4096).
SHAPE_SETS: dict[str, tuple[tuple[str, int, int, int, int, int, int, str], ...]] = {
    "practitioners": (
        ("olmoe-1b-7b", 2048, 1024, 64, 8, 32768, 1, "OLMoE-1B-7B"),
        ("qwen3-30b-a3b", 2048, 768, 128, 8, 32768, 1, "Qwen3-30B-A3B"),
        ("qwen3-235b-a22b", 4096, 1536, 128, 8, 32768, 1, "Qwen3-235B-A22B"),
        ("gpt-oss-20b", 2880, 2880, 32, 4, 32768, 1, "GPT-OSS-20B (its experts' shape; SwiGLU without "
         "GPT-OSS's clamp and biases)"),
        ("mixtral-8x7b", 4096, 14336, 8, 2, 32768, 1, "Mixtral-8x7B"),
        ("deepseek-v3-ep8", 7168, 2048, 256, 8, 4096, 8, "DeepSeek-V3 local slice at EP=8 (32 of 256 experts)"),
    ),
}
